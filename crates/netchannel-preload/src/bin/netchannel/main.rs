//! `netchannel run [OPTIONS] -- COMMAND [ARGS...]`: runs an unmodified, dynamically linked
//! program with the interposition library preloaded, so its TCP connections are carried by a
//! netchannel engine inside the process (see docs/ARCHITECTURE.md, "Interposition layer").

use std::ffi::OsString;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{exit, Command};

use clap::{Args, Parser, Subcommand};

mod stat;

#[derive(Parser)]
#[command(
    name = "netchannel",
    version,
    about = "Runs unmodified programs with their TCP connections carried by netchannel"
)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

/// `netchannel run --app-demotion` (`Config::app_demotion`).
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum AppDemotion {
    Sticky,
    PerCall,
    Off,
}

impl AppDemotion {
    fn name(self) -> &'static str {
        match self {
            AppDemotion::Sticky => "sticky",
            AppDemotion::PerCall => "per-call",
            AppDemotion::Off => "off",
        }
    }
}

#[derive(Subcommand)]
enum Cmd {
    /// Run an unmodified program with its TCP connections carried by netchannel
    ///
    /// The program (dynamically linked) runs with the interposition library preloaded: its
    /// TCP connections to hosts whose programs also run under netchannel go over virtual
    /// sockets, all others (and UDP, Unix sockets, DNS) stay kernel TCP.
    ///
    /// Exit status: the program's own (it replaces this process). 127 when the command is not
    /// found and 126 when it cannot be executed, as a shell exits; 2 when netchannel refuses
    /// it (setuid, statically linked, Go, liburing) or an option is wrong.
    Run(Box<Run>),
    /// List the netchannel engines on this host: peers, channels, virtual sockets, budgets
    ///
    /// Every engine (Rust API or inside a program run with `netchannel run`) answers through
    /// a control endpoint only its user and root can reach.
    Stat(stat::Stat),
}

