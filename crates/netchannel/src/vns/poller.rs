//! Readiness for many virtual sockets through one file descriptor (like mio's `Poll`).
//!
//! Register sockets with a token; `wait` returns the tokens of sockets whose state may have
//! changed (data, credit, end of stream, reset). Edge-triggered: after a token is returned, call
//! `recv`/`send` on that socket until `WouldBlock`; spurious tokens are possible. The fd (an
//! eventfd) is readable while tokens are pending, so a poller nests in epoll. Costs no fd per
//! socket, so a million sockets fit in one poller.

use std::io;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use super::Stream;
use crate::sys::EventFd;

pub(crate) struct PollerShared {
    ready: Mutex<Vec<(u64, Weak<Stream>)>>,
    fd: EventFd,
}

/// A socket's membership in a poller.
pub(crate) struct Registration {
    poller: Arc<PollerShared>,
    token: u64,
    /// Set while the token sits in the ready list, so a busy socket is listed once.
    queued: AtomicBool,
}

impl Registration {
    pub fn new(poller: &Poller, token: u64) -> Self {
        Registration { poller: poller.shared.clone(), token, queued: AtomicBool::new(false) }
    }

    /// Lists the stream as ready (once until the next `wait` returns it).
    pub fn notify(&self, stream: &Arc<Stream>) {
        if self.queued.swap(true, Ordering::AcqRel) {
            return;
        }
        let mut ready = self.poller.ready.lock().unwrap_or_else(|e| e.into_inner());
        let was_empty = ready.is_empty();
        ready.push((self.token, Arc::downgrade(stream)));
        drop(ready);
        if was_empty {
            self.poller.fd.notify();
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
            shared: Arc::new(PollerShared { ready: Mutex::new(Vec::new()), fd: EventFd::new()? }),
        })
    }

    /// Registers `sock` under `token`. A socket belongs to at most one poller; it is reported
    /// once right away if it is already readable or writable.
    pub fn register(&self, sock: &super::socket::VSocket, token: u64) -> io::Result<()> {
        sock.register(self, token)
    }

    /// Waits until at least one registered socket is ready or `timeout` passes, then replaces
    /// the contents of `tokens` with the ready tokens (possibly none after a timeout).
    pub fn wait(&self, tokens: &mut Vec<u64>, timeout: Option<Duration>) -> io::Result<()> {
        tokens.clear();
        let deadline = timeout.map(|t| Instant::now() + t);
        loop {
            // Drained before the list is taken: a notify racing with us re-signals the fd.
            self.shared.fd.drain();
            {
                let mut ready = self.shared.ready.lock().unwrap_or_else(|e| e.into_inner());
                for (token, stream) in ready.drain(..) {
                    // Cleared before the application looks, so any later change re-lists it.
                    if let Some(s) = stream.upgrade() {
                        if let Some(reg) = s.registration.get() {
                            reg.queued.store(false, Ordering::Release);
                        }
                    }
                    tokens.push(token);
                }
            }
            if !tokens.is_empty() {
                return Ok(());
            }
            let wait = match deadline {
                None => None,
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        return Ok(());
                    }
                    Some(d - now)
                }
            };
            crate::sys::poll_readable(self.shared.fd.raw(), wait)?;
        }
    }

    /// An eventfd readable while tokens are pending (for nesting in epoll).
    pub fn fd(&self) -> RawFd {
        self.shared.fd.raw()
    }
}

impl Drop for Poller {
    fn drop(&mut self) {
        self.shared.ready.lock().unwrap_or_else(|e| e.into_inner()).clear();
    }
}
