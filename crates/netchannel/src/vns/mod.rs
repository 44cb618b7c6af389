//! VNS: virtual sockets, the application's side. They only buffer and order application data
//! (in the session core); which channel carries a byte is the scheduler's business, how it
//! travels the driver's.
//!
//! - [`socket`]: the application API (`VSocket`, `Listener`).
//! - [`poller`]: readiness of many sockets through one waiter (tokens, edge-triggered).
//!
//! VNS sits on top of the engine: it calls the engine's runtime (sessions, waiters, listeners),
//! never the other way round.

pub mod poller;
#[cfg(feature = "internals")]
pub mod serve;
pub mod socket;

use std::io;
use std::net::SocketAddr;

use crate::engine::Engine;
use crate::wire::Class;
use socket::{Listener, VSocket};

/// The application's entry points into an engine. They live here, beside the types they
/// return, so that the engine never depends on VNS.
impl Engine {
    /// Listens for virtual sockets on a virtual `port` (its own namespace, not kernel ports).
    pub fn listen(&self, port: u16) -> io::Result<Listener> {
        Listener::bind(self.ctx.clone(), port)
    }

    /// Opens a virtual socket of `Config::default_class` to `port` on the engine at `peer`.
    pub fn connect(&self, peer: SocketAddr, port: u16) -> io::Result<VSocket> {
        self.connect_with_class(peer, port, self.ctx.config.default_class)
    }

    /// Opens a virtual socket of `class` to `port` on the engine at `peer`.
    pub fn connect_with_class(
        &self,
        peer: SocketAddr,
        port: u16,
        class: Class,
    ) -> io::Result<VSocket> {
        let session = self.ctx.session_to(peer)?;
        VSocket::connect(session, port, class, true)
    }

    /// Starts opening a virtual socket and returns at once (as a non-blocking TCP connect): the
    /// socket becomes writable when the peer accepted, and `VSocket::take_error` reports a
    /// refusal. Only the first socket to a peer waits, for the channels to be dialed.
    pub fn connect_nonblocking(
        &self,
        peer: SocketAddr,
        port: u16,
        class: Class,
    ) -> io::Result<VSocket> {
        let session = self.ctx.session_to(peer)?;
        VSocket::connect(session, port, class, false)
    }
}
