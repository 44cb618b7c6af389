//! Real, unmodified programs under `netchannel run`, on loopback and between two network
//! namespaces, with their results checked and the `--stats` summaries proving that the
//! connections went over netchannel (or, for fallback, over kernel TCP).

#[path = "../../netchannel/tests/common/mod.rs"]
mod common;
mod util;

use std::time::{Duration, Instant};

use common::{Hosts, Testbed};
use util::*;

const T: Duration = Duration::from_secs(60);

fn assert_carried(p: &Pair, min_client: u64, min_server: u64) {
    let (c, s) =
        (stat(&p.client.stats, "virtual sockets"), stat(&p.server.stats, "virtual sockets"));
    assert!(
        c >= min_client && s >= min_server,
        "expected virtual sockets (client {c} >= {min_client}, server {s} >= {min_server})\n\
         client: {}server: {}",
        stats_text(&p.client.stats),
        stats_text(&p.server.stats)
    );
}

/// `redis-benchmark --csv` lines: "SET","123456.78",... -> requests per second.
fn rps(csv: &str, test: &str) -> f64 {
    csv.lines()
        .find(|l| l.starts_with(&format!("\"{test}\"")))
        .and_then(|l| l.split(',').nth(1))
        .and_then(|v| v.trim_matches('"').parse().ok())
        .unwrap_or_else(|| panic!("no {test} result in redis-benchmark output:\n{csv}"))
}

fn redis(hosts: Hosts) {
    if !have("redis-server") || !have("redis-benchmark") {
        return;
    }
    let Some(tb) = Testbed::of(hosts) else { return };
    let _one_at_a_time = one_at_a_time();
    let p = Pair::new(tb, &format!("redis-{hosts:?}"), true, true);
    let port = ports(1).to_string();
    let h = p.server.addr.clone();
    let dir = p.dir.display().to_string();
    let server = p.server.spawn(
        "redis-server",
        &["--port", &port, "--bind", &h, "--protected-mode", "no", "--save", "", "--appendonly"]
            .into_iter()
            .chain(["no", "--dir", &dir, "--dbfilename", "dump.rdb", "--daemonize", "no"])
            .collect::<Vec<_>>(),
    );
    p.server.wait_listening(port.parse().unwrap());
    let cli = |args: &[&str]| {
        let mut a = vec!["-h", &h, "-p", &port, "--raw"];
        a.extend_from_slice(args);
        p.client.run("redis-cli", &a, T)
    };
    for size in [16usize, 4096] {
        let d = size.to_string();
        let out = p.client.run(
            "redis-benchmark",
            &["-h", &h, "-p", &port, "-c", "50", "-P", "16", "-t", "set,get", "-n", "40000"]
                .into_iter()
                .chain(["-d", &d, "--csv"])
                .collect::<Vec<_>>(),
            T,
        );
        assert!(rps(&out, "SET") > 1000.0 && rps(&out, "GET") > 1000.0, "{out}");
        // redis-benchmark's SET writes `size` bytes under this key.
        assert_eq!(cli(&["strlen", "key:__rand_int__"]).trim(), d);
    }

    // Known values, then a BGSAVE while 50 connections keep writing: the forked child closes
    // its inherited copies of the carried sockets, which must not disturb the parent's.
    let kv: Vec<(String, String)> =
        (0..200).map(|i| (format!("k{i}"), format!("{i}-{}", "v".repeat(i * 7 % 900)))).collect();
    let mut mset = vec!["mset"];
    for (k, v) in &kv {
        mset.push(k);
        mset.push(v);
    }
    assert_eq!(cli(&mset).trim(), "OK");
    let load = p
        .client
        .command(
            "redis-benchmark",
            &["-h", &h, "-p", &port, "-c", "50", "-P", "16", "-t", "set", "-n", "300000", "-d"]
                .into_iter()
                .chain(["64", "--csv"])
                .collect::<Vec<_>>(),
        )
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("redis-benchmark");
    std::thread::sleep(Duration::from_millis(300));
    let saves = |info: &str, key: &str| -> String {
        info.lines()
            .find_map(|l| l.strip_prefix(&format!("{key}:")))
            .unwrap_or_default()
            .trim()
            .to_string()
    };
    let reply = cli(&["bgsave"]);
    assert!(reply.contains("Background saving started"), "{reply}");
    let deadline = Instant::now() + T;
    loop {
        let info = cli(&["info", "persistence"]);
        if saves(&info, "rdb_bgsave_in_progress") == "0" {
            assert_eq!(saves(&info, "rdb_last_bgsave_status"), "ok", "{info}");
            break;
        }
        assert!(Instant::now() < deadline, "BGSAVE did not finish");
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = load.wait_with_output().expect("redis-benchmark");
    let csv = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "benchmark during BGSAVE failed: {csv}");
    assert!(rps(&csv, "SET") > 1000.0, "{csv}");
    let dump = std::fs::read(p.dir.join("dump.rdb")).expect("dump.rdb written by BGSAVE");
    assert!(dump.windows(4).any(|w| w == b"k199"), "dump.rdb lacks the keys written");
    let mut mget = vec!["mget"];
    mget.extend(kv.iter().map(|(k, _)| k.as_str()));
    let values: Vec<String> = cli(&mget).lines().map(String::from).collect();
    let want: Vec<String> = kv.iter().map(|(_, v)| v.clone()).collect();
    assert_eq!(values, want, "values read back differ from those written");
    server.stop();
    assert_carried(&p, 100, 100);
}

/// iperf3 --json: the received bits per second of the summary `key`.
fn iperf_bps(json: &str, key: &str) -> f64 {
    let v: serde_json::Value = serde_json::from_str(json).expect("iperf3 --json output");
    v["end"][key]["bits_per_second"].as_f64().unwrap_or_else(|| panic!("no end.{key} in {json}"))
}

fn iperf3(hosts: Hosts) {
    if !have("iperf3") {
        return;
    }
    let Some(tb) = Testbed::of(hosts) else { return };
    let _one_at_a_time = one_at_a_time();
    let p = Pair::new(tb, &format!("iperf3-{hosts:?}"), true, true);
    let port = ports(1).to_string();
    let h = p.server.addr.clone();
    let server = p.server.spawn("iperf3", &["-s", "-p", &port, "-B", &h]);
    p.server.wait_listening_quietly(port.parse().unwrap());
    let base = ["-c", &h, "-p", &port, "-t", "1", "--json"];
    let run = |extra: &[&str]| {
        let mut a = base.to_vec();
        a.extend_from_slice(extra);
        p.client.run("iperf3", &a, T)
    };
    let out = run(&["-P", "8"]);
    assert!(iperf_bps(&out, "sum_received") > 1e6, "{out}");
    let out = run(&["-R"]);
    assert!(iperf_bps(&out, "sum_received") > 1e6, "{out}");
    let out = run(&["--bidir"]);
    assert!(iperf_bps(&out, "sum_received") > 1e6, "{out}");
    assert!(iperf_bps(&out, "sum_received_bidir_reverse") > 1e6, "{out}");
    server.stop();
    // -P 8: 1 control + 8 data; -R: 1 + 1; --bidir: 1 + 2.
    assert_carried(&p, 14, 14);
    // The engine's and the library's own socket calls never came back into the library.
    for side in [&p.client, &p.server] {
        let text = stats_text(&side.stats);
        assert!(text.contains("re-entered "), "{text}");
        assert_eq!(stat(&side.stats, "re-entered"), 0, "{text}");
    }
}

