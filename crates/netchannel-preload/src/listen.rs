//! `listen` and `accept`. Beside a carried listening socket the engine listens on the same
//! virtual port; each virtual connection it accepts is announced to the program through its
//! own kernel listener, by a loopback connection from this library ("injected"), so that
//! `accept`, `poll`, `select`, epoll (`EPOLLEXCLUSIVE` included) and the backlog behave as the
//! kernel's. What the program's `accept` then returns depends on who accepts:
//!
//! - the process that owns the engine: the accepted socket is replaced by a placeholder served
//!   from the virtual socket (direct path);
//! - another process (a forked worker sharing the listener): it claims the connection (one
//!   byte back on the injected connection) and keeps the kernel socket, which a relay loop of
//!   the owner then serves;
//! - with `--path relay`: the injected connection is relayed from the start.
//!
//! Injected connections come from a source address of their own (127.7.45.1, or the target's
//! own address for IPv6-only listeners) and start with a 16-byte preamble the claiming process
//! consumes, so that a process that inherited the listener recognises them.

use std::collections::HashMap;
use std::ffi::c_int;
use std::io::{self, Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpStream};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use netchannel::sys::EventFd;
use netchannel::VSocket;
use parking_lot::Mutex;
use rustix::event::{PollFd, PollFlags};

use crate::connect::{in_family, install, is_v6, local_of, loopback_of, peer_of, FdModes};
use crate::process::{
    bump, fd_base, in_owner, inside, pid, relocate, server_engine, settings, DataPath, COUNTERS,
};
use crate::relay::{relay, Held};
use crate::table;

/// Where injected IPv4 connections come from: a loopback address nothing else uses.
pub(crate) const INJECTOR_V4: Ipv4Addr = Ipv4Addr::new(127, 7, 45, 1);
/// The first bytes of an injected connection.
const PREAMBLE: &[u8; 16] = b"netchannel-inj\x00\x01";
/// The byte a process that accepted an injected connection sends back to claim it.
const CLAIM: u8 = b'C';

/// An injected connection the program has not accepted yet, by the injector's local port.
struct Injected {
    vs: Option<VSocket>,
    peer: SocketAddr,
    /// Which injection holds the port now. A port is not unique over time, even while the
    /// acceptor still holds the injection's socket: when the owner takes an injected
    /// connection over, its kernel socket closes with the preamble unread, the injector's
    /// socket is reset, and the kernel frees a port bound as port 0 at the reset, so the next
    /// injection can get it before the acceptor has seen the reset.
    serial: u64,
}

static INJECTED: Mutex<Option<HashMap<u16, Injected>>> = Mutex::new(None);
static INJECTED_COUNT: AtomicUsize = AtomicUsize::new(0);
static NEXT_SERIAL: AtomicU64 = AtomicU64::new(0);

fn injected<T>(f: impl FnOnce(&mut HashMap<u16, Injected>) -> T) -> T {
    f(INJECTED.lock().get_or_insert_with(HashMap::new))
}

/// Takes the injection on `port` out of the map: any (the owner's `accept` of it), or only
/// the one `serial` names, if the port still names it (see [`Injected::serial`]): a later
/// injection on the same port is left alone.
fn take_injected(port: u16, serial: Option<u64>) -> Option<Injected> {
    let inj = injected(|m| match m.get(&port) {
        Some(i) if serial.is_none_or(|s| s == i.serial) => m.remove(&port),
        _ => None,
    });
    if inj.is_some() {
        INJECTED_COUNT.fetch_sub(1, Ordering::AcqRel);
    }
    inj
}

fn forget(port: u16, serial: u64) -> Option<Injected> {
    take_injected(port, Some(serial))
}

/// A carried listening socket's engine side.
pub(crate) struct ListenEntry {
    listener: Mutex<Option<Arc<netchannel::Listener>>>,
    /// Signalled when the program closes its listening fd.
    stop: EventFd,
    /// The process whose engine listens.
    owner: u32,
    /// The listener's own address (what accepted connections report as local).
    local: SocketAddr,
    /// A copy of the program's listening socket, through which the acceptor reads its accept
    /// queue (`queue_has_room`); closed with the program's fd (`close`), so that it never
    /// keeps the port listening after the program closed it (iperf3 listens again at once).
    queue_of: Mutex<Option<OwnedFd>>,
    /// When a connection from this listener last went to a relay (a forked process accepted
    /// or took it over), in ms since `FORKED_EPOCH`; 0: not within `FORKED_HOLD`. Meanwhile
    /// the engine's answers ask clients to use kernel TCP for the port (`note_relayed`).
    relayed_at_ms: AtomicU64,
}

