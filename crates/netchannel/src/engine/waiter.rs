//! How application threads wait, and do the engine's work while they wait (run to completion).
//!
//! Each thread that ever blocks in netchannel gets a [`Waiter`]: an epoll set holding an eventfd
//! (targeted wake-ups from other threads) and the channel sockets of the sessions it waits on.
//! Channel sockets are registered `EPOLLEXCLUSIVE` both here and in the worker's epoll set, and
//! the worker's registration is moved behind the application's: the kernel then wakes exactly
//! one sleeper per event, an application thread waiting on that channel if there is one, and
//! the worker only when nobody waits. The thread that wakes does the work (reads and dispatches
//! frames, writes queued ones) and usually finds its own bytes: one wake-up per message, as with
//! kernel TCP, instead of a wake-up of a worker and a second hand-off to the application.
//!
//! Lost wake-ups are impossible by construction: a thread announces it waits ([`Waiter::begin`]),
//! checks its condition and registers with the stream under the session lock, and only then
//! sleeps; a waker changes state under that lock and wakes every registered waiter after
//! releasing it, and a wake-up that comes between the check and the sleep makes the sleep
//! return at once.

use std::cell::RefCell;
use std::io;
use std::os::fd::{AsFd, RawFd};
use std::sync::atomic::{AtomicU16, AtomicU8, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use rustc_hash::FxHashMap;

use super::session::SessionRt;
use crate::driver::Channel;
use crate::proto::ChannelId;
use crate::sys::{Epoll, EventFd, SignalPolicy, EDGE, EXCLUSIVE, READABLE, WRITABLE};
use crate::wire::Class;

const IDLE: u8 = 0;
const SLEEPING: u8 = 1;
const NOTIFIED: u8 = 2;
const TOKEN_WAKE: u64 = 0;
/// A poller's companion fd (`Poller::wake_on`): an event on it ends the poller's wait.
const TOKEN_COMPANION: u64 = u64::MAX;
/// Polling before a sleep (`Waiter::sleep_signals`): a notify then only changes the state, and
/// the poller sees it.
const POLLING_FIRST: u8 = 3;
/// How long a thread whose waits are short polls its epoll set before it sleeps. A sleep and
/// its wake-up cost the answer's latency a scheduler wake-up of an idle core (on a virtual
/// machine an interprocessor interrupt and a halted vCPU's return: about 8 us each way here,
/// measured with `perf sched timehist`), which a ping-pong pays twice per round trip.
const POLL_FOR: Duration = Duration::from_micros(50);
/// The poll window in force (`set_poll_before_sleep`), in ns; `u64::MAX`: `POLL_FOR`.
static POLL_FOR_NS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(u64::MAX);

/// Sets how long a waiting thread whose waits are short polls before it sleeps (default
/// 50 us); `Duration::ZERO` turns polling off, for a machine whose idle cores are not this
/// process's to spend. Process-wide: a thread's waits span every engine of the process.
pub fn set_poll_before_sleep(window: Duration) {
    let ns = u64::try_from(window.as_nanos()).unwrap_or(u64::MAX - 1).min(u64::MAX - 1);
    POLL_FOR_NS.store(ns, Ordering::Relaxed);
}

/// The poll window in force.
fn poll_for() -> Duration {
    match POLL_FOR_NS.load(Ordering::Relaxed) {
        u64::MAX => POLL_FOR,
        ns => Duration::from_nanos(ns),
    }
}
/// Waits in a row that ended within `POLL_FOR` before a thread polls: a thread whose waits
/// are long (a blocked sender, one of many threads taking turns on few cores) never polls
/// (nor probes, `PROBE_EVERY`, once they are longer than twice the window), and one long wait
/// stops it polling until this many short ones came again (or a probe found its event). A
/// poll that found nothing (its time spent for nothing) doubles the number, up to
/// `POLL_AFTER_MAX`; one that found its event halves it.
const POLL_AFTER: u8 = 2;
const POLL_AFTER_MAX: u8 = 64;
/// A thread whose last `PROBE_EVERY` times its `polls_after` waits all ended within twice
/// `POLL_FOR`, none of them polled, polls once all the same (a probe). Without it, where a
/// wake-up is slow, polling could never start: two sleeping ends answer each other in two
/// wake-ups, longer than `POLL_FOR`, so no wait counts as short, though one end's poll would
/// make both ends' waits short (its peer's answer costs it no wake-up, and its own answer comes
/// without one). A probe that finds its event lets the thread poll from then on; one that
/// finds nothing doubles `polls_after`, which spaces the next probe twice as far (at most one
/// in `PROBE_EVERY * POLL_AFTER_MAX` waits). A thread whose waits are longer than that (a
/// blocked sender, one of many threads taking turns on few cores) never probes: a poll would
/// not have caught its events.
const PROBE_EVERY: u16 = 4;

/// Polls before a sleep in this process, and those that found what they waited for
/// (`poll_counts`).
static POLLS: [std::sync::atomic::AtomicU64; 2] =
    [const { std::sync::atomic::AtomicU64::new(0) }; 2];

/// How many waits of this process polled before sleeping, and how many of those found their
/// event by polling (the others slept after `POLL_FOR`).
pub fn poll_counts() -> (u64, u64) {
    (POLLS[0].load(Ordering::Relaxed), POLLS[1].load(Ordering::Relaxed))
}

/// Whether a core would stay idle while this thread waits, so that polling takes nothing from
/// anyone: the machine's runnable threads (this one included) are at most its cores. Where
/// threads wait for a core (the throughput work beside a latency stream, a crowd of blocking
/// threads) a poll would take the core from them, and the wake-up it saves is not slow there
/// (the core is awake). The count is read at most once a millisecond per process.
fn core_free(now: Instant) -> bool {
    static START: std::sync::OnceLock<(Instant, u32)> = std::sync::OnceLock::new();
    /// The last count read, plus one (0: none yet), and when (ms since `START`, high bits).
    static SEEN: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let (start, cores) = *START.get_or_init(|| {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        (Instant::now(), u32::try_from(cores).unwrap_or(u32::MAX))
    });
    let ms = now.saturating_duration_since(start).as_millis() as u64;
    let seen = SEEN.load(Ordering::Relaxed);
    let runnable = if seen != 0 && seen >> 32 == ms {
        (seen & 0xffff_ffff) as u32 - 1
    } else {
        let r = crate::sys::runnable_threads().unwrap_or(u32::MAX - 1).min(u32::MAX - 1);
        SEEN.store(ms << 32 | u64::from(r + 1), Ordering::Relaxed);
        r
    };
    runnable <= cores
}

/// Whether a thread's next wait polls first (where a core is free): it had `need` short waits in
/// a row, or `PROBE_EVERY * need` waits in a row that ended within twice `POLL_FOR`, none
/// polled (a probe).
fn poll_earned(short_waits: u8, need: u8, since_poll: u16) -> bool {
    short_waits >= need || since_poll >= PROBE_EVERY * u16::from(need)
}

/// A channel event a waiting thread received and must handle.
pub(crate) struct ChannelEvent {
    pub channel: Arc<Channel>,
    pub session: Arc<SessionRt>,
    pub events: u32,
}

#[derive(Default)]
struct Watched {
    /// Token (index + 1) to channel.
    slots: Vec<Option<(Weak<Channel>, Weak<SessionRt>)>>,
    by_uid: FxHashMap<u64, u64>,
    free: Vec<u64>,
    /// Per session (its address; the `Weak` keeps the address from being reused) and class:
    /// the channel set last registered (`SessionRt::channels_generation`) and the class whose
    /// channels serve it.
    seen: FxHashMap<(usize, usize), (Weak<SessionRt>, u64, Class)>,
    /// `watch` calls since the last sweep of what is gone: a sweep every `slots` calls keeps
    /// its cost per call constant however many channels the thread watches.
    since_sweep: usize,
}

pub(crate) struct Waiter {
    epoll: Epoll,
    event: EventFd,
    state: AtomicU8,
    watched: Mutex<Watched>,
    /// The companion fd in this thread's epoll set, if any, and its registration's key.
    companion: Mutex<Option<(RawFd, u64)>>,
    /// Waits in a row that ended within `POLL_FOR` (at most `POLL_AFTER_MAX`), and how many a
    /// poll needs (`POLL_AFTER` to `POLL_AFTER_MAX`): the owning thread's alone.
    short_waits: AtomicU8,
    polls_after: AtomicU8,
    /// Waits in a row, none polled, that ended within twice `POLL_FOR` (at most
    /// `PROBE_EVERY * POLL_AFTER_MAX`).
    since_poll: AtomicU16,
}

/// How a poll before a sleep ended.
enum Polled {
    /// Events came (and were collected): whether the companion fd had one.
    Events(bool),
    /// A notify came, or the deadline.
    Woken,
    /// A signal handler ran in an interruptible wait.
    Interrupted,
    /// Nothing within `POLL_FOR`: sleep (the state says so already).
    Sleep,
}

impl Waiter {
    fn new() -> io::Result<Arc<Waiter>> {
        let epoll = Epoll::new()?;
        let event = EventFd::new()?;
        // Edge-triggered: every notify is a new edge, so the counter never needs reading.
        epoll.add(event.as_fd(), READABLE | EDGE, TOKEN_WAKE)?;
        Ok(Arc::new(Waiter {
            epoll,
            event,
            state: AtomicU8::new(IDLE),
            watched: Mutex::default(),
            companion: Mutex::new(None),
            short_waits: AtomicU8::new(0),
            polls_after: AtomicU8::new(POLL_AFTER),
            since_poll: AtomicU16::new(0),
        }))
    }

    /// Wakes the thread if it sleeps; otherwise makes its next sleep return at once.
    pub fn notify(&self) {
        // A thread polling sees the state change itself.
        if self.state.swap(NOTIFIED, Ordering::SeqCst) == SLEEPING {
            self.event.notify();
        }
    }

    /// Starts a wait iteration: wake-ups from here on are not lost.
    pub fn begin(&self) {
        self.state.store(IDLE, Ordering::SeqCst);
    }

    /// Sleeps until notified (since `begin`), a watched channel has an event, the companion
    /// fd has one, or `deadline`. Channel events are appended to `out` for the caller to
    /// handle; returns whether the companion fd had an event.
    pub fn sleep(
        &self,
        deadline: Option<Instant>,
        out: &mut Vec<ChannelEvent>,
    ) -> io::Result<bool> {
        self.sleep_signals(deadline, out, SignalPolicy::default())
    }

    /// `sleep` under a signal policy (an interruptible sleep fails with `Interrupted`).
    pub fn sleep_signals(
        &self,
        deadline: Option<Instant>,
        out: &mut Vec<ChannelEvent>,
        signals: SignalPolicy<'_>,
    ) -> io::Result<bool> {
        let started = Instant::now();
        let window = poll_for();
        let need = self.polls_after.load(Ordering::Relaxed);
        let since_poll = self.since_poll.load(Ordering::Relaxed);
        let poll = !window.is_zero()
            && poll_earned(self.short_waits.load(Ordering::Relaxed), need, since_poll)
            && signals.may_poll_first()
            && deadline.is_none_or(|d| d > started)
            && core_free(started);
        let first = if poll { POLLING_FIRST } else { SLEEPING };
        if self.state.compare_exchange(IDLE, first, Ordering::SeqCst, Ordering::SeqCst).is_err() {
            self.state.store(IDLE, Ordering::SeqCst);
            return Ok(false);
        }
        let r = with_raw_events(|raw| {
            if poll {
                match self.poll_first(raw, out, started, window, deadline, signals) {
                    Polled::Events(companion) => return Ok(companion),
                    Polled::Woken => return Ok(false),
                    Polled::Interrupted => {
                        return Err(io::Error::from(io::ErrorKind::Interrupted));
                    }
                    Polled::Sleep => {}
                }
            }
            let timeout = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            let r = self.epoll.wait_signals(raw, 64, timeout, signals);
            self.state.store(IDLE, Ordering::SeqCst);
            r?;
            Ok(self.collect(raw, out))
        });
        let (elapsed, short_bound) = (started.elapsed(), window.max(POLL_FOR));
        let short = elapsed <= short_bound;
        // Within twice the window: slow wake-ups may be what made it long (`PROBE_EVERY`).
        let near = elapsed <= 2 * short_bound;
        let n = self.short_waits.load(Ordering::Relaxed);
        let mut next = if short { (n + 1).min(POLL_AFTER_MAX) } else { 0 };
        if poll && short {
            // A poll that found its event (a probe's too) earns the next wait's poll.
            next = next.max(need);
        }
        if next != n {
            self.short_waits.store(next, Ordering::Relaxed);
        }
        let since = if poll || !near {
            0
        } else {
            (since_poll + 1).min(PROBE_EVERY * u16::from(POLL_AFTER_MAX))
        };
        if since != since_poll {
            self.since_poll.store(since, Ordering::Relaxed);
        }
        if poll {
            POLLS[0].fetch_add(1, Ordering::Relaxed);
            if short {
                POLLS[1].fetch_add(1, Ordering::Relaxed);
            }
            let need = if short { (need / 2).max(POLL_AFTER) } else { need * 2 };
            self.polls_after.store(need.min(POLL_AFTER_MAX), Ordering::Relaxed);
        }
        r
    }

    /// Polls the thread's epoll set (without sleeping) for up to `POLL_FOR` after `started`
    /// (or until `deadline`), in state `POLLING_FIRST`; passes to `SLEEPING` when nothing came.
    fn poll_first(
        &self,
        raw: &mut Vec<(u64, u32)>,
        out: &mut Vec<ChannelEvent>,
        started: Instant,
        window: Duration,
        deadline: Option<Instant>,
        signals: SignalPolicy<'_>,
    ) -> Polled {
        let until = deadline.map_or(started + window, |d| d.min(started + window));
        let handled = signals.handled.map(|count| (count, count()));
        loop {
            if self.state.load(Ordering::SeqCst) == NOTIFIED {
                self.state.store(IDLE, Ordering::SeqCst);
                return Polled::Woken;
            }
            if self.epoll.wait(raw, 64, Some(Duration::ZERO)).is_ok_and(|n| n > 0) {
                self.state.store(IDLE, Ordering::SeqCst);
                return Polled::Events(self.collect(raw, out));
            }
            if signals.interruptible && handled.is_some_and(|(count, was)| count() != was) {
                self.state.store(IDLE, Ordering::SeqCst);
                return Polled::Interrupted;
            }
            if Instant::now() >= until {
                break;
            }
            std::hint::spin_loop();
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            self.state.store(IDLE, Ordering::SeqCst);
            return Polled::Woken;
        }
        match self.state.compare_exchange(
            POLLING_FIRST,
            SLEEPING,
            Ordering::SeqCst,
            Ordering::SeqCst,
        ) {
            Ok(_) => Polled::Sleep,
            // Notified meanwhile.
            Err(_) => {
                self.state.store(IDLE, Ordering::SeqCst);
                Polled::Woken
            }
        }
    }

    /// Turns raw events of the thread's epoll set into channel events; returns whether the
    /// companion fd had one.
    fn collect(&self, raw: &[(u64, u32)], out: &mut Vec<ChannelEvent>) -> bool {
        let watched = self.watched.lock();
        let mut companion = false;
        for &(token, events) in raw {
            if token == TOKEN_WAKE {
                continue;
            }
            if token == TOKEN_COMPANION {
                companion = true;
                continue;
            }
            let Some(Some((ch, s))) = watched.slots.get(token as usize - 1) else { continue };
            if let (Some(channel), Some(session)) = (ch.upgrade(), s.upgrade()) {
                out.push(ChannelEvent { channel, session, events });
            }
        }
        companion
    }

    /// Puts `fd` (edge-triggered) in this thread's epoll set as the companion, in place of any
    /// other. It stays there after the wait (two system calls per wait otherwise): another wait
    /// of this thread that sees its edge ignores it, which the poller's contract allows (its
    /// owner polls `fd` itself before each wait). `key` tells a new registration from an old
    /// one under a reused fd number.
    pub fn set_companion(&self, fd: RawFd, key: u64) {
        let mut c = self.companion.lock();
        if *c == Some((fd, key)) {
            return;
        }
        if let Some((old, _)) = c.take() {
            let _ = self.epoll.delete_raw(old);
        }
        if self.epoll.add_or_modify_raw(fd, READABLE | EDGE, TOKEN_COMPANION).is_ok() {
            *c = Some((fd, key));
        }
    }

    /// Sleeps in `sleep_in` (a `poll` over the caller's fds and `epoll_fd`, which is readable
    /// while a watched channel has an event or a wake-up is pending), then collects the
    /// channel events into `out`. `None` when a wake-up came since `begin` (nothing slept).
    #[cfg_attr(not(feature = "internals"), allow(dead_code))]
    pub fn sleep_beside<T>(
        &self,
        out: &mut Vec<ChannelEvent>,
        sleep_in: impl FnOnce(RawFd) -> T,
    ) -> Option<T> {
        if self.state.compare_exchange(IDLE, SLEEPING, Ordering::SeqCst, Ordering::SeqCst).is_err()
        {
            self.state.store(IDLE, Ordering::SeqCst);
            return None;
        }
        let r = sleep_in(self.epoll.raw());
        self.state.store(IDLE, Ordering::SeqCst);
        with_raw_events(|raw| {
            if self.epoll.wait(raw, 64, Some(Duration::ZERO)).is_ok() {
                self.collect(raw, out);
            }
        });
        Some(r)
    }

    /// Collects the channel events already queued in the thread's epoll set, without sleeping
    /// and without touching the wake-up state (a notification since `begin` still ends the
    /// next sleep at once). Used by `vns::serve` (the `internals` feature).
    #[cfg(feature = "internals")]
    pub fn collect_now(&self, out: &mut Vec<ChannelEvent>) {
        with_raw_events(|raw| {
            if self.epoll.wait(raw, 64, Some(Duration::ZERO)).is_ok() {
                self.collect(raw, out);
            }
        });
    }

    /// Sleeps until notified or `deadline` without serving channels: for waits no channel
    /// event can satisfy (accept), so that the channels this thread once watched go to the
    /// threads that wait on them (an epoll set nobody sleeps in is skipped by exclusive
    /// wake-ups).
    pub fn sleep_quiet(&self, deadline: Option<Instant>) -> io::Result<()> {
        if self.state.compare_exchange(IDLE, SLEEPING, Ordering::SeqCst, Ordering::SeqCst).is_err()
        {
            self.state.store(IDLE, Ordering::SeqCst);
            return Ok(());
        }
        let timeout = deadline.map(|d| d.saturating_duration_since(Instant::now()));
        let r = crate::sys::poll_readable(self.event.as_fd(), timeout);
        self.state.store(IDLE, Ordering::SeqCst);
        // Drained here (the epoll registration is edge-triggered and never needs it).
        self.event.drain();
        r.map(|_| ())
    }

    /// Makes sure this thread's epoll set holds the open channels of `session` that carry
    /// `class`, ahead of the workers' registrations, or only those `Watch::Channels` names,
    /// or none beyond those it holds (`Watch::Learned`: an event loop's
    /// wait, whose thread registers the channels of the streams it uses as it uses them,
    /// `learn`). Returns the class whose channels serve `class`.
    pub fn watch(&self, session: &Arc<SessionRt>, class: Class, which: Watch) -> Class {
        let key = (Arc::as_ptr(session) as usize, class.index());
        let generation = session.channels_generation();
        let mut w = self.watched.lock();
        w.since_sweep += 1;
        if let Some(&(_, seen, served)) = w.seen.get(&key) {
            if seen == generation || which == Watch::Learned {
                // Registered already, and the session's channels are the same.
                session.note_app_wait(served);
                w.sweep_now();
                return served;
            }
        }
        let channels = session.serving_channels(class);
        // The channels of the other class serve `class` when it has none of its own.
        let served = channels.first().map_or(class, |c| c.meta.class);
        session.note_app_wait(served);
        if let Watch::Channels(ids) = which {
            if ids.iter().any(Option::is_some) {
                for ch in channels.iter().filter(|c| ids.contains(&Some(c.meta.index))) {
                    self.register(&mut w, session, ch);
                }
                w.sweep_now();
                return served;
            }
        }
        if which == Watch::Learned {
            w.seen.insert(key, (Arc::downgrade(session), 0, served));
            w.sweep_now();
            return served;
        }
        let mut complete = true;
        for ch in channels.iter() {
            complete &= self.register(&mut w, session, ch);
        }
        if complete {
            w.seen.insert(key, (Arc::downgrade(session), generation, served));
        } else {
            w.seen.remove(&key);
        }
        w.sweep_now();
        served
    }

    /// Puts `ch` in this thread's epoll set (once), ahead of its worker's registration; false
    /// when the kernel refused (tried again on a later call).
    fn register(&self, w: &mut Watched, session: &Arc<SessionRt>, ch: &Arc<Channel>) -> bool {
        if w.by_uid.contains_key(&ch.uid) {
            return true;
        }
        let token = match w.free.pop() {
            Some(t) => t,
            None => {
                w.slots.push(None);
                w.slots.len() as u64
            }
        };
        let flags = READABLE | WRITABLE | EDGE | EXCLUSIVE;
        if self.epoll.add(ch.fd(), flags, token).is_err() {
            w.free.push(token);
            return false;
        }
        w.slots[token as usize - 1] = Some((Arc::downgrade(ch), Arc::downgrade(session)));
        w.by_uid.insert(ch.uid, token);
        ch.app_watchers.fetch_add(1, Ordering::AcqRel);
        // Behind us in the socket's wait queue from now on.
        session.ctx.workers[ch.worker].reregister(ch);
        true
    }

    /// This thread used a stream whose frames come on `channels` of `session`: they join its
    /// epoll set, so that the kernel wakes this thread for them (see `Session::home`).
    pub fn learn(&self, session: &Arc<SessionRt>, channels: [Option<ChannelId>; 2]) {
        let known = LEARNED.with(|l| l.borrow().knows(session, channels));
        if known {
            return;
        }
        let mut w = self.watched.lock();
        for id in channels.into_iter().flatten() {
            if let Some(ch) = session.channel(id) {
                self.register(&mut w, session, &ch);
            }
        }
        drop(w);
        LEARNED.with(|l| l.borrow_mut().note(session, channels));
    }
}

impl Drop for Waiter {
    fn drop(&mut self) {
        // The thread is gone: its registrations no longer serve the channels.
        for (ch, _) in self.watched.get_mut().slots.iter().flatten() {
            if let Some(ch) = ch.upgrade() {
                ch.app_watchers.fetch_sub(1, Ordering::AcqRel);
            }
        }
    }
}

/// Which channels of a session a waiting thread registers (`Waiter::watch`).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Watch {
    /// These (a blocking call's stream's `Session::wait_channels`); every one when none is
    /// known.
    Channels([Option<ChannelId>; 2]),
    /// Those the thread registered already (an event loop learns its channels as it uses its
    /// streams).
    Learned,
}

