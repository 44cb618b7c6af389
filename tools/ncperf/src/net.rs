//! The two stacks behind one small API: non-blocking connections and a readiness waiter (epoll
//! for kernel sockets, a netchannel `Poller` for virtual sockets), both edge-triggered.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use netchannel::sys::{Epoll, EDGE, READABLE, WRITABLE};
use netchannel::{Class, Config, Engine, Policy, Poller, VSocket};

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
pub enum Stack {
    Linux,
    Netchannel,
    /// yamux (libp2p's stream multiplexer) over kernel TCP, on tokio (`mux.rs`).
    Yamux,
    /// QUIC (quinn) over UDP with TLS 1.3, on tokio (`mux.rs`).
    Quinn,
    /// HTTP/2 (the h2 crate) over kernel TCP, cleartext, on tokio (`mux.rs`).
    H2,
}

impl Stack {
    pub fn name(self) -> &'static str {
        match self {
            Stack::Linux => "linux",
            Stack::Netchannel => "netchannel",
            Stack::Yamux => "yamux",
            Stack::Quinn => "quinn",
            Stack::H2 => "h2",
        }
    }

    /// A stream multiplexer in the application's own process, served by `mux.rs` on tokio
    /// rather than by the thread-per-app event loops of `apps.rs`.
    pub fn is_mux(self) -> bool {
        matches!(self, Stack::Yamux | Stack::Quinn | Stack::H2)
    }
}

/// The error of an `apps.rs` entry point asked to serve a multiplexer stack.
fn mux_here(stack: Stack) -> io::Error {
    io::Error::other(format!(
        "the {} stack is served by mux.rs, not by the epoll apps",
        stack.name()
    ))
}

/// The virtual port ncperf servers listen on inside a netchannel engine.
pub const VPORT: u16 = 1;

/// First bytes of every flow: what the server should do with it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FlowHeader {
    pub echo: bool,
    /// A latency-class flow (mixed workload): a multiplexer with stream priorities (quinn)
    /// gives its server-side stream the higher one too. The epoll apps ignore it.
    pub latency: bool,
    pub receiver_app: u16,
    pub size: u32,
}

impl FlowHeader {
    pub const LEN: usize = 8;

    pub fn encode(&self) -> [u8; 8] {
        let mut b = [0u8; 8];
        b[0] = self.echo as u8;
        b[1] = self.latency as u8;
        b[2..4].copy_from_slice(&self.receiver_app.to_be_bytes());
        b[4..8].copy_from_slice(&self.size.to_be_bytes());
        b
    }

    pub fn decode(b: &[u8; 8]) -> io::Result<Self> {
        let bad = |m: &str| io::Error::new(io::ErrorKind::InvalidData, m.to_string());
        if b[0] > 1 || b[1] > 1 {
            return Err(bad("not an ncperf flow header"));
        }
        let size = u32::from_be_bytes(b[4..8].try_into().expect("4 bytes"));
        if size == 0 || size > 64 << 20 {
            return Err(bad("flow message size out of range"));
        }
        Ok(FlowHeader {
            echo: b[0] == 1,
            latency: b[1] == 1,
            receiver_app: u16::from_be_bytes([b[2], b[3]]),
            size,
        })
    }
}

pub enum Conn {
    Tcp(TcpStream),
    Virtual(VSocket),
}

impl Conn {
    pub fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Conn::Tcp(s) => s.read(buf),
            Conn::Virtual(s) => s.recv(buf),
        }
    }

    pub fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Conn::Tcp(s) => s.write(buf),
            Conn::Virtual(s) => s.send(buf),
        }
    }

    fn write_all_blocking(&mut self, buf: &[u8]) -> io::Result<()> {
        match self {
            Conn::Tcp(s) => s.write_all(buf),
            Conn::Virtual(s) => (&*s).write_all(buf),
        }
    }

    fn read_exact_blocking(&mut self, buf: &mut [u8]) -> io::Result<()> {
        match self {
            Conn::Tcp(s) => s.read_exact(buf),
            Conn::Virtual(s) => (&*s).read_exact(buf),
        }
    }

    pub fn set_nonblocking(&self) -> io::Result<()> {
        match self {
            Conn::Tcp(s) => s.set_nonblocking(true),
            Conn::Virtual(s) => {
                s.set_nonblocking(true);
                Ok(())
            }
        }
    }
}

