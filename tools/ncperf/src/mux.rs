//! The stream multiplexers a person would reach for in their own process before a host stack
//! (issue 20): yamux over kernel TCP, HTTP/2 (the h2 crate) over kernel TCP, and QUIC (quinn)
//! over UDP, each on tokio, running ncperf's workloads with its flow header, its measurement
//! window and its reports, so that `ncperf run` and `compare` account for them like the others.
//!
//! Runtime: one multi-thread tokio runtime per process, with as many workers as that side has
//! application threads in the plan (sender apps on the client, receiver apps on the server; one
//! for incast's server). Not a current_thread runtime per app thread, because quinn's server is
//! one endpoint, one UDP socket, whose driver and connection drivers are tasks spawned where the
//! endpoint runs: pinned to one app thread, that thread alone would serve every connection. The
//! multi-thread runtime is these crates' usual home, and sizing it like the apps keeps the
//! thread count of the linux and netchannel runs, so the CPU figures compare. What differs: a
//! flow is a task rather than a slot in an app's event loop, and tokio's scheduler, not the
//! kernel's, picks the worker that runs it, so the apps of a pattern group connections rather
//! than pin threads.
//!
//! Mapping: every (sender app, receiver app) pair of the plan is a connection group with
//! `--mux-connections` connections, over which its flows are spread round-robin, one stream per
//! flow. In the mixed workload the L and T flows form one group: latency streams share the
//! connections of the bulk streams, which is what a multiplexer is for (quinn gives them a
//! higher stream priority; yamux has no priorities, and the h2 crate does not implement
//! HTTP/2's). yamux and quinn streams begin with ncperf's 8-byte flow header; h2 carries it in
//! a request header, and the server answers every request at once with a streamed response.

use std::cell::RefCell;
use std::collections::{BTreeMap, VecDeque};
use std::future::poll_fn;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::task::Poll;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::io::{AsyncRead, AsyncReadExt, AsyncWriteExt, ReadHalf, WriteHalf};
use hdrhistogram::Histogram;
use parking_lot::Mutex;
use quinn::rustls::pki_types::{CertificateDer, PrivatePkcs8KeyDer};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot};
use tokio_util::compat::{Compat, TokioAsyncReadCompatExt};

use crate::apps::{
    rss_bytes, sleep_until, snapshot, ClientArgs, ClientReport, Counters, FlowSpec, Plan, Window,
    IO_BUF, TURN_BUDGET,
};
use crate::metrics::{histogram_to_pairs, new_histogram};
use crate::net::{FlowHeader, Stack};

/// The request header that carries ncperf's flow header over h2 (hex of its 8 bytes).
const H2_FLOW_HEADER: &str = "ncperf-flow";
/// The name in quinn's self-signed certificate and the one the client asks for.
const TLS_NAME: &str = "localhost";
/// HTTP/2 windows and send buffers as hyper sets them (its client: 5 MiB per connection, 2 MiB
/// per stream, 1 MiB send buffer; its server: 1 MiB, 1 MiB, 400 KiB): the h2 crate's own
/// defaults are the protocol's 64 KiB windows, which nobody serving bulk data keeps, and hyper
/// is how most Rust programs use h2.
const H2_CLIENT_CONN_WINDOW: u32 = 5 << 20;
const H2_CLIENT_STREAM_WINDOW: u32 = 2 << 20;
const H2_CLIENT_SEND_BUF: usize = 1 << 20;
const H2_SERVER_CONN_WINDOW: u32 = 1 << 20;
const H2_SERVER_STREAM_WINDOW: u32 = 1 << 20;
const H2_SERVER_SEND_BUF: usize = 400 << 10;
/// Stream priority of latency-class flows on quinn (others keep the default 0).
const QUINN_LATENCY_PRIORITY: i32 = 1;

/// Whether a client flow or connection of this process has failed yet.
static CLIENT_FAILED: AtomicBool = AtomicBool::new(false);

/// Says the first failure of a client's flows or connections on stderr. The server outlives
/// its clients, so any failure before the client is done is abnormal (a connection the server
/// closed, say), and a run that measured less than it should must say why.
fn client_failure(what: &str, e: impl std::fmt::Display) {
    if !CLIENT_FAILED.swap(true, Ordering::Relaxed) {
        eprintln!("ncperf client: {what} (others may follow): {e}");
    }
}

thread_local! {
    /// Where received bytes land before they are counted and dropped: one per worker thread,
    /// as the epoll apps have one per app, so a million streams do not each hold a buffer.
    static READ_BUF: RefCell<Vec<u8>> = RefCell::new(vec![0u8; IO_BUF]);
}

fn h2_err(e: h2::Error) -> io::Error {
    if e.is_io() {
        e.into_io().unwrap_or_else(|| io::Error::other("h2 I/O error"))
    } else {
        io::Error::other(format!("h2: {e}"))
    }
}

fn yamux_err(e: yamux::ConnectionError) -> io::Error {
    io::Error::other(format!("yamux: {e}"))
}