/// A carried client and a kernel server (no engine there), and a kernel client of a carried
/// server: both work, over kernel TCP, and the stats say why.
fn fallback(hosts: Hosts) {
    if !have("iperf3") {
        return;
    }
    let Some(tb) = Testbed::of(hosts) else { return };
    let _one_at_a_time = one_at_a_time();
    let p = Pair::new(tb, &format!("fallback-{hosts:?}"), true, false);
    let port = ports(1).to_string();
    let h = p.server.addr.clone();
    let server = p.server.spawn("iperf3", &["-s", "-p", &port, "-B", &h]);
    p.server.wait_listening_quietly(port.parse().unwrap());
    let out = p.client.run("iperf3", &["-c", &h, "-p", &port, "-t", "1", "--json"], T);
    assert!(iperf_bps(&out, "sum_received") > 1e6, "{out}");
    assert_eq!(stat(&p.client.stats, "virtual sockets"), 0);
    assert!(stat(&p.client.stats, "no engine at peer") >= 2, "{}", stats_text(&p.client.stats));
    drop(server);

    let p = Pair::new(p.tb, &format!("fallback2-{hosts:?}"), false, true);
    let server = p.server.spawn("iperf3", &["-s", "-p", &port, "-B", &h]);
    p.server.wait_listening_quietly(port.parse().unwrap());
    let out = p.client.run("iperf3", &["-c", &h, "-p", &port, "-t", "1", "--json", "-R"], T);
    assert!(iperf_bps(&out, "sum_received") > 1e6, "{out}");
    server.stop();
    assert_eq!(stat(&p.server.stats, "virtual sockets"), 0, "{}", stats_text(&p.server.stats));

    // A second wrapped server on a host whose channel port another one owns: its listener
    // stays on kernel TCP, works, and the program is told so on stderr.
    let p = Pair::new(p.tb, &format!("fallback3-{hosts:?}"), false, true);
    let owner = p.server.spawn("iperf3", &["-s", "-p", &port, "-B", &h]);
    p.server.wait_listening_quietly(port.parse().unwrap());
    let port2 = ports(1).to_string();
    let second = {
        let (server, h, port2) = (p.server.clone(), h.clone(), port2.clone());
        std::thread::spawn(move || {
            server.output("iperf3", &["-s", "-p", &port2, "-B", &h, "-1"], T)
        })
    };
    // Not `wait_listening`: its probe would be the one test `-1` serves. Connects are refused
    // until the second server listens, which leaves its one test for the client.
    let mut out = String::new();
    let mut served = false;
    for _ in 0..100 {
        let got = p.client.output("iperf3", &["-c", &h, "-p", &port2, "-t", "1", "--json"], T);
        out = String::from_utf8_lossy(&got.stdout).into_owned();
        // iperf3 --json exits 0 on a refused connect too; the JSON says so.
        served = got.status.success() && !out.contains("\"error\"");
        if served {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    if !served {
        // Its one test, so that the second server ends before the test fails: none is left.
        p.server.wait_listening(port2.parse().unwrap());
    }
    let second = second.join().unwrap();
    assert!(iperf_bps(&out, "sum_received") > 1e6, "{out}");
    let said = String::from_utf8_lossy(&second.stderr);
    assert!(said.contains("channel port") && said.contains("stay on kernel TCP"), "{said}");
    drop(owner);
}

/// `netchannel run --psk-file`: a server whose engine requires the key carries the clients
/// that hold it; a client with another key is refused by its engine and goes over kernel TCP.
fn preshared_key(hosts: Hosts) {
    if !have("redis-server") || !have("redis-cli") {
        return;
    }
    let Some(tb) = Testbed::of(hosts) else { return };
    let _one_at_a_time = one_at_a_time();
    let mut p = Pair::new(tb, &format!("psk-{hosts:?}"), true, true);
    let (key, other) = (p.dir.join("key"), p.dir.join("other-key"));
    std::fs::write(&key, b"a pre-shared key of thirty-two b").unwrap();
    std::fs::write(&other, b"another key, also long enough!!!").unwrap();
    let with = |k: &std::path::Path| vec!["--psk-file".to_string(), k.display().to_string()];
    p.server.run_options = with(&key);
    let port = ports(1).to_string();
    let h = p.server.addr.clone();
    let server = p.server.spawn(
        "redis-server",
        &["--port", &port, "--bind", &h, "--protected-mode", "no", "--save", ""],
    );
    p.server.wait_listening(port.parse().unwrap());
    p.client.run_options = with(&key);
    let out = p.client.run("redis-cli", &["-h", &h, "-p", &port, "ping"], T);
    assert_eq!(out.trim(), "PONG");
    assert!(stat(&p.client.stats, "virtual sockets") >= 1, "{}", stats_text(&p.client.stats));
    // Another key: refused by the server's engine, so the connection is kernel TCP.
    p.client.run_options = with(&other);
    p.client.stats = p.dir.join("other-client.stats");
    let out = p.client.run("redis-cli", &["-h", &h, "-p", &port, "ping"], T);
    assert_eq!(out.trim(), "PONG");
    assert_eq!(stat(&p.client.stats, "virtual sockets"), 0, "{}", stats_text(&p.client.stats));
    assert!(stat(&p.client.stats, "kernel tcp") >= 1, "{}", stats_text(&p.client.stats));
    drop(server);
}

/// sockperf ping-pong and throughput through epoll, poll and select, blocking and not.
fn sockperf(hosts: Hosts) {
    if !have("sockperf") {
        return;
    }
    let Some(tb) = Testbed::of(hosts) else { return };
    let _one_at_a_time = one_at_a_time();
    let mut p = Pair::new(tb, &format!("sockperf-{hosts:?}"), true, true);
    let port = ports(1);
    let feed = p.dir.join("feed");
    std::fs::write(&feed, format!("T:{}:{port}\n", p.server.addr)).unwrap();
    let feed = feed.display().to_string();
    let server = p.server.spawn("sockperf", &["server", "-f", &feed, "-F", "epoll"]);
    p.server.wait_listening(port);
    for (i, mux) in ["epoll", "poll", "select"].into_iter().enumerate() {
        let mut a = vec!["ping-pong", "-f", &feed, "-F", mux, "-t", "1"];
        if i % 2 == 1 {
            a.push("--nonblocked");
        }
        let out = p.client.output("sockperf", &a, T);
        let text = String::from_utf8_lossy(&out.stderr).into_owned()
            + &String::from_utf8_lossy(&out.stdout);
        let p50: f64 = text
            .lines()
            .find_map(|l| l.split("percentile 50.000 =").nth(1))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("no p50 from sockperf ping-pong -F {mux}:\n{text}"));
        assert!(p50 > 0.0 && p50 < 100_000.0, "p50 {p50} us");
        let mut a = vec!["throughput", "-f", &feed, "-F", mux, "-t", "1", "-m", "1400"];
        if i % 2 == 0 {
            a.push("--nonblocked");
        }
        let out = p.client.output("sockperf", &a, T);
        let text = String::from_utf8_lossy(&out.stderr).into_owned()
            + &String::from_utf8_lossy(&out.stdout);
        let rate: f64 = text
            .lines()
            .find_map(|l| l.split("Message Rate is").nth(1))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap_or_else(|| {
                panic!("no message rate from sockperf throughput -F {mux}:\n{text}")
            });
        assert!(rate > 100.0, "{text}");
    }
    // With polling off (`--poll-us 0`) a ping-pong, whose waits are all short, never polls.
    let polled = stat(&p.client.stats, "polled before sleeping");
    p.client.run_options.extend(["--poll-us", "0"].map(String::from));
    let out = p.client.output("sockperf", &["ping-pong", "-f", &feed, "-t", "1"], T);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(stat(&p.client.stats, "polled before sleeping"), polled, "polled with --poll-us 0");
    drop(server);
    // sockperf's server leaves through a signal handler without exit(): client side only.
    assert!(stat(&p.client.stats, "virtual sockets") >= 6, "{}", stats_text(&p.client.stats));
}

/// memcached -t 4 with memcslap, then values written and read back by memccp/memccat.
fn memcached(hosts: Hosts) {
    if !have("memcached") || !have("memcslap") {
        return;
    }
    let Some(tb) = Testbed::of(hosts) else { return };
    let _one_at_a_time = one_at_a_time();
    let p = Pair::new(tb, &format!("memcached-{hosts:?}"), true, true);
    let port = ports(1).to_string();
    let h = p.server.addr.clone();
    let server =
        p.server.spawn("memcached", &["-t", "4", "-l", &h, "-p", &port, "-U", "0", "-u", "root"]);
    p.server.wait_listening(port.parse().unwrap());
    let servers = format!("--servers={h}:{port}");
    let out = p.client.run(
        "memcslap",
        &[&servers, "--concurrency=16", "--execute-number=500", "--flush"],
        T,
    );
    let secs: f64 = out
        .lines()
        .find_map(|l| l.strip_prefix("Time to set"))
        .and_then(|l| l.split(':').nth(1)?.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("no timing from memcslap:\n{out}"));
    assert!(secs > 0.0, "{out}");
    let file = p.dir.join("value.bin");
    let value: Vec<u8> = (0..100_000u32).map(|i| (i * 7 + i / 251) as u8).collect();
    std::fs::write(&file, &value).unwrap();
    p.client.run("memccp", &[&servers, &file.display().to_string()], T);
    let got = p.client.output("memccat", &[&servers, "value.bin"], T);
    assert!(got.status.success(), "{}", String::from_utf8_lossy(&got.stderr));
    // memccat ends the value with a newline.
    assert!(
        got.stdout.strip_suffix(b"\n") == Some(&value[..]),
        "memccat returned {} bytes unlike those stored",
        got.stdout.len()
    );
    server.stop();
    assert_carried(&p, 17, 17);
}

/// nginx serving a file to wrk (keep-alive and `Connection: close`), content checked by curl.
fn nginx(hosts: Hosts) {
    if !have("nginx") || !have("wrk") || !have("curl") {
        return;
    }
    // Relayed (`--relay-forked`), then as by default: once a worker accepted a connection, the
    // engine's answers ask the client to make its next ones over kernel TCP.
    for relay_forked in [true, false] {
        nginx_with(hosts, relay_forked);
    }
}

fn nginx_with(hosts: Hosts, relay_forked: bool) {
    let Some(tb) = Testbed::of(hosts) else { return };
    let _one_at_a_time = one_at_a_time();
    let mut p = Pair::new(tb, &format!("nginx-{hosts:?}-{relay_forked}"), true, true);
    if relay_forked {
        p.server.run_options.push("--relay-forked".into());
    }
    let port = ports(1);
    let root = p.dir.join("html");
    std::fs::create_dir_all(&root).unwrap();
    let body: String = (0..20_000).map(|i| format!("{i:07}\n")).collect();
    std::fs::write(root.join("f.txt"), &body).unwrap();
    let conf = p.dir.join("nginx.conf");
    std::fs::write(
        &conf,
        format!(
            "daemon off; master_process on; worker_processes 2; pid {d}/nginx.pid;\n\
             error_log {d}/error.log; events {{ worker_connections 1024; }}\n\
             http {{ access_log off; client_body_temp_path {d}; proxy_temp_path {d};\n\
             fastcgi_temp_path {d}; uwsgi_temp_path {d}; scgi_temp_path {d};\n\
             server {{ listen {a}:{port}; root {r}; }} }}\n",
            d = p.dir.display(),
            a = p.server.addr,
            r = root.display()
        ),
    )
    .unwrap();
    let server = p
        .server
        .spawn("nginx", &["-c", &conf.display().to_string(), "-p", &p.dir.display().to_string()]);
    p.server.wait_listening(port);
    let url = format!("http://{}:{port}/f.txt", p.server.addr);
    for close in [false, true] {
        let mut a = vec!["-t", "2", "-c", "16", "-d", "1", &url];
        if close {
            a.extend(["-H", "Connection: close"]);
        }
        let out = p.client.run("wrk", &a, T);
        let rps: f64 = out
            .lines()
            .find_map(|l| l.strip_prefix("Requests/sec:"))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("no Requests/sec from wrk:\n{out}"));
        assert!(rps > 10.0, "{out}");
        // wrk sizes its event loop to 10 + 3 x connections fds and counts a connection whose
        // fd lands above as a connect error. The engine's own fds move above the program's
        // as they are made; a placeholder's socket pair holds two low numbers for an instant
        // while one of wrk's threads connects, which shifts the other's new socket by two at
        // most, far within the loop's size.
        let errors = |kind: &str| -> u64 {
            out.lines()
                .find_map(|l| l.trim().strip_prefix("Socket errors:"))
                .and_then(|l| l.split(',').find_map(|e| e.trim().strip_prefix(kind)))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0)
        };
        for kind in ["connect", "read", "write", "timeout"] {
            assert_eq!(errors(kind), 0, "{out}");
        }
        assert!(!out.contains("Non-2xx"), "{out}");
    }
    let got = p.client.run("curl", &["-sf", &url], T);
    assert!(got == body, "curl got {} bytes unlike the file", got.len());
    server.stop();
    // nginx's master owns the engine; its workers accept the relayed connections.
    let (carried, forked) =
        (stat(&p.client.stats, "virtual sockets"), stat(&p.client.stats, "forked server"));
    if relay_forked {
        assert!(carried >= 33 && forked == 0, "{}", stats_text(&p.client.stats));
    } else {
        // Each of wrk's threads connects its 8 connections before the first answer with the
        // request comes back; then every other connect of its process within 2 s goes over
        // kernel TCP.
        assert!(carried >= 1 && forked >= 16, "{}", stats_text(&p.client.stats));
    }
}

/// PostgreSQL's programs: Debian keeps them in /usr/lib/postgresql/VERSION/bin (the newest).
fn postgres_bin() -> Option<std::path::PathBuf> {
    let mut dirs: Vec<(u32, std::path::PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .filter_map(|e| {
            let e = e.ok()?;
            let version = e.file_name().to_str()?.parse().ok()?;
            let bin = e.path().join("bin");
            ["initdb", "postgres", "pgbench", "psql"]
                .iter()
                .all(|p| bin.join(p).exists())
                .then_some((version, bin))
        })
        .collect();
    dirs.sort();
    let found = dirs.pop().map(|(_, bin)| bin);
    if found.is_none() {
        have("pgbench"); // skips, or fails in CI, naming scripts/setup.sh
    }
    found
}

/// PostgreSQL under pgbench (TPC-B-like transactions from 8 connections in 2 threads), results
/// checked with psql. The postmaster accepts each connection, forks a backend that serves it
/// and closes its own copy (accept-fork-parent-closes); with the relay the backend's fd is a
/// kernel socket, relayed by the postmaster's relay threads.
fn postgres(hosts: Hosts) {
    let Some(bin) = postgres_bin() else { return };
    if !have("runuser") {
        return;
    }
    let Some(tb) = Testbed::of(hosts) else { return };
    let _one_at_a_time = one_at_a_time();
    let p = Pair::new(tb, &format!("pgbench-{hosts:?}"), true, true);
    let pg = |name: &str| bin.join(name).display().to_string();
    // PostgreSQL refuses to run as root: nobody owns the data directory and runs the server,
    // and must be able to append to the server's stats file.
    let data = p.dir.join("data");
    std::fs::create_dir(&data).unwrap();
    let ok = std::process::Command::new("chown").arg("nobody:").arg(&data).status();
    assert!(ok.is_ok_and(|s| s.success()), "chown nobody {}", data.display());
    let out = std::process::Command::new("runuser")
        .args(["-u", "nobody", "--", &pg("initdb"), "-A", "trust", "-U", "postgres", "--no-sync"])
        .arg("-D")
        .arg(&data)
        .output()
        .unwrap();
    assert!(out.status.success(), "initdb: {}", String::from_utf8_lossy(&out.stderr));
    let mut hba = std::fs::OpenOptions::new().append(true).open(data.join("pg_hba.conf")).unwrap();
    std::io::Write::write_all(&mut hba, b"host all all 0.0.0.0/0 trust\n").unwrap();
    std::fs::write(&p.server.stats, "").unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&p.server.stats, std::fs::Permissions::from_mode(0o666)).unwrap();

    let port = ports(1).to_string();
    let h = p.server.addr.clone();
    let d = data.display().to_string();
    let server = p.server.spawn(
        "runuser",
        &["-u", "nobody", "--", &pg("postgres"), "-D", &d, "-k", &d, "-h", &h, "-p", &port]
            .into_iter()
            .chain(["-c", "fsync=off", "-c", "synchronous_commit=off", "-c"])
            .chain(["full_page_writes=off"])
            .collect::<Vec<_>>(),
    );
    p.server.wait_listening(port.parse().unwrap());
    let conn = ["-h", &h, "-p", &port, "-U", "postgres"];
    fn with<'a>(conn: &[&'a str], args: &[&'a str]) -> Vec<&'a str> {
        conn.iter().chain(args).copied().collect()
    }
    p.client.run(&pg("pgbench"), &with(&conn, &["-i", "-q", "postgres"]), T);
    let out = p.client.run(
        &pg("pgbench"),
        &with(&conn, &["-c", "8", "-j", "2", "-t", "250", "postgres"]),
        T,
    );
    assert!(out.contains("number of transactions actually processed: 2000/2000"), "{out}");
    assert!(out.contains("number of failed transactions: 0 "), "{out}");
    let tps: f64 = out
        .lines()
        .find_map(|l| l.strip_prefix("tps = "))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("no tps from pgbench:\n{out}"));
    assert!(tps > 0.0, "{out}");
    // Scale 1: 100,000 accounts; each transaction adds one history row.
    let counts = p.client.run(
        &pg("psql"),
        &with(&conn, &["-X", "-At", "-c", "select count(*) from pgbench_accounts"])
            .into_iter()
            .chain(["-c", "select count(*) from pgbench_history", "postgres"])
            .collect::<Vec<_>>(),
        T,
    );
    assert_eq!(counts, "100000\n2000\n");
    server.stop();
    // pgbench -i, pgbench (8 connections and one more) and psql: 11 connections. The
    // postmaster accepted the carried ones, and its backends took them over (they write the
    // counters they inherited). Once one was, the postmaster's engine asks clients for
    // kernel TCP: a process's connections after its first go over kernel TCP, and so do those
    // of a process started within 2 s of that answer (the host's hints).
    let client = |field| stat(&p.client.stats, field);
    let (carried, forked) = (client("virtual sockets"), client("forked server"));
    assert!(carried >= 1 && forked >= 1, "{}", stats_text(&p.client.stats));
    assert!(carried + forked >= 11, "{}", stats_text(&p.client.stats));
    assert!(stat_max(&p.server.stats, "accept") >= carried, "{}", stats_text(&p.server.stats));
    assert!(stat_max(&p.server.stats, "inherited") >= 1, "{}", stats_text(&p.server.stats));
}

