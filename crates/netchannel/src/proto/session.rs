//! The session state machine: every stream between this engine and one peer engine, and the
//! protocol state of every channel between them.
//!
//! Inputs: what each channel's frame reader parsed ([`Session::receive`]), application calls (`open`, `send`, `recv`,
//! `shutdown_write`, `close`), channel arrival and loss, and time (`handle_timeout`). Outputs:
//! the frames a channel sends next ([`Session::poll_transmit`]) and events
//! ([`Session::poll_event`], [`Session::poll_incoming`]).
//!
//! Reliability across channels: every frame pulled onto a channel is retained, with the
//! channel byte position where it ends, until the peer acknowledges that position (ACK frames,
//! piggybacked on whatever else goes the other way). When a channel is lost, what it carried
//! and the peer did not acknowledge is queued again on the channels that remain (DATA as bytes
//! to send again, control frames as owed again); the receiver trims duplicates. A stream is
//! freed only when nothing it depends on is in flight.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::time::{Duration, Instant};

use bytes::Bytes;

use super::framing::{Buffers, FrameReader, Parsed, Verdict};
use super::recvbuf::{TooManySegments, COMPACT_BELOW};
use super::stream::*;
use super::table::{Lookup, Table};
use crate::scheduler::{ActiveQueues, Policy};
use crate::wire::frame::{data_header, DATA_HEADER_LEN, MAX_HEADER_LEN};
use crate::wire::handshake::MAX_CHANNEL_INDEX;
use crate::wire::{Class, Frame, RstReason};

/// Event bits: the stream may have become readable / writable (or failed).
pub const EV_READ: u8 = 1;
pub const EV_WRITE: u8 = 2;

/// Senders woken per this many bytes of class space freed (each may write about that much).
const SPACE_WAKE_QUANTUM: u64 = 64 * 1024;

#[derive(Debug, Clone)]
pub struct CoreConfig {
    /// Receive window granted per stream.
    pub window: u32,
    /// Largest DATA payload this side sends.
    pub max_frame_payload: usize,
    /// Out-of-order segments held per stream before the peer is deemed abusive.
    pub max_out_of_order: usize,
    pub policy: Policy,
    /// Unsent bytes a class may hold per channel before senders wait (backpressure).
    pub queue_threshold: u64,
    pub max_streams: u32,
    /// Unacknowledged received bytes on a channel that make an ACK due on their own.
    pub ack_threshold: u64,
    /// RST frames queued for the peer before further ones are dropped (counted).
    pub max_pending_rsts: usize,
    pub connect_timeout: Duration,
    /// How long a closed stream may take to deliver its last bytes before it is reset.
    pub linger: Duration,
}

impl Default for CoreConfig {
    fn default() -> Self {
        CoreConfig {
            window: 4 << 20,
            max_frame_payload: 256 * 1024,
            max_out_of_order: 4096,
            policy: Policy::RoundRobin,
            queue_threshold: 2 << 20,
            max_streams: 1 << 21,
            ack_threshold: 1 << 20,
            max_pending_rsts: 4096,
            connect_timeout: Duration::from_secs(5),
            linger: Duration::from_secs(30),
        }
    }
}

/// One frame to write: an encoded header and, for DATA, its payload (shared, not copied).
pub struct OutFrame {
    pub header: [u8; MAX_HEADER_LEN],
    pub header_len: u8,
    pub payload: Bytes,
}

impl OutFrame {
    pub fn len(&self) -> usize {
        self.header_len as usize + self.payload.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn control(frame: Frame<'_>) -> OutFrame {
        let mut header = [0u8; MAX_HEADER_LEN];
        let n = frame.encode_header(&mut header);
        OutFrame { header, header_len: n as u8, payload: Bytes::new() }
    }
}

/// The outcome of `recv`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recv {
    /// This many bytes were moved to the output as slices.
    Data(u64),
    /// The next bytes are in channel `channel`'s socket: read at most `max` of them into the
    /// application's buffer, then report with `deferred_read`.
    Deferred {
        channel: u16,
        max: u64,
    },
    /// The peer finished and every byte was read.
    Eof,
    /// Nothing yet.
    Empty,
    Reset(ResetCause),
    /// No such stream (closed).
    Closed,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpenError {
    /// `max_streams` reached.
    Limit,
    /// The session has no channel left.
    NoChannels,
}

/// Counters of a session.
#[derive(Debug, Clone, Default)]
pub struct CoreStats {
    pub streams: usize,
    /// Frames for streams already closed here (normal after a reset; ignored).
    pub stale_frames: u64,
    /// Unsent bytes held in stream buffers.
    pub unsent_bytes: u64,
    /// Bytes sent and not yet acknowledged by the peer, kept for retransmission.
    pub retained_bytes: u64,
    /// Bytes retransmitted after channel losses.
    pub retransmitted_bytes: u64,
    /// RST frames dropped because the peer did not read the earlier ones.
    pub dropped_rsts: u64,
    /// RST frames sent without being kept for a resend (the peer acknowledged too few).
    pub unretained_rsts: u64,
    /// Received bytes held for the application in user space.
    pub held_bytes: u64,
    /// Bytes copied out of channel read buffers so that unread slices do not pin them.
    pub compacted_bytes: u64,
}

enum Retained {
    Data { stream: u64, offset: u64, bytes: Bytes },
    Control { stream: u64, owe: u8 },
    Rst { peer: u64, reason: RstReason, class: Class },
}

/// A DATA payload left in a channel's socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeferredRx {
    pub stream: u64,
    /// Stream offset of the next unread byte of the payload.
    pub offset: u64,
    pub remaining: u64,
    pub since: Instant,
    /// The engine reads the rest itself (`take_over_deferred`): no direct read any more.
    pub taken: bool,
}

struct ChannelState {
    class: Class,
    /// Bytes of frames pulled for this channel.
    tx_pos: u64,
    /// Highest position the peer acknowledged.
    acked: u64,
    retained: VecDeque<(u64, Retained)>,
    retained_bytes: u64,
    /// RSTs among `retained`: at `max_pending_rsts`, more RSTs go without retention (a peer
    /// that never acknowledges cannot make us keep them all).
    retained_rsts: u32,
    /// Bytes of the peer's frames processed (their content is safe in user space).
    rx_pos: u64,
    /// The position this side last acknowledged.
    rx_acked: u64,
    /// Since when bytes are unacknowledged.
    ack_since: Option<Instant>,
    deferred: Option<DeferredRx>,
}

impl ChannelState {
    fn received(&mut self, n: u64, now: Instant) {
        self.rx_pos += n;
        if self.ack_since.is_none() {
            self.ack_since = Some(now);
        }
    }
}

#[derive(Default)]
struct ClassTx {
    /// Open channels of the class, in the order they arrived.
    channels: Vec<u16>,
    /// Streams owing control frames.
    control: VecDeque<u64>,
    /// RSTs owed for streams that have no state here (refused, aborted, stale).
    rsts: VecDeque<(u64, RstReason)>,
    unsent: u64,
    space_waiters: VecDeque<u64>,
    /// A sender found no space since the last `take_congestion`.
    congested: bool,
}

pub struct Session<U> {
    cfg: CoreConfig,
    streams: Table<Stream<U>>,
    channels: Vec<Option<ChannelState>>,
    classes: [ClassTx; 2],
    /// Streams with unsent bytes: the scheduler's queues.
    active: ActiveQueues,
    /// For each index of the peer's stream table, the index (+1) of the stream it opened here
    /// from it, so a SYN sent again after a channel loss does not open a second stream. Dense,
    /// like the peer's ids: 4 bytes per stream instead of a hash-map entry.
    opened_by_peer: Vec<u32>,
    events: VecDeque<u64>,
    incoming: VecDeque<u64>,
    /// Stream deadlines on the session's compact clock (entries whose stream has another
    /// deadline by now are dropped when met).
    timers: BinaryHeap<Reverse<(u64, u64)>>,
    /// The last channel was lost: every stream is reset and no new one can open.
    dead: bool,
    stats: CoreStats,
    /// The latest time an input carried (for calls that carry none).
    now: Option<Instant>,
    /// The origin of the session's compact clock (`ticks`).
    epoch: Option<Instant>,
    /// Received bytes held in user space, every stream (what the peer made us allocate).
    rx_held: u64,
    /// Streams that took small slices of channel read buffers since the last compaction.
    pinned: Vec<u64>,
}

