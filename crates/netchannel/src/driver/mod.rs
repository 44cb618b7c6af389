//! NetDriver: the network and remote hosts seen as a multi-queue device. A *channel* is one queue.
//!
//! The paper's API maps onto two halves:
//! - [`Channel`] (shared): `enqueue` of frames by any thread, queue occupancy for the scheduler,
//!   statistics. [`ChannelQueues`] implements it once for every transport.
//! - [`ChannelIo`] (owned by the channel's worker): `transmit` what was enqueued, `dequeue`
//!   received frames, `park` until there is work. `create` is a transport's constructor
//!   (for TCP, [`tcp::dial`] / [`tcp::accept_handshake`]); `destroy` is dropping the pair.
//!
//! A new transport implements only `ChannelIo` and its constructors.

pub mod pool;
pub mod tcp;

use std::collections::VecDeque;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use crate::sys::EventFd;
use crate::wire::{Class, Frame};

/// Identity of a channel within its session.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChannelMeta {
    pub index: u16,
    pub class: Class,
    pub peer_engine: u64,
}

/// A received frame, owned, so DATA payloads move into the receive buffer without a copy.
#[derive(Debug)]
pub enum InFrame {
    Data { stream: u32, offset: u64, payload: Vec<u8> },
    Control(Frame<'static>),
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
    pub index: u16,
    pub class: Class,
    pub peer_engine: u64,
    pub open: bool,
    pub tx_bytes: u64,
    pub rx_bytes: u64,
    pub tx_frames: u64,
    pub rx_frames: u64,
    pub queued_bytes: u64,
    pub protocol_errors: u64,
    /// Why the channel closed, once it has.
    pub close_reason: Option<String>,
}

/// The shared side of a channel.
pub trait Channel: Send + Sync {
    fn meta(&self) -> ChannelMeta;
    /// Queues one encoded DATA frame. Never blocks: the scheduler bounds the queue by checking
    /// `queued_bytes` first. Returns false when the channel is closed (the frame is dropped).
    fn enqueue(&self, frame: Vec<u8>) -> bool;
    /// Queues a control frame; sent before queued DATA. Control frames are bounded by
    /// construction (a few per stream per window, see docs/ARCHITECTURE.md).
    fn enqueue_control(&self, frame: Frame<'static>) -> bool;
    fn queued_bytes(&self) -> u64;
    fn is_open(&self) -> bool;
    fn stats(&self) -> ChannelStats;
}

/// The worker-owned side of a channel.
pub trait ChannelIo: Send {
    /// Writes queued frames, at most about `budget` bytes; returns bytes written.
    fn transmit(&mut self, budget: usize) -> Result<usize, ChannelError>;
    /// Reads and parses at most `max_frames` frames, handing each to `sink`; an `Err` from the
    /// sink is a protocol violation that closes the channel. Returns frames handled.
    fn dequeue(
        &mut self,
        max_frames: usize,
        sink: &mut dyn FnMut(InFrame) -> Result<(), String>,
    ) -> Result<usize, ChannelError>;
    /// Blocks until the transport is readable, writable with output pending, or woken.
    fn park(&mut self, timeout: Option<Duration>) -> io::Result<()>;
}

#[derive(Default)]
struct Counters {
    tx_bytes: AtomicU64,
    rx_bytes: AtomicU64,
    tx_frames: AtomicU64,
    rx_frames: AtomicU64,
    protocol_errors: AtomicU64,
}

/// Result of a producer's attempt to transmit on a parked worker's behalf.
pub enum Inline {
    /// Everything queued was written.
    Done,
    /// Bytes remain (the transport is full, or failed): the worker must take over.
    Pending,
    /// Another thread is transmitting right now.
    Busy,
}

/// A transport's sending half that producers may drive themselves while the worker is parked,
/// which saves the worker's wake-up (an eventfd write and a context switch, the largest cost of
/// small RPCs in `ncperf profile`).
pub trait InlineTransmit: Send + Sync {
    fn try_transmit(&self, queues: &ChannelQueues, budget: usize) -> Inline;
}

/// Bytes a producer writes inline before handing the rest to the worker.
const INLINE_BUDGET: usize = 256 * 1024;
/// Only a small backlog (RPC-sized messages, control frames) is written inline; bulk frames go
/// to the worker, so a bulk sender keeps its workers' parallelism (measured: inline bulk writes
/// cost a single stream a fifth of its goodput, inline small ones cut 4 KiB RPC latency by 20%).
const INLINE_MAX_QUEUED: u64 = 64 * 1024;

/// Transport-independent queues of a channel plus the wake-up of its parked worker.
pub struct ChannelQueues {
    meta: ChannelMeta,
    data: Mutex<VecDeque<Vec<u8>>>,
    control: Mutex<VecDeque<Frame<'static>>>,
    control_len: AtomicUsize,
    /// Frames in `data` not yet taken by the worker (unlike `queued`, excludes bytes the
    /// worker holds while the transport is busy), so a blocked worker can still park.
    data_len: AtomicUsize,
    queued: AtomicU64,
    parked: AtomicBool,
    open: AtomicBool,
    wake: EventFd,
    counters: Counters,
    close_reason: Mutex<Option<String>>,
    inline: OnceLock<Arc<dyn InlineTransmit>>,
}

impl ChannelQueues {
    pub fn new(meta: ChannelMeta) -> io::Result<Self> {
        Ok(ChannelQueues {
            meta,
            data: Mutex::new(VecDeque::new()),
            control: Mutex::new(VecDeque::new()),
            control_len: AtomicUsize::new(0),
            data_len: AtomicUsize::new(0),
            queued: AtomicU64::new(0),
            parked: AtomicBool::new(false),
            open: AtomicBool::new(true),
            wake: EventFd::new()?,
            counters: Counters::default(),
            close_reason: Mutex::new(None),
            inline: OnceLock::new(),
        })
    }

