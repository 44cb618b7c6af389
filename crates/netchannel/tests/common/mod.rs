//! Test harness: engine pairs over loopback or across two network namespaces joined by a veth
//! pair (created here, removed when the testbed is dropped).

#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};

use netchannel::{Config, Engine};

#[derive(Clone, Copy, Debug)]
pub enum Hosts {
    Loopback,
    Netns,
}

/// Two "hosts": on loopback both are this network namespace; with netns, each is its own.
pub struct Testbed {
    pub a: Option<PathBuf>,
    pub b: Option<PathBuf>,
    pub addr_a: std::net::IpAddr,
    pub addr_b: std::net::IpAddr,
    /// Host A's end of the veth pair, and its namespace's name (namespaces only).
    pub link_a: Option<(String, String)>,
    names: Vec<String>,
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip").args(args).output().map_err(|e| format!("ip: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("ip {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim()))
    }
}

static COUNTER: AtomicUsize = AtomicUsize::new(0);

impl Testbed {
    pub fn loopback() -> Testbed {
        Testbed {
            a: None,
            b: None,
            addr_a: [127, 0, 0, 1].into(),
            addr_b: [127, 0, 0, 1].into(),
            link_a: None,
            names: vec![],
        }
    }

    /// Two namespaces joined by a veth pair. `None` (with a note on stderr) when namespaces
    /// cannot be created here; in CI (CI set) that is a failure instead.
    pub fn netns() -> Option<Testbed> {
        let n = COUNTER.fetch_add(1, Ordering::SeqCst);
        let tag = format!("{}x{n}", std::process::id() % 100_000);
        let (na, nb) = (format!("nct{tag}a"), format!("nct{tag}b"));
        let (va, vb) = (format!("ncv{tag}a"), format!("ncv{tag}b"));
        let build = || -> Result<(), String> {
            ip(&["netns", "add", &na])?;
            ip(&["netns", "add", &nb])?;
            ip(&["link", "add", &va, "type", "veth", "peer", "name", &vb])?;
            ip(&["link", "set", &va, "netns", &na])?;
            ip(&["link", "set", &vb, "netns", &nb])?;
            ip(&["-n", &na, "addr", "add", "10.213.0.1/24", "dev", &va])?;
            // A second address on host A: a second source (attacks that come from one place).
            ip(&["-n", &na, "addr", "add", "10.213.0.3/24", "dev", &va])?;
            ip(&["-n", &nb, "addr", "add", "10.213.0.2/24", "dev", &vb])?;
            for (ns, dev) in [(&na, &va), (&nb, &vb)] {
                ip(&["-n", ns, "link", "set", dev, "up"])?;
                ip(&["-n", ns, "link", "set", "lo", "up"])?;
            }
            Ok(())
        };
        let tb = Testbed {
            a: Some(PathBuf::from(format!("/run/netns/{na}"))),
            b: Some(PathBuf::from(format!("/run/netns/{nb}"))),
            addr_a: [10, 213, 0, 1].into(),
            addr_b: [10, 213, 0, 2].into(),
            link_a: Some((na.clone(), va.clone())),
            names: vec![na.clone(), nb.clone()],
        };
        match build() {
            Ok(()) => Some(tb),
            Err(e) => {
                drop(tb);
                if std::env::var_os("CI").is_some() {
                    panic!("cannot create network namespaces in CI: {e}");
                }
                eprintln!("skipping namespace test: {e}");
                None
            }
        }
    }

    /// Another address of host A than `addr_a`: a second source.
    pub fn second_addr_a(&self) -> std::net::IpAddr {
        match self.a {
            None => [127, 0, 0, 2].into(),
            Some(_) => [10, 213, 0, 3].into(),
        }
    }

    pub fn of(hosts: Hosts) -> Option<Testbed> {
        match hosts {
            Hosts::Loopback => Some(Testbed::loopback()),
            Hosts::Netns => Testbed::netns(),
        }
    }

    /// One session per peer (`session_shards` 1, whatever the cores): the tests count a
    /// session's channels and streams; `tests/shards.rs` tests the shards.
    pub fn config_a(&self) -> Config {
        Config {
            netns: self.a.clone(),
            session_shards: 1,
            ..Config::new(SocketAddr::new(self.addr_a, 0))
        }
    }

