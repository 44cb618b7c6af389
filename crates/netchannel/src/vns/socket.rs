//! The application API: [`VSocket`] (a virtual stream socket) and [`Listener`].
//!
//! Semantics follow TCP: reliable, ordered bytes; `recv` returns 0 at end of stream after the
//! peer's `shutdown`; `close` with unread data resets the peer; errors use the `io::ErrorKind`
//! a TCP user expects. Both blocking and non-blocking modes work; in non-blocking mode use a
//! [`Poller`] (or the readiness fd in epoll/mio) and call until `WouldBlock` (edge-triggered,
//! spurious wake-ups possible), exactly as with a non-blocking kernel socket.
//!
//! Copies: `send` copies the caller's bytes once, into the stream's send buffer (they stay
//! there until the peer acknowledges them, so a lost channel loses nothing); the kernel then
//! copies them into the channel socket. `recv` copies small messages once, out of the buffer
//! the channel was read into; large payloads are read by the kernel straight into the caller's
//! buffer (direct placement: no user-space copy) when the reader is at hand as the payload
//! arrives, and are otherwise staged and copied out once as small ones are (ARCHITECTURE.md,
//! "Copies per byte").

use std::cell::Cell;
use std::io;
use std::net::SocketAddr;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use bytes::Bytes;

use super::poller::Poller;
use crate::engine::listener::ListenerShared;
use crate::engine::readiness::{PollEntry, ReadinessObserver, StreamUser};
use crate::engine::session::{Core, SessionRt};
use crate::engine::waiter::{self, Watch};
use crate::engine::{EngineCtx, SocketStats};
use crate::proto::{
    ChannelId, OpenError, Phase, Recv, ResetCause, SendError, StreamId, EV_READ, EV_WRITE,
};
use crate::sys::SignalPolicy;
use crate::wire::{Class, RstReason};

/// Writes at least this large are copied into the send buffer outside the session lock.
const COPY_OUTSIDE_LOCK: usize = 64 * 1024;

fn reset_error(cause: ResetCause) -> io::Error {
    use io::ErrorKind::*;
    let (kind, msg) = match cause {
        ResetCause::Peer(RstReason::NoListener) => {
            (ConnectionRefused, "no listener on that virtual port at the peer")
        }
        ResetCause::Peer(RstReason::Refused) => (ConnectionRefused, "the peer refused the stream"),
        ResetCause::Peer(RstReason::TimedOut) => (TimedOut, "the peer timed the stream out"),
        ResetCause::Peer(_) => (ConnectionReset, "connection reset by peer"),
        ResetCause::ChannelLost => (ConnectionReset, "every channel to the peer was lost"),
        ResetCause::ConnectTimeout => (TimedOut, "the peer did not answer in time"),
        ResetCause::ConnectAborted => (ConnectionReset, "the connect was given up"),
        ResetCause::EngineShutdown => (ConnectionAborted, "the local engine shut down"),
        ResetCause::LocalAbort => (ConnectionAborted, "the socket was aborted"),
        ResetCause::ProtocolError => (ConnectionReset, "the peer broke the protocol"),
        ResetCause::Undeliverable => (TimedOut, "bytes could not be delivered in time"),
    };
    io::Error::new(kind, msg)
}

thread_local! {
    /// `recv`'s list of the slices it copies out, kept between calls: one allocation per
    /// thread, not one per read.
    static RECV_SLICES: Cell<Vec<Bytes>> = const { Cell::new(Vec::new()) };
}

/// `WouldBlock`, without a message: a non-blocking socket returns it on every empty read or
/// full write, and an error with a message is an allocation (two) each time.
fn would_block() -> io::Error {
    io::ErrorKind::WouldBlock.into()
}

fn send_error(e: SendError) -> io::Error {
    match e {
        SendError::Reset(cause) => reset_error(cause),
        SendError::WriteClosed => {
            io::Error::new(io::ErrorKind::BrokenPipe, "the write half is shut down")
        }
        // The peer's window or the channels are full: as from a TCP socket.
        SendError::NoCredit | SendError::NoSpace => would_block(),
        SendError::NotOpen => io::Error::new(io::ErrorKind::WouldBlock, "still connecting"),
        SendError::Closed => io::Error::new(io::ErrorKind::NotConnected, "the socket is closed"),
    }
}

fn closed() -> io::Error {
    io::Error::new(io::ErrorKind::NotConnected, "the socket is closed")
}

fn timeout_from(ns: &AtomicU64) -> Option<Instant> {
    match ns.load(Ordering::Relaxed) {
        0 => None,
        n => Some(Instant::now() + Duration::from_nanos(n)),
    }
}

fn store_timeout(ns: &AtomicU64, t: Option<Duration>) -> io::Result<()> {
    match t {
        Some(d) if d.is_zero() => {
            Err(io::Error::new(io::ErrorKind::InvalidInput, "a zero timeout is not allowed"))
        }
        Some(d) => {
            ns.store(d.as_nanos().min(u64::MAX as u128) as u64, Ordering::Relaxed);
            Ok(())
        }
        None => {
            ns.store(0, Ordering::Relaxed);
            Ok(())
        }
    }
}

/// A virtual socket's readiness ([`VSocket::readiness`]), in the terms of a TCP socket's
/// poll bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Readiness {
    /// `recv` returns without waiting (data, end of stream or an error): `POLLIN`.
    pub readable: bool,
    /// `send` takes bytes or fails without waiting: `POLLOUT`.
    pub writable: bool,
    /// The peer accepted the connection.
    pub connected: bool,
    /// The peer's FIN arrived, and every byte before it (they may still be unread): `POLLRDHUP`.
    pub peer_finished: bool,
    /// This side's write half is shut down.
    pub write_closed: bool,
    /// This side's read half is shut down (`shutdown_read`).
    pub read_closed: bool,
    /// The connection failed: the error `recv` and `send` report (`POLLERR`).
    pub error: Option<io::ErrorKind>,
    /// Bytes `recv` returns now at least (`FIONREAD`): in order, not those that arrived ahead of
    /// a gap, nor those of a payload not yet out of its channel's socket beyond the first.
    pub unread: u64,
    /// The peer's urgent byte waits to be read out of band (`POLLPRI`; see `recv_urgent`).
    pub urgent: bool,
}

/// What one read attempt (`VSocket::try_recv`) found.
enum Attempt {
    /// This many bytes (0: end of stream).
    Read(usize),
    /// Nothing yet.
    Nothing,
    /// An urgent byte kept out of the stream was dropped: read again.
    Again,
}

