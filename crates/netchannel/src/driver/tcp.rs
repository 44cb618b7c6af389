//! The TCP transport: one channel = one kernel TCP connection, and its handshake.
//!
//! The dialer runs the handshake blocking (with a timeout) on the thread that dials. The
//! acceptor runs it as a non-blocking state machine ([`Incoming`]) that the engine's acceptor
//! thread drives for many connections at once, so a silent or slow peer costs neither a thread
//! nor a wait.

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::os::fd::{AsFd, BorrowedFd};
use std::time::{Duration, Instant};

use super::Transport;
use crate::proto::ChannelId;
use crate::sys;
use crate::wire::handshake::{check_prefix, FLAG_AUTH, HANDSHAKE_LEN};
use crate::wire::{Class, Handshake, HandshakeKind, RejectReason, WireError};

/// Socket options every channel gets.
#[derive(Debug, Clone)]
pub struct TcpOptions {
    /// Liveness: an idle channel is probed after this long without traffic (`TCP_KEEPIDLE`),
    /// then every `keepalive_interval`, `keepalive_count` times. (A busy one is watched by the
    /// engine: `SessionRt::black_holed`.)
    pub keepalive_idle: Duration,
    /// Time between keepalive probes.
    pub keepalive_interval: Duration,
    /// Unanswered probes before the channel fails.
    pub keepalive_count: u32,
    /// Unsent bytes the kernel may hold per channel (`TCP_NOTSENT_LOWAT`): the rest waits in
    /// user space, where the scheduler still decides.
    pub notsent_lowat: u32,
    /// The same for latency-class channels (small: nothing queues in front of an RPC).
    pub latency_notsent_lowat: u32,
    /// `SO_PRIORITY` of latency-class channels (used by qdiscs on real NICs).
    pub latency_priority: i32,
    /// Congestion control algorithms in order of preference (`Config::congestion`).
    pub congestion: Vec<String>,
    /// Source address of dialed channels (`Config::dial_source`).
    pub dial_source: Option<std::net::IpAddr>,
}

/// Sets the first algorithm of `preferred` the kernel accepts (one not built in, or not in
/// `net.ipv4.tcp_allowed_congestion_control` for an unprivileged process, is refused); none
/// leaves the host's default. Stats read back what the socket got.
fn set_congestion(fd: BorrowedFd<'_>, preferred: &[String]) {
    for name in preferred {
        if rustix::net::sockopt::set_tcp_congestion(fd, name).is_ok() {
            return;
        }
    }
}

/// A channel's kernel TCP connection. A forked child gets no copy (`sys::ShedOnFork`): the
/// channel ends when this process's engine does.
pub struct TcpTransport(sys::ShedOnFork<TcpStream>);

impl Transport for TcpTransport {
    fn fd(&self) -> BorrowedFd<'_> {
        self.0.as_fd()
    }

    fn shutdown(&self) {
        let _ = self.0.shutdown(Shutdown::Both);
    }
}

impl TcpTransport {
    pub fn new(sock: TcpStream) -> Self {
        TcpTransport(sys::ShedOnFork::new(sock))
    }
}

/// Applies the channel options for `class`.
pub fn configure(sock: &TcpStream, class: Class, opts: &TcpOptions) -> io::Result<()> {
    sock.set_nodelay(true)?;
    let secs = |d: Duration| d.as_secs().clamp(1, i32::MAX as u64) as i32;
    let fd = sock.as_fd();
    sys::set_int_sockopt(fd, libc::SOL_SOCKET, libc::SO_KEEPALIVE, 1)?;
    sys::set_int_sockopt(fd, libc::IPPROTO_TCP, libc::TCP_KEEPIDLE, secs(opts.keepalive_idle))?;
    let interval = secs(opts.keepalive_interval);
    sys::set_int_sockopt(fd, libc::IPPROTO_TCP, libc::TCP_KEEPINTVL, interval)?;
    let count = opts.keepalive_count.clamp(1, 127) as i32;
    sys::set_int_sockopt(fd, libc::IPPROTO_TCP, libc::TCP_KEEPCNT, count)?;
    let lowat = match class {
        Class::Throughput => opts.notsent_lowat,
        Class::Latency => opts.latency_notsent_lowat,
    };
    sys::set_int_sockopt(
        sock.as_fd(),
        libc::IPPROTO_TCP,
        libc::TCP_NOTSENT_LOWAT,
        lowat.min(i32::MAX as u32) as i32,
    )?;
    set_congestion(fd, &opts.congestion);
    if class == Class::Latency && opts.latency_priority != 0 {
        // Best effort: priorities above 6 need CAP_NET_ADMIN.
        let _ = sys::set_int_sockopt(
            sock.as_fd(),
            libc::SOL_SOCKET,
            libc::SO_PRIORITY,
            opts.latency_priority,
        );
    }
    Ok(())
}

