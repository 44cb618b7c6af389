//! `ncperf suite`: the studies' matrix on both stacks, with a markdown report and PNG plots.
//! Each configuration runs linux then netchannel back to back, so every ratio comes from one
//! pair of adjacent runs on the same testbed.

use std::fmt::Write as _;
use std::path::Path;

use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;

use crate::apps::{Pattern, Workload};
use crate::metrics::RunResult;
use crate::net::Stack;
use crate::orchestrate::{run_once, Hosts};
use crate::RunArgs;

const FONT: &str = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf";

/// One configuration of the matrix.
struct Case {
    section: &'static str,
    name: String,
    args: RunArgs,
}

fn base(hosts: Hosts, quick: bool) -> RunArgs {
    RunArgs {
        workload: Workload::Stream,
        pattern: Pattern::Single,
        flows: 1,
        size: 65536,
        duration: if quick { 1.0 } else { 3.0 },
        warmup: if quick { 0.3 } else { 1.0 },
        channels: 4,
        policy: netchannel::Policy::RoundRobin,
        hosts,
        rate: None,
        latency_flows: None,
        throughput_flows: None,
        max_apps: 8,
        split_processes: false,
        isolation: crate::net::IsolationOpt::Auto,
        demote_to: crate::net::DemoteTo::Idle,
        latency_nice: 0,
        host_congestion: false,
        mux_connections: 1,
        peers: 1,
        first_peer: 0,
        max_sessions: None,
        max_peer_buffered: None,
        max_channels: None,
        shards: None,
        app_demotion: Default::default(),
    }
}

fn matrix(hosts: Hosts, quick: bool) -> Vec<Case> {
    let b = || base(hosts, quick);
    let mut cases = Vec::new();
    let flow_counts: &[u64] = if quick { &[1, 64] } else { &[1, 8, 64, 1000, 10_000] };
    for pattern in
        [Pattern::Single, Pattern::OneToOne, Pattern::Incast, Pattern::Outcast, Pattern::AllToAll]
    {
        for &flows in flow_counts {
            if pattern == Pattern::Single && flows != 1 {
                continue;
            }
            cases.push(Case {
                section: "patterns",
                name: format!("stream-{}-{flows}", pattern.name()),
                args: RunArgs { pattern, flows, ..b() },
            });
        }
    }
    let sizes: &[u64] = if quick { &[4096, 65536] } else { &[64, 4096, 16384, 65536] };
    for workload in [Workload::Stream, Workload::Rr] {
        for &size in sizes {
            cases.push(Case {
                section: "sizes",
                name: format!("{}-{size}", workload.name()),
                args: RunArgs { workload, size, ..b() },
            });
        }
    }
    let shorts: &[u64] = if quick { &[1] } else { &[1, 4, 16] };
    for &l in shorts {
        cases.push(Case {
            section: "mixes",
            name: format!("mixed-1long-{l}short"),
            args: RunArgs {
                workload: Workload::Mixed,
                latency_flows: Some(l),
                throughput_flows: Some(1),
                ..b()
            },
        });
    }
    cases.push(Case {
        section: "isolation",
        name: "isolation-1L-8T".into(),
        args: RunArgs {
            workload: Workload::Mixed,
            latency_flows: Some(1),
            throughput_flows: Some(8),
            ..b()
        },
    });
    cases
}

struct Outcome {
    case: Case,
    linux: Result<RunResult, String>,
    netchannel: Result<RunResult, String>,
}