/// How long after a connection of a listener last went to a relay its answers keep asking
/// clients for kernel TCP. Clients ask again every `connect::NO_ENGINE_TTL`, and the one
/// connection that asks goes to a relay too while the program forks, which renews it.
const FORKED_HOLD: Duration = Duration::from_secs(10);
static FORKED_EPOCH: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();

fn forked_clock_ms() -> u64 {
    // At least 1, so that 0 means "never".
    FORKED_EPOCH.get_or_init(Instant::now).elapsed().as_millis() as u64 + 1
}

impl ListenEntry {
    /// A connection from this listener went to a relay loop: served by another process (a
    /// forked worker accepted it, or a child took it over). Relayed connections cost about
    /// twice a kernel TCP connection's CPU, so for a while the engine's answers ask clients
    /// to make their further connections to this port over kernel TCP, which the forked
    /// processes then serve natively (`Listener::prefer_kernel`). `--relay-forked` keeps
    /// relaying instead.
    fn note_relayed(&self) {
        if settings().relay_forked || settings().path == DataPath::Relay {
            return;
        }
        self.relayed_at_ms.store(forked_clock_ms(), Ordering::Release);
        if let Some(l) = self.listener.lock().as_ref() {
            l.prefer_kernel(true);
        }
    }

    /// Ends the request for kernel TCP once no connection went to a relay for `FORKED_HOLD`.
    fn expire_relayed(&self, l: &netchannel::Listener) {
        let at = self.relayed_at_ms.load(Ordering::Acquire);
        let hold = FORKED_HOLD.as_millis() as u64;
        if at != 0 && forked_clock_ms().saturating_sub(at) > hold {
            let still =
                self.relayed_at_ms.compare_exchange(at, 0, Ordering::AcqRel, Ordering::Relaxed);
            if still.is_ok() {
                l.prefer_kernel(false);
                // A connection went to a relay meanwhile: its mark stands.
                if self.relayed_at_ms.load(Ordering::Acquire) != 0 {
                    l.prefer_kernel(true);
                }
            }
        }
    }

    /// The program closed its listening fd: the virtual port is free at once (iperf3 closes
    /// and re-creates its listener on the same port between control and data connections).
    pub(crate) fn close(&self) {
        // A forked child's copy went at the fork (`close_queue_copies_in_child`).
        if self.owner != pid() {
            return;
        }
        drop(self.queue_of.lock().take());
        self.stop.notify();
        drop(self.listener.lock().take());
    }
}

/// The engine side of a listening socket, listening on the virtual port already, before its
/// acceptor runs.
pub(crate) struct Prepared {
    listener: netchannel::Listener,
    local: SocketAddr,
    target: SocketAddr,
    /// How many connections the program's kernel listener queues for `accept`.
    queue: usize,
}

/// Before the real `listen` of a bound socket: the engine listens on the same virtual port
/// first, so that a client that sees the kernel listener (and connects at once) finds the
/// engine there too instead of falling back to kernel TCP. `None` when the socket is not
/// carried, or not bound yet (`listen` picks its port: see [`add_engine_listener`]).
pub(crate) fn prepare_engine_listener(
    fd: c_int,
    app: BorrowedFd<'_>,
    backlog: c_int,
) -> Option<Prepared> {
    let s = settings();
    if !in_owner() {
        bump(&COUNTERS.kernel_listen_only);
        return None;
    }
    let is_stream =
        rustix::net::sockopt::socket_type(app).is_ok_and(|t| t == rustix::net::SocketType::STREAM);
    if s.disabled || !is_stream || !table::in_range(fd) || table::kind(fd) & table::LISTENING != 0 {
        return None;
    }
    let local = local_of(app)?;
    if local.port() == 0
        || local.port() == s.channel_port
        || (!s.ports.is_empty() && !s.ports.contains(&local.port()))
    {
        return None;
    }
    let Some(engine) = server_engine() else {
        bump(&COUNTERS.kernel_listen_only);
        return None;
    };
    // Bound as the program's socket is: a server on 127.0.0.1 is not reached from other hosts
    // through the engine either.
    let v6only = is_v6(app) && rustix::net::sockopt::ipv6_v6only(app).unwrap_or(true);
    let Ok(listener) = inside(|| engine.listen_on(local, v6only)) else {
        bump(&COUNTERS.kernel_listen_only);
        return None;
    };
    // The engine's listener takes the program's backlog (as the kernel queues it): it answers
    // that many opens ahead of the acceptor, which injects them while the program's kernel
    // queue has room, and leaves the others unanswered, as the kernel leaves SYNs to a full
    // queue. So a program that does not accept has at most twice its queue answered (with the
    // engine's default, 4,096), and a burst of connects is answered without waiting for each
    // injection.
    let queue = accept_queue(backlog);
    listener.set_backlog(queue);
    let target = match local.ip() {
        ip if ip.is_unspecified() => {
            // A dual-stack IPv6 listener is reached over IPv4 (from the injector's address).
            let ip = if is_v6(app) && !v6only {
                IpAddr::V4(Ipv4Addr::LOCALHOST)
            } else {
                loopback_of(&local)
            };
            SocketAddr::new(ip, local.port())
        }
        _ => local,
    };
    Some(Prepared { listener, local, target, queue })
}

