//! The engine: threads and execution model, running inside the application process.
//!
//! Threads: one acceptor (the channel listener and its handshakes) and a fixed pool of workers
//! (`Config::workers`, plus one for latency-class channels when there are any), whatever the
//! number of peers, channels or sockets. The thread that waits does the work: an application
//! thread blocked in `recv`, `send` or `Poller::wait` reads and writes the channels it waits
//! on itself; workers serve channels only while no application thread does (see `waiter`).

pub(crate) mod acceptor;
pub(crate) mod budget;
pub mod config;
pub mod control;
pub(crate) mod listener;
pub(crate) mod priority;
pub(crate) mod readiness;
pub(crate) mod session;
pub(crate) mod stats;
pub(crate) mod waiter;
pub(crate) mod worker;

use std::collections::{HashMap, VecDeque};
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

pub use config::{AppDemotion, Config, Isolation};
pub use stats::{EngineStats, PeerChannelStats, SocketStats};
pub use worker::WorkerThread;

use crate::driver::tcp::{self, Incoming, TcpOptions, TcpTransport};
use crate::driver::{Channel, ChannelError, ChannelMeta, ChannelStats};
use crate::proto::{ChannelId, CoreConfig};
use crate::sys::EventFd;
use crate::wire::{Class, Handshake, RejectReason};
use listener::ListenerShared;
use session::SessionRt;
use worker::Worker;

/// Closed channels remembered for `stats()`.
const CLOSED_CHANNEL_HISTORY: usize = 256;

#[derive(Default)]
pub(crate) struct EngineCounters {
    pub protocol_errors: AtomicU64,
    pub handshake_failures: AtomicU64,
    pub redialed_channels: AtomicU64,
}

#[derive(Default)]
struct Sessions {
    /// By peer address and shard (`Config::session_shards`).
    dialed: HashMap<(SocketAddr, u16), Arc<SessionRt>>,
    accepted: HashMap<u64, Arc<SessionRt>>,
    /// Destinations being dialed: a second connect to one waits for that dial, and dials to
    /// other peers go on meanwhile (no engine-wide lock is held across a dial).
    dialing: HashMap<(SocketAddr, u16), Arc<DialSlot>>,
    /// Peers that refused a shard beyond the first, until when their threads use a shard
    /// they have (bounded: `MAX_SHARD_REFUSALS`).
    shard_refused: HashMap<SocketAddr, std::time::Instant>,
}

impl Sessions {
    /// The distinct peer engines of the live accepted sessions (each shard of a peer is a
    /// session: `Config::session_shards`), and whether the engine of `id` is among them.
    fn accepted_engines(&self, id: u64) -> (usize, bool) {
        use crate::wire::handshake::engine_key;
        let mut keys: Vec<u64> = self
            .accepted
            .values()
            .filter(|s| s.is_alive())
            .map(|s| engine_key(s.peer_engine))
            .collect();
        let known = keys.contains(&engine_key(id));
        keys.sort_unstable();
        keys.dedup();
        (keys.len(), known)
    }
}

/// How long a peer that refused a new shard is not asked for another.
const SHARD_REFUSAL_HOLD: std::time::Duration = std::time::Duration::from_secs(5);
/// Most peers remembered as refusing shards (older entries are dropped past it).
const MAX_SHARD_REFUSALS: usize = 4096;

/// How a dial ended, for the connects that waited for it (an `io::Error` is not `Clone`).
type DialResult = Result<Arc<SessionRt>, (io::ErrorKind, String)>;

/// Clears a flag when dropped (however the thread that holds it ends).
struct ClearOnDrop<'a>(&'a AtomicBool);

impl Drop for ClearOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

/// The channels of a session to dial: (channel index, class).
pub(crate) type DialPlan = Vec<(u16, Class)>;

/// A dial in progress to one destination and, once done, how it ended.
#[derive(Default)]
struct DialSlot {
    result: parking_lot::Mutex<Option<DialResult>>,
    done: parking_lot::Condvar,
}

/// What every part of the engine shares.
pub(crate) struct EngineCtx {
    pub config: Config,
    /// Large buffers for bulk bytes (send chunks, staged payloads).
    pub pool: Arc<crate::driver::pool::BufPool>,
    pub id: u64,
    pub local_addr: SocketAddr,
    pub listeners: Mutex<HashMap<u16, Arc<ListenerShared>>>,
    pub workers: Vec<Arc<Worker>>,
    pub tcp_options: TcpOptions,
    pub stopping: AtomicBool,
    pub counters: EngineCounters,
    sessions: Mutex<Sessions>,
    /// The shard the next application thread to open a stream gets (`thread_shard`).
    next_shard: std::sync::atomic::AtomicUsize,
    /// `can_shed`'s last answer and when: connections knocking at a full engine do not each
    /// walk every session.
    shed_answer: Mutex<Option<(std::time::Instant, bool)>>,
    /// File descriptors: open channels, engine-wide and per source address.
    pub channel_budget: Arc<budget::ChannelBudget>,
    closed_channels: Mutex<VecDeque<PeerChannelStats>>,
    refusals: Mutex<HashMap<String, u64>>,
    /// Sessions retired (all channels lost) but still referenced: their counters stay visible.
    retired_stale: AtomicU64,
    /// Received bytes held for applications, every session (see `SessionRt::account_held`).
    pub rx_held: AtomicU64,
    /// Application threads doing throughput-class work may be demoted to `throughput_policy`
    /// meanwhile (see `priority`): the process can put them back. Found out on first need (a
    /// scratch thread tries it), not at start: a short-lived client never needs it.
    demote_app_threads: std::sync::OnceLock<bool>,
    /// Latency-class virtual sockets open (`Isolation::Auto` isolates while there are any).
    pub latency_sockets: std::sync::atomic::AtomicUsize,
}

/// A NetChannel engine embedded in this process. Dropping it shuts it down: every virtual socket
/// still open fails with `ConnectionAborted`.
pub struct Engine {
    pub(crate) ctx: Arc<EngineCtx>,
    acceptor: Mutex<Option<JoinHandle<()>>>,
    stop: Arc<EventFd>,
    control: Mutex<Option<control::Endpoint>>,
}

/// Runs `f` on a thread that first enters `netns` (if any) and waits for its result.
fn in_netns<T: Send + 'static>(
    netns: Option<std::path::PathBuf>,
    f: impl FnOnce() -> io::Result<T> + Send + 'static,
) -> io::Result<T> {
    match netns {
        None => f(),
        Some(ns) => std::thread::spawn(move || {
            crate::sys::enter_netns(&ns)?;
            f()
        })
        .join()
        .map_err(|_| io::Error::other("engine set-up thread panicked"))?,
    }
}

