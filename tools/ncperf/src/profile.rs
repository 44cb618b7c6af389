//! `ncperf profile`: where the CPU goes, by the studies' taxonomy, on current kernels.
//!
//! Runs an `ncperf run` workload under `perf record -e cpu-clock -a -g` for exactly the
//! measured window, then classifies every sample with the rules in `profile-rules.txt` (a data
//! file: symbol patterns plus call-chain conditions) and prints a breakdown machine-wide and per
//! side: client processes, server processes, kernel work in softirq context, everything else.
//! Idle samples are excluded and reported apart.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use regex::Regex;
use serde::Serialize;

use crate::net::Stack;
use crate::orchestrate::WindowEvent;
use crate::RunArgs;

/// The rules shipped with ncperf; `--rules FILE` replaces them.
pub const DEFAULT_RULES: &str = include_str!("../profile-rules.txt");

const IDLE: &str = "idle";
const SOFTIRQ_FRAME: &str = r"^(handle_softirqs|__do_softirq|run_ksoftirqd|net_rx_action)$";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Match {
    Sym,
    Dso,
    Comm,
    User,
}

#[derive(Debug)]
struct Rule {
    category: String,
    kind: Match,
    pattern: Regex,
    under: Option<Regex>,
}

#[derive(Debug)]
pub struct Rules {
    rules: Vec<Rule>,
    softirq: Regex,
}

impl Rules {
    pub fn parse(text: &str) -> Result<Rules, String> {
        let mut rules = Vec::new();
        for (n, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let bad = |what: &str| format!("rules line {}: {what}: {line}", n + 1);
            let f: Vec<&str> = line.split_whitespace().collect();
            let (category, kind, pattern) = match f.as_slice() {
                [c, k, p, ..] => (c, k, p),
                _ => return Err(bad("expected CATEGORY MATCH REGEX [under REGEX]")),
            };
            let kind = match *kind {
                "sym" => Match::Sym,
                "dso" => Match::Dso,
                "comm" => Match::Comm,
                "user" => Match::User,
                _ => return Err(bad("MATCH must be sym, dso, comm or user")),
            };
            let under = match &f[3..] {
                [] => None,
                ["under", re] => Some(Regex::new(re).map_err(|e| bad(&e.to_string()))?),
                _ => return Err(bad("trailing text; expected 'under REGEX'")),
            };
            rules.push(Rule {
                category: category.to_string(),
                kind,
                pattern: Regex::new(pattern).map_err(|e| bad(&e.to_string()))?,
                under,
            });
        }
        Ok(Rules { rules, softirq: Regex::new(SOFTIRQ_FRAME).expect("valid") })
    }

    pub fn load(path: Option<&Path>) -> Result<Rules, String> {
        match path {
            None => Rules::parse(DEFAULT_RULES),
            Some(p) => Rules::parse(
                &std::fs::read_to_string(p).map_err(|e| format!("{}: {e}", p.display()))?,
            ),
        }
    }

    /// The category of a sample, or None if no rule reaches it.
    pub fn classify(&self, s: &Sample) -> Option<&str> {
        let leaf = s.frames.first()?;
        if !leaf.kernel {
            return self
                .rules
                .iter()
                .find(|r| match r.kind {
                    Match::Dso => r.pattern.is_match(&leaf.dso),
                    Match::Comm => r.pattern.is_match(&s.comm),
                    Match::User => r.pattern.is_match(&leaf.sym),
                    Match::Sym => false,
                })
                .map(|r| r.category.as_str());
        }
        for (depth, frame) in s.frames.iter().enumerate().take_while(|(_, f)| f.kernel) {
            let callers = &s.frames[depth + 1..];
            let hit = self.rules.iter().find(|r| {
                r.kind == Match::Sym
                    && r.pattern.is_match(&frame.sym)
                    && r.under.as_ref().is_none_or(|u| callers.iter().any(|c| u.is_match(&c.sym)))
            });
            if let Some(r) = hit {
                return Some(&r.category);
            }
        }
        None
    }

