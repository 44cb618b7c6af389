//! The application API: [`VSocket`] (a virtual stream socket) and [`Listener`].
//!
//! Semantics follow TCP: reliable, ordered bytes; `recv` returns 0 at end of stream after the
//! peer's `shutdown`; `close` with unread data resets the peer; errors use the `io::ErrorKind`
//! a TCP user expects. Both blocking and non-blocking modes work; in non-blocking mode use the
//! readiness fd in epoll/mio and call until `WouldBlock` (edge-triggered, spurious wake-ups
//! possible), exactly as with a non-blocking kernel socket.

use std::collections::VecDeque;
use std::io;
use std::net::SocketAddr;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use super::poller::{Poller, Registration};
use super::stream::{Phase, ReadError, ResetCause, SendError, StreamState};
use super::Stream;
use crate::engine::session::{Session, Wait};
use crate::engine::EngineInner;
use crate::sys::EventFd;
use crate::wire::{Class, Frame, RstReason};

fn reset_error(cause: ResetCause) -> io::Error {
    use io::ErrorKind::*;
    let (kind, msg) = match cause {
        ResetCause::Peer(RstReason::NoListener) => {
            (ConnectionRefused, "no listener on that virtual port at the peer")
        }
        ResetCause::Peer(RstReason::Refused) => (ConnectionRefused, "the peer refused the stream"),
        ResetCause::Peer(_) => (ConnectionReset, "connection reset by peer"),
        ResetCause::ChannelLost => (ConnectionReset, "a channel carrying this socket was lost"),
        ResetCause::ConnectTimeout => (TimedOut, "the peer did not answer in time"),
        ResetCause::EngineShutdown => (ConnectionAborted, "the local engine shut down"),
        ResetCause::LocalAbort => (NotConnected, "the socket was closed"),
    };
    io::Error::new(kind, msg)
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

/// Waits on the stream's condition variable until `deadline`; `Err(TimedOut)` after it.
fn wait_until<'a>(
    stream: &'a Stream,
    guard: std::sync::MutexGuard<'a, StreamState>,
    deadline: Option<Instant>,
) -> io::Result<std::sync::MutexGuard<'a, StreamState>> {
    let now = Instant::now();
    if deadline.is_some_and(|d| now >= d) {
        return Err(io::Error::new(io::ErrorKind::TimedOut, "operation timed out"));
    }
    stream.waiters.fetch_add(1, Ordering::SeqCst);
    let guard = match deadline {
        None => stream.changed.wait(guard).unwrap_or_else(|e| e.into_inner()),
        Some(d) => stream.changed.wait_timeout(guard, d - now).unwrap_or_else(|e| e.into_inner()).0,
    };
    stream.waiters.fetch_sub(1, Ordering::SeqCst);
    Ok(guard)
}

/// Per-socket counters (a snapshot).
#[derive(Debug, Clone)]
pub struct SocketStats {
    pub id: u32,
    pub port: u16,
    pub class: Class,
    pub peer_engine_addr: SocketAddr,
    pub bytes_sent: u64,
    pub bytes_received: u64,
    pub frames_sent: u64,
    pub frames_received: u64,
    /// Received bytes the application has not read yet.
    pub unread_bytes: usize,
    /// Sent bytes the peer application has not read yet.
    pub unacked_bytes: u64,
    pub protocol_errors: u32,
    pub state: &'static str,
}

impl SocketStats {
    pub(crate) fn of(s: &Stream) -> SocketStats {
        let st = s.lock();
        let state = match (st.reset, st.phase, st.app_closed) {
            (Some(_), ..) => "reset",
            (_, _, true) => "closed",
            (_, Phase::Connecting, _) => "connecting",
            _ if st.write_closed() && st.peer_finished() => "finished",
            _ if st.write_closed() => "write-closed",
            _ if st.peer_finished() => "peer-finished",
            _ => "open",
        };
        SocketStats {
            id: s.id,
            port: s.port,
            class: st.class,
            peer_engine_addr: s.session.peer_addr,
            bytes_sent: st.bytes_sent(),
            bytes_received: st.bytes_received(),
            frames_sent: st.frames_sent,
            frames_received: st.frames_received,
            unread_bytes: st.unread_bytes(),
            unacked_bytes: st.unacked_bytes(),
            protocol_errors: st.protocol_errors,
            state,
        }
    }
}

