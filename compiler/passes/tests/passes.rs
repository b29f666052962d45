//! Each planner pass run alone on lowered example and stdlib plans, its decisions snapshotted
//! (the rendered plan: calls, fusion decisions, transfers, and the graph after the pass); the
//! full pipeline with the verifier between passes; determinism; searched placement never worse
//! than the heuristic; `E0504` for plans that do not fit.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use braid_cost::cluster::ClusterSpec;
use braid_cost::cost::ModelShape;
use braid_passes::annotated::{
    Annotated, Cut, FusePin, PinTarget, Pins, PlacePin, SpeculatePin, default_workload,
    shapes_from_plan,
};
use braid_passes::passes::{PassManager, all_passes, run_one};
use braid_passes::render::{PlanSpans, memory_diagnostics, report, to_text};

fn lower(name: &str, src: &str) -> braid_ir::graph::Plan {
    let checked = braid_sema::check(name, src, &braid_sema::NoImports);
    assert!(!checked.has_errors(), "{name}: {:?}", checked.diagnostics);
    braid_sema::lower_graph::lower_run(&checked.program).unwrap()
}

fn annotate(plan: braid_ir::graph::Plan, cluster: &str, pins: Pins) -> Annotated {
    let cluster = ClusterSpec::parse(cluster).unwrap();
    // A model directory's config.json (relative to examples/, where the example programs
    // are), else a preset named by the directory.
    let shapes = shapes_from_plan(&plan, &mut |dir| {
        let cfg = format!(
            "{}/../../examples/{dir}/config.json",
            env!("CARGO_MANIFEST_DIR")
        );
        if let Ok(text) = std::fs::read_to_string(&cfg) {
            let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| e.to_string())?;
            return ModelShape::from_hf_config(dir, &json).map_err(|e| e.to_string());
        }
        ModelShape::preset_for_path(dir).ok_or_else(|| format!("no preset for {dir}"))
    })
    .unwrap();
    let workload = default_workload(&plan);
    let cost = cluster.cost_model();
    Annotated::new(plan, cluster, cost, shapes, workload, pins)
}

fn example(file: &str) -> braid_ir::graph::Plan {
    let path = format!("{}/../../examples/{file}.rlhf", env!("CARGO_MANIFEST_DIR"));
    lower(&path, &std::fs::read_to_string(&path).unwrap())
}

/// PPO with LLaMA-7B-sized actor, critic, reference and reward models.
const PPO_7B: &str = r#"
use std::ppo
model actor = hf("llama-7b") { train: adamw(lr: 1e-6) }
model critic = hf("llama-7b") { head: value
  train: adamw(lr: 1e-6) }
model rm = hf("llama-7b") { head: score }
dataset prompts = synthetic::letters(count: 4096)
run ppo(actor, prompts, reward_model: rm, critic: critic) {
  steps: 10
  batch: 128
  max_new_tokens: 512
  minibatches: 2
}
"#;

const GRPO_TINY: &str = r#"
use std::grpo
model policy = tiny(vocab: "bytes", layers: 2, hidden: 64, heads: 4) { train: adamw(lr: 1e-3) }
dataset prompts = synthetic::letters(count: 64)
fn r(s: Sample) -> float { len(s.completion) }
run grpo(policy, prompts, reward: r) {
  steps: 3
  batch: 8
  group: 4
  max_new_tokens: 64
}
"#;

fn ppo_7b() -> braid_ir::graph::Plan {
    lower("ppo_7b.rlhf", PPO_7B)
}

/// The plans each pass is snapshotted on: (name, plan, cluster).
fn cases() -> Vec<(&'static str, braid_ir::graph::Plan, &'static str)> {
    vec![
        ("ppo_tiny_1x8xH100", example("ppo_tiny"), "1x8xH100"),
        ("grpo_tiny_cpu", lower("grpo.rlhf", GRPO_TINY), "cpu"),
        ("ppo_7b_2x8xH100", ppo_7b(), "2x8xH100"),
    ]
}

#[test]
fn each_pass_alone_is_snapshotted() {
    for pass in all_passes() {
        for (name, plan, cluster) in cases() {
            let mut a = annotate(plan, cluster, Pins::default());
            let before = a.plan.graph_text();
            run_one(pass.as_ref(), &mut a, true).unwrap();
            a.plan.graph.verify().unwrap();
            let text = format!(
                "# pass {} alone on {name}\n# graph before:\n{before}\n{}",
                pass.name(),
                to_text(&report(&a))
            );
            insta::assert_snapshot!(format!("{}__{name}", pass.name()), text);
        }
    }
}

