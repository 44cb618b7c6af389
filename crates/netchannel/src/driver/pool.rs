//! A bounded pool of large buffers for bulk bytes: the send buffer's chunks of large writes and
//! payloads the engine stages. A buffer becomes a `Bytes` (`Bytes::from_owner`), is sliced into
//! frames, and comes back to the pool when the last slice is dropped (the peer acknowledged the
//! frames, or the application read the payload). Without it, every large write or staged
//! payload is a fresh allocation beyond glibc's mmap threshold: page faults that zero it, and an
//! `madvise` that returns it (measured: 13% of a bulk stream's CPU).

use std::collections::VecDeque;
use std::ops::{Deref, DerefMut};
use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use parking_lot::Mutex;

/// Two sizes of buffer: `size` (a frame's largest payload), and a quarter of it for the end of
/// a write that does not fill one (a 64 KiB write held a whole 256 KiB buffer until the peer
/// acknowledged it: four times the memory in flight, and a pool that ran dry under 64 flows).
pub struct BufPool {
    /// Idle buffers by class: `[SMALL]` of `size / 4` bytes, `[LARGE]` of `size`.
    free: [Mutex<Vec<Vec<u8>>>; 2],
    /// Channel readers' staging buffers they let go while staged slices were still unread,
    /// oldest first: taken up again once those are read (at most `2 * max`, pinned or idle).
    retired: Mutex<VecDeque<BytesMut>>,
    size: usize,
    /// Idle buffers kept per class: `max` large ones and twice as many small ones, so that
    /// idle memory is at most one and a half times `max` large buffers.
    max: usize,
}

const SMALL: usize = 0;
const LARGE: usize = 1;

impl BufPool {
    /// Buffers of `size` bytes (and of a quarter of it); at most `max` large and `2 * max`
    /// small ones are kept when idle.
    pub fn new(size: usize, max: usize) -> Arc<BufPool> {
        Arc::new(BufPool {
            free: [Mutex::new(Vec::new()), Mutex::new(Vec::new())],
            retired: Mutex::new(VecDeque::new()),
            size,
            max,
        })
    }

    pub fn buffer_size(&self) -> usize {
        self.size
    }

    fn class_size(&self, class: usize) -> usize {
        if class == SMALL {
            (self.size / 4).max(1)
        } else {
            self.size
        }
    }

    fn class_max(&self, class: usize) -> usize {
        if class == SMALL {
            self.max * 2
        } else {
            self.max
        }
    }

    /// An empty buffer with room for `size` bytes.
    pub fn get(self: &Arc<Self>) -> PoolBuf {
        self.take(LARGE)
    }

    /// An empty buffer with room for `len` bytes (at most `size`): a small one when that is
    /// enough.
    pub fn get_for(self: &Arc<Self>, len: usize) -> PoolBuf {
        self.take(if len <= self.class_size(SMALL) { SMALL } else { LARGE })
    }

    fn take(self: &Arc<Self>, class: usize) -> PoolBuf {
        let buf = self.free[class]
            .lock()
            .pop()
            .unwrap_or_else(|| Vec::with_capacity(self.class_size(class)));
        PoolBuf { buf, pool: self.clone() }
    }

    /// Staging buffers retired and not yet taken up again.
    #[cfg(test)]
    pub(crate) fn retired_len(&self) -> usize {
        self.retired.lock().len()
    }

    /// Buffers idle in the pool, small and large.
    #[cfg(test)]
    pub fn idle(&self) -> (usize, usize) {
        (self.free[SMALL].lock().len(), self.free[LARGE].lock().len())
    }
}

/// A buffer from the pool; goes back when dropped.
pub struct PoolBuf {
    buf: Vec<u8>,
    pool: Arc<BufPool>,
}

impl PoolBuf {
    /// Shares the buffer as `Bytes`; it returns to the pool when the last slice is dropped.
    pub fn freeze(self) -> Bytes {
        Bytes::from_owner(self)
    }
}

impl Deref for PoolBuf {
    type Target = Vec<u8>;
    fn deref(&self) -> &Vec<u8> {
        &self.buf
    }
}

impl DerefMut for PoolBuf {
    fn deref_mut(&mut self) -> &mut Vec<u8> {
        &mut self.buf
    }
}

impl AsMut<Vec<u8>> for PoolBuf {
    fn as_mut(&mut self) -> &mut Vec<u8> {
        &mut self.buf
    }
}

/// Retired staging buffers looked at per `staging` call: the oldest are the likeliest to be
/// free, and a buffer still held by a slow reader's slices must not make each call walk all.
const RETIRED_LOOKS: usize = 8;

/// Channel readers stage payloads into pooled buffers, and their staging buffers come back.
impl crate::proto::framing::Buffers for Arc<BufPool> {
    type Buf = PoolBuf;
    fn get(&self) -> PoolBuf {
        BufPool::get(self)
    }

    fn staging(&self, min: usize) -> BytesMut {
        let mut retired = self.retired.lock();
        for _ in 0..RETIRED_LOOKS.min(retired.len()) {
            let mut buf = retired.pop_front().expect("counted");
            // Its whole allocation once no slice is left, or room of its own already.
            let room = crate::proto::reclaim_whole(&mut buf) || buf.try_reclaim(min);
            if room && buf.capacity() >= min {
                return buf;
            }
            retired.push_back(buf);
        }
        drop(retired);
        BytesMut::with_capacity(min.max(crate::proto::framing::READ_SIZE))
    }

