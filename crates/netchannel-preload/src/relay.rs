//! Relay loops: move bytes between a kernel TCP socket a program holds and a virtual socket,
//! for the connections the direct path cannot serve: one accepted by another process of the
//! program (a forked worker), one a process took over after fork, exec or `SCM_RIGHTS`
//! (`attach`), and every connection under `netchannel run --path relay`. The program's end is
//! a loopback TCP connection to the relay's listener, so it keeps kernel TCP's semantics.
//!
//! A few threads (one per CPU, at most 4) each run one epoll set over the kernel ends of their
//! connections and one `Poller` over their virtual sockets, and sleep in the poller (which the
//! epoll set also wakes: `Poller::wake_on`). Against two blocking pump threads per connection
//! (the first design), a loaded program's many connections are served in batches, one wake-up
//! for many of them, and the sends one round makes leave together: they are flushed once, at
//! the end of the round.
//!
//! Each connection holds at most one read's worth (`CHUNK`) of bytes per direction that the
//! other side has not taken yet; while it does, the loop stops reading that direction, so a slow
//! receiver holds the sender back through both kernels' windows (backpressure, nothing dropped).

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use netchannel::sys::{Epoll, EventFd, ShedOnFork, EDGE, PEER_SHUTDOWN, READABLE, WRITABLE};
use netchannel::{Poller, VSocket};
use parking_lot::Mutex;

use crate::carried::Carried;
use crate::forklock::ForkMutex;
use crate::process::{fd_base, inside, relocate, COUNTERS};

/// The virtual side of a relayed connection.
pub(crate) enum Held {
    /// A virtual socket only the relay uses.
    Own(VSocket),
    /// A carried connection a process took over (its owner may still hold placeholders).
    Shared(Arc<Carried>),
}

impl Held {
    fn vs(&self) -> &VSocket {
        match self {
            Held::Own(vs) => vs,
            Held::Shared(c) => &c.vs,
        }
    }
}

/// Bytes moved per read.
const CHUNK: usize = 64 * 1024;
/// epoll tokens of the loop's own fds (connection ids count up from 0).
const WAKE: u64 = u64::MAX;

pub(crate) struct Loop {
    /// Connections handed over, not yet registered.
    inbox: Mutex<Vec<(ShedOnFork<TcpStream>, Held)>>,
    /// The inbox has something.
    wake: EventFd,
}

/// The relay loops, started on first use (most processes never relay: a short-lived client
/// would start them for nothing), under `fds_high`: the loops' own fds move above the
/// application's as they are made (`moved_above`, and their pollers by the floor).
fn loops() -> &'static [Arc<Loop>] {
    static LOOPS: OnceLock<Vec<Arc<Loop>>> = OnceLock::new();
    LOOPS.get_or_init(|| {
        let n = std::thread::available_parallelism().map_or(1, |n| n.get()).min(4);
        (0..n).filter_map(|_| start()).collect()
    })
}

fn start() -> Option<Arc<Loop>> {
    let wake = EventFd::new().and_then(|e| e.moved_above(fd_base())).ok()?;
    let ep = Epoll::new().and_then(|e| e.moved_above(fd_base())).ok()?;
    let poller = Poller::new().ok()?;
    let lp = Arc::new(Loop { inbox: Mutex::new(Vec::new()), wake });
    ep.add(lp.wake.as_fd(), READABLE, WAKE).ok()?;
    let run_lp = lp.clone();
    std::thread::Builder::new()
        .name("nc-relay-loop".into())
        .spawn(move || inside(|| run(&run_lp, ep, poller)))
        .ok()?;
    Some(lp)
}

/// Hands a connection to a relay loop (round robin).
pub(crate) fn relay(app: TcpStream, vs: Held) {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let all = crate::process::fds_high(loops);
    if all.is_empty() {
        // No thread could be started: the connection cannot be served; dropping both ends
        // closes them, so the application sees its connection end rather than hang.
        return;
    }
    let lp = &all[NEXT.fetch_add(1, Ordering::Relaxed) % all.len()];
    // A forked child keeps no copy of the relay's end: the relay's close (or reset) of it
    // reaches the taker whatever other processes this one forked.
    lp.inbox.lock().push((ShedOnFork::new(app), vs));
    lp.wake.notify();
}

