//! What runs inside the client and server processes: the traffic pattern as application threads
//! ("apps"), each an event loop over its flows.
//!
//! Client flows either stream (`--size`-byte writes as fast as possible) or ping-pong (`--size`
//! requests answered by `--size` responses, closed loop or open loop at `--rate`). The server
//! learns from each flow's header whether to sink or echo it and which receiver app serves it.

use std::collections::VecDeque;
use std::io::{self, BufRead, Write};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::{Condvar, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};

use crate::metrics::{histogram_to_pairs, new_histogram};
use crate::net::{Client, Conn, EngineOpts, FlowHeader, Server, Stack, Waiter};
use netchannel::Class;

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Workload {
    Stream,
    Rr,
    Mixed,
    /// Flows opened and left idle: what a connection costs in memory when it holds no bytes.
    Idle,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Pattern {
    Single,
    OneToOne,
    Incast,
    Outcast,
    AllToAll,
}

impl Workload {
    pub fn name(self) -> &'static str {
        match self {
            Workload::Stream => "stream",
            Workload::Rr => "rr",
            Workload::Mixed => "mixed",
            Workload::Idle => "idle",
        }
    }
}

impl Pattern {
    pub fn name(self) -> &'static str {
        match self {
            Pattern::Single => "single",
            Pattern::OneToOne => "one-to-one",
            Pattern::Incast => "incast",
            Pattern::Outcast => "outcast",
            Pattern::AllToAll => "all-to-all",
        }
    }
}

/// Message size of the latency flows of the mixed workload (the studies' short RPCs).
pub const LATENCY_RPC: u32 = 4096;

#[derive(Debug, Clone, Copy)]
pub struct FlowSpec {
    pub echo: bool,
    pub size: u32,
    pub sender_app: u32,
    pub receiver_app: u16,
    pub latency: bool,
}

#[derive(Debug, Clone)]
pub struct Plan {
    pub flows: Vec<FlowSpec>,
    pub sender_apps: usize,
}

/// Maps a workload and pattern onto flows and application threads. Apps are capped at
/// `max_apps` per side; flows are spread over them round-robin.
pub fn plan(
    workload: Workload,
    pattern: Pattern,
    flows: u64,
    size: u32,
    mixed: (u64, u64),
    max_apps: usize,
) -> Result<Plan, String> {
    if max_apps == 0 {
        return Err("--max-apps must be at least 1".into());
    }
    if workload == Workload::Mixed {
        let (l, t) = mixed;
        if l + t == 0 {
            return Err(
                "the mixed workload needs --latency-flows or --throughput-flows >= 1".into()
            );
        }
        // One L-app on each side (app 0, when there are L flows), T flows over their own
        // T-apps (either set may be empty: a side's L-apps or T-apps alone).
        let first_t = usize::from(l > 0);
        let t_apps = (t as usize).min(max_apps.saturating_sub(first_t).max(1));
        let mut v = Vec::with_capacity((l + t) as usize);
        for _ in 0..l {
            v.push(FlowSpec {
                echo: true,
                size: LATENCY_RPC,
                sender_app: 0,
                receiver_app: 0,
                latency: true,
            });
        }
        for i in 0..t as usize {
            let app = first_t + i % t_apps;
            v.push(FlowSpec {
                echo: false,
                size,
                sender_app: app as u32,
                receiver_app: app as u16,
                latency: false,
            });
        }
        return Ok(Plan { flows: v, sender_apps: (first_t + t_apps).max(1) });
    }
    if flows == 0 {
        return Err("--flows must be at least 1".into());
    }
    if pattern == Pattern::Single && flows != 1 {
        return Err(format!("the single pattern is one flow; got --flows {flows}"));
    }
    let n = flows as usize;
    let cap = |x: usize| x.clamp(1, max_apps);
    let (senders, receivers) = match pattern {
        Pattern::Single => (1, 1),
        Pattern::OneToOne => (cap(n), cap(n)),
        Pattern::Incast => (cap(n), 1),
        Pattern::Outcast => (1, cap(n)),
        Pattern::AllToAll => {
            let side = cap((n as f64).sqrt().ceil() as usize);
            (side, side)
        }
    };
    let echo = workload == Workload::Rr;
    let flows = (0..n)
        .map(|i| {
            let s = i % senders;
            let r = match pattern {
                Pattern::AllToAll => (i / senders) % receivers,
                Pattern::OneToOne => s,
                _ => i % receivers,
            };
            FlowSpec { echo, size, sender_app: s as u32, receiver_app: r as u16, latency: false }
        })
        .collect();
    Ok(Plan { flows, sender_apps: senders })
}

