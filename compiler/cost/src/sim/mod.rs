//! The cluster simulator: a discrete-event engine that runs a DAG of tasks on devices over
//! several iterations, with generation lengths drawn from a distribution, long-tail
//! migration and sample-level streaming (RLHFuse's inter-stage fusion), and reports iteration
//! time, per-stage times, per-device utilisation and the bubble fraction, with the timeline as
//! Chrome-trace JSON or SVG.
//!
//! `braid sim` shows what a plan does at cluster scale before any GPU is involved. This module
//! and its children compute values only: they must not read or write files or print.

pub mod dag;
pub mod engine;
pub mod lengths;
pub mod trace;

pub use dag::{
    Dag, DagBuilder, DagError, ENGINE_MAX_BATCH, GenerateSpec, Migration, TaskId, TaskSpec, Work,
};
pub use engine::{
    GenerationReport, IterationReport, SimError, SimOptions, SimReport, Span, StageSummary,
    StageTime, pick_migration_threshold, simulate,
};
pub use lengths::{LengthDist, LengthError};
pub use trace::{spans_to_chrome_trace, spans_to_svg, to_chrome_trace, to_svg};

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::{CostModel, DeviceKind, Layout, ModelShape};

    /// Checks a timeline: spans well-formed, and no device doing two things at once.
    fn check_timeline(report: &SimReport, devices: usize) {
        let mut per: Vec<Vec<&Span>> = vec![Vec::new(); devices];
        for s in &report.timeline {
            assert!(s.end >= s.start && s.start >= 0.0, "{s:?}");
            per[s.device].push(s);
        }
        for spans in &mut per {
            spans.sort_by(|a, b| a.start.total_cmp(&b.start));
            for w in spans.windows(2) {
                assert!(
                    w[1].start >= w[0].end - 1e-9,
                    "overlap on device {}: {:?} and {:?}",
                    w[0].device,
                    w[0],
                    w[1]
                );
            }
        }
        for u in &report.device_utilisation {
            assert!((0.0..=1.0 + 1e-9).contains(u), "{u}");
        }
    }

    struct Ppo {
        fused: bool,
        threshold: u64,
        lengths: LengthDist,
    }

    const SAMPLES: u64 = 256;
    const PROMPT: u64 = 128;

    /// The tests' generation: `SAMPLES` prompts of `PROMPT` tokens on 8 single-device
    /// instances, the tail migrating onto instance 0 below `migrate_below` samples if given.
    fn generate_work(
        cost: &CostModel,
        model: &ModelShape,
        lengths: LengthDist,
        migrate_below: Option<u64>,
    ) -> Work {
        Work::Generate(Box::new(GenerateSpec {
            samples: SAMPLES,
            samples_per_prompt: 1,
            prompt_len: PROMPT,
            instances: 8,
            lengths,
            model: model.clone(),
            cost: cost.clone(),
            migration: migrate_below.map(|threshold| Migration {
                threshold,
                to_instances: 1,
            }),
            max_batch: None,
            stages: 1,
        }))
    }

    /// A PPO iteration on one 8×H100 node with LLaMA-7B-shaped actor, critic, reference and
    /// reward models: generate → (reference log-probs, values, score) → train actor → train
    /// critic. Sequential: each stage waits for the previous one. Fused: the inference tasks
    /// stream samples from the generation and run on devices its migrated tail frees.
    fn ppo(p: &Ppo) -> (Dag, TaskId) {
        let cost = CostModel::new(DeviceKind::H100.spec(), 8);
        let model = ModelShape::preset("llama-7b").expect("preset");
        let seq = PROMPT + 256;
        let mut b = DagBuilder::new(8);
        let generate = b.task(
            "generate",
            "generate",
            0..8,
            generate_work(
                &cost,
                &model,
                p.lengths.clone(),
                p.fused.then_some(p.threshold),
            ),
        );
        // Fused: device 0 keeps the tail, so inference uses 1..8; sequential: all 8.
        let groups: [Vec<usize>; 3] = if p.fused {
            [vec![1, 2], vec![3, 4, 5], vec![6, 7]]
        } else {
            [vec![0, 1, 2], vec![3, 4, 5], vec![6, 7]]
        };
        let mut inference = Vec::new();
        for (name, devs) in ["ref_logprobs", "values", "score"].iter().zip(groups) {
            let work = Work::inference(
                &cost,
                &model,
                Layout::SINGLE,
                devs.len() as u64,
                SAMPLES,
                seq,
                16,
            );
            let t = b.task(name, "inference", devs, work);
            if p.fused {
                b.stream(t, generate);
            } else {
                b.after(t, generate);
            }
            inference.push(t);
        }
        let layout = Layout {
            dp: 8,
            tp: 1,
            pp: 1,
        };
        let train = cost
            .train_step_time(&model, layout, SAMPLES, seq, 4, false)
            .total;
        let actor = b.task("train_actor", "train", 0..8, Work::Fixed { seconds: train });
        let critic = b.task(
            "train_critic",
            "train",
            0..8,
            Work::Fixed { seconds: train },
        );
        for &t in &inference {
            b.after(actor, t);
        }
        b.after(critic, actor);
        (b.build().expect("valid DAG"), generate)
    }

    fn long_tail() -> LengthDist {
        LengthDist::parse("lognormal:4.5,1.0,2048").expect("parses")
    }

    #[test]
    fn fusion_beats_sequential_stages_on_a_long_tailed_distribution() {
        let opts = SimOptions {
            iterations: 3,
            seed: 7,
        };
        let (seq_dag, _) = ppo(&Ppo {
            fused: false,
            threshold: 0,
            lengths: long_tail(),
        });
        let (fused_dag, _) = ppo(&Ppo {
            fused: true,
            threshold: 16,
            lengths: long_tail(),
        });
        let seq = simulate(&seq_dag, &opts).expect("runs");
        let fused = simulate(&fused_dag, &opts).expect("runs");
        check_timeline(&seq, 8);
        check_timeline(&fused, 8);
        // Fusion hides most of the inference stage behind the generation's tail (training is
        // the same in both); consolidating the tail slows it a little, so demand more than
        // half of the inference time back.
        let seq_inference = seq
            .stages
            .iter()
            .find(|s| s.stage == "inference")
            .expect("stage")
            .mean_time;
        assert!(
            fused.mean_iteration_time < seq.mean_iteration_time - 0.5 * seq_inference,
            "fused {} vs sequential {} (inference {seq_inference})",
            fused.mean_iteration_time,
            seq.mean_iteration_time
        );
        // The tail was consolidated, and inference started before generation ended.
        for it in &fused.iterations {
            let g = &it.generations[0];
            let migrated_at = g.migrated_at.expect("migrated");
            assert!(migrated_at < g.end && g.samples_migrated <= 16);
            let inference = it
                .stages
                .iter()
                .find(|s| s.stage == "inference")
                .expect("stage");
            assert!(inference.start < g.end, "{inference:?} vs {g:?}");
        }
        // Sequential inference starts only when generation is over.
        for it in &seq.iterations {
            let g = &it.generations[0];
            assert!(g.migrated_at.is_none());
            let inference = it
                .stages
                .iter()
                .find(|s| s.stage == "inference")
                .expect("stage");
            assert!(inference.start >= g.end);
        }
    }

    /// Continuous batching: an instance holding at most `max_batch` rows decodes a batch
    /// larger than that in waves, so equal-length samples take about as many times longer as
    /// there are waves (a decode step at small batch is bound by the weights' reads, so a
    /// wave's step costs about what a full batch's does); a cap at or above the batch changes
    /// nothing.
    #[test]
    fn an_engine_batch_cap_decodes_in_waves() {
        let cost = CostModel::new(DeviceKind::H100.spec(), 1);
        let model = ModelShape::preset("llama-7b").expect("preset");
        let time = |max_batch: Option<u64>| {
            let mut b = DagBuilder::new(1);
            b.task(
                "generate",
                "generate",
                [0],
                Work::Generate(Box::new(GenerateSpec {
                    samples: 64,
                    samples_per_prompt: 1,
                    prompt_len: 32,
                    instances: 1,
                    lengths: LengthDist::Fixed { len: 128 },
                    model: model.clone(),
                    cost: cost.clone(),
                    migration: None,
                    max_batch,
                    stages: 1,
                })),
            );
            let dag = b.build().expect("valid DAG");
            let r = simulate(
                &dag,
                &SimOptions {
                    iterations: 1,
                    seed: 1,
                },
            )
            .expect("runs");
            r.iterations[0].generations[0].end
        };
        let all = time(None);
        assert_eq!(time(Some(64)), all);
        assert_eq!(time(Some(1000)), all);
        let two = time(Some(32));
        let four = time(Some(16));
        assert!(two > 1.6 * all && two < 2.2 * all, "{two} vs {all}");
        assert!(four > 1.6 * two && four < 2.2 * two, "{four} vs {two}");
    }

    #[test]
    fn the_long_tail_decodes_at_small_batch() {
        let (dag, _) = ppo(&Ppo {
            fused: false,
            threshold: 0,
            lengths: long_tail(),
        });
        let r = simulate(
            &dag,
            &SimOptions {
                iterations: 1,
                seed: 3,
            },
        )
        .expect("runs");
        let g = &r.iterations[0].generations[0];
        // Lognormal(4.5, 1): the mean is about 150 tokens, the longest far beyond.
        assert!(g.max_len as f64 > 4.0 * g.mean_len, "{g:?}");
        // Some devices sit idle while the longest sample's instance decodes.
        let spans: Vec<&Span> = r.timeline.iter().filter(|s| s.task == "generate").collect();
        let first_done = spans.iter().map(|s| s.end).fold(f64::INFINITY, f64::min);
        assert!(first_done < 0.9 * g.end);
    }

    #[test]
    fn simulation_is_deterministic_for_a_seed() {
        let (dag, _) = ppo(&Ppo {
            fused: true,
            threshold: 16,
            lengths: long_tail(),
        });
        let opts = SimOptions {
            iterations: 2,
            seed: 11,
        };
        let a = simulate(&dag, &opts).expect("runs");
        let b = simulate(&dag, &opts).expect("runs");
        assert_eq!(
            serde_json::to_string(&a).expect("json"),
            serde_json::to_string(&b).expect("json")
        );
        assert_eq!(to_chrome_trace(&a, 8), to_chrome_trace(&b, 8));
        assert_eq!(to_svg(&a, 8), to_svg(&b, 8));
        let c = simulate(
            &dag,
            &SimOptions {
                iterations: 2,
                seed: 12,
            },
        )
        .expect("runs");
        assert_ne!(a.mean_iteration_time, c.mean_iteration_time);
    }

    #[test]
    fn picks_a_migration_threshold_by_simulation() {
        let (dag, generate) = ppo(&Ppo {
            fused: true,
            threshold: 0,
            lengths: long_tail(),
        });
        let opts = SimOptions {
            iterations: 2,
            seed: 5,
        };
        let candidates = [1, 8, 32, 128];
        let (best, all) =
            pick_migration_threshold(&dag, generate, &candidates, &opts).expect("runs");
        assert_eq!(all.len(), candidates.len());
        let best_time = all.iter().find(|c| c.0 == best).expect("listed").1;
        assert!(all.iter().all(|c| c.1 >= best_time));
        // The threshold matters. Instances that drain before the migration hand their devices
        // back at once, so here a late migration loses least, and consolidating half the
        // batch early slows the tail more than the devices it frees save.
        assert!(best_time < all[3].1, "{all:?}");
        assert_ne!(all[0].1, all[3].1);
        let (fixed_dag, _) = ppo(&Ppo {
            fused: false,
            threshold: 0,
            lengths: long_tail(),
        });
        assert!(pick_migration_threshold(&fixed_dag, TaskId(1), &candidates, &opts).is_err());
    }

    #[test]
    fn fixed_tasks_serialise_on_shared_devices_and_overlap_on_disjoint_ones() {
        let mut b = DagBuilder::new(3);
        let a = b.task("a", "s1", [0, 1], Work::Fixed { seconds: 2.0 });
        let c = b.task("c", "s1", [1], Work::Fixed { seconds: 1.0 });
        let d = b.task("d", "s2", [2], Work::Fixed { seconds: 1.5 });
        let e = b.task("e", "s2", [0, 2], Work::Fixed { seconds: 1.0 });
        b.after(e, d);
        let _ = (a, c);
        let dag = b.build().expect("valid");
        let r = simulate(
            &dag,
            &SimOptions {
                iterations: 2,
                seed: 0,
            },
        )
        .expect("runs");
        check_timeline(&r, 3);
        // a [0,2) on 0,1; c waits for device 1 [2,3); d [0,1.5) on 2; e waits for a [2,3).
        assert_eq!(r.iterations[0].time, 3.0);
        assert_eq!(r.iterations[1].start, 3.0);
        assert_eq!(r.total_time, 6.0);
        let util = &r.device_utilisation;
        assert!((util[0] - 3.0 / 3.0).abs() < 1e-12);
        assert!((util[1] - 3.0 / 3.0).abs() < 1e-12);
        assert!((util[2] - 2.5 / 3.0).abs() < 1e-12);
        assert!((r.bubble_fraction - (1.0 - (2.0 + 2.5 / 3.0) / 3.0)).abs() < 1e-12);
        assert_eq!(r.stages[0].stage, "s1");
        assert_eq!(r.stages[0].mean_time, 3.0);
    }

    #[test]
    fn an_exchange_costs_what_the_skew_of_its_ranks_arrivals_gives() {
        // Two ranks compute 10 s each, then exchange twice: the first exchange follows 10 s
        // of work (a skew of 0.1 × 10 = 1 s: 0.5 s), the second follows the first at once
        // (no skew: 3 s).
        let exchange = || Work::Exchange {
            by_skew: vec![(0.0, 3.0), (1.0, 0.5)],
            range: 0.1,
        };
        let mut b = DagBuilder::new(2);
        let w0 = b.task("w0", "work", [0], Work::Fixed { seconds: 10.0 });
        let w1 = b.task("w1", "work", [1], Work::Fixed { seconds: 10.0 });
        let x = b.task("x", "gather", [0, 1], exchange());
        b.after(x, w0);
        b.after(x, w1);
        let y = b.task("y", "gather", [0, 1], exchange());
        b.after(y, x);
        let dag = b.build().expect("valid");
        let r = simulate(&dag, &SimOptions::default()).expect("simulates");
        let it = &r.iterations[0];
        assert!((it.time - 13.5).abs() < 1e-9, "{}", it.time);
        // The ranks met at the end of the iteration before: the next one prices the same.
        assert!((r.iterations[1].time - 13.5).abs() < 1e-9);
        // Halfway between the measured skews: halfway between their times; past the last, the
        // last; nothing measured past 0: the together time.
        let w = exchange();
        assert!((w.exchange_seconds(5.0) - 1.75).abs() < 1e-12);
        assert!((w.exchange_seconds(100.0) - 0.5).abs() < 1e-12);
        let flat = Work::Exchange {
            by_skew: vec![(0.0, 3.0)],
            range: 0.1,
        };
        assert_eq!(flat.exchange_seconds(10.0), 3.0);
        // Times by skew must start at skew 0 and rise in skew.
        for by_skew in [vec![(0.5, 1.0)], vec![(0.0, 1.0), (0.0, 2.0)], vec![]] {
            let mut b = DagBuilder::new(1);
            b.task(
                "x",
                "gather",
                [0],
                Work::Exchange {
                    by_skew,
                    range: 0.1,
                },
            );
            assert!(b.build().is_err());
        }
    }

    #[test]
    fn streaming_consumers_never_run_ahead_of_the_producer() {
        let (dag, _) = ppo(&Ppo {
            fused: true,
            threshold: 16,
            lengths: LengthDist::parse("uniform:16..400").expect("parses"),
        });
        let r = simulate(
            &dag,
            &SimOptions {
                iterations: 1,
                seed: 2,
            },
        )
        .expect("runs");
        check_timeline(&r, 8);
        let g = &r.iterations[0].generations[0];
        // Every consumer's last chunk ends after the last sample was emitted.
        for name in ["ref_logprobs", "values", "score"] {
            let last = r
                .timeline
                .iter()
                .filter(|s| s.task == name)
                .map(|s| s.end)
                .fold(0.0, f64::max);
            assert!(last >= g.end, "{name}: {last} < {}", g.end);
        }
    }

    /// Two streaming consumers on the same freed devices share them chunk by chunk: the
    /// second does not wait for the first to see the generation's last sample.
    #[test]
    fn streaming_consumers_on_shared_devices_interleave_their_chunks() {
        let cost = CostModel::new(DeviceKind::H100.spec(), 8);
        let model = ModelShape::preset("llama-7b").expect("preset");
        let mut b = DagBuilder::new(8);
        let generate = b.task(
            "generate",
            "generate",
            0..8,
            generate_work(&cost, &model, long_tail(), Some(16)),
        );
        for name in ["ref_logprobs", "values"] {
            let work = Work::inference(&cost, &model, Layout::SINGLE, 7, SAMPLES, PROMPT + 256, 8);
            let t = b.task(name, "inference", 1..8, work);
            b.stream(t, generate);
        }
        let dag = b.build().expect("valid DAG");
        let r = simulate(&dag, &SimOptions::default()).expect("runs");
        check_timeline(&r, 8);
        let it = &r.iterations[0];
        let g = &it.generations[0];
        let first = |name: &str| {
            r.timeline
                .iter()
                .filter(|s| s.task == name && s.iteration == 0)
                .map(|s| s.start)
                .fold(f64::INFINITY, f64::min)
        };
        assert!(first("values") < g.end, "{} vs {}", first("values"), g.end);
        assert!(first("ref_logprobs") < g.end);
    }

    /// A streaming consumer's replicas run their shares independently: each chunk holds one
    /// replica's devices for that replica's time on its samples (not all the task's devices
    /// for a share of the time), so a trickle of tail samples costs a replica's latency each,
    /// and chunks on different replicas overlap.
    #[test]
    fn streaming_replicas_run_their_own_chunks() {
        let cost = CostModel::new(DeviceKind::H100.spec(), 8);
        let model = ModelShape::preset("llama-7b").expect("preset");
        let mut b = DagBuilder::new(8);
        let generate = b.task(
            "generate",
            "generate",
            0..8,
            generate_work(&cost, &model, long_tail(), Some(16)),
        );
        let work = Work::inference(&cost, &model, Layout::SINGLE, 7, SAMPLES, PROMPT + 256, 8);
        let t = b.task("values", "inference", 1..8, work.clone());
        b.stream(t, generate);
        let r = simulate(&b.build().expect("valid DAG"), &SimOptions::default()).expect("runs");
        check_timeline(&r, 8);
        let spans: Vec<&Span> = r.timeline.iter().filter(|s| s.task == "values").collect();
        let mut total = 0;
        for s in &spans {
            let n: u64 = s
                .label
                .rsplit('×')
                .next()
                .and_then(|x| x.parse().ok())
                .expect("a count");
            total += n;
            let want = work.run_time(n);
            assert!((s.end - s.start - want).abs() < 1e-9, "{s:?} vs {want}");
        }
        assert_eq!(total, SAMPLES * SimOptions::default().iterations as u64);
        let overlapping = spans.iter().any(|a| {
            spans
                .iter()
                .any(|b| a.device != b.device && a.start < b.end && b.start < a.end)
        });
        assert!(overlapping, "chunks on different replicas should overlap");
    }

    /// Chunks issued back to back through pipeline stages overlap: `k` chunks take `k + pp − 1`
    /// stage times, not `k · pp`.
    #[test]
    fn pipelined_inference_overlaps_its_chunks() {
        let cost = CostModel::new(DeviceKind::H100.spec(), 8);
        let model = ModelShape::preset("llama-7b").expect("preset");
        let layout = Layout {
            dp: 1,
            tp: 1,
            pp: 4,
        };
        let chunk = 8;
        let work = Work::inference(&cost, &model, layout, 1, 64, 512, chunk);
        let mut b = DagBuilder::new(4);
        b.task("fwd", "inference", 0..4, work);
        let r = simulate(
            &b.build().expect("valid DAG"),
            &SimOptions {
                iterations: 1,
                seed: 1,
            },
        )
        .expect("runs");
        let one = cost.forward_time(&model, layout, chunk, 512);
        let want = (8.0 + 4.0 - 1.0) / 4.0 * one;
        assert!(
            (r.mean_iteration_time - want).abs() < 1e-9 * want.max(1.0),
            "{} vs {want}",
            r.mean_iteration_time
        );
    }

    #[test]
    fn histogram_lengths_drive_the_generation() {
        let hist = LengthDist::from_histogram("32 90\n900 10\n").expect("parses");
        let (dag, _) = ppo(&Ppo {
            fused: true,
            threshold: 24,
            lengths: hist,
        });
        let r = simulate(
            &dag,
            &SimOptions {
                iterations: 2,
                seed: 4,
            },
        )
        .expect("runs");
        check_timeline(&r, 8);
        for it in &r.iterations {
            let g = &it.generations[0];
            assert_eq!(g.max_len, 900);
            // About 10 % of 256 samples are long: the mean sits near 0.9·32 + 0.1·900.
            assert!(g.mean_len > 60.0 && g.mean_len < 150.0, "{g:?}");
            assert!(g.samples_migrated > 0 && g.samples_migrated <= 24, "{g:?}");
        }
    }

    #[test]
    fn traces_are_well_formed() {
        let (dag, _) = ppo(&Ppo {
            fused: true,
            threshold: 16,
            lengths: long_tail(),
        });
        let r = simulate(
            &dag,
            &SimOptions {
                iterations: 1,
                seed: 1,
            },
        )
        .expect("runs");
        let json: serde_json::Value = serde_json::from_str(&to_chrome_trace(&r, 8)).expect("json");
        let events = json["traceEvents"].as_array().expect("events");
        assert_eq!(events.len(), r.timeline.len() + 8);
        assert!(
            events
                .iter()
                .any(|e| e["ph"] == "X" && e["cat"] == "inference")
        );
        let svg = to_svg(&r, 8);
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert!(svg.contains(">device 7</text>") && svg.contains(">train</text>"));
    }

    #[test]
    fn malformed_dags_are_rejected() {
        let gen_work = || {
            Work::Generate(Box::new(GenerateSpec {
                samples: 4,
                samples_per_prompt: 1,
                prompt_len: 8,
                instances: 2,
                lengths: LengthDist::Fixed { len: 4 },
                model: ModelShape::preset("llama-7b").expect("preset"),
                cost: CostModel::new(DeviceKind::A100.spec(), 8),
                migration: None,
                max_batch: None,
                stages: 1,
            }))
        };
        let per_sample = |samples| Work::PerSample {
            samples,
            chunk: 2,
            chunk_fixed: 0.0,
            per_sample: 1.0,
            stages: 1,
            replicas: 1,
        };
        type Make = Box<dyn Fn(&mut DagBuilder)>;
        let cases: Vec<(Make, &str)> = vec![
            (
                Box::new(|b| {
                    b.task("x", "s", [5], Work::Fixed { seconds: 1.0 });
                }),
                "out of range",
            ),
            (
                Box::new(|b| {
                    b.task("x", "s", Vec::new(), Work::Fixed { seconds: 1.0 });
                }),
                "occupies no device",
            ),
            (
                Box::new(|b| {
                    b.task("x", "s", [0, 0], Work::Fixed { seconds: 1.0 });
                }),
                "twice",
            ),
            (
                Box::new(|b| {
                    b.task("x", "s", [0], Work::Fixed { seconds: f64::NAN });
                }),
                "finite",
            ),
            (
                Box::new(|b| {
                    let x = b.task("x", "s", [0], Work::Fixed { seconds: 1.0 });
                    let y = b.task("y", "s", [1], Work::Fixed { seconds: 1.0 });
                    b.after(x, y);
                }),
                "created first",
            ),
            (
                Box::new(move |b| {
                    let x = b.task("x", "s", [0], Work::Fixed { seconds: 1.0 });
                    let y = b.task("y", "s", [1], per_sample(4));
                    b.stream(y, x);
                }),
                "only from a generation",
            ),
            (
                Box::new(move |b| {
                    let g = b.task("g", "s", [0, 1], gen_work());
                    let y = b.task("y", "s", [2], per_sample(5));
                    b.stream(y, g);
                }),
                "emits 4",
            ),
            (
                Box::new(move |b| {
                    b.task("g", "s", [0, 1, 2], gen_work());
                }),
                "do not split into 2 instances",
            ),
        ];
        for (make, needle) in cases {
            let mut b = DagBuilder::new(4);
            make(&mut b);
            let e = b.build().expect_err(needle);
            assert!(e.0.contains(needle), "{needle}: {e}");
        }
    }
}