/// Connections of this process another process took over, which its relay loops serve
/// (`Held::Shared`): this process's exit ends them (docs/ARCHITECTURE.md, "Limits").
static TAKEN_OVER: Mutex<Vec<Arc<Carried>>> = Mutex::new(Vec::new());

/// How many connections this process carries for other processes that still hold them: a
/// taker that closed its end is not counted, whether or not a relay loop has seen it yet (on
/// a loaded machine it may not have when this process exits).
pub(crate) fn taken_over() -> usize {
    TAKEN_OVER.lock().iter().filter(|c| !c.taker_closed()).count()
}

struct Conn {
    app: ShedOnFork<TcpStream>,
    vs: Held,
    /// Read from the application, not yet taken by the virtual socket.
    up: Vec<u8>,
    /// Received from the virtual socket, not yet written to the application.
    down: Vec<u8>,
    up_done: bool,
    down_done: bool,
    /// When a shared connection's taker's end of stream came while it still seemed to hold
    /// its end (`LAST_CLOSE_GRACE`); nothing moves until that is settled.
    ended_at: Option<Instant>,
}

impl Drop for Conn {
    fn drop(&mut self) {
        if let Held::Shared(c) = &self.vs {
            TAKEN_OVER.lock().retain(|t| !Arc::ptr_eq(t, c));
        }
    }
}

/// Kernel events the loop takes per round.
const EVENTS_PER_ROUND: usize = 256;
/// How long a shared connection's taker may look as if it still held its end after its end of
/// stream came, before the relay takes that for a half close. A process's last `close` sends
/// the FIN before the kernel orphans the socket (as we read `__tcp_close`: `tcp_send_fin`, then
/// `sock_orphan`), so the relay can read the end of stream and ask while the socket still has
/// its inode: taken for a half close, the FIN went on to the peer, and a parent that had
/// waited for its forked child to exit read end of stream instead of its answer (1 round in
/// about 200 of `process_rounds` beside another test).
const LAST_CLOSE_GRACE: Duration = Duration::from_millis(20);
/// How often a connection in that grace is looked at again.
const LAST_CLOSE_RECHECK: Duration = Duration::from_micros(200);

fn run(lp: &Loop, ep: Epoll, poller: Poller) {
    // The loop sleeps in the poller (so it serves its virtual sockets' channels itself, one
    // wake-up per message as an application thread blocked in recv would), woken also by its
    // epoll set of kernel ends, which it polls without blocking each round.
    poller.wake_on(ep.raw());
    let mut conns: HashMap<u64, Conn> = HashMap::new();
    let mut next_id: u64 = 0;
    let mut scratch = vec![0u8; CHUNK];
    let mut events: Vec<(u64, u32)> = Vec::with_capacity(EVENTS_PER_ROUND);
    let mut tokens = Vec::new();
    let mut due: Vec<u64> = Vec::new();
    // Connections whose taker's end of stream waits for its verdict (`Conn::ended_at`).
    let mut recheck: Vec<u64> = Vec::new();
    let mut sleep = false;
    loop {
        due.clear();
        let timeout = if !sleep {
            Some(Duration::ZERO)
        } else if !recheck.is_empty() {
            Some(LAST_CLOSE_RECHECK)
        } else {
            None
        };
        let _ = poller.wait(&mut tokens, timeout);
        due.extend_from_slice(&tokens);
        events.clear();
        // An interrupted wait reports no event (the round goes on); other errors end the loop.
        let n = match ep.wait(&mut events, EVENTS_PER_ROUND, Some(Duration::ZERO)) {
            Ok(n) => n,
            Err(_) => return,
        };
        for &(token, _) in &events {
            if token != WAKE {
                due.push(token);
                continue;
            }
            lp.wake.drain();
            let arrived = std::mem::take(&mut *lp.inbox.lock());
            for (app, vs) in arrived {
                let id = next_id;
                next_id += 1;
                let _ = app.set_nonblocking(true);
                let _ = app.set_nodelay(true);
                vs.vs().set_nonblocking(true);
                // Urgent bytes travel inline both ways while a relay serves the connection: a
                // relay that read them as TCP does by default would drop them.
                let _ = rustix::net::sockopt::set_socket_oobinline(&*app, true);
                vs.vs().set_oob_inline(true);
                let flags = READABLE | WRITABLE | PEER_SHUTDOWN | EDGE;
                if ep.add(app.as_fd(), flags, id).is_err() || poller.register(vs.vs(), id).is_err()
                {
                    reset(&app);
                    continue;
                }
                if let Held::Shared(c) = &vs {
                    c.relay_link(app.as_fd().try_clone_to_owned().ok());
                }
                // Bytes the owner was given back (or kept for a peek) and has not read go to
                // the taker first.
                let down = match &vs {
                    Held::Shared(c) => c.take_all_returned(),
                    _ => Vec::new(),
                };
                if let Held::Shared(c) = &vs {
                    TAKEN_OVER.lock().push(c.clone());
                }
                let c = Conn {
                    app,
                    vs,
                    up: Vec::new(),
                    down,
                    up_done: false,
                    down_done: false,
                    ended_at: None,
                };
                conns.insert(id, c);
                due.push(id);
            }
        }
        // A full batch of kernel events may have left more: go round without sleeping.
        sleep = due.is_empty() && n < EVENTS_PER_ROUND;
        // Looked at again on this round without keeping the next from sleeping (it sleeps
        // `LAST_CLOSE_RECHECK` at most while any wait).
        due.append(&mut recheck);
        due.sort_unstable();
        due.dedup();
        for id in &due {
            let Some(c) = conns.get_mut(id) else { continue };
            drive(c, &mut scratch);
            if c.ended_at.is_some() {
                recheck.push(*id);
            }
            if c.up_done && c.down_done {
                // Closing the kernel end takes it out of the epoll set; dropping the virtual
                // socket closes it (delivering what is queued, or resetting if bytes were
                // left unread, as TCP does).
                conns.remove(id);
            }
        }
        // What this batch sent leaves now, together (a burst is otherwise held until the
        // loop sleeps, and under steady load it may not).
        netchannel::flush_sends();
    }
}

