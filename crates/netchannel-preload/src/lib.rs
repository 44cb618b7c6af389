//! LD_PRELOAD interposition library: an unmodified, dynamically linked program's TCP
//! connections are carried by a netchannel engine inside the process.
//!
//! The direct path (docs/ARCHITECTURE.md, "Interposition layer"): a carried `connect` opens a
//! virtual socket to the peer engine and puts a placeholder under the program's fd number, an
//! AF_UNIX socket whose readiness mirrors the virtual socket's (`carried`). The program's data
//! calls on it (`read`, `write`, `send*`, `recv*`, `sendfile`, `splice`, ...) are served from
//! the virtual socket in the calling thread; its waits (`epoll_*`, `poll`, `select`) wait on the
//! kernel object, and serve the connections' channels while they wait (`waits`). A carried
//! `listen` also listens in the engine, and announces each virtual connection through the
//! program's own kernel listener (`listen`). Connections the program's own process cannot serve
//! (accepted by a forked worker, inherited through fork, exec or `SCM_RIGHTS`) are served by a
//! relay loop (`relay`, `inherit`), as is every connection with `netchannel run --path relay`.
//!
//! Module map: `interpose` (the C entry points, the only unsafe code), `table` (which fds are
//! ours), `connect`, `listen`, `carried` (a direct-path connection and its placeholder),
//! `sockopt`, `waits`, `elide` (readiness a wait reports itself), `hints` (destinations left to
//! kernel TCP, shared by a host's processes), `inherit`, `reaper`, `relay`, `process` (settings, engines, counters).

#![deny(unsafe_code)]
#![warn(clippy::undocumented_unsafe_blocks)]

mod carried;
mod connect;
mod elide;
mod forklock;
mod hints;
mod inherit;
#[allow(unsafe_code)]
mod interpose;
mod listen;
mod process;
mod reaper;
mod relay;
mod sockopt;
mod table;
mod waits;

pub use process::DEFAULT_CHANNEL_PORT;
