//! The demo: two engines in this process on loopback, next to plain kernel TCP measured in the
//! same run. Four workloads, each as interleaved rounds (the stack that goes first alternates,
//! a warm-up round is discarded), reported as medians with their spread:
//!
//! - one bulk stream of 1 MiB writes (Gbit/s);
//! - one stream of 64-byte writes (messages/s): per-message cost, where kernel TCP pays a system
//!   call and a segment per write;
//! - 100 request/response flows of 4 KiB each way (requests/s, p99), 4 threads a side: one
//!   kernel TCP connection per flow, or one virtual socket per flow over the engines' channels;
//! - one 4 KiB ping-pong flow (p50 and p99 latency).
//!
//! usage: nc-demo [--seconds S] [--rounds N] [--channels K] [--frame BYTES]
//!                [--only linux|netchannel] [--json PATH] [--quick]

use std::fmt::Write as _;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use netchannel::{Config, Engine, VSocket};

const BULK_WRITE: usize = 1 << 20;
const SMALL_WRITE: usize = 64;
const RPC: usize = 4096;
const RPC_FLOWS: usize = 100;
/// Threads on each side of the RPC flows (a client thread keeps its flows' requests
/// outstanding at once): the same few threads for both stacks, as an event-driven server has.
const RPC_THREADS: usize = 4;

const USAGE: &str = "usage: nc-demo [--seconds S] [--rounds N] [--channels K] [--frame BYTES] \
                     [--only linux|netchannel] [--json PATH] [--quick]";

struct Args {
    seconds: f64,
    rounds: usize,
    channels: usize,
    frame: Option<usize>,
    /// Measure only this stack ("linux" or "netchannel"); both when unset.
    only: Option<String>,
    json: Option<String>,
}

fn parse_args(argv: impl Iterator<Item = String>) -> Result<Args, String> {
    let mut a = Args { seconds: 1.0, rounds: 5, channels: 4, frame: None, only: None, json: None };
    let mut it = argv;
    while let Some(flag) = it.next() {
        if flag == "--quick" {
            // A few seconds in all: shows that everything runs, not what it measures.
            (a.seconds, a.rounds) = (0.1, 1);
            continue;
        }
        let v = it.next().ok_or(format!("{flag} needs a value"))?;
        let bad = |e: &dyn std::fmt::Display| format!("{flag} {v}: {e}");
        match flag.as_str() {
            "--seconds" => a.seconds = v.parse().map_err(|e| bad(&e))?,
            "--rounds" => a.rounds = v.parse().map_err(|e| bad(&e))?,
            "--channels" => a.channels = v.parse().map_err(|e| bad(&e))?,
            "--frame" => a.frame = Some(v.parse().map_err(|e| bad(&e))?),
            "--only" if v == "linux" || v == "netchannel" => a.only = Some(v),
            "--json" => a.json = Some(v),
            _ => return Err(format!("unknown argument {flag}")),
        }
    }
    if !a.seconds.is_finite() || a.seconds <= 0.0 || a.rounds == 0 {
        return Err("--seconds and --rounds must be positive".into());
    }
    Ok(a)
}

/// Streams `write`-byte writes for `secs`; returns bytes per second at the receiver.
fn stream<W: Write + Send + 'static, R: Read + Send + 'static>(
    mut tx: W,
    mut rx: R,
    write: usize,
    secs: f64,
    finish: impl FnOnce(W) + Send + 'static,
) -> f64 {
    let reader = std::thread::spawn(move || {
        let mut buf = vec![0u8; BULK_WRITE];
        let mut total = 0u64;
        let start = Instant::now();
        loop {
            match rx.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => total += n as u64,
            }
        }
        total as f64 / start.elapsed().as_secs_f64()
    });
    let writer = std::thread::spawn(move || {
        let buf = vec![0x5Au8; write];
        let end = Instant::now() + Duration::from_secs_f64(secs);
        // Checking the clock every write would cost as much as a 64-byte write itself.
        'run: while Instant::now() < end {
            for _ in 0..64 {
                if tx.write_all(&buf).is_err() {
                    break 'run;
                }
            }
        }
        finish(tx);
    });
    writer.join().expect("writer");
    reader.join().expect("reader")
}

/// Echoes `RPC`-byte requests until the client goes away.
fn echo<S: Read + Write + Send + 'static>(mut s: S) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let mut buf = vec![0u8; RPC];
        while s.read_exact(&mut buf).is_ok() {
            if s.write_all(&buf).is_err() {
                break;
            }
        }
    })
}

