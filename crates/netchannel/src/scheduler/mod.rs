//! NetScheduler: where the channel for each chunk of a virtual socket's data is picked.
//!
//! Channels *pull*: when a channel can write, it asks for the next chunks, and the scheduler
//! says whose. Streams with unsent bytes wait in active queues (an O(1) active list, never a
//! scan over all streams):
//! - `RoundRobin`: one queue per class shared by every channel of the class; a stream gets at
//!   most one chunk (`max_frame_payload`) per turn, then goes to the back, so many streams share
//!   channels fairly and one stream's chunks spread over every channel that has room.
//! - `Sticky`: a stream id hashes to one channel (its *home*), so its bytes never need
//!   reordering.
//!
//! Under `RoundRobin` a stream that sends little at a time (messages, not a backlog) keeps to
//! a home channel of its own too, when the session gives it one (`push`'s `home`): the
//! channel its application thread serves, so that the answer comes back where that thread
//! waits and wakes it, not a thread that then hands the answer over (`Session::home`).
//!
//! A channel whose kernel socket is full simply does not pull (backpressure); the class's unsent
//! bytes are bounded by `channel_queue_threshold` per channel, and senders wait beyond that.

use std::collections::VecDeque;

use crate::wire::Class;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
/// How a stream's chunks are spread over the channels of its class.
pub enum Policy {
    #[default]
    /// One queue per class: a chunk per turn, on whichever channel has room.
    RoundRobin,
    /// A stream keeps to one home channel (its bytes never need reordering).
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

/// Index (within `channels` candidates) of a stream's home channel.
pub fn home_channel(stream_id: u64, channels: usize) -> usize {
    debug_assert!(channels > 0);
    // Fibonacci hashing spreads consecutive dense ids evenly.
    let h = stream_id.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32;
    (h as usize) % channels
}

/// Streams with unsent bytes, by where they may go next. `S` is the session's stream id and
/// `C` its channel index: the scheduler only copies them, hashes stream ids (`Into<u64>`, for
/// the sticky policy) and indexes its per-channel queues by channel (`Into<usize>`).
pub struct ActiveQueues<S, C> {
    policy: Policy,
    by_class: [VecDeque<S>; 2],
    by_channel: Vec<VecDeque<S>>,
    channel: std::marker::PhantomData<C>,
}

impl<S: Copy + Into<u64>, C: Copy + Into<usize>> ActiveQueues<S, C> {
    pub fn new(policy: Policy, channels: usize) -> Self {
        ActiveQueues {
            policy,
            by_class: [VecDeque::new(), VecDeque::new()],
            by_channel: (0..channels).map(|_| VecDeque::new()).collect(),
            channel: std::marker::PhantomData,
        }
    }

    /// A stream of `class` got unsent bytes; `serving` are the channels that carry its class,
    /// `home` the one it keeps to for now, if any (round-robin only). Returns the one channel
    /// that may carry it, if only one may (the runtime must make that channel write).
    pub fn push(&mut self, id: S, class: Class, serving: &[C], home: Option<C>) -> Option<C> {
        let ch = if self.policy == Policy::Sticky && !serving.is_empty() {
            serving[home_channel(id.into(), serving.len())]
        } else if let Some(ch) = home {
            ch
        } else {
            self.by_class[class.index()].push_back(id);
            return None;
        };
        self.by_channel[ch.into()].push_back(id);
        Some(ch)
    }

    /// The next stream channel `ch` should carry a chunk of, among the classes it serves.
    pub fn pop(&mut self, ch: C, served: &[Class]) -> Option<S> {
        if let Some(id) = self.by_channel[ch.into()].pop_front() {
            return Some(id);
        }
        served.iter().find_map(|k| self.by_class[k.index()].pop_front())
    }

