//! Two measurements on 2 Gloo ranks of this machine (one per core, one libtorch thread each),
//! side by side in one run:
//!
//! 1. **Reshards** of a 30M-parameter Llama-shaped model (f32) between layouts of 2 devices:
//!    bytes the transfer plan moves and seconds it takes (the slower rank, median of 5),
//!    against the planner's estimate of the bytes (`braid_passes::estimate::reshard_bytes`)
//!    and the cost model's seconds for its busiest receiver (`reshard_seconds`' formula with
//!    the CPU device's figures).
//! 2. **Fused against sequential** training of two models (RLHFuse intra-stage fusion): two
//!    2-stage pipelines in opposite directions, trained one after the other by 1F1B, then as
//!    the fused-pipeline solver's schedule built from the stage times profiled here; measured
//!    ratio (sequential / fused, median of 3 alternating rounds) beside the solver's predicted
//!    ratio (its serial-1F1B latency over its fused latency).
//!
//! It starts its own ranks (this binary again, told its rank through torchrun's variables):
//!
//!     cargo run -p braid-runtime --example bench_parallel

use std::path::PathBuf;
#[path = "common/ranks.rs"]
mod ranks;

use std::process::ExitCode;
use std::time::{Duration, Instant};

use braid_cost::cost::{DeviceKind, ModelShape};
use braid_cost::fused_pipeline;
use braid_cost::fused_pipeline::spec::{ModelSpec, PipelineSpec, RealSchedule};
use braid_ir::exec_plan::Placement;
use braid_ir::settings::Head;
use braid_ir::transfer::{Param, dims, params, plan_reshard};
use braid_runtime::dist::{GroupOptions, ProcessGroup, ReduceOp, World};
use braid_runtime::exec::realloc::{run_plan, slices_of};
use braid_runtime::models::config::ModelConfig;
use braid_runtime::models::pipeline::{FusedPart, MicroBatch, Pass, Pipeline, run_fused};
use braid_runtime::{Device, Kind, Model};
use tch::Tensor;

const RANK_VAR: &str = "BRAID_BENCH_RANK";
const RANKS: usize = 2;

fn main() -> ExitCode {
    ranks::run(
        "bench_parallel",
        RANK_VAR,
        RANKS,
        Duration::from_secs(1200),
        bench_rank,
    )
}

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn bench_rank() -> Res<()> {
    tch::set_num_threads(1);
    let world = World::from_env()?;
    let group = ProcessGroup::init(&world, GroupOptions::gloo(Duration::from_secs(60)))?;
    reshards(&group)?;
    fused(&group)?;
    group.shutdown()?;
    Ok(())
}