    pub fn wake_fd(&self) -> &EventFd {
        &self.wake
    }

    /// Lets producers transmit inline through `tx` while the worker is parked.
    pub fn set_inline(&self, tx: Arc<dyn InlineTransmit>) {
        let _ = self.inline.set(tx);
    }

    /// New work is queued: if the worker is parked, transmit it inline, and wake the worker
    /// only if that could not finish. Pairs with [`ChannelQueues::set_parked`]: both sides use
    /// SeqCst so either the worker sees the new work or the producer sees `parked`.
    pub fn wake(&self) {
        if !self.parked.load(Ordering::SeqCst) {
            return;
        }
        if let Some(tx) = self.inline.get() {
            let small = self.queued_bytes() <= INLINE_MAX_QUEUED;
            if small
                && self.is_open()
                && matches!(tx.try_transmit(self, INLINE_BUDGET), Inline::Done)
            {
                return;
            }
        }
        self.wake.notify();
    }

    pub fn set_parked(&self, parked: bool) {
        self.parked.store(parked, Ordering::SeqCst);
    }

    pub fn has_work(&self) -> bool {
        self.control_len.load(Ordering::SeqCst) > 0 || self.data_len.load(Ordering::SeqCst) > 0
    }

    /// Moves queued control frames into `out`.
    pub fn take_control(&self, out: &mut Vec<Frame<'static>>) {
        if self.control_len.load(Ordering::Acquire) == 0 {
            return;
        }
        let mut q = self.control.lock().unwrap_or_else(|e| e.into_inner());
        self.control_len.store(0, Ordering::Release);
        out.extend(q.drain(..));
    }

    /// Moves up to `max_frames` DATA frames (about `max_bytes`) into `out`.
    pub fn take_data(&self, out: &mut VecDeque<Vec<u8>>, max_frames: usize, max_bytes: usize) {
        let mut q = self.data.lock().unwrap_or_else(|e| e.into_inner());
        let mut bytes = 0;
        while bytes < max_bytes && out.len() < max_frames {
            let Some(f) = q.pop_front() else { break };
            bytes += f.len();
            out.push_back(f);
        }
        self.data_len.store(q.len(), Ordering::SeqCst);
    }

    /// A DATA frame of `len` bytes has been handed to the transport.
    pub fn data_sent(&self, len: usize) {
        self.queued.fetch_sub(len as u64, Ordering::AcqRel);
        self.counters.tx_frames.fetch_add(1, Ordering::Relaxed);
    }