/// A yamux error that only says the peer went away (the client's process ended).
fn yamux_disconnect(e: &yamux::ConnectionError) -> bool {
    use yamux::{ConnectionError as C, FrameDecodeError as D};
    matches!(e, C::Io(_) | C::Closed | C::Decode(D::Io(_)))
}

fn closed(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::ConnectionAborted, format!("{what} closed"))
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

pub fn unhex(text: &str) -> Result<Vec<u8>, String> {
    let text = text.trim();
    if text.len() % 2 != 0 || !text.is_ascii() {
        return Err("not an even number of hex digits".into());
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&text[i..i + 2], 16).map_err(|e| format!("bad hex: {e}")))
        .collect()
}

/// The sending half of one flow's stream.
enum Tx {
    Yamux(WriteHalf<yamux::Stream>),
    Quinn(quinn::SendStream),
    H2(h2::SendStream<Bytes>),
}

impl Tx {
    /// Writes a prefix of `data[from..to]` (as much as the stream takes now, once it takes
    /// any) and returns its length.
    async fn send(&mut self, data: &Bytes, from: usize, to: usize) -> io::Result<usize> {
        match self {
            Tx::Yamux(w) => w.write(&data[from..to]).await,
            Tx::Quinn(w) => w.write(&data[from..to]).await.map_err(io::Error::from),
            Tx::H2(w) => {
                // h2 takes only what the peer's windows allow, in capacity granted ahead.
                let want = to - from;
                w.reserve_capacity(want);
                let cap = loop {
                    let c = w.capacity();
                    if c > 0 {
                        break c;
                    }
                    match poll_fn(|cx| w.poll_capacity(cx)).await {
                        Some(Ok(_)) => {}
                        Some(Err(e)) => return Err(h2_err(e)),
                        // Closed: by a reset or the connection's end, whose reason says why.
                        None => {
                            return Err(match poll_fn(|cx| w.poll_reset(cx)).await {
                                Ok(reason) => io::Error::new(
                                    io::ErrorKind::ConnectionReset,
                                    format!("h2 stream reset by the peer: {reason}"),
                                ),
                                Err(e) => h2_err(e),
                            })
                        }
                    }
                };
                let n = cap.min(want);
                w.send_data(data.slice(from..from + n), false).map_err(h2_err)?;
                Ok(n)
            }
        }
    }

    /// Writes all of `data[from..to]`, counting each part as it goes.
    async fn send_all(
        &mut self,
        data: &Bytes,
        mut from: usize,
        to: usize,
        counters: &Counters,
    ) -> io::Result<()> {
        while from < to {
            let n = self.send(data, from, to).await?;
            counters.bytes.fetch_add(n as u64, Ordering::Relaxed);
            from += n;
        }
        Ok(())
    }
}

/// The receiving half of one flow's stream.
enum Rx {
    Yamux(ReadHalf<yamux::Stream>),
    Quinn(quinn::RecvStream),
    /// h2 client: the response (and its body) arrives when the server answers the request.
    H2Response(h2::client::ResponseFuture),
    H2(h2::RecvStream),
}

impl Rx {
    /// Receives what is there (up to one buffer) and drops it; 0 at the end of the stream.
    async fn recv(&mut self) -> io::Result<usize> {
        loop {
            match self {
                Rx::Yamux(r) => {
                    return poll_fn(|cx| {
                        READ_BUF.with_borrow_mut(|b| Pin::new(&mut *r).poll_read(cx, b))
                    })
                    .await
                }
                Rx::Quinn(r) => {
                    return poll_fn(|cx| READ_BUF.with_borrow_mut(|b| r.poll_read(cx, b)))
                        .await
                        .map_err(io::Error::from)
                }
                Rx::H2Response(f) => {
                    let response = f.await.map_err(h2_err)?;
                    *self = Rx::H2(response.into_body());
                }
                Rx::H2(r) => match r.data().await {
                    Some(Ok(b)) => {
                        // Received bytes are "read" once counted: give their window back.
                        let n = b.len();
                        r.flow_control().release_capacity(n).map_err(h2_err)?;
                        if n > 0 {
                            return Ok(n);
                        }
                    }
                    Some(Err(e)) => return Err(h2_err(e)),
                    None => return Ok(0),
                },
            }
        }
    }

    /// The flow header at the start of a yamux or quinn stream.
    async fn read_header(&mut self) -> io::Result<FlowHeader> {
        let mut h = [0u8; FlowHeader::LEN];
        match self {
            Rx::Yamux(r) => r.read_exact(&mut h).await?,
            Rx::Quinn(r) => r.read_exact(&mut h).await.map_err(io::Error::other)?,
            Rx::H2Response(_) | Rx::H2(_) => {
                return Err(io::Error::other("h2 carries the flow header in the request"))
            }
        }
        FlowHeader::decode(&h)
    }
}

/// One multiplexed connection as the client holds it: what opens a stream on it.
enum MuxConn {
    /// Asks the task that owns and drives the yamux `Connection` for a new outbound stream.
    Yamux(mpsc::UnboundedSender<OpenRequest>),
    Quinn(quinn::Connection),
    H2(h2::client::SendRequest<Bytes>),
}

