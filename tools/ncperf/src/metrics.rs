//! Metric arithmetic: latency percentiles from HDR histograms, CPU accounting from /proc samples,
//! and the JSON result of one run (field names are a contract).

use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};

/// Latency percentiles in microseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Latency {
    pub p50: f64,
    pub p99: f64,
    pub p999: f64,
    pub max: f64,
}

/// One run, as printed with `--json`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct RunResult {
    pub stack: String,
    pub workload: String,
    pub pattern: String,
    pub flows: u64,
    pub size: u64,
    pub duration_s: f64,
    pub warmup_s: f64,
    pub goodput_gbps: f64,
    pub rps: f64,
    pub latency_us: Option<Latency>,
    pub cpu_cores: f64,
    pub client_cpu_cores: f64,
    pub server_cpu_cores: f64,
    pub gbps_per_core: f64,
    /// Resident memory each side's processes gained for their flows, per flow, between before
    /// the flows were opened and the start of the window (bytes; includes ncperf's own state).
    #[serde(default)]
    pub client_rss_per_flow: Option<f64>,
    #[serde(default)]
    pub server_rss_per_flow: Option<f64>,
    pub hosts: String,
    pub channels: Option<usize>,
    pub policy: Option<String>,
    pub latency_flows: Option<u64>,
    pub throughput_flows: Option<u64>,
    /// Client/server process pairs used (more than one when the open-file limit requires).
    pub processes: usize,
    /// Completed RPCs measured (rr and mixed).
    pub rpcs: u64,
    /// yamux, quinn, h2: connections per pair of sender and receiver apps.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mux_connections: Option<usize>,
    /// quinn: generating the server's self-signed certificate and TLS config (ms).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cert_gen_ms: Option<f64>,
    /// yamux, quinn, h2: the client's first connection, made alone: TCP connect (yamux), plus
    /// writing the HTTP/2 preface (h2, which awaits no reply), or the QUIC and TLS 1.3
    /// handshake (quinn) (ms).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_connect_ms: Option<f64>,
    /// yamux, quinn, h2: from the client's start until every connection and stream was open
    /// (ms; the slowest client process).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub open_ms: Option<f64>,
    /// quinn: UDP segments per send (GSO) and per receive (GRO) the kernel offers quinn-udp.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub udp_offload: Option<(usize, usize)>,
    /// Open file descriptors the server processes gained for their flows, per flow.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server_fds_per_flow: Option<f64>,
    /// netchannel with `--peers`: client engines (peers of the server).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peers: Option<usize>,
    /// netchannel: each client engine's first connect, a new peer's time until it can send
    /// (its first channel's handshake and the stream's open), in ms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub new_peer_connect_ms: Option<Latency>,
    /// (quantile, microseconds) points of the latency distribution, for CDF plots.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub latency_cdf: Vec<(f64, f64)>,
}

/// A latency histogram in microseconds (1 us .. 100 s, 3 significant digits).
pub fn new_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 100_000_000, 3).expect("valid bounds")
}

/// Histogram contents as (value, count) pairs, to move between processes as JSON.
pub fn histogram_to_pairs(h: &Histogram<u64>) -> Vec<(u64, u64)> {
    h.iter_recorded().map(|v| (v.value_iterated_to(), v.count_at_value())).collect()
}

pub fn histogram_from_pairs(pairs: &[(u64, u64)]) -> Histogram<u64> {
    let mut h = new_histogram();
    for &(v, n) in pairs {
        h.saturating_record_n(v, n);
    }
    h
}

pub fn percentiles(h: &Histogram<u64>) -> Option<Latency> {
    if h.is_empty() {
        return None;
    }
    Some(Latency {
        p50: h.value_at_quantile(0.50) as f64,
        p99: h.value_at_quantile(0.99) as f64,
        p999: h.value_at_quantile(0.999) as f64,
        max: h.max() as f64,
    })
}

/// Points of the latency CDF at fixed quantiles (denser toward the tail).
pub fn cdf_points(h: &Histogram<u64>) -> Vec<(f64, f64)> {
    if h.is_empty() {
        return Vec::new();
    }
    let mut qs: Vec<f64> = (1..100).map(|i| i as f64 / 100.0).collect();
    qs.extend([0.995, 0.999, 0.9999, 1.0]);
    qs.into_iter().map(|q| (q, h.value_at_quantile(q) as f64)).collect()
}

/// Machine-wide CPU time from the first line of /proc/stat, in clock ticks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CpuSample {
    pub busy: u64,
    pub total: u64,
}

