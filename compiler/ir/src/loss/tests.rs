#![allow(clippy::unwrap_used)]

use super::*;

/// PPO's clipped surrogate with a clip fraction, as the lowering builds it for `clip = 0.2`.
fn ppo() -> Objective {
    let mut b = ObjectiveBuilder::new("ppo_loss");
    let old = b.input(InputKind::PerToken);
    let adv = b.input(InputKind::PerSample);
    let logp = b.model(ModelOutput::Logp);
    let d = b.binary(BinOp::Sub, logp, old);
    let ratio = b.unary(UnOp::Exp, d);
    let one = b.float(1.0);
    let clip = b.float(0.2);
    let lo = b.binary(BinOp::Sub, one, clip);
    let hi = b.binary(BinOp::Add, one, clip);
    let a1 = b.binary(BinOp::Mul, adv, ratio);
    let pg1 = b.unary(UnOp::Neg, a1);
    let c = b.clamp(ratio, lo, hi);
    let a2 = b.binary(BinOp::Mul, adv, c);
    let pg2 = b.unary(UnOp::Neg, a2);
    let pg = b.binary(BinOp::Max, pg1, pg2);
    let dev = b.binary(BinOp::Sub, ratio, one);
    let dev = b.unary(UnOp::Abs, dev);
    let clipped = b.binary(BinOp::Gt, dev, clip);
    b.metric("clip_frac", clipped);
    let seq = b.reduce(ReduceOp::Mean, pg);
    let loss = b.batch_mean(seq);
    b.finish(loss).unwrap()
}

#[test]
fn text_form_of_ppo() {
    assert_eq!(
        ppo().to_string(),
        "loss ppo_loss(p0: per_token, p1: per_sample) {
  %0: token = input p0
  %1: sample = input p1
  %2: token = model logp
  %3: token = sub %2, %0
  %4: token = exp %3
  %5: scalar = const 1.0
  %6: scalar = const 0.2
  %7: scalar = const 0.8
  %8: scalar = const 1.2
  %9: token = mul %1, %4
  %10: token = neg %9
  %11: token = clamp %4, %7, %8
  %12: token = mul %1, %11
  %13: token = neg %12
  %14: token = max %10, %13
  %15: token = sub %4, %5
  %16: token = abs %15
  %17: token bool = gt %16, %6
  %18: token = layout inv_len
  %19: token = mul %14, %18
  %20: loss = batch_sum %19 / samples
  metric clip_frac = %17
  return %20
}
"
    );
}

#[test]
fn constants_fold_and_constant_conditions_pick_a_branch() {
    let mut b = ObjectiveBuilder::new("t");
    let two = b.float(2.0);
    let three = b.float(3.0);
    let six = b.binary(BinOp::Mul, two, three);
    assert_eq!(b.float_const(six), Some(6.0));
    let lt = b.binary(BinOp::Lt, two, three);
    assert_eq!(b.bool_const(lt), Some(true));
    let logp = b.model(ModelOutput::Logp);
    let ent = b.model(ModelOutput::Entropy);
    assert_eq!(b.select(lt, logp, ent), logp);
    let e = b.unary(UnOp::Exp, two);
    assert_eq!(b.float_const(e), Some(2f64.exp()));
    let nan = b.float(f64::NAN);
    let m = b.binary(BinOp::Max, nan, two);
    assert!(b.float_const(m).unwrap().is_nan());
}

#[test]
fn reductions_take_their_canonical_form() {
    // Dr. GRPO: batch_mean(sum(x)) / 256 is one sum over the tokens divided by samples * 256.
    let mut b = ObjectiveBuilder::new("dr");
    let logp = b.model(ModelOutput::Logp);
    let s = b.reduce(ReduceOp::Sum, logp);
    let m = b.batch_mean(s);
    let k = b.float(256.0);
    let l = b.binary(BinOp::Div, m, k);
    let o = b.finish(l).unwrap();
    assert_eq!(
        o.to_string(),
        "loss dr() {\n  %0: token = model logp\n  %1: loss = batch_sum %0 / (samples * 256.0)\n  return %1\n}\n"
    );
    // A token mean of the mini-batch divides by its tokens; group means weight by the group.
    let mut b = ObjectiveBuilder::new("g");
    let logp = b.model(ModelOutput::Logp);
    let t = b.batch_mean(logp);
    let g = b.group_mean(logp);
    let l = b.binary(BinOp::Add, t, g);
    let o = b.finish(l).unwrap();
    assert_eq!(
        o.to_string(),
        "loss g() {
  %0: token = model logp
  %1: loss = batch_sum %0 / tokens
  %2: token = layout inv_group_tokens
  %3: token = mul %0, %2
  %4: loss = batch_sum %3 / groups
  %5: loss = add %1, %4
  return %5
}
"
    );
}

