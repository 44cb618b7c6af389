//! `connect`: a TCP connection to a host whose programs run under netchannel is opened as a
//! virtual socket, and the program's fd becomes its placeholder (direct path) or a loopback
//! connection to a relay loop (`--path relay`).

use std::collections::{HashMap, HashSet};
use std::ffi::c_int;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::fd::{AsFd, BorrowedFd};
use std::time::{Duration, Instant};

use netchannel::VSocket;

use crate::carried::{errno_of, Carried};
use crate::forklock::ForkMutex;
use crate::hints;
use crate::interpose::{dup_onto, real_connect};
use crate::process::{bump, client_engine, in_owner, inside, settings, DataPath, COUNTERS};
use crate::table;

/// Destinations the peer's engine refused (none there, or no listener on that port), that
/// did not answer at the channel port, or whose listener asked for kernel TCP (forked
/// processes serve its connections: `kernel_preferred`): left to kernel TCP without asking
/// again until `retry_at`. A refusal costs a round trip, and is asked again after 2 s. Silence costs the
/// connect `DIAL_TIMEOUT` (250 ms), so the wait after it doubles with each silence in a row up
/// to a minute: a host that drops the channel port stalls one connect a minute, not one every
/// 2 s. At most `NO_ENGINE_MAX` destinations are kept (expired ones go first, then all): a
/// program that reaches millions of kernel-TCP destinations keeps a bounded map, and pays at
/// worst a dial more. What a process learns here is shared with the host's other processes
/// (`hints`): a new process starts from it, where each one used to learn it again.
pub(crate) static NO_ENGINE: ForkMutex<NoEngineMap> = ForkMutex::new(NoEngineMap(None));
const NO_ENGINE_TTL: Duration = Duration::from_secs(2);
const SILENT_MOST: Duration = Duration::from_secs(60);
const NO_ENGINE_MAX: usize = 4096;

struct NoEngine {
    retry_at: Instant,
    wait: Duration,
    /// The last try found silence (not a refusal).
    silent: bool,
    /// The peer's listener asked for kernel TCP (forked processes serve it): not a refusal.
    forked: bool,
}

/// The destinations left to kernel TCP for now (see `NO_ENGINE`).
pub(crate) struct NoEngineMap(Option<HashMap<SocketAddr, NoEngine>>);

/// What this process knows of a destination (`NoEngineMap::known`).
#[derive(Debug, PartialEq, Eq)]
enum Known {
    /// Ask its engine.
    Ask,
    /// Leave it to kernel TCP for now (`forked`: its listener asked for that).
    Skip { forked: bool },
    /// Nothing: the host's hints may know.
    Nothing,
}

impl NoEngineMap {
    /// What is known here of `dest` at `now` (under its own key, and its host's silence).
    fn known(&self, dest: &SocketAddr, now: Instant) -> Known {
        let mut known = Known::Nothing;
        for k in [*dest, silence_key(dest)] {
            if let Some(e) = self.0.as_ref().and_then(|m| m.get(&k)) {
                if now < e.retry_at {
                    return Known::Skip { forked: e.forked };
                }
                known = Known::Ask;
            }
        }
        known
    }

    /// Whether a connect to `dest` asks the engine at `now`: `Err(forked)` if not, `forked`
    /// when the peer's listener asked for kernel TCP.
    #[cfg(test)]
    fn asks(&self, dest: &SocketAddr, now: Instant) -> Result<(), bool> {
        match self.known(dest, now) {
            Known::Skip { forked } => Err(forked),
            _ => Ok(()),
        }
    }

    /// Takes over what another process of the host learnt about `key`.
    fn adopt(&mut self, key: SocketAddr, h: hints::Hint, now: Instant) -> bool {
        let (silent, forked) = (h.kind == hints::Kind::Silent, h.kind == hints::Kind::Forked);
        let e = NoEngine { retry_at: now + h.remaining, wait: h.wait, silent, forked };
        self.insert(key, e, now);
        forked
    }

