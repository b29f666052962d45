//! The standard library's `fn`s, written in the language, lowered to kernels and run by both
//! backends: the JIT and the interpreter agree bit for bit, and both agree with straightforward
//! Rust implementations of GAE, discounted returns, group normalisation, whitening and the KL
//! estimators. Also `braid eval` end to end.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::process::Command;

use braid_ir::kernel::{Arg, Batch, Interpreter, KernelExec, Output, Ragged};
use braid_sema::hir::FnId;

fn stdlib_program() -> braid_sema::Checked {
    let src = "use std::advantages\nuse std::kl\nuse std::rewards\nuse std::grpo\n";
    let checked = braid_sema::check("all.rlhf", src, &braid_sema::NoImports);
    assert!(!checked.has_errors(), "{:?}", checked.diagnostics);
    checked
}

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
    fn f(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64 * 4.0 - 2.0
    }
}

struct Data {
    a: (Vec<f64>, Vec<usize>),
    b: (Vec<f64>, Vec<usize>),
    r: Vec<f64>,
    groups: Vec<i64>,
}

fn data(seed: u64, n: usize) -> Data {
    let mut rng = Rng(seed);
    let (mut av, mut bv, mut offsets) = (Vec::new(), Vec::new(), vec![0]);
    for _ in 0..n {
        let len = (rng.next() % 9) as usize;
        for _ in 0..len {
            av.push(rng.f());
            bv.push(rng.f());
        }
        offsets.push(av.len());
    }
    let r = (0..n).map(|_| rng.f()).collect();
    let groups = (0..n).map(|i| (i / 4) as i64).collect();
    Data {
        a: (av, offsets.clone()),
        b: (bv, offsets),
        r,
        groups,
    }
}

fn run_both(
    program: &braid_sema::hir::Program,
    name: &str,
    strings: &[(&str, &str)],
    batch: &Batch<'_>,
    args: &[Arg<'_>],
) -> Output {
    let fid = program.fns.iter().position(|f| f.name == name).unwrap();
    let strings: BTreeMap<String, String> = strings
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let lowered = braid_sema::lower_kernel::lower_fn(program, FnId(fid as u32), &strings).unwrap();
    let interp = Interpreter::new(lowered.kernel.clone())
        .unwrap()
        .run(batch, args)
        .unwrap();
    let jit = braid_jit::Jit::new()
        .unwrap()
        .compile(&lowered.kernel)
        .unwrap()
        .run(batch, args)
        .unwrap();
    let bits = |o: &Output| match o {
        Output::PerSample(v) => v.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        Output::PerToken { values, .. } => values.iter().map(|x| x.to_bits()).collect(),
    };
    assert_eq!(
        bits(&interp),
        bits(&jit),
        "{name}: JIT and interpreter differ"
    );
    jit
}

fn tokens(o: &Output) -> &[f64] {
    match o {
        Output::PerToken { values, .. } => values,
        Output::PerSample(_) => panic!("expected a per-token result"),
    }
}

fn samples(o: &Output) -> &[f64] {
    match o {
        Output::PerSample(v) => v,
        Output::PerToken { .. } => panic!("expected a per-sample result"),
    }
}

fn close(a: &[f64], b: &[f64], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            (x - y).abs() <= 1e-12 * (1.0 + y.abs()),
            "{what}[{i}]: {x} vs {y}"
        );
    }
}