/// How one direction of a connection stopped moving.
enum Stop {
    /// Either side would block: wait for its next event.
    Blocked,
    /// The reading side ended (EOF).
    Ended,
    /// The reading side failed (reset).
    ReadFailed,
    /// The writing side failed (gone); what is pending is dropped.
    WriteFailed,
}

/// Moves bytes from `read` to `write` until one of them stops: straight through while `write`
/// takes everything, with what it leaves in `pending` (then nothing more is read until it is
/// taken: backpressure).
fn forward(
    pending: &mut Vec<u8>,
    scratch: &mut [u8],
    moved: &AtomicU64,
    mut read: impl FnMut(&mut [u8]) -> io::Result<usize>,
    mut write: impl FnMut(&[u8]) -> io::Result<usize>,
) -> Stop {
    let blocked = |e: &io::Error| e.kind() == io::ErrorKind::WouldBlock;
    let interrupted = |e: &io::Error| e.kind() == io::ErrorKind::Interrupted;
    loop {
        if !pending.is_empty() {
            match write(pending) {
                Ok(n) => {
                    pending.drain(..n);
                    moved.fetch_add(n as u64, Ordering::Relaxed);
                }
                Err(e) if blocked(&e) => return Stop::Blocked,
                Err(e) if interrupted(&e) => {}
                // What is pending stays for the caller (given back, or dropped).
                Err(_) => return Stop::WriteFailed,
            }
            continue;
        }
        match read(scratch) {
            Ok(0) => return Stop::Ended,
            Ok(n) => match write(&scratch[..n]) {
                Ok(m) => {
                    moved.fetch_add(m as u64, Ordering::Relaxed);
                    pending.extend_from_slice(&scratch[m..n]);
                }
                // Kept: the pending branch above retries it and sees the error again, if any.
                Err(_) => pending.extend_from_slice(&scratch[..n]),
            },
            Err(e) if blocked(&e) => return Stop::Blocked,
            Err(e) if interrupted(&e) => {}
            Err(_) => return Stop::ReadFailed,
        }
    }
}

