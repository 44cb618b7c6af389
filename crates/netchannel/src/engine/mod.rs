//! The engine: threads and execution model, running inside the application process.
//!
//! Threads: one acceptor (channel listener), and one worker per channel. A worker spins while its
//! channel has work (bounded batches each way per round), keeps polling for `idle_spin` after the
//! last work, then parks in epoll on its socket and a wake-up eventfd. An idle engine uses no CPU.

pub mod config;
pub(crate) mod session;
mod worker;

use std::collections::{HashMap, VecDeque};
use std::io;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;

pub use config::Config;

use crate::driver::pool::BufferPool;
use crate::driver::tcp::{self, TcpChannelIo, TcpOptions};
use crate::driver::{Channel, ChannelError, ChannelMeta, ChannelQueues, ChannelStats};
use crate::scheduler::Scheduler;
use crate::vns::socket::{Listener, ListenerShared, SocketStats, VSocket};
use crate::vns::stream::ResetCause;
use crate::vns::table::StreamTable;
use crate::wire::{Class, Frame, Handshake, RejectReason, RstReason};
use session::Session;

/// Handshakes in progress at once; more connections are refused (`RejectReason::Limit`).
const MAX_PENDING_HANDSHAKES: usize = 64;
/// Idle frame buffers kept for reuse (each `max_frame_payload` + header).
const POOLED_BUFFERS: usize = 256;
/// Closed channels remembered for `stats()`.
const CLOSED_CHANNEL_HISTORY: usize = 256;

/// Counters of the whole engine.
#[derive(Debug, Clone, Default)]
pub struct EngineStats {
    pub engine_id: u64,
    pub local_addr: Option<SocketAddr>,
    /// Open channels, every peer.
    pub channels: Vec<PeerChannelStats>,
    /// The most recently closed channels, with why they closed.
    pub closed_channels: Vec<PeerChannelStats>,
    pub sockets: Vec<SocketStats>,
    /// Virtual sockets holding state (open, or closed and waiting for the peer to finish).
    pub open_sockets: usize,
    /// Channels closed because the peer broke the protocol, handshakes included.
    pub protocol_errors: u64,
    pub handshake_failures: u64,
    /// Frames for streams that were already closed here (normal after a reset; ignored).
    pub stale_frames: u64,
}

#[derive(Debug, Clone, Default)]
pub struct PeerChannelStats {
    pub peer_addr: Option<SocketAddr>,
    pub channel: ChannelStats,
}

#[derive(Default)]
pub(crate) struct EngineCounters {
    pub protocol_errors: AtomicU64,
    pub handshake_failures: AtomicU64,
    pub stale_frames: AtomicU64,
}

#[derive(Default)]
struct Sessions {
    dialed: HashMap<SocketAddr, Arc<Session>>,
    accepted: HashMap<u64, Arc<Session>>,
}

pub(crate) struct EngineInner {
    pub config: Config,
    pub id: u64,
    pub local_addr: SocketAddr,
    pub streams: StreamTable,
    pub listeners: Mutex<HashMap<u16, Arc<ListenerShared>>>,
    pub counters: EngineCounters,
    /// Frame buffers recycled between senders, workers and readers.
    pub buffers: Arc<BufferPool>,
    tcp_options: TcpOptions,
    listener: TcpListener,
    sessions: Mutex<Sessions>,
    dial_lock: Mutex<()>,
    stopping: AtomicBool,
    threads: Mutex<Vec<JoinHandle<()>>>,
    closed_channels: Mutex<VecDeque<PeerChannelStats>>,
    pending_handshakes: AtomicUsize,
}

/// A NetChannel engine embedded in this process. Dropping it shuts it down: every virtual socket
/// still open fails with `ConnectionAborted`.
pub struct Engine {
    inner: Arc<EngineInner>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Runs `f` on a thread that first enters `netns` (if any) and waits for its result.
fn in_netns<T: Send + 'static>(
    netns: Option<std::path::PathBuf>,
    f: impl FnOnce() -> io::Result<T> + Send + 'static,
) -> io::Result<T> {
    std::thread::spawn(move || {
        if let Some(ns) = &netns {
            crate::sys::enter_netns(ns)?;
        }
        f()
    })
    .join()
    .map_err(|_| io::Error::other("engine set-up thread panicked"))?
}

