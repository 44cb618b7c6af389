//! Per-virtual-socket protocol state: offsets, credit, half-close, reset. Sans-IO: frames and
//! application calls go in, decisions come out (bytes read, a CREDIT to send, a violation); the
//! engine does the waiting and the sending.

use super::reorder::{RecvBuffer, ReorderError};
use crate::wire::{Class, RstReason};

/// Why a stream ended abnormally.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResetCause {
    /// The peer sent RST.
    Peer(RstReason),
    /// A channel that carried this stream's data was lost; bytes may be missing.
    ChannelLost,
    /// The peer did not answer the open in time.
    ConnectTimeout,
    /// The local engine shut down.
    EngineShutdown,
    /// Closed locally with unread data (the peer was sent RST).
    LocalAbort,
}

/// A peer frame that breaks the protocol for this stream. Closes the channel it came on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Violation {
    /// DATA or FIN beyond the credit this side granted.
    BeyondCredit,
    /// DATA beyond the final offset announced by FIN, or a FIN that contradicts data or an
    /// earlier FIN.
    BeyondFin,
    /// Bytes overlapping bytes already received.
    Overlap,
    /// Too many out-of-order segments.
    TooManySegments,
    /// CREDIT acknowledging bytes never sent.
    CreditBeyondSent,
}

impl From<ReorderError> for Violation {
    fn from(e: ReorderError) -> Self {
        match e {
            ReorderError::Overlap => Violation::Overlap,
            ReorderError::TooManySegments => Violation::TooManySegments,
        }
    }
}

impl std::fmt::Display for Violation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = match self {
            Violation::BeyondCredit => "data beyond granted credit",
            Violation::BeyondFin => "data or FIN inconsistent with final offset",
            Violation::Overlap => "data overlapping bytes already received",
            Violation::TooManySegments => "too many out-of-order segments",
            Violation::CreditBeyondSent => "credit acknowledges bytes never sent",
        };
        f.write_str(s)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// SYN sent, waiting for SYN_ACK.
    Connecting,
    Open,
}

/// Outcome of an attempt to take send credit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendError {
    Reset(ResetCause),
    /// `shutdown(Write)` or `close` happened.
    WriteClosed,
    /// The peer granted no more credit yet.
    NoCredit,
    /// Still connecting: the peer's stream id is not known yet.
    NotOpen,
}

/// Outcome of a read attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadError {
    Reset(ResetCause),
    /// Nothing to read yet.
    Empty,
}

pub struct StreamState {
    pub phase: Phase,
    pub class: Class,
    /// The peer's id for this stream (valid once open).
    pub peer_stream: u32,
    /// Bit i set: channel i carried a frame of this stream (either direction).
    pub channel_mask: u64,
    pub reset: Option<ResetCause>,
    /// The application closed its handle; the state lingers until the peer closes too.
    pub app_closed: bool,
    pub frames_sent: u64,
    pub frames_received: u64,
    pub protocol_errors: u32,

    send_next: u64,
    send_limit: u64,
    peer_consumed: u64,
    write_closed: bool,

    rx: RecvBuffer,
    rx_high: u64,
    consumed: u64,
    granted: u64,
    window: u32,
    fin: Option<u64>,
}

impl StreamState {
    /// `window`: the receive window this side grants; `peer_window`: the one the peer granted
    /// (0 while connecting).
    pub fn new(class: Class, window: u32, max_segments: usize) -> Self {
        StreamState {
            phase: Phase::Connecting,
            class,
            peer_stream: 0,
            channel_mask: 0,
            reset: None,
            app_closed: false,
            frames_sent: 0,
            frames_received: 0,
            protocol_errors: 0,
            send_next: 0,
            send_limit: 0,
            peer_consumed: 0,
            write_closed: false,
            rx: RecvBuffer::new(max_segments),
            rx_high: 0,
            consumed: 0,
            granted: window as u64,
            window,
            fin: None,
        }
    }

    /// The peer accepted (SYN_ACK) or opened (SYN) the stream.
    pub fn open(&mut self, peer_stream: u32, peer_window: u32) {
        self.phase = Phase::Open;
        self.peer_stream = peer_stream;
        self.send_limit = self.send_limit.max(peer_window as u64);
    }

    pub fn peer_stream_known(&self) -> bool {
        self.phase == Phase::Open
    }

    pub fn window(&self) -> u32 {
        self.window
    }

    // ---- peer input ----