    fn insert(&mut self, dest: SocketAddr, e: NoEngine, now: Instant) {
        let m = self.0.get_or_insert_with(HashMap::new);
        if m.len() >= NO_ENGINE_MAX && !m.contains_key(&dest) {
            m.retain(|_, e| e.retry_at > now);
            if m.len() >= NO_ENGINE_MAX {
                m.clear();
            }
        }
        m.insert(dest, e);
    }

    /// `dest`'s engine refused, or (`silent`) nothing answered at its channel port.
    fn refused(&mut self, dest: SocketAddr, silent: bool, now: Instant) -> Learnt {
        self.leave_for(dest, silent, false, now)
    }

    /// `dest` goes over kernel TCP for a while: its engine refused, nothing answered at its
    /// channel port (`silent`), or its listener asked for it (`forked`). Returns what to tell
    /// the host's other processes (after the lock: `Learnt::share`).
    fn leave_for(&mut self, dest: SocketAddr, silent: bool, forked: bool, now: Instant) -> Learnt {
        let dest = if silent { silence_key(&dest) } else { dest };
        let wait = match self.0.as_ref().and_then(|m| m.get(&dest)) {
            Some(e) if silent && e.silent => (e.wait * 2).clamp(NO_ENGINE_TTL, SILENT_MOST),
            _ => NO_ENGINE_TTL,
        };
        self.insert(dest, NoEngine { retry_at: now + wait, wait, silent, forked }, now);
        let kind = match (silent, forked) {
            (true, _) => hints::Kind::Silent,
            (_, true) => hints::Kind::Forked,
            _ => hints::Kind::Refused,
        };
        Learnt { key: dest, kind, wait }
    }

    /// `dest`'s engine took a connection: what was known of it here goes.
    fn answered(&mut self, dest: &SocketAddr) {
        if let Some(m) = self.0.as_mut() {
            m.remove(dest);
            m.remove(&silence_key(dest));
        }
    }
}

/// What a process learnt about a destination, for the host's hints (written without holding
/// `NO_ENGINE`: a file's first use creates it, and a fork meanwhile must not leave a child
/// a held lock for that long).
#[must_use]
struct Learnt {
    key: SocketAddr,
    kind: hints::Kind,
    wait: Duration,
}

impl Learnt {
    fn share(self) {
        hints::record(self.key, self.kind, self.wait);
    }
}

/// Whether a connect to `dest` asks its engine now (`Err(forked)` if not): what this process
/// knows, else what the host's other processes learnt (`host`: not for destinations this
/// process carries, whose answers it has).
fn asks(dest: SocketAddr, host: bool) -> Result<(), bool> {
    let now = Instant::now();
    match NO_ENGINE.lock().known(&dest, now) {
        Known::Ask => return Ok(()),
        Known::Skip { forked } => return Err(forked),
        Known::Nothing if !host => return Ok(()),
        Known::Nothing => {}
    }
    for k in [dest, silence_key(&dest)] {
        if let Some(h) = hints::lookup(k) {
            return Err(NO_ENGINE.lock().adopt(k, h, now));
        }
    }
    Ok(())
}

/// `dest`'s engine took a connection: what was known of it goes, here and on the host (a host
/// that answers again is asked again at once by every process).
fn answered(dest: SocketAddr) {
    NO_ENGINE.lock().answered(&dest);
    hints::clear(dest);
    hints::clear(silence_key(&dest));
}

/// Silence at the channel port is the host's, whatever port the program connects to: kept
/// under the address alone (port 0), so that connects to other ports of that host do not wait
/// again.
fn silence_key(dest: &SocketAddr) -> SocketAddr {
    SocketAddr::new(dest.ip().to_canonical(), 0)
}

fn no_engine(dest: SocketAddr, silent: bool) {
    let learnt = NO_ENGINE.lock().refused(dest, silent, Instant::now());
    learnt.share();
}

