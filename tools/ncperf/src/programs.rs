//! `ncperf programs`: unmodified programs' own benchmark clients (redis-benchmark, memcslap,
//! iperf3, sockperf) between the testbed's namespaces, each over plain kernel TCP and with both
//! ends under `netchannel run`, interleaved; medians and netchannel/linux ratios.
//!
//! A netchannel run whose client carried no virtual socket (its `--stats-file` says so) is an
//! error, not a figure: a silent fallback to kernel TCP would otherwise read as a ratio near 1.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::metrics::median;
use crate::testbed::{self, NS_A, NS_B};

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Program {
    /// redis-benchmark -c 50 -P 16 -t set,get, 16-byte values.
    Redis16,
    /// The same with 4 KiB values.
    Redis4k,
    /// memcached -t 4 with memcslap --concurrency=16, set then get.
    Memcached,
    /// iperf3 -P 8.
    Iperf3,
    /// sockperf ping-pong, 64-byte messages.
    Sockperf,
}

impl Program {
    pub const ALL: [Program; 5] = [
        Program::Redis16,
        Program::Redis4k,
        Program::Memcached,
        Program::Iperf3,
        Program::Sockperf,
    ];

    /// Where its server listens (inside ncperf-b): a port of its own, since some servers
    /// (sockperf) cannot bind over the TIME_WAIT connections a previous program left.
    fn port(self) -> u16 {
        6390 + self as u16
    }

    fn name(self) -> &'static str {
        match self {
            Program::Redis16 => "redis16",
            Program::Redis4k => "redis4k",
            Program::Memcached => "memcached",
            Program::Iperf3 => "iperf3",
            Program::Sockperf => "sockperf",
        }
    }
}

