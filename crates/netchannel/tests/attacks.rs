//! Hostile peers, round two: each attack of issue 16, reproduced first (against a separate
//! `nc-echo` process where it is about resources, in-process where a thread or a counter must be
//! watched), then held to the targets: the target stays under 64 threads and 256 MiB of
//! resident memory beyond its idle size, under its fd limit with room for a good peer, below
//! 10% of a core once the attacker stops sending, and a well-behaved peer is served within 1 s
//! during the attack.

mod common;

use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use netchannel::wire::{self, Decoded, Frame, RejectReason};
use netchannel::{Class, Engine, VSocket};

both_testbeds!(
    syns_claiming_high_indexes_allocate_nothing,
    a_peer_that_never_acknowledges_is_bounded_and_kept,
    peers_that_never_read_are_bounded,
    slowly_arriving_payloads_do_not_make_readers_spin,
    channels_are_budgeted_per_source_and_in_all,
    running_out_of_fds_does_not_spin_the_acceptor,
    silent_handshakes_from_one_source_do_not_keep_others_out,
    a_relayed_or_reflected_handshake_is_refused,
    failed_admissions_leave_no_session,
    credit_keeps_flowing_while_a_peer_holds_unread_bytes,
    a_slow_acceptor_holds_neither_its_dial_nor_other_peers,
    a_black_holed_peer_is_declared_dead,
    streams_reset_in_the_waiting_line_are_freed,
    a_retired_session_leaves_only_readable_streams_in_the_backlog,
);

const MIB: u64 = 1 << 20;

// ------------------------------------------------------------------------------ the targets

/// A target `nc-echo` and the bounds for it.
struct Target {
    echo: EchoProcess,
    pid: String,
    idle_rss: u64,
    fd_limit: usize,
}

impl Target {
    fn start(tb: &Testbed, extra: &[&str]) -> Target {
        Self::start_with(tb, extra, None)
    }

    fn start_with(tb: &Testbed, extra: &[&str], nofile: Option<u32>) -> Target {
        let echo = EchoProcess::start_with(tb, extra, nofile);
        let pid = echo.pid();
        std::thread::sleep(Duration::from_millis(100));
        let fd_limit = nofile.map_or_else(|| open_file_limit(&pid), |n| n as usize);
        Target { idle_rss: rss_bytes(&pid), echo, pid, fd_limit }
    }

    fn addr(&self) -> SocketAddr {
        self.echo.addr
    }

    /// Threads, memory and fds within the targets.
    fn assert_bounded(&self, during: &str) {
        self.assert_bounded_at(during, rss_bytes(&self.pid));
    }

    /// As `assert_bounded`, with the resident memory `rss` measured when it peaked.
    fn assert_bounded_at(&self, during: &str, rss: u64) {
        let threads = thread_count(&self.pid);
        assert!(threads < 64, "{during}: {threads} threads");
        let grown = rss.saturating_sub(self.idle_rss);
        eprintln!("{during}: target grew {} MiB, {threads} threads", grown / MIB);
        assert!(grown < 256 * MIB, "{during}: resident memory grew by {} MiB", grown / MIB);
        let fds = fds_in_use(&self.pid, self.fd_limit);
        // Room left for a good peer: its channels and their hang-up duplicates.
        assert!(fds + 16 <= self.fd_limit, "{during}: {fds} fds of {}", self.fd_limit);
    }

    /// Below 10% of a core over a second (the attacker has stopped sending).
    fn assert_quiet(&self, after: &str) {
        let busy = cpu_fraction(&self.pid, None, Duration::from_secs(1));
        eprintln!("{after}: target used {:.1}% of a core", busy * 100.0);
        assert!(busy < 0.10, "{after}: the target used {:.0}% of a core", busy * 100.0);
    }
}

fn open_file_limit(pid: &str) -> usize {
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
    let line = limits.lines().find(|l| l.starts_with("Max open files")).unwrap();
    line.split_whitespace().nth(3).unwrap().parse().unwrap()
}

fn fd_count(pid: &str) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count())
}

/// The process's fds that take a slot below its limit (an fd inherited above it takes none).
fn fds_in_use(pid: &str, limit: usize) -> usize {
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/fd")) else { return 0 };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<usize>().ok())
        .filter(|&fd| fd < limit)
        .count()
}

/// CPU time (user and system) of a process, or of one of its threads, in seconds.
fn cpu_seconds(pid: &str, tid: Option<i32>) -> f64 {
    let path = match tid {
        Some(t) => format!("/proc/{pid}/task/{t}/stat"),
        None => format!("/proc/{pid}/stat"),
    };
    let stat = std::fs::read_to_string(path).unwrap();
    // After the command name (in parentheses, possibly with spaces): state is field 3.
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap();
    ticks as f64 / rustix::param::clock_ticks_per_second() as f64
}

/// Share of a core a process (or thread) used over `window`.
fn cpu_fraction(pid: &str, tid: Option<i32>, window: Duration) -> f64 {
    let before = cpu_seconds(pid, tid);
    let t0 = Instant::now();
    std::thread::sleep(window);
    (cpu_seconds(pid, tid) - before) / t0.elapsed().as_secs_f64()
}