#[derive(Args)]
#[command(after_help = "Example: netchannel run --stats -- redis-benchmark -h 10.0.0.2 -t set")]
struct Run {
    /// Channel port of the engines (env NETCHANNEL_PORT).
    #[arg(long, default_value_t = netchannel::DEFAULT_CHANNEL_PORT,
          value_parser = clap::value_parser!(u16).range(1..))]
    port: u16,
    /// Carry only TCP connections to, and listeners on, these ports (default: all).
    #[arg(long, value_delimiter = ',', value_name = "P1,P2,...")]
    ports: Vec<u16>,
    /// Also look for an engine at public (internet) addresses a program connects to. By
    /// default a globally routed address reached through a gateway is not asked, so that a
    /// program reaching the internet sends nothing to other hosts' channel port; loopback,
    /// private, link-local, documentation and other reserved addresses, and any address on one
    /// of this host's networks, are (env NETCHANNEL_CARRY_PUBLIC=1).
    #[arg(long)]
    carry_public: bool,
    /// Print a one-line summary at exit, on stderr, for each process that used TCP (a
    /// connection, a listener, an engine); processes that never did print nothing.
    #[arg(long, conflicts_with = "stats_file")]
    stats: bool,
    /// Append the summary to PATH instead.
    #[arg(long, value_name = "PATH")]
    stats_file: Option<PathBuf>,
    /// The interposition library (default: the newest libnetchannel_preload.so beside this
    /// binary or in its deps/ folder).
    #[arg(long, value_name = "PATH")]
    lib: Option<PathBuf>,
    /// Run a program linked with liburing anyway (sockets it drives through io_uring stay on
    /// kernel TCP; a warning at exit counts its rings).
    #[arg(long)]
    allow_io_uring: bool,
    /// Pre-shared key file (16 bytes or more): the program's engine admits only engines that
    /// hold the same key, and proves it holds it to those it dials.
    #[arg(long, value_name = "PATH")]
    psk_file: Option<PathBuf>,
    /// Peers (engines) admitted at once.
    #[arg(long, value_name = "N")]
    max_sessions: Option<usize>,
    /// Receive credit one peer may be granted beyond each stream's own window (bytes; k, M, G
    /// suffixes).
    #[arg(long, value_name = "BYTES", value_parser = bytes)]
    max_peer_buffered: Option<u64>,
    /// The same over every peer together.
    #[arg(long, value_name = "BYTES", value_parser = bytes)]
    max_buffered: Option<u64>,
    /// Unsent and unacknowledged bytes, every peer together.
    #[arg(long, value_name = "BYTES", value_parser = bytes)]
    max_send_buffered: Option<u64>,
    /// Channels open at once (one file descriptor each; default half the fd limit).
    #[arg(long, value_name = "N")]
    max_channels_total: Option<usize>,
    /// Channels accepted from one source address (IPv4, or IPv6 /64) at once.
    #[arg(long, value_name = "N")]
    max_channels_per_source: Option<usize>,
    /// Virtual sockets per peer.
    #[arg(long, value_name = "N")]
    max_streams: Option<u32>,
    /// Throughput channels (kernel TCP connections) to each peer engine, 1 to 63 (default 4):
    /// each application thread that talks to a peer keeps its messages to one of them.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..=63))]
    channels: Option<u16>,
    /// Sessions to each peer engine, 1 to 63 (default 16): each application thread that opens
    /// connections to a peer takes the next, so threads share no lock and each thread's
    /// connections keep to channels of their own; 1 puts every thread's connections to a peer
    /// in one session.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..=63))]
    session_shards: Option<u16>,
    /// How long a channel's frames may wait for the peer engine's acknowledgement before the
    /// channel is looked at (default 20,000): closed if the peer acknowledges its other
    /// channels or its kernel is silent too; kept, as TCP keeps a connection to a stopped
    /// process, if only its engine is.
    #[arg(long, value_name = "MS", value_parser = clap::value_parser!(u64).range(100..))]
    ack_timeout_ms: Option<u64>,
    /// How the program's threads are demoted while the engine isolates latency-class sockets
    /// from throughput-class ones (default sticky: a thread that only does throughput work
    /// stays demoted; per-call: only during each such call; off: only the engine's workers).
    #[arg(long, value_name = "MODE", value_enum)]
    app_demotion: Option<AppDemotion>,
    /// How the program's own calls reach a carried connection: `direct` serves them from the
    /// virtual socket in the calling thread; `relay` moves the bytes through a loopback TCP
    /// connection and a relay thread (the older path, kept for comparison; env NETCHANNEL_PATH).
    #[arg(long, value_enum, default_value_t = DataPath::Direct)]
    path: DataPath,
    /// Keep relaying connections that forked processes of the program serve (a worker that
    /// accepts from a listener it inherited, a child that takes a connection over). By
    /// default, once one goes to a relay, the listener's answers ask clients to make their
    /// further connections to that port over kernel TCP for a while, which the forked
    /// processes serve natively (env NETCHANNEL_FORKED=relay).
    #[arg(long)]
    relay_forked: bool,
    /// Let the engine's workers yield the cores to the program's threads (SCHED_IDLE) while
    /// no channel of theirs has a send backlog: the program's threads then read their own
    /// channels when they come back. Measured on a 2-core host: redis-benchmark GET +15-19%,
    /// iperf3 -P 8 -14-20% (env NETCHANNEL_WORKERS_YIELD=1).
    #[arg(long)]
    workers_yield: bool,
    /// How long a program thread whose waits are short polls before it sleeps (default 50; 0
    /// turns polling off). It polls only while a core is free; a poll saves the wake-up of an
    /// idle core (sockperf's p50 1.8x -> 0.9x of kernel TCP here) at up to this much CPU per
    /// wait (env NETCHANNEL_POLL_US).
    #[arg(long, value_name = "US", value_parser = clap::value_parser!(u64).range(0..=10_000))]
    poll_us: Option<u64>,
    /// The program and its arguments.
    #[arg(required = true, trailing_var_arg = true, value_name = "COMMAND")]
    command: Vec<OsString>,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum DataPath {
    Direct,
    Relay,
}

/// A byte count with an optional k, M or G suffix (powers of 1024).
fn bytes(s: &str) -> Result<u64, String> {
    let (digits, shift) = match s.char_indices().last() {
        Some((i, 'k' | 'K')) => (&s[..i], 10),
        Some((i, 'm' | 'M')) => (&s[..i], 20),
        Some((i, 'g' | 'G')) => (&s[..i], 30),
        _ => (s, 0),
    };
    let n: u64 = digits.parse().map_err(|_| format!("'{s}' is not a byte count (e.g. 64M)"))?;
    n.checked_mul(1 << shift).ok_or_else(|| format!("'{s}' is too large"))
}

