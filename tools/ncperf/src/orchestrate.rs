//! `ncperf run` and `ncperf compare`: start server and client processes on the testbed, give
//! them one measurement window, sample CPU over exactly that window, and combine the reports.

use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use crate::apps::{unix_ns_after, ClientReport, ServerReport, Window, Workload};
use crate::metrics::{self, RunResult};
use crate::net::{IsolationOpt, Stack};
use crate::testbed;
use crate::RunArgs;

/// File descriptors a process keeps beside its flows (engine, epoll, stdio, ...).
const FD_SLACK: u64 = 256;
/// Most flows the tool accepts, per the studies' scale.
pub const MAX_FLOWS: u64 = 1_000_000;

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Hosts {
    Netns,
    Loopback,
}

struct Proc {
    child: Child,
    stdin: Option<ChildStdin>,
    stdout: BufReader<ChildStdout>,
    what: String,
}

impl Proc {
    fn spawn(args: &[String], what: String) -> Result<Proc, String> {
        let exe = std::env::current_exe().map_err(|e| format!("cannot find own binary: {e}"))?;
        let mut child = Command::new(exe)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| format!("cannot start {what}: {e}"))?;
        let stdin = child.stdin.take();
        let stdout = BufReader::new(child.stdout.take().expect("piped"));
        Ok(Proc { child, stdin, stdout, what })
    }

    /// Reads lines until one starts with `prefix`; fails if the process ends first.
    fn expect_line(&mut self, prefix: &str) -> Result<String, String> {
        let mut line = String::new();
        loop {
            line.clear();
            let n = self.stdout.read_line(&mut line).map_err(|e| format!("{}: {e}", self.what))?;
            if n == 0 {
                let status = self.child.wait().map(|s| s.to_string()).unwrap_or_default();
                return Err(format!(
                    "{} exited before '{prefix}' ({status}); see its error above",
                    self.what
                ));
            }
            if line.starts_with(prefix) {
                return Ok(line.trim_end().to_string());
            }
        }
    }

    fn send(&mut self, line: &str) -> Result<(), String> {
        let stdin = self.stdin.as_mut().ok_or("stdin closed")?;
        writeln!(stdin, "{line}")
            .and_then(|_| stdin.flush())
            .map_err(|e| format!("{}: {e}", self.what))
    }

    fn close_stdin(&mut self) {
        self.stdin = None;
    }

    fn ticks(&self) -> u64 {
        metrics::read_process_ticks(self.child.id()).unwrap_or(0)
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        // On any error path, never leave a child behind.
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// The per-process open-file hard limit, after raising the soft limit to it.
pub fn raise_fd_limit() -> u64 {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let lim = getrlimit(Resource::Nofile);
    let Some(max) = lim.maximum else { return 1 << 20 }; // unlimited
    if lim.current < Some(max) {
        // Best effort: where it fails, the soft limit stays and the caller works within it.
        let _ = setrlimit(Resource::Nofile, Rlimit { current: Some(max), maximum: Some(max) });
    }
    max
}

/// One client process: its server's index, its flows, and with `--peers` its engines and the
/// index of the first.
type ClientJob = (usize, u64, Option<(usize, usize)>);

/// Client engines (`--peers`) per client process: each holds about 20 file descriptors
/// (its channels, listener, workers' epoll sets and eventfds), and the per-process limit is
/// 20,000 on the machines this was measured on.
const PEERS_PER_PROCESS: usize = 400;

/// The `i`th of `parts` near-equal shares of `total` (the first `total % parts` get one more).
fn nth_share(total: u64, parts: usize, i: usize) -> u64 {
    total / parts as u64 + u64::from((i as u64) < total % parts as u64)
}

/// How many client/server process pairs `flows` kernel sockets need.
pub fn processes_for(stack: Stack, flows: u64, fd_limit: u64) -> Result<usize, String> {
    if stack == Stack::Netchannel || stack.is_mux() {
        return Ok(1); // channels or multiplexed connections, not flows, use file descriptors
    }
    let per = fd_limit.saturating_sub(FD_SLACK);
    if per == 0 {
        return Err(format!("the open-file limit ({fd_limit}) leaves no room for sockets"));
    }
    let n = flows.div_ceil(per);
    if n > 64 {
        return Err(format!(
            "{flows} kernel sockets need {n} processes per side under the per-process open-file \
             limit of {fd_limit} (RLIMIT_NOFILE); at most 64 are started"
        ));
    }
    Ok(n as usize)
}

pub fn validate(args: &RunArgs, stack: Stack) -> Result<(), String> {
    if args.peers != 1 {
        if stack != Stack::Netchannel {
            return Err("--peers is netchannel's (client engines); other stacks have one".into());
        }
        if args.peers == 0 || args.peers > testbed::MAX_PEERS {
            return Err(format!("--peers must be between 1 and {}", testbed::MAX_PEERS));
        }
        if args.flows < args.peers as u64 {
            return Err(format!(
                "--peers {} needs at least as many --flows (each peer carries one at least)",
                args.peers
            ));
        }
    }
    if args.flows > MAX_FLOWS {
        return Err(format!("--flows {} exceeds the supported {MAX_FLOWS}", args.flows));
    }
    if args.size == 0 || args.size > 64 << 20 {
        return Err("--size must be between 1 byte and 64 MiB".into());
    }
    if args.duration <= 0.0 || args.warmup < 0.0 {
        return Err("--duration must be > 0 and --warmup >= 0".into());
    }
    if args.rate.is_some() && !matches!(args.workload, Workload::Rr | Workload::Mixed) {
        return Err("--rate applies to the rr workload and to mixed's L flows only".into());
    }
    if matches!(args.rate, Some(r) if r <= 0.0 || !r.is_finite()) {
        return Err("--rate must be a positive number of requests per second per flow".into());
    }
    let mixed_flags = args.latency_flows.is_some() || args.throughput_flows.is_some();
    if mixed_flags && args.workload != Workload::Mixed {
        return Err("--latency-flows/--throughput-flows apply to the mixed workload only".into());
    }
    if args.split_processes
        && !(args.workload == Workload::Mixed
            && args.latency_flows.unwrap_or(0) > 0
            && args.throughput_flows.unwrap_or(0) > 0)
    {
        return Err("--split-processes needs the mixed workload with L and T flows".into());
    }
    if stack == Stack::Netchannel && !(1..=63).contains(&args.channels) {
        return Err("--channels must be between 1 and 63".into());
    }
    if stack.is_mux() && !(1..=64).contains(&args.mux_connections) {
        return Err("--mux-connections must be between 1 and 64".into());
    }
    crate::apps::plan(
        args.workload,
        args.pattern,
        args.flows,
        args.size as u32,
        (args.latency_flows.unwrap_or(0), args.throughput_flows.unwrap_or(0)),
        args.max_apps,
    )
    .map(|_| ())
}

fn total_flows(args: &RunArgs) -> u64 {
    match args.workload {
        Workload::Mixed => args.latency_flows.unwrap_or(0) + args.throughput_flows.unwrap_or(0),
        _ => args.flows,
    }
}

/// Runs one measurement of one stack.
pub fn run_once(args: &RunArgs, stack: Stack) -> Result<RunResult, String> {
    run_with(args, stack, None)
}

/// Moments of a run a hook (the profiler) can act on.
pub enum WindowEvent<'a> {
    /// Every process is connected; the window has not been announced yet.
    Ready {
        clients: &'a [u32],
        servers: &'a [u32],
    },
    Start,
    End,
}