#[test]
fn the_pipeline_verifies_between_passes_and_is_deterministic() {
    for (name, plan, cluster) in cases() {
        let run = || {
            let mut a = annotate(plan.clone(), cluster, Pins::default());
            let mut seen = Vec::new();
            PassManager::new()
                .run(&mut a, |p, a| {
                    a.plan.graph.verify().unwrap();
                    seen.push(p.to_string());
                })
                .unwrap();
            assert_eq!(seen.len(), 5, "{name}");
            to_text(&report(&a))
        };
        let first = run();
        assert_eq!(first, run(), "{name}: planning is not deterministic");
        insta::assert_snapshot!(format!("pipeline__{name}"), first);
    }
}

#[test]
fn disabled_passes_do_not_run_and_unknown_names_are_errors() {
    let mut a = annotate(ppo_7b(), "2x8xH100", Pins::default());
    PassManager::new()
        .disable(&["place", "speculate"])
        .unwrap()
        .run(&mut a, |_, _| {})
        .unwrap();
    assert_eq!(
        a.decisions.passes_run,
        ["sample-split", "microbatch-interleave", "reshard-insert"]
    );
    assert!(a.decisions.search.is_none() && a.decisions.speculation.is_empty());
    let e = PassManager::new().disable(&["fuse"]).unwrap_err();
    assert!(
        e.0.contains("unknown pass `fuse`") && e.0.contains("sample-split"),
        "{e}"
    );
}

#[test]
fn searched_placement_is_never_worse_than_the_heuristic() {
    for (name, plan, cluster) in cases() {
        let mut a = annotate(plan, cluster, Pins::default());
        PassManager::new().run(&mut a, |_, _| {}).unwrap();
        let s = a.decisions.search.clone().unwrap();
        // In the simulator, the kept placement is the fastest candidate.
        let kept = s.simulated.iter().find(|c| c.0 == s.kept).map(|c| c.1);
        for (cand, t) in &s.simulated {
            assert!(kept.unwrap() <= *t, "{name}: {cand} {t} vs {s:?}");
        }
        if s.kept == "searched" {
            assert!(s.searched_seconds <= s.heuristic_seconds, "{name}: {s:?}");
        }
    }
}

#[test]
fn pins_are_respected() {
    let target = |op: &str, model: &str| PinTarget {
        op: op.into(),
        model: Some(model.into()),
    };
    let pins = Pins {
        place: vec![PlacePin {
            target: target("generate", "actor"),
            from: 0,
            to: 8,
            tp: Some(2),
            pp: None,
            dp: None,
        }],
        speculate: vec![(Some(target("generate", "actor")), SpeculatePin::Off)],
        migrate_below: Some(0.25),
        ..Pins::default()
    };
    let mut a = annotate(ppo_7b(), "2x8xH100", pins);
    PassManager::new().run(&mut a, |_, _| {}).unwrap();
    let gen_id = a.calls()[0];
    let p = a.decisions.placements[&gen_id];
    assert_eq!((p.first, p.count, p.dp, p.tp, p.pp), (0, 8, 4, 2, 1));
    assert_eq!(
        a.decisions.speculation[&gen_id].mode,
        braid_passes::annotated::DraftKind::Off
    );
    assert!(a.decisions.speculation[&gen_id].pinned);
    assert_eq!(a.decisions.migrations[&gen_id].threshold, 32);
}

#[test]
fn a_plan_that_does_not_fit_is_an_e0504_naming_call_device_and_bytes() {
    let src = PPO_7B.replace("llama-7b", "llama-65b");
    let mut a = annotate(lower("ppo_65b.rlhf", &src), "1x1xH100", Pins::default());
    PassManager::new().run(&mut a, |_, _| {}).unwrap();
    let diags = memory_diagnostics(&a, &PlanSpans::default());
    assert!(!diags.is_empty());
    let d = &diags[0];
    assert_eq!(d.code, braid_diagnostics::Code::E0504);
    assert!(d.message.contains("generate(actor)"), "{}", d.message);
    assert!(
        d.message.contains("device 0") && d.message.contains("bytes"),
        "{}",
        d.message
    );
    assert!(d.message.contains("H100"), "{}", d.message);
}