/// Streams holding small slices before they are compacted (each slice may pin a read buffer).
const PINNED_STREAMS: usize = 64;
/// In-order segments of one stream before its small ones are merged.
const SEGMENTS_BEFORE_COMPACT: usize = 64;

fn rst_reason(cause: ResetCause) -> RstReason {
    match cause {
        ResetCause::ConnectTimeout | ResetCause::Undeliverable => RstReason::TimedOut,
        _ => RstReason::Aborted,
    }
}

impl<U: Default> Session<U> {
    pub fn new(cfg: CoreConfig) -> Self {
        Session {
            streams: Table::new(cfg.max_streams),
            active: ActiveQueues::new(cfg.policy, MAX_CHANNEL_INDEX as usize + 1),
            cfg,
            channels: (0..=MAX_CHANNEL_INDEX).map(|_| None).collect(),
            classes: [ClassTx::default(), ClassTx::default()],
            opened_by_peer: Vec::new(),
            events: VecDeque::new(),
            incoming: VecDeque::new(),
            timers: BinaryHeap::new(),
            dead: false,
            stats: CoreStats::default(),
            now: None,
            epoch: None,
            rx_held: 0,
            pinned: Vec::new(),
        }
    }

    /// Received bytes held in user space across every stream.
    pub fn rx_held(&self) -> u64 {
        self.rx_held
    }

    /// Puts received bytes in stream `id`'s buffer, keeping the count of bytes held and the
    /// list of streams holding slices of read buffers.
    fn rx_insert(&mut self, id: u64, offset: u64, data: Bytes) -> Result<u64, TooManySegments> {
        let max = self.cfg.max_out_of_order;
        let small = data.len() < COMPACT_BELOW;
        let Some(s) = self.streams.get_mut(id) else { return Ok(0) };
        let before = s.rx.held_bytes();
        let r = s.rx.insert_data(offset, data, max);
        let after = s.rx.held_bytes();
        self.rx_held = self.rx_held + after - before;
        if small && after > before {
            if s.rx.ready_segments() > SEGMENTS_BEFORE_COMPACT {
                self.stats.compacted_bytes += s.rx.compact();
            } else if s.flags & F_PINNED == 0 {
                s.flags |= F_PINNED;
                self.pinned.push(id);
                if self.pinned.len() > PINNED_STREAMS {
                    self.compact();
                }
            }
        }
        r
    }

    /// Copies the small slices every listed stream holds into buffers of their own, so that
    /// unread bytes never keep whole channel read buffers alive.
    fn compact(&mut self) {
        for id in std::mem::take(&mut self.pinned) {
            if let Some(s) = self.streams.get_mut(id) {
                s.flags &= !F_PINNED;
                self.stats.compacted_bytes += s.rx.compact();
            }
        }
    }

    /// An input carried the current time.
    fn observe(&mut self, now: Instant) {
        self.now = Some(now);
        self.epoch.get_or_insert(now);
    }

    /// `t` on the session's compact clock: nanoseconds since the first current time it saw,
    /// plus one (0 stands for "none").
    fn ticks(&mut self, t: Instant) -> u64 {
        let epoch = *self.epoch.get_or_insert(t);
        t.saturating_duration_since(epoch).as_nanos() as u64 + 1
    }

    fn instant(&self, ticks: u64) -> Instant {
        self.epoch.expect("ticks were taken") + std::time::Duration::from_nanos(ticks - 1)
    }

    /// Whether the application read a payload of `id` straight from a channel within
    /// `window` before `now` (it is reading this stream right now).
    pub fn read_directly_within(&self, id: u64, now: Instant, window: Duration) -> bool {
        let Some(epoch) = self.epoch else { return false };
        let now_us = ((now.saturating_duration_since(epoch).as_nanos() as u64 + 1) / 1000) as u32;
        self.streams.get(id).is_some_and(|s| {
            s.direct_read_us != 0
                && (now_us.wrapping_sub(s.direct_read_us) as u128) < window.as_micros()
        })
    }

    fn clock(&self) -> Instant {
        self.now.unwrap_or_else(Instant::now)
    }

    pub fn config(&self) -> &CoreConfig {
        &self.cfg
    }

    // ---------------------------------------------------------------- channels

    pub fn add_channel(&mut self, index: u16, class: Class) {
        let Some(slot) = self.channels.get_mut(index as usize) else { return };
        if slot.is_some() {
            return;
        }
        *slot = Some(ChannelState {
            class,
            tx_pos: 0,
            acked: 0,
            retained: VecDeque::new(),
            retained_bytes: 0,
            retained_rsts: 0,
            rx_pos: 0,
            rx_acked: 0,
            ack_since: None,
            deferred: None,
        });
        self.classes[class.index()].channels.push(index);
        self.dead = false;
        // More channels, more room: senders waiting for space may go on.
        self.wake_space_waiters(class);
    }

    pub fn has_channel(&self, index: u16) -> bool {
        self.channels.get(index as usize).is_some_and(Option::is_some)
    }

    pub fn channel_count(&self) -> usize {
        self.classes.iter().map(|c| c.channels.len()).sum()
    }

    pub fn class_channels(&self, class: Class) -> usize {
        self.classes[class.index()].channels.len()
    }

    /// The channels that carry a class: its own, or the other class's when it has none.
    fn serving(&self, class: Class) -> Class {
        if self.classes[class.index()].channels.is_empty() {
            other(class)
        } else {
            class
        }
    }

    /// A channel failed. What it carried unacknowledged is queued again on the channels that
    /// remain; a payload deferred in it is forgotten (the peer sends it again). When it was the
    /// last channel, every stream is reset.
    pub fn channel_lost(&mut self, index: u16) {
        let Some(state) = self.channels.get_mut(index as usize).and_then(Option::take) else {
            return;
        };
        let class = state.class;
        self.classes[class.index()].channels.retain(|&c| c != index);
        for id in self.active.take_channel(index) {
            if let Some(s) = self.streams.get_mut(id) {
                s.flags &= !F_ACTIVE;
            }
            self.activate(id);
        }
        if self.channel_count() == 0 {
            self.dead = true;
            for id in self.streams.ids() {
                if self.streams.get(id).is_some_and(|s| s.received_everything()) {
                    self.keep_for_reading(id);
                } else {
                    self.reset_stream(id, ResetCause::ChannelLost, false);
                }
            }
            self.classes = [ClassTx::default(), ClassTx::default()];
            return;
        }
        if let Some(d) = state.deferred {
            if let Some(s) = self.streams.get_mut(d.stream) {
                let before = s.rx.held_bytes();
                s.rx.remove_deferred(d.offset);
                self.rx_held = self.rx_held + s.rx.held_bytes() - before;
            }
        }
        for (_, r) in state.retained {
            match r {
                Retained::Data { stream, offset, bytes } => {
                    let Some(s) = self.streams.get_mut(stream) else { continue };
                    s.unacked_frames -= 1;
                    if s.reset.is_none() {
                        let n = bytes.len() as u64;
                        s.tx.retransmit(offset, bytes);
                        let c = s.class;
                        self.classes[c.index()].unsent += n;
                        self.stats.retransmitted_bytes += n;
                        self.activate(stream);
                    }
                }
                Retained::Control { stream, owe } => {
                    let Some(s) = self.streams.get_mut(stream) else { continue };
                    s.unacked_frames -= 1;
                    if s.reset.is_some() {
                        continue;
                    }
                    let mut again = owe & (OWE_CREDIT | OWE_SYN_ACK);
                    if s.phase == Phase::Connecting {
                        again |= owe & OWE_SYN;
                    }
                    if s.write_closed {
                        again |= owe & OWE_FIN;
                    }
                    self.owe(stream, again);
                }
                Retained::Rst { peer, reason, class } => self.queue_rst(class, peer, reason),
            }
        }
        self.wake_space_waiters(class);
    }

