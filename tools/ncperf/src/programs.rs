//! `ncperf programs`: unmodified programs' own benchmark clients (redis-benchmark, memcslap,
//! iperf3, sockperf, wrk against nginx, pgbench against PostgreSQL) between the testbed's
//! namespaces, each over plain kernel TCP and with both ends under `netchannel run`,
//! interleaved; medians and netchannel/linux ratios, and which data path (direct or relayed)
//! each side's connections took, from the `--stats-file` lines.
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
    /// nginx (master and 2 forked workers) serving a 4 KiB file to wrk -t 2 -c 16.
    Nginx,
    /// PostgreSQL (a forked backend per connection) under pgbench -c 8 -j 2, TPC-B-like.
    Pgbench,
}

impl Program {
    pub const ALL: [Program; 7] = [
        Program::Redis16,
        Program::Redis4k,
        Program::Memcached,
        Program::Iperf3,
        Program::Sockperf,
        Program::Nginx,
        Program::Pgbench,
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
            Program::Nginx => "nginx",
            Program::Pgbench => "pgbench",
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
    /// The server's, one line per process (forked workers write their own).
    pub server_stats: Option<String>,
    /// Connections each side served on the direct path and through a relay, summed over its
    /// processes: `[client direct, client relayed, server direct, server relayed]`; `None` for
    /// a side none of whose processes wrote a stats line.
    pub paths: Option<[Option<u64>; 6]>,
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
    /// Which data path the netchannel runs' connections took (the first repetition's).
    pub paths: Option<[Option<u64>; 6]>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// `netchannel run --path`.
    pub path: String,
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
    /// `netchannel run --path`: direct (default) or relay.
    pub path: String,
}

/// `netchannel` beside this executable (cargo builds both into the same target directory).
pub fn default_netchannel() -> PathBuf {
    let exe = std::env::current_exe().unwrap_or_default();
    exe.with_file_name("netchannel")
}

fn server_argv(p: Program, dir: &Path) -> Vec<String> {
    let host = testbed::addr_b().to_string();
    let port = p.port().to_string();
    let conf = dir.join("nginx.conf").display().to_string();
    let prefix = dir.display().to_string();
    let data = dir.join("pgdata").display().to_string();
    let postgres = postgres_bin().join("postgres").display().to_string();
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
        Program::Nginx => vec!["nginx", "-c", &conf, "-p", &prefix],
        Program::Pgbench => vec![
            "runuser",
            "-u",
            "nobody",
            "--",
            &postgres,
            "-D",
            &data,
            "-k",
            &data,
            "-h",
            &host,
            "-p",
            &port,
            "-c",
            "fsync=off",
            "-c",
            "synchronous_commit=off",
            "-c",
            "full_page_writes=off",
        ],
    };
    v.into_iter().map(String::from).collect()
}

/// PostgreSQL's programs: Debian keeps them in /usr/lib/postgresql/VERSION/bin (the newest).
fn postgres_bin() -> PathBuf {
    let mut found: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .filter_map(|e| {
            let e = e.ok()?;
            Some((e.file_name().to_str()?.parse().ok()?, e.path().join("bin")))
        })
        .filter(|(_, bin)| bin.join("pgbench").exists())
        .collect();
    found.sort();
    found.pop().map(|(_, bin)| bin).unwrap_or_else(|| PathBuf::from("/usr/lib/postgresql/bin"))
}

