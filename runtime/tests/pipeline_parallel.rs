//! Pipeline parallelism against one process: on 2 Gloo ranks, each architecture's fixture
//! split into 2 stages and trained by 1F1B over 3 micro-batches gives the whole model's losses,
//! final hidden states and gradients (each stage's parameters) within 1e-5; on 4 ranks a
//! `tp 2 × pp 2` layout's training step (gradients, then the same SGD update) equals the
//! one-process step. Each rank compares with the whole model it loads itself. The harness is
//! `ranks/`.

#![allow(clippy::unwrap_used)] // Test helpers: a failed unwrap is a failed test.

mod compare;
mod ranks;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use braid_cost::fused_pipeline::{self, PipelineModel, PipelineProblem};
use braid_runtime::dist::ProcessGroup;
use braid_runtime::models::pipeline::{FusedPart, MicroBatch, Pass, Pipeline, run_fused};
use braid_runtime::{Head, Model};
use compare::{TOLERANCE, max_diff};
use ranks::{Ranks, child_rank, serial, world_group};
use tch::{Device, Kind, Tensor};

/// Three micro-batches of two right-padded sequences each.
fn micro_batches(vocab: i64) -> Vec<MicroBatch> {
    (0..3i64)
        .map(|m| {
            let a: Vec<i64> = (0..6).map(|i| (7 * m + 13 * i + 3) % vocab).collect();
            let b: Vec<i64> = (0..6)
                .map(|i| {
                    if i < 4 {
                        (11 * m + 5 * i + 1) % vocab
                    } else {
                        0
                    }
                })
                .collect();
            MicroBatch {
                ids: Tensor::from_slice(&[a, b].concat()).reshape([2, 6]),
                mask: Tensor::from_slice(&[1i64, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0]).reshape([2, 6]),
            }
        })
        .collect()
}

/// Micro-batch `m`'s loss from its final hidden states: a weighted sum of next-token
/// log-probabilities and entropies at temperature 0.8.
fn loss(model: &Model, mb: &MicroBatch, m: usize, hidden: &Tensor) -> Tensor {
    let ids = Vec::<i64>::try_from(mb.ids.reshape([-1])).unwrap();
    let lens = [6usize, 4];
    let (mut rows, mut cols, mut targets) = (Vec::new(), Vec::new(), Vec::new());
    for (r, &len) in lens.iter().enumerate() {
        for i in 0..len - 1 {
            rows.push(r as i64);
            cols.push(i as i64);
            targets.push(ids[r * 6 + i + 1]);
        }
    }
    let h = hidden.index(&[
        Some(Tensor::from_slice(&rows)),
        Some(Tensor::from_slice(&cols)),
    ]);
    let (lp, ent) = model
        .token_logprobs(&h, &Tensor::from_slice(&targets), 0.8, true)
        .unwrap();
    let w =
        Tensor::linspace(-1.0, 1.0, lp.size()[0], (Kind::Float, Device::Cpu)) * (m as f64 + 1.0);
    (lp * w).sum(Kind::Float) + ent.unwrap().sum(Kind::Float) * 0.05
}

/// The one-process reference: losses, final hidden states and every gradient.
fn reference(name: &str) -> (Vec<f64>, Vec<Tensor>, BTreeMap<String, Tensor>, Model) {
    let m = load(name);
    let micro = micro_batches(m.config().vocab_size);
    let mut losses = Vec::new();
    let mut hidden = Vec::new();
    for (i, mb) in micro.iter().enumerate() {
        let h = m.hidden_states(&mb.ids, Some(&mb.mask)).unwrap();
        let l = loss(&m, mb, i, &h);
        losses.push(l.double_value(&[]));
        l.backward();
        hidden.push(h.detach());
    }
    let grads = m
        .named_parameters()
        .into_iter()
        .map(|(n, t)| (n, t.grad()))
        .collect();
    (losses, hidden, grads, m)
}

