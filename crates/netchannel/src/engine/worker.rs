//! Worker threads: they serve channels when no application thread does. A fixed pool per engine
//! (not a thread per channel), each parked in its own epoll set on its channels' sockets and a
//! wake-up eventfd. A worker never spins: it handles the events it is woken for and parks again.
//!
//! Lazy duties run on a *tick* (every `TICK`), only while something asks for it: payloads left in
//! a socket for a reader who does not come (staged after `defer_grace`), sends a thread deferred
//! and never flushed, acknowledgements nobody carried, and the core's timers (connect and
//! linger deadlines). An idle engine has no tick and uses no CPU.

use std::collections::HashMap;
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::session::SessionRt;
use super::EngineCtx;
use crate::driver::Channel;
use crate::sys::ThreadPolicy;
use crate::sys::{Epoll, EventFd, EDGE, EXCLUSIVE, HANGUP, PEER_SHUTDOWN, READABLE, WRITABLE};
use crate::wire::Class;

/// Period of the lazy duties, while they are asked for.
pub(crate) const TICK: Duration = Duration::from_millis(1);
/// How long ticking goes on after the last request.
const TICK_LINGER: Duration = Duration::from_millis(20);
/// Acknowledgements not carried by other traffic go alone after this long.
const ACK_DELAY: Duration = Duration::from_millis(5);
const TOKEN_WAKE: u64 = 0;
/// Set in the token of a channel's hang-up registration.
const HANGUP_TOKEN: u64 = 1 << 63;

enum Request {
    Add(Arc<Channel>, Arc<SessionRt>),
    Remove(u64),
    /// Run the receive half (a thread stopped before draining it).
    Service(u64),
    /// Run the sending half (a thread's batch budget ran out with bytes left).
    ServiceTx(u64),
    Stop,
}

pub(crate) struct Worker {
    pub index: usize,
    epoll: Epoll,
    /// Only `wake`: where the worker sleeps while application threads serve its channels
    /// (events on them queue in `epoll` meanwhile, and are collected without waiting).
    requests_only: Epoll,
    wake: EventFd,
    requests: Mutex<Vec<Request>>,
    /// Nanoseconds since `epoch` until which the worker ticks.
    tick_until: AtomicU64,
    /// The worker is parked with no timeout: a new duty must wake it.
    parked: AtomicBool,
    epoch: Instant,
    thread: Mutex<Option<JoinHandle<()>>>,
    /// The class of channels it serves.
    pub class: Class,
    /// What its thread is and how it is scheduled, once it runs.
    pub info: Mutex<Option<WorkerThread>>,
}

/// A worker thread as `Engine::stats` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerThread {
    /// Thread name (`nc-worker-N`).
    pub name: String,
    /// Thread id (as in /proc/PID/task).
    pub tid: i32,
    /// The class of channels it serves.
    pub class: Class,
    /// The scheduling applied, or why it could not be.
    pub policy: String,
    /// The cores it is pinned to, if any.
    pub cpus: Option<Vec<usize>>,
}

impl Worker {
    pub fn new(index: usize, class: Class) -> std::io::Result<Arc<Worker>> {
        let epoll = Epoll::new()?;
        let wake = EventFd::new()?;
        epoll.add(wake.as_fd(), READABLE | EDGE, TOKEN_WAKE)?;
        let requests_only = Epoll::new()?;
        requests_only.add(wake.as_fd(), READABLE | EDGE, TOKEN_WAKE)?;
        Ok(Arc::new(Worker {
            index,
            epoll,
            requests_only,
            wake,
            requests: Mutex::new(Vec::new()),
            tick_until: AtomicU64::new(0),
            parked: AtomicBool::new(false),
            epoch: Instant::now(),
            thread: Mutex::new(None),
            class,
            info: Mutex::new(None),
        }))
    }

    pub fn start(self: &Arc<Self>, ctx: &Arc<EngineCtx>) -> std::io::Result<()> {
        let (me, ctx) = (self.clone(), Arc::downgrade(ctx));
        let config = ctx.upgrade().map(|c| c.config.clone()).expect("engine alive");
        let name = format!("nc-worker-{}", self.index);
        let handle = std::thread::Builder::new().name(name.clone()).spawn(move || {
            if let Some(ns) = &config.netns {
                // Worker threads create no sockets; the namespace only matters for
                // consistency of /proc views. A failure is not fatal.
                let _ = crate::sys::enter_netns(ns);
            }
            let cpus = match me.class {
                Class::Throughput => config.throughput_cpus.clone(),
                Class::Latency => config.latency_cpus.clone(),
            };
            let placed = match cpus.as_deref() {
                Some(set) => crate::sys::set_thread_policy(ThreadPolicy::Normal, Some(set)),
                None => Ok(()),
            };
            *me.info.lock() = Some(WorkerThread {
                name,
                tid: crate::sys::thread_id(),
                class: me.class,
                policy: String::new(),
                cpus: cpus.filter(|_| placed.is_ok()),
            });
            me.run(ctx)
        })?;
        *self.thread.lock() = Some(handle);
        Ok(())
    }

