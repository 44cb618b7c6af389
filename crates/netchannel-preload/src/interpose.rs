//! The interposed C ABI functions and the bookkeeping behind them (the crate doc says how
//! carried connections work). The one module of this crate where `unsafe` is allowed: it is
//! made of C entry points and raw libc calls.

use std::cell::Cell;
use std::collections::HashMap;
use std::ffi::c_int;
use std::io::{self, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd};
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;
use std::path::Path;
use std::time::{Duration, Instant};

use libc::{sockaddr, socklen_t};
use netchannel::{Config, Engine, VSocket};

use crate::relay;

/// Highest fd number tracked; above it sockets are left to kernel TCP (counted).
const MAX_FD: usize = 65536;
/// The fd is a carried connection (getpeername reports the real peer).
const CARRIED: u8 = 1;
/// The fd is a listening socket with an engine `Listener` beside it.
const LISTENING: u8 = 2;

static FLAGS: [AtomicU8; MAX_FD] = [const { AtomicU8::new(0) }; MAX_FD];

fn flag(fd: c_int) -> u8 {
    if fd >= 0 && (fd as usize) < MAX_FD {
        FLAGS[fd as usize].load(Ordering::Acquire)
    } else {
        0
    }
}

fn set_flag(fd: c_int, v: u8) {
    if fd >= 0 && (fd as usize) < MAX_FD {
        FLAGS[fd as usize].store(v, Ordering::Release);
    }
}

// ---------------------------------------------------------------------------------------------
// The real libc functions, resolved once at load time (dlsym is not signal-safe, so the hot
// path only loads a pointer).

struct Real {
    connect: AtomicUsize,
    listen: AtomicUsize,
    accept: AtomicUsize,
    accept4: AtomicUsize,
    getpeername: AtomicUsize,
    close: AtomicUsize,
    dup2: AtomicUsize,
    dup3: AtomicUsize,
}

static REAL: Real = Real {
    connect: AtomicUsize::new(0),
    listen: AtomicUsize::new(0),
    accept: AtomicUsize::new(0),
    accept4: AtomicUsize::new(0),
    getpeername: AtomicUsize::new(0),
    close: AtomicUsize::new(0),
    dup2: AtomicUsize::new(0),
    dup3: AtomicUsize::new(0),
};

fn resolve(slot: &AtomicUsize, name: &'static [u8]) -> usize {
    let p = slot.load(Ordering::Relaxed);
    if p != 0 {
        return p;
    }
    // SAFETY: `name` is a NUL-terminated literal; RTLD_NEXT finds libc's definition behind us.
    let p = unsafe { libc::dlsym(libc::RTLD_NEXT, name.as_ptr().cast()) } as usize;
    slot.store(p, Ordering::Relaxed);
    p
}

macro_rules! real {
    ($field:ident, $ty:ty) => {{
        let p = resolve(&REAL.$field, concat!(stringify!($field), "\0").as_bytes());
        // SAFETY: the pointer is libc's definition of this very symbol, whose C signature is $ty;
        // dlsym cannot fail for these symbols in a process linked against libc.
        unsafe { std::mem::transmute::<usize, $ty>(p) }
    }};
}

type ConnectFn = unsafe extern "C" fn(c_int, *const sockaddr, socklen_t) -> c_int;
type ListenFn = unsafe extern "C" fn(c_int, c_int) -> c_int;
type AcceptFn = unsafe extern "C" fn(c_int, *mut sockaddr, *mut socklen_t) -> c_int;
type Accept4Fn = unsafe extern "C" fn(c_int, *mut sockaddr, *mut socklen_t, c_int) -> c_int;
type CloseFn = unsafe extern "C" fn(c_int) -> c_int;
type Dup2Fn = unsafe extern "C" fn(c_int, c_int) -> c_int;
type Dup3Fn = unsafe extern "C" fn(c_int, c_int, c_int) -> c_int;

/// The process that loaded the library. A forked child (Redis' BGSAVE) has none of the
/// engine's or relays' threads, and any lock may have been held at fork time, so a child never
/// touches that state: its inherited fds are plain kernel sockets to it, its new connections
/// go over kernel TCP.
static OWNER_PID: AtomicU32 = AtomicU32::new(0);

fn in_owner() -> bool {
    // SAFETY: getpid has no preconditions.
    OWNER_PID.load(Ordering::Relaxed) == unsafe { libc::getpid() } as u32
}

extern "C" fn init() {
    // SAFETY: getpid has no preconditions.
    OWNER_PID.store(unsafe { libc::getpid() } as u32, Ordering::Relaxed);
    resolve(&REAL.connect, b"connect\0");
    resolve(&REAL.listen, b"listen\0");
    resolve(&REAL.accept, b"accept\0");
    resolve(&REAL.accept4, b"accept4\0");
    resolve(&REAL.getpeername, b"getpeername\0");
    resolve(&REAL.close, b"close\0");
    resolve(&REAL.dup2, b"dup2\0");
    resolve(&REAL.dup3, b"dup3\0");
    // SAFETY: registering a plain extern "C" fn with no arguments.
    unsafe { libc::atexit(at_exit) };
}

