//! Bar charts of results against linux: `ncperf plot`, and `--png` of `compare` and
//! `programs`. Every bar is a stack's median divided by linux's median of the same metric, on a
//! log scale around 1 (a 30x win and a 0.3x loss read alike), with the spread of that stack's
//! repetitions (min..max over linux's median) as an error bar. Ratios rather than values put
//! Gbit/s, requests/s and microseconds on one axis; where lower is better (latency, CPU) the
//! group says so, and its bars are inverted (linux / stack) so that up is always better.

use std::path::Path;

use plotters::prelude::*;
use serde_json::Value;

/// The metrics a `compare` chart shows by default (those a result has).
const DEFAULT_METRICS: [&str; 5] =
    ["goodput_gbps", "rps", "latency_us.p50", "latency_us.p99", "gbps_per_core"];

/// One bar: a stack's ratio to linux, with the spread of its repetitions.
#[derive(Debug, Clone, PartialEq)]
pub struct Bar {
    pub stack: String,
    pub ratio: f64,
    pub low: f64,
    pub high: f64,
}

/// One group of bars: a metric of a workload.
#[derive(Debug, Clone, PartialEq)]
pub struct Group {
    pub label: String,
    pub bars: Vec<Bar>,
}

fn lower_is_better(metric: &str) -> bool {
    metric.starts_with("latency") || metric.contains("cpu") || metric.contains("rss")
}

/// `value` at `path`: a flat key ("latency_us.p99", as medians have it) or a dotted path into
/// nested objects (as runs have it).
fn at<'a>(value: &'a Value, path: &str) -> Option<&'a Value> {
    value.get(path).or_else(|| path.split('.').try_fold(value, |v, k| v.get(k)))
}

/// Min and max of `xs`.
fn range(xs: &[f64]) -> Option<(f64, f64)> {
    let lo = xs.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = xs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    (lo.is_finite() && hi.is_finite()).then_some((lo, hi))
}

/// A bar from a stack's median and repetitions against linux's median; inverted where lower
/// is better.
fn bar(stack: &str, median: f64, runs: &[f64], linux: f64, lower: bool) -> Option<Bar> {
    if !(median.is_finite() && linux.is_finite() && linux > 0.0) {
        return None;
    }
    let (lo, hi) = range(runs).unwrap_or((median, median));
    let r = |x: f64| if lower { linux / x.max(1e-9) } else { x / linux };
    let (a, b) = (r(lo), r(hi));
    Some(Bar { stack: stack.into(), ratio: r(median), low: a.min(b), high: a.max(b) })
}

/// Groups of a `compare --json` result (two stacks, or more with `--with`): one per metric in
/// `metrics` (default: the usual ones the result has), `label` naming the workload.
pub fn from_compare(doc: &Value, label: &str, metrics: &[String]) -> Result<Vec<Group>, String> {
    let medians = doc
        .get("medians")
        .cloned()
        .or_else(|| {
            // Two stacks only: `linux` and `netchannel` at the top.
            Some(serde_json::json!({ "linux": doc.get("linux")?, "netchannel": doc.get("netchannel")? }))
        })
        .filter(|m| m.get("linux").is_some())
        .ok_or("not a compare result: no linux medians")?;
    let runs = doc.get("runs").and_then(Value::as_array).cloned().unwrap_or_default();
    let wanted: Vec<String> = if metrics.is_empty() {
        DEFAULT_METRICS
            .iter()
            .filter(|m| at(&medians["linux"], m).and_then(Value::as_f64).is_some_and(|v| v > 0.0))
            .map(|m| m.to_string())
            .collect()
    } else {
        metrics.to_vec()
    };
    let mut groups = Vec::new();
    for metric in wanted {
        let linux = at(&medians["linux"], &metric)
            .and_then(Value::as_f64)
            .ok_or_else(|| format!("no {metric} in the linux medians"))?;
        let lower = lower_is_better(&metric);
        let mut bars = Vec::new();
        for (stack, m) in medians.as_object().into_iter().flatten() {
            if stack == "linux" {
                continue;
            }
            let Some(median) = at(m, &metric).and_then(Value::as_f64) else { continue };
            let reps: Vec<f64> = runs
                .iter()
                .filter(|r| r["stack"] == stack.as_str())
                .filter_map(|r| at(r, &metric).and_then(Value::as_f64))
                .collect();
            bars.extend(bar(stack, median, &reps, linux, lower));
        }
        let suffix = if lower { "\n(lower is better)" } else { "" };
        groups.push(Group { label: format!("{label}\n{metric}{suffix}"), bars });
    }
    Ok(groups)
}