/// A virtual stream socket. Usable from several threads at once (`&self` methods).
pub struct VSocket {
    session: Arc<SessionRt>,
    id: StreamId,
    nonblocking: AtomicBool,
    closed: AtomicBool,
    read_timeout_ns: AtomicU64,
    write_timeout_ns: AtomicU64,
    /// The private poller behind `readiness_fd`.
    own_poller: OnceLock<Poller>,
    /// Counted in the engine's open latency-class sockets (isolation is on while any is).
    latency: AtomicBool,
    /// An observer mirrors its readiness to a program (`set_observer`): "readable" must mean a
    /// read finds bytes, so a read waits for a channel's busy receive half, and for a payload
    /// the engine is staging, rather than report nothing (the Rust API's readers just retry).
    observed: AtomicBool,
}

impl VSocket {
    pub(crate) fn wrap(session: Arc<SessionRt>, id: StreamId, class: Class) -> VSocket {
        let sock = VSocket {
            session,
            id,
            nonblocking: AtomicBool::new(false),
            closed: AtomicBool::new(false),
            read_timeout_ns: AtomicU64::new(0),
            write_timeout_ns: AtomicU64::new(0),
            own_poller: OnceLock::new(),
            latency: AtomicBool::new(false),
            observed: AtomicBool::new(false),
        };
        sock.count_class(class);
        sock
    }

    /// Keeps the engine's count of open latency-class sockets.
    fn count_class(&self, class: Class) {
        let latency = class == Class::Latency;
        if self.latency.swap(latency, Ordering::AcqRel) != latency {
            let ctx = &self.session.ctx;
            let before = if latency {
                ctx.latency_sockets.fetch_add(1, Ordering::AcqRel)
            } else {
                ctx.latency_sockets.fetch_sub(1, Ordering::AcqRel)
            };
            // The first latency socket opened or the last closed: workers re-apply their
            // scheduling now rather than at their next wake-up.
            if before == usize::from(!latency) {
                for w in &ctx.workers {
                    w.nudge();
                }
            }
        }
    }

    pub(crate) fn connect(
        session: Arc<SessionRt>,
        port: u16,
        class: Class,
        wait: bool,
    ) -> io::Result<VSocket> {
        let now = Instant::now();
        let id = {
            let mut core = session.core();
            let thread = Some(waiter::thread_number());
            core.open_from(port, class, StreamUser::default(), now, thread).map_err(
                |e| match e {
                    OpenError::Limit => io::Error::other(format!(
                        "virtual socket limit reached ({} open to {})",
                        core.stream_count(),
                        session.peer_addr
                    )),
                    OpenError::NoChannels => io::Error::new(
                        io::ErrorKind::ConnectionReset,
                        format!("every channel to {} is lost", session.peer_addr),
                    ),
                },
            )?
        };
        session.timers_changed();
        let sock = VSocket::wrap(session, id, class);
        if waiter::send_now(&sock.session, class, sock.id.0, 0, false) {
            sock.session.transmit(class);
        }
        if wait {
            sock.wait_open_until(now, sock.session.ctx.config.connect_timeout)?;
        }
        Ok(sock)
    }

    /// Waits up to `within` for the peer to accept a socket opened with `connect_nonblocking`
    /// (serving the channels meanwhile): `Ok` once it is open, its refusal or reset, or a
    /// `TimedOut` error that `is_unanswered_open` recognises (the socket is still opening;
    /// dropping it gives up). A shorter wait than `Config::connect_timeout` lets a caller fall
    /// back to something else while the open itself may wait longer.
    pub fn wait_open(&self, within: Duration) -> io::Result<()> {
        self.wait_open_until(Instant::now(), within)
    }

    fn wait_open_until(&self, from: Instant, within: Duration) -> io::Result<()> {
        let id = self.id;
        self.wait_for(EV_WRITE, Some(from + within), |core| {
            let s = core.stream(id)?;
            match (s.reset, s.phase) {
                (Some(cause), _) => Some(Err(reset_error(cause))),
                (None, Phase::Open) => Some(Ok(())),
                _ => None,
            }
        })
        .map_err(|e| {
            if e.kind() == io::ErrorKind::TimedOut {
                let peer = self.session.peer_addr;
                io::Error::new(io::ErrorKind::TimedOut, UnansweredOpen { peer, waited: within })
            } else {
                e
            }
        })
    }

    /// The socket's id in its session (as `SocketStats::id` shows it).
    pub fn id(&self) -> u64 {
        self.id.get()
    }

    /// The virtual port this socket was opened to (or accepted on).
    pub fn port(&self) -> u16 {
        self.session.core().stream(self.id).map_or(0, |s| s.port)
    }

    /// The channel address of the peer engine.
    pub fn peer_engine_addr(&self) -> SocketAddr {
        self.session.peer_addr
    }

    /// The local address of one of the channels carrying it: the address this host uses
    /// towards the peer (what a TCP socket's `getsockname` would name).
    pub fn local_channel_addr(&self) -> Option<SocketAddr> {
        let ch = self.session.channels().into_iter().next()?;
        crate::sys::local_addr(ch.fd())
    }

    /// Its traffic class.
    pub fn class(&self) -> Class {
        self.session.core().stream(self.id).map_or(Class::Throughput, |s| s.class)
    }

    /// Moves the socket to another class: its next chunks use that class's channels.
    pub fn set_class(&self, class: Class) {
        self.session.core().handle(self.id).set_class(class);
        if class == Class::Latency && !self.session.has_own_channels(Class::Latency) {
            // Its session's latency channel may wait to be dialed (`RestChannels`).
            self.session.hurry_rest();
        }
        if !self.closed.load(Ordering::Acquire) {
            self.count_class(class);
        }
    }

    /// Records the addresses the application knows this connection by (e.g. the kernel
    /// socket addresses a program sees through the interposition library), for
    /// `EngineStats::sockets` and `netchannel stat`.
    pub fn set_app_addresses(&self, local: SocketAddr, peer: SocketAddr) {
        if !self.closed.load(Ordering::Acquire) {
            self.session.app_addrs.lock().insert(self.id.get(), [local, peer]);
        }
    }

    /// In non-blocking mode `send` and `recv` fail with `WouldBlock` instead of waiting.
    pub fn set_nonblocking(&self, nonblocking: bool) {
        self.nonblocking.store(nonblocking, Ordering::Relaxed);
    }

    /// Whether it is in non-blocking mode.
    pub fn is_nonblocking(&self) -> bool {
        self.nonblocking.load(Ordering::Relaxed)
    }

