//! Readiness: who is told when a stream's state changes. Each stream in the session core
//! carries a [`StreamUser`] (the threads blocked on it, its poller registration); the core's
//! events are turned into [`Wakes`] under the session lock and fired after it is released.
//! [`PollerShared`] is the engine's side of a `Poller` (in `vns`): its ready list and the
//! thread waiting in it.

use std::cell::Cell;
use std::collections::HashMap;
use std::io;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::listener::ListenerShared;
use super::session::SessionRt;
use super::waiter::{self, Waiter};
use crate::proto::{EV_READ, EV_URGENT, EV_WRITE};
use crate::sys::EventFd;
use crate::wire::Class;

/// What the runtime keeps with each stream in the session core: the threads blocked on it and
/// its poller registration. An idle stream with neither costs 32 bytes here.
#[derive(Default)]
pub(crate) struct StreamUser {
    /// Threads blocked on the stream, with the `EV_*` bits they wait for.
    waiters: Vec<(Arc<Waiter>, u8)>,
    pub poll: Option<Arc<PollEntry>>,
}

thread_local! {
    /// An empty waiter list kept for the thread's next blocking wait (`add_waiter`).
    static SPARE_WAITERS: std::cell::Cell<Vec<(Arc<Waiter>, u8)>> =
        const { std::cell::Cell::new(Vec::new()) };
}

impl StreamUser {
    pub fn add_waiter(&mut self, w: &Arc<Waiter>, interest: u8) {
        match self.waiters.iter_mut().find(|(x, _)| Arc::ptr_eq(x, w)) {
            Some((_, i)) => *i |= interest,
            None => {
                if self.waiters.capacity() == 0 {
                    // The list the thread's last wait gave back: a blocking call allocates not.
                    self.waiters =
                        SPARE_WAITERS.try_with(std::cell::Cell::take).unwrap_or_default();
                }
                self.waiters.push((w.clone(), interest));
            }
        }
    }

    pub fn remove_waiter(&mut self, w: &Arc<Waiter>) {
        self.waiters.retain(|(x, _)| !Arc::ptr_eq(x, w));
        if self.waiters.is_empty() {
            // The memory goes back (idle streams stay small), to the thread for its next wait.
            let list = std::mem::take(&mut self.waiters);
            if list.capacity() <= 4 {
                let _exiting = SPARE_WAITERS.try_with(|c| c.set(list));
            }
        }
    }

    /// Whether a large payload for this stream should stay in the socket for its reader to read
    /// straight into its buffer: only when the reader is at hand (the current thread is it, in
    /// `recv` or in `wait` on the stream's poller) or is blocked in `recv` on this stream. A
    /// deferred payload holds up its channel until read: left for an event loop elsewhere, even
    /// one that sleeps and would come within a wake-up, it stalls every other stream of the
    /// channel meanwhile (measured: all-to-all over 64 streams lost a fifth of its goodput).
    pub fn reader_at_hand(&self) -> bool {
        self.waiters.iter().any(|(_, interest)| interest & EV_READ != 0)
            || self.poll.as_ref().is_some_and(|p| p.polled_by_current_thread())
    }

    /// Collects who must be told about `bits`.
    pub fn wakes(&self, bits: u8, wakes: &mut Wakes) {
        for (w, interest) in &self.waiters {
            if interest & bits != 0 {
                wakes.thread(w.clone());
            }
        }
        if bits & (EV_READ | EV_WRITE) != 0 {
            if let Some(p) = &self.poll {
                wakes.poll(p.clone(), bits);
            }
        }
    }
}

/// Wake-ups collected under the session lock and delivered after it is released (a wake-up is
/// a system call; none is made while holding the lock). Only the core guard
/// (`SessionRt::core`) fills and fires them: it fires after it unlocks.
///
/// Most holds wake nobody: they start with no lists at all and cost nothing at the end. The
/// first wake-up collected takes the thread's spare lists (so collecting does not allocate on
/// every hold), and firing gives them back. Before, every hold took and gave back the spare
/// lists and drained all three: a fifth of the library's instructions per memcslap key.
#[derive(Default)]
pub(crate) struct Wakes {
    threads: Vec<Arc<Waiter>>,
    polls: Vec<(Arc<PollEntry>, u8)>,
    listeners: Vec<Arc<ListenerShared>>,
}