/// Moves what can move in both directions until each would block.
fn drive(c: &mut Conn, scratch: &mut [u8]) {
    // A connection taken over while its owner holds P: the taker's close is not the last
    // close, and the connection goes back to the owner (`give_back`).
    let shared = match &c.vs {
        Held::Shared(carried) if carried.held_here() => Some(carried.clone()),
        _ => None,
    };
    if !c.up_done {
        let (app, vs): (&TcpStream, _) = (&c.app, c.vs.vs());
        match forward(&mut c.up, scratch, &COUNTERS.bytes_out, |b| (&*app).read(b), |b| vs.send(b))
        {
            Stop::Blocked => {}
            Stop::Ended => match &shared {
                // The taker closed its end (its last copy): what it wrote came first.
                Some(carried) if taker_holds(app) != Some(true) => {
                    c.ended_at = None;
                    return give_back(c, carried);
                }
                // It may be closing still (`LAST_CLOSE_GRACE`): looked at again before anything
                // moves, bytes for it included (written into a closing socket, they are lost).
                Some(_)
                    if c.ended_at.get_or_insert_with(Instant::now).elapsed() < LAST_CLOSE_GRACE =>
                {
                    return;
                }
                // A half close: the taker still holds its end and reads on.
                _ => {
                    c.ended_at = None;
                    let _ = c.vs.vs().shutdown();
                    c.up_done = true;
                }
            },
            // The virtual connection is gone: what the application writes goes nowhere.
            Stop::WriteFailed => {
                c.up.clear();
                let _ = c.app.shutdown(Shutdown::Read);
                c.up_done = true;
            }
            Stop::ReadFailed => match &shared {
                // The taker closed with bytes unread (its kernel reset its end): not the last
                // close of a shared connection either.
                Some(carried) => return give_back(c, carried),
                // The application reset its connection: so does the virtual one (dropped with
                // the connection, its unread bytes make it a reset).
                None => {
                    c.up_done = true;
                    c.down_done = true;
                }
            },
        }
    }
    if !c.down_done {
        let (app, vs): (&TcpStream, _) = (&c.app, c.vs.vs());
        // To a shared connection's taker, bytes go only while it holds its end. Its close shows
        // here late on a loaded machine (loopback delivers the FIN in a softirq, which may wait
        // for ksoftirqd), and bytes written meanwhile were lost with the taker's socket: a
        // parent that waited for its spawned child to exit, then sent a request, never saw the
        // answer. The kernel's own answer (the socket orphaned at its last close) is exact.
        let write = |b: &[u8]| {
            if shared.is_some() && taker_holds(app) == Some(false) {
                return Err(io::ErrorKind::BrokenPipe.into());
            }
            (&*app).write(b)
        };
        match forward(&mut c.down, scratch, &COUNTERS.bytes_in, |b| vs.recv(b), write) {
            Stop::Blocked => {}
            Stop::Ended => {
                let _ = c.app.shutdown(Shutdown::Write);
                c.down_done = true;
            }
            // The taker is gone. Bytes it did not get are kept for the owner of a shared
            // connection, given back once what the taker wrote before its close is read (at its
            // end of stream or reset, above), else dropped.
            Stop::WriteFailed => match &shared {
                Some(carried) if c.up_done => give_back(c, carried),
                Some(_) => c.down_done = true,
                None => {
                    c.down.clear();
                    c.down_done = true;
                }
            },
            // The virtual connection was reset: reset the application's too.
            Stop::ReadFailed => {
                reset(&c.app);
                c.down_done = true;
                c.up_done = true;
            }
        }
    }
}

/// The taker closed its end of a shared connection while the owner holds P: the connection goes
/// back to the owner's direct path, with what could not be delivered.
fn give_back(c: &mut Conn, carried: &Arc<Carried>) {
    c.vs.vs().deregister();
    carried.retire_relay(&mut c.down);
    c.up_done = true;
    c.down_done = true;
}