/// Edge-triggered readiness for many connections, reported as tokens.
pub enum Waiter {
    Epoll(Epoll, parking_lot::Mutex<Vec<(u64, u32)>>),
    Poller(Poller),
}

impl Waiter {
    pub fn new(stack: Stack) -> io::Result<Waiter> {
        Ok(match stack {
            Stack::Linux => Waiter::Epoll(Epoll::new()?, parking_lot::Mutex::new(Vec::new())),
            Stack::Netchannel => Waiter::Poller(Poller::new()?),
            other => return Err(mux_here(other)),
        })
    }

    /// Registers a connection. Kernel sockets get write interest only with `writes_block`
    /// (stream senders): otherwise every ACK that frees send buffer would wake the app, an
    /// extra wake-up per RPC that no real RPC server pays. Virtual sockets report all changes.
    pub fn register(&self, conn: &Conn, token: u64, writes_block: bool) -> io::Result<()> {
        match (self, conn) {
            (Waiter::Epoll(ep, _), Conn::Tcp(s)) => {
                let write = if writes_block { WRITABLE } else { 0 };
                ep.add(s.as_fd(), READABLE | write | EDGE, token)
            }
            (Waiter::Poller(p), Conn::Virtual(s)) => p.register(s, token),
            _ => Err(io::Error::other("connection and waiter belong to different stacks")),
        }
    }

    /// Adds write interest after a write would have blocked (kernel sockets).
    pub fn want_writable(&self, conn: &Conn, token: u64) -> io::Result<()> {
        match (self, conn) {
            (Waiter::Epoll(ep, _), Conn::Tcp(s)) => {
                ep.modify(s.as_fd(), READABLE | WRITABLE | EDGE, token)
            }
            _ => Ok(()),
        }
    }

    pub fn wait(&self, tokens: &mut Vec<u64>, timeout: Duration) -> io::Result<()> {
        match self {
            Waiter::Epoll(ep, events) => {
                let mut events = events.lock();
                events.clear();
                ep.wait(&mut events, 256, Some(timeout))?;
                tokens.clear();
                tokens.extend(events.iter().map(|e| e.0));
                Ok(())
            }
            Waiter::Poller(p) => p.wait(tokens, Some(timeout)),
        }
    }
}

/// Engine settings ncperf exposes.
#[derive(Debug, Clone, Copy)]
pub struct EngineOpts {
    pub channels: usize,
    pub policy: Policy,
    pub isolation: IsolationOpt,
    pub demote_to: DemoteTo,
    /// `Config::latency_policy`: the latency-class worker's nice value (0: SCHED_OTHER nice 0).
    pub latency_nice: i8,
    /// The channels keep the host's congestion control (`Config::congestion` empty).
    pub host_congestion: bool,
    /// Client: engines, each a peer of the server dialing from an address of its own
    /// (`testbed::peer_source`); flows spread over them.
    pub peers: usize,
    /// Client: the index of the first of them (`testbed::peer_source`).
    pub first_peer: usize,
    /// Server: `Config::max_sessions` (`None`: the engine's default).
    pub max_sessions: Option<usize>,
    /// `Config::max_peer_buffered` (`None`: the engine's default).
    pub max_peer_buffered: Option<u64>,
    /// `Config::max_channels` (`None`: the engine's default); at least `channels`.
    pub max_channels: Option<usize>,
    /// `Config::session_shards` (`None`: the engine's default).
    pub shards: Option<usize>,
    /// `Config::app_demotion`.
    pub app_demotion: AppDemotionArg,
}

/// `Config::app_demotion` on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum AppDemotionArg {
    /// For each call that does throughput-class channel work.
    PerCall,
    /// From a thread's first throughput-class call until it does latency-class work (the
    /// engine's default).
    #[default]
    Sticky,
    /// Never: only the workers are demoted.
    Off,
}