/// Runs one pipeline stage of `name` (cut over `tp` first when given) and compares with the
/// reference; then one SGD step on both, compared parameter by parameter.
fn stage_against_reference(
    name: &str,
    world: &ProcessGroup,
    stage_ranks: &[usize],
    tp: Option<Arc<braid_runtime::dist::TensorParallel>>,
) {
    let (want_losses, want_hidden, want_grads, whole) = reference(name);
    let mut m = load(name);
    if let Some(tp) = tp {
        m = m.shard(tp).unwrap();
    }
    let mut pipe = Pipeline::new(world, stage_ranks, &m).unwrap();
    let (stage, stages) = pipe.stage();
    m.retain_stage(stage, stages).unwrap();
    let micro = micro_batches(m.config().vocab_size);
    let hidden = pipe.forward_all(&m, &micro).unwrap();
    let losses = pipe
        .train_1f1b(&m, &micro, &mut |i, h| Ok(loss(&m, &micro[i], i, h)))
        .unwrap();
    if stage + 1 == stages {
        for (a, b) in want_hidden.iter().zip(hidden.as_ref().unwrap()) {
            let d = max_diff(a, b);
            assert!(d <= TOLERANCE, "{name}: final hidden states differ by {d}");
        }
    } else {
        assert!(hidden.is_none() && losses.is_empty());
    }
    check_stage(name, &m, &pipe, &losses, &want_losses, &want_grads);
    // One SGD step on both: the stage's parameters stay the whole model's.
    let lr = 0.1;
    let step = |model: &Model| {
        tch::no_grad(|| {
            for (_, mut p) in model.held_parameters() {
                let g = p.grad();
                if g.defined() {
                    let _ = p.f_sub_(&(g * lr)).unwrap();
                }
            }
        })
    };
    step(&whole);
    step(&m);
    let after: BTreeMap<String, Tensor> = whole.named_parameters().into_iter().collect();
    for (n, p) in m.gather_parameters().unwrap() {
        let d = max_diff(&after[&n], &p);
        assert!(d <= TOLERANCE, "{name}: after the step, {n} differs by {d}");
    }
    println!("{name}: stage {stage} of {stages} agrees");
}

fn pp2_rank(rank: usize) {
    tch::set_num_threads(1);
    let world = world_group(Duration::from_secs(60), Duration::from_millis(200));
    for name in [
        "llama_gqa",
        "llama_tied",
        "qwen2_bias",
        "mistral_window",
        "gpt2",
    ] {
        stage_against_reference(name, &world, &[0, 1], None);
    }
    let _ = rank;
}

fn tp2_pp2_rank(rank: usize) {
    tch::set_num_threads(1);
    let world = world_group(Duration::from_secs(60), Duration::from_millis(200));
    // The planner's coordinates: tensor-parallel rank innermost, then stages.
    let (t, stage) = (rank % 2, rank / 2);
    let tp_group = world.subgroup(&[2 * stage, 2 * stage + 1]).unwrap();
    let tp = Arc::new(tp_group.tensor_parallel().unwrap());
    for name in ["llama_gqa", "llama_tied"] {
        stage_against_reference(name, &world, &[t, 2 + t], Some(tp.clone()));
    }
}

#[test]
fn pipeline_degree_2_trains_like_one_process_for_every_architecture() {
    if let Some(rank) = child_rank() {
        return pp2_rank(rank);
    }
    let _serial = serial();
    let mut ranks = Ranks::spawn(
        "pipeline_degree_2_trains_like_one_process_for_every_architecture",
        2,
        &[],
    );
    ranks.expect_all_success(Duration::from_secs(600));
    assert!(
        ranks.output(1).contains("gpt2: stage 1 of 2 agrees"),
        "{}",
        ranks.all_output()
    );
}

#[test]
fn a_tp2_pp2_training_step_on_4_ranks_equals_the_one_process_step() {
    if let Some(rank) = child_rank() {
        return tp2_pp2_rank(rank);
    }
    let _serial = serial();
    let mut ranks = Ranks::spawn(
        "a_tp2_pp2_training_step_on_4_ranks_equals_the_one_process_step",
        4,
        &[],
    );
    ranks.expect_all_success(Duration::from_secs(600));
    assert!(
        ranks.output(3).contains("llama_tied: stage 1 of 2 agrees"),
        "{}",
        ranks.all_output()
    );
}