    /// `recv` fails with `TimedOut` after `t` (as `SO_RCVTIMEO`); `None`: never.
    pub fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        store_timeout(&self.read_timeout_ns, t)
    }

    /// `send` returns what it sent, or fails with `TimedOut`, after `t` (as `SO_SNDTIMEO`).
    pub fn set_write_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        store_timeout(&self.write_timeout_ns, t)
    }

    /// Blocks until `check` (run under the session lock) returns a result, serving the
    /// session's channels while it waits. `interest`: the event bits that may satisfy it.
    fn wait_for<T>(
        &self,
        interest: u8,
        deadline: Option<Instant>,
        check: impl FnMut(&mut Core) -> Option<io::Result<T>>,
    ) -> io::Result<T> {
        self.wait_for_signals(interest, deadline, SignalPolicy::default(), check)
    }

    /// `wait_for` under a signal policy: an interruptible wait fails with `Interrupted`.
    fn wait_for_signals<T>(
        &self,
        interest: u8,
        deadline: Option<Instant>,
        signals: SignalPolicy<'_>,
        check: impl FnMut(&mut Core) -> Option<io::Result<T>>,
    ) -> io::Result<T> {
        let w = waiter::current()?;
        // The thread's kept list: a fresh one cost an allocation per blocking call.
        waiter::with_channel_events(|events| {
            self.wait_with(&w, events, interest, deadline, signals, check)
        })
    }

    fn wait_with<T>(
        &self,
        w: &Arc<waiter::Waiter>,
        events: &mut Vec<waiter::ChannelEvent>,
        interest: u8,
        deadline: Option<Instant>,
        signals: SignalPolicy<'_>,
        mut check: impl FnMut(&mut Core) -> Option<io::Result<T>>,
    ) -> io::Result<T> {
        let mut registered = false;
        // Waiting serves channels (reads, writes): throughput-class work, done demoted.
        let class = self.session.core().stream(self.id).map_or(Class::Throughput, |s| s.class);
        let _demoted = self.session.ctx.demote_for(class);
        let result = loop {
            w.begin();
            let (class, channels) = {
                let mut core = self.session.core();
                if let Some(r) = check(&mut core) {
                    break r;
                }
                let channels = core.wait_channels(self.id);
                let Some(s) = core.stream_mut(self.id) else { break Err(closed()) };
                if !registered {
                    s.user.add_waiter(w, interest);
                    registered = true;
                }
                (s.class, channels)
            };
            if deadline.is_some_and(|d| Instant::now() >= d) {
                break Err(io::Error::new(io::ErrorKind::TimedOut, "operation timed out"));
            }
            waiter::before_wait(false);
            // The channels this stream's frames come on (all of the class when none is known
            // yet): the kernel wakes this thread for them, not for other threads' streams.
            w.watch(&self.session, class, Watch::Channels(channels));
            let slept = w.sleep_signals(deadline, events, signals);
            waiter::handle(events);
            if let Err(e) = slept {
                break Err(e);
            }
        };
        if registered {
            if let Some(s) = self.session.core().stream_mut(self.id) {
                s.user.remove_waiter(w);
            }
        }
        result
    }

    /// Sends bytes. Blocking: returns once every byte is in the send buffer (like a blocking
    /// TCP send). Non-blocking: takes what credit and channel space allow, `WouldBlock` if
    /// nothing.
    pub fn send(&self, buf: &[u8]) -> io::Result<usize> {
        self.send_marked(buf, false)
    }

    /// Sends bytes as `send`, the last byte taken as urgent data (TCP's `MSG_OOB`): the peer's
    /// reads stop before it, it can be read out of band there (`recv_urgent`), and the peer's
    /// socket shows it (`Readiness::urgent`). As TCP's, a write that has to wait for room (or
    /// returns short) first moves the mark to the last byte taken so far.
    pub fn send_urgent(&self, buf: &[u8]) -> io::Result<usize> {
        self.send_marked(buf, true)
    }

    fn send_marked(&self, buf: &[u8], urgent: bool) -> io::Result<usize> {
        if buf.is_empty() {
            // Like TCP: nothing to send, but a dead or shut-down socket still says so.
            let core = self.session.core();
            let Some(s) = core.stream(self.id) else { return Err(closed()) };
            if let Some(cause) = s.reset {
                return Err(reset_error(cause));
            }
            if s.write_closed() {
                return Err(send_error(SendError::WriteClosed));
            }
            return Ok(0);
        }
        let deadline = timeout_from(&self.write_timeout_ns);
        let mut sent = 0;
        loop {
            match self.try_send(&buf[sent..], urgent) {
                Ok(n) => {
                    sent += n;
                    if sent == buf.len() {
                        return Ok(sent);
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return if sent > 0 { Ok(sent) } else { Err(e) },
            }
            if urgent && sent > 0 {
                // As TCP's `tcp_push` before it waits (or returns short): the mark moves to the
                // last byte taken so far.
                self.mark_urgent(buf[sent - 1]);
            }
            if self.is_nonblocking() {
                return if sent > 0 { Ok(sent) } else { Err(would_block()) };
            }
            let id = self.id;
            let r = self
                .wait_for(EV_WRITE, deadline, |core| core.handle(id).writable().then_some(Ok(())));
            if let Err(e) = r {
                return if sent > 0 && e.kind() == io::ErrorKind::TimedOut {
                    Ok(sent)
                } else {
                    Err(e)
                };
            }
        }
    }

    /// One attempt: queues what credit and space allow and writes it now or soon.
    fn try_send(&self, data: &[u8], urgent: bool) -> io::Result<usize> {
        let s = &self.session;
        let (n, class, congested, channels, work) = {
            let mut core = s.core();
            core.set_thread(self.id, waiter::thread_number(), Instant::now(), data.len());
            let r = if data.len() < COPY_OUTSIDE_LOCK {
                core.handle(self.id).send(data)
            } else {
                match core.handle(self.id).reserve(data.len()) {
                    Ok((offset, n)) => {
                        drop(core);
                        // Copied outside the lock into pooled buffers (warm, no page faults).
                        let pool = &s.ctx.pool;
                        let mut chunks = Vec::with_capacity(n.div_ceil(pool.buffer_size()));
                        for piece in data[..n].chunks(pool.buffer_size()) {
                            let mut b = pool.get_for(piece.len());
                            crate::copy::extend(&mut *b, piece);
                            chunks.push(b.freeze());
                        }
                        core = s.core();
                        let mut at = offset;
                        for c in chunks {
                            let len = c.len() as u64;
                            core.handle(self.id).commit(at, c);
                            at += len;
                        }
                        Ok(n)
                    }
                    Err(e) => Err(e),
                }
            };
            if let (true, Ok(n @ 1..)) = (urgent, &r) {
                if *n == data.len() {
                    // The write's last byte, marked before the bytes are pulled: the URGENT
                    // leaves ahead of them.
                    core.handle(self.id).mark_urgent(data[*n - 1]);
                }
            }
            let class = core.stream(self.id).map_or(Class::Throughput, |st| st.class);
            // Short of room, or more of this process's threads send to the peer than it has
            // channels: one more channel (the dialing side adds it, up to `max_channels`).
            let congested = core.take_congestion(class) | core.wants_channel(class);
            let channels = core.wait_channels(self.id);
            let work = core.transmit_work(class);
            drop(core);
            match r {
                Ok(n) => (n, class, congested, channels, work),
                Err(e) => {
                    if congested {
                        s.ctx.grow(s, class);
                    }
                    return Err(send_error(e));
                }
            }
        };
        if congested {
            s.ctx.grow(s, class);
        }
        learn(s, channels);
        if waiter::send_now(s, class, self.id.0, n, self.observed.load(Ordering::Relaxed)) {
            let _demoted = s.ctx.demote_for(class);
            s.transmit_known(class, work);
        } else {
            s.defer_flush_class(class);
        }
        Ok(n)
    }

    /// Receives bytes; `Ok(0)` means the peer shut down its write half and every byte arrived.
    pub fn recv(&self, buf: &mut [u8]) -> io::Result<usize> {
        let deadline = timeout_from(&self.read_timeout_ns);
        let mut moved = 0;
        loop {
            match self.try_recv(buf)? {
                Attempt::Read(n) => return Ok(n),
                Attempt::Again => continue,
                Attempt::Nothing => {}
            }
            if self.is_nonblocking() {
                // A payload read from its channel may have been staged by the engine meanwhile:
                // a stream that still says readable is read again, not reported empty.
                moved += 1;
                if moved < 4 && self.observed.load(Ordering::Relaxed) && self.settle_front() {
                    continue;
                }
                return Err(would_block());
            }
            let id = self.id;
            self.wait_for(EV_READ, deadline, |core| core.handle(id).readable().then_some(Ok(())))?;
        }
    }

    /// After a read found nothing: whether to try again. Yes if the stream says readable now
    /// (a payload read from its channel was staged meanwhile), or once a thread that is
    /// reading the payload at the front out of its channel (the engine took it over) is done.
    fn settle_front(&self) -> bool {
        let (readable, front) = {
            let mut core = self.session.core();
            let front = core.stream(self.id).and_then(|s| s.rx.front_deferred());
            (core.handle(self.id).readable(), front)
        };
        if readable {
            return true;
        }
        let Some((index, _)) = front else { return false };
        let Some(ch) = self.session.channel(index) else { return false };
        if !ch.rx_run.is_busy() || !acquire_briefly(&ch.rx_run) {
            return false;
        }
        self.session.rx_owned(&ch);
        self.session.core().handle(self.id).readable()
    }

    /// One attempt.
    fn try_recv(&self, buf: &mut [u8]) -> io::Result<Attempt> {
        if buf.is_empty() {
            return Ok(Attempt::Read(0));
        }
        let mut slices = RECV_SLICES.try_with(Cell::take).unwrap_or_default();
        let mut urgent_in = None;
        let (r, can_wait, class, channels, work) = {
            let mut core = self.session.core();
            let r = core.handle(self.id).recv(buf.len() as u64, &mut slices);
            let owes = core.handle(self.id).owes_control();
            let can_wait = owes && core.handle(self.id).control_can_wait();
            let class = core.stream(self.id).map_or(Class::Throughput, |s| s.class);
            let channels = core.wait_channels(self.id);
            let work = (owes && !can_wait).then(|| core.transmit_work(class));
            (r, can_wait, class, channels, work)
        };
        if !matches!(r, Recv::Empty) {
            learn(&self.session, channels);
        }
        let n = match r {
            Recv::Data(n) => {
                let mut at = 0;
                for s in &slices {
                    crate::copy::copy(&mut buf[at..at + s.len()], s);
                    at += s.len();
                }
                debug_assert_eq!(at as u64, n);
                Attempt::Read(n as usize)
            }
            Recv::Deferred { channel, max } => {
                let _demoted = self.session.ctx.demote_for(class);
                match self.read_deferred(channel, &mut buf[..max as usize]) {
                    Some(n) => Attempt::Read(n),
                    None => Attempt::Nothing,
                }
            }
            Recv::Eof => Attempt::Read(0),
            Recv::Empty => Attempt::Nothing,
            Recv::Reset(cause) => return Err(reset_error(cause)),
            Recv::Closed => return Err(closed()),
            Recv::DropDeferred { channel } => {
                urgent_in = Some(channel);
                Attempt::Nothing
            }
        };
        // The list goes back to the thread whatever the outcome (a read that finds nothing,
        // which an event loop makes after each message, used to lose it).
        slices.clear();
        if slices.capacity() <= 256 {
            let _exiting = RECV_SLICES.try_with(|c| c.set(slices));
        }
        if can_wait {
            // A CREDIT the sender does not wait for: it rides with the next frames out.
            waiter::defer_control(&self.session, class);
        } else if let Some(work) = work {
            // A CREDIT is due: the sender may be waiting for it.
            self.session.transmit_known(class, work);
        }
        if let Some(channel) = urgent_in {
            return Ok(self.drop_urgent(channel));
        }
        Ok(n)
    }

    /// An urgent byte kept out of the stream and still in its channel's socket is next: read
    /// and dropped (`Again`: the read goes on). Out of line: the common read path stays as it
    /// was.
    #[cold]
    #[inline(never)]
    fn drop_urgent(&self, channel: ChannelId) -> Attempt {
        let mut urgent = [0u8; 1];
        match self.read_deferred(channel, &mut urgent) {
            Some(1) => Attempt::Again,
            _ => Attempt::Nothing,
        }
    }

    /// Marks the last byte sent, `byte`, as urgent, and sends the mark.
    fn mark_urgent(&self, byte: u8) {
        let class = {
            let mut core = self.session.core();
            core.handle(self.id).mark_urgent(byte);
            core.stream(self.id).map_or(Class::Throughput, |s| s.class)
        };
        self.session.transmit(class);
    }

    /// The peer's urgent byte, read out of band (TCP's `recv` with `MSG_OOB`): `InvalidInput`
    /// when there is none to read (none came, it was read already, the reads went past it, or
    /// urgent bytes stay in the stream), as TCP's `EINVAL`. Never waits: the byte comes with
    /// the peer's mark.
    pub fn recv_urgent(&self, peek: bool) -> io::Result<u8> {
        let mut core = self.session.core();
        match core.handle(self.id).take_urgent(peek) {
            Some(b) => Ok(b),
            None => Err(io::Error::new(io::ErrorKind::InvalidInput, "no urgent data")),
        }
    }

    /// With the peer's urgent byte kept out of the stream and arrived: the bytes before it
    /// (TCP's `FIONREAD` counts only those then).
    pub fn unread_before_mark(&self) -> Option<u64> {
        self.session.core().unread_before_mark(self.id)
    }

    /// The next byte a read returns is the peer's urgent byte (`SIOCATMARK`).
    pub fn at_urgent_mark(&self) -> bool {
        self.session.core().at_urgent_mark(self.id)
    }

    /// Keeps the peer's urgent bytes in the stream (`SO_OOBINLINE`), or out of it (the default,
    /// as TCP's).
    pub fn set_oob_inline(&self, on: bool) {
        self.session.core().handle(self.id).set_oob_inline(on);
    }

    /// Reads the payload waiting in a channel's socket straight into `buf` (direct
    /// placement), then goes on serving that channel. `None`: nothing read (try again).
    fn read_deferred(&self, index: ChannelId, buf: &mut [u8]) -> Option<usize> {
        let s = &self.session;
        let ch = s.channel(index)?;
        let exact = self.observed.load(Ordering::Relaxed);
        if !(if exact { acquire_briefly(&ch.rx_run) } else { ch.rx_run.try_acquire() }) {
            // Somebody else serves the channel; it tells us when our bytes can be read. It may
            // have settled the stream's readiness before we marked it empty: a second try
            // (which leaves the owner a note to run again if it fails) settles it after.
            s.core().handle(self.id).deferred_empty();
            if ch.rx_run.try_acquire() {
                s.rx_owned(&ch);
            }
            return None;
        }
        // Checked again now that the channel's receive half is ours: another thread may have
        // staged the payload before we got here.
        let max = s.core().handle(self.id).deferred_readable(index);
        let Some(max) = max else {
            s.rx_owned(&ch);
            return None;
        };
        let len = (max as usize).min(buf.len());
        let buf = &mut buf[..len];
        let got = match ch.read_direct(buf) {
            Ok(0) => {
                s.channel_failed(&ch, crate::driver::ChannelError::Closed);
                None
            }
            Ok(n) => {
                let ours = s.with_core(|core| core.handle(self.id).deferred_read(index, n as u64));
                ours.then_some(n)
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                s.core().handle(self.id).deferred_empty();
                None
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => None,
            Err(e) => {
                s.channel_failed(&ch, crate::driver::ChannelError::Io(e));
                None
            }
        };
        // Still the owner of the channel's receive half: go on with its next frames.
        s.rx_owned(&ch);
        got
    }

    /// Copies received bytes without consuming them (`MSG_PEEK`). Waits like `recv`.
    pub fn peek(&self, buf: &mut [u8]) -> io::Result<usize> {
        let deadline = timeout_from(&self.read_timeout_ns);
        loop {
            match self.session.core().handle(self.id).peek(buf) {
                Recv::Data(n) => return Ok(n as usize),
                Recv::Eof => return Ok(0),
                Recv::Reset(c) => return Err(reset_error(c)),
                Recv::Closed => return Err(closed()),
                Recv::Empty | Recv::Deferred { .. } | Recv::DropDeferred { .. } => {}
            }
            if buf.is_empty() {
                return Ok(0);
            }
            // A payload still in the socket is staged by the engine before it can be peeked.
            let staged = self.session.stage_front(self.id);
            if staged {
                continue;
            }
            if self.is_nonblocking() {
                return Err(would_block());
            }
            let id = self.id;
            self.wait_for(EV_READ, deadline, |core| core.handle(id).readable().then_some(Ok(())))?;
        }
    }

    /// Whether the stream ended because every channel to the peer was lost (the peer's engine
    /// went away, with its process), not by a reset the peer sent.
    pub fn lost_with_peer(&self) -> bool {
        self.session.core().stream(self.id).is_some_and(|s| {
            matches!(s.send_capacity(), Err(SendError::Reset(ResetCause::ChannelLost)))
        })
    }

    /// Received bytes not yet read (`FIONREAD`).
    pub fn unread_bytes(&self) -> u64 {
        self.session.core().stream(self.id).map_or(0, |s| s.unread_bytes())
    }

    /// Shuts down the write half: the peer reads end of stream after the last byte sent.
    pub fn shutdown(&self) -> io::Result<()> {
        let class = {
            let mut core = self.session.core();
            match core.handle(self.id).shutdown_write() {
                Ok(()) => {}
                Err(SendError::NotOpen) => {
                    return Err(io::Error::new(io::ErrorKind::NotConnected, "not connected"))
                }
                Err(e) => return Err(send_error(e)),
            }
            core.stream(self.id).map_or(Class::Throughput, |s| s.class)
        };
        self.session.transmit(class);
        Ok(())
    }

    /// The pending error of a socket opened with `connect_nonblocking`: `Ok(true)` once
    /// connected, `Ok(false)` while connecting, the refusal or reset otherwise.
    pub fn take_error(&self) -> io::Result<bool> {
        let core = self.session.core();
        let Some(s) = core.stream(self.id) else { return Err(closed()) };
        match (s.reset, s.phase) {
            (Some(c), _) => Err(reset_error(c)),
            (None, Phase::Open) => Ok(true),
            _ => Ok(false),
        }
    }

    /// Closes the socket (also done on drop). Unread received data resets the peer, as in TCP;
    /// otherwise the write half is finished and the bytes still queued are delivered (within
    /// `Config::linger`).
    pub fn close(self) {
        self.close_inner();
    }

    fn close_inner(&self) {
        if self.closed.swap(true, Ordering::SeqCst) {
            return;
        }
        self.count_class(Class::Throughput);
        let s = &self.session;
        s.app_addrs.lock().remove(&self.id.get());
        // A close that resets (unread bytes now, or arriving before the close is done, as
        // TCP's does) drops what is unsent: what the writes held back goes first.
        self.send_before_reset(false);
        let class = s.with_core(|core| {
            let class = core.stream_mut(self.id).map(|st| {
                st.user.poll = None;
                st.class
            });
            core.handle(self.id).close(Instant::now());
            class
        });
        s.timers_changed();
        // The stream's own class: a latency thread closing its socket does not write the
        // throughput backlog (a closed stream's RST goes out on its class's channels too).
        match class {
            Some(class) => s.transmit_classes(class.bit()),
            None => s.transmit_all(),
        }
    }

    /// An fd that becomes readable whenever this socket may have changed state (data, credit,
    /// end of stream, reset): a private [`Poller`] holding only this socket, created on first
    /// call. Edge-triggered: after it fires, call [`VSocket::clear_readiness`] and then
    /// `recv`/`send` until `WouldBlock`. For many sockets, share one `Poller` instead.
    pub fn readiness_fd(&self) -> io::Result<RawFd> {
        if let Some(p) = self.own_poller.get() {
            return Ok(p.fd());
        }
        let poller = Poller::new()?;
        self.register(&poller, 0)?;
        let fd = poller.fd();
        let _ = self.own_poller.set(poller);
        Ok(fd)
    }

    /// Consumes the pending notification of `readiness_fd`.
    pub fn clear_readiness(&self) {
        if let Some(p) = self.own_poller.get() {
            let mut tokens = Vec::new();
            let _ = p.wait(&mut tokens, Some(Duration::ZERO));
        }
    }

    pub(crate) fn register(&self, poller: &Poller, token: u64) -> io::Result<()> {
        let entry = Arc::new(PollEntry::new(&poller.shared, token));
        let ready = {
            let mut core = self.session.core();
            let (readable, writable) =
                (core.handle(self.id).readable(), core.handle(self.id).writable());
            let Some(s) = core.stream_mut(self.id) else { return Err(closed()) };
            if s.user.poll.is_some() {
                return Err(io::Error::new(
                    io::ErrorKind::AlreadyExists,
                    "the socket is already registered with a poller",
                ));
            }
            s.user.poll = Some(entry.clone());
            poller.shared.watch(&self.session, s.class);
            readable || writable
        };
        if ready {
            entry.notify(EV_READ | EV_WRITE);
        }
        Ok(())
    }

    /// Hands every readiness change of this socket to `observer` (instead of a poller): for a
    /// layer that mirrors the socket's readiness into a kernel object (the interposition
    /// library's placeholder fd). Told once right away. A socket has one poller or observer.
    pub fn set_observer(&self, observer: Arc<dyn ReadinessObserver>) -> io::Result<()> {
        let entry = Arc::new(PollEntry::observer(observer));
        {
            let mut core = self.session.core();
            let Some(s) = core.stream_mut(self.id) else { return Err(closed()) };
            if s.user.poll.is_some() {
                return Err(io::Error::new(
                    io::ErrorKind::AlreadyExists,
                    "the socket already has a poller or an observer",
                ));
            }
            s.user.poll = Some(entry.clone());
        }
        self.observed.store(true, Ordering::Relaxed);
        entry.notify(EV_READ | EV_WRITE);
        Ok(())
    }

    /// Takes the socket's poller registration or observer away (it may then get another).
    pub fn deregister(&self) {
        if let Some(s) = self.session.core().stream_mut(self.id) {
            s.user.poll = None;
        }
    }

    /// Resets the connection and closes the socket (a TCP close with `SO_LINGER` zero): what
    /// the writes left waiting for a moment goes first, as far as the peer's window takes it
    /// (TCP sent it at the write), the rest is dropped, and the peer's read fails with
    /// `ConnectionReset` after the bytes sent before.
    pub fn abort(&self) {
        self.send_before_reset(true);
        self.session.with_core(|core| core.handle(self.id).abort(ResetCause::LocalAbort));
        self.close_inner();
    }

    /// Gives up a connect still waiting for the peer's answer, as TCP's `shutdown` of a socket
    /// in SYN_SENT does: the socket fails with `ConnectionReset` and the peer's late answer is
    /// refused. False (nothing done) if the socket is not connecting.
    pub fn abort_connect(&self) -> bool {
        let aborted = self.session.with_core(|core| {
            let connecting = core
                .stream(self.id)
                .is_some_and(|st| st.phase == Phase::Connecting && st.reset.is_none());
            if connecting {
                core.handle(self.id).abort(ResetCause::ConnectAborted);
            }
            connecting
        });
        self.session.timers_changed();
        aborted
    }

    /// Before this socket closes (`abort`: resets): sends what its writes left in the send
    /// buffer for a moment (a burst, or an event loop's iteration, leaves together), as far as
    /// the peer's window and the channels take it. TCP would have sent those bytes when they
    /// were written, so its peer reads them before the RST of a close that resets; only bytes
    /// the window holds back are dropped, as TCP drops its unsent queue. When the close will
    /// reset (`abort`, or bytes unread), bytes the window allows but a channel busy with
    /// another thread's writing did not take are tried again for up to 20 ms: that thread may
    /// have been preempted mid-write, and a busy machine's scheduler slice is longer than the
    /// 2 ms this waited before (`answer_then_close` lost an answer in about 500 connections
    /// beside a busy loop then, none in 8,000 after).
    fn send_before_reset(&self, abort: bool) {
        let look = |core: &mut crate::engine::session::Core| {
            core.stream(self.id).filter(|st| st.reset.is_none() && !st.tx.is_empty()).map(|st| {
                let sendable = st.tx.sent_end(st.send_next) < st.send_limit;
                (st.class, sendable && (abort || st.rx.unread() > 0))
            })
        };
        let Some((class, _)) = self.session.with_core(look) else { return };
        let deadline = Instant::now() + Duration::from_millis(20);
        loop {
            self.session.transmit_classes(class.bit());
            let retry = self.session.with_core(look).is_some_and(|(_, retry)| retry);
            if !retry || Instant::now() >= deadline {
                return;
            }
            std::thread::yield_now();
        }
    }

    /// Its readiness, all of it read under one lock.
    pub fn readiness(&self) -> Readiness {
        let (mut r, deferred_front) = self.readiness_locked();
        if let Some(index) = deferred_front {
            // What comes next is a payload still in its channel's socket, readable "once bytes
            // came for it" by the engine's last look. Asked now: a program told readable must
            // find bytes (one that finds none counts an error, as wrk does). If none are there
            // yet, their arrival makes the stream readable again.
            if self.session.channel(index).is_some_and(|ch| !ch.bytes_waiting()) {
                r.readable = false;
                r.unread = 0;
            }
        }
        r
    }

    /// The readiness under the core's lock, and the channel of the payload it counts as
    /// readable when that payload is still in its channel's socket (nothing else is before it).
    fn readiness_locked(&self) -> (Readiness, Option<ChannelId>) {
        let mut core = self.session.core();
        let (readable, writable) =
            (core.handle(self.id).readable(), core.handle(self.id).writable());
        match core.stream(self.id) {
            Some(s) => {
                let in_memory = s.readable_bytes();
                let deferred_front = match s.rx.front_deferred() {
                    Some((index, _)) if readable && in_memory == 0 => Some(index),
                    _ => None,
                };
                let r = Readiness {
                    readable,
                    writable,
                    connected: s.phase == Phase::Open,
                    peer_finished: s.fin_in_order(),
                    write_closed: s.write_closed(),
                    read_closed: s.read_closed(),
                    error: s.reset.map(|c| reset_error(c).kind()),
                    // A payload still in a channel's socket counts as one byte: a read returns
                    // at least that much, and no more is known without asking the kernel.
                    unread: match in_memory {
                        _ if !readable => 0,
                        0 if deferred_front.is_some() => 1,
                        n => n,
                    },
                    urgent: core.urgent_pending(self.id),
                };
                (r, deferred_front)
            }
            None => (
                Readiness {
                    readable: true,
                    writable: true,
                    connected: false,
                    peer_finished: true,
                    write_closed: true,
                    read_closed: true,
                    error: Some(io::ErrorKind::NotConnected),
                    unread: 0,
                    urgent: false,
                },
                None,
            ),
        }
    }

    /// Shuts down the read half (`shutdown(SHUT_RD)`): bytes already received can still be
    /// read, then `recv` returns end of stream instead of waiting; blocked readers wake.
    pub fn shutdown_read(&self) {
        self.session.core().handle(self.id).shutdown_read();
    }

    /// Blocks until the socket is readable (`read`) or writable (`write`), `deadline`
    /// (`TimedOut`), or a signal under an interruptible policy (`Interrupted`), serving the
    /// session's channels meanwhile. For a layer that implements blocking calls on top of
    /// non-blocking ones with the kernel's signal rules.
    #[cfg(feature = "internals")]
    pub fn wait_ready(
        &self,
        read: bool,
        write: bool,
        deadline: Option<Instant>,
        signals: SignalPolicy<'_>,
    ) -> io::Result<()> {
        let id = self.id;
        let interest = if read { EV_READ } else { 0 } | if write { EV_WRITE } else { 0 };
        self.wait_for_signals(interest, deadline, signals, |core| {
            let mut h = core.handle(id);
            ((read && h.readable()) || (write && h.writable())).then_some(Ok(()))
        })
    }

    /// Whether every byte sent and the end of stream have reached the peer's engine (it
    /// acknowledged them), or the stream is reset or gone: what a close with `SO_LINGER` waits
    /// for, as TCP's waits for its FIN to be acknowledged.
    #[cfg(feature = "internals")]
    pub fn send_delivered(&self) -> bool {
        use crate::proto::stream::F_FIN_SENT;
        let core = self.session.core();
        core.stream(self.id).is_none_or(|s| {
            s.reset.is_some()
                || (s.tx.is_empty() && s.unacked_frames == 0 && s.flags & F_FIN_SENT != 0)
        })
    }

    /// The session it belongs to (a `ServeSet` serves its channels).
    #[cfg_attr(not(feature = "internals"), allow(dead_code))]
    pub(crate) fn session(&self) -> &Arc<SessionRt> {
        &self.session
    }

    /// Whether the peer's listener asked, in its answer, that further connections to its port
    /// go over kernel TCP (`Listener::prefer_kernel`). False until the open is answered.
    pub fn peer_prefers_kernel(&self) -> bool {
        self.session.core().handle(self.id).peer_prefers_kernel()
    }

    /// Whether `recv` would return without blocking (data, end of stream or an error).
    pub fn is_readable(&self) -> bool {
        self.session.core().handle(self.id).readable()
    }

    /// Whether `send` would make progress or fail without waiting.
    pub fn is_writable(&self) -> bool {
        self.session.core().handle(self.id).writable()
    }

    /// A snapshot of its counters.
    pub fn stats(&self) -> SocketStats {
        let core = self.session.core();
        match core.stream(self.id) {
            Some(s) => SocketStats {
                app_addrs: self.session.app_addrs.lock().get(&self.id.get()).copied(),
                ..SocketStats::of(self.id, s, self.session.peer_addr)
            },
            None => SocketStats {
                id: self.id.get(),
                port: 0,
                class: Class::Throughput,
                peer_engine_addr: self.session.peer_addr,
                bytes_sent: 0,
                bytes_received: 0,
                frames_sent: 0,
                frames_received: 0,
                unread_bytes: 0,
                unsent_bytes: 0,
                unacked_bytes: 0,
                send_window: 0,
                protocol_errors: 0,
                state: "closed",
                app_addrs: None,
            },
        }
    }
}

impl Drop for VSocket {
    fn drop(&mut self) {
        self.close_inner();
    }
}

impl io::Read for &VSocket {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.recv(buf)
    }
}

impl io::Write for &VSocket {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.send(buf)
    }
    /// Writes now what this thread's recent sends left for a moment (a burst of small sends
    /// is coalesced until the thread waits in the engine, or for at most one worker tick).
    fn flush(&mut self) -> io::Result<()> {
        flush_sends();
        Ok(())
    }
}