/// Per thread: the channels of recently used sessions this thread registered (by session
/// address and channel set), so that `Waiter::learn` costs a look-up per call.
#[derive(Default)]
struct Learned {
    entries: Vec<(usize, u64, u64)>,
}

/// Sessions a thread remembers its channels of (a thread of an event loop over more peers
/// takes the waiter's lock for those it forgot).
const LEARNED_SESSIONS: usize = 8;

impl Learned {
    fn bits(channels: [Option<ChannelId>; 2]) -> u64 {
        channels.into_iter().flatten().fold(0, |m, c| m | c.bit())
    }

    fn knows(&self, session: &Arc<SessionRt>, channels: [Option<ChannelId>; 2]) -> bool {
        let (key, generation) = (Arc::as_ptr(session) as usize, session.channels_generation());
        let want = Self::bits(channels);
        self.entries.iter().any(|&(k, g, m)| k == key && g == generation && m & want == want)
    }

    fn note(&mut self, session: &Arc<SessionRt>, channels: [Option<ChannelId>; 2]) {
        let (key, generation) = (Arc::as_ptr(session) as usize, session.channels_generation());
        let bits = Self::bits(channels);
        if let Some(i) = self.entries.iter().position(|&(k, _, _)| k == key) {
            let (_, g, m) = self.entries.remove(i);
            let m = if g == generation { m | bits } else { bits };
            self.entries.insert(0, (key, generation, m));
            return;
        }
        self.entries.truncate(LEARNED_SESSIONS - 1);
        self.entries.insert(0, (key, generation, bits));
    }
}

