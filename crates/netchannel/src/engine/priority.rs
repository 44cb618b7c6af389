//! Isolation by *when* work runs: an application thread that does throughput-class work (writes a
//! bulk backlog to a channel, reads a payload straight from one, or blocks in `recv`/`send` of a
//! throughput socket while serving channels) does it at the throughput workers' scheduling
//! policy; latency-class work always runs at the thread's own priority.
//!
//! `AppDemotion::Sticky` (the default): a thread stays demoted from its first throughput-class
//! call until it does latency-class work or isolation ends, its own work included, and is then
//! demoted per call. `AppDemotion::PerCall`: put back the moment each call returns (the copies
//! into and out of the engine and the channel work inside a `Poller::wait` not demoted). Per
//! call gives an L-app that waits on its answers the best tail, but every putting back
//! re-weights the thread, and an L-app that sleeps on a timer between requests then waited up
//! to half a second for a core behind the T-apps' threads (docs/BENCHMARKS.md, "Cores: 1 to 16
//! application threads, and session shards").
//!
//! Putting a thread back needs the right to raise its priority again (CAP_SYS_NICE, or an
//! RLIMIT_NICE that allows it). Without it the engine never demotes application threads (it
//! could not undo it), and `EngineStats::app_threads_demoted` says so.

use std::cell::Cell;

use crate::sys::{self, ThreadPolicy};
use crate::wire::Class;

thread_local! {
    /// This thread is demoted now (by an outer guard, or sticky).
    static DEMOTED: Cell<bool> = const { Cell::new(false) };
    /// `AppDemotion::Sticky`: what to put back, while this thread stays demoted between calls.
    static STICKY: Cell<Option<sys::Schedule>> = const { Cell::new(None) };
    /// This thread did latency-class work: its throughput work is demoted per call only.
    static LATENCY_SEEN: Cell<bool> = const { Cell::new(false) };
}

/// Puts a thread left demoted (`AppDemotion::Sticky`) back to its own scheduling.
fn end_sticky() {
    if let Some(before) = STICKY.take() {
        let _ = sys::restore_thread_schedule(before);
        DEMOTED.set(false);
    }
}

/// Whether this process may demote an application thread and put it back. Tried once, on a
/// scratch thread (its scheduling is its own).
pub(crate) fn can_demote(policy: ThreadPolicy) -> bool {
    if policy == ThreadPolicy::Normal {
        return false;
    }
    std::thread::spawn(move || match sys::demote_thread(policy) {
        Ok(Some(before)) => sys::restore_thread_schedule(before).is_ok(),
        _ => false,
    })
    .join()
    .unwrap_or(false)
}

/// While it lives, the calling thread runs at `policy` (if `class` is throughput-class and the
/// engine demotes application threads); dropping it restores the thread's own scheduling.
pub(crate) struct Demoted(Option<sys::Schedule>);

impl Demoted {
    /// `sticky`: `AppDemotion::Sticky` (the thread stays demoted after the call, until it
    /// does latency-class work or isolation ends: `enabled` false).
    pub fn enter(enabled: bool, sticky: bool, policy: ThreadPolicy, class: Class) -> Demoted {
        if class == Class::Latency {
            LATENCY_SEEN.set(true);
        }
        if !enabled || class != Class::Throughput {
            end_sticky();
            return Demoted(None);
        }
        if DEMOTED.get() {
            return Demoted(None);
        }
        // A real-time thread (or one already idle) is left as it is.
        let Ok(Some(before)) = sys::demote_thread(policy) else { return Demoted(None) };
        DEMOTED.set(true);
        if sticky && !LATENCY_SEEN.get() {
            STICKY.set(Some(before));
            return Demoted(None);
        }
        Demoted(Some(before))
    }
}

impl Drop for Demoted {
    fn drop(&mut self) {
        if let Some(before) = self.0.take() {
            let _ = sys::restore_thread_schedule(before);
            DEMOTED.set(false);
        }
    }
}
