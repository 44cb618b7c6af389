//! A session at run time: the protocol core of one peer under a lock, the channels to that peer,
//! and the two channel runners any thread may run (a waiting application thread or a worker):
//! `rx` reads, parses and feeds frames to the core; `tx` pulls frames from the core and writes
//! them. Each runner takes its channel half's [`RunLock`](crate::driver::RunLock) without
//! blocking: a thread that finds it busy leaves a note and the owner runs once more.
//!
//! Locking: the core lock is held for protocol decisions only, never across a system call or a
//! payload copy. The only way to the core is [`SessionRt::core`] (or `with_core`), whose guard
//! settles the core's events when dropped, releases the lock, and only then wakes the threads
//! and pollers concerned: no wake-up fires under the lock, by construction.

use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use parking_lot::{Mutex, MutexGuard, RwLock};

use super::listener::Offer;
use super::readiness::{StreamUser, Wakes};
use super::EngineCtx;
use crate::driver::{Channel, ChannelError};
use crate::proto::framing::Verdict;
use crate::proto::{ChannelId, Session, StreamId};
use crate::sys::{HANGUP, READABLE, WRITABLE};
use crate::wire::{Class, RstReason};

/// Reads per rx run before the rest is handed to the worker (so one thread cannot be kept
/// reading other streams' bytes forever).
const RX_READS_PER_RUN: usize = 16;
/// Frames parsed per session-lock acquisition.
const PARSE_BATCH: usize = 512;
/// Frames (and about twice as many iovecs) per pull.
const MAX_FRAMES: usize = 256;
/// A stream whose reader read a payload straight from a channel this recently is being read:
/// its next payload is left for it too.
const ACTIVE_READER: std::time::Duration = std::time::Duration::from_micros(200);
/// The longest a session waiting for traffic before it dials its other channels goes
/// between two looks at it (`RestChannels`).
const REST_LOOK_MAX: std::time::Duration = std::time::Duration::from_secs(1);

/// A session's channels beyond its first (the rest of its throughput channels, and its latency
/// channel when no latency stream opened it), while they wait to be dialed: for traffic
/// (`Config::rest_channels_rate`), or for a sender short of room or a latency stream.
pub struct RestChannels {
    pub plan: super::DialPlan,
    /// When to look at the session's traffic next; `None` while it moves nothing at all
    /// (dormant: the next frame it receives sets a look, `SessionRt::wake_rest_look`), so that
    /// an idle engine has no timer.
    pub at: Option<Instant>,
    /// The last look, and the bytes the session had moved by then (`Session::bytes_moved`).
    looked: Instant,
    moved: u64,
    interval: std::time::Duration,
}

impl RestChannels {
    /// `plan`, first looked at `first` from `now` (`Config::rest_channels_after`), when the
    /// session has moved `moved` bytes (`Session::bytes_moved`).
    pub fn new(
        plan: super::DialPlan,
        now: Instant,
        first: std::time::Duration,
        moved: u64,
    ) -> Self {
        RestChannels { plan, at: Some(now + first), looked: now, moved, interval: first }
    }

    /// Whether a look is due at `now`.
    pub fn due(&self, now: Instant) -> bool {
        self.at.is_some_and(|at| at <= now)
    }

    /// The dormant session received frames: a look `first` from `now`, as at its start.
    pub fn wake(&mut self, now: Instant, first: std::time::Duration) {
        if self.at.is_none() {
            self.at = Some(now + first);
            self.looked = now;
            self.interval = first;
        }
    }

    /// Whether the session carried `rate` since the last look (`proto::session::carries`),
    /// `moved` being its bytes now and `senders` the application threads sending on it: with
    /// two or more, a sixteenth of `rate` (1 MiB/s is 256 messages of 4 KiB a second; a peer of
    /// a few requests a second from several threads still costs one channel). If not, the next look is twice
    /// as far as the last (at most `REST_LOOK_MAX`), or none while the session moved nothing
    /// at all since the last (dormant: see `at`).
    pub fn busy(&mut self, now: Instant, moved: u64, senders: usize, rate: u64) -> bool {
        let delta = moved.saturating_sub(self.moved);
        let elapsed = now.saturating_duration_since(self.looked);
        if crate::proto::session::carries(delta, elapsed, senders, rate) {
            return true;
        }
        self.looked = now;
        self.moved = moved;
        self.interval = (self.interval * 2).min(REST_LOOK_MAX);
        self.at = (delta > 0).then(|| now + self.interval);
        false
    }
}

/// Workers a machine needs before bulk writes are spread over them (`SessionRt::spreads_bulk`):
/// 4 cores.
const SPREAD_MIN_WORKERS: usize = 3;

/// Nanoseconds since the first call in this process: a clock that fits in an atomic.
pub(crate) fn clock_ns() -> u64 {
    static ORIGIN: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    ORIGIN.get_or_init(Instant::now).elapsed().as_nanos() as u64
}

pub(crate) type Core = Session<StreamUser>;

/// The session core, locked. Dropping it delivers what the core decided meanwhile: the events
/// are settled (listener decisions, wake-ups collected), the lock is released, and only then
/// are the threads and pollers concerned woken.
pub(crate) struct CoreGuard<'a> {
    rt: &'a Arc<SessionRt>,
    core: Option<MutexGuard<'a, Core>>,
    /// Empty, with no lists, once fired: nothing left to drop.
    wakes: std::mem::ManuallyDrop<Wakes>,
}

impl CoreGuard<'_> {
    /// Settles the core's events now (before a decision that depends on them, such as whether
    /// an answer is due); the wake-ups still fire only after the lock is released.
    pub fn settle(&mut self) {
        let core = self.core.as_mut().expect("held until dropped");
        self.rt.settle(core, &mut self.wakes);
    }
}

impl std::ops::Deref for CoreGuard<'_> {
    type Target = Core;
    fn deref(&self) -> &Core {
        self.core.as_ref().expect("held until dropped")
    }
}