impl Watched {
    /// Forgets channels that are gone (their fds were closed, which removed them from the
    /// epoll set) and sessions that are gone, once every `slots` calls.
    fn sweep_now(&mut self) {
        if self.since_sweep < self.slots.len().max(64) {
            return;
        }
        self.since_sweep = 0;
        let dead: Vec<(u64, u64)> = self
            .by_uid
            .iter()
            .filter(|(_, &t)| {
                self.slots[t as usize - 1].as_ref().is_none_or(|(c, _)| c.strong_count() == 0)
            })
            .map(|(&u, &t)| (u, t))
            .collect();
        for (uid, token) in dead {
            self.by_uid.remove(&uid);
            self.slots[token as usize - 1] = None;
            self.free.push(token);
        }
        self.seen.retain(|_, (s, _, _)| s.strong_count() > 0);
    }
}

/// Runs `f` with the thread's buffer for the raw events of one wait, empty (kept between
/// waits: one is made per message, and a fresh list each time was an allocation per message).
fn with_raw_events<R>(f: impl FnOnce(&mut Vec<(u64, u32)>) -> R) -> R {
    let mut raw = RAW_EVENTS.try_with(std::cell::Cell::take).unwrap_or_default();
    raw.clear();
    let r = f(&mut raw);
    raw.clear();
    let _exiting = RAW_EVENTS.try_with(|c| c.set(raw));
    r
}

