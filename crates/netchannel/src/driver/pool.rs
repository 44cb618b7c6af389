//! A bounded pool of large buffers for bulk bytes: the send buffer's chunks of large writes and
//! payloads the engine stages. A buffer becomes a `Bytes` (`Bytes::from_owner`), is sliced into
//! frames, and comes back to the pool when the last slice is dropped (the peer acknowledged the
//! frames, or the application read the payload). Without it, every large write or staged
//! payload is a fresh allocation beyond glibc's mmap threshold: page faults that zero it, and an
//! `madvise` that returns it (measured: 13% of a bulk stream's CPU).

use std::ops::{Deref, DerefMut};
use std::sync::Arc;

use bytes::Bytes;
use parking_lot::Mutex;

/// Two sizes of buffer: `size` (a frame's largest payload), and a quarter of it for the end of
/// a write that does not fill one (a 64 KiB write held a whole 256 KiB buffer until the peer
/// acknowledged it: four times the memory in flight, and a pool that ran dry under 64 flows).
pub struct BufPool {
    /// Idle buffers by class: `[SMALL]` of `size / 4` bytes, `[LARGE]` of `size`.
    free: [Mutex<Vec<Vec<u8>>>; 2],
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
        Arc::new(BufPool { free: [Mutex::new(Vec::new()), Mutex::new(Vec::new())], size, max })
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

/// Channel readers stage payloads into pooled buffers.
impl crate::proto::framing::Buffers for Arc<BufPool> {
    type Buf = PoolBuf;
    fn get(&self) -> PoolBuf {
        BufPool::get(self)
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
