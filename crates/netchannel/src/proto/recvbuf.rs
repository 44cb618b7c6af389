//! The receive buffer of one stream: puts DATA that arrived over several channels back in order.
//! Pure data structure, no I/O.
//!
//! A segment is either bytes already in user space (`Data`, usually a slice of the buffer the
//! channel was read into: no copy) or a payload still in a channel's kernel socket (`Deferred`):
//! its header was parsed, and the application's `recv` reads it straight into its own buffer.
//!
//! Bytes may arrive twice after a channel loss (the sender sends again what the lost channel
//! may have dropped); duplicates are trimmed, as TCP does. A copy that arrives again for bytes
//! still deferred in a channel is kept aside, though: the sender may have lost that channel
//! before this end knows, and when it learns, the copy takes the lost payload's place (it is
//! dropped when the deferred payload is read after all). Memory is bounded by the caller (the
//! credit window caps `offset + len`) and by `max_segments`, which caps the bookkeeping a peer
//! can force with tiny out-of-order frames.

use std::collections::{BTreeMap, VecDeque};

use bytes::Bytes;
use smallvec::SmallVec;

use super::ids::ChannelId;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Seg {
    Data(Bytes),
    Deferred { channel: ChannelId, len: u64 },
}

impl Seg {
    pub fn len(&self) -> u64 {
        match self {
            Seg::Data(b) => b.len() as u64,
            Seg::Deferred { len, .. } => *len,
        }
    }
}

/// Slices shorter than this are copied rather than held when they could pin a larger buffer.
pub const COMPACT_BELOW: usize = 64 * 1024;

/// Memory an out-of-order segment costs besides its bytes (tree node, slice, allocation).
pub const OOO_SEG_COST: u64 = 96;

/// Too many out-of-order segments held at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TooManySegments;

#[derive(Default)]
struct OutOfOrder {
    segs: BTreeMap<u64, Seg>,
    data_bytes: u64,
    /// Copies that arrived again of bytes still deferred, by offset (never overlapping); here
    /// beside the rare out-of-order state so that an idle stream stays small.
    resent: BTreeMap<u64, Bytes>,
    resent_bytes: u64,
}

impl OutOfOrder {
    /// Nothing held: the box can go.
    fn is_empty(&self) -> bool {
        self.segs.is_empty() && self.resent.is_empty()
    }
}

#[derive(Default)]
pub struct RecvBuf {
    /// Offset of the first byte not yet handed to the application.
    consumed: u64,
    /// End of the contiguous prefix: `ready` holds `consumed..contig`.
    contig: u64,
    ready: VecDeque<Seg>,
    ready_data: u64,
    ooo: Option<Box<OutOfOrder>>,
    /// Deferred segments held (their reader is reading this stream straight from channels).
    deferred_segs: u32,
}

/// The parts of `offset..end` that none of `covered` (sorted `(start, len)`) covers.
fn gaps(covered: impl Iterator<Item = (u64, u64)>, offset: u64, end: u64) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    let mut at = offset;
    for (s, l) in covered {
        if s + l <= at {
            continue;
        }
        if s >= end {
            break;
        }
        if s > at {
            out.push((at, s));
        }
        at = at.max(s + l);
        if at >= end {
            break;
        }
    }
    if at < end {
        out.push((at, end));
    }
    out
}

impl RecvBuf {
    pub fn consumed(&self) -> u64 {
        self.consumed
    }

    /// End of the contiguous bytes received (read or not).
    pub fn contiguous_end(&self) -> u64 {
        self.contig
    }

    /// Highest offset received, in order or not.
    pub fn high(&self) -> u64 {
        match self.ooo.as_ref().and_then(|o| o.segs.last_key_value()) {
            Some((start, seg)) => start + seg.len(),
            None => self.contig,
        }
    }

    /// Bytes in user space ready to copy out.
    pub fn ready_data(&self) -> u64 {
        self.ready_data
    }

    /// Bytes received and not read: ready, out of order, and deferred in channel sockets.
    pub fn unread(&self) -> u64 {
        let ooo: u64 = self.ooo.as_ref().map_or(0, |o| o.segs.values().map(Seg::len).sum());
        self.contig - self.consumed + ooo
    }