#[test]
fn stdlib_kernels_match_reference_implementations() {
    let checked = stdlib_program();
    let p = &checked.program;
    for seed in 0..20 {
        let d = data(seed, 12);
        let ra = Ragged {
            values: &d.a.0,
            offsets: &d.a.1,
        };
        let rb = Ragged {
            values: &d.b.0,
            offsets: &d.b.1,
        };
        let batch = Batch {
            n_samples: 12,
            lengths: None,
            groups: Some(&d.groups),
            texts: None,
        };
        let spans: Vec<(usize, usize)> = d.a.1.windows(2).map(|w| (w[0], w[1])).collect();

        // GAE and discounted returns, token by token from the end.
        let (gamma, lambda) = (0.9, 0.8);
        let got = run_both(
            p,
            "gae",
            &[],
            &batch,
            &[
                Arg::PerToken(ra),
                Arg::PerToken(rb),
                Arg::Float(gamma),
                Arg::Float(lambda),
            ],
        );
        let mut want = vec![0.0; d.a.0.len()];
        let mut ret = vec![0.0; d.a.0.len()];
        for &(s, e) in &spans {
            let (mut acc, mut g) = (0.0, 0.0);
            for t in (s..e).rev() {
                let next_v = if t + 1 < e { d.b.0[t + 1] } else { 0.0 };
                acc = d.a.0[t] + gamma * next_v - d.b.0[t] + gamma * lambda * acc;
                want[t] = acc;
                g = d.a.0[t] + gamma * g;
                ret[t] = g;
            }
        }
        close(tokens(&got), &want, "gae");
        let got = run_both(
            p,
            "discounted_returns",
            &[],
            &batch,
            &[Arg::PerToken(ra), Arg::Float(gamma)],
        );
        close(tokens(&got), &ret, "discounted_returns");

        // KL estimators.
        for (name, f) in [
            ("kl_k1", (|l: f64, r: f64| l - r) as fn(f64, f64) -> f64),
            ("kl_k2", |l, r| 0.5 * (l - r) * (l - r)),
            ("kl_k3", |l, r| (r - l).exp() - (r - l) - 1.0),
        ] {
            let got = run_both(
                p,
                name,
                &[],
                &batch,
                &[Arg::PerToken(ra), Arg::PerToken(rb)],
            );
            let want: Vec<f64> = d.a.0.iter().zip(&d.b.0).map(|(l, r)| f(*l, *r)).collect();
            close(tokens(&got), &want, name);
            let est = &name[3..];
            let got = run_both(
                p,
                "kl",
                &[("estimator", est)],
                &batch,
                &[Arg::PerToken(ra), Arg::PerToken(rb)],
            );
            close(tokens(&got), &want, "kl by name");
        }

        // Group normalisation: per group, (r - mean) / (std + eps), population std.
        let eps = 1e-6;
        let got = run_both(
            p,
            "group_normalize",
            &[],
            &batch,
            &[Arg::PerSample(&d.r), Arg::Float(eps)],
        );
        let mut want = vec![0.0; 12];
        for g in 0..3 {
            let idx: Vec<usize> = (0..12).filter(|&i| d.groups[i] == g).collect();
            let m = idx.iter().map(|&i| d.r[i]).sum::<f64>() / idx.len() as f64;
            let sd = (idx
                .iter()
                .map(|&i| (d.r[i] - m) * (d.r[i] - m))
                .sum::<f64>()
                / idx.len() as f64)
                .sqrt();
            for &i in &idx {
                want[i] = (d.r[i] - m) / (sd + eps);
            }
        }
        close(samples(&got), &want, "group_normalize");

        // Whitening over all tokens of the batch.
        let got = run_both(
            p,
            "whiten",
            &[],
            &batch,
            &[Arg::PerToken(ra), Arg::Float(1e-8)],
        );
        let n = d.a.0.len() as f64;
        let m = d.a.0.iter().sum::<f64>() / n;
        let sd = (d.a.0.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / n).sqrt();
        let want: Vec<f64> = d.a.0.iter().map(|x| (x - m) / (sd + 1e-8)).collect();
        close(tokens(&got), &want, "whiten");
    }
}

#[test]
fn every_stdlib_function_lowers() {
    let checked = stdlib_program();
    for (i, f) in checked.program.fns.iter().enumerate() {
        // Losses lower to objectives, not kernels (`compiler/sema/tests/lower_loss.rs`).
        if f.is_loss() {
            continue;
        }
        let lowered =
            braid_sema::lower_kernel::lower_fn(&checked.program, FnId(i as u32), &BTreeMap::new());
        assert!(lowered.is_ok(), "{}: {:?}", f.name, lowered.err());
    }
}