/// What a server needs before it starts, made once per `ncperf programs` run in `dir`.
fn prepare(p: Program, dir: &Path) -> Result<(), String> {
    let run = |c: &mut Command| -> Result<(), String> {
        let out = c.output().map_err(|e| format!("{c:?}: {e}"))?;
        if out.status.success() {
            Ok(())
        } else {
            Err(format!("{c:?}: {}", String::from_utf8_lossy(&out.stderr)))
        }
    };
    match p {
        Program::Nginx => {
            let html = dir.join("html");
            std::fs::create_dir_all(&html).map_err(|e| e.to_string())?;
            std::fs::write(html.join("f.txt"), vec![b'x'; 4096]).map_err(|e| e.to_string())?;
            let d = dir.display();
            let conf = format!(
                "daemon off; master_process on; worker_processes 2; pid {d}/nginx.pid;\n\
                 error_log {d}/error.log; events {{ worker_connections 1024; }}\n\
                 http {{ access_log off; client_body_temp_path {d}; proxy_temp_path {d};\n\
                 fastcgi_temp_path {d}; uwsgi_temp_path {d}; scgi_temp_path {d};\n\
                 server {{ listen {a}:{port}; root {h}; }} }}\n",
                a = testbed::addr_b(),
                port = p.port(),
                h = html.display()
            );
            std::fs::write(dir.join("nginx.conf"), conf).map_err(|e| e.to_string())
        }
        Program::Pgbench => {
            // PostgreSQL refuses to run as root: nobody owns the data directory.
            let data = dir.join("pgdata");
            if data.exists() {
                return Ok(());
            }
            std::fs::create_dir_all(&data).map_err(|e| e.to_string())?;
            run(Command::new("chown").arg("nobody:").arg(dir).arg(&data))?;
            run(Command::new("runuser")
                .args(["-u", "nobody", "--"])
                .arg(postgres_bin().join("initdb"))
                .args(["-A", "trust", "-U", "postgres", "--no-sync", "-D"])
                .arg(&data))?;
            let mut hba = std::fs::OpenOptions::new()
                .append(true)
                .open(data.join("pg_hba.conf"))
                .map_err(|e| e.to_string())?;
            std::io::Write::write_all(&mut hba, b"host all all 0.0.0.0/0 trust\n")
                .map_err(|e| e.to_string())
        }
        _ => Ok(()),
    }
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
        Program::Nginx => {
            let url = format!("http://{host}:{port}/f.txt");
            vec![to_strings(vec!["wrk", "-t", "2", "-c", "16", "-d", &secs, &url])]
        }
        Program::Pgbench => {
            let pgbench = postgres_bin().join("pgbench").display().to_string();
            let conn = ["-h", &host, "-p", &port, "-U", "postgres"];
            let init = [&pgbench as &str].into_iter().chain(conn).chain(["-i", "-q", "postgres"]);
            let bench = [&pgbench as &str]
                .into_iter()
                .chain(conn)
                .chain(["-c", "8", "-j", "2", "-T", &secs, "postgres"]);
            vec![to_strings(init.collect()), to_strings(bench.collect())]
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

/// memcslap: "Time to set 320000 keys by 16 threads: 1.234 seconds." (`test`: set or get).
/// A get run first stores its keys from one connection ("Time to set 20000 keys: ...",
/// without threads): that line is not the get's rate.
fn memcslap_rate(out: &str, test: &str) -> Option<f64> {
    let line = out
        .lines()
        .find(|l| l.starts_with(&format!("Time to {test} ")) && l.contains(" threads:"))?;
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
            vec![fig(metric, "keys/s", true, memcslap_rate(out, metric))?]
        }
        Program::Iperf3 => {
            let v: Option<f64> = serde_json::from_str::<serde_json::Value>(out)
                .ok()
                .and_then(|v| v["end"]["sum_received"]["bits_per_second"].as_f64());
            vec![fig("-P 8 goodput", "Gbit/s", true, v.map(|b| b / 1e9))?]
        }
        Program::Nginx => {
            // wrk counts failed reads, writes and connects as socket errors: not a figure.
            if let Some(line) = out.lines().find(|l| l.contains("Socket errors")) {
                return Err(format!("nginx: wrk saw errors ({}):\n{out}", line.trim()));
            }
            if out.contains("Non-2xx") {
                return Err(format!("nginx: wrk got error responses:\n{out}"));
            }
            let rps = out
                .lines()
                .find_map(|l| l.strip_prefix("Requests/sec:"))
                .and_then(|v| v.trim().parse().ok());
            vec![fig("4 KiB GET", "requests/s", true, rps)?]
        }
        Program::Pgbench if invocation == 0 => Vec::new(), // pgbench -i: the tables
        Program::Pgbench => {
            if !out.contains("number of failed transactions: 0 ") {
                return Err(format!("pgbench: failed transactions:\n{out}"));
            }
            let tps = out
                .lines()
                .find_map(|l| l.strip_prefix("tps = "))
                .and_then(|v| v.split_whitespace().next()?.parse().ok());
            vec![fig("TPC-B-like", "transactions/s", true, tps)?]
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
    path: &'a str,
}

impl Side<'_> {
    fn command(&self, argv: &[String]) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", self.netns]);
        if let Some((netchannel, stats)) = &self.carried {
            c.arg(netchannel).arg("run").arg("--path").arg(self.path);
            c.arg("--stats-file").arg(stats).arg("--");
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
    let path = opts.path.as_str();
    let server_side =
        Side { netns: NS_B, carried: carried.then(|| (nc, server_stats.clone())), path };
    let client_side =
        Side { netns: NS_A, carried: carried.then(|| (nc, client_stats.clone())), path };
    if carried {
        // PostgreSQL's processes run as nobody and append to it.
        std::fs::write(&server_stats, "").map_err(|e| e.to_string())?;
        let _ = std::fs::set_permissions(
            &server_stats,
            std::os::unix::fs::PermissionsExt::from_mode(0o666),
        );
    }
    let server = server_side
        .command(&server_argv(p, dir))
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
    let server_stats = carried
        .then(|| std::fs::read_to_string(&server_stats).unwrap_or_default().trim().to_string());
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
    let paths = match (&client_stats, &server_stats) {
        (Some(c), Some(s)) => {
            let ([cd, cr, ck], [sd, sr, sk]) = (side_paths(c), side_paths(s));
            Some([cd, cr, ck, sd, sr, sk])
        }
        _ => None,
    };
    Ok(Run {
        program: p,
        stack: if carried { "netchannel" } else { "linux" },
        repetition,
        figures,
        client_stats,
        server_stats,
        paths,
    })
}

/// Direct, relayed and kernel TCP connections over a side's stats lines; `None` when no
/// process of the side wrote one (it did not exit cleanly), rather than a zero that reads as a
/// figure.
fn side_paths(text: &str) -> [Option<u64>; 3] {
    if !text.lines().any(|l| l.contains(", direct ")) {
        return [None, None, None];
    }
    ["direct", "relayed", "kernel tcp"].map(|field| Some(stat_sum(text, field)))
}

/// Sums the number after `", <field> "` over every stats line in `text` ("direct 3",
/// "relayed 0 (...)").
fn stat_sum(text: &str, field: &str) -> u64 {
    let key = format!(", {field} ");
    text.lines()
        .filter_map(|l| {
            let n = l.split(&key).nth(1)?.split_whitespace().next()?;
            n.trim_end_matches(',').parse::<u64>().ok()
        })
        .sum()
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
        prepare(p, &dir)?;
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
                server_command: server_argv(p, Path::new("DIR")).join(" "),
                client_command: clients.join("; "),
                paths: first_paths(&runs, p),
            });
        }
    }
    Ok(Report {
        path: opts.path.clone(),
        repetitions: opts.repetitions,
        scale: opts.scale,
        summaries,
        runs,
    })
}