impl AppDemotionArg {
    pub fn name(self) -> &'static str {
        match self {
            AppDemotionArg::PerCall => "per-call",
            AppDemotionArg::Sticky => "sticky",
            AppDemotionArg::Off => "off",
        }
    }
}

/// `Config::throughput_policy` on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DemoteTo {
    /// SCHED_IDLE.
    Idle,
    /// SCHED_OTHER at nice 19.
    Nice19,
}

impl DemoteTo {
    pub fn name(self) -> &'static str {
        match self {
            DemoteTo::Idle => "idle",
            DemoteTo::Nice19 => "nice19",
        }
    }
}

/// `netchannel::Isolation` on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum IsolationOpt {
    Auto,
    Always,
    Never,
}

impl IsolationOpt {
    pub fn name(self) -> &'static str {
        match self {
            IsolationOpt::Auto => "auto",
            IsolationOpt::Always => "always",
            IsolationOpt::Never => "never",
        }
    }
}

fn engine(bind: SocketAddr, opts: EngineOpts) -> io::Result<Engine> {
    engine_with(Config::new(bind), opts)
}

fn engine_with(mut config: Config, opts: EngineOpts) -> io::Result<Engine> {
    if let Some(n) = opts.max_sessions {
        config.max_sessions = n;
    }
    if let Some(n) = opts.max_peer_buffered {
        config.max_peer_buffered = n;
    }
    config.channels = opts.channels;
    config.max_channels = opts.max_channels.unwrap_or(config.max_channels).max(opts.channels);
    if let Some(n) = opts.shards {
        config.session_shards = n;
    }
    config.app_demotion = match opts.app_demotion {
        AppDemotionArg::PerCall => netchannel::AppDemotion::PerCall,
        AppDemotionArg::Sticky => netchannel::AppDemotion::Sticky,
        AppDemotionArg::Off => netchannel::AppDemotion::Off,
    };
    config.policy = opts.policy;
    config.max_streams = 1 << 21;
    if opts.host_congestion {
        config.congestion.clear();
    }
    config.throughput_policy = match opts.demote_to {
        DemoteTo::Idle => netchannel::ThreadPolicy::Idle,
        DemoteTo::Nice19 => netchannel::ThreadPolicy::Nice(19),
    };
    if opts.latency_nice != 0 {
        config.latency_policy = netchannel::ThreadPolicy::Nice(opts.latency_nice);
    }
    config.isolation = match opts.isolation {
        IsolationOpt::Auto => netchannel::Isolation::Auto,
        IsolationOpt::Always => netchannel::Isolation::Always,
        IsolationOpt::Never => netchannel::Isolation::Never,
    };
    Engine::new(config)
}

/// The server side of either stack.
pub enum Server {
    Tcp(TcpListener),
    Virtual(Engine, netchannel::Listener),
}

impl Server {
    pub fn bind(stack: Stack, addr: SocketAddr, opts: EngineOpts) -> io::Result<Server> {
        Ok(match stack {
            Stack::Linux => Server::Tcp(TcpListener::bind(addr)?),
            Stack::Netchannel => {
                let e = engine(addr, opts)?;
                let l = e.listen(VPORT)?;
                Server::Virtual(e, l)
            }
            other => return Err(mux_here(other)),
        })
    }

    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        match self {
            Server::Tcp(l) => l.local_addr(),
            Server::Virtual(e, _) => Ok(e.local_addr()),
        }
    }

    /// Accepts a flow and reads its header (blocking), leaving the connection non-blocking.
    pub fn accept(&self) -> io::Result<(Conn, FlowHeader)> {
        let mut conn = match self {
            Server::Tcp(l) => {
                let (s, _) = l.accept()?;
                s.set_nodelay(true)?;
                s.set_read_timeout(Some(Duration::from_secs(10)))?;
                Conn::Tcp(s)
            }
            Server::Virtual(_, l) => {
                let s = l.accept()?;
                s.set_read_timeout(Some(Duration::from_secs(10)))?;
                Conn::Virtual(s)
            }
        };
        let mut h = [0u8; FlowHeader::LEN];
        conn.read_exact_blocking(&mut h)?;
        let header = FlowHeader::decode(&h)?;
        conn.set_nonblocking()?;
        Ok((conn, header))
    }
}

