//! One test per construct of the kernel IR, each run on both backends (`run_both` asserts that
//! the interpreter and the JIT agree bit for bit) and checked against the value the language
//! defines; plus malformed inputs, which must be errors, and the compiled-kernel cache.

mod common;

use braid_ir::kernel::{
    Arg, Batch, BinOp, FieldTy, FieldValue, Fields, IntField, Kernel, KernelBuilder, Output,
    ParamKind, Ragged, ReduceOp, RunError, SampleText, ScalarTy, Scope, StrField, Value,
};
use common::*;
use std::sync::Arc;

fn per_sample(out: Result<Output, RunError>) -> Vec<f64> {
    match out.expect("runs") {
        Output::PerSample(v) => v,
        o => panic!("expected per-sample output, got {o:?}"),
    }
}

fn per_token(out: Result<Output, RunError>) -> Vec<f64> {
    match out.expect("runs") {
        Output::PerToken { values, .. } => values,
        o => panic!("expected per-token output, got {o:?}"),
    }
}

fn batch(n: usize) -> Batch<'static> {
    Batch {
        n_samples: n,
        ..Default::default()
    }
}

/// A sample kernel with one per-token parameter `x` (and nothing else); `f` builds the body.
fn tok_kernel(f: impl FnOnce(&mut KernelBuilder, Value) -> Value) -> Kernel {
    let mut b = KernelBuilder::new("t", Scope::Sample);
    let x = b.param(ParamKind::PerToken);
    let r = f(&mut b, x);
    b.finish(r).expect("builds")
}

/// A sample kernel with one per-sample parameter `x`.
fn ps_kernel(f: impl FnOnce(&mut KernelBuilder, Value) -> Value) -> Kernel {
    let mut b = KernelBuilder::new("t", Scope::Sample);
    let x = b.param(ParamKind::PerSample);
    let r = f(&mut b, x);
    b.finish(r).expect("builds")
}

fn run_ps(k: &Kernel, xs: &[f64]) -> Vec<f64> {
    per_sample(run_both(k, &batch(xs.len()), &[Arg::PerSample(xs)]))
}

fn run_tok(k: &Kernel, values: &[f64], offsets: &[usize]) -> Result<Output, RunError> {
    run_both(
        k,
        &batch(offsets.len() - 1),
        &[Arg::PerToken(Ragged { values, offsets })],
    )
}

#[test]
fn arithmetic_promotes_and_divides_as_float() {
    // 1 + 2 * x, then 7 / 2 (ints) = 3.5 added.
    let k = ps_kernel(|b, x| {
        let one = b.int(1);
        let two = b.int(2);
        let m = b.mul(two, x);
        let s = b.add(one, m);
        let seven = b.int(7);
        let d = b.div(seven, two);
        b.add(s, d)
    });
    assert_eq!(
        run_ps(&k, &[0.5, -1.0]),
        vec![1.0 + 1.0 + 3.5, 1.0 - 2.0 + 3.5]
    );
}

#[test]
fn int_arithmetic_wraps_and_rem_is_total() {
    let mut b = KernelBuilder::new("t", Scope::Sample);
    let a = b.param(ParamKind::Scalar(ScalarTy::Int));
    let d = b.param(ParamKind::Scalar(ScalarTy::Int));
    let r = b.rem(a, d);
    let k = b.finish(r).expect("builds");
    let run = |a: i64, d: i64| per_sample(run_both(&k, &batch(1), &[Arg::Int(a), Arg::Int(d)]))[0];
    assert_eq!(run(7, 3), 1.0);
    assert_eq!(run(-7, 3), -1.0);
    assert_eq!(run(7, 0), 0.0);
    assert_eq!(run(i64::MIN, -1), 0.0);

    let mut b = KernelBuilder::new("t", Scope::Sample);
    let a = b.param(ParamKind::Scalar(ScalarTy::Int));
    let one = b.int(1);
    let s = b.add(a, one);
    let n = b.neg(s);
    let k = b.finish(n).expect("builds");
    let out = per_sample(run_both(&k, &batch(1), &[Arg::Int(i64::MAX)]));
    assert_eq!(out, vec![i64::MIN as f64]); // -(MAX + 1) wraps to MIN, and -MIN is MIN
}

