//! Application calls on streams: open, accept, send, receive, shut down, close.

use std::time::Instant;

use bytes::Bytes;

use super::*;
use crate::wire::RstReason;

impl<U: Default> Session<U> {
    /// Opens a stream to `port` at the peer: queues its SYN. `Writable` fires once the peer
    /// answered (or refused: the stream is then reset).
    #[cfg(test)]
    pub fn open(
        &mut self,
        port: u16,
        class: Class,
        user: U,
        now: Instant,
    ) -> Result<StreamId, OpenError> {
        self.open_from(port, class, user, now, None)
    }

    /// `open` by application thread `thread` (see `set_thread`): the SYN already leaves on
    /// that thread's channel, so the peer answers there.
    pub fn open_from(
        &mut self,
        port: u16,
        class: Class,
        user: U,
        now: Instant,
        thread: Option<u16>,
    ) -> Result<StreamId, OpenError> {
        self.observe(now);
        if self.dead || self.channel_count() == 0 {
            return Err(OpenError::NoChannels);
        }
        let window = self.cfg.window;
        let turn = thread.map(|t| (t, self.thread_turn(t, None)));
        let id = self
            .streams
            .insert_with(|_| {
                let mut s = Stream::new(user, port, class, Phase::Connecting, window);
                s.flags |= F_LOCAL;
                if let Some((number, turn)) = turn {
                    s.thread_number = number;
                    s.thread = turn.wrapping_add(1);
                }
                s
            })
            .ok_or(OpenError::Limit)?;
        // The SYN grants the peer what the receive budget has room for.
        self.grant(id);
        let deadline = now + self.cfg.connect_timeout;
        self.set_deadline(id, Some(deadline));
        self.owe(id, OWE_SYN);
        Ok(id)
    }

    /// The listener took the incoming stream: answer SYN_ACK granting `window`.
    pub(super) fn accept_incoming(&mut self, id: StreamId, window: u32) {
        let Some(s) = self.streams.get_mut(id) else { return };
        if s.phase != Phase::Incoming || s.reset.is_some() {
            return;
        }
        s.phase = Phase::Open;
        s.window = window;
        self.grant(id);
        self.owe(id, OWE_SYN_ACK);
        self.emit(id, EV_WRITE);
    }

    /// Grows the window of a stream (e.g. when the application accepts it).
    pub(super) fn set_window(&mut self, id: StreamId, window: u32) {
        let Some(s) = self.streams.get_mut(id) else { return };
        s.window = window;
        if s.phase == Phase::Open && self.credit_due(id) {
            self.owe(id, OWE_CREDIT);
        }
    }

    /// The listener refused the incoming stream (no listener, backlog full).
    pub(super) fn refuse_incoming(&mut self, id: StreamId, reason: RstReason) {
        let Some(s) = self.streams.get(id) else { return };
        if s.phase != Phase::Incoming {
            return;
        }
        let (peer, class) = (s.peer, s.class);
        self.free(id);
        self.queue_rst(class, OwedRst { peer, reason, final_offset: 0 });
    }

    /// Room for unsent bytes of `class`, or `NoSpace` (registering `id` to be woken).
    pub(super) fn space(&mut self, id: StreamId, class: Class) -> Result<u64, SendError> {
        let limit = self.class_limit(class);
        let room = self.room(class);
        let c = &mut self.classes[class.index()];
        if room > 0 {
            return Ok(room);
        }
        // Out of class space (not of the session's send budget): the cue to add a channel.
        c.congested |= c.unsent >= limit;
        self.wait_for_space(id, class);
        Err(SendError::NoSpace)
    }

    /// Registers `id` to hear (`EV_WRITE`) when space of `class` frees. Whoever finds a stream
    /// without space registers it: a failed send, and also a readiness query (a blocking
    /// sender or an event loop that wrote part and now waits for "writable" may never see a
    /// send fail).
    pub(super) fn wait_for_space(&mut self, id: StreamId, class: Class) {
        self.heard_from_woken(id);
        let Some(s) = self.streams.get_mut(id) else { return };
        if s.flags & F_SPACE_WAIT == 0 {
            s.flags |= F_SPACE_WAIT;
            self.classes[class.index()].space_waiters.push_back(id);
        }
    }