/// The client side of either stack.
pub enum Client {
    Tcp,
    /// One engine per peer (`EngineOpts::peers`); flows take them in turn.
    Virtual(Vec<PeerEngine>, AtomicUsize),
}

/// A client engine, and how long its first connect took: the new peer's channel handshake
/// and the stream's open.
pub struct PeerEngine {
    engine: Engine,
    first_connect_us: OnceLock<u64>,
}

impl Client {
    pub fn new(stack: Stack, server: SocketAddr, opts: EngineOpts) -> io::Result<Client> {
        Ok(match stack {
            Stack::Linux => Client::Tcp,
            Stack::Netchannel => {
                let any: SocketAddr = if server.is_ipv6() {
                    "[::]:0".parse().expect("valid")
                } else {
                    "0.0.0.0:0".parse().expect("valid")
                };
                let mut engines = Vec::with_capacity(opts.peers.max(1));
                for i in 0..opts.peers.max(1) {
                    let mut config = Config::new(any);
                    if opts.peers > 1 {
                        let index = opts.first_peer + i;
                        config.dial_source = Some(crate::testbed::peer_source(server.ip(), index));
                        // One control endpoint per process is plenty. (Thousands of hosts
                        // arriving at once meet a busy acceptor, and dial again for the
                        // default `busy_dial_timeout`.)
                        config.control = i == 0;
                    }
                    let engine = engine_with(config, opts).map_err(|e| {
                        io::Error::new(e.kind(), format!("starting client engine {i}: {e}"))
                    })?;
                    engines.push(PeerEngine { engine, first_connect_us: OnceLock::new() });
                }
                Client::Virtual(engines, AtomicUsize::new(0))
            }
            other => return Err(mux_here(other)),
        })
    }

    /// Opens a flow and sends its header; the connection is returned non-blocking.
    pub fn connect(
        &self,
        server: SocketAddr,
        header: FlowHeader,
        class: Class,
    ) -> io::Result<Conn> {
        let mut conn = match self {
            Client::Tcp => {
                let s = TcpStream::connect_timeout(&server, Duration::from_secs(5))?;
                s.set_nodelay(true)?;
                Conn::Tcp(s)
            }
            Client::Virtual(engines, next) => {
                let i = next.fetch_add(1, Ordering::Relaxed) % engines.len();
                let peer = &engines[i];
                let started = Instant::now();
                let sock = peer.engine.connect_with_class(server, VPORT, class)?;
                let _ = peer.first_connect_us.set(started.elapsed().as_micros() as u64);
                Conn::Virtual(sock)
            }
        };
        conn.write_all_blocking(&header.encode())?;
        conn.set_nonblocking()?;
        Ok(conn)
    }

    /// netchannel: each engine's first connect (us): a new peer's time to its first byte.
    pub fn new_peer_connects_us(&self) -> Vec<u64> {
        match self {
            Client::Virtual(engines, _) => {
                engines.iter().filter_map(|p| p.first_connect_us.get().copied()).collect()
            }
            Client::Tcp => Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flow_header_round_trip_and_validation() {
        let h = FlowHeader { echo: true, latency: false, receiver_app: 7, size: 4096 };
        assert_eq!(FlowHeader::decode(&h.encode()).unwrap(), h);
        let l = FlowHeader { latency: true, ..h };
        assert_eq!(FlowHeader::decode(&l.encode()).unwrap(), l);
        let mut bad = h.encode();
        bad[0] = 9;
        assert!(FlowHeader::decode(&bad).is_err());
        let zero = FlowHeader { size: 0, ..h }.encode();
        assert!(FlowHeader::decode(&zero).is_err());
    }
}