/// A well-behaved client of the echo target, from host A (or its address `from`).
struct GoodPeer {
    _engine: Engine,
    sock: VSocket,
}

impl GoodPeer {
    fn new(tb: &Testbed, target: SocketAddr) -> GoodPeer {
        let engine = Engine::new(tb.config_a()).unwrap();
        let sock = engine.connect(target, 7).unwrap();
        sock.set_read_timeout(Some(Duration::from_secs(1))).unwrap();
        let p = GoodPeer { _engine: engine, sock };
        p.served_within(Duration::from_secs(1));
        p
    }

    /// An echo of a small message comes back within `limit`; returns how long it took.
    fn served_within(&self, limit: Duration) -> Duration {
        let t0 = Instant::now();
        (&self.sock).write_all(b"still there?").unwrap();
        let mut got = [0u8; 12];
        (&self.sock).read_exact(&mut got).expect("the good peer was not served");
        assert_eq!(&got, b"still there?");
        let took = t0.elapsed();
        assert!(took <= limit, "the good peer waited {took:?}");
        took
    }
}

/// Runs `attack` while the good peer checks every 100 ms that it is served within 1 s;
/// returns the attack's result and the slowest answer.
fn during<T>(peer: &GoodPeer, attack: impl FnOnce() -> T) -> (T, Duration) {
    let done = AtomicBool::new(false);
    std::thread::scope(|s| {
        let checker = s.spawn(|| {
            let mut worst = Duration::ZERO;
            while !done.load(Ordering::Acquire) {
                worst = worst.max(peer.served_within(Duration::from_secs(1)));
                std::thread::sleep(Duration::from_millis(100));
            }
            worst
        });
        let r = attack();
        done.store(true, Ordering::Release);
        let worst = checker.join().expect("the good peer was not served within 1 s");
        eprintln!("slowest answer to the good peer during the attack: {worst:?}");
        (r, worst)
    })
}

// ------------------------------------------------------------------------------ raw peers

/// A hand-driven channel: frames written as a hostile peer would, frames read as they come.
struct Raw {
    sock: TcpStream,
    buf: Vec<u8>,
}

impl Raw {
    fn new(sock: TcpStream) -> Raw {
        Raw { sock, buf: Vec::new() }
    }

    fn send(&mut self, frames: &[Frame<'_>]) -> std::io::Result<()> {
        let mut out = Vec::new();
        for f in frames {
            f.encode(&mut out);
        }
        self.sock.write_all(&out)
    }

    /// Frames that arrived within `wait` (none: an empty list); `Err` once the channel is
    /// closed.
    fn poll(&mut self, wait: Duration) -> std::io::Result<Vec<Frame<'static>>> {
        let mut chunk = vec![0u8; 256 * 1024];
        self.sock.set_read_timeout(Some(wait.max(Duration::from_millis(1))))?;
        match self.sock.read(&mut chunk) {
            Ok(0) => return Err(ErrorKind::UnexpectedEof.into()),
            Ok(n) => self.buf.extend_from_slice(&chunk[..n]),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(e) => return Err(e),
        }
        let mut out = Vec::new();
        while let Ok(Decoded::Frame(f, n)) = wire::decode(&self.buf) {
            out.push(f.into_owned_control());
            self.buf.drain(..n);
        }
        Ok(out)
    }

    /// Reads until a SYN_ACK for our stream `src`; returns the target's id and window.
    fn syn_ack(&mut self, src: u64) -> (u64, u32) {
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            for f in self.poll(Duration::from_millis(50)).unwrap() {
                if let Frame::SynAck { dst, src: id, window, .. } = f {
                    if dst == src {
                        return (id, window);
                    }
                }
            }
        }
        panic!("no SYN_ACK for stream {src}");
    }
}

fn syn(src: u64, port: u16, window: u32) -> Frame<'static> {
    Frame::Syn { src, port, class: Class::Throughput, window }
}

// ------------------------------------------------------------------------------ the attacks

/// One 20-byte SYN naming the peer's stream index 2^24-1 made the target size a table by it:
/// 64 MiB per session, never returned, whether or not anything listened on the port.
fn syns_claiming_high_indexes_allocate_nothing(hosts: Hosts) {
    let Some(tb) = Testbed::of(hosts) else { return };
    let target = Target::start(&tb, &[]);
    let peer = GoodPeer::new(&tb, target.addr());
    let before = rss_bytes(&target.pid);
    during(&peer, || {
        for engine in 0..32u64 {
            let sock = raw::channel_as(&tb, target.addr(), 0x5100 + engine, 0, None).unwrap();
            let mut ch = Raw::new(sock);
            let high = (1 << 24) | 0xFF_FFFF;
            ch.send(&[syn(high, 999, 1 << 20), syn(high - 1 + (1 << 24), 7, 1 << 20)]).unwrap();
            // The SYN to port 7 opened a stream: its answer says both were handled.
            ch.syn_ack(high - 1 + (1 << 24));
        }
    });
    let grown = rss_bytes(&target.pid).saturating_sub(before);
    eprintln!("64 SYNs naming high indexes over 32 sessions: target grew {} KiB", grown >> 10);
    assert!(grown < 16 * MIB, "resident memory grew by {} MiB", grown / MIB);
    target.assert_bounded("after the SYNs");
    target.assert_quiet("after the SYNs");
}