/// The peer's listener answered a connection to `dest` asking for kernel TCP (its connections
/// are served by forked processes, through a relay): this one goes on carried, and the next
/// ones there go over kernel TCP for `NO_ENGINE_TTL`, after which one asks again.
pub(crate) fn kernel_preferred(dest: SocketAddr) {
    refused_later(dest);
    let learnt = NO_ENGINE.lock().leave_for(dest, false, true, Instant::now());
    learnt.share();
}

/// Destinations (address and port) whose engine took a connection from this process. A
/// non-blocking connect to one returns `EINPROGRESS` at once, as TCP's does, and completes
/// (or fails) in the background: the peer there carries that port, so a refusal would no longer
/// mean "a program on kernel TCP", which only an answer can tell for other destinations (their
/// connect waits for it, `OPEN_WAIT` at most). A destination whose open is refused later
/// leaves the set (`refused_later`); at most `CARRIED_BEFORE_MAX` are kept (then all go).
pub(crate) static CARRIED_BEFORE: ForkMutex<Option<HashSet<SocketAddr>>> = ForkMutex::new(None);
const CARRIED_BEFORE_MAX: usize = 4096;

/// How long a connect waits for the peer engine to answer an open before it goes over kernel
/// TCP (the peer's listener backlog stayed full; the program's kernel listener, full too, then
/// makes the kernel connect wait as a kernel client would).
const OPEN_WAIT: Duration = Duration::from_secs(5);

/// The key of `dest` in `CARRIED_BEFORE` (IPv4 destinations in one form, whatever the
/// socket's family).
fn carried_key(dest: SocketAddr) -> SocketAddr {
    in_family(dest, false)
}

fn carried_before(dest: SocketAddr) -> bool {
    CARRIED_BEFORE.lock().as_ref().is_some_and(|s| s.contains(&carried_key(dest)))
}

fn note_carried(dest: SocketAddr) {
    let mut set = CARRIED_BEFORE.lock();
    let set = set.get_or_insert_with(HashSet::new);
    if set.len() >= CARRIED_BEFORE_MAX {
        set.clear();
    }
    set.insert(carried_key(dest));
}

/// A connect that returned `EINPROGRESS` to `dest` was refused after all: the next ones there
/// wait for the answer again (and go over kernel TCP on a refusal).
pub(crate) fn refused_later(dest: SocketAddr) {
    if let Some(set) = CARRIED_BEFORE.lock().as_mut() {
        set.remove(&carried_key(dest));
    }
}

