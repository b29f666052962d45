//! `braid report RUN_DIR`: one self-contained HTML page (inline SVG, no scripts) with a plot of
//! every metric of `metrics.jsonl` against the step, and the run's stage timeline — per step,
//! generation, inference (the part hidden under generation drawn inside it), kernels and
//! training.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

#[derive(clap::Args)]
pub struct Args {
    /// A run directory written by `braid run`.
    run_dir: PathBuf,
    /// Where to write the page (default RUN_DIR/report.html).
    #[arg(long, short)]
    out: Option<PathBuf>,
    /// Instead of the page, print the run's measured iteration and stage times beside what
    /// `braid sim` predicts for the same plan and workload (the run's own prompt lengths).
    #[arg(long)]
    against_sim: bool,
    /// With --against-sim: price the plan with this device profile (`braid calibrate`)
    /// instead of the one the plan was made with.
    #[arg(long, value_name = "FILE", requires = "against_sim")]
    profile: Option<PathBuf>,
    /// With --against-sim: a run of the same program without streaming (`braid run
    /// --no-fuse`), for the measured and the predicted gain of streaming. A run of `braid run
    /// --alternate-streaming` holds its own comparison: its steps without streaming.
    #[arg(long, value_name = "RUN_DIR", requires = "against_sim")]
    unfused: Option<PathBuf>,
    /// With --against-sim: print JSON.
    #[arg(long, requires = "against_sim")]
    json: bool,
    /// With --against-sim: write the simulated iteration of the run's plan as Chrome-trace
    /// JSON, to set beside the measured `RUN_DIR/timeline.json` in Perfetto.
    #[arg(long, value_name = "FILE.json", requires = "against_sim")]
    trace: Option<PathBuf>,
}

pub fn run(args: Args) -> ExitCode {
    if args.against_sim {
        return match crate::against::against_sim(
            &args.run_dir,
            args.profile.as_deref(),
            args.unfused.as_deref(),
        ) {
            Ok(c) => {
                if let Some(path) = &args.trace {
                    let (report, devices) = &c.simulated;
                    let text = braid_cost::sim::to_chrome_trace(report, *devices);
                    if let Err(e) = std::fs::write(path, text) {
                        eprintln!("error: {}: cannot write: {e}", path.display());
                        return ExitCode::from(2);
                    }
                }
                if args.json {
                    println!(
                        "{}",
                        serde_json::to_string_pretty(&crate::against::to_json(&c))
                            .unwrap_or_else(|e| e.to_string())
                    );
                } else {
                    print!("{}", crate::against::to_text(&c));
                }
                ExitCode::SUCCESS
            }
            Err((msg, code)) => {
                eprintln!("error: {msg}");
                ExitCode::from(code)
            }
        };
    }
    match report(&args) {
        Ok(path) => {
            println!("{}", path.display());
            ExitCode::SUCCESS
        }
        Err((msg, code)) => {
            eprintln!("error: {msg}");
            ExitCode::from(code)
        }
    }
}

pub(crate) type Series = BTreeMap<String, Vec<(f64, f64)>>;
/// Every step's metrics, by name (with `step`).
pub(crate) type Rows = Vec<BTreeMap<String, f64>>;

