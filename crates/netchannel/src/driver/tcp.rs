//! The TCP transport: one channel = one kernel TCP connection.
//!
//! Many frames leave in one `writev` and many are parsed from one `read`. Large DATA payloads
//! whose header arrived first are read straight into their own buffer, so the bytes are copied
//! once by the kernel and never staged in the receive buffer.

use std::collections::VecDeque;
use std::io::{self, IoSlice, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::pool::BufferPool;
use super::{owned_control, ChannelError, ChannelIo, ChannelQueues, InFrame};
use crate::sys::{self, Epoll, READABLE, WRITABLE};
use crate::wire::frame::{self, DATA_HEADER_LEN, MAX_CONTROL_LEN};
use crate::wire::handshake::HANDSHAKE_LEN;
use crate::wire::{Decoded, Handshake, HandshakeKind, WireError};

/// Payloads at least this large are read directly into their own buffer.
const DIRECT_READ_MIN: usize = 16 * 1024;
/// Bytes asked of one `read` into the staging buffer.
const RX_READ: usize = 256 * 1024;
/// iovecs per `writev`.
const MAX_IOV: usize = 64;
const TOKEN_SOCKET: u64 = 0;
const TOKEN_WAKE: u64 = 1;

/// Socket options every channel gets.
#[derive(Debug, Clone, Copy)]
pub struct TcpOptions {
    /// Unsent bytes the kernel may hold per channel (`TCP_NOTSENT_LOWAT`): the rest waits in
    /// user space, where the scheduler can still place it.
    pub notsent_lowat: u32,
}

fn configure(sock: &TcpStream, opts: &TcpOptions) -> io::Result<()> {
    sock.set_nodelay(true)?;
    sys::set_int_sockopt(
        sock.as_raw_fd(),
        libc::IPPROTO_TCP,
        libc::TCP_NOTSENT_LOWAT,
        opts.notsent_lowat.min(i32::MAX as u32) as i32,
    )
}

fn refused(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::ConnectionRefused, msg)
}

fn read_handshake(sock: &mut TcpStream) -> io::Result<[u8; HANDSHAKE_LEN]> {
    let mut buf = [0u8; HANDSHAKE_LEN];
    sock.read_exact(&mut buf)?;
    Ok(buf)
}

/// Dials a peer engine's channel listener and performs the handshake (the `create` of the
/// paper's API, dial side). Fails with `ConnectionRefused` when nothing listens or the peer
/// refuses, `InvalidData` when the peer is not a compatible engine, `TimedOut` when it is silent.
pub fn dial(
    addr: SocketAddr,
    hello: Handshake,
    timeout: Duration,
    opts: &TcpOptions,
) -> io::Result<(TcpStream, Handshake)> {
    let mut sock = TcpStream::connect_timeout(&addr, timeout)?;
    configure(&sock, opts)?;
    sock.set_read_timeout(Some(timeout))?;
    sock.write_all(&hello.encode())?;
    let reply = read_handshake(&mut sock).map_err(|e| match e.kind() {
        io::ErrorKind::UnexpectedEof | io::ErrorKind::ConnectionReset => {
            refused(format!("engine at {addr} closed the channel during the handshake"))
        }
        io::ErrorKind::WouldBlock => io::Error::new(
            io::ErrorKind::TimedOut,
            format!("engine at {addr} did not answer the channel handshake"),
        ),
        _ => e,
    })?;
    let reply = Handshake::decode(&reply).map_err(|e| match e {
        WireError::UnsupportedVersion(_) => refused(format!("engine at {addr}: {e}")),
        e => io::Error::new(io::ErrorKind::InvalidData, format!("engine at {addr}: {e}")),
    })?;
    match reply.kind {
        HandshakeKind::Accept => {}
        HandshakeKind::Reject(reason) => {
            return Err(refused(format!("engine at {addr} refused the channel: {reason}")))
        }
        HandshakeKind::Hello => {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("engine at {addr} answered a hello with a hello"),
            ))
        }
    }
    sock.set_read_timeout(None)?;
    sock.set_nonblocking(true)?;
    Ok((sock, reply))
}

