//! What a channel sends next: control frames owed, then chunks of streams with unsent bytes
//! in the scheduler's order, with acknowledgements riding along; and the class space that
//! slows senders down (backpressure).

use super::channels::Retained;
use super::*;
use crate::wire::frame::{data_header, DATA_HEADER_LEN};
use crate::wire::RstReason;

/// Senders woken per this many bytes of class space freed (each may write about that much).
const SPACE_WAKE_QUANTUM: u64 = 64 * 1024;

/// Application threads a session tells apart for homes (`Session::thread_turn`).
const MAX_THREAD_TURNS: usize = 256;

/// A thread that sent at least `CoreConfig::busy_thread_rate` bytes (64 MiB by default) on the
/// session's streams within one of the last two windows of this many nanoseconds is busy (opening a stream does not count: the opener may
/// hand it to another thread): the session wants a throughput channel for each
/// (`wants_channel`), and a backlog keeps to its thread's channel while more than one is
/// (`data_home`). A channel of its own pays for a thread that moves many bytes (the staging
/// copy and the hand-off it saves are per byte and per message read for another thread); one
/// that sends small messages is better off sharing, since a shared channel carries several
/// threads' messages in each read and write (memcslap's 16 threads of small requests took 11%
/// longer on 8 channels than on 4; docs/BENCHMARKS.md, "Channels per thread").
const ACTIVE_WINDOW_NS: u64 = 1_000_000_000;

/// What one send counts toward being busy at most (a large write is sent in several calls,
/// each with all that is left of it).
const MAX_COUNTED_SEND: u64 = 4 << 20;

/// The busy threads are counted again at most this often (nanoseconds): the count is read on
/// every chunk pulled. A thread that becomes busy counts at once.
const RECOUNT_NS: u64 = 10_000_000;

/// A stream with at most this many unsent bytes keeps to its home channel (`Session::home`);
/// beyond, its chunks go to whichever channel has room, unless other threads are busy too
/// (`data_home`).
const AFFINE_BYTES: u64 = 64 * 1024;

/// One application thread of `ThreadTurns`: its number and the bytes it sent in the current
/// window and the one before.
#[derive(Clone, Copy)]
struct ThreadUse {
    thread: u16,
    bytes: u64,
    bytes_before: u64,
}

impl ThreadUse {
    fn busy(&self, busy_bytes: u64) -> bool {
        self.bytes.max(self.bytes_before) >= busy_bytes
    }
}

/// The application threads that used a session's streams opened here, in order of first use
/// (a thread's place is its turn: `Session::thread_turn`), with how much each sent, and how
/// many are busy (in this window or the last) as last counted.
#[derive(Default)]
pub(super) struct ThreadTurns {
    threads: Vec<ThreadUse>,
    /// When the current window began (`Session::ticks`).
    window: u64,
    active: usize,
    counted_at: u64,
    /// Bytes in a window that make a thread busy (`CoreConfig::busy_thread_rate`).
    busy_bytes: u64,
}

impl ThreadTurns {
    pub(super) fn new(busy_bytes: u64) -> Self {
        ThreadTurns { busy_bytes: busy_bytes.max(1), ..ThreadTurns::default() }
    }

    /// Thread `turn` sends `bytes` on a stream at `now`. One that becomes busy counts at once;
    /// those that stop are found by the next count.
    fn used(&mut self, turn: u16, now: u64, bytes: u64) {
        if now.saturating_sub(self.counted_at) >= RECOUNT_NS {
            self.recount(now);
        }
        if let Some(t) = self.threads.get_mut(turn as usize) {
            let was = t.busy(self.busy_bytes);
            t.bytes = t.bytes.saturating_add(bytes.min(MAX_COUNTED_SEND));
            if !was && t.busy(self.busy_bytes) {
                self.active += 1;
            }
        }
    }

