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

pub struct BufPool {
    free: Mutex<Vec<Vec<u8>>>,
    size: usize,
    max: usize,
}

impl BufPool {
    /// Buffers of `size` bytes; at most `max` are kept when idle.
    pub fn new(size: usize, max: usize) -> Arc<BufPool> {
        Arc::new(BufPool { free: Mutex::new(Vec::new()), size, max })
    }

    pub fn buffer_size(&self) -> usize {
        self.size
    }

    /// An empty buffer with room for `size` bytes.
    pub fn get(self: &Arc<Self>) -> PoolBuf {
        let buf = self.free.lock().pop().unwrap_or_else(|| Vec::with_capacity(self.size));
        PoolBuf { buf, pool: self.clone() }
    }

    /// Buffers idle in the pool.
    #[cfg(test)]
    pub fn idle(&self) -> usize {
        self.free.lock().len()
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
        if buf.capacity() != self.pool.size {
            return;
        }
        buf.clear();
        let mut free = self.pool.free.lock();
        if free.len() < self.pool.max {
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
        assert_eq!(pool.idle(), 0, "a slice still holds it");
        assert_eq!(&slice[..], &[2, 3]);
        drop(slice);
        assert_eq!(pool.idle(), 1);
        assert_eq!(pool.get().as_ptr(), ptr, "the same memory, reused");
        let (x, y, z) = (pool.get(), pool.get(), pool.get());
        drop((x, y, z));
        assert_eq!(pool.idle(), 2, "bounded");
    }
}