#[test]
fn float_rem_is_rust_rem() {
    let k = ps_kernel(|b, x| {
        let m = b.float(0.75);
        b.rem(x, m)
    });
    let xs = [2.0, -2.0, 0.0, f64::INFINITY];
    let out = run_ps(&k, &xs);
    for (o, x) in out.iter().zip(xs) {
        assert!(same(*o, x % 0.75), "{x} % 0.75");
    }
}

#[test]
fn min_max_clamp_follow_fsem() {
    let k = ps_kernel(|b, x| {
        let z = b.float(0.0);
        b.max(x, z)
    });
    let out = run_ps(&k, &[-1.0, 2.0, f64::NAN, -0.0]);
    assert_eq!(out[0], 0.0);
    assert_eq!(out[1], 2.0);
    assert!(out[2].is_nan());
    assert_eq!(out[3].to_bits(), 0.0f64.to_bits()); // max(-0.0, 0.0) picks b
    let k = ps_kernel(|b, x| {
        let lo = b.float(-1.0);
        let hi = b.float(1.0);
        b.clamp(x, lo, hi)
    });
    assert_eq!(run_ps(&k, &[-5.0, 0.25, 5.0]), vec![-1.0, 0.25, 1.0]);
    let k = ps_kernel(|b, x| {
        let n = b.float(f64::NAN);
        b.min(n, x) // NaN first: NaN
    });
    assert!(run_ps(&k, &[1.0])[0].is_nan());
}

#[test]
fn math_functions() {
    let k = ps_kernel(|b, x| {
        let e = b.exp(x);
        let l = b.log(e);
        let a = b.abs(x);
        let s = b.sqrt(a);
        let sum = b.add(l, s);
        let n = b.neg(sum);
        b.sub(n, x)
    });
    let xs = [0.3, -2.0, 4.0];
    let out = run_ps(&k, &xs);
    for (o, x) in out.iter().zip(xs) {
        let want = -(x.exp().ln() + x.abs().sqrt()) - x;
        assert!(same(*o, want));
    }
}

#[test]
fn comparisons_and_booleans() {
    // (x > 0.0 && !(x == 2.0)) || x <= -5.0, as a float result
    let k = ps_kernel(|b, x| {
        let z = b.float(0.0);
        let gt = b.cmp(BinOp::Gt, x, z);
        let c = b.and_then(gt, |b| {
            let two = b.float(2.0);
            let eq = b.cmp(BinOp::Eq, x, two);
            b.not(eq)
        });
        b.or_else(c, |b| {
            let m5 = b.int(-5);
            b.cmp(BinOp::Le, x, m5)
        })
    });
    assert_eq!(
        run_ps(&k, &[1.0, 2.0, -1.0, -5.0, f64::NAN]),
        vec![1.0, 0.0, 0.0, 1.0, 0.0]
    );
    let k = ps_kernel(|b, x| b.cmp(BinOp::Ne, x, x));
    assert_eq!(run_ps(&k, &[1.0, f64::NAN]), vec![0.0, 1.0]);
}

#[test]
fn if_else_evaluates_the_taken_branch_and_promotes() {
    let k = ps_kernel(|b, x| {
        let z = b.float(0.0);
        let c = b.cmp(BinOp::Lt, x, z);
        b.if_else(c, |b| b.int(-1), |b| b.mul(x, x))
    });
    assert_eq!(run_ps(&k, &[-3.0, 3.0]), vec![-1.0, 9.0]);
    assert!(k.to_string().contains("to_float"), "{k}");
}