/// Runs `f` with the thread's list for the channel events of one wait, empty (kept between
/// waits, as `with_raw_events`'s buffer; a nested wait takes a list of its own).
pub(crate) fn with_channel_events<R>(f: impl FnOnce(&mut Vec<ChannelEvent>) -> R) -> R {
    let mut events = CHANNEL_EVENTS.try_with(std::cell::Cell::take).unwrap_or_default();
    let r = f(&mut events);
    events.clear();
    if events.capacity() <= 1024 {
        let _exiting = CHANNEL_EVENTS.try_with(|c| c.set(events));
    }
    r
}

thread_local! {
    /// See `with_channel_events`.
    static CHANNEL_EVENTS: std::cell::Cell<Vec<ChannelEvent>> = const { std::cell::Cell::new(Vec::new()) };
    /// See `with_raw_events`.
    static RAW_EVENTS: std::cell::Cell<Vec<(u64, u32)>> = const { std::cell::Cell::new(Vec::new()) };
    static CURRENT: RefCell<Option<Arc<Waiter>>> = const { RefCell::new(None) };
    static THREAD: RefCell<ThreadTx> = RefCell::new(ThreadTx::default());
    /// The poller this thread is serving channels for, while it does (its address).
    static POLLING: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
    static LEARNED: RefCell<Learned> = RefCell::new(Learned::default());
    /// The thread's number (`thread_number`), once it has one.
    static NUMBER: std::cell::Cell<Option<u16>> = const { std::cell::Cell::new(None) };
}