fn fail(msg: &str) -> ! {
    fail_with(2, msg)
}

/// The statuses a shell (and `env`, `timeout`, `nohup`) exits with when the command cannot be
/// run: scripts that run a program under `netchannel run` tell the cases apart as they would
/// without it.
/// A carried connection costs one fd more than on kernel TCP (the placeholder's other end), and
/// until the program accepts it, an accepted one costs the injector's socket too (as many as
/// the program's backlog holds); the engine has fds of its own (channels, epoll sets,
/// eventfds). The library puts all of them above a floor (`NETCHANNEL_FD_BASE`), which is half
/// the soft fd limit unless this raises the soft limit, within the hard one, to make room
/// (four times the program's own, plus 256) above it: the program then opens as many connections as
/// its limit lets it on kernel TCP (about 1,000 under the usual soft limit, not about 500). The program sees the raised limit; its children inherit
/// it and the floor. Not raised when the hard limit leaves less room than halving would, nor
/// above a soft limit of 8,192 (the floor stays at 8,192 there, as the library's `fd_base`
/// has it: while an engine makes its fds, every free slot below the floor is held).
fn raise_fd_limit() -> Option<u64> {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    const MOST: u64 = 1 << 20;
    let lim = getrlimit(Resource::Nofile);
    let soft = lim.current.unwrap_or(MOST).min(MOST);
    let hard = lim.maximum.unwrap_or(MOST).min(MOST);
    let raised = hard.min(soft.saturating_mul(4) + 256);
    if !(64..=8192).contains(&soft) || raised.saturating_sub(soft) < soft / 2 {
        return None;
    }
    setrlimit(Resource::Nofile, Rlimit { current: Some(raised), maximum: lim.maximum }).ok()?;
    Some(soft)
}

const NOT_FOUND: i32 = 127;
const NOT_EXECUTABLE: i32 = 126;

fn fail_with(code: i32, msg: &str) -> ! {
    eprintln!("netchannel: {msg}");
    exit(code)
}

