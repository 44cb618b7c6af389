//! The unsent bytes of one stream. Small writes are appended to the last chunk while it has
//! room, so many small messages leave as one frame; large writes arrive as their own chunk.
//! Bytes leave the buffer when a channel pulls them (`take`): the frame then shares the chunk's
//! memory (reference counted) until the peer acknowledges it, so memory follows the bytes held,
//! never the number of writes or frames. A chunk whose frames were all acknowledged goes back to
//! the session's `SpareChunks` for the next chunk of any of its streams.

use std::collections::VecDeque;

use bytes::{Bytes, BytesMut};

/// Largest capacity of a chunk for small writes.
pub const COALESCE_CHUNK: usize = 64 * 1024;
/// Capacity of the first chunk after the buffer drained. Chunks double while writes outpace
/// the channels (a burst), so an RPC's message costs about its own size and a stream of small
/// writes coalesces into 64 KiB frames.
const FIRST_CHUNK: usize = 1024;

/// A run of unsent bytes: still open to small appends, or frozen (a pooled buffer a large
/// write was copied into).
enum Chunk {
    Open(BytesMut),
    Frozen(Bytes),
}

impl Chunk {
    fn len(&self) -> usize {
        match self {
            Chunk::Open(b) => b.len(),
            Chunk::Frozen(b) => b.len(),
        }
    }

    fn split_to(&mut self, n: usize) -> Bytes {
        match self {
            Chunk::Open(b) => b.split_to(n).freeze(),
            Chunk::Frozen(b) => b.split_to(n),
        }
    }
}

/// Chunk buffers whose frames the peer acknowledged, kept for the next chunks of a session's
/// streams. Without them every write that starts a chunk (with many streams, every write) is a
/// fresh allocation, freed by whichever thread handles the acknowledgement: glibc's slow path,
/// about 10% of the CPU with 10,000 streams of 4 KiB writes. Bounded by the caller's `limit`
/// at each `give` (the session keeps spares within what it has in flight, and trims them when
/// an acknowledgement leaves nothing in flight).
#[derive(Default)]
pub struct SpareChunks {
    /// By size class: `free[i]` holds capacities in `[FIRST_CHUNK << i, FIRST_CHUNK << (i + 1))`,
    /// so a lookup is O(1) and buffers of one size never hide behind another's.
    free: [Vec<BytesMut>; SIZE_CLASSES],
    /// Sum of the capacities in `free`.
    bytes: usize,
}

/// Chunk capacities run from `FIRST_CHUNK` to `COALESCE_CHUNK`, doubling.
const SIZE_CLASSES: usize =
    (COALESCE_CHUNK.trailing_zeros() - FIRST_CHUNK.trailing_zeros()) as usize + 1;

/// The size class of capacity `cap` (at least `FIRST_CHUNK`, at most `COALESCE_CHUNK`).
fn size_class(cap: usize) -> usize {
    (cap.ilog2() - FIRST_CHUNK.ilog2()) as usize
}

/// The newest spare of `class` if it holds at least `min` bytes.
fn pop_if_fits(class: &mut Vec<BytesMut>, min: usize) -> Option<BytesMut> {
    class.last().is_some_and(|b| b.capacity() >= min).then(|| class.pop()).flatten()
}

impl SpareChunks {
    /// An empty chunk for a write of `min` bytes that would like room for `want` (`min` or
    /// more: room for later small writes to join it). A spare from one of the two classes above
    /// `want` (every capacity there is at least `want` and below eight times it, four for a
    /// power of two), else one of `want`'s own class that is large enough, else one of at
    /// least `min` from the class below (less room: a smaller frame, no allocation), else a new
    /// allocation of `want`.
    fn take(&mut self, min: usize, want: usize) -> BytesMut {
        if (FIRST_CHUNK..=COALESCE_CHUNK).contains(&want) {
            let own = size_class(want);
            let above = own + usize::from(!want.is_power_of_two());
            let found = (above..SIZE_CLASSES.min(above + 2))
                .find_map(|c| self.free[c].pop())
                .or_else(|| pop_if_fits(&mut self.free[own], want))
                .or_else(|| pop_if_fits(&mut self.free[own.checked_sub(1)?], min));
            if let Some(b) = found {
                self.bytes -= b.capacity();
                return b;
            }
        }
        BytesMut::with_capacity(want)
    }