    /// See `config_a`.
    pub fn config_b(&self) -> Config {
        Config {
            netns: self.b.clone(),
            session_shards: 1,
            ..Config::new(SocketAddr::new(self.addr_b, 0))
        }
    }

    /// Client engine on host A, server engine on host B.
    pub fn engines(&self, tweak: impl Fn(&mut Config)) -> (Engine, Engine) {
        let (mut ca, mut cb) = (self.config_a(), self.config_b());
        tweak(&mut ca);
        tweak(&mut cb);
        (Engine::new(ca).expect("engine a"), Engine::new(cb).expect("engine b"))
    }
}

impl Drop for Testbed {
    fn drop(&mut self) {
        for n in &self.names {
            let _ = ip(&["netns", "del", n]);
        }
    }
}

/// Deterministic test data: byte `i` of stream `seed`.
pub fn pattern(seed: u64, offset: u64, out: &mut [u8]) {
    // Word-at-a-time: byte p is byte p % 8 of a hash of word p / 8.
    let word = |w: u64| (w.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ seed).to_le_bytes();
    let mut p = offset;
    let mut i = 0;
    while i < out.len() {
        let w = word(p / 8);
        let start = (p % 8) as usize;
        let n = (8 - start).min(out.len() - i);
        out[i..i + n].copy_from_slice(&w[start..start + n]);
        i += n;
        p += n as u64;
    }
}

/// Small, fast PRNG for sizes and choices.
pub struct Rng(pub u64);
impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

impl Testbed {
    /// Runs `f` on a thread inside host A's namespace (sockets it creates live there).
    pub fn on_a<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> T {
        let ns = self.a.clone();
        std::thread::spawn(move || {
            if let Some(ns) = ns {
                netchannel::enter_netns(&ns).expect("enter netns");
            }
            f()
        })
        .join()
        .expect("thread in netns")
    }
}

/// Sends `len` bytes of `pattern(seed)` in `write` sized calls.
pub fn send_pattern(sock: &netchannel::VSocket, seed: u64, len: u64, write: usize) {
    let mut buf = vec![0u8; write];
    let mut off = 0u64;
    while off < len {
        let n = ((len - off) as usize).min(write);
        pattern(seed, off, &mut buf[..n]);
        let mut done = 0;
        while done < n {
            done += sock.send(&buf[done..n]).expect("send");
        }
        off += n as u64;
    }
}

/// Reads until EOF, checking every byte against `pattern(seed)`; returns the length.
pub fn recv_pattern(sock: &netchannel::VSocket, seed: u64, read: usize) -> u64 {
    let mut buf = vec![0u8; read];
    let mut expect = vec![0u8; read];
    let mut off = 0u64;
    loop {
        let n = sock.recv(&mut buf).expect("recv");
        if n == 0 {
            return off;
        }
        pattern(seed, off, &mut expect[..n]);
        assert!(buf[..n] == expect[..n], "corrupt bytes at offset {off}..{}", off + n as u64);
        off += n as u64;
    }
}

/// How long one test may run before it counts as hung. The slowest takes about 10 s here; a
/// hang (a lost wake-up, a stall) must fail the run in minutes with its name, not run into
/// CI's time limit with no word of which test stopped.
pub const TEST_DEADLINE: std::time::Duration = std::time::Duration::from_secs(240);

/// Ends the process at once after writing `why` to stderr itself: the harness captures
/// `eprintln!` of a test's threads and prints it only when the test ends, which an abort
/// never lets it do (a CI log then names the hung test but not the state it hung in).
pub fn abort_saying(why: &str) -> ! {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "{why}; aborting");
    std::process::abort();
}

/// Runs `test` on its own thread; a panic fails the test as usual, and a test still running
/// after `TEST_DEADLINE` aborts the whole process, naming it (a hung thread cannot be stopped,
/// and the harness would wait for it forever).
pub fn with_deadline(name: &str, test: impl FnOnce() + Send + 'static) {
    let (done, finished) = std::sync::mpsc::channel();
    let runner = std::thread::Builder::new()
        .name(name.to_string())
        .spawn(move || {
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(test));
            let _ = done.send(r);
        })
        .expect("spawn the test's thread");
    match finished.recv_timeout(TEST_DEADLINE) {
        Ok(Ok(())) => {
            let _ = runner.join();
        }
        Ok(Err(panic)) => std::panic::resume_unwind(panic),
        Err(_) => {
            abort_saying(&format!("test {name} still running after {TEST_DEADLINE:?}: hung"));
        }
    }
}

