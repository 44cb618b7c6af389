//! The process's side of the library: settings from `netchannel run`, the engines, the
//! counters behind `--stats`, which process owns what after `fork`, and where the library's own
//! fds live.

/// A warning on stderr that never panics (`netchannel::sys::warn`).
macro_rules! warn {
    ($($t:tt)*) => { netchannel::sys::warn(format_args!($($t)*)) };
}

use std::cell::Cell;
use std::ffi::c_int;
use std::io::{self, Write};
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;
use std::sync::atomic::{AtomicI32, AtomicU32, AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

use netchannel::{Config, Engine};

// ---------------------------------------------------------------------------------------------
// Which process this is. Engines, relays and carried connections belong to the process that
// made them: after `fork` the child has none of their threads, and any of their locks may have
// been held at fork time, so a child never touches that state; it reaches a connection it
// inherited through its owner's relay instead.

static PID: AtomicU32 = AtomicU32::new(0);

/// This process's id, kept without a system call (set at load and in a forked child).
pub(crate) fn pid() -> u32 {
    PID.load(Ordering::Relaxed)
}

/// Why the program must not run: `netchannel run` asked (its pid, which the program keeps
/// across its exec, in `NETCHANNEL_REFUSE_LIBURING`; no other process) and the loader mapped
/// liburing, whose io_uring sockets would bypass the calls interposed here.
pub(crate) fn liburing_refusal() -> Option<String> {
    let asked = std::env::var("NETCHANNEL_REFUSE_LIBURING").ok()?;
    if asked.parse::<u32>().ok()? != std::process::id() {
        return None;
    }
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    let liburing = maps
        .lines()
        .filter_map(|l| l.rsplit('/').next())
        .any(|file| file.starts_with("liburing.so") || file.starts_with("liburing-"));
    if !liburing {
        return None;
    }
    let program = std::env::current_exe().map(|p| p.display().to_string()).unwrap_or_default();
    Some(format!(
        "netchannel: cannot carry {program}: it is linked with liburing, and sockets it drives \
         through io_uring bypass the socket calls netchannel interposes (they would silently use \
         kernel TCP); --allow-io-uring runs it anyway\n"
    ))
}

/// Called at load time and in a forked child.
pub(crate) fn set_pid() {
    PID.store(std::process::id(), Ordering::Relaxed);
}

/// Whether the process created the engines it sees (not a forked child of that process).
pub(crate) fn in_owner() -> bool {
    engines().all(|e| e.pid == pid())
}

// ---------------------------------------------------------------------------------------------
// Settings (from `netchannel run` through the environment).

/// How carried connections reach the program.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum DataPath {
    /// The program's fd is served from the virtual socket in the calling thread.
    Direct,
    /// The program's fd is a kernel socket to a relay loop (`netchannel run --path relay`).
    Relay,
}

pub(crate) struct Settings {
    pub channel_port: u16,
    /// Destination ports carried; empty: every TCP destination.
    pub ports: Vec<u16>,
    pub disabled: bool,
    pub path: DataPath,
    /// Keep relaying the connections of listeners whose connections forked processes serve,
    /// instead of asking clients for kernel TCP (`NETCHANNEL_FORKED=relay`).
    pub relay_forked: bool,
    /// Also ask public addresses' hosts for an engine (`NETCHANNEL_CARRY_PUBLIC=1`); by
    /// default only those not public or on one of this host's networks are
    /// (`connect::worth_asking`).
    pub carry_public: bool,
}