/// Closed-loop request/response over `pairs` (client end, server end) for `secs`, with
/// `threads` threads on each side: a client thread sends one request on every flow it drives,
/// then reads every reply; the server thread of the same flows answers them in turn. Returns
/// (requests/s, p50 us, p99 us).
fn rpc<S: Read + Write + Send + 'static>(
    pairs: Vec<(S, S)>,
    threads: usize,
    secs: f64,
) -> (f64, f64, f64) {
    let mut clients: Vec<Vec<S>> = (0..threads).map(|_| Vec::new()).collect();
    let mut servers: Vec<Vec<S>> = (0..threads).map(|_| Vec::new()).collect();
    for (i, (c, s)) in pairs.into_iter().enumerate() {
        clients[i % threads].push(c);
        servers[i % threads].push(s);
    }
    let servers: Vec<_> = servers
        .into_iter()
        .map(|mut flows| {
            std::thread::spawn(move || {
                let mut buf = vec![0u8; RPC];
                'serve: loop {
                    for f in &mut flows {
                        if f.read_exact(&mut buf).is_err() || f.write_all(&buf).is_err() {
                            break 'serve;
                        }
                    }
                }
            })
        })
        .collect();
    let start = Instant::now();
    let end = start + Duration::from_secs_f64(secs);
    let clients: Vec<_> = clients
        .into_iter()
        .map(|mut flows| {
            std::thread::spawn(move || {
                let mut buf = vec![0u8; RPC];
                let mut samples = Vec::new();
                let mut sent_at = vec![Instant::now(); flows.len()];
                while Instant::now() < end {
                    for (f, t) in flows.iter_mut().zip(sent_at.iter_mut()) {
                        *t = Instant::now();
                        f.write_all(&buf).expect("rpc write");
                    }
                    for (f, t) in flows.iter_mut().zip(&sent_at) {
                        f.read_exact(&mut buf).expect("rpc read");
                        samples.push(t.elapsed().as_secs_f64() * 1e6);
                    }
                }
                samples
            })
        })
        .collect();
    let mut samples: Vec<f64> =
        clients.into_iter().flat_map(|c| c.join().expect("client")).collect();
    let elapsed = start.elapsed().as_secs_f64();
    // The client ends are closed: every server thread reads end of stream and stops.
    for s in servers {
        let _ = s.join();
    }
    let rps = samples.len() as f64 / elapsed;
    let (p50, p99) = percentiles(&mut samples);
    (rps, p50, p99)
}

/// Closed-loop ping-pong of `RPC` bytes on one flow for `secs`; returns (p50, p99) in us.
fn ping_pong<S: Read + Write + Send + 'static>(mut client: S, server: S, secs: f64) -> (f64, f64) {
    let e = echo(server);
    let mut buf = vec![0u8; RPC];
    let mut samples = Vec::new();
    let end = Instant::now() + Duration::from_secs_f64(secs);
    while Instant::now() < end {
        let t = Instant::now();
        client.write_all(&buf).expect("rpc write");
        client.read_exact(&mut buf).expect("rpc read");
        samples.push(t.elapsed().as_secs_f64() * 1e6);
    }
    drop(client);
    let _ = e.join();
    percentiles(&mut samples)
}

fn percentiles(samples: &mut [f64]) -> (f64, f64) {
    if samples.is_empty() {
        return (f64::NAN, f64::NAN);
    }
    samples.sort_by(|a, b| a.partial_cmp(b).expect("no NaN"));
    let pct = |p: f64| samples[((samples.len() - 1) as f64 * p) as usize];
    (pct(0.50), pct(0.99))
}

fn tcp_pair() -> std::io::Result<(TcpStream, TcpStream)> {
    let l = TcpListener::bind("127.0.0.1:0")?;
    let c = TcpStream::connect(l.local_addr()?)?;
    let (s, _) = l.accept()?;
    c.set_nodelay(true)?;
    s.set_nodelay(true)?;
    Ok((c, s))
}

/// The demo's two engines and the next free virtual port.
struct Engines {
    a: Engine,
    b: Engine,
    next_port: u16,
}

impl Engines {
    fn pair(&mut self) -> std::io::Result<(VSocket, VSocket)> {
        self.next_port = self.next_port.wrapping_add(1).max(1);
        let l = self.b.listen(self.next_port)?;
        let c = self.a.connect(self.b.local_addr(), self.next_port)?;
        Ok((c, l.accept()?))
    }
}

/// One metric's values per round for both stacks.
struct Metric {
    name: &'static str,
    unit: &'static str,
    /// Lower is better (latency): the summary says "faster" when the ratio is below 1.
    lower_is_better: bool,
    linux: Vec<f64>,
    netchannel: Vec<f64>,
}

impl Metric {
    fn new(name: &'static str, unit: &'static str, lower_is_better: bool) -> Metric {
        Metric { name, unit, lower_is_better, linux: Vec::new(), netchannel: Vec::new() }
    }
}

