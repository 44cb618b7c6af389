//! The engine's control endpoint: a Unix socket through which `netchannel stat` (or any tool)
//! reads a snapshot of the engine as one JSON document, then the connection closes.
//!
//! Only the same user and root reach it: it lives in a directory of this user's, mode 0700,
//! the socket is mode 0600, and the peer's credentials (`SO_PEERCRED`) are checked as well.
//! The socket is removed when the engine shuts down and when the process exits (`atexit`);
//! one left behind by a killed process is removed by a server engine's acceptor that finds its
//! process gone, a second after it starts ([`remove_stale`]), or by `netchannel stat` when
//! nothing listens on it any more. The thread that answers starts with the first reader
//! (`Endpoint::start`).

use std::collections::BTreeMap;
use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use parking_lot::Mutex;
use rustix::event::{PollFd, PollFlags};
use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
use serde_json::{json, Value};

use super::EngineCtx;
use crate::sys::EventFd;
use crate::wire::handshake::{engine_key, same_engine};

/// Overrides the directory of control endpoints, for engines and `netchannel stat` alike.
pub const CONTROL_DIR_ENV: &str = "NETCHANNEL_CONTROL_DIR";

/// Endpoint file names end with this.
pub const ENDPOINT_SUFFIX: &str = ".sock";

/// The directory this user's engines put their endpoints in (see `Config::control_dir`).
pub fn default_control_dir() -> PathBuf {
    if let Some(d) = std::env::var_os(CONTROL_DIR_ENV) {
        return d.into();
    }
    let uid = rustix::process::getuid();
    if uid.is_root() {
        return "/run/netchannel".into();
    }
    if let Some(d) = std::env::var_os("XDG_RUNTIME_DIR") {
        return PathBuf::from(d).join("netchannel");
    }
    PathBuf::from(format!("/tmp/netchannel-{}", uid.as_raw()))
}

/// Creates `dir` (mode 0700) if missing and checks that it is a directory of this user's that
/// nobody else can write to (else another user could put an endpoint of theirs there).
pub fn private_dir(dir: &Path) -> io::Result<()> {
    match std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e),
    }
    let md = std::fs::symlink_metadata(dir)?;
    if !md.is_dir() {
        return Err(io::Error::other(format!("{} is not a directory", dir.display())));
    }
    if md.uid() != rustix::process::getuid().as_raw() {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!("{} belongs to another user", dir.display()),
        ));
    }
    if md.mode() & 0o077 != 0 {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
    }
    Ok(())
}

/// The process id an endpoint's file name starts with (`PID-ENGINEID.sock`).
pub fn endpoint_pid(path: &Path) -> Option<u32> {
    let name = path.file_name()?.to_str()?.strip_suffix(ENDPOINT_SUFFIX)?;
    name.split_once('-')?.0.parse().ok()
}

/// Whether process `pid` runs (a zombie does not: it will never answer).
pub fn process_alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|st| {
        // "pid (comm) S ...": the state follows the last ')' (comm may hold one).
        st.rsplit_once(')').is_some_and(|(_, rest)| !rest.trim_start().starts_with('Z'))
    })
}

/// Removes the endpoints in `dir` whose process is gone; returns how many.
pub fn remove_stale(dir: &Path) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else { return 0 };
    let mut removed = 0;
    for e in entries.flatten() {
        let path = e.path();
        let Some(pid) = endpoint_pid(&path) else { continue };
        if !process_alive(pid) && std::fs::remove_file(&path).is_ok() {
            removed += 1;
        }
    }
    removed
}

/// Endpoints of this process, removed at exit if their engines were not shut down.
static AT_EXIT: Mutex<Vec<(u32, PathBuf)>> = Mutex::new(Vec::new());

// Never unwinds: remove_file reports errors as values, try_lock never panics.
extern "C" fn remove_at_exit() {
    let pid = std::process::id();
    // try_lock: an exit while another thread held the list must not hang the process.
    if let Some(list) = AT_EXIT.try_lock() {
        // A forked child inherits the list: it removes only endpoints of its own.
        for (_, path) in list.iter().filter(|(p, _)| *p == pid) {
            let _ = std::fs::remove_file(path);
        }
    }
}

