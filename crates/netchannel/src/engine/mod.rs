//! The engine: threads and execution model, running inside the application process.
//!
//! Threads: one acceptor (the channel listener and its handshakes) and a fixed pool of workers
//! (`Config::workers`, plus one for latency-class channels when there are any), whatever the
//! number of peers, channels or sockets. The thread that waits does the work: an application
//! thread blocked in `recv`, `send` or `Poller::wait` reads and writes the channels it waits
//! on itself; workers serve channels only while no application thread does (see `waiter`).

pub(crate) mod acceptor;
pub mod config;
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

use parking_lot::Mutex;

pub use config::{Config, Isolation};
pub use stats::{EngineStats, PeerChannelStats, SocketStats};
pub use worker::WorkerThread;

use crate::driver::tcp::{self, Incoming, TcpOptions, TcpTransport};
use crate::driver::{Channel, ChannelMeta, ChannelStats};
use crate::proto::{ChannelIndex, CoreConfig};
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
    dialed: HashMap<SocketAddr, Arc<SessionRt>>,
    accepted: HashMap<u64, Arc<SessionRt>>,
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
    dial_lock: Mutex<()>,
    closed_channels: Mutex<VecDeque<PeerChannelStats>>,
    refusals: Mutex<HashMap<String, u64>>,
    /// Sessions retired (all channels lost) but still referenced: their counters stay visible.
    retired_stale: AtomicU64,
    /// Received bytes held for applications, every session (see `SessionRt::account_held`).
    pub rx_held: AtomicU64,
    /// Sessions whose channels are not read while memory is at a limit.
    pub rx_paused: Mutex<Vec<std::sync::Weak<SessionRt>>>,
    /// Application threads doing throughput-class work may be demoted to `throughput_policy`
    /// meanwhile (see `priority`): the process can put them back.
    pub demote_app_threads: bool,
    /// Latency-class virtual sockets open (`Isolation::Auto` isolates while there are any).
    pub latency_sockets: std::sync::atomic::AtomicUsize,
}