    /// What this buffer costs in memory: the bytes held in user space, plus the bookkeeping of
    /// each out-of-order segment and each copy kept of a deferred payload (a peer sending
    /// 1-byte frames out of order, or again over a deferred payload, pays for those).
    pub fn held_bytes(&self) -> u64 {
        self.ready_data
            + self.ooo.as_ref().map_or(0, |o| {
                let segments = (o.segs.len() + o.resent.len()) as u64;
                o.data_bytes + segments * OOO_SEG_COST + o.resent_bytes
            })
    }

    /// Whether any payload of this stream waits in a channel's socket.
    pub fn has_deferred(&self) -> bool {
        self.deferred_segs > 0
    }

    /// Bytes in user space at the front, before any payload still in a channel's socket: what
    /// a read copies out without touching a channel.
    pub fn ready_front(&self) -> u64 {
        self.ready
            .iter()
            .map_while(|s| match s {
                Seg::Data(b) => Some(b.len() as u64),
                Seg::Deferred { .. } => None,
            })
            .sum()
    }

    /// The payload at the front is in a channel's socket: `(channel, bytes)`.
    pub fn front_deferred(&self) -> Option<(ChannelId, u64)> {
        match self.ready.front() {
            Some(Seg::Deferred { channel, len }) => Some((*channel, *len)),
            _ => None,
        }
    }

    /// Segments in order (each costs bookkeeping whatever its size).
    pub fn ready_segments(&self) -> usize {
        self.ready.len()
    }

    /// Segments held out of order, and copies kept of deferred payloads (each becomes one if
    /// its payload's channel is lost): together within `max_out_of_order_segments`.
    fn ooo_segments(&self) -> usize {
        self.ooo.as_ref().map_or(0, |o| o.segs.len() + o.resent.len())
    }

    /// True when no byte of `offset..offset + len` has been received.
    pub fn is_new(&self, offset: u64, len: u64) -> bool {
        if offset < self.contig {
            return false;
        }
        let end = offset + len;
        let Some(o) = &self.ooo else { return true };
        if let Some((&s, seg)) = o.segs.range(..=offset).next_back() {
            if s + seg.len() > offset {
                return false;
            }
        }
        o.segs.range(offset..end).next().is_none()
    }

    /// Inserts received bytes at `offset`, dropping any part already received. Returns the
    /// bytes that became readable in order.
    pub fn insert_data(
        &mut self,
        mut offset: u64,
        mut data: Bytes,
        max_segments: usize,
    ) -> Result<u64, TooManySegments> {
        let end = offset + data.len() as u64;
        if self.deferred_segs > 0 && end > self.consumed {
            self.keep_resent(offset, &data, max_segments)?;
        }
        if end <= self.contig || data.is_empty() {
            return Ok(0);
        }
        if offset < self.contig {
            let skip = (self.contig - offset) as usize;
            let _ = data.split_to(skip);
            offset = self.contig;
        }
        // The parts of offset..end that no out-of-order segment covers.
        // Inline: in order, a payload is one piece (no allocation per frame).
        let mut pieces: SmallVec<[(u64, Bytes); 2]> = SmallVec::new();
        match &self.ooo {
            None => pieces.push((offset, data)),
            Some(o) => {
                let mut at = offset;
                let first = o.segs.range(..offset).next_back().map(|(&s, seg)| (s, seg.len()));
                let overlapping = first
                    .into_iter()
                    .chain(o.segs.range(offset..end).map(|(&s, seg)| (s, seg.len())));
                for (s, l) in overlapping {
                    if s + l <= at {
                        continue;
                    }
                    if s > at {
                        let piece = data.slice((at - offset) as usize..(s - offset) as usize);
                        pieces.push((at, piece));
                    }
                    at = at.max(s + l);
                    if at >= end {
                        break;
                    }
                }
                if at < end {
                    pieces.push((at, data.slice((at - offset) as usize..)));
                }
            }
        }
        let new_ooo = pieces.iter().filter(|(s, _)| *s != self.contig).count();
        if new_ooo > 0 && self.ooo_segments() + new_ooo > max_segments {
            return Err(TooManySegments);
        }
        let before = self.ready_data;
        for (s, piece) in pieces {
            // A small slice held out of order would pin the whole read buffer it came from
            // (up to `READ_SIZE`) until the gap fills: hold a copy of just its bytes.
            let piece = if s != self.contig && piece.len() < COMPACT_BELOW {
                Bytes::copy_from_slice(&piece)
            } else {
                piece
            };
            self.place(s, Seg::Data(piece));
        }
        Ok(self.ready_data - before)
    }