#[test]
fn inputs_keep_the_names_of_their_parameters() {
    let mut b = ObjectiveBuilder::new("t");
    let adv = b.input_named(InputKind::PerSample, "adv");
    let logp = b.model(ModelOutput::Logp);
    let pg = b.binary(BinOp::Mul, adv, logp);
    let l = b.batch_mean(pg);
    let o = b.finish(l).unwrap();
    assert_eq!(o.input_named("adv"), Some(0));
    assert_eq!(o.input_named("old_logp"), None);
    assert!(
        o.to_string().starts_with("loss t(p0 adv: per_sample) {"),
        "{o}"
    );
}

#[test]
fn unused_instructions_are_removed() {
    let mut b = ObjectiveBuilder::new("t");
    let x = b.input(InputKind::PerToken);
    let logp = b.model(ModelOutput::Logp);
    let _unused = b.binary(BinOp::Mul, x, logp);
    let l = b.batch_sum(logp);
    let o = b.finish(l).unwrap();
    assert_eq!(o.insts.len(), 2);
    assert_eq!(o.inputs, vec![InputKind::PerToken]);
}

#[test]
fn the_builder_reports_misuse_instead_of_panicking() {
    let mut b = ObjectiveBuilder::new("t");
    let logp = b.model(ModelOutput::Logp);
    let l1 = b.batch_sum(logp);
    let l2 = b.batch_mean(logp);
    let bad = b.binary(BinOp::Mul, l1, l2);
    let again = b.unary(UnOp::Exp, bad);
    let err = b.finish(again).unwrap_err();
    assert!(
        err.to_string().contains("scales by constants only"),
        "{err}"
    );
    // A loss without gradient is refused by the verifier.
    let mut b = ObjectiveBuilder::new("t");
    let x = b.input(InputKind::PerToken);
    let x = b.unary(UnOp::StopGrad, x);
    let l = b.batch_sum(x);
    assert!(b.finish(l).unwrap_err().to_string().contains("no gradient"));
    let mut b = ObjectiveBuilder::new("t");
    let logp = b.model(ModelOutput::Logp);
    let sg = b.unary(UnOp::StopGrad, logp);
    let l = b.batch_sum(sg);
    assert!(b.finish(l).unwrap_err().to_string().contains("no gradient"));
}

#[test]
fn the_verifier_rejects_broken_objectives() {
    let good = ppo();
    verify(&good).unwrap();
    let broken = |f: &dyn Fn(&mut Objective)| {
        let mut o = good.clone();
        f(&mut o);
        verify(&o).is_err()
    };
    // An operand used before its definition.
    assert!(broken(
        &|o| o.insts[3].op = Op::Binary(BinOp::Sub, Value(2), Value(9))
    ));
    // A missing input, and input names that are not one per input.
    assert!(broken(&|o| o.insts[0].op = Op::Input(7)));
    assert!(broken(&|o| o.input_names = vec!["adv".into()]));
    // A recorded level that is not what the operation computes.
    assert!(broken(&|o| o.insts[4].level = Level::Sample));
    // A result that is not the loss.
    assert!(broken(&|o| o.result = Value(14)));
    // A token reduction of a per-sample value.
    assert!(broken(
        &|o| o.insts[18].op = Op::Reduce(ReduceOp::Sum, Value(1))
    ));
    // A metric of the loss, and a metric without a name.
    assert!(broken(&|o| o.metrics[0].value = Value(20)));
    assert!(broken(&|o| o.metrics[0].name.clear()));
    // The loss mixed non-linearly.
    assert!(broken(&|o| {
        o.insts.push(Inst {
            op: Op::Unary(UnOp::Exp, Value(20)),
            level: Level::Loss,
            ty: Ty::Float,
        });
        o.result = Value(21);
    }));
}

#[test]
fn gradients_follow_model_outputs_and_stop_at_stop_grad() {
    let o = ppo();
    let g = o.gradients();
    assert!(!g[0] && !g[1] && g[2] && g[4] && g[14] && g[20]);
    // The clip fraction is a boolean: no gradient.
    assert!(!g[17]);
    assert_eq!(o.outputs(), vec![ModelOutput::Logp]);
}

#[test]
fn objectives_round_trip_through_json() {
    // Objectives travel inside plans; a deserialised one is verified again before it runs.
    let o = ppo();
    let json = serde_json::to_string(&o).unwrap();
    let back: Objective = serde_json::from_str(&json).unwrap();
    assert_eq!(back, o);
    verify(&back).unwrap();
    let broken: Objective =
        serde_json::from_str(&json.replace("\"Input\":1", "\"Input\":5")).unwrap();
    assert!(verify(&broken).is_err());
}