pub type WindowHook<'a> = &'a mut dyn FnMut(WindowEvent<'_>) -> Result<(), String>;

/// `run_once`, calling `on_window` as the measured window opens (the profiler starts perf).
pub fn run_with(
    args: &RunArgs,
    stack: Stack,
    on_window: Option<WindowHook<'_>>,
) -> Result<RunResult, String> {
    validate(args, stack)?;
    let flows = total_flows(args);
    let fd_limit = raise_fd_limit();
    let split = args.workload == Workload::Mixed && args.split_processes;
    let pairs = match args.workload {
        Workload::Mixed if split => 2,
        Workload::Mixed => 1,
        _ => processes_for(stack, flows, fd_limit)?,
    };
    // Split: pair 0 carries the L-apps, pair 1 the T-apps, whose engines isolate always (no
    // latency socket of their own tells them that a neighbour process has one).
    let isolation_of = |i: usize| {
        if split && i == 1 && args.isolation == IsolationOpt::Auto {
            IsolationOpt::Always
        } else {
            args.isolation
        }
    };
    let mixed_of = |i: usize| match (args.latency_flows, args.throughput_flows) {
        (Some(l), Some(t)) if split => Some(if i == 0 { (l, 0) } else { (0, t) }),
        (l, t) if l.is_some() || t.is_some() => Some((l.unwrap_or(0), t.unwrap_or(0))),
        _ => None,
    };
    let (server_ip, client_ns, server_ns) = match args.hosts {
        Hosts::Loopback => ("127.0.0.1".parse().expect("valid"), None, None),
        Hosts::Netns => {
            if !testbed::exists() {
                eprintln!(
                    "ncperf: bringing the testbed up (namespaces {} and {})",
                    testbed::NS_A,
                    testbed::NS_B
                );
                testbed::up(testbed::Options::default())?;
            }
            (
                testbed::addr_b(),
                Some(testbed::ns_path(testbed::NS_A)),
                Some(testbed::ns_path(testbed::NS_B)),
            )
        }
    };
    // Each pair's share of the flows and, for the multiplexer stacks, its plan: their servers
    // size their runtime and their per-connection stream limit from it.
    let share_of = |i: usize| {
        if args.workload == Workload::Mixed {
            args.flows
        } else {
            nth_share(flows, pairs, i)
        }
    };
    let plan_of = |i: usize| {
        crate::apps::plan(
            args.workload,
            args.pattern,
            share_of(i),
            args.size as u32,
            mixed_of(i).unwrap_or((0, 0)),
            args.max_apps,
        )
    };
    if args.peers > 1 && args.hosts == Hosts::Netns {
        testbed::peer_routes()?;
    }
    let common = |v: &mut Vec<String>, i: usize| {
        v.extend(["--stack".into(), stack.name().into()]);
        v.extend(["--channels".into(), args.channels.to_string()]);
        v.extend(["--policy".into(), args.policy.to_string()]);
        v.extend(["--isolation".into(), isolation_of(i).name().into()]);
        v.extend(["--demote-to".into(), args.demote_to.name().into()]);
        v.push(format!("--latency-nice={}", args.latency_nice));
        if args.host_congestion {
            v.push("--host-congestion".into());
        }
        if let Some(n) = args.max_peer_buffered {
            v.extend(["--max-peer-buffered".into(), n.to_string()]);
        }
        if let Some(n) = args.max_channels {
            v.extend(["--max-channels".into(), n.to_string()]);
        }
        if let Some(n) = args.shards {
            v.extend(["--shards".into(), n.to_string()]);
        }
        v.extend(["--app-demotion".into(), args.app_demotion.name().into()]);
    };
    let mut servers = Vec::new();
    for i in 0..pairs {
        let mut v = vec!["server".to_string(), "--coordinated".into()];
        v.extend(["--listen".into(), SocketAddr::new(server_ip, 0).to_string()]);
        common(&mut v, i);
        if stack.is_mux() {
            let plan = plan_of(i)?;
            let streams = crate::mux::streams_per_connection(&plan, args.mux_connections);
            v.extend(["--max-streams".into(), streams.to_string()]);
            v.extend(["--apps".into(), crate::mux::receiver_apps(&plan).to_string()]);
        }
        if let Some(n) = args.max_sessions {
            v.extend(["--max-sessions".into(), n.to_string()]);
        }
        if let Some(ns) = &server_ns {
            v.extend(["--netns".into(), ns.display().to_string()]);
        }
        servers.push(Proc::spawn(&v, format!("server process {i}"))?);
    }
    let mut server_addrs = Vec::new();
    let mut server_certs = Vec::new();
    for s in &mut servers {
        if stack == Stack::Quinn {
            let line = s.expect_line("cert ")?;
            server_certs.push(line["cert ".len()..].to_string());
        }
        let line = s.expect_line("ready ")?;
        server_addrs.push(line["ready ".len()..].to_string());
    }
    // Client processes: one per server, or with --peers as many as the client engines' fds
    // need (pairs is 1 then).
    let mut jobs: Vec<ClientJob> = Vec::new();
    for i in 0..server_addrs.len() {
        if args.peers > 1 {
            let procs = args.peers.div_ceil(PEERS_PER_PROCESS);
            let mut first = 0;
            for j in 0..procs {
                let peers = nth_share(args.peers as u64, procs, j) as usize;
                jobs.push((i, nth_share(share_of(i), procs, j), Some((peers, first))));
                first += peers;
            }
        } else {
            jobs.push((i, share_of(i), None));
        }
    }
    let mut clients = Vec::new();
    for (i, share, peers) in jobs {
        let addr = &server_addrs[i];
        let mut v =
            vec!["client".to_string(), "--coordinated".into(), "--connect".into(), addr.clone()];
        common(&mut v, i);
        v.extend(["--workload".into(), args.workload.name().into()]);
        v.extend(["--pattern".into(), args.pattern.name().into()]);
        v.extend(["--flows".into(), share.to_string(), "--size".into(), args.size.to_string()]);
        v.extend(["--max-apps".into(), args.max_apps.to_string()]);
        if let Some(r) = args.rate {
            v.extend(["--rate".into(), r.to_string()]);
        }
        if let Some((l, t)) = mixed_of(i) {
            v.extend([
                "--latency-flows".into(),
                l.to_string(),
                "--throughput-flows".into(),
                t.to_string(),
            ]);
        }
        if stack.is_mux() {
            v.extend(["--mux-connections".into(), args.mux_connections.to_string()]);
        }
        if let Some((peers, first)) = peers {
            v.extend(["--peers".into(), peers.to_string()]);
            v.extend(["--first-peer".into(), first.to_string()]);
        }
        if let Some(cert) = server_certs.get(i) {
            v.extend(["--server-cert".into(), cert.clone()]);
        }
        if let Some(ns) = &client_ns {
            v.extend(["--netns".into(), ns.display().to_string()]);
        }
        let what = format!("client process {}", clients.len());
        clients.push(Proc::spawn(&v, what)?);
    }
    for c in &mut clients {
        c.expect_line("connected")?;
    }
    let mut on_window = on_window;
    if let Some(hook) = on_window.as_mut() {
        let ids = |ps: &[Proc]| ps.iter().map(|p| p.child.id()).collect::<Vec<u32>>();
        hook(WindowEvent::Ready { clients: &ids(&clients), servers: &ids(&servers) })?;
    }

    let warmup = Duration::from_secs_f64(args.warmup);
    let duration = Duration::from_secs_f64(args.duration);
    // A little lead so every process has read the line before the warm-up starts.
    let start_ns = unix_ns_after(warmup + Duration::from_millis(100));
    let go = format!("go {start_ns} {}", duration.as_nanos());
    let window = Window::from_unix(start_ns, duration.as_nanos() as u64);
    for p in servers.iter_mut().chain(clients.iter_mut()) {
        p.send(&go)?;
    }
    let bar = progress_bar(args, stack);
    let sample = |servers: &[Proc], clients: &[Proc]| {
        let m = metrics::read_machine_cpu().unwrap_or_default();
        let s: u64 = servers.iter().map(Proc::ticks).sum();
        let c: u64 = clients.iter().map(Proc::ticks).sum();
        (m, s, c)
    };
    tick_until(window.start, &bar);
    let t0 = Instant::now();
    let (m0, s0, c0) = sample(&servers, &clients);
    if let Some(hook) = on_window.as_mut() {
        hook(WindowEvent::Start)?;
    }
    tick_until(window.end, &bar);
    let (m1, s1, c1) = sample(&servers, &clients);
    if let Some(hook) = on_window.as_mut() {
        hook(WindowEvent::End)?;
    }
    let measured = t0.elapsed().as_secs_f64();
    if let Some(b) = &bar {
        b.finish_and_clear();
    }

    let mut client_reports = Vec::new();
    for c in &mut clients {
        let line = c.expect_line("{")?;
        let r: ClientReport =
            serde_json::from_str(&line).map_err(|e| format!("{}: bad report: {e}", c.what))?;
        client_reports.push(r);
        let _ = c.child.wait();
    }
    let mut server_reports = Vec::new();
    for s in &mut servers {
        s.close_stdin();
        let line = s.expect_line("{")?;
        let r: ServerReport =
            serde_json::from_str(&line).map_err(|e| format!("{}: bad report: {e}", s.what))?;
        server_reports.push(r);
        let _ = s.child.wait();
    }

    let tps = metrics::clock_ticks_per_second();
    let secs = args.duration;
    let mut hist = metrics::new_histogram();
    for r in &client_reports {
        hist.add(metrics::histogram_from_pairs(&r.latency_hist)).map_err(|e| e.to_string())?;
    }
    let client_bytes: u64 = client_reports.iter().map(|r| r.bytes).sum();
    let sink_bytes: u64 = server_reports.iter().map(|r| r.sink_bytes).sum();
    let rpcs: u64 = client_reports.iter().map(|r| r.rpcs).sum();
    let goodput = match args.workload {
        Workload::Stream | Workload::Mixed | Workload::Idle => metrics::gbps(sink_bytes, secs),
        Workload::Rr => metrics::gbps(client_bytes, secs),
    };
    // Resident memory each side gained for its flows, per flow (all processes together).
    let per_flow = |before: u64, window: u64| {
        (flows > 0).then(|| window.saturating_sub(before) as f64 / flows as f64)
    };
    let client_rss_per_flow = per_flow(
        client_reports.iter().map(|r| r.rss_before).sum(),
        client_reports.iter().map(|r| r.rss_window).sum(),
    );
    let server_rss_per_flow = per_flow(
        server_reports.iter().map(|r| r.rss_before).sum(),
        server_reports.iter().map(|r| r.rss_window).sum(),
    );
    let server_fds_per_flow = per_flow(
        server_reports.iter().map(|r| r.fds_before).sum(),
        server_reports.iter().map(|r| r.fds_window).sum(),
    );
    let mut connects = metrics::new_histogram();
    for us in client_reports.iter().flat_map(|r| &r.new_peer_connect_us) {
        connects.saturating_record(*us);
    }
    let ms_of = |l: metrics::Latency| metrics::Latency {
        p50: l.p50 / 1e3,
        p99: l.p99 / 1e3,
        p999: l.p999 / 1e3,
        max: l.max / 1e3,
    };
    let cpu_cores = metrics::busy_cores(m1.busy.saturating_sub(m0.busy), tps, measured);
    Ok(RunResult {
        stack: stack.name().into(),
        workload: args.workload.name().into(),
        pattern: args.pattern.name().into(),
        flows,
        size: args.size,
        duration_s: args.duration,
        warmup_s: args.warmup,
        goodput_gbps: goodput,
        rps: rpcs as f64 / secs,
        latency_us: metrics::percentiles(&hist),
        cpu_cores,
        client_cpu_cores: metrics::busy_cores(c1.saturating_sub(c0), tps, measured),
        server_cpu_cores: metrics::busy_cores(s1.saturating_sub(s0), tps, measured),
        gbps_per_core: if cpu_cores > 0.0 { goodput / cpu_cores } else { 0.0 },
        hosts: match args.hosts {
            Hosts::Netns => "netns".into(),
            Hosts::Loopback => "loopback".into(),
        },
        channels: (stack == Stack::Netchannel).then_some(args.channels),
        policy: (stack == Stack::Netchannel).then(|| args.policy.to_string()),
        client_rss_per_flow,
        server_rss_per_flow,
        latency_flows: args.latency_flows,
        throughput_flows: args.throughput_flows,
        processes: pairs,
        rpcs,
        mux_connections: stack.is_mux().then_some(args.mux_connections),
        cert_gen_ms: server_reports.iter().filter_map(|r| r.cert_gen_us).max().map(ms),
        first_connect_ms: client_reports.first().and_then(|r| r.first_connect_us).map(ms),
        open_ms: client_reports.iter().filter_map(|r| r.open_us).max().map(ms),
        udp_offload: server_reports.iter().find_map(|r| r.udp_offload),
        latency_cdf: metrics::cdf_points(&hist),
        server_fds_per_flow,
        peers: (stack == Stack::Netchannel).then_some(args.peers),
        new_peer_connect_ms: metrics::percentiles(&connects).map(ms_of),
    })
}

fn ms(us: u64) -> f64 {
    us as f64 / 1e3
}

fn progress_bar(args: &RunArgs, stack: Stack) -> Option<indicatif::ProgressBar> {
    let total = args.warmup + args.duration;
    if total <= 2.0 {
        return None;
    }
    let bar = indicatif::ProgressBar::new((total * 10.0) as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{msg} [{bar:30}] {elapsed}/{duration}")
            .expect("valid template"),
    );
    bar.set_message(format!("{} {} {}", stack.name(), args.workload.name(), args.pattern.name()));
    Some(bar)
}

fn tick_until(t: Instant, bar: &Option<indicatif::ProgressBar>) {
    loop {
        let now = Instant::now();
        if now >= t {
            return;
        }
        std::thread::sleep((t - now).min(Duration::from_millis(100)));
        if let Some(b) = bar {
            b.inc(1);
        }
    }
}

/// Every numeric metric of a result, by JSON name, for medians and ratios.
pub fn numeric_metrics(r: &RunResult) -> Vec<(&'static str, f64)> {
    let lat = r.latency_us.unwrap_or(metrics::Latency {
        p50: f64::NAN,
        p99: f64::NAN,
        p999: f64::NAN,
        max: f64::NAN,
    });
    vec![
        ("goodput_gbps", r.goodput_gbps),
        ("rps", r.rps),
        ("latency_us.p50", lat.p50),
        ("latency_us.p99", lat.p99),
        ("latency_us.p999", lat.p999),
        ("latency_us.max", lat.max),
        ("cpu_cores", r.cpu_cores),
        ("client_cpu_cores", r.client_cpu_cores),
        ("server_cpu_cores", r.server_cpu_cores),
        ("gbps_per_core", r.gbps_per_core),
    ]
}

#[derive(Debug, serde::Serialize)]
pub struct Comparison {
    pub repetitions: usize,
    pub linux: serde_json::Map<String, serde_json::Value>,
    pub netchannel: serde_json::Map<String, serde_json::Value>,
    /// netchannel / linux of every metric's median.
    pub ratio: serde_json::Map<String, serde_json::Value>,
    /// With --with: every stack's medians (linux and netchannel too), by stack name.
    #[serde(skip_serializing_if = "serde_json::Map::is_empty")]
    pub medians: serde_json::Map<String, serde_json::Value>,
    /// With --with: every other stack's medians over linux's, by stack name.
    #[serde(skip_serializing_if = "serde_json::Map::is_empty")]
    pub ratios: serde_json::Map<String, serde_json::Value>,
    pub runs: Vec<RunResult>,
}

/// The stacks of a comparison: linux and netchannel, then those of --with (each once).
pub fn compare_stacks(with: &[Stack]) -> Result<Vec<Stack>, String> {
    let mut stacks = vec![Stack::Linux, Stack::Netchannel];
    for &s in with {
        if !s.is_mux() {
            return Err(format!(
                "--with takes the multiplexer stacks (yamux, quinn, h2); {} is always compared",
                s.name()
            ));
        }
        if !stacks.contains(&s) {
            stacks.push(s);
        }
    }
    Ok(stacks)
}

/// The stacks interleaved (linux, netchannel, then --with's, linux, ...), medians and ratios.
pub fn compare(args: &RunArgs, repetitions: usize, with: &[Stack]) -> Result<Comparison, String> {
    if repetitions == 0 {
        return Err("--repetitions must be at least 1".into());
    }
    let stacks = compare_stacks(with)?;
    for &s in &stacks {
        validate(args, s)?;
    }
    let mut runs = Vec::new();
    for rep in 0..repetitions {
        for &stack in &stacks {
            eprintln!("ncperf compare: {} repetition {}/{repetitions}", stack.name(), rep + 1);
            runs.push(run_once(args, stack)?);
        }
    }
    let medians = |stack: &str| -> Vec<(&'static str, f64)> {
        let of: Vec<&RunResult> = runs.iter().filter(|r| r.stack == stack).collect();
        numeric_metrics(of[0])
            .iter()
            .enumerate()
            .map(|(i, (name, _))| {
                let v: Vec<f64> = of.iter().map(|r| numeric_metrics(r)[i].1).collect();
                (*name, metrics::median(&v))
            })
            .collect()
    };
    let to_map = |m: &[(&str, f64)]| {
        m.iter().map(|(k, v)| (k.to_string(), json_num(*v))).collect::<serde_json::Map<_, _>>()
    };
    let over = |a: &[(&str, f64)], b: &[(&str, f64)]| {
        a.iter()
            .zip(b)
            .map(|((k, av), (_, bv))| (k.to_string(), json_num(bv / av)))
            .collect::<serde_json::Map<_, _>>()
    };
    let (l, n) = (medians("linux"), medians("netchannel"));
    let ratio = over(&l, &n);
    let (mut all, mut ratios) = (serde_json::Map::new(), serde_json::Map::new());
    if !with.is_empty() {
        for s in &stacks {
            let m = medians(s.name());
            all.insert(s.name().into(), to_map(&m).into());
            if *s != Stack::Linux {
                ratios.insert(s.name().into(), over(&l, &m).into());
            }
        }
    }
    Ok(Comparison {
        repetitions,
        linux: to_map(&l),
        netchannel: to_map(&n),
        ratio,
        medians: all,
        ratios,
        runs,
    })
}

fn json_num(v: f64) -> serde_json::Value {
    serde_json::Number::from_f64(v).map_or(serde_json::Value::Null, serde_json::Value::Number)
}

pub fn print_comparison(c: &Comparison) {
    println!("{:<18} {:>14} {:>14} {:>10}", "metric (median)", "linux", "netchannel", "ratio");
    for (k, lv) in &c.linux {
        let f = |v: Option<&serde_json::Value>| {
            v.and_then(|v| v.as_f64()).map_or("-".to_string(), |x| format!("{x:.3}"))
        };
        println!(
            "{k:<18} {:>14} {:>14} {:>10}",
            f(Some(lv)),
            f(c.netchannel.get(k)),
            f(c.ratio.get(k))
        );
    }
}

/// The table of a comparison with --with: each stack's medians, then each one's ratio to linux.
pub fn print_comparison_with(c: &Comparison) {
    print!("{}", comparison_with_table(c));
}

fn comparison_with_table(c: &Comparison) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    // In the order they ran (linux, netchannel, then --with's), not the maps' sorted order.
    let mut stacks: Vec<&String> = Vec::new();
    for r in &c.runs {
        if !stacks.contains(&&r.stack) {
            stacks.push(&r.stack);
        }
    }
    let others: Vec<&String> = stacks.iter().copied().filter(|s| *s != "linux").collect();
    let mut head = format!("{:<18}", "metric (median)");
    for s in &stacks {
        head += &format!(" {s:>12}");
    }
    for s in &others {
        head += &format!(" {:>12}", format!("{s}/linux"));
    }
    let _ = writeln!(out, "{head}");
    let get = |m: &serde_json::Map<String, serde_json::Value>, s: &str, k: &str| {
        m.get(s)
            .and_then(|v| v.get(k))
            .and_then(|v| v.as_f64())
            .map_or("-".to_string(), |x| format!("{x:.3}"))
    };
    for k in c.linux.keys() {
        let mut line = format!("{k:<18}");
        for s in &stacks {
            line += &format!(" {:>12}", get(&c.medians, s, k));
        }
        for s in &others {
            line += &format!(" {:>12}", get(&c.ratios, s, k));
        }
        let _ = writeln!(out, "{line}");
    }
    let setup: Vec<String> = c
        .runs
        .iter()
        .filter(|r| r.first_connect_ms.is_some())
        .map(|r| {
            let cert = r.cert_gen_ms.map_or(String::new(), |m| format!(", certificate {m:.2} ms"));
            format!(
                "  {}: first connection {:.2} ms{cert}, all flows open {:.1} ms",
                r.stack,
                r.first_connect_ms.unwrap_or(f64::NAN),
                r.open_ms.unwrap_or(f64::NAN)
            )
        })
        .collect();
    if !setup.is_empty() {
        let _ = writeln!(out, "set-up (each run):");
        for line in setup {
            let _ = writeln!(out, "{line}");
        }
    }
    out
}