impl std::ops::DerefMut for CoreGuard<'_> {
    fn deref_mut(&mut self) -> &mut Core {
        self.core.as_mut().expect("held until dropped")
    }
}

impl Drop for CoreGuard<'_> {
    fn drop(&mut self) {
        self.settle();
        drop(self.core.take());
        self.wakes.fire();
    }
}

pub(crate) struct SessionRt {
    pub ctx: Arc<EngineCtx>,
    core: Mutex<Core>,
    /// Open channels.
    channels: RwLock<Vec<Arc<Channel>>>,
    /// The channels serving each class (`serving_channels`), kept with every change of
    /// `channels` (under its write lock) so that a send does not collect them anew.
    serving: RwLock<[Arc<[Arc<Channel>]>; 2]>,
    /// Changes with every change of `channels` (engine-wide unique values): a thread that
    /// registered them once knows it need not look again.
    channels_generation: AtomicU64,
    pub peer_addr: SocketAddr,
    /// This host's address on the session's first channel: the one the peer dialed (for a
    /// session it opened), which a bound listener checks (`ListenerShared::admits`).
    pub local_ip: std::sync::OnceLock<std::net::IpAddr>,
    /// The peer engine's id (its sessions are keyed by it on the accepting side).
    pub peer_engine: u64,
    /// This engine dialed the session, so it can add channels.
    pub initiator: bool,
    /// Which of this engine's sessions to the peer it is (`Config::session_shards`; 0 for a
    /// session the peer dialed).
    pub shard: u16,
    /// Index the next added channel gets.
    pub next_index: AtomicU16,
    /// A channel is being added.
    pub growing: AtomicBool,
    /// The session's channels beyond the first, while they wait to be dialed.
    pub rest: Mutex<Option<RestChannels>>,
    /// `rest` waits, dormant, for the session's next received frame (`wake_rest_look`).
    rest_dormant: AtomicBool,
    /// No channel is added before this time (`clock_ns`): a dial to add one failed.
    pub grow_after_ns: AtomicU64,
    /// Dials to add a channel that failed in a row (the wait after the next failure doubles).
    pub grow_failures: AtomicU32,
    /// Channel ids the next added channels take before a new index (`EngineCtx::grow`): the
    /// next incarnation of a retired channel's index (`retire`), or of one whose dial to add
    /// it failed. At most one per index, so at most 64.
    pub free_ids: Mutex<Vec<ChannelId>>,
    /// The channel `retire` is closing: it is not dialed again (`was_retired`).
    retiring: Mutex<Option<ChannelId>>,
    /// Which channel an inline send tries first.
    cursor: AtomicUsize,
    /// `core.rx_held()` as last added to the engine's total.
    held_seen: AtomicU64,
    /// The addresses applications know their sockets by (`VSocket::set_app_addresses`), by
    /// stream id: kept beside the streams so that an idle stream stays small.
    pub app_addrs: Mutex<std::collections::HashMap<u64, [SocketAddr; 2]>>,
    /// When an application thread last came to wait on the session's channels of each class
    /// (`clock_ns`). While one keeps coming back, it serves them itself (its epoll registration
    /// is ahead of the worker's), so the worker need not be woken by each arrival
    /// (`engine/worker.rs`).
    app_waited_ns: [AtomicU64; 2],
    /// Pollers whose threads wait on the session's channels of a class: each keeps the time its
    /// thread last came to wait (`PollerShared::stamp`), so that a poller over thousands of
    /// sessions stamps one clock per wait instead of each session.
    app_watchers: Mutex<Vec<(Class, Arc<AtomicU64>)>>,
}

static NEXT_GENERATION: AtomicU64 = AtomicU64::new(1);

/// A value no session's channel set had before (`SessionRt::channels_generation`).
fn next_generation() -> u64 {
    NEXT_GENERATION.fetch_add(1, Ordering::AcqRel)
}

/// Changes whenever any session's channel set changes (in this process): a poller that saw the
/// same value at its last look need not look at its sessions' channels again.
pub(crate) fn channels_epoch() -> u64 {
    NEXT_GENERATION.load(Ordering::Acquire)
}

impl SessionRt {
    pub fn new(
        ctx: Arc<EngineCtx>,
        peer_addr: SocketAddr,
        peer_engine: u64,
        initiator: bool,
        first_index: u16,
        shard: u16,
    ) -> Arc<SessionRt> {
        let mut config = ctx.core_config();
        // A shard's floor when giving channels back is what it started with.
        config.min_channels = ctx.config.shard_channels(shard);
        let core = Session::new(config);
        Arc::new(SessionRt {
            shard,
            ctx,
            core: Mutex::new(core),
            channels: RwLock::new(Vec::new()),
            serving: RwLock::new([Arc::from([]), Arc::from([])]),
            channels_generation: AtomicU64::new(next_generation()),
            peer_addr,
            local_ip: std::sync::OnceLock::new(),
            peer_engine,
            initiator,
            next_index: AtomicU16::new(first_index),
            growing: AtomicBool::new(false),
            rest: Mutex::new(None),
            rest_dormant: AtomicBool::new(false),
            grow_after_ns: AtomicU64::new(0),
            grow_failures: AtomicU32::new(0),
            free_ids: Mutex::new(Vec::new()),
            retiring: Mutex::new(None),
            cursor: AtomicUsize::new(0),
            held_seen: AtomicU64::new(0),
            app_addrs: Mutex::new(std::collections::HashMap::new()),
            app_waited_ns: [AtomicU64::new(0), AtomicU64::new(0)],
            app_watchers: Mutex::new(Vec::new()),
        })
    }

    /// The engine id this session's channels present to the peer: the engine's own, or its
    /// shard's (`EngineCtx::shard_engine_id`).
    pub fn local_id(&self) -> u64 {
        if self.initiator {
            self.ctx.shard_engine_id(self.shard)
        } else {
            self.ctx.id
        }
    }