    // ---------------------------------------------------------------- application calls

    /// Opens a stream to `port` at the peer: queues its SYN. `Writable` fires once the peer
    /// answered (or refused: the stream is then reset).
    pub fn open(
        &mut self,
        port: u16,
        class: Class,
        user: U,
        now: Instant,
    ) -> Result<u64, OpenError> {
        self.observe(now);
        if self.dead || self.channel_count() == 0 {
            return Err(OpenError::NoChannels);
        }
        let window = self.cfg.window;
        let id = self
            .streams
            .insert_with(|_| Stream::new(user, port, class, Phase::Connecting, window))
            .ok_or(OpenError::Limit)?;
        let deadline = now + self.cfg.connect_timeout;
        self.set_deadline(id, Some(deadline));
        self.owe(id, OWE_SYN);
        Ok(id)
    }

    /// The listener took the incoming stream: answer SYN_ACK granting `window`.
    pub fn accept_incoming(&mut self, id: u64, window: u32) {
        let Some(s) = self.streams.get_mut(id) else { return };
        if s.phase != Phase::Incoming || s.reset.is_some() {
            return;
        }
        s.phase = Phase::Open;
        s.window = window;
        s.granted = window as u64;
        self.owe(id, OWE_SYN_ACK);
        self.emit(id, EV_WRITE);
    }

    /// Grows the window of a stream (e.g. when the application accepts it).
    pub fn set_window(&mut self, id: u64, window: u32) {
        let Some(s) = self.streams.get_mut(id) else { return };
        s.window = window;
        if s.phase == Phase::Open && s.credit_due() {
            self.owe(id, OWE_CREDIT);
        }
    }

    /// The listener refused the incoming stream (no listener, backlog full).
    pub fn refuse_incoming(&mut self, id: u64, reason: RstReason) {
        let Some(s) = self.streams.get(id) else { return };
        if s.phase != Phase::Incoming {
            return;
        }
        let (peer, class) = (s.peer, s.class);
        self.free(id);
        self.queue_rst(class, peer, reason);
    }

    fn class_limit(&self, class: Class) -> u64 {
        let serving = self.serving(class);
        self.cfg.queue_threshold * self.classes[serving.index()].channels.len().max(1) as u64
    }

    /// Room for unsent bytes of `class`, or `NoSpace` (registering `id` to be woken).
    fn space(&mut self, id: u64, class: Class) -> Result<u64, SendError> {
        let limit = self.class_limit(class);
        let c = &mut self.classes[class.index()];
        if c.unsent < limit {
            return Ok(limit - c.unsent);
        }
        c.congested = true;
        let s = self.streams.get_mut(id).expect("caller checked");
        if s.flags & F_SPACE_WAIT == 0 {
            s.flags |= F_SPACE_WAIT;
            c.space_waiters.push_back(id);
        }
        Err(SendError::NoSpace)
    }

    fn send_checks(&mut self, id: u64, max: usize) -> Result<(u64, usize), SendError> {
        let s = self.streams.get(id).ok_or(SendError::Closed)?;
        let credit = s.send_capacity()?;
        let class = s.class;
        let room = self.space(id, class)?;
        let n = (max as u64).min(credit).min(room) as usize;
        Ok((self.streams.get(id).expect("checked").send_next, n))
    }

    /// Copies what credit and class space allow of `data` into the stream's send buffer.
    pub fn send(&mut self, id: u64, data: &[u8]) -> Result<usize, SendError> {
        let (offset, n) = self.send_checks(id, data.len())?;
        let s = self.streams.get_mut(id).expect("checked");
        s.send_next += n as u64;
        s.tx.push_copy(offset, &data[..n]);
        let class = s.class;
        self.classes[class.index()].unsent += n as u64;
        self.activate(id);
        Ok(n)
    }

    /// Takes up to `max` bytes of credit and space for a large write the caller copies
    /// outside the session lock; hand the bytes over with `commit`.
    pub fn reserve(&mut self, id: u64, max: usize) -> Result<(u64, usize), SendError> {
        let (offset, n) = self.send_checks(id, max)?;
        self.streams.get_mut(id).expect("checked").send_next += n as u64;
        Ok((offset, n))
    }

    pub fn commit(&mut self, id: u64, offset: u64, chunk: Bytes) {
        let Some(s) = self.streams.get_mut(id) else { return };
        if s.reset.is_some() {
            return;
        }
        let n = chunk.len() as u64;
        s.tx.push_frozen(offset, chunk);
        let class = s.class;
        self.classes[class.index()].unsent += n;
        self.activate(id);
    }

    /// Moves up to `max` readable bytes into `out` (slices), or says where the next bytes are.
    pub fn recv(&mut self, id: u64, max: u64, out: &mut Vec<Bytes>) -> Recv {
        let Some(s) = self.streams.get_mut(id) else { return Recv::Closed };
        if let Some(cause) = s.reset {
            return Recv::Reset(cause);
        }
        let n = s.rx.take(max, out);
        if n > 0 {
            self.rx_held -= n;
            self.after_consume(id);
            return Recv::Data(n);
        }
        let front = s.rx.front_deferred();
        let (empty, eof) = (s.flags & F_DEFERRED_EMPTY != 0, s.at_eof());
        if let Some((channel, len)) = front {
            let taken = self.deferred(channel).is_none_or(|d| d.taken);
            if taken || empty {
                return Recv::Empty;
            }
            return Recv::Deferred { channel, max: len.min(max) };
        }
        if eof {
            return Recv::Eof;
        }
        Recv::Empty
    }

    /// Copies ready bytes without consuming them (MSG_PEEK).
    pub fn peek(&self, id: u64, buf: &mut [u8]) -> Recv {
        let Some(s) = self.streams.get(id) else { return Recv::Closed };
        if let Some(cause) = s.reset {
            return Recv::Reset(cause);
        }
        match s.rx.peek(buf) {
            0 if s.at_eof() => Recv::Eof,
            0 => Recv::Empty,
            n => Recv::Data(n as u64),
        }
    }

    fn after_consume(&mut self, id: u64) {
        if self.streams.get(id).is_some_and(|s| s.credit_due()) {
            self.owe(id, OWE_CREDIT);
        }
    }

    /// How many bytes stream `id` may read straight from `channel` now: the payload at its
    /// front must still be deferred in that channel (another thread may have staged it, or the
    /// channel may be gone). The caller holds the channel's receive half.
    pub fn deferred_readable(&self, id: u64, channel: u16) -> Option<u64> {
        let d = self.deferred(channel).filter(|d| !d.taken)?;
        let s = self.streams.get(id)?;
        match s.rx.front_deferred() {
            Some((c, len)) if c == channel && d.stream == id && s.rx.consumed() == d.offset => {
                Some(len.min(d.remaining))
            }
            _ => None,
        }
    }

    /// `n` bytes of the deferred payload at the front of `id` were read straight from `channel`
    /// into the application's buffer. False if they are not the stream's any more (the channel
    /// was lost meanwhile and the peer sends them again): the caller must not deliver them.
    pub fn deferred_read(&mut self, id: u64, channel: u16, n: u64) -> bool {
        if self.deferred_readable(id, channel).is_none_or(|max| max < n) {
            return false;
        }
        let now = self.clock();
        let st = self.channels[channel as usize].as_mut().expect("checked");
        st.received(n, now);
        let d = st.deferred.as_mut().expect("checked");
        d.offset += n;
        d.remaining -= n;
        if d.remaining == 0 {
            st.deferred = None;
        }
        let us = ((self.ticks(now) / 1000) as u32).max(1);
        let s = self.streams.get_mut(id).expect("checked");
        s.rx.consume_deferred(n);
        s.flags &= !F_DEFERRED_EMPTY;
        s.direct_read_us = us;
        self.after_consume(id);
        true
    }

