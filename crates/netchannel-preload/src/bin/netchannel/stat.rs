//! `netchannel stat`: every engine on the host that this user may see (the Rust API's and
//! those inside programs run with `netchannel run`), read through their control endpoints
//! (`netchannel::control`), as tables, JSON, or refreshed like `watch ss`.

use std::io::{self, Read};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::Args;
use netchannel::control::{default_control_dir, endpoint_pid, process_alive, ENDPOINT_SUFFIX};
use serde_json::{json, Value};

#[derive(Args)]
#[command(after_help = "Engines answer through Unix sockets in a directory of their user's \
    (NETCHANNEL_CONTROL_DIR, else /run/netchannel for root, $XDG_RUNTIME_DIR/netchannel, or \
    /tmp/netchannel-UID); root also sees every other user's.")]
pub struct Stat {
    /// One JSON document: {"engines": [...], "unreachable": [...], "stale_removed": N}.
    #[arg(long)]
    json: bool,
    /// Refresh every SECONDS (default 1) until interrupted.
    #[arg(long, value_name = "SECONDS", num_args = 0..=1, default_missing_value = "1")]
    watch: Option<f64>,
    /// Look for endpoints in DIR only.
    #[arg(long, value_name = "DIR")]
    dir: Option<PathBuf>,
    /// Virtual sockets listed per engine in tables (JSON lists every one).
    #[arg(long, value_name = "N", default_value_t = 20)]
    sockets: usize,
}

/// What one look at the endpoints found.
struct Found {
    engines: Vec<Value>,
    /// Endpoints that exist but did not answer: (path, why).
    unreachable: Vec<(PathBuf, String)>,
    stale_removed: usize,
    looked_in: Vec<PathBuf>,
}

pub fn run(args: &Stat) -> i32 {
    if let Some(secs) = args.watch {
        if !(secs.is_finite() && secs > 0.0) {
            eprintln!("netchannel stat: --watch takes a positive number of seconds");
            return 2;
        }
        loop {
            let found = look(args);
            // Home and clear, as watch(1) does.
            out("\x1b[H\x1b[2J");
            print_found(args, &found);
            std::thread::sleep(Duration::from_secs_f64(secs));
        }
    }
    let found = look(args);
    print_found(args, &found);
    0
}

fn print_found(args: &Stat, found: &Found) {
    if args.json {
        let unreachable: Vec<Value> = found
            .unreachable
            .iter()
            .map(|(p, why)| json!({"endpoint": p.display().to_string(), "error": why}))
            .collect();
        let doc = json!({
            "engines": found.engines,
            "unreachable": unreachable,
            "stale_removed": found.stale_removed,
        });
        out(&format!("{doc:#}\n"));
    } else {
        out(&table(found, args.sockets));
    }
}

/// Writes to stdout; a reader that went away (`| head`) ends the program quietly.
fn out(text: &str) {
    use std::io::Write;
    let mut o = io::stdout().lock();
    if o.write_all(text.as_bytes()).and_then(|()| o.flush()).is_err() {
        std::process::exit(0);
    }
}

/// The directories to look in: this user's, and for root every user's.
fn dirs(args: &Stat) -> Vec<PathBuf> {
    if let Some(d) = &args.dir {
        return vec![d.clone()];
    }
    let mine = default_control_dir();
    let mut v = vec![mine.clone()];
    if rustix::process::getuid().is_root()
        && std::env::var_os(netchannel::control::CONTROL_DIR_ENV).is_none()
    {
        let mut others: Vec<PathBuf> = Vec::new();
        if let Ok(users) = std::fs::read_dir("/run/user") {
            others.extend(users.flatten().map(|u| u.path().join("netchannel")));
        }
        if let Ok(tmp) = std::fs::read_dir("/tmp") {
            others.extend(tmp.flatten().map(|e| e.path()).filter(|p| {
                p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("netchannel-"))
            }));
        }
        others.sort();
        v.extend(others.into_iter().filter(|p| p.is_dir() && *p != mine));
    }
    v
}