/// Carries the connection when selected and an engine answers at the peer's host: `Some` with
/// the connect result then, `None` to leave the fd to kernel TCP (nothing was changed).
pub(crate) fn try_carry(
    fd: c_int,
    app: BorrowedFd<'_>,
    dest: SocketAddr,
) -> Option<Result<(), i32>> {
    let s = settings();
    if !in_owner() {
        bump(&COUNTERS.kernel_other);
        return None;
    }
    if s.disabled || !is_stream(app) || dest.port() == 0 || dest.ip().is_unspecified() {
        return None;
    }
    if dest.port() == s.channel_port
        || (!s.ports.is_empty() && !s.ports.contains(&dest.port()))
        || (!s.carry_public && !worth_asking(dest.ip()))
    {
        bump(&COUNTERS.kernel_not_selected);
        return None;
    }
    if !table::in_range(fd) || table::kind(fd) != 0 {
        bump(&COUNTERS.kernel_other);
        return None;
    }
    let carried_before = carried_before(dest);
    if let Err(forked) = asks(dest, !carried_before) {
        bump(if forked { &COUNTERS.kernel_forked_server } else { &COUNTERS.kernel_no_engine });
        return None;
    }
    let Some(engine) = client_engine() else {
        bump(&COUNTERS.kernel_other);
        return None;
    };
    let engine_addr = SocketAddr::new(dest.ip(), s.channel_port);
    let mut in_background = s.path == DataPath::Direct && nonblocking(app) && carried_before;
    // A blocking connect gives up waiting after the socket's send timeout, as TCP's does
    // (`EINPROGRESS`, the connect going on): only the direct path can go on in the background,
    // and only to a destination carried before (elsewhere only the answer tells whether the
    // port is carried: a refusal still on its way must send this connect to kernel TCP).
    let send_timeout =
        rustix::net::sockopt::socket_timeout(app, rustix::net::sockopt::Timeout::Send)
            .ok()
            .flatten()
            .filter(|&t| t < OPEN_WAIT && s.path == DataPath::Direct && carried_before);
    // The first connect to a peer dials its channels in this thread (their fds go above the
    // program's, as the engine's all do).
    let opened = inside(|| {
        let class = engine.config().default_class;
        let vs = engine.connect_nonblocking(engine_addr, dest.port(), class)?;
        if in_background {
            return Ok((vs, false));
        }
        match vs.wait_open(send_timeout.unwrap_or(OPEN_WAIT)) {
            Ok(()) => Ok((vs, false)),
            // The peer's engine holds the open in its listener's queue: the port is carried
            // there, so the open may go on here.
            Err(e) if send_timeout.is_some() && netchannel::is_unanswered_open(&e) => {
                Ok((vs, true))
            }
            Err(e) => Err(e),
        }
    });
    let vs = match opened {
        // (An open that timed out is not answered yet: no SYN_ACK told it to prefer kernel TCP.)
        Ok((vs, _)) if !in_background && vs.peer_prefers_kernel() => {
            kernel_preferred(dest);
            vs
        }
        Ok((vs, timed_out)) => {
            in_background |= timed_out;
            answered(dest);
            note_carried(dest);
            vs
        }
        Err(e) => {
            match e.kind() {
                io::ErrorKind::ConnectionRefused => {
                    no_engine(dest, false);
                    bump(&COUNTERS.kernel_no_engine);
                }
                // The engine is there but its listener's backlog stayed full: this connect
                // alone goes to kernel TCP (the program's kernel listener, full too, makes it
                // wait as a kernel client would); the next ones ask the engine again.
                io::ErrorKind::TimedOut if netchannel::is_unanswered_open(&e) => {
                    bump(&COUNTERS.kernel_other);
                }
                // Nothing answered at the channel port within the dial timeout (a host that
                // drops packets): not asked again for a while either, so that the program's
                // next connects there do not wait again.
                io::ErrorKind::TimedOut => {
                    no_engine(dest, true);
                    bump(&COUNTERS.kernel_other);
                }
                _ => bump(&COUNTERS.kernel_other),
            }
            return None;
        }
    };
    let r = match s.path {
        DataPath::Direct => carry_direct(fd, app, vs, dest),
        DataPath::Relay => carry_relayed(fd, app, vs, dest),
    };
    if r.as_ref().is_some_and(|r| r.is_ok()) {
        bump(&COUNTERS.carried_connects);
        if in_background {
            // The open goes on: the placeholder shows writable once the peer accepted, and
            // SO_ERROR its refusal, as a TCP connect in progress does.
            if let Some(c) = table::carried(fd) {
                c.set_connect_in_progress();
            }
            bump(&COUNTERS.connects_in_progress);
            return Some(Err(libc::EINPROGRESS));
        }
    }
    r
}

/// Whether a connect to `ip` asks the host there for an engine: unless `--carry-public`, only
/// where it is not a public (globally routed) address, or where a route of this host's
/// reaches it without a gateway (a host on one of its own networks, whatever its addresses).
/// Asking a host on the internet at the channel port would send it a connection attempt the
/// user never asked for, and cost `DIAL_TIMEOUT` where that port's packets are dropped.
pub(crate) fn worth_asking(ip: IpAddr) -> bool {
    !is_global(ip) || on_link(ip)
}

