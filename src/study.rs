//! `braid sim study MANIFEST.json`: simulates the settings of a published throughput study and
//! sets the simulated speed-ups beside the measured ones.
//!
//! The manifest names the source, the prompt length and, per setting, a program (relative to
//! the manifest), the generated length (every answer that long, as the study fixes it) and the
//! measured throughput of each system (`null` where the study reports it out of memory). Every
//! system in a setting runs the same work, so a ratio of throughputs is the inverse ratio of
//! iteration times. The command prints, per setting, the simulated iteration of each system and
//! the speed-ups of Braid's plan without fusion (the ReaL-style plan: searched placement and
//! reallocation, no RLHFuse fusion) over ReaL's heuristic and over DeepSpeed-Chat, simulated
//! and measured; then how many settings agree within a quarter, the rank correlation across
//! settings, and whether Braid's plan is ever slower than the heuristic. Generation is
//! simulated with no batch cap (ReaL's engine decodes the whole batch at once, memory
//! permitting), for every system but those whose own engines bound it (DeepSpeed-Chat,
//! OpenRLHF).
//!
//! The joint-memory check of `braid plan` (`E0504`, which prices Braid's runtime holding every
//! model resident) is not applied: the study predicts the systems' times on settings they ran.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

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
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Manifest {
    title: String,
    source: String,
    prompt_len: u64,
    settings: Vec<Setting>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Setting {
    name: String,
    program: String,
    gen_len: u64,
    /// Throughput per system (`real`, `real-heuristic`, `deepspeed-chat`, `openrlhf`).
    measured_pflops: BTreeMap<String, Option<f64>>,
}

/// One setting's figures.
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    pub name: String,
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
}

/// The study's summary figures.
#[derive(Clone, Debug, Serialize)]
pub struct Summary {
    pub settings: usize,
    /// Settings whose simulated speed-up over the heuristic is within 25 % of the measured one.
    pub within_quarter_heuristic: usize,
    pub compared_heuristic: usize,
    pub within_quarter_deepspeed: usize,
    pub compared_deepspeed: usize,
    /// Spearman rank correlation of simulated and measured speed-ups across settings.
    pub rank_correlation_heuristic: Option<f64>,
    pub rank_correlation_deepspeed: Option<f64>,
    /// Settings where Braid's plan (without / with fusion) is slower than the heuristic.
    pub slower_than_heuristic: Vec<String>,
}

const SYSTEMS: [(&str, &str); 5] = [
    ("deepspeed-chat", "deepspeed-chat"),
    ("openrlhf", "openrlhf"),
    ("real-heuristic", "real-heuristic"),
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
        match setting(&file, s, manifest.prompt_len, args.iterations) {
            Ok(r) => rows.push(r),
            Err(code) => return code,
        }
    }
    let summary = summarise(&rows);
    if args.json {
        let out = serde_json::json!({
            "title": manifest.title,
            "source": manifest.source,
            "rows": rows,
            "summary": summary,
        });
        match serde_json::to_string_pretty(&out) {
            Ok(j) => println!("{j}"),
            Err(e) => return fail(&args.manifest, e),
        }
    } else {
        print!("{}", text_of(&manifest, &rows, &summary));
    }
    ExitCode::SUCCESS
}

