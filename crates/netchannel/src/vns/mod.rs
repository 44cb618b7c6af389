//! VNS: virtual sockets, the application's side. They only buffer and order application data
//! (in the session core); which channel carries a byte is the scheduler's business, how it
//! travels the driver's.
//!
//! - [`socket`]: the application API (`VSocket`, `Listener`).
//! - [`poller`]: readiness of many sockets through one waiter (tokens, edge-triggered).
//!
//! This module also holds what the runtime keeps with each stream in the core: who waits on it.

pub mod poller;
pub mod socket;

use std::sync::Arc;

use crate::engine::waiter::Waiter;
use crate::proto::{EV_READ, EV_WRITE};
use poller::PollEntry;

/// What the runtime keeps with each stream in the session core: the threads blocked on it and
/// its poller registration. An idle stream with neither costs 32 bytes here.
#[derive(Default)]
pub(crate) struct StreamUser {
    /// Threads blocked on the stream, with the `EV_*` bits they wait for.
    waiters: Vec<(Arc<Waiter>, u8)>,
    pub poll: Option<Arc<PollEntry>>,
}

impl StreamUser {
    pub fn add_waiter(&mut self, w: &Arc<Waiter>, interest: u8) {
        match self.waiters.iter_mut().find(|(x, _)| Arc::ptr_eq(x, w)) {
            Some((_, i)) => *i |= interest,
            None => self.waiters.push((w.clone(), interest)),
        }
    }

    pub fn remove_waiter(&mut self, w: &Arc<Waiter>) {
        self.waiters.retain(|(x, _)| !Arc::ptr_eq(x, w));
        if self.waiters.is_empty() {
            self.waiters = Vec::new(); // give the memory back: idle streams stay small
        }
    }

    /// Whether a large payload for this stream should stay in the socket for its reader to read
    /// straight into its buffer: only when the reader is at hand (the current thread is it, in
    /// `recv` or in `wait` on the stream's poller) or is blocked in `recv` on this stream. A
    /// deferred payload holds up its channel until read: left for an event loop elsewhere, even
    /// one that sleeps and would come within a wake-up, it stalls every other stream of the
    /// channel meanwhile (measured: all-to-all over 64 streams lost a fifth of its goodput).
    pub fn reader_at_hand(&self) -> bool {
        self.waiters.iter().any(|(_, interest)| interest & EV_READ != 0)
            || self.poll.as_ref().is_some_and(|p| p.polled_by_current_thread())
    }

    /// Collects who must be told about `bits`.
    pub fn wakes(&self, bits: u8, wakes: &mut Wakes) {
        for (w, interest) in &self.waiters {
            if interest & bits != 0 {
                wakes.threads.push(w.clone());
            }
        }
        if bits & (EV_READ | EV_WRITE) != 0 {
            if let Some(p) = &self.poll {
                wakes.polls.push(p.clone());
            }
        }
    }
}

/// Wake-ups collected under the session lock and delivered after it is released (a wake-up is
/// a system call; none is made while holding the lock).
#[derive(Default)]
pub(crate) struct Wakes {
    pub threads: Vec<Arc<Waiter>>,
    pub polls: Vec<Arc<PollEntry>>,
    pub listeners: Vec<Arc<socket::ListenerShared>>,
}

impl Wakes {
    pub fn fire(&mut self) {
        for w in self.threads.drain(..) {
            w.notify();
        }
        for p in self.polls.drain(..) {
            p.notify();
        }
        for l in self.listeners.drain(..) {
            l.notify();
        }
    }
}

impl Drop for Wakes {
    fn drop(&mut self) {
        self.fire();
    }
}
