//! The unsent bytes of one stream. Small writes are appended to the last chunk while it has
//! room, so many small messages leave as one frame; large writes arrive as their own chunk.
//! Bytes leave the buffer when a channel pulls them (`take`): the frame then shares the chunk's
//! memory (reference counted) until the peer acknowledges it, so memory follows the bytes held,
//! never the number of writes or frames.

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

    /// Copies `data` (stream bytes starting at `offset`) into the buffer.
    pub fn push_copy(&mut self, offset: u64, data: &[u8]) {
        if data.is_empty() {
            return;
        }
        self.bytes += data.len() as u64;
        if let Some((start, Chunk::Open(back))) = self.chunks.back_mut() {
            let contiguous = *start + back.len() as u64 == offset;
            if contiguous && back.capacity() - back.len() >= data.len() {
                back.extend_from_slice(data);
                return;
            }
        }
        let grow = (self.next_chunk as usize).max(FIRST_CHUNK);
        self.next_chunk = (grow * 2).min(COALESCE_CHUNK) as u32;
        let mut chunk = BytesMut::with_capacity(data.len().max(grow));
        chunk.extend_from_slice(data);
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
        for i in 0..100u64 {
            b.push_copy(i * 64, &[i as u8; 64]);
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
            b.push_copy(6400 + i * 64, &[1; 64]);
        }
        let (_, first) = b.take(1 << 20).unwrap();
        assert!(first.len() >= 1024, "chunks grow during a burst: {}", first.len());
        while b.take(1 << 20).is_some() {}
        assert!(b.chunks.is_empty(), "an emptied buffer holds no chunk");
        b.push_copy(6400 + 2000 * 64, b"x");
        let (_, x) = b.take(1).unwrap();
        assert_eq!(&x[..], b"x");
        assert!(b.take(10).is_none());
        b.push_copy(200_000, b"tail");
        assert_eq!(b.take(2).unwrap(), (200_000, Bytes::from_static(b"ta")));
        assert_eq!(b.take(9).unwrap(), (200_002, Bytes::from_static(b"il")));
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
}
