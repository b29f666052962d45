//! Checking losses: each program below has the one mistake its comment names, and the checker
//! reports exactly the codes listed (on the lines marked `//~`), nothing else. The UI fixtures
//! (`tests/ui/`) render one case per code; these cover the other rules of loss bodies.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;

/// The (line, code) pairs of `//~ CODE` marks in `src`.
fn marks(src: &str) -> BTreeSet<(u32, String)> {
    let mut out = BTreeSet::new();
    for (i, line) in src.lines().enumerate() {
        if let Some(pos) = line.find("//~") {
            for code in line[pos + 3..].split_whitespace() {
                out.insert((i as u32 + 1, code.to_string()));
            }
        }
    }
    out
}

fn check(src: &str) {
    let checked = braid_sema::check("t.rlhf", src, &braid_sema::NoImports);
    let root = checked.program.root;
    let got: BTreeSet<(u32, String)> = checked
        .diagnostics
        .iter()
        .map(|d| {
            let span = d.span();
            let line = if span.file == root {
                checked.sources.get(root).unwrap().line_col(span.start).line
            } else {
                0
            };
            (line, d.code.as_str().to_string())
        })
        .collect();
    assert_eq!(
        got,
        marks(src),
        "{src}\n{:#?}",
        checked
            .diagnostics
            .iter()
            .map(|d| d.message.clone())
            .collect::<Vec<_>>()
    );
}

#[test]
fn a_loss_reduces_to_the_loss_and_combines_linearly() {
    check(
        "fn product(policy: Model, old: PerToken) -> Loss {
  batch_mean(policy.logp) * batch_mean(old)  //~ E0306
}
fn exp_of_loss(policy: Model) -> Loss {
  exp(batch_mean(policy.logp))  //~ E0301
}
fn per_sample_scale(policy: Model, adv: PerSample) -> Loss {
  batch_mean(policy.logp) * adv  //~ E0311
}
fn no_reduction(policy: Model) -> Loss {
  policy.logp  //~ E0301
}
fn choice(policy: Model, adv: PerSample) -> Loss {
  if adv > 0.0 { batch_mean(policy.logp) } else { batch_sum(policy.logp) }  //~ E0311
}
fn of_a_constant(policy: Model) -> Loss {
  batch_mean(policy.logp) + batch_mean(1.0)  //~ E0301
}
fn fine(policy: Model, adv: PerSample, c: float = 0.5) -> Loss {
  let l = batch_mean(-(adv * policy.logp))
  -(c * l - l / 2.0) + batch_sum(policy.entropy) / 3.0
}
",
    );
}