type OpenRequest = oneshot::Sender<yamux::Result<yamux::Stream>>;

impl MuxConn {
    /// Opens a stream for a flow and sends its header.
    async fn open(&self, header: FlowHeader) -> io::Result<(Tx, Rx)> {
        match self {
            MuxConn::Yamux(opener) => {
                let (tx, rx) = oneshot::channel();
                opener.send(tx).map_err(|_| closed("yamux connection"))?;
                let stream =
                    rx.await.map_err(|_| closed("yamux connection"))?.map_err(yamux_err)?;
                let (r, mut w) = stream.split();
                w.write_all(&header.encode()).await?;
                Ok((Tx::Yamux(w), Rx::Yamux(r)))
            }
            MuxConn::Quinn(c) => {
                let (mut s, r) = c.open_bi().await.map_err(io::Error::other)?;
                if header.latency {
                    s.set_priority(QUINN_LATENCY_PRIORITY).map_err(io::Error::other)?;
                }
                s.write_all(&header.encode()).await.map_err(io::Error::other)?;
                Ok((Tx::Quinn(s), Rx::Quinn(r)))
            }
            MuxConn::H2(send_request) => {
                let mut ready = send_request.clone().ready().await.map_err(h2_err)?;
                let request = http::Request::post("http://ncperf/")
                    .header(H2_FLOW_HEADER, hex(&header.encode()))
                    .body(())
                    .map_err(io::Error::other)?;
                let (response, s) = ready.send_request(request, false).map_err(h2_err)?;
                Ok((Tx::H2(s), Rx::H2Response(response)))
            }
        }
    }
}

/// yamux's configuration for a connection that carries up to `streams` streams. Its defaults
/// cap a connection at 512 streams and at a 1 GiB receive window in all (256 KiB for each
/// stream to start with); the stream cap is raised to the plan's, and the total window only as
/// far as yamux requires for that many streams.
fn yamux_config(streams: usize) -> yamux::Config {
    let streams = streams.max(512);
    let mut c = yamux::Config::default();
    let window = (1usize << 30).max(streams * yamux::DEFAULT_CREDIT as usize);
    c.set_max_connection_receive_window(Some(window));
    c.set_max_num_streams(streams);
    c
}

/// quinn's transport: its defaults, but for the number of streams a peer may have open at once
/// (100 by default; quinn sets up the state of that many streams in advance, so it is sized to
/// the plan's streams per connection rather than to the largest run).
fn quinn_transport(streams: usize) -> quinn::TransportConfig {
    let mut t = quinn::TransportConfig::default();
    let n = quinn::VarInt::from_u64(streams.max(100) as u64).unwrap_or(quinn::VarInt::MAX);
    t.max_concurrent_bidi_streams(n);
    t
}

/// Owns a client-side yamux connection: opens the outbound streams asked for and, by polling
/// for inbound ones (the server opens none), drives its I/O, as yamux requires.
async fn drive_yamux_client(
    mut conn: yamux::Connection<Compat<TcpStream>>,
    mut requests: mpsc::UnboundedReceiver<OpenRequest>,
) {
    let mut waiting: VecDeque<OpenRequest> = VecDeque::new();
    let mut accepting = true;
    poll_fn(|cx| loop {
        while accepting {
            match requests.poll_recv(cx) {
                Poll::Ready(Some(r)) => waiting.push_back(r),
                Poll::Ready(None) => accepting = false,
                Poll::Pending => break,
            }
        }
        while !waiting.is_empty() {
            match conn.poll_new_outbound(cx) {
                Poll::Ready(r) => {
                    let _ = waiting.pop_front().expect("not empty").send(r);
                }
                Poll::Pending => break,
            }
        }
        match conn.poll_next_inbound(cx) {
            Poll::Ready(Some(Ok(_unexpected))) => {}
            Poll::Ready(Some(Err(e))) => {
                client_failure("a yamux connection failed", e);
                return Poll::Ready(());
            }
            Poll::Ready(None) => return Poll::Ready(()),
            Poll::Pending => return Poll::Pending,
        }
    })
    .await
}

/// Client-side settings every connection of a process shares.
struct ClientSide {
    stack: Stack,
    server: SocketAddr,
    streams_per_conn: usize,
    quinn: Option<quinn::ClientConfig>,
}

impl ClientSide {
    /// A quinn endpoint (one UDP socket) for one sender app.
    fn endpoint(&self) -> io::Result<Option<quinn::Endpoint>> {
        let Some(config) = &self.quinn else { return Ok(None) };
        let any: SocketAddr =
            if self.server.is_ipv6() { "[::]:0" } else { "0.0.0.0:0" }.parse().expect("valid");
        let mut ep = quinn::Endpoint::client(any)?;
        ep.set_default_client_config(config.clone());
        Ok(Some(ep))
    }

