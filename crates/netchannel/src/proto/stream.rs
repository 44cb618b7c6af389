//! Per-stream protocol state: offsets, credit, half-close, reset, and the two buffers. Pure:
//! the session core ([`super::Session`]) calls these with peer frames and application calls.

use super::ids::PeerStreamId;
use super::recvbuf::RecvBuf;
use super::sendbuf::SendBuf;
use crate::wire::{Class, RstReason};

/// Why a stream ended abnormally.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResetCause {
    /// The peer sent RST.
    Peer(RstReason),
    /// Every channel to the peer was lost; bytes may be missing.
    ChannelLost,
    /// The peer did not answer the open in time.
    ConnectTimeout,
    /// The application gave the open up (TCP's `shutdown` of a socket in SYN_SENT).
    ConnectAborted,
    /// The local engine shut down.
    EngineShutdown,
    /// Closed locally with unread data (the peer was sent RST).
    LocalAbort,
    /// The peer broke the protocol on this stream.
    ProtocolError,
    /// Closed with bytes still unsent or unacknowledged, and the linger time ran out.
    Undeliverable,
}

/// A peer frame that breaks the protocol for this stream. Closes the channel it came on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Violation {
    /// DATA or FIN beyond the credit this side granted.
    BeyondCredit,
    /// DATA beyond the final offset announced by FIN, or a FIN that contradicts data or an
    /// earlier FIN.
    BeyondFin,
    /// Too many out-of-order segments.
    TooManySegments,
    /// CREDIT acknowledging bytes never sent.
    CreditBeyondSent,
    /// A frame that makes no sense in the stream's state (SYN_ACK for an open stream, ...).
    UnexpectedFrame(&'static str),
    /// A stream id this side never issued.
    UnknownStream,
    /// An ACK for bytes never sent, or for a channel that does not exist.
    BadAck,
}

impl std::fmt::Display for Violation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Violation::BeyondCredit => f.write_str("data beyond granted credit"),
            Violation::BeyondFin => f.write_str("data or FIN inconsistent with final offset"),
            Violation::TooManySegments => f.write_str("too many out-of-order segments"),
            Violation::CreditBeyondSent => f.write_str("credit acknowledges bytes never sent"),
            Violation::UnexpectedFrame(what) => write!(f, "unexpected {what}"),
            Violation::UnknownStream => f.write_str("unknown stream id"),
            Violation::BadAck => f.write_str("acknowledgement of bytes never sent"),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// SYN sent, waiting for SYN_ACK.
    Connecting,
    /// SYN received; the listener has not decided yet.
    Incoming,
    Open,
}

/// Why `send` cannot take bytes now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendError {
    Reset(ResetCause),
    /// `shutdown(Write)` or `close` happened.
    WriteClosed,
    /// The peer granted no more credit yet.
    NoCredit,
    /// Every channel of the stream's class holds its share of unsent bytes (backpressure).
    NoSpace,
    /// Still connecting: the peer's stream id is not known yet.
    NotOpen,
    /// The stream does not exist (closed).
    Closed,
}

/// Control frames the stream owes the peer (bits of `Stream::owe`).
pub(crate) const OWE_SYN: u8 = 1;
pub(crate) const OWE_SYN_ACK: u8 = 2;
pub(crate) const OWE_CREDIT: u8 = 4;
pub(crate) const OWE_FIN: u8 = 8;
pub(crate) const OWE_URGENT: u8 = 16;

/// A stream's urgent data (TCP's urgent pointer: `MSG_OOB`, `SO_OOBINLINE`, `SIOCATMARK`), kept
/// beside the session's streams (`Session::urgent`), so that a stream that never uses it costs
/// nothing. `pos` below is the stream's read position (`RecvBuf::consumed`).
#[derive(Debug, Default)]
pub struct Urgent {
    /// The last byte this side's application sent as urgent: (offset, value), sent in URGENT
    /// (again after a channel loss).
    pub(crate) tx: Option<(u64, u8)>,
    /// The peer's latest urgent byte (the mark).
    rx: Option<RxUrgent>,
    /// An earlier mark the read position stood on when a newer one replaced it: its byte is
    /// still dropped from the stream (as `tcp_check_urg` steps over it at once).
    hole: Option<u64>,
    /// `SO_OOBINLINE`: urgent bytes stay in the stream.
    pub(crate) inline: bool,
}