fn target(op: &str, model: &str) -> PinTarget {
    PinTarget {
        op: op.into(),
        model: Some(model.into()),
    }
}

fn planned(plan: braid_ir::graph::Plan, cluster: &str, pins: Pins) -> Annotated {
    let mut a = annotate(plan, cluster, pins);
    PassManager::new()
        .run(&mut a, |_, x| x.plan.graph.verify().unwrap())
        .unwrap();
    a
}

/// The cut `sample-split` gave the call named `name`.
fn cut_of(a: &Annotated, name: &str) -> Cut {
    let id = a
        .calls()
        .into_iter()
        .find(|i| a.call_name(*i) == name)
        .unwrap();
    a.decisions.streams[&id].cut
}

#[test]
fn a_fuse_pin_streams_only_the_listed_consumers() {
    let free = planned(ppo_7b(), "2x8xH100", Pins::default());
    for c in ["logprobs(ref)", "values(critic)", "score(rm)"] {
        assert_eq!(cut_of(&free, c), Cut::Sample, "{c}");
    }
    let pins = Pins {
        fuse: vec![FusePin {
            from: target("generate", "actor"),
            to: vec![target("logprobs", "ref"), target("score", "rm")],
        }],
        ..Pins::default()
    };
    let a = planned(ppo_7b(), "2x8xH100", pins);
    assert_eq!(cut_of(&a, "logprobs(ref)"), Cut::Sample);
    assert_eq!(cut_of(&a, "score(rm)"), Cut::Sample);
    assert_eq!(cut_of(&a, "values(critic)"), Cut::Batch);
    assert_eq!(cut_of(&a, "logprobs(actor)"), Cut::Batch);
    let text = to_text(&report(&a));
    assert_ne!(text, to_text(&report(&free)));
    insta::assert_snapshot!("pin_fuse__ppo_7b_2x8xH100", text);
}

#[test]
fn an_interleave_pin_fuses_the_listed_trainings() {
    let free = planned(example("ppo_tiny"), "1x8xH100", Pins::default());
    assert!(free.decisions.interleave.is_empty());
    let pins = Pins {
        interleave: vec![vec![target("train", "policy"), target("train", "critic")]],
        ..Pins::default()
    };
    let a = planned(example("ppo_tiny"), "1x8xH100", pins);
    assert_eq!(a.decisions.interleave.len(), 1, "{:?}", a.decisions.notes);
    let text = to_text(&report(&a));
    insta::assert_snapshot!("pin_interleave__ppo_tiny_1x8xH100", text);
}

/// A plan simulated on another workload than the one it was planned on (as `braid report
/// --against-sim` does with a run's prompts) prices its interleaved training on that workload:
/// longer prompts make the fused training longer, in proportion to the trainings' serial time.
#[test]
fn interleaved_training_is_priced_on_the_simulated_workload() {
    use braid_cost::sim::SimOptions;
    use braid_passes::to_sim::{simulate_plan, summarise};
    let pins = Pins {
        interleave: vec![vec![target("train", "policy"), target("train", "critic")]],
        ..Pins::default()
    };
    let a = planned(example("ppo_tiny"), "1x8xH100", pins);
    assert_eq!(a.decisions.interleave.len(), 1, "{:?}", a.decisions.notes);
    let opts = SimOptions {
        iterations: 1,
        seed: a.seed,
    };
    let train = |a: &Annotated| {
        summarise("braid", &simulate_plan(a, true, &opts).unwrap()).training_seconds
    };
    let planned_on = train(&a);
    let d = &a.decisions.interleave[0];
    assert!(
        (planned_on - d.fused_seconds).abs() <= 1e-9 + 1e-6 * d.fused_seconds,
        "{planned_on} vs {}",
        d.fused_seconds
    );
    let mut longer = a.clone();
    longer.workload.prompt_len *= 8;
    let priced = train(&longer);
    assert!(priced > planned_on * 1.5, "{priced} vs {planned_on}");
}

#[test]
fn an_interleave_pin_that_cannot_hold_says_why() {
    // One device: no pipeline to interleave.
    let pins = Pins {
        interleave: vec![vec![target("train", "policy"), target("train", "critic")]],
        ..Pins::default()
    };
    let a = planned(example("ppo_tiny"), "1x1xH100", pins);
    assert!(a.decisions.interleave.is_empty());
    let text = to_text(&report(&a));
    assert!(text.contains("`interleave` pin"), "{text}");
    insta::assert_snapshot!("pin_interleave_impossible__ppo_tiny_1x1xH100", text);
}