fn remove_at_exit_too(path: &Path) {
    static REGISTER: std::sync::Once = std::sync::Once::new();
    REGISTER.call_once(|| {
        crate::sys::at_exit(remove_at_exit);
    });
    AT_EXIT.lock().push((std::process::id(), path.to_path_buf()));
}

/// A running control endpoint.
pub(crate) struct Endpoint {
    path: PathBuf,
    stop: Arc<EventFd>,
    /// Whether it was stopped, and its thread once a reader came (`start`).
    thread: Arc<Mutex<(bool, Option<JoinHandle<()>>)>>,
}

impl Endpoint {
    /// Binds the endpoint in `dir`. Its thread starts with the first reader: until then a
    /// worker watches the socket (`Worker::when_readable`), so that an engine nobody reads (a
    /// short-lived client's) costs no thread for it.
    pub fn start(ctx: &Arc<EngineCtx>, dir: &Path) -> io::Result<Endpoint> {
        private_dir(dir)?;
        let path = dir.join(format!("{}-{:016x}{ENDPOINT_SUFFIX}", std::process::id(), ctx.id));
        let fd = rustix::net::socket_with(
            AddressFamily::UNIX,
            SocketType::STREAM,
            SocketFlags::CLOEXEC,
            None,
        )?;
        let fd = crate::sys::raised(fd);
        // Bound and listening under a temporary name first: an endpoint that exists under its
        // real name always answers or is stale (`netchannel stat` removes refusing ones).
        let tmp = path.with_extension("new");
        let _ = std::fs::remove_file(&tmp);
        rustix::net::bind(&fd, &SocketAddrUnix::new(&tmp)?)?;
        std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o600))?;
        rustix::net::listen(&fd, 16)?;
        std::fs::rename(&tmp, &path)?;
        remove_at_exit_too(&path);
        let stop = Arc::new(EventFd::new()?);
        let thread = Arc::new(Mutex::new((false, None)));
        let (stop2, thread2, engine) = (stop.clone(), thread.clone(), Arc::downgrade(ctx));
        let start = move |fd: OwnedFd| {
            let mut slot = thread2.lock();
            if slot.0 {
                return; // stopped meanwhile
            }
            let spawned = std::thread::Builder::new().name("nc-control".into()).spawn(move || {
                if let Some(ctx) = engine.upgrade() {
                    serve(&ctx, &fd, &stop2);
                }
            });
            slot.1 = spawned.ok();
        };
        ctx.workers[0].when_readable(fd, Box::new(start));
        Ok(Endpoint { path, stop, thread })
    }

    /// Where it listens.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Stops the thread and removes the socket.
    pub fn stop(&mut self) {
        // Under the thread's lock: a reader arriving now starts no thread.
        let thread = {
            let mut slot = self.thread.lock();
            self.stop.notify();
            slot.0 = true;
            slot.1.take()
        };
        if let Some(t) = thread {
            let _ = t.join();
        }
        let _ = std::fs::remove_file(&self.path);
        AT_EXIT.lock().retain(|(_, p)| p != &self.path);
    }
}

