//! `netchannel stat` against real engines: this process's (the Rust API), and those inside
//! unmodified programs run with `netchannel run` in two network namespaces; endpoints of
//! processes that exit or are killed disappear; other users see nothing.

#[path = "../../netchannel/tests/common/mod.rs"]
mod common;
mod util;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{Hosts, Testbed};
use netchannel::{Config, Engine};
use serde_json::Value;
use util::*;

const DIR_ENV: &str = netchannel::control::CONTROL_DIR_ENV;

fn control_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("nc-stat-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// `netchannel stat --json` over `dir`, parsed.
fn stat_json(dir: &Path) -> Value {
    let out = Command::new(NETCHANNEL)
        .args(["stat", "--json", "--dir"])
        .arg(dir)
        .output()
        .expect("netchannel stat runs");
    assert!(out.status.success(), "stat failed: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!("stat --json is not JSON ({e}): {}", String::from_utf8_lossy(&out.stdout))
    })
}

fn engines(doc: &Value) -> &[Value] {
    doc["engines"].as_array().map_or(&[], |v| &v[..])
}

fn endpoints(dir: &Path) -> usize {
    std::fs::read_dir(dir).map_or(0, |d| {
        d.flatten().filter(|e| e.path().extension().is_some_and(|x| x == "sock")).count()
    })
}

#[test]
fn lists_this_process_engines_with_channels_sockets_and_budgets() {
    let dir = control_dir("api");
    let cfg = |addr: &str| Config {
        control_dir: Some(dir.clone()),
        // Every channel of the session dialed, traffic or not.
        rest_channels_rate: 0,
        ..Config::new(addr.parse().unwrap())
    };
    let server = Engine::new(cfg("127.0.0.1:0")).unwrap();
    let client = Engine::new(cfg("127.0.0.1:0")).unwrap();
    assert!(server.control_path().is_some_and(|p| p.starts_with(&dir)));
    let l = server.listen(4242).unwrap();
    let s = client.connect(server.local_addr(), 4242).unwrap();
    let p = l.accept().unwrap();
    let (here, there) = ("10.1.2.3:5555".parse().unwrap(), "10.9.8.7:4242".parse().unwrap());
    s.set_app_addresses(here, there);
    s.send(&[7u8; 1000]).unwrap();
    // Unread at the server until it reads: wait until the bytes are there.
    let deadline = Instant::now() + Duration::from_secs(10);
    while p.unread_bytes() < 1000 {
        assert!(Instant::now() < deadline, "bytes never arrived");
        std::thread::sleep(Duration::from_millis(5));
    }

    // A session's throughput channels after its first are dialed in the background.
    while client.stats().channels.len() < 5 {
        assert!(Instant::now() < deadline, "channels never all open");
        std::thread::sleep(Duration::from_millis(5));
    }

    let doc = stat_json(&dir);
    let list = engines(&doc);
    assert_eq!(list.len(), 2, "{doc:#}");
    let by_id = |e: &Engine| {
        let id = format!("{:016x}", e.id());
        list.iter().find(|x| x["engine_id"] == id.as_str()).cloned().expect("engine listed")
    };
    let (c, sv) = (by_id(&client), by_id(&server));
    for e in [&c, &sv] {
        assert_eq!(e["pid"], std::process::id());
        assert_eq!(e["psk"], false);
        assert!(e["budgets"]["channels"][1].as_u64().unwrap() > 0, "{e:#}");
    }
    assert_eq!(sv["channel_addr"], server.local_addr().to_string().as_str());
    // The client dialed 4 throughput channels and a latency one, all open, all with the
    // kernel's round-trip time.
    let peers = c["peers"].as_array().unwrap();
    assert_eq!(peers.len(), 1, "{c:#}");
    assert_eq!(peers[0]["addr"], server.local_addr().to_string().as_str());
    let chans = peers[0]["channels"].as_array().unwrap();
    assert_eq!(chans.len(), 5, "{c:#}");
    assert!(chans.iter().all(|ch| ch["state"] == "open"
        && ch["rtt_us"].as_u64().is_some()
        && ch["tcp_retransmitted_bytes"].as_u64().is_some()));
    assert_eq!(chans.iter().filter(|ch| ch["class"] == "latency").count(), 1);
    // The socket as the application named it; the peer's copy holds the 1000 unread bytes.
    let cs = &c["sockets"][0];
    assert_eq!(
        (cs["local"].as_str(), cs["peer"].as_str()),
        (Some("10.1.2.3:5555"), Some("10.9.8.7:4242"))
    );
    assert_eq!(cs["bytes_sent"], 1000);
    let ss = &sv["sockets"][0];
    assert_eq!((ss["port"].as_u64(), ss["unread_bytes"].as_u64()), (Some(4242), Some(1000)));
    assert!(ss["local"].is_null(), "nobody named the accepted socket");

    // The table shows the same.
    let out = Command::new(NETCHANNEL).args(["stat", "--dir"]).arg(&dir).output().unwrap();
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    assert!(table.contains(&format!("pid {}", std::process::id())), "{table}");
    assert!(table.contains("10.9.8.7:4242") && table.contains("1000 B"), "{table}");

    // Shut down: the endpoints go with the engines.
    drop((s, p, l));
    drop(client);
    drop(server);
    assert_eq!(endpoints(&dir), 0);
    assert!(engines(&stat_json(&dir)).is_empty());
    let _ = std::fs::remove_dir_all(&dir);
}

