//! ncperf: the host-stack studies' workloads on Linux TCP and on netchannel, side by side.

#![deny(unsafe_code)]

mod apps;
mod bars;
mod cdf;
mod metrics;
mod mux;
mod net;
mod orchestrate;
mod profile;
mod programs;
mod suite;
mod testbed;

use std::io::{BufRead, Write};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use netchannel::Policy;

use apps::{Pattern, Workload};
use net::{DemoteTo, EngineOpts, IsolationOpt, Stack};
use orchestrate::Hosts;

#[derive(Parser)]
#[command(
    name = "ncperf",
    version,
    about = "Linux TCP and netchannel under the host-stack studies' workloads"
)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// One measurement of one stack, both ends on this machine.
    Run {
        #[arg(long, value_enum)]
        stack: Stack,
        #[command(flatten)]
        run: RunArgs,
        /// Print one JSON object instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Both stacks, interleaved, medians and netchannel/linux ratios.
    Compare {
        #[command(flatten)]
        run: RunArgs,
        #[arg(long, default_value_t = 3)]
        repetitions: usize,
        /// More stacks interleaved with linux and netchannel (yamux, quinn, h2): medians of
        /// each and ratios against linux.
        #[arg(long, value_enum, value_delimiter = ',')]
        with: Vec<Stack>,
        #[arg(long)]
        json: bool,
        /// Also draw each stack's ratio to linux per metric, with the repetitions' spread.
        #[arg(long, value_name = "PATH")]
        png: Option<PathBuf>,
    },
    /// Bar charts from results written earlier (`compare --json`, `programs --json`): each
    /// stack's ratio to linux per metric with its repetitions' spread, on a log scale.
    Plot {
        #[arg(long, value_name = "PATH")]
        png: PathBuf,
        #[arg(long, default_value = "netchannel and the others against linux")]
        title: String,
        /// `[LABEL=]FILE[@METRIC,...]` each (METRIC as in the JSON: goodput_gbps,
        /// latency_us.p99, ...; default: the usual ones the result has).
        #[arg(required = true)]
        inputs: Vec<String>,
    },
    /// Run a workload under `perf record` and break its CPU time down by the studies' taxonomy.
    Profile {
        /// Required unless --compare.
        #[arg(long, value_enum)]
        stack: Option<Stack>,
        #[command(flatten)]
        run: RunArgs,
        #[arg(long)]
        json: bool,
        /// Profile both stacks on the same workload and draw a stacked-bar PNG.
        #[arg(long)]
        compare: bool,
        /// Where --compare writes its PNG.
        #[arg(long, default_value = "profile-compare.png")]
        out: PathBuf,
        /// Classification rules instead of the shipped profile-rules.txt.
        #[arg(long)]
        rules: Option<PathBuf>,
        /// Keep the window's recording in this directory (STACK.data), for `perf report -i`.
        #[arg(long)]
        keep_data: Option<PathBuf>,
    },
    /// The whole matrix for both stacks: JSON per run, a markdown report and PNG plots.
    Suite {
        #[arg(long)]
        out: PathBuf,
        /// A reduced matrix that finishes in under 5 minutes.
        #[arg(long)]
        quick: bool,
        #[arg(long, value_enum, default_value_t = Hosts::Netns)]
        hosts: Hosts,
        /// Also profile every run and report classification coverage.
        #[arg(long)]
        profile: bool,
    },
    /// Latency CDFs of several results in one PNG: `LABEL=FILE.json` each (a `compare --json`
    /// output: its median-p99 run of each stack is drawn; or a `run --json` output).
    Cdf {
        #[arg(long)]
        out: PathBuf,
        #[arg(long, default_value = "Latency")]
        title: String,
        #[arg(required = true)]
        inputs: Vec<String>,
    },
    /// Unmodified programs' own benchmark clients (redis-benchmark, memcslap, iperf3,
    /// sockperf, wrk against nginx, pgbench) between the namespaces, over kernel TCP and under
    /// `netchannel run`.
    Programs {
        /// Which programs (default: all).
        #[arg(long, value_enum, value_delimiter = ',')]
        only: Vec<programs::Program>,
        #[arg(long, default_value_t = 3)]
        repetitions: usize,
        /// Multiplies request counts and durations (e.g. 0.1 for a smoke run).
        #[arg(long, default_value_t = 1.0)]
        scale: f64,
        /// The `netchannel` launcher (default: beside ncperf).
        #[arg(long)]
        netchannel: Option<PathBuf>,
        /// `netchannel run --path`: direct, or relay (the older path, for comparison).
        #[arg(long, default_value = "direct", value_parser = ["direct", "relay"])]
        path: String,
        /// Also write every run and the summary as JSON to this file.
        #[arg(long)]
        json: Option<PathBuf>,
        /// Also draw netchannel's ratio to linux per program and metric, with the spread.
        #[arg(long, value_name = "PATH")]
        png: Option<PathBuf>,
    },
    /// Manage the two-namespace testbed.
    Testbed {
        #[arg(value_enum)]
        action: TestbedAction,
        #[arg(long, default_value_t = 1500)]
        mtu: u32,
        #[arg(long, value_enum, default_value_t = OnOff::On)]
        gro: OnOff,
        #[arg(long, value_enum, default_value_t = OnOff::On)]
        tso: OnOff,
    },
    /// Serve ncperf clients (for measurements between two real hosts).
    Server {
        #[arg(long, value_enum)]
        stack: Stack,
        /// Kernel TCP: the listening address. netchannel: the engine's channel listener.
        #[arg(long, default_value = "0.0.0.0:5299")]
        listen: SocketAddr,
        #[arg(long, default_value_t = 4)]
        channels: usize,
        #[arg(long, default_value_t = Policy::RoundRobin)]
        policy: Policy,
        /// Driven by `ncperf run` over stdin.
        #[arg(long, hide = true)]
        coordinated: bool,
        /// Enter this network namespace first.
        #[arg(long)]
        netns: Option<PathBuf>,
        /// netchannel: when throughput-class work is demoted (`Config::isolation`).
        #[arg(long, value_enum, default_value_t = IsolationOpt::Auto)]
        isolation: IsolationOpt,
        /// netchannel: to what throughput-class work is demoted.
        #[arg(long, value_enum, default_value_t = DemoteTo::Idle)]
        demote_to: DemoteTo,
        /// netchannel: nice value of the latency-class worker (`Config::latency_policy`).
        #[arg(long, default_value_t = 0, allow_hyphen_values = true)]
        latency_nice: i8,
        /// netchannel: leave the channels' congestion control at the host's default.
        #[arg(long)]
        host_congestion: bool,
        /// yamux, quinn, h2: streams one connection may carry (yamux's max_num_streams,
        /// quinn's max_concurrent_bidi_streams; ncperf run sets it from the plan).
        #[arg(long, default_value_t = 1000)]
        max_streams: usize,
        /// yamux, quinn, h2: worker threads of the server's tokio runtime (ncperf run: the
        /// plan's receiver apps; 0: one per CPU).
        #[arg(long, default_value_t = 0)]
        apps: usize,
        /// netchannel: `Config::max_sessions` (default: the engine's).
        #[arg(long)]
        max_sessions: Option<usize>,
        /// netchannel: `Config::max_peer_buffered`, bytes (default: the engine's).
        #[arg(long)]
        max_peer_buffered: Option<u64>,
        /// netchannel: `Config::max_channels` (default: the engine's, at least --channels).
        #[arg(long)]
        max_channels: Option<usize>,
        /// netchannel: `Config::session_shards` (default: the engine's).
        #[arg(long)]
        shards: Option<usize>,
        /// netchannel: `Config::app_demotion`.
        #[arg(long, value_enum, default_value = "sticky")]
        app_demotion: net::AppDemotionArg,
    },
    /// Run a workload against an `ncperf server` (measured at the client).
    Client {
        #[arg(long, value_enum)]
        stack: Stack,
        #[arg(long)]
        connect: SocketAddr,
        #[command(flatten)]
        run: RunArgs,
        #[arg(long, hide = true)]
        coordinated: bool,
        #[arg(long)]
        netns: Option<PathBuf>,
        #[arg(long)]
        json: bool,
        /// quinn: the server's certificate, hex DER, as its `cert` line prints it.
        #[arg(long)]
        server_cert: Option<String>,
    },
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum TestbedAction {
    Up,
    Down,
    Status,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum OnOff {
    On,
    Off,
}

/// Workload arguments shared by run, compare and client.
#[derive(Args, Clone, Debug)]
pub struct RunArgs {
    #[arg(long, value_enum, default_value_t = Workload::Stream)]
    pub workload: Workload,
    #[arg(long, value_enum, default_value_t = Pattern::Single)]
    pub pattern: Pattern,
    #[arg(long, default_value_t = 1)]
    pub flows: u64,
    /// Bytes per write (stream) or per message (rr).
    #[arg(long, default_value_t = 65536)]
    pub size: u64,
    /// Measured seconds.
    #[arg(long, default_value_t = 5.0)]
    pub duration: f64,
    /// Seconds of traffic before measuring.
    #[arg(long, default_value_t = 1.0)]
    pub warmup: f64,
    /// netchannel: throughput channels per peer.
    #[arg(long, default_value_t = 4)]
    pub channels: usize,
    #[arg(long, default_value_t = Policy::RoundRobin)]
    pub policy: Policy,
    #[arg(long, value_enum, default_value_t = Hosts::Netns)]
    pub hosts: Hosts,
    /// rr, and mixed's L flows: open loop at this many requests per second per flow (latency
    /// from scheduled send).
    #[arg(long)]
    pub rate: Option<f64>,
    /// mixed: 4 KiB ping-pong flows.
    #[arg(long)]
    pub latency_flows: Option<u64>,
    /// mixed: bulk stream flows of --size writes.
    #[arg(long)]
    pub throughput_flows: Option<u64>,
    /// Application threads per side at most.
    #[arg(long, default_value_t = 8)]
    pub max_apps: usize,
    /// mixed: run the L-apps and the T-apps as separate process pairs, each with its own
    /// engine (as applications share a host); the T-apps' engines isolate always.
    #[arg(long)]
    pub split_processes: bool,
    /// netchannel: when throughput-class work is demoted (`Config::isolation`).
    #[arg(long, value_enum, default_value_t = IsolationOpt::Auto)]
    pub isolation: IsolationOpt,
    /// netchannel: to what throughput-class work is demoted (`Config::throughput_policy`).
    #[arg(long, value_enum, default_value_t = DemoteTo::Idle)]
    pub demote_to: DemoteTo,
    /// netchannel: nice value of the latency-class worker (`Config::latency_policy`; below 0
    /// needs CAP_SYS_NICE).
    #[arg(long, default_value_t = 0, allow_hyphen_values = true)]
    pub latency_nice: i8,
    /// netchannel: leave the channels' congestion control at the host's default
    /// (`net.ipv4.tcp_congestion_control`) instead of `Config::congestion`'s (cubic, else reno).
    #[arg(long)]
    pub host_congestion: bool,
    /// yamux, quinn, h2: connections per pair of sender and receiver apps, the flows spread
    /// over them (set it to --channels to match netchannel's channel count).
    #[arg(long, default_value_t = 1)]
    pub mux_connections: usize,
    /// netchannel: client engines, each a peer of the server with an address of its own
    /// (10.215.0.0/16 in the client namespace, 127.215.0.0/16 on loopback); the flows take
    /// them in turn, so --flows at least --peers.
    #[arg(long, default_value_t = 1)]
    pub peers: usize,
    /// The index of this process's first peer (ncperf run splits --peers over processes).
    #[arg(long, default_value_t = 0, hide = true)]
    pub first_peer: usize,
    /// netchannel: the server engine's `Config::max_sessions` (default: the engine's).
    #[arg(long)]
    pub max_sessions: Option<usize>,
    /// netchannel: every engine's `Config::max_peer_buffered`, the receive credit one peer may
    /// be granted beyond its streams' minimum windows, in bytes (default: the engine's).
    #[arg(long)]
    pub max_peer_buffered: Option<u64>,
    /// netchannel: every engine's `Config::max_channels`, the most throughput channels per peer
    /// (a session starts with --channels and adds one while more application threads send to
    /// the peer than it has channels; default: the engine's, at least --channels; set it to
    /// --channels for a fixed count).
    #[arg(long)]
    pub max_channels: Option<usize>,
    /// netchannel: every engine's `Config::session_shards`, the sessions a client engine opens
    /// to the server, one per application thread modulo this (default: the engine's, a
    /// quarter of the cores from 1 to 8)
    #[arg(long)]
    pub shards: Option<usize>,
    /// netchannel: how application threads are demoted while isolating (`Config::app_demotion`;
    /// the workers always are)
    #[arg(long, value_enum, default_value = "sticky")]
    pub app_demotion: net::AppDemotionArg,
}

fn main() {
    let cli = Cli::parse();
    if let Err(e) = dispatch(cli.command) {
        eprintln!("ncperf: {e}");
        std::process::exit(1);
    }
}

fn enter(netns: &Option<PathBuf>) -> Result<(), String> {
    if let Some(ns) = netns {
        netchannel::enter_netns(ns).map_err(|e| e.to_string())?;
    }
    Ok(())
}

fn dispatch(cmd: Cmd) -> Result<(), String> {
    match cmd {
        Cmd::Run { stack, run, json } => {
            let r = orchestrate::run_once(&run, stack)?;
            if json {
                println!("{}", serde_json::to_string(&r).map_err(|e| e.to_string())?);
            } else {
                orchestrate::print_result(&r);
            }
        }
        Cmd::Compare { run, repetitions, with, json, png } => {
            let c = orchestrate::compare(&run, repetitions, &with)?;
            if let Some(out) = &png {
                let doc = serde_json::to_value(&c).map_err(|e| e.to_string())?;
                let label =
                    format!("{} {} {} B", run.workload.name(), run.pattern.name(), run.size);
                bars::draw(out, &label, &bars::from_compare(&doc, &label, &[])?)?;
                eprintln!("wrote {}", out.display());
            }
            if json {
                println!("{}", serde_json::to_string(&c).map_err(|e| e.to_string())?);
            } else if with.is_empty() {
                orchestrate::print_comparison(&c);
            } else {
                orchestrate::print_comparison_with(&c);
            }
        }
        Cmd::Suite { out, quick, hosts, profile } => suite::run(&out, quick, hosts, profile)?,
        Cmd::Cdf { out, title, inputs } => cdf::run(&out, &title, &inputs)?,
        Cmd::Plot { png, title, inputs } => {
            bars::plot(&png, &title, &inputs)?;
            eprintln!("wrote {}", png.display());
        }
        Cmd::Profile { stack, run, json, compare, out, rules, keep_data } => {
            let rules = profile::Rules::load(rules.as_deref())?;
            let stacks = match (compare, stack) {
                (true, _) => vec![Stack::Linux, Stack::Netchannel],
                (false, Some(s)) => vec![s],
                (false, None) => return Err("--stack is required (or --compare for both)".into()),
            };
            let mut reports = Vec::new();
            for s in stacks {
                let (result, b) = profile::profile(&run, s, &rules, keep_data.as_deref())?;
                let report = b.report(s.name());
                if json {
                    let v = serde_json::json!({ "run": result, "profile": report });
                    println!("{v}");
                } else {
                    orchestrate::print_result(&result);
                    profile::print_table(&report);
                    println!();
                }
                reports.push(report);
            }
            if compare {
                suite::register_font()?;
                let title = format!(
                    "CPU breakdown, {} {} size {}",
                    run.workload.name(),
                    run.pattern.name(),
                    run.size
                );
                profile::stacked_bars(&out, &reports, &title)?;
                eprintln!("wrote {}", out.display());
            }
        }
        Cmd::Programs { only, repetitions, scale, netchannel, path, json, png } => {
            let opts = programs::Options {
                programs: if only.is_empty() { programs::Program::ALL.to_vec() } else { only },
                repetitions: repetitions.max(1),
                scale,
                netchannel: netchannel.unwrap_or_else(programs::default_netchannel),
                path,
            };
            let report = programs::run(&opts)?;
            programs::print(&report);
            if let Some(path) = json {
                let text = serde_json::to_string_pretty(&report).map_err(|e| e.to_string())?;
                std::fs::write(&path, text).map_err(|e| format!("{}: {e}", path.display()))?;
            }
            if let Some(out) = &png {
                let doc = serde_json::to_value(&report).map_err(|e| e.to_string())?;
                bars::draw(
                    out,
                    "unmodified programs: netchannel run against kernel TCP",
                    &bars::from_programs(&doc)?,
                )?;
                eprintln!("wrote {}", out.display());
            }
        }
        Cmd::Testbed { action, mtu, gro, tso } => match action {
            TestbedAction::Up => {
                testbed::up(testbed::Options {
                    mtu,
                    gro: gro == OnOff::On,
                    tso: tso == OnOff::On,
                })?;
                print!("{}", testbed::status()?);
            }
            TestbedAction::Down => testbed::down()?,
            TestbedAction::Status => print!("{}", testbed::status()?),
        },
        Cmd::Server {
            stack,
            listen,
            channels,
            policy,
            coordinated,
            netns,
            isolation,
            demote_to,
            latency_nice,
            host_congestion,
            max_streams,
            apps,
            max_sessions,
            max_peer_buffered,
            max_channels,
            shards,
            app_demotion,
        } => {
            enter(&netns)?;
            orchestrate::raise_fd_limit();
            if stack.is_mux() {
                let apps = if apps > 0 {
                    apps
                } else {
                    std::thread::available_parallelism().map_or(1, |n| n.get())
                };
                return mux::run_server(stack, listen, coordinated, max_streams, apps)
                    .map_err(|e| format!("server: {e}"));
            }
            let opts = EngineOpts {
                channels,
                policy,
                isolation,
                demote_to,
                latency_nice,
                host_congestion,
                peers: 1,
                first_peer: 0,
                max_sessions,
                max_peer_buffered,
                max_channels,
                shards,
                app_demotion,
            };
            apps::run_server(stack, listen, opts, coordinated)
                .map_err(|e| format!("server: {e}"))?;
        }
        Cmd::Client { stack, connect, run, coordinated, netns, json, server_cert } => {
            enter(&netns)?;
            orchestrate::raise_fd_limit();
            let server_cert = server_cert
                .map(|h| mux::unhex(&h).map_err(|e| format!("--server-cert: {e}")))
                .transpose()?;
            client(stack, connect, &run, coordinated, json, server_cert)?;
        }
    }
    Ok(())
}

fn client(
    stack: Stack,
    server: SocketAddr,
    run: &RunArgs,
    coordinated: bool,
    json: bool,
    server_cert: Option<Vec<u8>>,
) -> Result<(), String> {
    let plan = apps::plan(
        run.workload,
        run.pattern,
        run.flows,
        run.size as u32,
        (run.latency_flows.unwrap_or(0), run.throughput_flows.unwrap_or(0)),
        run.max_apps,
    )?;
    let args = apps::ClientArgs {
        stack,
        server,
        engine: EngineOpts {
            channels: run.channels,
            policy: run.policy,
            isolation: run.isolation,
            demote_to: run.demote_to,
            latency_nice: run.latency_nice,
            host_congestion: run.host_congestion,
            peers: run.peers,
            first_peer: run.first_peer,
            max_sessions: None,
            max_peer_buffered: run.max_peer_buffered,
            max_channels: run.max_channels,
            shards: run.shards,
            app_demotion: run.app_demotion,
        },
        plan,
        rate: run.rate,
        idle: run.workload == Workload::Idle,
        mux_connections: run.mux_connections,
        server_cert,
    };
    let (warmup, duration) = (run.warmup, run.duration);
    let window = move || -> std::io::Result<apps::Window> {
        if coordinated {
            println!("connected");
            std::io::stdout().flush()?;
            let mut line = String::new();
            std::io::stdin().lock().read_line(&mut line)?;
            apps::parse_go(&line)
                .ok_or_else(|| std::io::Error::other(format!("bad go line '{}'", line.trim())))
        } else {
            let start = apps::unix_ns_after(Duration::from_secs_f64(warmup));
            Ok(apps::Window::from_unix(start, Duration::from_secs_f64(duration).as_nanos() as u64))
        }
    };
    let cpu0 = metrics::read_machine_cpu();
    let own0 = metrics::read_process_ticks(std::process::id());
    let report = apps::run_client(args, window).map_err(|e| format!("client: {e}"))?;
    if coordinated {
        println!("{}", serde_json::to_string(&report).map_err(|e| e.to_string())?);
        return Ok(());
    }
    // Standalone: only this host's view (client-side bytes; CPU of this machine and process,
    // warm-up included since there is no orchestrator to sample the window).
    let tps = metrics::clock_ticks_per_second();
    let total = warmup + duration;
    let busy = match (cpu0, metrics::read_machine_cpu()) {
        (Some(a), Some(b)) => metrics::busy_cores(b.busy - a.busy, tps, total),
        _ => 0.0,
    };
    let own = match (own0, metrics::read_process_ticks(std::process::id())) {
        (Some(a), Some(b)) => metrics::busy_cores(b - a, tps, total),
        _ => 0.0,
    };
    let hist = metrics::histogram_from_pairs(&report.latency_hist);
    let goodput = metrics::gbps(report.bytes, duration);
    let r = metrics::RunResult {
        stack: stack.name().into(),
        workload: run.workload.name().into(),
        pattern: run.pattern.name().into(),
        flows: report.flows,
        size: run.size,
        duration_s: duration,
        warmup_s: warmup,
        goodput_gbps: goodput,
        rps: report.rpcs as f64 / duration,
        latency_us: metrics::percentiles(&hist),
        cpu_cores: busy,
        client_cpu_cores: own,
        server_cpu_cores: f64::NAN,
        gbps_per_core: if busy > 0.0 { goodput / busy } else { 0.0 },
        hosts: "remote".into(),
        processes: 1,
        rpcs: report.rpcs,
        mux_connections: stack.is_mux().then_some(run.mux_connections),
        first_connect_ms: report.first_connect_us.map(|us| us as f64 / 1e3),
        open_ms: report.open_us.map(|us| us as f64 / 1e3),
        ..Default::default()
    };
    if json {
        println!("{}", serde_json::to_string(&r).map_err(|e| e.to_string())?);
    } else {
        orchestrate::print_result(&r);
    }
    Ok(())
}