fn serve(ctx: &EngineCtx, listener: &OwnedFd, stop: &EventFd) {
    let me = rustix::process::getuid();
    loop {
        let mut fds = [PollFd::new(listener, PollFlags::IN), PollFd::new(stop, PollFlags::IN)];
        match rustix::event::poll(&mut fds, None) {
            Ok(_) => {}
            Err(rustix::io::Errno::INTR) => continue,
            Err(_) => return,
        }
        if !fds[1].revents().is_empty() {
            return;
        }
        let Ok(conn) = rustix::net::accept_with(listener, SocketFlags::CLOEXEC) else { continue };
        let allowed = rustix::net::sockopt::socket_peercred(&conn)
            .is_ok_and(|c| c.uid == me || c.uid.is_root());
        if !allowed {
            continue; // dropped: closed without a word
        }
        // A reader that stops reading cannot hold the endpoint for long.
        let _ = rustix::net::sockopt::set_socket_timeout(
            &conn,
            rustix::net::sockopt::Timeout::Send,
            Some(Duration::from_secs(1)),
        );
        let mut doc = snapshot(ctx).to_string();
        doc.push('\n');
        // rustix: raw system calls, which an interposition library in the process never sees.
        let mut rest = doc.as_bytes();
        while !rest.is_empty() {
            match rustix::net::send(&conn, rest, rustix::net::SendFlags::NOSIGNAL) {
                Ok(n) => rest = &rest[n..],
                Err(rustix::io::Errno::INTR) => {}
                Err(_) => break,
            }
        }
    }
}

/// What `snapshot` gathers of one peer engine.
#[derive(Default)]
struct PeerEntry {
    engine: Option<String>,
    dialed_out: bool,
    dialed_in: bool,
    sessions: Vec<u64>,
    addrs: Vec<std::net::SocketAddr>,
    channels: Vec<Value>,
}

/// The process's command name (`/proc/self/comm`).
fn command() -> String {
    std::fs::read_to_string("/proc/self/comm").map(|s| s.trim_end().to_string()).unwrap_or_default()
}

fn class_name(c: crate::Class) -> &'static str {
    match c {
        crate::Class::Latency => "latency",
        crate::Class::Throughput => "throughput",
    }
}