fn refused(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::ConnectionRefused, msg)
}

/// An acceptor's refusal of a channel, with its reason (the inner error of the `io::Error`
/// `dial` returns, `ConnectionRefused`).
#[derive(Debug)]
pub struct Refused {
    pub reason: RejectReason,
    message: String,
}

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Refused {}

/// Whether `e` is an acceptor's refusal at one of its resource limits (handshakes in
/// progress, channels, sessions): a busy acceptor, which a later try may find with room, as a
/// TCP client retries a SYN that a full backlog dropped.
pub fn refused_at_limit(e: &io::Error) -> bool {
    e.get_ref()
        .and_then(|inner| inner.downcast_ref::<Refused>())
        .is_some_and(|r| r.reason == RejectReason::Limit)
}

/// Reads exactly `buf.len()` bytes by `deadline` (one timeout for the whole read, not per
/// byte: a peer that dribbles a byte at a time cannot stretch it).
fn read_by(sock: &mut TcpStream, buf: &mut [u8], deadline: Instant) -> io::Result<()> {
    let mut got = 0;
    while got < buf.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "handshake deadline passed"));
        }
        sock.set_read_timeout(Some(left))?;
        match sock.read(&mut buf[got..]) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Writes all of `buf` by `deadline`.
fn write_by(sock: &mut TcpStream, buf: &[u8], deadline: Instant) -> io::Result<()> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(io::Error::new(io::ErrorKind::TimedOut, "handshake deadline passed"));
    }
    sock.set_write_timeout(Some(left))?;
    sock.write_all(buf)
}

/// Reads one handshake message, naming a peer of another protocol version from the first six
/// bytes (its messages have another size).
fn read_message(
    sock: &mut TcpStream,
    addr: SocketAddr,
    deadline: Instant,
) -> io::Result<Handshake> {
    let mut buf = [0u8; HANDSHAKE_LEN];
    let map_io = |e: io::Error| match e.kind() {
        io::ErrorKind::UnexpectedEof | io::ErrorKind::ConnectionReset => {
            refused(format!("engine at {addr} closed the channel during the handshake"))
        }
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => io::Error::new(
            io::ErrorKind::TimedOut,
            format!("engine at {addr} did not answer the channel handshake"),
        ),
        _ => e,
    };
    read_by(sock, &mut buf[..6], deadline).map_err(map_io)?;
    check_prefix(buf[..6].try_into().expect("6 bytes")).map_err(|e| match e {
        WireError::UnsupportedVersion(_) => refused(format!("engine at {addr}: {e}")),
        e => io::Error::new(io::ErrorKind::InvalidData, format!("engine at {addr}: {e}")),
    })?;
    read_by(sock, &mut buf[6..], deadline).map_err(map_io)?;
    Handshake::decode(&buf)
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, format!("engine at {addr}: {e}")))
}