    /// Copies the small in-order slices held (each may pin a whole channel read buffer) into
    /// buffers of their own, merging neighbours up to `COMPACT_BELOW` bytes each, so memory
    /// follows the bytes held. A merged buffer of `COMPACT_BELOW` bytes is never copied again.
    /// Returns the bytes copied.
    pub fn compact(&mut self) -> u64 {
        if !self.ready.iter().any(|s| matches!(s, Seg::Data(b) if b.len() < COMPACT_BELOW)) {
            return 0;
        }
        let mut copied = 0;
        let mut out = VecDeque::with_capacity(self.ready.len());
        let mut acc = bytes::BytesMut::new();
        for seg in self.ready.drain(..) {
            match seg {
                Seg::Data(b) if b.len() < COMPACT_BELOW => {
                    if acc.len() + b.len() > COMPACT_BELOW && !acc.is_empty() {
                        out.push_back(Seg::Data(std::mem::take(&mut acc).freeze()));
                    }
                    if acc.is_empty() {
                        acc.reserve(COMPACT_BELOW.min(b.len().max(1024)));
                    }
                    copied += b.len() as u64;
                    crate::copy::extend(&mut acc, &b);
                }
                other => {
                    if !acc.is_empty() {
                        out.push_back(Seg::Data(std::mem::take(&mut acc).freeze()));
                    }
                    out.push_back(other);
                }
            }
        }
        if !acc.is_empty() {
            out.push_back(Seg::Data(acc.freeze()));
        }
        self.ready = out;
        copied
    }

    /// Records a payload left in a channel's socket. The caller checked `is_new`.
    pub fn insert_deferred(
        &mut self,
        offset: u64,
        channel: ChannelId,
        len: u64,
        max_segments: usize,
    ) -> Result<(), TooManySegments> {
        debug_assert!(self.is_new(offset, len));
        if offset != self.contig && self.ooo_segments() >= max_segments {
            return Err(TooManySegments);
        }
        self.place(offset, Seg::Deferred { channel, len });
        self.deferred_segs += 1;
        Ok(())
    }

    fn place(&mut self, offset: u64, seg: Seg) {
        if offset != self.contig {
            let o = self.ooo.get_or_insert_with(Box::default);
            if let Seg::Data(b) = &seg {
                o.data_bytes += b.len() as u64;
            }
            o.segs.insert(offset, seg);
            return;
        }
        self.push_ready(seg);
        while let Some(o) = self.ooo.as_mut() {
            let Some(entry) = o.segs.first_entry() else { break };
            if *entry.key() != self.contig {
                break;
            }
            let seg = entry.remove();
            if let Seg::Data(b) = &seg {
                o.data_bytes -= b.len() as u64;
            }
            self.push_ready(seg);
        }
        if self.ooo.as_ref().is_some_and(|o| o.is_empty()) {
            self.ooo = None;
        }
    }

    fn push_ready(&mut self, seg: Seg) {
        self.contig += seg.len();
        if let Seg::Data(b) = &seg {
            self.ready_data += b.len() as u64;
        }
        self.ready.push_back(seg);
    }

    /// Moves up to `max` ready bytes out (slices, no copy), stopping at a deferred payload.
    pub fn take(&mut self, max: u64, out: &mut Vec<Bytes>) -> u64 {
        let mut taken = 0;
        while taken < max {
            let Some(Seg::Data(front)) = self.ready.front_mut() else { break };
            let want = (max - taken) as usize;
            let piece = if front.len() <= want {
                let Some(Seg::Data(b)) = self.ready.pop_front() else { unreachable!() };
                b
            } else {
                front.split_to(want)
            };
            taken += piece.len() as u64;
            out.push(piece);
        }
        self.ready_data -= taken;
        self.consumed += taken;
        taken
    }

    /// Copies up to `buf.len()` ready bytes without consuming them (MSG_PEEK).
    pub fn peek(&self, buf: &mut [u8]) -> usize {
        let mut n = 0;
        for seg in &self.ready {
            let Seg::Data(b) = seg else { break };
            let k = b.len().min(buf.len() - n);
            crate::copy::copy(&mut buf[n..n + k], &b[..k]);
            n += k;
            if n == buf.len() {
                break;
            }
        }
        n
    }

