//! Peer input: the one entry point for what a channel read ([`Session::receive`]), frame by
//! frame, with every field checked against the session's state.

use std::time::{Duration, Instant};

use bytes::Bytes;

use super::super::framing::{Buffers, FrameReader, Parsed, Verdict};
use super::super::recvbuf::{TooManySegments, COMPACT_BELOW};
use super::super::table::Lookup;
use super::*;
use crate::wire::frame::DATA_HEADER_LEN;
use crate::wire::RstReason;

/// Bytes read on a session's channels that close a compaction window, unless twice the bytes
/// held is more (see `compact_if_due`).
const COMPACT_WINDOW: u64 = 4 << 20;
/// In-order segments of one stream before its small ones are merged.
const SEGMENTS_BEFORE_COMPACT: usize = 64;
/// Bookkeeping of out-of-order segments (`OOO_SEG_COST` each) a session may hold beyond the
/// bytes it granted; past it the peer is abusive (honest peers reorder little: what is in flight
/// on other channels).
const OUT_OF_ORDER_ALLOWANCE: u64 = 8 << 20;

impl<U: Default> Session<U> {
    /// Puts received bytes in stream `id`'s buffer, keeping the count of bytes held and the
    /// list of streams holding slices of read buffers.
    pub(super) fn rx_insert(
        &mut self,
        id: StreamId,
        offset: u64,
        data: Bytes,
    ) -> Result<u64, TooManySegments> {
        let max = self.cfg.max_out_of_order;
        let small = data.len() < COMPACT_BELOW;
        let Some(s) = self.streams.get_mut(id) else { return Ok(0) };
        let before = s.rx.held_bytes();
        let r = s.rx.insert_data(offset, data, max);
        let after = s.rx.held_bytes();
        self.rx_held = self.rx_held + after - before;
        // Received bytes never exceed what was granted; what is held beyond is bookkeeping.
        if self.rx_held > self.rx_granted + OUT_OF_ORDER_ALLOWANCE {
            return Err(TooManySegments);
        }
        if small && after > before {
            if s.rx.ready_segments() > SEGMENTS_BEFORE_COMPACT {
                self.stats.compacted_bytes += s.rx.compact();
            } else if s.flags & F_PINNED == 0 {
                s.flags |= F_PINNED;
                self.pinned.push(id);
            }
        }
        self.compact_if_due();
        r
    }

    /// Closes a compaction window once the channels read more than `COMPACT_WINDOW` bytes, or
    /// twice the bytes held, since the last one closed. Streams that took small slices in the
    /// window before and still hold them are compacted then: their reader lags by more than a
    /// window, so the slices may pin read buffers that are otherwise spent. A slice held
    /// unread therefore pins buffers filled within the last two windows at most, so the memory
    /// pinned stays within `2 * max(COMPACT_WINDOW, 2 * rx_held)` (and the buffer each channel
    /// is filling), whatever slices a peer sends. Readers that keep up within a window cost no
    /// copy, however many streams they read, and nor do honest slices held unread for long:
    /// they fill the buffers densely, held bytes grow with what was read, and windows stretch.
    pub(super) fn compact_if_due(&mut self) {
        let read = self.rx_read - self.compacted_at;
        if read > COMPACT_WINDOW.max(2 * self.rx_held)
            && !(self.pinned.is_empty() && self.pinned_before.is_empty())
        {
            self.compact();
        }
    }

    /// Copies the small slices held by the streams listed in the window before into buffers
    /// of their own, and starts a new window.
    pub(super) fn compact(&mut self) {
        self.compacted_at = self.rx_read;
        for id in std::mem::take(&mut self.pinned_before) {
            if let Some(s) = self.streams.get_mut(id) {
                self.stats.compacted_bytes += s.rx.compact();
            }
        }
        for &id in &self.pinned {
            if let Some(s) = self.streams.get_mut(id) {
                s.flags &= !F_PINNED;
            }
        }
        self.pinned_before = std::mem::take(&mut self.pinned);
    }

    /// Resolves a peer-supplied stream id: `Ok(None)` for a stream closed here (stale),
    /// `Err` for an id never issued.
    pub(super) fn resolve(&mut self, id: u64) -> Result<Option<StreamId>, Violation> {
        match self.streams.lookup(id) {
            Lookup::Live => Ok(Some(StreamId(id))),
            Lookup::Stale => {
                self.stats.stale_frames += 1;
                Ok(None)
            }
            Lookup::Unknown => Err(Violation::UnknownStream),
        }
    }