/// Dials a peer engine's channel listener and performs the handshake (the `create` of the
/// paper's API, dial side), all of it within `timeout` (connect and every message: a peer that
/// answers a byte at a time cannot hold the dial longer). Fails with `ConnectionRefused` when
/// nothing listens, the peer refuses or speaks another version, `PermissionDenied` when
/// authentication fails either way, `InvalidData` when the peer is not an engine (or is this
/// engine itself), `TimedOut` when it is silent or slow. Returns the socket (non-blocking) and
/// the acceptor's engine id.
#[allow(clippy::too_many_arguments)]
pub fn dial(
    addr: SocketAddr,
    engine_id: u64,
    channel: ChannelId,
    class: Class,
    key: Option<&[u8]>,
    timeout: Duration,
    opts: &TcpOptions,
) -> io::Result<(TcpStream, u64)> {
    let deadline = Instant::now() + timeout;
    let mut sock = sys::tcp_connect(&addr, opts.dial_source, timeout)?;
    configure(&sock, class, opts)?;
    let (index, incarnation) = (channel.index, channel.incarnation);
    let nonce = sys::random_bytes();
    let hello = Handshake::hello(engine_id, index, incarnation, class, nonce, key.is_some());
    // Without a key the Confirm depends on the Hello alone: both go at once, and the handshake
    // takes one round trip (the acceptor reads the Confirm after answering the Hello).
    let early_confirm = key.is_none().then(|| Handshake::confirm_unkeyed(&hello));
    match &early_confirm {
        Some(confirm) => {
            let mut both = [0u8; 2 * HANDSHAKE_LEN];
            both[..HANDSHAKE_LEN].copy_from_slice(&hello.encode());
            both[HANDSHAKE_LEN..].copy_from_slice(&confirm.encode());
            write_by(&mut sock, &both, deadline)?;
        }
        None => write_by(&mut sock, &hello.encode(), deadline)?,
    }
    let denied = |msg: String| io::Error::new(io::ErrorKind::PermissionDenied, msg);
    let challenge = expect(&mut sock, addr, HandshakeKind::Challenge, deadline)?;
    if crate::wire::handshake::same_engine(challenge.engine_id, engine_id) {
        // A connection to ourselves, or our own messages reflected back by a machine in the
        // middle: never a channel.
        let _ = write_by(
            &mut sock,
            &Handshake::reject(engine_id, RejectReason::BadField).encode(),
            deadline,
        );
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("engine at {addr} answered with this engine's own id (a self-connection or a reflection)"),
        ));
    }
    if key.is_none() && challenge.flags & FLAG_AUTH != 0 {
        let reject = Handshake::reject(engine_id, RejectReason::AuthFailed);
        let _ = write_by(&mut sock, &reject.encode(), deadline);
        return Err(denied(format!(
            "engine at {addr} requires authentication: configure the pre-shared key"
        )));
    }
    if early_confirm.is_none() {
        let confirm = Handshake::confirm(&hello, &challenge, key, addr);
        write_by(&mut sock, &confirm.encode(), deadline)?;
    }
    let accept = expect(&mut sock, addr, HandshakeKind::Accept, deadline)?;
    if accept.channel != index || accept.incarnation != incarnation || accept.class != class {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("engine at {addr} accepted another channel than the one dialed"),
        ));
    }
    if let Some(k) = key {
        if !Handshake::verify_accept(k, &hello, &challenge, &accept, addr) {
            return Err(denied(format!(
                "engine at {addr} did not prove the pre-shared key for this address (it has \
                 none or another, or the answer was relayed from elsewhere)"
            )));
        }
    }
    sock.set_read_timeout(None)?;
    sock.set_write_timeout(None)?;
    sock.set_nonblocking(true)?;
    Ok((sock, challenge.engine_id))
}

/// Reads the next handshake message and checks it is of `kind`, mapping a reject to the error
/// a TCP user expects.
fn expect(
    sock: &mut TcpStream,
    addr: SocketAddr,
    kind: HandshakeKind,
    deadline: Instant,
) -> io::Result<Handshake> {
    let m = read_message(sock, addr, deadline)?;
    match m.kind {
        k if k == kind => Ok(m),
        HandshakeKind::Reject(RejectReason::AuthFailed) => Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!("engine at {addr} refused the channel: authentication failed"),
        )),
        HandshakeKind::Reject(reason) => {
            let message = format!("engine at {addr} refused the channel: {reason}");
            Err(io::Error::new(io::ErrorKind::ConnectionRefused, Refused { reason, message }))
        }
        other => Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("engine at {addr} answered with {other:?} where {kind:?} was due"),
        )),
    }
}

/// The accepting side of one channel handshake, driven without blocking.
pub struct Incoming {
    pub sock: TcpStream,
    pub peer: Option<SocketAddr>,
    pub deadline: Instant,
    /// The address the dialer reached this engine at, as the transcript binds it: the
    /// engine's advertised address if it has one (address translation in between), else the
    /// socket's own local address.
    pub acceptor: SocketAddr,
    buf: [u8; HANDSHAKE_LEN],
    have: usize,
    /// The hello and our challenge, once sent.
    sent: Option<(Handshake, Handshake)>,
}