    /// The id the session is known by at both ends: the one its dialer presents.
    pub fn dialer_id(&self) -> u64 {
        if self.initiator {
            self.local_id()
        } else {
            self.peer_engine
        }
    }

    /// Called with `channels`' write lock held, after each change, with its new contents.
    fn channels_changed(&self, all: &[Arc<Channel>]) {
        let serving = |class: Class| -> Arc<[Arc<Channel>]> {
            let own: Vec<_> = all.iter().filter(|c| c.meta.class == class).cloned().collect();
            if own.is_empty() {
                all.into()
            } else {
                own.into()
            }
        };
        *self.serving.write() = [serving(Class::Throughput), serving(Class::Latency)];
        self.channels_generation.store(next_generation(), Ordering::Release);
    }

    /// Which set of channels the session has: equal values, the same channels (read before
    /// `serving_channels`).
    pub fn channels_generation(&self) -> u64 {
        self.channels_generation.load(Ordering::Acquire)
    }

    /// An application thread is about to wait on the session's channels of `class`.
    pub fn note_app_wait(&self, class: Class) {
        self.app_waited_ns[class.index()].store(clock_ns(), Ordering::Relaxed);
    }

    /// A poller's thread waits on the session's channels of `class`; `stamp` is when it last
    /// came to wait (see `app_waited_after`).
    pub fn add_app_watcher(&self, class: Class, stamp: &Arc<AtomicU64>) {
        let mut w = self.app_watchers.lock();
        // Pollers that are gone hold no other reference.
        w.retain(|(_, s)| Arc::strong_count(s) > 1);
        if !w.iter().any(|(c, s)| *c == class && Arc::ptr_eq(s, stamp)) {
            w.push((class, stamp.clone()));
        }
    }

    /// Whether an application thread came to wait on the session's channels of `class` after
    /// `since` (a `clock_ns` reading): a blocking call on one of its sockets, or the thread of
    /// a poller over them.
    pub fn app_waited_after(&self, class: Class, since: u64) -> bool {
        let at = self.app_waited_ns[class.index()].load(Ordering::Relaxed);
        if at != 0 && at > since {
            return true;
        }
        self.app_watchers
            .lock()
            .iter()
            .any(|(c, s)| *c == class && s.load(Ordering::Relaxed) > since)
    }