/// Reads and validates the hello of an accepted connection. On a bad hello, answers with a
/// reject naming the reason before returning the error, so both sides see why.
pub fn accept_handshake(
    sock: &mut TcpStream,
    local_engine: u64,
    timeout: Duration,
    opts: &TcpOptions,
) -> Result<Handshake, WireError> {
    let bad_io = |_: io::Error| WireError::BadField { field: "handshake (i/o)", value: 0 };
    configure(sock, opts).map_err(bad_io)?;
    sock.set_read_timeout(Some(timeout)).map_err(bad_io)?;
    let buf = read_handshake(sock).map_err(bad_io)?;
    let hello = match Handshake::decode(&buf) {
        Ok(h) if h.kind == HandshakeKind::Hello => h,
        Ok(_) => Err(WireError::BadField { field: "handshake kind", value: buf[6] as u64 })?,
        Err(e) => {
            let _ = sock.write_all(&Handshake::reject_for(&e, local_engine).encode());
            return Err(e);
        }
    };
    Ok(hello)
}

/// Sends the accept (or a reject) and switches the socket to non-blocking mode.
pub fn finish_accept(sock: &mut TcpStream, reply: Handshake) -> io::Result<()> {
    sock.write_all(&reply.encode())?;
    sock.set_read_timeout(None)?;
    sock.set_nonblocking(true)
}

/// What one `read` on the channel socket produced.
enum ReadOutcome {
    /// Bytes arrived (or the call was interrupted): go on.
    Data,
    /// The peer closed the connection.
    Eof,
    /// Nothing more until epoll says readable.
    Drained,
}

/// A large DATA payload being read straight into its final buffer.
struct PartialPayload {
    stream: u32,
    offset: u64,
    len: usize,
    buf: Vec<u8>,
}

pub struct TcpChannelIo {
    sock: Arc<TcpStream>,
    queues: Arc<ChannelQueues>,
    epoll: Epoll,
    interest: u32,
    rx: Vec<u8>,
    rx_start: usize,
    partial: Option<PartialPayload>,
    /// False once a read returned EAGAIN, until epoll reports the socket readable again: saves
    /// a failing `read` per round on a channel that only transmits.
    maybe_readable: bool,
    pool: Arc<BufferPool>,
    /// The sending half, shared with threads that transmit inline while the worker is parked.
    tx: Arc<Mutex<TxHalf>>,
}

/// Frames taken from the queues and not yet fully written.
pub struct TxHalf {
    sock: Arc<TcpStream>,
    pool: Arc<BufferPool>,
    /// `tx_data[i]` says whether `tx[i]` is a DATA frame (control frames are batched).
    tx: VecDeque<Vec<u8>>,
    tx_data: VecDeque<bool>,
    tx_written: usize,
    blocked_on_write: bool,
    control_scratch: Vec<crate::wire::Frame<'static>>,
}

impl TcpChannelIo {
    pub fn new(
        sock: TcpStream,
        queues: Arc<ChannelQueues>,
        pool: Arc<BufferPool>,
    ) -> io::Result<Self> {
        let epoll = Epoll::new()?;
        epoll.add(sock.as_raw_fd(), READABLE, TOKEN_SOCKET)?;
        epoll.add(queues.wake_fd().raw(), READABLE, TOKEN_WAKE)?;
        let sock = Arc::new(sock);
        let tx = Arc::new(Mutex::new(TxHalf {
            sock: sock.clone(),
            pool: pool.clone(),
            tx: VecDeque::new(),
            tx_data: VecDeque::new(),
            tx_written: 0,
            blocked_on_write: false,
            control_scratch: Vec::new(),
        }));
        queues.set_inline(tx.clone());
        Ok(TcpChannelIo {
            sock,
            queues,
            epoll,
            interest: READABLE,
            rx: Vec::with_capacity(RX_READ),
            rx_start: 0,
            partial: None,
            maybe_readable: true,
            pool,
            tx,
        })
    }