fn main() {
    let run = match Cli::parse().command {
        Cmd::Run(run) => *run,
        Cmd::Stat(args) => exit(stat::run(&args)),
    };
    let mut envs: Vec<(&str, OsString)> = vec![("NETCHANNEL_PORT", run.port.to_string().into())];
    if !run.ports.is_empty() {
        let list: Vec<String> = run.ports.iter().map(u16::to_string).collect();
        envs.push(("NETCHANNEL_PORTS", list.join(",").into()));
    }
    if run.path == DataPath::Relay {
        envs.push(("NETCHANNEL_PATH", "relay".into()));
    }
    if run.relay_forked {
        envs.push(("NETCHANNEL_FORKED", "relay".into()));
    }
    if run.workers_yield {
        envs.push(("NETCHANNEL_WORKERS_YIELD", "1".into()));
    }
    if run.carry_public {
        envs.push(("NETCHANNEL_CARRY_PUBLIC", "1".into()));
    }
    if run.stats {
        envs.push(("NETCHANNEL_STATS", "stderr".into()));
    }
    if let Some(f) = &run.stats_file {
        // Opened here, so that a path the summary cannot reach is an error now and not a
        // silent loss at exit; absolute, because the program may change its directory.
        if let Err(e) = std::fs::OpenOptions::new().create(true).append(true).open(f) {
            fail(&format!("cannot append to the stats file {}: {e}", f.display()));
        }
        let abs = std::fs::canonicalize(f).unwrap_or_else(|_| f.clone());
        envs.push(("NETCHANNEL_STATS", abs.into_os_string()));
    }
    if let Some(f) = &run.psk_file {
        // Checked here, so that a wrong path is an error now and not a silent kernel-TCP run.
        match std::fs::read(f) {
            Ok(k) if k.len() >= 16 => {}
            Ok(_) => fail(&format!("{}: a pre-shared key needs 16 bytes or more", f.display())),
            Err(e) => fail(&format!("cannot read the key file {}: {e}", f.display())),
        }
        let abs = std::fs::canonicalize(f).unwrap_or_else(|_| f.clone());
        envs.push(("NETCHANNEL_PSK_FILE", abs.into_os_string()));
    }
    let mut limit = |name: &'static str, v: Option<String>| {
        if let Some(v) = v {
            envs.push((name, v.into()));
        }
    };
    limit("NETCHANNEL_MAX_SESSIONS", run.max_sessions.map(|v| v.to_string()));
    limit("NETCHANNEL_MAX_PEER_BUFFERED", run.max_peer_buffered.map(|v| v.to_string()));
    limit("NETCHANNEL_MAX_BUFFERED", run.max_buffered.map(|v| v.to_string()));
    limit("NETCHANNEL_MAX_SEND_BUFFERED", run.max_send_buffered.map(|v| v.to_string()));
    limit("NETCHANNEL_MAX_CHANNELS_TOTAL", run.max_channels_total.map(|v| v.to_string()));
    limit("NETCHANNEL_MAX_CHANNELS_PER_SOURCE", run.max_channels_per_source.map(|v| v.to_string()));
    limit("NETCHANNEL_MAX_STREAMS", run.max_streams.map(|v| v.to_string()));
    limit("NETCHANNEL_CHANNELS", run.channels.map(|v| v.to_string()));
    limit("NETCHANNEL_SESSION_SHARDS", run.session_shards.map(|v| v.to_string()));
    limit("NETCHANNEL_ACK_TIMEOUT_MS", run.ack_timeout_ms.map(|v| v.to_string()));
    limit("NETCHANNEL_POLL_US", run.poll_us.map(|v| v.to_string()));
    limit("NETCHANNEL_APP_DEMOTION", run.app_demotion.map(|m| m.name().to_string()));
    if let Some(base) = raise_fd_limit() {
        envs.push(("NETCHANNEL_FD_BASE", base.to_string().into()));
    }
    let command = run.command;
    let lib = run.lib.unwrap_or_else(default_lib);
    if !lib.is_file() {
        fail(&format!(
            "interposition library {} not found (cargo build -p netchannel-preload)",
            lib.display()
        ));
    }
    let program = resolve(Path::new(&command[0])).unwrap_or_else(|(code, why)| {
        fail_with(code, &format!("{}: {why}", command[0].to_string_lossy()))
    });
    if let Err(why) = carriable(&program) {
        fail(&format!("cannot carry {}: {why}; run it without netchannel", program.display()));
    }
    // The library, loaded into the program (this process, after exec), refuses it if the
    // loader mapped liburing: the loader's own account of every library the program loads,
    // where asking it through `ldd` cost about 5 ms per run.
    let refuse_liburing = (!run.allow_io_uring).then(|| std::process::id().to_string());
    let mut preload = lib.into_os_string();
    if let Some(old) = std::env::var_os("LD_PRELOAD").filter(|o| !o.is_empty()) {
        preload.push(" ");
        preload.push(old);
    }
    // The program checked above, under the name it was given (argv[0], as a shell passes it).
    let mut cmd = Command::new(&program);
    cmd.arg0(&command[0]).args(&command[1..]).envs(envs).env("LD_PRELOAD", preload);
    match refuse_liburing {
        Some(pid) => cmd.env("NETCHANNEL_REFUSE_LIBURING", pid),
        None => cmd.env_remove("NETCHANNEL_REFUSE_LIBURING"),
    };
    let err = cmd.exec();
    let code = if err.kind() == std::io::ErrorKind::NotFound { NOT_FOUND } else { NOT_EXECUTABLE };
    fail_with(code, &format!("cannot run {}: {err}", command[0].to_string_lossy()))
}

fn default_lib() -> PathBuf {
    let exe = std::env::current_exe().unwrap_or_default();
    let dir = exe.parent().map(Path::to_path_buf).unwrap_or_default();
    newest_lib(&dir)
}

/// The library beside the launcher in `dir`. Cargo puts the cdylib beside the binary (`cargo
/// build`), or only in deps/ (`cargo test`, which leaves the copy beside the binary as the last
/// `cargo build` made it): the newest is the one built with this launcher.
fn newest_lib(dir: &Path) -> PathBuf {
    [dir.to_path_buf(), dir.join("deps"), dir.join("..")]
        .into_iter()
        .map(|d| d.join("libnetchannel_preload.so"))
        .filter(|p| p.is_file())
        .filter_map(|p| Some((std::fs::metadata(&p).ok()?.modified().ok()?, p)))
        .max_by_key(|(modified, _)| *modified)
        .map_or_else(|| dir.join("libnetchannel_preload.so"), |(_, p)| p)
}