impl Urgent {
    /// The peer's mark for its byte at `offset` (checked as a one-byte DATA range,
    /// `Stream::check_data`). Returns
    /// whether it is a new mark (as TCP's `tcp_check_urg`: a mark already read past, or no newer
    /// than the one held, is old news).
    pub(crate) fn on_peer_mark(&mut self, offset: u64, byte: u8, pos: u64) -> bool {
        if offset < pos {
            return false;
        }
        if let Some(old) = self.rx {
            if offset <= old.offset {
                return false;
            }
            if old.offset == pos && !self.inline {
                self.hole = Some(pos);
            }
        }
        self.rx = Some(RxUrgent { offset, byte, taken: false });
        true
    }

    /// The mark, while the read position has not passed it.
    pub fn mark(&self, pos: u64) -> Option<RxUrgent> {
        self.rx.filter(|r| r.offset >= pos)
    }

    /// Urgent data waits to be read out of band (`POLLPRI`): a mark not read past and not
    /// taken with `MSG_OOB`.
    pub fn pending(&self, pos: u64) -> bool {
        self.mark(pos).is_some_and(|r| !r.taken)
    }

    /// The read position is at the mark (`SIOCATMARK`).
    pub fn at_mark(&self, pos: u64) -> bool {
        self.mark(pos).is_some_and(|r| r.offset == pos)
    }

    /// For a read of at most `max` bytes at `pos`: whether the byte there is an urgent byte
    /// kept out of the stream (to be dropped first), and how many bytes the read may take (it
    /// stops before the next mark, as TCP's does once it has bytes).
    pub(crate) fn read_limit(&self, pos: u64, max: u64) -> (bool, u64) {
        let mark = self.rx.map(|r| r.offset);
        let skip = !self.inline && (self.hole == Some(pos) || mark == Some(pos));
        let from = pos + skip as u64;
        match mark {
            Some(m) if m > from => (skip, max.min(m - from)),
            _ => (skip, max),
        }
    }

    /// The urgent byte, read out of band (`MSG_OOB`): `None` when there is none to read
    /// (inline, none, already taken, or read past: TCP's `EINVAL`).
    pub(crate) fn take(&mut self, pos: u64, peek: bool) -> Option<u8> {
        if self.inline {
            return None;
        }
        let r = self.rx.as_mut().filter(|r| r.offset >= pos && !r.taken)?;
        if !peek {
            r.taken = true;
        }
        Some(r.byte)
    }
}

/// The peer's urgent byte.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RxUrgent {
    /// Its stream offset.
    pub offset: u64,
    /// Its value.
    pub byte: u8,
    /// Read out of band already (`MSG_OOB`).
    pub taken: bool,
}

/// Flags of `Stream::flags`.
pub(crate) const F_ACTIVE: u16 = 1; // in an active (unsent data) queue
pub(crate) const F_CONTROL: u16 = 2; // in a control queue
pub(crate) const F_EVENT: u16 = 4; // in the event queue
pub(crate) const F_SPACE_WAIT: u16 = 8; // waiting for class space
pub(crate) const F_DEFERRED_EMPTY: u16 = 16; // the front deferred payload has no bytes for now
pub(crate) const F_FIN_SENT: u16 = 32; // the FIN left (pulled at least once)
pub(crate) const F_PINNED: u16 = 64; // listed in the current compaction window (see `compact_if_due`)
pub(crate) const F_WRITE_LOST: u16 = 128; // every channel is gone; only reading goes on
pub(crate) const F_STARVED: u16 = 256; // wants more credit than the receive budget has room for
pub(crate) const F_READ_SHUT: u16 = 512; // the application shut the read half down (SHUT_RD)
pub(crate) const F_LOCAL: u16 = 1024; // opened here: this side picks its home channel
pub(crate) const F_KERNEL_PREFERRED: u16 = 4096; // accepted here: the SYN_ACK asks the opener to use kernel TCP
pub(crate) const F_PEER_PREFERS_KERNEL: u16 = 8192; // opened here: the peer's SYN_ACK asked for kernel TCP
pub(crate) const F_SPACE_WOKEN: u16 = 32768; // woken for class space, and not heard from since (`ClassTx::woken`)
pub(crate) const F_RST_PENDING: u16 = 16384; // the peer's RST waits for bytes sent before it (`Session::pending_rsts`)
pub(crate) const F_COMPETING: u16 = 2048; // holds receive credit beyond its floor, or wants it (`Session::rx_competing`)