    /// `n` bytes of the deferred payload at the front were read by the application.
    pub fn consume_deferred(&mut self, n: u64) {
        let Some(Seg::Deferred { len, .. }) = self.ready.front_mut() else {
            debug_assert!(false, "no deferred payload at the front");
            return;
        };
        debug_assert!(n <= *len);
        *len -= n;
        if *len == 0 {
            self.ready.pop_front();
            self.deferred_segs -= 1;
        }
        self.forget_resent(self.consumed, self.consumed + n);
        self.consumed += n;
    }

    /// Keeps aside the parts of `data` (at `offset`) that fall on deferred payloads and are
    /// not kept already. Each kept copy counts as an out-of-order segment (it becomes one if
    /// its payload's channel is lost), within the same `max_segments`.
    fn keep_resent(
        &mut self,
        offset: u64,
        data: &Bytes,
        max_segments: usize,
    ) -> Result<(), TooManySegments> {
        let end = offset + data.len() as u64;
        // The deferred segments `offset..end` overlaps, as `(start, len)`.
        let mut hits = Vec::new();
        if offset < self.contig {
            let mut at = self.consumed;
            for seg in &self.ready {
                if at >= end {
                    break;
                }
                if let Seg::Deferred { len, .. } = seg {
                    if at + len > offset {
                        hits.push((at, *len));
                    }
                }
                at += seg.len();
            }
        }
        if let Some(o) = &self.ooo {
            let first = o.segs.range(..offset).next_back();
            for (&s, seg) in first.into_iter().chain(o.segs.range(offset..end)) {
                if let Seg::Deferred { len, .. } = seg {
                    if s + len > offset {
                        hits.push((s, *len));
                    }
                }
            }
        }
        for (s, l) in hits {
            let (lo, hi) = (s.max(offset), (s + l).min(end));
            if lo >= hi {
                continue;
            }
            let kept = self.ooo.get_or_insert_with(Box::default);
            let first = kept.resent.range(..lo).next_back().map(|(&s, b)| (s, b.len() as u64));
            let covered = first
                .into_iter()
                .chain(kept.resent.range(lo..hi).map(|(&s, b)| (s, b.len() as u64)));
            let gaps = gaps(covered, lo, hi);
            if kept.segs.len() + kept.resent.len() + gaps.len() > max_segments {
                // A peer resending a deferred payload a few bytes at a time.
                return Err(TooManySegments);
            }
            for (a, b) in gaps {
                let piece = data.slice((a - offset) as usize..(b - offset) as usize);
                // As out-of-order bytes: a small slice must not pin a whole read buffer.
                let piece = if piece.len() < COMPACT_BELOW {
                    Bytes::copy_from_slice(&piece)
                } else {
                    piece
                };
                kept.resent_bytes += piece.len() as u64;
                kept.resent.insert(a, piece);
            }
        }
        Ok(())
    }

    /// Takes the copies kept of `lo..hi` out (trimmed to it; parts outside stay kept).
    fn take_resent(&mut self, lo: u64, hi: u64) -> Vec<(u64, Bytes)> {
        let Some(kept) = self.ooo.as_mut() else { return Vec::new() };
        let mut starts: Vec<u64> = kept.resent.range(lo..hi).map(|(&s, _)| s).collect();
        if let Some((&s, b)) = kept.resent.range(..lo).next_back() {
            if s + b.len() as u64 > lo {
                starts.insert(0, s);
            }
        }
        let mut out = Vec::new();
        for s in starts {
            let mut b = kept.resent.remove(&s).expect("listed");
            kept.resent_bytes -= b.len() as u64;
            let e = s + b.len() as u64;
            if e > hi {
                let tail = b.split_off((hi - s) as usize);
                kept.resent_bytes += tail.len() as u64;
                kept.resent.insert(hi, tail);
            }
            let mut start = s;
            if s < lo {
                let head = b.split_to((lo - s) as usize);
                kept.resent_bytes += head.len() as u64;
                kept.resent.insert(s, head);
                start = lo;
            }
            out.push((start, b));
        }
        if kept.is_empty() {
            self.ooo = None;
        }
        out
    }