/// The generating model's own log-probs stream in the generation's layout on the devices
/// migration frees: its weights are already there, so no reshard after the generation holds
/// them back, and they start before the generation ends.
#[test]
fn the_policys_logprobs_stream_in_the_generations_layout() {
    let a = planned(ppo_7b(), "2x8xH100", Pins::default());
    let id = |name: &str| {
        a.calls()
            .into_iter()
            .find(|i| a.call_name(*i) == name)
            .unwrap()
    };
    let (g, lp) = (id("generate(actor)"), id("logprobs(actor)"));
    assert!(a.decisions.migrations.contains_key(&g));
    let gp = braid_passes::estimate::placements(&a)[&g];
    let sub = a.decisions.subtask_placements[&lp];
    assert_eq!((sub.tp, sub.pp), (gp.tp, gp.pp));
    let (dag, tasks) = braid_passes::to_sim::to_dag(&a, true).unwrap();
    let name = &dag.tasks[tasks[&lp].0].name;
    let opts = braid_cost::sim::SimOptions {
        iterations: 1,
        seed: a.seed,
    };
    let r = braid_cost::sim::simulate(&dag, &opts).unwrap();
    let start = r
        .timeline
        .iter()
        .filter(|s| &s.task == name)
        .map(|s| s.start)
        .fold(f64::INFINITY, f64::min);
    let end = r.iterations[0].generations[0].end;
    assert!(
        start < end,
        "{name} starts at {start}, the generation ends at {end}"
    );
}

const REUSE_MODELS: &str = "model policy = tiny(vocab: \"bytes\", layers: 1, hidden: 32, heads: 2) {\n  train: adamw(lr: 1e-3)\n}\nmodel critic = tiny(vocab: \"bytes\", layers: 1, hidden: 32, heads: 2) {\n  head: value\n  train: adamw(lr: 1e-3)\n}\ndataset d = synthetic::letters(count: 8)\nfn r(s: Sample) -> float { len(s.completion) }\n";

fn reused_labels(p: &braid_ir::graph::Plan) -> Vec<String> {
    braid_passes::passes::sample_split::reusable_logprobs(p)
        .into_keys()
        .map(|n| p.graph.node(n).unwrap().label.clone().unwrap_or_default())
        .collect()
}

/// The policy's own log-probabilities come from its training forward pass only when the
/// update is a single optimizer step and nothing but the loss reads them.
#[test]
fn on_policy_logprobs_are_reused_only_when_exact() {
    let run = |pipeline: &str, settings: &str| {
        lower(
            "t.rlhf",
            &format!("use std::{pipeline}\n{REUSE_MODELS}{settings}"),
        )
    };
    let one = run(
        "grpo",
        "run grpo(policy, d, reward: r) {\n  steps: 1\n  batch: 2\n  group: 2\n}\n",
    );
    assert_eq!(reused_labels(&one), vec!["old_logp".to_string()]);
    let epochs = run(
        "grpo",
        "run grpo(policy, d, reward: r) {\n  steps: 1\n  batch: 2\n  group: 2\n  epochs: 2\n}\n",
    );
    assert!(reused_labels(&epochs).is_empty());
    let minibatches = run(
        "grpo",
        "run grpo(policy, d, reward: r) {\n  steps: 1\n  batch: 2\n  group: 2\n  minibatches: 2\n}\n",
    );
    assert!(reused_labels(&minibatches).is_empty());
    // PPO shapes rewards with old_logp (a kernel reads it): computed by inference.
    let ppo = run(
        "ppo",
        "run ppo_fn(policy, d, reward: r, critic: critic) {\n  steps: 1\n  batch: 2\n  minibatches: 1\n}\n",
    );
    assert!(reused_labels(&ppo).is_empty());
    // The pass records it, and the reused call neither streams nor costs time.
    let mut a = annotate(one.clone(), "cpu", Pins::default());
    PassManager::new().run(&mut a, |_, _| {}).unwrap();
    let (&lp, _) = a.decisions.reused_logprobs.iter().next().unwrap();
    assert_eq!(a.decisions.streams[&lp].cut, Cut::Batch);
    assert!(
        a.to_exec_plan()
            .streamed(braid_ir::graph::NodeId(1))
            .iter()
            .all(|(c, _)| *c != lp)
    );
}

