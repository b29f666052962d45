//! Lowering runs to task graphs: every example and every stdlib pipeline lowers, the verifier
//! accepts the graph, and the text form is snapshotted (so a change in lowering shows up in
//! review). Lowering is deterministic: the same program gives byte-identical text.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use braid_ir::graph::{Op, Plan};

fn lower(name: &str, src: &str) -> Plan {
    let checked = braid_sema::check(name, src, &braid_sema::NoImports);
    assert!(!checked.has_errors(), "{name}: {:?}", checked.diagnostics);
    braid_sema::lower_graph::lower_run(&checked.program).unwrap()
}

fn text(plan: &Plan) -> String {
    let mut s = format!(
        "pipeline {} steps={} seed={}\n",
        plan.pipeline, plan.steps, plan.seed
    );
    for m in &plan.models {
        s.push_str(&format!(
            "model {} head={} source={:?} trained={}\n",
            m.name,
            m.head,
            m.source,
            m.optimizer.is_some()
        ));
    }
    s.push_str(&plan.graph_text());
    s.push_str(&plan.losses_text());
    s
}

#[test]
fn examples_lower_to_verified_graphs() {
    for file in ["quickstart", "ppo_tiny", "grpo_math"] {
        let path = format!("{}/../../examples/{file}.rlhf", env!("CARGO_MANIFEST_DIR"));
        let src = std::fs::read_to_string(&path).unwrap();
        let plan = lower(&path, &src);
        plan.graph.verify().unwrap();
        let again = lower(&path, &src);
        assert_eq!(
            text(&plan),
            text(&again),
            "{file}: lowering is not deterministic"
        );
        insta::assert_snapshot!(format!("example_{file}"), text(&plan));
    }
}

const MODELS: &str = r#"
model policy = tiny(vocab: "bytes", layers: 1, hidden: 32, heads: 2) {
  train: adamw(lr: 1e-3)
}
model critic = tiny(vocab: "bytes", layers: 1, hidden: 32, heads: 2) {
  head: value
  train: adamw(lr: 1e-3)
}
model rm = tiny(vocab: "bytes", layers: 1, hidden: 32, heads: 2) {
  head: score
}
dataset prompts = synthetic::letters(count: 64)
fn r(s: Sample) -> float { len(s.completion) }
"#;

#[test]
fn stdlib_pipelines_lower_to_verified_graphs() {
    let runs = [
        (
            "grpo",
            "run grpo(policy, prompts, reward: r) {\n  steps: 3\n  batch: 4\n  group: 2\n}",
        ),
        (
            "grpo_dr",
            "run grpo(policy, prompts, reward: r) {\n  steps: 3\n  batch: 4\n  group: 2\n  variant: \"dr_grpo\"\n}",
        ),
        (
            "grpo_gspo",
            "run grpo(policy, prompts, reward: r) {\n  steps: 3\n  batch: 4\n  group: 2\n  variant: \"gspo\"\n  clip: 3e-4\n  clip_high: 4e-4\n}",
        ),
        (
            "grpo_dapo",
            "run grpo(policy, prompts, reward: r) {\n  steps: 3\n  batch: 4\n  group: 2\n  variant: \"dapo\"\n  kl_coef: 0.0\n}",
        ),
        (
            "grpo_cispo",
            "run grpo(policy, prompts, reward: r) {\n  steps: 3\n  batch: 4\n  group: 2\n  variant: \"cispo\"\n}",
        ),
        (
            "rloo",
            "run rloo(policy, prompts, reward: r) {\n  steps: 3\n  batch: 4\n}",
        ),
        (
            "reinforce_pp",
            "run reinforce_pp(policy, prompts, reward: r) {\n  steps: 3\n  batch: 4\n}",
        ),
        (
            "remax",
            "run remax(policy, prompts, reward: r) {\n  steps: 3\n  batch: 4\n}",
        ),
        (
            "ppo",
            "run ppo(policy, prompts, reward_model: rm, critic: critic) {\n  steps: 3\n  batch: 4\n}",
        ),
        (
            "ppo_fn",
            "run ppo_fn(policy, prompts, reward: r, critic: critic) {\n  steps: 3\n  batch: 4\n}",
        ),
    ];
    for (name, run) in runs {
        let module = match name {
            n if n.starts_with("grpo") => "grpo",
            "ppo_fn" => "ppo",
            n => n,
        };
        let src = format!("use std::{module}\n{MODELS}\n{run}\n");
        let plan = lower(&format!("{name}.rlhf"), &src);
        plan.graph.verify().unwrap();
        // Every trained model has a version edge from its train to its first call.
        let trains = plan
            .graph
            .node_ids()
            .into_iter()
            .filter(|n| matches!(plan.graph.node(*n).unwrap().op, Op::Train { .. }))
            .count();
        assert!(trains >= 1, "{name}: no train node");
        insta::assert_snapshot!(format!("stdlib_{name}"), text(&plan));
    }
}

#[test]
fn micro_batch_pins_reach_their_calls() {
    let src = format!(
        "use std::grpo\n{MODELS}\nrun grpo(policy, prompts, reward: r) {{\n  steps: 3\n  batch: 4\n  group: 2\n}}\nschedule {{\n  micro_batch logprobs(policy) 4\n}}\n"
    );
    let checked = braid_sema::check("pins.rlhf", &src, &braid_sema::NoImports);
    assert!(!checked.has_errors(), "{:?}", checked.diagnostics);
    let plan = braid_sema::lower_graph::lower_run(&checked.program).unwrap();
    let pinned: Vec<_> = plan
        .graph
        .node_ids()
        .into_iter()
        .filter_map(|n| {
            let node = plan.graph.node(n).unwrap();
            node.micro_batch
                .map(|m| (node.op.name(), node.op.model(), m))
        })
        .collect();
    // Only the policy's logprobs, not the reference's.
    assert_eq!(pinned, vec![("logprobs", Some(0), 4)]);
}

#[test]
fn the_verifier_rejects_a_malformed_graph() {
    let src = format!(
        "use std::grpo\n{MODELS}\nrun grpo(policy, prompts, reward: r) {{\n  steps: 3\n  batch: 4\n  group: 2\n}}\n"
    );
    let mut plan = lower("bad.rlhf", &src);
    let train = plan
        .graph
        .node_ids()
        .into_iter()
        .find(|n| matches!(plan.graph.node(*n).unwrap().op, Op::Train { .. }))
        .unwrap();
    // Removing the loss leaves `train` with one input.
    let loss = plan.graph.inputs(train)[1];
    plan.graph.remove_node(loss);
    let e = plan.graph.verify().unwrap_err();
    assert!(e.0.contains("train takes a rollout and a loss"), "{e}");
}
