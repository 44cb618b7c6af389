//! Channels of a session: their arrival and loss, what each carried and the peer has not
//! acknowledged yet (retention), and acknowledgements both ways.

use std::collections::VecDeque;
use std::time::Instant;

use bytes::Bytes;

use super::*;

/// Spare chunks a session keeps when it has less than this in flight (one RPC message's chunk
/// survives between messages; an idle session holds no more).
const SPARE_FLOOR: usize = 8 * 1024;

/// Capacity of `on_ack`'s stream list a session keeps between acknowledgements.
const ACKED_STREAMS_KEPT: usize = 1024;

/// A frame pulled onto a channel, kept until the peer acknowledges the position it ends at.
pub(super) enum Retained {
    Data { stream: StreamId, offset: u64, bytes: Bytes },
    Control { stream: StreamId, owe: u8 },
    Rst { rst: OwedRst, class: Class },
}

/// The protocol state of one channel.
pub(super) struct ChannelState {
    /// Its index and incarnation: input addressed to another incarnation of the slot is not
    /// this channel's.
    pub(super) id: ChannelId,
    pub(super) class: Class,
    /// Bytes of frames pulled for this channel.
    pub(super) tx_pos: u64,
    /// Highest position the peer acknowledged.
    pub(super) acked: u64,
    pub(super) retained: VecDeque<(u64, Retained)>,
    pub(super) retained_bytes: u64,
    /// RSTs among `retained`: at `max_pending_rsts`, more RSTs go without retention (a peer
    /// that never acknowledges cannot make us keep them all).
    pub(super) retained_rsts: u32,
    /// Bytes of the peer's frames processed (their content is safe in user space).
    pub(super) rx_pos: u64,
    /// The position this side last acknowledged.
    pub(super) rx_acked: u64,
    /// Since when bytes are unacknowledged.
    pub(super) ack_since: Option<Instant>,
    /// A stream's end (FIN or RST) came since the last acknowledgement: acknowledged at once,
    /// as TCP acknowledges a FIN, so that a peer waiting for its last bytes to be taken (a
    /// process's exit, `Engine::drain`) does not wait for the delayed acknowledgement.
    pub(super) ack_now: bool,
    /// Since when the peer has not acknowledged anything while frames wait for it (reset to
    /// now by every acknowledgement that makes progress): the peer's liveness.
    pub(super) unacked_since: Option<Instant>,
    pub(super) deferred: Option<DeferredRx>,
    /// Streams homed on this channel that owe control frames (see `Session::queue_control`).
    pub(super) control: VecDeque<StreamId>,
}

impl ChannelState {
    pub(super) fn received(&mut self, n: u64, now: Instant) {
        self.rx_pos += n;
        if self.ack_since.is_none() {
            self.ack_since = Some(now);
        }
    }
}

impl<U: Default> Session<U> {
    /// The throughput channel the dialing side should close, if the session has had more of
    /// them than busy application threads (and than `min_channels`, or than one while it is
    /// idle: `idle_rate`) for `retire_after`: its
    /// highest-indexed one, once nothing of ours waits on it (nothing unacknowledged, queued
    /// or half-read). One per `retire_after`, so a session shrinks slowly and grows at once
    /// (`wants_channel`). Whatever the peer still had in flight on it comes again on the
    /// others, as after any channel loss.
    pub fn surplus_channel(&mut self, now: Instant) -> Option<ChannelId> {
        self.surplus_checked = Some(now);
        let ticks = self.ticks(now);
        self.thread_turns.recount(ticks);
        let floor = if self.idle(now) { 1 } else { self.cfg.min_channels };
        let keep = self.thread_turns.active().max(floor).max(1);
        let channels = &self.classes[Class::Throughput.index()].channels;
        if channels.len() <= keep {
            self.surplus_since = None;
            return None;
        }
        let since = *self.surplus_since.get_or_insert(now);
        if now.saturating_duration_since(since) < self.cfg.retire_after {
            return None;
        }
        let &ch = channels.iter().max_by_key(|c| c.index)?;
        let st = self.channel(ch)?;
        let quiet = st.retained.is_empty()
            && st.control.is_empty()
            && st.deferred.is_none()
            && !self.active.has_own_work(ch);
        if !quiet {
            return None;
        }
        self.surplus_since = Some(now); // the next one waits its turn
        Some(ch)
    }

    /// Whether the session has moved less than `idle_rate` bytes a second (a sixteenth of it
    /// while two or more application threads send on it, as the runtime counts them when it
    /// dials channels) for `retire_after`, as seen by this look and the ones before
    /// (`surplus_channel`'s).
    fn idle(&mut self, now: Instant) -> bool {
        let moved = self.bytes_moved();
        let senders = self.sending_threads(now);
        if let Some((at, before)) = self.traffic_looked {
            let (delta, elapsed) =
                (moved.saturating_sub(before), now.saturating_duration_since(at));
            if !carries(delta, elapsed, senders, self.cfg.idle_rate) {
                self.idle_since.get_or_insert(at);
            } else {
                self.idle_since = None;
            }
        }
        self.traffic_looked = Some((now, moved));
        self.idle_since.is_some_and(|t| now.saturating_duration_since(t) >= self.cfg.retire_after)
    }