#[test]
fn index_out_of_range_reads_zero() {
    // x[t + 1] - x[t - 1] for t = 0 and t = len - 1 and a wild index.
    let k = tok_kernel(|b, x| {
        let n = b.len();
        let one = b.int(1);
        let last = b.sub(n, one);
        let beyond = b.index(x, n);
        let before = b.int(-1);
        let neg = b.index(x, before);
        let huge = b.int(i64::MAX);
        let wild = b.index(x, huge);
        let l = b.index(x, last);
        let s = b.add(beyond, neg);
        let s = b.add(s, wild);
        b.add(s, l)
    });
    let out = per_sample(run_tok(&k, &[1.0, 2.0, 3.0, 9.0], &[0, 3, 3, 4]));
    assert_eq!(out, vec![3.0, 0.0, 9.0]);
}

#[test]
fn elementwise_per_token_arithmetic_with_scalars() {
    // 0.5 * d * d + exp(d) - 1.0 with d = x - 1
    let k = tok_kernel(|b, x| {
        let one = b.float(1.0);
        let d = b.sub(x, one);
        let h = b.float(0.5);
        let hd = b.mul(h, d);
        let sq = b.mul(hd, d);
        let e = b.exp(d);
        let s = b.add(sq, e);
        b.sub(s, one)
    });
    let xs = [1.0, 2.0, -0.5];
    let out = per_token(run_tok(&k, &xs, &[0, 2, 3]));
    for (o, x) in out.iter().zip(xs) {
        let d = x - 1.0;
        assert!(same(*o, 0.5 * d * d + d.exp() - 1.0));
    }
}

#[test]
fn sample_reductions() {
    let xs = [1.0, -2.0, 0.0, 4.0, 5.0];
    let offsets = [0, 4, 4, 5];
    for op in [
        ReduceOp::Sum,
        ReduceOp::Mean,
        ReduceOp::Max,
        ReduceOp::Min,
        ReduceOp::Count,
        ReduceOp::Std,
    ] {
        let k = tok_kernel(|b, x| b.reduce(op, x));
        let out = per_sample(run_tok(&k, &xs, &offsets));
        let want: Vec<f64> = match op {
            ReduceOp::Sum => vec![3.0, 0.0, 5.0],
            ReduceOp::Mean => vec![0.75, 0.0, 5.0],
            ReduceOp::Max => vec![4.0, f64::NEG_INFINITY, 5.0],
            ReduceOp::Min => vec![-2.0, f64::INFINITY, 5.0],
            ReduceOp::Count => vec![3.0, 0.0, 1.0],
            ReduceOp::Std => {
                let m: f64 = 0.75;
                let v = [1.0f64, -2.0, 0.0, 4.0]
                    .iter()
                    .fold(0.0, |a, x| a + (x - m) * (x - m))
                    / 4.0;
                vec![v.sqrt(), 0.0, 0.0]
            }
        };
        assert_eq!(out, want, "{op:?}");
    }
    let k = tok_kernel(|b, x| b.reduce(ReduceOp::Max, x));
    assert!(per_sample(run_tok(&k, &[1.0, f64::NAN, 2.0], &[0, 3]))[0].is_nan());
}

#[test]
fn scans_forward_and_reverse() {
    for reverse in [false, true] {
        let k = tok_kernel(|b, x| {
            let init = b.int(10);
            b.scan(reverse, init, |b, t, acc| {
                let xt = b.index(x, t);
                let tf = b.to_float(t);
                let s = b.add(acc, xt);
                b.add(s, tf)
            })
        });
        let out = per_token(run_tok(&k, &[1.0, 2.0, 3.0, 7.0], &[0, 3, 3, 4]));
        let want = if reverse {
            vec![19.0, 18.0, 15.0, 17.0]
        } else {
            vec![11.0, 14.0, 19.0, 17.0]
        };
        assert_eq!(out, want, "reverse = {reverse}");
    }
}

#[test]
fn sample_fields_and_len() {
    let mut b = KernelBuilder::new("t", Scope::Sample);
    let s = b.sample_param();
    let l = b.sample_int(s, IntField::Length);
    let g = b.sample_int(s, IntField::Group);
    let hundred = b.int(100);
    let gg = b.mul(g, hundred);
    let r = b.add(l, gg);
    let k = b.finish(r).expect("builds");
    let texts = vec![SampleText::default(); 2];
    let out = per_sample(run_both(
        &k,
        &Batch {
            n_samples: 2,
            lengths: Some(&[3, 5]),
            groups: Some(&[7, 1]),
            texts: Some(&texts),
        },
        &[Arg::Sample],
    ));
    assert_eq!(out, vec![703.0, 105.0]);
}