/// At run time the migration is re-chosen from the lengths an iteration produced: a long tail
/// keeps it (within the plan's instances), lengths that are all equal have no tail to migrate.
#[test]
fn migration_is_rechosen_from_observed_lengths() {
    let a = planned(ppo_7b(), "2x8xH100", Pins::default());
    let g = a
        .calls()
        .into_iter()
        .find(|i| a.call_name(*i) == "generate(actor)")
        .unwrap();
    let planned_kept = a.decisions.migrations[&g].to_instances;
    let retune = |lengths: &[u64]| {
        braid_passes::passes::sample_split::retune_migration(&a, g, lengths, planned_kept).unwrap()
    };
    let mut tail = vec![40u64; 120];
    tail.extend([512u64; 8]);
    let (threshold, kept) = retune(&tail).expect("a long tail migrates");
    assert!(
        kept >= 1 && kept <= planned_kept,
        "{kept} of {planned_kept}"
    );
    assert!((1..=64).contains(&threshold), "{threshold}");
    assert_eq!(retune(&tail), Some((threshold, kept)), "deterministic");
    assert_eq!(retune(&[256u64; 128]), None, "no tail, nothing to migrate");
    assert!(
        braid_passes::passes::sample_split::retune_migration(&a, g, &[], planned_kept).is_err()
    );
}

/// The calls of a plan by name, with the placements a baseline gave them.
fn by_name(
    a: &Annotated,
    placements: &std::collections::BTreeMap<
        braid_ir::graph::NodeId,
        braid_passes::annotated::Placement,
    >,
) -> std::collections::BTreeMap<String, braid_passes::annotated::Placement> {
    placements
        .iter()
        .map(|(id, p)| (a.call_name(*id), *p))
        .collect()
}

#[test]
fn reals_heuristic_follows_its_published_allocation() {
    // Four nodes of 8: generation pipelined over max(2, 4) stages on all 32 devices; equal
    // models split the trainings 2 + 2 nodes (`min(⌈4 · ½⌉, 3)`), `dp 2, tp 4`, a stage per
    // node; the reference on all devices; the reward model on the first half, the critic's
    // inference on the second.
    let a = annotate(ppo_7b(), "4x8xH100", Pins::default());
    let p = braid_passes::baselines::real_heuristic_placements(&a).unwrap();
    let p = by_name(&a, &p);
    let shape = |n: &str| {
        let x = p[n];
        (x.first, x.count, x.dp, x.tp, x.pp)
    };
    assert_eq!(shape("generate(actor)"), (0, 32, 8, 1, 4));
    assert_eq!(shape("train(actor)"), (0, 16, 2, 4, 2));
    assert_eq!(shape("train(critic)"), (16, 16, 2, 4, 2));
    assert_eq!(shape("logprobs(ref)"), (0, 32, 2, 4, 4));
    assert_eq!(shape("score(rm)"), (0, 16, 2, 4, 2));
    assert_eq!(shape("values(critic)"), (16, 16, 2, 4, 2));
    // One node: halves, `tp 2` for 7B models.
    let a = annotate(ppo_7b(), "1x8xH100", Pins::default());
    let p = by_name(
        &a,
        &braid_passes::baselines::real_heuristic_placements(&a).unwrap(),
    );
    assert_eq!((p["generate(actor)"].dp, p["generate(actor)"].pp), (4, 2));
    assert_eq!(
        (
            p["train(critic)"].first,
            p["train(critic)"].tp,
            p["train(critic)"].dp
        ),
        (4, 2, 2)
    );
    // Written for nodes of 8 GPUs.
    let a = annotate(ppo_7b(), "2x4xH100", Pins::default());
    let e = braid_passes::baselines::real_heuristic_placements(&a).unwrap_err();
    assert!(e.contains("nodes of 8"), "{e}");
}