impl Engine {
    /// Starts an engine whose channel listener binds `config.listen_addr`.
    pub fn new(config: Config) -> io::Result<Engine> {
        config.validate()?;
        let addr = config.listen_addr;
        let listener =
            in_netns(config.netns.clone(), move || TcpListener::bind(addr)).map_err(|e| {
                io::Error::new(e.kind(), format!("cannot bind channel listener {addr}: {e}"))
            })?;
        let local_addr = listener.local_addr()?;
        let inner = Arc::new(EngineInner {
            id: crate::sys::random_u64(),
            local_addr,
            streams: StreamTable::new(config.max_streams),
            listeners: Mutex::new(HashMap::new()),
            counters: EngineCounters::default(),
            buffers: Arc::new(BufferPool::new(
                crate::wire::frame::DATA_HEADER_LEN + config.max_frame_payload,
                POOLED_BUFFERS,
            )),
            tcp_options: TcpOptions { notsent_lowat: config.notsent_lowat },
            listener,
            sessions: Mutex::new(Sessions::default()),
            dial_lock: Mutex::new(()),
            stopping: AtomicBool::new(false),
            threads: Mutex::new(Vec::new()),
            closed_channels: Mutex::new(VecDeque::new()),
            pending_handshakes: AtomicUsize::new(0),
            config,
        });
        let acceptor = inner.clone();
        inner.spawn("nc-accept", move || acceptor.accept_loop())?;
        Ok(Engine { inner })
    }

    pub fn id(&self) -> u64 {
        self.inner.id
    }

    /// The address peers dial to reach this engine.
    pub fn local_addr(&self) -> SocketAddr {
        self.inner.local_addr
    }

    pub fn config(&self) -> &Config {
        &self.inner.config
    }

    /// Listens for virtual sockets on a virtual `port` (its own namespace, not kernel ports).
    pub fn listen(&self, port: u16) -> io::Result<Listener> {
        Listener::bind(self.inner.clone(), port)
    }

    /// Opens a Throughput-class virtual socket to `port` on the engine at `peer`.
    pub fn connect(&self, peer: SocketAddr, port: u16) -> io::Result<VSocket> {
        self.connect_with_class(peer, port, Class::Throughput)
    }

    pub fn connect_with_class(
        &self,
        peer: SocketAddr,
        port: u16,
        class: Class,
    ) -> io::Result<VSocket> {
        let session = self.inner.session_to(peer)?;
        VSocket::connect(self.inner.clone(), session, port, class)
    }

    pub fn stats(&self) -> EngineStats {
        self.inner.stats()
    }

    /// Stops every thread and fails every open virtual socket. Idempotent.
    pub fn shutdown(&self) {
        self.inner.shutdown();
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.inner.shutdown();
    }
}

impl EngineInner {
    pub fn stopping(&self) -> bool {
        self.stopping.load(Ordering::SeqCst)
    }

    fn spawn(self: &Arc<Self>, name: &str, f: impl FnOnce() + Send + 'static) -> io::Result<()> {
        let netns = self.config.netns.clone();
        let handle = std::thread::Builder::new().name(name.into()).spawn(move || {
            if let Some(ns) = &netns {
                if let Err(e) = crate::sys::enter_netns(ns) {
                    eprintln!("netchannel: {e}");
                    return;
                }
            }
            f()
        })?;
        let mut threads = lock(&self.threads);
        threads.retain(|h| !h.is_finished());
        threads.push(handle);
        Ok(())
    }