#[test]
fn host_builtins() {
    // vowel_share: count(s.completion, r"[aeiou]") / max(len(s.completion), 1)
    let mut b = KernelBuilder::new("vowel_share", Scope::Sample);
    let s = b.sample_param();
    let c = b.count_regex(s, StrField::Completion, "[aeiou]");
    let n = b.str_len(s, StrField::Completion);
    let one = b.int(1);
    let m = b.max(n, one);
    let r = b.div(c, m);
    let k = b.finish(r).expect("builds");
    let texts: Vec<SampleText> = ["banana", "", "xyz"]
        .iter()
        .map(|c| SampleText {
            completion: (*c).into(),
            ..Default::default()
        })
        .collect();
    let out = per_sample(run_both(
        &k,
        &Batch {
            n_samples: 3,
            texts: Some(&texts),
            ..Default::default()
        },
        &[Arg::Sample],
    ));
    assert_eq!(out, vec![0.5, 0.0, 0.0]);

    // Each boolean built-in contributes one bit.
    let mut b = KernelBuilder::new("bits", Scope::Sample);
    let s = b.sample_param();
    let checks = [
        b.matches_regex(s, StrField::Prompt, "^Q:"),
        b.contains(s, StrField::Completion, "answer"),
        b.starts_with(s, StrField::Completion, "The"),
        b.ends_with(s, StrField::Completion, "."),
        b.answer_matches(s, StrField::Completion, StrField::Answer),
    ];
    let mut acc = b.int(0);
    for (i, c) in checks.into_iter().enumerate() {
        let bit = b.if_else(c, |b| b.int(1 << i), |b| b.int(0));
        acc = b.add(acc, bit);
    }
    let k = b.finish(acc).expect("builds");
    let texts = vec![
        SampleText {
            prompt: "Q: sum?".into(),
            completion: "The answer is \\boxed{1,000}.".into(),
            answer: "1000".into(),
            ..Default::default()
        },
        SampleText {
            prompt: "sum?".into(),
            completion: "no idea".into(),
            answer: "3".into(),
            ..Default::default()
        },
    ];
    let out = per_sample(run_both(
        &k,
        &Batch {
            n_samples: 2,
            texts: Some(&texts),
            ..Default::default()
        },
        &[Arg::Sample],
    ));
    assert_eq!(out, vec![31.0, 0.0]);
}