/// How many connections the kernel queues for `accept` after `listen(fd, backlog)`: `backlog`
/// clamped to `net.core.somaxconn` (a negative one too), plus one.
fn accept_queue(backlog: c_int) -> usize {
    let somaxconn = std::fs::read_to_string("/proc/sys/net/core/somaxconn")
        .ok()
        .and_then(|s| s.trim().parse::<usize>().ok())
        .unwrap_or(4096);
    usize::try_from(backlog).map_or(somaxconn, |b| b.min(somaxconn)) + 1
}

/// After a successful `listen` of a socket that was not bound before it: listen on the port
/// the kernel picked in the engine too.
pub(crate) fn add_engine_listener(fd: c_int, app: BorrowedFd<'_>, backlog: c_int) {
    if let Some(p) = prepare_engine_listener(fd, app, backlog) {
        start_engine_listener(fd, p);
    }
}

/// After a successful `listen`: the acceptor starts announcing the engine's connections
/// through the program's kernel listener (those that arrived in between wait in the engine's
/// backlog).
pub(crate) fn start_engine_listener(fd: c_int, prepared: Prepared) {
    let Prepared { listener, local, target, queue } = prepared;
    listener.set_nonblocking(true);
    // The acceptor waits on its own copy of the readiness eventfd: it holds the listener only
    // while it accepts (see `ListenEntry::close`), and the copy outlives it.
    let ready = listener.readiness_fd().and_then(|fd| {
        let fd = crate::interpose::borrow_raw(fd, &listener);
        Ok(rustix::io::fcntl_dupfd_cloexec(fd, fd_base())?)
    });
    let Ok(ready) = ready else {
        bump(&COUNTERS.kernel_listen_only);
        return;
    };
    let Ok(stop) = EventFd::new().and_then(|e| e.moved_above(fd_base())) else {
        bump(&COUNTERS.kernel_listen_only);
        return;
    };
    // The acceptor reads the kernel listener's queue through a copy of it (closed as soon as
    // the program closes its own: `ListenEntry::close` stops the acceptor).
    let queue_of =
        crate::interpose::with_fd(fd, |app| rustix::io::fcntl_dupfd_cloexec(app, fd_base()).ok());
    // The acceptor holds the listener only weakly (see `ListenEntry::close`).
    let listener = Arc::new(listener);
    let weak = Arc::downgrade(&listener);
    let entry = Arc::new(ListenEntry {
        listener: Mutex::new(Some(listener)),
        stop,
        owner: pid(),
        local,
        queue_of: Mutex::new(queue_of),
        relayed_at_ms: AtomicU64::new(0),
    });
    table::map_listener(fd, entry.clone());
    let _ = std::thread::Builder::new()
        .name("nc-listen".into())
        .spawn(move || inside(|| acceptor(entry, weak, ready, target, queue)));
}