pub(crate) fn read_metrics(run_dir: &std::path::Path) -> Result<(Series, Rows), (String, u8)> {
    let path = run_dir.join("metrics.jsonl");
    let text = std::fs::read_to_string(&path).map_err(|e| {
        (
            format!(
                "{}: {e} (is {} a run directory of `braid run`?)",
                path.display(),
                run_dir.display()
            ),
            2,
        )
    })?;
    let mut series: Series = BTreeMap::new();
    let mut rows = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let v: serde_json::Value = serde_json::from_str(line).map_err(|e| {
            (
                format!("{}: line {}: not valid JSON: {e}", path.display(), i + 1),
                1,
            )
        })?;
        let Some(obj) = v.as_object() else {
            return Err((
                format!("{}: line {}: expected an object", path.display(), i + 1),
                1,
            ));
        };
        let Some(step) = obj.get("step").and_then(|s| s.as_f64()) else {
            return Err((format!("{}: line {}: no `step`", path.display(), i + 1), 1));
        };
        let mut row = BTreeMap::new();
        for (k, val) in obj {
            if k == "step" {
                continue;
            }
            if let Some(x) = val.as_f64() {
                series.entry(k.clone()).or_default().push((step, x));
                row.insert(k.clone(), x);
            }
        }
        row.insert("step".into(), step);
        rows.push(row);
    }
    if rows.is_empty() {
        return Err((format!("{}: no steps recorded yet", path.display()), 1));
    }
    Ok((series, rows))
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// A line chart of one metric.
fn chart(name: &str, points: &[(f64, f64)]) -> String {
    let (w, h, pad) = (360.0, 180.0, 36.0);
    let (x0, x1) = points.iter().fold((f64::MAX, f64::MIN), |(a, b), (x, _)| {
        (a.min(*x), b.max(*x))
    });
    let (mut y0, mut y1) = points.iter().fold((f64::MAX, f64::MIN), |(a, b), (_, y)| {
        (a.min(*y), b.max(*y))
    });
    if (y1 - y0).abs() < 1e-12 {
        y0 -= 1.0;
        y1 += 1.0;
    }
    let sx = |x: f64| pad + (x - x0) / (x1 - x0).max(1e-12) * (w - 2.0 * pad);
    let sy = |y: f64| h - pad + (y0 - y) / (y1 - y0) * (h - 2.0 * pad);
    let path: Vec<String> = points
        .iter()
        .map(|(x, y)| format!("{:.1},{:.1}", sx(*x), sy(*y)))
        .collect();
    let mut s = String::new();
    let _ = write!(
        s,
        r##"<figure><svg width="{w}" height="{h}" viewBox="0 0 {w} {h}" role="img"><title>{t}</title>
<rect x="{pad}" y="{pad}" width="{iw}" height="{ih}" fill="#fafafa" stroke="#ccc"/>
<polyline fill="none" stroke="#1f77b4" stroke-width="1.5" points="{p}"/>
<text x="{pad}" y="{ty}" font-size="10">{y1:.4}</text><text x="{pad}" y="{by}" font-size="10">{y0:.4}</text>
<text x="{pad}" y="{h2}" font-size="10">step {x0}</text><text x="{rx}" y="{h2}" font-size="10" text-anchor="end">{x1}</text>
</svg><figcaption>{t}</figcaption></figure>"##,
        t = esc(name),
        iw = w - 2.0 * pad,
        ih = h - 2.0 * pad,
        p = path.join(" "),
        ty = pad - 4.0,
        by = h - pad + 12.0,
        h2 = h - 6.0,
        rx = w - pad,
    );
    s
}

/// Per step: generation, inference (hidden part inside generation), kernels, training.
fn timeline(rows: &[BTreeMap<String, f64>]) -> String {
    let get = |r: &BTreeMap<String, f64>, k: &str| r.get(k).copied().unwrap_or(0.0);
    let longest = rows
        .iter()
        .map(|r| {
            let inf = get(r, "time/infer");
            let hidden = get(r, "time/infer_hidden") * inf;
            get(r, "time/generate") + (inf - hidden) + get(r, "time/kernels") + get(r, "time/train")
        })
        .fold(0.0f64, f64::max)
        .max(1e-9);
    let (w, row_h, left) = (760.0, 12.0, 60.0);
    let h = rows.len() as f64 * row_h + 40.0;
    let scale = (w - left - 10.0) / longest;
    let mut s = String::new();
    let _ = write!(
        s,
        r#"<svg width="{w}" height="{h}" viewBox="0 0 {w} {h}" role="img"><title>stage timeline</title>"#
    );
    for (i, r) in rows.iter().enumerate() {
        let y = 20.0 + i as f64 * row_h;
        let g = get(r, "time/generate");
        let inf = get(r, "time/infer");
        let hidden = (get(r, "time/infer_hidden") * inf).min(g);
        let after = inf - hidden;
        let k = get(r, "time/kernels");
        let t = get(r, "time/train");
        let step = get(r, "step");
        let _ = write!(
            s,
            r#"<text x="4" y="{ty:.1}" font-size="9">step {step}</text>"#,
            ty = y + 9.0
        );
        let mut x = left;
        for (len, color, what) in [
            (g, "#1f77b4", "generate"),
            (after, "#ff7f0e", "inference after generation"),
            (k, "#2ca02c", "kernels"),
            (t, "#d62728", "train"),
        ] {
            let wd = len * scale;
            let _ = write!(
                s,
                r#"<rect x="{x:.1}" y="{y:.1}" width="{wd:.1}" height="{hh:.1}" fill="{color}"><title>{what}: {len:.3} s</title></rect>"#,
                hh = row_h - 2.0
            );
            x += wd;
        }
        if hidden > 0.0 {
            // Inference streamed under generation: a band inside the generation bar.
            let _ = write!(
                s,
                r##"<rect x="{x:.1}" y="{yy:.1}" width="{wd:.1}" height="{hh:.1}" fill="#ffbb78"><title>inference hidden under generation: {hidden:.3} s</title></rect>"##,
                x = left + (g - hidden) * scale,
                yy = y + (row_h - 2.0) / 2.0,
                wd = hidden * scale,
                hh = (row_h - 2.0) / 2.0
            );
        }
    }
    let _ = write!(
        s,
        r#"<text x="{left}" y="12" font-size="10">0 s</text><text x="{r}" y="12" font-size="10" text-anchor="end">{longest:.2} s</text></svg>"#,
        r = w - 10.0
    );
    s
}