/// One figure a client reports; `higher_is_better` says which way the ratio is read.
#[derive(Debug, Clone, Serialize)]
pub struct Figure {
    pub metric: String,
    pub unit: &'static str,
    pub higher_is_better: bool,
    pub value: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct Run {
    pub program: Program,
    pub stack: &'static str,
    pub repetition: usize,
    pub figures: Vec<Figure>,
    /// The client's `netchannel run --stats-file` line (netchannel runs).
    pub client_stats: Option<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    pub program: Program,
    pub metric: String,
    pub unit: &'static str,
    pub higher_is_better: bool,
    pub linux: f64,
    pub netchannel: f64,
    /// netchannel / linux.
    pub ratio: f64,
    /// The command each side ran (without `ip netns exec` and `netchannel run`).
    pub server_command: String,
    pub client_command: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub repetitions: usize,
    pub scale: f64,
    pub summaries: Vec<Summary>,
    pub runs: Vec<Run>,
}

pub struct Options {
    pub programs: Vec<Program>,
    pub repetitions: usize,
    /// Multiplies request counts and durations (0.1 for a smoke run).
    pub scale: f64,
    pub netchannel: PathBuf,
}

/// `netchannel` beside this executable (cargo builds both into the same target directory).
pub fn default_netchannel() -> PathBuf {
    let exe = std::env::current_exe().unwrap_or_default();
    exe.with_file_name("netchannel")
}

fn server_argv(p: Program) -> Vec<String> {
    let host = testbed::addr_b().to_string();
    let port = p.port().to_string();
    let v: Vec<&str> = match p {
        Program::Redis16 | Program::Redis4k => vec![
            "redis-server",
            "--port",
            &port,
            "--bind",
            &host,
            "--protected-mode",
            "no",
            "--save",
            "",
            "--appendonly",
            "no",
            "--daemonize",
            "no",
        ],
        Program::Memcached => {
            vec!["memcached", "-t", "4", "-l", &host, "-p", &port, "-U", "0", "-u", "root"]
        }
        Program::Iperf3 => vec!["iperf3", "-s", "-p", &port, "-B", &host],
        Program::Sockperf => vec!["sockperf", "server", "--tcp", "-i", &host, "-p", &port],
    };
    v.into_iter().map(String::from).collect()
}

/// The client invocations of one measurement (memcached: a set run, then a get run).
fn client_argvs(p: Program, scale: f64) -> Vec<Vec<String>> {
    let host = testbed::addr_b().to_string();
    let port = p.port().to_string();
    let n = |base: f64| ((base * scale).round() as u64).max(1).to_string();
    let secs = n(10.0);
    let redis = |count: String, size: &str| {
        ["redis-benchmark", "-h", &host, "-p", &port, "-c", "50", "-P", "16", "-t", "set,get"]
            .into_iter()
            .map(String::from)
            .chain(["-n".into(), count, "-d".into(), size.into(), "--csv".into()])
            .collect::<Vec<String>>()
    };
    let to_strings = |v: Vec<&str>| v.into_iter().map(String::from).collect::<Vec<String>>();
    match p {
        Program::Redis16 => vec![redis(n(2_000_000.0), "16")],
        Program::Redis4k => vec![redis(n(400_000.0), "4096")],
        Program::Memcached => {
            let servers = format!("--servers={host}:{port}");
            let count = format!("--execute-number={}", n(20_000.0));
            ["set", "get"]
                .into_iter()
                .map(|t| {
                    let test = format!("--test={t}");
                    to_strings(vec!["memcslap", &servers, "--concurrency=16", &count, &test])
                })
                .collect()
        }
        Program::Iperf3 => {
            vec![to_strings(vec!["iperf3", "-c", &host, "-p", &port, "-P", "8", "-t", &secs, "-J"])]
        }
        Program::Sockperf => vec![to_strings(vec![
            "sockperf",
            "ping-pong",
            "--tcp",
            "-i",
            &host,
            "-p",
            &port,
            "-m",
            "64",
            "-t",
            &secs,
        ])],
    }
}

fn redis_rps(out: &str, test: &str) -> Option<f64> {
    out.lines()
        .find(|l| l.starts_with(&format!("\"{test}\"")))?
        .split(',')
        .nth(1)?
        .trim_matches('"')
        .parse()
        .ok()
}

/// memcslap: "Time to set 320000 keys by 16 threads: 1.234 seconds." (also "get").
fn memcslap_rate(out: &str) -> Option<f64> {
    let line =
        out.lines().find(|l| l.starts_with("Time to set") || l.starts_with("Time to get"))?;
    let keys: f64 = line.split_whitespace().nth(3)?.parse().ok()?;
    let secs: f64 = line.split(':').nth(1)?.split_whitespace().next()?.parse().ok()?;
    (secs > 0.0).then(|| keys / secs)
}

fn sockperf_percentile(out: &str, p: &str) -> Option<f64> {
    out.lines().find_map(|l| l.split(&format!("percentile {p} =")).nth(1))?.trim().parse().ok()
}

fn parse(p: Program, invocation: usize, out: &str) -> Result<Vec<Figure>, String> {
    let fig = |metric: &str, unit, higher_is_better, value: Option<f64>| {
        value
            .map(|value| Figure { metric: metric.into(), unit, higher_is_better, value })
            .ok_or_else(|| format!("{}: no {metric} in the client's output:\n{out}", p.name()))
    };
    Ok(match p {
        Program::Redis16 | Program::Redis4k => vec![
            fig("SET", "requests/s", true, redis_rps(out, "SET"))?,
            fig("GET", "requests/s", true, redis_rps(out, "GET"))?,
        ],
        Program::Memcached => {
            let metric = if invocation == 0 { "set" } else { "get" };
            vec![fig(metric, "keys/s", true, memcslap_rate(out))?]
        }
        Program::Iperf3 => {
            let v: Option<f64> = serde_json::from_str::<serde_json::Value>(out)
                .ok()
                .and_then(|v| v["end"]["sum_received"]["bits_per_second"].as_f64());
            vec![fig("-P 8 goodput", "Gbit/s", true, v.map(|b| b / 1e9))?]
        }
        Program::Sockperf => vec![
            fig("ping-pong p50", "us", false, sockperf_percentile(out, "50.000"))?,
            fig("ping-pong p99", "us", false, sockperf_percentile(out, "99.000"))?,
        ],
    })
}

struct Side<'a> {
    netns: &'static str,
    carried: Option<(&'a Path, PathBuf)>,
}

impl Side<'_> {
    fn command(&self, argv: &[String]) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", self.netns]);
        if let Some((netchannel, stats)) = &self.carried {
            c.arg(netchannel).arg("run").arg("--stats-file").arg(stats).arg("--");
        }
        c.args(argv);
        c
    }
}

/// A server process, stopped (SIGTERM, then SIGKILL) when dropped.
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        // Our own child, not reaped yet: its pid is still its own.
        if let Some(pid) = rustix::process::Pid::from_raw(self.0.id() as i32) {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
        }
        let deadline = Instant::now() + Duration::from_secs(3);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.0.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn wait_listening(port: u16) -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_secs(10);
    let filter = format!("sport = :{port}");
    while Instant::now() < deadline {
        let out = Command::new("ip")
            .args(["netns", "exec", NS_B, "ss", "-Hltn", &filter])
            .output()
            .map_err(|e| format!("ss: {e}"))?;
        if !out.stdout.is_empty() {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Err(format!("no server listening on port {port} in {NS_B} after 10 s"))
}

fn measure(
    p: Program,
    carried: bool,
    opts: &Options,
    dir: &Path,
    repetition: usize,
) -> Result<Run, String> {
    let stats = |side: &str| dir.join(format!("{}-{side}-{repetition}.stats", p.name()));
    let (server_stats, client_stats) = (stats("server"), stats("client"));
    for f in [&server_stats, &client_stats] {
        let _ = std::fs::remove_file(f);
    }
    let nc = opts.netchannel.as_path();
    let server_side = Side { netns: NS_B, carried: carried.then_some((nc, server_stats)) };
    let client_side = Side { netns: NS_A, carried: carried.then(|| (nc, client_stats.clone())) };
    let server = server_side
        .command(&server_argv(p))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("cannot start {}'s server: {e}", p.name()))?;
    let server = Server(server);
    wait_listening(p.port())?;
    let mut figures = Vec::new();
    for (i, argv) in client_argvs(p, opts.scale).iter().enumerate() {
        let out = client_side
            .command(argv)
            .stdin(Stdio::null())
            .output()
            .map_err(|e| format!("cannot run {}: {e}", argv[0]))?;
        let text = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        if !out.status.success() {
            return Err(format!("{} failed ({}):\n{text}", argv.join(" "), out.status));
        }
        figures.extend(parse(p, i, &text)?);
    }
    drop(server);
    let client_stats = if carried {
        let line = std::fs::read_to_string(&client_stats).unwrap_or_default();
        let carried_sockets: u64 = line
            .split("virtual sockets ")
            .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
            .sum();
        if carried_sockets == 0 {
            return Err(format!(
                "{}: the client carried no virtual socket (stats: {:?}): not a netchannel figure",
                p.name(),
                line.trim()
            ));
        }
        Some(line.trim().to_string())
    } else {
        None
    };
    Ok(Run {
        program: p,
        stack: if carried { "netchannel" } else { "linux" },
        repetition,
        figures,
        client_stats,
    })
}

