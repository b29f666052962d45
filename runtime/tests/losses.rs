//! The standard library's losses, lowered from the language and evaluated with libtorch's
//! autograd, against independent references:
//!
//! - GSPO, DAPO and CISPO agree with NumPy implementations of their papers' formulas
//!   (`scripts/loss_reference.py`, gradients derived by hand), loss and gradient with respect
//!   to every log-probability, within 1e-6, on random mini-batches;
//! - every reduction gives the same loss and gradient whether a mini-batch is evaluated at once
//!   or as micro-batches whose gradients accumulate (token, sequence and group means divide by
//!   the mini-batch's counts).
//!
//! NumPy comes with `scripts/setup` (into `.venv`); `BRAID_NUMPY_PYTHON` names another Python.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use braid_ir::graph::NodeId;
use braid_ir::loss::{InputKind, Objective};
use braid_runtime::training::objective::{Layout, Outputs, evaluate};
use braid_sema::hir::{FnId, SigTy, Value};
use braid_sema::lower_loss::{LossArg, LossTree, lower_objective};
use tch::{Kind, Tensor};

/// SplitMix64, for reproducible inputs.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [lo, hi).
    fn f(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (self.next() >> 11) as f64 / (1u64 << 53) as f64 * (hi - lo)
    }
}

/// A random mini-batch: groups of 2 to 4 samples of 1 to 8 tokens.
struct Batch {
    lengths: Vec<usize>,
    groups: Vec<usize>,
    logp: Vec<f64>,
    old_logp: Vec<f64>,
    adv: Vec<f64>,
}

fn batch(seed: u64, spread: f64) -> Batch {
    let mut rng = Rng(seed);
    let mut b = Batch {
        lengths: vec![],
        groups: vec![],
        logp: vec![],
        old_logp: vec![],
        adv: vec![],
    };
    for g in 0..5 {
        for _ in 0..2 + rng.next() % 3 {
            let len = 1 + (rng.next() % 8) as usize;
            b.lengths.push(len);
            b.groups.push(g);
            b.adv.push(rng.f(-1.5, 1.5));
            for _ in 0..len {
                let lp = rng.f(-3.0, -0.05);
                b.logp.push(lp);
                b.old_logp.push(lp + rng.f(-spread, spread));
            }
        }
    }
    b
}

const OLD: NodeId = NodeId(1);
const ADV: NodeId = NodeId(2);

/// The objective of a loss `name` of a program, called with the model, `old_logp` (node 1),
/// `adv` (node 2, per sample) and the constants in `set` (defaults for the others).
fn objective(src: &str, name: &str, set: &[(&str, f64)]) -> (Objective, Vec<NodeId>) {
    let checked = braid_sema::check("t.rlhf", src, &braid_sema::NoImports);
    assert!(!checked.has_errors(), "{:?}", checked.diagnostics);
    let p = &checked.program;
    let i = p.fns.iter().position(|f| f.name == name).unwrap();
    let args = p.fns[i]
        .params
        .iter()
        .map(|param| match (&param.ty, param.name.as_str()) {
            (SigTy::Model, _) => LossArg::Model(0),
            (_, "old_logp") => LossArg::Node {
                node: OLD,
                kind: InputKind::PerToken,
            },
            (_, "adv") => LossArg::Node {
                node: ADV,
                kind: InputKind::PerSample,
            },
            (_, n) => LossArg::Const(match set.iter().find(|(k, _)| *k == n) {
                Some((_, v)) => Value::Float(*v),
                None => match &param.default.as_ref().unwrap().kind {
                    braid_sema::hir::ExprKind::Lit(v) => v.clone(),
                    other => panic!("{n}: {other:?}"),
                },
            }),
        })
        .collect();
    let tree = LossTree::Call {
        f: FnId(i as u32),
        args,
    };
    lower_objective(p, &tree).unwrap()
}

/// Loss and gradient with respect to `logp`, the mini-batch split into micro-batches of
/// `micro` samples whose gradients accumulate (f64 throughout).
fn run(o: &Objective, nodes: &[NodeId], b: &Batch, micro: usize) -> (f64, Vec<f64>) {
    let logp = Tensor::from_slice(&b.logp).set_requires_grad(true);
    let old = Tensor::from_slice(&b.old_logp);
    let adv = Tensor::from_slice(&b.adv);
    let n = b.lengths.len();
    let mut loss = 0.0;
    let mut start_sample = 0;
    let mut start_token = 0;
    while start_sample < n {
        let end_sample = (start_sample + micro).min(n);
        let lens = &b.lengths[start_sample..end_sample];
        let t: usize = lens.iter().sum();
        let layout = Layout::new(
            lens,
            &b.groups[start_sample..end_sample],
            &b.lengths,
            &b.groups,
        );
        let lp = logp.narrow(0, start_token as i64, t as i64);
        let inputs: Vec<Tensor> = nodes
            .iter()
            .map(|node| match *node {
                OLD => old.narrow(0, start_token as i64, t as i64),
                ADV => adv.narrow(0, start_sample as i64, (end_sample - start_sample) as i64),
                other => panic!("unexpected input {other}"),
            })
            .collect();
        let outputs = Outputs {
            logp: Some(&lp),
            ..Outputs::default()
        };
        let ev = evaluate(o, &inputs, &outputs, &layout).unwrap();
        loss += ev.loss.double_value(&[]);
        ev.loss.backward();
        start_sample = end_sample;
        start_token += t;
    }
    let grad = Vec::<f64>::try_from(logp.grad().to_kind(Kind::Double)).unwrap();
    (loss, grad)
}

/// The Python that has NumPy.
fn numpy_python() -> PathBuf {
    if let Ok(p) = std::env::var("BRAID_NUMPY_PYTHON") {
        return PathBuf::from(p);
    }
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../.venv/bin/python")
}