    /// The core, locked (see [`CoreGuard`]).
    pub fn core(self: &Arc<Self>) -> CoreGuard<'_> {
        CoreGuard {
            rt: self,
            core: Some(self.core.lock()),
            wakes: std::mem::ManuallyDrop::new(Wakes::new()),
        }
    }

    /// Runs `f` on the core; its events are settled and the wake-ups fired after the lock.
    pub fn with_core<T>(self: &Arc<Self>, f: impl FnOnce(&mut Core) -> T) -> T {
        f(&mut self.core())
    }

    pub fn channels(&self) -> Vec<Arc<Channel>> {
        self.channels.read().clone()
    }

    pub fn channel(&self, index: ChannelId) -> Option<Arc<Channel>> {
        self.channels.read().iter().find(|c| c.meta.index == index).cloned()
    }

    /// The open channels that carry `class` (its own, or the other class's if it has none).
    pub fn serving_channels(&self, class: Class) -> Arc<[Arc<Channel>]> {
        self.serving.read()[class.index()].clone()
    }

    /// [`Core::unflushed`] of a live session (0 once no channel is left to carry anything),
    /// or `None` when its locks did not come within `wait`.
    pub fn unflushed(&self, wait: std::time::Duration) -> Option<u64> {
        if self.channels.try_read_for(wait)?.is_empty() {
            return Some(0);
        }
        Some(self.core.try_lock_for(wait)?.unflushed())
    }

    /// Whether `class` has open channels of its own (not lent by the other class).
    pub fn has_own_channels(&self, class: Class) -> bool {
        self.serving_channels(class).first().is_some_and(|c| c.meta.class == class)
    }

    /// Its channels beyond the first, if they wait to be dialed (`RestChannels`), are dialed
    /// now. (A look for traffic after an idle spell, `regrow`, is left: a sender short of room
    /// grows the session itself.)
    pub fn hurry_rest(self: &Arc<Self>) {
        let rest = {
            let mut rest = self.rest.lock();
            if rest.as_ref().is_some_and(|r| !r.plan.is_empty()) {
                rest.take()
            } else {
                None
            }
        };
        if let Some(rest) = rest {
            self.ctx.dial_rest_now(self.clone(), rest.plan);
        }
    }

    /// The session received frames: if its look at its traffic was dormant (it had moved
    /// nothing), one is due `rest_channels_after` from now. One load per read otherwise.
    fn wake_rest_look(&self) {
        if self.rest_dormant.load(Ordering::Relaxed)
            && self.rest_dormant.swap(false, Ordering::AcqRel)
        {
            if let Some(r) = self.rest.lock().as_mut() {
                r.wake(Instant::now(), self.ctx.config.rest_channels_after);
            }
            self.timers_changed();
        }
    }

    /// Throughput channels of this session that are its own (none lent by the latency class).
    fn own_throughput_channels(&self) -> usize {
        self.channels.read().iter().filter(|c| c.meta.class == Class::Throughput).count()
    }

    /// The session gave back throughput channels while idle (below `channels`: see
    /// `Session::surplus_channel`), and now carries traffic again, or may: one more, if none
    /// is being added, and another look soon, until it has `channels` again.
    fn regrow(self: &Arc<Self>, now: Instant) {
        if self.own_throughput_channels() >= self.ctx.config.shard_channels(self.shard) {
            return;
        }
        if !self.growing.load(Ordering::Acquire) {
            self.ctx.grow(self, Class::Throughput);
        }
        self.look_for_regrowth(now);
    }

    /// Sets a look at the session's traffic (`regrow` when it finds some), unless one waits.
    fn look_for_regrowth(self: &Arc<Self>, now: Instant) {
        let (first, moved) = (self.ctx.config.rest_channels_after, self.core().bytes_moved());
        let mut rest = self.rest.lock();
        if rest.is_none() {
            *rest = Some(RestChannels::new(Vec::new(), now, first, moved));
            drop(rest);
            self.timers_changed();
        }
    }

    pub fn is_alive(&self) -> bool {
        !self.channels.read().is_empty()
    }

    /// Adds an open channel: to the core, to the session, and to its worker's epoll set.
    pub fn add_channel(self: &Arc<Self>, ch: Arc<Channel>) -> bool {
        if self.local_ip.get().is_none() {
            if let Some(a) = crate::sys::local_addr(ch.fd()) {
                let _ = self.local_ip.set(a.ip());
            }
        }
        {
            let mut core = self.core();
            if core.has_channel(ch.meta.index) {
                return false;
            }
            core.add_channel(ch.meta.index, ch.meta.class);
            let mut all = self.channels.write();
            all.push(ch.clone());
            self.channels_changed(&all);
        }
        self.ctx.workers[ch.worker].add(ch, self.clone());
        true
    }

    /// Brings the engine's count of unread bytes up to date with this session's (the caller
    /// holds the core lock): statistics only, the receive budget bounds the bytes themselves.
    fn account_held(&self, core: &Core) {
        let held = core.rx_held();
        // Written only under the core lock: a load and a store, not a read-modify-write.
        let last = self.held_seen.load(Ordering::Relaxed);
        if held == last {
            return;
        }
        self.held_seen.store(held, Ordering::Relaxed);
        if held > last {
            self.ctx.rx_held.fetch_add(held - last, Ordering::Relaxed);
        } else {
            self.ctx.rx_held.fetch_sub(last - held, Ordering::Relaxed);
        }
    }

    /// Delivers the core's events: wake-ups of waiting threads and pollers (collected in
    /// `wakes`, fired by the guard after it unlocks), and the listener's decision for streams
    /// the peer opened.
    fn settle(self: &Arc<Self>, core: &mut Core, wakes: &mut Wakes) {
        self.account_held(core);
        while let Some((id, port)) = core.poll_incoming() {
            let listener = self.ctx.listeners.lock().get(&port).cloned();
            let listener = listener.filter(|l| l.admits(self.local_ip.get().copied()));
            match listener {
                None => core.handle(id).refuse(RstReason::NoListener),
                Some(l) => {
                    // The full window comes when the application accepts it.
                    let window = self.ctx.config.unaccepted_window;
                    match l.offer(self.clone(), id) {
                        Offer::Queued => {
                            l.answer(core, id, window);
                            wakes.listener(l);
                        }
                        Offer::Waiting => {}
                        Offer::Refused => core.handle(id).refuse(RstReason::Refused),
                    }
                }
            }
        }
        while let Some((id, bits)) = core.poll_event() {
            if let Some(s) = core.stream(id) {
                s.user.wakes(bits, wakes);
            }
        }
    }

    /// Handles a readiness event of one of this session's channels.
    pub fn on_channel_event(self: &Arc<Self>, ch: &Arc<Channel>, events: u32) {
        if events & HANGUP != 0 {
            ch.hung_up.store(true, Ordering::Release);
        }
        if events & WRITABLE != 0 {
            ch.tx_blocked.store(false, Ordering::Release);
            self.tx(ch, false);
        }
        if events & (READABLE | HANGUP) != 0 || events & WRITABLE == 0 {
            self.rx(ch);
        }
    }

    // ------------------------------------------------------------------ receive

    /// Runs the receive half of `ch` if no other thread does (else leaves it a note).
    pub fn rx(self: &Arc<Self>, ch: &Arc<Channel>) {
        if !ch.is_open() || !ch.rx_run.try_acquire() {
            return;
        }
        loop {
            match self.rx_run(ch) {
                Ok(drained) => {
                    if !drained {
                        // Budget spent with bytes left: the worker goes on.
                        self.ctx.workers[ch.worker].service(ch.uid);
                    }
                }
                Err(e) => {
                    self.channel_failed(ch, e);
                    ch.rx_run.release();
                    return;
                }
            }
            if !ch.rx_run.release() {
                return;
            }
        }
    }

    /// Reads and dispatches until the socket is drained (true), the channel waits on a
    /// deferred payload (true: its reader goes on), or the budget is spent (false).
    fn rx_run(self: &Arc<Self>, ch: &Arc<Channel>) -> Result<bool, ChannelError> {
        let mut st = ch.rx.lock();
        let grace = self.ctx.config.defer_grace;
        for _ in 0..RX_READS_PER_RUN {
            if st.reader.is_deferred() {
                let mut core = self.core();
                if !core.reader_may_read(ch.meta.index, &mut st.reader, Instant::now(), grace) {
                    // Its reader reads the payload (woken now: bytes may have arrived for it);
                    // the tick takes it over if the reader does not come within the grace.
                    drop(core);
                    self.ctx.workers[ch.worker].demand_tick(ch);
                    return Ok(true);
                }
            }
            if st.reader.want() == 0 {
                return Ok(true);
            }
            let (n, asked) = match ch.read(&mut st) {
                Ok((0, _)) if st.reader.mid_frame() => {
                    return Err(ChannelError::Protocol(
                        "truncated frame: eof inside a frame".into(),
                    ))
                }
                Ok((0, _)) => return Err(ChannelError::Closed),
                Ok(r) => r,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(true),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(ChannelError::Io(e)),
            };
            self.wake_rest_look();
            self.dispatch(ch, &mut st)?;
            if n < asked && !ch.hung_up.load(Ordering::Acquire) {
                return Ok(true); // a short read: the socket is drained
            }
        }
        Ok(false)
    }

    /// Parses what was read and feeds it to the core, a batch per lock acquisition.
    fn dispatch(
        self: &Arc<Self>,
        ch: &Arc<Channel>,
        st: &mut crate::driver::RxState,
    ) -> Result<(), ChannelError> {
        let index = ch.meta.index;
        loop {
            let mut parsed = std::mem::take(&mut st.parsed);
            st.reader
                .parse(&mut parsed, PARSE_BATCH)
                .map_err(|e| ChannelError::Protocol(e.to_string()))?;
            if parsed.is_empty() {
                st.parsed = parsed;
                return Ok(());
            }
            let now = Instant::now();
            let defer_ok = self.ctx.config.defer_min > 0;
            let mut frames = 0;
            let mut core = self.core();
            let mut result = Ok(());
            for item in parsed.drain(..) {
                frames += usize::from(item.is_frame());
                // Left in the socket only when its reader will read it soon: it is at hand, or
                // reads this stream's payloads straight from channels (one is waiting, or it
                // read one a moment ago).
                let reader_at_hand = |core: &Core, stream: StreamId| {
                    defer_ok
                        && (core
                            .stream(stream)
                            .is_some_and(|s| s.user.reader_at_hand() || s.rx.has_deferred())
                            || core.read_directly_within(stream, now, ACTIVE_READER))
                };
                let r = core.receive(index, item, now, reader_at_hand);
                if let Ok(Some(v)) = r {
                    st.reader.verdict(v);
                    if v == Verdict::Defer {
                        self.ctx.workers[ch.worker].demand_tick(ch);
                    }
                }
                if let Err(v) = r {
                    result = Err(ChannelError::Protocol(v.to_string()));
                    break;
                }
            }
            // Settled now: the listener's answers to new streams are part of what is due.
            core.settle();
            let control_due = core.has_transmit(index) || core.ack_due(None);
            // Channels the peer's acknowledgements let take frames again.
            let freed = core.take_tx_ready();
            // Frames queued for channels of their streams' own (a CREDIT let a sender go on).
            let mut kicked = core.take_kicked(ch.meta.class);
            if control_due {
                kicked &= !index.bit();
            }
            if core.owes_ack() {
                // Carried by the next frames out; if none go, the worker sends it when due.
                self.ctx.workers[ch.worker].demand_ack(ch);
            }
            drop(core);
            st.parsed = parsed;
            ch.count_rx_frames(frames);
            result?;
            if control_due {
                // Answers (SYN_ACK, RST) and due acknowledgements leave now.
                self.transmit_channel(ch);
            }
            for id in freed {
                if let Some(other) = self.channel(id) {
                    self.transmit_channel(&other);
                }
            }
            self.kick(kicked);
            if st.reader.want() == 0 || st.reader.is_deferred() {
                return Ok(());
            }
        }
    }

    // ------------------------------------------------------------------ transmit

    /// Runs the receive half of `ch`, which the caller already owns (it read a deferred payload
    /// straight into its buffer), and lets it go.
    pub fn rx_owned(self: &Arc<Self>, ch: &Arc<Channel>) {
        loop {
            if ch.is_open() {
                match self.rx_run(ch) {
                    Ok(true) => {}
                    Ok(false) => self.ctx.workers[ch.worker].service(ch.uid),
                    Err(e) => self.channel_failed(ch, e),
                }
            }
            if !ch.rx_run.release() {
                return;
            }
        }
    }

    /// Makes the engine read the deferred payload at the front of stream `id` into user space
    /// (for `MSG_PEEK`, which cannot read from the socket without consuming). True if it did.
    pub fn stage_front(self: &Arc<Self>, id: StreamId) -> bool {
        let front = self.core().stream(id).and_then(|s| s.rx.front_deferred());
        let Some((index, _)) = front else { return false };
        let Some(ch) = self.channel(index) else { return false };
        if !ch.rx_run.try_acquire() {
            return false;
        }
        self.core().take_over_reader(index, &mut ch.rx.lock().reader);
        self.rx_owned(&ch);
        true
    }

    /// The worker that keeps this session's timers and lazy duties.
    fn duty_worker(&self) -> Option<usize> {
        self.channels.read().first().map(|c| c.worker)
    }

    /// A core deadline was set: the worker recomputes when to wake.
    pub fn timers_changed(&self) {
        if let Some(w) = self.duty_worker() {
            self.ctx.workers[w].timers_changed();
        }
    }

    /// A thread deferred sends: the worker writes them on its next tick if the thread does not
    /// come back first.
    pub fn defer_flush(&self) {
        for ch in self.channels.read().iter() {
            self.ctx.workers[ch.worker].demand_tick(ch);
        }
    }

    /// `defer_flush` for sends of `class` only (their channels' workers).
    pub fn defer_flush_class(&self, class: Class) {
        for ch in self.serving_channels(class).iter() {
            self.ctx.workers[ch.worker].demand_tick(ch);
        }
    }

    /// Runs the sending half of `ch` if no other thread does (else leaves it a note); if its
    /// budget ran out with bytes left, the channel's worker goes on.
    pub fn tx(self: &Arc<Self>, ch: &Arc<Channel>, force_ack: bool) {
        if self.tx_once(ch, force_ack) {
            self.ctx.workers[ch.worker].service_tx(ch.uid);
        }
    }

    /// One run of the sending half; true if the budget ran out with bytes left.
    fn tx_once(self: &Arc<Self>, ch: &Arc<Channel>, force_ack: bool) -> bool {
        if !ch.is_open() || !ch.tx_run.try_acquire() {
            return false;
        }
        let mut more;
        let mut kicked = 0;
        loop {
            match self.tx_run(ch, force_ack, &mut kicked) {
                Ok(m) => more = m,
                Err(e) => {
                    self.channel_failed(ch, ChannelError::Io(e));
                    ch.tx_run.release();
                    return false;
                }
            }
            if !ch.tx_run.release() {
                break;
            }
        }
        self.kick(kicked & !ch.meta.index.bit());
        more
    }

    /// Makes the channels named (bits by index, `Session::take_kicked`) write what only they
    /// may carry.
    fn kick(self: &Arc<Self>, mut kicked: u64) {
        while kicked != 0 {
            let index = kicked.trailing_zeros() as u16;
            kicked &= kicked - 1;
            // Looked up one at a time: no list to allocate, and no lock held while writing.
            let ch = self.channels.read().iter().find(|c| c.meta.index.index == index).cloned();
            if let Some(ch) = ch {
                self.transmit_channel(&ch);
            }
        }
    }

    /// Pulls and writes until the core has nothing for the channel, the socket is full, or the
    /// batch budget is spent. Frames already pulled are always written before the run ends
    /// unless the socket is full (then EPOLLOUT resumes them): pulled frames never wait for a
    /// trigger that might not come. Returns whether the core still has bytes for the channel.
    fn tx_run(
        self: &Arc<Self>,
        ch: &Arc<Channel>,
        force_ack: bool,
        kicked: &mut u64,
    ) -> io::Result<bool> {
        let mut st = ch.tx.lock();
        let budget = self.ctx.config.tx_batch_bytes;
        let mut written = 0;
        // The core had nothing more for the channel when the frames being written were pulled:
        // once they are written the run ends without asking again (a frame queued since is
        // another thread's to write, and its `tx` finds this run and asks it to run again).
        let mut drained = false;
        loop {
            if st.frames.is_empty() {
                if drained {
                    return Ok(false);
                }
                if written >= budget {
                    return Ok(self.core().has_transmit(ch.meta.index));
                }
                let mut core = self.core();
                let tx = &mut *st;
                let n = core.poll_transmit(
                    ch.meta.index,
                    budget - written,
                    MAX_FRAMES,
                    force_ack,
                    &mut tx.pulled,
                );
                *kicked |= core.take_kicked(ch.meta.class);
                drained = !core.has_transmit(ch.meta.index);
                drop(core);
                if n == 0 {
                    return Ok(false);
                }
                ch.count_queued(n);
                tx.frames.extend(tx.pulled.drain(..));
            }
            let w = ch.write(&mut st)?;
            if w.blocked {
                ch.tx_blocked.store(true, Ordering::Release);
                return Ok(false);
            }
            // The socket took bytes: it is not full. A flag left set would be stale when an
            // EPOLLOUT handler cleared it while this run was still on its way to set it (the
            // handler's run became this one's rerun, which wrote): senders would then skip the
            // channel, and no EPOLLOUT comes for a socket that is not full (a sender hung with
            // 0.5 MiB queued and an empty socket once in about 2,000 starts).
            if ch.tx_blocked.load(Ordering::Relaxed) {
                ch.tx_blocked.store(false, Ordering::Release);
            }
            written += w.bytes;
        }
    }

    /// Writes now on `ch` unless its socket is full.
    pub fn transmit_channel(self: &Arc<Self>, ch: &Arc<Channel>) {
        if !ch.tx_blocked.load(Ordering::Acquire) {
            self.tx(ch, false);
        }
    }

    /// Writes the class's queued frames now, on the channels that carry it and have room,
    /// starting with the next one in turn (so one stream's chunks spread over channels).
    pub fn transmit(self: &Arc<Self>, class: Class) {
        let work = self.core().transmit_work(class);
        self.transmit_known(class, work);
    }

    /// `transmit`, given what the core said it has to send (`Core::transmit_work`, read by a
    /// caller that held the lock anyway: one acquisition fewer per send).
    pub fn transmit_known(self: &Arc<Self>, class: Class, (shared, own): (bool, u64)) {
        if !shared {
            // Only frames of streams homed on their channels: write on those.
            if own != 0 {
                self.kick(own);
            }
            return;
        }
        let channels = self.serving_channels(class);
        if channels.is_empty() {
            return;
        }
        let start = self.cursor.fetch_add(1, Ordering::Relaxed);
        if self.spreads_bulk(class, channels.len()) {
            // Cores to spare: the other channels' kernel work (the copy into the socket, TCP)
            // goes to their workers, and this thread writes one channel itself meanwhile, so a
            // single thread's stream runs on several cores.
            let core = self.core();
            let others = (1..channels.len()).map(|k| &channels[(start + k) % channels.len()]);
            let others: Vec<_> = others
                .filter(|c| {
                    !c.tx_blocked.load(Ordering::Acquire) && core.has_transmit(c.meta.index)
                })
                .collect();
            drop(core);
            for ch in others {
                self.ctx.workers[ch.worker].service_tx(ch.uid);
            }
            let own = &channels[start % channels.len()];
            if !own.tx_blocked.load(Ordering::Acquire) && self.tx_once(own, false) {
                self.ctx.workers[own.worker].service_tx(own.uid);
            }
            if channels.iter().all(|c| c.tx_blocked.load(Ordering::Acquire)) {
                self.ctx.grow(self, class); // as below: every channel full, bytes left
            }
            return;
        }
        let mut left = None;
        for k in 0..channels.len() {
            let ch = &channels[(start + k) % channels.len()];
            if ch.tx_blocked.load(Ordering::Acquire) {
                continue;
            }
            if self.tx_once(ch, false) {
                left = Some(ch);
            }
            let core = self.core();
            if !channels.iter().any(|c| core.has_transmit(c.meta.index)) {
                return;
            }
        }
        if let Some(ch) = left {
            // Every channel got its batch and bytes are left: a worker goes on.
            self.ctx.workers[ch.worker].service_tx(ch.uid);
            return;
        }
        // Bytes are left and every channel of the class is full: the cue to add a channel
        // (NetScheduler's channel scaling; the dialing side only, up to `max_channels`, and
        // only where throughput channels serve the class).
        if channels.iter().all(|c| c.tx_blocked.load(Ordering::Acquire)) {
            self.ctx.grow(self, class);
        }
    }

    /// Whether a thread's shared (bulk) throughput frames are written by the channels'
    /// workers beside it (`Config::spread_bulk_writes`, with `SPREAD_MIN_WORKERS` workers or
    /// more: on fewer cores the workers would only take the cores the application and its
    /// peer use).
    fn spreads_bulk(&self, class: Class, channels: usize) -> bool {
        class == Class::Throughput
            && channels > 1
            && self.ctx.config.spread_bulk_writes
            && self.ctx.workers.len() >= SPREAD_MIN_WORKERS
    }

    /// Writes everything queued for every class.
    pub fn transmit_all(self: &Arc<Self>) {
        self.transmit_classes(u8::MAX);
    }

    /// Writes everything queued for the classes in `classes` (`Class::bit`).
    pub fn transmit_classes(self: &Arc<Self>, classes: u8) {
        for class in [Class::Latency, Class::Throughput] {
            if classes & class.bit() == 0 {
                continue;
            }
            // What is pending and where it may go, under one hold of the lock.
            let work = {
                let core = self.core();
                let pending =
                    self.serving_channels(class).iter().any(|c| core.has_transmit(c.meta.index));
                pending.then(|| core.transmit_work(class))
            };
            if let Some(work) = work {
                self.transmit_known(class, work);
            }
        }
    }

    /// Runs the core's timers (connect and linger deadlines) and closes channels whose peer
    /// acknowledged nothing for `ack_timeout` while frames waited for it: at once if the peer
    /// engine acknowledges its other channels (this one is broken), else only if the peer's
    /// kernel is silent too (`black_holed`). A peer whose kernel answers and whose engine
    /// processes nothing is a stopped or paused process, and TCP waits for such a peer.
    pub fn handle_timeouts(self: &Arc<Self>, now: Instant) {
        if self.rest.lock().as_ref().is_some_and(|r| r.due(now)) {
            let (moved, senders) = {
                let mut core = self.core();
                (core.bytes_moved(), core.sending_threads(now))
            };
            let rate = self.ctx.config.rest_channels_rate;
            let busy = {
                let mut rest = self.rest.lock();
                let due = rest.as_mut().filter(|r| r.due(now));
                if due.is_some_and(|r| r.busy(now, moved, senders, rate)) {
                    rest.take()
                } else {
                    // Dormant: the next frame received wakes the look.
                    let dormant = rest.as_ref().is_some_and(|r| r.at.is_none());
                    self.rest_dormant.store(dormant, Ordering::Release);
                    None
                }
            };
            match busy {
                Some(rest) if rest.plan.is_empty() => self.regrow(now),
                Some(rest) => self.ctx.dial_rest_now(self.clone(), rest.plan),
                // Gone dormant: frames read since the count above found the flag unset, so
                // they wake it here, or the next frame would.
                None if self.rest_dormant.load(Ordering::Acquire)
                    && self.core().bytes_moved() != moved =>
                {
                    self.wake_rest_look()
                }
                None => {}
            }
        }
        let (pending, dead, surplus, engine_alive) = self.with_core(|core| {
            let engine_alive = core.peer_engine_active(now);
            let mut dead = core.unacknowledging_channels(now);
            if !engine_alive {
                dead.retain(|&id| {
                    let gone = self.channel(id).is_none_or(|ch| self.black_holed(&ch));
                    if !gone {
                        core.rearm_ack_clock(id, now);
                    }
                    gone
                });
            }
            // Only the dialing side adds channels, so only it gives them back.
            let surplus = if self.initiator && core.next_surplus_check().is_some_and(|t| t <= now) {
                core.surplus_channel(now)
            } else {
                None
            };
            if core.poll_timeout().is_none_or(|t| t > now) {
                return (false, dead, surplus, engine_alive);
            }
            core.handle_timeout(now);
            (core.control_backlog() > 0, dead, surplus, engine_alive)
        });
        if let Some(ch) = surplus.and_then(|id| self.channel(id)) {
            self.retire(&ch);
            // Given back for idleness, below `channels`: they come back with traffic.
            if self.own_throughput_channels() < self.ctx.config.shard_channels(self.shard) {
                self.look_for_regrowth(now);
            }
        }
        for id in dead {
            if let Some(ch) = self.channel(id) {
                let (timeout, user_timeout) =
                    (self.ctx.config.ack_timeout, self.ctx.config.user_timeout);
                let why = if engine_alive {
                    format!(
                        "the peer acknowledged nothing on it for {timeout:?} (ack_timeout) while it acknowledged its other channels"
                    )
                } else {
                    format!(
                        "neither the peer engine (for {timeout:?}) nor its kernel (for {user_timeout:?}) acknowledged"
                    )
                };
                self.channel_failed(
                    &ch,
                    ChannelError::Io(io::Error::new(io::ErrorKind::TimedOut, why)),
                );
            }
        }
        if pending {
            self.transmit_all();
        }
    }

    /// Whether `ch` looks black-holed (`TCP_INFO`): bytes wait to be sent or acknowledged and
    /// the peer's kernel acknowledged nothing for `user_timeout`, with the window open or a
    /// zero-window probe unanswered. A peer that stopped reading keeps its window closed and
    /// answers every probe (more and more rarely as they back off), so it is alive. The
    /// kernel's own `TCP_USER_TIMEOUT` is not used for this: it also aborts a connection whose
    /// peer keeps its window closed that long while answering every probe.
    fn black_holed(&self, ch: &Channel) -> bool {
        let Some(info) = crate::sys::tcp_info(ch.fd()) else { return true };
        let silent = std::time::Duration::from_millis(info.last_ack_recv_ms.into());
        let waiting = info.unacked > 0 || info.notsent_bytes > 0;
        let unanswered = info.snd_wnd > 0 || info.probes > 0;
        waiting && unanswered && silent >= self.ctx.config.user_timeout
    }

    /// When the worker must next run this session's timers (stream deadlines, the peer's
    /// acknowledgement deadline, whether a channel is surplus, the first channels beyond the
    /// first).
    pub fn next_deadline(self: &Arc<Self>) -> Option<Instant> {
        let rest = self.rest.lock().as_ref().and_then(|r| r.at);
        let mut core = self.core();
        let surplus = if self.initiator { core.next_surplus_check() } else { None };
        [core.poll_timeout(), core.next_ack_deadline(), surplus, rest].into_iter().flatten().min()
    }

    /// Closes a throughput channel the session no longer needs (`Session::surplus_channel`):
    /// it is lost to the session as any channel is (whatever the peer still had in flight on
    /// it comes again on the others), but not dialed again; its index's next incarnation is
    /// the next channel added.
    fn retire(self: &Arc<Self>, ch: &Arc<Channel>) {
        let id = ch.meta.index;
        *self.retiring.lock() = Some(id);
        let why = "retired: fewer threads send on the session than it has channels";
        self.channel_failed(ch, ChannelError::Io(io::Error::other(why)));
        self.retiring.lock().take();
        // Listed only now that it is out of the session: a growth meanwhile takes a new index.
        self.free_id(ChannelId::new(id.index, id.incarnation.wrapping_add(1)));
    }

    /// Lists `id` as the next to dial for its index (`free_ids`), in place of any other.
    pub fn free_id(&self, id: ChannelId) {
        let mut ids = self.free_ids.lock();
        ids.retain(|x| x.index != id.index);
        ids.push(id);
    }

    /// Whether `ch` is being retired (`retire`) rather than lost.
    pub fn was_retired(&self, ch: &Channel) -> bool {
        *self.retiring.lock() == Some(ch.meta.index)
    }

    /// Whether a channel with index `index` (any incarnation) is open in the session.
    pub fn has_index(&self, index: u16) -> bool {
        self.channels.read().iter().any(|c| c.meta.index.index == index)
    }

    // ------------------------------------------------------------------ failures

    /// A channel failed: it is closed, its unacknowledged frames are queued again on the
    /// channels that remain, and the engine is told (statistics, redial, session loss).
    pub fn channel_failed(self: &Arc<Self>, ch: &Arc<Channel>, err: ChannelError) {
        if !ch.close(&err) {
            return;
        }
        {
            let mut all = self.channels.write();
            all.retain(|c| !Arc::ptr_eq(c, ch));
            self.channels_changed(&all);
        }
        self.ctx.workers[ch.worker].remove(ch.uid);
        let closed_by_peer = matches!(err, ChannelError::Closed);
        self.with_core(|core| core.channel_lost(ch.meta.index, closed_by_peer));
        self.ctx.channel_closed(self, ch);
        // What was queued again leaves on the channels that remain.
        self.transmit_all();
    }

    /// Closes every channel (engine shutdown).
    pub fn close_all(self: &Arc<Self>, why: &str) {
        for ch in self.channels() {
            ch.close(&ChannelError::Io(io::Error::other(why.to_string())));
            self.ctx.workers[ch.worker].remove(ch.uid);
        }
        let mut all = self.channels.write();
        all.clear();
        self.channels_changed(&all);
    }
}