pub(crate) fn settings() -> &'static Settings {
    static S: OnceLock<Settings> = OnceLock::new();
    S.get_or_init(|| {
        let channel_port = std::env::var("NETCHANNEL_PORT")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(DEFAULT_CHANNEL_PORT);
        let ports = std::env::var("NETCHANNEL_PORTS")
            .map(|v| v.split(',').filter_map(|p| p.trim().parse().ok()).collect())
            .unwrap_or_default();
        let disabled = std::env::var("NETCHANNEL_DISABLE").is_ok_and(|v| v == "1");
        let path = match std::env::var("NETCHANNEL_PATH").as_deref() {
            Ok("relay") => DataPath::Relay,
            _ => DataPath::Direct,
        };
        let relay_forked = std::env::var("NETCHANNEL_FORKED").is_ok_and(|v| v == "relay");
        let carry_public = std::env::var("NETCHANNEL_CARRY_PUBLIC").is_ok_and(|v| v == "1");
        Settings { channel_port, ports, disabled, path, relay_forked, carry_public }
    })
}

/// The channel port an engine listens on when its process listens (`netchannel run --port`).
pub use netchannel::DEFAULT_CHANNEL_PORT;

// ---------------------------------------------------------------------------------------------
// Counters for `--stats`.

#[derive(Default)]
pub(crate) struct Counters {
    pub carried_connects: AtomicU64,
    /// Carried non-blocking connects that returned `EINPROGRESS` (to a destination carried
    /// before) and completed in the background.
    pub connects_in_progress: AtomicU64,
    pub carried_accepts: AtomicU64,
    /// Connections the program's own thread serves from the virtual socket (direct path).
    pub direct: AtomicU64,
    /// Connections served through a relay loop: accepted by another process of the program
    /// (a forked worker), taken over after fork, exec or `SCM_RIGHTS`, or all of them with
    /// `--path relay`.
    pub relayed_accepted_elsewhere: AtomicU64,
    pub relayed_inherited: AtomicU64,
    pub relayed_by_choice: AtomicU64,
    pub kernel_no_engine: AtomicU64,
    /// Connects that went over kernel TCP because the peer's listener asked for it: forked
    /// processes serve its connections (`FLAG_KERNEL_PREFERRED`).
    pub kernel_forked_server: AtomicU64,
    pub kernel_not_selected: AtomicU64,
    pub kernel_other: AtomicU64,
    pub kernel_listen_only: AtomicU64,
    pub bytes_out: AtomicU64,
    pub bytes_in: AtomicU64,
    /// Interposed socket calls made by the library's or the engine's own threads: there should
    /// be none (both use raw system calls), and the stats line says so.
    pub reentered: AtomicU64,
    /// Tokens written into placeholders, and readable edges their waits reported instead
    /// (`elide`).
    pub readiness_tokens: AtomicU64,
    pub readiness_elided: AtomicU64,
    /// Calls that came through libc's `syscall()` (libuv closes fds so) and went to the
    /// library's wrapper of the same call: those on its fds, and every accept and epoll_create.
    pub raw_syscalls: AtomicU64,
    /// Fd numbers the kernel gave out again while the tables still held them: closed where
    /// the library could not see (the connection ended then).
    pub closed_unseen: AtomicU64,
}

pub(crate) static COUNTERS: Counters = Counters {
    carried_connects: AtomicU64::new(0),
    connects_in_progress: AtomicU64::new(0),
    carried_accepts: AtomicU64::new(0),
    direct: AtomicU64::new(0),
    relayed_accepted_elsewhere: AtomicU64::new(0),
    relayed_inherited: AtomicU64::new(0),
    relayed_by_choice: AtomicU64::new(0),
    kernel_no_engine: AtomicU64::new(0),
    kernel_forked_server: AtomicU64::new(0),
    kernel_not_selected: AtomicU64::new(0),
    kernel_other: AtomicU64::new(0),
    kernel_listen_only: AtomicU64::new(0),
    bytes_out: AtomicU64::new(0),
    bytes_in: AtomicU64::new(0),
    reentered: AtomicU64::new(0),
    readiness_tokens: AtomicU64::new(0),
    readiness_elided: AtomicU64::new(0),
    raw_syscalls: AtomicU64::new(0),
    closed_unseen: AtomicU64::new(0),
};

pub(crate) fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