#[test]
fn record_fields_and_string_equality() {
    // field_float(s, "weight") * field_int(s, "difficulty")
    //   + (if field_bool(s, "hard") { 100 } else { 0 })
    //   + (if field(s, "topic") == "math" { 10 } else { 0 })
    //   + (if s.completion == field(s, "topic") { 1000 } else { 0 })
    let mut b = KernelBuilder::new("fields", Scope::Sample);
    let s = b.sample_param();
    let topic = StrField::Record("topic".into());
    let w = b.record_field(s, "weight", ScalarTy::Float);
    let d = b.record_field(s, "difficulty", ScalarTy::Int);
    let h = b.record_field(s, "hard", ScalarTy::Bool);
    let m = b.str_equals(s, topic.clone(), "math");
    let same_text = b.texts_equal(s, StrField::Completion, topic);
    let x = b.mul(w, d);
    let h = b.if_else(h, |b| b.float(100.0), |b| b.float(0.0));
    let m = b.if_else(m, |b| b.float(10.0), |b| b.float(0.0));
    let e = b.if_else(same_text, |b| b.float(1000.0), |b| b.float(0.0));
    let x = b.add(x, h);
    let x = b.add(x, m);
    let r = b.add(x, e);
    let k = b.finish(r).expect("builds");
    let sample = |w: FieldValue, d: i64, hard: bool, topic: &str, completion: &str| {
        let mut fields = Fields::new();
        fields.insert("weight".into(), w);
        fields.insert("difficulty".into(), FieldValue::Int(d));
        fields.insert("hard".into(), FieldValue::Bool(hard));
        fields.insert("topic".into(), FieldValue::Str(topic.into()));
        SampleText {
            completion: completion.into(),
            fields,
            ..Default::default()
        }
    };
    let mut texts = vec![
        sample(FieldValue::Float(0.5), 3, true, "math", "math"),
        // An int field read as a float widens.
        sample(FieldValue::Int(2), 2, false, "art", "x"),
    ];
    let batch = |texts: &[SampleText]| -> Result<Output, RunError> {
        run_both(
            &k,
            &Batch {
                n_samples: texts.len(),
                texts: Some(texts),
                ..Default::default()
            },
            &[Arg::Sample],
        )
    };
    assert_eq!(per_sample(batch(&texts)), vec![1111.5, 4.0]);
    // A sample without a field the kernel reads, or with the wrong type, is an error on both
    // backends before any sample runs.
    texts[1].fields.remove("hard");
    let e = batch(&texts).unwrap_err();
    assert!(
        matches!(&e, RunError::Field { sample: 1, name, .. } if name == "hard"),
        "{e}"
    );
    texts[1]
        .fields
        .insert("hard".into(), FieldValue::Str("yes".into()));
    let e = batch(&texts).unwrap_err().to_string();
    assert!(
        e.contains("sample 1")
            && e.contains("`hard`")
            && e.contains("field_bool")
            && e.contains("has a string"),
        "{e}"
    );
    assert_eq!(
        k.record_fields()
            .iter()
            .map(|f| (f.name.as_str(), f.ty))
            .collect::<Vec<_>>(),
        vec![
            ("difficulty", FieldTy::Int),
            ("hard", FieldTy::Bool),
            ("topic", FieldTy::Str),
            ("weight", FieldTy::Float)
        ]
    );
}

#[test]
fn group_and_batch_scope_reductions() {
    // r - mean(r) + count(r) over group; per-sample argument.
    let mut b = KernelBuilder::new("g", Scope::Group);
    let r = b.param(ParamKind::PerSample);
    let m = b.scope_reduce(ReduceOp::Mean, r);
    let c = b.scope_reduce(ReduceOp::Count, r);
    let d = b.sub(r, m);
    let out = b.add(d, c);
    let k = b.finish(out).expect("builds");
    let rs = [1.0, 3.0, 0.0, 10.0];
    let groups = [0, 0, 5, 5];
    let got = per_sample(run_both(
        &k,
        &Batch {
            n_samples: 4,
            groups: Some(&groups),
            ..Default::default()
        },
        &[Arg::PerSample(&rs)],
    ));
    assert_eq!(got, vec![-1.0 + 2.0, 1.0 + 2.0, -5.0 + 1.0, 5.0 + 1.0]);

    // max over all tokens of the batch, per-token output x / max.
    let mut b = KernelBuilder::new("b", Scope::Batch);
    let x = b.param(ParamKind::PerToken);
    let mx = b.scope_reduce(ReduceOp::Max, x);
    let q = b.div(x, mx);
    let k = b.finish(q).expect("builds");
    let got = per_token(run_tok(&k, &[1.0, 4.0, 2.0], &[0, 1, 1, 3]));
    assert_eq!(got, vec![0.25, 1.0, 0.5]);
}

#[test]
fn int_and_bool_results_become_floats() {
    let k = tok_kernel(|b, x| b.reduce(ReduceOp::Count, x));
    assert_eq!(
        per_sample(run_tok(&k, &[1.0, 0.0, -0.0, f64::NAN], &[0, 4])),
        vec![2.0]
    );
    let k = ps_kernel(|b, x| {
        let z = b.float(0.0);
        b.cmp(BinOp::Ge, x, z)
    });
    assert_eq!(run_ps(&k, &[1.0, -1.0]), vec![1.0, 0.0]);
}