    /// When the dialing side should next ask `surplus_channel`: while the session has more
    /// throughput channels than it may shrink to (`min_channels`, or one with an `idle_rate`),
    /// twice per `retire_after`.
    pub fn next_surplus_check(&self) -> Option<Instant> {
        let channels = self.classes[Class::Throughput.index()].channels.len();
        let floor = if self.cfg.idle_rate > 0 { 1 } else { self.cfg.min_channels.max(1) };
        if channels <= floor {
            return None;
        }
        let last = self.surplus_checked.or(self.now)?;
        Some(last + self.cfg.retire_after / 2)
    }

    /// A channel joined the session (a new index, or an index whose previous incarnation was
    /// lost).
    pub fn add_channel(&mut self, index: ChannelId, class: Class) {
        if index.slot() > MAX_CHANNEL_INDEX as usize {
            return;
        }
        if self.channels.len() <= index.slot() {
            self.channels.resize_with(index.slot() + 1, || None);
        }
        let slot = &mut self.channels[index.slot()];
        if slot.is_some() {
            return;
        }
        *slot = Some(ChannelState {
            id: index,
            class,
            tx_pos: 0,
            acked: 0,
            retained: VecDeque::new(),
            retained_bytes: 0,
            retained_rsts: 0,
            rx_pos: 0,
            rx_acked: 0,
            ack_since: None,
            ack_now: false,
            unacked_since: None,
            deferred: None,
            control: VecDeque::new(),
        });
        self.classes[class.index()].channels.push(index);
        self.dead = false;
        // More channels, more room: senders waiting for space may go on.
        self.wake_space_waiters(class);
    }

    /// Whether the session holds this channel (this incarnation).
    pub fn has_channel(&self, index: ChannelId) -> bool {
        self.channel(index).is_some()
    }

    /// Whether the slot of `index` holds any incarnation.
    pub fn slot_taken(&self, index: u16) -> bool {
        self.channels.get(index as usize).is_some_and(Option::is_some)
    }

    /// Open channels.
    pub fn channel_count(&self) -> usize {
        self.classes.iter().map(|c| c.channels.len()).sum()
    }

    /// The channels that carry a class: its own, or the other class's when it has none.
    pub(super) fn serving(&self, class: Class) -> Class {
        if self.classes[class.index()].channels.is_empty() {
            other(class)
        } else {
            class
        }
    }