/// Whether a process still holds the other end of `app` (a TCP connection within this host),
/// as the kernel's socket diagnostics tell: a socket is orphaned (inode 0) at its last close,
/// just after its FIN leaves (`LAST_CLOSE_GRACE`), or gone (and `app` closed, when it reset).
/// `None` when the kernel does not say.
fn taker_holds(app: &TcpStream) -> Option<bool> {
    let ours = app.local_addr().ok()?;
    // No peer: `app` is closed (the other end reset it).
    let Ok(theirs) = app.peer_addr() else { return Some(false) };
    let nl = rustix::net::socket_with(
        rustix::net::AddressFamily::NETLINK,
        rustix::net::SocketType::DGRAM,
        rustix::net::SocketFlags::CLOEXEC,
        Some(rustix::net::netlink::SOCK_DIAG),
    )
    .ok()?;
    rustix::net::send(&nl, &diag_request(theirs, ours), rustix::net::SendFlags::empty()).ok()?;
    let mut answer = [0u8; 512];
    let n = rustix::net::recv(&nl, &mut answer, rustix::net::RecvFlags::empty()).ok()?.0;
    diag_answer(&answer[..n])
}

const SOCK_DIAG_BY_FAMILY: u16 = 20;
const NLMSG_ERROR: u16 = 2;
const NLM_F_REQUEST: u16 = 1;
const NLMSG_HEADER: usize = 16;
/// `inet_diag_msg`'s `idiag_inode`: after family, state, timer, retrans (4 bytes), the socket
/// id (48) and expires, rqueue, wqueue, uid (16).
const DIAG_INODE_AT: usize = 68;

/// A `SOCK_DIAG_BY_FAMILY` request for the one TCP socket bound to `local` and connected to
/// `remote` (`nlmsghdr` and `inet_diag_req_v2`, native byte order but for ports and addresses).
fn diag_request(local: SocketAddr, remote: SocketAddr) -> Vec<u8> {
    let family = if local.is_ipv4() { libc::AF_INET } else { libc::AF_INET6 } as u8;
    let addr = |a: SocketAddr| -> [u8; 16] {
        let mut b = [0u8; 16];
        match a.ip() {
            IpAddr::V4(v4) => b[..4].copy_from_slice(&v4.octets()),
            IpAddr::V6(v6) => b = v6.octets(),
        }
        b
    };
    let mut req = Vec::with_capacity(NLMSG_HEADER + 56);
    req.extend_from_slice(&((NLMSG_HEADER + 56) as u32).to_ne_bytes());
    req.extend_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
    req.extend_from_slice(&NLM_F_REQUEST.to_ne_bytes());
    req.extend_from_slice(&[0u8; 8]); // sequence, port id
    req.extend_from_slice(&[family, libc::IPPROTO_TCP as u8, 0, 0]);
    req.extend_from_slice(&u32::MAX.to_ne_bytes()); // every state
    req.extend_from_slice(&local.port().to_be_bytes());
    req.extend_from_slice(&remote.port().to_be_bytes());
    req.extend_from_slice(&addr(local));
    req.extend_from_slice(&addr(remote));
    req.extend_from_slice(&0u32.to_ne_bytes()); // any interface
    req.extend_from_slice(&[0xff; 8]); // no cookie
    req
}

/// Reads the kernel's answer to `diag_request`: whether the socket has an inode (a process holds
/// it); `Some(false)` when no such socket exists (`ENOENT`).
fn diag_answer(answer: &[u8]) -> Option<bool> {
    let kind = u16::from_ne_bytes(answer.get(4..6)?.try_into().ok()?);
    let body = answer.get(NLMSG_HEADER..)?;
    match kind {
        SOCK_DIAG_BY_FAMILY => {
            let inode =
                u32::from_ne_bytes(body.get(DIAG_INODE_AT..DIAG_INODE_AT + 4)?.try_into().ok()?);
            Some(inode != 0)
        }
        NLMSG_ERROR => {
            let errno = i32::from_ne_bytes(body.get(..4)?.try_into().ok()?);
            (errno == -libc::ENOENT).then_some(false)
        }
        _ => None,
    }
}

/// Resets the program's end like TCP when its virtual connection was reset.
fn reset(s: &TcpStream) {
    let _ = rustix::net::sockopt::set_socket_linger(s, Some(Duration::ZERO));
    let _ = s.shutdown(Shutdown::Read);
}

// ---------------------------------------------------------------------------------------------
// The relay listeners (one per address family): the program's end of a relayed connection is a
// loopback connection to one of them, matched by its port to what waits for it here.