    fn in_softirq(&self, s: &Sample) -> bool {
        s.frames.iter().any(|f| f.kernel && self.softirq.is_match(&f.sym))
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    pub sym: String,
    pub dso: String,
    pub kernel: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sample {
    pub comm: String,
    pub pid: u32,
    /// Leaf first.
    pub frames: Vec<Frame>,
}

/// Parses `perf script -F comm,pid,tid,ip,sym,dso` output (with call chains). Lines starting
/// with '#' are comments (fixtures use them).
pub fn parse_perf_script(text: &str) -> Vec<Sample> {
    let mut samples = Vec::new();
    let mut cur: Option<Sample> = None;
    for line in text.lines() {
        if line.starts_with('#') {
            continue;
        }
        if line.trim().is_empty() {
            samples.extend(cur.take());
            continue;
        }
        if !line.starts_with(char::is_whitespace) {
            samples.extend(cur.take());
            // "COMM PID/TID" — COMM may contain spaces, so read from the end.
            let head = line.trim_end();
            let (comm, ids) = head.rsplit_once(' ').unwrap_or(("", head));
            let pid = ids.split('/').next().and_then(|p| p.parse().ok()).unwrap_or(0);
            cur = Some(Sample { comm: comm.trim().to_string(), pid, frames: Vec::new() });
            continue;
        }
        let Some(s) = cur.as_mut() else { continue };
        // "\t ADDR SYMBOL (DSO)" — SYMBOL may contain spaces (demangled Rust/C++).
        let body = line.trim();
        let Some((_, rest)) = body.split_once(' ') else { continue };
        let (sym, dso) = match rest.rfind(" (") {
            Some(i) if rest.ends_with(')') => (&rest[..i], &rest[i + 2..rest.len() - 1]),
            _ => (rest, ""),
        };
        let sym = match sym.rfind("+0x") {
            Some(i) => &sym[..i],
            None => sym,
        };
        let kernel = dso.starts_with('[') && dso != "[unknown]" && dso != "[vdso]";
        s.frames.push(Frame { sym: sym.trim().to_string(), dso: dso.to_string(), kernel });
    }
    samples.extend(cur);
    samples
}

/// Which part of the system a sample belongs to.
pub const SIDES: [&str; 4] = ["client", "server", "softirq", "other"];

/// Sample counts by side and category.
#[derive(Debug, Default, Clone)]
pub struct Breakdown {
    pub samples: u64,
    pub idle: u64,
    /// side -> category -> samples (non-idle). Unclassified samples use category "".
    pub counts: BTreeMap<&'static str, BTreeMap<String, u64>>,
    /// leaf symbol -> samples, for unclassified samples.
    pub unclassified: HashMap<String, u64>,
}

pub fn breakdown(
    samples: &[Sample],
    rules: &Rules,
    client: &HashSet<u32>,
    server: &HashSet<u32>,
) -> Breakdown {
    let mut b = Breakdown::default();
    for s in samples {
        b.samples += 1;
        let category = rules.classify(s);
        if category == Some(IDLE) {
            b.idle += 1;
            continue;
        }
        let side = if rules.in_softirq(s) {
            "softirq"
        } else if client.contains(&s.pid) {
            "client"
        } else if server.contains(&s.pid) {
            "server"
        } else {
            "other"
        };
        *b.counts
            .entry(side)
            .or_default()
            .entry(category.unwrap_or("").to_string())
            .or_default() += 1;
        if category.is_none() {
            let leaf = s.frames.first().map_or("[no frames]".to_string(), |f| f.sym.clone());
            *b.unclassified.entry(leaf).or_default() += 1;
        }
    }
    b
}

impl Breakdown {
    pub fn non_idle(&self) -> u64 {
        self.samples - self.idle
    }

    fn pct(&self, n: u64) -> f64 {
        if self.non_idle() == 0 {
            0.0
        } else {
            100.0 * n as f64 / self.non_idle() as f64
        }
    }

    /// Category -> samples over all sides (classified only).
    pub fn totals(&self) -> BTreeMap<String, u64> {
        let mut t = BTreeMap::new();
        for cats in self.counts.values() {
            for (c, n) in cats.iter().filter(|(c, _)| !c.is_empty()) {
                *t.entry(c.clone()).or_default() += n;
            }
        }
        t
    }

    pub fn unclassified_pct(&self) -> f64 {
        self.pct(self.unclassified.values().sum())
    }

    pub fn idle_pct(&self) -> f64 {
        if self.samples == 0 {
            0.0
        } else {
            100.0 * self.idle as f64 / self.samples as f64
        }
    }

    pub fn top_unclassified(&self, n: usize) -> Vec<(String, f64)> {
        let mut v: Vec<_> =
            self.unclassified.iter().map(|(s, c)| (s.clone(), self.pct(*c))).collect();
        v.sort_by(|a, b| b.1.partial_cmp(&a.1).expect("finite").then(a.0.cmp(&b.0)));
        v.truncate(n);
        v
    }

    pub fn report(&self, stack: &str) -> ProfileReport {
        let categories = self.totals().into_iter().map(|(c, n)| (c, self.pct(n))).collect();
        let sides = SIDES
            .iter()
            .map(|side| {
                let cats = self.counts.get(side).cloned().unwrap_or_default();
                let m: BTreeMap<String, f64> = cats
                    .into_iter()
                    .map(|(c, n)| {
                        (if c.is_empty() { "unclassified".into() } else { c }, self.pct(n))
                    })
                    .collect();
                (side.to_string(), m)
            })
            .collect();
        ProfileReport {
            stack: stack.into(),
            categories,
            unclassified_pct: self.unclassified_pct(),
            samples: self.samples,
            idle_pct: self.idle_pct(),
            sides,
            top_unclassified: self.top_unclassified(10),
        }
    }
}

/// The JSON form (`--json`): `categories {name: percent}`, `unclassified_pct`, `samples`,
/// `idle_pct`; percents are of non-idle samples.
#[derive(Debug, Serialize)]
pub struct ProfileReport {
    pub stack: String,
    pub categories: BTreeMap<String, f64>,
    pub unclassified_pct: f64,
    pub samples: u64,
    pub idle_pct: f64,
    /// side -> category -> percent of all non-idle samples (sides add up to the total).
    pub sides: BTreeMap<String, BTreeMap<String, f64>>,
    pub top_unclassified: Vec<(String, f64)>,
}

pub fn print_table(r: &ProfileReport) {
    let mut cats: Vec<&String> = r.categories.keys().collect();
    cats.sort_by(|a, b| r.categories[*b].partial_cmp(&r.categories[*a]).expect("finite"));
    println!(
        "{} — % of non-idle samples ({} samples, idle {:.1}% excluded)",
        r.stack, r.samples, r.idle_pct
    );
    print!("{:<20} {:>7}", "category", "all");
    for s in SIDES {
        print!(" {s:>8}");
    }
    println!();
    let cell =
        |side: &str, c: &str| r.sides.get(side).and_then(|m| m.get(c)).copied().unwrap_or(0.0);
    for c in cats {
        print!("{c:<20} {:>7.1}", r.categories[c]);
        for s in SIDES {
            print!(" {:>8.1}", cell(s, c));
        }
        println!();
    }
    print!("{:<20} {:>7.1}", "unclassified", r.unclassified_pct);
    for s in SIDES {
        print!(" {:>8.1}", cell(s, "unclassified"));
    }
    println!();
    let side_total = |s: &str| r.sides.get(s).map_or(0.0, |m| m.values().sum::<f64>());
    print!("{:<20} {:>7.1}", "side total", 100.0);
    for s in SIDES {
        print!(" {:>8.1}", side_total(s));
    }
    println!();
    if !r.top_unclassified.is_empty() {
        let top: Vec<String> =
            r.top_unclassified.iter().map(|(s, p)| format!("{s} {p:.2}%")).collect();
        println!("top unclassified: {}", top.join(", "));
    }
}

/// Fails with the fix when perf cannot sample the whole machine.
pub fn check_perf() -> Result<(), String> {
    let ok =
        Command::new("perf").arg("--version").stdout(Stdio::null()).stderr(Stdio::null()).status();
    if !matches!(ok, Ok(s) if s.success()) {
        return Err("perf not found: install Debian's linux-perf (scripts/setup.sh does)".into());
    }
    let root = rustix::process::geteuid().is_root();
    let paranoid: i32 = std::fs::read_to_string("/proc/sys/kernel/perf_event_paranoid")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(2);
    if !root && paranoid > 0 {
        return Err(format!(
            "kernel.perf_event_paranoid is {paranoid}: system-wide sampling needs root or \
             `sysctl -w kernel.perf_event_paranoid=0` (scripts/setup.sh sets it when run as root)"
        ));
    }
    Ok(())
}

/// Profiles one run of `stack`; returns the run's result and the breakdown. With `keep`, the
/// recording stays in that directory as `STACK.data`.
pub fn profile(
    args: &RunArgs,
    stack: Stack,
    rules: &Rules,
    keep: Option<&std::path::Path>,
) -> Result<(crate::metrics::RunResult, Breakdown), String> {
    check_perf()?;
    let dir = std::env::temp_dir().join(format!("ncperf-profile-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let data: PathBuf = dir.join(format!("{}.data", stack.name()));
    let (ctl, ack) = (dir.join("ctl"), dir.join("ack"));
    let mut recorder: Option<Recorder> = None;
    let mut pids = (HashSet::new(), HashSet::new());
    // perf starts disabled before the window is announced and is switched on and off exactly at
    // its edges: started at the window itself, on a saturated machine it got its CPU late and
    // recorded mostly the idle time after the workload.
    let mut hook = |event: WindowEvent<'_>| -> Result<(), String> {
        match event {
            WindowEvent::Ready { clients, servers } => {
                pids = (clients.iter().copied().collect(), servers.iter().copied().collect());
                recorder = Some(Recorder::start(&data, &ctl, &ack)?);
                Ok(())
            }
            WindowEvent::Start => recorder.as_mut().ok_or("perf not started")?.command("enable"),
            WindowEvent::End => recorder.as_mut().ok_or("perf not started")?.command("disable"),
        }
    };
    let result = crate::orchestrate::run_with(args, stack, Some(&mut hook));
    let recorder = recorder.ok_or("the run ended before its measurement window")?;
    let stopped = recorder.stop();
    let result = result?;
    stopped?;
    let script = Command::new("perf")
        .args(["script", "-F", "comm,pid,tid,ip,sym,dso", "-i"])
        .arg(&data)
        .output()
        .map_err(|e| format!("perf script: {e}"))?;
    if let Some(keep) = keep {
        std::fs::create_dir_all(keep).map_err(|e| format!("{}: {e}", keep.display()))?;
        let to = keep.join(format!("{}.data", stack.name()));
        std::fs::copy(&data, &to).map_err(|e| format!("keeping {}: {e}", to.display()))?;
    }
    let _ = std::fs::remove_dir_all(&dir);
    if !script.status.success() {
        return Err(format!(
            "perf script failed: {}",
            String::from_utf8_lossy(&script.stderr).trim()
        ));
    }
    let samples = parse_perf_script(&String::from_utf8_lossy(&script.stdout));
    if samples.is_empty() {
        return Err("perf recorded no samples".into());
    }
    Ok((result, breakdown(&samples, rules, &pids.0, &pids.1)))
}

/// A `perf record` controlled through its control fifos (`--control fifo:CTL,ACK`).
struct Recorder {
    child: std::process::Child,
    ctl: std::fs::File,
    ack: std::io::BufReader<std::fs::File>,
}

impl Recorder {
    fn start(data: &Path, ctl: &Path, ack: &Path) -> Result<Recorder, String> {
        for fifo in [ctl, ack] {
            let ok =
                Command::new("mkfifo").arg(fifo).status().map_err(|e| format!("mkfifo: {e}"))?;
            if !ok.success() {
                return Err(format!("mkfifo {} failed", fifo.display()));
            }
        }
        let control = format!("fifo:{},{}", ctl.display(), ack.display());
        let child = Command::new("perf")
            .args([
                "record",
                "-e",
                "cpu-clock",
                "-a",
                "-g",
                "-q",
                "-D",
                "-1",
                "--control",
                &control,
                "-o",
            ])
            .arg(data)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("cannot start perf record: {e}"))?;
        // Opening blocks until perf has opened its ends, i.e. is ready.
        let ctl = std::fs::OpenOptions::new()
            .write(true)
            .open(ctl)
            .map_err(|e| format!("perf control: {e}"))?;
        let ack = std::fs::File::open(ack).map_err(|e| format!("perf ack: {e}"))?;
        Ok(Recorder { child, ctl, ack: std::io::BufReader::new(ack) })
    }

    /// Sends `enable` or `disable` and waits for perf's acknowledgement.
    fn command(&mut self, cmd: &str) -> Result<(), String> {
        use std::io::{BufRead, Write};
        writeln!(self.ctl, "{cmd}").map_err(|e| format!("perf control: {e}"))?;
        let mut line = String::new();
        self.ack.read_line(&mut line).map_err(|e| format!("perf ack: {e}"))?;
        // perf writes "ack\n" with its C string terminator, so a NUL may lead the next line.
        let reply = line.trim_matches(|c: char| c == '\0' || c.is_whitespace());
        if reply != "ack" {
            return Err(format!("perf did not acknowledge '{cmd}' (got '{reply}')"));
        }
        Ok(())
    }

    fn stop(self) -> Result<(), String> {
        // Our own child, not reaped yet: its pid is still its own.
        if let Some(pid) = rustix::process::Pid::from_raw(self.child.id() as i32) {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::INT);
        }
        drop(self.ctl);
        let out = self.child.wait_with_output().map_err(|e| format!("perf record: {e}"))?;
        // perf exits 0 after SIGINT once its data is written; a failing exit code is an error.
        if !out.status.success() && out.status.code().is_some() {
            return Err(format!(
                "perf record failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        Ok(())
    }
}

/// Stacked bars of the category shares of each stack.
pub fn stacked_bars(path: &Path, reports: &[ProfileReport], title: &str) -> Result<(), String> {
    use plotters::prelude::*;
    let err = |e: &dyn std::fmt::Debug| format!("plot: {e:?}");
    let mut cats: Vec<String> = reports.iter().flat_map(|r| r.categories.keys().cloned()).collect();
    cats.sort();
    cats.dedup();
    cats.push("unclassified".into());
    let root = BitMapBackend::new(path, (900, 600)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let n = reports.len() as u32;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(20)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d((0u32..n).into_segmented(), 0f64..100.0)
        .map_err(|e| err(&e))?;
    let names: Vec<String> = reports.iter().map(|r| r.stack.clone()).collect();
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_label_formatter(&|x| match x {
            SegmentValue::CenterOf(i) => names.get(*i as usize).cloned().unwrap_or_default(),
            _ => String::new(),
        })
        .y_desc("% of non-idle samples")
        .draw()
        .map_err(|e| err(&e))?;
    for (ci, cat) in cats.iter().enumerate() {
        let color = Palette99::pick(ci).to_rgba();
        let bars: Vec<Rectangle<(SegmentValue<u32>, f64)>> = reports
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let share = |c: &String| {
                    if c == "unclassified" {
                        r.unclassified_pct
                    } else {
                        r.categories.get(c).copied().unwrap_or(0.0)
                    }
                };
                let below: f64 = cats[..ci].iter().map(share).sum();
                let x0 = SegmentValue::Exact(i as u32);
                let x1 = SegmentValue::Exact(i as u32 + 1);
                let mut bar =
                    Rectangle::new([(x0, below), (x1, below + share(cat))], color.filled());
                bar.set_margin(0, 0, 40, 40);
                bar
            })
            .collect();
        chart
            .draw_series(bars)
            .map_err(|e| err(&e))?
            .label(cat.clone())
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], color.filled()));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .border_style(BLACK)
        .background_style(WHITE.mix(0.9))
        .draw()
        .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(comm: &str, pid: u32, frames: &[(&str, bool)]) -> Sample {
        Sample {
            comm: comm.into(),
            pid,
            frames: frames
                .iter()
                .map(|(s, k)| Frame {
                    sym: s.to_string(),
                    dso: if *k { "[kernel.kallsyms]".into() } else { "/usr/bin/app".into() },
                    kernel: *k,
                })
                .collect(),
        }
    }

    #[test]
    fn parses_perf_script_with_spaces_in_names() {
        let text = "# client 10\nmy app 10/11 \n\tffffffff81b6ccb0 _copy_to_iter+0x10 ([kernel.kallsyms])\n\
                    \t          10a974 <T as core::fmt::Debug>::fmt (/opt/my app/bin)\n\n\
                    swapper 0/0 \n\tffffffff8100 pv_native_safe_halt ([kernel.kallsyms])\n";
        let s = parse_perf_script(text);
        assert_eq!(s.len(), 2);
        assert_eq!(s[0].comm, "my app");
        assert_eq!(s[0].pid, 10);
        assert_eq!(
            s[0].frames[0],
            Frame { sym: "_copy_to_iter".into(), dso: "[kernel.kallsyms]".into(), kernel: true }
        );
        assert_eq!(s[0].frames[1].sym, "<T as core::fmt::Debug>::fmt");
        assert_eq!(s[0].frames[1].dso, "/opt/my app/bin");
        assert!(!s[0].frames[1].kernel);
        assert_eq!(s[1].pid, 0);
    }

    #[test]
    fn call_chain_rules_decide_generic_leaves() {
        let r = Rules::load(None).unwrap();
        let wake = sample(
            "nc-channel",
            5,
            &[("_raw_spin_unlock_irq", true), ("eventfd_write", true), ("ksys_write", true)],
        );
        assert_eq!(r.classify(&wake), Some("scheduling"));
        let lock =
            sample("x", 5, &[("_raw_spin_unlock_irqrestore", true), ("tcp_write_xmit", true)]);
        assert_eq!(r.classify(&lock), Some("lock"));
        let copy = sample("x", 5, &[("_copy_from_iter", true), ("tcp_sendmsg_locked", true)]);
        assert_eq!(r.classify(&copy), Some("data-copy"));
        // An unlisted helper counts where it was called.
        let helper = sample("x", 5, &[("some_new_helper", true), ("tcp_ack", true)]);
        assert_eq!(r.classify(&helper), Some("tcp-ip"));
        let gro = sample("x", 5, &[("tcp4_gro_receive", true), ("dev_gro_receive", true)]);
        assert_eq!(r.classify(&gro), Some("netdevice"), "GRO is netdevice, not TCP");
        let frag = sample("x", 5, &[("tcp_fragment", true)]);
        assert_eq!(r.classify(&frag), Some("skb"));
        let alloc =
            sample("x", 5, &[("kmem_cache_alloc_node_noprof", true), ("__alloc_skb", true)]);
        assert_eq!(r.classify(&alloc), Some("memory"));
        let idle = sample("swapper", 0, &[("pv_native_safe_halt", true), ("default_idle", true)]);
        assert_eq!(r.classify(&idle), Some("idle"));
        let unknown = sample("x", 5, &[("mystery_fn", true)]);
        assert_eq!(r.classify(&unknown), None);
    }

    #[test]
    fn user_space_by_object_thread_and_symbol() {
        let r = Rules::load(None).unwrap();
        let mut libc = sample("app", 1, &[("__memmove_avx512_unaligned_erms", false)]);
        libc.frames[0].dso = "/usr/lib/x86_64-linux-gnu/libc.so.6".into();
        assert_eq!(r.classify(&libc), Some("libc"));
        let engine = sample("nc-channel", 1, &[("netchannel::engine::worker::run", false)]);
        assert_eq!(r.classify(&engine), Some("netchannel-runtime"));
        let engine_fn = sample("ncperf", 1, &[("netchannel::vns::socket::VSocket::send", false)]);
        assert_eq!(r.classify(&engine_fn), Some("netchannel-runtime"));
        let app = sample("ncperf", 1, &[("ncperf::apps::receiver_loop", false)]);
        assert_eq!(r.classify(&app), Some("application"));
    }

    #[test]
    fn breakdown_arithmetic_and_sides() {
        let r = Rules::load(None).unwrap();
        let s = vec![
            sample("c", 1, &[("_copy_from_iter", true), ("tcp_sendmsg", true)]),
            sample("c", 1, &[("_copy_from_iter", true), ("tcp_sendmsg", true)]),
            sample(
                "s",
                2,
                &[("tcp_v4_rcv", true), ("net_rx_action", true), ("handle_softirqs", true)],
            ),
            sample("s", 2, &[("mystery", true)]),
            sample("swapper", 0, &[("pv_native_safe_halt", true)]),
        ];
        let b = breakdown(&s, &r, &[1].into(), &[2].into());
        assert_eq!((b.samples, b.idle, b.non_idle()), (5, 1, 4));
        assert!((b.idle_pct() - 20.0).abs() < 1e-9);
        assert!((b.unclassified_pct() - 25.0).abs() < 1e-9);
        let rep = b.report("linux");
        assert!((rep.categories["data-copy"] - 50.0).abs() < 1e-9);
        assert!((rep.sides["client"]["data-copy"] - 50.0).abs() < 1e-9);
        assert!(
            (rep.sides["softirq"]["tcp-ip"] - 25.0).abs() < 1e-9,
            "softirq work is its own side"
        );
        assert!((rep.sides["server"]["unclassified"] - 25.0).abs() < 1e-9);
        assert_eq!(rep.top_unclassified, vec![("mystery".to_string(), 25.0)]);
        let total: f64 = rep.categories.values().sum::<f64>() + rep.unclassified_pct;
        assert!((total - 100.0).abs() < 1e-9);
    }

    /// Real recordings from this kernel (every 50th sample of a machine-wide `perf record`).
    #[test]
    fn recorded_fixtures_are_classified() {
        let r = Rules::load(None).unwrap();
        for (name, text, must_have) in [
            (
                "linux-stream",
                include_str!("../tests/fixtures/linux-stream.perf-script.txt"),
                ["data-copy", "tcp-ip", "scheduling"],
            ),
            (
                "netchannel-rr",
                include_str!("../tests/fixtures/netchannel-rr.perf-script.txt"),
                ["scheduling", "netchannel-runtime", "tcp-ip"],
            ),
        ] {
            let samples = parse_perf_script(text);
            assert!(samples.len() > 200, "{name}: {} samples", samples.len());
            assert!(samples.iter().all(|s| !s.frames.is_empty()), "{name}: sample without frames");
            let b = breakdown(&samples, &r, &HashSet::new(), &HashSet::new());
            assert!(b.idle > 0, "{name}: idle samples recognised");
            let rep = b.report(name);
            assert!(
                rep.unclassified_pct < 5.0,
                "{name}: {:.1}% unclassified: {:?}",
                rep.unclassified_pct,
                rep.top_unclassified
            );
            for c in must_have {
                assert!(
                    rep.categories.get(c).copied().unwrap_or(0.0) > 1.0,
                    "{name}: {c} in {:?}",
                    rep.categories
                );
            }
        }
    }

    #[test]
    fn bad_rules_are_clear_errors() {
        assert!(Rules::parse("cat sym (").unwrap_err().contains("line 1"));
        assert!(Rules::parse("cat bogus x").unwrap_err().contains("MATCH"));
        assert!(Rules::parse("cat sym x over y").unwrap_err().contains("under"));
    }
}
