//! The demo: two engines in this process, one virtual socket striped over 4 channels, its
//! goodput next to a plain kernel TCP socket measured in the same run (interleaved, medians),
//! then 4 KiB ping-pong latency on both.
//!
//! usage: nc-demo [--seconds S] [--rounds N] [--channels K] [--frame BYTES] [--only linux|netchannel]

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use netchannel::{Config, Engine, VSocket};

const WRITE: usize = 1 << 20;
const RPC: usize = 4096;

struct Args {
    seconds: f64,
    rounds: usize,
    channels: usize,
    frame: Option<usize>,
    /// Measure only this stack ("linux" or "netchannel"); both when unset.
    only: Option<String>,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args { seconds: 2.0, rounds: 3, channels: 4, frame: None, only: None };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let v = it.next().ok_or(format!("{flag} needs a value"))?;
        let bad = |e: &dyn std::fmt::Display| format!("{flag} {v}: {e}");
        match flag.as_str() {
            "--seconds" => a.seconds = v.parse().map_err(|e| bad(&e))?,
            "--rounds" => a.rounds = v.parse().map_err(|e| bad(&e))?,
            "--channels" => a.channels = v.parse().map_err(|e| bad(&e))?,
            "--frame" => a.frame = Some(v.parse().map_err(|e| bad(&e))?),
            "--only" if v == "linux" || v == "netchannel" => a.only = Some(v),
            _ => return Err(format!("unknown argument {flag}")),
        }
    }
    Ok(a)
}

/// Streams `WRITE`-byte writes for `secs`; returns goodput in Gbit/s measured at the receiver.
fn stream<W: Write + Send + 'static, R: Read + Send + 'static>(
    mut tx: W,
    mut rx: R,
    secs: f64,
    finish: impl FnOnce(W) + Send + 'static,
) -> f64 {
    let reader = std::thread::spawn(move || {
        let mut buf = vec![0u8; WRITE];
        let mut total = 0u64;
        let start = Instant::now();
        loop {
            match rx.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => total += n as u64,
            }
        }
        total as f64 * 8.0 / start.elapsed().as_secs_f64() / 1e9
    });
    let writer = std::thread::spawn(move || {
        let buf = vec![0x5Au8; WRITE];
        let end = Instant::now() + Duration::from_secs_f64(secs);
        while Instant::now() < end {
            if tx.write_all(&buf).is_err() {
                break;
            }
        }
        finish(tx);
    });
    writer.join().expect("writer");
    reader.join().expect("reader")
}

/// Closed-loop ping-pong of `RPC` bytes for `secs`; returns (p50, p99) in microseconds.
fn ping_pong<S: Read + Write + Send + 'static>(
    mut client: S,
    mut server: S,
    secs: f64,
) -> (f64, f64) {
    let echo = std::thread::spawn(move || {
        let mut buf = vec![0u8; RPC];
        while server.read_exact(&mut buf).is_ok() {
            if server.write_all(&buf).is_err() {
                break;
            }
        }
    });
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
    let _ = echo.join();
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

fn vsocket_pair(a: &Engine, b: &Engine, port: u16) -> std::io::Result<(VSocket, VSocket)> {
    let l = b.listen(port)?;
    let c = a.connect(b.local_addr(), port)?;
    Ok((c, l.accept()?))
}

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.partial_cmp(b).expect("no NaN"));
    v[v.len() / 2]
}

fn main() {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("nc-demo: {e}\nusage: nc-demo [--seconds S] [--rounds N] [--channels K] [--frame BYTES] [--only linux|netchannel]");
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
    let (a, b) = (Engine::new(config.clone())?, Engine::new(config)?);
    println!(
        "netchannel demo: two engines on loopback, one virtual socket over {} channels ({} policy)",
        args.channels,
        a.config().policy
    );
    println!(
        "goodput, {WRITE}-byte writes, {} s per run, {} interleaved rounds:",
        args.seconds, args.rounds
    );
    let want = |stack: &str| args.only.as_deref().is_none_or(|o| o == stack);
    let (mut linux, mut nc) = (vec![f64::NAN], vec![f64::NAN]);
    for round in 0..args.rounds {
        if want("linux") {
            let (c, s) = tcp_pair()?;
            let g = stream(c, s, args.seconds, drop);
            println!("  round {round}: linux tcp   {g:6.2} Gbit/s");
            linux.push(g);
        }
        if want("netchannel") {
            let (c, s) = vsocket_pair(&a, &b, 10 + round as u16)?;
            let g = stream(c, s, args.seconds, |c| {
                let _ = c.shutdown();
            });
            println!("  round {round}: netchannel  {g:6.2} Gbit/s");
            nc.push(g);
        }
    }
    let (gl, gn) = (median(linux[1..].to_vec()), median(nc[1..].to_vec()));
    println!(
        "median goodput: linux {gl:.2} Gbit/s, netchannel {gn:.2} Gbit/s, ratio {:.2}",
        gn / gl
    );

    println!("{RPC}-byte ping-pong, {} s each:", args.seconds);
    let (mut l50, mut n50) = (f64::NAN, f64::NAN);
    if want("linux") {
        let (c, s) = tcp_pair()?;
        let (p50, p99) = ping_pong(c, s, args.seconds);
        println!("  linux tcp   p50 {p50:7.1} us  p99 {p99:7.1} us");
        l50 = p50;
    }
    if want("netchannel") {
        let (c, s) = vsocket_pair(&a, &b, 100)?;
        let (p50, p99) = ping_pong(c, s, args.seconds);
        println!("  netchannel  p50 {p50:7.1} us  p99 {p99:7.1} us");
        n50 = p50;
    }
    println!("p50 latency ratio netchannel/linux: {:.2}", n50 / l50);
    let stats = a.stats();
    println!(
        "sender engine: {} channels, {} protocol errors",
        stats.channels.len(),
        stats.protocol_errors
    );
    Ok(())
}