/// io_uring instances the process has mapped: a socket driven through one bypasses the socket
/// calls this library interposes, so its bytes go over kernel TCP. A ring is used through its
/// mapped queues, so `/proc/self/maps` shows each (by inode), even one whose fd was closed or
/// registered away; one read, where a look at every fd took a `readlink` each (a short-lived
/// client with an engine holds about 30). Not seen: a ring made with `IORING_SETUP_NO_MMAP`
/// (its queues in the program's own memory).
pub(crate) fn io_uring_rings() -> usize {
    use std::io::Read;
    // Room up front: /proc files report no size, and reading them from an empty buffer takes
    // a dozen small reads.
    let mut maps = String::with_capacity(64 * 1024);
    let read = std::fs::File::open("/proc/self/maps").and_then(|mut f| f.read_to_string(&mut maps));
    if read.is_err() {
        return 0;
    }
    rings_in_maps(&maps)
}

fn rings_in_maps(maps: &str) -> usize {
    let mut inodes: Vec<&str> = maps
        .lines()
        .filter(|l| l.ends_with("[io_uring]"))
        .filter_map(|l| l.split_ascii_whitespace().nth(4))
        .collect();
    inodes.sort_unstable();
    inodes.dedup();
    inodes.len()
}

/// The thread running the process's exit (`drain_engines`), 0 before.
static EXITING: AtomicI32 = AtomicI32::new(0);

/// A write on a carried connection by another thread while the process exits waits for the
/// exit to end the thread, as the kernel's `exit_group` ends it: the exit has shut the
/// connections' write halves, and the write would otherwise fail with `EPIPE` (and raise
/// `SIGPIPE`, whose default action would change the process's exit status).
pub(crate) fn hold_if_exiting() {
    let exiting = EXITING.load(Ordering::Acquire);
    if exiting != 0 && exiting != rustix::thread::gettid().as_raw_nonzero().get() {
        loop {
            std::thread::sleep(Duration::from_secs(3600));
        }
    }
}

/// How long an exiting process waits for a peer that takes none of its bytes, and at most
/// (see `drain_engines`).
const EXIT_STALL: Duration = Duration::from_secs(2);
const EXIT_CAP: Duration = Duration::from_secs(30);

/// At exit, the connections still open end (`carried::end_all_at_exit`), and what they queued
/// reaches the peer engines before the engine's threads and channels go with the process. A
/// kernel's exit leaves its sockets' queues to the kernel, which delivers them after the
/// process (an orphaned socket): without this, the bytes a program wrote just before exiting
/// (still in a stream's send buffer, or in a channel the exit resets because it holds unread
/// bytes) were lost, and the peer read a reset. A peer that takes nothing for `EXIT_STALL` ends
/// the wait (the kernel would go on trying for minutes); so does `EXIT_CAP`. Only the process
/// that owns an engine waits, not a forked or vforked child (asked of the kernel: a vfork child
/// shares the cached pid), and not from a program's signal handler: there `_exit` must stay
/// async-signal-safe, and an `exit` (not async-signal-safe, but common) must not wait on locks
/// the interrupted code may hold.
pub(crate) fn drain_engines() {
    if crate::interpose::in_signal_handler() {
        return;
    }
    let me = rustix::process::getpid().as_raw_nonzero().get() as u32;
    if me != pid() || !engines().any(|e| e.pid == me) {
        // A forked child owns no connection (it has no engine of its own): nothing to end.
        return;
    }
    EXITING.store(rustix::thread::gettid().as_raw_nonzero().get(), Ordering::Release);
    let taken = crate::relay::taken_over();
    if taken > 0 {
        // Kernel TCP would leave them to the other process; here the engine and the relay
        // that carry them are this process's. Said, so that the other process's reset is
        // not a mystery.
        warn!(
            "netchannel: pid {me} exits while another process uses {taken} connection(s) it \
             carries (taken over after fork, exec or SCM_RIGHTS): they end with it, where \
             kernel TCP would keep them (docs/ARCHITECTURE.md, limits)"
        );
    }
    crate::carried::end_all_at_exit();
    for e in engines() {
        if e.pid == me {
            e.engine.drain(EXIT_STALL, EXIT_CAP);
        }
    }
}