fn look(args: &Stat) -> Found {
    let mut found = Found {
        engines: Vec::new(),
        unreachable: Vec::new(),
        stale_removed: 0,
        looked_in: dirs(args),
    };
    for dir in found.looked_in.clone() {
        let entries = match std::fs::read_dir(&dir) {
            Ok(e) => e,
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => {
                found.unreachable.push((dir.clone(), e.to_string()));
                continue;
            }
        };
        let mut paths: Vec<PathBuf> = entries
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.to_str().is_some_and(|s| s.ends_with(ENDPOINT_SUFFIX)))
            .collect();
        paths.sort();
        for path in paths {
            match query(&path) {
                Ok(v) => found.engines.push(v),
                Err(e) => {
                    // Nothing listens on it (its engine is gone), or its process is gone.
                    let gone = e.kind() == io::ErrorKind::ConnectionRefused
                        || endpoint_pid(&path).is_some_and(|pid| !process_alive(pid));
                    if gone && std::fs::remove_file(&path).is_ok() {
                        found.stale_removed += 1;
                    } else if !gone {
                        found.unreachable.push((path, e.to_string()));
                    }
                }
            }
        }
    }
    found.engines.sort_by_key(|e| (e["pid"].as_u64(), e["engine_id"].as_str().map(str::to_owned)));
    found
}

/// Reads one engine's snapshot.
fn query(path: &Path) -> io::Result<Value> {
    let mut s = UnixStream::connect(path)?;
    // A process that inherited the endpoint (a fork) but runs no engine never answers.
    s.set_read_timeout(Some(Duration::from_secs(2)))?;
    let mut buf = Vec::new();
    s.read_to_end(&mut buf)?;
    if buf.is_empty() {
        return Err(io::Error::new(io::ErrorKind::PermissionDenied, "closed without an answer"));
    }
    serde_json::from_slice(&buf).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
}

/// A byte count for people: 1.5 MiB.
fn human(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

fn u(v: &Value) -> u64 {
    v.as_u64().unwrap_or(0)
}

fn s(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Null => "-".into(),
        other => other.to_string(),
    }
}

fn pair(v: &Value, bytes: bool) -> String {
    let (a, b) = (u(&v[0]), u(&v[1]));
    if bytes {
        format!("{}/{}", human(a), human(b))
    } else {
        format!("{a}/{b}")
    }
}