fn setting(file: &Path, s: &Setting, prompt_len: u64, iterations: u32) -> Result<Row, ExitCode> {
    let options = Options {
        lengths: Some(LengthDist::Fixed { len: s.gen_len }),
        prompt_len: Some(prompt_len),
        ..Options::default()
    };
    let compiled = crate::plan::compile(file, &options, false, &mut |_, _| {})?;
    let Some(mut prepared) = compiled.prepared else {
        return Err(fail(file, "the program has no run to plan"));
    };
    prepared.engine_max_batch = None;
    let opts = SimOptions {
        iterations: iterations.max(1),
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
        (t("real-heuristic"), t("braid-no-fusion"), t("braid"))
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
    Ok(Row {
        name: s.name.clone(),
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

fn summarise(rows: &[Row]) -> Summary {
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
    Summary {
        settings: rows.len(),
        within_quarter_heuristic: heur.iter().filter(|p| within_quarter(p.0, p.1)).count(),
        compared_heuristic: heur.len(),
        within_quarter_deepspeed: ds.iter().filter(|p| within_quarter(p.0, p.1)).count(),
        compared_deepspeed: ds.len(),
        rank_correlation_heuristic: spearman(&heur),
        rank_correlation_deepspeed: spearman(&ds),
        slower_than_heuristic: rows
            .iter()
            .filter(|r| r.over_heuristic.0 < 1.0 || r.fused_over_heuristic < 1.0)
            .map(|r| r.name.clone())
            .collect(),
    }
}

fn opt(x: Option<f64>) -> String {
    x.map_or_else(|| "—".to_string(), |v| format!("{v:.2}x"))
}

fn text_of(m: &Manifest, rows: &[Row], s: &Summary) -> String {
    let mut o = String::new();
    let _ = writeln!(o, "{}\nsource: {}\n", m.title, m.source);
    let _ = writeln!(
        o,
        "{:<34} {:>9} {:>9} {:>9} {:>9} {:>9} | {:>9} {:>9} {:>9} | {:>9} {:>9}",
        "setting (simulated iteration, s)",
        "ds-chat",
        "openrlhf",
        "heuristic",
        "braid-nf",
        "braid",
        "vs heur.",
        "measured",
        "fused",
        "vs ds",
        "measured"
    );
    for r in rows {
        let t = |k: &str| {
            r.simulated
                .get(k)
                .map_or_else(|| "—".to_string(), |v| format!("{v:.1}"))
        };
        let _ = writeln!(
            o,
            "{:<34} {:>9} {:>9} {:>9} {:>9} {:>9} | {:>9} {:>9} {:>9} | {:>9} {:>9}",
            r.name,
            t("deepspeed-chat"),
            t("openrlhf"),
            t("real-heuristic"),
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
        "\n{:<34} {:>8} | measured iteration (s): {:>7} {:>8} {:>9} {:>7} | simulated / measured: {:>7} {:>8} {:>9} {:>9}",
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
            "{:<34} {:>8.1} | {:>31} {:>8} {:>9} {:>7} | {:>29} {:>8} {:>9} {:>9}",
            r.name,
            r.flops / 1e15,
            show(ms("deepspeed-chat"), 1),
            show(ms("openrlhf"), 1),
            show(ms("real-heuristic"), 1),
            show(ms("real"), 1),
            ratio("deepspeed-chat", "deepspeed-chat"),
            ratio("openrlhf", "openrlhf"),
            ratio("real-heuristic", "real-heuristic"),
            ratio("braid-no-fusion", "real"),
        );
    }
    let corr = |c: Option<f64>| c.map_or_else(|| "—".to_string(), |v| format!("{v:.2}"));
    let _ = writeln!(
        o,
        "\nspeed-up of Braid's plan (no fusion) over ReaL's heuristic: within a quarter of the measured in {} of {} settings; rank correlation {}",
        s.within_quarter_heuristic,
        s.compared_heuristic,
        corr(s.rank_correlation_heuristic)
    );
    let _ = writeln!(
        o,
        "speed-up over DeepSpeed-Chat: within a quarter of the measured in {} of {} settings; rank correlation {}",
        s.within_quarter_deepspeed,
        s.compared_deepspeed,
        corr(s.rank_correlation_deepspeed)
    );
    if s.slower_than_heuristic.is_empty() {
        let _ = writeln!(
            o,
            "Braid's plan is never slower than the heuristic ({} settings)",
            s.settings
        );
    } else {
        let _ = writeln!(
            o,
            "Braid's plan is slower than the heuristic in: {}",
            s.slower_than_heuristic.join(", ")
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