/// A NetChannel engine embedded in this process. Dropping it shuts it down: every virtual socket
/// still open fails with `ConnectionAborted`.
pub struct Engine {
    pub(crate) ctx: Arc<EngineCtx>,
    acceptor: Mutex<Option<JoinHandle<()>>>,
    stop: Arc<EventFd>,
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
    /// Starts an engine whose channel listener binds `config.listen_addr`.
    pub fn new(config: Config) -> io::Result<Engine> {
        config.validate()?;
        let addr = config.listen_addr;
        let listener = in_netns(config.netns.clone(), move || crate::sys::tcp_listen(&addr))
            .map_err(|e| {
                io::Error::new(e.kind(), format!("cannot bind channel listener {addr}: {e}"))
            })?;
        let local_addr = listener.local_addr()?;
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
            },
            stopping: AtomicBool::new(false),
            counters: EngineCounters::default(),
            sessions: Mutex::new(Sessions::default()),
            dial_lock: Mutex::new(()),
            closed_channels: Mutex::new(VecDeque::new()),
            refusals: Mutex::new(HashMap::new()),
            retired_stale: AtomicU64::new(0),
            rx_held: AtomicU64::new(0),
            rx_paused: Mutex::new(Vec::new()),
            demote_app_threads: config.isolation != config::Isolation::Never
                && priority::can_demote(config.throughput_policy),
            latency_sockets: std::sync::atomic::AtomicUsize::new(0),
            config,
        });
        for w in &ctx.workers {
            w.start(&ctx)?;
        }
        let stop = Arc::new(EventFd::new()?);
        let engine = Engine { ctx: ctx.clone(), acceptor: Mutex::new(None), stop: stop.clone() };
        let netns = ctx.config.netns.clone();
        let handle = std::thread::Builder::new().name("nc-accept".into()).spawn(move || {
            if let Some(ns) = &netns {
                if let Err(e) = crate::sys::enter_netns(ns) {
                    eprintln!("netchannel: {e}");
                    return;
                }
            }
            acceptor::run(ctx, listener, stop)
        })?;
        *engine.acceptor.lock() = Some(handle);
        Ok(engine)
    }

    /// This engine's random id (its peers key their sessions by it).
    pub fn id(&self) -> u64 {
        self.ctx.id
    }

    /// The address peers dial to reach this engine.
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

    /// Stops every thread and fails every open virtual socket. Idempotent.
    pub fn shutdown(&self) {
        if self.ctx.stopping.swap(true, Ordering::SeqCst) {
            return;
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
    /// A listener for virtual `port`.
    pub fn bind_listener(&self, port: u16) -> io::Result<Arc<ListenerShared>> {
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

    /// Demotes the calling application thread while it does `class` work (see `priority`).
    pub fn demote_for(&self, class: Class) -> priority::Demoted {
        let on = self.demote_app_threads && self.isolating();
        priority::Demoted::enter(on, self.config.throughput_policy, class)
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
        }
    }

    fn all_sessions(&self) -> Vec<Arc<SessionRt>> {
        let s = self.sessions.lock();
        s.dialed.values().chain(s.accepted.values()).cloned().collect()
    }

    /// The worker for a new channel: latency channels get the last worker when it is theirs.
    fn pick_worker(&self, index: u16, class: Class) -> usize {
        let throughput = self.config.workers;
        if class == Class::Latency && self.workers.len() > throughput {
            return throughput;
        }
        index as usize % throughput
    }

    /// The session to the engine at `addr`, dialing its channels if there is none.
    pub fn session_to(self: &Arc<Self>, addr: SocketAddr) -> io::Result<Arc<SessionRt>> {
        let existing =
            |me: &Self| me.sessions.lock().dialed.get(&addr).filter(|s| s.is_alive()).cloned();
        if let Some(s) = existing(self) {
            return Ok(s);
        }
        let _dialing = self.dial_lock.lock();
        if let Some(s) = existing(self) {
            return Ok(s);
        }
        if self.stopping.load(Ordering::Acquire) {
            return Err(io::Error::new(io::ErrorKind::ConnectionAborted, "engine shut down"));
        }
        let plan: Vec<(u16, Class)> = std::iter::repeat_n(Class::Throughput, self.config.channels)
            .chain(std::iter::repeat_n(Class::Latency, self.config.latency_channels))
            .enumerate()
            .map(|(i, c)| (i as u16, c))
            .collect();
        let me = self.clone();
        let dialed = in_netns(self.config.netns.clone(), move || {
            plan.iter().map(|&(index, class)| me.dial_channel(addr, index, class)).collect()
        });
        let channels: Vec<Arc<Channel>> = dialed?;
        let peer = channels[0].meta.peer_engine;
        let session = SessionRt::new(self.clone(), addr, peer, true, channels.len() as u16);
        for ch in channels {
            session.add_channel(ch);
        }
        self.sessions.lock().dialed.insert(addr, session.clone());
        Ok(session)
    }

    fn dial_channel(&self, addr: SocketAddr, index: u16, class: Class) -> io::Result<Arc<Channel>> {
        let (sock, peer) = tcp::dial(
            addr,
            self.id,
            index,
            class,
            self.config.psk.as_deref(),
            self.config.dial_timeout,
            &self.tcp_options,
        )?;
        let meta = ChannelMeta { index: ChannelIndex(index), class, peer_engine: peer };
        let worker = self.pick_worker(index, class);
        let transport = Box::new(TcpTransport::new(sock));
        let large = self.config.defer_min.max(1);
        Ok(Arc::new(Channel::new(meta, transport, large, worker, self.pool.clone())?))
    }

    /// Adds a throughput channel to a session this engine dialed (NetScheduler's channel
    /// scaling), if it is below `max_channels` and not already adding one.
    pub fn grow(self: &Arc<Self>, session: &Arc<SessionRt>) {
        let count = session.serving_channels(Class::Throughput).len();
        if !session.initiator
            || self.stopping.load(Ordering::Acquire)
            || count >= self.config.max_channels
            || session.growing.swap(true, Ordering::AcqRel)
        {
            return;
        }
        self.add_channel_async(session.clone(), Class::Throughput);
    }

    /// Dials one more channel of `class` for `session` in the background.
    fn add_channel_async(self: &Arc<Self>, session: Arc<SessionRt>, class: Class) {
        let index = session.next_index.fetch_add(1, Ordering::AcqRel);
        if index > crate::wire::handshake::MAX_CHANNEL_INDEX {
            session.growing.store(false, Ordering::Release);
            return; // indexes are spent (channels came and went); stay at this size
        }
        let me = self.clone();
        let netns = self.config.netns.clone();
        let spawned = std::thread::Builder::new().name("nc-dial".into()).spawn(move || {
            let r = in_netns(netns, {
                let me = me.clone();
                let addr = session.peer_addr;
                move || me.dial_channel(addr, index, class)
            });
            match r {
                Ok(ch) if !me.stopping.load(Ordering::Acquire) => {
                    session.add_channel(ch);
                }
                Ok(_) => {}
                // Do not redial a refusing or unreachable peer on every full queue.
                Err(_) => std::thread::sleep(std::time::Duration::from_millis(100)),
            }
            session.growing.store(false, Ordering::Release);
        });
        if spawned.is_err() {
            // Out of threads: stay at this size.
        }
    }

    /// Dials a lost channel again, with the same index and class, while the session lives
    /// (its other channels carried on meanwhile). Gives up after a few tries.
    fn redial(self: &Arc<Self>, session: Arc<SessionRt>, index: u16, class: Class) {
        let me = self.clone();
        let spawned = std::thread::Builder::new().name("nc-dial".into()).spawn(move || {
            for delay_ms in [5, 50, 250, 1000, 3000] {
                std::thread::sleep(std::time::Duration::from_millis(delay_ms));
                if me.stopping.load(Ordering::Acquire) || !session.is_alive() {
                    return;
                }
                let r = in_netns(me.config.netns.clone(), {
                    let me = me.clone();
                    let addr = session.peer_addr;
                    move || me.dial_channel(addr, index, class)
                });
                // The peer may not have noticed the loss yet (the index is still taken there).
                let Ok(ch) = r else { continue };
                if !me.stopping.load(Ordering::Acquire) && session.add_channel(ch) {
                    me.counters.redialed_channels.fetch_add(1, Ordering::Relaxed);
                }
                return;
            }
        });
        if spawned.is_err() {
            self.refused("redial: cannot start a thread");
        }
    }

    /// Refuses a hello before anything is answered (the channel index is taken).
    pub fn check_hello(&self, hello: &Handshake) -> Result<(), RejectReason> {
        let (existing, count) = {
            let sessions = self.sessions.lock();
            let existing =
                sessions.accepted.get(&hello.engine_id).filter(|s| s.is_alive()).cloned();
            (existing, sessions.accepted.values().filter(|s| s.is_alive()).count())
        };
        match existing {
            Some(s) if s.channel(ChannelIndex(hello.channel)).is_some() => {
                Err(RejectReason::BadField)
            }
            Some(_) => Ok(()),
            None if count >= self.config.max_sessions => {
                self.refused("sessions at max_sessions");
                Err(RejectReason::Limit)
            }
            None => Ok(()),
        }
    }

    /// A confirmed handshake: admit the channel into the peer's session.
    pub fn admit(self: &Arc<Self>, mut inc: Incoming, hello: Handshake) {
        if self.stopping.load(Ordering::Acquire) {
            return;
        }
        let peer_addr = inc.peer.unwrap_or_else(|| SocketAddr::from(([0, 0, 0, 0], 0)));
        let session = {
            let mut s = self.sessions.lock();
            if s.accepted.get(&hello.engine_id).is_some_and(|x| !x.is_alive()) {
                s.accepted.remove(&hello.engine_id);
            }
            if !s.accepted.contains_key(&hello.engine_id)
                && s.accepted.values().filter(|x| x.is_alive()).count() >= self.config.max_sessions
            {
                drop(s);
                self.refused("sessions at max_sessions");
                inc.refuse(self.id, RejectReason::Limit);
                return;
            }
            s.accepted
                .entry(hello.engine_id)
                .or_insert_with(|| {
                    SessionRt::new(self.clone(), peer_addr, hello.engine_id, false, 0)
                })
                .clone()
        };
        if session.channel(ChannelIndex(hello.channel)).is_some() {
            inc.refuse(self.id, RejectReason::BadField);
            self.handshake_failed(inc.peer, "channel index already in use".into());
            return;
        }
        let sock = match inc.admit(self.config.psk.as_deref()) {
            Ok(s) => s,
            Err(e) => return self.handshake_failed(Some(peer_addr), format!("{e}")),
        };
        let meta = ChannelMeta {
            index: ChannelIndex(hello.channel),
            class: hello.class,
            peer_engine: hello.engine_id,
        };
        let worker = self.pick_worker(hello.channel, hello.class);
        let transport = Box::new(TcpTransport::new(sock));
        let large = self.config.defer_min.max(1);
        match Channel::new(meta, transport, large, worker, self.pool.clone()) {
            Ok(ch) => {
                session.add_channel(Arc::new(ch));
            }
            Err(e) => self.handshake_failed(Some(peer_addr), format!("cannot set up channel: {e}")),
        }
    }

    pub fn handshake_failed(&self, peer: Option<std::net::SocketAddr>, why: String) {
        self.remember_closed(PeerChannelStats {
            peer_addr: peer,
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
            channel: stats,
        });
        if errors > 0 {
            self.counters.protocol_errors.fetch_add(errors, Ordering::Relaxed);
        }
        if self.stopping.load(Ordering::Acquire) {
            return;
        }
        if session.is_alive() {
            if session.initiator {
                self.redial(session.clone(), ch.meta.index.get(), ch.meta.class);
            }
            return;
        }
        self.retired_stale.fetch_add(session.core().stats().stale_frames, Ordering::Relaxed);
        let mut s = self.sessions.lock();
        s.dialed.retain(|_, v| !Arc::ptr_eq(v, session));
        s.accepted.retain(|_, v| !Arc::ptr_eq(v, session));
    }

    fn stats(&self) -> EngineStats {
        let sessions = self.all_sessions();
        let mut stats = EngineStats {
            engine_id: self.id,
            local_addr: Some(self.local_addr),
            closed_channels: self.closed_channels.lock().iter().cloned().collect(),
            protocol_errors: self.counters.protocol_errors.load(Ordering::Relaxed),
            handshake_failures: self.counters.handshake_failures.load(Ordering::Relaxed),
            stale_frames: self.retired_stale.load(Ordering::Relaxed),
            sessions: sessions.iter().filter(|s| s.is_alive()).count(),
            refusals: self.refusals.lock().iter().map(|(k, v)| (k.clone(), *v)).collect(),
            redialed_channels: self.counters.redialed_channels.load(Ordering::Relaxed),
            held_bytes: self.rx_held.load(Ordering::Relaxed),
            workers: self.workers.iter().filter_map(|w| w.info.lock().clone()).collect(),
            app_threads_demoted: self.demote_app_threads,
            isolating: self.isolating(),
            ..EngineStats::default()
        };
        for s in &sessions {
            debug_assert!(s.peer_engine != 0 || !s.is_alive());
            for c in s.channels() {
                stats
                    .channels
                    .push(PeerChannelStats { peer_addr: Some(s.peer_addr), channel: c.stats() });
            }
            let core = s.core();
            let cs = core.stats();
            stats.stale_frames += cs.stale_frames;
            stats.retransmitted_bytes += cs.retransmitted_bytes;
            stats.open_sockets += cs.streams;
            for (id, st) in core.streams() {
                stats.sockets.push(SocketStats::of(id, st, s.peer_addr));
            }
        }
        stats
    }
}