thread_local! {
    /// A thread's `Wakes` between two holds of a session lock, emptied: the lists keep their
    /// capacity, so collecting wake-ups does not allocate on every hold.
    static SPARE_WAKES: Cell<Wakes> = const {
        Cell::new(Wakes::new())
    };
}

impl Wakes {
    /// No lists yet (see the type's doc).
    pub const fn new() -> Wakes {
        Wakes { threads: Vec::new(), polls: Vec::new(), listeners: Vec::new() }
    }

    fn capacity(&self) -> usize {
        self.threads.capacity() + self.polls.capacity() + self.listeners.capacity()
    }

    /// Before the first wake-up is collected: takes the thread's spare lists, with the
    /// capacity its last `fire` left (a guard taken while another holds them gets new ones).
    fn lists(&mut self) -> &mut Self {
        if self.capacity() == 0 {
            if let Ok(spare) = SPARE_WAKES.try_with(Cell::take) {
                *self = spare;
            }
        }
        self
    }

    pub fn thread(&mut self, w: Arc<Waiter>) {
        self.lists().threads.push(w);
    }

    pub fn poll(&mut self, p: Arc<PollEntry>, bits: u8) {
        self.lists().polls.push((p, bits));
    }

    pub fn listener(&mut self, l: Arc<ListenerShared>) {
        self.lists().listeners.push(l);
    }

    /// Delivers what was collected and gives the lists back for the thread's next hold: none
    /// are left (what `CoreGuard` relies on to skip dropping them).
    pub fn fire(&mut self) {
        if self.capacity() == 0 {
            return; // nothing was collected
        }
        for w in self.threads.drain(..) {
            w.notify();
        }
        for (p, bits) in self.polls.drain(..) {
            p.notify(bits);
        }
        for l in self.listeners.drain(..) {
            l.notify();
        }
        let lists = std::mem::take(self);
        // Lists a burst made long are let go: a thread keeps little between holds.
        if lists.capacity() <= 1024 {
            let _exiting = SPARE_WAKES.try_with(|c| c.set(lists));
        }
    }
}

/// The engine's side of a `Poller`: the ready list of its sockets, the thread waiting in it,
/// and whose channels that thread serves while it waits.
pub(crate) struct PollerShared {
    ready: Mutex<Vec<Arc<PollEntry>>>,
    /// The thread in `wait`, if any.
    waiter: Mutex<Option<Arc<Waiter>>>,
    fd: EventFd,
    /// `fd()` was handed out: keep it readable while tokens are pending.
    fd_used: AtomicBool,
    /// Sessions (and classes) of registered sockets: whose channels `wait` serves.
    sessions: Mutex<WatchedSessions>,
    /// A kernel fd whose events also end `wait` (`wake_on`), with a key unique to this call.
    companion: Mutex<Option<(RawFd, u64)>>,
    /// When a thread last came to `wait` (`clock_ns`), shared with the sessions it waits on
    /// (`SessionRt::add_app_watcher`): their workers stay quiet while it keeps coming.
    stamp: Arc<AtomicU64>,
    /// Sessions added to `sessions` so far.
    sessions_added: AtomicU64,
    /// What the last look at the sessions saw: the waiting thread (its waiter's address),
    /// `channels_epoch` and `sessions_added`. While all hold, the sessions' channels are
    /// registered in that thread's epoll set already.
    looked: Mutex<Option<(usize, u64, u64)>>,
}

/// A poller's sessions by address and class. Registering a socket costs O(1), not a walk over
/// the poller's sessions (quadratic when a poller takes thousands of peers' sockets); a
/// session's `Weak` keeps its address from being reused, so a key never names a newer session.
#[derive(Default)]
struct WatchedSessions {
    by_key: HashMap<(usize, usize), (Weak<SessionRt>, Class)>,
    /// Registrations since gone sessions were last swept out (once per as many as there are).
    since_sweep: usize,
}