    fn tx(&self) -> std::sync::MutexGuard<'_, TxHalf> {
        self.tx.lock().unwrap_or_else(|e| e.into_inner())
    }
    fn read_more(&mut self) -> io::Result<usize> {
        if self.rx_start > 0 && (self.rx_start == self.rx.len() || self.rx_start > RX_READ / 2) {
            self.rx.drain(..self.rx_start);
            self.rx_start = 0;
        }
        sys::read_append(self.sock.as_raw_fd(), &mut self.rx, RX_READ)
    }

    /// Continues a direct payload read. Returns true when the payload is complete.
    fn read_partial(&mut self, p: &mut PartialPayload) -> Result<bool, ChannelError> {
        while p.buf.len() < p.len {
            let want = p.len - p.buf.len();
            let r = sys::read_append(self.sock.as_raw_fd(), &mut p.buf, want);
            match self.after_read(r)? {
                ReadOutcome::Data => {}
                ReadOutcome::Eof => {
                    return Err(ChannelError::Protocol(
                        "truncated frame: eof inside a payload".into(),
                    ))
                }
                ReadOutcome::Drained => return Ok(false),
            }
        }
        Ok(true)
    }

    /// Accounts one `read` result. Every EAGAIN clears the readiness hint, so a worker only
    /// reads again after epoll reports the socket readable; EINTR counts as no data yet.
    fn after_read(&mut self, r: io::Result<usize>) -> Result<ReadOutcome, ChannelError> {
        match r {
            Ok(0) => Ok(ReadOutcome::Eof),
            Ok(n) => {
                self.queues.count_rx(n, 0);
                Ok(ReadOutcome::Data)
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                self.maybe_readable = false;
                Ok(ReadOutcome::Drained)
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => Ok(ReadOutcome::Data),
            Err(e) => Err(ChannelError::Io(e)),
        }
    }
}

impl TxHalf {
    fn refill(&mut self, queues: &ChannelQueues, budget: usize) {
        queues.take_control(&mut self.control_scratch);
        if !self.control_scratch.is_empty() {
            let mut buf = Vec::with_capacity(self.control_scratch.len() * MAX_CONTROL_LEN);
            for f in &self.control_scratch {
                f.encode(&mut buf);
            }
            queues.control_sent(self.control_scratch.len());
            self.control_scratch.clear();
            self.tx.push_back(buf);
            self.tx_data.push_back(false);
        }
        let before = self.tx.len();
        queues.take_data(&mut self.tx, MAX_IOV - before, budget);
        self.tx_data.extend(std::iter::repeat_n(true, self.tx.len() - before));
    }

    fn advance(&mut self, queues: &ChannelQueues, mut n: usize) {
        while n > 0 {
            let Some(front) = self.tx.front() else { break };
            let left = front.len() - self.tx_written;
            if n < left {
                self.tx_written += n;
                return;
            }
            n -= left;
            self.tx_written = 0;
            let buf = self.tx.pop_front().expect("front exists");
            if self.tx_data.pop_front() == Some(true) {
                queues.data_sent(buf.len());
                self.pool.put(buf);
            }
        }
    }

