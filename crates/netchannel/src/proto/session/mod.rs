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
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::time::{Duration, Instant};

use bytes::Bytes;

use super::ids::{ChannelId, PeerStreamId, StreamId};
use super::sendbuf::SpareChunks;
use super::stream::*;
use super::table::Table;
use crate::scheduler::{ActiveQueues, Policy};
use crate::wire::frame::MAX_HEADER_LEN;
use crate::wire::handshake::MAX_CHANNEL_INDEX;
use crate::wire::{Class, Frame};

mod app;
mod channels;
mod credit;
mod deferred;
mod input;
mod lifecycle;
mod transmit;

use channels::ChannelState;
pub use deferred::DeferredRx;
use transmit::{ClassTx, OwedRst, ThreadTurns};

/// Event bits: the stream may have become readable / writable (or failed).
pub const EV_READ: u8 = 1;
pub const EV_WRITE: u8 = 2;
/// The peer's urgent byte came (with `EV_READ`): an observer shows it (`POLLPRI`, `SIGURG`).
pub const EV_URGENT: u8 = 4;

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
    /// Receive credit the session may grant beyond each stream's `min_window` (bytes its streams
    /// may be sent and not yet have read): what a peer can make this side hold (see `credit`).
    pub rx_budget: u64,
    /// The window every stream gets whatever the budget (as a socket's own receive buffer).
    pub min_window: u32,
    /// Unsent and unacknowledged bytes the session may hold, every class (see `room`).
    pub tx_budget: u64,
    /// Bytes of DATA a channel may hold unacknowledged by the peer before it pulls no more
    /// (a peer that does not acknowledge slows its senders, it cannot grow our memory).
    pub max_retained_bytes: u64,
    /// Frames a channel may hold unacknowledged before it pulls no more.
    pub max_retained_frames: usize,
    /// A channel whose peer acknowledged nothing for this long while frames waited is dead.
    pub ack_timeout: Duration,
    /// Most throughput-class channels per peer: the session asks for one more while more of
    /// its application threads are busy on it than it has channels (`wants_channel`).
    pub max_channels: usize,
    /// Throughput-class channels the session keeps whatever the threads (the ones dialed at
    /// the start) while it is not idle.
    pub min_channels: usize,
    /// Bytes a second (`bytes_moved`) below which the session is idle: idle for
    /// `retire_after`, it gives back channels down to one, not `min_channels`. Zero: never.
    pub idle_rate: u64,
    /// A session that has had more throughput channels than busy threads (and than
    /// `min_channels`) for this long gives one back (`surplus_channel`).
    pub retire_after: Duration,
    /// Bytes a second an application thread sends on the session's streams to count as busy
    /// (it wants a channel of its own: `wants_channel`).
    pub busy_thread_rate: u64,
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
            rx_budget: 256 << 20,
            min_window: 64 * 1024,
            tx_budget: 1 << 30,
            max_retained_bytes: 8 << 20,
            max_retained_frames: 1 << 16,
            ack_timeout: Duration::from_secs(20),
            max_channels: 4,
            min_channels: 4,
            idle_rate: 0,
            retire_after: Duration::from_secs(10),
            busy_thread_rate: 64 << 20,
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
        channel: ChannelId,
        max: u64,
    },
    /// The peer finished and every byte was read.
    Eof,
    /// Nothing yet.
    Empty,
    /// The next byte is an urgent byte kept out of the stream and still in channel
    /// `channel`'s socket: read one byte of it, drop it (report with `deferred_read`), and
    /// read again.
    DropDeferred {
        channel: ChannelId,
    },
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
    /// Acknowledged send-buffer chunks kept for reuse (bytes of capacity).
    pub spare_bytes: u64,
}

