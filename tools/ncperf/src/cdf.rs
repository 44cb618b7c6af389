//! `ncperf cdf`: latency CDFs of several `compare` (or `run`) results in one PNG, e.g. an
//! L-app's latency with and without T-apps on both stacks. Left: the CDF; right: its tail
//! (1 - CDF) on a log scale, where isolation shows.

use std::path::Path;

use plotters::prelude::*;

use crate::metrics::RunResult;

/// One curve: a label and the latency distribution as (quantile, microseconds) points.
struct Curve {
    label: String,
    points: Vec<(f64, f64)>,
}

/// The run whose p99 is the median of its stack's runs in `file` (a compare JSON with `runs`,
/// or a single run's JSON).
fn median_runs(file: &Path) -> Result<Vec<RunResult>, String> {
    let text = std::fs::read_to_string(file).map_err(|e| format!("{}: {e}", file.display()))?;
    let value: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| format!("{}: {e}", file.display()))?;
    let runs: Vec<RunResult> = match value.get("runs") {
        Some(r) => serde_json::from_value(r.clone()),
        None => serde_json::from_value(value).map(|r| vec![r]),
    }
    .map_err(|e| format!("{}: not an ncperf result: {e}", file.display()))?;
    let mut picked = Vec::new();
    for stack in ["linux", "netchannel", "yamux", "quinn", "h2"] {
        let mut of: Vec<&RunResult> =
            runs.iter().filter(|r| r.stack == stack && !r.latency_cdf.is_empty()).collect();
        of.sort_by(|a, b| {
            let p = |r: &RunResult| r.latency_us.map_or(0.0, |l| l.p99);
            p(a).total_cmp(&p(b))
        });
        if let Some(r) = of.get(of.len() / 2) {
            picked.push((*r).clone());
        }
    }
    if picked.is_empty() {
        return Err(format!("{}: no run with a latency distribution", file.display()));
    }
    Ok(picked)
}

/// Draws the CDFs of `inputs` (`LABEL=FILE`) into `out`.
pub fn run(out: &Path, title: &str, inputs: &[String]) -> Result<(), String> {
    let mut curves = Vec::new();
    for input in inputs {
        let (label, file) =
            input.split_once('=').ok_or_else(|| format!("{input}: expected LABEL=FILE.json"))?;
        for r in median_runs(Path::new(file))? {
            curves.push(Curve { label: format!("{} {label}", r.stack), points: r.latency_cdf });
        }
    }
    crate::suite::register_font()?;
    let err = |e: &dyn std::fmt::Debug| format!("plot: {e:?}");
    let xmax = curves.iter().flat_map(|c| &c.points).map(|p| p.1).fold(10.0, f64::max) * 1.5;
    let root = BitMapBackend::new(out, (1400, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let root = root.titled(title, ("sans-serif", 20)).map_err(|e| err(&e))?;
    let (left, right) = root.split_horizontally(700);
    let style = |i: usize| {
        let colors = [RED, BLUE, RGBColor(230, 140, 0), RGBColor(0, 150, 170), MAGENTA, BLACK];
        ShapeStyle::from(colors[i % colors.len()]).stroke_width(2)
    };
    let mut cdf = ChartBuilder::on(&left)
        .caption("CDF", ("sans-serif", 16))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d((1f64..xmax).log_scale(), 0f64..1.0)
        .map_err(|e| err(&e))?;
    cdf.configure_mesh()
        .x_desc("latency (us)")
        .y_desc("fraction of RPCs at or below")
        .draw()
        .map_err(|e| err(&e))?;
    for (i, c) in curves.iter().enumerate() {
        let pts = c.points.iter().map(|&(q, us)| (us.max(1.0), q));
        cdf.draw_series(LineSeries::new(pts, style(i)))
            .map_err(|e| err(&e))?
            .label(c.label.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], style(i)));
    }
    cdf.configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|e| err(&e))?;
    let mut tail = ChartBuilder::on(&right)
        .caption("tail: 1 - CDF", ("sans-serif", 16))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d((1f64..xmax).log_scale(), (1e-4f64..1.0).log_scale())
        .map_err(|e| err(&e))?;
    tail.configure_mesh()
        .x_desc("latency (us)")
        .y_desc("fraction of RPCs above")
        .draw()
        .map_err(|e| err(&e))?;
    for (i, c) in curves.iter().enumerate() {
        let pts = c.points.iter().filter(|p| p.0 < 1.0).map(|&(q, us)| (us.max(1.0), 1.0 - q));
        tail.draw_series(LineSeries::new(pts, style(i))).map_err(|e| err(&e))?;
    }
    root.present().map_err(|e| err(&e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_a_png_from_compare_results_and_names_bad_input() {
        let dir = std::env::temp_dir().join(format!("ncperf-cdf-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let run = |stack: &str, scale: f64| RunResult {
            stack: stack.into(),
            latency_us: Some(crate::metrics::Latency {
                p50: 10.0 * scale,
                p99: 50.0 * scale,
                p999: 90.0 * scale,
                max: 100.0 * scale,
            }),
            latency_cdf: vec![(0.5, 10.0 * scale), (0.99, 50.0 * scale), (1.0, 100.0 * scale)],
            ..RunResult::default()
        };
        let compare = serde_json::json!({ "runs": [run("linux", 2.0), run("netchannel", 1.0)] });
        let file = dir.join("c.json");
        std::fs::write(&file, compare.to_string()).unwrap();
        let png = dir.join("cdf.png");
        run_ok(&png, &file);
        assert!(std::fs::metadata(&png).unwrap().len() > 1000);
        let bad = dir.join("bad.json");
        std::fs::write(&bad, "{}").unwrap();
        let e = super::run(&png, "t", &[format!("x={}", bad.display())]).unwrap_err();
        assert!(e.contains("bad.json"), "{e}");
        assert!(super::run(&png, "t", &["no-equals".into()]).unwrap_err().contains("LABEL=FILE"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    fn run_ok(png: &Path, file: &Path) {
        super::run(png, "test", &[format!("with T-apps={}", file.display())]).unwrap();
    }
}