pub(crate) fn at_exit() {
    drain_engines();
    let rings = io_uring_rings();
    if rings > 0 {
        let _ = writeln!(
            io::stderr(),
            "netchannel: pid {} holds {rings} io_uring instance(s): sockets it drives through \
             io_uring are not carried (they use kernel TCP); see docs/ARCHITECTURE.md, limits",
            std::process::id()
        );
    }
    if std::env::var_os("NETCHANNEL_STATS").is_some() {
        print_stats(rings);
    }
}

fn print_stats(io_uring_rings: usize) {
    let c = &COUNTERS;
    let get = |x: &AtomicU64| x.load(Ordering::Relaxed);
    let (mut channels, mut own_engines) = (0, 0);
    for e in engines() {
        if e.pid == pid() {
            channels += e.engine.stats().channels.len();
            own_engines += 1;
        }
    }
    let counted = [
        &c.carried_connects,
        &c.carried_accepts,
        &c.relayed_accepted_elsewhere,
        &c.relayed_inherited,
        &c.relayed_by_choice,
        &c.kernel_no_engine,
        &c.kernel_forked_server,
        &c.kernel_not_selected,
        &c.kernel_other,
        &c.kernel_listen_only,
        &c.reentered,
    ];
    if own_engines == 0 && io_uring_rings == 0 && counted.into_iter().all(|x| get(x) == 0) {
        // A process that never touched TCP (a shell, a helper a wrapper script ran) has
        // nothing to report: a line of zeros per such process buried the ones that matter.
        return;
    }
    let relayed =
        get(&c.relayed_accepted_elsewhere) + get(&c.relayed_inherited) + get(&c.relayed_by_choice);
    let polls = netchannel::poll_counts();
    let line = format!(
        "netchannel: pid {} virtual sockets {} (connect {}, of which in progress {}, accept {}), direct {}, relayed {} \
             (accepted by another process {}, inherited {}, by choice {}), kernel tcp {} \
             (no engine at peer {}, forked server {}, not selected {}, other {}), listeners without engine {}, \
             bytes out {} in {}, channels {}, io_uring instances {}, re-entered {}, readiness tokens {} \
             elided {}, raw syscalls {}, closed unseen {}, polled before sleeping {} (found {})\n",
        std::process::id(),
        get(&c.carried_connects) + get(&c.carried_accepts),
        get(&c.carried_connects),
        get(&c.connects_in_progress),
        get(&c.carried_accepts),
        get(&c.direct),
        relayed,
        get(&c.relayed_accepted_elsewhere),
        get(&c.relayed_inherited),
        get(&c.relayed_by_choice),
        get(&c.kernel_no_engine)
            + get(&c.kernel_forked_server)
            + get(&c.kernel_not_selected)
            + get(&c.kernel_other),
        get(&c.kernel_no_engine),
        get(&c.kernel_forked_server),
        get(&c.kernel_not_selected),
        get(&c.kernel_other),
        get(&c.kernel_listen_only),
        get(&c.bytes_out),
        get(&c.bytes_in),
        channels,
        io_uring_rings,
        get(&c.reentered),
        get(&c.readiness_tokens),
        get(&c.readiness_elided),
        get(&c.raw_syscalls),
        get(&c.closed_unseen),
        polls.0,
        polls.1,
    );
    match std::env::var("NETCHANNEL_STATS").as_deref() {
        Ok("stderr") | Ok("") | Err(_) => {
            let _ = io::stderr().write_all(line.as_bytes());
        }
        Ok(path) => {
            if let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(path) {
                let _ = f.write_all(line.as_bytes());
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Engines. A process that listens owns the host's channel port (server engine); a process
// that only connects uses an engine on an ephemeral loopback port (client engine).

pub(crate) struct ProcEngine {
    pub engine: Engine,
    pub pid: u32,
}

static SERVER_ENGINE: OnceLock<Option<ProcEngine>> = OnceLock::new();
static CLIENT_ENGINE: OnceLock<Option<ProcEngine>> = OnceLock::new();

thread_local! {
    /// Set while this library itself makes socket calls (engine set-up, relay connections), so
    /// they are never carried.
    static INSIDE: Cell<bool> = const { Cell::new(false) };
}

pub(crate) fn inside<T>(f: impl FnOnce() -> T) -> T {
    struct Reset(bool);
    impl Drop for Reset {
        fn drop(&mut self) {
            INSIDE.with(|c| c.set(self.0));
        }
    }
    let _r = Reset(INSIDE.with(|c| c.replace(true)));
    f()
}

pub(crate) fn is_inside() -> bool {
    INSIDE.try_with(|c| c.get()).unwrap_or(true)
}

/// The engines this process's memory holds: its own, or a parent's (a forked child's copy).
fn engines() -> impl Iterator<Item = &'static ProcEngine> {
    [SERVER_ENGINE.get(), CLIENT_ENGINE.get()].into_iter().flatten().flatten()
}

/// An engine this process started, if any (none is started here).
pub(crate) fn started_engine() -> Option<&'static Engine> {
    engines().find(|e| e.pid == pid()).map(|e| &e.engine)
}

fn live(e: &Option<ProcEngine>) -> Option<&Engine> {
    e.as_ref().filter(|e| e.pid == pid()).map(|e| &e.engine)
}

pub(crate) fn server_engine() -> Option<&'static Engine> {
    live(SERVER_ENGINE.get_or_init(|| {
        let port = settings().channel_port;
        inside(|| {
            let v6 = SocketAddr::from((Ipv6Addr::UNSPECIFIED, port));
            let v4 = SocketAddr::from((Ipv4Addr::UNSPECIFIED, port));
            fds_high(|| {
                let new = |a| {
                    let c = engine_config(a).ok_or_else(|| io::Error::other("no key"))?;
                    Engine::new(c)
                };
                let e = new(v6).or_else(|_| new(v4));
                if e.as_ref().is_err_and(|e| e.kind() == io::ErrorKind::AddrInUse) {
                    // One process per host owns the channel port: say so once, rather than
                    // leave the user to find "listeners without engine" in the stats.
                    warn!(
                        "netchannel: pid {}: channel port {port} is taken (another program under \
                         netchannel run on this host owns it; `netchannel stat` lists the \
                         engines): this program's listeners stay on kernel TCP",
                        pid()
                    );
                }
                e
            })
            .ok()
            .map(|engine| ProcEngine { engine, pid: pid() })
        })
    }))
}

pub(crate) fn client_engine() -> Option<&'static Engine> {
    if let Some(Some(e)) = SERVER_ENGINE.get() {
        if e.pid == pid() {
            return Some(&e.engine);
        }
    }
    live(CLIENT_ENGINE.get_or_init(|| {
        inside(|| {
            fds_high(|| {
                engine_config(Config::default().listen_addr)
                    .map(|c| Config { accept_channels: false, ..c })
                    .ok_or_else(|| io::Error::other("no key"))
                    .and_then(Engine::new)
            })
            .ok()
            .map(|engine| ProcEngine { engine, pid: pid() })
        })
    }))
}