impl Engine {
    /// Starts an engine whose channel listener binds `config.listen_addr` (none if
    /// `config.accept_channels` is false).
    pub fn new(config: Config) -> io::Result<Engine> {
        config.validate()?;
        let addr = config.listen_addr;
        let listener = if config.accept_channels {
            let l = in_netns(config.netns.clone(), move || crate::sys::tcp_listen(&addr)).map_err(
                |e| io::Error::new(e.kind(), format!("cannot bind channel listener {addr}: {e}")),
            )?;
            // A forked child keeps no copy: kept, it held the port bound after the engine's
            // process exited (a daemon's parent exits after `listen`), so no other engine
            // could own it and peers that dialed it waited for a handshake nobody would
            // answer, where they are now refused at once.
            Some(crate::sys::ShedOnFork::new(l))
        } else {
            None
        };
        let local_addr = match &listener {
            Some(l) => l.local_addr()?,
            None => addr,
        };
        let worker_count = config.workers + usize::from(config.latency_channels > 0);
        let class_of =
            |i: usize| if i < config.workers { Class::Throughput } else { Class::Latency };
        let workers = (0..worker_count)
            .map(|i| Worker::new(i, class_of(i)))
            .collect::<io::Result<Vec<_>>>()?;
        let ctx = Arc::new(EngineCtx {
            pool: crate::driver::pool::BufPool::new(config.max_frame_payload.max(64 * 1024), 64),
            id: crate::sys::random_u64(),
            local_addr,
            listeners: Mutex::new(HashMap::new()),
            workers,
            tcp_options: TcpOptions {
                notsent_lowat: config.notsent_lowat,
                latency_notsent_lowat: config.latency_notsent_lowat,
                latency_priority: 6,
                congestion: config.congestion.clone(),
                keepalive_idle: config.keepalive_idle,
                keepalive_interval: config.keepalive_interval,
                keepalive_count: config.keepalive_count,
                dial_source: config.dial_source,
            },
            stopping: AtomicBool::new(false),
            counters: EngineCounters::default(),
            sessions: Mutex::new(Sessions::default()),
            next_shard: std::sync::atomic::AtomicUsize::new(0),
            shed_answer: Mutex::new(None),
            channel_budget: budget::ChannelBudget::new(
                config.effective_max_channels_total(),
                config.max_channels_per_source,
            ),
            closed_channels: Mutex::new(VecDeque::new()),
            refusals: Mutex::new(HashMap::new()),
            retired_stale: AtomicU64::new(0),
            rx_held: AtomicU64::new(0),
            demote_app_threads: std::sync::OnceLock::new(),
            latency_sockets: std::sync::atomic::AtomicUsize::new(0),
            config,
        });
        // The latency worker starts with the first latency channel: a process whose sessions
        // carry none (a short-lived client of throughput sockets) never needs its thread.
        for w in &ctx.workers {
            w.belongs_to(&ctx);
            if w.class == Class::Throughput {
                w.start(&ctx)?;
            }
        }
        let stop = Arc::new(EventFd::new()?);
        // The directory of the control endpoint, once it is there: the acceptor sweeps it.
        let (control, control_dir) = if ctx.config.control {
            let dir = ctx.config.control_dir.clone().unwrap_or_else(control::default_control_dir);
            match control::Endpoint::start(&ctx, &dir) {
                Ok(e) => (Some(e), Some(dir)),
                Err(e) => {
                    // The engine works without it; only `netchannel stat` will not list it.
                    crate::sys::warn(format_args!(
                        "netchannel: no control endpoint in {}: {e}",
                        dir.display()
                    ));
                    (None, None)
                }
            }
        } else {
            (None, None)
        };
        let engine = Engine {
            ctx: ctx.clone(),
            acceptor: Mutex::new(None),
            stop: stop.clone(),
            control: Mutex::new(control),
        };
        let Some(listener) = listener else { return Ok(engine) };
        let netns = ctx.config.netns.clone();
        let handle = std::thread::Builder::new().name("nc-accept".into()).spawn(move || {
            if let Some(ns) = &netns {
                if let Err(e) = crate::sys::enter_netns(ns) {
                    crate::sys::warn(format_args!("netchannel: {e}"));
                    return;
                }
            }
            acceptor::run(ctx, listener, stop, control_dir)
        })?;
        *engine.acceptor.lock() = Some(handle);
        Ok(engine)
    }

    /// Calls `then` with `fd` once `fd` is readable (a listener's first connection), on one of
    /// the engine's worker threads: a seldom-used service needs no thread of its own until
    /// then. `then` should hand `fd` to a thread and return. If the engine shuts down first,
    /// `fd` is closed and `then` never runs.
    pub fn when_readable(
        &self,
        fd: std::os::fd::OwnedFd,
        then: impl FnOnce(std::os::fd::OwnedFd) + Send + 'static,
    ) {
        self.ctx.workers[0].when_readable(fd, Box::new(then));
    }

    /// This engine's random id (its peers key their sessions by it).
    pub fn id(&self) -> u64 {
        self.ctx.id
    }

    /// The address peers dial to reach this engine (for one that accepts no channels,
    /// `Config::accept_channels`, the address it was given, where nothing listens).
    pub fn local_addr(&self) -> SocketAddr {
        self.ctx.local_addr
    }

    /// The configuration it runs with.
    pub fn config(&self) -> &Config {
        &self.ctx.config
    }

    /// A snapshot of its channels, sockets and counters.
    pub fn stats(&self) -> EngineStats {
        self.ctx.stats()
    }

    /// The Unix socket `netchannel stat` reads this engine through (`Config::control`).
    pub fn control_path(&self) -> Option<std::path::PathBuf> {
        self.control.lock().as_ref().map(|e| e.path().to_path_buf())
    }

    /// Waits until what the applications sent has reached the peer engines (nothing unsent or
    /// unacknowledged), as a process's exit leaves its sockets' queues to its kernel; the
    /// engine keeps running. Gives up once no session made progress for `stall`, or after
    /// `cap`; returns whether everything went. Meant for a process about to exit (the
    /// interposition library's `exit`), whose calling thread may hold one of this engine's
    /// locks (an `exit` from a signal handler): every lock is only tried, for a while, and a
    /// session whose lock does not come ends the wait.
    pub fn drain(&self, stall: Duration, cap: Duration) -> bool {
        const TRY: Duration = Duration::from_millis(100);
        let Some(sessions) = self
            .ctx
            .sessions
            .try_lock_for(TRY)
            .map(|s| s.dialed.values().chain(s.accepted.values()).cloned().collect::<Vec<_>>())
        else {
            return false;
        };
        let start = Instant::now();
        let (mut least, mut progress_at) = (u64::MAX, start);
        // The peer engine acknowledges within a round trip or two. This thread reads the
        // acknowledgements itself as they come (the worker may be leaving the channels to the
        // application threads for a tick), and looks again after short waits first: a
        // short-lived client's exit takes a round trip more than its work, not milliseconds.
        let mut nap = Duration::from_micros(50);
        let mut waiting = Vec::new();
        // What was left when the last poll found a channel readable: if reading it moved
        // nothing (bytes only their stream's reader may take), the next wait is a sleep, not a
        // poll that returns at once again.
        let mut readable_at: Option<u64> = None;
        loop {
            let mut left = 0;
            waiting.clear();
            for s in &sessions {
                match s.unflushed(TRY) {
                    Some(0) => {}
                    Some(n) => {
                        left += n;
                        // Writes held back for the writer's next wait go now.
                        s.transmit_all();
                        waiting.extend(s.channels().into_iter().map(|ch| (s.clone(), ch)));
                    }
                    None => return false,
                }
            }
            let now = Instant::now();
            if left == 0 {
                return true;
            }
            if left < least {
                (least, progress_at) = (left, now);
            }
            if now - progress_at >= stall || now - start >= cap {
                return false;
            }
            if readable_at.is_some_and(|before| left >= before) {
                std::thread::sleep(nap);
            }
            let mut fds: Vec<_> = waiting
                .iter()
                .map(|(_, ch)| {
                    rustix::event::PollFd::from_borrowed_fd(ch.fd(), rustix::event::PollFlags::IN)
                })
                .collect();
            let timeout = rustix::event::Timespec::try_from(nap).unwrap_or_default();
            let ready = rustix::event::poll(&mut fds, Some(&timeout)).unwrap_or(0);
            drop(fds);
            readable_at = (ready > 0).then_some(left);
            for (s, ch) in &waiting {
                s.rx(ch);
            }
            nap = (nap * 2).min(Duration::from_millis(1));
        }
    }