/// io_uring instances the process holds: a socket driven through one bypasses the socket
/// calls this library interposes, so its bytes go over kernel TCP.
fn io_uring_rings() -> usize {
    let Ok(dir) = std::fs::read_dir("/proc/self/fd") else { return 0 };
    dir.filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter(|target| target.to_string_lossy().contains("io_uring"))
        .count()
}

extern "C" fn at_exit() {
    let _ = std::panic::catch_unwind(|| {
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
    });
}

#[used]
#[link_section = ".init_array"]
static INIT: extern "C" fn() = init;

// ---------------------------------------------------------------------------------------------
// Settings (from `netchannel run` through the environment).

struct Settings {
    channel_port: u16,
    /// Destination ports carried; empty: every TCP destination.
    ports: Vec<u16>,
    disabled: bool,
}

fn settings() -> &'static Settings {
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
        Settings { channel_port, ports, disabled }
    })
}

/// The channel port an engine listens on when its process listens (`netchannel run --port`).
pub const DEFAULT_CHANNEL_PORT: u16 = 7450;

// ---------------------------------------------------------------------------------------------
// Counters for `--stats`.

#[derive(Default)]
pub(crate) struct Counters {
    carried_connects: AtomicU64,
    carried_accepts: AtomicU64,
    kernel_no_engine: AtomicU64,
    kernel_not_selected: AtomicU64,
    kernel_other: AtomicU64,
    kernel_listen_only: AtomicU64,
    pub(crate) bytes_out: AtomicU64,
    pub(crate) bytes_in: AtomicU64,
    /// Interposed socket calls made by the library's or the engine's own threads: there should
    /// be none (both use raw system calls), and the stats line says so.
    reentered: AtomicU64,
}

pub(crate) static COUNTERS: Counters = Counters {
    carried_connects: AtomicU64::new(0),
    carried_accepts: AtomicU64::new(0),
    kernel_no_engine: AtomicU64::new(0),
    kernel_not_selected: AtomicU64::new(0),
    kernel_other: AtomicU64::new(0),
    kernel_listen_only: AtomicU64::new(0),
    bytes_out: AtomicU64::new(0),
    bytes_in: AtomicU64::new(0),
    reentered: AtomicU64::new(0),
};

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

fn print_stats(io_uring_rings: usize) {
    let c = &COUNTERS;
    let mut channels = 0;
    for e in [SERVER_ENGINE.get(), CLIENT_ENGINE.get()].into_iter().flatten().flatten() {
        if e.pid == std::process::id() {
            channels += e.engine.stats().channels.len();
        }
    }
    let line = format!(
        "netchannel: pid {} virtual sockets {} (connect {}, accept {}), kernel tcp {} \
             (no engine at peer {}, not selected {}, other {}), listeners without engine {}, \
             bytes out {} in {}, channels {}, io_uring instances {}, re-entered {}\n",
        std::process::id(),
        c.carried_connects.load(Ordering::Relaxed) + c.carried_accepts.load(Ordering::Relaxed),
        c.carried_connects.load(Ordering::Relaxed),
        c.carried_accepts.load(Ordering::Relaxed),
        c.kernel_no_engine.load(Ordering::Relaxed)
            + c.kernel_not_selected.load(Ordering::Relaxed)
            + c.kernel_other.load(Ordering::Relaxed),
        c.kernel_no_engine.load(Ordering::Relaxed),
        c.kernel_not_selected.load(Ordering::Relaxed),
        c.kernel_other.load(Ordering::Relaxed),
        c.kernel_listen_only.load(Ordering::Relaxed),
        c.bytes_out.load(Ordering::Relaxed),
        c.bytes_in.load(Ordering::Relaxed),
        channels,
        io_uring_rings,
        c.reentered.load(Ordering::Relaxed),
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
// that only connects uses an engine on an ephemeral loopback port (client engine). Engines
// belong to the process that created them: after fork the child has none of their threads,
// so a child leaves its new connections to kernel TCP.

struct ProcEngine {
    engine: Engine,
    pid: u32,
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

fn is_inside() -> bool {
    INSIDE.try_with(|c| c.get()).unwrap_or(true)
}

fn live(e: &Option<ProcEngine>) -> Option<&Engine> {
    e.as_ref().filter(|e| e.pid == std::process::id()).map(|e| &e.engine)
}

fn server_engine() -> Option<&'static Engine> {
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
                relay::loops();
                e
            })
            .ok()
            .map(|engine| ProcEngine { engine, pid: std::process::id() })
        })
    }))
}