/// The calling thread uses a stream whose frames come on `channels`: they join the thread's
/// epoll set (see `Waiter::learn`).
fn learn(session: &Arc<SessionRt>, channels: [Option<ChannelId>; 2]) {
    if let Ok(w) = waiter::current() {
        w.learn(session, channels);
    }
}

/// Writes now every send the calling thread deferred (on any socket). Sends made in a burst
/// (closer together than 20 us, with no wait in the engine between them) are coalesced until the
/// thread next waits in the engine or for at most one worker tick (1 ms); an event loop that
/// sleeps in its own epoll set calls this before it sleeps. Same as `Write::flush` on a socket.
pub fn flush_sends() {
    waiter::flush_deferred();
}

impl io::Read for VSocket {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.recv(buf)
    }
}

impl io::Write for VSocket {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.send(buf)
    }
    /// Writes now what this thread's recent sends left for a moment (a burst of small sends
    /// is coalesced until the thread waits in the engine, or for at most one worker tick).
    fn flush(&mut self) -> io::Result<()> {
        flush_sends();
        Ok(())
    }
}

impl std::fmt::Debug for VSocket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VSocket")
            .field("id", &self.id)
            .field("peer", &self.session.peer_addr)
            .finish()
    }
}

/// Accepts virtual sockets opened to one virtual port of this engine.
pub struct Listener {
    ctx: Arc<EngineCtx>,
    port: u16,
    shared: Arc<ListenerShared>,
    nonblocking: AtomicBool,
}

