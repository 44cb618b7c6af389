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
use std::sync::Arc;
use std::time::Duration;

use crate::engine::readiness::PollerShared;

/// One readiness source for many virtual sockets.
pub struct Poller {
    pub(crate) shared: Arc<PollerShared>,
}

impl Poller {
    /// A poller with no socket registered.
    pub fn new() -> io::Result<Poller> {
        Ok(Poller { shared: PollerShared::new()? })
    }

    /// Registers `sock` under `token`. A socket belongs to at most one poller; it is reported
    /// once right away if it is already readable or writable.
    pub fn register(&self, sock: &super::socket::VSocket, token: u64) -> io::Result<()> {
        sock.register(self, token)
    }

    /// Waits until at least one registered socket is ready or `timeout` passes, then replaces
    /// the contents of `tokens` with the ready tokens (possibly none after a timeout).
    pub fn wait(&self, tokens: &mut Vec<u64>, timeout: Option<Duration>) -> io::Result<()> {
        self.shared.wait(tokens, timeout)
    }

    /// Makes `wait` also return (possibly with no tokens) when `fd` gets an event: for example
    /// the loop's own epoll set over kernel sockets, so that one thread sleeps on both kinds
    /// and still serves its virtual sockets' channels itself. Edge-triggered, and an edge may
    /// be spent by another wait of the same thread: poll `fd` without blocking before each
    /// `wait`. `fd` must stay open while it is the companion (until the poller is dropped).
    pub fn wake_on(&self, fd: RawFd) {
        self.shared.wake_on(fd)
    }

    /// An eventfd readable while tokens are pending (for nesting in epoll).
    pub fn fd(&self) -> RawFd {
        self.shared.fd()
    }
}

impl Drop for Poller {
    fn drop(&mut self) {
        self.shared.clear();
    }
}