/// Groups of an `ncperf programs --json` result: one per program and metric.
pub fn from_programs(doc: &Value) -> Result<Vec<Group>, String> {
    let summaries =
        doc.get("summaries").and_then(Value::as_array).ok_or("not a programs result")?;
    let runs = doc.get("runs").and_then(Value::as_array).cloned().unwrap_or_default();
    let mut groups = Vec::new();
    for s in summaries {
        let (program, metric) =
            (s["program"].as_str().unwrap_or("?"), s["metric"].as_str().unwrap_or("?"));
        let (Some(linux), Some(nc)) = (s["linux"].as_f64(), s["netchannel"].as_f64()) else {
            continue;
        };
        let lower = s["higher_is_better"].as_bool() == Some(false);
        let reps: Vec<f64> = runs
            .iter()
            .filter(|r| r["program"] == program && r["stack"] == "netchannel")
            .flat_map(|r| r["figures"].as_array().cloned().unwrap_or_default())
            .filter(|f| f["metric"] == metric)
            .filter_map(|f| f["value"].as_f64())
            .collect();
        let suffix = if lower { "\n(lower is better)" } else { "" };
        groups.push(Group {
            label: format!("{program}\n{metric}{suffix}"),
            bars: bar("netchannel", nc, &reps, linux, lower).into_iter().collect(),
        });
    }
    Ok(groups)
}

/// Groups of one JSON file of either kind.
pub fn from_file(path: &Path, label: &str, metrics: &[String]) -> Result<Vec<Group>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let doc: Value =
        serde_json::from_str(&text).map_err(|e| format!("{}: not JSON: {e}", path.display()))?;
    if doc.get("summaries").is_some() {
        from_programs(&doc)
    } else {
        from_compare(&doc, label, metrics)
    }
    .map_err(|e| format!("{}: {e}", path.display()))
}

/// `ncperf plot`: inputs are `[LABEL=]FILE[@METRIC,...]`.
pub fn plot(out: &Path, title: &str, inputs: &[String]) -> Result<(), String> {
    let mut groups = Vec::new();
    for input in inputs {
        let (label, rest) = match input.split_once('=') {
            Some((l, r)) => (l.to_string(), r),
            None => (String::new(), input.as_str()),
        };
        let (file, metrics) = match rest.split_once('@') {
            Some((f, m)) => (f, m.split(',').map(str::to_string).collect()),
            None => (rest, Vec::new()),
        };
        let label = if label.is_empty() {
            Path::new(file).file_stem().map_or(String::new(), |s| s.to_string_lossy().into())
        } else {
            label
        };
        groups.extend(from_file(Path::new(file), &label, &metrics)?);
    }
    draw(out, title, &groups)
}

/// Colours of the stacks, as the other charts use them.
fn colour(stack: &str) -> RGBColor {
    match stack {
        "netchannel" => RGBColor(31, 119, 180),
        "yamux" => RGBColor(44, 160, 44),
        "quinn" => RGBColor(214, 39, 40),
        "h2" => RGBColor(148, 103, 189),
        _ => RGBColor(127, 127, 127),
    }
}

