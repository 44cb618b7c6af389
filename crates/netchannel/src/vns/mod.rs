//! VNS: virtual sockets. They only buffer and order application data; which channel carries a
//! byte is the scheduler's business, how it travels the driver's.
//!
//! - [`stream`]: the sans-IO protocol state of one virtual socket (offsets, credit, FIN, RST).
//! - [`reorder`]: the receive buffer that puts DATA from several channels back in order.
//! - [`table`]: dense stream ids, indexed directly (no hash on the hot path).
//! - [`socket`]: the application API (`VSocket`, `Listener`) and readiness.

pub mod poller;
pub mod reorder;
pub mod socket;
pub mod stream;
pub mod table;

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};

use crate::engine::session::Session;
use poller::Registration;
use stream::StreamState;

/// What the engine shares about one virtual socket between the application and the workers.
/// Idle cost: this struct plus an `Arc` header and a table slot (see `idle_socket_is_small`).
pub(crate) struct Stream {
    pub id: u32,
    pub port: u16,
    pub session: Arc<Session>,
    pub state: Mutex<StreamState>,
    /// Signalled on every state change that can unblock a reader, writer or connector.
    pub changed: Condvar,
    /// Threads blocked on `changed`; counted under `state`'s lock, so a waker that changed the
    /// state under that lock and then reads 0 knows nobody needs the (syscall-costly) notify.
    pub waiters: AtomicU32,
    /// Set when the socket joins a poller; idle sockets cost no file descriptor.
    pub registration: OnceLock<Registration>,
}

impl Stream {
    pub fn new(id: u32, port: u16, session: Arc<Session>, state: StreamState) -> Self {
        Stream {
            id,
            port,
            session,
            state: Mutex::new(state),
            changed: Condvar::new(),
            waiters: AtomicU32::new(0),
            registration: OnceLock::new(),
        }
    }

    pub fn lock(&self) -> MutexGuard<'_, StreamState> {
        // A panic while holding the lock cannot leave the state half-updated in a way that
        // matters more than losing the socket; keep serving the other threads.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Wakes blocked callers and the poller the socket is registered with.
    pub fn wake(self: &Arc<Self>) {
        if self.waiters.load(Ordering::SeqCst) > 0 {
            self.changed.notify_all();
        }
        if let Some(reg) = self.registration.get() {
            reg.notify(self);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn idle_socket_is_small() {
        // Design target (brief, section 5): <= 512 B for an idle stream, so a million idle
        // virtual sockets stay well under 1 GiB. Arc header (16) + Stream + table slot (16).
        let total = 16 + std::mem::size_of::<Stream>() + 16;
        assert!(total <= 512, "idle socket costs {total} bytes");
    }
}
