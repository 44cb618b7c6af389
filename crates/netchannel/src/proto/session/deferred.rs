//! Deferred payloads: a large DATA payload left in its channel's socket for the stream's
//! reader to read straight into its own buffer (direct placement), and what happens when the
//! reader does not come.

use std::time::{Duration, Instant};

use bytes::Bytes;

use super::*;

/// A DATA payload left in a channel's socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeferredRx {
    pub stream: StreamId,
    /// Stream offset of the next unread byte of the payload.
    pub offset: u64,
    pub remaining: u64,
    pub since: Instant,
    /// The engine reads the rest itself (`take_over_deferred`): no direct read any more.
    pub taken: bool,
}

impl<U: Default> Session<U> {
    /// Whether the application read a payload of `id` straight from a channel within
    /// `window` before `now` (it is reading this stream right now).
    pub fn read_directly_within(&self, id: StreamId, now: Instant, window: Duration) -> bool {
        let Some(epoch) = self.epoch else { return false };
        let now_us = ((now.saturating_duration_since(epoch).as_nanos() as u64 + 1) / 1000) as u32;
        self.streams.get(id).is_some_and(|s| {
            s.direct_read_us != 0
                && (now_us.wrapping_sub(s.direct_read_us) as u128) < window.as_micros()
        })
    }

    /// How many bytes stream `id` may read straight from `channel` now: the payload at its
    /// front must still be deferred in that channel (another thread may have staged it, or the
    /// channel may be gone). The caller holds the channel's receive half.
    pub(super) fn deferred_readable(&self, id: StreamId, channel: ChannelId) -> Option<u64> {
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
    pub(super) fn deferred_read(&mut self, id: StreamId, channel: ChannelId, n: u64) -> bool {
        if self.deferred_readable(id, channel).is_none_or(|max| max < n) {
            // The bytes left the channel's socket all the same. If they were this stream's
            // payload (the stream was reset while they were read), the channel moves past
            // them, or its next frame would be read from the middle of the payload.
            let ours = self
                .deferred(channel)
                .is_some_and(|d| d.stream == id && !d.taken && d.remaining >= n);
            if ours {
                self.discard_deferred(channel, n);
            }
            return false;
        }
        let now = self.clock();
        let st = self.channel_mut(channel).expect("checked");
        st.received(n, now);
        let d = st.deferred.as_mut().expect("checked");
        d.offset += n;
        d.remaining -= n;
        if d.remaining == 0 {
            st.deferred = None;
        }
        let us = ((self.ticks(now) / 1000) as u32).max(1);
        let s = self.streams.get_mut(id).expect("checked");
        let before = s.rx.held_bytes();
        s.rx.consume_deferred(n);
        // Copies resent of these bytes, if any, were held: they are duplicates now.
        self.rx_held = self.rx_held + s.rx.held_bytes() - before;
        s.flags &= !F_DEFERRED_EMPTY;
        s.direct_read_us = us;
        self.after_consume(id);
        self.settle_rst(id);
        true
    }

    /// A read of the deferred payload found no byte yet: the stream is not readable until the
    /// channel reports new bytes (`channel_readable`).
    pub(super) fn deferred_empty(&mut self, id: StreamId) {
        if let Some(s) = self.streams.get_mut(id) {
            s.flags |= F_DEFERRED_EMPTY;
        }
    }

    /// Bytes arrived on a channel blocked on a deferred payload: its reader may go on.
    pub fn channel_readable(&mut self, channel: ChannelId) {
        let Some(d) = self.deferred(channel) else { return };
        if let Some(s) = self.streams.get_mut(d.stream) {
            s.flags &= !F_DEFERRED_EMPTY;
            self.emit(d.stream, EV_READ);
        }
    }

    /// The payload deferred in `channel`, if any.
    pub fn deferred(&self, channel: ChannelId) -> Option<DeferredRx> {
        self.channel(channel)?.deferred
    }

    /// The engine reads the payload deferred in `channel` itself from now on (its reader did
    /// not come in time, or is gone): it arrives with `stage_deferred` or `discard_deferred`.
    pub(super) fn take_over_deferred(&mut self, channel: ChannelId) -> Option<DeferredRx> {
        let st = self.channel_mut(channel)?;
        let d = st.deferred.as_mut()?;
        d.taken = true;
        Some(*d)
    }

    /// Whether the stream of the payload deferred in `channel` still wants it (else the
    /// runtime reads and drops it with `discard_deferred`).
    pub fn deferred_wanted(&self, channel: ChannelId) -> bool {
        self.deferred(channel).is_some_and(|d| {
            self.streams.get(d.stream).is_some_and(|s| s.reset.is_none() && !s.app_closed)
        })
    }

    /// The next `data.len()` bytes of the payload deferred in `channel` were read into user
    /// space by the engine (the reader did not come for them in time).
    pub(super) fn stage_deferred(&mut self, channel: ChannelId, data: Bytes) {
        let now = self.clock();
        self.rx_read += data.len() as u64;
        let Some(st) = self.channel_mut(channel) else {
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
        self.settle_rst(stream);
    }

    /// `n` bytes of the payload deferred in `channel` were read and dropped.
    pub(super) fn discard_deferred(&mut self, channel: ChannelId, n: u64) {
        let now = self.clock();
        self.rx_read += n;
        let Some(st) = self.channel_mut(channel) else {
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
}