fn client_engine() -> Option<&'static Engine> {
    if let Some(Some(e)) = SERVER_ENGINE.get() {
        if e.pid == std::process::id() {
            return Some(&e.engine);
        }
    }
    live(CLIENT_ENGINE.get_or_init(|| {
        inside(|| {
            fds_high(|| {
                let e = engine_config(Config::default().listen_addr)
                    .ok_or_else(|| io::Error::other("no key"))
                    .and_then(Engine::new);
                relay::loops();
                e
            })
            .ok()
            .map(|engine| ProcEngine { engine, pid: std::process::id() })
        })
    }))
}

// ---------------------------------------------------------------------------------------------
// Bookkeeping for carried fds (locked only on carried fds and on connect/listen/accept).

/// Real peer address of each carried fd, for getpeername.
static PEERS: Mutex<Option<HashMap<c_int, SocketAddr>>> = Mutex::new(None);
/// Virtual sockets waiting for the application's fd to reach the relay, by its local port.
static PENDING: Mutex<Option<HashMap<u16, VSocket>>> = Mutex::new(None);
/// Loopback connections made by an acceptor into the application's listener, by local port:
/// the virtual peer's address.
static INJECTED: Mutex<Option<HashMap<u16, SocketAddr>>> = Mutex::new(None);
static INJECTED_COUNT: AtomicUsize = AtomicUsize::new(0);
/// Stop flags of the acceptor threads beside listening fds.
static LISTENERS: Mutex<Option<HashMap<c_int, Arc<ListenEntry>>>> = Mutex::new(None);
/// Destinations refused by the peer's engine (none there, or no listener on that port): left
/// to kernel TCP without asking again for a while.
static NO_ENGINE: Mutex<Option<HashMap<SocketAddr, Instant>>> = Mutex::new(None);
/// Peer engines this process has connected to (their channels exist).
static CONTACTED: Mutex<Option<HashMap<SocketAddr, ()>>> = Mutex::new(None);
const NO_ENGINE_TTL: Duration = Duration::from_secs(2);
/// How long a connect waits for the peer's channel port to answer on first contact (the
/// engine's default is 3 s per channel): the program's own `connect` waits that long, even a
/// non-blocking one, before it falls back to kernel TCP.
const DIAL_TIMEOUT: Duration = Duration::from_millis(250);

/// The engine's configuration: `netchannel run`'s key file and budgets, from the environment.
/// `None` when a key file was asked for and cannot be read: then no engine starts (the
/// program's connections stay kernel TCP) rather than one that admits peers without the key.
fn engine_config(channel_listener: SocketAddr) -> Option<Config> {
    let mut c = Config::new(channel_listener);
    c.dial_timeout = DIAL_TIMEOUT;
    fn num<T: std::str::FromStr>(name: &str, into: &mut T) {
        if let Some(v) = std::env::var_os(name) {
            match v.to_str().and_then(|v| v.parse().ok()) {
                Some(n) => *into = n,
                None => eprintln!("netchannel: ignoring {name}={v:?}: not a number"),
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
    if let Some(path) = std::env::var_os("NETCHANNEL_PSK_FILE") {
        match std::fs::read(&path) {
            Ok(key) => c.psk = Some(key),
            Err(e) => {
                eprintln!(
                    "netchannel: cannot read the key file {}: {e}; connections stay kernel TCP",
                    Path::new(&path).display()
                );
                return None;
            }
        }
    }
    Some(c)
}

fn with<K, V, T>(m: &Mutex<Option<HashMap<K, V>>>, f: impl FnOnce(&mut HashMap<K, V>) -> T) -> T {
    let mut g = m.lock();
    f(g.get_or_insert_with(HashMap::new))
}

fn errno() -> c_int {
    io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

fn set_errno(e: c_int) {
    // SAFETY: __errno_location returns this thread's errno slot.
    unsafe { *libc::__errno_location() = e };
}

// ---------------------------------------------------------------------------------------------
// File descriptor numbers. Programs expect their own fds to be numbered from the lowest free
// slot, and some size tables by their connection count (wrk's event loop holds
// 10 + 3 x connections fds). The library's and engine's fds therefore live high: ours are moved
// above `fd_base()`, and while the engine creates its fds (start, first contact with a peer)
// the free slots below are held, so the kernel's lowest-free rule places them above too.

pub(crate) fn fd_base() -> c_int {
    static BASE: OnceLock<c_int> = OnceLock::new();
    *BASE.get_or_init(|| {
        // SAFETY: zeroed rlimit is valid; getrlimit writes it.
        let mut rl: libc::rlimit = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        let cur = if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut rl) } == 0 {
            rl.rlim_cur.min(1 << 20) as c_int
        } else {
            1024
        };
        (cur / 2).clamp(64, 8192)
    })
}

/// Moves one of our fds above `fd_base()` (close-on-exec), returning its new number.
fn relocate(fd: c_int) -> c_int {
    // SAFETY: duplicating an fd we own.
    let n = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, fd_base()) };
    if n < 0 {
        return fd;
    }
    let real = real!(close, CloseFn);
    // SAFETY: closing the original of an fd we own, now duplicated.
    unsafe { real(fd) };
    n
}