/// haproxy in TCP mode between redis-benchmark and redis-server: one event loop that accepts
/// the clients' connections and connects to the backend for each. The client and the backend
/// are on host A, haproxy on host B. Between namespaces both hops are carried. On loopback the
/// hosts share one channel port, which haproxy's engine holds (it listens), so the backend runs
/// on kernel TCP and haproxy's connections to it find no engine at the peer.
fn haproxy(hosts: Hosts) {
    if !have("haproxy") || !have("redis-server") || !have("redis-benchmark") {
        return;
    }
    let Some(tb) = Testbed::of(hosts) else { return };
    let _one_at_a_time = one_at_a_time();
    let p = Pair::new(tb, &format!("haproxy-{hosts:?}"), true, true);
    let both = p.server.netns.is_some();
    let mut backend = p.client.clone();
    backend.carried = both;
    backend.stats = p.dir.join("backend.stats");
    let (front, back) = (ports(1), ports(1));
    let redis = backend.spawn(
        "redis-server",
        &["--port", &back.to_string(), "--bind", &backend.addr, "--protected-mode", "no"]
            .into_iter()
            .chain(["--save", "", "--appendonly", "no"])
            .collect::<Vec<_>>(),
    );
    backend.wait_listening(back);
    let conf = p.dir.join("haproxy.cfg");
    std::fs::write(
        &conf,
        format!(
            "global\n  maxconn 1000\n\
             defaults\n  mode tcp\n  timeout connect 5s\n  timeout client 60s\n  timeout server 60s\n\
             frontend fe\n  bind {}:{front}\n  default_backend be\n\
             backend be\n  server redis {}:{back}\n",
            p.server.addr, backend.addr
        ),
    )
    .unwrap();
    let proxy = p.server.spawn("haproxy", &["-f", &conf.display().to_string(), "-db"]);
    p.server.wait_listening(front);
    let (h, port) = (p.server.addr.clone(), front.to_string());
    let cli = |args: &[&str]| {
        let mut a = vec!["-h", &h, "-p", &port, "--raw"];
        a.extend_from_slice(args);
        p.client.run("redis-cli", &a, T)
    };
    let out = p.client.run(
        "redis-benchmark",
        &["-h", &h, "-p", &port, "-c", "20", "-P", "8", "-t", "set,get", "-n", "20000", "--csv"],
        T,
    );
    assert!(rps(&out, "SET") > 1000.0 && rps(&out, "GET") > 1000.0, "{out}");
    let kv: Vec<(String, String)> =
        (0..200).map(|i| (format!("k{i}"), format!("{i}-{}", "v".repeat(i * 13 % 2000)))).collect();
    let mut mset = vec!["mset"];
    for (k, v) in &kv {
        mset.push(k);
        mset.push(v);
    }
    assert_eq!(cli(&mset).trim(), "OK");
    let mut mget = vec!["mget"];
    mget.extend(kv.iter().map(|(k, _)| k.as_str()));
    let values: Vec<String> = cli(&mget).lines().map(String::from).collect();
    let want: Vec<String> = kv.iter().map(|(_, v)| v.clone()).collect();
    assert_eq!(values, want, "values read back through haproxy differ from those written");
    // Every request of the benchmark reached redis once (20,000 is a multiple of -P 8).
    let stats = cli(&["info", "commandstats"]);
    for cmd in ["set", "get"] {
        let calls = stats
            .lines()
            .find_map(|l| l.strip_prefix(&format!("cmdstat_{cmd}:calls=")))
            .and_then(|v| v.split(',').next()?.parse::<u64>().ok());
        assert_eq!(calls, Some(20_000), "{stats}");
    }
    assert!(stats.contains("failed_calls=0"), "{stats}");
    // haproxy leaves through exit() (writing its stats) on SIGUSR1, its soft stop.
    proxy.stop_with(libc::SIGUSR1);
    redis.stop();
    let proxy_stats = stats_text(&p.server.stats);
    // redis-benchmark: 2 x 20 connections (and 2 for its CONFIG GET); redis-cli: 3.
    assert!(stat(&p.client.stats, "virtual sockets") >= 40, "{}", stats_text(&p.client.stats));
    assert!(stat(&p.server.stats, "accept") >= 40, "{proxy_stats}");
    if both {
        assert!(stat(&p.server.stats, "connect") >= 40, "{proxy_stats}");
        assert!(stat(&backend.stats, "accept") >= 40, "{}", stats_text(&backend.stats));
    } else {
        assert_eq!(stat(&p.server.stats, "connect"), 0, "{proxy_stats}");
        assert!(stat(&p.server.stats, "no engine at peer") >= 40, "{proxy_stats}");
    }
}

/// node.js (libuv: level-triggered epoll re-armed with `EPOLL_CTL_MOD`, writes that wait for
/// `drain`, half-close by `end`): an echo server and a client that sends each of 6 connections
/// 8 MiB as fast as the socket takes it and checks the SHA-256 of what comes back; then the
/// same client again without the library, against the same server.
fn node(hosts: Hosts) {
    if !have("node") {
        return;
    }
    let Some(tb) = Testbed::of(hosts) else { return };
    let _one_at_a_time = one_at_a_time();
    let p = Pair::new(tb, &format!("node-{hosts:?}"), true, true);
    let port = ports(1);
    let server_js = p.dir.join("server.js");
    std::fs::write(
        &server_js,
        format!(
            "const net = require('net');\n\
             net.createServer(c => c.pipe(c)).listen({port}, '{}');\n\
             process.on('SIGTERM', () => process.exit(0));\n",
            p.server.addr
        ),
    )
    .unwrap();
    let client_js = p.dir.join("client.js");
    std::fs::write(
        &client_js,
        format!(
            "const net = require('net'), crypto = require('crypto');\n\
             const N = 6, SIZE = 8 << 20;\n\
             let done = 0;\n\
             for (let i = 0; i < N; i++) {{\n\
               const c = net.connect({port}, '{}');\n\
               const sent = crypto.createHash('sha256'), got = crypto.createHash('sha256');\n\
               const chunk = crypto.randomBytes(65536 + 4099 * i);\n\
               let n = 0, back = 0;\n\
               const pump = () => {{\n\
                 while (n < SIZE) {{\n\
                   const b = chunk.subarray(0, Math.min(chunk.length, SIZE - n));\n\
                   sent.update(b); n += b.length;\n\
                   if (!c.write(b)) return;\n\
                 }}\n\
                 c.end();\n\
               }};\n\
               c.on('connect', pump); c.on('drain', pump);\n\
               c.on('data', d => {{ got.update(d); back += d.length; }});\n\
               c.on('end', () => {{\n\
                 const same = sent.digest('hex') === got.digest('hex');\n\
                 console.log(i, back, same ? 'same' : 'DIFFERENT');\n\
                 if (++done === N) process.exit(0);\n\
               }});\n\
               c.on('error', e => {{ console.log(i, 'error', e.code); process.exit(1); }});\n\
             }}\n",
            p.server.addr
        ),
    )
    .unwrap();
    let server = p.server.spawn("node", &[&server_js.display().to_string()]);
    p.server.wait_listening(port);
    // Then the same client without the library: libuv closes fds through `syscall()`, and the
    // server's next connections (over kernel TCP now) reused the closed ones' numbers, which
    // the library must no longer take for carried connections (they were reset).
    let plain = Side { carried: false, ..p.client.clone() };
    for side in [&p.client, &plain] {
        let out = side.run("node", &[&client_js.display().to_string()], T);
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines.len(), 6, "{out}");
        for l in lines {
            assert!(l.ends_with(&format!(" {} same", 8 << 20)), "{out}");
        }
    }
    server.stop();
    assert_eq!(stat(&p.client.stats, "direct"), 6, "{}", stats_text(&p.client.stats));
    assert_eq!(stat(&p.server.stats, "accept"), 6, "{}", stats_text(&p.server.stats));
    assert_eq!(stat(&p.server.stats, "relayed"), 0, "{}", stats_text(&p.server.stats));
}

/// A Java program: `com.sun.net.httpserver` (a selector thread and a pool of 4) against
/// `java.net.http.HttpClient` (its own selector thread, sequential then concurrent requests) and
/// a plain blocking `Socket` with a read timeout (JDK 17's `NioSocketImpl`: `poll` on a
/// non-blocking socket, and closing by `dup2` over the fd): the same output as on kernel TCP.
fn java(hosts: Hosts) {
    if !have("java") {
        return;
    }
    let Some(outputs) = kernel_then_carried(hosts, "java", |p, carried| {
        let port = ports(1);
        let (srv, cli) = (p.dir.join("Srv.java"), p.dir.join("Cli.java"));
        std::fs::write(&srv, JAVA_SERVER).unwrap();
        std::fs::write(&cli, JAVA_CLIENT).unwrap();
        let server = p
            .server
            .spawn("java", &[&srv.display().to_string(), &p.server.addr, &port.to_string()]);
        p.server.wait_listening(port);
        let out = p.client.run(
            "java",
            &[&cli.display().to_string(), &p.server.addr, &port.to_string(), "40"],
            T,
        );
        server.stop();
        if carried {
            let text = stats_text(&p.client.stats);
            assert!(stat(&p.client.stats, "direct") > 0, "{text}");
            assert_eq!(stat(&p.client.stats, "relayed"), 0, "{text}");
            assert_eq!(stat(&p.client.stats, "kernel tcp"), 0, "{text}");
        }
        out
    }) else {
        return;
    };
    assert_eq!(outputs[0], format!("raw socket read all\nok {}\n", 2 * 40 * 4096), "kernel TCP");
    assert_eq!(outputs[1], outputs[0], "carried differs from kernel TCP");
}

const JAVA_SERVER: &str = r#"import com.sun.net.httpserver.*;
import java.net.*;
import java.util.concurrent.*;
public class Srv {
    public static void main(String[] a) throws Exception {
        HttpServer s = HttpServer.create(new InetSocketAddress(a[0], Integer.parseInt(a[1])), 128);
        byte[] body = new byte[4096];
        for (int i = 0; i < body.length; i++) body[i] = (byte) ('a' + i % 26);
        s.createContext("/", x -> {
            x.sendResponseHeaders(200, body.length);
            try (var o = x.getResponseBody()) { o.write(body); }
        });
        s.setExecutor(Executors.newFixedThreadPool(4));
        s.start();
        System.out.println("listening");
    }
}
"#;

const JAVA_CLIENT: &str = r#"import java.net.*;
import java.net.http.*;
import java.util.*;
import java.util.concurrent.*;
public class Cli {
    public static void main(String[] a) throws Exception {
        var c = HttpClient.newBuilder().version(HttpClient.Version.HTTP_1_1).build();
        var uri = URI.create("http://" + a[0] + ":" + a[1] + "/");
        int n = Integer.parseInt(a[2]);
        long bytes = 0;
        for (int i = 0; i < n; i++) {
            var r = c.send(HttpRequest.newBuilder(uri).build(), HttpResponse.BodyHandlers.ofByteArray());
            bytes += r.body().length;
        }
        List<CompletableFuture<HttpResponse<byte[]>>> fs = new ArrayList<>();
        for (int i = 0; i < n; i++)
            fs.add(c.sendAsync(HttpRequest.newBuilder(uri).build(), HttpResponse.BodyHandlers.ofByteArray()));
        for (var f : fs) bytes += f.get().body().length;
        // Plain blocking sockets (NioSocketImpl): an echo through a raw socket with a timeout.
        try (var s = new Socket()) {
            s.connect(new InetSocketAddress(a[0], Integer.parseInt(a[1])), 2000);
            s.setSoTimeout(2000);
            s.getOutputStream().write("GET / HTTP/1.0\r\n\r\n".getBytes());
            var in = s.getInputStream(); byte[] buf = new byte[65536]; int k; long got = 0;
            while ((k = in.read(buf)) > 0) got += k;
            System.out.println("raw socket read " + (got > 4096 ? "all" : "short: " + got));
        }
        System.out.println("ok " + bytes);
    }
}
"#;

/// A dual-stack IPv6 listener (`::`, `IPV6_V6ONLY` off) accepting an IPv4 client reports the
/// peer as `::ffff:a.b.c.d` in a `sockaddr_in6`, from `accept` as from `getpeername`, and its
/// own address the same way: the same text under kernel TCP and carried.
fn dual_stack_listener(hosts: Hosts) {
    if !have("python3") {
        return;
    }
    let Some(outputs) = kernel_then_carried(hosts, "dual", |p, _| {
        let port = ports(1);
        let server_py = p.dir.join("server.py");
        std::fs::write(
            &server_py,
            "import socket, sys\n\
             s = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)\n\
             s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)\n\
             s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n\
             s.bind(('::', int(sys.argv[1])))\n\
             s.listen()\n\
             while True:\n\
             \x20   c, a = s.accept()\n\
             \x20   p, l = c.getpeername(), c.getsockname()\n\
             \x20   c.sendall(f'{c.family.name} peer {a[0]} getpeername-same {a[:2] == p[:2]} \
             local {l[0]}\\n'.encode())\n\
             \x20   c.close()\n",
        )
        .unwrap();
        let server =
            p.server.spawn("python3", &[&server_py.display().to_string(), &port.to_string()]);
        p.server.wait_listening(port);
        let client = format!(
            "import socket\n\
             c = socket.create_connection(('{}', {port}))\n\
             print(c.makefile().readline().strip())\n",
            p.server.addr
        );
        let out = p.client.run("python3", &["-c", &client], T);
        server.stop();
        out
    }) else {
        return;
    };
    assert!(outputs[0].starts_with("AF_INET6 peer ::ffff:"), "kernel: {}", outputs[0]);
    assert_eq!(outputs[1], outputs[0], "carried differs from kernel TCP");
}

/// A one-process, one-thread echo server (`python3 server.py ADDRESS PORT`): a `selectors`
/// loop over its listener and connections; SIGTERM ends it through `exit` (its stats line).
const SELECT_ECHO_PY: &str = "import selectors, signal, socket, sys\n\
      signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\n\
      sel = selectors.DefaultSelector()\n\
      l = socket.socket()\n\
      l.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n\
      l.bind((sys.argv[1], int(sys.argv[2])))\n\
      l.listen(512)\n\
      l.setblocking(False)\n\
      sel.register(l, selectors.EVENT_READ)\n\
      while True:\n\
      \x20   for k, _ in sel.select():\n\
      \x20       if k.fileobj is l:\n\
      \x20           try:\n\
      \x20               while True:\n\
      \x20                   c, _ = l.accept()\n\
      \x20                   c.setblocking(False)\n\
      \x20                   sel.register(c, selectors.EVENT_READ)\n\
      \x20           except BlockingIOError:\n\
      \x20               pass\n\
      \x20       else:\n\
      \x20           c = k.fileobj\n\
      \x20           d = c.recv(65536)\n\
      \x20           if d:\n\
      \x20               c.sendall(d)\n\
      \x20           else:\n\
      \x20               sel.unregister(c)\n\
      \x20               c.close()\n";