/// What waits for a loopback connection from a given address and port. The address counts,
/// not only the port: any local process may connect to the relay listener, and from another
/// loopback address (127.0.0.2) it can bind the port a pending connection holds on 127.0.0.1.
static PENDING: ForkMutex<Option<HashMap<SocketAddr, Held>>> = ForkMutex::new(None);

/// The form `relay_listener` sees the address in (an IPv4 one, not IPv4-mapped).
fn canonical(a: SocketAddr) -> SocketAddr {
    SocketAddr::new(a.ip().to_canonical(), a.port())
}

/// A connection from `from` will come for `held`.
pub(crate) fn expect_held(from: SocketAddr, held: Held) {
    let replaced = PENDING.lock().get_or_insert_with(HashMap::new).insert(canonical(from), held);
    // Dropped without the lock (a connection's drop may take other locks).
    drop(replaced);
}

/// `--path relay`: the program's fd will connect from `from` for `vs`.
pub(crate) fn expect(from: SocketAddr, vs: VSocket) {
    expect_held(from, Held::Own(vs));
}

/// The connect from `from` failed: what waited is dropped (the virtual socket closes).
pub(crate) fn unexpect(from: SocketAddr) {
    let gone = PENDING.lock().get_or_insert_with(HashMap::new).remove(&canonical(from));
    drop(gone);
}

/// The relay listener's address for one family, started on first use.
pub(crate) fn relay_addr(v6: bool) -> Option<SocketAddr> {
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
            let l = TcpListener::from(relocate(OwnedFd::from(l)));
            let addr = l.local_addr().ok()?;
            std::thread::Builder::new()
                .name("nc-relay".into())
                .spawn(move || inside(|| relay_listener(l)))
                .ok()?;
            Some(addr)
        })
    })
}

fn relay_listener(l: TcpListener) {
    loop {
        let Ok(s) = netchannel::sys::tcp_accept(&l) else { continue };
        let Ok(peer) = s.peer_addr() else { continue };
        if !peer.ip().is_loopback() && !is_mapped_loopback(&peer) {
            continue;
        }
        let s = TcpStream::from(relocate(OwnedFd::from(s)));
        let held = PENDING.lock().get_or_insert_with(HashMap::new).remove(&canonical(peer));
        // Anything else knocking on the relay's port is dropped.
        if let Some(held) = held {
            relay(s, held);
        }
    }
}

fn is_mapped_loopback(a: &SocketAddr) -> bool {
    matches!(a, SocketAddr::V6(v6) if v6.ip().to_ipv4_mapped().is_some_and(|ip| ip.is_loopback()))
}

/// A connected loopback TCP pair for a relayed connection: the program's end (returned) and
/// the relay's end, which serves `held`.
pub(crate) fn relayed_pair(held: Held) -> io::Result<OwnedFd> {
    let relay = relay_addr(false).ok_or_else(|| io::Error::other("no relay listener"))?;
    inside(|| {
        let s = rustix::net::socket_with(
            rustix::net::AddressFamily::INET,
            rustix::net::SocketType::STREAM,
            rustix::net::SocketFlags::CLOEXEC,
            None,
        )?;
        rustix::net::bind(&s, &SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0))?;
        let from = crate::connect::local_of(s.as_fd())
            .ok_or_else(|| io::Error::other("relay socket without an address"))?;
        expect_held(from, held);
        if let Err(e) = rustix::net::connect(&s, &relay) {
            unexpect(from);
            return Err(e.into());
        }
        let _ = rustix::net::sockopt::set_tcp_nodelay(&s, true);
        Ok(s)
    })
}

// ---------------------------------------------------------------------------------------------
// Taking a connection over: a process that inherited a placeholder (fork, exec, SCM_RIGHTS)
// connects to its owner's attach socket (abstract AF_UNIX "nc-attach/<owner pid>"), proves
// that it holds the placeholder by sending a copy of it, and gets back the program's end of a
// relayed TCP connection to put under the placeholder's number.

/// The attach socket's name for the process `pid`.
pub(crate) fn attach_name(pid: u32) -> String {
    format!("nc-attach/{pid}")
}