/// The protocol state of one session (see the module doc).
pub struct Session<U> {
    cfg: CoreConfig,
    streams: Table<Stream<U>>,
    /// By index, up to the highest index joined so far: an idle peer's session (one channel)
    /// does not carry 63 empty states of 200 bytes each.
    channels: Vec<Option<ChannelState>>,
    classes: [ClassTx; 2],
    /// Streams with unsent bytes: the scheduler's queues.
    active: ActiveQueues<StreamId, ChannelId>,
    /// The stream each of the peer's streams opened here, so a SYN sent again after a channel
    /// loss does not open a second one. Keyed by the peer's id, one entry per stream held here:
    /// nothing is sized by a number the peer chooses (a dense table indexed by the peer's ids
    /// let one SYN claiming a high index allocate 64 MiB).
    opened_by_peer: HashMap<PeerStreamId, StreamId>,
    /// Urgent data of the streams that used it (`Urgent`): empty in a session that never did,
    /// which is all its streams pay.
    urgent: HashMap<StreamId, Urgent>,
    events: VecDeque<StreamId>,
    incoming: VecDeque<StreamId>,
    /// Stream deadlines on the session's compact clock (entries whose stream has another
    /// deadline by now are dropped when met).
    timers: BinaryHeap<Reverse<(u64, StreamId)>>,
    /// The last channel was lost: every stream is reset and no new one can open.
    dead: bool,
    stats: CoreStats,
    /// The latest time an input carried (for calls that carry none).
    now: Option<Instant>,
    /// The origin of the session's compact clock (`ticks`).
    epoch: Option<Instant>,
    /// Received bytes held in user space, every stream (what the peer made us allocate).
    rx_held: u64,
    /// Streams that took small slices of channel read buffers in the current compaction
    /// window, and in the window before (see `compact_if_due`).
    pinned: Vec<StreamId>,
    pinned_before: Vec<StreamId>,
    /// Bytes read into user space on every channel (the clock of the compaction trigger).
    rx_read: u64,
    /// `rx_read` when the current compaction window opened.
    compacted_at: u64,
    /// Channels that left their retention limit since the runtime last asked.
    tx_ready: Vec<ChannelId>,
    /// Sum of every stream's `rx_charge`: receive credit granted and not yet consumed.
    rx_granted: u64,
    /// Streams flagged `F_COMPETING`: those the receive budget is shared among.
    rx_competing: usize,
    /// DATA bytes retained on every channel (the sum of their `retained_bytes`).
    retained_total: u64,
    /// When the peer engine last acknowledged new frames, on any channel: it is processing.
    peer_progress: Option<Instant>,
    /// Streams that want more credit than the receive budget had room for, in order.
    starved: VecDeque<StreamId>,
    /// Acknowledged send-buffer chunks kept for the next writes (see `SpareChunks`).
    spares: SpareChunks,
    /// `on_ack`'s list of the streams whose frames were acknowledged (kept for its capacity).
    acked_streams: Vec<StreamId>,
    /// Channels (bits by index) frames were queued for that only they may carry
    /// (`take_kicked`).
    kicked: u64,
    /// Application threads that used the session's streams: their turns and which are busy
    /// (`thread_turn`, `ThreadTurns`).
    thread_turns: ThreadTurns,
    /// Since when the session has had more throughput channels than it needs, and when that
    /// was last looked at (`surplus_channel`).
    surplus_since: Option<Instant>,
    surplus_checked: Option<Instant>,
    /// The last look at the session's traffic (`surplus_channel`): when, and `bytes_moved`.
    traffic_looked: Option<(Instant, u64)>,
    /// Since when the session has moved less than `idle_rate`.
    idle_since: Option<Instant>,
    /// The peer's RSTs that wait for the bytes sent before them (`F_RST_PENDING`): the final
    /// offset and the reason, by stream. At most one per stream held here.
    pending_rsts: HashMap<StreamId, (u64, crate::wire::RstReason)>,
    /// Ranges taken by `reserve` and not yet `commit`ted (a large write being copied outside
    /// the lock), by stream and offset: an RST's final offset stops before them. One per
    /// writing thread at most.
    reserved: Vec<(StreamId, u64)>,
}

/// Where two or more application threads send on a session, its traffic counts this many times
/// over (`carries`): threads sharing a channel wake each other for frames that are not theirs, a
/// cost per message that matters once messages are many.
const SHARED_RATE_DIVISOR: u64 = 16;

/// Whether a session that moved `bytes` (`Session::bytes_moved`) in `elapsed`, with `senders`
/// application threads sending on it, carried `rate` bytes a second or more, or a sixteenth of
/// that with two or more senders (`SHARED_RATE_DIVISOR`). The one measure of a session's
/// traffic: against `CoreConfig::idle_rate` here (channels given back), and against
/// `Config::rest_channels_rate` where the runtime dials them.
pub fn carries(bytes: u64, elapsed: Duration, senders: usize, rate: u64) -> bool {
    let rate = if senders > 1 { rate / SHARED_RATE_DIVISOR } else { rate };
    u128::from(bytes) * 1_000_000_000 >= u128::from(rate) * elapsed.as_nanos()
}