/// Whether `ip` is a globally routed unicast address: not loopback, private (RFC 1918, IPv6
/// unique local), link-local, shared (100.64/10), benchmarking (198.18/15), documentation
/// (192.0.2/24, 198.51.100/24, 203.0.113/24, 2001:db8::/32), reserved, multicast or this
/// network.
pub(crate) fn is_global(ip: IpAddr) -> bool {
    let v4 = |a: Ipv4Addr| {
        let [b0, b1, b2, _] = a.octets();
        !(b0 == 0
            || a.is_loopback()
            || a.is_private()
            || a.is_link_local()
            || (b0 == 100 && (64..128).contains(&b1))
            || (b0 == 192 && b1 == 0 && (b2 == 0 || b2 == 2))
            || (b0 == 198 && (18..20).contains(&b1))
            || (b0 == 198 && b1 == 51 && b2 == 100)
            || (b0 == 203 && b1 == 0 && b2 == 113)
            || b0 >= 224)
    };
    match ip.to_canonical() {
        IpAddr::V4(a) => v4(a),
        IpAddr::V6(a) => {
            let s = a.segments();
            !(a.is_loopback()
                || a.is_unspecified()
                || (s[0] & 0xfe00) == 0xfc00
                || (s[0] & 0xffc0) == 0xfe80
                || (s[0] & 0xff00) == 0xff00
                || (s[0] == 0x2001 && s[1] == 0x0db8)
                || (s[0] == 0x2001 && s[1] == 0x0002 && s[2] == 0)
                || (s[0] == 0x0100 && s[1..4] == [0, 0, 0]))
        }
    }
}

/// Whether this network namespace has a route to `ip` without a gateway (the main table, from
/// /proc/net/route or /proc/net/ipv6_route; a default route does not count).
fn on_link(ip: IpAddr) -> bool {
    // By raw system calls, as all the library's own I/O (nothing interposed is re-entered);
    // at most 1 MiB of routes.
    let read = |path: &str| -> Option<String> {
        let flags = rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::CLOEXEC;
        let fd = rustix::fs::open(path, flags, rustix::fs::Mode::empty()).ok()?;
        let mut text = Vec::new();
        let mut buf = [0u8; 4096];
        while text.len() < 1 << 20 {
            match rustix::io::read(&fd, &mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => text.extend_from_slice(&buf[..n]),
            }
        }
        String::from_utf8(text).ok()
    };
    match ip.to_canonical() {
        IpAddr::V4(a) => read("/proc/net/route").is_some_and(|t| on_link_v4(&t, a)),
        IpAddr::V6(a) => read("/proc/net/ipv6_route").is_some_and(|t| on_link_v6(&t, a)),
    }
}

/// /proc/net/route: `Iface Destination Gateway Flags ... Mask ...`, addresses in hex as the
/// kernel stores them (network order read as a little-endian word).
fn on_link_v4(table: &str, a: Ipv4Addr) -> bool {
    const RTF_UP: u32 = 1;
    const RTF_GATEWAY: u32 = 2;
    let addr = u32::from_le_bytes(a.octets());
    table.lines().skip(1).any(|line| {
        let f: Vec<&str> = line.split_whitespace().collect();
        let hex = |i: usize| f.get(i).and_then(|v| u32::from_str_radix(v, 16).ok());
        match (hex(1), hex(2), hex(3), hex(7)) {
            (Some(dest), Some(gateway), Some(flags), Some(mask)) => {
                mask != 0
                    && gateway == 0
                    && flags & RTF_UP != 0
                    && flags & RTF_GATEWAY == 0
                    && addr & mask == dest
            }
            _ => false,
        }
    })
}