/// The measurement window, shared by every app of a process.
#[derive(Clone, Copy)]
pub struct Window {
    pub start: Instant,
    pub end: Instant,
}

impl Window {
    pub fn contains(&self, t: Instant) -> bool {
        t >= self.start && t < self.end
    }

    /// A window starting at a wall-clock time (ns since the epoch), as sent by the orchestrator.
    pub fn from_unix(start_ns: u64, duration_ns: u64) -> Window {
        let now_unix =
            SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
        let now = Instant::now();
        let start = if start_ns >= now_unix {
            now + Duration::from_nanos(start_ns - now_unix)
        } else {
            now.checked_sub(Duration::from_nanos(now_unix - start_ns)).unwrap_or(now)
        };
        Window { start, end: start + Duration::from_nanos(duration_ns) }
    }
}

pub fn unix_ns_after(d: Duration) -> u64 {
    (SystemTime::now() + d).duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
}

/// Starts all apps at once, with the window every one of them measures.
#[derive(Default)]
struct Gate {
    window: Mutex<Option<Window>>,
    opened: Condvar,
}

impl Gate {
    fn open(&self, w: Window) {
        *self.window.lock() = Some(w);
        self.opened.notify_all();
    }

    fn wait(&self) -> Window {
        let mut g = self.window.lock();
        loop {
            if let Some(w) = *g {
                return w;
            }
            self.opened.wait(&mut g);
        }
    }
}

/// Cumulative counters of one app; the meter snapshots them at the window's edges.
#[derive(Default)]
pub struct Counters {
    pub bytes: AtomicU64,
    pub rpcs: AtomicU64,
}

/// Sum of counters at a moment.
pub fn snapshot(counters: &[Arc<Counters>]) -> (u64, u64) {
    counters.iter().fold((0, 0), |(b, r), c| {
        (b + c.bytes.load(Ordering::Relaxed), r + c.rpcs.load(Ordering::Relaxed))
    })
}

/// Sleeps until `t`.
pub fn sleep_until(t: Instant) {
    let now = Instant::now();
    if t > now {
        std::thread::sleep(t - now);
    }
}

/// What a client process reports.
#[derive(Debug, Default, Serialize, Deserialize)]
pub struct ClientReport {
    pub bytes: u64,
    pub rpcs: u64,
    pub latency_hist: Vec<(u64, u64)>,
    pub flows: u64,
    /// Resident memory before the flows were opened and at the start of the window (bytes).
    #[serde(default)]
    pub rss_before: u64,
    #[serde(default)]
    pub rss_window: u64,
    /// Multiplexer stacks: how long the first connection took to be usable (TCP connect, plus
    /// writing the HTTP/2 preface or the QUIC+TLS handshake), alone, before any other (us).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_connect_us: Option<u64>,
    /// Multiplexer stacks: from the start of the process until every flow was open (us).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub open_us: Option<u64>,
    /// netchannel: the first connect of each client engine (a new peer of the server), us.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub new_peer_connect_us: Vec<u64>,
}

/// What a server process reports: bytes its sink flows received in the window.
#[derive(Debug, Default, Serialize, Deserialize)]
pub struct ServerReport {
    pub sink_bytes: u64,
    pub flows: u64,
    #[serde(default)]
    pub rss_before: u64,
    #[serde(default)]
    pub rss_window: u64,
    /// Open file descriptors before any flow and at the start of the window.
    #[serde(default)]
    pub fds_before: u64,
    #[serde(default)]
    pub fds_window: u64,
    /// quinn: generating the self-signed certificate and its TLS server config at start (us).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cert_gen_us: Option<u64>,
    /// quinn: UDP segments per send (GSO) and per receive (GRO) the kernel offers quinn-udp
    /// on the server's address; 1 when it offers none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub udp_offload: Option<(usize, usize)>,
}