/// How long a peer's RST waits for the bytes sent before it (`Session::pending_rsts`).
const RST_WAIT: Duration = Duration::from_secs(1);

impl<U: Default> Session<U> {
    pub fn new(cfg: CoreConfig) -> Self {
        let busy_thread_rate = cfg.busy_thread_rate;
        Session {
            streams: Table::new(cfg.max_streams),
            active: ActiveQueues::new(cfg.policy, MAX_CHANNEL_INDEX as usize + 1),
            cfg,
            channels: Vec::new(),
            classes: [ClassTx::default(), ClassTx::default()],
            opened_by_peer: HashMap::new(),
            urgent: HashMap::new(),
            events: VecDeque::new(),
            incoming: VecDeque::new(),
            timers: BinaryHeap::new(),
            dead: false,
            stats: CoreStats::default(),
            now: None,
            epoch: None,
            rx_held: 0,
            pinned: Vec::new(),
            pinned_before: Vec::new(),
            rx_read: 0,
            compacted_at: 0,
            tx_ready: Vec::new(),
            rx_granted: 0,
            rx_competing: 0,
            retained_total: 0,
            peer_progress: None,
            starved: VecDeque::new(),
            spares: SpareChunks::default(),
            acked_streams: Vec::new(),
            kicked: 0,
            thread_turns: ThreadTurns::new(busy_thread_rate),
            surplus_since: None,
            surplus_checked: None,
            traffic_looked: None,
            idle_since: None,
            pending_rsts: HashMap::new(),
            reserved: Vec::new(),
        }
    }

    /// Bytes the session holds for sending: unsent in stream buffers, and sent but not yet
    /// acknowledged.
    pub(super) fn in_flight(&self) -> usize {
        let unsent: u64 = self.classes.iter().map(|c| c.unsent).sum();
        (unsent + self.retained_total) as usize
    }

    /// What has not reached the peer engine yet, as a measure of progress: bytes unsent or
    /// unacknowledged, at least 1 while a control frame or RST waits, 0 once
    /// [`Session::flushed`].
    pub fn unflushed(&self) -> u64 {
        if self.flushed() {
            0
        } else {
            (self.in_flight() as u64).max(1)
        }
    }

    /// The peer's RSTs waiting for bytes (tests).
    #[cfg(test)]
    pub fn pending_rst_count(&self) -> usize {
        self.pending_rsts.len()
    }

    /// Entries of the peer-id-to-stream map (tests: it holds one per stream, whatever ids the
    /// peer chooses).
    #[cfg(test)]
    pub fn peer_index_entries(&self) -> usize {
        self.opened_by_peer.len()
    }

    /// The session's configuration (its receive budget as last set).
    pub fn config(&self) -> &CoreConfig {
        &self.cfg
    }

