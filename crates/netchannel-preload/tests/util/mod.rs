//! Running programs on the testbed's hosts, with or without `netchannel run`.

#![allow(dead_code)]

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicU16, Ordering};
use std::time::{Duration, Instant};

use crate::common::{Hosts, Testbed};

pub const NETCHANNEL: &str = env!("CARGO_BIN_EXE_netchannel");

/// Ports unique to this test process, so tests run in parallel on loopback do not collide
/// (each test takes a channel port and a few application ports). All below the kernel's
/// ephemeral range (`ip_local_port_range`, 32768 and up by default): a port there can already
/// be the local port of some connection (an engine's dialed channel, a benchmark client's),
/// and then a server's engine cannot bind its channel port and every connect to it is refused.
pub fn ports(n: u16) -> u16 {
    static NEXT: AtomicU16 = AtomicU16::new(0);
    let base = 20000 + (std::process::id() % 120) as u16 * 100;
    base + NEXT.fetch_add(n, Ordering::SeqCst)
}

/// Whether a program is installed (scripts/setup.sh installs them; CI must have them).
pub fn have(prog: &str) -> bool {
    let found = Command::new("sh")
        .args(["-c", &format!("command -v {prog}")])
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !found {
        if std::env::var_os("CI").is_some() {
            panic!("{prog} is not installed: run scripts/setup.sh");
        }
        eprintln!("skipping: {prog} is not installed (scripts/setup.sh installs it)");
    }
    found
}

/// One side of a test: a host (namespace or this one), and whether programs run under
/// `netchannel run`.
#[derive(Clone)]
pub struct Side {
    pub netns: Option<String>,
    pub addr: String,
    pub carried: bool,
    pub channel_port: u16,
    pub stats: PathBuf,
    /// More `netchannel run` options (a key file, budgets).
    pub run_options: Vec<String>,
    /// The soft fd limit the side's programs start with (the hard one is left as it is).
    pub soft_fd_limit: Option<u64>,
}

impl Side {
    pub fn command(&self, prog: &str, args: &[&str]) -> Command {
        let mut argv: Vec<String> = Vec::new();
        if let Some(ns) = &self.netns {
            argv.extend(["ip", "netns", "exec", ns].map(String::from));
        }
        if self.carried {
            argv.push(NETCHANNEL.into());
            argv.extend(["run", "--port"].map(String::from));
            argv.push(self.channel_port.to_string());
            argv.push("--stats-file".into());
            argv.push(self.stats.display().to_string());
            argv.extend(self.run_options.iter().cloned());
            argv.push("--".into());
        }
        argv.push(prog.into());
        argv.extend(args.iter().map(|s| s.to_string()));
        let mut c = Command::new(&argv[0]);
        c.args(&argv[1..]);
        if let Some(soft) = self.soft_fd_limit {
            let limit = rustix::process::getrlimit(rustix::process::Resource::Nofile);
            let limit = rustix::process::Rlimit { current: Some(soft), ..limit };
            // SAFETY: between fork and exec the closure makes one system call (setrlimit on
            // the child itself); it allocates nothing and takes no lock.
            unsafe {
                c.pre_exec(move || {
                    rustix::process::setrlimit(rustix::process::Resource::Nofile, limit)
                        .map_err(std::io::Error::from)
                })
            };
        }
        c
    }