/// Answers a dialer with a Reject for `reason`, before the socket is closed. What the dialer
/// sent and nobody read (its Hello, a Confirm sent with it) is read and dropped, and the write
/// half shut, so that the close is a FIN after the Reject rather than a reset. (Linux's dialer
/// still reads the Reject before a reset that follows it; the reason matters to its backoff,
/// and a reset is not what a refusal should look like on the wire.)
pub fn reject(sock: &TcpStream, local: u64, reason: RejectReason) {
    let _ = (&*sock).write(&Handshake::reject(local, reason).encode());
    let _ = sock.shutdown(Shutdown::Write);
    // Without waiting, and a few reads at most: a dialer that keeps sending holds nothing up.
    let mut rest = [0u8; 2 * HANDSHAKE_LEN];
    for _ in 0..4 {
        match rustix::net::recv(sock, &mut rest, rustix::net::RecvFlags::DONTWAIT) {
            Ok((n, _)) if n > 0 => {}
            _ => break,
        }
    }
}

/// Where an [`Incoming`] handshake stands.
pub enum Progress {
    /// Waiting for more bytes.
    Pending,
    /// The dialer proved what it had to; call [`Incoming::admit`] or [`Incoming::refuse`].
    Confirmed(Handshake),
    /// Refused (a reject was sent when the peer deserved an answer); the reason for the stats.
    Failed(String),
}

impl Incoming {
    pub fn new(
        sock: TcpStream,
        timeout: Duration,
        advertised: Option<SocketAddr>,
    ) -> io::Result<Self> {
        sock.set_nonblocking(true)?;
        let peer = sock.peer_addr().ok();
        let acceptor = match advertised {
            Some(a) => a,
            None => sock.local_addr()?,
        };
        Ok(Incoming {
            sock,
            peer,
            acceptor,
            deadline: Instant::now() + timeout,
            buf: [0; HANDSHAKE_LEN],
            have: 0,
            sent: None,
        })
    }

