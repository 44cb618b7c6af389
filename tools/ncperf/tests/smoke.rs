//! One-second smoke runs of every workload on both stacks through the real binary, and the
//! clear errors for impossible combinations. Namespaces when root (CI), loopback otherwise.

use std::process::Command;

use serde_json::Value;

fn hosts() -> &'static str {
    if rustix::process::geteuid().is_root() {
        "netns"
    } else {
        "loopback"
    }
}

fn ncperf(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_ncperf")).args(args).output().expect("run ncperf")
}

fn run_json(extra: &[&str]) -> Value {
    run_json_for("1", extra)
}

fn run_json_for(duration: &str, extra: &[&str]) -> Value {
    let mut args =
        vec!["run", "--duration", duration, "--warmup", "0.2", "--json", "--hosts", hosts()];
    args.extend_from_slice(extra);
    let out = ncperf(&args);
    assert!(
        out.status.success(),
        "ncperf {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    serde_json::from_str(text.lines().last().unwrap()).unwrap()
}

fn check_common(v: &Value, stack: &str, workload: &str) {
    for key in [
        "stack",
        "workload",
        "pattern",
        "flows",
        "size",
        "duration_s",
        "warmup_s",
        "goodput_gbps",
        "rps",
        "latency_us",
        "cpu_cores",
        "client_cpu_cores",
        "server_cpu_cores",
        "gbps_per_core",
    ] {
        assert!(v.get(key).is_some(), "missing {key} in {v}");
    }
    assert_eq!(v["stack"], stack);
    assert_eq!(v["workload"], workload);
    assert!(v["goodput_gbps"].as_f64().unwrap() > 0.0, "{v}");
    let cpu = v["cpu_cores"].as_f64().unwrap();
    assert!(cpu >= 0.0, "{v}");
    // /proc/stat counts 10 ms ticks: a light open-loop run may use less than one in its window.
    let per_core = if cpu > 0.0 { v["goodput_gbps"].as_f64().unwrap() / cpu } else { 0.0 };
    assert!((v["gbps_per_core"].as_f64().unwrap() - per_core).abs() < 1e-9);
}

#[test]
fn every_workload_on_both_stacks() {
    for stack in ["linux", "netchannel"] {
        let v = run_json(&["--stack", stack, "--workload", "stream", "--size", "65536"]);
        check_common(&v, stack, "stream");
        assert!(v["cpu_cores"].as_f64().unwrap() > 0.0, "a saturating stream is busy: {v}");
        assert!(v["latency_us"].is_null());

        let v = run_json(&[
            "--stack",
            stack,
            "--workload",
            "rr",
            "--size",
            "4096",
            "--pattern",
            "incast",
            "--flows",
            "4",
        ]);
        check_common(&v, stack, "rr");
        assert!(v["rps"].as_f64().unwrap() > 0.0);
        let lat = &v["latency_us"];
        let (p50, p99, max) = (
            lat["p50"].as_f64().unwrap(),
            lat["p99"].as_f64().unwrap(),
            lat["max"].as_f64().unwrap(),
        );
        assert!(0.0 < p50 && p50 <= p99 && p99 <= max, "{lat}");

        let v =
            run_json(&["--stack", stack, "--workload", "rr", "--size", "1024", "--rate", "500"]);
        check_common(&v, stack, "rr");
        // Open loop: about 500 requests per second, never more than scheduled.
        let rps = v["rps"].as_f64().unwrap();
        assert!(rps > 100.0 && rps < 560.0, "open-loop rate {rps}");

        let v = run_json(&[
            "--stack",
            stack,
            "--workload",
            "mixed",
            "--latency-flows",
            "1",
            "--throughput-flows",
            "2",
        ]);
        check_common(&v, stack, "mixed");
        assert!(v["latency_us"]["p50"].as_f64().unwrap() > 0.0);

        // The L-apps and the T-apps in separate process pairs (own engines): both measured.
        let v = run_json(&[
            "--stack",
            stack,
            "--workload",
            "mixed",
            "--latency-flows",
            "2",
            "--throughput-flows",
            "2",
            "--split-processes",
        ]);
        check_common(&v, stack, "mixed");
        assert_eq!(v["processes"].as_u64(), Some(2));
        assert!(v["latency_us"]["p50"].as_f64().unwrap() > 0.0);
        assert!(v["goodput_gbps"].as_f64().unwrap() > 0.0);

        // L-apps alone (the baseline of an isolation run): latency, no T goodput to speak of.
        let v = run_json(&[
            "--stack",
            stack,
            "--workload",
            "mixed",
            "--latency-flows",
            "1",
            "--throughput-flows",
            "0",
        ]);
        assert!(v["latency_us"]["p50"].as_f64().unwrap() > 0.0);
    }
}

/// The stream multiplexers (yamux, quinn, h2) through the same orchestration: bytes move,
/// latency is recorded, the JSON has every field and names the stack, and the set-up costs
/// (quinn's certificate and handshake) are reported.
#[test]
fn multiplexer_stacks_move_bytes_and_record_latency() {
    for stack in ["yamux", "quinn", "h2"] {
        let v = run_json_for("0.3", &["--stack", stack, "--workload", "stream", "--size", "65536"]);
        check_common(&v, stack, "stream");
        assert!(v["latency_us"].is_null());
        assert_eq!(v["mux_connections"].as_u64(), Some(1), "{v}");
        assert!(v["first_connect_ms"].as_f64().unwrap() > 0.0, "{v}");
        assert!(v["open_ms"].as_f64().unwrap() >= v["first_connect_ms"].as_f64().unwrap());
        assert_eq!(v["cert_gen_ms"].is_null(), stack != "quinn", "{v}");

        let v = run_json_for(
            "0.3",
            &[
                "--stack",
                stack,
                "--workload",
                "rr",
                "--size",
                "4096",
                "--pattern",
                "incast",
                "--flows",
                "4",
                "--mux-connections",
                "2",
            ],
        );
        check_common(&v, stack, "rr");
        assert!(v["rps"].as_f64().unwrap() > 0.0 && v["rpcs"].as_u64().unwrap() > 0, "{v}");
        let lat = &v["latency_us"];
        let (p50, max) = (lat["p50"].as_f64().unwrap(), lat["max"].as_f64().unwrap());
        assert!(0.0 < p50 && p50 <= max, "{lat}");

        // L and T streams sharing the connections: both measured.
        let v = run_json_for(
            "0.3",
            &[
                "--stack",
                stack,
                "--workload",
                "mixed",
                "--latency-flows",
                "1",
                "--throughput-flows",
                "2",
            ],
        );
        check_common(&v, stack, "mixed");
        assert!(v["latency_us"]["p50"].as_f64().unwrap() > 0.0, "{v}");
    }
}

/// compare --with adds the multiplexers' medians and ratios and keeps the two-stack fields.
#[test]
fn compare_with_interleaves_more_stacks() {
    let out = ncperf(&[
        "compare",
        "--repetitions",
        "1",
        "--duration",
        "0.3",
        "--warmup",
        "0.1",
        "--json",
        "--hosts",
        hosts(),
        "--workload",
        "rr",
        "--size",
        "4096",
        "--with",
        "yamux,quinn",
    ]);
    assert!(out.status.success(), "compare failed: {}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    let v: Value = serde_json::from_str(text.lines().last().unwrap()).unwrap();
    for key in ["linux", "netchannel", "ratio"] {
        assert!(v[key]["rps"].as_f64().unwrap() > 0.0, "{key}: {v}");
    }
    for stack in ["linux", "netchannel", "yamux", "quinn"] {
        assert!(v["medians"][stack]["latency_us.p50"].as_f64().unwrap() > 0.0, "{stack}: {v}");
    }
    assert!(v["ratios"]["linux"].is_null());
    for stack in ["netchannel", "yamux", "quinn"] {
        assert!(v["ratios"][stack]["rps"].as_f64().unwrap() > 0.0, "{stack}: {v}");
    }
    let stacks: Vec<&str> =
        v["runs"].as_array().unwrap().iter().map(|r| r["stack"].as_str().unwrap()).collect();
    assert_eq!(stacks, ["linux", "netchannel", "yamux", "quinn"]);
}

#[test]
fn impossible_combinations_are_clear_errors() {
    for (args, needle) in [
        (
            &["run", "--stack", "linux", "--pattern", "single", "--flows", "2"][..],
            "single pattern is one flow",
        ),
        (
            &["run", "--stack", "linux", "--rate", "10"][..],
            "--rate applies to the rr workload and to mixed",
        ),
        (&["run", "--stack", "netchannel", "--workload", "mixed"][..], "--latency-flows"),
        (
            &["run", "--stack", "netchannel", "--flows", "2000000", "--pattern", "incast"][..],
            "exceeds",
        ),
        (&["run", "--stack", "linux", "--size", "0"][..], "--size"),
        (&["run", "--stack", "linux", "--split-processes"][..], "--split-processes"),
        (&["run", "--stack", "yamux", "--mux-connections", "0"][..], "--mux-connections"),
        (&["compare", "--with", "linux"][..], "--with"),
    ] {
        let out = ncperf(args);
        assert!(!out.status.success(), "{args:?} should fail");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(needle), "{args:?}: {err}");
    }
}

#[test]
fn profile_classifies_a_run_where_perf_works() {
    let perf = Command::new("perf").arg("--version").output();
    if !matches!(perf, Ok(ref o) if o.status.success()) || !rustix::process::geteuid().is_root() {
        eprintln!("skipping: perf or root unavailable");
        return;
    }
    for stack in ["linux", "netchannel"] {
        let out = ncperf(&[
            "profile",
            "--stack",
            stack,
            "--workload",
            "stream",
            "--duration",
            "1",
            "--warmup",
            "0.2",
            "--json",
            "--hosts",
            hosts(),
        ]);
        assert!(out.status.success(), "profile failed: {}", String::from_utf8_lossy(&out.stderr));
        let text = String::from_utf8(out.stdout).unwrap();
        let v: Value = serde_json::from_str(text.lines().last().unwrap()).unwrap();
        let p = &v["profile"];
        assert!(p["samples"].as_u64().unwrap() > 100, "{p}");
        let unclassified = p["unclassified_pct"].as_f64().unwrap();
        assert!(
            unclassified < 5.0,
            "{stack}: {unclassified}% unclassified: {}",
            p["top_unclassified"]
        );
        let sum: f64 =
            p["categories"].as_object().unwrap().values().map(|x| x.as_f64().unwrap()).sum();
        assert!((sum + unclassified - 100.0).abs() < 0.01, "{p}");
        assert!(p["categories"]["data-copy"].as_f64().unwrap() > 0.0, "{p}");
    }
}

#[test]
fn missing_perf_is_a_clear_error() {
    let out = Command::new(env!("CARGO_BIN_EXE_ncperf"))
        .args(["profile", "--stack", "linux", "--duration", "1"])
        .env("PATH", "/nonexistent")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("perf not found") && err.contains("linux-perf"), "{err}");
}

/// With 64-byte writes a coalescing stack never says `WouldBlock`: the writer loop must still
/// see the end of the window (it once spun for good).
#[test]
fn tiny_writes_stop_on_time() {
    for stack in ["netchannel", "linux"] {
        let start = std::time::Instant::now();
        let v = run_json(&["--stack", stack, "--workload", "stream", "--size", "64"]);
        let took = start.elapsed();
        check_common(&v, stack, "stream");
        assert!(took < std::time::Duration::from_secs(30), "{stack}: a 1 s run took {took:?}");
    }
}
