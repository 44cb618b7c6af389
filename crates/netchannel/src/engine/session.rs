//! A session is the set of channels between this engine and one peer engine, in one direction of
//! establishment (the dialing side owns the session; the accepting side mirrors it). Channels are
//! split by class: Latency-class streams never use Throughput channels, and the reverse.

use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::time::Duration;

use crate::driver::{Channel, ChannelQueues};
use crate::scheduler::{home_channel, Scheduler};
use crate::wire::{Class, Frame};

/// How long a sender blocked on full channels sleeps before re-checking, in case a wake-up was
/// missed (wake-ups are the normal path; this only bounds the damage of a lost one).
const SPACE_RECHECK: Duration = Duration::from_millis(20);

pub(crate) struct Session {
    pub peer_addr: SocketAddr,
    groups: RwLock<[Vec<Arc<ChannelQueues>>; 2]>,
    scheduler: Scheduler,
    threshold: u64,
    space_lock: Mutex<()>,
    space: Condvar,
    space_waiters: AtomicUsize,
    alive: AtomicBool,
    /// This engine dialed the session, so it can add channels.
    pub initiator: bool,
    /// Index the next added channel gets.
    pub next_index: AtomicU16,
    /// A channel is being added.
    pub growing: AtomicBool,
}

pub(crate) enum Wait {
    Block(Option<std::time::Instant>),
    NonBlocking,
}

impl Session {
    pub fn new(
        peer_addr: SocketAddr,
        scheduler: Scheduler,
        threshold: u64,
        initiator: bool,
        first_free_index: u16,
    ) -> Self {
        Session {
            initiator,
            next_index: AtomicU16::new(first_free_index),
            growing: AtomicBool::new(false),
            peer_addr,
            groups: RwLock::new([Vec::new(), Vec::new()]),
            scheduler,
            threshold,
            space_lock: Mutex::new(()),
            space: Condvar::new(),
            space_waiters: AtomicUsize::new(0),
            alive: AtomicBool::new(true),
        }
    }

    pub fn is_alive(&self) -> bool {
        self.alive.load(Ordering::SeqCst)
    }

    pub fn kill(&self) {
        self.alive.store(false, Ordering::SeqCst);
        self.notify_space();
    }

    /// Adds a channel; false if its index is already in use by an open channel.
    pub fn add_channel(&self, ch: Arc<ChannelQueues>) -> bool {
        let mut g = self.groups.write().unwrap_or_else(|e| e.into_inner());
        let index = ch.meta().index;
        if g.iter().flatten().any(|c| c.meta().index == index) {
            return false;
        }
        let class = ch.meta().class.index();
        g[class].push(ch);
        true
    }

    /// Removes a channel; returns how many remain.
    pub fn remove_channel(&self, index: u16) -> usize {
        let mut g = self.groups.write().unwrap_or_else(|e| e.into_inner());
        for group in g.iter_mut() {
            group.retain(|c| c.meta().index != index);
        }
        g.iter().map(Vec::len).sum()
    }

    pub fn channels(&self) -> Vec<Arc<ChannelQueues>> {
        let g = self.groups.read().unwrap_or_else(|e| e.into_inner());
        g.iter().flatten().cloned().collect()
    }

    pub fn class_count(&self, class: Class) -> usize {
        self.groups.read().unwrap_or_else(|e| e.into_inner())[class.index()].len()
    }

    pub fn channel_count(&self) -> usize {
        let g = self.groups.read().unwrap_or_else(|e| e.into_inner());
        g.iter().map(Vec::len).sum()
    }

    /// The group of a class; a class with no channels borrows the other one's, so a session
    /// dialed without latency channels still works.
    fn with_group<R>(&self, class: Class, f: impl FnOnce(&[Arc<ChannelQueues>]) -> R) -> R {
        let g = self.groups.read().unwrap_or_else(|e| e.into_inner());
        let own = &g[class.index()];
        if own.is_empty() {
            f(&g[1 - class.index()])
        } else {
            f(own)
        }
    }

    /// Queues a control frame on the stream's home channel; returns the channel index used.
    pub fn send_control(&self, stream_id: u32, class: Class, frame: Frame<'static>) -> Option<u16> {
        self.with_group(class, |group| {
            if group.is_empty() {
                return None;
            }
            let ch = &group[home_channel(stream_id, group.len())];
            ch.enqueue_control(frame).then(|| ch.meta().index)
        })
    }

    fn try_pick(&self, stream_id: u32, class: Class) -> Option<Arc<ChannelQueues>> {
        self.with_group(class, |group| {
            let mut loads = [0u64; 64];
            for (l, ch) in loads.iter_mut().zip(group) {
                *l = ch.queued_bytes();
            }
            let i = self.scheduler.pick(stream_id, &loads[..group.len().min(64)])?;
            Some(group[i].clone())
        })
    }

    /// Picks the channel for the next DATA chunk of a stream, waiting while every eligible
    /// channel is over the queue threshold (backpressure). `on_full` runs when they all are:
    /// the engine's cue to add a channel.
    pub fn pick_channel(
        &self,
        stream_id: u32,
        class: Class,
        wait: Wait,
        on_full: &dyn Fn(),
    ) -> io::Result<Arc<ChannelQueues>> {
        loop {
            // The common case first: one read of the channel set per chunk.
            if self.is_alive() {
                if let Some(ch) = self.try_pick(stream_id, class) {
                    return Ok(ch);
                }
            }
            if !self.is_alive() || self.channel_count() == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::ConnectionReset,
                    format!("all channels to {} are lost", self.peer_addr),
                ));
            }
            on_full();
            let deadline = match wait {
                Wait::NonBlocking => {
                    return Err(io::Error::new(io::ErrorKind::WouldBlock, "channels are full"))
                }
                Wait::Block(deadline) => deadline,
            };
            let mut pause = SPACE_RECHECK;
            if let Some(d) = deadline {
                let now = std::time::Instant::now();
                if now >= d {
                    return Err(io::Error::new(io::ErrorKind::TimedOut, "send timed out"));
                }
                pause = pause.min(d - now);
            }
            self.space_waiters.fetch_add(1, Ordering::SeqCst);
            let guard = self.space_lock.lock().unwrap_or_else(|e| e.into_inner());
            // Re-check under the lock the notifier takes, so a wake-up in between is not lost.
            if self.try_pick(stream_id, class).is_none() && self.is_alive() {
                let _ = self.space.wait_timeout(guard, pause);
            }
            self.space_waiters.fetch_sub(1, Ordering::SeqCst);
        }
    }

    /// Called by a worker after its queue drained below the threshold.
    pub fn space_freed(&self, queued: u64) {
        if queued < self.threshold && self.space_waiters.load(Ordering::SeqCst) > 0 {
            self.notify_space();
        }
    }

    fn notify_space(&self) {
        let _guard = self.space_lock.lock().unwrap_or_else(|e| e.into_inner());
        self.space.notify_all();
    }
}