pub fn print_result(r: &RunResult) {
    println!(
        "{} {} {} flows={} size={}: goodput {:.2} Gbit/s, {:.0} rps, cpu {:.2} cores (client {:.2}, server {:.2}), {:.2} Gbit/s per core",
        r.stack, r.workload, r.pattern, r.flows, r.size, r.goodput_gbps, r.rps, r.cpu_cores,
        r.client_cpu_cores, r.server_cpu_cores, r.gbps_per_core
    );
    if let Some(l) = r.latency_us {
        println!(
            "  latency us: p50 {:.1} p99 {:.1} p99.9 {:.1} max {:.1}",
            l.p50, l.p99, l.p999, l.max
        );
    }
    if let (Some(peers), Some(c)) = (r.peers.filter(|&p| p > 1), r.new_peer_connect_ms) {
        println!(
            "  {peers} peers: a new peer's first connect p50 {:.2} p99 {:.2} max {:.2} ms; server \
             per flow: {:.0} bytes resident, {:.1} fds",
            c.p50,
            c.p99,
            c.max,
            r.server_rss_per_flow.unwrap_or(f64::NAN),
            r.server_fds_per_flow.unwrap_or(f64::NAN)
        );
    }
    if let Some(first) = r.first_connect_ms {
        let cert = r.cert_gen_ms.map_or(String::new(), |m| format!(", certificate {m:.2} ms"));
        let udp = r.udp_offload.map_or(String::new(), |(gso, gro)| {
            format!("; UDP offload: GSO {gso}, GRO {gro} segments")
        });
        println!(
            "  set-up: first connection {first:.2} ms{cert}, all flows open {:.1} ms{udp}",
            r.open_ms.unwrap_or(f64::NAN)
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_with_table_keeps_the_run_order_and_ratios_to_linux() {
        let run = |stack: &str, rps: f64| RunResult {
            stack: stack.into(),
            rps,
            first_connect_ms: (stack == "quinn").then_some(1.5),
            cert_gen_ms: (stack == "quinn").then_some(0.25),
            open_ms: (stack == "quinn").then_some(2.0),
            ..RunResult::default()
        };
        let runs = vec![run("linux", 100.0), run("netchannel", 200.0), run("quinn", 50.0)];
        let mut medians = serde_json::Map::new();
        let mut ratios = serde_json::Map::new();
        for r in &runs {
            medians.insert(r.stack.clone(), serde_json::json!({ "rps": r.rps }));
            if r.stack != "linux" {
                ratios.insert(r.stack.clone(), serde_json::json!({ "rps": r.rps / 100.0 }));
            }
        }
        let linux: serde_json::Map<_, _> =
            [("rps".to_string(), serde_json::json!(100.0))].into_iter().collect();
        let c = Comparison {
            repetitions: 1,
            linux,
            netchannel: serde_json::Map::new(),
            ratio: serde_json::Map::new(),
            medians,
            ratios,
            runs,
        };
        let t = comparison_with_table(&c);
        let lines: Vec<&str> = t.lines().collect();
        let head: Vec<&str> = lines[0].split_whitespace().collect();
        assert_eq!(
            head[2..],
            ["linux", "netchannel", "quinn", "netchannel/linux", "quinn/linux"],
            "{t}"
        );
        let rps: Vec<&str> = lines[1].split_whitespace().collect();
        assert_eq!(rps, ["rps", "100.000", "200.000", "50.000", "2.000", "0.500"], "{t}");
        assert!(t.contains("quinn: first connection 1.50 ms, certificate 0.25 ms"), "{t}");
    }

    #[test]
    fn compare_stacks_interleave_linux_netchannel_then_with() {
        assert_eq!(compare_stacks(&[]).unwrap(), vec![Stack::Linux, Stack::Netchannel]);
        assert_eq!(
            compare_stacks(&[Stack::Yamux, Stack::Quinn, Stack::Yamux]).unwrap(),
            vec![Stack::Linux, Stack::Netchannel, Stack::Yamux, Stack::Quinn]
        );
        assert!(compare_stacks(&[Stack::Linux]).unwrap_err().contains("--with"));
    }

    #[test]
    fn kernel_sockets_spread_over_processes_by_fd_limit() {
        assert_eq!(processes_for(Stack::Linux, 10_000, 20_000), Ok(1));
        assert_eq!(processes_for(Stack::Linux, 100_000, 20_000), Ok(6));
        assert_eq!(processes_for(Stack::Netchannel, 1_000_000, 20_000), Ok(1));
        assert_eq!(processes_for(Stack::Quinn, 1_000_000, 1_024), Ok(1));
        let err = processes_for(Stack::Linux, 1_000_000, 1_024).unwrap_err();
        assert!(err.contains("open-file limit") && err.contains("RLIMIT_NOFILE"), "{err}");
    }
}