    /// Received bytes held in user space across every stream.
    pub fn rx_held(&self) -> u64 {
        self.rx_held
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

    fn clock(&self) -> Instant {
        self.now.unwrap_or_else(Instant::now)
    }

    pub fn stream(&self, id: StreamId) -> Option<&Stream<U>> {
        self.streams.get(id)
    }

    pub fn stream_mut(&mut self, id: StreamId) -> Option<&mut Stream<U>> {
        self.streams.get_mut(id)
    }

    pub fn streams(&self) -> impl Iterator<Item = (StreamId, &Stream<U>)> {
        self.streams.iter()
    }

    pub fn stream_count(&self) -> usize {
        self.streams.live()
    }

    /// `recv` would return something other than `Empty`: bytes, end of stream, an error, or
    /// a payload its reader can read from a channel now. The same test `recv` makes, so that a
    /// reader woken for "readable" never finds nothing (a reader that spun on a payload the
    /// engine had taken over took both cores).
    pub(super) fn readable(&self, id: StreamId) -> bool {
        let Some(s) = self.streams.get(id) else { return true };
        if s.reset.is_some() {
            return true;
        }
        // What comes next decides: bytes staged behind a payload still in a socket cannot be
        // read before it.
        let pos = s.rx.consumed();
        if self.urgent_of(id).is_some_and(|u| u.read_limit(pos, 1).0)
            && s.rx.contiguous_end() - pos <= 1
            && !s.at_eof()
            && !s.read_closed()
        {
            // Only an urgent byte kept out of the stream: nothing a read returns (as TCP's
            // `tcp_poll` does not count it).
            return false;
        }
        match s.rx.front_deferred() {
            Some((channel, _)) => self.deferred_ready(id, channel),
            None => s.rx.ready_data() > 0 || s.at_eof() || s.read_closed(),
        }
    }

    /// A stream's urgent data, if it ever had any.
    #[inline]
    pub(super) fn urgent_of(&self, id: StreamId) -> Option<&Urgent> {
        if self.urgent.is_empty() {
            return None;
        }
        self.urgent.get(&id)
    }

    /// The peer's urgent mark on `id`, while the reads have not passed it.
    #[cfg(test)]
    pub(crate) fn urgent_mark(&self, id: StreamId) -> Option<RxUrgent> {
        let pos = self.streams.get(id)?.rx.consumed();
        self.urgent_of(id)?.mark(pos)
    }

    /// The peer's urgent byte on `id` waits to be read out of band (`POLLPRI`).
    #[inline]
    pub fn urgent_pending(&self, id: StreamId) -> bool {
        let Some(u) = self.urgent_of(id) else { return false };
        self.streams.get(id).is_some_and(|s| u.pending(s.rx.consumed()))
    }

    /// With a mark kept out of the stream whose byte has arrived ahead of the read position:
    /// the bytes before it, which is what TCP's `FIONREAD` counts then (`tcp_inq`).
    pub fn unread_before_mark(&self, id: StreamId) -> Option<u64> {
        let s = self.streams.get(id)?;
        let u = self.urgent_of(id).filter(|u| !u.inline)?;
        let (pos, end) = (s.rx.consumed(), s.rx.contiguous_end());
        let mark = u.mark(pos)?.offset;
        (mark < end).then_some(mark - pos)
    }

    /// The next byte a read of `id` returns is the peer's urgent byte (`SIOCATMARK`).
    pub fn at_urgent_mark(&self, id: StreamId) -> bool {
        let Some(s) = self.streams.get(id) else { return false };
        self.urgent_of(id).is_some_and(|u| u.at_mark(s.rx.consumed()))
    }

    /// The payload deferred at the front of `id` can be read from `channel` now: the channel
    /// still defers it for this stream, the engine has not taken it over, and bytes came since
    /// a read found none.
    pub(super) fn deferred_ready(&self, id: StreamId, channel: ChannelId) -> bool {
        let Some(s) = self.streams.get(id) else { return false };
        s.flags & F_DEFERRED_EMPTY == 0
            && self.deferred(channel).is_some_and(|d| d.stream == id && !d.taken)
    }

    /// `send` would take bytes (or fail at once). A stream short of class space only is
    /// registered to be told when it frees (as a failed send registers it).
    pub(super) fn writable(&mut self, id: StreamId) -> bool {
        let Some(s) = self.streams.get(id) else { return true };
        if !s.writable_credit() {
            return false;
        }
        if s.reset.is_some() || s.write_closed {
            return true;
        }
        let class = s.class;
        if self.room(class) > 0 {
            return true;
        }
        self.wait_for_space(id, class);
        false
    }

    /// Entries in the queue of streams waiting for receive room.
    #[cfg(test)]
    pub(crate) fn starved_len(&self) -> usize {
        self.starved.len()
    }

    pub fn stats(&self) -> CoreStats {
        let mut st = self.stats.clone();
        st.streams = self.streams.live();
        st.unsent_bytes = self.classes.iter().map(|c| c.unsent).sum();
        st.spare_bytes = self.spares.bytes() as u64;
        st.retained_bytes = self.retained_bytes();
        st.held_bytes = self.rx_held;
        debug_assert_eq!(
            self.rx_held,
            self.streams.iter().map(|(_, s)| s.rx.held_bytes()).sum::<u64>()
        );
        debug_assert_eq!(
            self.rx_competing,
            self.streams.iter().filter(|(_, s)| s.flags & F_COMPETING != 0).count()
        );
        st
    }
}

/// The other class.
fn other(class: Class) -> Class {
    match class {
        Class::Throughput => Class::Latency,
        Class::Latency => Class::Throughput,
    }
}