    /// Keeps `frame`'s buffer for reuse when `frame` was its last reference, it is a chunk's
    /// size, and the spares stay within `limit` bytes; otherwise drops it.
    pub fn give(&mut self, frame: Bytes, limit: usize) {
        // Pooled, static or still shared buffers are not ours to keep: dropped as before.
        let Ok(mut b) = frame.try_into_mut() else { return };
        b.clear();
        // A frame cut from the middle of its chunk sees only the tail of the buffer.
        let _whole = super::reclaim_whole(&mut b);
        let cap = b.capacity();
        if (FIRST_CHUNK..=COALESCE_CHUNK).contains(&cap) && self.bytes + cap <= limit {
            self.bytes += cap;
            self.free[size_class(cap)].push(b);
        }
    }

    /// Drops spares beyond `limit` bytes, the largest first.
    pub fn trim(&mut self, limit: usize) {
        for class in self.free.iter_mut().rev() {
            while self.bytes > limit {
                let Some(b) = class.pop() else { break };
                self.bytes -= b.capacity();
            }
        }
    }

    /// Bytes held in spares.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

#[derive(Default)]
pub struct SendBuf {
    /// Not yet sent, in offset order of arrival.
    chunks: VecDeque<(u64, Chunk)>,
    /// Sent on a channel that was lost before the peer acknowledged it: sent again first.
    /// Boxed (a VecDeque is 32 bytes even when empty): rare, and an idle stream stays small.
    #[allow(clippy::box_collection)]
    retransmit: Option<Box<VecDeque<(u64, Bytes)>>>,
    bytes: u64,
    /// Capacity of the next chunk (0: `FIRST_CHUNK`).
    next_chunk: u32,
}

impl SendBuf {
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }

    /// Copies `data` (stream bytes starting at `offset`) into the buffer; a new chunk comes
    /// from `spares` when one fits. A write that does not fit the last chunk's room fills it
    /// and starts the next chunk with the rest, and a chunk started while bytes wait is sized
    /// for the burst (room for what waits again, at most `COALESCE_CHUNK`): so writes of
    /// 16 KiB leave as 64 KiB frames as writes of 1 KiB do, while a lone message (nothing
    /// waiting) still takes a chunk its own size.
    pub fn push_copy(&mut self, offset: u64, data: &[u8], spares: &mut SpareChunks) {
        if data.is_empty() {
            return;
        }
        let waiting = self.bytes as usize;
        self.bytes += data.len() as u64;
        let (mut offset, mut data) = (offset, data);
        if let Some((start, Chunk::Open(back))) = self.chunks.back_mut() {
            if *start + back.len() as u64 == offset {
                let room = back.capacity() - back.len();
                if room >= data.len() {
                    crate::copy::extend(back, data);
                    return;
                }
                crate::copy::extend(back, &data[..room]);
                offset += room as u64;
                data = &data[room..];
            }
        }
        let mut grow = (self.next_chunk as usize).max(FIRST_CHUNK);
        self.next_chunk = (grow * 2).min(COALESCE_CHUNK) as u32;
        if waiting > 0 {
            grow = grow.max(waiting + data.len()).min(COALESCE_CHUNK);
        }
        let mut chunk = spares.take(data.len(), data.len().max(grow));
        crate::copy::extend(&mut chunk, data);
        self.chunks.push_back((offset, Chunk::Open(chunk)));
    }

    /// Adds bytes the caller copied (large writes are copied outside the session lock, into
    /// pooled buffers).
    pub fn push_frozen(&mut self, offset: u64, chunk: Bytes) {
        if chunk.is_empty() {
            return;
        }
        self.bytes += chunk.len() as u64;
        self.chunks.push_back((offset, Chunk::Frozen(chunk)));
    }

    /// Queues bytes to send again (after the channel that carried them was lost).
    pub fn retransmit(&mut self, offset: u64, data: Bytes) {
        self.bytes += data.len() as u64;
        self.retransmit.get_or_insert_with(Box::default).push_back((offset, data));
    }