    /// A read of the deferred payload found no byte yet: the stream is not readable until the
    /// channel reports new bytes (`channel_readable`).
    pub fn deferred_empty(&mut self, id: u64) {
        if let Some(s) = self.streams.get_mut(id) {
            s.flags |= F_DEFERRED_EMPTY;
        }
    }

    /// Bytes arrived on a channel blocked on a deferred payload: its reader may go on.
    pub fn channel_readable(&mut self, channel: u16) {
        let Some(d) = self.deferred(channel) else { return };
        if let Some(s) = self.streams.get_mut(d.stream) {
            s.flags &= !F_DEFERRED_EMPTY;
            self.emit(d.stream, EV_READ);
        }
    }

    /// The payload deferred in `channel`, if any.
    pub fn deferred(&self, channel: u16) -> Option<DeferredRx> {
        self.channels.get(channel as usize)?.as_ref()?.deferred
    }

    /// The engine reads the payload deferred in `channel` itself from now on (its reader did
    /// not come in time, or is gone): it arrives with `stage_deferred` or `discard_deferred`.
    fn take_over_deferred(&mut self, channel: u16) -> Option<DeferredRx> {
        let st = self.channels.get_mut(channel as usize)?.as_mut()?;
        let d = st.deferred.as_mut()?;
        d.taken = true;
        Some(*d)
    }

    /// Whether the stream of the payload deferred in `channel` still wants it (else the
    /// runtime reads and drops it with `discard_deferred`).
    pub fn deferred_wanted(&self, channel: u16) -> bool {
        self.deferred(channel).is_some_and(|d| {
            self.streams.get(d.stream).is_some_and(|s| s.reset.is_none() && !s.app_closed)
        })
    }

    /// The next `data.len()` bytes of the payload deferred in `channel` were read into user
    /// space by the engine (the reader did not come for them in time).
    fn stage_deferred(&mut self, channel: u16, data: Bytes) {
        let now = self.clock();
        let Some(st) = self.channels.get_mut(channel as usize).and_then(Option::as_mut) else {
            return;
        };
        let Some(d) = st.deferred.as_mut() else { return };
        let n = data.len() as u64;
        let (stream, offset) = (d.stream, d.offset);
        d.offset += n;
        d.remaining -= n;
        if d.remaining == 0 {
            st.deferred = None;
        }
        st.received(n, now);
        if let Some(s) = self.streams.get_mut(stream) {
            if s.reset.is_none() {
                let before = s.rx.held_bytes();
                s.rx.stage_deferred(offset, data);
                self.rx_held = self.rx_held + s.rx.held_bytes() - before;
                s.flags &= !F_DEFERRED_EMPTY;
                self.emit(stream, EV_READ);
            }
        }
    }

    /// `n` bytes of the payload deferred in `channel` were read and dropped.
    fn discard_deferred(&mut self, channel: u16, n: u64) {
        let now = self.clock();
        let Some(st) = self.channels.get_mut(channel as usize).and_then(Option::as_mut) else {
            return;
        };
        st.received(n, now);
        if let Some(d) = st.deferred.as_mut() {
            d.offset += n;
            d.remaining -= n;
            if d.remaining == 0 {
                st.deferred = None;
            }
        }
    }

    /// Closes the write half: the peer reads end of stream after the last byte sent.
    pub fn shutdown_write(&mut self, id: u64) -> Result<(), SendError> {
        let s = self.streams.get_mut(id).ok_or(SendError::Closed)?;
        if let Some(cause) = s.reset {
            return Err(SendError::Reset(cause));
        }
        if s.phase != Phase::Open {
            return Err(SendError::NotOpen);
        }
        if !s.write_closed {
            s.write_closed = true;
            self.owe(id, OWE_FIN);
            self.emit(id, EV_WRITE);
        }
        Ok(())
    }

    /// The application closed its handle. Unread received bytes reset the peer, as TCP does;
    /// otherwise the write half is finished and the stream lingers until its last bytes are
    /// delivered and the peer finished too (bounded by `linger`).
    pub fn close(&mut self, id: u64, now: Instant) {
        self.observe(now);
        let Some(s) = self.streams.get_mut(id) else { return };
        if s.app_closed {
            return;
        }
        s.app_closed = true;
        if s.reset.is_some() || s.phase == Phase::Connecting {
            // A connect given up: a late SYN_ACK finds no stream and is answered with RST.
            self.free(id);
            return;
        }
        if s.phase == Phase::Incoming {
            return self.refuse_incoming(id, RstReason::Aborted);
        }
        if s.rx.unread() > 0 {
            self.reset_stream(id, ResetCause::LocalAbort, true);
            return;
        }
        if !s.write_closed {
            s.write_closed = true;
            self.owe(id, OWE_FIN);
        }
        let deadline = now + self.cfg.linger;
        self.set_deadline(id, Some(deadline));
        self.maybe_free(id);
    }

    /// Moves a stream to another class: its next chunks use that class's channels.
    pub fn set_class(&mut self, id: u64, class: Class) {
        let Some(s) = self.streams.get_mut(id) else { return };
        if s.class == class {
            return;
        }
        let n = s.tx.bytes();
        let old = s.class;
        s.class = class;
        self.classes[old.index()].unsent -= n;
        self.classes[class.index()].unsent += n;
        // Queued entries under the old class are re-filed when popped.
    }

    /// Resets a stream locally (e.g. its application asked to abort), telling the peer.
    pub fn abort(&mut self, id: u64, cause: ResetCause) {
        self.reset_stream(id, cause, true);
    }

    /// Finishes every stream's write half (engine shutdown): its FIN follows its last byte.
    /// Streams not yet accepted or not yet connected are refused or reset.
    pub fn finish_all(&mut self) {
        for id in self.streams.ids() {
            let Some(s) = self.streams.get(id) else { continue };
            match s.phase {
                Phase::Open => {
                    let _ = self.shutdown_write(id);
                }
                Phase::Incoming => self.refuse_incoming(id, RstReason::Aborted),
                Phase::Connecting => self.reset_stream(id, ResetCause::EngineShutdown, false),
            }
        }
    }

    /// Everything sent reached the peer engine: no byte or control frame unsent or
    /// unacknowledged (or no channel is left to carry them).
    pub fn flushed(&self) -> bool {
        self.dead
            || (self
                .classes
                .iter()
                .all(|c| c.unsent == 0 && c.control.is_empty() && c.rsts.is_empty())
                && self.channels.iter().flatten().all(|c| c.retained.is_empty()))
    }

    /// Resets every stream (engine shutdown).
    pub fn reset_all(&mut self, cause: ResetCause) {
        for id in self.streams.ids() {
            self.reset_stream(id, cause, false);
        }
    }

    // ---------------------------------------------------------------- peer input

    fn channel_mut(&mut self, ch: u16) -> Option<&mut ChannelState> {
        self.channels.get_mut(ch as usize).and_then(Option::as_mut)
    }

    /// Resolves a peer-supplied stream id: `Ok(None)` for a stream closed here (stale),
    /// `Err` for an id never issued.
    fn resolve(&mut self, id: u64) -> Result<Option<u64>, Violation> {
        match self.streams.lookup(id) {
            Lookup::Live => Ok(Some(id)),
            Lookup::Stale => {
                self.stats.stale_frames += 1;
                Ok(None)
            }
            Lookup::Unknown => Err(Violation::UnknownStream),
        }
    }

    /// A peer frame broke the rules of stream `id`: the stream is reset (the channel it came
    /// on is closed by the caller).
    fn violated(&mut self, id: u64, v: Violation) -> Violation {
        if let Some(s) = self.streams.get_mut(id) {
            s.protocol_errors += 1;
        }
        self.reset_stream(id, ResetCause::ProtocolError, true);
        v
    }