/// One process, two listeners on one port (`SO_REUSEPORT`, as a server with a listener per
/// thread has): the kernel spreads connections over both, and those that reach the second
/// socket are served directly too, not taken for another process's (relayed, and then moved
/// to kernel TCP as a forked server's).
fn reuseport_listeners(hosts: Hosts) {
    if !have("python3") {
        return;
    }
    // IPv4, and IPv6-only listeners (injected into from their own address) on loopback.
    for v6 in [false, true] {
        reuseport_listeners_with(hosts, v6);
    }
}

fn reuseport_listeners_with(hosts: Hosts, v6: bool) {
    let Some(tb) = Testbed::of(hosts) else { return };
    let _one_at_a_time = one_at_a_time();
    let mut p = Pair::new(tb, &format!("reuseport-{hosts:?}-{v6}"), true, true);
    if v6 {
        if p.server.netns.is_some() {
            return;
        }
        p.server.addr = "::1".into();
    }
    let port = ports(1);
    let counts = p.dir.join("counts");
    let server_py = p.dir.join("server.py");
    std::fs::write(
        &server_py,
        "import selectors, signal, socket, sys\n\
         signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\n\
         sel = selectors.DefaultSelector()\n\
         listeners = []\n\
         for i in range(2):\n\
         \x20   l = socket.socket(socket.AF_INET6 if ':' in sys.argv[1] else socket.AF_INET)\n\
         \x20   if l.family == socket.AF_INET6:\n\
         \x20       l.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)\n\
         \x20   l.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)\n\
         \x20   l.bind((sys.argv[1], int(sys.argv[2])))\n\
         \x20   l.listen(64)\n\
         \x20   sel.register(l, selectors.EVENT_READ, i)\n\
         \x20   listeners.append(l)\n\
         accepted = [0, 0]\n\
         while True:\n\
         \x20   for k, _ in sel.select():\n\
         \x20       if k.fileobj in listeners:\n\
         \x20           c, _ = k.fileobj.accept()\n\
         \x20           accepted[k.data] += 1\n\
         \x20           open(sys.argv[3], 'w').write('%d %d' % tuple(accepted))\n\
         \x20           sel.register(c, selectors.EVENT_READ, 'c')\n\
         \x20       else:\n\
         \x20           d = k.fileobj.recv(65536)\n\
         \x20           if d:\n\
         \x20               k.fileobj.sendall(d)\n\
         \x20           else:\n\
         \x20               sel.unregister(k.fileobj)\n\
         \x20               k.fileobj.close()\n",
    )
    .unwrap();
    let args = [server_py.display().to_string(), p.server.addr.clone(), port.to_string()];
    let counts_arg = counts.display().to_string();
    let server = p.server.spawn("python3", &[&args[0], &args[1], &args[2], &counts_arg]);
    p.server.wait_listening(port);
    let client = format!(
        "import socket\n\
         for i in range(40):\n\
         \x20   s = socket.create_connection(('{}', {port}), timeout=10)\n\
         \x20   s.sendall(b'%d' % i)\n\
         \x20   assert s.recv(100) == b'%d' % i\n\
         \x20   s.close()\n\
         print('ok')\n",
        p.server.addr
    );
    assert_eq!(p.client.run("python3", &["-c", &client], T).trim(), "ok");
    server.stop();
    let text = std::fs::read_to_string(&counts).unwrap();
    let each: Vec<u64> = text.split(' ').map(|n| n.parse().unwrap()).collect();
    // Carried connections on each socket (and the harness's probe that the port listens on
    // one of them).
    assert!(each.iter().all(|&n| n >= 2) && each.iter().sum::<u64>() >= 40, "accepts: {text}");
    let (client, server) = (stats_text(&p.client.stats), stats_text(&p.server.stats));
    assert!(stat(&p.client.stats, "virtual sockets") >= 40, "{client}");
    assert_eq!(stat(&p.client.stats, "kernel tcp"), 0, "{client}");
    assert_eq!(stat(&p.server.stats, "relayed"), 0, "{server}");
    assert!(stat(&p.server.stats, "direct") >= 40, "{server}");
}

/// A server that accepts and forks a child per connection, on the wildcard address (as
/// PostgreSQL with `listen_addresses = '*'`): once a child took a connection over (relayed),
/// the client's further connects there go over kernel TCP ("forked server").
fn forking_server_on_the_wildcard(hosts: Hosts) {
    if !have("python3") {
        return;
    }
    let Some(tb) = Testbed::of(hosts) else { return };
    let _one_at_a_time = one_at_a_time();
    let p = Pair::new(tb, &format!("forking-{hosts:?}"), true, true);
    let port = ports(1);
    let server_py = p.dir.join("server.py");
    std::fs::write(
        &server_py,
        "import os, signal, socket, sys\n\
         signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\n\
         signal.signal(signal.SIGCHLD, signal.SIG_IGN)\n\
         l = socket.socket()\n\
         l.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n\
         l.bind(('0.0.0.0', int(sys.argv[1])))\n\
         l.listen(64)\n\
         while True:\n\
         \x20   c, _ = l.accept()\n\
         \x20   if os.fork() == 0:\n\
         \x20       l.close()\n\
         \x20       c.sendall(c.recv(100))\n\
         \x20       c.close()\n\
         \x20       os._exit(0)\n\
         \x20   c.close()\n",
    )
    .unwrap();
    let server = p.server.spawn("python3", &[&server_py.display().to_string(), &port.to_string()]);
    p.server.wait_listening(port);
    let client = format!(
        "import socket\n\
         for i in range(8):\n\
         \x20   s = socket.create_connection(('{}', {port}), timeout=10)\n\
         \x20   s.sendall(b'%d' % i)\n\
         \x20   assert s.recv(100) == b'%d' % i\n\
         \x20   s.close()\n\
         print('ok')\n",
        p.server.addr
    );
    assert_eq!(p.client.run("python3", &["-c", &client], T).trim(), "ok");
    // A second client process, at once: what the first learnt holds for it too (the host's
    // hints), so none of its connections is carried (relayed at the server) either.
    let carried = stat(&p.client.stats, "virtual sockets");
    let forked = stat(&p.client.stats, "forked server");
    assert_eq!(p.client.run("python3", &["-c", &client], T).trim(), "ok");
    assert_eq!(
        stat(&p.client.stats, "virtual sockets"),
        carried,
        "{}",
        stats_text(&p.client.stats)
    );
    assert_eq!(stat(&p.client.stats, "forked server"), forked + 8);
    server.stop();
    let (client, server) = (stats_text(&p.client.stats), stats_text(&p.server.stats));
    assert!(stat(&p.client.stats, "forked server") >= 1, "{client}");
    assert!(stat_max(&p.server.stats, "inherited") >= 1, "{server}");
}

/// A server that daemonizes after `listen` (nginx's default): its parent, whose engine owned
/// the host's channel port, exits, and the daemon serves the listener it inherited, over kernel
/// TCP (it has no engine). The port must be free then: the daemon's inherited copy of the
/// channel listener kept it bound, so another server under netchannel on that host could not
/// own it ("channel port ... is taken"), and clients that dialed it waited 250 ms for a
/// handshake nobody answered.
fn daemon_forked_after_listen_frees_the_channel_port(hosts: Hosts) {
    if !have("python3") {
        return;
    }
    let Some(tb) = Testbed::of(hosts) else { return };
    let _one_at_a_time = one_at_a_time();
    let p = Pair::new(tb, &format!("daemon-{hosts:?}"), true, true);
    let port = ports(2);
    let serve = "import os, signal, socket, sys\n\
         signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\n\
         l = socket.create_server(('0.0.0.0', int(sys.argv[1])), backlog=16)\n\
         if sys.argv[2] == 'daemon' and os.fork() != 0:\n\
         \x20   sys.exit(0)\n\
         while True:\n\
         \x20   c, _ = l.accept()\n\
         \x20   c.sendall(c.recv(100))\n\
         \x20   c.close()\n";
    let daemon = p.server.spawn("python3", &["-c", serve, &port.to_string(), "daemon"]);
    p.server.wait_listening(port);
    let other = p.server.spawn("python3", &["-c", serve, &(port + 1).to_string(), "plain"]);
    p.server.wait_listening(port + 1);
    let client = format!(
        "import socket\n\
         for port in ({port}, {port} + 1):\n\
         \x20   s = socket.create_connection(('{}', port), timeout=10)\n\
         \x20   s.sendall(b'hello')\n\
         \x20   print(port - {port}, s.recv(100))\n",
        p.server.addr
    );
    assert_eq!(p.client.run("python3", &["-c", &client], T), "0 b'hello'\n1 b'hello'\n");
    other.stop();
    drop(daemon);
    let (client, server) = (stats_text(&p.client.stats), stats_text(&p.server.stats));
    assert_eq!(stat(&p.server.stats, "listeners without engine"), 0, "{server}");
    // The daemon's connection went over kernel TCP, the other server's was carried.
    assert_eq!(stat(&p.client.stats, "no engine at peer"), 1, "{client}");
    assert_eq!(stat(&p.client.stats, "direct"), 1, "{client}");
}

/// A connect to a public address (8.8.8.8, from a namespace with no route there: nothing
/// leaves) is left to kernel TCP without asking that host's channel port; `--carry-public`
/// asks it.
fn public_destinations_are_left_to_kernel_tcp(hosts: Hosts) {
    if !have("python3") {
        return;
    }
    let client = "import socket\n\
                  try:\n\
                  \x20   socket.create_connection(('8.8.8.8', 9), timeout=0.3)\n\
                  except OSError:\n\
                  \x20   pass\n";
    for carry_public in [false, true] {
        let Some(tb) = Testbed::of(hosts) else { return };
        let _one_at_a_time = one_at_a_time();
        let mut p = Pair::new(tb, &format!("public-{hosts:?}-{carry_public}"), true, true);
        if p.client.netns.is_none() {
            return;
        }
        if carry_public {
            p.client.run_options.push("--carry-public".into());
        }
        p.client.run("python3", &["-c", client], T);
        let stats = stats_text(&p.client.stats);
        let asked = stat(&p.client.stats, "not selected") == 0;
        assert!(stat(&p.client.stats, "kernel tcp") == 1 && asked == carry_public, "{stats}");
    }
}

/// A one-process server accepting many short connections at once: every one is served by
/// the owner directly, none is taken for another process's, none is lost. Between the
/// namespaces the server's ephemeral port range is narrowed to 16 ports, so the injector's
/// ports are reused at once: an injection reset when the owner took it over freed its port
/// before the acceptor saw the reset, and the acceptor then forgot the next injection on that
/// port (its client read end of stream; redis-benchmark once said "Server closed the
/// connection").
fn connection_churn(hosts: Hosts) {
    if !have("python3") {
        return;
    }
    let Some(tb) = Testbed::of(hosts) else { return };
    let _one_at_a_time = one_at_a_time();
    let p = Pair::new(tb, &format!("churn-{hosts:?}"), true, true);
    if let Some(ns) = &p.server.netns {
        let narrow = std::process::Command::new("ip")
            .args(["netns", "exec", ns, "sysctl", "-q", "net.ipv4.ip_local_port_range=40000 40015"])
            .status();
        assert!(narrow.is_ok_and(|s| s.success()), "narrowing the port range");
    }
    let port = ports(1);
    let server_py = p.dir.join("server.py");
    std::fs::write(&server_py, SELECT_ECHO_PY).unwrap();
    let server = p
        .server
        .spawn("python3", &[&server_py.display().to_string(), &p.server.addr, &port.to_string()]);
    p.server.wait_listening(port);
    let client = format!(
        "import socket, threading\n\
         bad = []\n\
         def work(k):\n\
         \x20   for i in range(150):\n\
         \x20       msg = b'%d-%d' % (k, i)\n\
         \x20       try:\n\
         \x20           s = socket.create_connection(('{}', {port}), timeout=10)\n\
         \x20           s.sendall(msg)\n\
         \x20           got = b''\n\
         \x20           while len(got) < len(msg):\n\
         \x20               d = s.recv(100)\n\
         \x20               if not d:\n\
         \x20                   break\n\
         \x20               got += d\n\
         \x20           s.close()\n\
         \x20       except OSError as e:\n\
         \x20           got = repr(e)\n\
         \x20       if got != msg:\n\
         \x20           bad.append((k, i, got))\n\
         ts = [threading.Thread(target=work, args=(k,)) for k in range(8)]\n\
         [t.start() for t in ts]\n\
         [t.join() for t in ts]\n\
         print('failed', len(bad), bad[:5])\n",
        p.server.addr
    );
    let out = p.client.run("python3", &["-c", &client], T);
    server.stop();
    assert_eq!(out, "failed 0 []\n", "{}", stats_text(&p.server.stats));
    assert_eq!(
        stat(&p.server.stats, "accepted by another process"),
        0,
        "{}",
        stats_text(&p.server.stats)
    );
    assert_eq!(stat(&p.server.stats, "direct"), 1200, "{}", stats_text(&p.server.stats));
}