/// This process's open file descriptors.
pub fn open_fds() -> u64 {
    std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count() as u64)
}

/// This process's resident memory in bytes (VmRSS of /proc/self/status).
pub fn rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            let line = s.lines().find(|l| l.starts_with("VmRSS:"))?;
            line.split_whitespace().nth(1)?.parse::<u64>().ok()
        })
        .map_or(0, |kb| kb * 1024)
}

pub struct ClientArgs {
    pub stack: Stack,
    pub server: SocketAddr,
    pub engine: EngineOpts,
    pub plan: Plan,
    pub rate: Option<f64>,
    /// Open the flows and leave them idle.
    pub idle: bool,
    /// Multiplexer stacks: connections per connection group (`mux.rs`).
    pub mux_connections: usize,
    /// quinn: the server's certificate (DER), the only one the client trusts.
    pub server_cert: Option<Vec<u8>>,
}

struct ClientFlow {
    conn: Conn,
    spec: FlowSpec,
    /// Stream: position within the current write. RR: request bytes still to write.
    out: u64,
    /// RR: response bytes received toward the current response.
    got: u64,
    /// RR: when each outstanding request was (scheduled to be) sent.
    sent_at: VecDeque<Instant>,
    next_send: Instant,
    closed: bool,
    token: u64,
    /// Write interest registered (kernel sockets start without it for RR flows).
    write_interest: bool,
}

pub const IO_BUF: usize = 256 * 1024;
/// Bytes one flow may move per turn of its event loop. A flow that still could go on is
/// served again next turn without waiting: a stack that never says `WouldBlock` (small writes
/// coalesce) must not keep the loop from seeing the end of the window or its other flows.
pub const TURN_BUDGET: u64 = 1 << 20;

