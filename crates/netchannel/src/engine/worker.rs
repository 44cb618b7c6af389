//! Worker threads: they serve channels when no application thread does. A fixed pool per engine
//! (not a thread per channel), each parked in its own epoll set on its channels' sockets and a
//! wake-up eventfd. A worker never spins: it handles the events it is woken for and parks again.
//!
//! Lazy duties run on a *tick* (every `TICK`), while some channel has one (and `TICK_LINGER`
//! after, for a steady exchange), and only on the channels that have one: payloads left in a
//! socket for a reader who does not come (staged after `defer_grace`), sends a thread deferred
//! and never flushed. Acknowledgements nobody carried are looked at when due (`ACK_DELAY`),
//! not every tick. The core's timers (connect and linger deadlines, acknowledgement timeouts) are
//! looked at when the earliest comes and after wake-ups, at most every `TIMER_SCAN`. A worker's
//! cost per wake-up is its channels with duties, not all its channels: a server with a thousand
//! quiet peers does not visit a thousand sessions per message. An idle engine has no tick and
//! uses no CPU.

use std::collections::{HashMap, HashSet};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
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
/// How long ticking goes on after the last urgent duty, when it came within as long of the one
/// before: a steady exchange then finds the worker ticking instead of waking it each time.
/// Short, because each tick is a wake-up too: at 2 ms a quiet peer's message costs at most a
/// few (20 ms cost 20, which with a thousand engines on one machine took more than a core).
const TICK_LINGER: Duration = Duration::from_millis(2);
/// How long a yielding worker stays at normal priority after a channel of its last waited
/// for room (`Config::workers_yield`): a bulk sender's backlog comes and goes many times a
/// second, and each change of policy is a system call or two.
const YIELD_HOLD: Duration = Duration::from_millis(100);
/// Acknowledgements not carried by other traffic go alone after this long.
const ACK_DELAY: Duration = Duration::from_millis(5);
/// How soon after `timers_changed` (a stream's connect or linger deadline was set) the worker
/// looks at its sessions' timers.
const TIMER_SCAN: Duration = Duration::from_millis(5);
/// How often traffic makes it look: traffic starts only acknowledgement timeouts (seconds), and
/// a worker woken by every message of a thousand peers must not visit a thousand sessions each
/// time.
const TRAFFIC_SCAN: Duration = Duration::from_millis(100);
const TOKEN_WAKE: u64 = 0;
/// The token of the worker's set of hang-up registrations (`Worker::hangups`) in its epoll set.
const HANGUP_TOKEN: u64 = 1 << 63;
/// Hang-ups collected from `Worker::hangups` per wait.
const HANGUP_BATCH: usize = 64;
/// `Channel::tick_listed`: not on the tick list.
const UNLISTED: u8 = 0;
/// On the tick list for an acknowledgement owed only: looked at when it is due.
const ACK_ONLY: u8 = 1;
/// On the tick list for a payload left in its socket or sends left unwritten: every `TICK`.
const URGENT: u8 = 2;

enum Request {
    Add(Arc<Channel>, Arc<SessionRt>),
    Remove(u64),
    /// Run the receive half (a thread stopped before draining it).
    Service(u64),
    /// Run the sending half (a thread's batch budget ran out with bytes left).
    ServiceTx(u64),
    /// Call the function with the fd once it is readable (`Worker::when_readable`).
    Watch(OwnedFd, WhenReadable),
    Stop,
}

/// What runs when a watched fd becomes readable, given the fd.
pub(crate) type WhenReadable = Box<dyn FnOnce(OwnedFd) + Send>;

/// Tokens of watched fds (`Request::Watch`): above channel uids, below `HANGUP_TOKEN`.
const WATCH_TOKEN: u64 = 1 << 62;

