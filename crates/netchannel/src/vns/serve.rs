//! Serving channels while the thread waits somewhere the engine does not own: in a program's
//! own `epoll_wait`, `poll` or `select` (the interposition library's direct path).
//!
//! A [`ServeSet`] names the virtual sockets whose channels a waiting thread serves (reads,
//! dispatches, writes), as a thread blocked in `VSocket::recv` or `Poller::wait` does: the
//! thread that waits for a message usually reads it itself (run to completion), one wake-up per
//! message. Their readiness reaches the program through each socket's observer, which mirrors
//! it into a kernel object the program's own wait sees.

use std::io;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Instant;

use smallvec::SmallVec;

use super::socket::VSocket;
use crate::engine::readiness::SERVING_OBSERVED;
use crate::engine::session::SessionRt;
use crate::engine::waiter::{self, Waiter, Watch};
use crate::sys::SignalPolicy;
use crate::wire::Class;

/// The sessions (and how many of the set's sockets use each) whose channels a wait serves.
#[derive(Clone)]
pub struct ServeSet {
    /// Inline: a `poll` makes a set per call, most over one or two sessions.
    sessions: SmallVec<[(Weak<SessionRt>, usize); 2]>,
    /// Tells this set's companion registration from an older one under a reused fd number.
    key: u64,
}

impl Default for ServeSet {
    fn default() -> Self {
        ServeSet::new()
    }
}

impl ServeSet {
    /// An empty set.
    pub fn new() -> ServeSet {
        static KEYS: AtomicU64 = AtomicU64::new(1 << 32);
        ServeSet { sessions: SmallVec::new(), key: KEYS.fetch_add(1, Ordering::Relaxed) }
    }

    /// Serves `sock`'s channels during waits (counted: add once per registration).
    pub fn add(&mut self, sock: &VSocket) {
        let s = sock.session();
        self.sessions.retain(|(w, _)| w.strong_count() > 0);
        match self.sessions.iter_mut().find(|(w, _)| w.as_ptr() == Arc::as_ptr(s)) {
            Some((_, n)) => *n += 1,
            None => self.sessions.push((Arc::downgrade(s), 1)),
        }
    }

    /// Undoes one `add` of `sock`.
    pub fn remove(&mut self, sock: &VSocket) {
        let s = sock.session();
        if let Some(i) = self.sessions.iter().position(|(w, _)| w.as_ptr() == Arc::as_ptr(s)) {
            self.sessions[i].1 -= 1;
            if self.sessions[i].1 == 0 {
                self.sessions.swap_remove(i);
            }
        }
    }

    /// Adds every session of `other` (a nested wait: an epoll set inside another, or a poll
    /// over an epoll set).
    pub fn merge(&mut self, other: &ServeSet) {
        for (w, n) in &other.sessions {
            match self.sessions.iter_mut().find(|(x, _)| x.as_ptr() == w.as_ptr()) {
                Some((_, m)) => *m += n,
                None => self.sessions.push((w.clone(), *n)),
            }
        }
    }

    /// Whether no socket is in the set.
    pub fn is_empty(&self) -> bool {
        self.sessions.is_empty()
    }

    /// Registers the sessions' channels with the thread's waiter; writes what this thread's
    /// sends deferred (an event loop flushes once per iteration, when it waits).
    fn prepare(&self, w: &Arc<Waiter>) {
        waiter::before_wait(true);
        for (s, _) in &self.sessions {
            if let Some(s) = s.upgrade() {
                // The thread registers its streams' channels as it uses them (`Waiter::learn`).
                w.watch(&s, Class::Throughput, Watch::Learned);
                w.watch(&s, Class::Latency, Watch::Learned);
            }
        }
    }