    /// Counts the busy threads again, first closing the window if it is over.
    pub(super) fn recount(&mut self, now: u64) {
        let elapsed = now.saturating_sub(self.window);
        if elapsed >= ACTIVE_WINDOW_NS {
            // Two windows or more without a look: the last one saw nothing either.
            let idle = elapsed >= 2 * ACTIVE_WINDOW_NS;
            for t in &mut self.threads {
                t.bytes_before = if idle { 0 } else { t.bytes };
                t.bytes = 0;
            }
            self.window = now;
        }
        let busy_bytes = self.busy_bytes;
        self.active = self.threads.iter().filter(|t| t.busy(busy_bytes)).count();
        self.counted_at = now;
    }

    /// Threads busy on the session's streams in this window or the last, as last counted.
    pub(super) fn active(&self) -> usize {
        self.active
    }

    /// Threads that sent anything on the session's streams in this window or the last.
    pub(super) fn senders(&mut self, now: u64) -> usize {
        self.recount(now);
        self.threads.iter().filter(|t| t.bytes.max(t.bytes_before) > 0).count()
    }
}

/// An RST to send: the peer's stream, why, and where the bytes sent before it end (the peer
/// delivers those first, wherever they travel).
#[derive(Clone, Copy)]
pub(super) struct OwedRst {
    pub(super) peer: PeerStreamId,
    pub(super) reason: RstReason,
    pub(super) final_offset: u64,
}

/// Per class: its channels and what waits for them.
#[derive(Default)]
pub(super) struct ClassTx {
    /// Open channels of the class, in the order they arrived.
    pub(super) channels: Vec<ChannelId>,
    /// Streams owing control frames.
    pub(super) control: VecDeque<StreamId>,
    /// RSTs owed for streams that have no state here (refused, aborted, stale).
    pub(super) rsts: VecDeque<OwedRst>,
    pub(super) unsent: u64,
    pub(super) space_waiters: VecDeque<StreamId>,
    /// Senders woken for space that have neither sent, nor waited again, nor stopped sending
    /// (shut down, closed, reset) since: each is counted on to take about a quantum of the
    /// room (`wake_space_waiters`).
    pub(super) woken: u64,
    /// A sender found no space since the last `take_congestion`.
    pub(super) congested: bool,
}

/// The classes whose frames a channel of one class carries (its own, and the other when that
/// has no channel): at most two, kept inline (asked on every pull).
pub(super) struct ServedClasses {
    list: [Class; 2],
    len: usize,
}

impl std::ops::Deref for ServedClasses {
    type Target = [Class];
    fn deref(&self) -> &[Class] {
        &self.list[..self.len]
    }
}

impl<U: Default> Session<U> {
    pub(super) fn served_by(&self, class: Class) -> ServedClasses {
        let mut served = ServedClasses { list: [class; 2], len: 0 };
        for k in [class, other(class)] {
            if self.serving(k) == class {
                served.list[served.len] = k;
                served.len += 1;
            }
        }
        served
    }

    /// Whether channel `ch` has frames to pull (acknowledgements aside). A channel at its
    /// retention limit has none but RSTs until the peer acknowledges (see `take_tx_ready`).
    pub fn has_transmit(&self, ch: ChannelId) -> bool {
        let Some(st) = self.channel(ch) else {
            return false;
        };
        let served = self.served_by(st.class);
        let rsts = served.iter().any(|k| !self.classes[k.index()].rsts.is_empty());
        if !self.may_retain(ch) {
            return rsts;
        }
        rsts || self.active.has_work(ch, &served)
            || !st.control.is_empty()
            || served.iter().any(|k| !self.classes[k.index()].control.is_empty())
    }

    /// What the channels carrying `class` have to send: whether frames wait that any of them
    /// may carry, and which (bits by index) hold frames only they may carry (their streams'
    /// homes). A sender writes on those alone when nothing else waits, instead of trying
    /// every channel in turn.
    pub fn transmit_work(&self, class: Class) -> (bool, u64) {
        let serving = self.serving(class);
        let served = self.served_by(serving);
        let shared = served.iter().any(|&k| {
            let c = &self.classes[k.index()];
            self.active.has_shared_work(k) || !c.control.is_empty() || !c.rsts.is_empty()
        });
        let mut own = 0u64;
        for &ch in &self.classes[serving.index()].channels {
            let queued = self.channel(ch).is_some_and(|st| !st.control.is_empty());
            if queued || self.active.has_own_work(ch) {
                own |= ch.bit();
            }
        }
        (shared, own)
    }