/// /proc/net/ipv6_route: `dest prefixlen src srclen nexthop metric refcnt use flags iface`.
fn on_link_v6(table: &str, a: Ipv6Addr) -> bool {
    const RTF_GATEWAY: u32 = 2;
    let addr = u128::from_be_bytes(a.octets());
    table.lines().any(|line| {
        let f: Vec<&str> = line.split_whitespace().collect();
        let parsed = (|| {
            let dest = u128::from_str_radix(f.first()?, 16).ok()?;
            let len = u32::from_str_radix(f.get(1)?, 16).ok()?;
            let nexthop = u128::from_str_radix(f.get(4)?, 16).ok()?;
            let flags = u32::from_str_radix(f.get(8)?, 16).ok()?;
            Some((dest, len, nexthop, flags))
        })();
        let Some((dest, len, nexthop, flags)) = parsed else { return false };
        let mask = if len == 0 || len > 128 { 0 } else { u128::MAX << (128 - len) };
        mask != 0 && nexthop == 0 && flags & RTF_GATEWAY == 0 && addr & mask == dest & mask
    })
}

fn is_stream(fd: BorrowedFd<'_>) -> bool {
    rustix::net::sockopt::socket_type(fd).is_ok_and(|t| t == rustix::net::SocketType::STREAM)
}

pub(crate) fn is_v6(fd: BorrowedFd<'_>) -> bool {
    rustix::net::sockopt::socket_domain(fd).is_ok_and(|d| d == rustix::net::AddressFamily::INET6)
}

pub(crate) fn nonblocking(fd: BorrowedFd<'_>) -> bool {
    rustix::fs::fcntl_getfl(fd).is_ok_and(|f| f.contains(rustix::fs::OFlags::NONBLOCK))
}

pub(crate) fn cloexec(fd: BorrowedFd<'_>) -> bool {
    rustix::io::fcntl_getfd(fd).is_ok_and(|f| f.contains(rustix::io::FdFlags::CLOEXEC))
}

pub(crate) fn local_of(fd: BorrowedFd<'_>) -> Option<SocketAddr> {
    SocketAddr::try_from(rustix::net::getsockname(fd).ok()?).ok()
}

pub(crate) fn peer_of(fd: BorrowedFd<'_>) -> Option<SocketAddr> {
    SocketAddr::try_from(rustix::net::getpeername(fd).ok()??).ok()
}

/// `a` in the family of a socket (`v6`): v4-mapped IPv6 for an IPv6 socket, as the kernel
/// reports addresses to it (programs such as Redis check "is loopback" on them).
pub(crate) fn in_family(a: SocketAddr, v6: bool) -> SocketAddr {
    match (a, v6) {
        (SocketAddr::V4(v4), true) => SocketAddr::from((v4.ip().to_ipv6_mapped(), v4.port())),
        (SocketAddr::V6(a6), false) => match a6.ip().to_ipv4_mapped() {
            Some(ip) => SocketAddr::from((ip, a6.port())),
            None => a,
        },
        _ => a,
    }
}

/// What a new fd's flags are, when its maker says so (`accept4`'s flags).
#[derive(Debug, Clone, Copy)]
pub(crate) struct FdModes {
    pub nonblocking: bool,
    pub cloexec: bool,
}

/// Puts a new placeholder for `vs` under the program's fd number `fd` (its flags kept) and
/// starts serving it directly. `known`: the socket's family (IPv6) and modes when the caller
/// knows them, which saves asking the kernel (an accept's).
pub(crate) fn install(
    fd: c_int,
    app: BorrowedFd<'_>,
    vs: VSocket,
    peer: SocketAddr,
    local: SocketAddr,
    known: Option<(bool, FdModes)>,
) -> Result<(), i32> {
    let (v6, nb, cx) = match known {
        Some((v6, m)) => (v6, m.nonblocking, m.cloexec),
        None => (is_v6(app), nonblocking(app), cloexec(app)),
    };
    vs.set_app_addresses(local, peer);
    let (c, p) = Carried::create(vs, in_family(peer, v6), in_family(local, v6), v6, nb)
        .map_err(|e| errno_of(&e))?;
    crate::sockopt::adopt(&c, app, known.is_some());
    dup_onto(p.as_fd(), fd, cx)?;
    drop(p);
    table::map_carried(fd, c.clone());
    c.observe();
    bump(&COUNTERS.direct);
    Ok(())
}