    /// The one entry point for what a channel read: each item its frame reader parsed, in
    /// order. An `Err` is a protocol violation: the caller closes the channel (and counts it).
    /// For a `Header` (a large payload whose rest is still in the socket) `may_defer` says
    /// whether the stream's reader is at hand to read the rest straight into its own buffer;
    /// the verdict returned must be handed to the reader (`FrameReader::verdict`).
    pub fn receive(
        &mut self,
        ch: u16,
        item: Parsed,
        now: Instant,
        may_defer: impl FnOnce(&Self, u64) -> bool,
    ) -> Result<Option<Verdict>, Violation> {
        match item {
            Parsed::Control(f) => self.on_frame(ch, f, None, now).map(|()| None),
            Parsed::Data { stream, offset, payload } => {
                let f = Frame::Data { stream, offset, payload: &[] };
                self.on_frame(ch, f, Some(payload), now).map(|()| None)
            }
            Parsed::Header { stream, offset, len, prefix } => {
                let defer = may_defer(self, stream);
                self.data_header(ch, stream, offset, len, prefix, defer, now).map(Some)
            }
            Parsed::Piece { stream, offset, data } => {
                self.data_piece(ch, stream, offset, data);
                Ok(None)
            }
            Parsed::StagedDeferred(data) => {
                self.stage_deferred(ch, data);
                Ok(None)
            }
            Parsed::Discarded { bytes, deferred: true } => {
                self.discard_deferred(ch, bytes);
                Ok(None)
            }
            Parsed::Discarded { bytes, deferred: false } => {
                self.discard(ch, bytes);
                Ok(None)
            }
        }
    }

    /// Whether channel `ch`'s reader may read now. While a payload is deferred in the socket
    /// for its stream's reader, the channel waits (false) for at most `grace`; then, or when
    /// the stream no longer wants it, the reader takes the rest over itself (staged, or
    /// dropped) and goes on.
    pub fn reader_may_read<B: Buffers>(
        &mut self,
        ch: u16,
        reader: &mut FrameReader<B>,
        now: Instant,
        grace: Duration,
    ) -> bool {
        if !reader.is_deferred() {
            return true;
        }
        let Some(d) = self.deferred(ch) else {
            reader.resume();
            return true;
        };
        let wanted = self.deferred_wanted(ch);
        if wanted && !d.taken && now.saturating_duration_since(d.since) < grace {
            // Its reader reads it; bytes may have arrived for it.
            self.channel_readable(ch);
            return false;
        }
        if let Some(d) = self.take_over_deferred(ch) {
            reader.take_over_deferred(d.remaining, wanted);
        }
        true
    }

    /// The engine reads the payload deferred in `ch` itself from now on, into user space (for
    /// `MSG_PEEK`, which cannot read from the socket without consuming it).
    pub fn take_over_reader<B: Buffers>(&mut self, ch: u16, reader: &mut FrameReader<B>) {
        if let Some(d) = self.take_over_deferred(ch) {
            reader.take_over_deferred(d.remaining, true);
        }
    }

    /// A whole frame (DATA with its `payload`).
    fn on_frame(
        &mut self,
        ch: u16,
        frame: Frame<'_>,
        payload: Option<Bytes>,
        now: Instant,
    ) -> Result<(), Violation> {
        let wire_len = match &payload {
            Some(p) => DATA_HEADER_LEN + p.len(),
            None => frame.wire_len(),
        } as u64;
        self.observe(now);
        let is_ack = matches!(frame, Frame::Ack { .. });
        match self.channel_mut(ch) {
            // An ACK is not retained by its sender: it needs no acknowledgement of its own (an
            // ACK for an ACK would ping-pong forever).
            Some(st) if is_ack && st.rx_acked == st.rx_pos => {
                st.rx_pos += wire_len;
                st.rx_acked = st.rx_pos;
            }
            Some(st) => st.received(wire_len, now),
            None => return Ok(()),
        }
        match frame {
            Frame::Data { stream, offset, .. } => {
                self.on_data(stream, offset, payload.expect("DATA comes with its payload"))
            }
            Frame::Syn { src, port, class, window } => {
                self.on_syn(src, port, class, window);
                Ok(())
            }
            Frame::SynAck { dst, src, window } => {
                let Some(id) = self.resolve(dst)? else {
                    // The connector gave up (timed out): tell the acceptor.
                    self.queue_rst(Class::Throughput, src, RstReason::Aborted);
                    return Ok(());
                };
                let s = self.streams.get_mut(id).expect("live");
                match s.phase {
                    Phase::Connecting => {
                        s.phase = Phase::Open;
                        s.peer = src;
                        s.send_limit = s.send_limit.max(window as u64);
                        s.frames_received += 1;
                        self.set_deadline(id, None);
                        if self.streams.get(id).is_some_and(|s| s.credit_due()) {
                            self.owe(id, OWE_CREDIT);
                        }
                        self.emit(id, EV_READ | EV_WRITE);
                        Ok(())
                    }
                    // Sent again after a channel loss.
                    Phase::Open if s.peer == src => Ok(()),
                    _ => Err(self.violated(id, Violation::UnexpectedFrame("SYN_ACK"))),
                }
            }
            Frame::Rst { dst, reason } => {
                let Some(id) = self.resolve(dst)? else { return Ok(()) };
                self.reset_stream(id, ResetCause::Peer(reason), false);
                Ok(())
            }
            Frame::Fin { dst, final_offset } => {
                let Some(id) = self.resolve(dst)? else { return Ok(()) };
                let s = self.streams.get_mut(id).expect("live");
                s.frames_received += 1;
                if s.reset.is_some() {
                    return Ok(());
                }
                if let Err(v) = s.on_fin(final_offset) {
                    return Err(self.violated(id, v));
                }
                self.emit(id, EV_READ);
                self.maybe_free(id);
                Ok(())
            }
            Frame::Credit { dst, consumed, window } => {
                let Some(id) = self.resolve(dst)? else { return Ok(()) };
                let s = self.streams.get_mut(id).expect("live");
                s.frames_received += 1;
                match s.on_credit(consumed, window) {
                    Ok(true) => self.emit(id, EV_WRITE),
                    Ok(false) => {}
                    Err(v) => return Err(self.violated(id, v)),
                }
                Ok(())
            }
            Frame::Ack { channel, position } => self.on_ack(channel, position, now),
        }
    }

    /// The stream the peer's stream `src` opened here, if it still exists.
    fn opened_from(&self, src: u64) -> Option<u64> {
        let ours = *self.opened_by_peer.get(super::table::index_of(src))?;
        let id = self.streams.id_at(ours.checked_sub(1)? as usize)?;
        self.streams.get(id).filter(|s| s.peer == src && s.phase != Phase::Connecting)?;
        Some(id)
    }

    fn on_syn(&mut self, src: u64, port: u16, class: Class, window: u32) {
        if let Some(id) = self.opened_from(src) {
            // Sent again after a channel loss: answer again if we already answered.
            if self.streams.get(id).is_some_and(|s| s.phase == Phase::Open) {
                self.owe(id, OWE_SYN_ACK);
            }
            return;
        }
        let my_window = self.cfg.window;
        let Some(id) = self.streams.insert_with(|_| {
            let mut s = Stream::new_incoming(port, class, my_window, src, window);
            s.frames_received = 1;
            s
        }) else {
            return self.queue_rst(class, src, RstReason::Refused);
        };
        let slot = super::table::index_of(src);
        if self.opened_by_peer.len() <= slot {
            self.opened_by_peer.resize(slot + 1, 0);
        }
        self.opened_by_peer[slot] = super::table::index_of(id) as u32 + 1;
        self.incoming.push_back(id);
    }