pub struct Stream<U> {
    /// What the runtime keeps with the stream (wakers, poller registration).
    pub user: U,
    pub port: u16,
    pub class: Class,
    pub phase: Phase,
    /// The peer's id for this stream (from its SYN or SYN_ACK).
    pub peer: PeerStreamId,
    pub reset: Option<ResetCause>,
    /// The application closed its handle; the state lingers until the stream is done.
    pub app_closed: bool,
    pub(crate) owe: u8,
    pub(crate) flags: u16,
    /// Pending event bits (`EV_*`), while `F_EVENT` is set.
    pub(crate) events: u8,
    /// Frames of this stream pulled onto channels and not yet acknowledged.
    pub(crate) unacked_frames: u32,
    /// Connect or linger deadline, in the session's clock (`Session::ticks`; 0: none).
    pub(crate) deadline: u64,
    /// When the application last read a payload of this stream straight from a channel, in
    /// microseconds of the session's clock (wrapping; 0: never).
    pub(crate) direct_read_us: u32,
    pub frames_sent: u32,
    pub frames_received: u32,
    pub protocol_errors: u16,
    /// The channel the peer's last DATA (or its SYN) came on (index + 1; 0: none): the home of
    /// a stream the peer opened.
    pub(crate) rx_channel: u8,
    /// For a stream opened here: the turn of the application thread that last used it (+ 1,
    /// 0: none; `Session::thread_turn`), which picks the home among the class's channels.
    pub(crate) thread: u16,
    /// That thread's number.
    pub(crate) thread_number: u16,

    // send half
    pub(crate) send_next: u64,
    pub(crate) send_limit: u64,
    pub(crate) peer_consumed: u64,
    pub(crate) write_closed: bool,
    pub(crate) tx: SendBuf,

    // receive half
    pub(crate) rx: RecvBuf,
    /// The limit advertised to the peer: it may send bytes below it (SYN, SYN_ACK, CREDIT).
    pub(crate) granted: u64,
    /// What this stream holds of the session's receive budget (`Session::recharge`).
    pub(crate) rx_charge: u64,
    /// The window the application wants (the grant grows toward `consumed + window` as the
    /// budget allows).
    pub(crate) window: u32,
    /// The final offset the peer announced (`NO_FIN` until its FIN).
    fin: u64,
}

const NO_FIN: u64 = u64::MAX;

impl<U> Stream<U> {
    pub(crate) fn new(user: U, port: u16, class: Class, phase: Phase, window: u32) -> Self {
        Stream {
            user,
            port,
            class,
            phase,
            peer: PeerStreamId::default(),
            reset: None,
            app_closed: false,
            owe: 0,
            flags: 0,
            events: 0,
            unacked_frames: 0,
            deadline: 0,
            direct_read_us: 0,
            frames_sent: 0,
            frames_received: 0,
            protocol_errors: 0,
            rx_channel: 0,
            thread: 0,
            thread_number: 0,
            send_next: 0,
            send_limit: 0,
            peer_consumed: 0,
            write_closed: false,
            tx: SendBuf::default(),
            rx: RecvBuf::default(),
            // Nothing is granted until the session grants it within its budget.
            granted: 0,
            rx_charge: 0,
            window,
            fin: NO_FIN,
        }
    }

    /// The final offset the peer announced, once its FIN arrived.
    pub fn fin(&self) -> Option<u64> {
        (self.fin != NO_FIN).then_some(self.fin)
    }

    /// A DATA range (or an URGENT's byte) from the peer is within what this side granted and
    /// before any FIN.
    pub(crate) fn check_data(&self, offset: u64, len: u64) -> Result<(), Violation> {
        let end = offset + len; // the codec rejects overflow
        if end > self.granted {
            return Err(Violation::BeyondCredit);
        }
        if matches!(self.fin(), Some(fin) if end > fin) {
            return Err(Violation::BeyondFin);
        }
        Ok(())
    }

    /// The peer's process closed every channel (it exited, or was killed) while this stream was
    /// open: its kernel would have ended the connection with a FIN had it read everything this
    /// side sent, and with a reset otherwise. So the stream ends where what arrived in order ends
    /// (as if the peer's FIN came there) when the peer reported reading every byte sent and
    /// nothing of its own is missing (out of order, or deferred in a channel now closed).
    /// Returns whether it did. The peer reports what it read only every quarter window, so
    /// after a small request the answer is no (a reset) where TCP might have had a FIN.
    pub(crate) fn end_with_peer(&mut self) -> bool {
        let clean = self.reset.is_none()
            && self.phase == Phase::Open
            && !self.peer_finished()
            && self.peer_consumed == self.send_next
            && self.rx.high() == self.rx.contiguous_end()
            && !self.rx.has_deferred();
        if clean {
            self.fin = self.rx.contiguous_end();
        }
        clean
    }

    /// FIN carries the final offset: EOF is reported only once every byte before it arrived,
    /// whatever channel it travelled on and whenever the FIN itself arrived.
    pub(crate) fn on_fin(&mut self, final_offset: u64) -> Result<(), Violation> {
        if final_offset > self.granted {
            return Err(Violation::BeyondCredit);
        }
        if final_offset == NO_FIN
            || final_offset < self.rx.high()
            || matches!(self.fin(), Some(f) if f != final_offset)
        {
            return Err(Violation::BeyondFin);
        }
        self.fin = final_offset;
        Ok(())
    }

