//! Events, deadlines, and the end of streams: resets, and freeing a stream once nothing it
//! depends on is in flight.

use std::cmp::Reverse;
use std::time::Instant;

use super::*;
use crate::wire::RstReason;

fn rst_reason(cause: ResetCause) -> RstReason {
    match cause {
        ResetCause::ConnectTimeout | ResetCause::Undeliverable => RstReason::TimedOut,
        _ => RstReason::Aborted,
    }
}

impl<U: Default> Session<U> {
    pub(super) fn emit(&mut self, id: StreamId, bits: u8) {
        let Some(s) = self.streams.get_mut(id) else { return };
        s.events |= bits;
        if s.flags & F_EVENT == 0 {
            s.flags |= F_EVENT;
            self.events.push_back(id);
        }
    }

    /// The next stream whose readiness may have changed, with `EV_*` bits.
    pub fn poll_event(&mut self) -> Option<(StreamId, u8)> {
        while let Some(id) = self.events.pop_front() {
            if let Some(s) = self.streams.get_mut(id) {
                s.flags &= !F_EVENT;
                return Some((id, std::mem::take(&mut s.events)));
            }
        }
        None
    }

    /// The next stream the peer opened, waiting for `accept_incoming` or `refuse_incoming`.
    pub fn poll_incoming(&mut self) -> Option<(StreamId, u16)> {
        while let Some(id) = self.incoming.pop_front() {
            if let Some(s) = self.streams.get(id) {
                if s.phase == Phase::Incoming {
                    return Some((id, s.port));
                }
            }
        }
        None
    }

    pub(super) fn set_deadline(&mut self, id: StreamId, deadline: Option<Instant>) {
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
            if s.flags & F_RST_PENDING != 0 && !s.app_closed {
                self.apply_pending_rst(id);
            } else if s.phase == Phase::Connecting {
                self.reset_stream(id, ResetCause::ConnectTimeout, false);
            } else if s.app_closed {
                let undelivered = !s.tx.is_empty() || s.unacked_frames > 0 || s.owe != 0;
                let cause =
                    if undelivered { ResetCause::Undeliverable } else { ResetCause::LocalAbort };
                self.reset_stream(id, cause, true);
            }
        }
    }

    pub(super) fn reset_stream(&mut self, id: StreamId, cause: ResetCause, tell_peer: bool) {
        self.heard_from_woken(id);
        let Some(s) = self.streams.get_mut(id) else { return };
        if s.reset.is_some() {
            return;
        }
        s.reset = Some(cause);
        // What the peer will have had before the RST: bytes past it (unsent, or to be sent
        // again after a channel loss) are dropped below.
        let reserved = self.reserved.iter().filter(|r| r.0 == id).map(|r| r.1).min();
        let final_offset = s.tx.sent_end(s.send_next).min(reserved.unwrap_or(u64::MAX));
        if s.flags & F_RST_PENDING != 0 {
            s.flags &= !F_RST_PENDING;
            self.pending_rsts.remove(&id);
        }
        let s = self.streams.get_mut(id).expect("live");
        let dropped = s.tx.clear();
        self.rx_held -= s.rx.held_bytes();
        // As TCP's reset: what arrived in order before it is still read, then the error (the
        // kernel keeps its receive queue). For the peer's reset, or the loss of the session,
        // of a stream still open here; a local abort has nobody to read.
        if matches!(cause, ResetCause::Peer(_) | ResetCause::ChannelLost) && !s.app_closed {
            s.rx.keep_front();
        } else {
            s.rx.clear();
        }
        self.rx_held += s.rx.held_bytes();
        s.owe = 0;
        let (class, peer, phase, closed) = (s.class, s.peer, s.phase, s.app_closed);
        self.compact_if_due();
        self.classes[class.index()].unsent -= dropped;
        self.recharge(id);
        self.feed_starved();
        if tell_peer && phase != Phase::Connecting {
            self.queue_rst(class, OwedRst { peer, reason: rst_reason(cause), final_offset });
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
    pub(super) fn keep_for_reading(&mut self, id: StreamId) {
        self.heard_from_woken(id);
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
    pub(super) fn maybe_free(&mut self, id: StreamId) {
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

    /// The peer reset stream `id` after sending the bytes below `final_offset`: the reset
    /// takes effect once those are in user space (the application reads them first, as from a
    /// TCP socket whose RST came after its data), at once if they are, or nobody reads.
    pub(super) fn on_rst(
        &mut self,
        id: StreamId,
        reason: RstReason,
        final_offset: u64,
    ) -> Result<(), Violation> {
        let s = self.streams.get_mut(id).expect("live");
        if s.reset.is_some() {
            return Ok(());
        }
        if final_offset > s.granted {
            return Err(self.violated(id, Violation::BeyondCredit));
        }
        s.flags |= F_RST_PENDING;
        self.pending_rsts.insert(id, (final_offset, reason));
        self.settle_rst(id);
        if self.streams.get(id).is_some_and(|s| s.flags & F_RST_PENDING != 0) {
            // The bytes come within a round trip, or were on a channel lost before the RST
            // came (the peer does not send a reset stream's bytes again): waited for only so
            // long.
            let deadline = self.clock() + RST_WAIT;
            self.set_deadline(id, Some(deadline));
        }
        Ok(())
    }

    /// Applies the peer's pending RST of stream `id` if what came before it is all in user
    /// space (or nobody will read it).
    pub(super) fn settle_rst(&mut self, id: StreamId) {
        let Some(s) = self.streams.get(id) else { return };
        if s.flags & F_RST_PENDING == 0 {
            return;
        }
        let Some(&(final_offset, reason)) = self.pending_rsts.get(&id) else { return };
        let arrived = s.rx.contiguous_end() >= final_offset && !s.rx.has_deferred();
        if arrived || s.app_closed || s.phase != Phase::Open {
            self.reset_stream(id, ResetCause::Peer(reason), false);
        }
    }

    /// Applies every pending RST now (a channel was lost: what they wait for may never come).
    pub(super) fn apply_pending_rsts(&mut self) {
        let pending: Vec<StreamId> = self.pending_rsts.keys().copied().collect();
        for id in pending {
            self.apply_pending_rst(id);
        }
    }

    fn apply_pending_rst(&mut self, id: StreamId) {
        if let Some(&(_, reason)) = self.pending_rsts.get(&id) {
            self.reset_stream(id, ResetCause::Peer(reason), false);
        }
    }

    pub(super) fn free(&mut self, id: StreamId) {
        self.heard_from_woken(id);
        if let Some(s) = self.streams.remove(id) {
            if !self.reserved.is_empty() {
                self.reserved.retain(|r| r.0 != id);
            }
            if s.flags & F_RST_PENDING != 0 {
                self.pending_rsts.remove(&id);
            }
            if !self.urgent.is_empty() {
                self.urgent.remove(&id);
            }
            self.rx_held -= s.rx.held_bytes();
            self.rx_granted -= s.rx_charge;
            self.rx_competing -= usize::from(s.flags & F_COMPETING != 0);
            self.compact_if_due();
            if s.phase != Phase::Connecting && self.opened_by_peer.get(&s.peer) == Some(&id) {
                self.opened_by_peer.remove(&s.peer);
            }
            let n = s.tx.bytes();
            self.classes[s.class.index()].unsent -= n;
            self.feed_starved();
        }
    }
}