fn relocate_stream(s: TcpStream) -> TcpStream {
    use std::os::fd::IntoRawFd;
    // SAFETY: the relocated fd is the only owner of the socket.
    unsafe { TcpStream::from_raw_fd(relocate(s.into_raw_fd())) }
}

/// Runs `f` with the free fd slots below `fd_base()` held, so fds it creates land above.
fn fds_high<T>(f: impl FnOnce() -> T) -> T {
    let base = fd_base();
    // SAFETY: opening /dev/null read-only as a placeholder we close below.
    let ph = unsafe { libc::open(c"/dev/null".as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
    let mut held = Vec::new();
    if ph >= 0 && ph < base {
        loop {
            // SAFETY: duplicating our placeholder into the lowest free slot.
            let n = unsafe { libc::fcntl(ph, libc::F_DUPFD_CLOEXEC, 0) };
            if n < 0 {
                break;
            }
            held.push(n);
            if n >= base {
                break;
            }
        }
    }
    let out = f();
    let real = real!(close, CloseFn);
    for fd in held.into_iter().chain((ph >= 0).then_some(ph)) {
        // SAFETY: closing the placeholders opened above.
        unsafe { real(fd) };
    }
    out
}

// ---------------------------------------------------------------------------------------------
// sockaddr conversions.

/// # Safety
/// `addr` must point to `len` readable bytes (or be null).
unsafe fn to_socketaddr(addr: *const sockaddr, len: socklen_t) -> Option<SocketAddr> {
    if addr.is_null() {
        return None;
    }
    // SAFETY: caller guarantees `len` bytes; each cast is checked against the length first.
    unsafe {
        match (*addr).sa_family as c_int {
            libc::AF_INET if len as usize >= std::mem::size_of::<libc::sockaddr_in>() => {
                let a = &*(addr as *const libc::sockaddr_in);
                let ip = Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr));
                Some(SocketAddr::from((ip, u16::from_be(a.sin_port))))
            }
            libc::AF_INET6 if len as usize >= std::mem::size_of::<libc::sockaddr_in6>() => {
                let a = &*(addr as *const libc::sockaddr_in6);
                let ip = Ipv6Addr::from(a.sin6_addr.s6_addr);
                Some(SocketAddr::from((ip, u16::from_be(a.sin6_port))))
            }
            _ => None,
        }
    }
}

fn from_socketaddr(a: SocketAddr) -> (libc::sockaddr_storage, socklen_t) {
    // SAFETY: sockaddr_storage is plain data; all-zero is a valid value.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let len = match a {
        SocketAddr::V4(v4) => {
            // SAFETY: sockaddr_storage is large enough and aligned for sockaddr_in.
            let s = unsafe { &mut *(&mut ss as *mut _ as *mut libc::sockaddr_in) };
            s.sin_family = libc::AF_INET as _;
            s.sin_port = v4.port().to_be();
            s.sin_addr.s_addr = u32::from(*v4.ip()).to_be();
            std::mem::size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(v6) => {
            // SAFETY: sockaddr_storage is large enough and aligned for sockaddr_in6.
            let s = unsafe { &mut *(&mut ss as *mut _ as *mut libc::sockaddr_in6) };
            s.sin6_family = libc::AF_INET6 as _;
            s.sin6_port = v6.port().to_be();
            s.sin6_addr.s6_addr = v6.ip().octets();
            std::mem::size_of::<libc::sockaddr_in6>()
        }
    };
    (ss, len as socklen_t)
}

/// Copies `a` into a caller's (addr, len) result pair, truncating as the kernel does.
///
/// # Safety
/// `addr`/`len` as passed to accept/getpeername by the application.
unsafe fn write_addr(a: SocketAddr, addr: *mut sockaddr, len: *mut socklen_t) {
    if addr.is_null() || len.is_null() {
        return;
    }
    let (ss, l) = from_socketaddr(a);
    // SAFETY: the caller provides `*len` writable bytes at `addr`; we copy at most that many.
    unsafe {
        let n = (*len).min(l) as usize;
        std::ptr::copy_nonoverlapping(&ss as *const _ as *const u8, addr as *mut u8, n);
        *len = l;
    }
}

fn sock_local(fd: c_int) -> Option<SocketAddr> {
    // SAFETY: zeroed sockaddr_storage is valid; getsockname writes at most `len` bytes.
    unsafe {
        let mut ss: libc::sockaddr_storage = std::mem::zeroed();
        let mut len = std::mem::size_of::<libc::sockaddr_storage>() as socklen_t;
        if libc::getsockname(fd, &mut ss as *mut _ as *mut sockaddr, &mut len) != 0 {
            return None;
        }
        to_socketaddr(&ss as *const _ as *const sockaddr, len)
    }
}

