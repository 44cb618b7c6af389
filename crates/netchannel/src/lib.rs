//! NetChannel in user space: virtual sockets with stream semantics, multiplexed over many kernel
//! TCP connections ("channels") by an engine embedded in the application process.
//!
//! Layers (see docs/ARCHITECTURE.md):
//! - [`wire`]: handshake and frame codec (pure).
//! - [`proto`]: the sans-IO protocol core: streams, credit, ordering, retention, recovery.
//! - [`scheduler`]: which stream's chunk each channel carries next.
//! - [`driver`]: channels (the queues of a multi-queue "device"), framing, the TCP transport.
//! - [`engine`]: threads and execution model (workers, run to completion).
//! - [`vns`]: virtual sockets, the application API.
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

pub mod driver;
pub mod engine;
pub mod proto;
pub mod scheduler;
pub mod sys;
pub mod vns;
pub mod wire;

pub use engine::WorkerThread;
pub use engine::{Config, Engine, EngineStats, Isolation, PeerChannelStats, SocketStats};
pub use scheduler::Policy;
pub use sys::{enter_netns, ThreadPolicy};
pub use vns::poller::Poller;
pub use vns::socket::{flush_sends, Listener, VSocket};
pub use wire::Class;