#[test]
fn malformed_inputs_are_errors() {
    let k = kl(1);
    let v = [1.0, 2.0, 3.0];
    let good = [0usize, 1, 3];
    let run = |o1: &[usize], o2: &[usize], n: usize| {
        run_both(
            &k,
            &batch(n),
            &[
                Arg::PerToken(Ragged {
                    values: &v,
                    offsets: o1,
                }),
                Arg::PerToken(Ragged {
                    values: &v,
                    offsets: o2,
                }),
            ],
        )
    };
    assert!(run(&good, &good, 2).is_ok());
    assert!(matches!(
        run(&[0, 3], &good, 2),
        Err(RunError::BadRagged { index: 0, .. })
    ));
    assert!(matches!(
        run(&good, &[1, 2, 3], 2),
        Err(RunError::BadRagged { index: 1, .. })
    ));
    assert!(matches!(
        run(&good, &[0, 2, 1], 2),
        Err(RunError::BadRagged { index: 1, .. })
    ));
    assert!(matches!(
        run(&good, &[0, 1, 2], 2),
        Err(RunError::BadRagged { index: 1, .. })
    ));
    // Equal totals, different per-sample lengths: caught at entry.
    let w = [1.0, 2.0, 3.0];
    let out = run_both(
        &k,
        &batch(2),
        &[
            Arg::PerToken(Ragged {
                values: &v,
                offsets: &good,
            }),
            Arg::PerToken(Ragged {
                values: &w,
                offsets: &[0, 2, 3],
            }),
        ],
    );
    assert_eq!(
        out,
        Err(RunError::LengthMismatch {
            sample: 0,
            index: 1,
            expected: 1,
            got: 2
        })
    );
    assert!(matches!(
        run_both(&k, &batch(2), &[Arg::PerSample(&v)]),
        Err(RunError::ArgCount {
            expected: 2,
            got: 1
        })
    ));
    assert!(matches!(
        run_both(&k, &batch(2), &[Arg::PerSample(&v), Arg::Float(1.0)]),
        Err(RunError::ArgKind { index: 0, .. })
    ));
    // batch.lengths disagreeing with the tokens.
    let out = run_both(
        &k,
        &Batch {
            n_samples: 2,
            lengths: Some(&[1, 1]),
            ..Default::default()
        },
        &[
            Arg::PerToken(Ragged {
                values: &v,
                offsets: &good,
            }),
            Arg::PerToken(Ragged {
                values: &v,
                offsets: &good,
            }),
        ],
    );
    assert!(matches!(
        out,
        Err(RunError::LengthMismatch { sample: 1, .. })
    ));

    let ps = ps_kernel(|_, x| x);
    assert!(matches!(
        run_both(&ps, &batch(4), &[Arg::PerSample(&v)]),
        Err(RunError::PerSampleLen { .. })
    ));
    let g = normalize(Scope::Group, false);
    assert_eq!(
        run_both(&g, &batch(3), &[Arg::PerSample(&v), Arg::Float(0.0)]),
        Err(RunError::Missing("groups"))
    );
    let out = run_both(
        &g,
        &Batch {
            n_samples: 3,
            groups: Some(&[1]),
            ..Default::default()
        },
        &[Arg::PerSample(&v), Arg::Float(0.0)],
    );
    assert!(matches!(
        out,
        Err(RunError::BatchLen {
            field: "groups",
            ..
        })
    ));

    let mut b = KernelBuilder::new("t", Scope::Sample);
    let s = b.sample_param();
    let r = b.str_len(s, StrField::Prompt);
    let hk = b.finish(r).expect("builds");
    assert_eq!(
        run_both(&hk, &batch(1), &[Arg::Sample]),
        Err(RunError::Missing("texts"))
    );
    let mut b = KernelBuilder::new("t", Scope::Sample);
    let s = b.sample_param();
    let r = b.sample_int(s, IntField::Length);
    let lk = b.finish(r).expect("builds");
    assert_eq!(
        run_both(&lk, &batch(1), &[Arg::Sample]),
        Err(RunError::Missing("lengths"))
    );
}