/// Checks a stage's losses (on the last stage) and gradients against the reference, and that
/// the stage holds parameters of its own layers only.
fn check_stage(
    name: &str,
    m: &Model,
    pipe: &Pipeline,
    losses: &[f64],
    want_losses: &[f64],
    want_grads: &BTreeMap<String, Tensor>,
) {
    let (stage, stages) = pipe.stage();
    if stage + 1 == stages {
        assert_eq!(losses.len(), want_losses.len());
        for (a, b) in want_losses.iter().zip(losses) {
            assert!(
                (a - b).abs() <= TOLERANCE * a.abs().max(1.0),
                "{name}: loss {b} against {a}"
            );
        }
    }
    let grads = m.gather_gradients().unwrap();
    assert!(!grads.is_empty(), "{name}: stage {stage} holds nothing");
    let layers = pipe.layers();
    for (n, g) in &grads {
        let layer = n
            .strip_prefix("model.layers.")
            .or_else(|| n.strip_prefix("transformer.h."))
            .and_then(|r| r.split('.').next())
            .and_then(|i| i.parse::<usize>().ok());
        if let Some(i) = layer {
            assert!(layers.contains(&i), "{name}: stage {stage} holds layer {i}");
        }
        let d = max_diff(&want_grads[n], g);
        assert!(
            d <= TOLERANCE,
            "{name}: stage {stage}: gradient of {n} differs by {d}"
        );
    }
}

/// Two fixture models on 2 ranks, model `i`'s pipeline on `stage_ranks[i]`, each stage keeping
/// only its parameters, with their micro-batches (the first `micro` of them).
fn two_pipelines(
    world: &ProcessGroup,
    names: [&str; 2],
    stage_ranks: [[usize; 2]; 2],
    micro: usize,
) -> (Vec<Model>, Vec<Pipeline>, Vec<Vec<MicroBatch>>) {
    let mut models: Vec<Model> = names.iter().map(|n| load(n)).collect();
    let mut pipes = Vec::new();
    for (m, ranks) in models.iter_mut().zip(stage_ranks) {
        let pipe = Pipeline::new(world, &ranks, m).unwrap();
        let (stage, stages) = pipe.stage();
        m.retain_stage(stage, stages).unwrap();
        pipes.push(pipe);
    }
    let batches = models
        .iter()
        .map(|m| {
            micro_batches(m.config().vocab_size)
                .into_iter()
                .take(micro)
                .collect()
        })
        .collect();
    (models, pipes, batches)
}

/// Runs this rank's `order` of the two models' subtasks as one fused schedule.
fn run_two(
    models: &[Model],
    pipes: &mut [Pipeline],
    micro: &[Vec<MicroBatch>],
    order: &[(usize, usize, Pass)],
) -> Vec<Vec<f64>> {
    let (p0, p1) = pipes.split_at_mut(1);
    let mut loss0 = |i: usize, h: &Tensor| Ok(loss(&models[0], &micro[0][i], i, h));
    let mut loss1 = |i: usize, h: &Tensor| Ok(loss(&models[1], &micro[1][i], i, h));
    let mut parts = [
        FusedPart {
            pipeline: &mut p0[0],
            model: &models[0],
            micro: &micro[0],
            loss: &mut loss0,
        },
        FusedPart {
            pipeline: &mut p1[0],
            model: &models[1],
            micro: &micro[1],
            loss: &mut loss1,
        },
    ];
    run_fused(&mut parts, order).unwrap()
}

