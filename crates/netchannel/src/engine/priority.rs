//! Isolation by *when* work runs: an application thread that does throughput-class work (writes a
//! bulk backlog to a channel, reads a payload straight from one, or blocks in `recv`/`send` of a
//! throughput socket while serving channels) does it at the throughput workers' scheduling
//! policy, and is put back to its own the moment it returns to the application; latency-class
//! work always runs at the thread's own priority. Not demoted: the thread's copies into and out
//! of the engine and the channel work inside a `Poller::wait`. Demoting those too was measured
//! (docs/BENCHMARKS.md, "Isolation") and lengthened the latency tail: every return to the
//! thread's own policy re-queues it as a fresh competitor, so more toggling costs more than the
//! demoted work saves.
//!
//! Putting a thread back needs the right to raise its priority again (CAP_SYS_NICE, or an
//! RLIMIT_NICE that allows it). Without it the engine never demotes application threads (it
//! could not undo it), and `EngineStats::app_threads_demoted` says so.

use std::cell::Cell;

use crate::sys::{self, ThreadPolicy};
use crate::wire::Class;

thread_local! {
    /// This thread is demoted now (by an outer guard).
    static DEMOTED: Cell<bool> = const { Cell::new(false) };
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
    pub fn enter(enabled: bool, policy: ThreadPolicy, class: Class) -> Demoted {
        if !enabled || class != Class::Throughput || DEMOTED.get() {
            return Demoted(None);
        }
        // A real-time thread (or one already idle) is left as it is.
        let Ok(Some(before)) = sys::demote_thread(policy) else { return Demoted(None) };
        DEMOTED.set(true);
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
