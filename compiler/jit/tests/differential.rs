//! Property tests: the JIT agrees with the interpreter bit for bit (NaN-aware) on random
//! well-typed kernels and random ragged inputs, and both agree with plain Rust implementations
//! of the standard estimators.

mod common;

use braid_ir::kernel::random::random_case;
use braid_ir::kernel::{Arg, Batch, Output, Ragged, Scope};
use common::*;
use proptest::prelude::*;

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn jit_agrees_with_interpreter(bytes in proptest::collection::vec(any::<u8>(), 0..400)) {
        let case = random_case(&bytes).map_err(|e| TestCaseError::fail(format!("generator: {e}")))?;
        let args = case.inputs.args();
        // Agreement (and no panic) is asserted inside; either both succeed or both fail alike.
        let _ = run_both(&case.kernel, &case.inputs.batch(), &args);
    }
}

/// Ragged inputs: per-sample lengths and two token arrays.
fn ragged() -> impl Strategy<Value = (Vec<usize>, Vec<f64>, Vec<f64>)> {
    proptest::collection::vec(0usize..12, 0..8).prop_flat_map(|lens| {
        let total: usize = lens.iter().sum();
        let vals = proptest::collection::vec(-10.0f64..10.0, total);
        (Just(lens), vals.clone(), vals)
    })
}

fn offsets(lens: &[usize]) -> Vec<usize> {
    let mut o = vec![0];
    for l in lens {
        o.push(o.last().copied().unwrap_or(0) + l);
    }
    o
}

fn per_token(out: &Output) -> &[f64] {
    match out {
        Output::PerToken { values, .. } => values,
        Output::PerSample(_) => panic!("expected per-token output"),
    }
}

fn assert_same(got: &[f64], want: &[f64]) {
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(same(*g, *w), "element {i}: got {g:?}, want {w:?}");
    }
}

/// GAE as the textbook loop, in the kernel's operation order.
fn gae_ref(r: &[f64], v: &[f64], gamma: f64, lambda: f64) -> Vec<f64> {
    let n = r.len();
    let mut out = vec![0.0; n];
    let mut acc = 0.0;
    for t in (0..n).rev() {
        let v_next = if t + 1 < n { v[t + 1] } else { 0.0 };
        let delta = r[t] + gamma * v_next - v[t];
        acc = delta + gamma * lambda * acc;
        out[t] = acc;
    }
    out
}