/// Generations that samples to show: the last ones of `samples.jsonl`.
const SAMPLES_SHOWN: usize = 24;

/// The table of the run's last generations from `samples.jsonl` (none when the file is
/// missing: runs before it existed); a line that is not a JSON object is an error naming it.
fn samples(run_dir: &std::path::Path) -> Result<String, (String, u8)> {
    let path = run_dir.join("samples.jsonl");
    let Ok(text) = std::fs::read_to_string(&path) else {
        return Ok(String::new());
    };
    let mut lines = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let v: serde_json::Value = serde_json::from_str(line).map_err(|e| {
            (
                format!("{}: line {}: not valid JSON: {e}", path.display(), i + 1),
                1,
            )
        })?;
        if !v.is_object() {
            return Err((
                format!("{}: line {}: expected a JSON object", path.display(), i + 1),
                1,
            ));
        }
        lines.push(v);
    }
    let mut html = format!(
        "<h2>Samples</h2><p>The last {} of {} generations in <code>samples.jsonl</code> (the first sample of a few prompts per step).</p>\n<table border=\"1\" cellspacing=\"0\" cellpadding=\"4\" style=\"font-size:12px;border-collapse:collapse\"><tr><th>step</th><th>prompt</th><th>completion</th><th>answer</th><th>reward</th><th>advantage</th></tr>\n",
        lines.len().min(SAMPLES_SHOWN),
        lines.len()
    );
    for v in lines.iter().skip(lines.len().saturating_sub(SAMPLES_SHOWN)) {
        let text = |k: &str| esc(v.get(k).and_then(|x| x.as_str()).unwrap_or(""));
        let num = |k: &str| {
            v.get(k)
                .and_then(serde_json::Value::as_f64)
                .map_or_else(|| "–".to_string(), |x| format!("{x:.3}"))
        };
        let _ = writeln!(
            html,
            "<tr><td>{}</td><td><pre>{}</pre></td><td><pre>{}</pre></td><td>{}</td><td>{}</td><td>{}</td></tr>",
            v.get("step")
                .and_then(serde_json::Value::as_i64)
                .unwrap_or(0),
            text("prompt"),
            text("completion"),
            text("answer"),
            num("reward"),
            num("advantage")
        );
    }
    html.push_str("</table>\n");
    Ok(html)
}

fn report(args: &Args) -> Result<PathBuf, (String, u8)> {
    let (series, rows) = read_metrics(&args.run_dir)?;
    // The plan the run executed: its pipeline and where it was compiled.
    let plan_json = std::fs::read_to_string(args.run_dir.join("plan.json"))
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok());
    let program = plan_json
        .as_ref()
        .map(|v| {
            format!(
                "{} (in {})",
                v["plan"]["pipeline"].as_str().unwrap_or("?"),
                v["base_dir"].as_str().unwrap_or("?")
            )
        })
        .unwrap_or_else(|| "?".into());
    let mut html = String::new();
    let _ = write!(
        html,
        r#"<!doctype html><html><head><meta charset="utf-8"><title>braid run report: {dir}</title>
<style>body{{font-family:sans-serif;margin:1.5em}}figure{{display:inline-block;margin:.4em}}figcaption{{font-size:12px;text-align:center}}</style></head><body>
<h1>Run {dir}</h1><p>pipeline <code>{prog}</code>, {n} steps recorded</p>"#,
        dir = esc(&args.run_dir.display().to_string()),
        prog = esc(&program),
        n = rows.len()
    );
    // Reward and KL first, then the rest by name.
    let mut names: Vec<&String> = series.keys().collect();
    names.sort_by_key(|k| {
        (
            match k.as_str() {
                "reward_mean" => 0,
                "reward_std" => 1,
                "kl" => 2,
                k if k.starts_with("time/") => 4,
                _ => 3,
            },
            k.to_string(),
        )
    });
    html.push_str("<h2>Metrics</h2>\n");
    for k in names {
        html.push_str(&chart(k, &series[k]));
        html.push('\n');
    }
    html.push_str(
        "<h2>Stage timeline</h2><p>Per step: generation (blue), inference streamed under it (light orange band), inference after generation (orange), <code>fn</code> kernels (green), training (red).</p>\n",
    );
    html.push_str(&timeline(&rows));
    html.push_str(&measured_and_simulated(&args.run_dir)?);
    html.push_str(&samples(&args.run_dir)?);
    html.push_str("\n</body></html>\n");
    let out = args
        .out
        .clone()
        .unwrap_or_else(|| args.run_dir.join("report.html"));
    std::fs::write(&out, html).map_err(|e| (format!("{}: cannot write: {e}", out.display()), 1))?;
    Ok(out)
}