/// The error of a connect whose peer engine is there (the session is up) but did not answer
/// the virtual socket's SYN in time: its listener's backlog stayed full. Told from a peer that
/// cannot be reached at all (the dial's `TimedOut`) by [`is_unanswered_open`].
#[derive(Debug)]
struct UnansweredOpen {
    peer: std::net::SocketAddr,
    waited: Duration,
}

impl std::fmt::Display for UnansweredOpen {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "no answer from {} within {:?}", self.peer, self.waited)
    }
}

impl std::error::Error for UnansweredOpen {}

/// Whether `e` says the peer engine was reached but did not answer the virtual socket's SYN
/// within `Config::connect_timeout` or `VSocket::wait_open`'s wait (a full backlog), rather
/// than that no engine answered.
pub fn is_unanswered_open(e: &io::Error) -> bool {
    e.get_ref().is_some_and(|inner| inner.is::<UnansweredOpen>())
}

impl Listener {
    pub(crate) fn bind(
        ctx: Arc<EngineCtx>,
        port: u16,
        bound: Option<crate::engine::listener::Bound>,
    ) -> io::Result<Listener> {
        let shared = ctx.bind_listener(port, bound)?;
        Ok(Listener { ctx, port, shared, nonblocking: AtomicBool::new(false) })
    }