/// Median, minimum and maximum.
fn summary(v: &[f64]) -> Option<(f64, f64, f64)> {
    let mut s: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
    if s.is_empty() {
        return None;
    }
    s.sort_by(|a, b| a.partial_cmp(b).expect("finite"));
    let median =
        if s.len() % 2 == 1 { s[s.len() / 2] } else { (s[s.len() / 2 - 1] + s[s.len() / 2]) / 2.0 };
    Some((median, s[0], s[s.len() - 1]))
}

fn fmt_value(v: f64) -> String {
    if v >= 100_000.0 {
        format!("{:.0}k", v / 1000.0)
    } else if v >= 100.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.2}")
    }
}

/// "median (min-max, +-spread%)" of one stack's rounds.
fn fmt_stack(v: &[f64]) -> String {
    match summary(v) {
        Some((m, lo, hi)) => {
            let spread = if m > 0.0 { (hi - lo) / m * 100.0 } else { 0.0 };
            format!("{} ({}-{}, spread {spread:.0}%)", fmt_value(m), fmt_value(lo), fmt_value(hi))
        }
        None => "-".into(),
    }
}

fn ratio(m: &Metric) -> Option<f64> {
    Some(summary(&m.netchannel)?.0 / summary(&m.linux)?.0)
}

fn report(metrics: &[Metric], rounds: usize) -> String {
    let mut o = String::new();
    let _ = writeln!(o, "\nmedians of {rounds} round(s) (min-max, spread = (max-min)/median):");
    let _ = writeln!(o, "{:<34} {:<36} {:<36} {:>6}", "metric", "linux tcp", "netchannel", "ratio");
    for m in metrics {
        let r = ratio(m).map_or("-".into(), |r| format!("{r:.2}"));
        let _ = writeln!(
            o,
            "{:<34} {:<36} {:<36} {:>6}",
            format!("{} ({})", m.name, m.unit),
            fmt_stack(&m.linux),
            fmt_stack(&m.netchannel),
            r
        );
    }
    let _ = writeln!(o, "\nin short:");
    for m in metrics {
        let Some(r) = ratio(m) else { continue };
        let (better, factor) = if m.lower_is_better { (r < 1.0, 1.0 / r) } else { (r > 1.0, r) };
        let verdict = if (0.95..=1.05).contains(&r) {
            "on par with".to_string()
        } else if better {
            format!("{factor:.2}x better than")
        } else {
            format!("{:.2}x worse than", 1.0 / factor)
        };
        let _ = writeln!(o, "  {}: netchannel {verdict} kernel TCP", m.name);
    }
    o
}

fn json(metrics: &[Metric], args: &Args) -> String {
    let list = |v: &[f64]| {
        v.iter()
            .map(|x| if x.is_finite() { format!("{x}") } else { "null".into() })
            .collect::<Vec<_>>()
            .join(",")
    };
    let mut o = String::new();
    let _ = write!(
        o,
        "{{\"rounds\":{},\"seconds\":{},\"channels\":{},\"metrics\":[",
        args.rounds, args.seconds, args.channels
    );
    for (i, m) in metrics.iter().enumerate() {
        let med = |v: &[f64]| summary(v).map_or("null".into(), |s| format!("{}", s.0));
        let _ = write!(
            o,
            "{}{{\"name\":\"{}\",\"unit\":\"{}\",\"lower_is_better\":{},\"linux\":[{}],\"netchannel\":[{}],\"linux_median\":{},\"netchannel_median\":{},\"ratio\":{}}}",
            if i > 0 { "," } else { "" },
            m.name,
            m.unit,
            m.lower_is_better,
            list(&m.linux),
            list(&m.netchannel),
            med(&m.linux),
            med(&m.netchannel),
            ratio(m).map_or("null".into(), |r| format!("{r}")),
        );
    }
    o.push_str("]}\n");
    o
}

fn main() {
    let args = match parse_args(std::env::args().skip(1)) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("nc-demo: {e}\n{USAGE}");
            std::process::exit(2);
        }
    };
    if let Err(e) = run(&args) {
        eprintln!("nc-demo: {e}");
        std::process::exit(1);
    }
}