    /// Takes up to `max` bytes from the front: `(offset, bytes)`.
    pub fn take(&mut self, max: usize) -> Option<(u64, Bytes)> {
        if max == 0 {
            return None;
        }
        if let Some(q) = self.retransmit.as_mut() {
            if let Some((offset, data)) = q.front_mut() {
                let off = *offset;
                let out = if data.len() <= max {
                    let (_, d) = q.pop_front().expect("front exists");
                    d
                } else {
                    *offset += max as u64;
                    data.split_to(max)
                };
                if q.is_empty() {
                    self.retransmit = None;
                }
                self.bytes -= out.len() as u64;
                return Some((off, out));
            }
        }
        let (offset, chunk) = self.chunks.front_mut()?;
        let off = *offset;
        let n = chunk.len().min(max);
        let out = chunk.split_to(n);
        *offset += n as u64;
        // An emptied chunk is dropped, spare room and all: an idle stream holds no memory.
        if chunk.len() == 0 {
            self.chunks.pop_front();
        }
        self.bytes -= n as u64;
        if self.bytes == 0 {
            self.next_chunk = 0;
        }
        Some((off, out))
    }

    /// Where the bytes sent once and not to be sent again end, for a stream whose next byte
    /// written would be `send_next`: the first byte waiting to be sent (again), if any (chunks
    /// of writers that copied concurrently may be queued out of offset order).
    pub fn sent_end(&self, send_next: u64) -> u64 {
        let resend = self.retransmit.iter().flat_map(|q| q.iter()).map(|&(off, _)| off);
        let unsent = self.chunks.iter().map(|&(off, _)| off);
        resend.chain(unsent).min().unwrap_or(send_next).min(send_next)
    }

