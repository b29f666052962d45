//! Lowering losses to objectives: every loss of the standard library lowers, for every value
//! its string parameters accept, to an objective the verifier accepts; specialisation keeps
//! only what the constants select (branches, the entropy bonus, the KL term, the metrics of a
//! branch taken), and the aggregations take their canonical forms.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use braid_ir::graph::NodeId;
use braid_ir::loss::{InputKind, Objective, verify};
use braid_sema::hir::{FnId, Program, SigTy, Value};
use braid_sema::lower_loss::{LossArg, LossTree, lower_objective};

fn program() -> Program {
    let checked = braid_sema::check("l.rlhf", "use std::losses\n", &braid_sema::NoImports);
    assert!(!checked.has_errors(), "{:?}", checked.diagnostics);
    checked.program
}

/// `f` called with graph nodes for its per-token and per-sample parameters, the model in slot
/// 0, and its defaults for constants but those in `set`.
fn call(p: &Program, name: &str, set: &[(&str, Value)]) -> LossTree {
    let (i, f) = p
        .fns
        .iter()
        .enumerate()
        .find(|(_, f)| f.name == name)
        .unwrap();
    let args = f
        .params
        .iter()
        .enumerate()
        .map(|(k, param)| match &param.ty {
            SigTy::Model => LossArg::Model(0),
            SigTy::PerToken => LossArg::Node {
                node: NodeId(10 + k as u32),
                kind: InputKind::PerToken,
            },
            SigTy::PerSample => LossArg::Node {
                node: NodeId(10 + k as u32),
                kind: InputKind::PerSample,
            },
            _ => LossArg::Const(match set.iter().find(|(n, _)| *n == param.name) {
                Some((_, v)) => v.clone(),
                None => match &param.default.as_ref().unwrap().kind {
                    braid_sema::hir::ExprKind::Lit(v) => v.clone(),
                    other => panic!("{name}: default {other:?}"),
                },
            }),
        })
        .collect();
    LossTree::Call {
        f: FnId(i as u32),
        args,
    }
}

fn lower(p: &Program, name: &str, set: &[(&str, Value)]) -> (Objective, Vec<NodeId>) {
    let (o, nodes) = lower_objective(p, &call(p, name, set)).unwrap();
    verify(&o).unwrap();
    assert_eq!(o.inputs.len(), nodes.len());
    (o, nodes)
}

fn s(v: &str) -> Value {
    Value::Str(v.into())
}

#[test]
fn every_stdlib_loss_lowers_for_every_accepted_string() {
    let p = program();
    let losses: Vec<&str> = p
        .fns
        .iter()
        .filter(|f| f.is_loss())
        .map(|f| f.name.as_str())
        .collect();
    assert_eq!(
        losses,
        [
            "ppo_loss",
            "value_loss",
            "kl_loss",
            "grpo_loss",
            "grpo_surrogate",
            "gspo_loss",
            "dapo_loss",
            "cispo_loss"
        ]
    );
    for name in &losses {
        lower(&p, name, &[]);
    }
    for agg in ["token", "sequence", "sum"] {
        lower(
            &p,
            "ppo_loss",
            &[("agg", s(agg)), ("max_new_tokens", Value::Int(16))],
        );
    }
    for est in ["k1", "k2", "k3"] {
        lower(&p, "kl_loss", &[("estimator", s(est))]);
        for variant in ["grpo", "dr_grpo", "gspo", "dapo", "cispo"] {
            lower(
                &p,
                "grpo_loss",
                &[
                    ("kl_estimator", s(est)),
                    ("variant", s(variant)),
                    ("max_new_tokens", Value::Int(16)),
                ],
            );
        }
    }
}

#[test]
fn aggregations_take_their_canonical_forms() {
    let p = program();
    let text = |agg: &str| {
        lower(
            &p,
            "ppo_loss",
            &[("agg", s(agg)), ("max_new_tokens", Value::Int(256))],
        )
        .0
        .to_string()
    };
    // Token mean: one sum over the tokens divided by the mini-batch's tokens.
    assert!(text("token").contains("= batch_sum %") && text("token").contains(" / tokens"));
    // Sequence mean: each token weighted by 1/len, divided by the mini-batch's samples.
    let seq = text("sequence");
    assert!(
        seq.contains("layout inv_len") && seq.contains(" / samples"),
        "{seq}"
    );
    assert!(!seq.contains("token_mean"), "{seq}");
    // Dr. GRPO's constant normaliser folds into the divisor.
    assert!(
        text("sum").contains(" / (samples * 256.0)"),
        "{}",
        text("sum")
    );
}

#[test]
fn constants_select_what_is_computed() {
    let p = program();
    let plain = lower(&p, "ppo_loss", &[]).0.to_string();
    assert!(
        !plain.contains("select") && !plain.contains("entropy"),
        "{plain}"
    );
    let dual = lower(&p, "ppo_loss", &[("dual_clip", Value::Float(3.0))])
        .0
        .to_string();
    assert!(
        dual.contains("select") && dual.contains("const 3.0"),
        "{dual}"
    );
    let ent = lower(&p, "ppo_loss", &[("entropy_coef", Value::Float(0.01))])
        .0
        .to_string();
    assert!(ent.contains("model entropy"), "{ent}");
    // Without a KL coefficient the reference's log-probabilities are still an input (the
    // graph keeps the program's dataflow) that nothing reads.
    let reads = |o: &Objective| {
        o.insts
            .iter()
            .filter(|i| matches!(i.op, braid_ir::loss::Op::Input(_)))
            .count()
    };
    let (o, nodes) = lower(&p, "grpo_loss", &[("kl_coef", Value::Float(0.0))]);
    assert_eq!(nodes, vec![NodeId(11), NodeId(12), NodeId(13)]);
    assert_eq!(reads(&o), 2, "{o}");
    let (o, _) = lower(&p, "grpo_loss", &[]);
    assert_eq!(reads(&o), 3, "{o}");
}

#[test]
fn only_the_branch_taken_declares_its_metrics() {
    let p = program();
    for (variant, stop_grad, per_sample_clip) in [
        ("grpo", false, false),
        ("gspo", false, true),
        ("dapo", false, false),
        ("cispo", true, false),
    ] {
        let (o, _) = lower(&p, "grpo_loss", &[("variant", s(variant))]);
        let names: Vec<&str> = o.metrics.iter().map(|m| m.name.as_str()).collect();
        assert_eq!(names, ["clip_frac"], "{variant}");
        let text = o.to_string();
        assert_eq!(text.contains("stop_grad"), stop_grad, "{variant}: {text}");
        let level = o.inst(o.metrics[0].value).unwrap().level;
        assert_eq!(
            level == braid_ir::loss::Level::Sample,
            per_sample_clip,
            "{variant}"
        );
    }
}

#[test]
fn a_sum_of_losses_is_one_objective() {
    let p = program();
    let tree = LossTree::Add(
        Box::new(call(&p, "ppo_loss", &[])),
        Box::new(LossTree::Scale(Box::new(call(&p, "kl_loss", &[])), 0.5)),
    );
    let (o, nodes) = lower_objective(&p, &tree).unwrap();
    assert_eq!(o.name, "ppo_loss + kl_loss");
    // ppo_loss reads nodes 11 and 12, kl_loss node 11: the shared node is one input.
    assert_eq!(nodes, vec![NodeId(11), NodeId(12)]);
    assert!(o.to_string().contains("loss = add %"), "{o}");
}