/// How long a connect waits for the peer's channel port to answer on first contact (the
/// engine's default is 3 s per channel): the program's own `connect` waits that long, even a
/// non-blocking one, before it falls back to kernel TCP.
pub(crate) const DIAL_TIMEOUT: Duration = Duration::from_millis(250);

/// Session shards per peer for a program (`netchannel run --session-shards`'s default).
const PROGRAM_SESSION_SHARDS: usize = 16;

/// The engine's configuration: `netchannel run`'s key file and budgets, from the environment.
/// `None` when a key file was asked for and cannot be read: then no engine starts (the
/// program's connections stay kernel TCP) rather than one that admits peers without the key.
fn engine_config(channel_listener: SocketAddr) -> Option<Config> {
    let mut c = Config::new(channel_listener);
    c.dial_timeout = DIAL_TIMEOUT;
    // A peer engine that refuses at its limits is not waited for either: the connect goes over
    // kernel TCP, whose listener in the peer program waits as TCP does.
    c.busy_dial_timeout = DIAL_TIMEOUT;
    // How long an open may stay unanswered (the peer's listener backlog full): as long as TCP
    // sends SYNs (tcp_syn_retries 6: 127 s), for a connect that returned EINPROGRESS. A
    // connect that waits gives up sooner and goes over kernel TCP (`connect::OPEN_WAIT`).
    c.connect_timeout = Duration::from_secs(127);
    fn num<T: std::str::FromStr>(name: &str, into: &mut T) {
        if let Some(v) = std::env::var_os(name) {
            match v.to_str().and_then(|v| v.parse().ok()) {
                Some(n) => *into = n,
                None => warn!("netchannel: ignoring {name}={v:?}: not a number"),
            }
        }
    }
    num("NETCHANNEL_MAX_SESSIONS", &mut c.max_sessions);
    num("NETCHANNEL_MAX_PEER_BUFFERED", &mut c.max_peer_buffered);
    num("NETCHANNEL_MAX_BUFFERED", &mut c.max_buffered);
    num("NETCHANNEL_MAX_SEND_BUFFERED", &mut c.max_send_buffered);
    num("NETCHANNEL_MAX_CHANNELS_TOTAL", &mut c.max_channels_total);
    num("NETCHANNEL_MAX_CHANNELS_PER_SOURCE", &mut c.max_channels_per_source);
    num("NETCHANNEL_MAX_STREAMS", &mut c.max_streams);
    num("NETCHANNEL_CHANNELS", &mut c.channels);
    num("NETCHANNEL_REST_CHANNELS_RATE", &mut c.rest_channels_rate);
    num("NETCHANNEL_NOTSENT_LOWAT", &mut c.notsent_lowat);
    // A program's threads are mostly a connection's each (memcslap's, iperf3's): a session
    // per thread, as a socket per connection, took 8-13% more keys and Gbit/s than one per core
    // (docs/BENCHMARKS.md, "Sixteen session shards"). The Rust API keeps one per core.
    c.session_shards = PROGRAM_SESSION_SHARDS;
    num("NETCHANNEL_SESSION_SHARDS", &mut c.session_shards);
    let mut poll_us = u64::MAX;
    num("NETCHANNEL_POLL_US", &mut poll_us);
    if poll_us != u64::MAX {
        // The process's waits, whichever engine they are for: this process has one.
        netchannel::set_poll_before_sleep(Duration::from_micros(poll_us.min(10_000)));
    }
    let mut ack_timeout_ms = c.ack_timeout.as_millis() as u64;
    num("NETCHANNEL_ACK_TIMEOUT_MS", &mut ack_timeout_ms);
    c.ack_timeout = Duration::from_millis(ack_timeout_ms.max(1));
    if let Some(v) = std::env::var_os("NETCHANNEL_APP_DEMOTION") {
        match v.to_str() {
            Some("sticky") => c.app_demotion = netchannel::AppDemotion::Sticky,
            Some("per-call") => c.app_demotion = netchannel::AppDemotion::PerCall,
            Some("off") => c.app_demotion = netchannel::AppDemotion::Off,
            _ => {
                warn!("netchannel: ignoring NETCHANNEL_APP_DEMOTION={v:?}: sticky, per-call or off")
            }
        }
    }
    if let Some(v) = std::env::var_os("NETCHANNEL_WORKERS_YIELD") {
        match v.to_str() {
            Some("1") => c.workers_yield = true,
            Some("0") => c.workers_yield = false,
            _ => warn!("netchannel: ignoring NETCHANNEL_WORKERS_YIELD={v:?}: 0 or 1"),
        }
    }
    c.max_channels = c.max_channels.max(c.channels);
    if let Some(path) = std::env::var_os("NETCHANNEL_PSK_FILE") {
        match std::fs::read(&path) {
            Ok(key) => c.psk = Some(key),
            Err(e) => {
                warn!(
                    "netchannel: cannot read the key file {}: {e}; connections stay kernel TCP",
                    Path::new(&path).display()
                );
                return None;
            }
        }
    }
    Some(c)
}

