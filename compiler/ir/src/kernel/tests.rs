//! Unit tests of the kernel IR itself: the builder's typing and misuse errors, the verifier's
//! rejections, the text form, the structural hash, and the shared float semantics. Backend
//! agreement is tested in `braid-jit`.

use super::exec::{Arg, Batch, Ragged};
use super::*;

fn gae() -> Kernel {
    let mut b = KernelBuilder::new("gae", Scope::Sample);
    let r = b.param(ParamKind::PerToken);
    let v = b.param(ParamKind::PerToken);
    let gamma = b.param(ParamKind::Scalar(ScalarTy::Float));
    let lambda = b.param(ParamKind::Scalar(ScalarTy::Float));
    let zero = b.float(0.0);
    let adv = b.scan(true, zero, |b, t, acc| {
        let rt = b.index(r, t);
        let one = b.int(1);
        let t1 = b.add(t, one);
        let vn = b.index(v, t1);
        let gv = b.mul(gamma, vn);
        let s = b.add(rt, gv);
        let vt = b.index(v, t);
        let delta = b.sub(s, vt);
        let gl = b.mul(gamma, lambda);
        let gla = b.mul(gl, acc);
        b.add(delta, gla)
    });
    b.finish(adv).unwrap()
}

const GAE_TEXT: &str =
    "kernel gae(p0: per_token, p1: per_token, p2: float, p3: float) over sample {
  %0: tokens = param p0
  %1: tokens = param p1
  %2: float = param p2
  %3: float = param p3
  %4: float = const 0.0
  %18: tokens = scan reverse init %4 (%5: int, %6: float) {
    %7: float = index %0[%5]
    %8: int = const 1
    %9: int = add %5, %8
    %10: float = index %1[%9]
    %11: float = mul %2, %10
    %12: float = add %7, %11
    %13: float = index %1[%5]
    %14: float = sub %12, %13
    %15: float = mul %2, %3
    %16: float = mul %15, %6
    %17: float = add %14, %16
    yield %17
  }
  return %18
}
";

const GAE_HASH: u64 = 0x1810_10ed_7e20_3c97;

#[test]
fn text_form_of_gae() {
    assert_eq!(gae().to_string(), GAE_TEXT);
}

#[test]
fn structural_hash_ignores_the_name_and_sees_everything_else() {
    let a = gae();
    let mut b = gae();
    b.name = "renamed".into();
    assert_eq!(a.structural_hash(), b.structural_hash());
    assert!(a.same_structure(&b));
    let mut c = gae();
    c.insts[4].op = Op::ConstFloat(1.0f64.to_bits());
    assert_ne!(a.structural_hash(), c.structural_hash());
    let mut d = gae();
    d.scope = Scope::Batch;
    assert_ne!(a.structural_hash(), d.structural_hash());
    // Pinned: a change here means cached compilations keyed by the old hash are orphaned,
    // which is fine, but it should be a conscious change of the IR or the hasher.
    assert_eq!(a.structural_hash(), GAE_HASH, "{:#x}", a.structural_hash());
}

#[test]
fn builder_promotes_like_the_language() {
    let mut b = KernelBuilder::new("t", Scope::Sample);
    let x = b.param(ParamKind::PerToken);
    let i = b.int(2);
    let f = b.float(0.5);
    let ii = b.add(i, i);
    assert_eq!(b.ty(ii), Some(Ty::Int));
    let d = b.div(i, i);
    assert_eq!(b.ty(d), Some(Ty::Float));
    let m = b.mul(i, f);
    assert_eq!(b.ty(m), Some(Ty::Float));
    let xt = b.mul(x, i);
    assert_eq!(b.ty(xt), Some(Ty::Tokens));
    let e = b.exp(i);
    assert_eq!(b.ty(e), Some(Ty::Float));
    let a = b.abs(i);
    assert_eq!(b.ty(a), Some(Ty::Int));
    let c = b.cmp(BinOp::Lt, i, f);
    assert_eq!(b.ty(c), Some(Ty::Bool));
    let k = b.finish(xt).unwrap();
    assert_eq!(k.result_kind(), Some(ResultKind::PerToken));
}

fn misuse(k: Result<Kernel, BuildError>) -> String {
    match k {
        Err(BuildError::Misuse(m)) => m,
        other => panic!("expected a misuse, got {other:?}"),
    }
}