/// A number of the calling thread, given in order of first use (wrapping): the thread's
/// channel among a session's (`Session::set_thread`).
pub(crate) fn thread_number() -> u16 {
    static NEXT: std::sync::atomic::AtomicU16 = std::sync::atomic::AtomicU16::new(0);
    NUMBER
        .try_with(|n| match n.get() {
            Some(v) => v,
            None => {
                let v = NEXT.fetch_add(1, Ordering::Relaxed);
                n.set(Some(v));
                v
            }
        })
        .unwrap_or(0)
}

/// The poller the calling thread is handling channel events for (0: none).
pub(crate) fn polling() -> usize {
    POLLING.with(|p| p.get())
}

pub(crate) fn set_polling(poller: usize) {
    POLLING.with(|p| p.set(poller));
}

/// This thread's waiter, created on first use.
pub(crate) fn current() -> io::Result<Arc<Waiter>> {
    CURRENT.with(|c| {
        let mut c = c.borrow_mut();
        if let Some(w) = c.as_ref() {
            return Ok(w.clone());
        }
        let w = Waiter::new()?;
        *c = Some(w.clone());
        Ok(w)
    })
}

/// How this thread sends: whether its sends are written at once or left for a moment so that
/// more of them leave in one system call.
#[derive(Default)]
struct ThreadTx {
    /// The thread's last wait was a poller's: it is an event loop, and it will flush when it
    /// comes back to wait.
    event_loop: bool,
    /// When the thread last sent, and whether it waited since.
    last_send: Option<Instant>,
    waited: bool,
    /// Sessions holding sends this thread deferred, each with the classes (`Class::bit`) they were deferred in, and how many bytes: a flush writes those classes
    /// only, so a latency thread never writes the throughput backlog of its session.
    dirty: Vec<(Arc<SessionRt>, u8)>,
    deferred: usize,
    /// The stream of the first deferred send, and whether others followed (`send_now`).
    first_stream: Option<u64>,
    several_streams: bool,
}