// ---------------------------------------------------------------------------------------------
// File descriptor numbers. Programs expect their own fds to be numbered from the lowest free
// slot, and some size tables by their connection count (wrk's event loop holds
// 10 + 3 x connections fds). The library's and engine's fds therefore live high: each is moved
// above `fd_base()` as soon as it is made (`relocate`, the engine's `keep_fds_above`).

pub(crate) fn fd_base() -> c_int {
    static BASE: OnceLock<c_int> = OnceLock::new();
    *BASE.get_or_init(|| {
        let cur = rustix::process::getrlimit(rustix::process::Resource::Nofile)
            .current
            .map_or(1 << 20, |c| c.min(1 << 20)) as c_int;
        // The program's own soft limit, below a soft limit `netchannel run` raised to make room
        // above it; not if the limit has been lowered since (room for at least 64 of ours).
        let above_program = std::env::var("NETCHANNEL_FD_BASE")
            .ok()
            .and_then(|v| v.parse::<c_int>().ok())
            .filter(|&b| b >= 64 && b.saturating_add(64) <= cur);
        above_program.unwrap_or((cur / 2).clamp(64, 8192))
    })
}

/// One of our fds moved above `fd_base()` (close-on-exec).
pub(crate) fn relocate(fd: OwnedFd) -> OwnedFd {
    let fd = rustix::io::fcntl_dupfd_cloexec(fd.as_fd(), fd_base()).unwrap_or(fd);
    // Kept open by a range the program closes (`close_range`, `closefrom`).
    netchannel::sys::note_own_fd(std::os::fd::AsRawFd::as_raw_fd(&fd));
    fd
}