    pub(super) fn send_checks(
        &mut self,
        id: StreamId,
        max: usize,
    ) -> Result<(u64, usize), SendError> {
        self.heard_from_woken(id);
        let s = self.streams.get(id).ok_or(SendError::Closed)?;
        let credit = s.send_capacity()?;
        let class = s.class;
        let room = self.space(id, class)?;
        let n = (max as u64).min(credit).min(room) as usize;
        Ok((self.streams.get(id).expect("checked").send_next, n))
    }

    /// Copies what credit and class space allow of `data` into the stream's send buffer.
    pub(super) fn send(&mut self, id: StreamId, data: &[u8]) -> Result<usize, SendError> {
        let (offset, n) = self.send_checks(id, data.len())?;
        let s = self.streams.get_mut(id).expect("checked");
        s.send_next += n as u64;
        s.tx.push_copy(offset, &data[..n], &mut self.spares);
        let class = s.class;
        self.classes[class.index()].unsent += n as u64;
        self.activate(id);
        Ok(n)
    }

    /// Takes up to `max` bytes of credit and space for a large write the caller copies
    /// outside the session lock; hand the bytes over with `commit`.
    pub(super) fn reserve(&mut self, id: StreamId, max: usize) -> Result<(u64, usize), SendError> {
        let (offset, n) = self.send_checks(id, max)?;
        self.streams.get_mut(id).expect("checked").send_next += n as u64;
        if n > 0 {
            self.reserved.push((id, offset));
        }
        Ok((offset, n))
    }