/// Draws `groups` into a PNG at `out`.
pub fn draw(out: &Path, title: &str, groups: &[Group]) -> Result<(), String> {
    if groups.iter().all(|g| g.bars.is_empty()) {
        return Err("nothing to plot: no stack has a figure beside linux".into());
    }
    crate::suite::register_font()?;
    let err = |e: &dyn std::fmt::Debug| format!("plot {}: {e:?}", out.display());
    let mut stacks: Vec<String> = Vec::new();
    for b in groups.iter().flat_map(|g| &g.bars) {
        if !stacks.contains(&b.stack) {
            stacks.push(b.stack.clone());
        }
    }
    // Log axis: a ratio of 0 (a stack that moved nothing) sits at the floor.
    let floor = 0.01;
    let clamp = |v: f64| v.clamp(floor, 1000.0);
    let top = groups.iter().flat_map(|g| &g.bars).map(|b| clamp(b.high)).fold(2.0, f64::max) * 2.0;
    let width = (160 + 90 * groups.len() * stacks.len().max(1)).clamp(700, 2400) as u32;
    let root = BitMapBackend::new(out, (width, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let n = groups.len() as f64;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(80)
        .y_label_area_size(70)
        .build_cartesian_2d(0.0..n, (floor..top).log_scale())
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(0)
        .y_desc("ratio to linux (up is better; log scale)")
        .y_label_formatter(&|v| format!("{v}x"))
        .draw()
        .map_err(|e| err(&e))?;
    // Linux itself: 1x.
    chart
        .draw_series(LineSeries::new([(0.0, 1.0), (n, 1.0)], BLACK.stroke_width(1)))
        .map_err(|e| err(&e))?;
    let slot = 0.8 / stacks.len().max(1) as f64;
    for (gi, g) in groups.iter().enumerate() {
        for b in &g.bars {
            let si = stacks.iter().position(|s| *s == b.stack).unwrap_or(0);
            let x0 = gi as f64 + 0.1 + si as f64 * slot;
            let (x1, c) = (x0 + slot * 0.9, colour(&b.stack));
            let (lo, hi) = (clamp(b.ratio.min(1.0)), clamp(b.ratio.max(1.0)));
            chart
                .draw_series([Rectangle::new([(x0, lo), (x1, hi)], c.filled())])
                .map_err(|e| err(&e))?;
            let xm = (x0 + x1) / 2.0;
            chart
                .draw_series([PathElement::new(
                    [(xm, clamp(b.low)), (xm, clamp(b.high))],
                    BLACK.stroke_width(2),
                )])
                .map_err(|e| err(&e))?;
            let text = if b.ratio >= 10.0 {
                format!("{:.0}x", b.ratio)
            } else {
                format!("{:.2}x", b.ratio)
            };
            chart
                .draw_series([Text::new(
                    text,
                    (x0, clamp(b.high.max(b.ratio)) * 1.15),
                    ("sans-serif", 13),
                )])
                .map_err(|e| err(&e))?;
        }
        // The group's label under the axis, one line per part.
        for (li, line) in g.label.lines().enumerate() {
            let pos = chart.backend_coord(&(gi as f64 + 0.08, floor));
            root.draw(&Text::new(
                line.to_string(),
                (pos.0, pos.1 + 8 + 16 * li as i32),
                ("sans-serif", 13),
            ))
            .map_err(|e| err(&e))?;
        }
    }
    for (i, s) in stacks.iter().enumerate() {
        let (x, y) = (90 + 140 * i as i32, 40);
        root.draw(&Rectangle::new([(x, y), (x + 14, y + 14)], colour(s).filled()))
            .map_err(|e| err(&e))?;
        root.draw(&Text::new(s.clone(), (x + 20, y), ("sans-serif", 15))).map_err(|e| err(&e))?;
    }
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Width and height from a PNG's IHDR, if `bytes` is a PNG.
    fn png_size(bytes: &[u8]) -> Option<(u32, u32)> {
        if bytes.len() < 24 || &bytes[..8] != b"\x89PNG\r\n\x1a\n" || &bytes[12..16] != b"IHDR" {
            return None;
        }
        let be = |b: &[u8]| u32::from_be_bytes([b[0], b[1], b[2], b[3]]);
        Some((be(&bytes[16..20]), be(&bytes[20..24])))
    }

    fn repo(path: &str) -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").join(path)
    }

    #[test]
    fn ratios_point_up_when_better_and_carry_the_spread() {
        let doc = serde_json::json!({
            "medians": {"linux": {"rps": 100.0, "latency_us": {"p99": 50.0}},
                        "netchannel": {"rps": 150.0, "latency_us": {"p99": 100.0}}},
            "runs": [{"stack": "netchannel", "rps": 140.0, "latency_us": {"p99": 80.0}},
                     {"stack": "netchannel", "rps": 160.0, "latency_us": {"p99": 125.0}}],
        });
        let g = from_compare(&doc, "rr", &[]).unwrap();
        assert_eq!(g.len(), 2, "{g:?}");
        assert_eq!(
            g[0].bars[0],
            Bar { stack: "netchannel".into(), ratio: 1.5, low: 1.4, high: 1.6 }
        );
        // Latency: twice linux's is half as good, its spread inverted too.
        assert_eq!(
            g[1].bars[0],
            Bar { stack: "netchannel".into(), ratio: 0.5, low: 0.4, high: 0.625 }
        );
        assert!(g[1].label.contains("lower is better"));
    }

    #[test]
    fn charts_of_the_committed_results_are_pngs_of_the_asked_shape() {
        let dir = std::env::temp_dir().join(format!("ncperf-bars-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for (name, input) in [
            ("mux", format!("rr={}", repo("docs/bench/mux/rr-4k-lo.json").display())),
            ("apps", repo("docs/bench/unmodified-apps/direct.json").display().to_string()),
        ] {
            let out = dir.join(format!("{name}.png"));
            plot(&out, name, &[input]).unwrap();
            let bytes = std::fs::read(&out).unwrap();
            let (w, h) = png_size(&bytes).expect("a PNG");
            assert!(w >= 700 && h == 560, "{w}x{h}");
            // Not blank: bars, labels and text make a real image, far larger than a flat fill.
            assert!(bytes.len() > 8_000, "{} bytes", bytes.len());
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn wrong_inputs_are_clear_errors() {
        let e = plot(Path::new("/tmp/x.png"), "t", &["/nonexistent.json".into()]).unwrap_err();
        assert!(e.contains("/nonexistent.json"), "{e}");
        let f = std::env::temp_dir().join(format!("ncperf-bars-bad-{}.json", std::process::id()));
        std::fs::write(&f, "{\"x\": 1}").unwrap();
        let e = plot(Path::new("/tmp/x.png"), "t", &[f.display().to_string()]).unwrap_err();
        assert!(e.contains("not a compare result"), "{e}");
        let _ = std::fs::remove_file(&f);
    }
}
