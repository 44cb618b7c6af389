//! The engine's side of a virtual listener: the queue of streams the peer opened to a virtual
//! port, filled by the session runners (`SessionRt::settle`) and drained by the application's
//! `Listener::accept` (in `vns`). A backlog of accepted streams, and behind it a waiting line of
//! streams whose SYN is left unanswered while the backlog is full.

use std::collections::VecDeque;
use std::io;
use std::net::IpAddr;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;

use super::session::{Core, SessionRt};
use super::waiter::Waiter;
use crate::proto::StreamId;
use crate::sys::EventFd;
use crate::wire::Class;

/// State shared between a `Listener` and the threads that deliver streams to it.
pub(crate) struct ListenerShared {
    backlog: Mutex<VecDeque<(Arc<SessionRt>, StreamId)>>,
    /// Streams answered and not accepted, at most (`Listener::set_backlog`; `capacity` at
    /// first).
    answered: AtomicUsize,
    capacity: usize,
    /// Streams that came while the backlog was full: their SYN is not answered yet (their
    /// `connect` waits, as a TCP client whose SYN was dropped retries), and each `accept`
    /// admits one. Bounded by `capacity`; beyond, SYNs are refused.
    waiting: Mutex<VecDeque<(Arc<SessionRt>, StreamId)>>,
    closed: AtomicBool,
    waiters: Mutex<Vec<Arc<Waiter>>>,
    readiness: OnceLock<EventFd>,
    /// The address the listener is bound to, as a kernel socket is: only streams whose
    /// session the peer dialed to an address it covers reach it (`admits`).
    bound: OnceLock<Bound>,
    /// Answers ask the openers to use kernel TCP for this port (`Listener::prefer_kernel`).
    kernel_preferred: AtomicBool,
}

/// A listener's local address (`Engine::listen_on`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Bound {
    pub ip: IpAddr,
    /// For the IPv6 wildcard: IPv4 peers are not admitted (`IPV6_V6ONLY`).
    pub v6only: bool,
}

impl Bound {
    /// Whether a stream that came over a channel dialed to `local` (this host's address, as
    /// the peer dialed it) reaches a listener bound here, as the kernel decides for a SYN: a
    /// wildcard covers its family (the IPv6 one IPv4 too, unless `v6only`); an address covers
    /// itself only (a server bound to 127.0.0.1 is not reached through the host's other
    /// addresses, nor from another host).
    pub fn admits(&self, local: IpAddr) -> bool {
        let local = local.to_canonical();
        match self.ip.to_canonical() {
            IpAddr::V4(b) if b.is_unspecified() => local.is_ipv4(),
            IpAddr::V6(b) if b.is_unspecified() => !(self.v6only && local.is_ipv4()),
            b => b == local,
        }
    }
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
            answered: AtomicUsize::new(capacity),
            capacity,
            closed: AtomicBool::new(false),
            waiters: Mutex::new(Vec::new()),
            readiness: OnceLock::new(),
            bound: OnceLock::new(),
            kernel_preferred: AtomicBool::new(false),
        })
    }

    /// At most `n` streams (at least 1, at most the capacity) answered and not accepted; the
    /// others wait unanswered.
    pub fn set_backlog(&self, n: usize) {
        self.answered.store(n.clamp(1, self.capacity), Ordering::Relaxed);
    }

    /// Whether the answers from now on ask their openers to use kernel TCP for this port.
    pub fn set_kernel_preferred(&self, on: bool) {
        self.kernel_preferred.store(on, Ordering::Relaxed);
    }

    /// Accepts stream `id` for this listener: its SYN_ACK grants `window`, and asks the opener
    /// to use kernel TCP for this port if the listener does (`set_kernel_preferred`).
    pub fn answer(&self, core: &mut Core, id: StreamId, window: u32) {
        let mut stream = core.handle(id);
        if self.kernel_preferred.load(Ordering::Relaxed) {
            stream.prefer_kernel();
        }
        stream.accept(window);
    }

    /// Binds the listener to a local address (before anything can reach it).
    pub fn bind_to(&self, bound: Bound) {
        let _ = self.bound.set(bound);
    }

    /// Whether a stream over a session whose channels the peer dialed to `local` may reach
    /// this listener (unbound: any; an unknown local address: only an unbound listener).
    pub fn admits(&self, local: Option<IpAddr>) -> bool {
        match (self.bound.get(), local) {
            (None, _) => true,
            (Some(b), Some(local)) => b.admits(local),
            (Some(_), None) => false,
        }
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
            if q.len() < self.answered.load(Ordering::Relaxed) {
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
                self.answer(core, id, window);
                let mut stream = core.handle(id);
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

#[cfg(test)]
mod tests {
    use super::Bound;
    use std::net::IpAddr;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn a_bound_listener_admits_what_a_kernel_socket_bound_there_would() {
        let at = |b: &str, v6only: bool| Bound { ip: ip(b), v6only };
        let loopback = at("127.0.0.1", false);
        assert!(loopback.admits(ip("127.0.0.1")));
        assert!(loopback.admits(ip("::ffff:127.0.0.1")), "dialed through a dual-stack socket");
        assert!(!loopback.admits(ip("127.0.0.3")));
        assert!(!loopback.admits(ip("10.0.0.2")));
        assert!(!loopback.admits(ip("::1")));
        let any4 = at("0.0.0.0", false);
        assert!(any4.admits(ip("10.0.0.2")) && any4.admits(ip("::ffff:10.0.0.2")));
        assert!(!any4.admits(ip("fd00::2")));
        let dual = at("::", false);
        assert!(dual.admits(ip("10.0.0.2")) && dual.admits(ip("fd00::2")));
        let v6only = at("::", true);
        assert!(v6only.admits(ip("fd00::2")) && !v6only.admits(ip("::ffff:10.0.0.2")));
        assert!(at("::1", true).admits(ip("::1")) && !at("::1", true).admits(ip("127.0.0.1")));
    }
}
