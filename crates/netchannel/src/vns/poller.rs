//! Readiness for many virtual sockets through one waiter (like mio's `Poll`).
//!
//! Register sockets with a token; `wait` returns the tokens of sockets whose state may have
//! changed (data, credit, end of stream, reset). Edge-triggered: after a token is returned, call
//! `recv`/`send` on that socket until `WouldBlock`; spurious tokens are possible. Costs no file
//! descriptor per socket, so a million sockets fit in one poller.
//!
//! The thread in `wait` serves the channels of the registered sockets' sessions itself (reads,
//! dispatches, writes), so an event loop's own bytes usually need no other thread. Sends an
//! event loop makes are written once per iteration, when it comes back to `wait`. For nesting in
//! another epoll set, `fd()` is an eventfd readable while tokens are pending; the other way round,
//! `wake_on(fd)` makes `wait` return when the loop's own epoll set (kernel sockets) has events,
//! so the loop can sleep in `wait` and keep serving channels itself.

use std::io;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::engine::session::SessionRt;
use crate::engine::waiter::{self, Waiter};
use crate::sys::EventFd;
use crate::wire::Class;

pub(crate) struct PollerShared {
    ready: Mutex<Vec<Arc<PollEntry>>>,
    /// The thread in `wait`, if any.
    waiter: Mutex<Option<Arc<Waiter>>>,
    fd: EventFd,
    /// `fd()` was handed out: keep it readable while tokens are pending.
    fd_used: AtomicBool,
    /// Sessions (and classes) of registered sockets: whose channels `wait` serves.
    sessions: Mutex<Vec<(Weak<SessionRt>, Class)>>,
    /// A kernel fd whose events also end `wait` (`wake_on`), with a key unique to this call.
    companion: Mutex<Option<(RawFd, u64)>>,
}

/// A socket's membership in a poller.
pub(crate) struct PollEntry {
    poller: Arc<PollerShared>,
    token: u64,
    /// Set while the token sits in the ready list, so a busy socket is listed once.
    queued: AtomicBool,
}

impl PollEntry {
    pub fn new(poller: &Poller, token: u64) -> Self {
        PollEntry { poller: poller.shared.clone(), token, queued: AtomicBool::new(false) }
    }

    /// Whether the calling thread is the one waiting on this entry's poller right now.
    pub fn polled_by_current_thread(&self) -> bool {
        waiter::polling() == Arc::as_ptr(&self.poller) as usize
    }

    /// Lists the socket as ready (once until `wait` returns it).
    pub fn notify(self: &Arc<Self>) {
        if self.queued.swap(true, Ordering::AcqRel) {
            return;
        }
        let p = &self.poller;
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
}

/// One readiness source for many virtual sockets.
pub struct Poller {
    shared: Arc<PollerShared>,
}

impl Poller {
    pub fn new() -> io::Result<Poller> {
        Ok(Poller {
            shared: Arc::new(PollerShared {
                ready: Mutex::new(Vec::new()),
                waiter: Mutex::new(None),
                fd: EventFd::new()?,
                fd_used: AtomicBool::new(false),
                sessions: Mutex::new(Vec::new()),
                companion: Mutex::new(None),
            }),
        })
    }

    /// Registers `sock` under `token`. A socket belongs to at most one poller; it is reported
    /// once right away if it is already readable or writable.
    pub fn register(&self, sock: &super::socket::VSocket, token: u64) -> io::Result<()> {
        sock.register(self, token)
    }

    pub(crate) fn watch(&self, session: &Arc<SessionRt>, class: Class) {
        let mut s = self.shared.sessions.lock();
        s.retain(|(w, _)| w.strong_count() > 0);
        let known = s.iter().any(|(w, c)| *c == class && w.as_ptr() == Arc::as_ptr(session));
        if !known {
            s.push((Arc::downgrade(session), class));
        }
    }

    /// Waits until at least one registered socket is ready or `timeout` passes, then replaces
    /// the contents of `tokens` with the ready tokens (possibly none after a timeout).
    pub fn wait(&self, tokens: &mut Vec<u64>, timeout: Option<Duration>) -> io::Result<()> {
        tokens.clear();
        let deadline = timeout.map(|t| Instant::now() + t);
        let w = waiter::current()?;
        *self.shared.waiter.lock() = Some(w.clone());
        let mut events = Vec::new();
        let result = loop {
            w.begin();
            if self.shared.fd_used.load(Ordering::Acquire) {
                // Drained before the list is taken: a notify racing with us re-signals it.
                self.shared.fd.drain();
            }
            {
                let mut ready = self.shared.ready.lock();
                for e in ready.drain(..) {
                    // Cleared before the application looks, so any later change re-lists it.
                    e.queued.store(false, Ordering::Release);
                    tokens.push(e.token);
                }
            }
            if !tokens.is_empty() {
                break Ok(());
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                break Ok(());
            }
            waiter::before_wait(true);
            let sessions: Vec<(Arc<SessionRt>, Class)> = self
                .shared
                .sessions
                .lock()
                .iter()
                .filter_map(|(s, c)| s.upgrade().map(|s| (s, *c)))
                .collect();
            for (s, c) in &sessions {
                w.watch(s, *c);
            }
            drop(sessions);
            if let Some((fd, key)) = *self.shared.companion.lock() {
                w.set_companion(fd, key);
            }
            let companion = match w.sleep(deadline, &mut events) {
                Ok(c) => c,
                Err(e) => break Err(e),
            };
            waiter::set_polling(Arc::as_ptr(&self.shared) as usize);
            waiter::handle(&mut events);
            waiter::set_polling(0);
            if companion {
                break Ok(());
            }
        };
        *self.shared.waiter.lock() = None;
        result
    }

    /// Makes `wait` also return (possibly with no tokens) when `fd` gets an event: for example
    /// the loop's own epoll set over kernel sockets, so that one thread sleeps on both kinds
    /// and still serves its virtual sockets' channels itself. Edge-triggered, and an edge may
    /// be spent by another wait of the same thread: poll `fd` without blocking before each
    /// `wait`. `fd` must stay open while it is the companion (until the poller is dropped).
    pub fn wake_on(&self, fd: RawFd) {
        static KEYS: AtomicU64 = AtomicU64::new(1);
        *self.shared.companion.lock() = Some((fd, KEYS.fetch_add(1, Ordering::Relaxed)));
    }

    /// An eventfd readable while tokens are pending (for nesting in epoll).
    pub fn fd(&self) -> RawFd {
        self.shared.fd_used.store(true, Ordering::Release);
        if !self.shared.ready.lock().is_empty() {
            self.shared.fd.notify();
        }
        self.shared.fd.raw()
    }
}

impl Drop for Poller {
    fn drop(&mut self) {
        self.shared.ready.lock().clear();
    }
}