/// Under the usual soft fd limit (1,024), a carried server and client hold about as many
/// connections at once as on kernel TCP. The library's own fds go above a soft limit that
/// `netchannel run` raised for them: one more per connection, the injector's until the program
/// accepts, and the engine's. Before, they took half of the program's limit, and the server's
/// `accept` failed with `EMFILE` at about 500 connections.
fn fd_limit(hosts: Hosts) {
    if !have("python3") {
        return;
    }
    const CONNECTIONS: usize = 1000;
    for carried in [false, true] {
        let Some(tb) = Testbed::of(hosts) else { return };
        let _one_at_a_time = one_at_a_time();
        let mut p = Pair::new(tb, &format!("fdlimit-{hosts:?}-{carried}"), carried, carried);
        p.server.soft_fd_limit = Some(1024);
        p.client.soft_fd_limit = Some(1024);
        let port = ports(1);
        let server_py = p.dir.join("server.py");
        std::fs::write(&server_py, SELECT_ECHO_PY).unwrap();
        let server = p.server.spawn(
            "python3",
            &[&server_py.display().to_string(), &p.server.addr, &port.to_string()],
        );
        p.server.wait_listening(port);
        let client = format!(
            "import resource, socket\n\
             socks = [socket.create_connection(('{}', {port}), timeout=10) \
             for i in range({CONNECTIONS})]\n\
             for i, s in enumerate(socks):\n\
             \x20   s.sendall(b'%08d' % i)\n\
             bad = sum(s.recv(8) != b'%08d' % i for i, s in enumerate(socks))\n\
             print('open', len(socks), 'failed', bad)\n",
            p.server.addr
        );
        let out = p.client.run("python3", &["-c", &client], T);
        server.stop();
        assert_eq!(
            out,
            format!("open {CONNECTIONS} failed 0\n"),
            "carried: {carried}\n{}",
            stats_text(&p.server.stats)
        );
        if carried {
            let direct = stat(&p.server.stats, "direct");
            assert_eq!(direct, CONNECTIONS as u64, "{}", stats_text(&p.server.stats));
        }
    }
}

/// A server killed (SIGKILL) with its connections open: the client reads what the server
/// sent before it died and then the end of the stream, as its kernel's FIN gives it, on a
/// connection where the server had read everything; and a reset on one where the server left
/// the client's bytes unread. Before, every carried connection was reset and the bytes the
/// server had sent were lost with it. (A connection whose few bytes the server had read is
/// still reset where the kernel gives end-of-stream: the engine hears of a read only every
/// quarter window; see `Stream::end_with_peer`.)
fn peer_killed(hosts: Hosts) {
    if !have("python3") {
        return;
    }
    let Some(outputs) = kernel_then_carried(hosts, "killed", |p, carried| {
        // The probe goes to a second listener, opened after the first: a probe of the first
        // would be the first connection the server accepts.
        let port = ports(2);
        let server_py = p.dir.join("server.py");
        std::fs::write(
            &server_py,
            "import socket, sys, time\n\
             l = socket.socket()\n\
             l.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n\
             l.bind((sys.argv[1], int(sys.argv[2])))\n\
             l.listen()\n\
             ready = socket.create_server((sys.argv[1], int(sys.argv[2]) + 1))\n\
             answered, _ = l.accept()\n\
             answered.sendall(b'last words')\n\
             unread, _ = l.accept()\n\
             time.sleep(600)\n",
        )
        .unwrap();
        let server = p.server.spawn(
            "python3",
            &[&server_py.display().to_string(), &p.server.addr, &port.to_string()],
        );
        p.server.wait_listening(port + 1);
        let (ready, killed) = (p.dir.join("ready"), p.dir.join("killed"));
        let client = format!(
            "import os, socket, time\n\
             answered = socket.create_connection(('{addr}', {port}))\n\
             time.sleep(0.2)\n\
             unread = socket.create_connection(('{addr}', {port}))\n\
             unread.sendall(b'never read')\n\
             time.sleep(1)\n\
             open('{ready}', 'w').close()\n\
             while not os.path.exists('{killed}'):\n\
             \x20   time.sleep(0.05)\n\
             time.sleep(0.5)\n\
             for name, c in (('answered', answered), ('unread', unread)):\n\
             \x20   got = []\n\
             \x20   try:\n\
             \x20       while True:\n\
             \x20           d = c.recv(100)\n\
             \x20           got.append(d)\n\
             \x20           if not d:\n\
             \x20               break\n\
             \x20       print(name, got)\n\
             \x20   except OSError as e:\n\
             \x20       print(name, got, 'then', e.strerror)\n",
            addr = p.server.addr,
            ready = ready.display(),
            killed = killed.display(),
        );
        let side = p.client.clone();
        let run = std::thread::spawn(move || side.run("python3", &["-c", &client], T));
        let deadline = Instant::now() + Duration::from_secs(30);
        while !ready.exists() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        drop(server); // SIGKILL to its process group
        std::fs::write(&killed, b"").unwrap();
        let out = run.join().expect("client");
        if carried {
            let carried = stat(&p.client.stats, "virtual sockets");
            assert_eq!(carried, 2, "{}", stats_text(&p.client.stats));
        }
        out
    }) else {
        return;
    };
    assert_eq!(
        outputs[0], "answered [b'last words', b'']\nunread [] then Connection reset by peer\n",
        "kernel TCP"
    );
    assert_eq!(outputs[1], outputs[0], "carried differs from kernel TCP");
}

/// A server process stopped (SIGSTOP) for three times the engine's `ack_timeout`, once while
/// its client waits for an echo and once while the client fills every window, then continued:
/// kernel TCP keeps the connection and so must the engine (its peer's kernel still answers).
/// Before, the connection was reset after `ack_timeout` (or by `TCP_USER_TIMEOUT`'s
/// zero-window abort).
fn stopped_peer(hosts: Hosts) {
    if !have("python3") {
        return;
    }
    let Some(outputs) = kernel_then_carried(hosts, "stopped", |mut p, carried| {
        if carried {
            for side in [&mut p.client, &mut p.server] {
                side.run_options.extend(["--ack-timeout-ms", "1000"].map(String::from));
            }
        }
        let port = ports(2);
        let server = p.server.spawn(
            "python3",
            &[
                "-c",
                "import socket, sys\n\
                 l = socket.create_server((sys.argv[1], int(sys.argv[2])))\n\
                 ready = socket.create_server((sys.argv[1], int(sys.argv[2]) + 1))\n\
                 c, _ = l.accept()\n\
                 while True:\n\
                 \x20   d = c.recv(65536)\n\
                 \x20   if not d:\n\
                 \x20       break\n\
                 \x20   c.sendall(d)\n",
                &p.server.addr,
                &port.to_string(),
            ],
        );
        p.server.wait_listening(port + 1);
        let (ready, stopped) = (p.dir.join("ready"), p.dir.join("stopped"));
        let client = format!(
            "import os, socket, threading, time\n\
             c = socket.create_connection(('{addr}', {port}))\n\
             def echo(n):\n\
             \x20   got = []\n\
             \x20   def read():\n\
             \x20       k = 0\n\
             \x20       while k < n:\n\
             \x20           d = c.recv(65536)\n\
             \x20           if not d:\n\
             \x20               break\n\
             \x20           k += len(d)\n\
             \x20       got.append(k)\n\
             \x20   t = threading.Thread(target=read)\n\
             \x20   t.start()\n\
             \x20   c.sendall(b'x' * n)\n\
             \x20   t.join()\n\
             \x20   return got[0]\n\
             def stop(name):\n\
             \x20   open('{ready}' + name, 'w').close()\n\
             \x20   while not os.path.exists('{stopped}' + name):\n\
             \x20       time.sleep(0.01)\n\
             try:\n\
             \x20   print('warm', sum(echo(1000) for _ in range(10)))\n\
             \x20   stop('1')\n\
             \x20   print('an echo across a stop', echo(1000))\n\
             \x20   stop('2')\n\
             \x20   print('every window filled across a stop', echo(32 << 20))\n\
             \x20   print('after', echo(1000))\n\
             except OSError as e:\n\
             \x20   print('failed:', e.strerror)\n",
            addr = p.server.addr,
            ready = ready.display(),
            stopped = stopped.display(),
        );
        let side = p.client.clone();
        let run = std::thread::spawn(move || side.run("python3", &["-c", &client], T));
        let group = -(server.0.id() as i32);
        for round in ["1", "2"] {
            let ready = p.dir.join(format!("ready{round}"));
            let deadline = Instant::now() + Duration::from_secs(30);
            while !ready.exists() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(10));
            }
            // SAFETY: signalling the server's own process group, which this test started.
            unsafe { libc::kill(group, libc::SIGSTOP) };
            std::fs::write(p.dir.join(format!("stopped{round}")), b"").unwrap();
            // Three ack timeouts: the client's engine looks at its channels at least twice.
            std::thread::sleep(Duration::from_millis(3500));
            // SAFETY: as above.
            unsafe { libc::kill(group, libc::SIGCONT) };
        }
        let out = run.join().expect("client");
        if carried {
            let carried = stat(&p.client.stats, "virtual sockets");
            assert_eq!(carried, 1, "{}", stats_text(&p.client.stats));
        }
        drop(server);
        out
    }) else {
        return;
    };
    assert_eq!(
        outputs[0],
        "warm 10000\nan echo across a stop 1000\nevery window filled across a stop 33554432\n\
         after 1000\n",
        "kernel TCP"
    );
    assert_eq!(outputs[1], outputs[0], "carried differs from kernel TCP");
}

/// `TcpExt: ListenOverflows` of the namespace `ns` (`/proc/net/netstat`): SYNs its kernel
/// listeners dropped because their accept queue was full.
fn listen_overflows(ns: &str) -> u64 {
    let out = std::process::Command::new("ip")
        .args(["netns", "exec", ns, "cat", "/proc/net/netstat"])
        .output()
        .expect("ip netns exec");
    let text = String::from_utf8_lossy(&out.stdout);
    let mut rows = text.lines().filter(|l| l.starts_with("TcpExt:"));
    let (keys, values) = (rows.next().unwrap_or(""), rows.next().unwrap_or(""));
    keys.split_whitespace()
        .zip(values.split_whitespace())
        .find(|(k, _)| *k == "ListenOverflows")
        .and_then(|(_, v)| v.parse().ok())
        .expect("ListenOverflows in /proc/net/netstat")
}

/// A server with a small backlog (Python's `socketserver`: 5) and a burst of clients that
/// connect, are answered and closed, 40 at a time: every one is served, and between the
/// namespaces the server's kernel listener never overflows. The library's acceptor injects no
/// more connections than the program's listener queues; before, it overflowed it, and each
/// dropped SYN held the acceptor a second (`http.server` under `wrk -c 8`: 6 requests a second).
fn small_backlog_burst(hosts: Hosts) {
    if !have("python3") {
        return;
    }
    let Some(tb) = Testbed::of(hosts) else { return };
    let _one_at_a_time = one_at_a_time();
    let p = Pair::new(tb, &format!("backlog-{hosts:?}"), true, true);
    let port = ports(1);
    let server_py = p.dir.join("server.py");
    std::fs::write(
        &server_py,
        "import signal, socketserver, sys\n\
         signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\n\
         class Echo(socketserver.BaseRequestHandler):\n\
         \x20   def handle(self):\n\
         \x20       self.request.sendall(self.request.recv(100))\n\
         class Server(socketserver.ThreadingTCPServer):\n\
         \x20   allow_reuse_address = True\n\
         \x20   daemon_threads = True\n\
         Server((sys.argv[1], int(sys.argv[2])), Echo).serve_forever()\n",
    )
    .unwrap();
    let server = p
        .server
        .spawn("python3", &[&server_py.display().to_string(), &p.server.addr, &port.to_string()]);
    p.server.wait_listening(port);
    let before = p.server.netns.as_deref().map(listen_overflows);
    let client = format!(
        "import socket, threading\n\
         bad = []\n\
         def work(k):\n\
         \x20   for i in range(10):\n\
         \x20       msg = b'%d-%d' % (k, i)\n\
         \x20       try:\n\
         \x20           s = socket.create_connection(('{}', {port}), timeout=20)\n\
         \x20           s.sendall(msg)\n\
         \x20           got = s.recv(100)\n\
         \x20           s.close()\n\
         \x20       except OSError as e:\n\
         \x20           got = repr(e)\n\
         \x20       if got != msg:\n\
         \x20           bad.append((k, i, got))\n\
         ts = [threading.Thread(target=work, args=(k,)) for k in range(40)]\n\
         [t.start() for t in ts]\n\
         [t.join() for t in ts]\n\
         print('failed', len(bad), bad[:5])\n",
        p.server.addr
    );
    let out = p.client.run("python3", &["-c", &client], T);
    let after = p.server.netns.as_deref().map(listen_overflows);
    server.stop();
    assert_eq!(out, "failed 0 []\n", "{}", stats_text(&p.server.stats));
    assert_eq!(stat(&p.server.stats, "direct"), 400, "{}", stats_text(&p.server.stats));
    assert_eq!(after, before, "the server's kernel listener overflowed");
}