/// With `profile`, every run is also profiled (`ncperf profile`), each profile is written beside
/// its run, and the report gains a classification-coverage table.
pub fn run(out: &Path, quick: bool, hosts: Hosts, profile: bool) -> Result<(), String> {
    let rules = crate::profile::Rules::load(None)?;
    let mut coverage: Vec<(String, crate::profile::ProfileReport)> = Vec::new();
    let runs_dir = out.join("runs");
    std::fs::create_dir_all(&runs_dir)
        .map_err(|e| format!("cannot create {}: {e}", runs_dir.display()))?;
    register_font()?;
    let cases = matrix(hosts, quick);
    let total = cases.len();
    let mut outcomes = Vec::new();
    for (i, case) in cases.into_iter().enumerate() {
        eprintln!("ncperf suite: [{}/{total}] {}", i + 1, case.name);
        let mut one = |stack: Stack| -> Result<RunResult, String> {
            let write = |suffix: &str, json: String| {
                let path = runs_dir.join(format!("{}-{}{suffix}.json", case.name, stack.name()));
                std::fs::write(&path, json).map_err(|e| format!("{}: {e}", path.display()))
            };
            let r = if profile {
                crate::profile::profile(&case.args, stack, &rules, None).and_then(|(r, b)| {
                    let rep = b.report(stack.name());
                    write(
                        "-profile",
                        serde_json::to_string_pretty(&rep).map_err(|e| e.to_string())?,
                    )?;
                    coverage.push((case.name.clone(), rep));
                    Ok(r)
                })
            } else {
                run_once(&case.args, stack)
            };
            if let Ok(r) = &r {
                write("", serde_json::to_string_pretty(r).map_err(|e| e.to_string())?)?;
            }
            r
        };
        let linux = one(Stack::Linux);
        let netchannel = one(Stack::Netchannel);
        outcomes.push(Outcome { case, linux, netchannel });
    }
    let mut report = report(&outcomes, quick, hosts);
    if profile {
        report.push_str("\n## Profile classification coverage\n\n");
        report.push_str(
            "| case | stack | unclassified % of non-idle | idle % | top unclassified |\n",
        );
        report.push_str("|---|---|---:|---:|---|\n");
        for (name, rep) in &coverage {
            let top: Vec<String> =
                rep.top_unclassified.iter().take(3).map(|(s, p)| format!("{s} {p:.2}%")).collect();
            let _ = writeln!(
                report,
                "| {name} | {} | {:.2} | {:.1} | {} |",
                rep.stack,
                rep.unclassified_pct,
                rep.idle_pct,
                top.join(", ")
            );
        }
        let worst = coverage.iter().map(|c| c.1.unclassified_pct).fold(0.0, f64::max);
        let _ = writeln!(report, "\nWorst case: {worst:.2}% unclassified.");
    }
    let path = out.join("report.md");
    std::fs::write(&path, report).map_err(|e| format!("{}: {e}", path.display()))?;
    plots(out, &outcomes)?;
    println!("wrote {} and plots in {}", path.display(), out.display());
    Ok(())
}

fn fmt(v: f64) -> String {
    if v.is_finite() {
        format!("{v:.2}")
    } else {
        "-".into()
    }
}

fn ratio(n: f64, l: f64) -> String {
    if l > 0.0 && n.is_finite() && l.is_finite() {
        format!("{:.2}", n / l)
    } else {
        "-".into()
    }
}

