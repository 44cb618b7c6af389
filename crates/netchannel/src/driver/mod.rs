//! NetDriver: the network and remote hosts seen as a multi-queue device. A *channel* is one
//! queue: an instance of a transport (for TCP: one connection) with its own congestion and flow
//! control. The paper's API maps onto:
//! - `create`: a transport's constructors (`tcp::dial`, `tcp::Incoming` on the accepting side);
//! - `destroy`: [`Channel::close`];
//! - `enqueue`: the session core's queues, pulled by [`Channel::write`] when the socket has room;
//! - `dequeue`: [`Channel::read`] into the channel's frame reader (`proto::framing`).
//!
//! A new transport implements [`Transport`] (a non-blocking byte stream with a pollable fd) and
//! its constructors; framing, batching and the execution model are shared. `pool` holds the
//! reused large buffers bulk bytes travel in.

pub mod pool;
pub mod tcp;

use std::collections::VecDeque;
use std::io::{self, IoSlice};
use std::os::fd::BorrowedFd;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, Ordering};

use parking_lot::Mutex;

use std::sync::Arc;

use crate::proto::framing::{FrameReader, Parsed, Target};
use crate::proto::{ChannelId, OutFrame};
use crate::sys;
use crate::wire::Class;
use pool::BufPool;

/// What a channel needs from its transport.
pub trait Transport: Send + Sync + 'static {
    /// The fd epoll watches (readable, writable, hang-up).
    fn fd(&self) -> BorrowedFd<'_>;
    /// Stops both directions; the peer sees end of stream.
    fn shutdown(&self);
}

/// Identity of a channel within its session.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChannelMeta {
    pub index: ChannelId,
    /// Class of the streams it carries.
    pub class: Class,
    /// The peer engine's id.
    pub peer_engine: u64,
}

/// Why a channel stopped.
#[derive(Debug)]
pub enum ChannelError {
    /// The peer closed the connection at a frame boundary.
    Closed,
    Io(io::Error),
    /// The peer broke the protocol; the channel is closed and the error counted.
    Protocol(String),
}

impl std::fmt::Display for ChannelError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ChannelError::Closed => write!(f, "closed by peer"),
            ChannelError::Io(e) => write!(f, "i/o error: {e}"),
            ChannelError::Protocol(s) => write!(f, "protocol error: {s}"),
        }
    }
}

/// Counters of one channel (a snapshot).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ChannelStats {
    /// Index within the session (0..=63).
    pub index: u16,
    /// How many times the index was dialed before this channel.
    pub incarnation: u16,
    /// Class of the streams it carries.
    pub class: Class,
    /// The peer engine's id.
    pub peer_engine: u64,
    /// Still open (false in `closed_channels`).
    pub open: bool,
    /// Bytes written to the socket.
    pub tx_bytes: u64,
    /// Bytes read from the socket.
    pub rx_bytes: u64,
    /// Frames written whole.
    pub tx_frames: u64,
    /// Frames received.
    pub rx_frames: u64,
    /// Bytes pulled from the session and not yet written to the socket.
    pub queued_bytes: u64,
    /// Protocol violations by the peer on this channel (each closes it).
    pub protocol_errors: u64,
    /// Why the channel closed, once it has.
    pub close_reason: Option<String>,
    /// The kernel's view of the connection (`TCP_INFO`: round-trip time, retransmitted
    /// segments) while it is open over TCP.
    pub tcp: Option<crate::sys::TcpInfo>,
    /// The connection's congestion control algorithm (`TCP_CONGESTION`) while it is open
    /// over TCP (`Config::congestion` chooses it).
    pub congestion: Option<String>,
}

/// Exclusive, non-blocking ownership of one half of a channel. A thread that finds the half
/// busy leaves a note (`PENDING`) instead of waiting; the owner runs again before it lets go,
/// so work announced while it ran is never lost and nobody ever blocks on the half.
#[derive(Default)]
pub struct RunLock(AtomicU8);

const BUSY: u8 = 1;
const PENDING: u8 = 2;