    async fn connect(&self, endpoint: Option<&quinn::Endpoint>) -> io::Result<MuxConn> {
        match self.stack {
            Stack::Yamux => {
                let tcp = TcpStream::connect(self.server).await?;
                tcp.set_nodelay(true)?;
                let config = yamux_config(self.streams_per_conn);
                let conn = yamux::Connection::new(tcp.compat(), config, yamux::Mode::Client);
                let (tx, rx) = mpsc::unbounded_channel();
                tokio::spawn(drive_yamux_client(conn, rx));
                Ok(MuxConn::Yamux(tx))
            }
            Stack::H2 => {
                let tcp = TcpStream::connect(self.server).await?;
                tcp.set_nodelay(true)?;
                let (send_request, conn) = h2::client::Builder::new()
                    .initial_window_size(H2_CLIENT_STREAM_WINDOW)
                    .initial_connection_window_size(H2_CLIENT_CONN_WINDOW)
                    .max_send_buffer_size(H2_CLIENT_SEND_BUF)
                    .handshake::<_, Bytes>(tcp)
                    .await
                    .map_err(h2_err)?;
                tokio::spawn(async move {
                    if let Err(e) = conn.await {
                        client_failure("an h2 connection failed", e);
                    }
                });
                Ok(MuxConn::H2(send_request))
            }
            Stack::Quinn => {
                let ep = endpoint.ok_or_else(|| io::Error::other("quinn needs an endpoint"))?;
                let connecting = ep.connect(self.server, TLS_NAME).map_err(io::Error::other)?;
                Ok(MuxConn::Quinn(connecting.await.map_err(io::Error::other)?))
            }
            Stack::Linux | Stack::Netchannel => Err(io::Error::other("not a multiplexer stack")),
        }
    }
}

/// Flows grouped by the connections they share: (sender app, receiver app) pairs, or one group
/// for the mixed workload's L and T flows (the module doc says why). Flow indices per group.
pub fn connection_groups(plan: &Plan) -> BTreeMap<(u32, u16), Vec<usize>> {
    let mixed = plan.flows.iter().any(|f| f.latency);
    let mut groups: BTreeMap<(u32, u16), Vec<usize>> = BTreeMap::new();
    for (i, f) in plan.flows.iter().enumerate() {
        let key = if mixed { (0, 0) } else { (f.sender_app, f.receiver_app) };
        groups.entry(key).or_default().push(i);
    }
    groups
}

/// The most streams one connection carries with `connections` connections per group.
pub fn streams_per_connection(plan: &Plan, connections: usize) -> usize {
    let c = connections.max(1);
    connection_groups(plan).values().map(|g| g.len().div_ceil(c)).max().unwrap_or(1)
}

/// Receiver apps of a plan: the server runtime's worker count.
pub fn receiver_apps(plan: &Plan) -> usize {
    plan.flows.iter().map(|f| f.receiver_app as usize + 1).max().unwrap_or(1)
}

/// What the flows of one sender app share: their counters and their latency histogram.
struct App {
    counters: Arc<Counters>,
    hist: Mutex<Histogram<u64>>,
}