    /// The virtual port it listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Answers at most `n` opens that `accept` has not taken yet (at least 1, at most
    /// `Config::accept_backlog`, the default), as `listen(2)`'s backlog bounds a kernel
    /// listener's queue: the others wait unanswered (their `connect` waits, as a TCP client's
    /// whose SYN the full queue dropped), up to `accept_backlog` of them, and are answered
    /// one per `accept`.
    pub fn set_backlog(&self, n: usize) {
        self.shared.set_backlog(n);
    }

    /// From now on, each stream this listener answers asks its opener to make its further
    /// connections to this port over kernel TCP (`FLAG_KERNEL_PREFERRED` in the SYN_ACK; see
    /// `VSocket::peer_prefers_kernel`): for a port whose connections this side cannot serve
    /// well (the interposition library sets it when forked processes take them). The stream
    /// itself is accepted as usual.
    pub fn prefer_kernel(&self, on: bool) {
        self.shared.set_kernel_preferred(on);
    }

    /// In non-blocking mode `accept` fails with `WouldBlock` when nothing is pending.
    pub fn set_nonblocking(&self, nonblocking: bool) {
        self.nonblocking.store(nonblocking, Ordering::Relaxed);
    }

    /// Waits for the next virtual socket opened to this port.
    pub fn accept(&self) -> io::Result<VSocket> {
        self.accept_timeout(None)
    }