/// Declares one test per testbed for a function taking `Hosts`, each under `TEST_DEADLINE`.
#[macro_export]
macro_rules! both_testbeds {
    ($($name:ident),* $(,)?) => {
        mod loopback { $( #[test] fn $name() {
            $crate::common::with_deadline(concat!("loopback::", stringify!($name)), || {
                super::$name($crate::common::Hosts::Loopback)
            })
        } )* }
        mod netns { $( #[test] fn $name() {
            $crate::common::with_deadline(concat!("netns::", stringify!($name)), || {
                super::$name($crate::common::Hosts::Netns)
            })
        } )* }
    };
}

/// Resident memory of process `pid` ("self" for this one), from /proc.
pub fn rss_bytes(pid: &str) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = s.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() * 1024
}

/// Threads of process `pid`, from /proc.
pub fn thread_count(pid: &str) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/task")).unwrap().count()
}

/// An `nc-echo` process on host B: a target with its own memory and threads to measure.
pub struct EchoProcess {
    pub child: std::process::Child,
    pub addr: SocketAddr,
}

impl EchoProcess {
    pub fn start(tb: &Testbed, extra: &[&str]) -> EchoProcess {
        Self::start_with(tb, extra, None)
    }

    /// `start` with the process's open-file limit set to `nofile` (through prlimit).
    pub fn start_with(tb: &Testbed, extra: &[&str], nofile: Option<u32>) -> EchoProcess {
        use std::io::BufRead;
        // Defined for this crate's tests only (other crates include this module too).
        let Some(exe) = option_env!("CARGO_BIN_EXE_nc-echo") else {
            panic!("nc-echo is built only for netchannel's own tests")
        };
        let mut cmd = match nofile {
            Some(n) => {
                let mut c = Command::new("prlimit");
                c.arg(format!("--nofile={n}:{n}")).arg(exe);
                c
            }
            None => Command::new(exe),
        };
        cmd.args(["--listen", &SocketAddr::new(tb.addr_b, 0).to_string(), "--port", "7"]);
        cmd.args(extra);
        if let Some(ns) = &tb.b {
            cmd.arg("--netns").arg(ns);
        }
        let mut child = cmd.stdout(std::process::Stdio::piped()).spawn().unwrap();
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
        let addr = line.trim().parse().unwrap_or_else(|_| panic!("nc-echo said {line:?}"));
        EchoProcess { child, addr }
    }

    pub fn pid(&self) -> String {
        self.child.id().to_string()
    }
}

impl Drop for EchoProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Hand-driven channels, speaking raw bytes as a hostile peer would.
pub mod raw {
    use std::io::{Read, Write};
    use std::net::{SocketAddr, TcpStream};
    use std::time::Duration;

    use netchannel::wire::handshake::HANDSHAKE_LEN;
    use netchannel::wire::{self, Decoded, Frame, Handshake, HandshakeKind, RejectReason};
    use netchannel::Class;

    use super::Testbed;

    /// A TCP connection from host A to `to`.
    pub fn peer(tb: &Testbed, to: SocketAddr) -> TcpStream {
        peer_from(tb, None, to).expect("connect")
    }

    /// A TCP connection from host A's address `from` (default: its first) to `to`.
    pub fn peer_from(
        tb: &Testbed,
        from: Option<std::net::IpAddr>,
        to: SocketAddr,
    ) -> std::io::Result<TcpStream> {
        let s = tb.on_a(move || {
            let sock = socket2::Socket::new(
                socket2::Domain::for_address(to),
                socket2::Type::STREAM,
                None,
            )?;
            if let Some(ip) = from {
                sock.bind(&SocketAddr::new(ip, 0).into())?;
            }
            sock.connect(&to.into())?;
            Ok::<_, std::io::Error>(TcpStream::from(sock))
        })?;
        s.set_read_timeout(Some(Duration::from_secs(5)))?;
        Ok(s)
    }