    /// Stops every thread and fails every open virtual socket. Idempotent.
    pub fn shutdown(&self) {
        if self.ctx.stopping.swap(true, Ordering::SeqCst) {
            return;
        }
        if let Some(mut e) = self.control.lock().take() {
            e.stop();
        }
        for l in self.ctx.listeners.lock().values() {
            l.close();
        }
        let sessions = self.ctx.all_sessions();
        // As a process exit with SO_LINGER: what the applications sent is delivered, each
        // stream ends with FIN, and only what cannot go within `linger` is reset.
        for s in &sessions {
            s.with_core(|core| core.finish_all());
            s.transmit_all();
        }
        let deadline = std::time::Instant::now() + self.ctx.config.linger;
        while std::time::Instant::now() < deadline
            && !sessions.iter().all(|s| !s.is_alive() || s.core().flushed())
        {
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        for s in &sessions {
            s.with_core(|core| core.reset_all(crate::proto::ResetCause::EngineShutdown));
            s.close_all("engine shut down");
        }
        for l in self.ctx.listeners.lock().values() {
            l.close();
        }
        self.stop.notify();
        if let Some(h) = self.acceptor.lock().take() {
            let _ = h.join();
        }
        for w in &self.ctx.workers {
            w.stop();
        }
        for w in &self.ctx.workers {
            w.join();
        }
        // Break the reference cycles engine -> sessions -> engine.
        *self.ctx.sessions.lock() = Sessions::default();
        self.ctx.listeners.lock().clear();
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.shutdown();
    }
}

impl EngineCtx {
    /// A listener for virtual `port`, bound to a local address if `bound` (before anything can
    /// reach it).
    pub fn bind_listener(
        &self,
        port: u16,
        bound: Option<listener::Bound>,
    ) -> io::Result<Arc<ListenerShared>> {
        if self.stopping.load(Ordering::Acquire) {
            return Err(io::Error::new(io::ErrorKind::ConnectionAborted, "engine shut down"));
        }
        let mut map = self.listeners.lock();
        if map.contains_key(&port) {
            return Err(io::Error::new(
                io::ErrorKind::AddrInUse,
                format!("virtual port {port} already has a listener"),
            ));
        }
        let shared = ListenerShared::new(self.config.accept_backlog);
        if let Some(b) = bound {
            shared.bind_to(b);
        }
        map.insert(port, shared.clone());
        Ok(shared)
    }

    /// Frees virtual `port` if `shared` still holds it.
    pub fn unbind_listener(&self, port: u16, shared: &Arc<ListenerShared>) {
        let mut map = self.listeners.lock();
        if map.get(&port).is_some_and(|l| Arc::ptr_eq(l, shared)) {
            map.remove(&port);
        }
    }

    /// Whether throughput-class work runs demoted now (`Config::isolation`).
    pub fn isolating(&self) -> bool {
        match self.config.isolation {
            config::Isolation::Always => true,
            config::Isolation::Never => false,
            config::Isolation::Auto => self.latency_sockets.load(Ordering::Relaxed) > 0,
        }
    }

    /// Whether application threads doing throughput-class work are demoted meanwhile.
    pub fn demotes_app_threads(&self) -> bool {
        *self.demote_app_threads.get_or_init(|| {
            let c = &self.config;
            c.app_demotion != config::AppDemotion::Off
                && c.isolation != config::Isolation::Never
                && priority::can_demote(c.throughput_policy)
        })
    }

    /// Demotes the calling application thread while it does `class` work (see `priority`).
    pub fn demote_for(&self, class: Class) -> priority::Demoted {
        // Only throughput-class work while isolating asks whether demotion is possible.
        let on = class == Class::Throughput && self.isolating() && self.demotes_app_threads();
        let sticky = self.config.app_demotion == config::AppDemotion::Sticky;
        priority::Demoted::enter(on, sticky, self.config.throughput_policy, class)
    }

    pub fn core_config(&self) -> CoreConfig {
        let c = &self.config;
        CoreConfig {
            window: c.stream_window,
            max_frame_payload: c.max_frame_payload,
            max_out_of_order: c.max_out_of_order_segments,
            policy: c.policy,
            queue_threshold: c.channel_queue_threshold,
            max_streams: c.max_streams,
            ack_threshold: 1 << 20,
            max_pending_rsts: c.max_control_backlog,
            connect_timeout: c.connect_timeout,
            linger: c.linger,
            rx_budget: c.max_peer_buffered,
            min_window: c.min_stream_window,
            tx_budget: c.max_send_buffered,
            max_retained_bytes: c.max_retained_bytes,
            max_retained_frames: c.max_retained_frames,
            ack_timeout: c.ack_timeout,
            max_channels: c.max_channels,
            min_channels: c.channels,
            idle_rate: c.rest_channels_rate,
            retire_after: c.channel_retire_after,
            busy_thread_rate: c.busy_thread_rate,
        }
    }

    fn all_sessions(&self) -> Vec<Arc<SessionRt>> {
        let s = self.sessions.lock();
        s.dialed.values().chain(s.accepted.values()).cloned().collect()
    }

    /// The worker for a new channel: latency channels get the last worker when it is theirs
    /// (started now if it was not).
    /// `session_id` is the id the session's channels present (ours or a shard's when we
    /// dialed, the peer's when it did): its shard bits spread the first channels of the
    /// shards of one peer (and of different peers) over the workers, rather than putting
    /// every session's channel 0 on worker 0.
    fn pick_worker(&self, index: u16, class: Class, session_id: u64) -> usize {
        let throughput = self.config.workers;
        // Else, without a thread for it, on a throughput worker.
        if class == Class::Latency
            && self.workers.len() > throughput
            && self.workers[throughput].start_lazily().is_ok()
        {
            return throughput;
        }
        let spread = crate::wire::handshake::shard_bits(session_id) as usize;
        (index as usize + spread) % throughput
    }