fn run(args: &Args) -> std::io::Result<()> {
    let mut config =
        Config { channels: args.channels, max_channels: args.channels, ..Config::default() };
    if let Some(f) = args.frame {
        config.max_frame_payload = f;
    }
    let mut e = Engines { a: Engine::new(config.clone())?, b: Engine::new(config)?, next_port: 0 };
    println!(
        "netchannel demo: two engines on loopback, {} channels ({} policy), beside kernel TCP;\n\
         {} s per run, {} round(s) after a warm-up, the stack that goes first alternating",
        args.channels,
        e.a.config().policy,
        args.seconds,
        args.rounds
    );
    let want = |stack: &str| args.only.as_deref().is_none_or(|o| o == stack);
    let secs = args.seconds;
    let mut bulk = Metric::new("one stream, 1 MiB writes", "Gbit/s", false);
    let mut small = Metric::new("one stream, 64 B writes", "Mmsg/s", false);
    let mut rps = Metric::new("100 RPC flows, 4 KiB", "req/s", false);
    let mut rpc_p99 = Metric::new("100 RPC flows, p99", "us", true);
    let mut p50 = Metric::new("4 KiB ping-pong, p50", "us", true);
    let mut p99 = Metric::new("4 KiB ping-pong, p99", "us", true);
    for round in 0..=args.rounds {
        let warm_up = round == 0;
        let order: [&str; 2] =
            if round % 2 == 0 { ["linux", "netchannel"] } else { ["netchannel", "linux"] };
        print!("{}", if warm_up { "warm-up:" } else { "round:" });
        for stack in order.into_iter().filter(|s| want(s)) {
            let linux = stack == "linux";
            let bytes_per_s = if linux {
                let (c, s) = tcp_pair()?;
                stream(c, s, BULK_WRITE, secs, drop)
            } else {
                let (c, s) = e.pair()?;
                stream(c, s, BULK_WRITE, secs, |c| drop(c.shutdown()))
            };
            let small_per_s = if linux {
                let (c, s) = tcp_pair()?;
                stream(c, s, SMALL_WRITE, secs, drop)
            } else {
                let (c, s) = e.pair()?;
                stream(c, s, SMALL_WRITE, secs, |c| drop(c.shutdown()))
            } / SMALL_WRITE as f64;
            let (r, _, r99) = if linux {
                let pairs = (0..RPC_FLOWS).map(|_| tcp_pair()).collect::<Result<Vec<_>, _>>()?;
                rpc(pairs, RPC_THREADS, secs)
            } else {
                let pairs = (0..RPC_FLOWS).map(|_| e.pair()).collect::<Result<Vec<_>, _>>()?;
                rpc(pairs, RPC_THREADS, secs)
            };
            let (l50, l99) = if linux {
                let (c, s) = tcp_pair()?;
                ping_pong(c, s, secs)
            } else {
                let (c, s) = e.pair()?;
                ping_pong(c, s, secs)
            };
            print!(
                " {stack} {:.1} Gbit/s {:.2} Mmsg/s {:.0} req/s",
                bytes_per_s * 8e-9,
                small_per_s * 1e-6,
                r
            );
            let _ = std::io::stdout().flush();
            if warm_up {
                continue;
            }
            for (m, v) in [
                (&mut bulk, bytes_per_s * 8e-9),
                (&mut small, small_per_s * 1e-6),
                (&mut rps, r),
                (&mut rpc_p99, r99),
                (&mut p50, l50),
                (&mut p99, l99),
            ] {
                if linux { &mut m.linux } else { &mut m.netchannel }.push(v);
            }
        }
        println!();
    }
    let metrics = [bulk, small, rps, rpc_p99, p50, p99];
    print!("{}", report(&metrics, args.rounds));
    if let Some(path) = &args.json {
        std::fs::write(path, json(&metrics, args))?;
        println!("results: {path}");
    }
    let stats = e.a.stats();
    println!(
        "sender engine: {} channels, {} protocol errors",
        stats.channels.len(),
        stats.protocol_errors
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians_and_spreads() {
        assert_eq!(summary(&[3.0, 1.0, 2.0]), Some((2.0, 1.0, 3.0)));
        assert_eq!(summary(&[1.0, 4.0]), Some((2.5, 1.0, 4.0)));
        assert_eq!(summary(&[f64::NAN]), None);
        assert_eq!(fmt_stack(&[10.0, 9.0, 11.0]), "10.00 (9.00-11.00, spread 20%)");
    }

    #[test]
    fn the_summary_says_which_way_a_ratio_goes() {
        let mut lat = Metric::new("p50", "us", true);
        lat.linux = vec![100.0];
        lat.netchannel = vec![50.0];
        let mut rate = Metric::new("rate", "req/s", false);
        rate.linux = vec![100.0];
        rate.netchannel = vec![50.0];
        let r = report(&[lat, rate], 1);
        assert!(r.contains("p50: netchannel 2.00x better than kernel TCP"), "{r}");
        assert!(r.contains("rate: netchannel 2.00x worse than kernel TCP"), "{r}");
    }

    #[test]
    fn arguments() {
        let a = |v: &[&str]| parse_args(v.iter().map(|s| s.to_string()));
        assert!(a(&["--quick"]).is_ok_and(|a| a.rounds == 1));
        assert!(a(&["--rounds", "0"]).is_err());
        assert!(a(&["--bogus", "1"]).is_err());
        assert!(a(&["--only", "quic"]).is_err());
    }
}