    fn on_data(&mut self, stream: u64, offset: u64, payload: Bytes) -> Result<(), Violation> {
        let Some(id) = self.resolve(stream)? else { return Ok(()) };
        let len = payload.len() as u64;
        let s = self.streams.get_mut(id).expect("live");
        s.frames_received += 1;
        if s.phase == Phase::Incoming {
            return Err(self.violated(id, Violation::UnexpectedFrame("DATA before SYN_ACK")));
        }
        if let Err(v) = s.check_data(offset, len) {
            return Err(self.violated(id, v));
        }
        if s.reset.is_some() {
            return Ok(());
        }
        if s.app_closed {
            // Nobody will read: answer with a reset, as TCP does.
            self.reset_stream(id, ResetCause::LocalAbort, true);
            return Ok(());
        }
        match self.rx_insert(id, offset, payload) {
            Ok(0) => Ok(()),
            Ok(_) => {
                self.emit(id, EV_READ);
                Ok(())
            }
            Err(_) => Err(self.violated(id, Violation::TooManySegments)),
        }
    }

    /// The header of a DATA frame arrived on `ch` with only `prefix` of its `len`-byte payload.
    /// Validates the whole frame, keeps the prefix, and says where the rest should go.
    #[allow(clippy::too_many_arguments)]
    fn data_header(
        &mut self,
        ch: u16,
        stream: u64,
        offset: u64,
        len: u64,
        prefix: Bytes,
        may_defer: bool,
        now: Instant,
    ) -> Result<Verdict, Violation> {
        let got = DATA_HEADER_LEN as u64 + prefix.len() as u64;
        self.observe(now);
        let can_defer = match self.channel_mut(ch) {
            Some(st) => {
                st.received(got, now);
                st.deferred.is_none()
            }
            None => return Ok(Verdict::Discard),
        };
        let Some(id) = self.resolve(stream)? else { return Ok(Verdict::Discard) };
        let max_ooo = self.cfg.max_out_of_order;
        let s = self.streams.get_mut(id).expect("live");
        s.frames_received += 1;
        if s.phase == Phase::Incoming {
            return Err(self.violated(id, Violation::UnexpectedFrame("DATA before SYN_ACK")));
        }
        if let Err(v) = s.check_data(offset, len) {
            return Err(self.violated(id, v));
        }
        if s.reset.is_some() {
            return Ok(Verdict::Discard);
        }
        if s.app_closed {
            self.reset_stream(id, ResetCause::LocalAbort, true);
            return Ok(Verdict::Discard);
        }
        let n = prefix.len() as u64;
        if n > 0 {
            match self.rx_insert(id, offset, prefix) {
                Ok(0) => {}
                Ok(_) => self.emit(id, EV_READ),
                Err(_) => return Err(self.violated(id, Violation::TooManySegments)),
            }
        }
        let s = self.streams.get_mut(id).expect("live");
        let (rest_off, rest_len) = (offset + n, len - n);
        if !(may_defer && can_defer && s.rx.is_new(rest_off, rest_len)) {
            return Ok(Verdict::Stage);
        }
        let before = s.rx.held_bytes();
        if s.rx.insert_deferred(rest_off, ch, rest_len, max_ooo).is_err() {
            return Err(self.violated(id, Violation::TooManySegments));
        }
        self.rx_held = self.rx_held + s.rx.held_bytes() - before;
        s.flags &= !F_DEFERRED_EMPTY;
        let front = s.rx.front_deferred().is_some();
        let st = self.channel_mut(ch).expect("checked");
        st.deferred = Some(DeferredRx {
            stream: id,
            offset: rest_off,
            remaining: rest_len,
            since: now,
            taken: false,
        });
        if front {
            self.emit(id, EV_READ);
        }
        Ok(Verdict::Defer)
    }

    /// A piece of a staged payload (after `Verdict::Stage`).
    fn data_piece(&mut self, ch: u16, stream: u64, offset: u64, data: Bytes) {
        let now = self.clock();
        match self.channel_mut(ch) {
            Some(st) => st.received(data.len() as u64, now),
            None => return,
        }
        let Some(s) = self.streams.get_mut(stream) else { return };
        if s.reset.is_some() || s.app_closed {
            return;
        }
        match self.rx_insert(stream, offset, data) {
            Ok(0) => {}
            Ok(_) => self.emit(stream, EV_READ),
            Err(_) => {
                // Validated at the header; only the segment limit can refuse a piece.
                self.reset_stream(stream, ResetCause::ProtocolError, true);
            }
        }
    }

    /// `n` bytes of a discarded payload were read and dropped.
    fn discard(&mut self, ch: u16, n: u64) {
        let now = self.clock();
        if let Some(st) = self.channel_mut(ch) {
            st.received(n, now);
        }
    }

    fn on_ack(&mut self, channel: u16, position: u64, _now: Instant) -> Result<(), Violation> {
        let Some(st) = self.channels.get_mut(channel as usize).and_then(Option::as_mut) else {
            // A channel already lost here: its frames were queued again.
            return Ok(());
        };
        if position > st.tx_pos {
            return Err(Violation::BadAck);
        }
        if position <= st.acked {
            return Ok(());
        }
        st.acked = position;
        let mut done = Vec::new();
        while st.retained.front().is_some_and(|(end, _)| *end <= position) {
            let (_, r) = st.retained.pop_front().expect("front exists");
            match r {
                Retained::Data { stream, bytes, .. } => {
                    st.retained_bytes -= bytes.len() as u64;
                    done.push(stream);
                }
                Retained::Control { stream, .. } => done.push(stream),
                Retained::Rst { .. } => st.retained_rsts -= 1,
            }
        }
        for id in done {
            if let Some(s) = self.streams.get_mut(id) {
                s.unacked_frames -= 1;
                if s.unacked_frames == 0 {
                    self.maybe_free(id);
                }
            }
        }
        Ok(())
    }

    // ---------------------------------------------------------------- transmit

    fn served_by(&self, class: Class) -> Vec<Class> {
        [class, other(class)].into_iter().filter(|&k| self.serving(k) == class).collect()
    }

    /// Whether channel `ch` has frames to pull (acknowledgements aside).
    pub fn has_transmit(&self, ch: u16) -> bool {
        let Some(st) = self.channels.get(ch as usize).and_then(Option::as_ref) else {
            return false;
        };
        let served = self.served_by(st.class);
        self.active.has_work(ch, &served)
            || served.iter().any(|k| {
                let c = &self.classes[k.index()];
                !c.control.is_empty() || !c.rsts.is_empty()
            })
    }

    /// Whether acknowledgements are owed on their own (without other frames to carry them):
    /// a channel holds `ack_threshold` unacknowledged bytes, or, with `owed_since`, any
    /// acknowledgement has been owed since that time or earlier.
    pub fn ack_due(&self, owed_since: Option<Instant>) -> bool {
        self.channels.iter().flatten().any(|st| {
            st.rx_pos - st.rx_acked >= self.cfg.ack_threshold
                || owed_since.is_some_and(|t| st.ack_since.is_some_and(|s| s <= t))
        })
    }

    /// Whether this side owes the peer an acknowledgement on any channel.
    pub fn owes_ack(&self) -> bool {
        self.channels.iter().flatten().any(|st| st.rx_pos > st.rx_acked)
    }

    /// Bytes sent on channel `ch` and not yet acknowledged.
    pub fn channel_retained(&self, ch: u16) -> u64 {
        self.channels.get(ch as usize).and_then(Option::as_ref).map_or(0, |st| st.retained_bytes)
    }

    /// Bytes sent on channels and not yet acknowledged.
    pub fn retained_bytes(&self) -> u64 {
        self.channels.iter().flatten().map(|st| st.retained_bytes).sum()
    }