    /// The session to the engine at `addr`, dialing it if there is none. Only the first
    /// channel of each class is waited for (the first admitted within `dial_timeout`, dialed
    /// again within `busy_dial_timeout` while the peer refuses it at a limit): a new peer's
    /// first bytes wait for two channel handshakes, not for one per channel. The other
    /// throughput channels are dialed in the background, and streams use the channels there are
    /// meanwhile. Only connects to `addr` wait for this dial: no lock shared with other peers
    /// is held while dialing.
    ///
    /// With `Config::session_shards` above 1, the session is the calling thread's shard of
    /// the sessions to `addr` (for a `class` of latency, the latency shard). A new shard of a
    /// peer we have a session with is not a new peer: its first channel is not dialed again
    /// when the peer refuses it at a limit, and the thread then uses a shard the peer has (no
    /// new shard is asked of that peer for `SHARD_REFUSAL_HOLD`).
    pub fn session_to(
        self: &Arc<Self>,
        addr: SocketAddr,
        class: Class,
    ) -> io::Result<Arc<SessionRt>> {
        let shards = self.config.session_shards;
        let shard = match class {
            Class::Latency if shards > 1 => config::LATENCY_SHARD,
            _ => self.thread_shard(),
        };
        if shard == 0 {
            return self.session_shard(addr, 0, true, class);
        }
        let fallback = || {
            let s = self.sessions.lock();
            let held = s.shard_refused.get(&addr).is_some_and(|&t| t > std::time::Instant::now());
            let live = |k: u16| s.dialed.get(&(addr, k)).filter(|x| x.is_alive()).cloned();
            let other = (0..shards as u16).chain([config::LATENCY_SHARD]).find_map(live);
            (held, other)
        };
        let (held, other) = fallback();
        if let (true, Some(other)) = (held, &other) {
            return Ok(other.clone());
        }
        match self.session_shard(addr, shard, other.is_none(), class) {
            Ok(session) => Ok(session),
            Err(e) => {
                let (_, other) = fallback();
                let Some(other) = other else { return Err(e) };
                let mut s = self.sessions.lock();
                if s.shard_refused.len() >= MAX_SHARD_REFUSALS {
                    let now = std::time::Instant::now();
                    s.shard_refused.retain(|_, &mut t| t > now);
                    if s.shard_refused.len() >= MAX_SHARD_REFUSALS {
                        s.shard_refused.clear();
                    }
                }
                s.shard_refused.insert(addr, std::time::Instant::now() + SHARD_REFUSAL_HOLD);
                Ok(other)
            }
        }
    }

    /// The calling thread's shard (`Config::session_shards`): the n-th thread to open a
    /// stream through this engine gets shard n modulo the shards, and keeps it.
    fn thread_shard(&self) -> u16 {
        let shards = self.config.session_shards;
        if shards <= 1 {
            return 0;
        }
        thread_local! {
            /// (engine id, shard) of the engines this thread opened streams through, the
            /// latest last (a thread that used more engines than it holds is given new shards).
            static SHARD_OF: std::cell::RefCell<Vec<(u64, u16)>> =
                const { std::cell::RefCell::new(Vec::new()) };
        }
        SHARD_OF
            .try_with(|own| {
                let mut own = own.borrow_mut();
                if let Some(&(_, shard)) = own.iter().find(|(id, _)| *id == self.id) {
                    return shard;
                }
                let shard = (self.next_shard.fetch_add(1, Ordering::Relaxed) % shards) as u16;
                if own.len() >= 16 {
                    own.remove(0);
                }
                own.push((self.id, shard));
                shard
            })
            .unwrap_or(0)
    }

    /// The session of shard `shard` to the engine at `addr` for a stream of `class`, dialing
    /// it if there is none (`new_peer`: no other session to that engine lives; see
    /// `dial_session`).
    fn session_shard(
        self: &Arc<Self>,
        addr: SocketAddr,
        shard: u16,
        new_peer: bool,
        class: Class,
    ) -> io::Result<Arc<SessionRt>> {
        let key = (addr, shard);
        let slot = loop {
            let mut s = self.sessions.lock();
            if let Some(existing) = s.dialed.get(&key).filter(|s| s.is_alive()) {
                let existing = existing.clone();
                drop(s);
                if class == Class::Latency {
                    self.latency_channel_for(&existing);
                }
                return Ok(existing);
            }
            if self.stopping.load(Ordering::Acquire) {
                return Err(io::Error::new(io::ErrorKind::ConnectionAborted, "engine shut down"));
            }
            if let Some(slot) = s.dialing.get(&key).cloned() {
                drop(s);
                let mut r = slot.result.lock();
                while r.is_none() {
                    slot.done.wait(&mut r);
                }
                match r.as_ref().expect("set") {
                    Ok(session) if session.is_alive() => {
                        let session = session.clone();
                        drop(r);
                        if class == Class::Latency {
                            self.latency_channel_for(&session);
                        }
                        return Ok(session);
                    }
                    Ok(_) => continue, // dialed, then lost already: dial again
                    Err((kind, msg)) => return Err(io::Error::new(*kind, msg.clone())),
                }
            }
            let slot = Arc::new(DialSlot::default());
            s.dialing.insert(key, slot.clone());
            break slot;
        };
        let r = self.dial_session(addr, shard, new_peer, class);
        let mut s = self.sessions.lock();
        s.dialing.remove(&key);
        if let Ok((session, _)) = &r {
            s.dialed.insert(key, session.clone());
        }
        drop(s);
        let r = r.map(|(session, rest)| {
            self.rebudget();
            // Registered first: a channel joins only a current session.
            self.dial_rest(session.clone(), rest);
            session
        });
        *slot.result.lock() = Some(match &r {
            Ok(session) => Ok(session.clone()),
            Err(e) => Err((e.kind(), e.to_string())),
        });
        slot.done.notify_all();
        r
    }