fn sock_peer(fd: c_int) -> Option<SocketAddr> {
    let f = real!(getpeername, AcceptFn);
    // SAFETY: as in sock_local.
    unsafe {
        let mut ss: libc::sockaddr_storage = std::mem::zeroed();
        let mut len = std::mem::size_of::<libc::sockaddr_storage>() as socklen_t;
        if f(fd, &mut ss as *mut _ as *mut sockaddr, &mut len) != 0 {
            return None;
        }
        to_socketaddr(&ss as *const _ as *const sockaddr, len)
    }
}

fn is_stream(fd: c_int) -> bool {
    let mut ty: c_int = 0;
    let mut len = std::mem::size_of::<c_int>() as socklen_t;
    // SAFETY: SO_TYPE writes one c_int into `ty`.
    let rc = unsafe {
        libc::getsockopt(fd, libc::SOL_SOCKET, libc::SO_TYPE, &mut ty as *mut _ as *mut _, &mut len)
    };
    rc == 0 && ty == libc::SOCK_STREAM
}

fn loopback_of(a: &SocketAddr) -> IpAddr {
    match a {
        SocketAddr::V4(_) => IpAddr::V4(Ipv4Addr::LOCALHOST),
        SocketAddr::V6(v6) if v6.ip().to_ipv4_mapped().is_some() => {
            IpAddr::V6(Ipv4Addr::LOCALHOST.to_ipv6_mapped())
        }
        SocketAddr::V6(_) => IpAddr::V6(Ipv6Addr::LOCALHOST),
    }
}

/// `a` in the address family of `like` (v4-mapped IPv6 ⇔ IPv4), as the kernel would report a
/// peer to a socket of that family: programs such as Redis check `is loopback` on it.
fn same_family(a: SocketAddr, like: &SocketAddr) -> SocketAddr {
    match (a, like) {
        (SocketAddr::V6(v6), SocketAddr::V4(_)) => match v6.ip().to_ipv4_mapped() {
            Some(ip) => SocketAddr::from((ip, v6.port())),
            None => a,
        },
        (SocketAddr::V4(v4), SocketAddr::V6(_)) => {
            SocketAddr::from((v4.ip().to_ipv6_mapped(), v4.port()))
        }
        _ => a,
    }
}

// ---------------------------------------------------------------------------------------------
// The kernel end of a carried connection: reset like TCP when its virtual connection was.

pub(crate) fn reset(s: &TcpStream) {
    let l = libc::linger { l_onoff: 1, l_linger: 0 };
    // SAFETY: SO_LINGER takes a struct linger; the fd is ours.
    unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            &l as *const _ as *const _,
            std::mem::size_of::<libc::linger>() as socklen_t,
        );
    }
    let _ = s.shutdown(Shutdown::Read);
}

// ---------------------------------------------------------------------------------------------
// Relay listeners (one per address family), reached by the application's carried fds.

fn relay_addr(v6: bool) -> Option<SocketAddr> {
    static V4: OnceLock<Option<SocketAddr>> = OnceLock::new();
    static V6: OnceLock<Option<SocketAddr>> = OnceLock::new();
    let (cell, ip) = if v6 {
        (&V6, IpAddr::V6(Ipv6Addr::LOCALHOST))
    } else {
        (&V4, IpAddr::V4(Ipv4Addr::LOCALHOST))
    };
    *cell.get_or_init(|| {
        inside(|| {
            let l = netchannel::sys::tcp_listen(&SocketAddr::new(ip, 0)).ok()?;
            use std::os::fd::IntoRawFd;
            // SAFETY: the relocated fd is the only owner of the listening socket.
            let l = unsafe { TcpListener::from_raw_fd(relocate(l.into_raw_fd())) };
            let addr = l.local_addr().ok()?;
            std::thread::Builder::new()
                .name("nc-relay".into())
                .spawn(move || inside(|| relay_loop(l)))
                .ok()?;
            Some(addr)
        })
    })
}