/// The program `cmd` names, found as a shell finds it: a name with a slash as it is, any other
/// in `PATH`, skipping files that are not executable. Else the shell's exit status and why.
fn resolve(cmd: &Path) -> Result<PathBuf, (i32, &'static str)> {
    let executable = |p: &Path| {
        std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    };
    if cmd.components().count() > 1 {
        return match std::fs::metadata(cmd) {
            Err(_) => Err((NOT_FOUND, "No such file or directory")),
            Ok(m) if m.is_dir() => Err((NOT_EXECUTABLE, "Is a directory")),
            Ok(_) if !executable(cmd) => Err((NOT_EXECUTABLE, "Permission denied")),
            Ok(_) => Ok(cmd.to_path_buf()),
        };
    }
    let path = std::env::var_os("PATH").unwrap_or_else(|| "/usr/bin:/bin".into());
    // An empty PATH entry is the current directory, named so that the path keeps a slash.
    std::env::split_paths(&path)
        .map(|d| if d.as_os_str().is_empty() { PathBuf::from(".") } else { d })
        .map(|d| d.join(cmd))
        .find(|p| executable(p))
        .ok_or((NOT_FOUND, "command not found"))
}

/// Why LD_PRELOAD would not take effect: setuid/setgid binaries (the loader ignores
/// LD_PRELOAD for them), statically linked ones (no loader at all) and Go programs (their
/// runtime never calls libc's socket functions). Scripts are run by
/// their interpreter, which is checked instead.
fn carriable(program: &Path) -> Result<(), String> {
    carriable_at(program, 0)
}

fn carriable_at(program: &Path, depth: usize) -> Result<(), String> {
    let meta = std::fs::metadata(program).map_err(|e| e.to_string())?;
    if meta.permissions().mode() & 0o6000 != 0 {
        return Err("it is setuid/setgid, so the dynamic loader ignores LD_PRELOAD".into());
    }
    if let Some(interp) = script_interpreter(program) {
        // The kernel follows at most 4 interpreters (a script naming itself never ends).
        if depth >= 4 {
            return Err("its #! interpreters nest too deep".into());
        }
        return carriable_at(&interp, depth + 1);
    }
    // Only the headers are read: the whole file is tens of megabytes for some programs (node,
    // about 50 ms).
    let file = std::fs::File::open(program).map_err(|e| e.to_string())?;
    let read = |offset: usize, buf: &mut [u8]| {
        std::os::unix::fs::FileExt::read_exact_at(&file, buf, offset as u64).is_ok()
    };
    match elf_interp(&read) {
        // Go's runtime makes its socket calls by raw system call, never through libc.
        Some(true) if elf_has_section(&read, b".go.buildinfo") => Err(
            "it is a Go program, whose sockets bypass libc's socket calls (they would silently \
             use kernel TCP)"
                .into(),
        ),
        Some(true) => Ok(()),
        Some(false) => {
            Err("it is statically linked (no PT_INTERP), so nothing can be preloaded".into())
        }
        None => Err("it is not an ELF executable".into()),
    }
}

/// A script's interpreter (`#!` line), which is what the loader runs.
fn script_interpreter(program: &Path) -> Option<PathBuf> {
    let mut head = [0u8; 256];
    let n = std::io::Read::read(&mut std::fs::File::open(program).ok()?, &mut head).ok()?;
    let line = head[..n].strip_prefix(b"#!")?.split(|&b| b == b'\n').next()?;
    let interp = String::from_utf8_lossy(line);
    interp.split_whitespace().next().map(PathBuf::from)
}

/// Fills the buffer with the file's bytes at an offset; false where the file is shorter.
trait ReadAt: Fn(usize, &mut [u8]) -> bool {}
impl<F: Fn(usize, &mut [u8]) -> bool> ReadAt for F {}

/// Whether a 64- or 32-bit little-endian ELF file has a PT_INTERP program header.
fn elf_interp(d: &impl ReadAt) -> Option<bool> {
    let mut ident = [0u8; 6];
    if !d(0, &mut ident) || &ident[..4] != b"\x7fELF" || ident[5] != 1 || !d(51, &mut [0]) {
        return None;
    }
    let at = |o: usize, width: usize| le_at(d, o, width);
    let (phoff, phentsize, phnum) = match ident[4] {
        2 => (at(0x20, 8)?, at(0x36, 2)?, at(0x38, 2)?),
        1 => (at(0x1c, 4)?, at(0x2a, 2)?, at(0x2c, 2)?),
        _ => return None,
    };
    const PT_INTERP: usize = 3;
    let header = |i: usize| phoff.checked_add(i.checked_mul(phentsize)?);
    Some((0..phnum).any(|i| header(i).and_then(|h| at(h, 4)) == Some(PT_INTERP)))
}