/// A server bound to 127.0.0.1 is reached on that address only, as on kernel TCP: not from
/// another host through the host's own address, nor through another loopback address. Before,
/// the engine listened on the virtual port whatever the program had bound, and a server meant
/// for local clients answered other hosts.
fn bound_listener(hosts: Hosts) {
    if !have("python3") {
        return;
    }
    let Some(outputs) = kernel_then_carried(hosts, "bound", |p, _| {
        let port = ports(1);
        let server = p.server.spawn(
            "python3",
            &[
                "-c",
                "import socket, sys\n\
                 l = socket.create_server(('127.0.0.1', int(sys.argv[1])))\n\
                 while True:\n\
                 \x20   c, _ = l.accept()\n\
                 \x20   c.sendall(b'local only')\n\
                 \x20   c.close()\n",
                &port.to_string(),
            ],
        );
        // Reached from outside: the server's address between the namespaces, another loopback
        // address on loopback (both hosts are this one there).
        let outside =
            if p.server.netns.is_some() { p.server.addr.clone() } else { "127.0.0.3".into() };
        let connect = |to: &str| {
            format!(
                "import socket, time\n\
                 for attempt in range(50):\n\
                 \x20   try:\n\
                 \x20       s = socket.create_connection(('{to}', {port}), timeout=5)\n\
                 \x20       print('{to}:', s.recv(100))\n\
                 \x20       break\n\
                 \x20   except ConnectionRefusedError as e:\n\
                 \x20       if '{to}' != '127.0.0.1':\n\
                 \x20           print('{to}:', e.strerror)\n\
                 \x20           break\n\
                 \x20       time.sleep(0.1)\n"
            )
        };
        // First on the server's host, at the bound address (waits until the server listens).
        let mut out = p.server.run("python3", &["-c", &connect("127.0.0.1")], T);
        out += &p.client.run("python3", &["-c", &connect(&outside)], T);
        drop(server);
        out.replace(&outside, "OUTSIDE")
    }) else {
        return;
    };
    assert_eq!(outputs[0], "127.0.0.1: b'local only'\nOUTSIDE: Connection refused\n", "kernel TCP");
    assert_eq!(outputs[1], outputs[0], "carried differs from kernel TCP");
}

/// An event-loop server that answers and closes at once, its client's request unread (as Redis
/// refuses a client in protected mode: write the error, close): the client reads the whole
/// answer, then `ECONNRESET`, as on kernel TCP. The library had
/// dropped the answer (its write waited for the loop's next wait, and the close reset first),
/// and a reset sent on one channel could overtake the answer on another: most clients got
/// `ECONNRESET` and no byte.
fn answer_then_close(hosts: Hosts) {
    if !have("python3") {
        return;
    }
    let server_py = "import select, socket, sys\n\
         l = socket.create_server(('0.0.0.0', int(sys.argv[1])), backlog=128)\n\
         l.setblocking(False)\n\
         ep = select.epoll()\n\
         ep.register(l.fileno(), select.EPOLLIN)\n\
         while True:\n\
         \x20   for fd, _ in ep.poll():\n\
         \x20       try:\n\
         \x20           c, _ = l.accept()\n\
         \x20       except BlockingIOError:\n\
         \x20           continue\n\
         \x20       c.setblocking(False)\n\
         \x20       ep.register(c.fileno(), select.EPOLLIN)\n\
         \x20       select.select([c], [], [], 10)\n\
         \x20       c.send(b'E' * 500)\n\
         \x20       ep.unregister(c.fileno())\n\
         \x20       c.close()\n";
    let Some(outputs) = kernel_then_carried(hosts, "answer-then-close", |p, _| {
        let port = ports(1);
        let server = p.server.spawn("python3", &["-c", server_py, &port.to_string()]);
        p.server.wait_listening(port);
        let client = format!(
            "import socket, time\n\
             full = reset = 0\n\
             for i in range(200):\n\
             \x20   s = socket.create_connection(('{}', {port}), timeout=10)\n\
             \x20   s.sendall(b'u')\n\
             \x20   got = b''\n\
             \x20   try:\n\
             \x20       while True:\n\
             \x20           b = s.recv(4096)\n\
             \x20           if not b: break\n\
             \x20           got += b\n\
             \x20   except ConnectionResetError:\n\
             \x20       reset += 1\n\
             \x20   full += len(got) == 500\n\
             \x20   s.close()\n\
             print('read the whole answer:', full, 'of 200; then reset:', reset)\n",
            p.server.addr
        );
        let out = p.client.run("python3", &["-c", &client], T);
        server.stop();
        out
    }) else {
        return;
    };
    assert_eq!(outputs[0], "read the whole answer: 200 of 200; then reset: 200\n", "kernel TCP");
    assert_eq!(outputs[1], outputs[0], "carried differs from kernel TCP");
}

/// A client that writes and exits at once, with `exit` or `_exit`, its socket closed first or
/// left to the exit: the server, which reads only half a second later, reads every byte and the
/// end of stream, as from kernel TCP (whose exit leaves the socket's queue to the kernel; a
/// socket left open is detached from Python's object, so that the exit, not Python, ends it). The
/// client also holds a second connection with bytes unread, so that its exit resets that one
/// and the channels it shared. The library had lost the bytes still in the stream's send
/// buffer or in a channel the exit reset, and the server read a reset after 0.2-1.9 MB. Then
/// the server answers the gone client twice: TCP takes the first answer (the client's kernel
/// resets it) and fails the second with `EPIPE`; the library failed the first at once, which
/// killed a server that does not ignore `SIGPIPE`.
fn bytes_written_before_exit_arrive(hosts: Hosts) {
    if !have("python3") {
        return;
    }
    let server_py = "import socket, sys, threading, time\n\
         l = socket.create_server(('0.0.0.0', int(sys.argv[1])), backlog=8)\n\
         def chatter(c):\n\
         \x20   try:\n\
         \x20       while True:\n\
         \x20           c.sendall(b'y' * 1000)\n\
         \x20           time.sleep(0.0005)\n\
         \x20   except OSError:\n\
         \x20       pass\n\
         while True:\n\
         \x20   a, _ = l.accept()\n\
         \x20   tag = a.recv(1)\n\
         \x20   if tag == b'B':\n\
         \x20       threading.Thread(target=chatter, args=(a,), daemon=True).start()\n\
         \x20   if tag != b'A':\n\
         \x20       continue\n\
         \x20   time.sleep(0.5)\n\
         \x20   n, end = 0, 'end of stream'\n\
         \x20   try:\n\
         \x20       while d := a.recv(65536):\n\
         \x20           n += len(d)\n\
         \x20   except ConnectionResetError:\n\
         \x20       end = 'reset'\n\
         \x20   answers = []\n\
         \x20   for wait in (0.3, 0.2):\n\
         \x20       time.sleep(wait)\n\
         \x20       try:\n\
         \x20           a.send(b'late')\n\
         \x20           answers.append('sent')\n\
         \x20       except OSError as e:\n\
         \x20           answers.append(type(e).__name__)\n\
         \x20   with open(sys.argv[2], 'a') as f:\n\
         \x20       f.write(f'{n} bytes, then {end}; answers after it: {answers}\\n')\n\
         \x20   a.close()\n";
    let Some(outputs) = kernel_then_carried(hosts, "bytes-before-exit", |p, _| {
        let port = ports(1);
        let results = p.dir.join("results");
        let server = p.server.spawn(
            "python3",
            &["-c", server_py, &port.to_string(), &results.display().to_string()],
        );
        p.server.wait_listening(port);
        let mut out = String::new();
        for (closed, exit) in
            [(true, "sys.exit"), (false, "sys.exit"), (true, "os._exit"), (false, "os._exit")]
        {
            let client = format!(
                "import os, socket, sys, time\n\
                 b = socket.create_connection(('{addr}', {port}))\n\
                 b.sendall(b'B')\n\
                 time.sleep(0.05)\n\
                 a = socket.create_connection(('{addr}', {port}))\n\
                 a.sendall(b'A' + b'x' * 3000000)\n\
                 a.close() if {closed} else a.detach()\n\
                 {exit}(0)\n",
                addr = p.server.addr,
                closed = if closed { "True" } else { "False" },
            );
            p.client.run("python3", &["-c", &client], T);
            let deadline = Instant::now() + Duration::from_secs(10);
            let line = loop {
                let text = std::fs::read_to_string(&results).unwrap_or_default();
                if let Some(l) = text.lines().nth(out.lines().count()) {
                    break l.to_string();
                }
                assert!(Instant::now() < deadline, "the server reported nothing: {out}");
                std::thread::sleep(Duration::from_millis(50));
            };
            out += &format!("{} and {exit}: {line}\n", if closed { "closed" } else { "open" });
        }
        server.stop();
        out
    }) else {
        return;
    };
    let expected: String =
        ["closed and sys.exit", "open and sys.exit", "closed and os._exit", "open and os._exit"]
            .map(|case| {
                format!(
                    "{case}: 3000000 bytes, then end of stream; answers after it: \
                 ['sent', 'BrokenPipeError']\n"
                )
            })
            .concat();
    assert_eq!(outputs[0], expected, "kernel TCP");
    assert_eq!(outputs[1], outputs[0], "carried differs from kernel TCP");
}

/// A host whose channel port drops packets costs the dial timeout (250 ms) once for the
/// processes of a host, not once per process and port: the first to find the silence tells
/// the others (`hints`), for every port of that host. Here the destination is an address of the namespaces' link that no host holds, so
/// nothing answers at all; each process makes one non-blocking connect there and says how long
/// the call took (kernel TCP: no time, `EINPROGRESS` at once). Each process used to wait 250 ms.
fn a_silent_host_costs_one_dial_per_host(hosts: Hosts) {
    if !have("python3") || matches!(hosts, Hosts::Loopback) {
        return; // on loopback every address answers
    }
    let Some(tb) = Testbed::of(hosts) else { return };
    let _one_at_a_time = one_at_a_time();
    let p = Pair::new(tb, "silent-host", true, true);
    let (net, _) = p.server.addr.rsplit_once('.').unwrap();
    // An address nobody holds, another each run (a run's silence is remembered for a while).
    let nobody = 100 + std::process::id() % 150;
    let base = ports(4);
    let client = |port: u16| {
        format!(
            "import socket, time\n\
         s = socket.socket()\n\
         s.setblocking(False)\n\
         t = time.monotonic()\n\
         try:\n\
         \x20   s.connect(('{net}.{nobody}', {port}))\n\
         except BlockingIOError:\n\
         \x20   pass\n\
         print(round(time.monotonic() - t, 3))\n"
        )
    };
    // Each to another port: the silence is the host's channel port's, whatever the port.
    let waits: Vec<f64> = (0..4)
        .map(|i| p.client.run("python3", &["-c", &client(base + i)], T).trim().parse().unwrap())
        .collect();
    assert!(waits[0] >= 0.2, "the first process waits for the dial: {waits:?}");
    assert!(waits[1..].iter().all(|&w| w < 0.1), "the others do not: {waits:?}");
    assert!(stat(&p.client.stats, "kernel tcp") >= 4, "{}", stats_text(&p.client.stats));
}

/// Redis replication, both servers carried: a master in host B holding 20,000 keys, a replica
/// in host A that syncs them (diskless: the master's forked child streams the snapshot through
/// a pipe to the parent, which writes it to the replica's connection), then 5,000 writes more
/// over the replication stream. The replica ends with the master's keys and digest, as on
/// kernel TCP.
fn redis_replication(hosts: Hosts) {
    if !have("redis-server") || !have("redis-benchmark") {
        return;
    }
    let Some(outputs) = kernel_then_carried(hosts, "redis-replication", |p, _| {
        let (mport, rport) = (ports(1).to_string(), ports(1).to_string());
        let (mh, rh) = (p.server.addr.clone(), p.client.addr.clone());
        let dir = p.dir.display().to_string();
        let common = ["--protected-mode", "no", "--save", "", "--appendonly", "no", "--dir", &dir];
        let common = common.into_iter().chain(["--enable-debug-command", "yes"]);
        let master = p.server.spawn(
            "redis-server",
            &["--port", &mport, "--bind", &mh, "--repl-diskless-sync", "yes"]
                .into_iter()
                .chain(["--repl-diskless-sync-delay", "0", "--dbfilename", "m.rdb"])
                .chain(common.clone())
                .collect::<Vec<_>>(),
        );
        p.server.wait_listening(mport.parse().unwrap());
        let on = |side: &Side, h: &str, port: &str, args: &[&str]| {
            let mut a = vec!["-h", h, "-p", port, "--raw"];
            a.extend_from_slice(args);
            side.run("redis-cli", &a, T)
        };
        on(&p.server, &mh, &mport, &["debug", "populate", "20000", "key", "100"]);
        let replica = p.client.spawn(
            "redis-server",
            &["--port", &rport, "--bind", &rh, "--replicaof", &mh, &mport]
                .into_iter()
                .chain(["--dbfilename", "r.rdb"])
                .chain(common)
                .collect::<Vec<_>>(),
        );
        p.client.wait_listening(rport.parse().unwrap());
        let synced = |want: &str| {
            let deadline = Instant::now() + Duration::from_secs(30);
            loop {
                let info = on(&p.client, &rh, &rport, &["info", "replication"]);
                if info.contains("master_link_status:up")
                    && on(&p.client, &rh, &rport, &["dbsize"]).trim() == want
                {
                    return;
                }
                assert!(Instant::now() < deadline, "replica not in sync: {info}");
                std::thread::sleep(Duration::from_millis(100));
            }
        };
        synced("20000");
        let out = p.client.run(
            "redis-benchmark",
            &["-h", &mh, "-p", &mport, "-t", "set", "-n", "5000", "-r", "1000000", "-q"],
            T,
        );
        assert!(out.contains("SET"), "{out}");
        let keys = on(&p.server, &mh, &mport, &["dbsize"]).trim().to_string();
        synced(&keys);
        let digest = on(&p.server, &mh, &mport, &["debug", "digest"]);
        assert_eq!(on(&p.client, &rh, &rport, &["debug", "digest"]), digest, "digests");
        replica.stop();
        master.stop();
        let grew = keys.parse::<u64>().unwrap() > 20000;
        format!("replica in sync with the master's keys, more than the first 20000: {grew}\n")
    }) else {
        return;
    };
    let want = "replica in sync with the master's keys, more than the first 20000: true\n";
    assert_eq!(outputs[0], want, "kernel TCP");
    assert_eq!(outputs[1], outputs[0], "carried differs from kernel TCP");
}