/// Starts the attach socket of this process (once; before its first placeholder exists).
pub(crate) fn start_attach_server() {
    static STARTED: OnceLock<bool> = OnceLock::new();
    STARTED.get_or_init(|| {
        inside(|| {
            let listen = || -> io::Result<OwnedFd> {
                let s = rustix::net::socket_with(
                    rustix::net::AddressFamily::UNIX,
                    rustix::net::SocketType::STREAM,
                    rustix::net::SocketFlags::CLOEXEC,
                    None,
                )?;
                let name = attach_name(crate::process::pid());
                let addr = rustix::net::SocketAddrUnix::new_abstract_name(name.as_bytes())?;
                rustix::net::bind(&s, &addr)?;
                rustix::net::listen(&s, 64)?;
                Ok(relocate(s))
            };
            let serve = |l: OwnedFd| {
                std::thread::Builder::new()
                    .name("nc-attach".into())
                    .spawn(move || inside(|| attach_server(l)))
                    .is_ok()
            };
            match (listen(), crate::process::started_engine()) {
                // Its thread starts with the first taker (a forked or exec'd process, or one
                // given the placeholder): until then the engine's worker watches the socket.
                (Ok(l), Some(engine)) => {
                    engine.when_readable(l, move |l| {
                        serve(l);
                    });
                    true
                }
                (Ok(l), None) => serve(l),
                (Err(_), _) => false,
            }
        })
    });
}

fn attach_server(l: OwnedFd) {
    loop {
        let Ok(conn) = rustix::net::accept_with(&l, rustix::net::SocketFlags::CLOEXEC) else {
            std::thread::sleep(Duration::from_millis(10));
            continue;
        };
        let _ = rustix::net::sockopt::set_socket_timeout(
            &conn,
            rustix::net::sockopt::Timeout::Recv,
            Some(Duration::from_secs(1)),
        );
        let taker = attach_request(&conn);
        // From here until this process's copy of the taker's end is closed, no fork: a child
        // forked meanwhile (a server forking per connection, back to back) kept a copy, and the
        // taker's close then did not end its connection until that child exited.
        let no_fork = taker.is_some().then(|| TAKER_END.lock());
        let answer = taker.and_then(hand_to_relay);
        {
            let (status, fd) = match &answer {
                Some(fd) => (1u8, Some(fd.as_fd())),
                None => (0u8, None),
            };
            let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
            let mut control = rustix::net::SendAncillaryBuffer::new(&mut space);
            let fds;
            if let Some(fd) = fd {
                fds = [fd];
                control.push(rustix::net::SendAncillaryMessage::ScmRights(&fds));
            }
            let _ = rustix::net::sendmsg(
                &conn,
                &[io::IoSlice::new(&[status])],
                &mut control,
                rustix::net::SendFlags::NOSIGNAL,
            );
        }
        // The taker uses its end only once this copy is closed (`inherit::request` waits for
        // the byte after it). Kept open a moment longer (this thread preempted on a loaded
        // machine), it outlived a taker that was quick to exit, and the relay, which asks the
        // kernel whether anyone still holds the taker's end (`taker_holds`), wrote the owner's
        // next answer into it: lost, and the owner's read never returned.
        if answer.is_some() {
            drop(answer);
            drop(no_fork);
            let _ = rustix::net::send(&conn, &[ATTACH_RELEASED], rustix::net::SendFlags::NOSIGNAL);
        }
    }
}

/// Held while the attach thread holds a copy of a taker's end, and across `fork`.
static TAKER_END: ForkMutex<()> = ForkMutex::new(());

/// Sent by the owner after an attach answer once it has closed its own copy of the taker's end.
pub(crate) const ATTACH_RELEASED: u8 = 2;

/// Reads an attach request (connection id and a copy of its placeholder): the connection, or
/// `None` when the request does not prove it holds that connection's placeholder.
fn attach_request(conn: &OwnedFd) -> Option<Arc<Carried>> {
    let mut id = [0u8; 8];
    let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = rustix::net::RecvAncillaryBuffer::new(&mut space);
    let got = rustix::net::recvmsg(
        conn,
        &mut [io::IoSliceMut::new(&mut id)],
        &mut control,
        rustix::net::RecvFlags::CMSG_CLOEXEC,
    )
    .ok()?;
    let mut proof = None;
    for msg in control.drain() {
        if let rustix::net::RecvAncillaryMessage::ScmRights(fds) = msg {
            for fd in fds {
                proof.get_or_insert(fd);
            }
        }
    }
    if got.bytes != 8 {
        return None;
    }
    let c = crate::carried::registered(u64::from_ne_bytes(id))?;
    c.is_placeholder(proof?.as_fd()).then_some(c)
}