    pub fn read_handshake(s: &mut TcpStream) -> Handshake {
        try_read_handshake(s).expect("a handshake message")
    }

    /// The next handshake message, or `None` when the acceptor closed the connection.
    pub fn try_read_handshake(s: &mut TcpStream) -> Option<Handshake> {
        let mut reply = [0u8; HANDSHAKE_LEN];
        s.read_exact(&mut reply).ok()?;
        Some(Handshake::decode(&reply).unwrap())
    }

    /// Completes a channel handshake claiming `engine_id` and channel `index`, with `key` if
    /// given; the acceptor's refusal otherwise.
    pub fn channel_as(
        tb: &Testbed,
        to: SocketAddr,
        engine_id: u64,
        index: u16,
        key: Option<&[u8]>,
    ) -> Result<TcpStream, RejectReason> {
        channel_as_from(tb, None, to, engine_id, index, key)
    }

    /// `channel_as` from host A's address `from`.
    pub fn channel_as_from(
        tb: &Testbed,
        from: Option<std::net::IpAddr>,
        to: SocketAddr,
        engine_id: u64,
        index: u16,
        key: Option<&[u8]>,
    ) -> Result<TcpStream, RejectReason> {
        let Ok(mut s) = peer_from(tb, from, to) else {
            return Err(RejectReason::Unknown(0));
        };
        let hello =
            Handshake::hello(engine_id, index, 0, Class::Throughput, [7; 16], key.is_some());
        s.write_all(&hello.encode()).unwrap();
        let Some(challenge) = try_read_handshake(&mut s) else {
            return Err(RejectReason::Unknown(0));
        };
        match challenge.kind {
            HandshakeKind::Challenge => {}
            HandshakeKind::Reject(why) => return Err(why),
            other => panic!("unexpected {other:?}"),
        }
        // The proof binds the address dialed, as the engine's dialer does.
        s.write_all(&Handshake::confirm(&hello, &challenge, key, to).encode()).unwrap();
        let Some(answer) = try_read_handshake(&mut s) else {
            return Err(RejectReason::Unknown(0));
        };
        match answer.kind {
            HandshakeKind::Accept => Ok(s),
            HandshakeKind::Reject(why) => Err(why),
            other => panic!("unexpected {other:?}"),
        }
    }

    /// Completes a channel handshake by hand (no key) and returns the raw channel.
    pub fn channel(tb: &Testbed, to: SocketAddr) -> TcpStream {
        channel_as(tb, to, 0xBAD, 0, None).expect("channel accepted")
    }

    /// Reads frames until a SYN_ACK; returns the acceptor's stream id.
    pub fn read_syn_ack(s: &mut TcpStream) -> u64 {
        let mut buf = Vec::new();
        let mut chunk = [0u8; 256];
        loop {
            while let Ok(Decoded::Frame(f, n)) = wire::decode(&buf) {
                if let Frame::SynAck { src, .. } = f {
                    return src;
                }
                buf.drain(..n);
            }
            let n = s.read(&mut chunk).unwrap();
            assert!(n > 0, "channel closed before SYN_ACK");
            buf.extend_from_slice(&chunk[..n]);
        }
    }
}

/// Waits (up to 10 s) until `engine` has `n` channels open: a session's throughput channels
/// after its first are dialed in the background.
pub fn wait_for_channels(engine: &netchannel::Engine, n: usize) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while engine.stats().channels.len() < n {
        assert!(
            std::time::Instant::now() < deadline,
            "{} of {n} channels after 10 s",
            engine.stats().channels.len()
        );
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
}

/// Voluntary context switches of the engines' worker threads (in this process): their
/// wake-ups.
pub fn worker_wakes(engines: &[&Engine]) -> u64 {
    engines
        .iter()
        .flat_map(|e| e.stats().workers)
        .map(|w| {
            let status = std::fs::read_to_string(format!("/proc/self/task/{}/status", w.tid))
                .unwrap_or_default();
            status
                .lines()
                .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))
                .map_or(0, |v| v.trim().parse().unwrap())
        })
        .sum()
}