/// The spans of a Chrome trace `RUN_DIR/timeline.json` (what every rank ran in the run's
/// latest step), and the number of ranks.
fn measured_spans(path: &Path) -> Result<(Vec<braid_cost::sim::Span>, usize), (String, u8)> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| (format!("{}: cannot read: {e}", path.display()), 1))?;
    let v: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| (format!("{}: not a trace: {e}", path.display()), 1))?;
    let events = v["traceEvents"]
        .as_array()
        .ok_or_else(|| (format!("{}: no `traceEvents`", path.display()), 1))?;
    let mut spans = Vec::new();
    let mut devices = 1;
    for e in events {
        let tid = e["tid"].as_u64().unwrap_or(0) as usize;
        devices = devices.max(tid + 1);
        if e["ph"] != "X" {
            continue;
        }
        let (ts, dur) = (
            e["ts"].as_f64().unwrap_or(0.0),
            e["dur"].as_f64().unwrap_or(0.0),
        );
        spans.push(braid_cost::sim::Span {
            device: tid,
            iteration: e["args"]["iteration"].as_u64().unwrap_or(0) as u32,
            task: e["args"]["task"].as_str().unwrap_or("").to_string(),
            stage: e["cat"].as_str().unwrap_or("").to_string(),
            label: e["name"].as_str().unwrap_or("").to_string(),
            start: ts / 1e6,
            end: (ts + dur) / 1e6,
        });
    }
    Ok((spans, devices))
}

/// The measured timeline of the run's latest step beside the one `braid sim` predicts for the
/// same plan (one iteration, the plan's workload), each a row per device.
fn measured_and_simulated(run_dir: &Path) -> Result<String, (String, u8)> {
    let trace = run_dir.join("timeline.json");
    if !trace.exists() {
        return Ok(String::new());
    }
    let (spans, devices) = measured_spans(&trace)?;
    let total = spans.iter().map(|s| s.end).fold(0.0, f64::max);
    let mut html = format!(
        "<h2>Timeline of the latest step, measured</h2><p>What every rank ran, from <code>timeline.json</code> (Chrome trace events; open it in Perfetto): {:.3} s.</p>\n{}",
        total,
        braid_cost::sim::spans_to_svg(&spans, devices, total)
    );
    let plan_path = run_dir.join("plan.json");
    if let Ok(text) = std::fs::read_to_string(&plan_path)
        && let Ok(plan) = braid_ir::exec_plan::ExecPlan::from_json(&text)
    {
        let a = braid_passes::annotated::Annotated::from_exec_plan(&plan);
        let opts = braid_cost::sim::SimOptions {
            iterations: 1,
            seed: plan.seed,
        };
        match braid_passes::to_sim::simulate_plan(&a, true, &opts) {
            Ok(r) => {
                let _ = write!(
                    html,
                    "<h2>Timeline of one iteration, simulated</h2><p>What <code>braid sim</code> predicts for the same plan on its cost model: {:.3} s per iteration.</p>\n{}",
                    r.mean_iteration_time,
                    braid_cost::sim::to_svg(&r, plan.cluster.devices() as usize)
                );
            }
            Err(e) => {
                let _ = write!(html, "<p>The plan could not be simulated: {}</p>", esc(&e));
            }
        }
    }
    Ok(html)
}