    /// Appends the next frames channel `ch` should write (at most about `budget` bytes and
    /// `max_frames` frames) and returns their bytes. Acknowledgements ride along whenever
    /// anything is sent, and go alone when `ack_due(force_ack)`.
    pub fn poll_transmit(
        &mut self,
        ch: u16,
        budget: usize,
        max_frames: usize,
        force_ack: bool,
        out: &mut Vec<OutFrame>,
    ) -> usize {
        let Some(class) = self.channels.get(ch as usize).and_then(|c| c.as_ref()).map(|c| c.class)
        else {
            return 0;
        };
        let start = out.len();
        let mut bytes = 0usize;
        let served = self.served_by(class);
        for &k in &served {
            while out.len() - start < max_frames {
                let Some((peer, reason)) = self.classes[k.index()].rsts.pop_front() else {
                    break;
                };
                let f = OutFrame::control(Frame::Rst { dst: peer, reason });
                let cap = self.cfg.max_pending_rsts as u32;
                let st = self.channel_mut(ch).expect("pulling for a live channel");
                if st.retained_rsts < cap {
                    st.retained_rsts += 1;
                    bytes += self.retain(ch, f.len(), Retained::Rst { peer, reason, class: k });
                } else {
                    st.tx_pos += f.len() as u64;
                    bytes += f.len();
                    self.stats.unretained_rsts += 1;
                }
                out.push(f);
            }
            while out.len() - start < max_frames {
                let Some(id) = self.classes[k.index()].control.pop_front() else { break };
                bytes += self.emit_control(ch, id, out);
            }
        }
        while bytes < budget && out.len() - start + 2 <= max_frames {
            let Some(id) = self.next_active(ch, &served) else { break };
            let max_frame = self.cfg.max_frame_payload;
            let Some(s) = self.streams.get_mut(id) else { continue };
            let Some((offset, data)) = s.tx.take(max_frame.min(budget - bytes).max(1)) else {
                s.flags &= !F_ACTIVE;
                continue;
            };
            let n = data.len();
            let c = s.class;
            let header = data_header(s.peer, offset, n);
            s.frames_sent += 1;
            s.unacked_frames += 1;
            let more = !s.tx.is_empty();
            self.classes[c.index()].unsent -= n as u64;
            let mut h = [0u8; MAX_HEADER_LEN];
            h[..DATA_HEADER_LEN].copy_from_slice(&header);
            let f =
                OutFrame { header: h, header_len: DATA_HEADER_LEN as u8, payload: data.clone() };
            bytes += self.retain(ch, f.len(), Retained::Data { stream: id, offset, bytes: data });
            out.push(f);
            if more {
                self.requeue_active(id, ch);
            } else if let Some(s) = self.streams.get_mut(id) {
                s.flags &= !F_ACTIVE;
                self.maybe_free(id);
            }
            self.wake_space_waiters(c);
        }
        let sending = out.len() > start;
        let owed = || self.channels.iter().flatten().any(|st| st.rx_pos > st.rx_acked);
        if sending || self.ack_due(None) || (force_ack && owed()) {
            let acks: Vec<(u16, u64)> = self
                .channels
                .iter_mut()
                .enumerate()
                .filter_map(|(i, st)| {
                    let st = st.as_mut()?;
                    (st.rx_pos > st.rx_acked).then(|| {
                        st.rx_acked = st.rx_pos;
                        st.ack_since = None;
                        (i as u16, st.rx_pos)
                    })
                })
                .collect();
            for (channel, position) in acks {
                let f = OutFrame::control(Frame::Ack { channel, position });
                bytes += f.len();
                if let Some(st) = self.channel_mut(ch) {
                    st.tx_pos += f.len() as u64;
                }
                out.push(f);
            }
        }
        bytes
    }

    /// Records a pulled frame in the channel's retention; returns its length.
    fn retain(&mut self, ch: u16, len: usize, what: Retained) -> usize {
        let st = self.channel_mut(ch).expect("pulling for a live channel");
        st.tx_pos += len as u64;
        if let Retained::Data { bytes, .. } = &what {
            st.retained_bytes += bytes.len() as u64;
        }
        let end = st.tx_pos;
        st.retained.push_back((end, what));
        len
    }

    fn emit_control(&mut self, ch: u16, id: u64, out: &mut Vec<OutFrame>) -> usize {
        let Some(s) = self.streams.get_mut(id) else { return 0 };
        s.flags &= !F_CONTROL;
        let owe = std::mem::take(&mut s.owe);
        if owe == 0 || s.reset.is_some() {
            return 0;
        }
        let mut frames = Vec::with_capacity(4);
        if owe & OWE_SYN != 0 && s.phase == Phase::Connecting {
            frames.push(Frame::Syn { src: id, port: s.port, class: s.class, window: s.window });
        }
        if owe & OWE_SYN_ACK != 0 && s.phase == Phase::Open {
            frames.push(Frame::SynAck { dst: s.peer, src: id, window: s.window });
        }
        if owe & OWE_CREDIT != 0 && s.phase == Phase::Open && !s.peer_finished() {
            let consumed = s.rx.consumed();
            s.granted = consumed + s.window as u64;
            frames.push(Frame::Credit { dst: s.peer, consumed, window: s.window });
        }
        if owe & OWE_FIN != 0 && s.write_closed && s.phase == Phase::Open {
            s.flags |= F_FIN_SENT;
            frames.push(Frame::Fin { dst: s.peer, final_offset: s.send_next });
        }
        s.unacked_frames += frames.len() as u32;
        s.frames_sent += frames.len() as u32;
        let mut bytes = 0;
        for f in frames {
            let bit = match f {
                Frame::Syn { .. } => OWE_SYN,
                Frame::SynAck { .. } => OWE_SYN_ACK,
                Frame::Credit { .. } => OWE_CREDIT,
                _ => OWE_FIN,
            };
            let of = OutFrame::control(f);
            bytes += self.retain(ch, of.len(), Retained::Control { stream: id, owe: bit });
            out.push(of);
        }
        bytes
    }

    fn next_active(&mut self, ch: u16, served: &[Class]) -> Option<u64> {
        let mine = self.serving(served[0]);
        while let Some(id) = self.active.pop(ch, served) {
            let Some(class) = self.streams.get(id).map(|s| s.class) else { continue };
            if self.serving(class) != mine {
                // Its class changed while queued: file it where it belongs now.
                if let Some(s) = self.streams.get_mut(id) {
                    s.flags &= !F_ACTIVE;
                }
                self.activate(id);
                continue;
            }
            return Some(id);
        }
        None
    }

    fn requeue_active(&mut self, id: u64, ch: u16) {
        let Some(s) = self.streams.get(id) else { return };
        self.active.requeue(id, ch, s.class);
    }

    fn activate(&mut self, id: u64) {
        let Some(s) = self.streams.get_mut(id) else { return };
        if s.flags & F_ACTIVE != 0 || s.tx.is_empty() || s.reset.is_some() {
            return;
        }
        s.flags |= F_ACTIVE;
        let class = s.class;
        let serving = &self.classes[self.serving(class).index()].channels;
        self.active.push(id, class, serving);
    }

    fn owe(&mut self, id: u64, bits: u8) {
        let Some(s) = self.streams.get_mut(id) else { return };
        if bits == 0 {
            return;
        }
        s.owe |= bits;
        if s.flags & F_CONTROL == 0 {
            s.flags |= F_CONTROL;
            let class = s.class;
            self.classes[class.index()].control.push_back(id);
        }
    }

    fn queue_rst(&mut self, class: Class, peer: u64, reason: RstReason) {
        let q = &mut self.classes[class.index()].rsts;
        if q.len() >= self.cfg.max_pending_rsts {
            self.stats.dropped_rsts += 1;
            return;
        }
        q.push_back((peer, reason));
    }

    /// Whether stream `id` owes the peer a control frame (a CREDIT after reads, a FIN, ...).
    pub fn owes_control(&self, id: u64) -> bool {
        self.streams.get(id).is_some_and(|s| s.owe != 0)
    }

    /// Unsent bytes of a class.
    pub fn unsent(&self, class: Class) -> u64 {
        self.classes[class.index()].unsent
    }

    /// RSTs and control frames queued and not yet pulled (a peer that does not read them
    /// should be slowed: stop reading its frames).
    pub fn control_backlog(&self) -> usize {
        self.classes.iter().map(|c| c.rsts.len() + c.control.len()).sum()
    }