/// Told when a virtual socket's readiness may have changed: an interposition layer mirrors it
/// into a kernel object (see `VSocket::set_observer`). Called after the engine's locks are
/// released, from whichever thread made the change; it must not block.
pub trait ReadinessObserver: Send + Sync {
    /// `readable`/`writable`: which of the socket's sides may have changed (new data, end of
    /// stream or an error; credit or buffer space).
    fn changed(&self, readable: bool, writable: bool);
    /// The peer's urgent byte came (`MSG_OOB`); called before `changed`.
    fn urgent(&self) {}
}

/// Who a socket's readiness changes go to.
enum Target {
    /// A `Poller`'s ready list, under a token.
    Poller { poller: Arc<PollerShared>, token: u64, queued: AtomicBool },
    /// An observer, told every change.
    Observer(Arc<dyn ReadinessObserver>),
}

/// A socket's membership in a poller, or its observer.
pub(crate) struct PollEntry {
    target: Target,
}

/// What `polled_by_current_thread` answers for observed sockets while the thread serves
/// channels on behalf of an observer's owner (`ServeSet`).
pub(crate) const SERVING_OBSERVED: usize = 1;

impl PollEntry {
    pub fn new(poller: &Arc<PollerShared>, token: u64) -> Self {
        PollEntry {
            target: Target::Poller {
                poller: poller.clone(),
                token,
                queued: AtomicBool::new(false),
            },
        }
    }

    pub fn observer(observer: Arc<dyn ReadinessObserver>) -> Self {
        PollEntry { target: Target::Observer(observer) }
    }

    /// Whether the calling thread is the one waiting on this entry's poller right now (for an
    /// observed socket: whether it serves channels for the observer's owner, who reads next).
    pub fn polled_by_current_thread(&self) -> bool {
        match &self.target {
            Target::Poller { poller, .. } => waiter::polling() == Arc::as_ptr(poller) as usize,
            Target::Observer(_) => waiter::polling() == SERVING_OBSERVED,
        }
    }

    /// Lists the socket as ready (once until `wait` returns it), or tells its observer.
    pub fn notify(self: &Arc<Self>, bits: u8) {
        let (p, queued) = match &self.target {
            Target::Observer(o) => {
                if bits & EV_URGENT != 0 {
                    o.urgent();
                }
                return o.changed(bits & EV_READ != 0, bits & EV_WRITE != 0);
            }
            Target::Poller { poller, queued, .. } => (poller, queued),
        };
        if queued.swap(true, Ordering::AcqRel) {
            return;
        }
        let was_empty = {
            let mut ready = p.ready.lock();
            let e = ready.is_empty();
            ready.push(self.clone());
            e
        };
        if was_empty {
            if let Some(w) = p.waiter.lock().as_ref() {
                w.notify();
            }
            if p.fd_used.load(Ordering::Acquire) {
                p.fd.notify();
            }
        }
    }

    /// The poller's token, cleared from the ready list (`None` for an observer).
    fn take_token(&self) -> Option<u64> {
        match &self.target {
            Target::Poller { token, queued, .. } => {
                // Cleared before the application looks, so any later change re-lists it.
                queued.store(false, Ordering::Release);
                Some(*token)
            }
            Target::Observer(_) => None,
        }
    }
}

impl PollerShared {
    pub fn new() -> io::Result<Arc<PollerShared>> {
        Ok(Arc::new(PollerShared {
            ready: Mutex::new(Vec::new()),
            waiter: Mutex::new(None),
            fd: EventFd::new()?,
            fd_used: AtomicBool::new(false),
            sessions: Mutex::default(),
            companion: Mutex::new(None),
            stamp: Arc::new(AtomicU64::new(0)),
            sessions_added: AtomicU64::new(0),
            looked: Mutex::new(None),
        }))
    }

