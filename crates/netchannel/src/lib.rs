//! NetChannel in user space: virtual sockets with stream semantics, multiplexed over many kernel
//! TCP connections ("channels") by an engine embedded in the application process.
//!
//! The public API is the engine ([`Engine`], [`Config`]), virtual sockets ([`VSocket`],
//! [`Listener`], [`Poller`]) and their statistics. Layers, lowest first (see
//! docs/ARCHITECTURE.md; each uses only those before it, which `tests/layers.rs` checks):
//! - `copy`: the data path's byte copies (around a slow case of glibc's `memcpy`).
//! - `sys`: every OS call std does not wrap; the crate's `unsafe` lives only here.
//! - `wire`: handshake and frame codec (pure).
//! - `scheduler`: which stream's chunk each channel carries next.
//! - `proto`: the sans-IO protocol core: streams, credit, ordering, retention, recovery.
//! - `driver`: channels (the queues of a multi-queue "device"), the TCP transport.
//! - `engine`: threads and execution model (workers, run to completion).
//! - `vns`: virtual sockets, the application API.
//!
//! The feature `internals` makes `copy`, `sys` and `wire` public for netchannel's own tools and
//! tests (ncperf, the preload library, the attack tests); they carry no stability promise.
//!
//! ```no_run
//! use netchannel::{Config, Engine};
//! let server = Engine::new(Config::default())?;
//! let listener = server.listen(80)?;
//! let client = Engine::new(Config::default())?;
//! let sock = client.connect(server.local_addr(), 80)?;
//! sock.send(b"hello")?;
//! let peer = listener.accept()?;
//! let mut buf = [0u8; 5];
//! peer.recv(&mut buf)?;
//! # Ok::<(), std::io::Error>(())
//! ```

#![deny(unsafe_code)]
#![warn(missing_docs)]
#![warn(clippy::undocumented_unsafe_blocks)]

#[cfg(feature = "internals")]
pub mod copy;
#[cfg(not(feature = "internals"))]
mod copy;
mod driver;
mod engine;
mod proto;
mod scheduler;
#[cfg(feature = "internals")]
pub mod sys;
#[cfg(not(feature = "internals"))]
mod sys;
mod vns;
#[cfg(feature = "internals")]
pub mod wire;
#[cfg(not(feature = "internals"))]
mod wire;

pub use driver::ChannelStats;
pub use engine::control;
pub use engine::readiness::ReadinessObserver;
/// How many waits polled before sleeping, and how many of them found their event so.
#[cfg(feature = "internals")]
pub use engine::waiter::poll_counts;
pub use engine::waiter::set_poll_before_sleep;
pub use engine::{
    AppDemotion, Config, Engine, EngineStats, Isolation, PeerChannelStats, SocketStats,
    WorkerThread,
};
pub use scheduler::Policy;
pub use sys::{enter_netns, ThreadPolicy};
pub use vns::poller::Poller;
/// Serving channels from a program's own waits: for the interposition library.
#[cfg(feature = "internals")]
pub use vns::serve::{ServeSet, ThreadWake};
pub use vns::socket::{flush_sends, is_unanswered_open, Listener, Readiness, VSocket};
pub use wire::Class;

/// The channel port a program's engine listens on by default under `netchannel run`
/// (`--port`): one per host (network namespace), shared by the host's programs.
pub const DEFAULT_CHANNEL_PORT: u16 = 7450;