    fn request(&self, r: Request) {
        self.requests.lock().push(r);
        self.wake.notify();
    }

    /// Hands a channel to this worker. The worker registers it itself, after it knows the
    /// token: registration reports bytes that are already there, so nothing is missed.
    pub fn add(&self, ch: Arc<Channel>, session: Arc<SessionRt>) {
        self.request(Request::Add(ch, session));
    }

    pub fn remove(&self, uid: u64) {
        self.request(Request::Remove(uid));
    }

    pub fn service(&self, uid: u64) {
        self.request(Request::Service(uid));
    }

    pub fn service_tx(&self, uid: u64) {
        self.request(Request::ServiceTx(uid));
    }

    /// Wakes the worker so that it re-reads the engine's state (e.g. isolation turned on).
    pub fn nudge(&self) {
        self.wake.notify();
    }

    pub fn stop(&self) {
        self.request(Request::Stop);
    }

    pub fn join(&self) {
        let handle = self.thread.lock().take();
        if let Some(h) = handle {
            if h.thread().id() != std::thread::current().id() {
                let _ = h.join();
            }
        }
    }

    /// Moves the worker's registration of `ch` behind every other: an application thread
    /// that waits on the channel is woken first (see `waiter`).
    pub fn reregister(&self, ch: &Channel) {
        if self.epoll.delete(ch.fd()).is_ok() {
            let _ = self.epoll.add(ch.fd(), READABLE | WRITABLE | EDGE | EXCLUSIVE, ch.uid);
        }
    }

    /// Asks for ticks for a while (lazy duties are pending).
    pub fn demand_tick(&self) {
        let until = (self.epoch.elapsed() + TICK_LINGER).as_nanos() as u64;
        if self.tick_until.load(Ordering::Relaxed) >= until.saturating_sub(TICK.as_nanos() as u64) {
            return;
        }
        self.tick_until.store(until, Ordering::Release);
        if self.parked.load(Ordering::Acquire) {
            self.wake.notify();
        }
    }

    /// A core timer may now be due earlier than the worker planned.
    pub fn timers_changed(&self) {
        if self.parked.load(Ordering::Acquire) {
            self.wake.notify();
        }
    }

    fn ticking(&self) -> bool {
        (self.epoch.elapsed().as_nanos() as u64) < self.tick_until.load(Ordering::Acquire)
    }

    /// Applies the scheduling this worker's class gets now (throughput workers follow the
    /// engine's isolation state); recorded for `stats()`.
    fn schedule(&self, ctx: &EngineCtx, applied: &mut Option<ThreadPolicy>) {
        let c = &ctx.config;
        let want = match self.class {
            Class::Latency => c.latency_policy,
            Class::Throughput if ctx.isolating() => c.throughput_policy,
            Class::Throughput => ThreadPolicy::Normal,
        };
        if *applied == Some(want) {
            return;
        }
        *applied = Some(want);
        let shown = match crate::sys::set_thread_policy(want, None) {
            Ok(()) => want.to_string(),
            Err(e) => format!("{want} not applied: {e}"),
        };
        if let Some(info) = self.info.lock().as_mut() {
            info.policy = shown;
        }
    }