#[test]
fn reals_symmetric_plan_puts_every_call_on_all_devices_with_one_layout() {
    // The figure's "ReaL-Heuristic": tp over a node's 8 devices, a stage per node, dp 1; ReaL's
    // default micro-batches (pp for generation and inference, 2·pp for a pipelined training).
    let a = annotate(ppo_7b(), "4x8xH100", Pins::default());
    let p = by_name(
        &a,
        &braid_passes::baselines::real_symmetric_placements(&a).unwrap(),
    );
    assert_eq!(p.len(), a.calls().len());
    for (name, x) in &p {
        assert_eq!(
            (x.first, x.count, x.dp, x.tp, x.pp),
            (0, 32, 1, 8, 4),
            "{name}"
        );
        let mb = if name.starts_with("train") { 8 } else { 4 };
        assert_eq!(x.microbatches, mb, "{name}");
    }
    // One node: no pipeline, one micro-batch for training.
    let a = annotate(ppo_7b(), "1x8xH100", Pins::default());
    let p = by_name(
        &a,
        &braid_passes::baselines::real_symmetric_placements(&a).unwrap(),
    );
    let t = p["train(actor)"];
    assert_eq!((t.dp, t.tp, t.pp, t.microbatches), (1, 8, 1, 1));
}

/// `place` searches within what a device holds at once: every trained model's state stays
/// resident between its calls, so a plan whose devices could run each call alone but not hold
/// the trained models together is not chosen when one that fits exists.
#[test]
fn placement_keeps_what_every_device_holds_within_its_memory() {
    let a = planned(ppo_7b(), "1x8xH100", Pins::default());
    let placements = a.decisions.placements.clone();
    assert_eq!(
        braid_passes::estimate::memory_overflow(&a, &placements, &mut |id, p| {
            braid_passes::estimate::call_memory(&a, id, p)
        }),
        0
    );
    let thirteen = PPO_7B.replace("llama-7b", "llama-13b");
    let small = annotate(
        lower("ppo_13b.rlhf", &thirteen),
        "1x4xH100",
        Pins::default(),
    );
    let two: std::collections::BTreeMap<_, _> = small
        .calls()
        .into_iter()
        .filter(|id| small.call_name(*id).starts_with("train"))
        .map(|id| {
            (
                id,
                braid_passes::annotated::Placement {
                    first: 0,
                    count: 4,
                    dp: 1,
                    tp: 4,
                    pp: 1,
                    microbatches: 32,
                },
            )
        })
        .collect();
    // Each 13B training alone fits four devices (its 20 B a parameter in bf16 quartered by
    // tp 4: 65 GB); the two trained models' state together does not.
    for (id, p) in &two {
        assert!(braid_passes::estimate::fits(&small, *id, p));
    }
    assert!(
        braid_passes::estimate::memory_overflow(&small, &two, &mut |id, p| {
            braid_passes::estimate::call_memory(&small, id, p)
        }) > 0
    );
}

#[test]
fn deepspeed_chat_gathers_for_every_call_and_limits_its_generation_batch() {
    let a = annotate(ppo_7b(), "1x8xH100", Pins::default());
    let (p, extras, rows) = braid_passes::baselines::deepspeed_chat(&a).unwrap();
    let p = by_name(&a, &p);
    // ZeRO-3 data parallel for everything but the hybrid engine's generation.
    assert_eq!((p["train(actor)"].dp, p["train(actor)"].tp), (8, 1));
    assert_eq!(p["generate(actor)"].count, 8);
    assert!(rows >= 1);
    // One gather before generation, one per call after it; all positive.
    let named: Vec<String> = extras.iter().map(|x| a.call_name(x.call)).collect();
    for call in [
        "generate(actor)",
        "train(actor)",
        "train(critic)",
        "logprobs(ref)",
    ] {
        assert!(named.iter().any(|n| n == call), "{call}: {named:?}");
    }
    assert!(extras.iter().all(|x| x.seconds > 0.0 && !x.after));
    // A 65B actor gathered on one 80 GB device cannot generate: the baseline says so.
    let big = PPO_7B.replace("llama-7b", "llama-65b");
    let a = annotate(lower("big.rlhf", &big), "1x1xH100", Pins::default());
    let e = braid_passes::baselines::deepspeed_chat(&a).unwrap_err();
    assert!(e.contains("hybrid engine"), "{e}");
}