fn report(outcomes: &[Outcome], quick: bool, hosts: Hosts) -> String {
    let mut md = String::new();
    let _ = writeln!(md, "# ncperf suite{}\n", if quick { " (quick)" } else { "" });
    let _ = writeln!(
        md,
        "Hosts: {}. Each row: linux then netchannel, back to back; ratio = netchannel / linux. \
         CPU is machine-wide busy cores over the measured window (on one machine the receive-side \
         kernel work runs mostly on the sending core, so per-process CPU mixes both ends).\n",
        match hosts {
            Hosts::Netns => "two network namespaces joined by a veth pair",
            Hosts::Loopback => "loopback",
        }
    );
    for (section, title) in [
        ("patterns", "Traffic patterns, 64 KiB writes"),
        ("sizes", "Single flow, message sizes"),
        ("mixes", "One long flow with short flows (mixed)"),
        ("isolation", "Isolation: one L-app (4 KiB ping-pong) beside 8 T-apps"),
    ] {
        let _ = writeln!(md, "## {title}\n");
        let _ = writeln!(
            md,
            "| case | linux Gbit/s | nc Gbit/s | ratio | linux Gbit/s/core | nc Gbit/s/core | ratio | linux p50/p99 us | nc p50/p99 us | p99 ratio |"
        );
        let _ = writeln!(md, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
        for o in outcomes.iter().filter(|o| o.case.section == section) {
            match (&o.linux, &o.netchannel) {
                (Ok(l), Ok(n)) => {
                    let lat = |r: &RunResult| {
                        r.latency_us
                            .map_or("-".to_string(), |x| format!("{:.0}/{:.0}", x.p50, x.p99))
                    };
                    let p99 = |r: &RunResult| r.latency_us.map_or(f64::NAN, |x| x.p99);
                    let _ = writeln!(
                        md,
                        "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                        o.case.name,
                        fmt(l.goodput_gbps),
                        fmt(n.goodput_gbps),
                        ratio(n.goodput_gbps, l.goodput_gbps),
                        fmt(l.gbps_per_core),
                        fmt(n.gbps_per_core),
                        ratio(n.gbps_per_core, l.gbps_per_core),
                        lat(l),
                        lat(n),
                        ratio(p99(n), p99(l))
                    );
                }
                (l, n) => {
                    let err = |r: &Result<RunResult, String>| {
                        r.as_ref().err().cloned().unwrap_or_default()
                    };
                    let _ = writeln!(
                        md,
                        "| {} | failed: {} {} | | | | | | | | |",
                        o.case.name,
                        err(l),
                        err(n)
                    );
                }
            }
        }
        md.push('\n');
    }
    md.push_str("Plots: `tput-per-core-<pattern>.png`, `latency-cdf-rr-*.png`, `isolation.png`.\n");
    md
}

pub fn register_font() -> Result<(), String> {
    let bytes = std::fs::read(FONT).map_err(|e| {
        format!("cannot read font {FONT}: {e} (scripts/setup.sh installs fonts-dejavu-core)")
    })?;
    let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
    plotters::style::register_font("sans-serif", FontStyle::Normal, bytes)
        .map_err(|_| format!("cannot load font {FONT}"))
}

fn plot_err<E: std::fmt::Debug>(e: E) -> String {
    format!("plot: {e:?}")
}

/// Throughput per core against flows, one PNG per pattern.
fn plots(out: &Path, outcomes: &[Outcome]) -> Result<(), String> {
    for pattern in ["one-to-one", "incast", "outcast", "all-to-all"] {
        let points = |stack: fn(&Outcome) -> &Result<RunResult, String>| -> Vec<(f64, f64)> {
            outcomes
                .iter()
                .filter(|o| o.case.section == "patterns" && o.case.args.pattern.name() == pattern)
                .filter_map(|o| stack(o).as_ref().ok().map(|r| (r.flows as f64, r.gbps_per_core)))
                .collect()
        };
        let (l, n) = (points(|o| &o.linux), points(|o| &o.netchannel));
        if l.is_empty() && n.is_empty() {
            continue;
        }
        let path = out.join(format!("tput-per-core-{pattern}.png"));
        let ymax = l.iter().chain(&n).map(|p| p.1).fold(1.0, f64::max) * 1.15;
        let xmax = l.iter().chain(&n).map(|p| p.0).fold(10.0, f64::max) * 1.5;
        let root = BitMapBackend::new(&path, (800, 500)).into_drawing_area();
        root.fill(&WHITE).map_err(plot_err)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(format!("Throughput per core, {pattern}, 64 KiB writes"), ("sans-serif", 22))
            .margin(15)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d((1f64..xmax).log_scale(), 0f64..ymax)
            .map_err(plot_err)?;
        chart
            .configure_mesh()
            .x_desc("flows")
            .y_desc("Gbit/s per busy core")
            .draw()
            .map_err(plot_err)?;
        draw_stacks(&mut chart, l, n, true)?;
        root.present().map_err(plot_err)?;
    }
    for o in outcomes
        .iter()
        .filter(|o| o.case.section == "sizes" && o.case.args.workload == Workload::Rr)
    {
        let path = out.join(format!("latency-cdf-{}.png", o.case.name));
        cdf_plot(&path, &format!("Latency CDF, {}", o.case.name), o)?;
    }
    if let Some(o) = outcomes.iter().find(|o| o.case.section == "isolation") {
        let gp = |r: &Result<RunResult, String>| r.as_ref().map_or(f64::NAN, |r| r.goodput_gbps);
        let title = format!(
            "Isolation: L-app latency beside 8 T-apps (T goodput linux {:.1}, netchannel {:.1} Gbit/s)",
            gp(&o.linux),
            gp(&o.netchannel)
        );
        cdf_plot(&out.join("isolation.png"), &title, o)?;
    }
    Ok(())
}

fn cdf_plot(path: &Path, title: &str, o: &Outcome) -> Result<(), String> {
    let pts = |r: &Result<RunResult, String>| -> Vec<(f64, f64)> {
        r.as_ref()
            .map(|r| r.latency_cdf.iter().map(|&(q, us)| (us.max(1.0), q)).collect())
            .unwrap_or_default()
    };
    let (l, n) = (pts(&o.linux), pts(&o.netchannel));
    if l.is_empty() && n.is_empty() {
        return Ok(());
    }
    let xmax = l.iter().chain(&n).map(|p| p.0).fold(10.0, f64::max) * 1.5;
    let root = BitMapBackend::new(path, (900, 500)).into_drawing_area();
    root.fill(&WHITE).map_err(plot_err)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 18))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d((1f64..xmax).log_scale(), 0f64..1.0)
        .map_err(plot_err)?;
    chart
        .configure_mesh()
        .x_desc("latency (us)")
        .y_desc("fraction of RPCs")
        .draw()
        .map_err(plot_err)?;
    draw_stacks(&mut chart, l, n, false)?;
    root.present().map_err(plot_err)
}