impl ClientFlow {
    /// Serves the flow until it would block or its turn is used up; true if it could go on.
    fn service(&mut self, cx: &mut AppCtx<'_>) -> bool {
        if self.closed {
            return false;
        }
        let mut moved = 0u64;
        let size = self.spec.size as u64;
        if self.spec.echo {
            loop {
                if moved >= TURN_BUDGET {
                    return true;
                }
                match self.conn.read(&mut cx.rbuf) {
                    Ok(0) => {
                        self.closed = true;
                        return false;
                    }
                    Ok(n) => {
                        moved += n as u64;
                        cx.counters.bytes.fetch_add(n as u64, Ordering::Relaxed);
                        self.got += n as u64;
                        while self.got >= size {
                            self.got -= size;
                            let now = Instant::now();
                            if let Some(t0) = self.sent_at.pop_front() {
                                if cx.window.contains(now) {
                                    let us = now.saturating_duration_since(t0).as_micros() as u64;
                                    cx.hist.saturating_record(us.max(1));
                                    cx.counters.rpcs.fetch_add(1, Ordering::Relaxed);
                                }
                            }
                            if cx.closed_loop {
                                self.sent_at.push_back(now);
                                self.out += size;
                            }
                        }
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(_) => {
                        self.closed = true;
                        return false;
                    }
                }
            }
            while self.out > 0 {
                let n = (self.out as usize).min(cx.wbuf.len());
                match self.conn.write(&cx.wbuf[..n]) {
                    Ok(n) => {
                        cx.counters.bytes.fetch_add(n as u64, Ordering::Relaxed);
                        self.out -= n as u64;
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        if !self.write_interest {
                            self.write_interest = true;
                            if cx.waiter.want_writable(&self.conn, self.token).is_err() {
                                self.closed = true;
                                return false;
                            }
                            continue; // writable again before the interest took effect?
                        }
                        break;
                    }
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(_) => {
                        self.closed = true;
                        return false;
                    }
                }
            }
            false
        } else {
            loop {
                if moved >= TURN_BUDGET {
                    return true;
                }
                let from = self.out as usize;
                match self.conn.write(&cx.wbuf[from..size as usize]) {
                    Ok(n) => {
                        moved += n as u64;
                        cx.counters.bytes.fetch_add(n as u64, Ordering::Relaxed);
                        self.out = (self.out + n as u64) % size;
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => return false,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(_) => {
                        self.closed = true;
                        return false;
                    }
                }
            }
        }
    }
}

/// What a client app's flows share while being served.
struct AppCtx<'a> {
    waiter: &'a Waiter,
    wbuf: Vec<u8>,
    rbuf: Vec<u8>,
    counters: &'a Counters,
    hist: Histogram<u64>,
    window: Window,
    closed_loop: bool,
}

/// Runs one client app until the window ends. Returns its latency histogram.
fn client_app(
    mut flows: Vec<ClientFlow>,
    waiter: Waiter,
    counters: Arc<Counters>,
    gate: Arc<Gate>,
    rate: Option<f64>,
    idle: bool,
) -> Histogram<u64> {
    let max_size = flows.iter().map(|f| f.spec.size as usize).max().unwrap_or(1);
    let window = gate.wait();
    if idle {
        sleep_until(window.end);
        drop(flows);
        return new_histogram();
    }
    let mut cx = AppCtx {
        waiter: &waiter,
        wbuf: vec![0x6Eu8; max_size.max(IO_BUF)],
        rbuf: vec![0u8; IO_BUF],
        counters: &counters,
        hist: new_histogram(),
        window,
        closed_loop: rate.is_none(),
    };
    let interval = rate.map(|r| Duration::from_secs_f64(1.0 / r));
    let now = Instant::now();
    let n = flows.len().max(1) as u32;
    let mut hot: Vec<usize> = Vec::new();
    for (i, f) in flows.iter_mut().enumerate() {
        if f.spec.echo {
            match interval {
                // Spread first sends over one interval so flows do not fire in lockstep.
                Some(iv) => f.next_send = now + iv * i as u32 / n,
                None => {
                    f.sent_at.push_back(now);
                    f.out = f.spec.size as u64;
                }
            }
        }
        if f.service(&mut cx) {
            hot.push(i);
        }
    }
    let mut tokens = Vec::new();
    let mut again = Vec::new();
    loop {
        let now = Instant::now();
        if now >= window.end {
            break;
        }
        let mut timeout = (window.end - now).min(Duration::from_millis(100));
        if !hot.is_empty() {
            timeout = Duration::ZERO; // flows that could go on are served without waiting
        }
        if let Some(iv) = interval {
            for (i, f) in flows.iter_mut().enumerate().filter(|(_, f)| f.spec.echo && !f.closed) {
                let mut due = false;
                while f.next_send <= now {
                    f.sent_at.push_back(f.next_send);
                    f.out += f.spec.size as u64;
                    f.next_send += iv;
                    due = true;
                }
                if due && f.service(&mut cx) {
                    hot.push(i);
                }
                timeout = timeout.min(f.next_send.saturating_duration_since(now));
            }
        }
        if waiter.wait(&mut tokens, timeout).is_err() {
            break;
        }
        again.clear();
        again.append(&mut hot);
        again.extend(tokens.iter().map(|&t| t as usize));
        for &i in &again {
            if let Some(f) = flows.get_mut(i) {
                if f.service(&mut cx) && !hot.contains(&i) {
                    hot.push(i);
                }
            }
        }
    }
    cx.hist
}

/// The client process: connects every flow, reports "connected", waits for the window (from
/// `window`), runs it, and returns the measured counters.
pub fn run_client(
    args: ClientArgs,
    window: impl FnOnce() -> io::Result<Window>,
) -> io::Result<ClientReport> {
    if args.stack.is_mux() {
        return crate::mux::run_client(args, window);
    }
    let client = Arc::new(Client::new(args.stack, args.server, args.engine)?);
    let rss_before = rss_bytes();
    let gate = Arc::new(Gate::default());
    let mut per_app: Vec<Vec<FlowSpec>> = vec![Vec::new(); args.plan.sender_apps];
    for f in &args.plan.flows {
        per_app[f.sender_app as usize].push(*f);
    }
    let failed = Arc::new(AtomicBool::new(false));
    let mut handles = Vec::new();
    let mut counters = Vec::new();
    let (ready_tx, ready_rx) = std::sync::mpsc::channel::<io::Result<()>>();
    for specs in per_app {
        let c = Arc::new(Counters::default());
        counters.push(c.clone());
        let (client, gate, ready, failed) =
            (client.clone(), gate.clone(), ready_tx.clone(), failed.clone());
        let (stack, server, rate, idle) = (args.stack, args.server, args.rate, args.idle);
        // Named by class, so that traces (perf sched, ps) tell L-apps from T-apps.
        let name = if specs.iter().any(|f| f.latency) { "ncperf-lat-app" } else { "ncperf-app" };
        let spawn = std::thread::Builder::new().name(name.into());
        handles.push(spawn.spawn(move || {
            let setup = || -> io::Result<(Vec<ClientFlow>, Waiter)> {
                let waiter = Waiter::new(stack)?;
                let mut flows = Vec::with_capacity(specs.len());
                for (token, spec) in specs.into_iter().enumerate() {
                    if failed.load(Ordering::Relaxed) {
                        return Err(io::Error::other("another app failed to connect"));
                    }
                    let header = FlowHeader {
                        echo: spec.echo,
                        latency: spec.latency,
                        receiver_app: spec.receiver_app,
                        size: spec.size,
                    };
                    let class = if spec.latency { Class::Latency } else { Class::Throughput };
                    let conn = client.connect(server, header, class)?;
                    waiter.register(&conn, token as u64, !spec.echo)?;
                    flows.push(ClientFlow {
                        conn,
                        spec,
                        out: 0,
                        got: 0,
                        sent_at: VecDeque::new(),
                        next_send: Instant::now(),
                        closed: false,
                        token: token as u64,
                        write_interest: !spec.echo,
                    });
                }
                Ok((flows, waiter))
            };
            match setup() {
                Ok((flows, waiter)) => {
                    let _ = ready.send(Ok(()));
                    Some(client_app(flows, waiter, c, gate, rate, idle))
                }
                Err(e) => {
                    failed.store(true, Ordering::Relaxed);
                    let _ = ready.send(Err(e));
                    None
                }
            }
        })?);
    }
    drop(ready_tx);
    let mut first_error = None;
    for _ in 0..handles.len() {
        match ready_rx.recv() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                first_error.get_or_insert(e);
            }
            Err(_) => {
                first_error.get_or_insert(io::Error::other("an app thread died during set-up"));
            }
        }
    }
    if let Some(e) = first_error {
        return Err(io::Error::new(e.kind(), format!("connecting flows: {e}")));
    }
    let w = window()?;
    gate.open(w);
    sleep_until(w.start);
    let rss_window = rss_bytes();
    let (b0, r0) = snapshot(&counters);
    sleep_until(w.end);
    let (b1, r1) = snapshot(&counters);
    let mut hist = new_histogram();
    for h in handles {
        if let Ok(Some(app_hist)) = h.join() {
            hist.add(app_hist).map_err(|e| io::Error::other(format!("histogram: {e}")))?;
        }
    }
    Ok(ClientReport {
        bytes: b1 - b0,
        rpcs: r1 - r0,
        latency_hist: histogram_to_pairs(&hist),
        flows: args.plan.flows.len() as u64,
        rss_before,
        rss_window,
        first_connect_us: None,
        open_us: None,
        new_peer_connect_us: client.new_peer_connects_us(),
    })
}