#[test]
fn a_loss_body_is_per_token_and_has_no_sample() {
    check(
        "use std::advantages
fn elementwise(policy: Model, old: PerToken, adv: PerToken) -> Loss {
  let r = exp(policy.logp - old)
  let clipped = r < 0.8 || r > 1.2
  batch_mean(if clipped && adv > 0.0 { 0.0 } else { -(adv * r) })
}
fn typo(policy: Model) -> Loss {
  batch_mean(policy.lgop)  //~ E0206
}
fn text(policy: Model, s: string) -> Loss {
  batch_mean(if contains(s, \"x\") { policy.logp } else { policy.entropy })  //~ E0318
}
fn grouped(policy: Model, r: PerSample) -> Loss {
  batch_mean(policy.logp * group_normalize(r))  //~ E0311
}
fn no_model(old: PerToken) -> Loss {  //~ E0301
  batch_mean(old)
}
fn two_models(policy: Model, critic: Model) -> Loss {  //~ E0301
  batch_mean(policy.logp)
}
fn sample(policy: Model, s: Sample) -> Loss {  //~ E0301
  batch_mean(policy.logp)
}
",
    );
}

#[test]
fn metrics_are_per_token_or_per_sample_and_named_once() {
    check(
        "fn m(policy: Model, old: PerToken) -> Loss {
  let r = exp(policy.logp - old)
  metric clip_frac = abs(r - 1.0) > 0.2
  metric clip_frac = r > 2.0  //~ E0202
  metric lr = r  //~ E0202
  metric constant = 1.0  //~ E0301
  metric whole = batch_mean(r)  //~ E0301
  metric seq = mean(r)
  batch_mean(r)
}
fn f(x: PerToken) -> float {
  metric m = x  //~ E0407
  1.0
}
fn g(x: PerToken) -> PerToken {
  x * batch_mean(x)  //~ E0407
}
",
    );
}

#[test]
fn losses_are_called_in_pipelines_and_losses_with_their_model() {
    check(
        "fn pg(policy: Model, old: PerToken, adv: PerToken) -> Loss {
  batch_mean(-(adv * exp(policy.logp - old)))
}
fn entropy_bonus(policy: Model) -> Loss {
  -batch_mean(policy.entropy)
}
fn both(policy: Model, old: PerToken, adv: PerSample) -> Loss {
  pg(policy, old, adv) + 0.01 * entropy_bonus(policy)
}
fn in_a_fn(x: PerToken) -> PerToken {
  x - pg(x, x, x)  //~ E0407
}
pipeline p(policy: Model, critic: Model, prompts: Dataset) {
  param steps: int
  each _ in steps {
    let r = generate(policy, next(prompts, 4))
    let r2 = generate(policy, next(prompts, 4))
    let lp = logprobs(policy, r)
    let lp2 = logprobs(policy, r2)
    let v = values(critic, r)
    train(policy, r, loss: both(policy, lp, v))  //~ E0301
    train(policy, r, loss: pg(policy, lp, v) + entropy_bonus(critic))  //~ E0415
    train(policy, r2, loss: pg(policy, lp, v))  //~ E0304
    train(policy, r, loss: pg(policy, lp, lp2))  //~ E0304
    train(policy, r, loss: pg(policy, lp, v) / 2.0 - entropy_bonus(policy))
  }
}
",
    );
}

#[test]
fn where_conditions_hold_through_the_run() {
    check(
        "fn pick(x: PerToken, name: string = \"a\" where name == \"a\" || name == \"b\") -> PerToken {
  if name == \"a\" { x } else { -x }
}
fn bad_default(x: PerToken, k: int = 0 where k > 0) -> PerToken {  //~ E0404
  x
}
fn forward(x: PerToken, name: string) -> PerToken {
  pick(x, name)
}
fn literal(x: PerToken) -> PerToken {
  pick(x, \"c\")  //~ E0404
}
fn not_bool(x: PerToken, k: int = 1 where k + 1) -> PerToken {  //~ E0301
  x
}
pipeline p(policy: Model, prompts: Dataset) {
  param steps: int
  param which: string = \"a\"
  each _ in steps {
    let r = generate(policy, next(prompts, 4))
    let lp = logprobs(policy, r)
    let f = forward(lp, which)
    train(policy, r, loss: ppo_like(policy, lp, f))
  }
}
fn ppo_like(policy: Model, old: PerToken, adv: PerToken) -> Loss {
  batch_mean(-(adv * exp(policy.logp - old)))
}
model policy = tiny() { train: adamw(lr: 1e-3) }
dataset prompts = synthetic::letters()
run p(policy, prompts) {
  steps: 1
  which: \"z\"  //~ E0404
}
",
    );
}

#[test]
fn gradients_come_only_from_the_model() {
    check(
        "fn through_a_fn(policy: Model, adv: PerSample) -> Loss {
  batch_mean(-(adv * double(policy.logp)))
}
fn double(x: PerToken) -> PerToken { x + x }
fn second(x: PerToken, y: PerToken) -> PerToken { y }
fn through_an_ignoring_fn(policy: Model, old: PerToken) -> Loss {
  batch_mean(second(policy.logp, old))  //~ E0317
}
fn compared(policy: Model) -> Loss {
  batch_mean(if policy.logp > -1.0 { 1.0 } else { 0.0 })  //~ E0317
}
fn weight(policy: Model, adv: PerToken) -> Loss {
  batch_mean(-(stop_grad(exp(policy.logp)) * adv * policy.logp))
}
fn of_a_loss(policy: Model, old: PerToken) -> Loss {
  through_a_fn(policy, sum(old)) + batch_mean(stop_grad(old))  //~ W0004
}
",
    );
}
