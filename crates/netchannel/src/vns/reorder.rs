//! The receive buffer of one virtual socket: puts DATA that arrived over several channels back in
//! order. Pure data structure, no I/O.
//!
//! Each byte of a stream is sent exactly once (channels are reliable), so any overlap with bytes
//! already held or delivered is a protocol violation rather than a retransmission to trim.
//! Memory is bounded by the caller (the credit window caps `offset + len`) and by
//! `max_segments`, which caps the bookkeeping a peer can force with tiny out-of-order frames.

use std::collections::{BTreeMap, VecDeque};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReorderError {
    /// The range overlaps bytes already received.
    Overlap,
    /// Too many out-of-order segments held at once.
    TooManySegments,
}

struct Segment {
    data: Vec<u8>,
    read: usize,
}

pub struct RecvBuffer {
    /// Offset of the first byte not yet in `ready`.
    next: u64,
    ready: VecDeque<Segment>,
    ready_bytes: usize,
    out_of_order: BTreeMap<u64, Vec<u8>>,
    out_of_order_bytes: usize,
    max_segments: usize,
}

impl RecvBuffer {
    pub fn new(max_segments: usize) -> Self {
        RecvBuffer {
            next: 0,
            ready: VecDeque::new(),
            ready_bytes: 0,
            out_of_order: BTreeMap::new(),
            out_of_order_bytes: 0,
            max_segments,
        }
    }

    /// Offset up to which bytes are contiguous (delivered or ready to read).
    pub fn contiguous_end(&self) -> u64 {
        self.next
    }

    pub fn ready_bytes(&self) -> usize {
        self.ready_bytes
    }

    /// Bytes held: ready plus out of order.
    pub fn buffered_bytes(&self) -> usize {
        self.ready_bytes + self.out_of_order_bytes
    }

    /// Inserts `data` at stream `offset`. Returns the number of bytes that became readable.
    pub fn insert(&mut self, offset: u64, data: Vec<u8>) -> Result<usize, ReorderError> {
        let len = data.len() as u64;
        if len == 0 {
            return Ok(0);
        }
        if offset < self.next {
            return Err(ReorderError::Overlap);
        }
        let end = offset.checked_add(len).ok_or(ReorderError::Overlap)?;
        if offset > self.next {
            if let Some((&start, seg)) = self.out_of_order.range(..=offset).next_back() {
                if start + seg.len() as u64 > offset {
                    return Err(ReorderError::Overlap);
                }
            }
            if let Some((&start, _)) = self.out_of_order.range(offset..).next() {
                if start < end {
                    return Err(ReorderError::Overlap);
                }
            }
            if self.out_of_order.len() >= self.max_segments {
                return Err(ReorderError::TooManySegments);
            }
            self.out_of_order_bytes += data.len();
            self.out_of_order.insert(offset, data);
            return Ok(0);
        }
        // In order: the following out-of-order segment must not start inside this one.
        if let Some((&start, _)) = self.out_of_order.iter().next() {
            if start < end {
                return Err(ReorderError::Overlap);
            }
        }
        let before = self.ready_bytes;
        self.push_ready(data);
        while let Some(entry) = self.out_of_order.first_entry() {
            if *entry.key() != self.next {
                break;
            }
            let seg = entry.remove();
            self.out_of_order_bytes -= seg.len();
            self.push_ready(seg);
        }
        Ok(self.ready_bytes - before)
    }

    fn push_ready(&mut self, data: Vec<u8>) {
        self.next += data.len() as u64;
        self.ready_bytes += data.len();
        self.ready.push_back(Segment { data, read: 0 });
    }

    /// Copies ready bytes into `buf`; returns how many. Emptied segments go to `recycle`.
    pub fn read(&mut self, buf: &mut [u8], recycle: &mut dyn FnMut(Vec<u8>)) -> usize {
        let mut copied = 0;
        while copied < buf.len() {
            let Some(seg) = self.ready.front_mut() else {
                break;
            };
            let avail = &seg.data[seg.read..];
            let n = avail.len().min(buf.len() - copied);
            buf[copied..copied + n].copy_from_slice(&avail[..n]);
            copied += n;
            seg.read += n;
            if seg.read == seg.data.len() {
                if let Some(done) = self.ready.pop_front() {
                    recycle(done.data);
                }
            }
        }
        self.ready_bytes -= copied;
        copied
    }

    /// Drops everything held (on reset or close with unread data); returns the bytes dropped.
    pub fn clear(&mut self) -> usize {
        let dropped = self.buffered_bytes();
        self.ready.clear();
        self.out_of_order.clear();
        self.ready_bytes = 0;
        self.out_of_order_bytes = 0;
        dropped
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn in_order_and_gap_filling() {
        let mut rb = RecvBuffer::new(16);
        assert_eq!(rb.insert(3, vec![3, 4]).unwrap(), 0);
        assert_eq!(rb.insert(0, vec![0, 1, 2]).unwrap(), 5);
        let mut out = [0u8; 8];
        assert_eq!(rb.read(&mut out, &mut drop), 5);
        assert_eq!(&out[..5], &[0, 1, 2, 3, 4]);
        assert_eq!(rb.contiguous_end(), 5);
    }

    #[test]
    fn overlaps_are_refused() {
        let mut rb = RecvBuffer::new(16);
        rb.insert(0, vec![0; 4]).unwrap();
        assert_eq!(rb.insert(2, vec![0; 4]), Err(ReorderError::Overlap));
        rb.insert(10, vec![0; 4]).unwrap();
        assert_eq!(rb.insert(12, vec![0; 1]), Err(ReorderError::Overlap));
        assert_eq!(rb.insert(8, vec![0; 3]), Err(ReorderError::Overlap));
        assert_eq!(rb.insert(4, vec![0; 7]), Err(ReorderError::Overlap));
        rb.insert(8, vec![0; 2]).unwrap();
    }

    #[test]
    fn segment_limit() {
        let mut rb = RecvBuffer::new(2);
        rb.insert(10, vec![1]).unwrap();
        rb.insert(20, vec![1]).unwrap();
        assert_eq!(rb.insert(30, vec![1]), Err(ReorderError::TooManySegments));
    }

    /// Splits `total` bytes into segments, shuffles them and checks exact in-order delivery.
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
            read_size in 1usize..512,
        ) {
            let segs = split_and_shuffle(total, &cuts, &order);
            let mut rb = RecvBuffer::new(1024);
            let mut out = Vec::new();
            let mut buf = vec![0u8; read_size];
            for (off, data) in segs {
                rb.insert(off, data).unwrap();
                let n = rb.read(&mut buf, &mut drop);
                out.extend_from_slice(&buf[..n]);
            }
            loop {
                let n = rb.read(&mut buf, &mut drop);
                if n == 0 { break; }
                out.extend_from_slice(&buf[..n]);
            }
            let expected: Vec<u8> = (0..total).map(|i| (i * 31 % 251) as u8).collect();
            prop_assert_eq!(out, expected);
            prop_assert_eq!(rb.buffered_bytes(), 0);
            prop_assert_eq!(rb.contiguous_end(), total as u64);
        }
    }
}
