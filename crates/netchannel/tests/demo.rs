//! The README's demo runs end to end and reports every workload for both stacks (what it
//! measures is not checked here: speed is for benchmarks, never for tests).

use std::process::Command;

#[test]
fn the_demo_reports_every_workload_with_a_ratio() {
    let dir = std::env::temp_dir().join(format!("nc-demo-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join("demo.json");
    let out = Command::new(env!("CARGO_BIN_EXE_nc-demo"))
        .args(["--quick", "--json"])
        .arg(&json)
        .output()
        .expect("nc-demo runs");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}\n{}", String::from_utf8_lossy(&out.stderr));
    for metric in [
        "one stream, 1 MiB writes",
        "one stream, 64 B writes",
        "100 RPC flows, 4 KiB",
        "100 RPC flows, p99",
        "4 KiB ping-pong, p50",
        "4 KiB ping-pong, p99",
    ] {
        let row = text
            .lines()
            .find(|l| l.starts_with(metric))
            .unwrap_or_else(|| panic!("no row for {metric}:\n{text}"));
        let ratio: f64 = row
            .split_whitespace()
            .last()
            .and_then(|r| r.parse().ok())
            .unwrap_or_else(|| panic!("no ratio in {row:?}"));
        assert!(ratio.is_finite() && ratio > 0.0, "{row}");
        assert!(
            text.lines().any(|l| l.trim_start().starts_with(&format!("{metric}: netchannel"))),
            "no summary line for {metric}:\n{text}"
        );
    }
    let doc = std::fs::read_to_string(&json).unwrap();
    assert!(doc.contains("\"metrics\":[") && doc.matches("\"ratio\":").count() == 6, "{doc}");
    let _ = std::fs::remove_dir_all(&dir);
}