struct ServerFlow {
    conn: Conn,
    header: FlowHeader,
    got: u64,
    out: u64,
    token: u64,
    write_interest: bool,
}

/// One receiver app: its flows arrive through `inbox` from the accept thread.
struct ReceiverApp {
    waiter: Waiter,
    inbox: Mutex<Vec<(u64, ServerFlow)>>,
    next_token: AtomicU64,
    counters: Arc<Counters>,
}

fn receiver_loop(app: Arc<ReceiverApp>, stop: Arc<AtomicBool>) {
    let mut flows: Vec<Option<ServerFlow>> = Vec::new();
    let mut tokens = Vec::new();
    let mut hot: Vec<u64> = Vec::new();
    let mut buf = vec![0u8; IO_BUF];
    let wbuf = vec![0x5Au8; IO_BUF];
    while !stop.load(Ordering::Relaxed) {
        let timeout = if hot.is_empty() { Duration::from_millis(100) } else { Duration::ZERO };
        if app.waiter.wait(&mut tokens, timeout).is_err() {
            return;
        }
        tokens.append(&mut hot);
        for (t, f) in app.inbox.lock().drain(..) {
            let t = t as usize;
            if flows.len() <= t {
                flows.resize_with(t + 1, || None);
            }
            flows[t] = Some(f);
        }
        for &t in &tokens {
            let Some(slot) = flows.get_mut(t as usize) else {
                continue;
            };
            let Some(f) = slot.as_mut() else { continue };
            match serve_flow(f, &app.waiter, &mut buf, &wbuf, &app.counters) {
                Served::Closed => *slot = None, // dropping it closes the connection
                Served::More if !hot.contains(&t) => hot.push(t),
                _ => {}
            }
        }
    }
}