#[test]
fn builder_reports_misuse_at_finish() {
    let mut b = KernelBuilder::new("t", Scope::Sample);
    let _first = b.int(1);
    let late = b.param(ParamKind::PerSample);
    assert!(misuse(b.finish(late)).contains("parameters must be declared"));

    let mut b = KernelBuilder::new("t", Scope::Sample);
    let t = b.bool(true);
    let one = {
        let o = b.int(1);
        b.add(t, o)
    };
    assert!(misuse(b.finish(one)).contains("Add"));

    let mut b = KernelBuilder::new("t", Scope::Sample);
    let x = b.param(ParamKind::PerToken);
    let y = b.cmp(BinOp::Lt, x, x);
    assert!(misuse(b.finish(y)).contains("per-token comparisons"));

    let mut b = KernelBuilder::new("t", Scope::Sample);
    let x = b.param(ParamKind::PerSample);
    let m = b.scope_reduce(ReduceOp::Mean, x);
    assert!(misuse(b.finish(m)).contains("scope is `sample`"));

    let mut b = KernelBuilder::new("t", Scope::Sample);
    let z = b.float(0.0);
    let (_s, _t, acc) = b.begin_scan(false, z);
    assert!(misuse(b.finish(acc)).contains("not ended"));

    let mut b = KernelBuilder::new("t", Scope::Sample);
    let c = b.bool(true);
    let one_ = b.float(1.0);
    let s = b.bool(false);
    let r = b.if_else(c, |_| one_, |_| s);
    assert!(misuse(b.finish(r)).contains("branches of types"));
}

fn rejected(k: &Kernel) -> String {
    match verify(k) {
        Err(e) => e.message,
        Ok(()) => panic!("verifier accepted:\n{k}"),
    }
}

#[test]
fn verifier_rejects_broken_kernels() {
    // A value used before it is defined.
    let mut k = gae();
    k.blocks[0].insts.swap(0, 4);
    let mut k2 = k.clone();
    k2.insts[4].op = Op::Binary(BinOp::Add, Value(2), Value(3));
    assert!(rejected(&k2).contains("not defined"), "{}", rejected(&k2));

    // A value of the scan body used outside it.
    let mut k = gae();
    k.blocks[0].result = Some(Value(17));
    assert!(rejected(&k).contains("not defined"));

    // A wrong result type.
    let mut k = gae();
    k.insts[11].ty = Ty::Int;
    assert!(rejected(&k).contains("Mul"));

    // An instruction listed twice.
    let mut k = gae();
    k.blocks[0].insts.push(Value(4));
    assert!(rejected(&k).contains("exactly one"));

    // A block owned twice.
    let mut k = gae();
    let body = match k.insts[18].op {
        Op::Scan { body, .. } => body,
        _ => unreachable!(),
    };
    k.insts.push(Inst {
        op: Op::Scan {
            reverse: false,
            init: Value(4),
            body,
        },
        ty: Ty::Tokens,
    });
    k.blocks[0].insts.push(Value(19));
    assert!(!rejected(&k).is_empty());

    // A host call on a non-Sample parameter, and an invalid regex.
    let mut k = gae();
    k.host_calls.push(HostCall::StrLen {
        param: 0,
        field: StrField::Prompt,
    });
    k.insts.push(Inst {
        op: Op::Host(0),
        ty: Ty::Int,
    });
    k.blocks[0].insts.push(Value(19));
    assert!(rejected(&k).contains("not a Sample"));
    let mut b = KernelBuilder::new("t", Scope::Sample);
    let s = b.sample_param();
    let c = b.count_regex(s, StrField::Prompt, "(");
    assert!(matches!(b.finish(c), Err(BuildError::Verify(_))));

    // A scope reduction inside an if branch.
    let mut k = gae();
    k.scope = Scope::Batch;
    let body = k.blocks.len() - 1;
    k.insts.push(Inst {
        op: Op::ScopeReduce(ReduceOp::Sum, Value(6)),
        ty: Ty::Float,
    });
    k.blocks[body].insts.push(Value(19));
    assert!(rejected(&k).contains("outside the entry block"));
}

#[test]
fn verifier_bounds_nesting() {
    let mut b = KernelBuilder::new("deep", Scope::Sample);
    let c = b.bool(true);
    let mut hs = Vec::new();
    for _ in 0..(verify::MAX_DEPTH + 2) {
        hs.push(b.begin_if(c));
    }
    let mut v = b.float(1.0);
    while let Some(mut h) = hs.pop() {
        b.begin_else(&mut h, v);
        let e = b.float(0.0);
        v = b.end_if(h, e);
    }
    assert!(
        matches!(b.finish(v), Err(BuildError::Verify(e)) if e.message.contains("nested deeper"))
    );
}

#[test]
fn fsem_min_max_rem() {
    assert!(fsem::max(f64::NAN, 1.0).is_nan());
    assert!(fsem::max(1.0, f64::NAN).is_nan());
    assert!(fsem::min(f64::NAN, 1.0).is_nan());
    assert_eq!(fsem::max(-0.0, 0.0).to_bits(), 0.0f64.to_bits());
    assert_eq!(fsem::max(0.0, -0.0).to_bits(), (-0.0f64).to_bits());
    assert_eq!(fsem::irem(5, 0), 0);
    assert_eq!(fsem::irem(i64::MIN, -1), 0);
    assert_eq!(fsem::irem(-5, 3), -2);
}