/// The address `getsockname` reports for a carried connection: the program's own binding if
/// it made one, otherwise the address this host uses towards the peer and a port of the
/// ephemeral range.
fn local_for(app: BorrowedFd<'_>, vs: &VSocket) -> SocketAddr {
    if let Some(l) = local_of(app).filter(|l| l.port() != 0) {
        return l;
    }
    let ip = vs.local_channel_addr().map_or(IpAddr::V4(Ipv4Addr::LOCALHOST), |a| a.ip());
    SocketAddr::new(ip, 32768 + (vs.id() % 28000) as u16)
}

fn carry_direct(
    fd: c_int,
    app: BorrowedFd<'_>,
    vs: VSocket,
    dest: SocketAddr,
) -> Option<Result<(), i32>> {
    let local = local_for(app, &vs);
    Some(install(fd, app, vs, dest, local, None))
}

/// `--path relay`: the program's fd connects to a relay loop's loopback listener, which moves
/// its bytes to and from the virtual socket.
fn carry_relayed(
    fd: c_int,
    app: BorrowedFd<'_>,
    vs: VSocket,
    dest: SocketAddr,
) -> Option<Result<(), i32>> {
    let local = local_of(app)?;
    let mut relay = crate::relay::relay_addr(local.is_ipv6())?;
    if local.port() == 0 {
        let any = SocketAddr::new(loopback_of(&local), 0);
        rustix::net::bind(app, &any).ok()?;
    }
    let from = local_of(app)?;
    if let SocketAddr::V6(v6) = &local {
        if v6.ip().to_ipv4_mapped().is_some() {
            let v4 = crate::relay::relay_addr(false)?;
            relay = SocketAddr::new(loopback_of(&local), v4.port());
        }
    }
    vs.set_app_addresses(local, dest);
    crate::relay::expect(from, vs);
    let r = real_connect(fd, relay);
    match r {
        Ok(()) | Err(libc::EINPROGRESS) => {
            crate::relay::note_relayed_peer(fd, dest);
            bump(&COUNTERS.relayed_by_choice);
        }
        Err(_) => crate::relay::unexpect(from),
    }
    Some(r)
}