/// A peer that reads what the target sends (so TCP flows) and grants itself window, but never
/// acknowledges a frame: everything the target sent stayed retained (3 GiB echoed took it to
/// 3.9 GiB). Now each channel keeps at most `max_retained_bytes`, and senders wait. The channel
/// is not closed after `ack_timeout`: the peer's kernel acknowledges what it reads, so the peer
/// is alive (a stopped or paused process looks the same), and TCP waits for a live peer; only
/// a channel whose peer's kernel is silent too is closed (`a_black_holed_peer_is_declared_dead`).
fn a_peer_that_never_acknowledges_is_bounded_and_kept(hosts: Hosts) {
    let Some(tb) = Testbed::of(hosts) else { return };
    let target = Target::start(&tb, &["--ack-timeout-ms", "2000"]);
    let peer = GoodPeer::new(&tb, target.addr());
    let t0 = Instant::now();
    let sock = raw::channel_as(&tb, target.addr(), 0xACC, 0, None).unwrap();
    let mut ch = Raw::new(sock);
    const STREAMS: u64 = 16;
    // Our streams grant the target a window of 2^30 bytes each: it may echo all it wants.
    let mut limit = Vec::new();
    let mut ids = Vec::new();
    for src in 1..=STREAMS {
        ch.send(&[syn(src, 7, 1 << 30)]).unwrap();
        let (id, window) = ch.syn_ack(src);
        ids.push(id);
        limit.push(window as u64);
    }
    let payload = vec![0x55u8; 60 * 1024];
    let mut sent = vec![0u64; STREAMS as usize];
    let mut peak = 0;
    // Three ack timeouts: the target looks at the channel at least twice meanwhile.
    let ((closed, echoed), _) = during(&peer, || {
        let mut echoed = 0u64;
        while t0.elapsed() < Duration::from_secs(6) {
            peak = peak.max(rss_bytes(&target.pid));
            // Data within the credit the target grants, on every stream.
            for i in 0..STREAMS as usize {
                let n = (limit[i] - sent[i]).min(payload.len() as u64) as usize;
                if n > 0 {
                    let f = Frame::Data { stream: ids[i], offset: sent[i], payload: &payload[..n] };
                    if ch.send(&[f]).is_err() {
                        return (Some(t0.elapsed()), echoed);
                    }
                    sent[i] += n as u64;
                }
            }
            match ch.poll(Duration::from_millis(5)) {
                Ok(frames) => {
                    for f in frames {
                        match f {
                            Frame::Credit { dst, consumed, window } => {
                                if let Some(i) = ids.iter().position(|&x| x == dst) {
                                    limit[i] = limit[i].max(consumed + window as u64);
                                }
                            }
                            Frame::Data { .. } => echoed += 1,
                            _ => {}
                        }
                    }
                }
                Err(_) => return (Some(t0.elapsed()), echoed),
            }
        }
        (None, echoed)
    });
    eprintln!("the target sent {echoed} DATA frames; channel closed: {closed:?}");
    assert!(echoed > 0, "the target never echoed");
    assert_eq!(closed, None, "the target closed a channel whose peer's kernel answers");
    target.assert_bounded_at("while the peer did not acknowledge (peak)", peak);
    target.assert_bounded("while the peer still does not acknowledge");
    peer.served_within(Duration::from_secs(1));
}

/// Peers that write and never read the echoes (three of them took the target to 2.1 GiB).
/// Each stream's bytes are bounded by the windows and each session's by its budgets; the
/// target's threads do not grow with the streams either.
fn peers_that_never_read_are_bounded(hosts: Hosts) {
    let Some(tb) = Testbed::of(hosts) else { return };
    let target = Target::start(&tb, &[]);
    let peer = GoodPeer::new(&tb, target.addr());
    const STREAMS: usize = 300;
    let chunk = vec![7u8; 256 * 1024];
    let mut peak = 0;
    let (peers, _) = during(&peer, || {
        let peers: Vec<(Engine, Vec<VSocket>)> = (0..3)
            .map(|_| {
                // What they sent cannot be delivered: do not wait for it when they go.
                let config =
                    netchannel::Config { linger: Duration::from_millis(200), ..tb.config_a() };
                let e = Engine::new(config).unwrap();
                let socks: Vec<VSocket> =
                    (0..STREAMS).map(|_| e.connect(target.addr(), 7).unwrap()).collect();
                for s in &socks {
                    s.set_nonblocking(true);
                }
                (e, socks)
            })
            .collect();
        // Write until every stream is blocked (its windows are full), a few rounds.
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(3) {
            for (_, socks) in &peers {
                for s in socks {
                    while s.send(&chunk).is_ok() {}
                }
            }
            peak = peak.max(rss_bytes(&target.pid));
            std::thread::sleep(Duration::from_millis(50));
        }
        target.assert_bounded_at("three peers that never read, 900 streams (peak)", peak);
        peers
    });
    drop(peers);
    std::thread::sleep(Duration::from_millis(500));
    target.assert_quiet("after the peers left");
}