    fn accept_loop(self: Arc<Self>) {
        loop {
            let conn = self.listener.accept();
            if self.stopping() {
                return;
            }
            match conn {
                Ok((mut sock, _)) => {
                    if self.pending_handshakes.fetch_add(1, Ordering::SeqCst)
                        >= MAX_PENDING_HANDSHAKES
                    {
                        self.pending_handshakes.fetch_sub(1, Ordering::SeqCst);
                        self.counters.handshake_failures.fetch_add(1, Ordering::Relaxed);
                        use std::io::Write;
                        let _ = sock
                            .write_all(&Handshake::reject(self.id, RejectReason::Limit).encode());
                        continue;
                    }
                    let me = self.clone();
                    if self.spawn("nc-channel", move || me.accept_channel(sock)).is_err() {
                        self.pending_handshakes.fetch_sub(1, Ordering::SeqCst);
                    }
                }
                // Out of fds or memory: back off instead of spinning; the peer retries.
                Err(_) => std::thread::sleep(std::time::Duration::from_millis(10)),
            }
        }
    }

    fn accept_channel(self: Arc<Self>, mut sock: TcpStream) {
        let peer_addr = sock.peer_addr().ok();
        let hello =
            tcp::accept_handshake(&mut sock, self.id, self.config.dial_timeout, &self.tcp_options);
        self.pending_handshakes.fetch_sub(1, Ordering::SeqCst);
        let hello = match hello {
            Ok(h) => h,
            Err(e) => {
                self.remember_closed(PeerChannelStats {
                    peer_addr,
                    channel: ChannelStats {
                        protocol_errors: 1,
                        close_reason: Some(format!("handshake refused: {e}")),
                        ..ChannelStats::default()
                    },
                });
                self.counters.handshake_failures.fetch_add(1, Ordering::SeqCst);
                self.counters.protocol_errors.fetch_add(1, Ordering::SeqCst);
                return;
            }
        };
        let session = {
            let mut s = lock(&self.sessions);
            s.accepted
                .entry(hello.engine_id)
                .or_insert_with(|| {
                    Arc::new(Session::new(
                        peer_addr.unwrap_or_else(|| SocketAddr::from(([0, 0, 0, 0], 0))),
                        Scheduler::new(self.config.policy, self.config.channel_queue_threshold),
                        self.config.channel_queue_threshold,
                        false,
                        0,
                    ))
                })
                .clone()
        };
        let meta =
            ChannelMeta { index: hello.channel, class: hello.class, peer_engine: hello.engine_id };
        let Ok(queues) = ChannelQueues::new(meta).map(Arc::new) else {
            return;
        };
        if !session.add_channel(queues.clone()) {
            self.counters.handshake_failures.fetch_add(1, Ordering::Relaxed);
            let _ =
                tcp::finish_accept(&mut sock, Handshake::reject(self.id, RejectReason::BadField));
            return;
        }
        let accept = Handshake::accept(self.id, hello.channel, hello.class);
        let io = match tcp::finish_accept(&mut sock, accept)
            .and_then(|_| TcpChannelIo::new(sock, queues.clone(), self.buffers.clone()))
        {
            Ok(io) => io,
            Err(e) => {
                queues.close(&ChannelError::Io(e));
                self.channel_closed(&session, &queues);
                return;
            }
        };
        worker::run(&self, &session, &queues, Box::new(io));
    }