    pub(super) fn commit(&mut self, id: StreamId, offset: u64, chunk: Bytes) {
        if let Some(i) = self.reserved.iter().position(|&r| r == (id, offset)) {
            self.reserved.swap_remove(i);
        }
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
    pub(super) fn recv(&mut self, id: StreamId, max: u64, out: &mut Vec<Bytes>) -> Recv {
        let mut max = max;
        if !self.urgent.is_empty() {
            match self.urgent_read(id, max) {
                Ok(m) => max = m,
                Err(r) => return r,
            }
        }
        let Some(s) = self.streams.get_mut(id) else { return Recv::Closed };
        let reset = s.reset;
        // After the peer's reset too: the bytes kept from before it come first.
        let n = s.rx.take(max, out);
        if n > 0 {
            self.rx_held -= n;
            if reset.is_some() {
                // No credit for a reset stream; their room in the budget goes to the others.
                self.recharge(id);
                self.feed_starved();
            } else {
                self.after_consume(id);
            }
            // Fewer bytes held: slices still pinned may now outweigh them.
            self.compact_if_due();
            return Recv::Data(n);
        }
        if let Some(cause) = reset {
            return Recv::Reset(cause);
        }
        let (front, eof) = (s.rx.front_deferred(), s.at_eof());
        if let Some((channel, len)) = front {
            // Exactly when `readable` says so (a staged payload arrives with an event).
            if self.deferred_ready(id, channel) {
                return Recv::Deferred { channel, max: len.min(max) };
            }
            return Recv::Empty;
        }
        if eof || s.read_closed() {
            return Recv::Eof;
        }
        Recv::Empty
    }

    /// Before a read of at most `max` bytes of a stream that has urgent data: drops the urgent
    /// bytes kept out of the stream at the read position, and returns how many bytes the read
    /// may take (it stops before the next mark). `Err`: what the read returns instead (an
    /// urgent byte still in its channel's socket is dropped by the caller: `DropDeferred`).
    #[cold]
    #[inline(never)]
    fn urgent_read(&mut self, id: StreamId, max: u64) -> Result<u64, Recv> {
        loop {
            let Some(s) = self.streams.get_mut(id) else { return Err(Recv::Closed) };
            let pos = s.rx.consumed();
            let Some(u) = self.urgent.get(&id) else { return Ok(max) };
            let (skip, max) = u.read_limit(pos, max);
            if !skip {
                return Ok(max);
            }
            if let Some((channel, _)) = s.rx.front_deferred() {
                // Still in its channel's socket: the caller reads it from there and drops it.
                return Err(if self.deferred_ready(id, channel) {
                    Recv::DropDeferred { channel }
                } else {
                    Recv::Empty
                });
            }
            if s.rx.ready_front() == 0 {
                // Not arrived: the read waits for it like any other byte.
                return Err(match s.reset {
                    Some(cause) => Recv::Reset(cause),
                    None if s.at_eof() || s.read_closed() => Recv::Eof,
                    None => Recv::Empty,
                });
            }
            let reset = s.reset.is_some();
            let n = s.rx.take(1, &mut Vec::new());
            debug_assert_eq!(n, 1);
            self.rx_held -= n;
            if reset {
                self.recharge(id);
                self.feed_starved();
            } else {
                self.after_consume(id);
            }
        }
    }

    /// Copies ready bytes without consuming them (MSG_PEEK).
    pub(super) fn peek(&self, id: StreamId, buf: &mut [u8]) -> Recv {
        let Some(s) = self.streams.get(id) else { return Recv::Closed };
        if let Some(u) = self.urgent_of(id) {
            return Self::peek_urgent(s, u, buf);
        }
        if let Some(cause) = s.reset {
            return match s.rx.peek(buf) {
                0 => Recv::Reset(cause),
                n => Recv::Data(n as u64),
            };
        }
        match s.rx.peek(buf) {
            0 if s.at_eof() => Recv::Eof,
            0 => Recv::Empty,
            n => Recv::Data(n as u64),
        }
    }

    /// A peek of a stream with urgent data: stops before the next mark, and steps over the
    /// urgent byte at the read position when it is kept out of the stream (as TCP's peek).
    fn peek_urgent(s: &Stream<U>, u: &Urgent, buf: &mut [u8]) -> Recv {
        let (skip, max) = u.read_limit(s.rx.consumed(), buf.len() as u64);
        let max = max as usize;
        let n = if skip {
            let mut ahead = vec![0u8; max + 1];
            let got = s.rx.peek(&mut ahead);
            let n = got.saturating_sub(1);
            buf[..n].copy_from_slice(&ahead[1..got.max(1)]);
            n
        } else {
            s.rx.peek(&mut buf[..max])
        };
        match (n, s.reset) {
            (0, Some(cause)) => Recv::Reset(cause),
            (0, None) if s.at_eof() => Recv::Eof,
            (0, None) => Recv::Empty,
            (n, _) => Recv::Data(n as u64),
        }
    }

    /// The application sent its last byte as urgent (`MSG_OOB`): an URGENT tells the peer.
    pub(super) fn mark_urgent(&mut self, id: StreamId, byte: u8) {
        let Some(s) = self.streams.get(id) else { return };
        if s.reset.is_some() || s.send_next == 0 {
            return;
        }
        let offset = s.send_next - 1;
        self.urgent.entry(id).or_default().tx = Some((offset, byte));
        self.owe(id, OWE_URGENT);
    }

    /// The peer's urgent byte, read out of band (`MSG_OOB`): `None` when there is none to
    /// read (inline, none, already taken, or read past).
    pub(super) fn take_urgent(&mut self, id: StreamId, peek: bool) -> Option<u8> {
        let pos = self.streams.get(id)?.rx.consumed();
        self.urgent.get_mut(&id)?.take(pos, peek)
    }

    /// Keeps the peer's urgent bytes in the stream (`SO_OOBINLINE`) or out of it.
    pub(super) fn set_oob_inline(&mut self, id: StreamId, on: bool) {
        if self.streams.get(id).is_none() {
            return;
        }
        if on || self.urgent.contains_key(&id) {
            self.urgent.entry(id).or_default().inline = on;
        }
    }

    /// The application consumed bytes of `id`: its budget share shrinks, and it, or streams
    /// waiting for room, may owe a CREDIT.
    pub(super) fn after_consume(&mut self, id: StreamId) {
        self.recharge(id);
        if self.credit_due(id) {
            self.owe(id, OWE_CREDIT);
        }
        self.feed_starved();
    }

    /// Closes the write half: the peer reads end of stream after the last byte sent.
    pub(super) fn shutdown_write(&mut self, id: StreamId) -> Result<(), SendError> {
        self.heard_from_woken(id);
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

    /// Shuts the read half down (`SHUT_RD`): what is buffered can still be read, then reads
    /// end at once instead of waiting (as on a Linux TCP socket; later bytes are still taken).
    pub(super) fn shutdown_read(&mut self, id: StreamId) {
        let Some(s) = self.streams.get_mut(id) else { return };
        if s.flags & F_READ_SHUT == 0 {
            s.flags |= F_READ_SHUT;
            self.emit(id, EV_READ);
        }
    }

    /// The application closed its handle. Unread received bytes reset the peer, as TCP does;
    /// otherwise the write half is finished and the stream lingers until its last bytes are
    /// delivered and the peer finished too (bounded by `linger`).
    pub(super) fn close(&mut self, id: StreamId, now: Instant) {
        self.observe(now);
        self.heard_from_woken(id);
        let Some(s) = self.streams.get_mut(id) else { return };
        if s.app_closed {
            return;
        }
        s.app_closed = true;
        if s.flags & F_RST_PENDING != 0 {
            // The peer reset it: nobody waits for the bytes before the RST any more.
            return self.settle_rst(id);
        }
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
    pub(super) fn set_class(&mut self, id: StreamId, class: Class) {
        let Some(s) = self.streams.get_mut(id) else { return };
        if s.class == class {
            return;
        }
        let n = s.tx.bytes();
        let old = s.class;
        s.class = class;
        let woken = u64::from(s.flags & F_SPACE_WOKEN != 0);
        self.classes[old.index()].unsent -= n;
        self.classes[class.index()].unsent += n;
        let was = &mut self.classes[old.index()].woken;
        *was = was.saturating_sub(woken);
        self.classes[class.index()].woken += woken;
        // Queued entries under the old class are re-filed when popped.
    }

    /// Resets a stream locally (e.g. its application asked to abort), telling the peer.
    pub(super) fn abort(&mut self, id: StreamId, cause: ResetCause) {
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
                && self.open_channels().all(|c| c.retained.is_empty() && c.control.is_empty()))
    }

    /// Resets every stream (engine shutdown).
    pub fn reset_all(&mut self, cause: ResetCause) {
        for id in self.streams.ids() {
            self.reset_stream(id, cause, false);
        }
    }
}

/// The application's calls on one stream ([`Session::handle`]). A stream that is gone answers
/// `Recv::Closed` or `SendError::Closed`, and its state queries say so.
pub struct StreamHandle<'a, U> {
    session: &'a mut Session<U>,
    id: StreamId,
}

impl<U: Default> Session<U> {
    /// The application's calls on stream `id`.
    pub fn handle(&mut self, id: StreamId) -> StreamHandle<'_, U> {
        StreamHandle { session: self, id }
    }
}