/// Runs `f` (which starts an engine, or makes its first contact with a peer) with the engine
/// keeping its fds above `fd_base()` (`keep_fds_above`): each fd it makes, in this thread or its
/// own, moves there at once. The free slots below are not held meanwhile (they were once): a
/// thread of the program that made an fd then got a number above them all, and wrk counts a
/// connection whose fd is beyond its event loop's size as a connect error. A number the engine
/// takes for an instant only shifts a concurrent fd of the program by one.
pub(crate) fn fds_high<T>(f: impl FnOnce() -> T) -> T {
    netchannel::sys::keep_fds_above(fd_base());
    f()
}

#[cfg(test)]
mod tests {
    use super::rings_in_maps;

    #[test]
    fn rings_are_counted_once_each_by_inode() {
        let maps = "\
55d3ce000000-55d3ce001000 r--p 00000000 fe:00 1234 /usr/bin/redis-cli
7f35ac640000-7f35ac641000 rw-s 00000000 00:10 29841938                   anon_inode:[io_uring]
7f35ac641000-7f35ac642000 rw-s 10000000 00:10 29841938                   anon_inode:[io_uring]
7f35ac650000-7f35ac651000 rw-s 00000000 00:10 29841999                   anon_inode:[io_uring]
7f35ac660000-7f35ac661000 rw-p 00000000 00:00 0                          [heap]
7f35ac670000-7f35ac671000 rw-p 00000000 fe:00 77 /tmp/not[io_uring]x
";
        assert_eq!(rings_in_maps(maps), 2);
        assert_eq!(rings_in_maps(""), 0);
    }
}