    /// Drops everything (reset); returns the bytes dropped.
    pub fn clear(&mut self) -> u64 {
        let n = self.bytes;
        self.chunks.clear();
        self.retransmit = None;
        self.bytes = 0;
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_writes_coalesce_into_one_frame() {
        let mut b = SendBuf::default();
        let s = &mut SpareChunks::default();
        for i in 0..100u64 {
            b.push_copy(i * 64, &[i as u8; 64], s);
        }
        assert_eq!(b.bytes(), 6400);
        let mut got = Vec::new();
        while let Some((off, bytes)) = b.take(1 << 20) {
            assert_eq!(off, got.len() as u64);
            got.extend_from_slice(&bytes);
        }
        assert_eq!(got.len(), 6400);
        assert_eq!(got[64 * 7], 7);
        assert!(b.chunks.len() <= 1);
        for i in 0..2000u64 {
            b.push_copy(6400 + i * 64, &[1; 64], s);
        }
        let (_, first) = b.take(1 << 20).unwrap();
        assert!(first.len() >= 1024, "chunks grow during a burst: {}", first.len());
        while b.take(1 << 20).is_some() {}
        assert!(b.chunks.is_empty(), "an emptied buffer holds no chunk");
        b.push_copy(6400 + 2000 * 64, b"x", s);
        let (_, x) = b.take(1).unwrap();
        assert_eq!(&x[..], b"x");
        assert!(b.take(10).is_none());
        b.push_copy(200_000, b"tail", s);
        assert_eq!(b.take(2).unwrap(), (200_000, Bytes::from_static(b"ta")));
        assert_eq!(b.take(9).unwrap(), (200_002, Bytes::from_static(b"il")));
    }

    #[test]
    fn a_burst_of_16_kib_writes_leaves_in_64_kib_frames() {
        let mut b = SendBuf::default();
        let s = &mut SpareChunks::default();
        let mut offset = 0;
        for i in 0..16u8 {
            b.push_copy(offset, &[i; 16 * 1024], s);
            offset += 16 * 1024;
        }
        let mut frames = Vec::new();
        let mut got = Vec::new();
        while let Some((off, bytes)) = b.take(1 << 20) {
            assert_eq!(off, got.len() as u64, "in order, no gap");
            got.extend_from_slice(&bytes);
            frames.push(bytes.len());
        }
        assert_eq!(got.len(), 256 * 1024);
        assert!(got.chunks(16 * 1024).enumerate().all(|(i, w)| w.iter().all(|&x| x == i as u8)));
        // The first write takes a chunk its own size (nothing waited), the second one with room
        // for the 16 KiB waiting again; from then on the writes fill whole chunks of the
        // largest size, however they fall across them.
        assert_eq!(frames[..2], [16 * 1024, 32 * 1024]);
        assert_eq!(frames[2..], [COALESCE_CHUNK, COALESCE_CHUNK, COALESCE_CHUNK, 16 * 1024]);

        // A lone message still costs its own size.
        b.push_copy(offset, &[1; 3000], s);
        assert_eq!(b.chunks.back().map(|(_, c)| c.len()), Some(3000));
        let Some((_, Chunk::Open(c))) = b.chunks.back() else { panic!("an open chunk") };
        assert!(c.capacity() < 4096, "capacity {}", c.capacity());
    }

    #[test]
    fn what_was_sent_ends_at_the_first_byte_waiting_to_go() {
        let mut b = SendBuf::default();
        assert_eq!(b.sent_end(300), 300, "nothing waits: everything written was sent");
        // Two writers' chunks, committed out of offset order.
        b.push_frozen(200, Bytes::from(vec![1u8; 100]));
        b.push_frozen(100, Bytes::from(vec![2u8; 100]));
        assert_eq!(b.sent_end(300), 100);
        b.retransmit(40, Bytes::from(vec![3u8; 10]));
        assert_eq!(b.sent_end(300), 40, "bytes to send again were not delivered");
        b.clear();
        assert_eq!(b.sent_end(300), 300);
    }

    #[test]
    fn retransmissions_go_first() {
        let mut b = SendBuf::default();
        b.push_frozen(100, Bytes::from_static(b"new"));
        b.retransmit(10, Bytes::from_static(b"again"));
        assert_eq!(b.take(3).unwrap(), (10, Bytes::from_static(b"aga")));
        assert_eq!(b.take(30).unwrap(), (13, Bytes::from_static(b"in")));
        assert_eq!(b.take(30).unwrap(), (100, Bytes::from_static(b"new")));
        assert_eq!(b.bytes(), 0);
    }

    #[test]
    fn acknowledged_chunks_are_reused_within_the_limit() {
        let mut b = SendBuf::default();
        let s = &mut SpareChunks::default();
        b.push_copy(0, &[7; 4096], s);
        let (_, frame) = b.take(1 << 20).unwrap();
        let ptr = frame.as_ptr();
        s.give(frame, 64 * 1024);
        assert_eq!(s.bytes(), 4096);
        b.push_copy(4096, &[8; 4000], s);
        let (off, again) = b.take(1 << 20).unwrap();
        assert_eq!((off, again.len(), again[0]), (4096, 4000, 8));
        assert_eq!(again.as_ptr(), ptr, "the acknowledged chunk's memory, reused");
        assert_eq!(s.bytes(), 0);

        // Frames cut from one chunk: only the last reference gives the buffer back, whole.
        b.push_copy(8096, &[9; 4096], s);
        let (_, first) = b.take(1000).unwrap();
        let (_, rest) = b.take(1 << 20).unwrap();
        let start = first.as_ptr();
        s.give(first, 64 * 1024);
        assert_eq!(s.bytes(), 0, "a buffer still shared is not kept");
        s.give(rest, 64 * 1024);
        assert_eq!(s.bytes(), 4096);
        b.push_copy(12_192, &[1; 4096], s);
        assert_eq!(b.take(1 << 20).unwrap().1.as_ptr(), start);
        // A spare serves a need of its own class, not one far smaller.
        b.push_copy(16_288, &[1; 4096], s);
        let (_, f) = b.take(1 << 20).unwrap();
        s.give(f, 64 * 1024);
        b.push_copy(20_384, &[1; 10], s);
        assert_eq!(b.take(100).unwrap().1.len(), 10);
        assert_eq!(s.bytes(), 4096, "a 4 KiB spare left for a 10-byte write");
        b.push_copy(20_394, &[1; 3000], s);
        assert_eq!(b.take(1 << 20).unwrap().1.len(), 3000);
        assert_eq!(s.bytes(), 0, "taken for a 3,000-byte write");

        // The limit holds, and buffers not made by push_copy are never kept.
        let big: Vec<Bytes> = (0..8)
            .map(|i| {
                b.push_copy(30_000 + i * 4096, &[1; 4096], s);
                b.take(1 << 20).unwrap().1
            })
            .collect();
        for f in big {
            s.give(f, 16 * 1024);
        }
        assert_eq!(s.bytes(), 16 * 1024);
        s.give(Bytes::from_static(b"static"), 1 << 20);
        s.give(Bytes::from(vec![0u8; COALESCE_CHUNK + 1]), 1 << 20);
        assert_eq!(s.bytes(), 16 * 1024);
        s.trim(4096);
        assert_eq!(s.bytes(), 4096);
    }
}