    pub fn fd(&self) -> BorrowedFd<'_> {
        self.sock.as_fd()
    }

    fn reject(&mut self, local: u64, reason: RejectReason, why: String) -> Progress {
        self.refuse(local, reason);
        Progress::Failed(why)
    }

    /// Reads what arrived and advances the handshake. `key`: the pre-shared key, if any.
    /// `check_hello` may refuse a hello before anything is answered (limits, duplicates).
    pub fn advance(
        &mut self,
        local: u64,
        key: Option<&[u8]>,
        opts: &TcpOptions,
        check_hello: &mut dyn FnMut(&Handshake) -> Result<(), RejectReason>,
    ) -> Progress {
        loop {
            match (&self.sock).read(&mut self.buf[self.have..]) {
                Ok(0) => {
                    return Progress::Failed("closed by the dialer during the handshake".into())
                }
                Ok(n) => self.have += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Progress::Pending,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Progress::Failed(format!("handshake i/o error: {e}")),
            }
            if self.have >= 6 {
                if let Err(e) = check_prefix(self.buf[..6].try_into().expect("6 bytes")) {
                    let why = format!("handshake refused: {e}");
                    return self.reject(local, Handshake::reject_reason(&e), why);
                }
            }
            if self.have < HANDSHAKE_LEN {
                continue;
            }
            self.have = 0;
            let msg = match Handshake::decode(&self.buf) {
                Ok(m) => m,
                Err(e) => {
                    let why = format!("handshake refused: {e}");
                    return self.reject(local, RejectReason::BadField, why);
                }
            };
            match (self.sent, msg.kind) {
                (None, HandshakeKind::Hello) => {
                    if crate::wire::handshake::same_engine(msg.engine_id, local) {
                        // Our own id (or a shard's): a connection to ourselves, or our Hello
                        // reflected back.
                        let why = "channel refused: the dialer claims this engine's id".into();
                        return self.reject(local, RejectReason::BadField, why);
                    }
                    if let Err(reason) = check_hello(&msg) {
                        return self.reject(local, reason, format!("channel refused: {reason}"));
                    }
                    if let Err(e) = configure(&self.sock, msg.class, opts) {
                        return Progress::Failed(format!("cannot configure channel: {e}"));
                    }
                    let challenge =
                        Handshake::challenge(local, &msg, sys::random_bytes(), key.is_some());
                    // 72 bytes into an empty socket buffer: a short write means a broken peer.
                    match (&self.sock).write(&challenge.encode()) {
                        Ok(HANDSHAKE_LEN) => self.sent = Some((msg, challenge)),
                        _ => return Progress::Failed("cannot answer the handshake".into()),
                    }
                }
                (Some((hello, challenge)), HandshakeKind::Confirm) => {
                    if let Some(k) = key {
                        let at = self.acceptor;
                        if !Handshake::verify_confirm(k, &hello, &challenge, &msg, at) {
                            return self.reject(
                                local,
                                RejectReason::AuthFailed,
                                "handshake refused: authentication failed".into(),
                            );
                        }
                    }
                    return Progress::Confirmed(hello);
                }
                (_, HandshakeKind::Reject(r)) => {
                    return Progress::Failed(format!("the dialer gave up: {r}"));
                }
                (_, kind) => {
                    let why = format!("handshake refused: unexpected {kind:?}");
                    return self.reject(local, RejectReason::BadField, why);
                }
            }
        }
    }

    /// Admits the channel: sends `Accept` (with the acceptor's proof) and returns the socket.
    pub fn admit(self, key: Option<&[u8]>) -> io::Result<TcpStream> {
        let (hello, challenge) = self.sent.ok_or_else(|| io::Error::other("not confirmed"))?;
        let accept = Handshake::accept(&hello, &challenge, key, self.acceptor);
        match (&self.sock).write(&accept.encode()) {
            Ok(HANDSHAKE_LEN) => Ok(self.sock),
            Ok(_) => Err(io::Error::other("short write of the handshake")),
            Err(e) => Err(e),
        }
    }

    /// Refuses the dialer (a limit, a duplicate channel index) with `reason` (see [`reject`]).
    pub fn refuse(&mut self, local: u64, reason: RejectReason) {
        reject(&self.sock, local, reason);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options() -> TcpOptions {
        TcpOptions {
            keepalive_idle: Duration::from_secs(10),
            keepalive_interval: Duration::from_secs(2),
            keepalive_count: 3,
            notsent_lowat: 1 << 20,
            latency_notsent_lowat: 16 << 10,
            latency_priority: 6,
            congestion: Vec::new(),
            dial_source: None,
        }
    }

    /// Without a key the dialer's Confirm goes with its Hello: an acceptor that answers
    /// nothing until it holds both still gets them, and the handshake takes one round trip.
    #[test]
    fn a_dialer_without_a_key_sends_its_confirm_with_its_hello() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let acceptor = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            let mut both = [0u8; 2 * HANDSHAKE_LEN];
            s.read_exact(&mut both).expect("Hello and Confirm before any answer");
            let message = |at: usize| {
                let bytes: &[u8; HANDSHAKE_LEN] = both[at..at + HANDSHAKE_LEN].try_into().unwrap();
                Handshake::decode(bytes).unwrap()
            };
            let (hello, confirm) = (message(0), message(HANDSHAKE_LEN));
            assert_eq!((hello.kind, confirm.kind), (HandshakeKind::Hello, HandshakeKind::Confirm));
            let challenge = Handshake::challenge(0x77, &hello, [1; 16], false);
            s.write_all(&challenge.encode()).unwrap();
            s.write_all(&Handshake::accept(&hello, &challenge, None, addr).encode()).unwrap();
            s
        });
        let channel = ChannelId::new(0, 0);
        let timeout = Duration::from_secs(5);
        let dialed = dial(addr, 0x11, channel, Class::Throughput, None, timeout, &options());
        let (_sock, peer) = dialed.unwrap();
        assert_eq!(peer, 0x77);
        drop(acceptor.join().unwrap());
    }

    /// A dialer refused after its Hello (and the Confirm sent with it) reads the Reject's
    /// reason: its backoff at a busy acceptor depends on it.
    #[test]
    fn a_refused_dialer_reads_the_reason_not_a_reset() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let acceptor = std::thread::spawn(move || {
            let (s, _) = l.accept().unwrap();
            // Both messages are in before the refusal.
            std::thread::sleep(Duration::from_millis(50));
            reject(&s, 0x77, RejectReason::Limit);
        });
        let channel = ChannelId::new(0, 0);
        let timeout = Duration::from_secs(5);
        let e = dial(addr, 0x11, channel, Class::Throughput, None, timeout, &options())
            .expect_err("refused");
        acceptor.join().unwrap();
        assert!(refused_at_limit(&e), "{e:?}");
    }
}