/// Hands a connection a taker proved it holds to a relay loop: the program's end.
fn hand_to_relay(c: Arc<Carried>) -> Option<OwnedFd> {
    c.hand_over();
    let local = c.local;
    let end = relayed_pair(Held::Shared(c)).ok()?;
    crate::process::bump(&COUNTERS.relayed_inherited);
    crate::listen::taken_over_from(local);
    Some(end)
}

// ---------------------------------------------------------------------------------------------
// `--path relay`: the program's fd is a loopback connection; `getpeername` reports the virtual
// peer instead of the relay listener.

static RELAYED_PEERS: ForkMutex<Option<HashMap<std::ffi::c_int, SocketAddr>>> =
    ForkMutex::new(None);

/// Takes the relay's address books (a forked child closes and connects through them) and the
/// taker-end lock until `forklock::release_held` (`interpose::fork_prepare`).
pub(crate) fn hold_across_fork() {
    TAKER_END.hold_across_fork();
    PENDING.hold_across_fork();
    RELAYED_PEERS.hold_across_fork();
}

pub(crate) fn note_relayed_peer(fd: std::ffi::c_int, peer: SocketAddr) {
    RELAYED_PEERS.lock().get_or_insert_with(HashMap::new).insert(fd, peer);
    crate::table::set_bits(fd, crate::table::RELAYED);
}

pub(crate) fn relayed_peer(fd: std::ffi::c_int) -> Option<SocketAddr> {
    RELAYED_PEERS.lock().get_or_insert_with(HashMap::new).get(&fd).copied()
}

pub(crate) fn forget_relayed(fd: std::ffi::c_int) {
    crate::table::clear_bits(fd, crate::table::RELAYED);
    RELAYED_PEERS.lock().get_or_insert_with(HashMap::new).remove(&fd);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    /// The kernel tells a held end from one its holder closed at once, whether or not its FIN
    /// has arrived, and from one that is gone.
    #[test]
    fn taker_holds_follows_the_other_end_of_a_loopback_connection() {
        for local in ["127.0.0.1:0", "[::1]:0"] {
            let Ok(l) = TcpListener::bind(local) else { continue };
            let ours = TcpStream::connect(l.local_addr().unwrap()).unwrap();
            let (theirs, _) = l.accept().unwrap();
            assert_eq!(taker_holds(&ours), Some(true), "{local}");
            // A copy held elsewhere keeps it held (a child of the taker).
            let copy = theirs.try_clone().unwrap();
            drop(theirs);
            assert_eq!(taker_holds(&ours), Some(true), "{local}");
            // Bytes it never reads: its close resets, and the socket goes at once.
            ours.set_nodelay(true).unwrap();
            (&ours).write_all(b"unread").unwrap();
            std::thread::sleep(Duration::from_millis(20));
            drop(copy);
            assert_eq!(taker_holds(&ours), Some(false), "{local}");
        }
        // A clean close leaves an orphan (FIN_WAIT, then TIME_WAIT), not held either.
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let ours = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (theirs, _) = l.accept().unwrap();
        drop(theirs);
        assert_eq!(taker_holds(&ours), Some(false));
        // A request for a socket that does not exist: gone.
        let (a, b) = (ours.local_addr().unwrap(), SocketAddr::from(([127, 0, 0, 1], 9)));
        let mut answer = [0u8; 512];
        let nl = rustix::net::socket_with(
            rustix::net::AddressFamily::NETLINK,
            rustix::net::SocketType::DGRAM,
            rustix::net::SocketFlags::CLOEXEC,
            Some(rustix::net::netlink::SOCK_DIAG),
        )
        .unwrap();
        rustix::net::send(&nl, &diag_request(b, a), rustix::net::SendFlags::empty()).unwrap();
        let n = rustix::net::recv(&nl, &mut answer, rustix::net::RecvFlags::empty()).unwrap().0;
        assert_eq!(diag_answer(&answer[..n]), Some(false));
        assert_eq!(diag_answer(&[0u8; 3]), None);
    }
}