fn braid(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_braid"))
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn eval_prints_one_result_per_sample_and_names_bad_lines() {
    let dir = std::env::temp_dir().join(format!("braid-eval-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let samples = dir.join("s.jsonl");
    std::fs::write(
        &samples,
        "{\"completion\": \"aeiou\"}\n{\"completion\": \"xyz\"}\n",
    )
    .unwrap();
    let s = samples.to_str().unwrap();
    let out = braid(&[
        "eval",
        "examples/quickstart.rlhf",
        "--fn",
        "vowel_share",
        "--samples",
        s,
    ]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2);
    assert_eq!(lines[0]["value"], 1.0);
    assert_eq!(lines[1]["value"], 0.0);
    let interp = braid(&[
        "eval",
        "examples/quickstart.rlhf",
        "--fn",
        "vowel_share",
        "--samples",
        s,
        "--interpret",
    ]);
    assert_eq!(
        interp.stdout, out.stdout,
        "--interpret gives the same output"
    );

    std::fs::write(
        &samples,
        "{\"r\": [1.0, 2.0], \"v\": [0.0, 0.0]}\n{\"r\": [1.0], \"v\": [0.0, 1.0]}\n",
    )
    .unwrap();
    std::fs::write(dir.join("f.rlhf"), "use std::advantages\n").unwrap();
    let f = dir.join("f.rlhf");
    let bad = braid(&["eval", f.to_str().unwrap(), "--fn", "gae", "--samples", s]);
    assert_eq!(bad.status.code(), Some(1));
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(
        err.contains("s.jsonl:2") && err.contains("different lengths"),
        "{err}"
    );

    std::fs::write(&samples, "{\"r\": [1.0, 2.0]}\n").unwrap();
    let missing = braid(&["eval", f.to_str().unwrap(), "--fn", "gae", "--samples", s]);
    assert!(String::from_utf8_lossy(&missing.stderr).contains("s.jsonl:1: missing field `v`"));
    std::fs::write(&samples, "not json\n").unwrap();
    let garbage = braid(&["eval", f.to_str().unwrap(), "--fn", "gae", "--samples", s]);
    assert!(String::from_utf8_lossy(&garbage.stderr).contains("s.jsonl:1: not valid JSON"));
    let unknown = braid(&["eval", f.to_str().unwrap(), "--fn", "nope", "--samples", s]);
    assert_eq!(unknown.status.code(), Some(2));
}

/// A reward that reads its records' other fields and compares texts, written in the language:
/// both backends agree, and `braid eval` reads the fields from the samples file, naming the
/// line of a sample without one.
const FIELD_REWARD: &str = r#"
fn weighted(s: Sample) -> float {
  let base = if answer_matches(s.completion, s.answer) { 1.0 } else { 0.0 }
  let bonus = if field(s, "topic") == "math" && field_bool(s, "verified") { 0.5 } else { 0.0 }
  let same = if s.completion != field(s, "topic") { 0.0 } else { 100.0 }
  base * field_float(s, "weight") * field_int(s, "difficulty") + bonus + same
}
"#;

#[test]
fn record_fields_reach_a_reward_on_both_backends() {
    use braid_ir::kernel::{FieldTy, FieldValue, Fields, SampleText};
    let checked = braid_sema::check("fields.rlhf", FIELD_REWARD, &braid_sema::NoImports);
    assert!(!checked.has_errors(), "{:?}", checked.diagnostics);
    let lowered =
        braid_sema::lower_kernel::lower_fn(&checked.program, FnId(0), &BTreeMap::new()).unwrap();
    let fields: Vec<(String, FieldTy)> = lowered
        .kernel
        .record_fields()
        .into_iter()
        .map(|f| (f.name, f.ty))
        .collect();
    assert_eq!(
        fields,
        vec![
            ("difficulty".to_string(), FieldTy::Int),
            ("topic".to_string(), FieldTy::Str),
            ("verified".to_string(), FieldTy::Bool),
            ("weight".to_string(), FieldTy::Float),
        ]
    );
    let text = |completion: &str, answer: &str, topic: &str, weight: FieldValue, d: i64| {
        let mut f = Fields::new();
        f.insert("topic".into(), FieldValue::Str(topic.into()));
        f.insert("verified".into(), FieldValue::Bool(true));
        f.insert("weight".into(), weight);
        f.insert("difficulty".into(), FieldValue::Int(d));
        SampleText {
            prompt: String::new(),
            completion: completion.into(),
            answer: answer.into(),
            fields: f,
        }
    };
    let texts = vec![
        text("so 12", "12", "math", FieldValue::Float(0.5), 2),
        text("so 12", "13", "art", FieldValue::Int(3), 2),
        text("art", "1", "art", FieldValue::Int(1), 1),
    ];
    let batch = Batch {
        n_samples: 3,
        texts: Some(&texts),
        ..Default::default()
    };
    let out = run_both(&checked.program, "weighted", &[], &batch, &[Arg::Sample]);
    assert_eq!(samples(&out), &[1.5, 0.0, 100.0]);
}

#[test]
fn eval_reads_record_fields_and_names_a_line_without_one() {
    let dir = std::env::temp_dir().join(format!("braid-eval-fields-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let program = dir.join("r.rlhf");
    std::fs::write(&program, FIELD_REWARD).unwrap();
    let samples = dir.join("s.jsonl");
    let line = |topic: &str, weight: &str| {
        format!(
            "{{\"completion\": \"12\", \"answer\": \"12\", \"topic\": \"{topic}\", \"verified\": true, \"weight\": {weight}, \"difficulty\": 2}}\n"
        )
    };
    std::fs::write(&samples, line("math", "0.25") + &line("art", "1")).unwrap();
    let args = |s: &std::path::Path| {
        vec![
            "eval".to_string(),
            program.to_str().unwrap().to_string(),
            "--fn".into(),
            "weighted".into(),
            "--samples".into(),
            s.to_str().unwrap().to_string(),
        ]
    };
    let run = |s: &std::path::Path| {
        let a = args(s);
        braid(&a.iter().map(String::as_str).collect::<Vec<_>>())
    };
    let out = run(&samples);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let values: Vec<f64> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["value"]
                .as_f64()
                .unwrap()
        })
        .collect();
    assert_eq!(values, vec![1.0, 2.0]);
    // The second line lacks `difficulty`; then it holds a string where an int is read.
    let full = line("math", "1");
    std::fs::write(
        &samples,
        full.clone() + &full.replace(", \"difficulty\": 2", ""),
    )
    .unwrap();
    let err = String::from_utf8_lossy(&run(&samples).stderr).to_string();
    assert!(
        err.contains("s.jsonl:2")
            && err.contains("no field `difficulty`")
            && err.contains("field_int"),
        "{err}"
    );
    std::fs::write(
        &samples,
        full.replace("\"difficulty\": 2", "\"difficulty\": \"2\""),
    )
    .unwrap();
    let err = String::from_utf8_lossy(&run(&samples).stderr).to_string();
    assert!(
        err.contains("s.jsonl:1") && err.contains("is a string") && err.contains("field_int"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