    /// The session to the engine at `addr`, dialing its channels if there is none.
    fn session_to(self: &Arc<Self>, addr: SocketAddr) -> io::Result<Arc<Session>> {
        let existing = |me: &Self| {
            lock(&me.sessions)
                .dialed
                .get(&addr)
                .filter(|s| s.is_alive() && s.channel_count() > 0)
                .cloned()
        };
        if let Some(s) = existing(self) {
            return Ok(s);
        }
        let _dialing = lock(&self.dial_lock);
        if let Some(s) = existing(self) {
            return Ok(s);
        }
        if self.stopping() {
            return Err(io::Error::new(io::ErrorKind::ConnectionAborted, "engine shut down"));
        }
        let initial = self.config.channels + self.config.latency_channels;
        let session = Arc::new(Session::new(
            addr,
            Scheduler::new(self.config.policy, self.config.channel_queue_threshold),
            self.config.channel_queue_threshold,
            true,
            initial as u16,
        ));
        let classes = std::iter::repeat_n(Class::Throughput, self.config.channels)
            .chain(std::iter::repeat_n(Class::Latency, self.config.latency_channels));
        let (tx, rx) = mpsc::channel();
        let mut dialing = 0;
        for (index, class) in classes.enumerate() {
            let me = self.clone();
            let session = session.clone();
            let tx = tx.clone();
            let done = move |r: io::Result<()>| {
                let _ = tx.send(r);
            };
            self.spawn("nc-channel", move || {
                me.dial_channel(session, addr, index as u16, class, done)
            })?;
            dialing += 1;
        }
        drop(tx);
        let mut first_error = None;
        for _ in 0..dialing {
            match rx.recv() {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    first_error.get_or_insert(e);
                }
                Err(_) => {
                    first_error.get_or_insert(io::Error::other("channel thread exited"));
                }
            }
        }
        if let Some(e) = first_error {
            session.kill();
            for ch in session.channels() {
                ch.close(&ChannelError::Io(io::Error::other("session set-up failed")));
                ch.wake_fd().notify();
            }
            return Err(e);
        }
        lock(&self.sessions).dialed.insert(addr, session.clone());
        Ok(session)
    }

    fn dial_channel(
        self: Arc<Self>,
        session: Arc<Session>,
        addr: SocketAddr,
        index: u16,
        class: Class,
        done: impl FnOnce(io::Result<()>),
    ) {
        let hello = Handshake::hello(self.id, index, class);
        let (sock, reply) =
            match tcp::dial(addr, hello, self.config.dial_timeout, &self.tcp_options) {
                Ok(ok) => ok,
                Err(e) => return done(Err(e)),
            };
        let meta = ChannelMeta { index, class, peer_engine: reply.engine_id };
        let setup = ChannelQueues::new(meta).map(Arc::new).and_then(|q| {
            let io = TcpChannelIo::new(sock, q.clone(), self.buffers.clone())?;
            Ok((q, io))
        });
        let (queues, io) = match setup {
            Ok(ok) => ok,
            Err(e) => return done(Err(e)),
        };
        session.add_channel(queues.clone());
        done(Ok(()));
        worker::run(&self, &session, &queues, Box::new(io));
    }

    /// Adds a throughput channel to a session this engine dialed, if it is below
    /// `max_channels` and not already adding one (NetScheduler's channel scaling).
    pub(crate) fn grow(self: &Arc<Self>, session: &Arc<Session>) {
        if !session.initiator
            || self.stopping()
            || !session.is_alive()
            || session.class_count(Class::Throughput) >= self.config.max_channels
            || session.growing.swap(true, Ordering::SeqCst)
        {
            return;
        }
        let index = session.next_index.fetch_add(1, Ordering::SeqCst);
        if index > crate::wire::handshake::MAX_CHANNEL_INDEX {
            return; // indexes are spent (channels came and went); stay at this size
        }
        let (me, s, addr) = (self.clone(), session.clone(), session.peer_addr);
        let done_session = session.clone();
        let done = move |r: io::Result<()>| {
            if r.is_err() {
                // Do not redial a refusing or unreachable peer on every full queue.
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
            done_session.growing.store(false, Ordering::SeqCst);
        };
        if self
            .spawn("nc-channel", move || me.dial_channel(s, addr, index, Class::Throughput, done))
            .is_err()
        {
            session.growing.store(false, Ordering::SeqCst);
        }
    }

    fn remember_closed(&self, stats: PeerChannelStats) {
        let mut closed = lock(&self.closed_channels);
        if closed.len() == CLOSED_CHANNEL_HISTORY {
            closed.pop_front();
        }
        closed.push_back(stats);
    }

    /// A channel stopped (its queues are already closed). Streams that had frames on it may have
    /// lost bytes: they are reset, and the peer is told over the channels that remain. When the
    /// last channel goes, the session and all its streams go with it.
    pub(crate) fn channel_closed(&self, session: &Arc<Session>, queues: &Arc<ChannelQueues>) {
        let stats = queues.stats();
        let (index, errors) = (stats.index, stats.protocol_errors);
        // Recorded before counted, so whoever sees the count also finds the reason.
        self.remember_closed(PeerChannelStats {
            peer_addr: Some(session.peer_addr),
            channel: stats,
        });
        if errors > 0 {
            self.counters.protocol_errors.fetch_add(errors, Ordering::SeqCst);
        }
        if self.stopping() {
            return;
        }
        let remaining = session.remove_channel(index);
        let bit = 1u64 << index;
        let affected = if remaining == 0 {
            session.kill();
            let mut s = lock(&self.sessions);
            s.dialed.retain(|_, v| !Arc::ptr_eq(v, session));
            s.accepted.retain(|_, v| !Arc::ptr_eq(v, session));
            drop(s);
            self.streams.collect(|st| Arc::ptr_eq(&st.session, session))
        } else {
            self.streams.collect(|st| {
                Arc::ptr_eq(&st.session, session) && st.lock().channel_mask & bit != 0
            })
        };
        for stream in affected {
            let mut st = stream.lock();
            let notify_peer = st.reset.is_none() && st.peer_stream_known();
            st.on_reset(ResetCause::ChannelLost);
            let (peer, class, app_closed) = (st.peer_stream, st.class, st.app_closed);
            drop(st);
            if notify_peer && remaining > 0 {
                let rst = Frame::Rst { dst: peer, reason: RstReason::Aborted };
                session.send_control(stream.id, class, rst);
            }
            if app_closed {
                self.streams.remove(stream.id);
            }
            stream.wake();
        }
    }

    fn shutdown(&self) {
        if self.stopping.swap(true, Ordering::SeqCst) {
            return;
        }
        for stream in self.streams.collect(|_| true) {
            stream.lock().on_reset(ResetCause::EngineShutdown);
            stream.wake();
        }
        for l in lock(&self.listeners).values() {
            l.close();
        }
        // Unblocks the acceptor's accept().
        // SAFETY: shutdown on a listening socket we own; it only changes its state.
        unsafe { libc::shutdown(self.listener.as_raw_fd(), libc::SHUT_RDWR) };
        let sessions = std::mem::take(&mut *lock(&self.sessions));
        for s in sessions.dialed.values().chain(sessions.accepted.values()) {
            s.kill();
            for ch in s.channels() {
                ch.close(&ChannelError::Io(io::Error::other("engine shut down")));
                ch.wake_fd().notify();
            }
        }
        let threads = std::mem::take(&mut *lock(&self.threads));
        let me = std::thread::current().id();
        for t in threads {
            if t.thread().id() != me {
                let _ = t.join();
            }
        }
    }

    fn stats(&self) -> EngineStats {
        let sessions: Vec<Arc<Session>> = {
            let s = lock(&self.sessions);
            s.dialed.values().chain(s.accepted.values()).cloned().collect()
        };
        let channels = sessions
            .iter()
            .flat_map(|s| {
                s.channels().into_iter().map(move |c| PeerChannelStats {
                    peer_addr: Some(s.peer_addr),
                    channel: c.stats(),
                })
            })
            .collect();
        let sockets = self.streams.collect(|_| true).iter().map(|s| SocketStats::of(s)).collect();
        EngineStats {
            engine_id: self.id,
            local_addr: Some(self.local_addr),
            channels,
            closed_channels: lock(&self.closed_channels).iter().cloned().collect(),
            sockets,
            open_sockets: self.streams.live(),
            protocol_errors: self.counters.protocol_errors.load(Ordering::Relaxed),
            handshake_failures: self.counters.handshake_failures.load(Ordering::Relaxed),
            stale_frames: self.counters.stale_frames.load(Ordering::Relaxed),
        }
    }
}
