//! Readiness no kernel object has to show: a placeholder's readability reported by the
//! library's own `epoll_wait` instead of a token written into P (`carried`, the mirror).
//!
//! A token costs two Unix-socket calls per readable edge, one written by whoever dispatched the
//! data and one drained by the program's read: 11% of the machine under redis-benchmark
//! (docs/BENCHMARKS.md). It is needed only when something the library does not answer for could
//! look at P: a wait of another thread or process, an epoll set nested in another, `poll` or
//! `select` on P or on its set, an edge-triggered or one-shot registration, or the program's
//! thread asleep in the kernel. While none can, the program's `epoll_wait` on P's one set
//! reports P's `EPOLLIN` itself ("elided"), level-triggered, as the kernel would:
//!
//! * one thread has waited on P's set (`SetState::waiter`; any number of threads may wait on
//!   other sets); the connection is this process's, and it and its set were made since the
//!   process last forked;
//! * P is in exactly one epoll set, level-triggered with `EPOLLIN`, with no bits beyond
//!   `ELIDABLE`; the set is not nested, polled, selected or dup'd (`EPOLL_OBSERVED`), and no
//!   other carried member of it has the same `data`;
//! * that thread is not asleep on the set (`SetState::asleep`): it sleeps only after a report
//!   found nothing, and an arrival while it sleeps writes a token as before, so no wake-up is
//!   lost (each side publishes, then reads the other's flag: one of them sees the other).
//!
//! Each epoll set keeps its own state, so a program with an event loop per thread (memcached's
//! workers) has each loop's connections elided.
//!
//! Whatever breaks a condition ends elision for the connections concerned for good, and a token
//! is written at once for one that is readable (`Carried::forbid_elision`, `SetState::end`).

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};

use parking_lot::Mutex;

use crate::carried::Carried;

/// Registration bits a placeholder may have and still be elided.
pub(crate) const ELIDABLE: u32 = (libc::EPOLLIN
    | libc::EPOLLOUT
    | libc::EPOLLRDHUP
    | libc::EPOLLRDNORM
    | libc::EPOLLWRNORM
    | libc::EPOLLERR
    | libc::EPOLLHUP) as u32;
/// The bits an elided report sets.
pub(crate) const REPORTED: u32 = (libc::EPOLLIN | libc::EPOLLRDNORM) as u32;

/// `SetState::waiter` once a second thread has waited on the set.
const SEVERAL: u64 = u64::MAX;
/// Forks of this process: a connection made before the last one may have copies of P and of
/// its epoll set in a child, whose waits this process does not see.
static FORKS: AtomicU64 = AtomicU64::new(0);

/// This thread's number for `SetState::waiter` (never 0 or `SEVERAL`).
fn thread_number() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    thread_local! { static ME: std::cell::Cell<u64> = const { std::cell::Cell::new(0) }; }
    ME.with(|me| {
        if me.get() == 0 {
            me.set(NEXT.fetch_add(1, Ordering::Relaxed));
        }
        me.get()
    })
}

pub(crate) fn forks() -> u64 {
    FORKS.load(Ordering::SeqCst)
}

/// Before `fork`: the child shares P and the epoll sets, so nothing made so far is elided, and
/// no set made so far elides what joins it later (observing a set ends its members' elision).
pub(crate) fn before_fork() {
    FORKS.fetch_add(1, Ordering::SeqCst);
    for epfd in crate::table::epoll_instances() {
        crate::waits::observe_set(epfd);
    }
}

/// One epoll set's elision (in the library's record of the set, shared with its members'
/// registrations).
#[derive(Default)]
pub(crate) struct SetState {
    /// The one thread that has waited on the set (0: none yet; `SEVERAL`: more than one has,
    /// and nothing in it is elided).
    waiter: AtomicU64,
    /// That thread is in (or about to enter) its sleep on the set: a count, since a signal
    /// handler may wait inside a wait.
    asleep: AtomicUsize,
    /// Elided arrivals so far (the thread sleeps only if none came since its last report).
    arrivals: AtomicU64,
    /// Members that became readable without a token, to be reported by the next wait (kept
    /// while they stay readable: level-triggered).
    ready: Mutex<Vec<Weak<Carried>>>,
    ready_len: AtomicUsize,
    /// With room for one event, whether the kernel has the next turn.
    kernel_next: AtomicBool,
}

impl SetState {
    /// Exactly one thread waits on the set.
    pub(crate) fn single_waiter(&self) -> bool {
        let w = self.waiter.load(Ordering::SeqCst);
        w != 0 && w != SEVERAL
    }