    pub fn on_data(&mut self, offset: u64, payload: Vec<u8>) -> Result<usize, Violation> {
        let end = offset + payload.len() as u64; // the codec rejects overflow
        if end > self.granted {
            return Err(Violation::BeyondCredit);
        }
        if matches!(self.fin, Some(fin) if end > fin) {
            return Err(Violation::BeyondFin);
        }
        if self.reset.is_some() || self.app_closed {
            // Nobody will read these bytes; the window still bounds what the peer may send.
            self.rx_high = self.rx_high.max(end);
            return Ok(0);
        }
        let readable = self.rx.insert(offset, payload)?;
        self.rx_high = self.rx_high.max(end);
        Ok(readable)
    }

    /// FIN carries the final offset: EOF is reported only once every byte before it arrived,
    /// whatever channel it travelled on and whenever the FIN itself arrived.
    pub fn on_fin(&mut self, final_offset: u64) -> Result<(), Violation> {
        if final_offset > self.granted {
            return Err(Violation::BeyondCredit);
        }
        if final_offset < self.rx_high || matches!(self.fin, Some(f) if f != final_offset) {
            return Err(Violation::BeyondFin);
        }
        self.fin = Some(final_offset);
        Ok(())
    }

    pub fn on_credit(&mut self, consumed: u64, window: u32) -> Result<bool, Violation> {
        if consumed > self.send_next {
            return Err(Violation::CreditBeyondSent);
        }
        self.peer_consumed = self.peer_consumed.max(consumed);
        let limit = consumed + window as u64;
        let grew = limit > self.send_limit;
        self.send_limit = self.send_limit.max(limit);
        Ok(grew)
    }

    pub fn on_reset(&mut self, cause: ResetCause) {
        if self.reset.is_none() {
            self.reset = Some(cause);
            self.rx.clear();
        }
    }

    // ---- application input ----

    /// Send credit available now, or why there is none.
    pub fn send_capacity(&self) -> Result<u64, SendError> {
        if let Some(cause) = self.reset {
            return Err(SendError::Reset(cause));
        }
        if self.write_closed {
            return Err(SendError::WriteClosed);
        }
        if self.phase != Phase::Open {
            return Err(SendError::NotOpen);
        }
        match self.send_limit - self.send_next {
            0 => Err(SendError::NoCredit),
            n => Ok(n),
        }
    }

    /// Takes up to `max` bytes of send credit; returns the offset of the first byte.
    pub fn reserve_send(&mut self, max: usize) -> Result<(u64, usize), SendError> {
        let avail = self.send_capacity()?;
        let n = (max as u64).min(avail) as usize;
        let offset = self.send_next;
        self.send_next += n as u64;
        Ok((offset, n))
    }

    /// Closes the write half; returns the final offset to announce in a FIN, once.
    pub fn shutdown_write(&mut self) -> Option<u64> {
        if self.write_closed || self.reset.is_some() {
            return None;
        }
        self.write_closed = true;
        Some(self.send_next)
    }

    /// Reads ready bytes. `Ok(0)` with a non-empty `buf` means end of stream. Buffers emptied
    /// by the read are handed to `recycle`.
    pub fn read_recycling(
        &mut self,
        buf: &mut [u8],
        recycle: &mut dyn FnMut(Vec<u8>),
    ) -> Result<usize, ReadError> {
        if let Some(cause) = self.reset {
            return Err(ReadError::Reset(cause));
        }
        if self.rx.ready_bytes() > 0 {
            let n = self.rx.read(buf, recycle);
            self.consumed += n as u64;
            return Ok(n);
        }
        if self.at_eof() || buf.is_empty() {
            return Ok(0);
        }
        Err(ReadError::Empty)
    }

    pub fn read(&mut self, buf: &mut [u8]) -> Result<usize, ReadError> {
        self.read_recycling(buf, &mut drop)
    }

    pub fn at_eof(&self) -> bool {
        self.fin == Some(self.rx.contiguous_end())
    }

    /// After reads: a CREDIT `(consumed, window)` to send, when the window the peer sees has
    /// shrunk by a quarter or more. Batching credits keeps control traffic to a few frames per
    /// window of data.
    pub fn credit_due(&mut self) -> Option<(u64, u32)> {
        if self.fin.is_some() || self.reset.is_some() || self.phase != Phase::Open {
            return None;
        }
        let limit = self.consumed + self.window as u64;
        if limit - self.granted >= (self.window as u64 / 4).max(1) {
            self.granted = limit;
            return Some((self.consumed, self.window));
        }
        None
    }

    pub fn readable(&self) -> bool {
        self.rx.ready_bytes() > 0 || self.at_eof() || self.reset.is_some()
    }

    pub fn writable(&self) -> bool {
        self.reset.is_some()
            || self.write_closed
            || (self.phase == Phase::Open && self.send_limit > self.send_next)
    }

    /// Bytes held for the application (ready and out of order).
    pub fn unread_bytes(&self) -> usize {
        self.rx.buffered_bytes()
    }

    pub fn bytes_sent(&self) -> u64 {
        self.send_next
    }