#[test]
fn interpreter_runs_gae() {
    let it = Interpreter::new(gae()).unwrap();
    let r = [1.0, 2.0, 3.0];
    let v = [0.5, 0.25, 0.125];
    let off = [0usize, 3];
    let out = it
        .run(
            &Batch {
                n_samples: 1,
                ..Default::default()
            },
            &[
                Arg::PerToken(Ragged {
                    values: &r,
                    offsets: &off,
                }),
                Arg::PerToken(Ragged {
                    values: &v,
                    offsets: &off,
                }),
                Arg::Float(1.0),
                Arg::Float(1.0),
            ],
        )
        .unwrap();
    // With gamma = lambda = 1, GAE telescopes to the reward-to-go minus v[t].
    assert_eq!(out.values(), &[6.0 - 0.5, 5.0 - 0.25, 3.0 - 0.125]);
}

#[test]
fn scope_reductions_fold_in_sample_order() {
    // Sum of [1e16, 1.0, -1e16] is 0.0 in this order (1e16 + 1 rounds back to 1e16).
    let xs = [1e16, 1.0, -1e16];
    let r = exec::reduce(ReduceOp::Sum, || xs.iter().copied());
    assert_eq!(r, 0.0);
    assert_eq!(exec::reduce(ReduceOp::Mean, || [].iter().copied()), 0.0);
    assert_eq!(
        exec::reduce(ReduceOp::Count, || [0.0, -0.0, f64::NAN].iter().copied()),
        1.0
    );
}

#[test]
fn random_cases_always_build() {
    for seed in 0u8..=255 {
        let bytes: Vec<u8> = (0..200u32)
            .map(|i| (i as u8).wrapping_mul(seed).wrapping_add(seed))
            .collect();
        let case = random::random_case(&bytes).unwrap();
        assert_eq!(case.inputs.args.len(), case.kernel.params.len());
    }
}

/// The differential tests only check what the generator makes: record fields of every type
/// must be among it, in kernels whose inputs both hold them and (sometimes) lack them.
#[test]
fn random_cases_read_record_fields_of_every_type() {
    use crate::kernel::{FieldTy, HostCall};
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = || {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (state >> 33) as u8
    };
    let mut types = std::collections::BTreeSet::new();
    let (mut complete, mut incomplete) = (0, 0);
    for _ in 0..2000 {
        let bytes: Vec<u8> = (0..400).map(|_| next()).collect();
        let case = random::random_case(&bytes).unwrap();
        let fields = case.kernel.record_fields();
        if fields.is_empty() || case.inputs.n_samples == 0 {
            continue;
        }
        types.extend(fields.iter().map(|f| f.ty));
        let all_present = case.inputs.texts.iter().all(|t| {
            fields
                .iter()
                .all(|f| t.fields.get(&f.name).is_some_and(|v| f.ty.accepts(v)))
        });
        if all_present {
            complete += 1;
        } else {
            incomplete += 1;
        }
        assert!(case.kernel.host_calls.iter().any(|h| matches!(
            h,
            HostCall::Field { .. } | HostCall::Equals { .. } | HostCall::TextsEqual { .. }
        ) || !h.record_fields().is_empty()));
    }
    assert_eq!(
        types.into_iter().collect::<Vec<_>>(),
        vec![FieldTy::Str, FieldTy::Int, FieldTy::Float, FieldTy::Bool]
    );
    assert!(
        complete > 20 && incomplete > 2,
        "{complete} complete, {incomplete} incomplete"
    );
}

#[test]
fn braid_ir_depends_on_no_backend_front_end_or_lsp_crate() {
    let manifest = include_str!("../../Cargo.toml");
    for forbidden in ["pest", "tch", "torch", "cranelift", "lsp"] {
        for line in manifest
            .lines()
            .filter(|l| !l.trim_start().starts_with('#'))
        {
            let name = line.split('=').next().unwrap_or("").trim();
            assert!(!name.contains(forbidden), "braid-ir depends on `{name}`");
        }
    }
}

#[test]
fn scope_levels_count_nested_scope_reductions() {
    // c = r - mean(r); std(c) + c: mean is level 1, std level 2, the result level 2.
    let mut b = KernelBuilder::new("t", Scope::Batch);
    let r = b.param(ParamKind::PerSample);
    let m = b.scope_reduce(ReduceOp::Mean, r);
    let c = b.sub(r, m);
    let s = b.scope_reduce(ReduceOp::Std, c);
    let out = b.add(s, c);
    let k = b.finish(out).unwrap();
    let levels = verify::scope_levels(&k);
    assert_eq!(
        [r, m, c, s, out].map(|v| levels[v.index()]),
        [0, 1, 1, 2, 2]
    );
}

#[test]
fn kernels_round_trip_through_json() {
    // Kernels travel inside plans; a deserialised kernel is re-verified by every backend.
    let k = gae();
    let json = serde_json::to_string(&k).unwrap();
    let back: Kernel = serde_json::from_str(&json).unwrap();
    assert_eq!(back, k);
    assert_eq!(back.structural_hash(), k.structural_hash());
    let mut broken: Kernel =
        serde_json::from_str(&json.replace("\"Param\":2", "\"Param\":9")).unwrap();
    assert!(verify(&broken).is_err());
    broken.entry = BlockId(77);
    assert!(Interpreter::new(broken).is_err());
}