impl<U: Default> StreamHandle<'_, U> {
    /// Its state, if it exists.
    pub fn state(&self) -> Option<&Stream<U>> {
        self.session.stream(self.id)
    }

    /// The listener took the incoming stream: answer SYN_ACK granting `window`.
    pub fn accept(&mut self, window: u32) {
        self.session.accept_incoming(self.id, window)
    }

    /// Its SYN_ACK (not sent yet) asks the opener to make its further connections to this
    /// port over kernel TCP (`FLAG_KERNEL_PREFERRED`).
    pub fn prefer_kernel(&mut self) {
        if let Some(s) = self.session.streams.get_mut(self.id) {
            s.flags |= F_KERNEL_PREFERRED;
        }
    }

    /// Whether the peer's SYN_ACK asked for kernel TCP (`FLAG_KERNEL_PREFERRED`).
    pub fn peer_prefers_kernel(&self) -> bool {
        self.state().is_some_and(|s| s.flags & F_PEER_PREFERS_KERNEL != 0)
    }

    /// The listener refused the incoming stream (no listener, backlog full).
    pub fn refuse(&mut self, reason: RstReason) {
        self.session.refuse_incoming(self.id, reason)
    }

    /// Grows the window granted to the peer (the application accepted the stream).
    pub fn set_window(&mut self, window: u32) {
        self.session.set_window(self.id, window)
    }

    /// Copies what credit and class space allow of `data` into the send buffer.
    pub fn send(&mut self, data: &[u8]) -> Result<usize, SendError> {
        self.session.send(self.id, data)
    }

    /// Takes up to `max` bytes of credit and space for a large write copied outside the lock;
    /// returns the stream offset and the bytes taken. Hand the bytes over with `commit`.
    pub fn reserve(&mut self, max: usize) -> Result<(u64, usize), SendError> {
        self.session.reserve(self.id, max)
    }

    /// Bytes reserved with `reserve`, starting at stream `offset`.
    pub fn commit(&mut self, offset: u64, chunk: Bytes) {
        self.session.commit(self.id, offset, chunk)
    }

    /// Moves up to `max` readable bytes into `out` (slices), or says where the next bytes are.
    pub fn recv(&mut self, max: u64, out: &mut Vec<Bytes>) -> Recv {
        self.session.recv(self.id, max, out)
    }

    /// Copies ready bytes without consuming them (`MSG_PEEK`).
    pub fn peek(&self, buf: &mut [u8]) -> Recv {
        self.session.peek(self.id, buf)
    }

    /// Marks the last byte sent as urgent (`MSG_OOB`).
    pub fn mark_urgent(&mut self, byte: u8) {
        self.session.mark_urgent(self.id, byte)
    }

    /// The peer's urgent byte, read out of band (`MSG_OOB`); `None`: none to read.
    pub fn take_urgent(&mut self, peek: bool) -> Option<u8> {
        self.session.take_urgent(self.id, peek)
    }

    /// Keeps urgent bytes in the stream (`SO_OOBINLINE`) or out of it.
    pub fn set_oob_inline(&mut self, on: bool) {
        self.session.set_oob_inline(self.id, on)
    }

    /// How many bytes of the payload deferred at the stream's front may be read straight from
    /// `channel` now (the caller holds the channel's receive half).
    pub fn deferred_readable(&self, channel: ChannelId) -> Option<u64> {
        self.session.deferred_readable(self.id, channel)
    }

    /// `n` bytes of the deferred payload were read straight into the application's buffer;
    /// false if they are not the stream's any more (the caller must not deliver them).
    pub fn deferred_read(&mut self, channel: ChannelId, n: u64) -> bool {
        self.session.deferred_read(self.id, channel, n)
    }

    /// A read of the deferred payload found no byte yet.
    pub fn deferred_empty(&mut self) {
        self.session.deferred_empty(self.id)
    }

    /// Closes the write half: the peer reads end of stream after the last byte sent.
    pub fn shutdown_write(&mut self) -> Result<(), SendError> {
        self.session.shutdown_write(self.id)
    }

    /// The application closed its handle (see `Session::close`'s rules: unread bytes reset
    /// the peer, otherwise the stream lingers until delivered).
    pub fn close(&mut self, now: Instant) {
        self.session.close(self.id, now)
    }

    /// Moves the stream to another class: its next chunks use that class's channels.
    pub fn set_class(&mut self, class: Class) {
        self.session.set_class(self.id, class)
    }

    /// Shuts the read half down (`SHUT_RD`).
    pub fn shutdown_read(&mut self) {
        self.session.shutdown_read(self.id)
    }

    /// Resets the stream locally, telling the peer.
    pub fn abort(&mut self, cause: ResetCause) {
        self.session.abort(self.id, cause)
    }

    /// `recv` would return without waiting (data, end of stream, an error).
    pub fn readable(&self) -> bool {
        self.session.readable(self.id)
    }

    /// `send` would take bytes (or fail at once). If only class space is missing, the stream
    /// is told (`EV_WRITE`) when it frees: ask before waiting for it.
    pub fn writable(&mut self) -> bool {
        self.session.writable(self.id)
    }

    /// The stream owes the peer a control frame (a CREDIT after reads, a FIN, ...).
    pub fn owes_control(&self) -> bool {
        self.session.owes_control(self.id)
    }

    /// What the stream owes may wait for the next frames out (see `Session::control_can_wait`).
    pub fn control_can_wait(&self) -> bool {
        self.session.control_can_wait(self.id)
    }
}