enum Served {
    Blocked,
    /// The turn's budget ran out with work left: serve it again without waiting.
    More,
    Closed,
}

/// Serves one flow until it would block or its turn is used up.
fn serve_flow(
    f: &mut ServerFlow,
    waiter: &Waiter,
    buf: &mut [u8],
    wbuf: &[u8],
    counters: &Counters,
) -> Served {
    let size = f.header.size as u64;
    let mut moved = 0u64;
    loop {
        if moved >= TURN_BUDGET {
            return Served::More;
        }
        match f.conn.read(buf) {
            Ok(0) => return Served::Closed,
            Ok(n) => {
                moved += n as u64;
                if f.header.echo {
                    f.got += n as u64;
                    f.out += (f.got / size) * size;
                    f.got %= size;
                } else {
                    counters.bytes.fetch_add(n as u64, Ordering::Relaxed);
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return Served::Closed,
        }
    }
    while f.out > 0 {
        let n = (f.out as usize).min(wbuf.len());
        match f.conn.write(&wbuf[..n]) {
            Ok(n) => f.out -= n as u64,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                if !f.write_interest {
                    f.write_interest = true;
                    if waiter.want_writable(&f.conn, f.token).is_err() {
                        return Served::Closed;
                    }
                    continue;
                }
                break;
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return Served::Closed,
        }
    }
    Served::Blocked
}

/// The server process. Prints `ready ADDR`; with `coordinated`, then reads `go START_NS DUR_NS`
/// from stdin, measures that window and prints its report as JSON when stdin closes. Without
/// it, serves until killed and prints received goodput every second on stderr.
pub fn run_server(
    stack: Stack,
    listen: SocketAddr,
    engine: EngineOpts,
    coordinated: bool,
) -> io::Result<()> {
    let server = Arc::new(Server::bind(stack, listen, engine)?);
    let (rss_before, fds_before) = (rss_bytes(), open_fds());
    println!("ready {}", server.local_addr()?);
    io::stdout().flush()?;
    let apps: Arc<Mutex<Vec<Arc<ReceiverApp>>>> = Arc::new(Mutex::new(Vec::new()));
    let stop = Arc::new(AtomicBool::new(false));
    let accepted = Arc::new(AtomicU64::new(0));
    {
        let (server, apps, stop, accepted) =
            (server.clone(), apps.clone(), stop.clone(), accepted.clone());
        std::thread::spawn(move || loop {
            let (conn, header) = match server.accept() {
                Ok(x) => x,
                Err(e)
                    if e.kind() == io::ErrorKind::InvalidData
                        || e.kind() == io::ErrorKind::WouldBlock =>
                {
                    continue; // a stray or silent connection: drop it, keep serving
                }
                Err(e) if e.kind() == io::ErrorKind::ConnectionAborted => return,
                Err(_) => continue,
            };
            accepted.fetch_add(1, Ordering::Relaxed);
            let app = {
                let mut apps = apps.lock();
                let want = header.receiver_app as usize + 1;
                while apps.len() < want {
                    let Ok(waiter) = Waiter::new(stack) else {
                        return;
                    };
                    let app = Arc::new(ReceiverApp {
                        waiter,
                        inbox: Mutex::new(Vec::new()),
                        next_token: AtomicU64::new(0),
                        counters: Arc::new(Counters::default()),
                    });
                    let (a, s) = (app.clone(), stop.clone());
                    let name = format!("ncperf-rx{}", apps.len());
                    let spawned =
                        std::thread::Builder::new().name(name).spawn(move || receiver_loop(a, s));
                    if spawned.is_err() {
                        return;
                    }
                    apps.push(app);
                }
                apps[header.receiver_app as usize].clone()
            };
            let token = app.next_token.fetch_add(1, Ordering::Relaxed);
            let flow = ServerFlow { conn, header, got: 0, out: 0, token, write_interest: false };
            // Registered under the inbox lock right after queuing: the app takes that lock
            // before it looks up a token, so it always finds the flow its token names.
            let mut inbox = app.inbox.lock();
            inbox.push((token, flow));
            let (_, f) = inbox.last().expect("just pushed");
            let _ = app.waiter.register(&f.conn, token, false);
        });
    }
    let counters =
        || -> Vec<Arc<Counters>> { apps.lock().iter().map(|a| a.counters.clone()).collect() };
    let setup = ServerSetup { fds_before, ..ServerSetup::default() };
    let served = serve_window(rss_before, counters, &accepted, coordinated, setup);
    stop.store(true, Ordering::Relaxed);
    served
}

/// What a multiplexer server measured at start (`ServerReport`'s fields of the same names).
#[derive(Debug, Default, Clone, Copy)]
pub struct ServerSetup {
    pub cert_gen_us: Option<u64>,
    pub udp_offload: Option<(usize, usize)>,
    pub fds_before: u64,
}

/// The server's side of the orchestrator's protocol, shared by every stack: with `coordinated`,
/// reads `go START_NS DUR_NS` from stdin, snapshots the sink counters at the window's edges and
/// prints its report as JSON when stdin closes (the clients are done). Without it, prints the
/// received goodput every second until killed.
pub fn serve_window(
    rss_before: u64,
    counters: impl Fn() -> Vec<Arc<Counters>>,
    accepted: &AtomicU64,
    coordinated: bool,
    setup: ServerSetup,
) -> io::Result<()> {
    if !coordinated {
        let mut last = (Instant::now(), 0u64);
        loop {
            std::thread::sleep(Duration::from_secs(1));
            let (b, _) = snapshot(&counters());
            let now = Instant::now();
            let g = crate::metrics::gbps(b - last.1, (now - last.0).as_secs_f64());
            eprintln!(
                "received {g:.2} Gbit/s, {} flows accepted",
                accepted.load(Ordering::Relaxed)
            );
            last = (now, b);
        }
    }
    let stdin = io::stdin();
    let mut lines = stdin.lock().lines();
    let window = loop {
        match lines.next() {
            Some(Ok(line)) => {
                if let Some(w) = parse_go(&line) {
                    break w;
                }
            }
            _ => return Err(io::Error::other("stdin closed before the go line")),
        }
    };
    sleep_until(window.start);
    let (rss_window, fds_window) = (rss_bytes(), open_fds());
    let (b0, _) = snapshot(&counters());
    sleep_until(window.end);
    let (b1, _) = snapshot(&counters());
    // Wait for the orchestrator to close stdin (the clients are done), then report.
    for _ in lines.by_ref() {}
    let report = ServerReport {
        sink_bytes: b1 - b0,
        flows: accepted.load(Ordering::Relaxed),
        rss_before,
        rss_window,
        fds_before: setup.fds_before,
        fds_window,
        cert_gen_us: setup.cert_gen_us,
        udp_offload: setup.udp_offload,
    };
    println!("{}", serde_json::to_string(&report).map_err(io::Error::other)?);
    io::stdout().flush()
}

/// Parses `go START_NS DURATION_NS`.
pub fn parse_go(line: &str) -> Option<Window> {
    let mut it = line.split_whitespace();
    if it.next()? != "go" {
        return None;
    }
    let start: u64 = it.next()?.parse().ok()?;
    let dur: u64 = it.next()?.parse().ok()?;
    Some(Window::from_unix(start, dur))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn apps_of(p: &Plan) -> (usize, usize) {
        let r = p.flows.iter().map(|f| f.receiver_app as usize).max().unwrap() + 1;
        (p.sender_apps, r)
    }

    #[test]
    fn patterns_map_flows_to_apps() {
        let p = plan(Workload::Stream, Pattern::Single, 1, 100, (0, 0), 8).unwrap();
        assert_eq!(apps_of(&p), (1, 1));
        assert!(plan(Workload::Stream, Pattern::Single, 2, 100, (0, 0), 8).is_err());
        let p = plan(Workload::Stream, Pattern::OneToOne, 64, 100, (0, 0), 8).unwrap();
        assert_eq!(apps_of(&p), (8, 8));
        assert!(p.flows.iter().all(|f| f.sender_app as u16 == f.receiver_app));
        let p = plan(Workload::Rr, Pattern::Incast, 64, 100, (0, 0), 8).unwrap();
        assert_eq!(apps_of(&p), (8, 1));
        assert!(p.flows.iter().all(|f| f.echo));
        let p = plan(Workload::Stream, Pattern::Outcast, 64, 100, (0, 0), 8).unwrap();
        assert_eq!(apps_of(&p), (1, 8));
        let p = plan(Workload::Stream, Pattern::AllToAll, 64, 100, (0, 0), 16).unwrap();
        assert_eq!(apps_of(&p), (8, 8));
        // Every sender talks to every receiver.
        let mut pairs: Vec<_> = p.flows.iter().map(|f| (f.sender_app, f.receiver_app)).collect();
        pairs.sort_unstable();
        pairs.dedup();
        assert_eq!(pairs.len(), 64);
    }

    #[test]
    fn mixed_puts_latency_flows_on_their_own_app() {
        let p = plan(Workload::Mixed, Pattern::OneToOne, 0, 65536, (1, 8), 16).unwrap();
        assert_eq!(p.flows.len(), 9);
        assert_eq!(p.sender_apps, 9);
        let l: Vec<_> = p.flows.iter().filter(|f| f.latency).collect();
        assert_eq!(l.len(), 1);
        assert!(l[0].echo && l[0].size == LATENCY_RPC && l[0].sender_app == 0);
        assert!(p.flows.iter().filter(|f| !f.latency).all(|f| f.sender_app != 0 && !f.echo));
        assert!(plan(Workload::Mixed, Pattern::OneToOne, 0, 1, (0, 0), 16).is_err());
        // Either side alone (the baselines of an isolation run, and split processes).
        let t = plan(Workload::Mixed, Pattern::OneToOne, 0, 65536, (0, 8), 16).unwrap();
        assert_eq!((t.flows.len(), t.sender_apps), (8, 8));
        assert!(t.flows.iter().all(|f| !f.latency && (f.sender_app as usize) < 8));
        let l = plan(Workload::Mixed, Pattern::OneToOne, 0, 65536, (1, 0), 16).unwrap();
        assert_eq!((l.flows.len(), l.sender_apps), (1, 1));
        assert!(l.flows[0].latency);
    }

    #[test]
    fn go_line_parses_into_a_window() {
        let start = unix_ns_after(Duration::from_millis(500));
        let w = parse_go(&format!("go {start} 2000000000")).unwrap();
        let d = w.start.saturating_duration_since(Instant::now());
        assert!(d > Duration::from_millis(300) && d <= Duration::from_millis(500), "{d:?}");
        assert_eq!(w.end - w.start, Duration::from_secs(2));
        assert!(parse_go("stop 1 2").is_none());
        assert!(parse_go("go x 2").is_none());
    }
}