    fn wake_space_waiters(&mut self, class: Class) {
        let limit = self.class_limit(class);
        let c = &mut self.classes[class.index()];
        if c.space_waiters.is_empty() || c.unsent >= limit {
            return;
        }
        let mut wake = (limit - c.unsent).div_ceil(SPACE_WAKE_QUANTUM);
        let mut woken = Vec::new();
        while wake > 0 {
            let Some(id) = c.space_waiters.pop_front() else { break };
            woken.push(id);
            wake -= 1;
        }
        for id in woken {
            if let Some(s) = self.streams.get_mut(id) {
                s.flags &= !F_SPACE_WAIT;
                self.emit(id, EV_WRITE);
            }
        }
    }

    /// Whether a sender of `class` found no space since the last call (the cue to add a
    /// channel).
    pub fn take_congestion(&mut self, class: Class) -> bool {
        std::mem::take(&mut self.classes[class.index()].congested)
    }

    // ---------------------------------------------------------------- events and time

    fn emit(&mut self, id: u64, bits: u8) {
        let Some(s) = self.streams.get_mut(id) else { return };
        s.events |= bits;
        if s.flags & F_EVENT == 0 {
            s.flags |= F_EVENT;
            self.events.push_back(id);
        }
    }

    /// The next stream whose readiness may have changed, with `EV_*` bits.
    pub fn poll_event(&mut self) -> Option<(u64, u8)> {
        while let Some(id) = self.events.pop_front() {
            if let Some(s) = self.streams.get_mut(id) {
                s.flags &= !F_EVENT;
                return Some((id, std::mem::take(&mut s.events)));
            }
        }
        None
    }

    /// The next stream the peer opened, waiting for `accept_incoming` or `refuse_incoming`.
    pub fn poll_incoming(&mut self) -> Option<(u64, u16)> {
        while let Some(id) = self.incoming.pop_front() {
            if let Some(s) = self.streams.get(id) {
                if s.phase == Phase::Incoming {
                    return Some((id, s.port));
                }
            }
        }
        None
    }

    fn set_deadline(&mut self, id: u64, deadline: Option<Instant>) {
        let ticks = deadline.map_or(0, |d| self.ticks(d));
        let Some(s) = self.streams.get_mut(id) else { return };
        s.deadline = ticks;
        if ticks != 0 {
            self.timers.push(Reverse((ticks, id)));
        }
    }

    /// When `handle_timeout` has something to do next.
    pub fn poll_timeout(&mut self) -> Option<Instant> {
        while let Some(Reverse((t, id))) = self.timers.peek().copied() {
            if self.streams.get(id).is_some_and(|s| s.deadline == t) {
                return Some(self.instant(t));
            }
            self.timers.pop();
        }
        None
    }

    pub fn handle_timeout(&mut self, now: Instant) {
        self.observe(now);
        let now = self.ticks(now);
        while let Some(Reverse((t, id))) = self.timers.peek().copied() {
            if t > now {
                break;
            }
            self.timers.pop();
            let Some(s) = self.streams.get_mut(id) else { continue };
            if s.deadline != t {
                continue;
            }
            s.deadline = 0;
            if s.phase == Phase::Connecting {
                self.reset_stream(id, ResetCause::ConnectTimeout, false);
            } else if s.app_closed {
                let undelivered = !s.tx.is_empty() || s.unacked_frames > 0 || s.owe != 0;
                let cause =
                    if undelivered { ResetCause::Undeliverable } else { ResetCause::LocalAbort };
                self.reset_stream(id, cause, true);
            }
        }
    }

    // ---------------------------------------------------------------- lifecycle

    fn reset_stream(&mut self, id: u64, cause: ResetCause, tell_peer: bool) {
        let Some(s) = self.streams.get_mut(id) else { return };
        if s.reset.is_some() {
            return;
        }
        s.reset = Some(cause);
        let dropped = s.tx.clear();
        self.rx_held -= s.rx.held_bytes();
        s.rx.clear();
        s.owe = 0;
        let (class, peer, phase, closed) = (s.class, s.peer, s.phase, s.app_closed);
        self.classes[class.index()].unsent -= dropped;
        if tell_peer && phase != Phase::Connecting {
            self.queue_rst(class, peer, rst_reason(cause));
        }
        self.emit(id, EV_READ | EV_WRITE);
        if closed {
            self.free(id);
        }
    }

    /// The session lost its last channel, but every byte the peer sent this stream arrived
    /// (a peer that finished, then went away): the application reads them to the end of the
    /// stream, as from a TCP socket whose peer closed; only writing fails (unsent bytes are
    /// dropped, and `send` says the connection was lost).
    fn keep_for_reading(&mut self, id: u64) {
        let Some(s) = self.streams.get_mut(id) else { return };
        let dropped = s.tx.clear();
        s.write_closed = true;
        s.flags |= F_WRITE_LOST;
        s.owe = 0;
        s.unacked_frames = 0;
        let (class, closed) = (s.class, s.app_closed);
        self.classes[class.index()].unsent -= dropped;
        self.emit(id, EV_READ | EV_WRITE);
        if closed {
            self.free(id);
        }
    }

    /// Frees a closed stream once nothing it depends on is pending: its bytes were all sent
    /// and acknowledged, its FIN acknowledged, and the peer finished too.
    fn maybe_free(&mut self, id: u64) {
        let Some(s) = self.streams.get(id) else { return };
        let done = s.app_closed
            && s.reset.is_none()
            && s.write_closed
            && s.tx.is_empty()
            && s.owe == 0
            && s.unacked_frames == 0
            && s.flags & F_FIN_SENT != 0
            && s.peer_finished();
        if done {
            self.free(id);
        }
    }

    fn free(&mut self, id: u64) {
        if let Some(s) = self.streams.remove(id) {
            self.rx_held -= s.rx.held_bytes();
            let slot = super::table::index_of(s.peer);
            if s.phase != Phase::Connecting
                && self.opened_by_peer.get(slot) == Some(&(super::table::index_of(id) as u32 + 1))
            {
                self.opened_by_peer[slot] = 0;
            }
            let n = s.tx.bytes();
            self.classes[s.class.index()].unsent -= n;
        }
    }

    // ---------------------------------------------------------------- queries

    pub fn stream(&self, id: u64) -> Option<&Stream<U>> {
        self.streams.get(id)
    }

    pub fn stream_mut(&mut self, id: u64) -> Option<&mut Stream<U>> {
        self.streams.get_mut(id)
    }

    pub fn streams(&self) -> impl Iterator<Item = (u64, &Stream<U>)> {
        self.streams.iter()
    }

    pub fn stream_count(&self) -> usize {
        self.streams.live()
    }

    pub fn is_dead(&self) -> bool {
        self.dead
    }

    pub fn readable(&self, id: u64) -> bool {
        self.streams.get(id).is_none_or(|s| s.readable())
    }

    /// `send` would take bytes (or fail at once).
    pub fn writable(&self, id: u64) -> bool {
        let Some(s) = self.streams.get(id) else { return true };
        if !s.writable_credit() {
            return false;
        }
        if s.reset.is_some() || s.write_closed {
            return true;
        }
        self.classes[s.class.index()].unsent < self.class_limit(s.class)
    }

    pub fn stats(&self) -> CoreStats {
        let mut st = self.stats.clone();
        st.streams = self.streams.live();
        st.unsent_bytes = self.classes.iter().map(|c| c.unsent).sum();
        st.retained_bytes = self.retained_bytes();
        st.held_bytes = self.rx_held;
        debug_assert_eq!(
            self.rx_held,
            self.streams.iter().map(|(_, s)| s.rx.held_bytes()).sum::<u64>()
        );
        st
    }
}

fn other(class: Class) -> Class {
    match class {
        Class::Throughput => Class::Latency,
        Class::Latency => Class::Throughput,
    }
}

impl<U> Stream<U> {
    fn new_incoming(port: u16, class: Class, window: u32, peer: u64, peer_window: u32) -> Self
    where
        U: Default,
    {
        let mut s = Stream::new(U::default(), port, class, Phase::Incoming, window);
        s.peer = peer;
        s.send_limit = peer_window as u64;
        s
    }
}