/// A virtual stream socket. Usable from several threads at once (`&self` methods).
pub struct VSocket {
    engine: Arc<EngineInner>,
    stream: Arc<Stream>,
    nonblocking: AtomicBool,
    read_timeout_ns: AtomicU64,
    write_timeout_ns: AtomicU64,
    closed: AtomicBool,
    /// The private poller behind `readiness_fd`.
    own_poller: OnceLock<Poller>,
}

impl VSocket {
    fn wrap(engine: Arc<EngineInner>, stream: Arc<Stream>) -> VSocket {
        VSocket {
            engine,
            stream,
            nonblocking: AtomicBool::new(false),
            read_timeout_ns: AtomicU64::new(0),
            write_timeout_ns: AtomicU64::new(0),
            closed: AtomicBool::new(false),
            own_poller: OnceLock::new(),
        }
    }

    pub(crate) fn connect(
        engine: Arc<EngineInner>,
        session: Arc<Session>,
        port: u16,
        class: Class,
    ) -> io::Result<VSocket> {
        let config = &engine.config;
        let stream = engine
            .streams
            .insert(|id| {
                let st =
                    StreamState::new(class, config.stream_window, config.max_out_of_order_segments);
                Arc::new(Stream::new(id, port, session.clone(), st))
            })
            .ok_or_else(|| {
                io::Error::other(format!(
                    "virtual socket limit reached ({} open)",
                    config.max_streams
                ))
            })?;
        // From here on, dropping `sock` releases the stream on every error path.
        let sock = VSocket::wrap(engine.clone(), stream);
        let s = &sock.stream;
        let syn = Frame::Syn { src: s.id, port, class, window: config.stream_window };
        let used = session.send_control(s.id, class, syn).ok_or_else(|| {
            io::Error::new(io::ErrorKind::ConnectionReset, "all channels to the peer are lost")
        })?;
        let deadline = Instant::now() + config.connect_timeout;
        let mut st = s.lock();
        st.channel_mask |= 1u64 << used;
        loop {
            if let Some(cause) = st.reset {
                return Err(reset_error(cause));
            }
            if st.phase == Phase::Open {
                break;
            }
            st = wait_until(s, st, Some(deadline)).map_err(|_| {
                io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!(
                        "no answer from {} within {:?}",
                        session.peer_addr, config.connect_timeout
                    ),
                )
            })?;
        }
        drop(st);
        Ok(sock)
    }

    pub fn id(&self) -> u32 {
        self.stream.id
    }

    /// The virtual port this socket was opened to (or accepted on).
    pub fn port(&self) -> u16 {
        self.stream.port
    }

    pub fn peer_engine_addr(&self) -> SocketAddr {
        self.stream.session.peer_addr
    }

    pub fn class(&self) -> Class {
        self.stream.lock().class
    }

    /// Moves the socket to another class: its next chunks use that class's channels.
    pub fn set_class(&self, class: Class) {
        self.stream.lock().class = class;
    }

    pub fn set_nonblocking(&self, nonblocking: bool) {
        self.nonblocking.store(nonblocking, Ordering::Relaxed);
    }

    pub fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        store_timeout(&self.read_timeout_ns, t)
    }

    pub fn set_write_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        store_timeout(&self.write_timeout_ns, t)
    }

    fn wait_mode(&self, deadline: Option<Instant>) -> Wait {
        if self.nonblocking.load(Ordering::Relaxed) {
            Wait::NonBlocking
        } else {
            Wait::Block(deadline)
        }
    }

    /// Sends bytes. Blocking: returns once every byte is queued on channels (like a blocking
    /// TCP send). Non-blocking: queues what credit and channel space allow, `WouldBlock` if
    /// nothing.
    pub fn send(&self, buf: &[u8]) -> io::Result<usize> {
        let deadline = timeout_from(&self.write_timeout_ns);
        let mut sent = 0;
        let partial_ok = |sent: usize, e: io::Error| {
            let soft = matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut);
            if sent > 0 && soft {
                Ok(sent)
            } else {
                Err(e)
            }
        };
        if buf.is_empty() {
            // Like TCP: nothing to send, but a dead or shut-down socket still says so.
            return match self.stream.lock().send_capacity() {
                Err(e @ (SendError::Reset(_) | SendError::WriteClosed)) => Err(send_error(e)),
                _ => Ok(0),
            };
        }
        while sent < buf.len() {
            let class = match self.wait_for_credit(deadline) {
                Ok(c) => c,
                Err(e) => return partial_ok(sent, e),
            };
            let session = &self.stream.session;
            let grow = || self.engine.grow(session);
            let ch = match session.pick_channel(
                self.stream.id,
                class,
                self.wait_mode(deadline),
                &grow,
            ) {
                Ok(ch) => ch,
                Err(e) => return partial_ok(sent, e),
            };
            let index = crate::driver::Channel::meta(&*ch).index;
            let max = (buf.len() - sent).min(self.engine.config.max_frame_payload);
            let (peer, offset, n) = {
                let mut st = self.stream.lock();
                match st.reserve_send(max) {
                    Ok((offset, n)) => {
                        st.channel_mask |= 1u64 << index;
                        st.frames_sent += 1;
                        (st.peer_stream, offset, n)
                    }
                    // Another thread took the credit in between.
                    Err(SendError::NoCredit) => continue,
                    Err(e) => return partial_ok(sent, send_error(e)),
                }
            };
            let payload = &buf[sent..sent + n];
            let mut frame = self.engine.buffers.get(crate::wire::frame::DATA_HEADER_LEN + n);
            Frame::Data { stream: peer, offset, payload }.encode(&mut frame);
            if !crate::driver::Channel::enqueue(&*ch, frame) {
                // The channel died after it was picked: these bytes are lost.
                self.stream.lock().on_reset(ResetCause::ChannelLost);
                self.stream.wake();
                return Err(reset_error(ResetCause::ChannelLost));
            }
            sent += n;
        }
        Ok(sent)
    }

    /// Waits until the socket may send (credit available, or an error to report).
    fn wait_for_credit(&self, deadline: Option<Instant>) -> io::Result<Class> {
        let mut st = self.stream.lock();
        loop {
            match st.send_capacity() {
                Ok(_) => return Ok(st.class),
                Err(SendError::NoCredit) => {}
                Err(e) => return Err(send_error(e)),
            }
            if self.nonblocking.load(Ordering::Relaxed) {
                return Err(io::Error::new(io::ErrorKind::WouldBlock, "no send credit"));
            }
            st = wait_until(&self.stream, st, deadline)?;
        }
    }

    /// Receives bytes; `Ok(0)` means the peer shut down its write half and every byte arrived.
    pub fn recv(&self, buf: &mut [u8]) -> io::Result<usize> {
        let deadline = timeout_from(&self.read_timeout_ns);
        let mut st = self.stream.lock();
        loop {
            match st.read_recycling(buf, &mut |b| self.engine.buffers.put(b)) {
                Ok(n) => {
                    let credit = st.credit_due();
                    let (peer, class) = (st.peer_stream, st.class);
                    drop(st);
                    if let Some((consumed, window)) = credit {
                        let f = Frame::Credit { dst: peer, consumed, window };
                        if let Some(used) =
                            self.stream.session.send_control(self.stream.id, class, f)
                        {
                            self.stream.lock().channel_mask |= 1u64 << used;
                        }
                    }
                    return Ok(n);
                }
                Err(ReadError::Reset(cause)) => return Err(reset_error(cause)),
                Err(ReadError::Empty) => {
                    if self.nonblocking.load(Ordering::Relaxed) {
                        return Err(io::Error::new(io::ErrorKind::WouldBlock, "no data"));
                    }
                    st = wait_until(&self.stream, st, deadline)?;
                }
            }
        }
    }

    /// Shuts down the write half: the peer reads end of stream after the last byte sent.
    pub fn shutdown(&self) -> io::Result<()> {
        let mut st = self.stream.lock();
        if let Some(cause) = st.reset {
            return Err(reset_error(cause));
        }
        let (peer, class) = (st.peer_stream, st.class);
        if let Some(final_offset) = st.shutdown_write() {
            drop(st);
            let fin = Frame::Fin { dst: peer, final_offset };
            if let Some(used) = self.stream.session.send_control(self.stream.id, class, fin) {
                self.stream.lock().channel_mask |= 1u64 << used;
            }
        }
        Ok(())
    }

    /// Closes the socket (also done on drop). Unread received data resets the peer, as in TCP;
    /// otherwise the write half is finished and the peer reads end of stream.
    pub fn close(self) {
        self.close_inner();
    }

    fn close_inner(&self) {
        if self.closed.swap(true, Ordering::SeqCst) {
            return;
        }
        let s = &self.stream;
        let mut st = s.lock();
        st.app_closed = true;
        let (peer, class) = (st.peer_stream, st.class);
        let release = if st.reset.is_some() || st.phase != Phase::Open {
            true
        } else if st.unread_bytes() > 0 {
            st.on_reset(ResetCause::LocalAbort);
            s.session.send_control(
                s.id,
                class,
                Frame::Rst { dst: peer, reason: RstReason::Aborted },
            );
            true
        } else {
            if let Some(final_offset) = st.shutdown_write() {
                s.session.send_control(s.id, class, Frame::Fin { dst: peer, final_offset });
            }
            // Otherwise linger until the peer finishes too (its FIN, RST or DATA frees it).
            st.peer_finished()
        };
        drop(st);
        if release {
            self.engine.streams.remove(s.id);
        }
        s.wake();
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
        if self.stream.registration.set(Registration::new(poller, token)).is_err() {
            return Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                "the socket is already registered with a poller",
            ));
        }
        if self.is_readable() || self.is_writable() {
            self.stream.wake();
        }
        Ok(())
    }

    /// Whether `recv` would return without blocking (data, end of stream or an error).
    pub fn is_readable(&self) -> bool {
        self.stream.lock().readable()
    }

    /// Whether `send` would make progress or fail without waiting for credit.
    pub fn is_writable(&self) -> bool {
        self.stream.lock().writable()
    }

    pub fn stats(&self) -> SocketStats {
        SocketStats::of(&self.stream)
    }
}