/// A Python server's first lines: `take(l)` accepts on `l` until a connection says "g" (the
/// harness's `wait_listening` connects too, and says nothing).
const TAKE_G: &str = "def take(l):\n\
     \x20   while True:\n\
     \x20       c, _ = l.accept()\n\
     \x20       if c.recv(1) == b'g': return c\n\
     \x20       c.close()\n";

/// Runs the Python `script` (after `TAKE_G`, with the port as its argument) on the server side
/// and waits until it listens; with `piped`, its stdout and stderr are kept for the test.
fn python_server(p: &Pair, script: &str, port: u16, piped: bool) -> std::process::Child {
    let out = || if piped { std::process::Stdio::piped() } else { std::process::Stdio::null() };
    let child = p
        .server
        .command("python3", &["-c", &format!("{TAKE_G}{script}"), &port.to_string()])
        .stdin(std::process::Stdio::null())
        .stdout(out())
        .stderr(out())
        .spawn()
        .expect("python3");
    p.server.wait_listening(port);
    child
}

/// A server accepts, forks, and closes its copy; the child takes the connection over, and the
/// parent exits while the child still uses it. Kernel TCP keeps the connection for the child;
/// under netchannel it ends with the parent, whose engine and relay carried it
/// (docs/ARCHITECTURE.md, "Limits"), and the parent says so on stderr. (The server takes the
/// connection that says "g": `wait_listening` connects too.)
fn owner_exit_under_a_child_is_reported(hosts: Hosts) {
    if !have("python3") {
        return;
    }
    let Some(tb) = Testbed::of(hosts) else { return };
    let _one_at_a_time = one_at_a_time();
    let p = Pair::new(tb, &format!("owner-exit-{hosts:?}"), true, true);
    let port = ports(1);
    let server_py = "import os, socket, sys, time\n\
         l = socket.create_server(('0.0.0.0', int(sys.argv[1])))\n\
         c = take(l)\n\
         if os.fork() == 0:\n\
         \x20   l.close()\n\
         \x20   c.sendall(b'from the child')\n\
         \x20   time.sleep(2)\n\
         \x20   os._exit(0)\n\
         c.close()\n\
         time.sleep(1)\n";
    let server = python_server(&p, server_py, port, true);
    let client = format!(
        "import socket\n\
         s = socket.create_connection(('{}', {port}), timeout=10)\n\
         s.sendall(b'g')\n\
         got = b''\n\
         while len(got) < 14:\n\
         \x20   got += s.recv(14 - len(got))\n\
         print(got.decode())\n",
        p.server.addr
    );
    let out = p.client.run("python3", &["-c", &client], T);
    assert_eq!(out, "from the child\n");
    let server = server.wait_with_output().expect("server output");
    let stderr = String::from_utf8_lossy(&server.stderr);
    assert!(
        stderr.contains("exits while another process uses 1 connection(s) it carries"),
        "stderr: {stderr}\n{}",
        stats_text(&p.server.stats)
    );
}

/// A server answers, forks a child that closes its copies and stays, and is killed (SIGKILL).
/// On kernel TCP the client reads the end of its connection at once; under netchannel the
/// killed engine's channels must end too, though the child inherited them (they used to stay
/// open in the child, and the client waited for the child's exit). The engine cannot send a
/// FIN for a connection when it is killed: the client reads the end or a reset.
fn killed_owner_leaves_its_channels_to_no_child(hosts: Hosts) {
    if !have("python3") {
        return;
    }
    let Some(tb) = Testbed::of(hosts) else { return };
    let _one_at_a_time = one_at_a_time();
    let p = Pair::new(tb, &format!("killed-owner-{hosts:?}"), true, true);
    let port = ports(1);
    // The child stays until 15 s after the parent's death, well past the client's wait.
    let server_py = "import os, signal, socket, sys, time\n\
         l = socket.create_server(('0.0.0.0', int(sys.argv[1])))\n\
         c = take(l)\n\
         parent = os.getpid()\n\
         if os.fork() == 0:\n\
         \x20   c.close(); l.close()\n\
         \x20   while os.getppid() == parent: time.sleep(0.1)\n\
         \x20   time.sleep(15)\n\
         \x20   os._exit(0)\n\
         c.sendall(b'hello')\n\
         c.recv(1)\n\
         os.kill(parent, signal.SIGKILL)\n";
    let mut server = python_server(&p, server_py, port, false);
    let client = format!(
        "import socket\n\
         s = socket.create_connection(('{}', {port}), timeout=10)\n\
         s.sendall(b'g')\n\
         got = b''\n\
         while len(got) < 5:\n\
         \x20   got += s.recv(5 - len(got))\n\
         s.sendall(b'k')\n\
         try:\n\
         \x20   end = 'end' if s.recv(1) == b'' else 'more'\n\
         except ConnectionResetError:\n\
         \x20   end = 'end'\n\
         except TimeoutError:\n\
         \x20   end = 'still open after 10 s'\n\
         print(got.decode(), end)\n",
        p.server.addr
    );
    let out = p.client.run("python3", &["-c", &client], T);
    let _ = server.wait();
    assert_eq!(out, "hello end\n", "{}", stats_text(&p.server.stats));
}

/// A server forks a child per connection: the first child waits on its connection while the
/// second holds its own. The client resets the first (`SO_LINGER` 0): the first child reads
/// the reset at once on kernel TCP. Under netchannel both children use the relay, and the
/// second used to inherit the relay's end of the first connection: the relay's reset then
/// waited for the second child's exit.
fn reset_reaches_a_forked_child_beside_its_sibling(hosts: Hosts) {
    if !have("python3") {
        return;
    }
    let Some(tb) = Testbed::of(hosts) else { return };
    let _one_at_a_time = one_at_a_time();
    let p = Pair::new(tb, &format!("sibling-reset-{hosts:?}"), true, true);
    let port = ports(1);
    let server_py = "import os, signal, socket, sys, time\n\
         l = socket.create_server(('0.0.0.0', int(sys.argv[1])))\n\
         a = take(l)\n\
         first = os.fork()\n\
         if first == 0:\n\
         \x20   l.close(); a.sendall(b'r')\n\
         \x20   a.recv(1)\n\
         \x20   t = time.time()\n\
         \x20   try:\n\
         \x20       end = 'eof' if a.recv(1) == b'' else 'data'\n\
         \x20   except ConnectionResetError:\n\
         \x20       end = 'reset'\n\
         \x20   print(end, 'late' if time.time() - t > 10 else 'at once', flush=True)\n\
         \x20   os._exit(0)\n\
         a.close()\n\
         b = take(l)\n\
         second = os.fork()\n\
         if second == 0:\n\
         \x20   l.close(); b.sendall(b'r'); time.sleep(20); os._exit(0)\n\
         b.close()\n\
         os.waitpid(first, 0)\n\
         os.kill(second, signal.SIGKILL)\n\
         os.waitpid(second, 0)\n";
    let server = python_server(&p, server_py, port, true);
    let client = format!(
        "import socket, struct, time\n\
         a = socket.create_connection(('{0}', {port}), timeout=30)\n\
         a.sendall(b'g'); a.recv(1)\n\
         b = socket.create_connection(('{0}', {port}), timeout=30)\n\
         b.sendall(b'g'); b.recv(1)\n\
         a.sendall(b't')\n\
         a.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack('ii', 1, 0))\n\
         a.close()\n\
         time.sleep(1)\n",
        p.server.addr
    );
    p.client.run("python3", &["-c", &client], T);
    let server = server.wait_with_output().expect("server output");
    assert_eq!(
        String::from_utf8_lossy(&server.stdout),
        "reset at once\n",
        "stderr: {}\n{}",
        String::from_utf8_lossy(&server.stderr),
        stats_text(&p.server.stats)
    );
}

crate::both_testbeds!(
    redis,
    iperf3,
    fallback,
    sockperf,
    memcached,
    nginx,
    conformance,
    process_rounds,
    preshared_key,
    postgres,
    haproxy,
    node,
    java,
    dual_stack_listener,
    connection_churn,
    reuseport_listeners,
    forking_server_on_the_wildcard,
    daemon_forked_after_listen_frees_the_channel_port,
    answer_then_close,
    bytes_written_before_exit_arrive,
    a_silent_host_costs_one_dial_per_host,
    public_destinations_are_left_to_kernel_tcp,
    fd_limit,
    peer_killed,
    stopped_peer,
    small_backlog_burst,
    bound_listener,
    owner_exit_under_a_child_is_reported,
    killed_owner_leaves_its_channels_to_no_child,
    reset_reaches_a_forked_child_beside_its_sibling,
    redis_replication
);

