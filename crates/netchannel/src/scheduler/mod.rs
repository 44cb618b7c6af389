//! NetScheduler: where the channel for each chunk of a virtual socket's data is picked.
//!
//! Pure decisions over channel loads; the engine applies them. Policies:
//! - `RoundRobin`: successive chunks go to successive channels of the socket's class, skipping
//!   any channel whose queued bytes exceed the threshold (default 2 MiB, as in the paper).
//! - `Sticky`: a stream id hashes to one channel, so its bytes never need reordering.
//!
//! Control frames of a stream (SYN, FIN, CREDIT, RST) always go to its *home* channel, the one
//! `Sticky` would pick, so they stay in order relative to each other.

use std::sync::atomic::{AtomicUsize, Ordering};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Policy {
    #[default]
    RoundRobin,
    Sticky,
}

impl std::str::FromStr for Policy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "round-robin" => Ok(Policy::RoundRobin),
            "sticky" => Ok(Policy::Sticky),
            other => Err(format!("unknown policy '{other}' (expected round-robin or sticky)")),
        }
    }
}

impl std::fmt::Display for Policy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Policy::RoundRobin => "round-robin",
            Policy::Sticky => "sticky",
        })
    }
}

/// Index of the channel a stream's control frames (and, under `Sticky`, its data) use.
pub fn home_channel(stream_id: u32, channels: usize) -> usize {
    debug_assert!(channels > 0);
    // Fibonacci hashing spreads consecutive dense ids evenly.
    let h = (stream_id as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32;
    (h as usize) % channels
}

pub struct Scheduler {
    policy: Policy,
    threshold: u64,
    cursor: AtomicUsize,
}

impl Scheduler {
    pub fn new(policy: Policy, threshold: u64) -> Self {
        Scheduler { policy, threshold, cursor: AtomicUsize::new(0) }
    }

    pub fn policy(&self) -> Policy {
        self.policy
    }

    /// Picks a channel among `loads.len()` candidates (queued bytes of each), or `None` when
    /// every eligible channel is over the threshold: the caller then waits (backpressure).
    pub fn pick(&self, stream_id: u32, loads: &[u64]) -> Option<usize> {
        let n = loads.len();
        if n == 0 {
            return None;
        }
        match self.policy {
            Policy::Sticky => {
                let i = home_channel(stream_id, n);
                (loads[i] < self.threshold).then_some(i)
            }
            Policy::RoundRobin => {
                let start = self.cursor.fetch_add(1, Ordering::Relaxed);
                (0..n).map(|k| (start + k) % n).find(|&i| loads[i] < self.threshold)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_robin_rotates_and_skips_full_channels() {
        let s = Scheduler::new(Policy::RoundRobin, 100);
        let picks: Vec<_> = (0..4).map(|_| s.pick(1, &[0, 0, 0, 0]).unwrap()).collect();
        assert_eq!(picks, vec![0, 1, 2, 3]);
        for _ in 0..8 {
            assert_ne!(s.pick(1, &[0, 100, 0, 500]), Some(1));
        }
        assert_eq!(s.pick(1, &[100, 100]), None);
    }

    #[test]
    fn sticky_keeps_a_stream_on_one_channel() {
        let s = Scheduler::new(Policy::Sticky, 100);
        let first = s.pick(42, &[0; 4]).unwrap();
        for _ in 0..10 {
            assert_eq!(s.pick(42, &[0; 4]), Some(first));
        }
        let mut loads = [0; 4];
        loads[first] = 100;
        assert_eq!(s.pick(42, &loads), None, "sticky waits rather than reorders");
    }

    #[test]
    fn home_channels_spread_dense_ids() {
        let mut counts = [0usize; 4];
        for id in 0..4000 {
            counts[home_channel(id, 4)] += 1;
        }
        assert!(counts.iter().all(|&c| c > 800), "{counts:?}");
    }
}
