//! The two-host testbed on one machine: network namespaces `ncperf-a` (client) and `ncperf-b`
//! (server) joined by a veth pair.

use std::net::IpAddr;
use std::path::PathBuf;
use std::process::Command;

pub const NS_A: &str = "ncperf-a";
pub const NS_B: &str = "ncperf-b";
const DEV_A: &str = "ncpf-a";
const DEV_B: &str = "ncpf-b";
pub const ADDR_A: [u8; 4] = [10, 214, 0, 1];
pub const ADDR_B: [u8; 4] = [10, 214, 0, 2];

#[derive(Debug, Clone, Copy)]
pub struct Options {
    pub mtu: u32,
    pub gro: bool,
    pub tso: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options { mtu: 1500, gro: true, tso: true }
    }
}

pub fn ns_path(ns: &str) -> PathBuf {
    PathBuf::from(format!("/run/netns/{ns}"))
}

pub fn addr_a() -> IpAddr {
    IpAddr::from(ADDR_A)
}

pub fn addr_b() -> IpAddr {
    IpAddr::from(ADDR_B)
}

/// Most `--peers` engines: one address each, in a /16 whose .0 and .255 are never used.
pub const MAX_PEERS: usize = 254 * 250;

/// The address the `i`th of several client engines dials from (`--peers`), so that the server
/// sees each as a host of its own (its per-source limits count addresses): 127.215.0.0/16 on
/// loopback (local there already), 10.215.0.0/16 between the namespaces (`peer_routes`).
pub fn peer_source(server: IpAddr, i: usize) -> IpAddr {
    let (hi, lo) = ((1 + i / 250) as u8, (1 + i % 250) as u8);
    let first = if server.is_loopback() { 127 } else { 10 };
    IpAddr::from([first, 215, hi, lo])
}

/// Makes 10.215.0.0/16 local to the client namespace (any of its addresses can be bound, as
/// on loopback) and routes it there from the server's. Idempotent.
pub fn peer_routes() -> Result<(), String> {
    run("ip", &["-n", NS_A, "route", "replace", "local", "10.215.0.0/16", "dev", "lo"])?;
    let via = addr_a().to_string();
    run("ip", &["-n", NS_B, "route", "replace", "10.215.0.0/16", "via", &via, "dev", DEV_B])?;
    Ok(())
}

fn run(cmd: &str, args: &[&str]) -> Result<String, String> {
    let out = Command::new(cmd).args(args).output().map_err(|e| {
        format!("cannot run {cmd}: {e} (run scripts/setup.sh to install what ncperf needs)")
    })?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(format!("{cmd} {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim()))
    }
}

pub fn exists() -> bool {
    ns_path(NS_A).exists() && ns_path(NS_B).exists()
}

/// Serialises `up` and `down` between processes: two ncperf runs that find the testbed missing
/// at once would otherwise both build it, one failing on the other's namespaces (or tearing a
/// half-built one down under it). Held until the returned file is dropped.
fn lock() -> Result<std::fs::File, String> {
    let path = "/run/lock/ncperf-testbed.lock";
    let _ = std::fs::create_dir_all("/run/lock");
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .map_err(|e| format!("{path}: {e} (the testbed needs root)"))?;
    rustix::fs::flock(&file, rustix::fs::FlockOperation::LockExclusive)
        .map_err(|e| format!("locking {path}: {e}"))?;
    Ok(file)
}

/// Creates the testbed if missing and applies `opts`. Idempotent, and safe to call from several
/// processes at once.
pub fn up(opts: Options) -> Result<(), String> {
    if !(1280..=9000).contains(&opts.mtu) {
        return Err(format!(
            "MTU {} out of range (1280..=9000; 1500 or 9000 are typical)",
            opts.mtu
        ));
    }
    let _locked = lock()?;
    if !exists() {
        // A half-built testbed from an interrupted run would make `add` fail: start clean.
        let _ = remove();
        let root = std::env::var("USER").unwrap_or_default();
        run("ip", &["netns", "add", NS_A]).map_err(|e| {
            if root != "root" {
                format!(
                    "{e}\nnetwork namespaces need root (CAP_NET_ADMIN); or use --hosts loopback"
                )
            } else {
                e
            }
        })?;
        run("ip", &["netns", "add", NS_B])?;
        run("ip", &["link", "add", DEV_A, "type", "veth", "peer", "name", DEV_B])?;
        run("ip", &["link", "set", DEV_A, "netns", NS_A])?;
        run("ip", &["link", "set", DEV_B, "netns", NS_B])?;
        let a = format!("{}/24", addr_a());
        let b = format!("{}/24", addr_b());
        run("ip", &["-n", NS_A, "addr", "add", &a, "dev", DEV_A])?;
        run("ip", &["-n", NS_B, "addr", "add", &b, "dev", DEV_B])?;
        for (ns, dev) in [(NS_A, DEV_A), (NS_B, DEV_B)] {
            run("ip", &["-n", ns, "link", "set", "lo", "up"])?;
            run("ip", &["-n", ns, "link", "set", dev, "up"])?;
        }
    }
    let mtu = opts.mtu.to_string();
    let onoff = |b: bool| if b { "on" } else { "off" };
    for (ns, dev) in [(NS_A, DEV_A), (NS_B, DEV_B)] {
        run("ip", &["-n", ns, "link", "set", dev, "mtu", &mtu])?;
        run(
            "ip",
            &[
                "netns",
                "exec",
                ns,
                "ethtool",
                "-K",
                dev,
                "gro",
                onoff(opts.gro),
                "tso",
                onoff(opts.tso),
            ],
        )?;
    }
    Ok(())
}

pub fn down() -> Result<(), String> {
    let _locked = lock()?;
    remove()
}

fn remove() -> Result<(), String> {
    let mut errors = Vec::new();
    for ns in [NS_A, NS_B] {
        if ns_path(ns).exists() {
            if let Err(e) = run("ip", &["netns", "del", ns]) {
                errors.push(e);
            }
        }
    }
    if errors.is_empty() {
        Ok(())
    } else {
        Err(errors.join("\n"))
    }
}

pub fn status() -> Result<String, String> {
    if !exists() {
        return Ok("testbed: down (ncperf testbed up creates it)".into());
    }
    let mut out = String::from("testbed: up\n");
    for (ns, dev) in [(NS_A, DEV_A), (NS_B, DEV_B)] {
        let link = run("ip", &["-n", ns, "-o", "link", "show", dev])?;
        let mtu = link.split_whitespace().skip_while(|w| *w != "mtu").nth(1).unwrap_or("?");
        let addr = run("ip", &["-n", ns, "-o", "-4", "addr", "show", dev])?;
        let ip = addr.split_whitespace().skip_while(|w| *w != "inet").nth(1).unwrap_or("?");
        let features = run("ip", &["netns", "exec", ns, "ethtool", "-k", dev]).unwrap_or_default();
        let feature = |name: &str| {
            features
                .lines()
                .find(|l| l.trim_start().starts_with(name))
                .and_then(|l| l.split(':').nth(1))
                .map(|v| v.split_whitespace().next().unwrap_or("?").to_string())
                .unwrap_or_else(|| "?".into())
        };
        out.push_str(&format!(
            "  {ns}: {dev} {ip} mtu {mtu} gro {} tso {}\n",
            feature("generic-receive-offload"),
            feature("tcp-segmentation-offload")
        ));
    }
    Ok(out)
}