#[test]
fn empty_batches_run() {
    let out = run_both(
        &gae(),
        &batch(0),
        &[
            Arg::PerToken(Ragged {
                values: &[],
                offsets: &[0],
            }),
            Arg::PerToken(Ragged {
                values: &[],
                offsets: &[0],
            }),
            Arg::Float(1.0),
            Arg::Float(1.0),
        ],
    );
    assert_eq!(
        out,
        Ok(Output::PerToken {
            values: vec![],
            offsets: vec![0]
        })
    );
}

#[test]
fn compiled_kernels_are_cached_by_structure() {
    let jit = braid_jit::Jit::new().expect("host ISA");
    let a = jit.compile(&gae()).expect("compiles");
    let b = jit.compile(&gae()).expect("compiles");
    assert!(Arc::ptr_eq(&a, &b));
    let mut renamed = gae();
    renamed.name = "other_name".into();
    assert!(Arc::ptr_eq(&a, &jit.compile(&renamed).expect("compiles")));
    let c = jit.compile(&discounted_returns()).expect("compiles");
    assert!(!Arc::ptr_eq(&a, &c));
    assert_eq!(jit.cached(), 2);
}

#[test]
fn invalid_kernels_are_rejected_by_both_backends() {
    let mut k = gae();
    k.blocks[0].result = None;
    assert!(braid_ir::kernel::Interpreter::new(k.clone()).is_err());
    assert!(matches!(
        jit().compile(&k),
        Err(braid_jit::JitError::Verify(_))
    ));
}

#[test]
fn compiled_kernels_can_be_shared_across_threads() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<braid_jit::Jit>();
    send_sync::<braid_jit::CompiledKernel>();
    send_sync::<braid_ir::kernel::Interpreter>();
    // And they do run from another thread.
    let k = jit().compile(&kl(2)).expect("compiles");
    let v = [1.0, 3.0];
    let out = std::thread::spawn(move || {
        braid_ir::kernel::KernelExec::run(
            &*k,
            &batch(1),
            &[
                Arg::PerToken(Ragged {
                    values: &v,
                    offsets: &[0, 2],
                }),
                Arg::PerToken(Ragged {
                    values: &[0.0, 1.0],
                    offsets: &[0, 2],
                }),
            ],
        )
    })
    .join()
    .expect("thread");
    assert_eq!(per_token(out), vec![0.5, 2.0]);
}

#[test]
fn scope_reductions_of_scope_reductions() {
    // c = r - mean(r) over the group; c / (std(c) + 1.0) + sum(c * c): two pre-passes.
    let mut b = KernelBuilder::new("g2", Scope::Group);
    let r = b.param(ParamKind::PerSample);
    let m = b.scope_reduce(ReduceOp::Mean, r);
    let c = b.sub(r, m);
    let s = b.scope_reduce(ReduceOp::Std, c);
    let cc = b.mul(c, c);
    let q = b.scope_reduce(ReduceOp::Sum, cc);
    let one = b.float(1.0);
    let den = b.add(s, one);
    let x = b.div(c, den);
    let out = b.add(x, q);
    let k = b.finish(out).expect("builds");
    let rs = [1.0, 2.5, -3.0, 10.0, 0.25];
    let groups = [3, 1, 3, 1, 3];
    let got = per_sample(run_both(
        &k,
        &Batch {
            n_samples: 5,
            groups: Some(&groups),
            ..Default::default()
        },
        &[Arg::PerSample(&rs)],
    ));
    let want: Vec<f64> = (0..5)
        .map(|i| {
            let members: Vec<f64> = (0..5)
                .filter(|&j| groups[j] == groups[i])
                .map(|j| rs[j])
                .collect();
            let n = members.len() as f64;
            let m = members.iter().fold(0.0, |a, x| a + x) / n;
            let cs: Vec<f64> = members.iter().map(|x| x - m).collect();
            let cm = cs.iter().fold(0.0, |a, x| a + x) / n;
            let sd = (cs.iter().fold(0.0, |a, x| a + (x - cm) * (x - cm)) / n).sqrt();
            let q = cs.iter().fold(0.0, |a, x| a + x * x);
            (rs[i] - m) / (sd + 1.0) + q
        })
        .collect();
    assert_eq!(got, want);
}
