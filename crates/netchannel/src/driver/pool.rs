//! A bounded pool of frame buffers shared by an engine's senders, workers and readers.
//!
//! Without it every DATA frame is a fresh allocation just above glibc's mmap threshold: an
//! `mmap`, page faults that zero each page, and an `munmap`, per 128 KiB (measured as the top
//! user-triggered kernel cost of a stream before the pool existed).

use std::sync::Mutex;

pub struct BufferPool {
    free: Mutex<Vec<Vec<u8>>>,
    capacity: usize,
    max_buffers: usize,
}

impl BufferPool {
    /// Buffers of `capacity` bytes; at most `max_buffers` are kept when idle.
    pub fn new(capacity: usize, max_buffers: usize) -> Self {
        BufferPool { free: Mutex::new(Vec::new()), capacity, max_buffers }
    }

    /// An empty buffer able to hold `len` bytes.
    pub fn get(&self, len: usize) -> Vec<u8> {
        if len <= self.capacity {
            if let Some(v) = self.free.lock().unwrap_or_else(|e| e.into_inner()).pop() {
                return v;
            }
        }
        Vec::with_capacity(len.max(self.capacity))
    }

    /// Returns a buffer; dropped if the pool is full or the buffer is not pool-sized.
    pub fn put(&self, mut v: Vec<u8>) {
        if v.capacity() < self.capacity || v.capacity() > 2 * self.capacity {
            return;
        }
        v.clear();
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        if free.len() < self.max_buffers {
            free.push(v);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recycles_within_bounds() {
        let pool = BufferPool::new(100, 2);
        let a = pool.get(50);
        assert!(a.capacity() >= 100);
        let ptr = a.as_ptr();
        pool.put(a);
        let again = pool.get(10);
        assert_eq!(again.as_ptr(), ptr, "reused");
        let big = pool.get(1000);
        assert!(big.capacity() >= 1000);
        pool.put(big); // too large for the pool: dropped
        pool.put(Vec::with_capacity(100));
        pool.put(Vec::with_capacity(100));
        pool.put(Vec::with_capacity(100));
        assert_eq!(pool.free.lock().unwrap().len(), 2);
    }
}