/// Whether the program's kernel listener has room for one more connection in its accept queue
/// (`TCP_INFO` of a listening socket: `tcpi_unacked` is the queue's length, `tcpi_sacked` its
/// bound; a SYN is dropped once the length is above the bound). `None` if it cannot tell.
fn queue_has_room(listener: BorrowedFd<'_>) -> Option<bool> {
    use std::mem::offset_of;
    let (length, bound) =
        (offset_of!(libc::tcp_info, tcpi_unacked), offset_of!(libc::tcp_info, tcpi_sacked));
    let mut info = [0u8; 64];
    let n =
        crate::interpose::raw_getsockopt(listener, libc::IPPROTO_TCP, libc::TCP_INFO, &mut info)
            .ok()?;
    let field = |at: usize| u32::from_ne_bytes(info[at..at + 4].try_into().expect("4 bytes"));
    (n >= bound + 4).then(|| field(length) <= field(bound))
}

/// The acceptor thread of one listener: injects each virtual connection the engine accepts,
/// and watches the injected connections until someone accepts them. It injects only while the
/// program's kernel listener has room in its accept queue (read from the kernel through
/// `ListenEntry::queue_of`; failing that, no more injected and unaccepted than the `listen`
/// backlog allows): one more would find the queue full, and its SYN, dropped, would be sent again only a second
/// later, with this thread blocked in the connect meanwhile (a Python `http.server`, whose
/// backlog is 5, under `wrk -c 8` served 6 requests a second instead of 1,900). The rest wait in
/// the engine's backlog, their clients' connects unanswered, as the kernel leaves SYNs to a
/// full listener.
fn acceptor(
    entry: Arc<ListenEntry>,
    weak: Weak<netchannel::Listener>,
    ready: OwnedFd,
    target: SocketAddr,
    queue: usize,
) {
    let relayed = settings().path == DataPath::Relay;
    // Injected connections not accepted yet: (socket, injector port, serial).
    let mut waiting: Vec<(TcpStream, u16, u64)> = Vec::new();
    loop {
        {
            // Held only while accepting: closing the program's listener frees the virtual
            // port at once.
            let Some(l) = weak.upgrade() else { break };
            l.clear_readiness();
            entry.expire_relayed(&l);
            // `waiting` also holds connections taken over but not yet seen reset: it counts
            // high for a moment, never low.
            let room = |waiting: &Vec<_>| {
                let kernel = entry.queue_of.lock().as_ref().and_then(|l| queue_has_room(l.as_fd()));
                kernel.unwrap_or(waiting.len() < queue)
            };
            while room(&waiting) {
                match l.accept() {
                    Ok(vs) => {
                        let peer = vs.peer_engine_addr();
                        if let Some(w) = inject(target, peer, vs, relayed) {
                            waiting.push(w);
                        }
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(_) => break,
                }
            }
        }
        let mut fds =
            vec![PollFd::new(&entry.stop, PollFlags::IN), PollFd::new(&ready, PollFlags::IN)];
        fds.extend(waiting.iter().map(|(s, _, _)| PollFd::new(s, PollFlags::IN)));
        let second = rustix::event::Timespec { tv_sec: 1, tv_nsec: 0 };
        if rustix::event::poll(&mut fds, Some(&second)).is_err() {
            continue;
        }
        if !fds[0].revents().is_empty() {
            break;
        }
        let done: Vec<usize> =
            (2..fds.len()).filter(|&i| !fds[i].revents().is_empty()).map(|i| i - 2).collect();
        drop(fds);
        for i in done.into_iter().rev() {
            let (mut s, port, serial) = waiting.swap_remove(i);
            let mut b = [0u8; 1];
            let claimed = matches!((&s).read(&mut b), Ok(1) if b[0] == CLAIM);
            match forget(port, serial).and_then(|i| i.vs) {
                // Accepted by another process: its kernel socket is relayed from now on.
                Some(vs) if claimed => {
                    let _ = s.set_nonblocking(false);
                    let _ = s.flush();
                    relay(s, Held::Own(vs));
                    bump(&COUNTERS.relayed_accepted_elsewhere);
                    entry.note_relayed();
                }
                // Closed unaccepted-by-us (a process accepted and closed it): the virtual
                // socket closes the same way (FIN, or a reset if the client's bytes were left).
                _ => {}
            }
        }
    }
    // The listener is gone: connections nobody accepted are refused, as the kernel resets
    // the ones in a closed listener's queue.
    for (s, port, serial) in waiting {
        forget(port, serial);
        drop(s);
    }
}

/// Connects a loopback TCP socket into the program's listener on behalf of a virtual client,
/// registered before the connect so that the program's accept always finds it. With
/// `relayed` the connection is handed to a relay loop at once.
fn inject(
    target: SocketAddr,
    peer: SocketAddr,
    vs: VSocket,
    relayed: bool,
) -> Option<(TcpStream, u16, u64)> {
    let family = if target.is_ipv4() {
        rustix::net::AddressFamily::INET
    } else {
        rustix::net::AddressFamily::INET6
    };
    let s = rustix::net::socket_with(
        family,
        rustix::net::SocketType::STREAM,
        rustix::net::SocketFlags::CLOEXEC,
        None,
    )
    .ok()?;
    let s = relocate(s);
    let from = match target {
        SocketAddr::V4(_) => SocketAddr::new(IpAddr::V4(INJECTOR_V4), 0),
        SocketAddr::V6(_) => SocketAddr::new(target.ip(), 0),
    };
    rustix::net::bind(&s, &from).ok()?;
    let port = local_of(s.as_fd())?.port();
    let peer = in_family(peer, target.is_ipv6());
    vs.set_app_addresses(target, peer);
    // `--path relay`: relayed from the start; the map only tells the owner's accept the peer.
    let (keep, relay_now) = if relayed { (None, Some(vs)) } else { (Some(vs), None) };
    let serial = NEXT_SERIAL.fetch_add(1, Ordering::Relaxed);
    // An entry still on this port is an injection reset in the program's accept queue
    // before it was accepted (its port was freed at the reset): it is replaced, and its
    // virtual socket closes, as the reset connection would.
    let replaced = injected(|m| m.insert(port, Injected { vs: keep, peer, serial }));
    if replaced.is_none() {
        INJECTED_COUNT.fetch_add(1, Ordering::AcqRel);
    }
    drop(replaced);
    if rustix::net::connect(&s, &target).is_err() {
        forget(port, serial);
        return None;
    }
    let _ = rustix::net::sockopt::set_tcp_nodelay(&s, true);
    let s = TcpStream::from(s);
    bump(&COUNTERS.carried_accepts);
    if let Some(vs) = relay_now {
        relay(s, Held::Own(vs));
        bump(&COUNTERS.relayed_by_choice);
        return None;
    }
    let _ = (&s).write_all(PREAMBLE);
    let _ = s.set_nonblocking(true);
    Some((s, port, serial))
}

/// What `accept`/`accept4` do after the real call returned `nfd`: an injected connection is
/// turned into what the accepting process should hold (see the module doc). Returns the
/// address to report as the peer's, if it is not the kernel's.
pub(crate) fn accepted(
    listen_fd: c_int,
    nfd: c_int,
    app: BorrowedFd<'_>,
    modes: FdModes,
) -> Option<SocketAddr> {
    let peer = peer_of(app)?;
    let from_injector = match peer {
        SocketAddr::V4(a) => *a.ip() == INJECTOR_V4,
        SocketAddr::V6(a) => a.ip().to_ipv4_mapped() == Some(INJECTOR_V4),
    };
    // IPv6-only listeners are injected into from their own address (see the module doc). The
    // socket's own address costs a system call: asked only where it can matter.
    let local = (from_injector || peer.is_ipv6()).then(|| local_of(app)).flatten();
    let from_itself = peer.is_ipv6() && local.is_some_and(|l| l.ip() == peer.ip());
    // An engine listener serving the accepted socket's address (this process's, with
    // `owned`): a socket that is not one itself may be another of its `SO_REUSEPORT` group,
    // over which the kernel spreads the injections, and the program accepts from each.
    let port_listener = |owned: bool| listener_serving(local?, owned);
    let listening = table::kind(listen_fd) & table::LISTENING != 0;
    let ours = || {
        if listening {
            if let Some(e) = table::TABLES.listeners.lock().get(&listen_fd) {
                return (e.owner == pid()).then_some(e.local);
            }
        }
        port_listener(true).filter(|_| from_injector || from_itself).map(|e| e.local)
    };
    if INJECTED_COUNT.load(Ordering::Acquire) > 0 {
        if let Some(local) = ours() {
            if let Some(inj) = take_injected(peer.port(), None) {
                return Some(take_over(local, nfd, app, inj, modes));
            }
        }
    }
    let maybe_injected =
        from_injector || (from_itself && (listening || port_listener(false).is_some()));
    if maybe_injected && claim(app, from_injector) {
        bump(&COUNTERS.relayed_accepted_elsewhere);
    }
    None
}

/// The owner accepted an injected connection.
fn take_over(
    local: SocketAddr,
    nfd: c_int,
    app: BorrowedFd<'_>,
    inj: Injected,
    modes: FdModes,
) -> SocketAddr {
    // In the accepted socket's family, as the kernel reports it: an IPv4 peer of a dual-stack
    // IPv6 listener is `::ffff:a.b.c.d` (the injection itself came over IPv4).
    let v6 = is_v6(app);
    let peer = in_family(inj.peer, v6);
    let Some(vs) = inj.vs else {
        // `--path relay`: the kernel socket is already relayed; only its peer's address is
        // the virtual one.
        crate::relay::note_relayed_peer(nfd, peer);
        return peer;
    };
    let local = if local.ip().is_unspecified() {
        let ip = vs.local_channel_addr().map_or(local.ip(), |a| a.ip());
        SocketAddr::new(ip, local.port())
    } else {
        local
    };
    if install(nfd, app, vs, peer, local, Some((v6, modes))).is_err() {
        // The accepted kernel socket stays: its injector end closes with the virtual socket,
        // so the program reads end of stream (nothing is delivered on a broken carry).
        bump(&COUNTERS.kernel_other);
    }
    peer
}

/// A process other than the owner accepted what may be an injected connection: consume the
/// preamble and claim it. `certain`: it comes from the injector's own address (the preamble
/// is on its way); otherwise it is only peeked at, briefly.
fn claim(app: BorrowedFd<'_>, certain: bool) -> bool {
    let wait = if certain { Duration::from_secs(2) } else { Duration::from_millis(50) };
    let deadline = Instant::now() + wait;
    let mut got = [0u8; 16];
    loop {
        match rustix::net::recv(
            app,
            &mut got,
            rustix::net::RecvFlags::PEEK | rustix::net::RecvFlags::DONTWAIT,
        ) {
            Ok((n, _)) if n == PREAMBLE.len() => break,
            Ok((n, _)) if n > 0 && got[..n] != PREAMBLE[..n] => return false,
            Ok((0, _)) => return false,
            _ => {}
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return false;
        }
        let mut p = [PollFd::new(&app, PollFlags::IN)];
        let t =
            rustix::event::Timespec { tv_sec: 0, tv_nsec: left.as_nanos().min(999_999_999) as _ };
        let _ = rustix::event::poll(&mut p, Some(&t));
    }
    if got != *PREAMBLE {
        return false;
    }
    let _ = rustix::net::recv(app, &mut got, rustix::net::RecvFlags::DONTWAIT);
    rustix::net::send(app, &[CLAIM], rustix::net::SendFlags::NOSIGNAL).is_ok()
}

/// In a forked child: closes its copies of the owner's `queue_of` sockets, which only the
/// owner's acceptors read (kept, they would keep a port listening after the program closed
/// its listener). A copy whose lock an acceptor of the parent held at the fork stays open
/// while the child lives: that lock stays held here, and waiting for it would hang the child.
pub(crate) fn close_queue_copies_in_child() {
    for e in table::TABLES.listeners.lock().values() {
        if e.owner != pid() {
            if let Some(mut q) = e.queue_of.try_lock() {
                drop(q.take());
            }
        }
    }
}

/// The engine listener serving connections that report `local` as their own address (a
/// wildcard one serves every address of its port; IPv4 in either form), of this process with
/// `owned`, else of any process holding its entry (a forked child's copy of the tables).
fn listener_serving(local: SocketAddr, owned: bool) -> Option<Arc<ListenEntry>> {
    let local = in_family(local, false);
    let entries = table::TABLES.listeners.lock();
    let serves = |e: &ListenEntry| {
        let at = in_family(e.local, false);
        (!owned || e.owner == pid())
            && at.port() == local.port()
            && (at.ip() == local.ip() || at.ip().is_unspecified())
    };
    entries.values().find(|e| serves(e)).cloned()
}

/// A connection this process accepted as `local` was taken over by another process (a child
/// after fork, a program after exec): its listener notes it (`ListenEntry::note_relayed`).
pub(crate) fn taken_over_from(local: SocketAddr) {
    if let Some(e) = listener_serving(local, true) {
        e.note_relayed();
    }
}