    /// A registered socket's session: `wait` serves its channels of `class`.
    pub fn watch(&self, session: &Arc<SessionRt>, class: Class) {
        let mut s = self.sessions.lock();
        let key = (Arc::as_ptr(session) as usize, class.index());
        if s.by_key.contains_key(&key) {
            return;
        }
        s.by_key.insert(key, (Arc::downgrade(session), class));
        self.sessions_added.fetch_add(1, Ordering::AcqRel);
        s.since_sweep += 1;
        if s.since_sweep >= s.by_key.len().max(64) {
            s.since_sweep = 0;
            s.by_key.retain(|_, (w, _)| w.strong_count() > 0);
        }
    }

    /// Waits until at least one registered socket is ready or `timeout` passes, serving the
    /// sessions' channels meanwhile; replaces `tokens` with the ready tokens.
    pub fn wait(
        self: &Arc<Self>,
        tokens: &mut Vec<u64>,
        timeout: Option<Duration>,
    ) -> io::Result<()> {
        tokens.clear();
        let deadline = timeout.map(|t| Instant::now() + t);
        let w = waiter::current()?;
        *self.waiter.lock() = Some(w.clone());
        let mut events = Vec::new();
        let result = loop {
            w.begin();
            if self.fd_used.load(Ordering::Acquire) {
                // Drained before the list is taken: a notify racing with us re-signals it.
                self.fd.drain();
            }
            {
                let mut ready = self.ready.lock();
                tokens.extend(ready.drain(..).filter_map(|e| e.take_token()));
            }
            if !tokens.is_empty() {
                break Ok(());
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                break Ok(());
            }
            waiter::before_wait(true);
            self.stamp.store(super::session::clock_ns(), Ordering::Relaxed);
            // The sessions are looked at only when something changed: a poller over thousands
            // of sessions does not visit each on every wait.
            // Read before the sessions: a change during the look makes the next wait look again.
            let added = self.sessions_added.load(Ordering::Acquire);
            let epoch = super::session::channels_epoch();
            let me = (Arc::as_ptr(&w) as usize, epoch, added);
            if *self.looked.lock() != Some(me) {
                let sessions: Vec<(Arc<SessionRt>, Class)> = self
                    .sessions
                    .lock()
                    .by_key
                    .values()
                    .filter_map(|(s, c)| s.upgrade().map(|s| (s, *c)))
                    .collect();
                for (s, c) in &sessions {
                    // The thread registers its streams' channels as it uses them.
                    let served = w.watch(s, *c, waiter::Watch::Learned);
                    s.add_app_watcher(served, &self.stamp);
                }
                *self.looked.lock() = Some(me);
            }
            if let Some((fd, key)) = *self.companion.lock() {
                w.set_companion(fd, key);
            }
            let companion = match w.sleep(deadline, &mut events) {
                Ok(c) => c,
                Err(e) => break Err(e),
            };
            waiter::set_polling(Arc::as_ptr(self) as usize);
            waiter::handle(&mut events);
            waiter::set_polling(0);
            if companion {
                break Ok(());
            }
        };
        *self.waiter.lock() = None;
        result
    }

    /// `wait` also returns when `fd` gets an event (see `Poller::wake_on`).
    pub fn wake_on(&self, fd: RawFd) {
        static KEYS: AtomicU64 = AtomicU64::new(1);
        *self.companion.lock() = Some((fd, KEYS.fetch_add(1, Ordering::Relaxed)));
    }

    /// An eventfd readable while tokens are pending (for nesting in epoll).
    pub fn fd(&self) -> RawFd {
        self.fd_used.store(true, Ordering::Release);
        if !self.ready.lock().is_empty() {
            self.fd.notify();
        }
        self.fd.raw()
    }

    /// The poller is gone: its pending tokens with it.
    pub fn clear(&self) {
        self.ready.lock().clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::Stream;

    #[test]
    fn idle_streams_are_small() {
        // A million idle virtual sockets must fit well under 1 GiB (design brief, section 5):
        // the core's boxed state with what the runtime keeps with it, plus a 16-byte table slot.
        let size = std::mem::size_of::<Stream<StreamUser>>() + 16;
        assert!(size <= 280, "idle stream costs {size} bytes");
    }
}