    /// Channels that were held at their retention limit and may pull frames again (the peer
    /// acknowledged): the runtime writes on them.
    pub fn take_tx_ready(&mut self) -> Vec<ChannelId> {
        std::mem::take(&mut self.tx_ready)
    }

    /// Appends the next frames channel `ch` should write (at most about `budget` bytes and
    /// `max_frames` frames) and returns their bytes. Acknowledgements ride along whenever
    /// anything is sent, and go alone when `ack_due(force_ack)`.
    pub fn poll_transmit(
        &mut self,
        ch: ChannelId,
        budget: usize,
        max_frames: usize,
        force_ack: bool,
        out: &mut Vec<OutFrame>,
    ) -> usize {
        let Some(class) = self.channel(ch).map(|c| c.class) else {
            return 0;
        };
        let start = out.len();
        let mut bytes = 0usize;
        let served = self.served_by(class);
        for &k in served.iter() {
            while out.len() - start < max_frames {
                let Some(rst) = self.classes[k.index()].rsts.pop_front() else {
                    break;
                };
                let f = OutFrame::control(Frame::Rst {
                    dst: rst.peer.get(),
                    reason: rst.reason,
                    final_offset: rst.final_offset,
                });
                let cap = self.cfg.max_pending_rsts as u32;
                let st = self.channel_mut(ch).expect("pulling for a live channel");
                if st.retained_rsts < cap {
                    st.retained_rsts += 1;
                    bytes += self.retain(ch, f.len(), Retained::Rst { rst, class: k });
                } else {
                    st.tx_pos += f.len() as u64;
                    bytes += f.len();
                    self.stats.unretained_rsts += 1;
                }
                out.push(f);
            }
            // Control frames are retained too: a channel at its retention limit takes none.
            while out.len() - start < max_frames && self.may_retain(ch) {
                let Some(id) = self.classes[k.index()].control.pop_front() else { break };
                bytes += self.emit_control(ch, id, out);
            }
        }
        // Those of the streams homed here.
        while out.len() - start < max_frames && self.may_retain(ch) {
            let Some(id) = self.channel_mut(ch).and_then(|st| st.control.pop_front()) else {
                break;
            };
            bytes += self.emit_control(ch, id, out);
        }
        while bytes < budget && out.len() - start + 2 <= max_frames && self.may_retain(ch) {
            let Some(id) = self.next_active(ch, &served) else { break };
            let max_frame = self.cfg.max_frame_payload;
            let Some(s) = self.streams.get_mut(id) else { continue };
            let Some((offset, data)) = s.tx.take(max_frame.min(budget - bytes).max(1)) else {
                s.flags &= !F_ACTIVE;
                continue;
            };
            let n = data.len();
            let c = s.class;
            let header = data_header(s.peer.get(), offset, n);
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
        let owed = || self.open_channels().any(|st| st.rx_pos > st.rx_acked);
        if sending || self.ack_due(None) || (force_ack && owed()) {
            // By index, not collected first: no allocation per frame sent.
            for slot in 0..self.channels.len() {
                let Some(st) = self.channels[slot].as_mut().filter(|st| st.rx_pos > st.rx_acked)
                else {
                    continue;
                };
                st.rx_acked = st.rx_pos;
                st.ack_since = None;
                st.ack_now = false;
                let (channel, incarnation, position) = (st.id.index, st.id.incarnation, st.rx_pos);
                let f = OutFrame::control(Frame::Ack { channel, incarnation, position });
                bytes += f.len();
                if let Some(st) = self.channel_mut(ch) {
                    st.tx_pos += f.len() as u64;
                }
                out.push(f);
            }
        }
        bytes
    }

    pub(super) fn emit_control(
        &mut self,
        ch: ChannelId,
        id: StreamId,
        out: &mut Vec<OutFrame>,
    ) -> usize {
        let Some(s) = self.streams.get(id) else { return 0 };
        let credit = s.owe & OWE_CREDIT != 0 && s.phase == Phase::Open && !s.peer_finished();
        // A CREDIT grants what the receive budget has room for now (the window it carries).
        let credit_window = if credit { self.grant(id) } else { 0 };
        let urgent = self.urgent_of(id).and_then(|u| u.tx);
        let Some(s) = self.streams.get_mut(id) else { return 0 };
        s.flags &= !F_CONTROL;
        let owe = std::mem::take(&mut s.owe);
        if owe == 0 || s.reset.is_some() {
            return 0;
        }
        // SYN and SYN_ACK carry the grant made when the stream opened or was accepted (the
        // same when sent again after a channel loss).
        let granted_window = (s.granted - s.rx.consumed()) as u32;
        let mut frames = Vec::with_capacity(4);
        if owe & OWE_SYN != 0 && s.phase == Phase::Connecting {
            frames.push(Frame::Syn {
                src: id.get(),
                port: s.port,
                class: s.class,
                window: granted_window,
            });
        }
        if owe & OWE_SYN_ACK != 0 && s.phase == Phase::Open {
            let (dst, src) = (s.peer.get(), id.get());
            let kernel_preferred = s.flags & F_KERNEL_PREFERRED != 0;
            frames.push(Frame::SynAck { dst, src, window: granted_window, kernel_preferred });
        }
        if credit {
            let consumed = s.rx.consumed();
            frames.push(Frame::Credit { dst: s.peer.get(), consumed, window: credit_window });
        }
        if let Some((offset, byte)) = urgent.filter(|_| owe & OWE_URGENT != 0) {
            if s.phase == Phase::Open {
                frames.push(Frame::Urgent { dst: s.peer.get(), offset, byte });
            }
        }
        if owe & OWE_FIN != 0 && s.write_closed && s.phase == Phase::Open {
            s.flags |= F_FIN_SENT;
            frames.push(Frame::Fin { dst: s.peer.get(), final_offset: s.send_next });
        }
        s.unacked_frames += frames.len() as u32;
        s.frames_sent += frames.len() as u32;
        let mut bytes = 0;
        for f in frames {
            let bit = match f {
                Frame::Syn { .. } => OWE_SYN,
                Frame::SynAck { .. } => OWE_SYN_ACK,
                Frame::Credit { .. } => OWE_CREDIT,
                Frame::Urgent { .. } => OWE_URGENT,
                _ => OWE_FIN,
            };
            let of = OutFrame::control(f);
            bytes += self.retain(ch, of.len(), Retained::Control { stream: id, owe: bit });
            out.push(of);
        }
        bytes
    }

    pub(super) fn next_active(&mut self, ch: ChannelId, served: &[Class]) -> Option<StreamId> {
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

    pub(super) fn requeue_active(&mut self, id: StreamId, ch: ChannelId) {
        let home = self.data_home(id);
        let Some(s) = self.streams.get(id) else { return };
        if let Some(h) = self.active.requeue(id, ch, s.class, home).filter(|&h| h != ch) {
            self.kick(h);
        }
    }

    /// Channel `ch` alone may carry frames just queued (a stream's home): the runtime makes it
    /// write (`take_kicked`), whichever channel's work queued them.
    fn kick(&mut self, ch: ChannelId) {
        self.kicked |= ch.bit();
    }

    /// The channels of `class` (bits by index) frames were queued for since the last call,
    /// that no other channel may carry: the runtime writes on them. Per class, so that a thread
    /// serving one class (a latency worker, an application's latency thread) never writes the
    /// other's frames on its way.
    pub fn take_kicked(&mut self, class: Class) -> u64 {
        let mask = self.classes[class.index()].channels.iter().fold(0, |m, c| m | c.bit());
        let taken = self.kicked & mask;
        self.kicked &= !mask;
        taken
    }

    pub(super) fn activate(&mut self, id: StreamId) {
        let home = self.data_home(id);
        let Some(s) = self.streams.get_mut(id) else { return };
        if s.flags & F_ACTIVE != 0 || s.tx.is_empty() || s.reset.is_some() {
            return;
        }
        s.flags |= F_ACTIVE;
        let class = s.class;
        let serving = &self.classes[self.serving(class).index()].channels;
        if let Some(ch) = self.active.push(id, class, serving, home) {
            self.kick(ch);
        }
    }

    /// The home channel stream `id`'s next chunks keep to. None while it holds a backlog and
    /// at most one thread is busy on the session: that thread's bulk streams spread over every
    /// channel with room. While several are busy, it keeps to its home, so that each
    /// channel carries the streams of one thread and the thread reading it is their reader:
    /// spread over channels read by eight receiving threads, eight bulk streams had their
    /// payloads read by the wrong thread, staged and copied a second time (docs/BENCHMARKS.md,
    /// "Channels per thread").
    fn data_home(&self, id: StreamId) -> Option<ChannelId> {
        let backlog = self.streams.get(id)?.tx.bytes() > AFFINE_BYTES;
        if backlog && self.thread_turns.active() <= 1 {
            None
        } else {
            self.home(id)
        }
    }

    /// Application threads that sent on the session's streams within the last second or two
    /// (the runtime dials a session's other channels for them: each thread's streams keep to
    /// a home channel of their own, `home`, whatever their rate).
    pub fn sending_threads(&mut self, now: Instant) -> usize {
        let ticks = self.ticks(now);
        self.thread_turns.senders(ticks)
    }

    /// Whether the session should have one more channel of the class that serves `class`:
    /// more application threads are busy on it than it has channels (each thread's streams
    /// keep to a channel of their own, `home`), and it has fewer than `max_channels`. The
    /// runtime of the dialing side adds one (the paper's "channels scale with cores").
    pub fn wants_channel(&self, class: Class) -> bool {
        if self.serving(class) != Class::Throughput {
            return false; // latency channels do not grow
        }
        let serving = self.classes[Class::Throughput.index()].channels.len();
        self.thread_turns.active() > serving && serving < self.cfg.max_channels
    }

    /// The channel stream `id` keeps to, among the open channels that carry its class (round-
    /// robin policy; `None` when it has none). For a stream opened here, the channel of the
    /// application thread that last used it (`set_thread`): each thread of a process that
    /// talks to one peer gets a channel of its own while there are as many. For a stream the
    /// peer opened, the channel its last DATA (or its SYN) came on: the answer goes back on
    /// the channel the question came on. Both ends thus agree without telling each other, and
    /// a thread that waits on its streams' homes alone (`engine/waiter.rs`) is the one the
    /// kernel wakes for their frames. Where they disagree (the peer's choice changed) nothing
    /// breaks: any thread reading a channel hands each frame to its stream.
    pub fn home(&self, id: StreamId) -> Option<ChannelId> {
        if self.cfg.policy == Policy::Sticky {
            return None;
        }
        let s = self.streams.get(id)?;
        let serving = &self.classes[self.serving(s.class).index()].channels;
        if serving.is_empty() {
            return None;
        }
        if s.flags & F_LOCAL != 0 {
            if s.thread == 0 {
                return None;
            }
            return Some(serving[(s.thread as usize - 1) % serving.len()]);
        }
        let index = s.rx_index()?;
        serving.iter().copied().find(|c| c.index == index)
    }

    /// The channels an application thread that uses stream `id` should wait on: its home
    /// (where answers to what it sends come) and the channel its last DATA came on (a bulk
    /// stream's spread over several), when open.
    pub fn wait_channels(&self, id: StreamId) -> [Option<ChannelId>; 2] {
        let home = self.home(id);
        let rx = self
            .streams
            .get(id)
            .and_then(|s| self.channels.get(s.rx_index()? as usize)?.as_ref().map(|st| st.id));
        [home, rx.filter(|&r| Some(r) != home)]
    }

    /// Application thread `thread` uses stream `id` (a number the runtime gives each thread):
    /// for a stream opened here, its frames keep to that thread's channel (see `home`).
    /// Called as the thread sends `bytes` at `now`, which count toward it being busy
    /// (`ThreadTurns`).
    pub fn set_thread(&mut self, id: StreamId, thread: u16, now: Instant, bytes: usize) {
        let Some(s) = self.streams.get(id) else { return };
        if s.flags & F_LOCAL == 0 {
            return;
        }
        let (turn, number) = (s.thread, s.thread_number);
        let now = self.ticks(now);
        if turn != 0 && number == thread {
            self.thread_turns.used(turn - 1, now, bytes as u64);
            return;
        }
        let turn = self.thread_turn(thread, Some((now, bytes as u64)));
        let s = self.streams.get_mut(id).expect("live");
        s.thread_number = thread;
        s.thread = turn.wrapping_add(1);
        // What it owes goes to the new home when next queued; nothing queued moves.
    }

    /// The place of application thread `thread` among those that used this session's streams
    /// (in order of first use): the `k`-th thread's streams keep to the `k`-th channel (modulo
    /// the channels), so threads spread evenly over the channels whatever numbers the process
    /// gave them. Remembers `MAX_THREAD_TURNS` threads; later ones take their number's turn
    /// (and count as that turn's thread). `sent`: when (`ticks`) and how much the thread sends;
    /// `None` for a thread that only opens a stream (it may hand it to another).
    pub(super) fn thread_turn(&mut self, thread: u16, sent: Option<(u64, u64)>) -> u16 {
        let turns = &mut self.thread_turns;
        let turn = match turns.threads.iter().position(|t| t.thread == thread) {
            Some(turn) => turn as u16,
            None if turns.threads.len() >= MAX_THREAD_TURNS => return thread,
            None => {
                turns.threads.push(ThreadUse { thread, bytes: 0, bytes_before: 0 });
                (turns.threads.len() - 1) as u16
            }
        };
        if let Some((now, bytes)) = sent {
            turns.used(turn, now, bytes);
        }
        turn
    }

    pub(super) fn owe(&mut self, id: StreamId, bits: u8) {
        let Some(s) = self.streams.get_mut(id) else { return };
        if bits == 0 {
            return;
        }
        s.owe |= bits;
        if s.flags & F_CONTROL == 0 {
            self.queue_control(id);
        }
    }

    /// Queues stream `id` for its control frames: on its home channel when it has one (a
    /// CREDIT or FIN wakes the thread that waits there), else on any of its class.
    pub(super) fn queue_control(&mut self, id: StreamId) {
        let home = self.home(id);
        let Some(s) = self.streams.get_mut(id) else { return };
        s.flags |= F_CONTROL;
        let class = s.class;
        match home.and_then(|h| self.channel_mut(h)) {
            Some(st) => {
                st.control.push_back(id);
                let h = st.id;
                self.kick(h);
            }
            None => self.classes[class.index()].control.push_back(id),
        }
    }

    pub(super) fn queue_rst(&mut self, class: Class, rst: OwedRst) {
        let q = &mut self.classes[class.index()].rsts;
        if q.len() >= self.cfg.max_pending_rsts {
            self.stats.dropped_rsts += 1;
            return;
        }
        q.push_back(rst);
    }

    /// Whether stream `id` owes the peer a control frame (a CREDIT after reads, a FIN, ...).
    pub(super) fn owes_control(&self, id: StreamId) -> bool {
        self.streams.get(id).is_some_and(|s| s.owe != 0)
    }

    /// Whether what stream `id` owes may wait for the next frames out (an answer the
    /// application is about to send, or the worker's tick): it owes only a CREDIT, and the peer
    /// has not used half of the credit it holds beyond what was read (half a minimum window at
    /// least), so no sender waits for it soon. As TCP delays a window update it can carry on
    /// data, this saves a packet (and a wake-up of the peer's reader) per CREDIT of a stream
    /// whose reads answer requests; a bulk sender, which keeps its credit nearly used up, is
    /// answered at once (a tick is a long time at tens of Gbit/s).
    pub(super) fn control_can_wait(&self, id: StreamId) -> bool {
        let Some(s) = self.streams.get(id) else { return false };
        let min = self.floor_window(s);
        let ahead = s.granted.saturating_sub(s.rx.consumed());
        let unused = s.granted.saturating_sub(s.rx.high());
        s.owe == OWE_CREDIT && unused >= (min / 2).max(ahead / 2)
    }

    /// RSTs and control frames queued and not yet pulled (a peer that does not read them
    /// should be slowed: stop reading its frames).
    pub fn control_backlog(&self) -> usize {
        self.classes.iter().map(|c| c.rsts.len() + c.control.len()).sum::<usize>()
            + self.open_channels().map(|st| st.control.len()).sum::<usize>()
    }

    pub(super) fn wake_space_waiters(&mut self, class: Class) {
        let room = self.room(class);
        let c = &mut self.classes[class.index()];
        if c.space_waiters.is_empty() || room == 0 {
            return;
        }
        // One sender per whole quantum of room, less the senders woken before and not heard
        // from since (each is counted on to take a quantum). Every pull asks: waking the
        // room's worth each time, and a sender for a part of a quantum (the senders still
        // writing fill the class before it comes), sent a million streams' event loops round
        // ten times for each write that went through. Once the class has nothing left to pull
        // no later pull comes, so everyone still waiting is woken: one woken earlier may not
        // have written (an event loop told EPOLLOUT with nothing to say).
        let quantum =
            SPACE_WAKE_QUANTUM.min(self.class_limit(class) / 4).min(self.cfg.tx_budget / 4).max(1);
        let c = &mut self.classes[class.index()];
        let mut wake = if c.unsent == 0 {
            c.woken = 0;
            u64::MAX
        } else {
            (room / quantum).saturating_sub(c.woken)
        };
        while wake > 0 {
            let Some(id) = self.classes[class.index()].space_waiters.pop_front() else { break };
            wake -= 1;
            if let Some(s) = self.streams.get_mut(id) {
                s.flags &= !F_SPACE_WAIT;
                if s.flags & F_SPACE_WOKEN == 0 {
                    s.flags |= F_SPACE_WOKEN;
                    self.classes[class.index()].woken += 1;
                }
                self.emit(id, EV_WRITE);
            }
        }
    }

    /// Stream `id` sent, or asked for space again, or will send no more: it no longer counts
    /// among the senders woken for space.
    pub(super) fn heard_from_woken(&mut self, id: StreamId) {
        let Some(s) = self.streams.get_mut(id) else { return };
        if s.flags & F_SPACE_WOKEN != 0 {
            s.flags &= !F_SPACE_WOKEN;
            let c = &mut self.classes[s.class.index()];
            c.woken = c.woken.saturating_sub(1);
        }
    }

    /// Whether a sender of `class` found no space since the last call (the cue to add a
    /// channel).
    pub fn take_congestion(&mut self, class: Class) -> bool {
        std::mem::take(&mut self.classes[class.index()].congested)
    }

    pub(super) fn class_limit(&self, class: Class) -> u64 {
        let serving = self.serving(class);
        self.cfg.queue_threshold * self.classes[serving.index()].channels.len().max(1) as u64
    }

    /// Bytes a sender of `class` may add now: within the class's share of unsent bytes
    /// (`queue_threshold` per channel) and the session's send budget (`tx_budget`: unsent
    /// and unacknowledged bytes of every class, so a peer that does not acknowledge slows
    /// senders instead of growing memory).
    pub(super) fn room(&self, class: Class) -> u64 {
        let class_room = self.class_limit(class).saturating_sub(self.classes[class.index()].unsent);
        let held = self.classes.iter().map(|c| c.unsent).sum::<u64>() + self.retained_total;
        class_room.min(self.cfg.tx_budget.saturating_sub(held))
    }

    /// Sets the send budget (the engine shares its own among its sessions).
    pub fn set_tx_budget(&mut self, budget: u64) {
        self.cfg.tx_budget = budget;
        self.wake_space_waiters(Class::Throughput);
        self.wake_space_waiters(Class::Latency);
    }
}
