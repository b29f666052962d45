//! `braid sim study MANIFEST.json`: simulates the settings of a published throughput study and
//! sets the simulated speed-ups beside the measured ones.
//!
//! The manifest names the source, the prompt length, the measured systems' engine where it
//! differs from the datasheet (`engine`: the compute efficiency its passes reach, the host's
//! time in its decode steps when they are host-bound; set on the datasheet entry of every
//! setting, calibrated on the settings the manifest marks `calibration`), which simulated
//! system ran the measured heuristic, and, per setting, a program (relative to the manifest),
//! the generated length (every answer that long, as the study fixes it) and the measured
//! throughput of each system (`null` where the study reports it out of memory). Every system in a setting runs the same work, so a ratio of throughputs
//! is the inverse ratio of iteration times. The command prints, per setting, the simulated
//! iteration of each system and the speed-ups of Braid's plan without fusion (the ReaL-style
//! plan: searched placement and reallocation, no RLHFuse fusion) over the heuristic and over
//! DeepSpeed-Chat, simulated and measured; then how many settings agree within a quarter and
//! the rank correlation across settings — over all of them and over the held-out ones — and
//! whether Braid's plan is ever slower than ReaL's simulated plans. Generation is simulated
//! with no batch cap (ReaL's engine decodes the whole batch at once, memory permitting), for
//! every system but those whose own engines bound it (DeepSpeed-Chat, OpenRLHF).
//!
//! The joint-memory check of `braid plan` (`E0504`, which prices Braid's runtime holding every
//! model resident) is not applied: the study predicts the systems' times on settings they ran.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use braid_cost::cost::HostDecode;
use braid_cost::sim::{LengthDist, SimOptions};
use braid_driver::Options;
use serde::{Deserialize, Serialize};