fn relay_loop(l: TcpListener) {
    loop {
        let Ok(s) = netchannel::sys::tcp_accept(&l) else { continue };
        let Ok(peer) = s.peer_addr() else { continue };
        let s = relocate_stream(s);
        if let Some(vs) = with(&PENDING, |p| p.remove(&peer.port())) {
            relay::relay(s, vs);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// connect

/// # Safety
/// C ABI: `addr` points to `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn connect(fd: c_int, addr: *const sockaddr, len: socklen_t) -> c_int {
    let real = real!(connect, ConnectFn);
    if is_inside() {
        bump(&COUNTERS.reentered);
        // SAFETY: forwarding the caller's arguments unchanged.
        return unsafe { real(fd, addr, len) };
    }
    // SAFETY: the caller guarantees `len` bytes at `addr`.
    let dest = unsafe { to_socketaddr(addr, len) };
    let carried = std::panic::catch_unwind(|| dest.and_then(|d| try_carry(fd, d)));
    match carried {
        Ok(Some(rc)) => rc,
        // SAFETY: forwarding the caller's arguments unchanged.
        _ => unsafe { real(fd, addr, len) },
    }
}

/// Carries the connection when selected and an engine answers at the peer's host; returns the
/// connect result then, or None to leave the fd to kernel TCP.
fn try_carry(fd: c_int, dest: SocketAddr) -> Option<c_int> {
    let s = settings();
    if !in_owner() {
        bump(&COUNTERS.kernel_other);
        return None;
    }
    if s.disabled || !is_stream(fd) || dest.port() == 0 || dest.ip().is_unspecified() {
        return None;
    }
    if dest.port() == s.channel_port || (!s.ports.is_empty() && !s.ports.contains(&dest.port())) {
        bump(&COUNTERS.kernel_not_selected);
        return None;
    }
    if fd < 0 || fd as usize >= MAX_FD {
        bump(&COUNTERS.kernel_other);
        return None;
    }
    let host = dest.ip();
    if with(&NO_ENGINE, |m| m.get(&dest).is_some_and(|t| t.elapsed() < NO_ENGINE_TTL)) {
        bump(&COUNTERS.kernel_no_engine);
        return None;
    }
    let Some(engine) = client_engine() else {
        bump(&COUNTERS.kernel_other);
        return None;
    };
    let saved = errno();
    let engine_addr = SocketAddr::new(host, s.channel_port);
    // The first connect to a peer dials its channels in this thread.
    let first = !with(&CONTACTED, |m| m.contains_key(&engine_addr));
    let connect = || inside(|| engine.connect(engine_addr, dest.port()));
    let vs = match if first { fds_high(connect) } else { connect() } {
        Ok(vs) => {
            with(&CONTACTED, |m| m.insert(engine_addr, ()));
            vs
        }
        Err(e) => {
            match e.kind() {
                io::ErrorKind::ConnectionRefused => {
                    with(&NO_ENGINE, |m| m.insert(dest, Instant::now()));
                    bump(&COUNTERS.kernel_no_engine);
                }
                // Nothing answered at the channel port within `DIAL_TIMEOUT` (a host that
                // drops packets): not asked again for a while either, so that the program's
                // next connects there do not wait again.
                io::ErrorKind::TimedOut => {
                    with(&NO_ENGINE, |m| m.insert(dest, Instant::now()));
                    bump(&COUNTERS.kernel_other);
                }
                _ => bump(&COUNTERS.kernel_other),
            }
            set_errno(saved);
            return None;
        }
    };
    let local = sock_local(fd)?;
    let relay = relay_addr(local.is_ipv6())?;
    let mut local_port = local.port();
    if local_port == 0 {
        let (ss, l) = from_socketaddr(SocketAddr::new(loopback_of(&local), 0));
        // SAFETY: binding our own well-formed loopback address.
        if unsafe { libc::bind(fd, &ss as *const _ as *const sockaddr, l) } != 0 {
            bump(&COUNTERS.kernel_other);
            set_errno(saved);
            return None;
        }
        local_port = sock_local(fd)?.port();
    }
    let relay = if local.is_ipv6() && local.ip().to_string().starts_with("::ffff:") {
        relay_addr(false).map(|a| SocketAddr::new(loopback_of(&local), a.port())).unwrap_or(relay)
    } else {
        relay
    };
    with(&PENDING, |p| p.insert(local_port, vs));
    let (ss, l) = from_socketaddr(relay);
    let real = real!(connect, ConnectFn);
    set_errno(saved);
    // SAFETY: connecting the application's fd to our relay's loopback address.
    let rc = unsafe { real(fd, &ss as *const _ as *const sockaddr, l) };
    let e = errno();
    if rc == 0 || e == libc::EINPROGRESS {
        with(&PEERS, |m| m.insert(fd, dest));
        set_flag(fd, CARRIED);
        bump(&COUNTERS.carried_connects);
    } else {
        with(&PENDING, |p| p.remove(&local_port));
    }
    set_errno(e);
    Some(rc)
}

// ---------------------------------------------------------------------------------------------
// listen

/// # Safety
/// C ABI.
#[no_mangle]
pub unsafe extern "C" fn listen(fd: c_int, backlog: c_int) -> c_int {
    let real = real!(listen, ListenFn);
    // SAFETY: forwarding the caller's arguments unchanged.
    let rc = unsafe { real(fd, backlog) };
    if is_inside() {
        bump(&COUNTERS.reentered);
        return rc;
    }
    if rc != 0 || flag(fd) == LISTENING {
        return rc;
    }
    let saved = errno();
    let _ = std::panic::catch_unwind(|| add_engine_listener(fd));
    set_errno(saved);
    rc
}

fn add_engine_listener(fd: c_int) {
    let s = settings();
    if !in_owner() {
        bump(&COUNTERS.kernel_listen_only);
        return;
    }
    if s.disabled || !is_stream(fd) || fd < 0 || fd as usize >= MAX_FD {
        return;
    }
    let Some(local) = sock_local(fd) else { return };
    if local.port() == s.channel_port || (!s.ports.is_empty() && !s.ports.contains(&local.port())) {
        return;
    }
    let Some(engine) = server_engine() else {
        bump(&COUNTERS.kernel_listen_only);
        return;
    };
    let Ok(listener) = inside(|| engine.listen(local.port())) else {
        bump(&COUNTERS.kernel_listen_only);
        return;
    };
    let target = if local.ip().is_unspecified() {
        SocketAddr::new(loopback_of(&local), local.port())
    } else {
        local
    };
    // The acceptor thread holds the listener only weakly, so that closing the application's
    // listening fd frees the virtual port at once (iperf3 closes and re-creates its listener
    // on the same port between control and data connections).
    listener.set_nonblocking(true);
    let Ok(ready) = listener.readiness_fd() else {
        bump(&COUNTERS.kernel_listen_only);
        return;
    };
    // SAFETY: plain eventfd creation; the fd is owned by the entry below.
    let stop = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
    if stop < 0 {
        bump(&COUNTERS.kernel_listen_only);
        return;
    }
    let listener = Arc::new(listener);
    let weak = Arc::downgrade(&listener);
    let entry = Arc::new(ListenEntry { listener: Mutex::new(Some(listener)), stop });
    with(&LISTENERS, |m| m.insert(fd, entry.clone()));
    set_flag(fd, LISTENING);
    let _ = std::thread::Builder::new()
        .name("nc-listen".into())
        .spawn(move || inside(|| acceptor(entry, weak, ready, target)));
}

struct ListenEntry {
    listener: Mutex<Option<Arc<netchannel::Listener>>>,
    /// eventfd signalled when the application closes its listening fd.
    stop: c_int,
}

impl ListenEntry {
    fn close(&self) {
        let one: u64 = 1;
        // SAFETY: writing 8 bytes to our own eventfd.
        unsafe { libc::write(self.stop, &one as *const u64 as *const _, 8) };
        drop(self.listener.lock().take());
    }
}

impl Drop for ListenEntry {
    fn drop(&mut self) {
        let real = real!(close, CloseFn);
        // SAFETY: closing our own eventfd, once.
        unsafe { real(self.stop) };
    }
}

fn acceptor(
    entry: Arc<ListenEntry>,
    weak: std::sync::Weak<netchannel::Listener>,
    ready: c_int,
    target: SocketAddr,
) {
    loop {
        let mut fds = [
            libc::pollfd { fd: entry.stop, events: libc::POLLIN, revents: 0 },
            libc::pollfd { fd: ready, events: libc::POLLIN, revents: 0 },
        ];
        // The listener (and its readiness fd) lives as long as `weak` upgrades; check the stop
        // flag first, so a closed listener's fd number is never waited on alone.
        {
            let Some(l) = weak.upgrade() else { return };
            l.clear_readiness();
            loop {
                match l.accept() {
                    Ok(vs) => {
                        let peer = same_family(vs.peer_engine_addr(), &target);
                        if let Some(s) = inject(target, peer) {
                            bump(&COUNTERS.carried_accepts);
                            relay::relay(s, vs);
                        }
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(_) => return,
                }
            }
        }
        // SAFETY: two valid pollfd entries.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, 1000) };
        if n > 0 && fds[0].revents != 0 {
            return;
        }
    }
}

/// Connects a loopback TCP socket into the application's listener on behalf of a virtual
/// client, registered before the connect so that the application's accept always finds it.
fn inject(target: SocketAddr, peer: SocketAddr) -> Option<TcpStream> {
    let family = if target.is_ipv4() { libc::AF_INET } else { libc::AF_INET6 };
    // SAFETY: plain socket creation; the fd is owned by the TcpStream below or closed.
    let fd = unsafe { libc::socket(family, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return None;
    }
    let fd = relocate(fd);
    // SAFETY: `fd` is a fresh socket we own.
    let stream = unsafe { TcpStream::from_raw_fd(fd) };
    let (ss, l) = from_socketaddr(SocketAddr::new(target.ip(), 0));
    // SAFETY: binding our own well-formed address.
    if unsafe { libc::bind(fd, &ss as *const _ as *const sockaddr, l) } != 0 {
        return None;
    }
    let port = sock_local(fd)?.port();
    with(&INJECTED, |m| m.insert(port, peer));
    INJECTED_COUNT.fetch_add(1, Ordering::AcqRel);
    let (ss, l) = from_socketaddr(target);
    let real = real!(connect, ConnectFn);
    // SAFETY: connecting our own socket to the application's listening address.
    if unsafe { real(fd, &ss as *const _ as *const sockaddr, l) } != 0 {
        if with(&INJECTED, |m| m.remove(&port)).is_some() {
            INJECTED_COUNT.fetch_sub(1, Ordering::AcqRel);
        }
        return None;
    }
    Some(stream)
}

// ---------------------------------------------------------------------------------------------
// accept, accept4

/// Marks an accepted fd that is one of our injected connections and reports the virtual
/// peer's address instead of the loopback one.
///
/// # Safety
/// `addr`/`len` as passed by the application.
unsafe fn accepted(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) {
    if fd < 0 || INJECTED_COUNT.load(Ordering::Acquire) == 0 || !in_owner() {
        return;
    }
    let Some(peer) = sock_peer(fd) else { return };
    if !peer.ip().is_loopback() && peer.ip().to_string() != "::ffff:127.0.0.1" {
        return;
    }
    let Some(real_peer) = with(&INJECTED, |m| m.remove(&peer.port())) else { return };
    INJECTED_COUNT.fetch_sub(1, Ordering::AcqRel);
    with(&PEERS, |m| m.insert(fd, real_peer));
    set_flag(fd, CARRIED);
    // SAFETY: forwarded from the caller.
    unsafe { write_addr(real_peer, addr, len) };
}

/// # Safety
/// C ABI.
#[no_mangle]
pub unsafe extern "C" fn accept(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int {
    let real = real!(accept, AcceptFn);
    // SAFETY: forwarding the caller's arguments unchanged.
    let nfd = unsafe { real(fd, addr, len) };
    // SAFETY: the caller's arguments, as the real accept just used them.
    unsafe { after_accept(fd, nfd, addr, len) }
}

/// What `accept` and `accept4` do after the real call: a connection accepted on a listener
/// that also takes netchannel clients may be one of them (its peer address is rewritten).
/// errno is kept as the real call left it.
///
/// # Safety
/// `addr` and `len` as the caller passed them to the real accept.
unsafe fn after_accept(fd: c_int, nfd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int {
    if is_inside() {
        bump(&COUNTERS.reentered);
    }
    if nfd >= 0 && flag(fd) == LISTENING {
        let saved = errno();
        // SAFETY: forwarded from the caller.
        let _ = std::panic::catch_unwind(|| unsafe { accepted(nfd, addr, len) });
        set_errno(saved);
    }
    nfd
}

/// # Safety
/// C ABI.
#[no_mangle]
pub unsafe extern "C" fn accept4(
    fd: c_int,
    addr: *mut sockaddr,
    len: *mut socklen_t,
    flags: c_int,
) -> c_int {
    let real = real!(accept4, Accept4Fn);
    // SAFETY: forwarding the caller's arguments unchanged.
    let nfd = unsafe { real(fd, addr, len, flags) };
    // SAFETY: the caller's arguments, as the real accept4 just used them.
    unsafe { after_accept(fd, nfd, addr, len) }
}

// ---------------------------------------------------------------------------------------------
// getpeername, close, dup2, dup3

/// # Safety
/// C ABI.
#[no_mangle]
pub unsafe extern "C" fn getpeername(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int {
    let real = real!(getpeername, AcceptFn);
    // SAFETY: forwarding the caller's arguments unchanged.
    let rc = unsafe { real(fd, addr, len) };
    if rc == 0 && flag(fd) == CARRIED && in_owner() {
        if let Ok(Some(p)) = std::panic::catch_unwind(|| with(&PEERS, |m| m.get(&fd).copied())) {
            // SAFETY: forwarded from the caller.
            unsafe { write_addr(p, addr, len) };
        }
    }
    rc
}

fn forget(fd: c_int) {
    match flag(fd) {
        0 => {}
        _ if !in_owner() => set_flag(fd, 0),
        CARRIED => {
            set_flag(fd, 0);
            let _ = std::panic::catch_unwind(|| with(&PEERS, |m| m.remove(&fd)));
        }
        _ => {
            set_flag(fd, 0);
            let _ = std::panic::catch_unwind(|| {
                if let Some(entry) = with(&LISTENERS, |m| m.remove(&fd)) {
                    entry.close();
                }
            });
        }
    }
}

/// # Safety
/// C ABI.
#[no_mangle]
pub unsafe extern "C" fn close(fd: c_int) -> c_int {
    forget(fd);
    let real = real!(close, CloseFn);
    // SAFETY: forwarding the caller's argument unchanged.
    unsafe { real(fd) }
}

/// # Safety
/// C ABI.
#[no_mangle]
pub unsafe extern "C" fn dup2(old: c_int, new: c_int) -> c_int {
    if old != new {
        forget(new);
    }
    let real = real!(dup2, Dup2Fn);
    // SAFETY: forwarding the caller's arguments unchanged.
    unsafe { real(old, new) }
}

/// # Safety
/// C ABI.
#[no_mangle]
pub unsafe extern "C" fn dup3(old: c_int, new: c_int, flags: c_int) -> c_int {
    if old != new {
        forget(new);
    }
    let real = real!(dup3, Dup3Fn);
    // SAFETY: forwarding the caller's arguments unchanged.
    unsafe { real(old, new, flags) }
}