fn send_error(e: SendError) -> io::Error {
    match e {
        SendError::Reset(cause) => reset_error(cause),
        SendError::WriteClosed => {
            io::Error::new(io::ErrorKind::BrokenPipe, "the write half is shut down")
        }
        SendError::NoCredit => io::Error::new(io::ErrorKind::WouldBlock, "no send credit"),
        SendError::NotOpen => io::Error::new(io::ErrorKind::NotConnected, "not connected"),
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
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
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
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// State shared between a [`Listener`] and the workers that deliver SYNs to it.
pub(crate) struct ListenerShared {
    backlog: Mutex<VecDeque<Arc<Stream>>>,
    ready: Condvar,
    capacity: usize,
    closed: AtomicBool,
    readiness: OnceLock<EventFd>,
}

impl ListenerShared {
    pub fn is_full(&self) -> bool {
        self.backlog.lock().unwrap_or_else(|e| e.into_inner()).len() >= self.capacity
    }

    /// Queues an opened stream for `accept`; false if closed or full.
    pub fn push(&self, s: Arc<Stream>) -> bool {
        let mut q = self.backlog.lock().unwrap_or_else(|e| e.into_inner());
        if self.closed.load(Ordering::SeqCst) || q.len() >= self.capacity {
            return false;
        }
        q.push_back(s);
        drop(q);
        self.ready.notify_one();
        if let Some(fd) = self.readiness.get() {
            fd.notify();
        }
        true
    }

    pub fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        let _g = self.backlog.lock().unwrap_or_else(|e| e.into_inner());
        self.ready.notify_all();
    }
}

/// Accepts virtual sockets opened to one virtual port of this engine.
pub struct Listener {
    engine: Arc<EngineInner>,
    port: u16,
    shared: Arc<ListenerShared>,
    nonblocking: AtomicBool,
}

impl Listener {
    pub(crate) fn bind(engine: Arc<EngineInner>, port: u16) -> io::Result<Listener> {
        if engine.stopping() {
            return Err(io::Error::new(io::ErrorKind::ConnectionAborted, "engine shut down"));
        }
        let shared = Arc::new(ListenerShared {
            backlog: Mutex::new(VecDeque::new()),
            ready: Condvar::new(),
            capacity: engine.config.accept_backlog,
            closed: AtomicBool::new(false),
            readiness: OnceLock::new(),
        });
        {
            let mut map = engine.listeners.lock().unwrap_or_else(|e| e.into_inner());
            if map.contains_key(&port) {
                return Err(io::Error::new(
                    io::ErrorKind::AddrInUse,
                    format!("virtual port {port} already has a listener"),
                ));
            }
            map.insert(port, shared.clone());
        }
        Ok(Listener { engine, port, shared, nonblocking: AtomicBool::new(false) })
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn set_nonblocking(&self, nonblocking: bool) {
        self.nonblocking.store(nonblocking, Ordering::Relaxed);
    }

    /// Waits for the next virtual socket opened to this port.
    pub fn accept(&self) -> io::Result<VSocket> {
        self.accept_timeout(None)
    }

    pub fn accept_timeout(&self, timeout: Option<Duration>) -> io::Result<VSocket> {
        let deadline = timeout.map(|d| Instant::now() + d);
        let mut q = self.shared.backlog.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(s) = q.pop_front() {
                return Ok(VSocket::wrap(self.engine.clone(), s));
            }
            if self.shared.closed.load(Ordering::SeqCst) {
                return Err(io::Error::new(io::ErrorKind::ConnectionAborted, "listener closed"));
            }
            if self.nonblocking.load(Ordering::Relaxed) {
                return Err(io::Error::new(io::ErrorKind::WouldBlock, "no pending connection"));
            }
            q = match deadline {
                None => self.shared.ready.wait(q).unwrap_or_else(|e| e.into_inner()),
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        return Err(io::Error::new(io::ErrorKind::TimedOut, "accept timed out"));
                    }
                    self.shared.ready.wait_timeout(q, d - now).unwrap_or_else(|e| e.into_inner()).0
                }
            };
        }
    }

    /// An eventfd that becomes readable when a connection is pending (edge-triggered).
    pub fn readiness_fd(&self) -> io::Result<RawFd> {
        if self.shared.readiness.get().is_none() {
            let _ = self.shared.readiness.set(EventFd::new()?);
        }
        let fd = self.shared.readiness.get().expect("set above");
        if !self.shared.backlog.lock().unwrap_or_else(|e| e.into_inner()).is_empty() {
            fd.notify();
        }
        Ok(fd.raw())
    }

    pub fn clear_readiness(&self) {
        if let Some(fd) = self.shared.readiness.get() {
            fd.drain();
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        {
            let mut map = self.engine.listeners.lock().unwrap_or_else(|e| e.into_inner());
            if map.get(&self.port).is_some_and(|l| Arc::ptr_eq(l, &self.shared)) {
                map.remove(&self.port);
            }
        }
        self.shared.close();
        let pending: Vec<_> =
            self.shared.backlog.lock().unwrap_or_else(|e| e.into_inner()).drain(..).collect();
        for s in pending {
            // Accepted by the engine but never by the application: reset, as TCP does.
            let mut st = s.lock();
            if st.reset.is_none() {
                let (peer, class) = (st.peer_stream, st.class);
                st.on_reset(ResetCause::LocalAbort);
                drop(st);
                s.session.send_control(
                    s.id,
                    class,
                    Frame::Rst { dst: peer, reason: RstReason::Aborted },
                );
            }
            self.engine.streams.remove(s.id);
        }
    }
}

impl std::fmt::Debug for VSocket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VSocket")
            .field("id", &self.stream.id)
            .field("port", &self.stream.port)
            .field("peer", &self.stream.session.peer_addr)
            .finish()
    }
}

impl std::fmt::Debug for Listener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Listener").field("port", &self.port).finish()
    }
}