pub fn run(opts: &Options) -> Result<Report, String> {
    if !opts.netchannel.is_file() {
        return Err(format!(
            "{} not found (cargo build --release -p netchannel-preload, or --netchannel PATH)",
            opts.netchannel.display()
        ));
    }
    testbed::up(testbed::Options::default())?;
    let dir = std::env::temp_dir().join(format!("ncperf-programs-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let mut runs = Vec::new();
    for &p in &opts.programs {
        for rep in 0..opts.repetitions {
            // Alternate which stack goes first, so drift in the machine's state hits both.
            let order = if rep % 2 == 0 { [false, true] } else { [true, false] };
            for carried in order {
                eprintln!(
                    "ncperf programs: {} {} repetition {}/{}",
                    p.name(),
                    if carried { "netchannel" } else { "linux" },
                    rep + 1,
                    opts.repetitions
                );
                runs.push(measure(p, carried, opts, &dir, rep)?);
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    let mut summaries = Vec::new();
    for &p in &opts.programs {
        let first = runs.iter().find(|r| r.program == p).expect("measured");
        let clients: Vec<String> =
            client_argvs(p, opts.scale).iter().map(|a| a.join(" ")).collect();
        for f in &first.figures {
            let values = |stack: &str| -> Vec<f64> {
                runs.iter()
                    .filter(|r| r.program == p && r.stack == stack)
                    .filter_map(|r| r.figures.iter().find(|g| g.metric == f.metric))
                    .map(|g| g.value)
                    .collect()
            };
            let (linux, netchannel) = (median(&values("linux")), median(&values("netchannel")));
            summaries.push(Summary {
                program: p,
                metric: f.metric.clone(),
                unit: f.unit,
                higher_is_better: f.higher_is_better,
                linux,
                netchannel,
                ratio: netchannel / linux,
                server_command: server_argv(p).join(" "),
                client_command: clients.join("; "),
            });
        }
    }
    Ok(Report { repetitions: opts.repetitions, scale: opts.scale, summaries, runs })
}

pub fn print(r: &Report) {
    println!(
        "{:<10} {:<14} {:>12} {:>12} {:>7}  unit ({} repetitions, medians)",
        "program", "metric", "linux", "netchannel", "nc/lx", r.repetitions
    );
    for s in &r.summaries {
        println!(
            "{:<10} {:<14} {:>12.2} {:>12.2} {:>6.2}x  {}{}",
            s.program.name(),
            s.metric,
            s.linux,
            s.netchannel,
            s.ratio,
            s.unit,
            if s.higher_is_better { "" } else { " (lower is better)" }
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_each_clients_output() {
        let csv = "\"test\",\"rps\",\"avg_latency_ms\"\n\"SET\",\"412371.12\",\"1.5\"\n\"GET\",\"500000.00\",\"1.1\"\n";
        let f = parse(Program::Redis16, 0, csv).unwrap();
        assert_eq!((f[0].value, f[1].value), (412371.12, 500000.0));
        let slap = "Time to set           32000 keys by   16 threads:     0.800 seconds.\n";
        assert_eq!(parse(Program::Memcached, 0, slap).unwrap()[0].value, 40000.0);
        assert_eq!(parse(Program::Memcached, 1, slap).unwrap()[0].metric, "get");
        let iperf = r#"{"end":{"sum_received":{"bits_per_second":2.5e9}}}"#;
        assert_eq!(parse(Program::Iperf3, 0, iperf).unwrap()[0].value, 2.5);
        let sp = "sockperf: ---> percentile 99.000 =   31.250\nsockperf: ---> percentile 50.000 =   12.500\n";
        let f = parse(Program::Sockperf, 0, sp).unwrap();
        assert_eq!((f[0].value, f[1].value), (12.5, 31.25));
        assert!(!f[0].higher_is_better);
        assert!(parse(Program::Redis4k, 0, "ERROR: connection refused").is_err());
    }
}