#[derive(clap::Args)]
pub struct StudyArgs {
    /// The study's manifest (e.g. tests/fixtures/real/study.json).
    manifest: PathBuf,
    /// Iterations to simulate per system.
    #[arg(long, default_value_t = 1)]
    iterations: u32,
    /// Only the settings whose name contains this.
    #[arg(long)]
    only: Option<String>,
    /// Print the results as JSON.
    #[arg(long)]
    json: bool,
    /// Fit the engine's compute efficiency on the settings marked `calibration` — the
    /// simulated heuristic's iteration against the measured one, least squares in the
    /// logarithm — and write it into the manifest's `engine`, instead of running the study.
    #[arg(long, conflicts_with_all = ["only", "json", "iterations"])]
    calibrate: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Manifest {
    title: String,
    source: String,
    prompt_len: u64,
    /// What the measured systems achieve where it differs from the datasheet entry: set on the
    /// cluster's entry for every setting; `None`: the datasheet entry as it is.
    #[serde(default)]
    engine: Option<Engine>,
    /// The simulated system that ran the study's measured `real-heuristic` (a key of
    /// [`SYSTEMS`]); `None`: `real-heuristic`.
    #[serde(default)]
    heuristic: Option<String>,
    settings: Vec<Setting>,
}

/// The measured systems' engine: the compute efficiency their passes reach and, when their
/// decode steps are host-bound, the host's time in them.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
struct Engine {
    #[serde(default)]
    compute_efficiency: Option<f64>,
    #[serde(default)]
    host_decode: Option<HostDecode>,
}

impl Engine {
    fn apply(&self, d: &mut braid_cost::cost::DeviceSpec) {
        if let Some(e) = self.compute_efficiency {
            d.compute_efficiency = e;
        }
        if let Some(h) = &self.host_decode {
            d.host_decode = Some(h.clone());
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Setting {
    name: String,
    program: String,
    gen_len: u64,
    /// Throughput per system (`real`, `real-heuristic`, `deepspeed-chat`, `openrlhf`).
    measured_pflops: BTreeMap<String, Option<f64>>,
    /// The setting's measurements calibrated the engine: the summary counts
    /// it apart from the held-out settings.
    #[serde(default)]
    calibration: bool,
}

/// One setting's figures.
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    pub name: String,
    /// The engine was calibrated on this setting's measurements.
    pub calibration: bool,
    /// Simulated mean iteration per system (seconds); absent where the system was not
    /// simulated.
    pub simulated: BTreeMap<String, f64>,
    pub notes: Vec<String>,
    /// The iteration's FLOPs as ReaL counts them, and the iteration each measured throughput
    /// implies (seconds) per system.
    pub flops: f64,
    pub measured_seconds: BTreeMap<String, f64>,
    /// Every system's simulated result, stage breakdown included.
    pub systems: Vec<braid_passes::to_sim::SystemResult>,
    /// Braid's plan: the placement of each call.
    pub plan: Vec<String>,
    /// Braid without fusion over ReaL's heuristic: simulated, measured (ReaL over it).
    pub over_heuristic: (f64, Option<f64>),
    /// Braid with fusion over ReaL's heuristic, simulated.
    pub fused_over_heuristic: f64,
    /// Braid without fusion over DeepSpeed-Chat: simulated, measured.
    pub over_deepspeed: (Option<f64>, Option<f64>),
    /// Braid's plan (without or with fusion) is slower than the other of ReaL's simulated
    /// plans (the one not compared with the measured heuristic).
    pub slower_than_other_real: bool,
}

/// The study's summary figures: over every setting, and over the held-out ones (those the
/// engine was not calibrated on) when some were.
#[derive(Clone, Debug, Serialize)]
pub struct Summary {
    pub all: Agreement,
    pub held_out: Option<Agreement>,
    /// Settings where Braid's plan (without / with fusion) is slower than the simulated
    /// heuristic the measured one is compared with.
    pub slower_than_heuristic: Vec<String>,
    /// Settings where it is slower than another of ReaL's simulated plans (its code's
    /// heuristic or its symmetric plan, whichever is not compared).
    pub slower_than_other_real: Vec<String>,
}

/// How the simulated speed-ups agree with the measured ones over a set of settings.
#[derive(Clone, Debug, Serialize)]
pub struct Agreement {
    pub settings: usize,
    /// Settings whose simulated speed-up over the heuristic is within 25 % of the measured one.
    pub within_quarter_heuristic: usize,
    pub compared_heuristic: usize,
    pub within_quarter_deepspeed: usize,
    pub compared_deepspeed: usize,
    /// Spearman rank correlation of simulated and measured speed-ups across settings.
    pub rank_correlation_heuristic: Option<f64>,
    pub rank_correlation_deepspeed: Option<f64>,
}

const SYSTEMS: [(&str, &str); 6] = [
    ("deepspeed-chat", "deepspeed-chat"),
    ("openrlhf", "openrlhf"),
    ("real-heuristic", "real-heuristic"),
    ("real-symmetric", "real-symmetric"),
    ("braid without fusion", "braid-no-fusion"),
    ("braid", "braid"),
];

fn key_of(system: &str) -> Option<&'static str> {
    // Longest prefix first: "braid without fusion" before "braid".
    let mut best: Option<(&str, &str)> = None;
    for (prefix, key) in SYSTEMS {
        if (system == prefix || system.starts_with(&format!("{prefix} ")))
            && best.is_none_or(|(p, _)| prefix.len() > p.len())
        {
            best = Some((prefix, key));
        }
    }
    best.map(|b| b.1)
}

fn fail(path: &Path, what: impl std::fmt::Display) -> ExitCode {
    eprintln!("error: {}: {what}", path.display());
    ExitCode::from(2)
}

pub fn run(args: &StudyArgs) -> ExitCode {
    let text = match std::fs::read_to_string(&args.manifest) {
        Ok(t) => t,
        Err(e) => return fail(&args.manifest, e),
    };
    let manifest: Manifest = match serde_json::from_str(&text) {
        Ok(m) => m,
        Err(e) => return fail(&args.manifest, format!("not a study manifest: {e}")),
    };
    let dir = args.manifest.parent().unwrap_or(Path::new("."));
    let heuristic = manifest
        .heuristic
        .clone()
        .unwrap_or_else(|| "real-heuristic".to_string());
    if !SYSTEMS.iter().any(|(_, k)| *k == heuristic) {
        return fail(
            &args.manifest,
            format!(
                "`heuristic` is `{heuristic}`; the simulated systems are {}",
                SYSTEMS.map(|s| s.1).join(", ")
            ),
        );
    }
    if let Some(engine) = &manifest.engine {
        let mut d = braid_cost::cost::DeviceKind::H100.spec();
        engine.apply(&mut d);
        if let Err(e) = d.check() {
            return fail(&args.manifest, format!("`engine`: {e}"));
        }
    }
    if args.calibrate {
        return calibrate(&args.manifest, &text, &manifest, &heuristic);
    }
    let mut rows = Vec::new();
    for s in &manifest.settings {
        if args
            .only
            .as_ref()
            .is_some_and(|o| !s.name.contains(o.as_str()))
        {
            continue;
        }
        let file = dir.join(&s.program);
        eprintln!("simulating {} ({})", s.name, file.display());
        let how = How {
            prompt_len: manifest.prompt_len,
            iterations: args.iterations,
            engine: manifest.engine.clone(),
            heuristic: &heuristic,
        };
        match setting(&file, s, &how) {
            Ok(r) => rows.push(r),
            Err(code) => return code,
        }
    }
    let summary = summarise(&rows);
    if args.json {
        let out = serde_json::json!({
            "title": manifest.title,
            "source": manifest.source,
            "heuristic": heuristic,
            "engine": manifest.engine,
            "rows": rows,
            "summary": summary,
        });
        match serde_json::to_string_pretty(&out) {
            Ok(j) => println!("{j}"),
            Err(e) => return fail(&args.manifest, e),
        }
    } else {
        print!("{}", text_of(&manifest, &heuristic, &rows, &summary));
    }
    ExitCode::SUCCESS
}

/// `--calibrate`: fits `engine.compute_efficiency` so that the simulated heuristic (ReaL's
/// symmetric plan) matches its measured iterations on the calibration settings, and writes it
/// into the manifest (every other field as it was). The efficiency stands for everything
/// ReaL's passes lose against the datasheet's peak outside decoding, whose host-bound steps
/// the engine's `host_decode` prices; golden-section search in its logarithm, between 1 %
/// and 100 %, on the mean squared logarithm of simulated over measured.
fn calibrate(path: &Path, text: &str, manifest: &Manifest, heuristic: &str) -> ExitCode {
    if heuristic != "real-symmetric" {
        return fail(
            path,
            format!(
                "--calibrate fits the simulated `real-symmetric`; the manifest compares `{heuristic}`"
            ),
        );
    }
    let dir = path.parent().unwrap_or(Path::new("."));
    let mut cases = Vec::new();
    for s in manifest.settings.iter().filter(|s| s.calibration) {
        let Some(pflops) = s.measured_pflops.get("real-heuristic").copied().flatten() else {
            continue;
        };
        let file = dir.join(&s.program);
        let options = Options {
            lengths: Some(LengthDist::Fixed { len: s.gen_len }),
            prompt_len: Some(manifest.prompt_len),
            ..Options::default()
        };
        let compiled = match crate::plan::compile(&file, &options, false, &mut |_, _| {}) {
            Ok(c) => c,
            Err(code) => return code,
        };
        let Some(mut prepared) = compiled.prepared else {
            return fail(&file, "the program has no run to plan");
        };
        prepared.engine_max_batch = None;
        if let Some(e) = &manifest.engine {
            e.apply(&mut prepared.cost.device);
        }
        let measured = real_flops(&prepared) / (pflops * 1e15);
        cases.push((s.name.clone(), prepared, measured));
    }
    if cases.is_empty() {
        return fail(
            path,
            "no setting is marked `calibration` with a measured `real-heuristic`",
        );
    }
    let simulate = |a: &braid_passes::annotated::Annotated| -> Result<f64, String> {
        let opts = SimOptions {
            iterations: 1,
            seed: a.seed,
        };
        match braid_passes::to_sim::simulate_real_symmetric(a, &opts) {
            Ok(Ok(r)) => Ok(r.mean_iteration_time),
            Ok(Err(e)) => Err(e),
            Err(e) => Err(e.0),
        }
    };
    let error = |eff: f64| -> Result<f64, String> {
        let mut sum = 0.0;
        for (_, a, measured) in &cases {
            let mut a = a.clone();
            a.cost.device.compute_efficiency = eff;
            sum += (simulate(&a)? / measured).ln().powi(2);
        }
        Ok(sum / cases.len() as f64)
    };
    // Golden-section search on ln(efficiency) in [ln 0.01, ln 1].
    let phi = (5f64.sqrt() - 1.0) / 2.0;
    let (mut lo, mut hi) = (0.01f64.ln(), 0.0f64);
    let mut x1 = hi - phi * (hi - lo);
    let mut x2 = lo + phi * (hi - lo);
    let (mut f1, mut f2) = match (error(x1.exp()), error(x2.exp())) {
        (Ok(a), Ok(b)) => (a, b),
        (Err(e), _) | (_, Err(e)) => return fail(path, e),
    };
    for _ in 0..30 {
        if f1 < f2 {
            hi = x2;
            x2 = x1;
            f2 = f1;
            x1 = hi - phi * (hi - lo);
            f1 = match error(x1.exp()) {
                Ok(v) => v,
                Err(e) => return fail(path, e),
            };
        } else {
            lo = x1;
            x1 = x2;
            f1 = f2;
            x2 = lo + phi * (hi - lo);
            f2 = match error(x2.exp()) {
                Ok(v) => v,
                Err(e) => return fail(path, e),
            };
        }
    }
    let eff = (((lo + hi) / 2.0).exp() * 1e4).round() / 1e4;
    for (name, a, measured) in &cases {
        let mut a = a.clone();
        a.cost.device.compute_efficiency = eff;
        match simulate(&a) {
            Ok(t) => println!(
                "{name:<36} heuristic measured {measured:7.1} s, simulated {t:7.1} s ({:+.0} %)",
                (t / measured - 1.0) * 100.0
            ),
            Err(e) => return fail(path, e),
        }
    }
    let mut json: serde_json::Value = match serde_json::from_str(text) {
        Ok(v) => v,
        Err(e) => return fail(path, e),
    };
    let Some(obj) = json.as_object_mut() else {
        return fail(path, "not a JSON object");
    };
    let engine = obj.entry("engine").or_insert_with(|| serde_json::json!({}));
    if let Some(e) = engine.as_object_mut() {
        e.insert("compute_efficiency".into(), serde_json::json!(eff));
    }
    let written = serde_json::to_string_pretty(&json).map(|t| t + "\n");
    match written
        .map_err(|e| e.to_string())
        .and_then(|t| std::fs::write(path, t).map_err(|e| e.to_string()))
    {
        Ok(()) => {
            println!(
                "compute efficiency {eff} (mean squared log error {:.4} over {} settings) written to {}",
                error(eff).unwrap_or(f64::NAN),
                cases.len(),
                path.display()
            );
            ExitCode::SUCCESS
        }
        Err(e) => fail(path, e),
    }
}

/// How every setting of a study is simulated.
struct How<'a> {
    prompt_len: u64,
    iterations: u32,
    engine: Option<Engine>,
    /// The simulated system the measured `real-heuristic` is compared with.
    heuristic: &'a str,
}

fn setting(file: &Path, s: &Setting, how: &How) -> Result<Row, ExitCode> {
    let options = Options {
        lengths: Some(LengthDist::Fixed { len: s.gen_len }),
        prompt_len: Some(how.prompt_len),
        ..Options::default()
    };
    let compiled = crate::plan::compile(file, &options, false, &mut |_, _| {})?;
    let Some(mut prepared) = compiled.prepared else {
        return Err(fail(file, "the program has no run to plan"));
    };
    prepared.engine_max_batch = None;
    if let Some(e) = &how.engine {
        e.apply(&mut prepared.cost.device);
    }
    let opts = SimOptions {
        iterations: how.iterations.max(1),
        seed: prepared.seed,
    };
    let sys = braid_passes::to_sim::systems(&prepared, &[], &opts).map_err(|e| fail(file, e))?;
    let mut simulated = BTreeMap::new();
    for r in &sys.results {
        if let Some(k) = key_of(&r.system) {
            simulated.insert(k.to_string(), r.mean_iteration_seconds);
        }
    }
    let t = |k: &str| simulated.get(k).copied();
    let m = |k: &str| s.measured_pflops.get(k).copied().flatten();
    let flops = real_flops(&prepared);
    let measured_seconds: BTreeMap<String, f64> = s
        .measured_pflops
        .iter()
        .filter_map(|(k, v)| {
            v.filter(|x| *x > 0.0)
                .map(|x| (k.clone(), flops / (x * 1e15)))
        })
        .collect();
    let (Some(heur), Some(ours), Some(fused)) =
        (t(how.heuristic), t("braid-no-fusion"), t("braid"))
    else {
        return Err(fail(
            file,
            "the comparison lacks the heuristic or Braid's plan",
        ));
    };
    let measured_over = |base: &str| match (m("real"), m(base)) {
        (Some(r), Some(b)) if b > 0.0 => Some(r / b),
        _ => None,
    };
    // Braid's plans against the other of ReaL's baselines.
    let other_real = ["real-heuristic", "real-symmetric"]
        .iter()
        .filter(|k| **k != how.heuristic)
        .filter_map(|k| t(k))
        .fold(f64::INFINITY, f64::min);
    Ok(Row {
        name: s.name.clone(),
        calibration: s.calibration,
        slower_than_other_real: ours > other_real || fused > other_real,
        notes: sys.notes.clone(),
        over_heuristic: (heur / ours, measured_over("real-heuristic")),
        fused_over_heuristic: heur / fused,
        over_deepspeed: (
            t("deepspeed-chat").map(|d| d / ours),
            measured_over("deepspeed-chat"),
        ),
        simulated,
        flops,
        measured_seconds,
        systems: sys.results,
        plan: sys
            .full
            .calls()
            .into_iter()
            .filter_map(|id| {
                let p = sys.full.decisions.placements.get(&id)?;
                Some(format!(
                    "{}: devices {}..{} dp {} tp {} pp {} mb {}",
                    sys.full.call_name(id),
                    p.first,
                    p.first + p.count,
                    p.dp,
                    p.tp,
                    p.pp,
                    p.microbatches
                ))
            })
            .collect(),
    })
}

/// The FLOPs of one iteration as ReaL's master worker counts them (`realhf/base/monitor.py`,
/// the Megatron-LM formula): per forward of `b` sequences of `l` tokens
/// `2·layers·(4·b·l·h² + 2·b·l²·h + 3·b·l·h·ffn) + 4·b·l·vocab·h`; a training call four
/// forwards (gradient checkpointing, ReaL's default); a generation the prompt's forward plus one
/// token per sequence per step over the growing prefix. The log-probabilities of the generating
/// model are not counted: ReaL's generation returns them, where Braid's PPO computes them in a
/// call of their own.
pub fn real_flops(a: &braid_passes::annotated::Annotated) -> f64 {
    use braid_ir::graph::Op;
    let g = &a.plan.graph;
    let mut gen_model = None;
    let mut total = 0.0;
    for id in a.calls() {
        let Some(node) = g.node(id) else { continue };
        let (Some(m), Some(size)) = (node.op.model(), braid_passes::estimate::call_size(a, id))
        else {
            continue;
        };
        let Some(sh) = a.shape(m) else { continue };
        let (layers, h, ffn, vocab) = (
            sh.layers as f64,
            sh.hidden as f64,
            sh.intermediate as f64,
            sh.vocab as f64,
        );
        let b = size.samples as f64;
        let forward = |l: f64| {
            2.0 * layers * (4.0 * b * l * h * h + 2.0 * b * l * l * h + 3.0 * b * l * h * ffn)
                + 4.0 * b * l * vocab * h
        };
        let p = size.prompt_len as f64;
        let gen_len = (size.mean_seq - size.prompt_len) as f64;
        total += match node.op {
            Op::Generate { .. } => {
                gen_model = Some(m);
                let mut f = forward(p);
                for i in 0..gen_len as u64 {
                    let prefix = b * (p + i as f64);
                    f += 2.0
                        * layers
                        * (4.0 * b * h * h + 2.0 * (prefix + b) * h + 3.0 * b * h * ffn)
                        + 4.0 * b * vocab * h;
                }
                f
            }
            Op::Train { .. } => 4.0 * forward(size.mean_seq as f64),
            Op::Logprobs { .. } if Some(m) == gen_model => 0.0,
            _ => forward(size.mean_seq as f64),
        };
    }
    total
}

/// Average ranks (ties share the mean of their positions).
fn ranks(xs: &[f64]) -> Vec<f64> {
    let mut idx: Vec<usize> = (0..xs.len()).collect();
    idx.sort_by(|&a, &b| xs[a].total_cmp(&xs[b]));
    let mut r = vec![0.0; xs.len()];
    let mut i = 0;
    while i < idx.len() {
        let mut j = i;
        while j + 1 < idx.len() && xs[idx[j + 1]] == xs[idx[i]] {
            j += 1;
        }
        let mean = (i + j) as f64 / 2.0 + 1.0;
        for k in &idx[i..=j] {
            r[*k] = mean;
        }
        i = j + 1;
    }
    r
}

/// Spearman's rank correlation (Pearson's on average ranks); `None` under three pairs or with
/// no spread.
pub fn spearman(pairs: &[(f64, f64)]) -> Option<f64> {
    if pairs.len() < 3 {
        return None;
    }
    let a = ranks(&pairs.iter().map(|p| p.0).collect::<Vec<_>>());
    let b = ranks(&pairs.iter().map(|p| p.1).collect::<Vec<_>>());
    let n = a.len() as f64;
    let (ma, mb) = (a.iter().sum::<f64>() / n, b.iter().sum::<f64>() / n);
    let cov: f64 = a.iter().zip(&b).map(|(x, y)| (x - ma) * (y - mb)).sum();
    let va: f64 = a.iter().map(|x| (x - ma).powi(2)).sum();
    let vb: f64 = b.iter().map(|y| (y - mb).powi(2)).sum();
    (va > 0.0 && vb > 0.0).then(|| cov / (va * vb).sqrt())
}

fn within_quarter(sim: f64, meas: f64) -> bool {
    (sim / meas - 1.0).abs() <= 0.25
}

fn agreement(rows: &[&Row]) -> Agreement {
    let heur: Vec<(f64, f64)> = rows
        .iter()
        .filter_map(|r| r.over_heuristic.1.map(|m| (r.over_heuristic.0, m)))
        .collect();
    let ds: Vec<(f64, f64)> = rows
        .iter()
        .filter_map(|r| match r.over_deepspeed {
            (Some(s), Some(m)) => Some((s, m)),
            _ => None,
        })
        .collect();
    Agreement {
        settings: rows.len(),
        within_quarter_heuristic: heur.iter().filter(|p| within_quarter(p.0, p.1)).count(),
        compared_heuristic: heur.len(),
        within_quarter_deepspeed: ds.iter().filter(|p| within_quarter(p.0, p.1)).count(),
        compared_deepspeed: ds.len(),
        rank_correlation_heuristic: spearman(&heur),
        rank_correlation_deepspeed: spearman(&ds),
    }
}

fn summarise(rows: &[Row]) -> Summary {
    let all: Vec<&Row> = rows.iter().collect();
    let held: Vec<&Row> = rows.iter().filter(|r| !r.calibration).collect();
    Summary {
        all: agreement(&all),
        held_out: (held.len() < rows.len()).then(|| agreement(&held)),
        slower_than_heuristic: rows
            .iter()
            .filter(|r| r.over_heuristic.0 < 1.0 || r.fused_over_heuristic < 1.0)
            .map(|r| r.name.clone())
            .collect(),
        slower_than_other_real: rows
            .iter()
            .filter(|r| r.slower_than_other_real)
            .map(|r| r.name.clone())
            .collect(),
    }
}

fn opt(x: Option<f64>) -> String {
    x.map_or_else(|| "—".to_string(), |v| format!("{v:.2}x"))
}

fn text_of(m: &Manifest, heuristic: &str, rows: &[Row], s: &Summary) -> String {
    let mut o = String::new();
    let _ = writeln!(o, "{}\nsource: {}", m.title, m.source);
    let _ = writeln!(
        o,
        "the measured `real-heuristic` is compared with the simulated `{heuristic}`{}\n",
        if rows.iter().any(|r| r.calibration) {
            "; * marks a setting the engine was calibrated on"
        } else {
            ""
        }
    );
    let _ = writeln!(
        o,
        "{:<36} {:>8} {:>8} {:>9} {:>9} {:>8} {:>8} | {:>8} {:>8} {:>8} | {:>8} {:>8}",
        "setting (simulated iteration, s)",
        "ds-chat",
        "openrlhf",
        "heuristic",
        "symmetric",
        "braid-nf",
        "braid",
        "vs heur.",
        "measured",
        "fused",
        "vs ds",
        "measured"
    );
    let name = |r: &Row| format!("{}{}", r.name, if r.calibration { " *" } else { "" });
    for r in rows {
        let t = |k: &str| {
            r.simulated
                .get(k)
                .map_or_else(|| "—".to_string(), |v| format!("{v:.1}"))
        };
        let _ = writeln!(
            o,
            "{:<36} {:>8} {:>8} {:>9} {:>9} {:>8} {:>8} | {:>8} {:>8} {:>8} | {:>8} {:>8}",
            name(r),
            t("deepspeed-chat"),
            t("openrlhf"),
            t("real-heuristic"),
            t("real-symmetric"),
            t("braid-no-fusion"),
            t("braid"),
            format!("{:.2}x", r.over_heuristic.0),
            opt(r.over_heuristic.1),
            format!("{:.2}x", r.fused_over_heuristic),
            opt(r.over_deepspeed.0),
            opt(r.over_deepspeed.1),
        );
        for n in &r.notes {
            let _ = writeln!(o, "    note: {n}");
        }
    }
    let _ = writeln!(
        o,
        "\n{:<36} {:>8} | measured iteration (s): {:>7} {:>8} {:>9} {:>7} | simulated / measured: {:>7} {:>8} {:>9} {:>9}",
        "setting (as ReaL counts FLOPs)",
        "PFLOP",
        "ds-chat",
        "openrlhf",
        "heuristic",
        "real",
        "ds-chat",
        "openrlhf",
        "heuristic",
        "braid-nf"
    );
    for r in rows {
        let ms = |k: &str| r.measured_seconds.get(k).copied();
        let show = |x: Option<f64>, digits: usize| {
            x.map_or_else(|| "—".to_string(), |v| format!("{v:.digits$}"))
        };
        let ratio = |sim: &str, meas: &str| {
            show(
                r.simulated
                    .get(sim)
                    .copied()
                    .zip(ms(meas))
                    .map(|(a, b)| a / b),
                2,
            )
        };
        let _ = writeln!(
            o,
            "{:<36} {:>8.1} | {:>31} {:>8} {:>9} {:>7} | {:>29} {:>8} {:>9} {:>9}",
            name(r),
            r.flops / 1e15,
            show(ms("deepspeed-chat"), 1),
            show(ms("openrlhf"), 1),
            show(ms("real-heuristic"), 1),
            show(ms("real"), 1),
            ratio("deepspeed-chat", "deepspeed-chat"),
            ratio("openrlhf", "openrlhf"),
            ratio(heuristic, "real-heuristic"),
            ratio("braid-no-fusion", "real"),
        );
    }
    let corr = |c: Option<f64>| c.map_or_else(|| "—".to_string(), |v| format!("{v:.2}"));
    let mut agreement = |a: &Agreement, which: &str| {
        let _ = writeln!(
            o,
            "\n{which}: speed-up of Braid's plan (no fusion) over ReaL's heuristic within a quarter of the measured in {} of {} settings; rank correlation {}",
            a.within_quarter_heuristic,
            a.compared_heuristic,
            corr(a.rank_correlation_heuristic)
        );
        let _ = write!(
            o,
            "{which}: speed-up over DeepSpeed-Chat within a quarter of the measured in {} of {} settings; rank correlation {}",
            a.within_quarter_deepspeed,
            a.compared_deepspeed,
            corr(a.rank_correlation_deepspeed)
        );
    };
    agreement(&s.all, "all settings");
    if let Some(h) = &s.held_out {
        agreement(h, "held-out settings");
    }
    let _ = writeln!(o);
    if s.slower_than_heuristic.is_empty() {
        let _ = writeln!(
            o,
            "Braid's plan is never slower than the simulated `{heuristic}` ({} settings)",
            s.all.settings
        );
    } else {
        let _ = writeln!(
            o,
            "Braid's plan is slower than the simulated `{heuristic}` in: {}",
            s.slower_than_heuristic.join(", ")
        );
    }
    if !s.slower_than_other_real.is_empty() {
        let _ = writeln!(
            o,
            "Braid's plan is slower than ReaL's other simulated plan in {} settings: {}",
            s.slower_than_other_real.len(),
            s.slower_than_other_real.join(", ")
        );
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spearman_orders_and_ties() {
        let same = [(1.0, 10.0), (2.0, 20.0), (3.0, 30.0), (4.0, 35.0)];
        assert!((spearman(&same).unwrap() - 1.0).abs() < 1e-12);
        let opposite = [(1.0, 4.0), (2.0, 3.0), (3.0, 2.0), (4.0, 1.0)];
        assert!((spearman(&opposite).unwrap() + 1.0).abs() < 1e-12);
        // Ties share a rank: x = 1, 1, 2 → ranks 1.5, 1.5, 3.
        assert_eq!(ranks(&[1.0, 1.0, 2.0]), vec![1.5, 1.5, 3.0]);
        assert_eq!(spearman(&[(1.0, 1.0), (2.0, 2.0)]), None);
        assert_eq!(spearman(&[(1.0, 1.0), (1.0, 2.0), (1.0, 3.0)]), None);
    }

    #[test]
    fn systems_are_keyed_by_their_longest_prefix() {
        assert_eq!(
            key_of("braid without fusion (same passes)"),
            Some("braid-no-fusion")
        );
        assert_eq!(key_of("braid"), Some("braid"));
        assert_eq!(
            key_of("real-heuristic (ReaL's allocation for PPO)"),
            Some("real-heuristic")
        );
        assert_eq!(key_of("braid's placement without fusion"), None);
    }

    #[test]
    fn a_quarter_is_relative_to_the_measured_speed_up() {
        assert!(within_quarter(1.25, 1.0));
        assert!(!within_quarter(1.26, 1.0));
        assert!(within_quarter(0.75, 1.0));
        assert!(!within_quarter(0.74, 1.0));
    }
}
