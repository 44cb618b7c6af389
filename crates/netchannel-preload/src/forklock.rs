//! Locks a forked child takes: held by the forking thread across `fork` (`pthread_atfork`, in
//! `interpose`) and released after it in both processes, so that the child finds its tables
//! consistent and their locks free.
//!
//! std's locks, not parking_lot's: parking_lot's unlock hands the lock to a thread that waits
//! for it when its eventual-fairness timer has run out, and in the child that waiting thread
//! does not exist. A parent thread that waited for a table's lock while another forked left
//! the child's copy of that lock held for good: conform's fork-server child hung in
//! `close(listener)` (about 1 round in 10 of a loop of that case). std's unlock only wakes a
//! waiter; it never hands the lock over.

use std::any::Any;
use std::cell::RefCell;
use std::sync::{
    Mutex, MutexGuard, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard, TryLockError,
};
use std::time::{Duration, Instant};

thread_local! {
    /// The guards `hold_across_fork` took in this (the forking) thread.
    static HELD: RefCell<Vec<Box<dyn Any>>> = const { RefCell::new(Vec::new()) };
}

/// A mutex that can be held across `fork`. Poisoning is ignored (a panic in the library is
/// caught at its entry points; the tables stay usable).
pub(crate) struct ForkMutex<T>(Mutex<T>);

impl<T> ForkMutex<T> {
    pub(crate) const fn new(value: T) -> Self {
        ForkMutex(Mutex::new(value))
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, T> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The lock if it comes within `wait` (for callers that may already hold it: an `exit`
    /// from a signal handler).
    pub(crate) fn try_lock_for(&self, wait: Duration) -> Option<MutexGuard<'_, T>> {
        let until = Instant::now() + wait;
        loop {
            match self.0.try_lock() {
                Ok(g) => return Some(g),
                Err(TryLockError::Poisoned(p)) => return Some(p.into_inner()),
                Err(TryLockError::WouldBlock) if Instant::now() < until => {
                    std::thread::sleep(Duration::from_millis(1))
                }
                Err(TryLockError::WouldBlock) => return None,
            }
        }
    }
}

impl<T: 'static> ForkMutex<T> {
    /// Takes the lock until `release_held` in this thread.
    pub(crate) fn hold_across_fork(&'static self) {
        let guard = self.lock();
        // A fork from a thread's exit (its locals gone) goes without it: the lock is let go.
        let _ = HELD.try_with(move |h| h.borrow_mut().push(Box::new(guard)));
    }
}

/// A reader-writer lock that can be held (for writing) across `fork`.
pub(crate) struct ForkRwLock<T>(RwLock<T>);

impl<T> ForkRwLock<T> {
    pub(crate) fn new(value: T) -> Self {
        ForkRwLock(RwLock::new(value))
    }

    pub(crate) fn read(&self) -> RwLockReadGuard<'_, T> {
        self.0.read().unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn write(&self) -> RwLockWriteGuard<'_, T> {
        self.0.write().unwrap_or_else(PoisonError::into_inner)
    }
}

impl<T: 'static> ForkRwLock<T> {
    /// Takes the write lock until `release_held` in this thread.
    pub(crate) fn hold_across_fork(&'static self) {
        let guard = self.write();
        let _ = HELD.try_with(move |h| h.borrow_mut().push(Box::new(guard)));
    }
}

/// Releases what `hold_across_fork` took in this thread, last taken first (after the fork, in
/// the parent and in the child).
pub(crate) fn release_held() {
    let held = HELD.try_with(|h| std::mem::take(&mut *h.borrow_mut())).unwrap_or_default();
    for guard in held.into_iter().rev() {
        drop(guard);
    }
}