#[test]
fn openrlhf_places_engines_and_groups_apart_and_broadcasts_weights() {
    let a = annotate(ppo_7b(), "2x8xH100", Pins::default());
    let (p, extras, rows) = braid_passes::baselines::openrlhf(&a).unwrap();
    let p = by_name(&a, &p);
    let g = p["generate(actor)"];
    assert_eq!((g.first, g.count), (0, 8));
    assert!(rows <= braid_passes::baselines::VLLM_MAX_NUM_SEQS);
    assert_eq!((p["train(actor)"].first, p["train(actor)"].count), (8, 4));
    assert_eq!((p["logprobs(ref)"].first, p["logprobs(ref)"].count), (8, 4));
    assert_eq!(
        (p["train(critic)"].first, p["train(critic)"].count),
        (12, 4)
    );
    assert_eq!((p["score(rm)"].first, p["score(rm)"].count), (12, 4));
    let broadcast: Vec<_> = extras.iter().filter(|x| x.after).collect();
    assert_eq!(broadcast.len(), 1);
    assert_eq!(a.call_name(broadcast[0].call), "train(actor)");
    let devs = broadcast[0].devices.clone().unwrap();
    assert!(devs.contains(&0) && devs.contains(&8) && !devs.contains(&12));
    let a = annotate(ppo_7b(), "1x2xH100", Pins::default());
    assert!(braid_passes::baselines::openrlhf(&a).is_err());
}

#[test]
fn the_comparison_names_every_baseline_or_says_why_not() {
    let a = annotate(ppo_7b(), "2x8xH100", Pins::default());
    let opts = braid_passes::sim::SimOptions {
        iterations: 1,
        seed: 1,
    };
    let s = braid_passes::to_sim::systems(&a, &[], &opts).unwrap();
    let names: Vec<&str> = s.results.iter().map(|r| r.system.as_str()).collect();
    for prefix in [
        "deepspeed-chat",
        "openrlhf",
        "real-heuristic (ReaL's",
        "real-symmetric",
        "braid",
    ] {
        assert!(names.iter().any(|n| n.starts_with(prefix)), "{names:?}");
    }
    assert!(s.notes.is_empty(), "{:?}", s.notes);
    // On one device neither OpenRLHF nor ReaL's rule applies; the notes say so.
    let a = annotate(ppo_7b(), "1x1xH100", Pins::default());
    let s = braid_passes::to_sim::systems(&a, &[], &opts).unwrap();
    assert!(
        s.notes
            .iter()
            .any(|n| n.starts_with("openrlhf not simulated")),
        "{:?}",
        s.notes
    );
    assert!(
        s.notes.iter().any(|n| n.starts_with("real-heuristic:")),
        "{:?}",
        s.notes
    );
}

/// On several CPU ranks the simulated iteration holds the runtime's exchanges among all ranks:
/// one as the generation ends (the rollout and the results streamed under it), and one where
/// the other inference calls' rows are first read; every call that reads them waits for it.
/// On GPUs (whose collective figures are not the hosts' Gloo ones) there are none.
#[test]
fn cpu_ranks_exchange_the_rollout_and_the_rows_as_the_runtime_does() {
    let plan = example("ppo_tiny");
    for (fusion, cluster) in [(true, "1x2xcpu"), (false, "1x2xcpu"), (true, "1x2xH100")] {
        let a = planned(plan.clone(), cluster, Pins::default());
        let (dag, tasks) = braid_passes::to_sim::to_dag(&a, fusion).unwrap();
        let gathers: Vec<usize> = (0..dag.tasks.len())
            .filter(|&t| dag.tasks[t].stage == "gather")
            .collect();
        if cluster.ends_with("H100") {
            assert!(gathers.is_empty(), "{cluster}: {gathers:?}");
            continue;
        }
        assert!(
            !gathers.is_empty(),
            "{cluster} fusion {fusion}: no exchange"
        );
        for &t in &gathers {
            assert_eq!(
                dag.tasks[t].devices.len(),
                2,
                "an exchange holds every rank"
            );
        }
        let generation = a
            .calls()
            .into_iter()
            .find(|i| a.call_name(*i) == "generate(policy)")
            .unwrap();
        // The generation's exchange follows the generation and every call streamed under it.
        let after_gen: Vec<usize> = gathers
            .iter()
            .copied()
            .filter(|&t| dag.tasks[t].deps.contains(&tasks[&generation]))
            .collect();
        assert_eq!(after_gen.len(), 1, "one exchange as the generation ends");
        let streamed: Vec<_> = a
            .decisions
            .streams
            .iter()
            .filter(|(id, s)| {
                fusion
                    && s.cut == Cut::Sample
                    && s.generate == generation
                    && a.plan
                        .graph
                        .node(**id)
                        .is_some_and(|n| n.op.is_model_call())
            })
            .map(|(id, _)| *id)
            .collect();
        assert_eq!(
            fusion,
            !streamed.is_empty(),
            "{cluster}: streamed {streamed:?}"
        );
        for c in &streamed {
            assert!(
                dag.tasks[after_gen[0]].deps.contains(&tasks[c]),
                "{}: its rows travel with the rollout",
                a.call_name(*c)
            );
        }
        // A training reads every inference call: it waits for an exchange, never for a call
        // directly (its rows are on other ranks too).
        let train = a
            .calls()
            .into_iter()
            .find(|i| a.call_name(*i) == "train(policy)")
            .unwrap();
        let deps = &dag.tasks[tasks[&train].0].deps;
        assert!(deps.iter().any(|d| dag.tasks[d.0].stage == "gather"));
        assert!(
            !deps.iter().any(|d| dag.tasks[d.0].stage == "inference"),
            "{cluster} fusion {fusion}: the training waits for a call's own task"
        );
    }
}