    /// The deferred copy of `lo..hi` arrived: copies kept of it are duplicates.
    fn forget_resent(&mut self, lo: u64, hi: u64) {
        if self.ooo.as_ref().is_some_and(|o| !o.resent.is_empty()) {
            self.take_resent(lo, hi);
        }
    }

    /// Finds the deferred segment starting at `offset`: in `ready` (its index) or out of order.
    fn find_deferred(&self, offset: u64) -> Option<Result<usize, ()>> {
        let mut at = self.consumed;
        for (i, seg) in self.ready.iter().enumerate() {
            if at == offset {
                return matches!(seg, Seg::Deferred { .. }).then_some(Ok(i));
            }
            at += seg.len();
            if at > offset {
                return None;
            }
        }
        let o = self.ooo.as_ref()?;
        matches!(o.segs.get(&offset), Some(Seg::Deferred { .. })).then_some(Err(()))
    }

    /// The first `data.len()` bytes of the deferred payload at `offset` were read into user
    /// space (the application did not come for them in time).
    pub fn stage_deferred(&mut self, offset: u64, data: Bytes) {
        let n = data.len() as u64;
        self.forget_resent(offset, offset + n);
        match self.find_deferred(offset) {
            Some(Ok(i)) => {
                let Seg::Deferred { channel, len } = self.ready[i] else { unreachable!() };
                self.ready_data += n;
                self.ready[i] = Seg::Data(data);
                if len > n {
                    self.ready.insert(i + 1, Seg::Deferred { channel, len: len - n });
                } else {
                    self.deferred_segs -= 1;
                }
            }
            Some(Err(())) => {
                let o = self.ooo.as_mut().expect("found out of order");
                let Some(Seg::Deferred { channel, len }) = o.segs.remove(&offset) else {
                    unreachable!()
                };
                o.data_bytes += n;
                o.segs.insert(offset, Seg::Data(data));
                if len > n {
                    o.segs.insert(offset + n, Seg::Deferred { channel, len: len - n });
                } else {
                    self.deferred_segs -= 1;
                }
            }
            None => debug_assert!(false, "no deferred payload at {offset}"),
        }
    }

    /// Forgets the deferred payload at `offset` (its channel is gone): a copy that arrived
    /// again takes its place; what did not arrive yet, the sender sends again. Bytes after it
    /// are no longer contiguous until then. Returns the bytes that became readable in order.
    pub fn remove_deferred(&mut self, offset: u64) -> u64 {
        let Some(lost) = self.unlink_deferred(offset) else { return 0 };
        let before = self.ready_data;
        for (at, piece) in self.take_resent(offset, offset + lost) {
            // Accepted once already (kept within the window): no segment limit applies.
            let _ = self.insert_data(at, piece, usize::MAX);
        }
        self.ready_data - before
    }

    /// Takes the deferred segment at `offset` out of the buffer; returns its length.
    fn unlink_deferred(&mut self, offset: u64) -> Option<u64> {
        match self.find_deferred(offset) {
            Some(Ok(i)) => {
                let mut tail = self.ready.drain(i..).collect::<Vec<Seg>>().into_iter();
                let lost = tail.next().expect("the deferred segment");
                let lost_len = lost.len();
                self.deferred_segs -= 1;
                let mut at = offset + lost.len();
                self.contig = offset;
                let o = self.ooo.get_or_insert_with(Box::default);
                for seg in tail {
                    let l = seg.len();
                    if let Seg::Data(b) = &seg {
                        self.ready_data -= b.len() as u64;
                        o.data_bytes += b.len() as u64;
                    }
                    o.segs.insert(at, seg);
                    at += l;
                }
                if o.is_empty() {
                    self.ooo = None;
                }
                Some(lost_len)
            }
            Some(Err(())) => {
                let o = self.ooo.as_mut()?;
                let lost = o.segs.remove(&offset)?;
                self.deferred_segs -= 1;
                if o.is_empty() {
                    self.ooo = None;
                }
                Some(lost.len())
            }
            None => None,
        }
    }

    /// The deferred payloads held, as `(offset, channel)`.
    #[cfg(test)]
    pub fn deferred(&self) -> Vec<(u64, ChannelId)> {
        let mut v = Vec::new();
        let mut at = self.consumed;
        for seg in &self.ready {
            if let Seg::Deferred { channel, .. } = seg {
                v.push((at, *channel));
            }
            at += seg.len();
        }
        if let Some(o) = &self.ooo {
            for (&s, seg) in &o.segs {
                if let Seg::Deferred { channel, .. } = seg {
                    v.push((s, *channel));
                }
            }
        }
        v
    }