/// The engine as `netchannel stat` shows it (format documented in docs/ARCHITECTURE.md,
/// "Observing engines").
pub(crate) fn snapshot(ctx: &EngineCtx) -> Value {
    let st = ctx.stats();
    let cfg = &ctx.config;
    // One entry per peer engine: the sessions of a peer's shards (each its own session,
    // dialed from its own address when the peer dialed) are one peer.
    let mut peers: BTreeMap<String, PeerEntry> = BTreeMap::new();
    for c in &st.channels {
        let engine = (c.peer_engine != 0).then(|| format!("{:016x}", engine_key(c.peer_engine)));
        let key = engine
            .clone()
            .unwrap_or_else(|| c.peer_addr.map_or_else(|| "?".to_string(), |a| a.to_string()));
        let peer = peers.entry(key).or_default();
        peer.engine = engine;
        if same_engine(c.session, st.engine_id) {
            peer.dialed_out = true;
        } else {
            peer.dialed_in = true;
        }
        if !peer.sessions.contains(&c.session) {
            peer.sessions.push(c.session);
        }
        if let Some(a) = c.peer_addr {
            if !peer.addrs.contains(&a) {
                peer.addrs.push(a);
            }
        }
        let ch = &c.channel;
        peer.channels.push(json!({
            "session": format!("{:016x}", c.session),
            "index": ch.index,
            "incarnation": ch.incarnation,
            "class": class_name(ch.class),
            "state": if ch.open { "open" } else { "closed" },
            "tx_bytes": ch.tx_bytes,
            "rx_bytes": ch.rx_bytes,
            "queued_bytes": ch.queued_bytes,
            "rtt_us": ch.tcp.map(|t| t.rtt_us),
            "tcp_retransmits": ch.tcp.map(|t| t.total_retrans),
            "tcp_retransmitted_bytes": ch.tcp.map(|t| t.bytes_retrans),
            "congestion": ch.congestion,
        }));
    }
    let peers: Vec<Value> = peers
        .into_values()
        .map(|p| {
            // A peer that dialed in from several shards did so from several ports.
            let addr = match &p.addrs[..] {
                [] => "?".to_string(),
                [one] => one.to_string(),
                [first, ..] if p.addrs.iter().all(|a| a.ip() == first.ip()) => {
                    first.ip().to_string()
                }
                many => many.iter().map(|a| a.to_string()).collect::<Vec<_>>().join(","),
            };
            json!({
                "addr": addr,
                "engine": p.engine,
                "dialed": match (p.dialed_out, p.dialed_in) {
                    (true, true) => "both",
                    (true, false) => "out",
                    _ => "in",
                },
                "sessions": p.sessions.len(),
                "channels": p.channels,
            })
        })
        .collect();
    let sockets: Vec<Value> = st
        .sockets
        .iter()
        .map(|s| {
            json!({
                "id": s.id,
                "port": s.port,
                "class": class_name(s.class),
                "state": s.state,
                "peer_engine": s.peer_engine_addr.to_string(),
                "local": s.app_addrs.map(|a| a[0].to_string()),
                "peer": s.app_addrs.map(|a| a[1].to_string()),
                "bytes_sent": s.bytes_sent,
                "bytes_received": s.bytes_received,
                "unread_bytes": s.unread_bytes,
                "unsent_bytes": s.unsent_bytes,
                "unacked_bytes": s.unacked_bytes,
                "send_window": s.send_window,
            })
        })
        .collect();
    let refusals: BTreeMap<&str, u64> = st.refusals.iter().map(|(k, v)| (k.as_str(), *v)).collect();
    let closed: Vec<Value> = st
        .closed_channels
        .iter()
        .rev()
        .take(8)
        .map(|c| {
            json!({
                "peer": c.peer_addr.map(|a| a.to_string()),
                "index": c.channel.index,
                "reason": c.channel.close_reason,
            })
        })
        .collect();
    json!({
        "version": 1,
        "pid": std::process::id(),
        "command": command(),
        "engine_id": format!("{:016x}", st.engine_id),
        "channel_addr": st.local_addr.map(|a| a.to_string()),
        "psk": cfg.psk.is_some(),
        "isolating": st.isolating,
        "peers": peers,
        "sockets": sockets,
        "refusals": refusals,
        "recent_closed_channels": closed,
        "counters": {
            "retransmitted_bytes": st.retransmitted_bytes,
            "redialed_channels": st.redialed_channels,
            "protocol_errors": st.protocol_errors,
            "handshake_failures": st.handshake_failures,
            "stale_frames": st.stale_frames,
        },
        "budgets": {
            "sessions": [st.sessions, cfg.max_sessions],
            "channels": [st.channels_open, st.max_channels_total],
            "sockets": st.open_sockets,
            "max_sockets_per_peer": cfg.max_streams,
            "held_bytes": [st.held_bytes, cfg.max_buffered],
            "granted_bytes": [st.rx_granted, cfg.max_buffered],
            "unsent_bytes": st.unsent_bytes,
            "retained_bytes": st.retained_bytes,
            "max_peer_buffered": cfg.max_peer_buffered,
            "max_send_buffered": cfg.max_send_buffered,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoint_names_carry_their_pid() {
        assert_eq!(endpoint_pid(Path::new("/x/123-00000000deadbeef.sock")), Some(123));
        assert_eq!(endpoint_pid(Path::new("/x/abc-1.sock")), None);
        assert_eq!(endpoint_pid(Path::new("/x/123-1.txt")), None);
    }

    #[test]
    fn stale_endpoints_of_dead_processes_are_removed_and_live_ones_kept() {
        let dir = std::env::temp_dir().join(format!("nc-control-test-{}", std::process::id()));
        private_dir(&dir).unwrap();
        // pid_max is at most 2^22: this pid never exists.
        let dead = dir.join(format!("{}-1{ENDPOINT_SUFFIX}", (1u32 << 22) + 5));
        let live = dir.join(format!("{}-2{ENDPOINT_SUFFIX}", std::process::id()));
        std::fs::write(&dead, b"").unwrap();
        std::fs::write(&live, b"").unwrap();
        assert_eq!(remove_stale(&dir), 1);
        assert!(!dead.exists() && live.exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_directory_others_can_write_to_is_made_private() {
        let dir = std::env::temp_dir().join(format!("nc-control-perm-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        private_dir(&dir).unwrap();
        assert_eq!(std::fs::metadata(&dir).unwrap().mode() & 0o777, 0o700);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