impl ThreadTx {
    /// `session` holds frames of `class` this thread left for its next flush.
    fn mark_dirty(&mut self, session: &Arc<SessionRt>, class: Class) {
        match self.dirty.iter_mut().find(|(s, _)| Arc::ptr_eq(s, session)) {
            Some((_, classes)) => *classes |= class.bit(),
            None => self.dirty.push((session.clone(), class.bit())),
        }
    }
}

/// Sends closer together than this, with no wait in between, are a burst: they coalesce.
const BURST_GAP: Duration = Duration::from_micros(20);
/// A thread that deferred this many bytes writes them now: large batches, bounded delay. 256
/// KiB: at 64 KiB a burst of 16 or 64 KiB writes went out one `writev` per write, and one
/// stream of 64 KiB writes ran at 34 Gbit/s against 54 now (docs/BENCHMARKS.md, "A burst
/// leaves in 256 KiB").
const FLUSH_BYTES: usize = 256 * 1024;
/// The same for a program's socket (`observed`): its writes leave as kernel TCP would send them,
/// sooner. At 256 KiB a write of 64-255 KiB waited for the program's next one, and
/// redis-benchmark's 4 KiB GETs (16 answers written at once) and iperf3 lost 13-20%.
const FLUSH_BYTES_OBSERVED: usize = 64 * 1024;
/// The same for an unmodified program's event loop answering several streams: their peers
/// start on the first answers while the loop is still producing the rest, instead of the two
/// sides taking turns a whole iteration at a time (redis-benchmark against redis-server ran
/// 20-40% faster with 4 KiB than with 64 KiB, docs/BENCHMARKS.md). The Rust API's event loops
/// keep 64 KiB: whether it helps or hurts them was not measurable here (ncperf's 1,000-flow RPC
/// varies from 58k to 118k requests/s run to run on this machine).
const FLUSH_BYTES_SEVERAL: usize = 4 * 1024;

/// Decides whether `bytes` just queued on `session` are written now (`true`) or deferred until
/// this thread waits (an event loop flushes once per iteration; a burst of small sends leaves
/// together). Deferred sends are also written by the worker after one tick, so a thread that
/// never comes back cannot strand them.
/// `observed`: the socket's program sees it through an interposition layer (it expects its
/// answers to leave as kernel TCP would send them: sooner).
pub(crate) fn send_now(
    session: &Arc<SessionRt>,
    class: Class,
    stream: u64,
    bytes: usize,
    observed: bool,
) -> bool {
    THREAD.with(|t| {
        let mut t = t.borrow_mut();
        let now = Instant::now();
        let burst = !t.waited && t.last_send.is_some_and(|l| now.duration_since(l) < BURST_GAP);
        t.last_send = Some(now);
        t.waited = false;
        let flush = if observed { FLUSH_BYTES_OBSERVED } else { FLUSH_BYTES };
        if !(t.event_loop || burst) || bytes >= flush {
            return true;
        }
        t.deferred += bytes;
        t.mark_dirty(session, class);
        match t.first_stream {
            None => t.first_stream = Some(stream),
            Some(first) if first != stream && observed => t.several_streams = true,
            Some(_) => {}
        }
        let limit = if t.several_streams { FLUSH_BYTES_SEVERAL } else { flush };
        if t.deferred >= limit {
            // Written now, with everything else this thread deferred on `session`.
            t.deferred = 0;
            t.first_stream = None;
            t.several_streams = false;
            return true;
        }
        false
    })
}

/// A control frame of `session` that may wait (a CREDIT the peer does not wait for): it leaves
/// with this thread's next frames out on the session, at the latest when the thread waits, and
/// the worker writes it after a tick if neither comes.
pub(crate) fn defer_control(session: &Arc<SessionRt>, class: Class) {
    let _exiting = THREAD.try_with(|t| t.borrow_mut().mark_dirty(session, class));
    session.defer_flush_class(class);
}

/// Writes now the sends this thread deferred, without waiting (`VSocket`'s `Write::flush`):
/// for a loop that sleeps somewhere the engine does not see, such as its own epoll set.
pub(crate) fn flush_deferred() {
    let mut dirty = THREAD.with(|t| {
        let mut t = t.borrow_mut();
        t.waited = true;
        t.deferred = 0;
        t.first_stream = None;
        t.several_streams = false;
        std::mem::take(&mut t.dirty)
    });
    for (s, classes) in dirty.drain(..) {
        s.transmit_classes(classes);
    }
    // The list's memory back for the next burst, unless the writes marked new work meanwhile.
    let _exiting = THREAD.try_with(|t| {
        let mut t = t.borrow_mut();
        if t.dirty.is_empty() {
            t.dirty = dirty;
        }
    });
}

/// Writes the sends this thread deferred; called before it sleeps. `event_loop`: the wait is a
/// poller's.
pub(crate) fn before_wait(event_loop: bool) {
    THREAD.with(|t| t.borrow_mut().event_loop = event_loop);
    flush_deferred();
}