fn mean_std(xs: &[f64]) -> (f64, f64) {
    if xs.is_empty() {
        return (0.0, 0.0);
    }
    let n = xs.len() as f64;
    let m = xs.iter().fold(0.0, |a, x| a + x) / n;
    let var = xs.iter().fold(0.0, |a, x| a + (x - m) * (x - m)) / n;
    (m, var.sqrt())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn gae_matches_reference((lens, r, v) in ragged(), gamma in 0.5f64..1.0, lambda in 0.5f64..1.0) {
        let off = offsets(&lens);
        let out = run_both(
            &gae(),
            &Batch { n_samples: lens.len(), ..Default::default() },
            &[Arg::PerToken(Ragged { values: &r, offsets: &off }), Arg::PerToken(Ragged { values: &v, offsets: &off }), Arg::Float(gamma), Arg::Float(lambda)],
        ).unwrap();
        let want: Vec<f64> = (0..lens.len()).flat_map(|i| gae_ref(&r[off[i]..off[i + 1]], &v[off[i]..off[i + 1]], gamma, lambda)).collect();
        assert_same(per_token(&out), &want);
    }

    #[test]
    fn discounted_returns_match_reference((lens, r, _v) in ragged(), gamma in 0.0f64..1.0) {
        let off = offsets(&lens);
        let out = run_both(
            &discounted_returns(),
            &Batch { n_samples: lens.len(), ..Default::default() },
            &[Arg::PerToken(Ragged { values: &r, offsets: &off }), Arg::Float(gamma)],
        ).unwrap();
        let mut want = Vec::new();
        for i in 0..lens.len() {
            let s = &r[off[i]..off[i + 1]];
            let mut ret = vec![0.0; s.len()];
            let mut acc = 0.0;
            for t in (0..s.len()).rev() {
                acc = s[t] + gamma * acc;
                ret[t] = acc;
            }
            want.extend(ret);
        }
        assert_same(per_token(&out), &want);
    }

    #[test]
    fn kl_estimators_match_reference((lens, logp, refp) in ragged()) {
        let off = offsets(&lens);
        let args = [Arg::PerToken(Ragged { values: &logp, offsets: &off }), Arg::PerToken(Ragged { values: &refp, offsets: &off })];
        let batch = Batch { n_samples: lens.len(), ..Default::default() };
        for which in 1..=3u8 {
            let out = run_both(&kl(which), &batch, &args).unwrap();
            let want: Vec<f64> = logp.iter().zip(&refp).map(|(&l, &r)| match which {
                1 => l - r,
                2 => 0.5 * (l - r) * (l - r),
                _ => (r - l).exp() - (r - l) - 1.0,
            }).collect();
            assert_same(per_token(&out), &want);
        }
    }

    #[test]
    fn group_normalize_matches_reference(r in proptest::collection::vec(-5.0f64..5.0, 0..16), groups_seed in proptest::collection::vec(0i64..4, 16)) {
        let n = r.len();
        let groups = &groups_seed[..n];
        let eps = 1e-6;
        let out = run_both(
            &normalize(Scope::Group, false),
            &Batch { n_samples: n, groups: Some(groups), ..Default::default() },
            &[Arg::PerSample(&r), Arg::Float(eps)],
        ).unwrap();
        let want: Vec<f64> = (0..n).map(|i| {
            let members: Vec<f64> = (0..n).filter(|&j| groups[j] == groups[i]).map(|j| r[j]).collect();
            let (m, s) = mean_std(&members);
            (r[i] - m) / (s + eps)
        }).collect();
        match &out {
            Output::PerSample(v) => assert_same(v, &want),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn whiten_matches_reference((lens, a, _v) in ragged()) {
        let off = offsets(&lens);
        let eps = 1e-8;
        let out = run_both(
            &normalize(Scope::Batch, true),
            &Batch { n_samples: lens.len(), ..Default::default() },
            &[Arg::PerToken(Ragged { values: &a, offsets: &off }), Arg::Float(eps)],
        ).unwrap();
        let (m, s) = mean_std(&a);
        let want: Vec<f64> = a.iter().map(|x| (x - m) / (s + eps)).collect();
        assert_same(per_token(&out), &want);
    }
}

/// The operands of an instruction, for mutation.
fn operands_mut(op: &mut braid_ir::kernel::Op) -> Vec<&mut braid_ir::kernel::Value> {
    use braid_ir::kernel::Op;
    match op {
        Op::Unary(_, a) | Op::Reduce(_, a) | Op::ScopeReduce(_, a) => vec![a],
        Op::Binary(_, a, b) => vec![a, b],
        Op::Index { tokens, index } => vec![tokens, index],
        Op::If { cond, .. } => vec![cond],
        Op::Scan { init, .. } => vec![init],
        _ => vec![],
    }
}

/// Breaks a valid kernel in a small random way.
fn mutate(k: &mut braid_ir::kernel::Kernel, u: &mut braid_ir::kernel::random::Bytes<'_>) {
    use braid_ir::kernel::{Op, Ty, Value};
    let n = k.insts.len();
    let i = u.below(n);
    match u.below(5) {
        0 => {
            let target = Value(u.below(n + 2) as u32);
            let mut ops = operands_mut(&mut k.insts[i].op);
            let j = u.below(ops.len());
            if let Some(v) = ops.get_mut(j) {
                **v = target;
            }
        }
        1 => k.insts[i].ty = [Ty::Int, Ty::Float, Ty::Bool, Ty::Tokens][u.below(4)],
        2 => {
            let b = u.below(k.blocks.len());
            let len = k.blocks[b].insts.len();
            if len > 1 {
                let (x, y) = (u.below(len), u.below(len));
                k.blocks[b].insts.swap(x, y);
            }
        }
        3 => {
            if let Op::Param(p) = &mut k.insts[i].op {
                *p = u.below(k.params.len() + 1) as u32;
            } else {
                k.insts[i].op = Op::Param(u.below(k.params.len() + 1) as u32);
            }
        }
        _ => {
            let b = u.below(k.blocks.len());
            k.blocks[b].result = Some(Value(u.below(n + 1) as u32));
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, failure_persistence: None, ..ProptestConfig::default() })]

    /// The verifier is the JIT's safety gate: on mutated kernels it must not panic, and whatever
    /// it accepts must run on both backends, in agreement.
    #[test]
    fn verifier_guards_the_backends(bytes in proptest::collection::vec(any::<u8>(), 0..400), mutations in proptest::collection::vec(any::<u8>(), 1..16)) {
        let mut case = random_case(&bytes).map_err(|e| TestCaseError::fail(format!("generator: {e}")))?;
        let mut u = braid_ir::kernel::random::Bytes::new(&mutations);
        for _ in 0..1 + u.below(3) {
            mutate(&mut case.kernel, &mut u);
        }
        if braid_ir::kernel::verify(&case.kernel).is_ok() {
            let args = case.inputs.args();
            let _ = run_both(&case.kernel, &case.inputs.batch(), &args);
        } else {
            prop_assert!(braid_ir::kernel::Interpreter::new(case.kernel.clone()).is_err());
            prop_assert!(jit().compile(&case.kernel).is_err());
        }
    }
}