/// Parses the aggregate `cpu` line of /proc/stat. Idle and iowait count as not busy; steal is
/// excluded from both (time the hypervisor took is not ours).
pub fn parse_proc_stat(text: &str) -> Option<CpuSample> {
    let line = text.lines().find(|l| l.starts_with("cpu "))?;
    let v: Vec<u64> = line.split_whitespace().skip(1).filter_map(|x| x.parse().ok()).collect();
    if v.len() < 4 {
        return None;
    }
    let field = |i: usize| v.get(i).copied().unwrap_or(0);
    // user nice system idle iowait irq softirq steal guest guest_nice
    let idle = field(3) + field(4);
    let busy = field(0) + field(1) + field(2) + field(5) + field(6);
    Some(CpuSample { busy, total: busy + idle })
}

/// utime + stime of a process from /proc/PID/stat, in clock ticks. The command name (field 2)
/// may contain spaces and parentheses, so fields are counted after the last ')'.
pub fn parse_pid_stat(text: &str) -> Option<u64> {
    let rest = &text[text.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // After ')': state is field 3 overall, so utime (14) and stime (15) are at 11 and 12.
    let utime: u64 = f.get(11)?.parse().ok()?;
    let stime: u64 = f.get(12)?.parse().ok()?;
    Some(utime + stime)
}

pub fn clock_ticks_per_second() -> f64 {
    match rustix::param::clock_ticks_per_second() {
        0 => 100.0,
        t => t as f64,
    }
}

pub fn read_machine_cpu() -> Option<CpuSample> {
    parse_proc_stat(&std::fs::read_to_string("/proc/stat").ok()?)
}

/// utime + stime of a process and, when it has exited, nothing (None).
pub fn read_process_ticks(pid: u32) -> Option<u64> {
    parse_pid_stat(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

/// Busy cores over a window: busy ticks / (ticks per second * seconds).
pub fn busy_cores(ticks: u64, ticks_per_s: f64, seconds: f64) -> f64 {
    if seconds <= 0.0 {
        return 0.0;
    }
    ticks as f64 / ticks_per_s / seconds
}

/// Goodput in Gbit/s for `bytes` over `seconds`.
pub fn gbps(bytes: u64, seconds: f64) -> f64 {
    if seconds <= 0.0 {
        return 0.0;
    }
    bytes as f64 * 8.0 / seconds / 1e9
}

pub fn median(values: &[f64]) -> f64 {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.partial_cmp(b).expect("finite"));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_stat_busy_excludes_idle_iowait_and_steal() {
        let text = "cpu  100 5 50 1000 20 3 2 7 0 0\ncpu0 50 2 25 500 10 1 1 3 0 0\n";
        let s = parse_proc_stat(text).unwrap();
        assert_eq!(s.busy, 100 + 5 + 50 + 3 + 2);
        assert_eq!(s.total, s.busy + 1000 + 20);
        assert_eq!(parse_proc_stat("intr 1 2 3"), None);
    }

    #[test]
    fn pid_stat_handles_names_with_spaces_and_parens() {
        let text = "4242 (my (weird) proc) S 1 4242 4242 0 -1 4194560 100 0 0 0 37 13 0 0 20 0 \
                    4 0 12345 1000000 100 18446744073709551615";
        assert_eq!(parse_pid_stat(text), Some(50));
        assert_eq!(parse_pid_stat("garbage"), None);
    }

    #[test]
    fn busy_cores_and_goodput_arithmetic() {
        // 300 ticks at 100 Hz over 2 s = 1.5 cores.
        assert!((busy_cores(300, 100.0, 2.0) - 1.5).abs() < 1e-12);
        assert!((gbps(1_250_000_000, 1.0) - 10.0).abs() < 1e-12);
        assert_eq!(gbps(1, 0.0), 0.0);
    }

    #[test]
    fn percentiles_of_a_known_distribution() {
        let mut h = new_histogram();
        for v in 1..=1000u64 {
            h.record(v).unwrap();
        }
        let p = percentiles(&h).unwrap();
        assert!((p.p50 - 500.0).abs() <= 1.0, "{p:?}");
        assert!((p.p99 - 990.0).abs() <= 1.0, "{p:?}");
        assert!((p.p999 - 999.0).abs() <= 1.0, "{p:?}");
        assert_eq!(p.max, 1000.0);
        assert!(percentiles(&new_histogram()).is_none());
    }

    #[test]
    fn histograms_survive_the_trip_between_processes() {
        let mut a = new_histogram();
        for v in [3u64, 3, 17, 250_000] {
            a.record(v).unwrap();
        }
        let b = histogram_from_pairs(&histogram_to_pairs(&a));
        assert_eq!(b.len(), 4);
        assert_eq!(percentiles(&a), percentiles(&b));
    }

    #[test]
    fn median_ignores_nan_and_averages_even_counts() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert_eq!(median(&[f64::NAN, 5.0]), 5.0);
        assert!(median(&[]).is_nan());
    }
}