    pub fn control_sent(&self, frames: usize) {
        self.counters.tx_frames.fetch_add(frames as u64, Ordering::Relaxed);
    }

    pub fn count_tx_bytes(&self, n: usize) {
        self.counters.tx_bytes.fetch_add(n as u64, Ordering::Relaxed);
    }

    pub fn count_rx(&self, bytes: usize, frames: usize) {
        self.counters.rx_bytes.fetch_add(bytes as u64, Ordering::Relaxed);
        self.counters.rx_frames.fetch_add(frames as u64, Ordering::Relaxed);
    }

    /// Marks the channel closed, records why, and drops what was still queued.
    pub fn close(&self, reason: &ChannelError) {
        if matches!(reason, ChannelError::Protocol(_)) {
            self.counters.protocol_errors.fetch_add(1, Ordering::Relaxed);
        }
        *self.close_reason.lock().unwrap_or_else(|e| e.into_inner()) = Some(reason.to_string());
        self.open.store(false, Ordering::SeqCst);
        let dropped: usize = {
            let mut q = self.data.lock().unwrap_or_else(|e| e.into_inner());
            self.data_len.store(0, Ordering::SeqCst);
            q.drain(..).map(|f| f.len()).sum()
        };
        self.queued.fetch_sub(dropped as u64, Ordering::AcqRel);
        self.control.lock().unwrap_or_else(|e| e.into_inner()).clear();
        self.control_len.store(0, Ordering::Release);
    }
}

impl Channel for ChannelQueues {
    fn meta(&self) -> ChannelMeta {
        self.meta
    }

    fn enqueue(&self, frame: Vec<u8>) -> bool {
        {
            let mut q = self.data.lock().unwrap_or_else(|e| e.into_inner());
            // Checked under the lock that `close` drains under, so nothing is left behind.
            if !self.open.load(Ordering::SeqCst) {
                return false;
            }
            self.queued.fetch_add(frame.len() as u64, Ordering::SeqCst);
            q.push_back(frame);
            self.data_len.store(q.len(), Ordering::SeqCst);
        }
        self.wake();
        true
    }

    fn enqueue_control(&self, frame: Frame<'static>) -> bool {
        {
            let mut q = self.control.lock().unwrap_or_else(|e| e.into_inner());
            if !self.open.load(Ordering::SeqCst) {
                return false;
            }
            q.push_back(frame);
            self.control_len.store(q.len(), Ordering::SeqCst);
        }
        self.wake();
        true
    }

    fn queued_bytes(&self) -> u64 {
        self.queued.load(Ordering::Relaxed)
    }

    fn is_open(&self) -> bool {
        self.open.load(Ordering::SeqCst)
    }

    fn stats(&self) -> ChannelStats {
        let c = &self.counters;
        ChannelStats {
            index: self.meta.index,
            class: self.meta.class,
            peer_engine: self.meta.peer_engine,
            open: self.is_open(),
            tx_bytes: c.tx_bytes.load(Ordering::Relaxed),
            rx_bytes: c.rx_bytes.load(Ordering::Relaxed),
            tx_frames: c.tx_frames.load(Ordering::Relaxed),
            rx_frames: c.rx_frames.load(Ordering::Relaxed),
            queued_bytes: self.queued_bytes(),
            protocol_errors: c.protocol_errors.load(Ordering::Relaxed),
            close_reason: self.close_reason.lock().unwrap_or_else(|e| e.into_inner()).clone(),
        }
    }
}

/// Converts a borrowed control frame into an owned one; `None` for DATA.
pub fn owned_control(frame: Frame<'_>) -> Option<Frame<'static>> {
    Some(match frame {
        Frame::Data { .. } => return None,
        Frame::Syn { src, port, class, window } => Frame::Syn { src, port, class, window },
        Frame::SynAck { dst, src, window } => Frame::SynAck { dst, src, window },
        Frame::Rst { dst, reason } => Frame::Rst { dst, reason },
        Frame::Fin { dst, final_offset } => Frame::Fin { dst, final_offset },
        Frame::Credit { dst, consumed, window } => Frame::Credit { dst, consumed, window },
    })
}