type LogXChart<'a, 'b> =
    ChartContext<'a, BitMapBackend<'b>, Cartesian2d<LogCoord<f64>, RangedCoordf64>>;

/// One line per stack (linux red, netchannel blue), optional point markers, and the legend.
fn draw_stacks<'a, 'b: 'a>(
    chart: &mut LogXChart<'a, 'b>,
    linux: Vec<(f64, f64)>,
    netchannel: Vec<(f64, f64)>,
    markers: bool,
) -> Result<(), String> {
    for (pts, color, name) in [(linux, RED, "linux"), (netchannel, BLUE, "netchannel")] {
        if markers {
            chart
                .draw_series(pts.iter().map(|p| Circle::new(*p, 4, color.filled())))
                .map_err(plot_err)?;
        }
        chart
            .draw_series(LineSeries::new(pts, color.stroke_width(2)))
            .map_err(plot_err)?
            .label(name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
    }
    chart
        .configure_series_labels()
        .border_style(BLACK)
        .background_style(WHITE)
        .draw()
        .map_err(plot_err)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matrix_covers_the_studies_configurations() {
        let full = matrix(Hosts::Loopback, false);
        let patterns = full.iter().filter(|c| c.section == "patterns").count();
        assert_eq!(patterns, 1 + 4 * 5, "single at 1 flow, four patterns at five flow counts");
        assert_eq!(full.iter().filter(|c| c.section == "sizes").count(), 8);
        assert_eq!(full.iter().filter(|c| c.section == "mixes").count(), 3);
        let iso = full.iter().find(|c| c.section == "isolation").unwrap();
        assert_eq!((iso.args.latency_flows, iso.args.throughput_flows), (Some(1), Some(8)));
        assert!(full.iter().any(|c| c.args.flows == 10_000));
        let quick = matrix(Hosts::Loopback, true);
        assert!(quick.len() < full.len());
        for c in full.iter().chain(&quick) {
            crate::orchestrate::validate(&c.args, Stack::Netchannel).unwrap();
        }
    }
}