/// Whether a 64- or 32-bit little-endian ELF file has a section of this name.
fn elf_has_section(d: &impl ReadAt, name: &[u8]) -> bool {
    let at = |o: usize, width: usize| le_at(d, o, width);
    let found = || -> Option<bool> {
        // The section table, its entry size and count, the names' section, and where a
        // section header keeps its file offset (and how wide that is).
        let (shoff, shentsize, shnum, shstrndx, offset_field, offset_width) = match at(4, 1)? {
            2 => (at(0x28, 8)?, at(0x3a, 2)?, at(0x3c, 2)?, at(0x3e, 2)?, 0x18, 8),
            1 => (at(0x20, 4)?, at(0x2e, 2)?, at(0x30, 2)?, at(0x32, 2)?, 0x10, 4),
            _ => return None,
        };
        let header = |i: usize| shoff.checked_add(i.checked_mul(shentsize)?);
        let names = at(header(shstrndx)?.checked_add(offset_field)?, offset_width)?;
        let mut candidate = vec![0u8; name.len() + 1];
        Some((0..shnum).any(|i| {
            let start = header(i).and_then(|h| at(h, 4)).and_then(|n| names.checked_add(n));
            start.is_some_and(|s| {
                d(s, &mut candidate) && candidate.starts_with(name) && candidate[name.len()] == 0
            })
        }))
    };
    found().unwrap_or(false)
}

/// The `width`-byte (at most 8) little-endian number at offset `o` of `d`, if `d` reaches that
/// far.
fn le_at(d: &impl ReadAt, o: usize, width: usize) -> Option<usize> {
    let mut buf = [0u8; 8];
    let bytes = buf.get_mut(..width)?;
    o.checked_add(width)?;
    if !d(o, bytes) {
        return None;
    }
    Some(bytes.iter().rev().fold(0, |n, &b| n << 8 | usize::from(b)))
}

/// Reads from a file's bytes in memory (tests).
#[cfg(test)]
fn in_memory(d: &[u8]) -> impl ReadAt + '_ {
    move |o: usize, buf: &mut [u8]| match o.checked_add(buf.len()).and_then(|end| d.get(o..end)) {
        Some(bytes) => {
            buf.copy_from_slice(bytes);
            true
        }
        None => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn section_names_are_read_from_the_elf_section_table() {
        let elf = std::fs::read("/bin/true").unwrap();
        assert!(elf_has_section(&in_memory(&elf), b".text"));
        assert!(!elf_has_section(&in_memory(&elf), b".tex"), "a whole name, not a prefix");
        assert!(!elf_has_section(&in_memory(&elf), b".go.buildinfo"));
        assert_eq!(elf_interp(&in_memory(&elf)), Some(true));
        // A truncated or damaged file answers no, and never panics.
        for len in (0..elf.len()).step_by(97) {
            let _ = elf_has_section(&in_memory(&elf[..len]), b".text");
            let _ = elf_interp(&in_memory(&elf[..len]));
        }
        assert_eq!(elf_interp(&in_memory(&elf[..40])), None);
        let mut damaged = elf.clone();
        damaged[0x28..0x30].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(!elf_has_section(&in_memory(&damaged), b".text"));
    }

    #[test]
    fn the_newest_library_beside_the_launcher_is_loaded() {
        let dir = std::env::temp_dir().join(format!("nc-lib-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("deps")).unwrap();
        assert_eq!(newest_lib(&dir), dir.join("libnetchannel_preload.so"), "none: the default");
        let beside = dir.join("libnetchannel_preload.so");
        let deps = dir.join("deps/libnetchannel_preload.so");
        std::fs::write(&beside, b"old").unwrap();
        assert_eq!(newest_lib(&dir), beside);
        let old = std::time::SystemTime::now() - std::time::Duration::from_secs(3600);
        std::fs::File::options().write(true).open(&beside).unwrap().set_modified(old).unwrap();
        std::fs::write(&deps, b"new").unwrap();
        assert_eq!(newest_lib(&dir), deps, "cargo test rebuilt only the one in deps/");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