/// A peer that opens streams from several threads dials a session per thread (its shards,
/// `Config::session_shards`), each channel from its own port: the accepting engine lists them
/// as one peer, by the peer engine, with its sessions counted; the dialer lists the one address
/// it dialed.
#[test]
fn a_peer_dialing_from_several_shards_is_one_peer() {
    let dir = control_dir("shards");
    let cfg = |shards: usize| Config {
        control_dir: Some(dir.clone()),
        session_shards: shards,
        ..Config::new("127.0.0.1:0".parse().unwrap())
    };
    let server = Engine::new(cfg(1)).unwrap();
    let client = std::sync::Arc::new(Engine::new(cfg(3)).unwrap());
    let l = server.listen(4343).unwrap();
    let to = server.local_addr();
    let socks: Vec<_> = (0..3)
        .map(|_| {
            let client = client.clone();
            std::thread::spawn(move || client.connect(to, 4343).unwrap()).join().unwrap()
        })
        .collect();
    let accepted: Vec<_> = (0..3).map(|_| l.accept().unwrap()).collect();
    let doc = stat_json(&dir);
    let list = engines(&doc);
    let by_id = |id: u64| {
        let id = format!("{id:016x}");
        list.iter().find(|x| x["engine_id"] == id.as_str()).cloned().expect("engine listed")
    };
    let (sv, cl) = (by_id(server.id()), by_id(client.id()));
    let peers = sv["peers"].as_array().unwrap();
    assert_eq!(peers.len(), 1, "{sv:#}");
    assert_eq!(peers[0]["dialed"], "in", "{sv:#}");
    assert_eq!(peers[0]["sessions"], 3, "{sv:#}");
    assert_eq!(peers[0]["addr"], "127.0.0.1", "{sv:#}");
    let key = |id: u64| format!("{:016x}", id & ((1 << 58) - 1));
    assert_eq!(peers[0]["engine"].as_str(), Some(key(client.id()).as_str()), "{sv:#}");
    let peers = cl["peers"].as_array().unwrap();
    assert_eq!(peers.len(), 1, "{cl:#}");
    assert_eq!(peers[0]["dialed"], "out", "{cl:#}");
    assert_eq!(peers[0]["sessions"], 3, "{cl:#}");
    assert_eq!(peers[0]["addr"], to.to_string().as_str(), "{cl:#}");
    assert_eq!(peers[0]["engine"].as_str(), Some(key(server.id()).as_str()), "{cl:#}");
    let out = Command::new(NETCHANNEL).args(["stat", "--dir"]).arg(&dir).output().unwrap();
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(table.contains("peer 127.0.0.1 (engine") && table.contains("dialed in, 3 sessions"));
    // The server dials the client's engine too: still one peer, dialed both ways.
    let back_l = client.listen(4344).unwrap();
    let back = server.connect(client.local_addr(), 4344).unwrap();
    let back_p = back_l.accept().unwrap();
    let doc = stat_json(&dir);
    let sv = engines(&doc)
        .iter()
        .find(|x| x["engine_id"] == format!("{:016x}", server.id()).as_str())
        .cloned()
        .expect("engine listed");
    let peers = sv["peers"].as_array().unwrap();
    assert_eq!(peers.len(), 1, "{sv:#}");
    assert_eq!(peers[0]["dialed"], "both", "{sv:#}");
    assert_eq!(peers[0]["sessions"], 4, "{sv:#}");
    drop((back, back_p, back_l));
    drop((socks, accepted, l));
    drop(server);
    drop(client);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn other_users_see_nothing() {
    if !rustix::process::getuid().is_root() || !have("setpriv") {
        return;
    }
    let dir = control_dir("perm");
    let e = Engine::new(Config { control_dir: Some(dir.clone()), ..Config::default() }).unwrap();
    let path = e.control_path().expect("an endpoint");
    // Another user: the directory is closed to it, and so is the socket.
    let as_nobody = |args: &[&str]| {
        Command::new("setpriv")
            .args(["--reuid=65534", "--regid=65534", "--clear-groups", NETCHANNEL, "stat"])
            .args(args)
            .output()
            .unwrap()
    };
    let out = as_nobody(&["--json", "--dir", dir.to_str().unwrap()]);
    let doc: Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert!(engines(&doc).is_empty(), "{doc:#}");
    let why = doc["unreachable"][0]["error"].as_str().unwrap_or_default().to_lowercase();
    assert!(why.contains("permission denied"), "{doc:#}");
    // Even with the directory opened up, the socket itself refuses.
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o711)).unwrap();
    let out = as_nobody(&["--json", "--dir", dir.to_str().unwrap()]);
    let doc: Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert!(engines(&doc).is_empty(), "{doc:#}");
    assert!(path.exists(), "a refused reader must not remove a live endpoint");
    drop(e);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn programs_under_netchannel_run_in_namespaces() {
    if !have("redis-server") || !have("redis-cli") {
        return;
    }
    let Some(tb) = Testbed::of(Hosts::Netns) else { return };
    let _one_at_a_time = one_at_a_time();
    let p = Pair::new(tb, "stat", true, true);
    let dir = control_dir("run");
    let port = ports(1).to_string();
    let h = p.server.addr.clone();
    let spawn = |side: &Side, prog: &str, args: &[&str]| {
        let mut c = side.command(prog, args);
        c.env(DIR_ENV, &dir).stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null());
        c.process_group(0);
        Server(c.spawn().unwrap())
    };
    use std::os::unix::process::CommandExt;
    let server = spawn(
        &p.server,
        "redis-server",
        &[
            "--port",
            &port,
            "--bind",
            &h,
            "--save",
            "",
            "--appendonly",
            "no",
            "--protected-mode",
            "no",
        ],
    );
    p.server.wait_listening(port.parse().unwrap());
    // A client that holds its connection open: BLPOP waits 30 s for a list that never fills.
    let client = spawn(&p.client, "redis-cli", &["-h", &h, "-p", &port, "BLPOP", "nothing", "30"]);
    let deadline = Instant::now() + Duration::from_secs(20);
    let doc = loop {
        let doc = stat_json(&dir);
        let with_socket = engines(&doc)
            .iter()
            .filter(|e| e["sockets"].as_array().is_some_and(|s| !s.is_empty()))
            .count();
        // An idle connection's session has its first channel only.
        let channel = engines(&doc).iter().any(|e| {
            e["command"] == "redis-cli"
                && e["peers"][0]["channels"].as_array().is_some_and(|c| c.len() == 1)
        });
        if with_socket == 2 && channel {
            break doc;
        }
        assert!(Instant::now() < deadline, "engines never showed the connection: {doc:#}");
        std::thread::sleep(Duration::from_millis(50));
    };
    let find = |comm: &str| -> Value {
        engines(&doc)
            .iter()
            .find(|e| e["command"] == comm)
            .cloned()
            .unwrap_or_else(|| panic!("no {comm} engine: {doc:#}"))
    };
    let (srv, cli) = (find("redis-server"), find("redis-cli"));
    let redis = format!("{h}:{port}");
    // The connection by the addresses the programs see: the client's peer and the server's
    // local address are redis's.
    let (cs, ss) = (&cli["sockets"][0], &srv["sockets"][0]);
    assert_eq!(cs["peer"].as_str(), Some(redis.as_str()), "{cli:#}");
    assert_eq!(ss["local"].as_str(), Some(redis.as_str()), "{srv:#}");
    assert!(cli["peers"][0]["channels"].as_array().is_some_and(|c| c.len() == 1), "{cli:#}");
    assert!(srv["channel_addr"]
        .as_str()
        .is_some_and(|a| a.ends_with(&format!(":{}", p.server.channel_port))));

    // Killed: nothing removes its endpoint but the next look, which finds it dead.
    let cli_pid = cli["pid"].as_u64().unwrap();
    // SAFETY: signalling the client's process group (our child leads it).
    unsafe { libc::kill(-(client.0.id() as i32), libc::SIGKILL) };
    drop(client);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let doc = stat_json(&dir);
        if engines(&doc).iter().all(|e| e["pid"].as_u64() != Some(cli_pid)) {
            break;
        }
        assert!(Instant::now() < deadline, "the killed client is still listed: {doc:#}");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(endpoints(&dir), 1, "only the server's endpoint remains");
    // Exiting (SIGTERM: redis leaves through exit()) removes its own endpoint.
    server.stop();
    assert_eq!(endpoints(&dir), 0);
    let _ = std::fs::remove_dir_all(&dir);
}