pub(crate) struct Worker {
    pub index: usize,
    epoll: Epoll,
    /// Only `wake`: where the worker sleeps while application threads serve its channels
    /// (events on them queue in `epoll` meanwhile, and are collected without waiting).
    requests_only: Epoll,
    /// Its channels' sockets again, for the peer's FIN or RST only. A channel is in `epoll`
    /// with EPOLLEXCLUSIVE (whoever sleeps is woken for data, not every thread that waits on
    /// it), which EPOLLRDHUP cannot join; this set's own registrations are not exclusive, so
    /// a hang-up wakes it whichever waiter a data edge went to, and it is itself in `epoll`
    /// (`HANGUP_TOKEN`). One set per worker, not a second fd per channel.
    hangups: Epoll,
    wake: EventFd,
    requests: Mutex<Vec<Request>>,
    /// Channels that asked for lazy duties since the worker last looked (each once, by
    /// `Channel::tick_listed`).
    tick_asked: Mutex<Vec<u64>>,
    /// A stream deadline was set since the last timer scan (`timers_changed`).
    timers_set: AtomicBool,
    /// The worker sleeps with no tick due and no wake-up within one: a new duty or deadline
    /// must wake it.
    parked: AtomicBool,
    /// A duty that must not wait for an acknowledgement's delay was asked for since the worker
    /// last looked (`demand_tick`): it ticks within a `TICK` again.
    urgent: AtomicBool,
    thread: Mutex<Option<JoinHandle<()>>>,
    /// Its thread was started (`start`, `start_lazily`); it may have ended since.
    started: AtomicBool,
    /// The engine, for a worker started on first need (`start_lazily`).
    engine: std::sync::OnceLock<Weak<EngineCtx>>,
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
        let hangups = Epoll::new()?;
        // Level-triggered: readable while any hang-up is left uncollected.
        epoll.add(hangups.as_fd(), READABLE, HANGUP_TOKEN)?;
        Ok(Arc::new(Worker {
            index,
            epoll,
            requests_only,
            hangups,
            wake,
            requests: Mutex::new(Vec::new()),
            tick_asked: Mutex::new(Vec::new()),
            timers_set: AtomicBool::new(false),
            parked: AtomicBool::new(false),
            urgent: AtomicBool::new(false),
            thread: Mutex::new(None),
            started: AtomicBool::new(false),
            engine: std::sync::OnceLock::new(),
            class,
            info: Mutex::new(None),
        }))
    }

    /// Remembers the engine, for `start_lazily`.
    pub fn belongs_to(&self, ctx: &Arc<EngineCtx>) {
        let _ = self.engine.set(Arc::downgrade(ctx));
    }

    /// Starts its thread unless it was started; `belongs_to` first.
    pub fn start_lazily(self: &Arc<Self>) -> std::io::Result<()> {
        if self.started.load(Ordering::Acquire) {
            return Ok(());
        }
        let ctx = self.engine.get().and_then(Weak::upgrade).ok_or_else(|| {
            std::io::Error::new(std::io::ErrorKind::ConnectionAborted, "engine shut down")
        })?;
        self.start(&ctx)
    }

    /// Starts its thread, unless it was started.
    pub fn start(self: &Arc<Self>, ctx: &Arc<EngineCtx>) -> std::io::Result<()> {
        let mut thread = self.thread.lock();
        if self.started.load(Ordering::Acquire) {
            return Ok(());
        }
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
        *thread = Some(handle);
        self.started.store(true, Ordering::Release);
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

    /// Calls `then` with `fd`, on this worker's thread, once `fd` is readable (a listener's
    /// first connection): a service that is seldom used (`netchannel stat`'s endpoint, the
    /// interposition library's attach socket) needs no thread of its own until then. `then`
    /// should hand `fd` to a thread and return. If the worker stops first, `fd` is closed.
    pub fn when_readable(&self, fd: OwnedFd, then: WhenReadable) {
        self.request(Request::Watch(fd, then));
    }

    pub fn service(&self, uid: u64) {
        self.request_once(Request::Service(uid), |r| matches!(r, Request::Service(u) if *u == uid));
    }

    pub fn service_tx(&self, uid: u64) {
        let same = |r: &Request| matches!(r, Request::ServiceTx(u) if *u == uid);
        self.request_once(Request::ServiceTx(uid), same);
    }

    /// `request`, unless one the same (`same`) still waits: a busy or demoted worker holds at
    /// most one service request of each kind per channel, however often threads ask (a bulk
    /// sender spreading its writes asks on every send).
    fn request_once(&self, r: Request, same: impl Fn(&Request) -> bool) {
        {
            let mut requests = self.requests.lock();
            if requests.iter().any(same) {
                return; // the wake-up that queued it is on its way or taken
            }
            requests.push(r);
        }
        self.wake.notify();
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

    /// Asks for ticks: `ch` has lazy duties pending. The worker ticks while some channel has
    /// duties, visiting only those, each until it has nothing pending.
    pub fn demand_tick(&self, ch: &Channel) {
        let was = ch.tick_listed.swap(URGENT, Ordering::SeqCst);
        if was == URGENT {
            return; // listed already, and ticked every `TICK` while it is
        }
        // Noted before `parked` is read, as the worker notes `parked` before reading this: one
        // of the two sees the other's.
        self.urgent.store(true, Ordering::SeqCst);
        if was == UNLISTED {
            self.tick_asked.lock().push(ch.uid);
        }
        self.wake_if_parked();
    }

    /// Asks for a tick when an acknowledgement `ch`'s session owes is due (`ACK_DELAY` after it
    /// came to be owed), unless frames out carry it first: a lone request or answer costs its
    /// worker one wake-up, not one per `TICK` until then.
    pub fn demand_ack(&self, ch: &Channel) {
        let listed =
            ch.tick_listed.compare_exchange(UNLISTED, ACK_ONLY, Ordering::SeqCst, Ordering::SeqCst);
        if listed.is_err() {
            return; // listed already
        }
        self.tick_asked.lock().push(ch.uid);
        self.wake_if_parked();
    }

    /// Wakes the worker if it sleeps with no tick due (`parked`): it would not see what was
    /// just asked of it before its next event.
    fn wake_if_parked(&self) {
        if self.parked.load(Ordering::SeqCst) {
            self.wake.notify();
        }
    }

    /// A core timer may now be due earlier than the worker planned.
    pub fn timers_changed(&self) {
        self.timers_set.store(true, Ordering::SeqCst);
        self.wake_if_parked();
    }

    /// Every channel whose peer hung up since the last collection, as `(uid, HANGUP)` to serve.
    fn collect_hangups(&self, serve: &mut Vec<(u64, u32)>) {
        let mut hung = Vec::new();
        loop {
            hung.clear();
            if self.hangups.wait(&mut hung, HANGUP_BATCH, Some(Duration::ZERO)).is_err() {
                return;
            }
            serve.extend(hung.iter().map(|&(uid, ev)| (uid, ev | HANGUP)));
            if hung.len() < HANGUP_BATCH {
                return;
            }
        }
    }

    /// Applies the scheduling this worker's class gets now (throughput workers follow the
    /// engine's isolation state, and yield while `yielding`); recorded for `stats()`.
    fn schedule(&self, ctx: &EngineCtx, applied: &mut Option<ThreadPolicy>, yielding: bool) {
        let c = &ctx.config;
        let want = match self.class {
            Class::Latency => c.latency_policy,
            Class::Throughput if ctx.isolating() || yielding => c.throughput_policy,
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
        // The sessions of those channels (keyed by address), with how many they have here.
        let mut sessions: HashMap<usize, (Arc<SessionRt>, usize)> = HashMap::new();
        let mut ticked: HashSet<u64> = HashSet::new();
        let mut events = Vec::new();
        // The channel events of one round, kept between rounds (an allocation per round else).
        let mut serve: Vec<(u64, u32)> = Vec::new();
        let mut next_tick = Instant::now();
        let mut linger_until = Instant::now();
        let mut last_urgent = Instant::now();
        let mut timers = TimerScan::default();
        let mut applied = None;
        let mut watched: HashMap<u64, (OwnedFd, WhenReadable)> = HashMap::new();
        let mut next_watch = 0;
        let mut arrivals = ArrivalsLeft::default();
        // When a channel of this worker last waited for room in its socket (`workers_yield`).
        let mut backlog_at: Option<Instant> = None;
        loop {
            let Some(ctx) = ctx.upgrade() else { return };
            // A send backlog is the worker's to push (the program's thread left it): it keeps
            // the worker at normal priority for `YIELD_HOLD` after it was last seen.
            let yielding = ctx.config.workers_yield
                && self.class == Class::Throughput
                && if channels.values().any(|(ch, _)| ch.tx_blocked.load(Ordering::Acquire)) {
                    backlog_at = Some(Instant::now());
                    false
                } else {
                    backlog_at.is_none_or(|t| t.elapsed() >= YIELD_HOLD)
                };
            self.schedule(&ctx, &mut applied, yielding);
            let mut timeout = None;
            let ticking = !ticked.is_empty() || Instant::now() < linger_until;
            if ticking {
                timeout = Some(next_tick.saturating_duration_since(Instant::now()));
            }
            if let Some(t) = timers.wake_at() {
                let d = t.saturating_duration_since(Instant::now());
                timeout = Some(timeout.map_or(d, |x: Duration| x.min(d)));
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
            // there is some, so a bulk sender's program is not left to find it later. Nor while
            // a channel that no application thread registered (threads register their streams'
            // channels, `Session::home`) carries traffic: only the worker is woken for it. A
            // quiet one that gets some is read within a tick, and keeps the worker attentive
            // from then on.
            let tick_ago = super::session::clock_ns().saturating_sub(TICK.as_nanos() as u64);
            let served_by_apps = !channels.is_empty()
                && channels.values().all(|(ch, s)| {
                    s.app_waited_after(ch.meta.class, tick_ago)
                        && (ch.app_watchers.load(Ordering::Acquire) > 0
                            || ch.quiet_since_last_look())
                        && !ch.tx_blocked.load(Ordering::Acquire)
                });
            if served_by_apps {
                timeout = Some(timeout.map_or(TICK, |t| t.min(TICK)));
            }
            // Parked: no wake-up within a tick (none at all, or only when an acknowledgement is
            // due), so a new duty or deadline must wake it (a timer seconds away must not hold
            // up a flush).
            let parked = timeout.is_none_or(|t| t > TICK);
            self.parked.store(parked, Ordering::SeqCst);
            // Re-check after announcing: a demand that raced with the decision is seen now.
            if parked && (self.urgent.load(Ordering::SeqCst) || !self.tick_asked.lock().is_empty())
            {
                timeout = Some(Duration::ZERO);
            }
            events.clear();
            if !served_by_apps {
                // Arrivals left to the program are the worker's again: their edges are spent.
                for uid in arrivals.take_all() {
                    if let Some((ch, s)) = channels.get(&uid) {
                        s.rx(ch);
                    }
                }
            }
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
            serve.clear();
            let mut readable = Vec::new();
            let looked = Instant::now();
            if served_by_apps {
                // Arrivals no thread read for a whole nap: the program is elsewhere.
                arrivals.unread(
                    looked,
                    |uid| channels.get(&uid).map(|(ch, _)| ch.rx_bytes()),
                    &mut serve,
                );
            }
            for &(token, ev) in &events {
                if token == HANGUP_TOKEN {
                    self.collect_hangups(&mut serve);
                } else if token & WATCH_TOKEN != 0 {
                    readable.push(token);
                } else if token != TOKEN_WAKE {
                    let left = served_by_apps
                        && ev & (READABLE | HANGUP) == READABLE
                        && channels.get(&token).is_some_and(|(ch, _)| {
                            let watchers = ch.app_watchers.load(Ordering::Acquire);
                            arrivals.leave(ch.uid, watchers, ch.rx_bytes(), looked)
                        });
                    if !left {
                        serve.push((token, ev));
                    } else if ev & WRITABLE != 0 {
                        serve.push((token, WRITABLE));
                    }
                }
            }
            for token in readable {
                if let Some((fd, then)) = watched.remove(&token) {
                    let _ = self.epoll.delete(fd.as_fd());
                    // A thread `then` starts inherits this one's scheduling: not a demoted
                    // worker's (`schedule` applies the worker's own again next round).
                    if applied.is_some_and(|p| p != ThreadPolicy::Normal) {
                        let _ = crate::sys::set_thread_policy(ThreadPolicy::Normal, None);
                        applied = None;
                    }
                    then(fd);
                }
            }
            let requests = std::mem::take(&mut *self.requests.lock());
            for r in requests {
                match r {
                    Request::Add(ch, s) => {
                        let flags = READABLE | WRITABLE | EDGE | EXCLUSIVE;
                        if self.epoll.add(ch.fd(), flags, ch.uid).is_ok() {
                            let key = Arc::as_ptr(&s) as usize;
                            sessions.entry(key).or_insert_with(|| (s.clone(), 0)).1 += 1;
                            // Never woken by data (its interest does not match), always by
                            // the peer's FIN or RST, which wake every non-exclusive waiter:
                            // end of stream is never lost in a data edge.
                            let _ = self.hangups.add(ch.fd(), PEER_SHUTDOWN | EDGE, ch.uid);
                            channels.insert(ch.uid, (ch, s));
                        }
                    }
                    Request::Remove(uid) => {
                        if let Some((ch, s)) = channels.remove(&uid) {
                            let _ = self.epoll.delete(ch.fd());
                            let _ = self.hangups.delete(ch.fd());
                            let key = Arc::as_ptr(&s) as usize;
                            if let Some(entry) = sessions.get_mut(&key) {
                                entry.1 -= 1;
                                if entry.1 == 0 {
                                    sessions.remove(&key);
                                }
                            }
                        }
                    }
                    Request::Watch(fd, then) => {
                        let token = WATCH_TOKEN | next_watch;
                        next_watch += 1;
                        if self.epoll.add(fd.as_fd(), READABLE, token).is_ok() {
                            watched.insert(token, (fd, then));
                        } else {
                            then(fd);
                        }
                    }
                    Request::Service(uid) => serve.push((uid, READABLE)),
                    Request::ServiceTx(uid) => serve.push((uid, WRITABLE)),
                    Request::Stop => return,
                }
            }
            for (uid, ev) in serve.drain(..) {
                if let Some((ch, s)) = channels.get(&uid) {
                    s.on_channel_event(ch, ev);
                }
            }
            let now = Instant::now();
            let asked = {
                let mut asked = self.tick_asked.lock();
                let any = !asked.is_empty();
                ticked.extend(asked.drain(..));
                any
            };
            if self.urgent.swap(false, Ordering::SeqCst) {
                // Ticking on after the duties only for a steady exchange (the last duty came
                // within the linger): a lone message's would cost its worker a wake-up a tick.
                if now.saturating_duration_since(last_urgent) < TICK_LINGER {
                    linger_until = now + TICK_LINGER;
                }
                last_urgent = now;
                next_tick = next_tick.min(now + TICK);
            } else if asked {
                // Acknowledgements newly owed: due `ACK_DELAY` from now at the latest.
                next_tick = next_tick.min(now + ACK_DELAY);
            }
            if (!ticked.is_empty() || now < linger_until) && now >= next_tick {
                let plan = tick(&channels, &mut ticked, now);
                next_tick = plan.next_tick(now);
            }
            // Whatever woke the worker may have started an acknowledgement timeout.
            timers.traffic = true;
            if self.timers_set.swap(false, Ordering::SeqCst) {
                timers.set = true;
            }
            if timers.due(now) {
                let mut next = None;
                for (s, _) in sessions.values() {
                    s.handle_timeouts(now);
                    if let Some(t) = s.next_deadline() {
                        next = Some(next.map_or(t, |x: Instant| x.min(t)));
                    }
                }
                timers.scanned(now, next);
            }
        }
    }
}

/// Arrivals on channels that application threads wait on, seen by the worker between its naps
/// while the program serves its channels itself (`served_by_apps`). A thread blocked on the
/// channel was woken by the kernel for the same arrival, and reads it within microseconds: the
/// worker reading it first (it polls at the end of each nap, whenever that falls) took the
/// message from under the woken thread and had to wake it a second time, through its eventfd
/// (sockperf ping-pong: 8% of messages, and a wake-up of the worker per message). So the worker
/// leaves the arrival to the program for one nap and reads the channel only if no thread read
/// anything from it meanwhile. The edge is spent: the arrival stays listed until then, or until
/// the worker stops napping, when it is read at once.
#[derive(Default)]
struct ArrivalsLeft {
    /// Channel uid -> bytes read from it when the arrival was seen (or last looked at), and
    /// when that was.
    left: HashMap<u64, (u64, Instant)>,
}

impl ArrivalsLeft {
    /// Leaves an arrival on channel `uid` to the application threads watching it (`watchers`,
    /// none: it is the worker's at once). `rx_bytes`: what has been read from it so far.
    fn leave(&mut self, uid: u64, watchers: u32, rx_bytes: u64, now: Instant) -> bool {
        if watchers == 0 {
            return false;
        }
        self.left.entry(uid).or_insert((rx_bytes, now));
        true
    }

    /// Moves to `serve` the channels nobody read from for at least `TICK` since they were
    /// listed or last looked at; the others are looked at again later (the thread that reads
    /// one may have stopped part-way). `rx_bytes` is a channel's count, `None` once it is gone.
    fn unread(
        &mut self,
        now: Instant,
        rx_bytes: impl Fn(u64) -> Option<u64>,
        serve: &mut Vec<(u64, u32)>,
    ) {
        self.left.retain(|&uid, (seen, since)| match rx_bytes(uid) {
            None => false,
            Some(n) if n != *seen => {
                (*seen, *since) = (n, now);
                true
            }
            Some(_) if now.saturating_duration_since(*since) < TICK => true,
            Some(_) => {
                serve.push((uid, READABLE));
                false
            }
        });
    }

    /// Every channel listed, for the worker to read now.
    fn take_all(&mut self) -> impl Iterator<Item = u64> + '_ {
        self.left.drain().map(|(uid, _)| uid)
    }
}

/// When the worker looks at its sessions' timers: when the earliest deadline it knows of
/// comes, within `TIMER_SCAN` of a deadline set (`timers_changed`), and within `TRAFFIC_SCAN` of
/// traffic, which may start an acknowledgement timeout.
#[derive(Default)]
struct TimerScan {
    last: Option<Instant>,
    /// The earliest deadline the last scan found.
    next: Option<Instant>,
    /// A deadline was set since the last scan.
    set: bool,
    /// The worker woke for traffic since the last scan.
    traffic: bool,
}

impl TimerScan {
    fn due(&self, now: Instant) -> bool {
        self.last.is_none() || self.wake_at().is_some_and(|t| now >= t)
    }

    fn scanned(&mut self, now: Instant, next: Option<Instant>) {
        self.last = Some(now);
        self.next = next;
        self.set = false;
        self.traffic = false;
    }

    /// When the worker must look next (`None`: nothing to look at).
    fn wake_at(&self) -> Option<Instant> {
        let Some(last) = self.last else { return Some(Instant::now()) };
        let set = self.set.then_some(last + TIMER_SCAN);
        let traffic = self.traffic.then_some(last + TRAFFIC_SCAN);
        [self.next, set, traffic].into_iter().flatten().min()
    }
}

/// What the channels left on the tick list wait for.
#[derive(Default)]
struct TickPlan {
    /// A payload left in a socket or sends left unwritten: looked at every `TICK`.
    urgent: bool,
    /// Otherwise the earliest acknowledgement owed, due `ACK_DELAY` after it came to be.
    ack_due: Option<Instant>,
}

impl TickPlan {
    fn next_tick(&self, now: Instant) -> Instant {
        match self.ack_due {
            Some(due) if !self.urgent => due.max(now + TICK),
            _ => now + TICK,
        }
    }
}

/// The lazy duties of one tick, on the channels that asked for them (`ticked`); a channel
/// with nothing left pending leaves the list.
fn tick(
    channels: &HashMap<u64, (Arc<Channel>, Arc<SessionRt>)>,
    ticked: &mut HashSet<u64>,
    now: Instant,
) -> TickPlan {
    let mut plan = TickPlan::default();
    ticked.retain(|uid| {
        let Some((ch, s)) = channels.get(uid) else { return false };
        tick_channel(ch, s, now);
        // Unlisted first, then checked: a duty that comes after the check lists it again (and
        // is not undone here: the listing below only raises the flag).
        ch.tick_listed.store(UNLISTED, Ordering::SeqCst);
        let core = s.core();
        let index = ch.meta.index;
        let urgent = core.deferred(index).is_some() || core.has_transmit(index);
        let ack_due = core.ack_owed_since().map(|since| since + ACK_DELAY);
        drop(core);
        let listed = match (urgent, ack_due) {
            (true, _) => URGENT,
            (false, Some(_)) => ACK_ONLY,
            (false, None) => UNLISTED,
        };
        // Never lowered: a demand since the check (which asked for the channel again) keeps
        // what it listed it for.
        let now_listed = ch.tick_listed.fetch_max(listed, Ordering::SeqCst).max(listed);
        plan.urgent |= now_listed == URGENT;
        if let Some(due) = ack_due {
            plan.ack_due = Some(plan.ack_due.map_or(due, |d: Instant| d.min(due)));
        }
        now_listed != UNLISTED
    });
    plan
}

fn tick_channel(ch: &Arc<Channel>, s: &Arc<SessionRt>, now: Instant) {
    let (deferred, transmit, ack) = {
        let core = s.core();
        let deferred = core
            .deferred(ch.meta.index)
            .is_some_and(|d| now.duration_since(d.since) >= s.ctx.config.defer_grace);
        let stale = now.checked_sub(ACK_DELAY);
        (deferred, core.has_transmit(ch.meta.index), stale.is_some_and(|t| core.ack_due(Some(t))))
    };
    if deferred {
        s.rx(ch);
    }
    if transmit {
        // A run in progress is asked to go again (its run lock's note) rather than passed
        // over: it may have pulled its last frames before these were queued.
        s.transmit_channel(ch);
    }
    if ack {
        s.tx(ch, true);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timers_are_looked_at_first_then_when_due_and_after_traffic_at_most_every_scan() {
        let mut t = TimerScan::default();
        let t0 = Instant::now();
        assert!(t.due(t0), "a new worker looks at once");
        t.scanned(t0, None);
        assert_eq!(t.wake_at(), None, "no deadline, no traffic: the worker may park");
        assert!(!t.due(t0 + Duration::from_secs(60)));
        // Traffic: within TRAFFIC_SCAN of the last look, not sooner.
        t.traffic = true;
        assert!(!t.due(t0 + TRAFFIC_SCAN / 2));
        assert!(t.due(t0 + TRAFFIC_SCAN));
        let t1 = t0 + TRAFFIC_SCAN;
        t.scanned(t1, Some(t1 + Duration::from_secs(20)));
        // A deadline set by an application: within TIMER_SCAN.
        t.set = true;
        assert_eq!(t.wake_at(), Some(t1 + TIMER_SCAN));
        assert!(!t.due(t1 + TIMER_SCAN / 2));
        assert!(t.due(t1 + TIMER_SCAN));
        t.scanned(t1 + TIMER_SCAN, Some(t1 + Duration::from_secs(20)));
        // The earliest known deadline, however quiet the worker is.
        assert_eq!(t.wake_at(), Some(t1 + Duration::from_secs(20)));
        assert!(!t.due(t1 + Duration::from_secs(19)));
        assert!(t.due(t1 + Duration::from_secs(20)));
    }

    #[test]
    fn an_arrival_left_to_the_program_is_read_by_the_worker_only_after_a_tick_unread() {
        let mut a = ArrivalsLeft::default();
        let t0 = Instant::now();
        // No application thread watches the channel: the worker reads it at once.
        assert!(!a.leave(1, 0, 100, t0));
        // Watched: left to the program, once (a second edge keeps the first look).
        assert!(a.leave(1, 1, 100, t0));
        assert!(a.leave(1, 1, 200, t0 + TICK / 2));
        let mut serve = Vec::new();
        let count = |n: u64| move |uid: u64| (uid == 1).then_some(n);
        // Nothing read yet, but not for a whole tick: still the program's.
        a.unread(t0 + TICK / 2, count(100), &mut serve);
        assert!(serve.is_empty());
        // A thread read from it: looked at again a tick from now.
        a.unread(t0 + TICK, count(150), &mut serve);
        assert!(serve.is_empty());
        a.unread(t0 + TICK * 3 / 2, count(150), &mut serve);
        assert!(serve.is_empty(), "read half a tick ago");
        // A tick with nothing read: the program is elsewhere, and the worker reads it.
        a.unread(t0 + TICK * 2, count(150), &mut serve);
        assert_eq!(serve, vec![(1, READABLE)]);
        serve.clear();
        a.unread(t0 + TICK * 9, count(150), &mut serve);
        assert!(serve.is_empty(), "read once, not again");
        // A channel that is gone is forgotten; one listed when the worker stops napping is
        // handed back at once.
        assert!(a.leave(2, 1, 0, t0));
        a.unread(t0 + TICK * 9, |_| None, &mut serve);
        assert!(serve.is_empty() && a.take_all().next().is_none());
        assert!(a.leave(3, 2, 0, t0));
        assert_eq!(a.take_all().collect::<Vec<_>>(), vec![3]);
        assert!(a.take_all().next().is_none());
    }
}