    pub fn bytes_received(&self) -> u64 {
        self.rx.contiguous_end()
    }

    /// Sent bytes the peer application has not consumed yet.
    pub fn unacked_bytes(&self) -> u64 {
        self.send_next - self.peer_consumed
    }

    pub fn peer_finished(&self) -> bool {
        self.fin.is_some()
    }

    pub fn write_closed(&self) -> bool {
        self.write_closed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn open_pair(window: u32) -> StreamState {
        let mut s = StreamState::new(Class::Throughput, window, 64);
        s.open(5, window);
        s
    }

    #[test]
    fn fin_overtaking_data_does_not_truncate() {
        let mut s = open_pair(1000);
        s.on_data(0, vec![1; 10]).unwrap();
        s.on_fin(30).unwrap(); // arrives before bytes 10..30 sent on another channel
        let mut buf = [0u8; 64];
        assert_eq!(s.read(&mut buf), Ok(10));
        assert_eq!(s.read(&mut buf), Err(ReadError::Empty), "no EOF while bytes are missing");
        s.on_data(20, vec![3; 10]).unwrap();
        assert_eq!(s.read(&mut buf), Err(ReadError::Empty));
        s.on_data(10, vec![2; 10]).unwrap();
        assert_eq!(s.read(&mut buf), Ok(20));
        assert_eq!(&buf[..20], &[[2u8; 10], [3u8; 10]].concat()[..]);
        assert_eq!(s.read(&mut buf), Ok(0), "EOF after the last byte");
    }

    #[test]
    fn data_beyond_credit_or_fin_is_a_violation() {
        let mut s = open_pair(100);
        assert_eq!(s.on_data(90, vec![0; 11]), Err(Violation::BeyondCredit));
        s.on_data(0, vec![0; 50]).unwrap();
        assert_eq!(s.on_fin(40), Err(Violation::BeyondFin), "FIN below received data");
        s.on_fin(60).unwrap();
        assert_eq!(s.on_fin(70), Err(Violation::BeyondFin), "FIN moved");
        assert_eq!(s.on_data(55, vec![0; 10]), Err(Violation::BeyondFin));
        assert_eq!(s.on_fin(101), Err(Violation::BeyondCredit));
    }

    #[test]
    fn credit_is_batched_and_moves_the_send_limit() {
        let mut rx = open_pair(100);
        rx.on_data(0, vec![0; 100]).unwrap();
        let mut buf = [0u8; 10];
        rx.read(&mut buf).unwrap();
        assert_eq!(rx.credit_due(), None, "10 bytes < a quarter of the window");
        let mut big = [0u8; 30];
        rx.read(&mut big).unwrap();
        assert_eq!(rx.credit_due(), Some((40, 100)));

        let mut tx = open_pair(100);
        assert_eq!(tx.reserve_send(80), Ok((0, 80)));
        assert_eq!(tx.reserve_send(80), Ok((80, 20)));
        assert_eq!(tx.reserve_send(1), Err(SendError::NoCredit));
        assert_eq!(tx.on_credit(101, 100), Err(Violation::CreditBeyondSent));
        assert_eq!(tx.on_credit(40, 100), Ok(true));
        assert_eq!(tx.reserve_send(100), Ok((100, 40)));
        assert_eq!(tx.unacked_bytes(), 100);
    }

    #[test]
    fn half_close_and_reset() {
        let mut s = open_pair(100);
        assert_eq!(s.shutdown_write(), Some(0));
        assert_eq!(s.shutdown_write(), None);
        assert_eq!(s.reserve_send(1), Err(SendError::WriteClosed));
        s.on_data(0, vec![1; 5]).unwrap();
        s.on_reset(ResetCause::Peer(RstReason::Aborted));
        let mut buf = [0u8; 8];
        assert_eq!(s.read(&mut buf), Err(ReadError::Reset(ResetCause::Peer(RstReason::Aborted))));
        assert_eq!(s.unread_bytes(), 0, "a reset drops buffered bytes");
    }

    #[test]
    fn cannot_send_before_open() {
        let mut s = StreamState::new(Class::Latency, 100, 8);
        assert_eq!(s.reserve_send(1), Err(SendError::NotOpen));
        // DATA may arrive before SYN_ACK (it travels on another channel): it is kept.
        s.on_data(0, vec![9; 3]).unwrap();
        s.open(1, 50);
        let mut b = [0u8; 3];
        assert_eq!(s.read(&mut b), Ok(3));
    }

    #[test]
    fn idle_state_is_small() {
        // A million idle virtual sockets must fit well under 1 GiB (design brief section 5).
        assert!(
            std::mem::size_of::<StreamState>() <= 256,
            "{}",
            std::mem::size_of::<StreamState>()
        );
    }
}