fn reference(loss: &str, b: &Batch, lo: f64, hi: f64) -> (f64, Vec<f64>) {
    let py = numpy_python();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/loss_reference.py");
    let query = serde_json::json!({
        "loss": loss,
        "lengths": b.lengths,
        "logp": b.logp,
        "old_logp": b.old_logp,
        "adv": b.adv,
        "clip_low": lo,
        "clip_high": hi,
    });
    let mut child = Command::new(&py)
        .arg(&script)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| {
            panic!(
                "cannot run {} ({e}): run scripts/setup, which installs NumPy into .venv, or set BRAID_NUMPY_PYTHON",
                py.display()
            )
        });
    child
        .stdin
        .take()
        .unwrap()
        .write_all(query.to_string().as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{} failed (is NumPy installed? scripts/setup installs it): {}",
        script.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let grad = v["grad"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect();
    (v["loss"].as_f64().unwrap(), grad)
}

fn close(what: &str, got: f64, want: f64) {
    assert!(
        (got - want).abs() <= 1e-6,
        "{what}: braid {got}, reference {want}"
    );
}

#[test]
fn gspo_dapo_and_cispo_match_numpy_references_of_their_formulas() {
    let cases = [
        // (loss, its parameters, the spread of log-ratios, the ranges given to the reference)
        ("gspo", vec![], 0.0008, (3e-4, 4e-4)),
        (
            "gspo",
            vec![("clip_low", 0.05), ("clip_high", 0.08)],
            0.4,
            (0.05, 0.08),
        ),
        ("dapo", vec![], 0.4, (0.2, 0.28)),
        (
            "dapo",
            vec![("clip_low", 0.1), ("clip_high", 0.3)],
            0.6,
            (0.1, 0.3),
        ),
        ("cispo", vec![], 0.4, (1.0, 0.28)),
        (
            "cispo",
            vec![("clip_low", 0.2), ("clip_high", 0.2)],
            0.6,
            (0.2, 0.2),
        ),
    ];
    let mut clipped_and_not = [false, false];
    for (i, (loss, set, spread, (lo, hi))) in cases.iter().enumerate() {
        let (o, nodes) = objective("use std::losses\n", &format!("{loss}_loss"), set);
        for seed in 0..4u64 {
            let b = batch(seed * 31 + i as u64, *spread);
            let (want_loss, want_grad) = reference(loss, &b, *lo, *hi);
            for micro in [usize::MAX, 3] {
                let (got_loss, got_grad) = run(&o, &nodes, &b, micro);
                let what = format!("{loss} case {i} seed {seed} micro {micro}");
                close(&what, got_loss, want_loss);
                assert_eq!(got_grad.len(), want_grad.len());
                for (t, (g, w)) in got_grad.iter().zip(&want_grad).enumerate() {
                    close(&format!("{what}: d/dlogp[{t}]"), *g, *w);
                }
            }
            for g in &want_grad {
                clipped_and_not[usize::from(*g != 0.0)] = true;
            }
        }
    }
    // The inputs reach both sides of the clip ranges: some gradients vanish, some do not.
    assert_eq!(clipped_and_not, [true, true]);
}

#[test]
fn reductions_accumulate_exactly_over_micro_batches() {
    let src = "fn means(policy: Model, old_logp: PerToken, adv: PerSample) -> Loss {
  let d = policy.logp - old_logp
  batch_mean(d * d) + batch_mean(mean(adv * d)) + group_mean(exp(d)) + group_mean(adv * sum(d)) + batch_sum(d) / 7.0
}
";
    let (o, nodes) = objective(src, "means", &[]);
    for seed in 0..3 {
        let b = batch(seed + 100, 0.5);
        let (whole, gw) = run(&o, &nodes, &b, usize::MAX);
        for micro in [1, 2, 5] {
            let (split, gs) = run(&o, &nodes, &b, micro);
            assert!((whole - split).abs() < 1e-12, "{whole} vs {split}");
            for (a, c) in gw.iter().zip(&gs) {
                assert!((a - c).abs() < 1e-12, "micro {micro}: {a} vs {c}");
            }
        }
        // And the values are the means they say, computed directly.
        let n = b.lengths.len() as f64;
        let t = b.logp.len() as f64;
        let d: Vec<f64> = b.logp.iter().zip(&b.old_logp).map(|(x, y)| x - y).collect();
        let mut at = 0;
        let (mut tok, mut seq, mut sum) = (0.0, 0.0, 0.0);
        let mut per_group: std::collections::BTreeMap<usize, (f64, f64, f64, f64)> =
            Default::default();
        for (i, &len) in b.lengths.iter().enumerate() {
            let ds = &d[at..at + len];
            tok += ds.iter().map(|x| x * x).sum::<f64>();
            seq += ds.iter().map(|x| b.adv[i] * x).sum::<f64>() / len as f64;
            sum += ds.iter().sum::<f64>();
            let e = per_group.entry(b.groups[i]).or_default();
            e.0 += ds.iter().map(|x| x.exp()).sum::<f64>();
            e.1 += len as f64;
            e.2 += b.adv[i] * ds.iter().sum::<f64>();
            e.3 += 1.0;
            at += len;
        }
        let g = per_group.len() as f64;
        let group_tok: f64 = per_group.values().map(|e| e.0 / e.1).sum::<f64>() / g;
        let group_smp: f64 = per_group.values().map(|e| e.2 / e.3).sum::<f64>() / g;
        let want = tok / t + seq / n + group_tok + group_smp + sum / 7.0;
        assert!((whole - want).abs() < 1e-9, "{whole} vs {want}");
    }
}