/// The launcher names what it cannot carry instead of running it on kernel TCP.
#[test]
fn refuses_static_and_setuid() {
    let dir = std::env::temp_dir().join(format!("ncpre-refuse-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let suid = dir.join("true-suid");
    std::fs::copy("/bin/true", &suid).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&suid, std::fs::Permissions::from_mode(0o4755)).unwrap();
    let out =
        std::process::Command::new(NETCHANNEL).args(["run", "--"]).arg(&suid).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("setuid"), "{out:?}");

    let src = dir.join("s.c");
    std::fs::write(&src, "int main(void) { return 0; }\n").unwrap();
    let bin = dir.join("static");
    let built =
        std::process::Command::new("cc").arg("-static").arg("-o").arg(&bin).arg(&src).status();
    if built.is_ok_and(|s| s.success()) {
        let out =
            std::process::Command::new(NETCHANNEL).args(["run", "--"]).arg(&bin).output().unwrap();
        assert_eq!(out.status.code(), Some(2));
        assert!(String::from_utf8_lossy(&out.stderr).contains("statically linked"), "{out:?}");
    }
    // A dynamically linked Go program: its runtime makes socket calls by raw system call. A
    // copy of true with the section every Go binary has stands in for one.
    let go = dir.join("go-program");
    let note = dir.join("buildinfo");
    std::fs::write(&note, b"\xff Go buildinf:").unwrap();
    let mut section = std::ffi::OsString::from(".go.buildinfo=");
    section.push(&note);
    let made = std::process::Command::new("objcopy")
        .arg("--add-section")
        .arg(section)
        .arg("/bin/true")
        .arg(&go)
        .status();
    if made.is_ok_and(|s| s.success()) {
        let out =
            std::process::Command::new(NETCHANNEL).args(["run", "--"]).arg(&go).output().unwrap();
        assert_eq!(out.status.code(), Some(2));
        assert!(String::from_utf8_lossy(&out.stderr).contains("Go program"), "{out:?}");
    }
    let out = std::process::Command::new(NETCHANNEL).args(["run", "--", "true"]).output().unwrap();
    assert!(out.status.success(), "{out:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--stats` prints a line for each process that used TCP, and none for the processes that
/// never did (a shell, or the helpers a wrapper script runs, printed a line of zeros each).
#[test]
fn stats_lines_come_from_the_processes_that_used_tcp() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    // bash runs `/bin/true` (a process that never touches TCP), then connects itself.
    let script = format!("/bin/true; exec 3<>/dev/tcp/127.0.0.1/{port}; echo hello >&3");
    let out = std::process::Command::new(NETCHANNEL)
        .args(["run", "--stats", "--", "bash", "-c", &script])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let (mut peer, _) = listener.accept().unwrap();
    let mut got = String::new();
    std::io::Read::read_to_string(&mut peer, &mut got).unwrap();
    assert_eq!(got, "hello\n");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<&str> = stderr.lines().filter(|l| l.starts_with("netchannel: pid")).collect();
    assert_eq!(lines.len(), 1, "one line, from bash alone:\n{stderr}");
    assert!(lines[0].contains("kernel tcp 1 "), "{stderr}");
}

/// What cannot be run at all exits as a shell would: 127 for a command that is not there, 126
/// for a file that is not executable; a non-executable file earlier in PATH is skipped; the
/// program keeps the name it was given. A stats file that cannot be written is an error at once.
#[test]
fn exits_as_a_shell_does_when_the_command_cannot_run() {
    let dir = std::env::temp_dir().join(format!("ncpre-notrun-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let run = |args: &[&str], path: Option<&std::path::Path>| {
        let mut c = std::process::Command::new(NETCHANNEL);
        c.arg("run").arg("--").args(args);
        if let Some(p) = path {
            c.env("PATH", p);
        }
        c.output().unwrap()
    };
    let missing = dir.join("missing");
    let out = run(&[missing.to_str().unwrap()], None);
    assert_eq!(out.status.code(), Some(127), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("No such file"), "{out:?}");
    let out = run(&["no-such-command-anywhere"], None);
    assert_eq!(out.status.code(), Some(127), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("command not found"), "{out:?}");

    let plain = dir.join("plain");
    std::fs::write(&plain, "#!/bin/sh\nexit 0\n").unwrap();
    let out = run(&[plain.to_str().unwrap()], None);
    assert_eq!(out.status.code(), Some(126), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("Permission denied"), "{out:?}");
    let out = run(&[dir.to_str().unwrap()], None);
    assert_eq!(out.status.code(), Some(126), "{out:?}");

    // PATH: the non-executable `sh` in `dir` comes first and is passed over.
    std::fs::copy(&plain, dir.join("sh")).unwrap();
    let path = std::env::join_paths([dir.clone(), "/usr/bin".into(), "/bin".into()]).unwrap();
    let out = run(&["sh", "-c", "echo $0; exit 7"], Some(std::path::Path::new(&path)));
    assert_eq!(out.status.code(), Some(7), "{out:?}");
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "sh", "argv[0] as given");

    // A stats file the summary could not reach is an error before the program runs.
    let unreachable = dir.join("no-such-dir").join("stats");
    let out = std::process::Command::new(NETCHANNEL)
        .args(["run", "--stats-file"])
        .arg(&unreachable)
        .args(["--", "true"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("stats file"), "{out:?}");

    // An option netchannel does not know, before the command, is a usage error (not a command
    // named "--bogus"); after the command, options are the program's.
    let out = std::process::Command::new(NETCHANNEL).args(["run", "--bogus", "true"]).output();
    let out = out.unwrap();
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("unexpected argument"), "{out:?}");
    let out = std::process::Command::new(NETCHANNEL)
        .args(["run", "echo", "-n", "--bogus"])
        .output()
        .unwrap();
    assert_eq!((out.status.code(), &out.stdout[..]), (Some(0), &b"--bogus"[..]), "{out:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A program linked with liburing is refused (its io_uring sockets would bypass netchannel)
/// unless `--allow-io-uring`; one that sets up io_uring by system call is reported at exit.
#[test]
fn reports_io_uring() {
    if !have("cc") {
        return;
    }
    let dir = std::env::temp_dir().join(format!("ncpre-uring-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cc = |args: &[&str]| {
        let ok = std::process::Command::new("cc").current_dir(&dir).args(args).status();
        assert!(ok.is_ok_and(|s| s.success()), "cc {args:?}");
    };
    // A stand-in liburing: the launcher goes by the dependency, not by what is called.
    std::fs::write(dir.join("empty.c"), "int liburing_stand_in;\n").unwrap();
    cc(&["-shared", "-fPIC", "-Wl,-soname,liburing.so.2", "-o", "liburing.so.2", "empty.c"]);
    std::fs::write(dir.join("main.c"), "int main(void) { return 0; }\n").unwrap();
    cc(&["-o", "linked", "main.c", "-Wl,--no-as-needed", "./liburing.so.2"]);
    let run = |args: &[&str]| {
        std::process::Command::new(NETCHANNEL)
            .args(args)
            .env("LD_LIBRARY_PATH", &dir)
            .current_dir(&dir)
            .output()
            .unwrap()
    };
    let out = run(&["run", "--", "./linked"]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("liburing"), "{out:?}");
    let out = run(&["run", "--allow-io-uring", "--", "./linked"]);
    assert!(out.status.success(), "{out:?}");
    // Asked once, of the program the launcher started: a script under `netchannel run` may exec
    // (same pid) a launcher that allows it, or a program linked with liburing.
    let nested = format!("exec {NETCHANNEL} run --allow-io-uring -- ./linked");
    let out = run(&["run", "--", "sh", "-c", &nested]);
    assert!(out.status.success(), "{out:?}");
    let out = run(&["run", "--", "sh", "-c", "exec ./linked"]);
    assert!(out.status.success(), "{out:?}");

    std::fs::write(
        dir.join("ring.c"),
        r#"#include <stdio.h>
#include <string.h>
#include <linux/io_uring.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>
int main(void) {
    struct io_uring_params p;
    memset(&p, 0, sizeof p);
    long fd = syscall(__NR_io_uring_setup, 4, &p);
    /* A ring is used through its mapped queues, as liburing maps them. */
    void *sq = fd < 0 ? MAP_FAILED
        : mmap(0, p.sq_off.array + p.sq_entries * sizeof(unsigned), PROT_READ | PROT_WRITE,
               MAP_SHARED | MAP_POPULATE, fd, IORING_OFF_SQ_RING);
    puts(sq != MAP_FAILED ? "ring" : "no ring");
    return 0; /* the ring stays open until exit */
}
"#,
    )
    .unwrap();
    cc(&["-o", "ring", "ring.c"]);
    let out = run(&["run", "--stats", "--", "./ring"]);
    assert!(out.status.success(), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    if String::from_utf8_lossy(&out.stdout).trim() == "ring" {
        assert!(stderr.contains("holds 1 io_uring instance"), "{stderr}");
        assert!(stderr.contains("io_uring instances 1"), "{stderr}");
    } else {
        eprintln!("skipping the ring check: io_uring is disabled in this kernel");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// tests/c/conform.c, compiled into the pair's folder; its path.
fn build_conform(p: &Pair) -> String {
    let bin = p.dir.join("conform");
    let src = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/c/conform.c");
    let ok = std::process::Command::new("cc").args(["-O1", "-o"]).arg(&bin).arg(src).status();
    assert!(ok.is_ok_and(|s| s.success()), "cc conform.c");
    bin.display().to_string()
}

/// Many rounds of two ways one connection passes between processes, each beside a CPU hog (the
/// hangs below showed only on a loaded machine):
/// - a server whose accepting thread forks a child per connection and closes its copy at once
///   (PostgreSQL's postmaster, inetd). With `--relay-forked` every round's connections are
///   carried and each child takes its connection over. Each fork finds the server's other
///   threads (its other acceptors, the engine's, the attach thread) anywhere, holding or
///   waiting for any of the library's locks. Before 2026-11-29 a child hung here about once in
///   ten rounds: a parent thread had waited for a table's lock at the fork, and the child's copy
///   of that lock went to the waiter, which the child does not have. Each round reads the first
///   connection's end of stream while the second child still serves: that child, forked while
///   the attach thread held the first child's end, kept a copy, and the end never came.
/// - a client that lends its connection to a program started by `posix_spawn` (as stdin and
///   stdout), or to a forked child, waits for it to exit, then sends a request itself. Before
///   2026-11-29 nearly every run of 100 rounds beside a hog lost one answer: the owner's attach
///   thread still held a copy of the child's end after the child's exit, and the relay wrote
///   the answer into it.
/// - a connection passed by `SCM_RIGHTS` to an exec'd child, the sender's copy closed at once.
fn process_rounds(hosts: Hosts) {
    if !have("cc") {
        return;
    }
    const ROUNDS: usize = 40;
    let Some(outputs) = kernel_then_carried(hosts, "rounds", |mut p, carried| {
        for side in [&mut p.server, &mut p.client] {
            side.run_options.push("--relay-forked".into());
        }
        let bin = build_conform(&p);
        let port = ports(4);
        let _server = p.server.spawn(&bin, &["server", &port.to_string()]);
        p.server.wait_listening(port);
        p.server.wait_listening(port + 2);
        let (port, rounds) = (port.to_string(), ROUNDS.to_string());
        let mut out = String::new();
        for kind in ["fork", "spawn", "child", "scm"] {
            let _hog = CpuHog::start();
            out += &p.client.run(&bin, &["rounds", kind, &p.server.addr, &port, &rounds], T);
        }
        if carried {
            let text = stats_text(&p.client.stats);
            assert_eq!(stat(&p.client.stats, "virtual sockets"), 5 * ROUNDS as u64, "{text}");
            assert_eq!(stat(&p.client.stats, "inherited"), 3 * ROUNDS as u64, "{text}");
        }
        out
    }) else {
        return;
    };
    assert_eq!(
        outputs[0],
        format!(
            "forkserver: echo one1 two2 eof 0 0\nrounds {ROUNDS}, all alike=1\n\
             posix_spawn child echoing through stdin/stdout: spawn=0 exit=0\n\
             \x20 parent after the spawned child: afta\nrounds {ROUNDS}, all alike=1\n\
             forked child echoing: exit=0\n\
             \x20 parent after the child exited: prnt\nrounds {ROUNDS}, all alike=1\n\
             SCM_RIGHTS to an exec'd child, sender closed its copy: exit=0\n\
             rounds {ROUNDS}, all alike=1\n"
        ),
        "kernel TCP"
    );
    assert_eq!(outputs[1], outputs[0], "carried");
}

/// A process that keeps one core busy until dropped.
struct CpuHog(std::process::Child);

impl CpuHog {
    fn start() -> CpuHog {
        let child = std::process::Command::new("sh")
            .args(["-c", "while :; do :; done"])
            .spawn()
            .expect("sh");
        CpuHog(child)
    }
}

impl Drop for CpuHog {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// tests/c/conform.c (non-blocking connect and SO_ERROR, FIONREAD, MSG_PEEK, LT/ET/one-shot
/// and nested epoll, select at fd 1000, fork-then-close, EPOLLRDHUP, partial writes to EAGAIN,
/// refused connect, UDP and DNS; accept4 flags with a connection accepted in one thread and
/// served in another, writev/readv, sendmsg/recvmsg, ppoll/pselect, dup/dup3, getsockname,
/// TCP_INFO, EINTR, a carried fd used after exec, shutdown of the write half, SIGPIPE; an edge
/// per arrival, one-shot re-armed, EPOLLEXCLUSIVE, one fd in two epoll sets, a registration kept
/// by a dup, an epoll fd in poll and select, poll/select over a socket, a pipe and a UDP
/// socket; poll/epoll masks, recv, SO_ERROR and send after the peer's FIN and after its RST;
/// SO_RCVTIMEO, SO_SNDTIMEO, MSG_WAITALL and SA_RESTART against signals; SO_RCVTIMEO and
/// TCP_NODELAY set before connect; SHUT_RD, also waking a
/// blocked reader; O_NONBLOCK shared by dups; a full window's EPOLLOUT and POLLOUT waiters using no CPU;
/// sendfile, splice both ways, IOV_MAX writev/readv; a forked child using the socket, a server
/// forking a child per connection, posix_spawn with the socket as stdin/stdout, SCM_RIGHTS to
/// an exec'd process; socket calls and a close made through libc's `syscall()`, as libuv makes
/// them, and a close made without libc; non-blocking connects to a listener that does not accept: `EINPROGRESS` at once,
/// unwritable, `ENOTCONN` and `EALREADY` until accepted) prints the same lines carried and on
/// kernel TCP.
///
/// `conform elide` runs one thread's level-triggered epoll loop over two connections in a
/// process of its own: the library reports their readability from the wait itself (the stats
/// must count such reports), then a second set, nesting and a fork end that, and every line
/// still matches kernel TCP.
///
/// `conform herd` blocks 8 threads in `poll` on idle connections while a ninth exchanges 1,000
/// messages on its own: they must wake fewer times than there are exchanges (kernel TCP: never).
/// Sleeping beside the engine's epoll set, in a ppoll on its fd, they had woken for every
/// channel event (about 8,000 times), an exclusive wake-up not counting for them.
///
/// `conform scm-nolib` passes a connection over SCM_RIGHTS to a process started without the
/// library (`env -u LD_PRELOAD`). It runs on kernel TCP only: what it prints there is the
/// contract, but a carried connection handed to a process without the library is outside what
/// `netchannel run` promises (the relay happens to keep it working while the sender lives).
fn conformance(hosts: Hosts) {
    if !have("cc") {
        return;
    }
    let mut outputs = Vec::new();
    for carried in [false, true] {
        let Some(tb) = Testbed::of(hosts) else { return };
        let _one_at_a_time = one_at_a_time();
        let p = Pair::new(tb, &format!("conform-{hosts:?}-{carried}"), carried, carried);
        let bin = build_conform(&p);
        // The server listens on port, port + 2 (forked children) and port + 3 (accepting
        // only when told, so never probed: it listens before port does); port + 1 stays
        // closed.
        let port = ports(4);
        let server = p.server.spawn(&bin, &["server", &port.to_string()]);
        p.server.wait_listening(port);
        p.server.wait_listening(port + 2);
        if !carried {
            let nolib = p.client.run(&bin, &["scm-nolib", &p.server.addr, &port.to_string()], T);
            assert_eq!(
                nolib,
                "  receiver: echo recv eof 0\nSCM_RIGHTS to a process without the library: exit=0\n"
            );
        }
        // First, in a process of its own: one thread's level-triggered epoll loop, whose
        // readability the library reports from the wait itself (elided) until something else
        // could see it.
        let mut out = p.client.run(&bin, &["elide", &p.server.addr, &port.to_string()], T);
        if carried {
            assert!(stat(&p.client.stats, "elided") > 0, "{}", stats_text(&p.client.stats));
        }
        out += &p.client.run(&bin, &["herd", &p.server.addr, &port.to_string()], T);
        // Last: the client ends the server ('q').
        out += &p.client.run(&bin, &["client", &p.server.addr, &port.to_string()], T);
        drop(server);
        if p.server.netns.is_some() {
            // An on-link address nobody answers: the SYN (and the engine's dial) go unanswered.
            let silent =
                p.server.addr.rsplit_once('.').map(|(net, _)| format!("{net}.99")).unwrap();
            out += &p.client.run(&bin, &["unreachable", &silent, &port.to_string()], T);
        }
        if carried {
            // conform's calls through syscall() were served as the named calls, and its
            // non-blocking connects to a destination carried before went on in the background.
            assert!(stat(&p.client.stats, "raw syscalls") > 0, "{}", stats_text(&p.client.stats));
            assert!(stat(&p.client.stats, "closed unseen") > 0, "{}", stats_text(&p.client.stats));
            assert!(stat(&p.client.stats, "in progress") > 0, "{}", stats_text(&p.client.stats));
            assert!(
                stat(&p.client.stats, "virtual sockets") >= 3,
                "{}",
                stats_text(&p.client.stats)
            );
        }
        outputs.push(out);
    }
    assert!(!outputs[0].contains("FAIL"), "{}", outputs[0]);
    let differ: Vec<String> = outputs[0]
        .lines()
        .zip(outputs[1].lines())
        .filter(|(k, c)| k != c)
        .map(|(k, c)| format!("kernel:  {k}\ncarried: {c}"))
        .collect();
    assert!(
        outputs[0] == outputs[1],
        "carried output differs from kernel TCP:\n{}\ncarried output:\n{}",
        differ.join("\n"),
        outputs[1]
    );
}