    /// Sleeps until `companion` (the program's epoll set) has an event, a channel event was
    /// served, or `deadline`; serves the channels meanwhile. Returns `Ok` in every case but a
    /// signal under an interruptible policy (`Interrupted`): the caller then looks at its fd.
    /// `woke` runs once the sleep is over, before the channel events found are served (the
    /// caller's readiness mirror may then report what this thread dispatches itself, instead
    /// of writing it into the kernel object for a sleeper).
    pub fn wait(
        &self,
        companion: RawFd,
        deadline: Option<Instant>,
        signals: SignalPolicy<'_>,
        woke: impl FnOnce(),
    ) -> io::Result<()> {
        let w = waiter::current()?;
        w.begin();
        self.prepare(&w);
        w.set_companion(companion, self.key);
        waiter::with_channel_events(|events| {
            let r = w.sleep_signals(deadline, events, signals);
            woke();
            serve(events);
            r.map(|_| ())
        })
    }

    /// Sleeps until `check` (run once the thread is registered as waiting, so a [`ThreadWake`]
    /// taken before it and woken after it is never lost) returns true, the thread is woken
    /// through its [`ThreadWake`], a channel event was served, or `deadline`; serves the
    /// channels meanwhile. Returns whether `check` held (then it did not sleep); `Interrupted`
    /// on a signal under an interruptible policy. For a wait whose readiness the caller's own
    /// objects report and which wakes it itself (a `poll` over carried fds only): the thread
    /// sleeps in its epoll set, where an exclusive channel wake-up counts, whereas a `poll` on
    /// that set's fd does not, so every thread sleeping beside it would wake for each event.
    /// `serve_first`: before sleeping, serve what the channels hold already, and return (to
    /// look again) only if there was any; a reply that came while the thread ran is usually
    /// there, as a kernel socket would have it queued, and otherwise the sleep follows in the
    /// same round, without a second `check`.
    pub fn wait_until(
        &self,
        deadline: Option<Instant>,
        signals: SignalPolicy<'_>,
        serve_first: bool,
        check: impl FnOnce() -> bool,
    ) -> io::Result<bool> {
        let w = waiter::current()?;
        w.begin();
        if check() {
            return Ok(true);
        }
        self.prepare(&w);
        waiter::with_channel_events(|events| {
            if serve_first {
                w.collect_now(events);
                if !events.is_empty() {
                    serve(events);
                    return Ok(false);
                }
            }
            let r = w.sleep_signals(deadline, events, signals);
            serve(events);
            r.map(|_| false)
        })
    }

    /// Sleeps in `sleep_in`, given the fd of the thread's epoll set (readable while a channel
    /// of the set has an event), for a wait over the program's own fds (`poll`, `select`);
    /// serves the channel events it finds after. `None`: a wake-up was already pending (it did
    /// not sleep; look at the fds again).
    pub fn sleep_beside<T>(&self, sleep_in: impl FnOnce(RawFd) -> T) -> io::Result<Option<T>> {
        let w = waiter::current()?;
        w.begin();
        self.prepare(&w);
        Ok(waiter::with_channel_events(|events| {
            let r = w.sleep_beside(events, sleep_in);
            serve(events);
            r
        }))
    }
}

/// Wakes a thread out of its `ServeSet::wait_until` (or makes its next one return at once),
/// from any thread.
#[derive(Clone)]
pub struct ThreadWake(Arc<Waiter>);

impl ThreadWake {
    /// The calling thread's.
    pub fn current() -> io::Result<ThreadWake> {
        waiter::current().map(ThreadWake)
    }

    /// Wakes the thread (a system call only when it sleeps).
    pub fn wake(&self) {
        self.0.notify();
    }

    /// Whether both wake the same thread.
    pub fn same(&self, other: &ThreadWake) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

/// Handles channel events, telling the engine the observed sockets' reader is at hand (a large
/// payload may stay in its channel for the program's next read to take straight).
fn serve(events: &mut Vec<waiter::ChannelEvent>) {
    if events.is_empty() {
        return;
    }
    waiter::set_polling(SERVING_OBSERVED);
    waiter::handle(events);
    waiter::set_polling(0);
}