    /// `accept`, giving up with `TimedOut` after `timeout` (`None`: never).
    pub fn accept_timeout(&self, timeout: Option<Duration>) -> io::Result<VSocket> {
        let deadline = timeout.map(|d| Instant::now() + d);
        let w = waiter::current()?;
        let mut registered = false;
        let cfg = &self.ctx.config;
        let result = loop {
            w.begin();
            if let Some((session, id, class)) =
                self.shared.accept_next(cfg.unaccepted_window, cfg.stream_window)
            {
                break Ok(VSocket::wrap(session, id, class));
            }
            if self.shared.is_closed() {
                break Err(io::Error::new(io::ErrorKind::ConnectionAborted, "listener closed"));
            }
            if self.nonblocking.load(Ordering::Relaxed) {
                break Err(would_block());
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                break Err(io::Error::new(io::ErrorKind::TimedOut, "accept timed out"));
            }
            if !registered {
                self.shared.add_waiter(&w);
                registered = true;
                continue; // re-check: an offer may have come before we were listed
            }
            waiter::before_wait(false);
            if let Err(e) = w.sleep_quiet(deadline) {
                break Err(e);
            }
        };
        if registered {
            self.shared.remove_waiter(&w);
        }
        result
    }

    /// An eventfd that becomes readable when a connection is pending (edge-triggered).
    pub fn readiness_fd(&self) -> io::Result<RawFd> {
        self.shared.readiness_fd()
    }