impl App {
    fn record(&self, w: &Window, t0: Instant, now: Instant) {
        if w.contains(now) {
            let us = now.saturating_duration_since(t0).as_micros() as u64;
            self.hist.lock().saturating_record(us.max(1));
            self.counters.rpcs.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// One flow's stream and what it is to do.
struct OpenFlow {
    tx: Tx,
    rx: Rx,
    spec: FlowSpec,
    /// Open loop: when its first request is due after the window opens (spread over one
    /// interval, as the epoll apps do, so that flows do not fire in lockstep).
    phase: f64,
}

/// The client process of a multiplexer stack: opens every flow, reports "connected" (through
/// `window`), runs the window and returns the measured counters, like `apps::run_client`.
pub fn run_client(
    args: ClientArgs,
    window: impl FnOnce() -> io::Result<Window>,
) -> io::Result<ClientReport> {
    let started = Instant::now();
    let rss_before = rss_bytes();
    let plan = args.plan;
    let quinn = match (args.stack, &args.server_cert) {
        (Stack::Quinn, Some(der)) => {
            let mut roots = quinn::rustls::RootCertStore::empty();
            roots.add(CertificateDer::from(der.clone())).map_err(io::Error::other)?;
            let mut c = quinn::ClientConfig::with_root_certificates(Arc::new(roots))
                .map_err(io::Error::other)?;
            // The streams the server may open to it: none, so quinn's default of 100.
            c.transport_config(Arc::new(quinn_transport(0)));
            Some(c)
        }
        (Stack::Quinn, None) => return Err(io::Error::other(
            "quinn needs the server's certificate (--server-cert, from the server's 'cert' line)",
        )),
        _ => None,
    };
    let side = Arc::new(ClientSide {
        stack: args.stack,
        server: args.server,
        streams_per_conn: streams_per_connection(&plan, args.mux_connections),
        quinn,
    });
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(plan.sender_apps.max(1))
        .thread_name("ncperf-app")
        .enable_all()
        .build()?;
    let apps: Vec<Arc<App>> = (0..plan.sender_apps.max(1))
        .map(|_| {
            Arc::new(App {
                counters: Arc::new(Counters::default()),
                hist: Mutex::new(new_histogram()),
            })
        })
        .collect();
    let connections = args.mux_connections.max(1);
    let (flows, first_connect) = rt.block_on(open_flows(&side, &plan, connections))?;
    let open_us = started.elapsed().as_micros() as u64;

    let w = window()?;
    let data =
        Bytes::from(vec![
            0x6Eu8;
            plan.flows.iter().map(|f| f.size as usize).max().unwrap_or(1).max(IO_BUF)
        ]);
    let mut held = Vec::new();
    let mut tasks = Vec::new();
    for f in flows {
        if args.idle {
            held.push(f); // open and silent until the window ends
            continue;
        }
        let app = apps[f.spec.sender_app as usize].clone();
        tasks.push(rt.spawn(client_flow(f, app, w, args.rate, data.clone())));
    }
    sleep_until(w.start);
    let rss_window = rss_bytes();
    let counters: Vec<Arc<Counters>> = apps.iter().map(|a| a.counters.clone()).collect();
    let (b0, r0) = snapshot(&counters);
    sleep_until(w.end);
    let (b1, r1) = snapshot(&counters);
    // Every flow task ends at the window's end; wait for them so the histograms are complete.
    rt.block_on(async {
        let all = async {
            for t in tasks {
                let _ = t.await;
            }
        };
        let _ = tokio::time::timeout(Duration::from_secs(10), all).await;
    });
    drop(held);
    let mut hist = new_histogram();
    for a in &apps {
        let h = a.hist.lock();
        hist.add(&*h).map_err(|e| io::Error::other(format!("histogram: {e}")))?;
    }
    // The connections' driver tasks never end by themselves; the process is about to exit.
    rt.shutdown_background();
    Ok(ClientReport {
        bytes: b1 - b0,
        rpcs: r1 - r0,
        latency_hist: histogram_to_pairs(&hist),
        flows: plan.flows.len() as u64,
        rss_before,
        rss_window,
        first_connect_us: Some(first_connect.as_micros() as u64),
        open_us: Some(open_us),
        new_peer_connect_us: Vec::new(),
    })
}

/// Connects every group's connections and opens every flow's stream, the groups in parallel.
/// The very first connection is made alone first, so that its time is the handshake's cost and
/// not a share of the machine's. Returns the flows and that first connection's time.
async fn open_flows(
    side: &Arc<ClientSide>,
    plan: &Plan,
    connections: usize,
) -> io::Result<(Vec<OpenFlow>, Duration)> {
    let endpoints: Vec<Option<quinn::Endpoint>> =
        (0..plan.sender_apps.max(1)).map(|_| side.endpoint()).collect::<io::Result<_>>()?;
    let groups = connection_groups(plan);
    let per_app: Vec<usize> = (0..plan.sender_apps.max(1))
        .map(|a| plan.flows.iter().filter(|f| f.sender_app as usize == a).count())
        .collect();
    // Index of each flow among its app's flows, for the open-loop phase.
    let mut seen = vec![0usize; per_app.len()];
    let phase: Vec<f64> = plan
        .flows
        .iter()
        .map(|f| {
            let a = f.sender_app as usize;
            seen[a] += 1;
            (seen[a] - 1) as f64 / per_app[a].max(1) as f64
        })
        .collect();
    let mut first_connect = Duration::ZERO;
    let mut tasks = Vec::new();
    for (n, ((sender, _), members)) in groups.into_iter().enumerate() {
        let endpoint = endpoints[sender as usize].clone();
        let mut first = None;
        if n == 0 {
            let t = Instant::now();
            first = Some(side.connect(endpoint.as_ref()).await?);
            first_connect = t.elapsed();
        }
        let side = side.clone();
        let specs: Vec<(FlowSpec, f64)> =
            members.iter().map(|&i| (plan.flows[i], phase[i])).collect();
        tasks.push(tokio::spawn(async move {
            let mut conns = Vec::with_capacity(connections);
            conns.extend(first);
            while conns.len() < connections {
                conns.push(side.connect(endpoint.as_ref()).await?);
            }
            let mut flows = Vec::with_capacity(specs.len());
            for (k, (spec, phase)) in specs.into_iter().enumerate() {
                let header = FlowHeader {
                    echo: spec.echo,
                    latency: spec.latency,
                    receiver_app: spec.receiver_app,
                    size: spec.size,
                };
                let (tx, rx) = conns[k % conns.len()].open(header).await?;
                flows.push(OpenFlow { tx, rx, spec, phase });
            }
            // The connections live on in their driver tasks (yamux, h2) and in the streams.
            Ok::<_, io::Error>(flows)
        }));
    }
    let mut all = Vec::with_capacity(plan.flows.len());
    for t in tasks {
        let flows =
            t.await.map_err(|e| io::Error::other(format!("a connection task died: {e}")))?;
        all.extend(flows.map_err(|e| io::Error::new(e.kind(), format!("connecting flows: {e}")))?);
    }
    Ok((all, first_connect))
}

/// One client flow until the window ends: stream writes, or closed- or open-loop ping-pong.
async fn client_flow(f: OpenFlow, app: Arc<App>, w: Window, rate: Option<f64>, data: Bytes) {
    let OpenFlow { mut tx, mut rx, spec, phase } = f;
    let size = spec.size as usize;
    let run = async {
        match (spec.echo, rate) {
            (false, _) => stream_writes(&mut tx, size, &app, &data).await,
            (true, None) => closed_loop(&mut tx, &mut rx, size, &app, &w, &data).await,
            (true, Some(r)) => {
                let iv = Duration::from_secs_f64(1.0 / r);
                let sent = Mutex::new(VecDeque::new());
                let first = Instant::now() + iv.mul_f64(phase);
                tokio::try_join!(
                    open_loop_writes(&mut tx, size, &app, &data, &sent, first, iv),
                    open_loop_reads(&mut rx, size, &app, &w, &sent),
                )
                .map(|_| ())
            }
        }
    };
    // An error (the peer went away) ends the flow, as in the epoll apps; inside the window that
    // is abnormal (the server outlives the clients), so the first one is said on stderr.
    if let Ok(Err(e)) = tokio::time::timeout_at(w.end.into(), run).await {
        client_failure("a flow ended early", e);
    }
}

/// Lets the worker's other tasks (and the timer that ends the window) run: a stream that always
/// takes more (small writes that coalesce) would otherwise keep its worker for good.
async fn turn(moved: &mut u64, n: usize) {
    *moved += n as u64;
    if *moved >= TURN_BUDGET {
        *moved = 0;
        tokio::task::yield_now().await;
    }
}

async fn stream_writes(tx: &mut Tx, size: usize, app: &App, data: &Bytes) -> io::Result<()> {
    let (mut pos, mut moved) = (0usize, 0u64);
    loop {
        let n = tx.send(data, pos, size).await?;
        app.counters.bytes.fetch_add(n as u64, Ordering::Relaxed);
        pos = (pos + n) % size;
        turn(&mut moved, n).await;
    }
}

async fn closed_loop(
    tx: &mut Tx,
    rx: &mut Rx,
    size: usize,
    app: &App,
    w: &Window,
    data: &Bytes,
) -> io::Result<()> {
    loop {
        let t0 = Instant::now();
        tx.send_all(data, 0, size, &app.counters).await?;
        let mut got = 0;
        while got < size {
            let n = rx.recv().await?;
            if n == 0 {
                return Err(closed("stream"));
            }
            app.counters.bytes.fetch_add(n as u64, Ordering::Relaxed);
            got += n;
        }
        app.record(w, t0, Instant::now());
    }
}

/// Open loop, sending side: each request at its scheduled time, whatever the responses do.
async fn open_loop_writes(
    tx: &mut Tx,
    size: usize,
    app: &App,
    data: &Bytes,
    sent: &Mutex<VecDeque<Instant>>,
    mut next: Instant,
    iv: Duration,
) -> io::Result<()> {
    loop {
        tokio::time::sleep_until(next.into()).await;
        let now = Instant::now();
        let mut due = 0;
        {
            let mut q = sent.lock();
            while next <= now {
                q.push_back(next); // latency counts from the scheduled time
                next += iv;
                due += 1;
            }
        }
        for _ in 0..due {
            tx.send_all(data, 0, size, &app.counters).await?;
        }
    }
}

/// Open loop, receiving side: each complete response ends the oldest request.
async fn open_loop_reads(
    rx: &mut Rx,
    size: usize,
    app: &App,
    w: &Window,
    sent: &Mutex<VecDeque<Instant>>,
) -> io::Result<()> {
    let mut got = 0usize;
    loop {
        let n = rx.recv().await?;
        if n == 0 {
            return Err(closed("stream"));
        }
        app.counters.bytes.fetch_add(n as u64, Ordering::Relaxed);
        got += n;
        while got >= size {
            got -= size;
            let t0 = sent.lock().pop_front();
            if let Some(t0) = t0 {
                app.record(w, t0, Instant::now());
            }
        }
    }
}

/// Where the server's flows count their bytes: one set of counters per connection, all of
/// them summed at the window's edges.
#[derive(Default)]
struct Registry {
    counters: Mutex<Vec<Arc<Counters>>>,
    streams: AtomicU64,
}

impl Registry {
    fn connection(&self) -> Arc<Counters> {
        let c = Arc::new(Counters::default());
        self.counters.lock().push(c.clone());
        c
    }
}

/// The server process of a multiplexer stack: `apps` runtime workers, streams admitted up to
/// `streams` per connection. Prints `cert HEX` (quinn) and `ready ADDR`, then follows the
/// orchestrator's protocol like every server (`apps::serve_window`).
pub fn run_server(
    stack: Stack,
    listen: SocketAddr,
    coordinated: bool,
    streams: usize,
    apps: usize,
) -> io::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(apps.max(1))
        .thread_name("ncperf-rx")
        .enable_all()
        .build()?;
    let registry = Arc::new(Registry::default());
    let (rss_before, fds_before) = (rss_bytes(), crate::apps::open_fds());
    let data = Bytes::from(vec![0x5Au8; IO_BUF]);
    let (addr, cert) = rt.block_on(async {
        match stack {
            Stack::Yamux | Stack::H2 => {
                let listener = TcpListener::bind(listen).await?;
                let addr = listener.local_addr()?;
                tokio::spawn(accept_tcp(stack, listener, streams, registry.clone(), data));
                Ok::<_, io::Error>((addr, None))
            }
            Stack::Quinn => {
                // The certificate is made here, at start, as a quinn server without one would;
                // its cost is reported (cert_gen_ms).
                let t = Instant::now();
                let ck = rcgen::generate_simple_self_signed(vec![TLS_NAME.to_string()])
                    .map_err(io::Error::other)?;
                let der = ck.cert.der().clone();
                let key = PrivatePkcs8KeyDer::from(ck.signing_key.serialize_der());
                let mut config =
                    quinn::ServerConfig::with_single_cert(vec![der.clone()], key.into())
                        .map_err(io::Error::other)?;
                config.transport_config(Arc::new(quinn_transport(streams)));
                let took = t.elapsed();
                let endpoint = quinn::Endpoint::server(config, listen)?;
                let addr = endpoint.local_addr()?;
                // What quinn-udp gets from this kernel for a socket like the endpoint's.
                let probe = std::net::UdpSocket::bind(SocketAddr::new(addr.ip(), 0))?;
                let state = quinn::udp::UdpSocketState::new((&probe).into())?;
                let offload = (state.max_gso_segments(), state.gro_segments());
                tokio::spawn(accept_quinn(endpoint, registry.clone(), data));
                Ok((addr, Some((der, took, offload))))
            }
            Stack::Linux | Stack::Netchannel => Err(io::Error::other("not a multiplexer stack")),
        }
    })?;
    if let Some((der, _, _)) = &cert {
        println!("cert {}", hex(der));
    }
    println!("ready {addr}");
    let counters = || registry.counters.lock().clone();
    let setup = crate::apps::ServerSetup {
        cert_gen_us: cert.as_ref().map(|(_, took, _)| took.as_micros() as u64),
        udp_offload: cert.as_ref().map(|(_, _, offload)| *offload),
        fds_before,
    };
    let served =
        crate::apps::serve_window(rss_before, counters, &registry.streams, coordinated, setup);
    rt.shutdown_background();
    served
}

async fn accept_tcp(
    stack: Stack,
    listener: TcpListener,
    streams: usize,
    registry: Arc<Registry>,
    data: Bytes,
) {
    loop {
        let Ok((tcp, _)) = listener.accept().await else {
            // Out of file descriptors, most likely: give the flows a moment, then go on.
            tokio::time::sleep(Duration::from_millis(1)).await;
            continue;
        };
        if tcp.set_nodelay(true).is_err() {
            continue;
        }
        let (registry, data) = (registry.clone(), data.clone());
        let counters = registry.connection();
        if stack == Stack::Yamux {
            tokio::spawn(async move {
                let mut conn = yamux::Connection::new(
                    tcp.compat(),
                    yamux_config(streams),
                    yamux::Mode::Server,
                );
                // Polling for inbound streams is also what drives the connection's I/O.
                loop {
                    let stream = match poll_fn(|cx| conn.poll_next_inbound(cx)).await {
                        Some(Ok(s)) => s,
                        Some(Err(e)) if !yamux_disconnect(&e) => {
                            eprintln!("ncperf server: yamux closed a connection: {e}");
                            return;
                        }
                        _ => return,
                    };
                    registry.streams.fetch_add(1, Ordering::Relaxed);
                    let (r, w) = stream.split();
                    let flow = serve_stream(
                        Tx::Yamux(w),
                        Rx::Yamux(r),
                        None,
                        counters.clone(),
                        data.clone(),
                    );
                    tokio::spawn(flow);
                }
            });
        } else {
            tokio::spawn(async move {
                let handshake = h2::server::Builder::new()
                    .initial_window_size(H2_SERVER_STREAM_WINDOW)
                    .initial_connection_window_size(H2_SERVER_CONN_WINDOW)
                    .max_send_buffer_size(H2_SERVER_SEND_BUF)
                    .handshake::<_, Bytes>(tcp);
                let Ok(mut conn) = handshake.await else { return };
                // Accepting is also what drives the connection's I/O.
                loop {
                    let (request, mut respond) = match conn.accept().await {
                        Some(Ok(r)) => r,
                        // The client going away is an I/O error; anything else is h2 closing
                        // the connection itself (its defences against small frames, say).
                        Some(Err(e)) if !e.is_io() => {
                            eprintln!("ncperf server: h2 closed a connection: {e}");
                            return;
                        }
                        _ => return,
                    };
                    let header = request
                        .headers()
                        .get(H2_FLOW_HEADER)
                        .and_then(|v| unhex(v.to_str().ok()?).ok())
                        .and_then(|b| <[u8; FlowHeader::LEN]>::try_from(b).ok())
                        .and_then(|b| FlowHeader::decode(&b).ok());
                    let Some(header) = header else {
                        respond.send_reset(h2::Reason::PROTOCOL_ERROR);
                        continue;
                    };
                    let Ok(send) = respond.send_response(http::Response::new(()), false) else {
                        continue;
                    };
                    registry.streams.fetch_add(1, Ordering::Relaxed);
                    let body = request.into_body();
                    let flow = serve_stream(
                        Tx::H2(send),
                        Rx::H2(body),
                        Some(header),
                        counters.clone(),
                        data.clone(),
                    );
                    tokio::spawn(flow);
                }
            });
        }
    }
}

async fn accept_quinn(endpoint: quinn::Endpoint, registry: Arc<Registry>, data: Bytes) {
    while let Some(incoming) = endpoint.accept().await {
        let (registry, data) = (registry.clone(), data.clone());
        tokio::spawn(async move {
            let Ok(conn) = incoming.await else { return };
            let counters = registry.connection();
            while let Ok((s, r)) = conn.accept_bi().await {
                registry.streams.fetch_add(1, Ordering::Relaxed);
                let flow =
                    serve_stream(Tx::Quinn(s), Rx::Quinn(r), None, counters.clone(), data.clone());
                tokio::spawn(flow);
            }
        });
    }
}

/// One server stream: reads its header (yamux, quinn), then sinks it (counting the bytes) or
/// echoes every complete `size`-byte message, until the peer goes away.
async fn serve_stream(
    mut tx: Tx,
    mut rx: Rx,
    header: Option<FlowHeader>,
    counters: Arc<Counters>,
    data: Bytes,
) {
    let header = match header {
        Some(h) => h,
        None => match rx.read_header().await {
            Ok(h) => h,
            Err(_) => return,
        },
    };
    match &mut tx {
        // A yamux stream is acknowledged with the first frame its acceptor sends, and a client
        // may have at most 256 unacknowledged streams: a sink stream would send nothing for a
        // long while, so an empty frame acknowledges it now.
        Tx::Yamux(w) => match w.write(&[]).await {
            Ok(_) => {}
            Err(_) => return,
        },
        Tx::Quinn(s) if header.latency => {
            let _ = s.set_priority(QUINN_LATENCY_PRIORITY);
        }
        _ => {}
    }
    let _ = serve(&mut tx, &mut rx, header, &counters, &data).await;
}

async fn serve(
    tx: &mut Tx,
    rx: &mut Rx,
    header: FlowHeader,
    counters: &Counters,
    data: &Bytes,
) -> io::Result<()> {
    let size = header.size as usize;
    let (mut got, mut moved) = (0usize, 0u64);
    // Echoed bytes are not goodput at the server (the client counts them).
    let uncounted = Counters::default();
    loop {
        let n = rx.recv().await?;
        if n == 0 {
            return Ok(());
        }
        if header.echo {
            got += n;
            let mut out = (got / size) * size;
            got %= size;
            while out > 0 {
                let k = out.min(data.len());
                tx.send_all(data, 0, k, &uncounted).await?;
                out -= k;
            }
        } else {
            counters.bytes.fetch_add(n as u64, Ordering::Relaxed);
        }
        turn(&mut moved, n).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::apps::{plan, Pattern, Workload};

    #[test]
    fn hex_round_trip_and_errors() {
        let b = [0u8, 1, 0xab, 0xff];
        assert_eq!(hex(&b), "0001abff");
        assert_eq!(unhex("0001abff").unwrap(), b);
        assert!(unhex("abc").is_err());
        assert!(unhex("zz").is_err());
    }

    #[test]
    fn groups_follow_app_pairs_and_mixed_shares_one() {
        let p = plan(Workload::Stream, Pattern::AllToAll, 64, 100, (0, 0), 16).unwrap();
        let g = connection_groups(&p);
        assert_eq!(g.len(), 64); // 8 x 8 app pairs
        assert_eq!(streams_per_connection(&p, 1), 1);
        let p = plan(Workload::Rr, Pattern::Incast, 1000, 4096, (0, 0), 8).unwrap();
        assert_eq!(connection_groups(&p).len(), 8);
        assert_eq!(streams_per_connection(&p, 1), 125);
        assert_eq!(streams_per_connection(&p, 4), 32);
        assert_eq!(receiver_apps(&p), 1);
        let p = plan(Workload::Mixed, Pattern::OneToOne, 0, 65536, (1, 4), 8).unwrap();
        assert_eq!(connection_groups(&p).len(), 1);
        assert_eq!(receiver_apps(&p), 5);
    }

    #[test]
    fn yamux_config_admits_a_million_streams() {
        // yamux asserts its window covers 256 KiB per stream; this must not panic.
        let _ = yamux_config(1_000_000);
        let _ = yamux_config(1);
    }
}