    /// A latency stream is about to open on `session`: if its latency channel is still among
    /// the channels to dial (`dial_session`), it is dialed now, in this thread and within
    /// `dial_timeout`, or waited for if it is being dialed: the stream never shares a
    /// throughput channel for want of its own (where the isolation demotes the throughput
    /// worker, an open on its channel could wait for a core behind bulk work). The session's
    /// other channels keep their time.
    fn latency_channel_for(self: &Arc<Self>, session: &Arc<SessionRt>) {
        if self.config.latency_channels == 0 || session.has_own_channels(Class::Latency) {
            return;
        }
        let planned = {
            let mut rest = session.rest.lock();
            let at =
                rest.as_ref().and_then(|r| r.plan.iter().position(|&(_, c)| c == Class::Latency));
            match (rest.as_mut(), at) {
                (Some(r), Some(at)) => {
                    let entry = r.plan.remove(at);
                    let emptied = r.plan.is_empty();
                    if emptied {
                        *rest = None;
                    }
                    Some((entry, emptied))
                }
                _ => None,
            }
        };
        let Some(((index, class), emptied)) = planned else {
            // Being dialed (the rest's first), or lost and dialed again: wait for it as long.
            let deadline = std::time::Instant::now() + self.config.dial_timeout;
            while session.growing.load(Ordering::Acquire)
                && !session.has_own_channels(Class::Latency)
                && std::time::Instant::now() < deadline
            {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            return;
        };
        let id = ChannelId::new(index, 0);
        match self.dial_for(session, id, class, self.config.dial_timeout) {
            Ok(ch) => {
                self.join_dialed(session, ch);
            }
            // A full acceptor keeps its room for new peers: the stream shares the session's
            // throughput channels, as when the session was opened.
            Err(e) if tcp::refused_at_limit(&e) => {}
            Err(_) => self.redial(session.clone(), id, class),
        }
        if emptied {
            // Nothing left to dial: the session may grow again.
            session.growing.store(false, Ordering::Release);
        }
    }

    /// Dials the first channel of a new session to `addr` (see `session_to`), and the first
    /// latency channel too when the stream that opens it is of the latency `class`: the
    /// session, and the channels still to dial. Only a `new_peer`'s first channel is dialed
    /// again while the acceptor refuses it at a limit, and only it takes a new peer's place in
    /// the channel budget: a further shard of a peer we have is turned away at once (its
    /// thread uses another shard).
    fn dial_session(
        self: &Arc<Self>,
        addr: SocketAddr,
        shard: u16,
        new_peer: bool,
        class: Class,
    ) -> io::Result<(Arc<SessionRt>, DialPlan)> {
        let local_id = self.shard_engine_id(shard);
        let plan: DialPlan =
            std::iter::repeat_n(Class::Throughput, self.config.shard_channels(shard))
                .chain(std::iter::repeat_n(Class::Latency, self.config.latency_channels))
                .enumerate()
                .map(|(i, c)| (i as u16, c))
                .collect();
        let (first, rest) = (plan[0], plan[1..].to_vec());
        let now = std::time::Instant::now();
        let busy_deadline = now + self.config.busy_dial_timeout;
        let mut deadline;
        let mut backoff = std::time::Duration::from_millis(5);
        let ch = loop {
            let id = ChannelId::new(first.0, 0);
            let now = std::time::Instant::now();
            deadline = now + self.config.dial_timeout;
            let purpose =
                if new_peer { budget::Purpose::FirstOfSession } else { budget::Purpose::More };
            let r = self.dial_in_netns(addr, local_id, id, first.1, purpose, deadline - now);
            match r {
                // A busy acceptor (many peers arriving at once): try again within
                // `busy_dial_timeout`, after a random part of a doubling backoff, so that the
                // peers spread out.
                Err(e) if new_peer && tcp::refused_at_limit(&e) => {
                    let jitter = (crate::sys::random_u64() % 1000) as f64 / 2000.0;
                    let pause = backoff.mul_f64(0.5 + jitter);
                    if std::time::Instant::now() + pause >= busy_deadline {
                        return Err(e);
                    }
                    std::thread::sleep(pause);
                    backoff = (backoff * 2).min(std::time::Duration::from_secs(1));
                }
                r => break r?,
            }
        };
        let peer = ch.meta.peer_engine;
        let session = SessionRt::new(self.clone(), addr, peer, true, plan.len() as u16, shard);
        session.add_channel(ch);
        // The latency class's first channel too, before a latency stream: it never shares a
        // throughput channel for want of its own (one more handshake, not four). Opened for a
        // throughput stream, the session dials it with the rest (first among them), or when a
        // latency stream comes (`latency_channel_for`): a short-lived client of throughput
        // sockets (every program's) never pays for it.
        let mut rest = rest;
        rest.sort_by_key(|&(_, class)| class != Class::Latency);
        let latency_now = class == Class::Latency;
        if let Some(at) =
            rest.iter().position(|&(_, class)| class == Class::Latency).filter(|_| latency_now)
        {
            let (index, class) = rest.remove(at);
            let id = ChannelId::new(index, 0);
            // Within the deadline of the first's last try: `dial_timeout` from it at most.
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            let r = self.dial_in_netns(addr, local_id, id, class, budget::Purpose::More, left);
            match r {
                Ok(ch) if ch.meta.peer_engine == peer => {
                    session.add_channel(ch);
                }
                Ok(_) => self.refused("a dialed channel reached another engine than its session's"),
                // A full acceptor keeps its room for new peers: latency sockets share the
                // throughput channels of this session.
                Err(e) if tcp::refused_at_limit(&e) => {}
                Err(_) => self.redial(session.clone(), id, class),
            }
        }
        Ok((session, rest))
    }

    /// Dials the rest of a new session's channels, one after the other, in one background
    /// thread, once the session carries traffic (`RestChannels`, looked at from
    /// `Config::rest_channels_after` on) or a sender runs short of room (`grow`); one that fails
    /// is dialed again as a lost one is (`redial`).
    fn dial_rest(self: &Arc<Self>, session: Arc<SessionRt>, rest: DialPlan) {
        if rest.is_empty() {
            return;
        }
        // Counted as growing meanwhile: a sender short of room must not add a channel beyond
        // `max_channels` on top of the ones being dialed (it hurries them instead).
        session.growing.store(true, Ordering::Release);
        let wait = self.config.rest_channels_after;
        if wait.is_zero() {
            return self.dial_rest_now(session, rest);
        }
        // The session's duty worker runs the dial when it comes due (`SessionRt::handle_timeouts`):
        // no thread waits for it meanwhile.
        *session.rest.lock() =
            Some(session::RestChannels::new(rest, std::time::Instant::now(), wait, 0));
        session.timers_changed();
    }

    /// Dials `rest` (see `dial_rest`) now, in a thread of its own.
    pub(crate) fn dial_rest_now(self: &Arc<Self>, session: Arc<SessionRt>, rest: DialPlan) {
        let me = self.clone();
        let growing = session.clone();
        let spawned = std::thread::Builder::new().name("nc-dial".into()).spawn(move || {
            let _done = ClearOnDrop(&session.growing);
            for (index, class) in rest {
                if me.stopping.load(Ordering::Acquire) || !me.is_current(&session) {
                    return;
                }
                let id = ChannelId::new(index, 0);
                let timeout = me.config.dial_timeout;
                let r = me.dial_for(&session, id, class, timeout);
                match r {
                    Ok(ch) => {
                        if me.join_dialed(&session, ch) {
                            // The worker's timers now include whether one is surplus (idle).
                            session.timers_changed();
                        }
                    }
                    // A busy or full acceptor keeps its room for new peers' first channels: the
                    // session stays at fewer channels (it may grow later, under load).
                    Err(e) if tcp::refused_at_limit(&e) => {}
                    // The session works with fewer channels meanwhile.
                    Err(_) => me.redial(session.clone(), id, class),
                }
            }
        });
        if spawned.is_err() {
            growing.growing.store(false, Ordering::Release);
            self.refused("dialing a session's other channels: cannot start a thread");
        }
    }

    /// `dial_channel` inside the engine's network namespace (`Config::netns`), where its
    /// channel sockets belong.
    fn dial_in_netns(
        self: &Arc<Self>,
        addr: SocketAddr,
        local_id: u64,
        id: ChannelId,
        class: Class,
        purpose: budget::Purpose,
        timeout: std::time::Duration,
    ) -> io::Result<Arc<Channel>> {
        let me = self.clone();
        in_netns(self.config.netns.clone(), move || {
            me.dial_channel(addr, local_id, id, class, purpose, timeout)
        })
    }

    /// Dials one more channel of `session` (beyond its first ones: `Purpose::More`).
    fn dial_for(
        self: &Arc<Self>,
        session: &SessionRt,
        id: ChannelId,
        class: Class,
        timeout: std::time::Duration,
    ) -> io::Result<Arc<Channel>> {
        let purpose = budget::Purpose::More;
        self.dial_in_netns(session.peer_addr, session.local_id(), id, class, purpose, timeout)
    }

    /// The engine id a dialed session of shard `shard` presents to its peer
    /// (`wire::handshake::shard_engine_id`).
    pub(crate) fn shard_engine_id(&self, shard: u16) -> u64 {
        crate::wire::handshake::shard_engine_id(self.id, shard)
    }

    /// Dials one channel within `timeout`, holding a place in the channel budget.
    fn dial_channel(
        &self,
        addr: SocketAddr,
        local_id: u64,
        id: ChannelId,
        class: Class,
        purpose: budget::Purpose,
        timeout: std::time::Duration,
    ) -> io::Result<Arc<Channel>> {
        let ticket = self.channel_budget.take(None, purpose).map_err(|why| {
            self.refused(why.reason());
            io::Error::other(format!(
                "cannot dial: {} channels open, {}",
                self.channel_budget.in_use(),
                why.reason()
            ))
        })?;
        let (sock, peer) = tcp::dial(
            addr,
            local_id,
            id,
            class,
            self.config.psk.as_deref(),
            timeout,
            &self.tcp_options,
        )?;
        let meta = ChannelMeta { index: id, class, peer_engine: peer };
        let worker = self.pick_worker(id.index, class, local_id);
        let transport = Box::new(TcpTransport::new(sock));
        let large = self.config.defer_min.max(1);
        let pool = self.pool.clone();
        Ok(Arc::new(Channel::new(meta, transport, large, worker, pool, Box::new(ticket))?))
    }

    /// Whether `session` is still this engine's session to its peer (it may have died and
    /// been replaced while a channel was dialed for it).
    fn is_current(&self, session: &Arc<SessionRt>) -> bool {
        let s = self.sessions.lock();
        let found = if session.initiator {
            s.dialed.get(&(session.peer_addr, session.shard))
        } else {
            s.accepted.get(&session.peer_engine)
        };
        found.is_some_and(|x| Arc::ptr_eq(x, session)) && session.is_alive()
    }

    /// Adds a channel this engine dialed to `session`, if the session is still current and the
    /// channel reached the same peer engine; false (the channel is dropped) otherwise.
    fn join_dialed(&self, session: &Arc<SessionRt>, ch: Arc<Channel>) -> bool {
        if ch.meta.peer_engine != session.peer_engine {
            self.refused("a dialed channel reached another engine than its session's");
            return false;
        }
        if self.stopping.load(Ordering::Acquire) || !self.is_current(session) {
            return false;
        }
        session.add_channel(ch)
    }

    /// Adds a throughput channel to a session this engine dialed (NetScheduler's channel
    /// scaling), if it is below `max_channels` and not already adding one. `class` is the class
    /// whose senders ran short of room or outnumber the channels: only one that throughput
    /// channels serve gains by it (a latency class with channels of its own does not).
    pub fn grow(self: &Arc<Self>, session: &Arc<SessionRt>, class: Class) {
        if !session.initiator {
            return;
        }
        // A throughput class lent the latency channels (its own lost, redial pending) still
        // grows its own.
        let served_by_throughput = class == Class::Throughput
            || session
                .serving_channels(class)
                .first()
                .is_none_or(|c| c.meta.class == Class::Throughput);
        let count = session.serving_channels(Class::Throughput).len();
        if !served_by_throughput
            || self.stopping.load(Ordering::Acquire)
            || count >= self.config.max_channels
            || session.grow_after_ns.load(Ordering::Relaxed) > session::clock_ns()
            || session.growing.swap(true, Ordering::AcqRel)
        {
            // The session's first channels beyond the first may be waiting to be dialed.
            session.hurry_rest();
            return;
        }
        self.add_channel_async(session.clone(), Class::Throughput);
    }

    /// A dial to add channel `id` to `session` failed: do not try again for a while, since
    /// every send that finds the session short of channels asks. The wait doubles with each
    /// failure in a row, from 100 ms (5 s when the acceptor refused at one of its limits,
    /// which a full server keeps doing) up to 10 s (5 min), and is spread by up to a quarter,
    /// so that thousands of client sessions turned away by one server neither keep dialing it
    /// nor come back all at once. The index is kept for the next try, so that failures do not
    /// use up the 64: as it is when the acceptor refused at a limit (it took nothing), else in
    /// its next incarnation (the peer may have taken this one).
    fn grow_failed(session: &SessionRt, id: ChannelId, e: &io::Error) {
        let at_limit = tcp::refused_at_limit(e);
        let next =
            if at_limit { id } else { ChannelId::new(id.index, id.incarnation.wrapping_add(1)) };
        session.free_id(next);
        let now = session::clock_ns();
        let wait_ns =
            growth_backoff_ns(session.grow_failures.fetch_add(1, Ordering::Relaxed), at_limit, now);
        session.grow_after_ns.store(now + wait_ns, Ordering::Relaxed);
    }

    /// Dials one more channel of `class` for `session` in the background.
    fn add_channel_async(self: &Arc<Self>, session: Arc<SessionRt>, class: Class) {
        // A free id whose index is open again (a redial took it) is dropped.
        let free = {
            let mut ids = session.free_ids.lock();
            ids.retain(|id| !session.has_index(id.index));
            ids.pop()
        };
        let id = match free {
            Some(id) => id,
            None => {
                let index = session.next_index.fetch_add(1, Ordering::AcqRel);
                if index > crate::wire::handshake::MAX_CHANNEL_INDEX {
                    session.growing.store(false, Ordering::Release);
                    return; // indexes are spent; stay at this size
                }
                ChannelId::new(index, 0)
            }
        };
        let me = self.clone();
        let growing = session.clone();
        let spawned = std::thread::Builder::new().name("nc-dial".into()).spawn(move || {
            let timeout = me.config.dial_timeout;
            let r = me.dial_for(&session, id, class, timeout);
            match r {
                Ok(ch) => {
                    session.grow_failures.store(0, Ordering::Relaxed);
                    if me.join_dialed(&session, ch) {
                        // The worker's timers now include whether it is surplus.
                        session.timers_changed();
                    }
                }
                Err(e) => Self::grow_failed(&session, id, &e),
            }
            session.growing.store(false, Ordering::Release);
        });
        if spawned.is_err() {
            // Out of threads: stay at this size for now, keeping the id for the next try.
            growing.free_id(id);
            growing.growing.store(false, Ordering::Release);
        }
    }

    /// Dials a lost channel again, with the same index and class and the next incarnation,
    /// while the session lives (its other channels carried on meanwhile). Gives up after a
    /// few tries.
    fn redial(self: &Arc<Self>, session: Arc<SessionRt>, lost: ChannelId, class: Class) {
        let me = self.clone();
        let next = ChannelId::new(lost.index, lost.incarnation.wrapping_add(1));
        let spawned = std::thread::Builder::new().name("nc-dial".into()).spawn(move || {
            for delay_ms in [5, 50, 250, 1000, 3000] {
                std::thread::sleep(std::time::Duration::from_millis(delay_ms));
                if me.stopping.load(Ordering::Acquire) || !me.is_current(&session) {
                    return;
                }
                let timeout = me.config.dial_timeout;
                let r = me.dial_for(&session, next, class, timeout);
                let ch = match r {
                    Ok(ch) => ch,
                    // A full acceptor (it may have shed this very channel for a new peer):
                    // the session goes on with fewer channels.
                    Err(e) if tcp::refused_at_limit(&e) => return,
                    // The peer may not have noticed the loss yet (the index is still taken).
                    Err(_) => continue,
                };
                if me.join_dialed(&session, ch) {
                    me.counters.redialed_channels.fetch_add(1, Ordering::Relaxed);
                }
                return;
            }
        });
        if spawned.is_err() {
            self.refused("redial: cannot start a thread");
        }
    }

    /// Refuses a hello before anything is answered: the channel index is taken in that
    /// engine's session, or a new session would exceed `max_sessions` (which counts peer
    /// engines: a new shard of a peer with sessions here is not a new peer).
    pub fn check_hello(&self, hello: &Handshake) -> Result<(), RejectReason> {
        let (existing, (engines, known)) = {
            let sessions = self.sessions.lock();
            let existing =
                sessions.accepted.get(&hello.engine_id).filter(|s| s.is_alive()).cloned();
            (existing, sessions.accepted_engines(hello.engine_id))
        };
        match existing {
            Some(s) if s.core().slot_taken(hello.channel) => Err(RejectReason::BadField),
            Some(_) => Ok(()),
            None if !known && engines >= self.config.max_sessions => {
                self.refused("sessions at max_sessions");
                Err(RejectReason::Limit)
            }
            None => Ok(()),
        }
    }

    /// A confirmed handshake: admits the channel into the peer's session. Either the channel
    /// joins a session (a new one is registered only now) or nothing is left behind.
    pub fn admit(self: &Arc<Self>, mut inc: Incoming, hello: Handshake) {
        if self.stopping.load(Ordering::Acquire) {
            return;
        }
        let peer_addr = inc.peer.unwrap_or_else(|| SocketAddr::from(([0, 0, 0, 0], 0)));
        let source = inc.peer.map(budget::SourceKey::of);
        // A shard of a peer with sessions here takes a place as that peer's further channels
        // do: the first-of-session places are for new peers.
        let known = self.sessions.lock().accepted_engines(hello.engine_id).1;
        let purpose = if known { budget::Purpose::More } else { budget::Purpose::FirstOfSession };
        let ticket = match self.channel_budget.take(source, purpose) {
            Ok(t) => t,
            Err(budget::Refusal::EngineFull)
                if purpose == budget::Purpose::FirstOfSession && self.shed_extra_channel() =>
            {
                // The place comes back once the shed channel's sockets are closed: the new
                // peer's dialer, refused at a limit, tries again shortly and finds it.
                self.refused("channels at max_channels_total: another peer's extra channel shed");
                inc.refuse(self.id, RejectReason::Limit);
                return;
            }
            Err(why) => {
                self.refused(why.reason());
                inc.refuse(self.id, RejectReason::Limit);
                return;
            }
        };
        let id = ChannelId::new(hello.channel, hello.incarnation);
        let (session, is_new) = {
            let s = self.sessions.lock();
            match s.accepted.get(&hello.engine_id).filter(|x| x.is_alive()) {
                Some(existing) => (existing.clone(), false),
                None if {
                    let (engines, known) = s.accepted_engines(hello.engine_id);
                    !known && engines >= self.config.max_sessions
                } =>
                {
                    drop(s);
                    self.refused("sessions at max_sessions");
                    inc.refuse(self.id, RejectReason::Limit);
                    return;
                }
                None => {
                    let session =
                        SessionRt::new(self.clone(), peer_addr, hello.engine_id, false, 0, 0);
                    (session, true)
                }
            }
        };
        if session.core().slot_taken(hello.channel) {
            inc.refuse(self.id, RejectReason::BadField);
            self.handshake_failed(inc.peer, "channel index already in use".into());
            return;
        }
        let sock = match inc.admit(self.config.psk.as_deref()) {
            Ok(s) => s,
            Err(e) => return self.handshake_failed(Some(peer_addr), format!("{e}")),
        };
        let meta = ChannelMeta { index: id, class: hello.class, peer_engine: hello.engine_id };
        let worker = self.pick_worker(hello.channel, hello.class, hello.engine_id);
        let transport = Box::new(TcpTransport::new(sock));
        let large = self.config.defer_min.max(1);
        let pool = self.pool.clone();
        let ch = match Channel::new(meta, transport, large, worker, pool, Box::new(ticket)) {
            Ok(ch) => Arc::new(ch),
            Err(e) => {
                return self
                    .handshake_failed(Some(peer_addr), format!("cannot set up channel: {e}"))
            }
        };
        if is_new {
            let mut s = self.sessions.lock();
            s.accepted.retain(|_, x| x.is_alive());
            s.accepted.insert(hello.engine_id, session.clone());
        }
        session.add_channel(ch);
        if is_new {
            self.rebudget();
        }
    }

    /// Closes one throughput channel beyond the first of the session with the most channels,
    /// to make room for a new peer's first channel (every channel budget place taken): a peer
    /// works with one channel, and none is refused for want of a place while another peer
    /// holds several. Its frames go on the session's other channels; the peer does not dial it
    /// again while the budget is full (a refusal at a limit ends a redial). False if every
    /// session has one channel.
    fn shed_extra_channel(&self) -> bool {
        let Some((session, ch)) = self.sheddable() else { return false };
        let why = "closed to make room for a new peer (max_channels_total)";
        session.channel_failed(&ch, ChannelError::Io(io::Error::other(why)));
        true
    }

    /// Whether `shed_extra_channel` would find a channel to close, as found at most 10 ms ago
    /// (an answer out of date costs a handshake refused after the hello, or a new peer's
    /// retry): a flood of connections at a full engine walks its sessions 100 times a second
    /// at most.
    pub fn can_shed(&self) -> bool {
        let now = std::time::Instant::now();
        let mut last = self.shed_answer.lock();
        match *last {
            Some((at, answer)) if now.duration_since(at) < std::time::Duration::from_millis(10) => {
                answer
            }
            _ => {
                let answer = self.sheddable().is_some();
                *last = Some((now, answer));
                answer
            }
        }
    }

    /// The highest-indexed throughput channel of the session with the most throughput
    /// channels, if it has more than one.
    fn sheddable(&self) -> Option<(Arc<SessionRt>, Arc<Channel>)> {
        let throughput = |s: &SessionRt| -> Vec<Arc<Channel>> {
            s.channels().into_iter().filter(|c| c.meta.class == Class::Throughput).collect()
        };
        let (chans, session) = self
            .all_sessions()
            .into_iter()
            .map(|s| (throughput(&s), s))
            .max_by_key(|(t, _)| t.len())?;
        if chans.len() < 2 {
            return None;
        }
        let extra = chans.into_iter().max_by_key(|c| c.meta.index.index)?;
        Some((session, extra))
    }

    /// Shares the engine's budgets among the live sessions: each may grant its peer at most
    /// `max_peer_buffered` of receive credit beyond the streams' minimum windows, and no more
    /// than its share of `max_buffered` (one stream window at least); each may hold its share
    /// of `max_send_buffered` unsent and unacknowledged (`MIN_SEND_SHARE` at least).
    pub fn rebudget(&self) {
        const MIN_SEND_SHARE: u64 = 16 << 20;
        let sessions: Vec<_> = self.all_sessions().into_iter().filter(|s| s.is_alive()).collect();
        let c = &self.config;
        let n = sessions.len().max(1) as u64;
        let rx = c.max_peer_buffered.min((c.max_buffered / n).max(c.stream_window as u64));
        let tx = (c.max_send_buffered / n).max(MIN_SEND_SHARE);
        for s in sessions {
            s.with_core(|core| {
                core.set_rx_budget(rx);
                core.set_tx_budget(tx);
            });
        }
    }

    pub fn handshake_failed(&self, peer: Option<std::net::SocketAddr>, why: String) {
        self.remember_closed(PeerChannelStats {
            peer_addr: peer,
            session: 0,
            peer_engine: 0,
            channel: ChannelStats {
                protocol_errors: 1,
                close_reason: Some(why),
                ..ChannelStats::default()
            },
        });
        self.counters.handshake_failures.fetch_add(1, Ordering::Relaxed);
        self.counters.protocol_errors.fetch_add(1, Ordering::Relaxed);
    }

    pub fn refused(&self, why: &str) {
        *self.refusals.lock().entry(why.to_string()).or_insert(0) += 1;
    }

    fn remember_closed(&self, stats: PeerChannelStats) {
        let mut closed = self.closed_channels.lock();
        if closed.len() == CLOSED_CHANNEL_HISTORY {
            closed.pop_front();
        }
        closed.push_back(stats);
    }

    /// A channel closed: record it; forget the session when it was its last channel.
    pub fn channel_closed(self: &Arc<Self>, session: &Arc<SessionRt>, ch: &Arc<Channel>) {
        let stats = ch.stats();
        let errors = stats.protocol_errors;
        self.remember_closed(PeerChannelStats {
            peer_addr: Some(session.peer_addr),
            session: session.dialer_id(),
            peer_engine: session.peer_engine,
            channel: stats,
        });
        if errors > 0 {
            self.counters.protocol_errors.fetch_add(errors, Ordering::Relaxed);
        }
        if self.stopping.load(Ordering::Acquire) {
            return;
        }
        if session.is_alive() {
            if session.initiator && !session.was_retired(ch) {
                self.redial(session.clone(), ch.meta.index, ch.meta.class);
            }
            return;
        }
        self.retired_stale.fetch_add(session.core().stats().stale_frames, Ordering::Relaxed);
        let listeners: Vec<_> = self.listeners.lock().values().cloned().collect();
        for l in listeners {
            l.forget_reset(session);
        }
        {
            let mut s = self.sessions.lock();
            s.dialed.retain(|_, v| !Arc::ptr_eq(v, session));
            s.accepted.retain(|_, v| !Arc::ptr_eq(v, session));
        }
        // Fewer sessions: the others' shares of the receive budget grow.
        self.rebudget();
    }

    fn stats(&self) -> EngineStats {
        let sessions = self.all_sessions();
        let mut stats = EngineStats {
            engine_id: self.id,
            local_addr: Some(self.local_addr).filter(|_| self.config.accept_channels),
            closed_channels: self.closed_channels.lock().iter().cloned().collect(),
            protocol_errors: self.counters.protocol_errors.load(Ordering::Relaxed),
            handshake_failures: self.counters.handshake_failures.load(Ordering::Relaxed),
            stale_frames: self.retired_stale.load(Ordering::Relaxed),
            sessions: sessions.iter().filter(|s| s.is_alive()).count(),
            session_entries: sessions.len(),
            refusals: self.refusals.lock().iter().map(|(k, v)| (k.clone(), *v)).collect(),
            redialed_channels: self.counters.redialed_channels.load(Ordering::Relaxed),
            held_bytes: self.rx_held.load(Ordering::Relaxed),
            channels_open: self.channel_budget.in_use(),
            max_channels_total: self.channel_budget.max_total(),
            workers: self.workers.iter().filter_map(|w| w.info.lock().clone()).collect(),
            app_threads_demoted: self.demotes_app_threads(),
            isolating: self.isolating(),
            ..EngineStats::default()
        };
        for s in &sessions {
            debug_assert!(s.peer_engine != 0 || !s.is_alive());
            for c in s.channels() {
                stats.channels.push(PeerChannelStats {
                    peer_addr: Some(s.peer_addr),
                    session: s.dialer_id(),
                    peer_engine: s.peer_engine,
                    channel: c.stats(),
                });
            }
            let core = s.core();
            let cs = core.stats();
            stats.stale_frames += cs.stale_frames;
            stats.retransmitted_bytes += cs.retransmitted_bytes;
            stats.open_sockets += cs.streams;
            stats.unsent_bytes += cs.unsent_bytes;
            stats.retained_bytes += cs.retained_bytes;
            stats.rx_granted += core.rx_granted();
            stats.rx_budget += if s.is_alive() { core.config().rx_budget } else { 0 };
            let names = s.app_addrs.lock();
            for (id, st) in core.streams() {
                stats.sockets.push(SocketStats {
                    app_addrs: names.get(&id.get()).copied(),
                    ..SocketStats::of(id, st, s.peer_addr)
                });
            }
        }
        stats
    }
}

/// How long a session waits before it tries again to add a channel, after `failures` earlier
/// failures in a row and one more now (`EngineCtx::grow_failed`); `now` spreads it.
fn growth_backoff_ns(failures: u32, at_limit: bool, now: u64) -> u64 {
    let (first_ms, most_ms): (u64, u64) = if at_limit { (5_000, 300_000) } else { (100, 10_000) };
    let wait = (first_ms << failures.min(12)).min(most_ms) * 1_000_000;
    // Up to a quarter more, from the clock's low bits (sessions fail at different instants).
    wait + (now ^ (now >> 17)) % (wait / 4 + 1)
}

#[cfg(test)]
mod tests {
    use super::growth_backoff_ns;

    const MS: u64 = 1_000_000;

    #[test]
    fn growth_waits_double_with_each_failure_up_to_a_cap_and_are_spread() {
        let within = |ns: u64, ms: u64| (ms * MS..=ms * MS + ms * MS / 4).contains(&ns);
        for now in [0, 1, 123_456_789, u64::MAX / 3] {
            assert!(within(growth_backoff_ns(0, false, now), 100));
            assert!(within(growth_backoff_ns(1, false, now), 200));
            assert!(within(growth_backoff_ns(6, false, now), 6_400));
            assert!(within(growth_backoff_ns(7, false, now), 10_000));
            assert!(within(growth_backoff_ns(u32::MAX, false, now), 10_000));
            assert!(within(growth_backoff_ns(0, true, now), 5_000));
            assert!(within(growth_backoff_ns(3, true, now), 40_000));
            assert!(within(growth_backoff_ns(u32::MAX, true, now), 300_000));
        }
        // Sessions that fail at different instants come back at different instants.
        let spread: std::collections::HashSet<u64> =
            (0..64u64).map(|i| growth_backoff_ns(2, true, i * 7_919 * MS)).collect();
        assert!(spread.len() > 32, "{spread:?}");
    }
}