    /// Runs to completion within `timeout`, failing the test on timeout or a failure exit.
    pub fn run(&self, prog: &str, args: &[&str], timeout: Duration) -> String {
        let out = self.output(prog, args, timeout);
        assert!(
            out.status.success(),
            "{prog} {args:?} failed: {}\nstdout: {}\nstderr: {}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    pub fn output(&self, prog: &str, args: &[&str], timeout: Duration) -> Output {
        let child = self
            .command(prog, args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {prog}: {e}"));
        let pid = child.id() as i32;
        // Output is drained while the program runs (a full pipe would stall it).
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(child.wait_with_output());
        });
        match rx.recv_timeout(timeout) {
            Ok(out) => out.expect("output"),
            Err(_) => {
                // SAFETY: signalling our own child, not yet reaped (the waiter holds it).
                unsafe { libc::kill(pid, libc::SIGKILL) };
                let out = rx.recv().expect("waiter").expect("output");
                panic!(
                    "{prog} {args:?} timed out after {timeout:?}\nstdout: {}\nstderr: {}",
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr)
                );
            }
        }
    }

    /// Starts a server, killed when the returned guard drops.
    pub fn spawn(&self, prog: &str, args: &[&str]) -> Server {
        let child = self
            .command(prog, args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            // A group of its own: a server's forked workers (nginx) go with it, even when a
            // failing test kills the server without ceremony.
            .process_group(0)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {prog}: {e}"));
        Server(child)
    }

    /// `prog` in this side's namespace, never under `netchannel run` (the harness's own tools).
    fn plain(&self, prog: &str) -> Command {
        match &self.netns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns, prog]);
                c
            }
            None => Command::new(prog),
        }
    }

    /// Waits (up to 10 s) until a socket listens on `port`, without connecting to it: a server
    /// that takes each connection for a client of its own (iperf3 runs a test on it, fails it
    /// when it closes, and resets what arrives meanwhile) must not be probed.
    pub fn wait_listening_quietly(&self, port: u16) {
        let deadline = Instant::now() + Duration::from_secs(10);
        let filter = format!("sport = :{port}");
        loop {
            let out = self.plain("ss").args(["-Hltn", &filter]).output().expect("ss");
            if !out.stdout.is_empty() {
                return;
            }
            assert!(Instant::now() < deadline, "nothing listens on {}:{port}", self.addr);
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits until something accepts TCP connections at `port` on this side's address.
    pub fn wait_listening(&self, port: u16) {
        let deadline = Instant::now() + Duration::from_secs(10);
        let probe = format!("exec 3<>/dev/tcp/{}/{port}", self.addr);
        loop {
            let mut c = self.plain("bash");
            c.args(["-c", &probe]);
            if c.stderr(Stdio::null()).status().is_ok_and(|s| s.success()) {
                return;
            }
            assert!(Instant::now() < deadline, "nothing listens on {}:{port}", self.addr);
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

pub struct Server(pub Child);

impl Server {
    /// Stops the server with SIGTERM (so it exits through atexit and writes its stats).
    pub fn stop(self) {
        self.stop_with(libc::SIGTERM)
    }

    /// Stops the server with `signal`, for programs that leave through exit() on another one
    /// (haproxy: SIGUSR1).
    pub fn stop_with(mut self, signal: i32) {
        // SAFETY: signalling our own child process.
        unsafe { libc::kill(self.0.id() as i32, signal) };
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if self.0.try_wait().ok().flatten().is_some() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        // SAFETY: signalling the process group our child leads (see `spawn`).
        unsafe { libc::kill(-(self.0.id() as i32), libc::SIGKILL) };
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A client side on host A and a server side on host B of the testbed, both carried or not.
pub struct Pair {
    pub tb: Testbed,
    pub dir: PathBuf,
    pub client: Side,
    pub server: Side,
}

fn ns_name(p: &Option<PathBuf>) -> Option<String> {
    p.as_ref().and_then(|p| p.file_name()).map(|n| n.to_string_lossy().into_owned())
}

impl Pair {
    pub fn new(tb: Testbed, name: &str, client_carried: bool, server_carried: bool) -> Pair {
        let dir = std::env::temp_dir().join(format!("ncpre-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("temp dir");
        let channel_port = ports(1);
        let client = Side {
            netns: ns_name(&tb.a),
            addr: tb.addr_a.to_string(),
            carried: client_carried,
            channel_port,
            stats: dir.join("client.stats"),
            run_options: Vec::new(),
            soft_fd_limit: None,
        };
        let server = Side {
            netns: ns_name(&tb.b),
            addr: tb.addr_b.to_string(),
            carried: server_carried,
            channel_port,
            stats: dir.join("server.stats"),
            run_options: Vec::new(),
            soft_fd_limit: None,
        };
        Pair { tb, dir, client, server }
    }
}

/// Runs `f` twice on a fresh pair of hosts, one program test at a time: first with both sides
/// on kernel TCP, then with both carried (`f`'s flag). Its two outputs, kernel TCP's first;
/// `None` where the testbed cannot be made (namespaces outside CI).
pub fn kernel_then_carried(
    hosts: Hosts,
    name: &str,
    mut f: impl FnMut(Pair, bool) -> String,
) -> Option<[String; 2]> {
    let mut run = |carried: bool| {
        let tb = Testbed::of(hosts)?;
        let _one_at_a_time = one_at_a_time();
        Some(f(Pair::new(tb, &format!("{name}-{hosts:?}-{carried}"), carried, carried), carried))
    };
    Some([run(false)?, run(true)?])
}

/// Runs the program tests one at a time. Each starts several multi-process programs and their
/// engines; several at once on a 2-core machine overload it far beyond what the programs' own
/// benchmarks do, and under that overload rare failures of the direct path were seen that do
/// not show one test at a time: wrk counting a read or connect error against nginx, and once a
/// conform fork-server echo that never came (an open bug, written down in docs/ARCHITECTURE.md,
/// "Limits"). Serialising keeps CI about the behaviour each test names.
pub fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    ONE.lock().unwrap_or_else(|e| e.into_inner())
}

/// Sums one `--stats` field ("virtual sockets", "kernel tcp", "no engine at peer",
/// "bytes out", ...) over all processes that wrote to `path`.
pub fn stat(path: &Path, field: &str) -> u64 {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    text.lines().map(|l| stat_line(l, field)).sum()
}

/// The largest value of one `--stats` field that one process wrote to `path`: a forked child
/// (a PostgreSQL backend) writes the counters it inherited, so a sum would count its parent's
/// connections again.
pub fn stat_max(path: &Path, field: &str) -> u64 {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    text.lines().map(|l| stat_line(l, field)).max().unwrap_or(0)
}

fn stat_line(l: &str, field: &str) -> u64 {
    let Some(at) = l.find(&format!("{field} ")) else { return 0 };
    let v = &l[at + field.len() + 1..];
    v.split(|c: char| !c.is_ascii_digit()).next().and_then(|n| n.parse().ok()).unwrap_or(0)
}

/// Stats lines for failure messages.
pub fn stats_text(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}