/// Handles channel events a waiting thread received.
pub(crate) fn handle(events: &mut Vec<ChannelEvent>) {
    for e in events.drain(..) {
        e.session.on_channel_event(&e.channel, e.events);
    }
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;

    use super::*;
    use crate::{Config, Engine, VSocket};

    /// Two engines on loopback, and a latency and a throughput socket from the first to the
    /// second (each with its accepted end): one session, both classes (`session_shards` 1:
    /// with more, latency streams are a session of their own and share no flush with
    /// throughput ones at all).
    fn two_classes() -> ((Engine, Engine), VSocket, VSocket, VSocket, VSocket) {
        let here = SocketAddr::from(([127, 0, 0, 1], 0));
        let config = || Config { session_shards: 1, ..Config::new(here) };
        let (a, b) = (Engine::new(config()).unwrap(), Engine::new(config()).unwrap());
        let l = b.listen(7).unwrap();
        let lat = a.connect_with_class(b.local_addr(), 7, Class::Latency).unwrap();
        let lat_peer = l.accept().unwrap();
        let bulk = a.connect_with_class(b.local_addr(), 7, Class::Throughput).unwrap();
        let bulk_peer = l.accept().unwrap();
        ((a, b), lat, lat_peer, bulk, bulk_peer)
    }

    /// Short waits (here: a deadline already reached) make a waiter poll first; one that runs past
    /// `POLL_FOR` makes it sleep at once again.
    #[test]
    fn short_waits_earn_a_poll_and_a_long_one_takes_it_back() {
        let w = Waiter::new().unwrap();
        let mut out = Vec::new();
        for _ in 0..POLL_AFTER {
            w.begin();
            assert!(!w.sleep(Some(Instant::now()), &mut out).unwrap());
        }
        assert!(w.short_waits.load(Ordering::Relaxed) >= POLL_AFTER);
        w.begin();
        let _ = w.sleep(Some(Instant::now() + 4 * POLL_FOR), &mut out);
        assert_eq!(w.short_waits.load(Ordering::Relaxed), 0);
    }

    /// Two ends that sleep answer each other in two wake-ups each way; where a wake-up is slower
    /// than half of `POLL_FOR` no wait is short, and only a probe starts polling: a probe's
    /// success earns the next wait a poll, and a failure spaces the next probe out.
    #[test]
    fn long_waits_still_probe_and_a_probe_that_finds_its_event_keeps_polling() {
        assert!(!poll_earned(0, POLL_AFTER, 0));
        let first_probe = (0..=u16::MAX).find(|&n| poll_earned(0, POLL_AFTER, n)).unwrap();
        assert_eq!(first_probe, PROBE_EVERY * u16::from(POLL_AFTER));
        let after_failures = (0..=u16::MAX).find(|&n| poll_earned(0, POLL_AFTER_MAX, n)).unwrap();
        assert_eq!(after_failures, PROBE_EVERY * u16::from(POLL_AFTER_MAX));
        // The cap on the count of waits since a poll is a probe's distance at most.
        assert!(poll_earned(0, POLL_AFTER_MAX, PROBE_EVERY * u16::from(POLL_AFTER_MAX)));
        // What a found poll leaves (`short_waits` at least `need`) earns the next one.
        assert!(poll_earned(POLL_AFTER, POLL_AFTER, 0));
    }

    /// Waits longer than twice the window never add up to a probe: a thread blocked for long
    /// (a sender waiting for room, one of many threads taking turns on few cores) keeps
    /// sleeping at once.
    #[test]
    fn waits_beyond_twice_the_window_never_probe() {
        let w = Waiter::new().unwrap();
        let mut out = Vec::new();
        for _ in 0..3 * PROBE_EVERY * u16::from(POLL_AFTER) {
            w.begin();
            let _ = w.sleep(Some(Instant::now() + 3 * POLL_FOR), &mut out);
            assert_eq!(w.since_poll.load(Ordering::Relaxed), 0);
        }
        assert_eq!(w.polls_after.load(Ordering::Relaxed), POLL_AFTER, "polled");
    }

    /// With the window set to zero a thread whose waits are short sleeps at once: no poll (which
    /// would double `polls_after`, finding nothing). The default is set back for the other
    /// tests of the process.
    #[test]
    fn a_zero_poll_window_turns_polling_off() {
        let w = Waiter::new().unwrap();
        set_poll_before_sleep(Duration::ZERO);
        w.short_waits.store(POLL_AFTER_MAX, Ordering::Relaxed);
        w.begin();
        let _ = w.sleep(Some(Instant::now() + Duration::from_millis(2)), &mut Vec::new());
        let off = w.polls_after.load(Ordering::Relaxed);
        set_poll_before_sleep(POLL_FOR);
        assert_eq!(off, POLL_AFTER, "polled with polling off");
    }

    /// A notify that comes while a thread polls ends its wait (it only changes the state, which
    /// the poll reads), and one that comes once the poll gave up finds it asleep as usual.
    #[test]
    fn a_notify_while_polling_is_not_lost() {
        let w = Waiter::new().unwrap();
        let (mut raw, mut out) = (Vec::new(), Vec::new());
        let far = Some(Instant::now() + Duration::from_secs(5));
        w.state.store(POLLING_FIRST, Ordering::SeqCst);
        w.notify();
        let started = Instant::now();
        assert!(matches!(
            w.poll_first(&mut raw, &mut out, started, POLL_FOR, far, SignalPolicy::default()),
            Polled::Woken
        ));
        assert_eq!(w.state.load(Ordering::SeqCst), IDLE);
        // Nothing comes: after `POLL_FOR` it is asleep, and a notify then writes the eventfd.
        w.state.store(POLLING_FIRST, Ordering::SeqCst);
        let started = Instant::now();
        assert!(matches!(
            w.poll_first(&mut raw, &mut out, started, POLL_FOR, far, SignalPolicy::default()),
            Polled::Sleep
        ));
        assert!(started.elapsed() >= POLL_FOR);
        assert_eq!(w.state.load(Ordering::SeqCst), SLEEPING);
        w.notify();
        assert!(crate::sys::poll_readable(w.event.as_fd(), Some(Duration::ZERO)).unwrap());
    }

    /// An interruptible wait that polls ends as interrupted when a signal handler runs while
    /// it polls (the handlers' count moves): in user space no system call would report it.
    #[test]
    fn a_handler_run_while_polling_interrupts_an_interruptible_wait() {
        static COUNT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        fn handled() -> u32 {
            // Moves from the second look on: as if a handler ran once the poll began.
            COUNT.fetch_add(1, Ordering::Relaxed)
        }
        let w = Waiter::new().unwrap();
        let (mut raw, mut out) = (Vec::new(), Vec::new());
        let far = Some(Instant::now() + Duration::from_secs(5));
        let policy = SignalPolicy { interruptible: true, mask: None, handled: Some(handled) };
        assert!(policy.may_poll_first());
        w.state.store(POLLING_FIRST, Ordering::SeqCst);
        assert!(matches!(
            w.poll_first(&mut raw, &mut out, Instant::now(), POLL_FOR, far, policy),
            Polled::Interrupted
        ));
        // Without a way to see handlers run, an interruptible wait never polls.
        assert!(!SignalPolicy { handled: None, ..policy }.may_poll_first());
    }

    #[test]
    fn the_machines_runnable_threads_are_read() {
        // This thread runs while it reads: at least one.
        assert!(crate::sys::runnable_threads().is_some_and(|n| n >= 1));
    }

    /// The classes this thread holds deferred sends in, per session.
    fn deferred_classes() -> Vec<u8> {
        THREAD.with(|t| t.borrow().dirty.iter().map(|(_, c)| *c).collect())
    }

    /// A latency thread that flushes must not write the throughput backlog of its session
    /// (another thread's work: the isolation mix lost a fifth of its requests to it).
    #[test]
    fn a_flush_covers_only_the_classes_this_thread_deferred() {
        let (_engines, lat, lat_peer, bulk, _bulk_peer) = two_classes();
        let (lb, tb) = (Class::Latency.bit(), Class::Throughput.bit());
        // As an event loop: sends wait for the thread's next wait.
        flush_deferred();
        THREAD.with(|t| t.borrow_mut().event_loop = true);
        lat.send(b"ping").unwrap();
        assert_eq!(deferred_classes(), vec![lb]);
        bulk.send(&[7u8; 100]).unwrap();
        assert_eq!(deferred_classes(), vec![lb | tb]);
        flush_deferred();
        assert!(deferred_classes().is_empty());
        lat.send(b"pong").unwrap();
        assert_eq!(deferred_classes(), vec![lb], "a latency send marks its class alone");
        flush_deferred();
        let mut got = Vec::new();
        let mut buf = [0u8; 16];
        while got.len() < 8 {
            let n = lat_peer.recv(&mut buf).unwrap();
            assert!(n > 0);
            got.extend_from_slice(&buf[..n]);
        }
        assert_eq!(got, b"pingpong");
        THREAD.with(|t| t.borrow_mut().event_loop = false);
    }

    /// The same, end to end: a throughput backlog another thread deferred is not written by a
    /// latency thread's flush (it is its own thread's, or its worker's within a tick).
    #[test]
    fn a_latency_flush_leaves_another_thread_s_throughput_backlog() {
        use crate::driver::WRITTEN_BY_THIS_THREAD;
        let ((a, _b), lat, lat_peer, bulk, bulk_peer) = two_classes();
        // A latency channel of its own (else the throughput channels serve both classes).
        let deadline = Instant::now() + Duration::from_secs(10);
        while !a.stats().channels.iter().any(|c| c.channel.class == Class::Latency) {
            assert!(Instant::now() < deadline, "no latency channel was dialed");
            std::thread::sleep(Duration::from_millis(2));
        }
        const BULK: usize = 32 * 1024;
        // The worker writes a deferred backlog within a tick, and sometimes first: the race is
        // run often enough that a flush writing every class would be caught (it was, in 2 of 5
        // single rounds).
        const ROUNDS: usize = 20;
        let (deferred_tx, deferred_rx) = std::sync::mpsc::channel();
        let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
        let other = std::thread::spawn(move || {
            // An event loop that has not come back to wait yet: its sends are deferred.
            THREAD.with(|t| t.borrow_mut().event_loop = true);
            for _ in 0..ROUNDS {
                assert_eq!(bulk.send(&[5u8; BULK]).unwrap(), BULK);
                deferred_tx.send(()).unwrap();
                go_rx.recv().unwrap();
                flush_deferred();
            }
            bulk
        });
        let reader = std::thread::spawn(move || {
            let mut buf = vec![0u8; 64 * 1024];
            let mut got = 0;
            while got < BULK * ROUNDS {
                let n = bulk_peer.recv(&mut buf).unwrap();
                assert!(n > 0 && buf[..n].iter().all(|&x| x == 5));
                got += n;
            }
        });
        THREAD.with(|t| t.borrow_mut().event_loop = true);
        for _ in 0..ROUNDS {
            deferred_rx.recv().unwrap();
            lat.send(b"ping").unwrap();
            let before = WRITTEN_BY_THIS_THREAD.with(|w| w.get());
            flush_deferred();
            let wrote = WRITTEN_BY_THIS_THREAD.with(|w| w.get()) - before;
            assert!(wrote < 1024, "the latency thread wrote {wrote} bytes: another's backlog");
            go_tx.send(()).unwrap();
        }
        THREAD.with(|t| t.borrow_mut().event_loop = false);
        let _bulk = other.join().unwrap();
        reader.join().unwrap();
        let mut pings = [0u8; 4 * ROUNDS];
        let mut got = 0;
        while got < pings.len() {
            got += lat_peer.recv(&mut pings[got..]).unwrap();
        }
        assert!(pings.chunks(4).all(|p| p == b"ping"));
    }
}