/// The slower rank's value.
fn slowest(group: &ProcessGroup, mine: f64) -> Res<f64> {
    let mut t = Tensor::from_slice(&[mine]);
    group.all_reduce(&mut t, ReduceOp::Max)?;
    Ok(t.double_value(&[0]))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn placement(first: u64, dp: u64, tp: u64, pp: u64) -> Placement {
    Placement {
        first,
        count: dp * tp * pp,
        dp,
        tp,
        pp,
        microbatches: 1,
    }
}

fn label(p: &Placement) -> String {
    let mesh = if p.count == 1 {
        format!("rank {}", p.first)
    } else {
        format!("ranks {}–{}", p.first, p.first + p.count - 1)
    };
    format!("dp{} tp{} pp{} on {mesh}", p.dp, p.tp, p.pp)
}

fn reshards(group: &ProcessGroup) -> Res<()> {
    let shape = ModelShape {
        name: "bench".into(),
        layers: 8,
        hidden: 512,
        heads: 8,
        kv_heads: 8,
        intermediate: 1376,
        vocab: 32000,
        tied_embeddings: false,
        declared_params: None,
    };
    let head = Head::Lm;
    let whole = |p: Param| -> braid_runtime::Result<Tensor> {
        let i = params(&shape, head)
            .iter()
            .position(|q| *q == p)
            .unwrap_or(0);
        tch::manual_seed(i as i64);
        let (r, c) = dims(&shape, p);
        Ok(Tensor::randn(
            [r as i64, c as i64],
            (Kind::Float, Device::Cpu),
        ))
    };
    let pairs = [
        (placement(0, 2, 1, 1), placement(0, 1, 2, 1)),
        (placement(0, 1, 2, 1), placement(0, 2, 1, 1)),
        (placement(0, 1, 2, 1), placement(0, 1, 1, 2)),
        (placement(0, 1, 1, 2), placement(0, 1, 2, 1)),
        (placement(0, 1, 2, 1), placement(0, 1, 1, 1)),
        (placement(0, 1, 1, 1), placement(1, 1, 1, 1)),
    ];
    let device = DeviceKind::Cpu.spec();
    if group.rank() == 0 {
        println!(
            "Reshards of a {:.1}M-parameter model (f32) on {} Gloo ranks over 127.0.0.1",
            shape.params() as f64 / 1e6,
            group.size()
        );
        println!(
            "| from | to | bytes moved (plan) | bytes (planner's estimate) | busiest receiver | seconds measured | seconds predicted | measured / predicted |"
        );
        println!("| --- | --- | --- | --- | --- | --- | --- | --- |");
    }
    for (from, to) in pairs {
        let plan = plan_reshard(&shape, head, &from, &to);
        let rank = group.rank() as u64;
        let mut times = Vec::new();
        for _ in 0..5 {
            let held = slices_of(&shape, head, &from, rank, &whole)?;
            group.barrier()?;
            let start = Instant::now();
            let got = run_plan(&plan, &shape, head, &from, &to, group, held, Kind::Float)?;
            let mine = start.elapsed().as_secs_f64();
            drop(got);
            times.push(slowest(group, mine)?);
        }
        let moved = plan.bytes_moved(&shape, 4);
        // The busiest receiver's bytes, from the plan.
        let mut per_dest = std::collections::BTreeMap::<u64, u64>::new();
        for t in &plan.transfers {
            for d in t.to.iter().filter(|d| **d != t.from) {
                *per_dest.entry(*d).or_default() += t.slice.elements(&shape) * 4;
            }
        }
        let busiest = per_dest.values().copied().max().unwrap_or(0);
        let (estimate, estimate_most) =
            braid_passes::estimate::reshard_bytes(&shape, 4, &from, &to);
        let predicted = if estimate_most == 0 {
            0.0
        } else {
            estimate_most as f64 / (device.intra_node_bandwidth * device.network_efficiency)
                + device.intra_node_latency
        };
        let measured = median(times);
        if group.rank() == 0 {
            println!(
                "| {} | {} | {:.1} MB | {:.1} MB | {:.1} MB | {:.3} | {:.4} | {:.1} |",
                label(&from),
                label(&to),
                moved as f64 / 1e6,
                estimate as f64 / 1e6,
                busiest as f64 / 1e6,
                measured,
                predicted,
                if predicted > 0.0 {
                    measured / predicted
                } else {
                    f64::NAN
                }
            );
        }
    }
    Ok(())
}

/// A random Llama-family model of the benchmark's size.
fn bench_model(seed: u64) -> Res<Model> {
    let config = ModelConfig::from_json(
        &PathBuf::from("bench"),
        serde_json::json!({
            "model_type": "llama", "vocab_size": 512, "hidden_size": 256,
            "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 8,
            "intermediate_size": 688, "max_position_embeddings": 256,
            "rms_norm_eps": 1e-6, "tie_word_embeddings": false
        }),
    )?;
    Ok(Model::random(
        config,
        Head::Lm,
        seed,
        Device::Cpu,
        PathBuf::from("bench"),
    )?)
}

const MICRO: usize = 4;

fn micro_batches(seed: i64) -> Vec<MicroBatch> {
    (0..MICRO as i64)
        .map(|m| {
            tch::manual_seed(seed * 100 + m);
            MicroBatch {
                ids: Tensor::randint(512, [4, 64], (Kind::Int64, Device::Cpu)),
                mask: Tensor::ones([4, 64], (Kind::Int64, Device::Cpu)),
            }
        })
        .collect()
}

fn loss(model: &Model, mb: &MicroBatch, h: &Tensor) -> braid_runtime::Result<Tensor> {
    let (b, t) = mb.ids.size2()?;
    let h = h.narrow(1, 0, t - 1).reshape([b * (t - 1), -1]);
    let targets = mb.ids.narrow(1, 1, t - 1).reshape([-1]);
    let (lp, _) = model.token_logprobs(&h, &targets, 1.0, false)?;
    Ok(-lp.mean(Kind::Float))
}

fn zero_grads(m: &Model) {
    for (_, p) in m.held_parameters() {
        let mut g = p.grad();
        if g.defined() {
            let _ = g.zero_();
        }
    }
}

fn fused(group: &ProcessGroup) -> Res<()> {
    let rank = group.rank();
    let mut models = [bench_model(1)?, bench_model(2)?];
    let mut pipes = Vec::new();
    for (i, m) in models.iter_mut().enumerate() {
        let ranks: Vec<usize> = (0..2)
            .map(|j| fused_pipeline::device_of(2, i, 2, 0, j))
            .collect();
        let pipe = Pipeline::new(group, &ranks, m)?;
        let (stage, stages) = pipe.stage();
        m.retain_stage(stage, stages)?;
        pipes.push(pipe);
    }
    let micro = [micro_batches(1), micro_batches(2)];
    // Stage times of one micro-batch, profiled on this rank for each model's stage here (the
    // loss included on the last stage), then the slower rank's figure: the solver's inputs.
    let mut fwd = [0.0f64; 2];
    let mut bwd = [0.0f64; 2];
    for (i, m) in models.iter().enumerate() {
        let layers = pipes[i].layers();
        let last = pipes[i].is_last();
        let mb = &micro[i][0];
        let (mut f, mut b) = (Vec::new(), Vec::new());
        for _ in 0..3 {
            let input = (layers.start > 0).then(|| {
                Tensor::randn([4, 64, 256], (Kind::Float, Device::Cpu)).set_requires_grad(true)
            });
            let t0 = Instant::now();
            let out = m.stage_forward(
                &mb.ids,
                Some(&mb.mask),
                input.as_ref(),
                layers.clone(),
                last,
            )?;
            let top = if last {
                loss(m, mb, &out)?
            } else {
                out.sum(Kind::Float)
            };
            f.push(t0.elapsed().as_secs_f64());
            let t1 = Instant::now();
            top.backward();
            b.push(t1.elapsed().as_secs_f64());
            zero_grads(m);
        }
        fwd[i] = slowest(group, median(f))?;
        bwd[i] = slowest(group, median(b))?;
    }
    let spec = PipelineSpec {
        stages: 2,
        models: (0..2)
            .map(|i| ModelSpec {
                name: Some(format!("model {i}")),
                pp: 2,
                microbatches: MICRO,
                fwd: (fwd[i] * 1e4).round() / 1e4,
                bwd: (bwd[i] * 1e4).round() / 1e4,
                mem_per_microbatch: 1.0,
            })
            .collect(),
        search: Default::default(),
    };
    let (problem, grid) = spec.to_problem()?;
    let solved = fused_pipeline::solve(&problem)?;
    let real = RealSchedule::new(&solved, grid);
    let mine = real
        .schedule
        .iter()
        .find(|d| d.device == rank)
        .ok_or("the schedule has no tasks for this rank")?;
    let tasks: Vec<(usize, usize, Pass)> = mine
        .tasks
        .iter()
        .map(|t| (t.model, t.microbatch, Pass::from(t.kind)))
        .collect();
    let (mut seq, mut fus) = (Vec::new(), Vec::new());
    for _ in 0..3 {
        for m in &models {
            zero_grads(m);
        }
        group.barrier()?;
        let t0 = Instant::now();
        for i in 0..2 {
            let m = &models[i];
            let mb = &micro[i];
            pipes[i].train_1f1b(m, mb, &mut |k, h| loss(m, &mb[k], h))?;
        }
        seq.push(slowest(group, t0.elapsed().as_secs_f64())?);
        for m in &models {
            zero_grads(m);
        }
        group.barrier()?;
        let t0 = Instant::now();
        {
            let (p0, p1) = pipes.split_at_mut(1);
            let (m0, m1) = (&models[0], &models[1]);
            let mut l0 = |k: usize, h: &Tensor| loss(m0, &micro[0][k], h);
            let mut l1 = |k: usize, h: &Tensor| loss(m1, &micro[1][k], h);
            let mut parts = [
                FusedPart {
                    pipeline: &mut p0[0],
                    model: m0,
                    micro: &micro[0],
                    loss: &mut l0,
                },
                FusedPart {
                    pipeline: &mut p1[0],
                    model: m1,
                    micro: &micro[1],
                    loss: &mut l1,
                },
            ];
            run_fused(&mut parts, &tasks)?;
        }
        fus.push(slowest(group, t0.elapsed().as_secs_f64())?);
    }
    if rank == 0 {
        let (s, f) = (median(seq), median(fus));
        println!();
        println!(
            "Fused against sequential training of two 2-stage pipelines in opposite directions, {MICRO} micro-batches of 4×64 tokens each"
        );
        println!(
            "profiled stage times (s): model 0 fwd {:.4} bwd {:.4}; model 1 fwd {:.4} bwd {:.4}",
            fwd[0], bwd[0], fwd[1], bwd[1]
        );
        println!("| | sequential 1F1B (s) | fused schedule (s) | sequential / fused |");
        println!("| --- | --- | --- | --- |");
        println!(
            "| solver (predicted) | {:.3} | {:.3} | {:.2} |",
            real.serial_1f1b_latency,
            real.latency,
            real.serial_1f1b_latency / real.latency
        );
        println!("| measured | {s:.3} | {f:.3} | {:.2} |", s / f);
    }
    Ok(())
}