    /// A channel failed, or the peer closed it (`closed_by_peer`: a clean end of stream at a
    /// frame boundary). What it carried unacknowledged is queued again on the channels that
    /// remain; a payload deferred in it is forgotten (the peer sends it again). When it was the
    /// last channel, the streams end as TCP connections to a peer host that went away end: what
    /// arrived in order is still read; then end of stream where the peer finished, or where its
    /// process closed the channels having read all this side sent (`Stream::end_with_peer`, as
    /// its kernel would send a FIN); otherwise a reset.
    pub fn channel_lost(&mut self, index: ChannelId, closed_by_peer: bool) {
        if !self.has_channel(index) {
            return; // another incarnation, or gone already
        }
        let Some(state) = self.channels.get_mut(index.slot()).and_then(Option::take) else {
            return;
        };
        self.retained_total -= state.retained_bytes;
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
            self.apply_pending_rsts();
            for id in self.streams.ids() {
                let ends = self.streams.get_mut(id).is_some_and(|s| {
                    s.received_everything() || (closed_by_peer && s.end_with_peer())
                });
                if ends {
                    self.keep_for_reading(id);
                } else {
                    self.reset_stream(id, ResetCause::ChannelLost, false);
                }
            }
            self.classes = [ClassTx::default(), ClassTx::default()];
            return;
        }
        // Control frames owed on it go on another channel.
        for id in state.control {
            if let Some(s) = self.streams.get_mut(id) {
                if s.flags & F_CONTROL != 0 {
                    s.flags &= !F_CONTROL;
                    self.queue_control(id);
                }
            }
        }
        if let Some(d) = state.deferred {
            if let Some(s) = self.streams.get_mut(d.stream) {
                let before = s.rx.held_bytes();
                // A copy the peer sent again before this end knew takes the payload's place.
                let readable = s.rx.remove_deferred(d.offset);
                self.rx_held = self.rx_held + s.rx.held_bytes() - before;
                if readable > 0 {
                    self.emit(d.stream, EV_READ);
                }
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
                    let mut again = owe & (OWE_CREDIT | OWE_SYN_ACK | OWE_URGENT);
                    if s.phase == Phase::Connecting {
                        again |= owe & OWE_SYN;
                    }
                    if s.write_closed {
                        again |= owe & OWE_FIN;
                    }
                    self.owe(stream, again);
                }
                Retained::Rst { rst, class } => self.queue_rst(class, rst),
            }
        }
        // Bytes a peer's RST waits for may have been on this channel, and the peer does not
        // send a reset stream's bytes again.
        self.apply_pending_rsts();
        self.wake_space_waiters(class);
    }

    /// The state of channel `ch`, this incarnation only.
    pub(super) fn channel(&self, ch: ChannelId) -> Option<&ChannelState> {
        self.channels.get(ch.slot())?.as_ref().filter(|st| st.id == ch)
    }

    /// The open channels' states, through the classes' lists: a session uses a few of its
    /// 64 slots, and the worker's timer scan asks this of every session.
    pub(super) fn open_channels(&self) -> impl Iterator<Item = &ChannelState> {
        self.classes.iter().flat_map(|c| c.channels.iter()).filter_map(|&id| self.channel(id))
    }

    /// The state of channel `ch`, this incarnation only.
    pub(super) fn channel_mut(&mut self, ch: ChannelId) -> Option<&mut ChannelState> {
        self.channels.get_mut(ch.slot())?.as_mut().filter(|st| st.id == ch)
    }

    pub(super) fn on_ack(
        &mut self,
        channel: ChannelId,
        position: u64,
        now: Instant,
    ) -> Result<(), Violation> {
        let (max_bytes, max_frames) = (self.cfg.max_retained_bytes, self.cfg.max_retained_frames);
        // Acknowledged chunks are kept for reuse within what the session has in flight. Less
        // was tried: one acknowledgement frees `ack_threshold` bytes or more at once, and with
        // 10,000 streams a cap of four times that still dropped a third of them.
        let spare_limit = self.spare_limit();
        // The field, not `channel_mut`: the loop gives buffers to `self.spares` beside it.
        let Some(st) = self
            .channels
            .get_mut(channel.slot())
            .and_then(|c| c.as_mut())
            .filter(|st| st.id == channel)
        else {
            // A channel already lost here (its frames were queued again), or an earlier
            // incarnation of one that was dialed again.
            return Ok(());
        };
        if position > st.tx_pos {
            return Err(Violation::BadAck);
        }
        if position <= st.acked {
            return Ok(());
        }
        let full =
            |st: &ChannelState| st.retained_bytes >= max_bytes || st.retained.len() >= max_frames;
        let was_full = full(st);
        st.acked = position;
        let mut done = std::mem::take(&mut self.acked_streams);
        let mut freed = 0;
        while st.retained.front().is_some_and(|(end, _)| *end <= position) {
            let (_, r) = st.retained.pop_front().expect("front exists");
            match r {
                Retained::Data { stream, bytes, .. } => {
                    st.retained_bytes -= bytes.len() as u64;
                    freed += bytes.len() as u64;
                    done.push(stream);
                    self.spares.give(bytes, spare_limit);
                }
                Retained::Control { stream, .. } => done.push(stream),
                Retained::Rst { .. } => st.retained_rsts -= 1,
            }
        }
        // Progress: the peer is alive; what still waits is timed from now.
        st.unacked_since = (!st.retained.is_empty()).then_some(now);
        self.peer_progress = Some(now);
        if was_full && !full(st) && !self.tx_ready.contains(&channel) {
            self.tx_ready.push(channel);
        }
        if freed > 0 {
            // The send budget has room again: senders waiting for it may go on.
            self.retained_total -= freed;
            if self.in_flight() == 0 {
                // Idle: keep what the next message needs, not what the last burst used.
                self.spares.trim(SPARE_FLOOR);
            }
            self.wake_space_waiters(Class::Throughput);
            self.wake_space_waiters(Class::Latency);
        }
        for &id in &done {
            if let Some(s) = self.streams.get_mut(id) {
                s.unacked_frames -= 1;
                if s.unacked_frames == 0 {
                    self.maybe_free(id);
                }
            }
        }
        done.clear();
        // One acknowledgement can cover many frames (up to `max_retained_frames`): a list a
        // burst made long is let go rather than kept by every session.
        if done.capacity() <= ACKED_STREAMS_KEPT {
            self.acked_streams = done;
        }
        Ok(())
    }

    /// The most the session keeps in spare chunks now: what it has in flight (so spares never
    /// outgrow `tx_budget`, which bounds those bytes).
    pub(super) fn spare_limit(&self) -> usize {
        self.in_flight().max(SPARE_FLOOR)
    }

    /// Whether acknowledgements are owed on their own (without other frames to carry them):
    /// a channel holds `ack_threshold` unacknowledged bytes, or, with `owed_since`, any
    /// acknowledgement has been owed since that time or earlier.
    pub fn ack_due(&self, owed_since: Option<Instant>) -> bool {
        self.open_channels().any(|st| {
            (st.ack_now && st.rx_pos > st.rx_acked)
                || st.rx_pos - st.rx_acked >= self.cfg.ack_threshold
                || owed_since.is_some_and(|t| st.ack_since.is_some_and(|s| s <= t))
        })
    }

    /// Since when the oldest acknowledgement this side owes is owed (`None`: none is).
    pub fn ack_owed_since(&self) -> Option<Instant> {
        self.open_channels()
            .filter(|st| st.rx_pos > st.rx_acked)
            .filter_map(|st| st.ack_since)
            .min()
    }

    /// Whether this side owes the peer an acknowledgement on any channel.
    pub fn owes_ack(&self) -> bool {
        self.open_channels().any(|st| st.rx_pos > st.rx_acked)
    }

    /// Bytes sent on channel `ch` and not yet acknowledged.
    #[cfg(test)]
    pub fn channel_retained(&self, ch: ChannelId) -> u64 {
        self.channel(ch).map_or(0, |st| st.retained_bytes)
    }

    /// Bytes sent on channels and not yet acknowledged.
    pub fn retained_bytes(&self) -> u64 {
        self.retained_total
    }

    /// Records a pulled frame in the channel's retention; returns its length.
    pub(super) fn retain(&mut self, ch: ChannelId, len: usize, what: Retained) -> usize {
        let now = self.clock();
        let st = self.channel_mut(ch).expect("pulling for a live channel");
        st.tx_pos += len as u64;
        if let Retained::Data { bytes, .. } = &what {
            st.retained_bytes += bytes.len() as u64;
            self.retained_total += bytes.len() as u64;
        }
        let st = self.channel_mut(ch).expect("pulling for a live channel");
        let end = st.tx_pos;
        if st.retained.is_empty() {
            st.unacked_since = Some(now);
        }
        st.retained.push_back((end, what));
        len
    }

    /// Whether channel `ch` may take more frames that wait for the peer's acknowledgement:
    /// below `max_retained_bytes` and `max_retained_frames` (a peer that does not acknowledge
    /// slows its senders down instead of growing our memory).
    pub(super) fn may_retain(&self, ch: ChannelId) -> bool {
        self.channel(ch).is_some_and(|st| {
            st.retained_bytes < self.cfg.max_retained_bytes
                && st.retained.len() < self.cfg.max_retained_frames
        })
    }

    /// Channels whose peer acknowledged nothing for `ack_timeout` while frames waited for it.
    /// What that means is for `peer_engine_active` to say: if the peer engine acknowledges
    /// other channels, such a channel is broken (its frames never delivered) and the caller
    /// closes it; if the whole peer is silent, it is a stopped or paused process (which TCP
    /// waits for) or a black hole, and only the channel's TCP state tells them apart.
    pub fn unacknowledging_channels(&self, now: Instant) -> Vec<ChannelId> {
        self.open_channels()
            .filter(|st| {
                st.unacked_since
                    .is_some_and(|t| now.saturating_duration_since(t) >= self.cfg.ack_timeout)
            })
            .map(|st| st.id)
            .collect()
    }

    /// Whether the peer engine acknowledged new frames, on any channel, within the last half
    /// `ack_timeout`: it is processing.
    pub fn peer_engine_active(&self, now: Instant) -> bool {
        self.peer_progress
            .is_some_and(|t| now.saturating_duration_since(t) < self.cfg.ack_timeout / 2)
    }

    /// The runtime found channel `id`'s peer alive (its kernel acknowledges) though its engine
    /// acknowledged nothing for `ack_timeout`: look again after another `ack_timeout`.
    pub fn rearm_ack_clock(&mut self, id: ChannelId, now: Instant) {
        if let Some(st) = self.channel_mut(id).filter(|st| st.unacked_since.is_some()) {
            st.unacked_since = Some(now);
        }
    }

    /// Bytes of frames sent and received on the session's open channels (their current
    /// incarnations): how busy it is (`idle_rate`; the runtime's choice of when to dial more
    /// channels, `Config::rest_channels_rate`). A lost channel's bytes leave the sum.
    pub fn bytes_moved(&self) -> u64 {
        self.open_channels().map(|st| st.tx_pos + st.rx_pos).sum()
    }

    /// The next time a channel may become unacknowledging (for the runtime's timers).
    pub fn next_ack_deadline(&self) -> Option<Instant> {
        self.open_channels()
            .filter_map(|st| st.unacked_since)
            .min()
            .map(|t| t + self.cfg.ack_timeout)
    }
}
