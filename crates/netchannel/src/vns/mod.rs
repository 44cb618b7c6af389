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
        Listener::bind(self.ctx.clone(), port, None)
    }

    /// Listens on virtual port `addr.port()` for peers that reach this host at `addr`'s
    /// address, as a kernel socket bound there is reached: an address admits only sessions its
    /// peer dialed to that address (a listener on 127.0.0.1 is not reached from another host),
    /// a wildcard those of its family (IPv6's IPv4 ones too, unless `v6only`). Others are
    /// refused as if nothing listened.
    pub fn listen_on(&self, addr: SocketAddr, v6only: bool) -> io::Result<Listener> {
        let bound = crate::engine::listener::Bound { ip: addr.ip(), v6only };
        Listener::bind(self.ctx.clone(), addr.port(), Some(bound))
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
        let session = self.ctx.session_to(peer, class)?;
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
        let session = self.ctx.session_to(peer, class)?;
        VSocket::connect(session, port, class, false)
    }
}
