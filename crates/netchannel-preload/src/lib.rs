//! LD_PRELOAD interposition library: an unmodified, dynamically linked program's TCP
//! connections are carried by a netchannel engine inside the process.
//!
//! Scheme ("relay", see docs/ARCHITECTURE.md, "Interposition layer"): the application's fd
//! stays a real kernel TCP socket for its whole life. A carried `connect` opens a virtual
//! socket to the peer engine and then connects the application's fd to a loopback relay
//! listener owned by this library; relay loops (`relay.rs`: a few threads, each an epoll set
//! over many connections) move bytes between the relay end and the `VSocket`. A carried
//! `listen` also opens an engine `Listener` on the same port; each virtual connection it
//! accepts is turned into a loopback connection to the application's own listening socket, so
//! `accept`, `poll`, `select` and `epoll` see it like any kernel client.
//! Because every fd is a kernel socket, all data-path calls (read, write, *msg, poll, select,
//! epoll in every mode, fcntl, ioctl, dup, fork, close-on-exec) keep exact kernel semantics and
//! are not interposed at all. Interposed: `connect`, `listen`, `accept`, `accept4`,
//! `getpeername`, `close`, `dup2`, `dup3`.
//!
//! Signal safety: a call on an fd that is not carried costs one atomic load in `FLAGS` and
//! goes straight to libc (no lock, no allocation). `connect`/`listen`/`accept` are not
//! async-signal-safe in POSIX anyway.

#![deny(unsafe_code)]
#![warn(clippy::undocumented_unsafe_blocks)]

#[allow(unsafe_code)]
mod interpose;
mod relay;

pub use interpose::DEFAULT_CHANNEL_PORT;