fn first_paths(runs: &[Run], p: Program) -> Option<[Option<u64>; 6]> {
    runs.iter().find(|r| r.program == p && r.paths.is_some()).and_then(|r| r.paths)
}

pub fn print(r: &Report) {
    println!(
        "{:<10} {:<16} {:>12} {:>12} {:>7}  unit ({} repetitions, medians; netchannel run --path {})",
        "program", "metric", "linux", "netchannel", "nc/lx", r.repetitions, r.path
    );
    for s in &r.summaries {
        println!(
            "{:<10} {:<16} {:>12.2} {:>12.2} {:>6.2}x  {}{}",
            s.program.name(),
            s.metric,
            s.linux,
            s.netchannel,
            s.ratio,
            s.unit,
            if s.higher_is_better { "" } else { " (lower is better)" }
        );
    }
    println!("connections by data path (first netchannel repetition, all processes of a side):");
    let mut seen = Vec::new();
    for s in &r.summaries {
        if let (Some([cd, cr, ck, sd, sr, sk]), false) = (s.paths, seen.contains(&s.program)) {
            seen.push(s.program);
            let side = |d: Option<u64>, r: Option<u64>, k: Option<u64>| match (d, r, k) {
                (Some(d), Some(r), Some(k)) => format!("direct {d}, relayed {r}, kernel tcp {k}"),
                _ => "no stats line (no process of the side exited cleanly)".to_string(),
            };
            println!(
                "  {:<10} client: {}; server: {}",
                s.program.name(),
                side(cd, cr, ck),
                side(sd, sr, sk)
            );
        }
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
        let get = "Time to set           20000 keys:                     1.499 seconds.\n\
                   Time to get          315375 keys by   16 threads:     5.000 seconds.\n";
        let f = parse(Program::Memcached, 1, get).unwrap();
        assert_eq!((f[0].metric.as_str(), f[0].value), ("get", 63075.0));
        assert!(parse(Program::Memcached, 1, slap).is_err(), "a set line is not a get's rate");
        let iperf = r#"{"end":{"sum_received":{"bits_per_second":2.5e9}}}"#;
        assert_eq!(parse(Program::Iperf3, 0, iperf).unwrap()[0].value, 2.5);
        let sp = "sockperf: ---> percentile 99.000 =   31.250\nsockperf: ---> percentile 50.000 =   12.500\n";
        let f = parse(Program::Sockperf, 0, sp).unwrap();
        assert_eq!((f[0].value, f[1].value), (12.5, 31.25));
        assert!(!f[0].higher_is_better);
        assert!(parse(Program::Redis4k, 0, "ERROR: connection refused").is_err());
        let wrk = "Requests/sec:   1234.50\n";
        assert_eq!(parse(Program::Nginx, 0, wrk).unwrap()[0].value, 1234.5);
        let errors = "  Socket errors: connect 0, read 1, write 0, timeout 0\nRequests/sec: 9\n";
        assert!(parse(Program::Nginx, 0, errors).is_err());
        let pg = "number of failed transactions: 0 (0.000%)\ntps = 850.5 (without initial connection time)\n";
        assert_eq!(parse(Program::Pgbench, 1, pg).unwrap()[0].value, 850.5);
        assert!(parse(Program::Pgbench, 0, "").unwrap().is_empty());
    }

    #[test]
    fn sums_paths_over_processes() {
        let line = |d: u64, r: u64, k: u64| {
            format!("netchannel: pid 1 virtual sockets 3 (connect 3, accept 0), direct {d}, relayed {r} (accepted by another process 0, inherited 0, by choice 0), kernel tcp {k} (no engine at peer 0, forked server {k})\n")
        };
        let text = line(28, 0, 0) + &line(2, 5, 7);
        assert_eq!((stat_sum(&text, "direct"), stat_sum(&text, "relayed")), (30, 5));
        assert_eq!(side_paths(&text), [Some(30), Some(5), Some(7)]);
        assert_eq!(side_paths(""), [None; 3], "no stats line is not zero connections");
    }
}
