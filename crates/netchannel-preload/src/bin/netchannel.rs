//! `netchannel run [OPTIONS] -- COMMAND [ARGS...]`: runs an unmodified, dynamically linked
//! program with the interposition library preloaded, so its TCP connections are carried by a
//! netchannel engine inside the process (see docs/ARCHITECTURE.md, "Interposition layer").

use std::ffi::OsString;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{exit, Command};

const USAGE: &str = "usage: netchannel run [--port PORT] [--ports P1,P2,...] [--stats] \
[--stats-file PATH] [--lib PATH] [--allow-io-uring] -- COMMAND [ARGS...]
  --port PORT       channel port of the engines (default 7450; env NETCHANNEL_PORT)
  --ports LIST      carry only TCP connections to / listeners on these ports (default: all)
  --stats           print a one-line summary per process at exit (stderr)
  --stats-file PATH append the summary to PATH instead
  --lib PATH        the interposition library (default: libnetchannel_preload.so beside this binary)
  --allow-io-uring  run a program linked with liburing anyway (sockets it drives through
                    io_uring stay on kernel TCP; a warning at exit counts its rings)";

fn fail(msg: &str) -> ! {
    eprintln!("netchannel: {msg}");
    exit(2)
}

fn main() {
    let mut args = std::env::args_os().skip(1);
    match args.next().as_deref().and_then(|a| a.to_str()) {
        Some("run") => {}
        Some("-h") | Some("--help") => {
            println!("{USAGE}");
            return;
        }
        _ => fail(USAGE),
    }
    let mut envs: Vec<(&str, OsString)> = Vec::new();
    let mut lib: Option<PathBuf> = None;
    let mut allow_io_uring = false;
    let mut command: Vec<OsString> = Vec::new();
    while let Some(a) = args.next() {
        let mut value =
            |name: &str| args.next().unwrap_or_else(|| fail(&format!("{name} needs a value")));
        match a.to_str() {
            Some("--") => {
                command.extend(args.by_ref());
                break;
            }
            Some("--port") => {
                let v = value("--port");
                if v.to_str().and_then(|s| s.parse::<u16>().ok()).is_none_or(|p| p == 0) {
                    fail("--port takes a port number 1-65535");
                }
                envs.push(("NETCHANNEL_PORT", v));
            }
            Some("--ports") => envs.push(("NETCHANNEL_PORTS", value("--ports"))),
            Some("--stats") => envs.push(("NETCHANNEL_STATS", "stderr".into())),
            Some("--stats-file") => envs.push(("NETCHANNEL_STATS", value("--stats-file"))),
            Some("--lib") => lib = Some(value("--lib").into()),
            Some("--allow-io-uring") => allow_io_uring = true,
            _ => {
                // No `--`: the first non-option starts the command.
                command.push(a);
                command.extend(args.by_ref());
                break;
            }
        }
    }
    if command.is_empty() {
        fail(USAGE);
    }
    let lib = lib.unwrap_or_else(default_lib);
    if !lib.is_file() {
        fail(&format!(
            "interposition library {} not found (cargo build -p netchannel-preload)",
            lib.display()
        ));
    }
    let program = resolve(Path::new(&command[0]))
        .unwrap_or_else(|| fail(&format!("{}: command not found", command[0].to_string_lossy())));
    if let Err(why) = carriable(&program) {
        fail(&format!("cannot carry {}: {why}; run it without netchannel", program.display()));
    }
    if !allow_io_uring && links_liburing(&program) {
        fail(&format!(
            "cannot carry {}: it is linked with liburing, and sockets it drives through \
             io_uring bypass the socket calls netchannel interposes (they would silently use \
             kernel TCP); --allow-io-uring runs it anyway",
            program.display()
        ));
    }
    let mut preload = lib.into_os_string();
    if let Some(old) = std::env::var_os("LD_PRELOAD").filter(|o| !o.is_empty()) {
        preload.push(" ");
        preload.push(old);
    }
    let err =
        Command::new(&command[0]).args(&command[1..]).envs(envs).env("LD_PRELOAD", preload).exec();
    fail(&format!("cannot run {}: {err}", command[0].to_string_lossy()))
}

fn default_lib() -> PathBuf {
    let exe = std::env::current_exe().unwrap_or_default();
    let dir = exe.parent().map(Path::to_path_buf).unwrap_or_default();
    // Cargo puts the cdylib beside the binary, or (built for `cargo test`) in deps/.
    for d in [dir.clone(), dir.join("deps"), dir.join("..")] {
        let p = d.join("libnetchannel_preload.so");
        if p.is_file() {
            return p;
        }
    }
    dir.join("libnetchannel_preload.so")
}

fn resolve(cmd: &Path) -> Option<PathBuf> {
    if cmd.components().count() > 1 {
        return cmd.is_file().then(|| cmd.to_path_buf());
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).map(|d| d.join(cmd)).find(|p| p.is_file())
}

/// Why LD_PRELOAD would not take effect: setuid/setgid binaries (the loader ignores
/// LD_PRELOAD for them) and statically linked ones (no loader at all). Scripts are run by
/// their interpreter, which is checked instead.
fn carriable(program: &Path) -> Result<(), String> {
    let meta = std::fs::metadata(program).map_err(|e| e.to_string())?;
    if meta.permissions().mode() & 0o6000 != 0 {
        return Err("it is setuid/setgid, so the dynamic loader ignores LD_PRELOAD".into());
    }
    if let Some(interp) = script_interpreter(program) {
        return carriable(&interp);
    }
    let data = std::fs::read(program).map_err(|e| e.to_string())?;
    match elf_interp(&data) {
        Some(true) => Ok(()),
        Some(false) => {
            Err("it is statically linked (no PT_INTERP), so nothing can be preloaded".into())
        }
        None => Err("it is not an ELF executable".into()),
    }
}

/// Whether the program (or a library it loads) is linked with liburing, by the dynamic
/// loader's own account (`ldd`); without ldd, by the program's own dependency names.
fn links_liburing(program: &Path) -> bool {
    let program = script_interpreter(program).unwrap_or_else(|| program.to_path_buf());
    match Command::new("ldd").arg(&program).output() {
        Ok(out) if out.status.success() => String::from_utf8_lossy(&out.stdout)
            .lines()
            .any(|l| l.trim_start().starts_with("liburing")),
        _ => std::fs::read(&program)
            .is_ok_and(|d| d.windows(b"liburing.so".len()).any(|w| w == b"liburing.so")),
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

/// Whether a 64- or 32-bit little-endian ELF file has a PT_INTERP program header.
fn elf_interp(d: &[u8]) -> Option<bool> {
    if d.len() < 52 || &d[..4] != b"\x7fELF" || d[5] != 1 {
        return None;
    }
    let u16_at = |o: usize| d.get(o..o + 2).map(|b| u16::from_le_bytes([b[0], b[1]]) as usize);
    let u32_at =
        |o: usize| d.get(o..o + 4).map(|b| u32::from_le_bytes(b.try_into().unwrap()) as usize);
    let u64_at =
        |o: usize| d.get(o..o + 8).map(|b| u64::from_le_bytes(b.try_into().unwrap()) as usize);
    let (phoff, phentsize, phnum) = match d[4] {
        2 => (u64_at(0x20)?, u16_at(0x36)?, u16_at(0x38)?),
        1 => (u32_at(0x1c)?, u16_at(0x2a)?, u16_at(0x2c)?),
        _ => return None,
    };
    const PT_INTERP: usize = 3;
    Some((0..phnum).any(|i| u32_at(phoff + i * phentsize) == Some(PT_INTERP)))
}