/// Two models trained as one fused schedule (RLHFuse's intra-stage fusion) on 2 ranks: the
/// solver's schedule for two 2-stage pipelines running in opposite directions, executed in its
/// order on each rank, gives each model the gradients of its own one-process training.
fn fused_rank(rank: usize) {
    tch::set_num_threads(1);
    let world = world_group(Duration::from_secs(60), Duration::from_millis(200));
    let names = ["llama_gqa", "mistral_window"];
    let problem = PipelineProblem {
        stages: 2,
        models: names
            .iter()
            .map(|n| PipelineModel {
                name: Some((*n).into()),
                pp: 2,
                microbatches: 3,
                fwd: 1,
                bwd: 2,
                mem_per_microbatch: 1,
            })
            .collect(),
        search: Default::default(),
    };
    let schedule = fused_pipeline::solve(&problem).unwrap();
    let mine = schedule.schedule.iter().find(|d| d.device == rank).unwrap();
    let tasks: Vec<(usize, usize, Pass)> = mine
        .tasks
        .iter()
        .map(|t| (t.model, t.microbatch, Pass::from(t.kind)))
        .collect();
    // Both models' subtasks interleave on this rank.
    assert!(tasks.iter().any(|t| t.0 == 0) && tasks.iter().any(|t| t.0 == 1));
    let refs: Vec<_> = names.iter().map(|n| reference(n)).collect();
    let ranks = |i: usize| [0, 1].map(|j| fused_pipeline::device_of(2, i, 2, 0, j));
    let (models, mut pipes, micro) = two_pipelines(&world, names, [ranks(0), ranks(1)], 3);
    let losses = run_two(&models, &mut pipes, &micro, &tasks);
    for (i, name) in names.iter().enumerate() {
        check_stage(
            name, &models[i], &pipes[i], &losses[i], &refs[i].0, &refs[i].2,
        );
    }
    println!(
        "fused schedule on rank {rank}: {} subtasks, solver latency {} against {} for the two 1F1B trainings one after the other",
        tasks.len(),
        schedule.latency,
        schedule.serial_1f1b_latency
    );
}

#[test]
fn a_fused_actor_critic_schedule_on_2_ranks_trains_both_like_one_process() {
    if let Some(rank) = child_rank() {
        return fused_rank(rank);
    }
    let _serial = serial();
    let mut ranks = Ranks::spawn(
        "a_fused_actor_critic_schedule_on_2_ranks_trains_both_like_one_process",
        2,
        &[],
    );
    ranks.expect_all_success(Duration::from_secs(600));
    assert!(
        ranks.output(0).contains("fused schedule on rank 0"),
        "{}",
        ranks.all_output()
    );
}

/// A valid order in which a stage sends twice on one link before its peer receives the first
/// message, because the peer first waits for something this stage sends later on another
/// link: sends must never block the stage (a stage that waited for its first send to be
/// received before queueing the second would deadlock here).
fn sends_never_block_rank(rank: usize) {
    tch::set_num_threads(1);
    let world = world_group(Duration::from_secs(30), Duration::from_millis(200));
    let names = ["llama_gqa", "mistral_window"];
    let (f, b) = (Pass::Forward, Pass::Backward);
    // Model 0 runs stage 0 on rank 0; model 1 runs stage 0 on rank 1.
    let order: Vec<(usize, usize, Pass)> = if rank == 0 {
        vec![
            (0, 0, f),
            (0, 1, f),
            (1, 0, f),
            (1, 0, b),
            (1, 1, f),
            (1, 1, b),
            (0, 0, b),
            (0, 1, b),
        ]
    } else {
        vec![
            (1, 0, f),
            (1, 1, f),
            (1, 0, b),
            (0, 0, f),
            (0, 0, b),
            (0, 1, f),
            (0, 1, b),
            (1, 1, b),
        ]
    };
    let (models, mut pipes, micro) = two_pipelines(&world, names, [[0, 1], [1, 0]], 2);
    run_two(&models, &mut pipes, &micro, &order);
    println!("rank {rank}: the order ran");
}

#[test]
fn a_stage_never_waits_for_its_own_sends() {
    if let Some(rank) = child_rank() {
        return sends_never_block_rank(rank);
    }
    let _serial = serial();
    let mut ranks = Ranks::spawn("a_stage_never_waits_for_its_own_sends", 2, &[]);
    ranks.expect_all_success(Duration::from_secs(120));
    assert!(
        ranks.output(1).contains("rank 1: the order ran"),
        "{}",
        ranks.all_output()
    );
}

/// Fixture `name` with its language-model head.
fn load(name: &str) -> Model {
    compare::load(name, Head::Lm)
}