/// A profile's measured spread between ranks prices every call on several ranks to end with
/// the slowest of them, and nothing on one rank.
#[test]
fn calls_on_several_ranks_end_with_their_slowest() {
    use braid_cost::sim::{Work, simulate};
    let plan = example("ppo_tiny");
    for cluster in ["1x2xcpu", "1x1xcpu"] {
        let even = planned(plan.clone(), cluster, Pins::default());
        let mut spread = even.clone();
        spread.cost.device.rank_spread = 0.1;
        let factor = spread.cost.slowest_of(2);
        assert!((factor - (1.0 + 0.1 / std::f64::consts::PI.sqrt())).abs() < 1e-6);
        let (d0, _) = braid_passes::to_sim::to_dag(&even, true).unwrap();
        let (d1, _) = braid_passes::to_sim::to_dag(&spread, true).unwrap();
        assert_eq!(d0.tasks.len(), d1.tasks.len());
        let mut several = 0;
        for (t0, t1) in d0.tasks.iter().zip(&d1.tasks) {
            let k = if t0.devices.len() > 1 { factor } else { 1.0 };
            match (&t0.work, &t1.work) {
                // An exchange is priced at the skew the spread makes the ranks arrive apart.
                (
                    Work::Exchange {
                        by_skew: a,
                        range: r0,
                    },
                    Work::Exchange {
                        by_skew: b,
                        range: r1,
                    },
                ) => {
                    assert_eq!(a, b, "{}", t0.name);
                    let n = t0.devices.len() as u64;
                    assert_eq!(*r0, even.cost.arrival_range(n), "{}", t0.name);
                    assert_eq!(*r1, spread.cost.arrival_range(n), "{}", t0.name);
                    assert!(*r1 > 0.0, "{}", t0.name);
                }
                (Work::Fixed { seconds: a }, Work::Fixed { seconds: b }) if t0.stage == "train" => {
                    assert!(
                        (b - a * k).abs() <= 1e-12 + 1e-9 * a,
                        "{}: {a} → {b}",
                        t0.name
                    );
                    several += usize::from(t0.devices.len() > 1);
                }
                (Work::PerSample { per_sample: a, .. }, Work::PerSample { per_sample: b, .. }) => {
                    assert!(
                        (b - a * k).abs() <= 1e-15 + 1e-9 * a,
                        "{}: {a} → {b}",
                        t0.name
                    );
                    several += usize::from(t0.devices.len() > 1);
                }
                (a, b) if t0.stage != "train" => {
                    if !matches!(a, Work::Generate(_)) {
                        assert_eq!(a, b, "{}", t0.name);
                    }
                }
                _ => panic!("{}: the work changed kind", t0.name),
            }
        }
        let opts = braid_cost::sim::SimOptions::default();
        let (r0, r1) = (simulate(&d0, &opts).unwrap(), simulate(&d1, &opts).unwrap());
        if cluster == "1x2xcpu" {
            assert!(several > 0, "no call on both ranks");
            assert!(
                r1.mean_iteration_time > r0.mean_iteration_time,
                "{} vs {}",
                r1.mean_iteration_time,
                r0.mean_iteration_time
            );
        } else {
            assert_eq!(several, 0);
            assert_eq!(r1.mean_iteration_time, r0.mean_iteration_time);
        }
    }
}