    pub fn transmit(
        &mut self,
        queues: &ChannelQueues,
        budget: usize,
    ) -> Result<usize, ChannelError> {
        let mut written = 0;
        while written < budget {
            if self.tx.is_empty() {
                self.refill(queues, budget - written);
                if self.tx.is_empty() {
                    break;
                }
            }
            let mut iov: [IoSlice<'_>; MAX_IOV] = [IoSlice::new(&[]); MAX_IOV];
            let mut count = 0;
            for (i, buf) in self.tx.iter().take(MAX_IOV).enumerate() {
                let start = if i == 0 { self.tx_written } else { 0 };
                iov[count] = IoSlice::new(&buf[start..]);
                count += 1;
            }
            match sys::writev(self.sock.as_raw_fd(), &iov[..count]) {
                Ok(n) => {
                    queues.count_tx_bytes(n);
                    self.advance(queues, n);
                    written += n;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    self.blocked_on_write = true;
                    break;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(ChannelError::Io(e)),
            }
        }
        Ok(written)
    }
}

impl super::InlineTransmit for Mutex<TxHalf> {
    fn try_transmit(&self, queues: &ChannelQueues, budget: usize) -> super::Inline {
        let Ok(mut tx) = self.try_lock() else { return super::Inline::Busy };
        match tx.transmit(queues, budget) {
            Ok(_) if tx.tx.is_empty() && !queues.has_work() => super::Inline::Done,
            Ok(_) => super::Inline::Pending,
            Err(_) => super::Inline::Pending, // the worker's own transmit meets the error
        }
    }
}

impl ChannelIo for TcpChannelIo {
    fn transmit(&mut self, budget: usize) -> Result<usize, ChannelError> {
        self.tx.lock().unwrap_or_else(|e| e.into_inner()).transmit(&self.queues, budget)
    }

    fn dequeue(
        &mut self,
        max_frames: usize,
        sink: &mut dyn FnMut(InFrame) -> Result<(), String>,
    ) -> Result<usize, ChannelError> {
        let mut frames = 0;
        loop {
            if let Some(mut p) = self.partial.take() {
                if !self.read_partial(&mut p)? {
                    self.partial = Some(p);
                    return Ok(frames);
                }
                self.queues.count_rx(0, 1);
                frames += 1;
                sink(InFrame::Data { stream: p.stream, offset: p.offset, payload: p.buf })
                    .map_err(ChannelError::Protocol)?;
            }
            while frames < max_frames {
                let avail = &self.rx[self.rx_start..];
                match frame::decode(avail).map_err(|e| ChannelError::Protocol(e.to_string()))? {
                    Decoded::Frame(f, n) => {
                        let owned = match f {
                            crate::wire::Frame::Data { stream, offset, payload } => {
                                let mut buf = self.pool.get(payload.len());
                                buf.extend_from_slice(payload);
                                InFrame::Data { stream, offset, payload: buf }
                            }
                            other => InFrame::Control(owned_control(other).expect("not data")),
                        };
                        self.rx_start += n;
                        self.queues.count_rx(0, 1);
                        frames += 1;
                        sink(owned).map_err(ChannelError::Protocol)?;
                    }
                    Decoded::PartialData { stream, offset, len } if len >= DIRECT_READ_MIN => {
                        let mut buf = self.pool.get(len);
                        buf.extend_from_slice(&avail[DATA_HEADER_LEN..]);
                        self.rx_start = self.rx.len();
                        self.partial = Some(PartialPayload { stream, offset, len, buf });
                        break;
                    }
                    Decoded::PartialData { .. } | Decoded::Incomplete { .. } => break,
                }
            }
            if frames >= max_frames {
                return Ok(frames);
            }
            if self.partial.is_some() {
                continue;
            }
            if !self.maybe_readable {
                return Ok(frames);
            }
            let r = self.read_more();
            match self.after_read(r)? {
                ReadOutcome::Data => {}
                ReadOutcome::Eof if self.rx_start < self.rx.len() => {
                    return Err(ChannelError::Protocol(
                        "truncated frame: eof inside a frame".into(),
                    ))
                }
                ReadOutcome::Eof => return Err(ChannelError::Closed),
                ReadOutcome::Drained => return Ok(frames),
            }
        }
    }

    fn park(&mut self, timeout: Option<Duration>) -> io::Result<()> {
        let want = {
            let tx = self.tx();
            if tx.blocked_on_write && !tx.tx.is_empty() {
                READABLE | WRITABLE
            } else {
                READABLE
            }
        };
        if want != self.interest {
            self.epoll.modify(self.sock.as_raw_fd(), want, TOKEN_SOCKET)?;
            self.interest = want;
        }
        let mut events = [libc::epoll_event { events: 0, u64: 0 }; 2];
        let n = self.epoll.wait(&mut events, timeout)?;
        let socket_ready = events[..n].iter().any(|e| e.u64 == TOKEN_SOCKET);
        // A timeout proves nothing either way: probe the socket again.
        self.maybe_readable |= socket_ready || n == 0;
        self.queues.wake_fd().drain();
        self.tx().blocked_on_write = false;
        Ok(())
    }
}

impl Drop for TcpChannelIo {
    fn drop(&mut self) {
        let _ = self.sock.shutdown(std::net::Shutdown::Both);
    }
}