impl RunLock {
    /// True: the caller owns the half until `release` returns false.
    pub fn try_acquire(&self) -> bool {
        let mut s = self.0.load(Ordering::Acquire);
        loop {
            let next = if s & BUSY != 0 { s | PENDING } else { BUSY };
            match self.0.compare_exchange_weak(s, next, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return s & BUSY == 0,
                Err(now) => s = now,
            }
        }
    }

    /// Lets go, unless somebody left a note meanwhile: then returns true, the caller still
    /// owns the half and must run again.
    pub fn release(&self) -> bool {
        let mut s = self.0.load(Ordering::Acquire);
        loop {
            let (next, again) = if s & PENDING != 0 { (BUSY, true) } else { (0, false) };
            match self.0.compare_exchange_weak(s, next, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return again,
                Err(now) => s = now,
            }
        }
    }

    pub fn is_busy(&self) -> bool {
        self.0.load(Ordering::Acquire) & BUSY != 0
    }
}

/// The receiving half: what was read and not yet handed to the session.
pub struct RxState {
    pub reader: FrameReader<Arc<BufPool>>,
    pub parsed: Vec<Parsed>,
}

/// The sending half: frames pulled from the session and not yet fully written.
#[derive(Default)]
pub struct TxState {
    pub frames: VecDeque<OutFrame>,
    /// Bytes of the front frame already written.
    pub written: usize,
    /// Frames just pulled from the session, on their way to `frames` (kept for its capacity).
    pub pulled: Vec<OutFrame>,
}