    fn retire(&self, buf: BytesMut) {
        let mut retired = self.retired.lock();
        if retired.len() >= 2 * self.max {
            // Bounded: the oldest is freed once its slices are read.
            retired.pop_front();
        }
        retired.push_back(buf);
    }
}

impl AsRef<[u8]> for PoolBuf {
    fn as_ref(&self) -> &[u8] {
        &self.buf
    }
}

impl Drop for PoolBuf {
    fn drop(&mut self) {
        let mut buf = std::mem::take(&mut self.buf);
        let Some(class) =
            [SMALL, LARGE].into_iter().find(|&c| self.pool.class_size(c) == buf.capacity())
        else {
            return;
        };
        buf.clear();
        let mut free = self.pool.free[class].lock();
        if free.len() < self.pool.class_max(class) {
            free.push(buf);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_come_back_when_the_last_slice_is_dropped() {
        let pool = BufPool::new(1024, 2);
        let mut b = pool.get();
        b.extend_from_slice(&[1, 2, 3, 4]);
        let ptr = b.as_ptr();
        let bytes = b.freeze();
        let slice = bytes.slice(1..3);
        drop(bytes);
        assert_eq!(pool.idle(), (0, 0), "a slice still holds it");
        assert_eq!(&slice[..], &[2, 3]);
        drop(slice);
        assert_eq!(pool.idle(), (0, 1));
        assert_eq!(pool.get().as_ptr(), ptr, "the same memory, reused");
        let (x, y, z) = (pool.get(), pool.get(), pool.get());
        drop((x, y, z));
        assert_eq!(pool.idle(), (0, 2), "bounded");
    }

    #[test]
    fn a_staging_buffer_let_go_while_pinned_is_taken_up_again_once_its_slices_are_read() {
        use crate::proto::framing::{Buffers, FrameReader, Parsed, READ_SIZE};
        use crate::wire::Frame;
        let pool = BufPool::new(1024, 1);
        let mut r = FrameReader::new(1 << 20, pool.clone());
        let mut frame = Vec::new();
        Frame::Data { stream: 1, offset: 0, payload: &[7u8; 60_000] }.encode(&mut frame);
        // Fill the first staging buffer with frames whose payloads stay unread (pinned), and
        // end it with the first half of one more frame.
        let first = r.buffer(READ_SIZE).as_ptr();
        let mut held = Vec::new();
        let mut out = Vec::new();
        loop {
            if r.room() < frame.len() + 100 {
                break;
            }
            r.buffer(frame.len()).extend_from_slice(&frame);
            r.parse(&mut out, usize::MAX).unwrap();
            held.append(&mut out);
        }
        assert!(held.len() >= 2);
        r.buffer(frame.len()).extend_from_slice(&frame[..100]);
        // No room for a whole read: a new buffer takes the half frame.
        let b = r.buffer(READ_SIZE);
        let end_of_first = first.wrapping_add(held.len() * frame.len());
        assert_ne!(b.as_ptr(), end_of_first.wrapping_add(100), "a fresh buffer");
        assert_eq!(&b[..], &frame[..100], "what was left to parse came along");
        let second = b.as_ptr();
        b.extend_from_slice(&frame[100..]);
        r.parse(&mut out, usize::MAX).unwrap();
        assert!(matches!(&out[..], [Parsed::Data { payload, .. }] if payload[..] == [7u8; 60_000]));
        // The first buffer is retired, not freed: while its slices are held it cannot be
        // taken up; once they are read, the next buffer the reader needs is that memory.
        assert_eq!(pool.retired_len(), 1);
        let mut again = Buffers::staging(&pool, READ_SIZE);
        assert_ne!(again.as_ptr(), first, "still pinned");
        again.clear();
        Buffers::retire(&pool, again);
        drop(held);
        let reused = Buffers::staging(&pool, READ_SIZE);
        // (The reader's reads started up to 63 bytes into it: `copy::clear_of_page_start`.)
        let reused_at = reused.as_ptr().addr();
        assert!(
            (reused_at..reused_at + 64).contains(&first.addr()),
            "the first buffer's memory, taken up again"
        );
        assert!(reused.capacity() >= READ_SIZE && reused.is_empty());
        drop((out, second));
        // Bounded: at most twice `max` retired buffers are kept.
        for _ in 0..5 {
            Buffers::retire(&pool, BytesMut::with_capacity(16));
        }
        assert_eq!(pool.retired_len(), 2);
    }

    #[test]
    fn the_end_of_a_write_takes_a_small_buffer_and_each_size_comes_back_to_its_own() {
        let pool = BufPool::new(1024, 1);
        let small = pool.get_for(256);
        assert_eq!(small.capacity(), 256);
        let large = pool.get_for(257);
        assert_eq!(large.capacity(), 1024);
        let (small_ptr, large_ptr) = (small.as_ptr(), large.as_ptr());
        drop((small, large));
        assert_eq!(pool.idle(), (1, 1));
        assert_eq!(pool.get_for(10).as_ptr(), small_ptr);
        assert_eq!(pool.get().as_ptr(), large_ptr);
        // A buffer that grew past its class is not kept (this one was the idle small one).
        let mut grown = pool.get_for(1);
        grown.extend_from_slice(&[0u8; 300]);
        drop(grown);
        assert_eq!(pool.idle(), (0, 1));
        let smalls: Vec<_> = (0..4).map(|_| pool.get_for(1)).collect();
        drop(smalls);
        assert_eq!(pool.idle(), (2, 1), "twice as many small ones as large ones are kept");
    }
}