fn table(found: &Found, max_sockets: usize) -> String {
    use std::fmt::Write;
    let mut o = String::new();
    if found.engines.is_empty() {
        let dirs: Vec<String> = found.looked_in.iter().map(|d| d.display().to_string()).collect();
        let _ = writeln!(o, "no netchannel engines (looked in {})", dirs.join(", "));
    }
    for e in &found.engines {
        let b = &e["budgets"];
        let _ = writeln!(
            o,
            "pid {} {}  engine {}  channels at {}  key {}  isolating {}",
            u(&e["pid"]),
            s(&e["command"]),
            s(&e["engine_id"]),
            if e["channel_addr"].is_null() {
                "none (dials only)".into()
            } else {
                s(&e["channel_addr"])
            },
            if e["psk"].as_bool() == Some(true) { "required" } else { "none" },
            if e["isolating"].as_bool() == Some(true) { "yes" } else { "no" },
        );
        let _ = writeln!(
            o,
            "  in use/limit: peers {}  channels {}  sockets {} ({} per peer)  held {}  granted {}",
            pair(&b["sessions"], false),
            pair(&b["channels"], false),
            u(&b["sockets"]),
            u(&b["max_sockets_per_peer"]),
            pair(&b["held_bytes"], true),
            pair(&b["granted_bytes"], true),
        );
        for p in e["peers"].as_array().into_iter().flatten() {
            let chans = p["channels"].as_array().map_or(&[][..], |v| &v[..]);
            let sessions = u(&p["sessions"]);
            let _ = writeln!(
                o,
                "  peer {} (engine {}, dialed {}{}): {} channels",
                s(&p["addr"]),
                if p["engine"].is_null() { "?".into() } else { s(&p["engine"]) },
                s(&p["dialed"]),
                if sessions > 1 { format!(", {sessions} sessions") } else { String::new() },
                chans.len()
            );
            let _ = writeln!(
                o,
                "    {:>5} {:<10} {:<6} {:>10} {:>10} {:>10} {:>9} {:>10} {:<6}",
                "CH", "CLASS", "STATE", "TX", "RX", "QUEUED", "RTT", "RESENT", "CC"
            );
            for c in chans {
                let rtt = c["rtt_us"].as_u64().map_or("-".into(), |r| format!("{r} us"));
                let resent = c["tcp_retransmitted_bytes"].as_u64().map_or("-".into(), human);
                let _ = writeln!(
                    o,
                    "    {:>5} {:<10} {:<6} {:>10} {:>10} {:>10} {:>9} {:>10} {:<6}",
                    format!("{}.{}", u(&c["index"]), u(&c["incarnation"])),
                    s(&c["class"]),
                    s(&c["state"]),
                    human(u(&c["tx_bytes"])),
                    human(u(&c["rx_bytes"])),
                    human(u(&c["queued_bytes"])),
                    rtt,
                    resent,
                    c["congestion"].as_str().unwrap_or("-"),
                );
            }
        }
        let socks = e["sockets"].as_array().map_or(&[][..], |v| &v[..]);
        let _ = writeln!(o, "  virtual sockets: {}", socks.len());
        if !socks.is_empty() {
            let _ = writeln!(
                o,
                "    {:<24} {:<24} {:<10} {:<13} {:>10} {:>10}",
                "LOCAL", "PEER", "CLASS", "STATE", "UNREAD", "UNACKED"
            );
        }
        for k in socks.iter().take(max_sockets) {
            // Without the application's addresses: the peer engine and the virtual port.
            let local = match &k["local"] {
                Value::Null => format!("port {}", u(&k["port"])),
                v => s(v),
            };
            let peer = match &k["peer"] {
                Value::Null => format!("engine {}", s(&k["peer_engine"])),
                v => s(v),
            };
            let _ = writeln!(
                o,
                "    {:<24} {:<24} {:<10} {:<13} {:>10} {:>10}",
                local,
                peer,
                s(&k["class"]),
                s(&k["state"]),
                human(u(&k["unread_bytes"])),
                human(u(&k["unacked_bytes"])),
            );
        }
        if socks.len() > max_sockets {
            let _ = writeln!(
                o,
                "    ... and {} more (--sockets N, or --json)",
                socks.len() - max_sockets
            );
        }
        if let Some(r) = e["refusals"].as_object().filter(|r| !r.is_empty()) {
            let list: Vec<String> = r.iter().map(|(k, v)| format!("{k}: {v}")).collect();
            let _ = writeln!(o, "  refused: {}", list.join("; "));
        }
        let c = &e["counters"];
        let _ = writeln!(
            o,
            "  retransmitted {}  channels dialed again {}  protocol errors {}  failed handshakes {}",
            human(u(&c["retransmitted_bytes"])),
            u(&c["redialed_channels"]),
            u(&c["protocol_errors"]),
            u(&c["handshake_failures"]),
        );
        o.push('\n');
    }
    for (p, why) in &found.unreachable {
        let _ = writeln!(o, "not answering: {} ({why})", p.display());
    }
    if found.stale_removed > 0 {
        let _ =
            writeln!(o, "removed {} endpoint(s) of processes that are gone", found.stale_removed);
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_counts_read_as_people_write_them() {
        assert_eq!(human(0), "0 B");
        assert_eq!(human(1023), "1023 B");
        assert_eq!(human(1536), "1.5 KiB");
        assert_eq!(human(32 << 20), "32.0 MiB");
    }
}
