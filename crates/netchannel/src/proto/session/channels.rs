//! Channels of a session: their arrival and loss, what each carried and the peer has not
//! acknowledged yet (retention), and acknowledgements both ways.

use std::collections::VecDeque;
use std::time::Instant;

use bytes::Bytes;

use super::*;
use crate::wire::RstReason;

/// A frame pulled onto a channel, kept until the peer acknowledges the position it ends at.
pub(super) enum Retained {
    Data { stream: StreamId, offset: u64, bytes: Bytes },
    Control { stream: StreamId, owe: u8 },
    Rst { peer: PeerStreamId, reason: RstReason, class: Class },
}

/// The protocol state of one channel.
pub(super) struct ChannelState {
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
    pub(super) deferred: Option<DeferredRx>,
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
    pub fn add_channel(&mut self, index: ChannelIndex, class: Class) {
        let Some(slot) = self.channels.get_mut(index.slot()) else { return };
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

    pub fn has_channel(&self, index: ChannelIndex) -> bool {
        self.channels.get(index.slot()).is_some_and(Option::is_some)
    }

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

    /// A channel failed. What it carried unacknowledged is queued again on the channels that
    /// remain; a payload deferred in it is forgotten (the peer sends it again). When it was the
    /// last channel, every stream is reset.
    pub fn channel_lost(&mut self, index: ChannelIndex) {
        let Some(state) = self.channels.get_mut(index.slot()).and_then(Option::take) else {
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

    pub(super) fn channel_mut(&mut self, ch: ChannelIndex) -> Option<&mut ChannelState> {
        self.channels.get_mut(ch.slot()).and_then(Option::as_mut)
    }

    pub(super) fn on_ack(
        &mut self,
        channel: ChannelIndex,
        position: u64,
        _now: Instant,
    ) -> Result<(), Violation> {
        let Some(st) = self.channels.get_mut(channel.slot()).and_then(Option::as_mut) else {
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
    #[cfg(test)]
    pub fn channel_retained(&self, ch: ChannelIndex) -> u64 {
        self.channels.get(ch.slot()).and_then(Option::as_ref).map_or(0, |st| st.retained_bytes)
    }

    /// Bytes sent on channels and not yet acknowledged.
    pub fn retained_bytes(&self) -> u64 {
        self.channels.iter().flatten().map(|st| st.retained_bytes).sum()
    }

    /// Records a pulled frame in the channel's retention; returns its length.
    pub(super) fn retain(&mut self, ch: ChannelIndex, len: usize, what: Retained) -> usize {
        let st = self.channel_mut(ch).expect("pulling for a live channel");
        st.tx_pos += len as u64;
        if let Retained::Data { bytes, .. } = &what {
            st.retained_bytes += bytes.len() as u64;
        }
        let end = st.tx_pos;
        st.retained.push_back((end, what));
        len
    }
}