    /// Returns whether the send limit grew from none left (a writer may be waiting for it).
    pub(crate) fn on_credit(&mut self, consumed: u64, window: u32) -> Result<bool, Violation> {
        if consumed > self.send_next {
            return Err(Violation::CreditBeyondSent);
        }
        self.peer_consumed = self.peer_consumed.max(consumed);
        let limit = consumed + window as u64;
        // Only a stream that had no credit left can have a writer waiting for this one, as
        // kernel TCP wakes writers only after one found no room (`SOCK_NOSPACE`); with credit
        // left it was writable all along (a writer short of the class's space is woken when
        // that frees, `space_waiters`), and an event loop told so would only go round.
        let was_blocked = self.send_limit <= self.send_next;
        let grew = limit > self.send_limit;
        self.send_limit = self.send_limit.max(limit);
        Ok(grew && was_blocked)
    }

    /// Send credit available now, or why there is none (class space is the session's concern).
    pub(crate) fn send_capacity(&self) -> Result<u64, SendError> {
        if let Some(cause) = self.reset {
            return Err(SendError::Reset(cause));
        }
        if self.flags & F_WRITE_LOST != 0 {
            return Err(SendError::Reset(ResetCause::ChannelLost));
        }
        if self.write_closed || self.app_closed {
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

    pub(crate) fn at_eof(&self) -> bool {
        self.fin == self.rx.consumed()
    }

    /// Bytes the grant would grow by to reach `consumed + window` (0 once the peer finished
    /// or the stream was reset, or before it is open).
    pub(crate) fn credit_wanted(&self) -> u64 {
        if self.fin != NO_FIN || self.reset.is_some() || self.phase != Phase::Open {
            return 0;
        }
        (self.rx.consumed() + self.window as u64).saturating_sub(self.granted)
    }

    /// Credit (ignores class space) or a terminal state to report.
    pub fn writable_credit(&self) -> bool {
        self.reset.is_some()
            || self.write_closed
            || (self.phase == Phase::Open && self.send_limit > self.send_next)
    }

    pub fn bytes_sent(&self) -> u64 {
        self.send_next
    }

    pub fn bytes_received(&self) -> u64 {
        self.rx.contiguous_end()
    }

    /// Received bytes the application has not read.
    pub fn unread_bytes(&self) -> u64 {
        self.rx.unread()
    }

    /// Received bytes in order and not read yet (what a read can take, `FIONREAD`).
    pub fn readable_bytes(&self) -> u64 {
        self.rx.ready_front()
    }

    /// Bytes accepted from the application that are not yet on a channel.
    pub fn unsent_bytes(&self) -> u64 {
        self.tx.bytes()
    }

    /// Sent bytes the peer application has not consumed yet.
    pub fn unacked_bytes(&self) -> u64 {
        self.send_next - self.peer_consumed
    }

    /// Bytes the peer's credit admits beyond what was sent (0 before the stream is open).
    pub fn send_window(&self) -> u64 {
        self.send_limit.saturating_sub(self.send_next)
    }

    pub fn peer_finished(&self) -> bool {
        self.fin != NO_FIN
    }

    /// The peer's FIN is in order: every byte before it arrived and is in user space (what
    /// TCP reports as `POLLRDHUP`; a FIN that came ahead of data on another channel is not).
    pub fn fin_in_order(&self) -> bool {
        self.peer_finished() && self.rx.contiguous_end() == self.fin && !self.rx.has_deferred()
    }

    /// The peer finished and every byte up to its FIN is in user space.
    pub(crate) fn received_everything(&self) -> bool {
        self.reset.is_none()
            && self.phase == Phase::Open
            && self.peer_finished()
            && self.rx.contiguous_end() == self.fin
            && !self.rx.has_deferred()
    }

    pub fn write_closed(&self) -> bool {
        self.write_closed
    }

    /// The application shut its read half down: reads past the buffered bytes end at once.
    pub fn read_closed(&self) -> bool {
        self.flags & F_READ_SHUT != 0
    }

    pub fn state_name(&self) -> &'static str {
        match (self.reset, self.phase, self.app_closed) {
            (Some(_), ..) => "reset",
            (_, _, true) => "closed",
            (_, Phase::Connecting, _) => "connecting",
            (_, Phase::Incoming, _) => "incoming",
            _ if self.write_closed && self.peer_finished() => "finished",
            _ if self.write_closed => "write-closed",
            _ if self.peer_finished() => "peer-finished",
            _ => "open",
        }
    }
}