    /// A stream that got a chunk on `ch` and has more: to the back of its queue (`home`: as
    /// in `push`).
    pub fn requeue(&mut self, id: S, ch: C, class: Class, home: Option<C>) -> Option<C> {
        let ch = match (self.policy, home) {
            (Policy::Sticky, _) => ch,
            (Policy::RoundRobin, Some(h)) => h,
            (Policy::RoundRobin, None) => {
                self.by_class[class.index()].push_back(id);
                return None;
            }
        };
        self.by_channel[ch.into()].push_back(id);
        Some(ch)
    }

    /// Channel `ch` is gone: the streams homed on it, to be pushed again.
    pub fn take_channel(&mut self, ch: C) -> Vec<S> {
        self.by_channel[ch.into()].drain(..).collect()
    }

    /// Whether streams wait that only channel `ch` may carry.
    pub fn has_own_work(&self, ch: C) -> bool {
        !self.by_channel[ch.into()].is_empty()
    }

    /// Whether streams of `class` wait that any of its channels may carry.
    pub fn has_shared_work(&self, class: Class) -> bool {
        !self.by_class[class.index()].is_empty()
    }

    pub fn has_work(&self, ch: C, served: &[Class]) -> bool {
        self.has_own_work(ch) || served.iter().any(|&k| self.has_shared_work(k))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_robin_shares_one_queue_per_class() {
        let mut q = ActiveQueues::<u64, usize>::new(Policy::RoundRobin, 4);
        q.push(1, Class::Throughput, &[0usize, 1], None);
        q.push(2, Class::Throughput, &[0, 1], None);
        q.push(3, Class::Latency, &[2], None);
        assert_eq!(q.pop(1, &[Class::Throughput]), Some(1));
        q.requeue(1, 1, Class::Throughput, None);
        assert_eq!(q.pop(0, &[Class::Throughput]), Some(2));
        assert_eq!(q.pop(0, &[Class::Throughput]), Some(1), "back of the queue, any channel");
        assert_eq!(q.pop(0, &[Class::Throughput]), None, "never another class's streams");
        assert_eq!(q.pop(2, &[Class::Latency]), Some(3));
    }

    #[test]
    fn sticky_keeps_a_stream_on_its_home_channel() {
        let mut q = ActiveQueues::<u64, usize>::new(Policy::Sticky, 4);
        q.push(42, Class::Throughput, &[0usize, 1, 3], None);
        let home = [0usize, 1, 3][home_channel(42, 3)];
        for ch in [0usize, 1, 3].into_iter().filter(|&c| c != home) {
            assert_eq!(q.pop(ch, &[Class::Throughput]), None);
        }
        assert_eq!(q.pop(home, &[Class::Throughput]), Some(42));
        q.requeue(42, home, Class::Throughput, None);
        assert_eq!(q.take_channel(home), vec![42]);
    }

    #[test]
    fn round_robin_keeps_a_homed_stream_to_its_home() {
        let mut q = ActiveQueues::<u64, usize>::new(Policy::RoundRobin, 4);
        q.push(7, Class::Throughput, &[0usize, 1, 2], Some(2));
        q.push(8, Class::Throughput, &[0usize, 1, 2], None);
        assert_eq!(q.pop(0, &[Class::Throughput]), Some(8), "only unhomed streams elsewhere");
        assert_eq!(q.pop(0, &[Class::Throughput]), None);
        assert_eq!(q.pop(2, &[Class::Throughput]), Some(7));
        q.requeue(7, 2, Class::Throughput, Some(1));
        assert!(!q.has_work(2, &[Class::Throughput]));
        assert_eq!(q.pop(1, &[Class::Throughput]), Some(7), "a new home takes it");
        q.requeue(7, 1, Class::Throughput, None);
        assert_eq!(q.pop(0, &[Class::Throughput]), Some(7), "a backlog goes to any channel");
    }

    #[test]
    fn home_channels_spread_dense_ids() {
        let mut counts = [0usize; 4];
        for id in 0..4000u64 {
            counts[home_channel((1 << 24) | id, 4)] += 1;
        }
        assert!(counts.iter().all(|&c| c > 800), "{counts:?}");
    }
}