    /// A peer frame broke the rules of stream `id`: the stream is reset (the channel it came
    /// on is closed by the caller).
    pub(super) fn violated(&mut self, id: StreamId, v: Violation) -> Violation {
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
        ch: ChannelId,
        item: Parsed,
        now: Instant,
        may_defer: impl FnOnce(&Self, StreamId) -> bool,
    ) -> Result<Option<Verdict>, Violation> {
        match item {
            Parsed::Control(f) => self.on_frame(ch, f, None, now).map(|()| None),
            Parsed::Data { stream, offset, payload } => {
                let f = Frame::Data { stream, offset, payload: &[] };
                let r = self.on_frame(ch, f, Some(payload), now).map(|()| None);
                self.settle_rst_after_data(stream);
                r
            }
            Parsed::Header { stream, offset, len, prefix } => {
                // Not while the peer's RST waits for the stream's bytes: it waits for them
                // in user space.
                let defer = match self.streams.lookup(stream) {
                    Lookup::Live => {
                        (self.pending_rsts.is_empty()
                            || !self.pending_rsts.contains_key(&StreamId(stream)))
                            && may_defer(self, StreamId(stream))
                    }
                    _ => false,
                };
                let r = self.data_header(ch, stream, offset, len, prefix, defer, now).map(Some);
                self.settle_rst_after_data(stream);
                r
            }
            Parsed::Piece { stream, offset, data } => {
                // The stream its header named: if it was closed since, the lookup misses.
                self.data_piece(ch, StreamId(stream), offset, data);
                self.settle_rst_after_data(stream);
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

    /// After bytes of stream `stream` (the receiver's id on the wire) came: a pending RST of
    /// the peer may take effect now.
    fn settle_rst_after_data(&mut self, stream: u64) {
        if !self.pending_rsts.is_empty() && self.streams.lookup(stream) == Lookup::Live {
            self.settle_rst(StreamId(stream));
        }
    }

    /// Whether channel `ch`'s reader may read now. While a payload is deferred in the socket
    /// for its stream's reader, the channel waits (false) for at most `grace`; then, or when
    /// the stream no longer wants it, the reader takes the rest over itself (staged, or
    /// dropped) and goes on.
    pub fn reader_may_read<B: Buffers>(
        &mut self,
        ch: ChannelId,
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
    pub fn take_over_reader<B: Buffers>(&mut self, ch: ChannelId, reader: &mut FrameReader<B>) {
        if let Some(d) = self.take_over_deferred(ch) {
            reader.take_over_deferred(d.remaining, true);
        }
    }

    /// A whole frame (DATA with its `payload`).
    pub(super) fn on_frame(
        &mut self,
        ch: ChannelId,
        frame: Frame<'_>,
        payload: Option<Bytes>,
        now: Instant,
    ) -> Result<(), Violation> {
        let wire_len = match &payload {
            Some(p) => DATA_HEADER_LEN + p.len(),
            None => frame.wire_len(),
        } as u64;
        self.rx_read += wire_len;
        self.observe(now);
        let is_ack = matches!(frame, Frame::Ack { .. });
        match self.channel_mut(ch) {
            // An ACK is not retained by its sender: it needs no acknowledgement of its own (an
            // ACK for an ACK would ping-pong forever).
            Some(st) if is_ack && st.rx_acked == st.rx_pos => {
                st.rx_pos += wire_len;
                st.rx_acked = st.rx_pos;
            }
            Some(st) => {
                st.received(wire_len, now);
                st.ack_now |= matches!(frame, Frame::Fin { .. } | Frame::Rst { .. });
            }
            None => return Ok(()),
        }
        match frame {
            Frame::Data { stream, offset, .. } => {
                self.on_data(ch, stream, offset, payload.expect("DATA comes with its payload"))
            }
            Frame::Syn { src, port, class, window } => {
                self.on_syn(ch, PeerStreamId(src), port, class, window);
                Ok(())
            }
            Frame::SynAck { dst, src, window, kernel_preferred } => {
                let Some(id) = self.resolve(dst)? else {
                    // The connector gave up (timed out): tell the acceptor.
                    let peer = PeerStreamId(src);
                    let rst = OwedRst { peer, reason: RstReason::Aborted, final_offset: 0 };
                    self.queue_rst(Class::Throughput, rst);
                    return Ok(());
                };
                let s = self.streams.get_mut(id).expect("live");
                if s.phase == Phase::Connecting && s.reset.is_some() {
                    // Given up here (timed out, or aborted) while the handle stays: the
                    // acceptor's stream is refused as if it were gone.
                    let peer = PeerStreamId(src);
                    let rst = OwedRst { peer, reason: RstReason::Aborted, final_offset: 0 };
                    let class = s.class;
                    self.queue_rst(class, rst);
                    return Ok(());
                }
                match s.phase {
                    Phase::Connecting => {
                        s.phase = Phase::Open;
                        s.peer = PeerStreamId(src);
                        s.send_limit = s.send_limit.max(window as u64);
                        if kernel_preferred {
                            s.flags |= F_PEER_PREFERS_KERNEL;
                        }
                        s.frames_received += 1;
                        self.set_deadline(id, None);
                        if self.credit_due(id) {
                            self.owe(id, OWE_CREDIT);
                        }
                        self.emit(id, EV_READ | EV_WRITE);
                        Ok(())
                    }
                    // Sent again after a channel loss.
                    Phase::Open if s.peer == PeerStreamId(src) => Ok(()),
                    _ => Err(self.violated(id, Violation::UnexpectedFrame("SYN_ACK"))),
                }
            }
            Frame::Rst { dst, reason, final_offset } => {
                let Some(id) = self.resolve(dst)? else { return Ok(()) };
                self.on_rst(id, reason, final_offset)
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
                // Nothing will come beyond the final offset: the rest of the grant is free.
                self.recharge(id);
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
            Frame::Ack { channel, incarnation, position } => {
                self.on_ack(ChannelId::new(channel, incarnation), position, now)
            }
            Frame::Urgent { dst, offset, byte } => {
                let Some(id) = self.resolve(dst)? else { return Ok(()) };
                let s = self.streams.get_mut(id).expect("live");
                s.frames_received += 1;
                if s.reset.is_some() {
                    return Ok(());
                }
                // The byte's range is held to the window and the FIN as DATA's is.
                if let Err(v) = s.check_data(offset, 1) {
                    return Err(self.violated(id, v));
                }
                let pos = s.rx.consumed();
                if self.urgent.entry(id).or_default().on_peer_mark(offset, byte, pos) {
                    // Readers and pollers look again (`POLLPRI`, reads stop at the mark).
                    self.emit(id, EV_READ | EV_URGENT);
                }
                Ok(())
            }
        }
    }

    /// The stream the peer's stream `src` opened here, if it still exists.
    pub(super) fn opened_from(&self, src: PeerStreamId) -> Option<StreamId> {
        let id = *self.opened_by_peer.get(&src)?;
        self.streams.get(id).filter(|s| s.peer == src && s.phase != Phase::Connecting)?;
        Some(id)
    }

    pub(super) fn on_syn(
        &mut self,
        ch: ChannelId,
        src: PeerStreamId,
        port: u16,
        class: Class,
        window: u32,
    ) {
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
            s.follow(ch);
            s
        }) else {
            return self.queue_rst(
                class,
                OwedRst { peer: src, reason: RstReason::Refused, final_offset: 0 },
            );
        };
        // One entry per stream held here, whatever ids the peer chooses.
        self.opened_by_peer.insert(src, id);
        self.incoming.push_back(id);
    }

    pub(super) fn on_data(
        &mut self,
        ch: ChannelId,
        stream: u64,
        offset: u64,
        payload: Bytes,
    ) -> Result<(), Violation> {
        let Some(id) = self.resolve(stream)? else { return Ok(()) };
        let len = payload.len() as u64;
        let s = self.streams.get_mut(id).expect("live");
        s.frames_received += 1;
        s.follow(ch);
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
    pub(super) fn data_header(
        &mut self,
        ch: ChannelId,
        stream: u64,
        offset: u64,
        len: u64,
        prefix: Bytes,
        may_defer: bool,
        now: Instant,
    ) -> Result<Verdict, Violation> {
        let got = DATA_HEADER_LEN as u64 + prefix.len() as u64;
        self.rx_read += got;
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
        s.follow(ch);
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
    pub(super) fn data_piece(&mut self, ch: ChannelId, stream: StreamId, offset: u64, data: Bytes) {
        let now = self.clock();
        self.rx_read += data.len() as u64;
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
    pub(super) fn discard(&mut self, ch: ChannelId, n: u64) {
        let now = self.clock();
        self.rx_read += n;
        if let Some(st) = self.channel_mut(ch) {
            st.received(n, now);
        }
    }
}

impl<U> Stream<U> {
    /// The peer's DATA (or SYN) came on `ch` (a stream the peer opened answers there:
    /// `Session::home`).
    fn follow(&mut self, ch: ChannelId) {
        self.rx_channel = ch.index as u8 + 1;
    }

    /// The index of the channel the peer's last DATA (or SYN) came on, if any came.
    pub(super) fn rx_index(&self) -> Option<u16> {
        (self.rx_channel as u16).checked_sub(1)
    }

    fn new_incoming(
        port: u16,
        class: Class,
        window: u32,
        peer: PeerStreamId,
        peer_window: u32,
    ) -> Self
    where
        U: Default,
    {
        let mut s = Stream::new(U::default(), port, class, Phase::Incoming, window);
        s.peer = peer;
        s.send_limit = peer_window as u64;
        s
    }
}