#[cfg(test)]
mod tests {
    use super::RestChannels;
    use std::time::{Duration, Instant};

    #[test]
    fn rest_channels_wait_for_traffic_and_look_less_often_while_it_stays_idle() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut rest = RestChannels::new(Vec::new(), t0, ms(50), 0);
        assert_eq!(rest.at, Some(t0 + ms(50)));
        // 16 MiB/s over 50 ms is 838,860 bytes: a few requests are not traffic.
        assert!(!rest.busy(t0 + ms(50), 4096, 1, 16 << 20));
        assert_eq!(rest.at, Some(t0 + ms(150)), "the next look twice as far");
        assert!(!rest.busy(t0 + ms(150), 8192, 1, 16 << 20));
        assert_eq!(rest.at, Some(t0 + ms(350)));
        let mut moved = 8192;
        for _ in 0..8 {
            moved += 100;
            assert!(!rest.busy(rest.at.unwrap(), moved, 1, 16 << 20));
        }
        let at = rest.at.unwrap();
        assert!(!rest.busy(at, moved + 100, 1, 16 << 20));
        assert_eq!(rest.at, Some(at + Duration::from_secs(1)), "a quiet session: once a second");
        // Nothing at all since the last look: dormant, no timer, until frames come.
        let at = rest.at.unwrap();
        assert!(!rest.busy(at, moved + 100, 1, 16 << 20));
        assert_eq!(rest.at, None);
        assert!(!rest.due(at + Duration::from_secs(3600)));
        rest.wake(at + ms(500), ms(50));
        assert_eq!(rest.at, Some(at + ms(550)), "woken: a look as at the start");
        // The rate counts from the last look: 2 MiB in 50 ms is 40 MiB/s.
        assert!(rest.busy(at + ms(550), moved + 100 + (2 << 20), 1, 16 << 20));
        // A lost channel's bytes leave the sum: never an overflow.
        let mut rest = RestChannels::new(Vec::new(), t0, ms(50), 0);
        assert!(!rest.busy(t0 + ms(50), 512 << 10, 1, 16 << 20)); // 10 MiB/s
        assert!(!rest.busy(t0 + ms(150), 0, 1, 16 << 20));
        assert_eq!(rest.at, None);
        // Two application threads sending: a sixteenth of the rate is enough (1 MiB/s: 52 KB
        // in 50 ms, 105 KB in the next 100 ms); a few requests are not.
        let mut rest = RestChannels::new(Vec::new(), t0, ms(50), 0);
        assert!(!rest.busy(t0 + ms(50), 40_000, 2, 16 << 20));
        assert!(rest.busy(t0 + ms(150), 40_000 + 110_000, 2, 16 << 20));
        // Rate zero: the first look dials, traffic or not.
        let mut rest = RestChannels::new(Vec::new(), t0, ms(50), 0);
        assert!(rest.busy(t0 + ms(50), 0, 1, 0));
    }
}