#[cfg(test)]
thread_local! {
    /// Bytes this thread wrote to channels (tests: who did whose work).
    pub(crate) static WRITTEN_BY_THIS_THREAD: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Slices one channel write hands the kernel at most (below `IOV_MAX`, 1024; a header and a
/// payload per frame).
const WRITE_IOV: usize = 512;
/// The slices of a write of a few frames (a header and a payload each).
const SMALL_WRITE_IOV: usize = 16;

#[derive(Default)]
struct Counters {
    tx_bytes: AtomicU64,
    rx_bytes: AtomicU64,
    tx_frames: AtomicU64,
    rx_frames: AtomicU64,
    protocol_errors: AtomicU64,
    queued: AtomicU64,
}

/// Outcome of one `write`.
pub struct Written {
    pub bytes: usize,
    /// The socket is full (EAGAIN): wait for writability.
    pub blocked: bool,
}

static NEXT_UID: AtomicU64 = AtomicU64::new(1);

/// One channel at run time: its transport and its two halves.
pub struct Channel {
    /// Unique in the process (tokens in epoll sets).
    pub uid: u64,
    pub meta: ChannelMeta,
    transport: Box<dyn Transport>,
    pub rx_run: RunLock,
    pub rx: Mutex<RxState>,
    pub tx_run: RunLock,
    pub tx: Mutex<TxState>,
    /// The last write met a full socket; producers leave the bytes to whoever sees EPOLLOUT.
    pub tx_blocked: AtomicBool,
    /// On its worker's list of channels with lazy duties (`Worker::demand_tick`), listed once,
    /// and for what (`engine::worker`'s `UNLISTED`, `ACK_ONLY`, `URGENT`).
    pub tick_listed: AtomicU8,
    /// Application threads' epoll sets it is registered in (`engine/waiter.rs`): while none,
    /// only its worker is woken for it, which must then not sleep through its traffic.
    pub app_watchers: AtomicU32,
    /// Bytes read from it when its worker last looked (`quiet_since_last_look`).
    worker_seen_rx: AtomicU64,
    /// The peer shut down or the connection failed: the receive half reads until the end (a
    /// short read no longer means nothing more will come: end of stream may follow the data
    /// in the same edge).
    pub hung_up: AtomicBool,
    open: AtomicBool,
    /// The worker thread that serves this channel when no application thread does.
    pub worker: usize,
    counters: Counters,
    close_reason: Mutex<Option<String>>,
    /// What the channel holds for as long as it (and its fds) exist: its place in the
    /// engine's channel budget.
    _hold: Box<dyn std::any::Any + Send + Sync>,
}

impl Channel {
    pub fn new(
        meta: ChannelMeta,
        transport: Box<dyn Transport>,
        large: usize,
        worker: usize,
        pool: Arc<BufPool>,
        hold: Box<dyn std::any::Any + Send + Sync>,
    ) -> io::Result<Self> {
        Ok(Channel {
            uid: NEXT_UID.fetch_add(1, Ordering::Relaxed),
            meta,
            transport,
            rx_run: RunLock::default(),
            rx: Mutex::new(RxState { reader: FrameReader::new(large, pool), parsed: Vec::new() }),
            tx_run: RunLock::default(),
            tx: Mutex::new(TxState::default()),
            tx_blocked: AtomicBool::new(false),
            tick_listed: AtomicU8::new(0),
            app_watchers: AtomicU32::new(0),
            worker_seen_rx: AtomicU64::new(0),
            hung_up: AtomicBool::new(false),
            open: AtomicBool::new(true),
            _hold: hold,
            worker,
            counters: Counters::default(),
            close_reason: Mutex::new(None),
        })
    }

    pub fn fd(&self) -> BorrowedFd<'_> {
        self.transport.fd()
    }

    pub fn is_open(&self) -> bool {
        self.open.load(Ordering::Acquire)
    }

    /// Reads what the reader wants next into its buffer: `(read, asked)`. `read == 0` is end
    /// of stream, `WouldBlock` means nothing is there, and `read < asked` that the socket was
    /// drained (the buffer's room may be less than the reader wants: only `asked` counts).
    pub fn read(&self, st: &mut RxState) -> io::Result<(usize, usize)> {
        let want = st.reader.want();
        debug_assert!(want > 0);
        let (n, asked) = match st.reader.target(want) {
            Target::Staging(buf) => {
                let asked = want.min(buf.capacity() - buf.len());
                (sys::read_append(self.transport.fd(), buf, asked)?, asked)
            }
            Target::Payload(buf) => {
                let asked = want.min(buf.capacity() - buf.len());
                (sys::read_append_vec(self.transport.fd(), buf, asked)?, asked)
            }
        };
        self.counters.rx_bytes.fetch_add(n as u64, Ordering::Relaxed);
        Ok((n, asked))
    }

    /// Reads bytes of a deferred payload straight into an application buffer.
    pub fn read_direct(&self, buf: &mut [u8]) -> io::Result<usize> {
        let n = sys::read_into(self.transport.fd(), buf)?;
        self.counters.rx_bytes.fetch_add(n as u64, Ordering::Relaxed);
        Ok(n)
    }

    /// The socket holds bytes to read now, or its end (a deferred payload's reader finds
    /// something). True when the kernel cannot tell: the reader then learns by reading.
    pub fn bytes_waiting(&self) -> bool {
        self.hung_up.load(Ordering::Acquire)
            || rustix::io::ioctl_fionread(self.transport.fd()).map_or(true, |n| n > 0)
    }

    /// Whether nothing was read from the channel since the last call (its worker's look).
    pub fn quiet_since_last_look(&self) -> bool {
        let rx = self.counters.rx_bytes.load(Ordering::Relaxed);
        self.worker_seen_rx.swap(rx, Ordering::Relaxed) == rx
    }

    /// Bytes read from the channel so far, by any thread.
    pub fn rx_bytes(&self) -> u64 {
        self.counters.rx_bytes.load(Ordering::Relaxed)
    }

    pub fn count_rx_frames(&self, n: usize) {
        self.counters.rx_frames.fetch_add(n as u64, Ordering::Relaxed);
    }

    /// Writes as much of the pulled frames as the socket takes, in one send.
    pub fn write(&self, st: &mut TxState) -> io::Result<Written> {
        // Most writes carry a few frames: filling 512 empty slices (8 KiB of stack) for each
        // was half of this function's time under memcslap.
        if st.frames.len() * 2 <= SMALL_WRITE_IOV {
            self.write_with::<SMALL_WRITE_IOV>(st)
        } else {
            self.write_with::<WRITE_IOV>(st)
        }
    }

    fn write_with<const N: usize>(&self, st: &mut TxState) -> io::Result<Written> {
        // On the stack: a vector per write was an allocation beyond the allocator's per-thread
        // cache (8 KiB for 256 frames).
        let mut iov = [IoSlice::new(&[]); N];
        let mut used = 0;
        let mut skip = st.written;
        'frames: for f in &st.frames {
            let header = &f.header[..f.header_len as usize];
            for part in [header, &f.payload[..]] {
                if skip >= part.len() {
                    skip -= part.len();
                    continue;
                }
                if used == N {
                    break 'frames;
                }
                iov[used] = IoSlice::new(&part[skip..]);
                used += 1;
                skip = 0;
            }
        }
        if used == 0 {
            return Ok(Written { bytes: 0, blocked: false });
        }
        let n = match sys::send_vectored(self.transport.fd(), &iov[..used]) {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                return Ok(Written { bytes: 0, blocked: true });
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {
                return Ok(Written { bytes: 0, blocked: false });
            }
            Err(e) => return Err(e),
        };
        self.counters.tx_bytes.fetch_add(n as u64, Ordering::Relaxed);
        self.counters.queued.fetch_sub(n as u64, Ordering::Relaxed);
        #[cfg(test)]
        WRITTEN_BY_THIS_THREAD.with(|w| w.set(w.get() + n as u64));
        let mut left = st.written + n;
        let mut frames = 0;
        while let Some(front) = st.frames.front() {
            if left < front.len() {
                break;
            }
            left -= front.len();
            st.frames.pop_front();
            frames += 1;
        }
        st.written = left;
        self.counters.tx_frames.fetch_add(frames, Ordering::Relaxed);
        Ok(Written { bytes: n, blocked: false })
    }

    /// Frames pulled from the session were added to `TxState` (statistics only).
    pub fn count_queued(&self, bytes: usize) {
        self.counters.queued.fetch_add(bytes as u64, Ordering::Relaxed);
    }

    /// Marks the channel closed and records why; shuts the transport down. Returns false if it
    /// was already closed.
    pub fn close(&self, reason: &ChannelError) -> bool {
        if !self.open.swap(false, Ordering::AcqRel) {
            return false;
        }
        if matches!(reason, ChannelError::Protocol(_)) {
            self.counters.protocol_errors.fetch_add(1, Ordering::Relaxed);
        }
        *self.close_reason.lock() = Some(reason.to_string());
        self.transport.shutdown();
        true
    }

    pub fn stats(&self) -> ChannelStats {
        let c = &self.counters;
        ChannelStats {
            index: self.meta.index.index,
            incarnation: self.meta.index.incarnation,
            class: self.meta.class,
            peer_engine: self.meta.peer_engine,
            open: self.is_open(),
            tx_bytes: c.tx_bytes.load(Ordering::Relaxed),
            rx_bytes: c.rx_bytes.load(Ordering::Relaxed),
            tx_frames: c.tx_frames.load(Ordering::Relaxed),
            rx_frames: c.rx_frames.load(Ordering::Relaxed),
            queued_bytes: c.queued.load(Ordering::Relaxed),
            protocol_errors: c.protocol_errors.load(Ordering::Relaxed),
            close_reason: self.close_reason.lock().clone(),
            tcp: self.is_open().then(|| crate::sys::tcp_info(self.transport.fd())).flatten(),
            congestion: self
                .is_open()
                .then(|| rustix::net::sockopt::tcp_congestion(self.transport.fd()).ok())
                .flatten(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_lock_never_loses_a_note() {
        let l = RunLock::default();
        assert!(l.try_acquire());
        assert!(!l.try_acquire(), "busy: leaves a note");
        assert!(l.release(), "the owner runs again");
        assert!(!l.release());
        assert!(!l.is_busy());
        assert!(l.try_acquire());
        assert!(!l.release());
    }

    #[test]
    fn run_lock_under_contention() {
        use std::sync::Arc;
        // Every announcement (a counter bump followed by try_acquire) is seen by a run.
        let lock = Arc::new(RunLock::default());
        let announced = Arc::new(AtomicU64::new(0));
        let seen = Arc::new(AtomicU64::new(0));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let (lock, announced, seen) = (lock.clone(), announced.clone(), seen.clone());
                std::thread::spawn(move || {
                    for _ in 0..20_000 {
                        announced.fetch_add(1, Ordering::SeqCst);
                        if lock.try_acquire() {
                            loop {
                                seen.store(announced.load(Ordering::SeqCst), Ordering::SeqCst);
                                if !lock.release() {
                                    break;
                                }
                            }
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(seen.load(Ordering::SeqCst), 80_000);
    }
}