    /// Keeps only the bytes in user space at the front (what a read takes without a channel):
    /// the rest (out of order, or still in a channel's socket) is dropped. Returns the dropped
    /// count, as `clear`.
    pub fn keep_front(&mut self) -> u64 {
        let before = self.unread();
        let keep = self.ready.iter().take_while(|s| matches!(s, Seg::Data(_))).count();
        self.ready.truncate(keep);
        self.ooo = None;
        self.ready_data = self.ready_front();
        self.deferred_segs = 0;
        // In order now ends where the kept bytes end.
        self.contig = self.consumed + self.ready_data;
        before - self.unread()
    }

    /// Drops everything held (reset, close with unread data); returns the bytes dropped.
    pub fn clear(&mut self) -> u64 {
        let dropped = self.unread();
        self.ready.clear();
        self.ooo = None;
        self.ready_data = 0;
        self.deferred_segs = 0;
        self.contig = self.consumed;
        dropped
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn read_all(rb: &mut RecvBuf) -> Vec<u8> {
        let mut out = Vec::new();
        rb.take(u64::MAX, &mut out);
        out.concat()
    }

    #[test]
    fn in_order_and_gap_filling() {
        let mut rb = RecvBuf::default();
        assert_eq!(rb.insert_data(3, Bytes::from_static(&[3, 4]), 16), Ok(0));
        assert_eq!(rb.insert_data(0, Bytes::from_static(&[0, 1, 2]), 16), Ok(5));
        assert_eq!(read_all(&mut rb), vec![0, 1, 2, 3, 4]);
        assert_eq!(rb.contiguous_end(), 5);
        assert_eq!(rb.consumed(), 5);
    }

    #[test]
    fn duplicates_are_trimmed() {
        let mut rb = RecvBuf::default();
        rb.insert_data(0, Bytes::from_static(b"abcd"), 16).unwrap();
        rb.insert_data(10, Bytes::from_static(b"klmn"), 16).unwrap();
        // Overlaps both ends and the out-of-order segment: only the holes are kept.
        assert_eq!(rb.insert_data(2, Bytes::from_static(b"cdefghijklmnop"), 16), Ok(12));
        assert_eq!(read_all(&mut rb), b"abcdefghijklmnop");
        assert_eq!(rb.insert_data(0, Bytes::from_static(b"abc"), 16), Ok(0));
        assert_eq!(rb.unread(), 0);
    }

    #[test]
    fn segment_limit() {
        let mut rb = RecvBuf::default();
        rb.insert_data(10, Bytes::from_static(&[1]), 2).unwrap();
        rb.insert_data(20, Bytes::from_static(&[1]), 2).unwrap();
        assert_eq!(rb.insert_data(30, Bytes::from_static(&[1]), 2), Err(TooManySegments));
        assert_eq!(rb.insert_data(0, Bytes::from_static(&[1]), 2), Ok(1), "in order is fine");
    }

    /// Copies of a deferred payload that arrive again a byte at a time (a peer's way to make
    /// many small allocations of legal duplicates) count as segments: held bytes include each
    /// one's bookkeeping, and past the limit they are refused, so they stay bounded when the
    /// payload's channel is lost and they become out-of-order segments.
    #[test]
    fn copies_kept_of_a_deferred_payload_count_as_segments() {
        let mut rb = RecvBuf::default();
        rb.insert_data(0, Bytes::from_static(b"head"), 8).unwrap();
        rb.insert_deferred(4, ChannelId::new(2, 0), 1000, 8).unwrap();
        let held = rb.held_bytes();
        for i in 0..8u64 {
            rb.insert_data(10 + 2 * i, Bytes::from_static(&[1]), 8).unwrap();
        }
        assert_eq!(rb.held_bytes(), held + 8 * (1 + OOO_SEG_COST));
        assert_eq!(rb.insert_data(100, Bytes::from_static(&[1]), 8), Err(TooManySegments));
        // A copy that adds nothing new is no new segment.
        rb.insert_data(10, Bytes::from_static(&[1]), 8).unwrap();
        // The channel is lost: the copies become out-of-order segments, within the limit.
        rb.remove_deferred(4);
        assert!(rb.ooo_segments() <= 8, "{}", rb.ooo_segments());
    }

    /// After a reset, only the bytes in user space at the front stay, and what is unread says
    /// so (the deferred and out-of-order parts are gone, not owed).
    #[test]
    fn keeping_the_front_drops_the_rest_and_counts_it() {
        let mut rb = RecvBuf::default();
        rb.insert_data(0, Bytes::from_static(b"head"), 8).unwrap();
        rb.insert_deferred(4, ChannelId::new(2, 0), 100, 8).unwrap();
        rb.insert_data(104, Bytes::from_static(b"tail"), 8).unwrap();
        rb.insert_data(200, Bytes::from_static(b"far"), 8).unwrap();
        assert_eq!(rb.unread(), 111);
        assert_eq!(rb.keep_front(), 107);
        assert_eq!((rb.unread(), rb.ready_data(), rb.has_deferred()), (4, 4, false));
        assert_eq!(read_all(&mut rb), b"head");
        assert_eq!(rb.unread(), 0);
        rb.insert_data(4, Bytes::from_static(b"xy"), 8).unwrap();
        assert_eq!(rb.clear(), 2);
        assert_eq!(rb.unread(), 0);
    }

    #[test]
    fn deferred_payloads_read_staged_and_lost() {
        let mut rb = RecvBuf::default();
        rb.insert_data(0, Bytes::from_static(b"head"), 8).unwrap();
        rb.insert_deferred(4, ChannelId::new(2, 0), 100, 8).unwrap();
        assert!(rb.is_new(104, 5) && !rb.is_new(50, 1));
        rb.insert_data(104, Bytes::from_static(b"tail!"), 8).unwrap();
        assert_eq!(rb.contiguous_end(), 109);
        assert_eq!(read_all(&mut rb), b"head");
        assert_eq!(rb.front_deferred(), Some((ChannelId::new(2, 0), 100)));
        rb.consume_deferred(40);
        assert_eq!(rb.front_deferred(), Some((ChannelId::new(2, 0), 60)));
        rb.stage_deferred(44, Bytes::from(vec![9u8; 10]));
        assert_eq!(rb.ready_data(), 15);
        assert_eq!(read_all(&mut rb), vec![9u8; 10]);
        assert_eq!(rb.deferred(), vec![(54, ChannelId::new(2, 0))]);
        assert!(rb.has_deferred());
        // The channel dies: the rest of the payload is gone, the tail is out of order again.
        rb.remove_deferred(54);
        assert!(!rb.has_deferred());
        assert_eq!(rb.contiguous_end(), 54);
        assert_eq!(rb.front_deferred(), None);
        assert_eq!(rb.ready_data(), 0);
        rb.insert_data(40, Bytes::from(vec![7u8; 64]), 8).unwrap(); // resent, partly duplicate
        assert_eq!(rb.contiguous_end(), 109);
        let rest = read_all(&mut rb);
        assert_eq!(rest.len(), 55);
        assert_eq!(&rest[50..], b"tail!");
    }

    /// Splits `total` bytes into segments and shuffles them.
    fn split_and_shuffle(total: usize, cuts: &[usize], order: &[usize]) -> Vec<(u64, Vec<u8>)> {
        let mut points: Vec<usize> = cuts.iter().map(|c| c % total).filter(|&c| c > 0).collect();
        points.push(0);
        points.push(total);
        points.sort_unstable();
        points.dedup();
        let mut segs: Vec<(u64, Vec<u8>)> = points
            .windows(2)
            .map(|w| (w[0] as u64, (w[0]..w[1]).map(|i| (i * 31 % 251) as u8).collect()))
            .collect();
        for (i, &o) in order.iter().enumerate() {
            let j = o % segs.len();
            let i = i % segs.len();
            segs.swap(i, j);
        }
        segs
    }

    proptest! {
        #[test]
        fn delivers_exactly_the_bytes_sent_in_order(
            total in 1usize..4096,
            cuts in proptest::collection::vec(any::<usize>(), 0..64),
            order in proptest::collection::vec(any::<usize>(), 0..64),
            dups in proptest::collection::vec((any::<usize>(), 1usize..300), 0..8),
            read_size in 1u64..512,
        ) {
            let mut segs = split_and_shuffle(total, &cuts, &order);
            let expected: Vec<u8> = (0..total).map(|i| (i * 31 % 251) as u8).collect();
            // Resent ranges, as after a channel loss.
            for (at, len) in dups {
                let s = at % total;
                let e = (s + len).min(total);
                segs.push((s as u64, expected[s..e].to_vec()));
            }
            let mut rb = RecvBuf::default();
            let mut out = Vec::new();
            for (off, data) in segs {
                rb.insert_data(off, Bytes::from(data), 1024).unwrap();
                let mut got = Vec::new();
                rb.take(read_size, &mut got);
                out.extend(got.concat());
            }
            out.extend(read_all(&mut rb));
            prop_assert_eq!(out, expected);
            prop_assert_eq!(rb.unread(), 0);
            prop_assert_eq!(rb.contiguous_end(), total as u64);
        }

        /// Deferred payloads that are read (by the application or the engine) or lost with
        /// their channel, with copies resent before or after the loss, as a sender that learnt
        /// of the loss first (or timed the channel out while it still delivered) sends them:
        /// every byte arrives exactly once and nothing is held at the end.
        #[test]
        fn deferred_payloads_lost_or_read_with_copies_resent_deliver_once(
            total in 1usize..4096,
            cuts in proptest::collection::vec(any::<usize>(), 0..48),
            order in proptest::collection::vec(any::<usize>(), 0..48),
            defer in any::<u64>(),
            lose in any::<u64>(),
            resend_early in any::<u64>(),
            read_size in 1u64..512,
        ) {
            let expected: Vec<u8> = (0..total).map(|i| (i * 31 % 251) as u8).collect();
            let mut rb = RecvBuf::default();
            let mut out = Vec::new();
            // Deferred payloads: (start, bytes, next unread offset).
            let mut deferred: Vec<(u64, Vec<u8>, u64)> = Vec::new();
            for (i, (off, data)) in split_and_shuffle(total, &cuts, &order).into_iter().enumerate() {
                let len = data.len() as u64;
                if defer >> (i % 64) & 1 == 1 && rb.is_new(off, len) {
                    rb.insert_deferred(off, ChannelId::new(i as u16 % 64, 0), len, 1024).unwrap();
                    deferred.push((off, data, off));
                } else {
                    rb.insert_data(off, Bytes::from(data), 1024).unwrap();
                }
            }
            // A reader: ready bytes, then the front deferred payload straight from its channel.
            let read = |rb: &mut RecvBuf, deferred: &mut Vec<(u64, Vec<u8>, u64)>, out: &mut Vec<u8>| {
                let mut got = Vec::new();
                rb.take(read_size, &mut got);
                out.extend(got.concat());
                if let Some((_, len)) = rb.front_deferred() {
                    let at = rb.consumed();
                    let d = deferred.iter_mut().find(|d| d.2 == at && d.2 < d.0 + d.1.len() as u64)
                        .expect("front is listed");
                    let k = len.min(read_size);
                    out.extend_from_slice(&d.1[(at - d.0) as usize..(at - d.0 + k) as usize]);
                    rb.consume_deferred(k);
                    d.2 += k;
                }
            };
            for i in 0..deferred.len() {
                read(&mut rb, &mut deferred, &mut out);
                let (start, data, next) = deferred[i].clone();
                if next == start + data.len() as u64 {
                    continue; // read whole already
                }
                let rest = Bytes::from(data[(next - start) as usize..].to_vec());
                let early = resend_early >> (i % 64) & 1 == 1;
                if early {
                    // The whole payload again: what was read of it is trimmed.
                    rb.insert_data(start, Bytes::from(data.clone()), 1024).unwrap();
                }
                if lose >> (i % 64) & 1 == 1 {
                    rb.remove_deferred(next);
                    if !early {
                        rb.insert_data(next, rest, 1024).unwrap();
                    }
                } else {
                    rb.stage_deferred(next, rest);
                }
                deferred[i].2 = start + data.len() as u64;
            }
            for _ in 0..=total {
                read(&mut rb, &mut deferred, &mut out);
            }
            prop_assert_eq!(out, expected);
            prop_assert_eq!(rb.unread(), 0);
            prop_assert_eq!(rb.held_bytes(), 0);
            prop_assert!(!rb.has_deferred());
        }
    }
}