    /// Consumes the pending notification of `readiness_fd`.
    pub fn clear_readiness(&self) {
        self.shared.clear_readiness()
    }

    /// Streams accepted by the engine and not yet by the application.
    pub fn pending(&self) -> usize {
        self.shared.pending()
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.ctx.unbind_listener(self.port, &self.shared);
        self.shared.close();
        for (session, id) in self.shared.take_all() {
            // Accepted by the engine but never by the application: reset, as TCP does.
            session.with_core(|core| {
                core.handle(id).abort(ResetCause::LocalAbort);
                core.handle(id).close(Instant::now());
            });
            session.timers_changed();
            session.transmit_all();
        }
    }
}

impl std::fmt::Debug for Listener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Listener").field("port", &self.port).finish()
    }
}

/// Takes a channel half that was found readable for us, waiting for a thread that is serving
/// it (it lets go as soon as it sees the payload is ours; the wait is for it to be scheduled,
/// as a kernel socket's reader waits on the socket lock): a reader told "readable" should find
/// bytes, and programs count an EAGAIN then as an error.
fn acquire_briefly(run: &crate::driver::RunLock) -> bool {
    const SPINS: usize = 16;
    const YIELDING: Duration = Duration::from_millis(1);
    // A bound for safety only: the owner never blocks while it holds the half.
    const MOST: Duration = Duration::from_millis(100);
    let mut since = None;
    for i in 0.. {
        if !run.is_busy() && run.try_acquire() {
            return true;
        }
        if i < SPINS {
            std::hint::spin_loop();
            continue;
        }
        let waited = since.get_or_insert_with(Instant::now).elapsed();
        if waited > MOST {
            break;
        }
        if waited < YIELDING {
            std::thread::yield_now();
        } else {
            // The owner is not running (a loaded machine): let it have the core.
            std::thread::sleep(Duration::from_micros(20));
        }
    }
    run.try_acquire()
}