    fn run(self: Arc<Self>, ctx: Weak<EngineCtx>) {
        let mut channels: HashMap<u64, (Arc<Channel>, Arc<SessionRt>)> = HashMap::new();
        let mut events = Vec::new();
        let mut next_tick = Instant::now();
        let mut applied = None;
        loop {
            let Some(ctx) = ctx.upgrade() else { return };
            self.schedule(&ctx, &mut applied);
            let mut timeout = None;
            if self.ticking() {
                timeout = Some(next_tick.saturating_duration_since(Instant::now()));
            }
            for (_, s) in channels.values() {
                if let Some(t) = s.next_deadline() {
                    let d = t.saturating_duration_since(Instant::now());
                    timeout = Some(timeout.map_or(d, |x: Duration| x.min(d)));
                }
            }
            drop(ctx);
            // While an application thread keeps coming back to wait on every session this
            // worker serves, it reads and writes their channels itself: an arrival while it is
            // busy would otherwise wake the worker (EPOLLEXCLUSIVE wakes whoever sleeps), which
            // on a small machine takes the core from the program it would save work for. The
            // worker then sleeps on requests alone for at most a tick and collects what queued
            // on the channels meanwhile, so a program that stops coming back is covered within
            // a tick, as the lazy duties are.
            // Not while a channel waits for room in its socket: the worker writes the moment
            // there is some, so a bulk sender's program is not left to find it later.
            let tick_ago = super::session::clock_ns().saturating_sub(TICK.as_nanos() as u64);
            let served_by_apps = !channels.is_empty()
                && channels.values().all(|(ch, s)| {
                    s.app_waited_after(ch.meta.class, tick_ago)
                        && !ch.tx_blocked.load(Ordering::Acquire)
                });
            if served_by_apps {
                timeout = Some(timeout.map_or(TICK, |t| t.min(TICK)));
            }
            self.parked.store(timeout.is_none(), Ordering::Release);
            // Re-check after announcing: a demand that raced with the decision is seen now.
            if timeout.is_none() && self.ticking() {
                timeout = Some(Duration::ZERO);
            }
            events.clear();
            let r = if served_by_apps {
                let r = self.requests_only.wait(&mut events, 1, timeout);
                events.clear();
                r.and_then(|_| self.epoll.wait(&mut events, 64, Some(Duration::ZERO)))
            } else {
                self.epoll.wait(&mut events, 64, timeout)
            };
            self.parked.store(false, Ordering::Release);
            if r.is_err() {
                std::thread::sleep(Duration::from_millis(1));
            }
            let mut serve: Vec<(u64, u32)> = Vec::new();
            for &(token, ev) in &events {
                if token & HANGUP_TOKEN != 0 {
                    serve.push((token & !HANGUP_TOKEN, ev | HANGUP));
                } else if token != TOKEN_WAKE {
                    serve.push((token, ev));
                }
            }
            let requests = std::mem::take(&mut *self.requests.lock());
            for r in requests {
                match r {
                    Request::Add(ch, s) => {
                        let flags = READABLE | WRITABLE | EDGE | EXCLUSIVE;
                        if self.epoll.add(ch.fd(), flags, ch.uid).is_ok() {
                            // EPOLLRDHUP cannot be exclusive. A second fd of the same socket,
                            // watched for hang-ups only, is never woken by data (its interest
                            // does not match) but always by the peer's FIN or RST, which wake
                            // every waiter: end of stream is never lost in a data edge.
                            let hup = PEER_SHUTDOWN | EDGE;
                            let _ = self.epoll.add(ch.hangup_fd(), hup, ch.uid | HANGUP_TOKEN);
                            channels.insert(ch.uid, (ch, s));
                        }
                    }
                    Request::Remove(uid) => {
                        if let Some((ch, _)) = channels.remove(&uid) {
                            let _ = self.epoll.delete(ch.fd());
                            let _ = self.epoll.delete(ch.hangup_fd());
                        }
                    }
                    Request::Service(uid) => serve.push((uid, READABLE)),
                    Request::ServiceTx(uid) => serve.push((uid, WRITABLE)),
                    Request::Stop => return,
                }
            }
            for (uid, ev) in serve {
                if let Some((ch, s)) = channels.get(&uid) {
                    s.on_channel_event(ch, ev);
                }
            }
            let now = Instant::now();
            if self.ticking() && now >= next_tick {
                next_tick = now + TICK;
                tick(&channels, now);
            }
            let sessions: Vec<&Arc<SessionRt>> = {
                let mut v: Vec<&Arc<SessionRt>> = Vec::new();
                for (_, s) in channels.values() {
                    if !v.iter().any(|x| Arc::ptr_eq(x, s)) {
                        v.push(s);
                    }
                }
                v
            };
            for s in sessions {
                s.handle_timeouts(now);
            }
        }
    }
}

/// The lazy duties of one tick.
fn tick(channels: &HashMap<u64, (Arc<Channel>, Arc<SessionRt>)>, now: Instant) {
    for (ch, s) in channels.values() {
        let (deferred, transmit, ack) = {
            let core = s.core();
            let deferred = core
                .deferred(ch.meta.index)
                .is_some_and(|d| now.duration_since(d.since) >= s.ctx.config.defer_grace);
            let stale = now.checked_sub(ACK_DELAY);
            (
                deferred,
                core.has_transmit(ch.meta.index),
                stale.is_some_and(|t| core.ack_due(Some(t))),
            )
        };
        if deferred {
            s.rx(ch);
        }
        if transmit && !ch.tx_run.is_busy() {
            s.transmit_channel(ch);
        }
        if ack {
            s.tx(ch, true);
        }
    }
}