/// A large payload that arrives a byte at a time: once the engine took it over (after
/// `defer_grace`), `recv` found nothing while the stream still said readable, and a blocked
/// reader spun at 100% for as long as the payload was unfinished (128 such frames took both
/// cores of an nc-echo and a good peer got no answer in 5 s).
fn slowly_arriving_payloads_do_not_make_readers_spin(hosts: Hosts) {
    let Some(tb) = Testbed::of(hosts) else { return };
    // In-process, a reader blocked in `recv`, whose thread's CPU time we watch.
    let (_a, b) = tb.engines(|_| {});
    let l = b.listen(7).unwrap();
    let mut ch = Raw::new(raw::channel(&tb, b.local_addr()));
    ch.send(&[syn(1, 7, 1 << 20)]).unwrap();
    let (id, _) = ch.syn_ack(1);
    let accepted = l.accept().unwrap();
    const LEN: usize = 512 * 1024;
    let tid = Arc::new(AtomicI32::new(0));
    let reader = {
        let tid = tid.clone();
        std::thread::spawn(move || {
            tid.store(rustix::thread::gettid().as_raw_nonzero().get(), Ordering::Release);
            let mut buf = vec![0u8; 1 << 20];
            let mut got = 0;
            while got < LEN {
                got += accepted.recv(&mut buf).unwrap();
            }
            got
        })
    };
    while tid.load(Ordering::Acquire) == 0 {
        std::thread::sleep(Duration::from_millis(1));
    }
    std::thread::sleep(Duration::from_millis(50)); // the reader is blocked in recv
    let mut frame = Vec::new();
    Frame::Data { stream: id, offset: 0, payload: &vec![1u8; LEN] }.encode(&mut frame);
    // The header and the first bytes now (deferred for the reader, taken over by the engine
    // after the grace); then a byte every 20 ms for two seconds.
    let mut at = 24 + 1000;
    ch.sock.write_all(&frame[..at]).unwrap();
    let pid = std::process::id().to_string();
    let watched = tid.load(Ordering::Acquire);
    let watch =
        std::thread::spawn(move || cpu_fraction(&pid, Some(watched), Duration::from_secs(2)));
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(2) {
        ch.sock.write_all(&frame[at..at + 1]).unwrap();
        at += 1;
        std::thread::sleep(Duration::from_millis(20));
    }
    let busy = watch.join().unwrap();
    eprintln!("a reader waiting on a dribbling payload used {:.1}% of a core", busy * 100.0);
    assert!(busy < 0.10, "the reader used {:.0}% of a core", busy * 100.0);
    ch.sock.write_all(&frame[at..]).unwrap();
    assert_eq!(reader.join().unwrap(), LEN, "the payload arrived whole");

    // Against nc-echo: 32 channels, each with a large payload that trickles in, then stops
    // unfinished. While it trickles the target does real work (each byte is read and echoed);
    // once it stops, nothing may spin.
    let target = Target::start(&tb, &[]);
    let peer = GoodPeer::new(&tb, target.addr());
    let mut slow = Vec::new();
    for engine in 0..32u64 {
        let mut ch =
            Raw::new(raw::channel_as(&tb, target.addr(), 0x510 + engine, 0, None).unwrap());
        ch.send(&[syn(1, 7, 1 << 20)]).unwrap();
        let (id, window) = ch.syn_ack(1);
        let mut frame = Vec::new();
        let len = window as usize; // within the credit the target granted
        Frame::Data { stream: id, offset: 0, payload: &vec![2u8; len] }.encode(&mut frame);
        ch.sock.write_all(&frame[..24 + 100]).unwrap();
        slow.push((ch, frame, 24 + 100));
    }
    during(&peer, || {
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(1) {
            for (ch, frame, at) in &mut slow {
                if *at < frame.len() {
                    let _ = ch.sock.write_all(&frame[*at..*at + 1]);
                    *at += 1;
                }
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    });
    assert!(slow.iter().all(|(_, frame, at)| *at < frame.len()), "a payload finished");
    target.assert_quiet("with 32 payloads left unfinished");
    target.assert_bounded("with 32 payloads left unfinished");
    peer.served_within(Duration::from_secs(1));
    drop(slow);
}

/// Fake engine ids from one source took the target to its fd limit (a channel costs an fd):
/// channels are budgeted per source address and engine-wide, and a peer from another source
/// still gets in.
fn channels_are_budgeted_per_source_and_in_all(hosts: Hosts) {
    let Some(tb) = Testbed::of(hosts) else { return };
    let target = Target::start(&tb, &["--max-channels-per-source", "40", "--max-sessions", "1000"]);
    let before = fd_count(&target.pid);
    let mut held = Vec::new();
    let mut refused = 0;
    let attacker = Some(tb.second_addr_a());
    for engine in 0..60u64 {
        match raw::channel_as_from(&tb, attacker, target.addr(), 0xFD00 + engine, 0, None) {
            Ok(s) => held.push(s),
            Err(RejectReason::Limit) => refused += 1,
            Err(e) => panic!("refused for another reason: {e:?}"),
        }
    }
    assert_eq!(held.len(), 40, "the per-source budget");
    assert_eq!(refused, 20);
    let grown = fd_count(&target.pid) - before;
    assert!(grown <= 40 + 4, "{grown} fds for 40 channels");
    target.assert_bounded("at the per-source channel budget");
    // Another source is not affected.
    let peer = GoodPeer::new(&tb, target.addr());
    peer.served_within(Duration::from_secs(1));
    drop(held);
}

/// Out of fds, the acceptor spun at 100% on a level-triggered listener whose `accept` kept
/// failing with `EMFILE`. Now it refuses the waiting connection and rests.
fn running_out_of_fds_does_not_spin_the_acceptor(hosts: Hosts) {
    let Some(tb) = Testbed::of(hosts) else { return };
    // A low fd limit, and engine budgets above it: the process runs out of fds first (the
    // engine-wide channel budget is 64 at least, and the process holds about 20 fds of its own).
    let target = Target::start_with(&tb, &["--max-channels-per-source", "1000"], Some(72));
    let peer = GoodPeer::new(&tb, target.addr());
    let mut held = Vec::new();
    for engine in 0..200u64 {
        match raw::channel_as(&tb, target.addr(), 0xE3F1E + engine, 0, None) {
            Ok(s) => held.push(s),
            Err(_) if !held.is_empty() => break, // out of fds: refused
            Err(e) => panic!("refused before any channel was admitted: {e:?}"),
        }
    }
    // More connections keep knocking while the process has no fd left.
    let knockers: Vec<_> =
        (0..50).filter_map(|_| raw::peer_from(&tb, None, target.addr()).ok()).collect();
    let fds = fds_in_use(&target.pid, target.fd_limit);
    eprintln!("{} channels admitted; target at {fds} of {} fds", held.len(), target.fd_limit);
    assert!(fds + 4 >= target.fd_limit, "the attack did not take the process to its fd limit");
    target.assert_quiet("with the process out of fds and connections waiting");
    // Channels made before still work.
    peer.served_within(Duration::from_secs(1));
    drop(knockers);
    drop(held);
    std::thread::sleep(Duration::from_millis(300));
    // Once fds are back, new peers get in.
    let later = GoodPeer::new(&tb, target.addr());
    later.served_within(Duration::from_secs(1));
}

/// Re-opening silent connections at about 1,000 per second kept every handshake slot full:
/// no well-behaved peer got in. Slots are now limited per source, and a newcomer from a
/// quieter source takes the oldest slot of the busiest one.
fn silent_handshakes_from_one_source_do_not_keep_others_out(hosts: Hosts) {
    let Some(tb) = Testbed::of(hosts) else { return };
    let target = Target::start(&tb, &[]);
    let stop = Arc::new(AtomicBool::new(false));
    // On loopback, attackers come from several addresses (and so fill every slot); between
    // the namespaces, from host A's second address. The good peer comes from host A's first.
    let sources: Vec<Option<IpAddr>> = match hosts {
        Hosts::Loopback => (10..18).map(|x| Some(IpAddr::from([127, 0, 0, x]))).collect(),
        Hosts::Netns => vec![Some(tb.second_addr_a())],
    };
    let attackers: Vec<_> = sources
        .into_iter()
        .map(|src| {
            let (tb_a, stop, to) = (tb.a.clone(), stop.clone(), target.addr());
            std::thread::spawn(move || {
                if let Some(ns) = tb_a {
                    netchannel::enter_netns(&ns).unwrap();
                }
                let mut held = std::collections::VecDeque::new();
                let mut opened = 0u64;
                while !stop.load(Ordering::Acquire) {
                    let s = socket2::Socket::new(
                        socket2::Domain::for_address(to),
                        socket2::Type::STREAM,
                        None,
                    )
                    .unwrap();
                    if let Some(ip) = src {
                        s.bind(&SocketAddr::new(ip, 0).into()).unwrap();
                    }
                    if s.connect(&to.into()).is_ok() {
                        opened += 1;
                        held.push_back(s);
                        if held.len() > 64 {
                            held.pop_front();
                        }
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
                opened
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(500)); // the slots are full by now
    let t0 = Instant::now();
    let peer = GoodPeer::new(&tb, target.addr());
    let joined = t0.elapsed();
    eprintln!("a good peer joined in {joined:?} while silent connections kept coming");
    assert!(joined < Duration::from_secs(1), "the good peer took {joined:?} to join");
    peer.served_within(Duration::from_secs(1));
    target.assert_bounded("during the handshake flood");
    stop.store(true, Ordering::Release);
    let opened: u64 = attackers.into_iter().map(|a| a.join().unwrap()).sum();
    eprintln!("the attackers opened {opened} connections");
    std::thread::sleep(Duration::from_millis(1200)); // their handshakes time out
    target.assert_quiet("after the flood");
}

/// With a pre-shared key, a keyless machine in the middle could relay one key holder's
/// handshake into another (or back into the same one) and be admitted as it. Proofs now bind
/// the address dialed and both roles, and an engine refuses its own id.
fn a_relayed_or_reflected_handshake_is_refused(hosts: Hosts) {
    let Some(tb) = Testbed::of(hosts) else { return };
    let key = b"the shared key, thirty-two bytes".to_vec();
    let (a, b) = tb.engines(|c| c.psk = Some(key.clone()));
    let _l = b.listen(7).unwrap();
    // A relay on host A: whoever dials it is piped to `to`.
    let relay = |to: SocketAddr| -> SocketAddr {
        let l = tb.on_a({
            let ip = tb.addr_a;
            move || TcpListener::bind(SocketAddr::new(ip, 0)).unwrap()
        });
        let at = l.local_addr().unwrap();
        let ns = tb.a.clone();
        std::thread::spawn(move || {
            if let Some(ns) = ns {
                netchannel::enter_netns(&ns).unwrap();
            }
            for inc in l.incoming() {
                let Ok(inc) = inc else { return };
                let Ok(out) = TcpStream::connect(to) else { continue };
                let (mut i2, mut o2) = (inc.try_clone().unwrap(), out.try_clone().unwrap());
                let (mut inc, mut out) = (inc, out);
                std::thread::spawn(move || std::io::copy(&mut inc, &mut o2));
                std::thread::spawn(move || std::io::copy(&mut out, &mut i2));
            }
        });
        at
    };
    // Relayed into another key holder: a dials the relay, which pipes to b.
    let failures = b.stats().handshake_failures;
    let err = a.connect(relay(b.local_addr()), 7).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::PermissionDenied, "{err}");
    assert_eq!(b.stats().sessions, 0, "b admitted a relayed channel");
    let deadline = Instant::now() + Duration::from_secs(5);
    while b.stats().handshake_failures == failures {
        assert!(Instant::now() < deadline, "b did not count the refusal");
        std::thread::sleep(Duration::from_millis(5));
    }
    // Reflected into the dialer itself: a dials the relay, which pipes back to a.
    let err = a.connect(relay(a.local_addr()), 7).unwrap_err();
    eprintln!("reflected: {err}");
    assert_eq!(a.stats().sessions, 0, "a admitted its own reflected channel");
    // The key holders still reach each other directly.
    let s = a.connect(b.local_addr(), 7).unwrap();
    s.send(b"direct").unwrap();
}

/// A Hello and a Confirm followed by a reset left one session each in the engine's map (it
/// was inserted before the channel was admitted and never removed).
fn failed_admissions_leave_no_session(hosts: Hosts) {
    let Some(tb) = Testbed::of(hosts) else { return };
    let (_a, b) = tb.engines(|_| {});
    for engine in 0..100u64 {
        let mut s = raw::peer(&tb, b.local_addr());
        let hello = netchannel::wire::Handshake::hello(
            0xAD00 + engine,
            0,
            0,
            Class::Throughput,
            [3; 16],
            false,
        );
        s.write_all(&hello.encode()).unwrap();
        let challenge = raw::read_handshake(&mut s);
        let confirm =
            netchannel::wire::Handshake::confirm(&hello, &challenge, None, b.local_addr());
        s.write_all(&confirm.encode()).unwrap();
        // A reset right after the Confirm (SO_LINGER 0).
        socket2::SockRef::from(&s).set_linger(Some(Duration::ZERO)).unwrap();
        drop(s);
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let st = b.stats();
        if st.sessions == 0 && st.session_entries == 0 && st.channels_open == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "admissions left {} sessions ({} entries), {} channels",
            st.sessions,
            st.session_entries,
            st.channels_open
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Pausing a peer's reads at its memory bound also stopped its ACKs and CREDITs: a client
/// blocked in send waiting for credit while it held unread bytes over the bound never got it.
/// Channels are never paused now; the receive budget bounds memory instead.
fn credit_keeps_flowing_while_a_peer_holds_unread_bytes(hosts: Hosts) {
    let Some(tb) = Testbed::of(hosts) else { return };
    let (a, b) = tb.engines(|c| {
        c.max_peer_buffered = 4 * MIB;
        c.max_buffered = 64 * MIB;
    });
    let l = b.listen(7).unwrap();
    // Stream 1: the server sends 16 MiB the client never reads.
    let unread = a.connect(b.local_addr(), 7).unwrap();
    let unread_peer = l.accept().unwrap();
    unread_peer.set_nonblocking(true);
    let big = vec![9u8; 16 << 20];
    let mut pushed = 0;
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(1) {
        if let Ok(n) = unread_peer.send(&big[pushed..]) {
            pushed += n;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let held = a.stats().held_bytes;
    eprintln!("the client holds {held} unread bytes (budget 4 MiB + the stream's own window)");
    let floor = u64::from(tb.config_a().min_stream_window);
    assert!(held <= 4 * MIB + floor, "held {held}");
    // Stream 2: the client sends 16 MiB the server reads; its credit must keep coming.
    let sender = a.connect(b.local_addr(), 7).unwrap();
    let reader = l.accept().unwrap();
    let r = std::thread::spawn(move || recv_pattern(&reader, 5, 1 << 16));
    sender.set_write_timeout(Some(Duration::from_secs(10))).unwrap();
    send_pattern(&sender, 5, 16 << 20, 1 << 20);
    sender.shutdown().unwrap();
    assert_eq!(r.join().unwrap(), 16 << 20);
    drop(unread);
}

/// Dialing held one engine-wide lock across sequential blocking dials: an acceptor that
/// dribbled a byte a second held each dial for minutes and every other peer waited. Each dial
/// now has one deadline, and only connects to the same destination wait for it.
fn a_slow_acceptor_holds_neither_its_dial_nor_other_peers(hosts: Hosts) {
    let Some(tb) = Testbed::of(hosts) else { return };
    let (a, b) = tb.engines(|c| c.dial_timeout = Duration::from_secs(2));
    let _l = b.listen(7).unwrap();
    // On host B: accepts, then answers a byte a second.
    let slow = {
        let ns = tb.b.clone();
        let ip = tb.addr_b;
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            if let Some(ns) = ns {
                netchannel::enter_netns(&ns).unwrap();
            }
            let l = TcpListener::bind(SocketAddr::new(ip, 0)).unwrap();
            tx.send(l.local_addr().unwrap()).unwrap();
            for inc in l.incoming() {
                let Ok(mut s) = inc else { return };
                std::thread::spawn(move || {
                    let msg = netchannel::wire::handshake::MAGIC;
                    for byte in msg.iter().cycle().take(72) {
                        if s.write_all(&[*byte]).is_err() {
                            return;
                        }
                        std::thread::sleep(Duration::from_secs(1));
                    }
                });
            }
        });
        rx.recv().unwrap()
    };
    let a = Arc::new(a);
    let dial = {
        let a = a.clone();
        std::thread::spawn(move || {
            let t0 = Instant::now();
            (a.connect(slow, 7).map(|_| ()), t0.elapsed())
        })
    };
    std::thread::sleep(Duration::from_millis(200));
    let t0 = Instant::now();
    let s = a.connect(b.local_addr(), 7).unwrap();
    let other = t0.elapsed();
    eprintln!("a connect to a good peer took {other:?} while a slow dial was in progress");
    assert!(other < Duration::from_secs(1), "the good peer waited {other:?}");
    s.send(b"ok").unwrap();
    let (r, took) = dial.join().unwrap();
    eprintln!("the dial to the slow acceptor failed after {took:?}: {r:?}");
    assert_eq!(r.unwrap_err().kind(), ErrorKind::TimedOut);
    assert!(took < Duration::from_secs(4), "the dial took {took:?}");
}

/// No keepalive or acknowledgement timeout: a black-holed channel was noticed after about 15
/// minutes (TCP's retransmissions), or never if idle. Between the namespaces, host A's link
/// goes down (everything dropped, no reset): a busy channel fails once neither the peer engine
/// (`ack_timeout`) nor the peer's kernel (`user_timeout`, read from `TCP_INFO`) acknowledged
/// anything, an idle one after `keepalive_idle` + `keepalive_count` x `keepalive_interval`.
fn a_black_holed_peer_is_declared_dead(hosts: Hosts) {
    let Some(tb) = Testbed::of(hosts) else { return };
    let Some((ns, dev)) = tb.link_a.clone() else { return }; // loopback cannot be cut
    let (a, b) = tb.engines(|c| {
        c.keepalive_idle = Duration::from_secs(1);
        c.keepalive_interval = Duration::from_secs(1);
        c.keepalive_count = 2;
        c.user_timeout = Duration::from_secs(2);
        c.ack_timeout = Duration::from_secs(2);
    });
    let l = b.listen(7).unwrap();
    let busy = a.connect(b.local_addr(), 7).unwrap();
    let _busy_peer = l.accept().unwrap();
    let link = |state: &str| {
        let out = std::process::Command::new("ip")
            .args(["-n", &ns, "link", "set", &dev, state])
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    };
    link("down");
    let t0 = Instant::now();
    // Bytes that cannot leave: the busy channels' retransmissions time out.
    busy.set_nonblocking(true);
    let _ = busy.send(&vec![1u8; 1 << 20]);
    busy.set_nonblocking(false);
    busy.set_read_timeout(Some(Duration::from_secs(15))).unwrap();
    let mut buf = [0u8; 16];
    let err = busy.recv(&mut buf).unwrap_err();
    let took = t0.elapsed();
    link("up");
    eprintln!("a black-holed peer was declared dead after {took:?}: {err}");
    assert_eq!(err.kind(), ErrorKind::ConnectionReset, "{err}");
    // ack_timeout and user_timeout (2 s; looked at again 2 s later if the kernel's silence was
    // a little short of it) for the busy channels, keepalive (1 + 2 x 1 s) for idle ones; the
    // session dies with its last channel.
    assert!(took < Duration::from_secs(8), "declared dead after {took:?}");
}

/// A peer that opened streams behind a full backlog and then reset them (a target's stream ids
/// can be guessed, and a wrong guess costs only a counter) left each one in the target's
/// stream table for good: no application accepts a reset stream, so nothing closed it, and
/// repeating that filled the table (`max_streams`) until the target's own connects to the peer
/// failed. Each is freed when its turn in the waiting line comes.
fn streams_reset_in_the_waiting_line_are_freed(hosts: Hosts) {
    let Some(tb) = Testbed::of(hosts) else { return };
    let (_a, b) = tb.engines(|c| c.accept_backlog = 2);
    let l = b.listen(7).unwrap();
    let sock = raw::channel_as(&tb, b.local_addr(), 0x7E57, 0, None).unwrap();
    let mut ch = Raw::new(sock);
    let syns: Vec<Frame<'static>> = (1..=4u64).map(|i| syn((1 << 24) | i, 7, 1 << 20)).collect();
    ch.send(&syns).unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    let incoming = || -> Vec<u64> {
        let st = b.stats();
        st.sockets.iter().filter(|s| s.state == "incoming").map(|s| s.id).collect()
    };
    while incoming().len() < 2 || l.pending() < 2 {
        assert!(Instant::now() < deadline, "{:?}", b.stats().sockets);
        std::thread::sleep(Duration::from_millis(1));
    }
    let waiting = incoming();
    let rsts: Vec<Frame<'static>> = waiting
        .iter()
        .map(|&dst| Frame::Rst { dst, reason: wire::RstReason::Aborted, final_offset: 0 })
        .collect();
    ch.send(&rsts).unwrap();
    while b.stats().sockets.iter().filter(|s| s.state == "reset").count() < 2 {
        assert!(Instant::now() < deadline, "{:?}", b.stats().sockets);
        std::thread::sleep(Duration::from_millis(1));
    }
    let accepted: Vec<VSocket> = (0..2).map(|_| l.accept().unwrap()).collect();
    assert_eq!(l.pending(), 0, "a reset stream was admitted to the backlog");
    let left = b.stats().sockets;
    assert_eq!(left.len(), 2, "reset streams stayed in the table: {left:?}");
    drop(accepted);
}

/// A peer that opened a stream and went away (its channel closed) left the stream in the
/// listener's backlog, and with it the whole retired session, outside `max_sessions`: a peer
/// repeating it under fresh engine ids kept up to two backlogs' worth of sessions alive. The
/// reset ones now leave the queue with their session; one whose every byte and FIN arrived
/// stays, as a TCP connection its peer closed stays in the accept queue, and reads to its end.
fn a_retired_session_leaves_only_readable_streams_in_the_backlog(hosts: Hosts) {
    let Some(tb) = Testbed::of(hosts) else { return };
    let (_a, b) = tb.engines(|_| {});
    let l = b.listen(7).unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    // Two peers: one opens a stream and vanishes; one opens, sends "bye" and FIN, then vanishes.
    for (engine, finish) in [(0x7E58u64, false), (0x7E59, true)] {
        let sock = raw::channel_as(&tb, b.local_addr(), engine, 0, None).unwrap();
        let mut ch = Raw::new(sock);
        let src = (1 << 24) | 1;
        ch.send(&[syn(src, 7, 1 << 20)]).unwrap();
        let (dst, _) = ch.syn_ack(src);
        if finish {
            let data = Frame::Data { stream: dst, offset: 0, payload: b"bye" };
            ch.send(&[data, Frame::Fin { dst, final_offset: 3 }]).unwrap();
            // Acknowledged, so every byte is in before the channel goes.
            while !ch
                .poll(Duration::from_millis(20))
                .unwrap()
                .iter()
                .any(|f| matches!(f, Frame::Ack { .. }))
            {
                assert!(Instant::now() < deadline, "no ACK for the FIN");
            }
        }
        socket2::SockRef::from(&ch.sock).set_linger(Some(Duration::ZERO)).unwrap();
        drop(ch);
    }
    while b.stats().sessions > 0 || l.pending() > 1 {
        assert!(
            Instant::now() < deadline,
            "pending {}, sessions {}: {:?}",
            l.pending(),
            b.stats().sessions,
            b.stats().sockets
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(l.pending(), 1, "the finished stream is still there to accept");
    let s = l.accept().unwrap();
    let mut got = Vec::new();
    (&s).read_to_end(&mut got).unwrap();
    assert_eq!(got, b"bye");
    drop(s);
    assert!(b.stats().sockets.iter().all(|s| s.state != "reset"), "{:?}", b.stats().sockets);
}