    /// Before an interposed wait on the set: the first thread to wait becomes its waiting
    /// thread; a second one ends elision in the set.
    pub(crate) fn before_wait(&self) {
        let me = thread_number();
        let w = self.waiter.load(Ordering::SeqCst);
        if w == me || w == SEVERAL {
            return;
        }
        match self.waiter.compare_exchange(0, me, Ordering::SeqCst, Ordering::SeqCst) {
            Ok(_) => {}
            Err(other) if other == me || other == SEVERAL => {}
            Err(_) => {
                self.waiter.store(SEVERAL, Ordering::SeqCst);
                self.end();
            }
        }
    }

    /// Every member whose readability was elided gets its token now (the conditions no longer
    /// hold: `Carried::may_elide` says so from now on). Only queued ones can be readable
    /// without a token: an elided arrival queues its connection until a report finds it
    /// drained.
    fn end(&self) {
        let queued: Vec<Weak<Carried>> = self.ready.lock().clone();
        for c in queued.iter().filter_map(Weak::upgrade) {
            c.end_elision();
        }
    }

    /// Called by `Carried::sync`, under its mirror lock, for an arrival it does not write a
    /// token for: queues the member for the next report (if not queued yet) and returns
    /// whether the set's thread is awake. False: it may be asleep in the kernel, and the caller
    /// writes the token after all.
    pub(crate) fn elided(&self, c: Option<Weak<Carried>>) -> bool {
        if let Some(c) = c {
            let mut r = self.ready.lock();
            r.push(c);
            self.ready_len.store(r.len(), Ordering::Release);
        }
        self.arrivals.fetch_add(1, Ordering::SeqCst);
        self.asleep.load(Ordering::SeqCst) == 0
    }

    pub(crate) fn arrivals(&self) -> u64 {
        self.arrivals.load(Ordering::SeqCst)
    }

    /// How many of `max` events the kernel may fill, so that queued elided reports are not
    /// starved by kernel events (nor the kernel's by them). With room for one event, the kernel
    /// and the queue take turns (as the kernel's own ready list rotates level-triggered events);
    /// 0 means the kernel is not asked this time.
    pub(crate) fn kernel_room(&self, max: usize) -> usize {
        let queued = self.ready_len.load(Ordering::Acquire);
        if queued == 0 {
            max
        } else if max <= 1 {
            usize::from(self.kernel_next.fetch_xor(true, Ordering::Relaxed)) * max
        } else {
            max - queued.min(max / 2)
        }
    }

    /// Adds the elided readiness of the set's members to the `n` events the kernel put in
    /// `out`: `EPOLLIN` merged into the kernel's event for the same registration (its
    /// `EPOLLOUT`), or an event of its own while there is room. Returns the new count. What was
    /// reported goes to the back of the queue, as the kernel's level-triggered ready list
    /// rotates.
    pub(crate) fn report(&self, out: &mut [libc::epoll_event], mut n: usize) -> usize {
        if self.ready_len.load(Ordering::Acquire) == 0 {
            return n;
        }
        let queued = std::mem::take(&mut *self.ready.lock());
        let mut waiting = Vec::with_capacity(queued.len());
        let mut reported = Vec::new();
        for w in queued {
            let Some(c) = w.upgrade() else { continue };
            let Some((bits, data)) = c.elided_report(self) else { continue };
            if let Some(e) = out[..n].iter_mut().find(|e| e.u64 == data) {
                let had = e.events;
                e.events = had | bits;
            } else if n < out.len() {
                out[n] = libc::epoll_event { events: bits, u64: data };
                n += 1;
            } else {
                waiting.push(w);
                continue;
            }
            crate::process::bump(&crate::process::COUNTERS.readiness_elided);
            reported.push(w);
        }
        let mut r = self.ready.lock();
        // Entries queued meanwhile are newer than these.
        let newer = std::mem::take(&mut *r);
        r.extend(waiting);
        r.extend(reported);
        r.extend(newer);
        self.ready_len.store(r.len(), Ordering::Release);
        n
    }
}

/// The set's thread asleep on it: entered only if no elided arrival came since `seen` (read
/// before the last report); from then on arrivals write tokens, which wake the kernel wait.
pub(crate) struct Asleep(Arc<SetState>);

impl Asleep {
    pub(crate) fn enter(set: &Arc<SetState>, seen: u64) -> Option<Asleep> {
        let asleep = Asleep(set.clone());
        set.asleep.fetch_add(1, Ordering::SeqCst);
        (set.arrivals.load(Ordering::SeqCst) == seen).then_some(asleep)
    }
}

impl Drop for Asleep {
    fn drop(&mut self) {
        self.0.asleep.fetch_sub(1, Ordering::SeqCst);
    }
}