pub(crate) fn loopback_of(a: &SocketAddr) -> IpAddr {
    match a {
        SocketAddr::V4(_) => IpAddr::V4(Ipv4Addr::LOCALHOST),
        SocketAddr::V6(v6) if v6.ip().to_ipv4_mapped().is_some() => {
            IpAddr::V6(Ipv4Addr::LOCALHOST.to_ipv6_mapped())
        }
        SocketAddr::V6(_) => IpAddr::V6(Ipv6Addr::LOCALHOST),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_destinations_that_are_not_public_or_are_on_link_are_asked() {
        let not_global = [
            "127.0.0.1",
            "10.214.0.2",
            "172.16.0.1",
            "172.31.255.255",
            "192.168.1.1",
            "169.254.1.1",
            "100.64.0.1",
            "100.127.255.255",
            "198.18.0.1",
            "198.19.255.255",
            "192.0.2.2",
            "198.51.100.7",
            "203.0.113.1",
            "240.0.0.1",
            "0.1.2.3",
            "::1",
            "fd00::1",
            "fc00::1",
            "fe80::1",
            "2001:db8::1",
            "::ffff:10.0.0.1",
            "::ffff:192.0.2.1",
        ];
        let global = [
            "8.8.8.8",
            "172.32.0.1",
            "100.128.0.1",
            "198.20.0.1",
            "1.1.1.1",
            "192.0.3.1",
            "2606:4700::1111",
            "2001:4860::8888",
            "::ffff:8.8.8.8",
        ];
        for a in not_global {
            assert!(!is_global(a.parse().unwrap()), "{a}");
        }
        for a in global {
            assert!(is_global(a.parse().unwrap()), "{a}");
        }
        // Routes without a gateway make a public address worth asking (a test network with
        // public addresses); a default route does not.
        let v4 =
            "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\tMTU\tWindow\tIRTT\n\
                  eth0\t00000000\t010200C0\t0003\t0\t0\t0\t00000000\t0\t0\t0\n\
                  veth0\t00030201\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0\n";
        assert!(on_link_v4(v4, "1.2.3.9".parse().unwrap()));
        assert!(!on_link_v4(v4, "1.2.4.9".parse().unwrap()));
        assert!(!on_link_v4(v4, "8.8.8.8".parse().unwrap()), "the default route has a gateway");
        let v6 = "2a010000000000000000000000000000 40 00000000000000000000000000000000 00 \
                  00000000000000000000000000000000 00000100 00000001 00000000 00000001 eth0\n\
                  00000000000000000000000000000000 00 00000000000000000000000000000000 00 \
                  fd000000000000000000000000000001 00000400 00000003 00000000 00000003 eth0\n";
        assert!(on_link_v6(v6, "2a01::5".parse().unwrap()));
        assert!(!on_link_v6(v6, "2606:4700::1111".parse().unwrap()), "only by the gateway");
        assert!(worth_asking("10.0.0.1".parse().unwrap()));
    }

    #[test]
    fn destinations_without_engine_wait_longer_when_silent_and_stay_few() {
        let mut m = NoEngineMap(None);
        let dest: SocketAddr = "10.0.0.2:80".parse().unwrap();
        let t0 = Instant::now();
        assert!(m.asks(&dest, t0).is_ok());
        // A refusal: asked again after 2 s, every time.
        let _ = m.refused(dest, false, t0);
        assert!(m.asks(&dest, t0 + Duration::from_millis(1999)).is_err());
        assert!(m.asks(&dest, t0 + NO_ENGINE_TTL).is_ok());
        let _ = m.refused(dest, false, t0 + NO_ENGINE_TTL);
        assert!(m.asks(&dest, t0 + 2 * NO_ENGINE_TTL).is_ok());
        // Silence in a row: 2, 4, 8, ... s, at most a minute; kept for the host (any port).
        let mut now = t0 + 2 * NO_ENGINE_TTL;
        let mut waits = Vec::new();
        for _ in 0..8 {
            let _ = m.refused(dest, true, now);
            let other_port = SocketAddr::new(dest.ip(), 443);
            assert!(m.asks(&other_port, now).is_err(), "silence is the host's");
            let e = &m.0.as_ref().unwrap()[&silence_key(&dest)];
            waits.push(e.wait.as_secs());
            now = e.retry_at;
            assert!(m.asks(&dest, now).is_ok());
        }
        assert_eq!(waits, [2, 4, 8, 16, 32, 60, 60, 60]);
        m.answered(&dest);
        assert!(m.asks(&dest, t0).is_ok());
        // A listener served by forked processes asked for kernel TCP: said so, for 2 s.
        let _ = m.leave_for(dest, false, true, t0);
        assert_eq!(m.asks(&dest, t0 + Duration::from_millis(1999)), Err(true));
        assert!(m.asks(&dest, t0 + NO_ENGINE_TTL).is_ok());
        let _ = m.refused(dest, false, t0);
        assert_eq!(m.asks(&dest, t0), Err(false));
        // Bounded: expired destinations go first, then all.
        for i in 0..10_000u32 {
            let d = SocketAddr::from(([10, (i >> 16) as u8, (i >> 8) as u8, i as u8], 80));
            let _ = m.refused(d, false, t0);
        }
        assert!(m.0.as_ref().unwrap().len() <= NO_ENGINE_MAX);
    }
}
