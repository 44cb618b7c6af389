//! The engine's side of a virtual listener: the queue of streams the peer opened to a virtual
//! port, filled by the session runners (`SessionRt::settle`) and drained by the application's
//! `Listener::accept` (in `vns`). A backlog of accepted streams, and behind it a waiting line of
//! streams whose SYN is left unanswered while the backlog is full.

use std::collections::VecDeque;
use std::io;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;

use super::session::SessionRt;
use super::waiter::Waiter;
use crate::proto::StreamId;
use crate::sys::EventFd;
use crate::wire::Class;

/// State shared between a `Listener` and the threads that deliver streams to it.
pub(crate) struct ListenerShared {
    backlog: Mutex<VecDeque<(Arc<SessionRt>, StreamId)>>,
    capacity: usize,
    /// Streams that came while the backlog was full: their SYN is not answered yet (their
    /// `connect` waits, as a TCP client whose SYN was dropped retries), and each `accept`
    /// admits one. Bounded by `capacity` too; beyond, SYNs are refused.
    waiting: Mutex<VecDeque<(Arc<SessionRt>, StreamId)>>,
    closed: AtomicBool,
    waiters: Mutex<Vec<Arc<Waiter>>>,
    readiness: OnceLock<EventFd>,
}

/// What a listener did with a stream the peer opened.
pub(crate) enum Offer {
    /// In the backlog: answer SYN_ACK.
    Queued,
    /// The backlog is full: leave the SYN unanswered for now.
    Waiting,
    /// Closed, or the waiting line is full too: refuse.
    Refused,
}

impl ListenerShared {
    /// A listener holding at most `capacity` accepted and as many waiting streams.
    pub fn new(capacity: usize) -> Arc<ListenerShared> {
        Arc::new(ListenerShared {
            backlog: Mutex::new(VecDeque::new()),
            waiting: Mutex::new(VecDeque::new()),
            capacity,
            closed: AtomicBool::new(false),
            waiters: Mutex::new(Vec::new()),
            readiness: OnceLock::new(),
        })
    }

    /// The next stream for the application, if any: it gets its full window now, and a stream
    /// waiting behind the full backlog takes its place. The CREDIT saying so rides with the
    /// next frames out (or the worker's tick): the peer already has the unaccepted window to
    /// go on with, and an accept loop must not pay a channel write per connection.
    pub fn accept_next(
        &self,
        unaccepted_window: u32,
        window: u32,
    ) -> Option<(Arc<SessionRt>, StreamId, Class)> {
        let (session, id) = self.backlog.lock().pop_front()?;
        self.admit_waiting(unaccepted_window);
        let class = session.with_core(|core| {
            let mut stream = core.handle(id);
            stream.set_window(window);
            stream.state().map_or(Class::Throughput, |s| s.class)
        });
        session.defer_flush();
        Some((session, id, class))
    }

    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::SeqCst)
    }

    /// `w` is told when a stream is queued (an `accept` blocked on this listener).
    pub fn add_waiter(&self, w: &Arc<Waiter>) {
        self.waiters.lock().push(w.clone());
    }

    pub fn remove_waiter(&self, w: &Arc<Waiter>) {
        self.waiters.lock().retain(|x| !Arc::ptr_eq(x, w));
    }

    /// An eventfd that becomes readable when a stream is queued (edge-triggered).
    pub fn readiness_fd(&self) -> io::Result<RawFd> {
        if self.readiness.get().is_none() {
            let _ = self.readiness.set(EventFd::new()?);
        }
        let fd = self.readiness.get().expect("set above");
        if !self.backlog.lock().is_empty() {
            fd.notify();
        }
        Ok(fd.raw())
    }

    pub fn clear_readiness(&self) {
        if let Some(fd) = self.readiness.get() {
            fd.drain();
        }
    }

    /// Streams accepted by the engine and not yet by the application.
    pub fn pending(&self) -> usize {
        self.backlog.lock().len()
    }

    /// Every stream still queued or waiting (the listener is going away).
    pub fn take_all(&self) -> Vec<(Arc<SessionRt>, StreamId)> {
        let mut all: Vec<_> = self.backlog.lock().drain(..).collect();
        all.extend(self.waiting.lock().drain(..));
        all
    }

    /// `session` lost its last channel: its streams still queued or waiting that were reset
    /// with it leave the queues and are freed (nobody can read anything from them, and each
    /// entry kept the whole retired session alive). Streams kept for reading (every byte and
    /// the FIN arrived) stay, as a TCP connection its peer closed stays in the accept queue.
    pub fn forget_reset(&self, session: &Arc<SessionRt>) {
        for queue in [&self.backlog, &self.waiting] {
            // The session's lock is never taken under a queue's (the runners offer streams
            // with the session locked).
            let ours: Vec<StreamId> = queue
                .lock()
                .iter()
                .filter(|(s, _)| Arc::ptr_eq(s, session))
                .map(|&(_, id)| id)
                .collect();
            if ours.is_empty() {
                continue;
            }
            let reset: Vec<StreamId> = session.with_core(|core| {
                ours.into_iter()
                    .filter(|&id| core.stream(id).is_none_or(|st| st.reset.is_some()))
                    .collect()
            });
            let mut removed = Vec::new();
            queue.lock().retain(|(s, id)| {
                let drop = Arc::ptr_eq(s, session) && reset.contains(id);
                if drop {
                    removed.push(*id);
                }
                !drop
            });
            // Only those still queued: one `accept` took meanwhile is the application's.
            session.with_core(|core| {
                for id in removed {
                    core.handle(id).close(std::time::Instant::now());
                }
            });
        }
    }

    /// Queues an opened stream for `accept`, or in the waiting line behind a full backlog.
    pub fn offer(&self, session: Arc<SessionRt>, id: StreamId) -> Offer {
        if self.closed.load(Ordering::SeqCst) {
            return Offer::Refused;
        }
        {
            let mut q = self.backlog.lock();
            if q.len() < self.capacity {
                q.push_back((session, id));
                return Offer::Queued;
            }
        }
        let mut w = self.waiting.lock();
        if w.len() >= self.capacity {
            return Offer::Refused;
        }
        w.push_back((session, id));
        Offer::Waiting
    }

    /// A place in the backlog freed: admits the first waiting stream that is still there.
    fn admit_waiting(&self, window: u32) {
        loop {
            let Some((session, id)) = self.waiting.lock().pop_front() else { return };
            let live = session.with_core(|core| {
                let mut stream = core.handle(id);
                stream.accept(window);
                let live = stream.state().is_some_and(|s| s.reset.is_none());
                if !live {
                    // Reset while it waited: no application will accept it, and so none will
                    // close it, so it is freed here.
                    stream.close(std::time::Instant::now());
                }
                live
            });
            if live {
                session.defer_flush();
                self.backlog.lock().push_back((session, id));
                return;
            }
        }
    }

    pub fn notify(&self) {
        for w in self.waiters.lock().iter() {
            w.notify();
        }
        if let Some(fd) = self.readiness.get() {
            fd.notify();
        }
    }

    pub fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        self.notify();
    }
}
