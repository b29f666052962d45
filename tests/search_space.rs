//! One search space: every layout the planner's `place` may propose for a call is one the
//! runtime runs. For each example planned for small clusters (1, 2 and 4 CPU ranks, one node
//! of 8 GPUs), every `(dp, tp, pp)` option the search draws from (`estimate::layout_options`,
//! on every mesh size it tries) is checked against the runtime's own refusals: the
//! tensor-parallel cut of the model (`models::parallel::check_split`, what `Model::shard`
//! checks), the stages of its pipeline (`models::model::stage_range`, what
//! `Model::retain_stage` and `Pipeline::new` check) and generation without pipeline stages
//! (what `braid run` refuses). `tests/distributed.rs` runs each kind of layout end to end.

#![allow(clippy::unwrap_used, clippy::expect_used)]
#![cfg(feature = "runtime")]

use std::path::Path;
use std::process::Command;

use braid_ir::exec_plan::ExecPlan;
use braid_ir::graph::{ModelSource, Op, Plan};
use braid_passes::annotated::Annotated;
use braid_passes::estimate::layout_options;
use braid_runtime::models::config::ModelConfig;
use braid_runtime::models::model::stage_range;
use braid_runtime::models::parallel::check_split;
use braid_runtime::models::tiny::{TinyConfig, TinyVocab};

const EXAMPLES: [&str; 4] = ["quickstart", "ppo_tiny", "grpo_math", "chat_tiny"];
const CLUSTERS: [&str; 4] = ["cpu", "2xcpu", "4xcpu", "1x8xH100"];

/// The plan of `example` for `cluster`, as `braid plan --emit` writes it.
fn plan(example: &str, cluster: &str) -> ExecPlan {
    let out = std::env::temp_dir().join(format!(
        "braid-space-{}-{example}-{cluster}.json",
        std::process::id()
    ));
    let status = Command::new(env!("CARGO_BIN_EXE_braid"))
        .args([
            "plan",
            &format!("examples/{example}.rlhf"),
            "--cluster",
            cluster,
        ])
        .arg("--emit")
        .arg(&out)
        .output()
        .expect("braid runs");
    assert!(
        status.status.success(),
        "braid plan {example} --cluster {cluster}: {}",
        String::from_utf8_lossy(&status.stderr)
    );
    let text = std::fs::read_to_string(&out).unwrap();
    let _ = std::fs::remove_file(&out);
    ExecPlan::from_json(&text).unwrap()
}

/// The runtime's configuration of model `slot` (following frozen copies to their source): a
/// tiny model's, a Hugging Face directory's `config.json`, or for a directory not on this
/// machine (`grpo_math`'s Qwen2.5) a Llama configuration of the shape the planner used.
fn config(e: &ExecPlan, slot: usize) -> ModelConfig {
    let plan: &Plan = &e.plan;
    let mut src = slot;
    while let ModelSource::FrozenOf(of) = &plan.models[src].source {
        src = *of as usize;
    }
    match &plan.models[src].source {
        ModelSource::Tiny {
            layers,
            hidden,
            heads,
            kv_heads,
            intermediate,
            max_len,
            seed,
        } => TinyConfig {
            vocab: TinyVocab::Bytes,
            layers: *layers,
            hidden: *hidden,
            heads: *heads,
            kv_heads: *kv_heads,
            intermediate: *intermediate,
            max_len: *max_len,
            seed: *seed as u64,
        }
        .to_model_config()
        .unwrap(),
        ModelSource::Hf { dir } => {
            let file = Path::new("examples").join(dir).join("config.json");
            if file.exists() {
                return ModelConfig::from_file(&file).unwrap();
            }
            let s = &e.shapes[slot];
            let json = serde_json::json!({
                "model_type": "llama",
                "num_hidden_layers": s.layers,
                "hidden_size": s.hidden,
                "num_attention_heads": s.heads,
                "num_key_value_heads": s.kv_heads,
                "intermediate_size": s.intermediate,
                "vocab_size": s.vocab,
                "max_position_embeddings": 4096,
                "rms_norm_eps": 1e-6,
                "tie_word_embeddings": s.tied_embeddings,
            });
            ModelConfig::from_json(&file, json).unwrap()
        }
        ModelSource::FrozenOf(_) => unreachable!("followed above"),
    }
}

#[test]
fn every_layout_the_planner_proposes_is_one_the_runtime_runs() {
    let mut checked = 0usize;
    let mut cut = 0usize;
    let mut staged = 0usize;
    for example in EXAMPLES {
        for cluster in CLUSTERS {
            let e = plan(example, cluster);
            let a = Annotated::from_exec_plan(&e);
            let n = e.cluster.devices();
            for id in a.calls() {
                let node = e.plan.graph.node(id).unwrap();
                let slot = node.op.model().unwrap() as usize;
                let c = config(&e, slot);
                let mut count = 1;
                while count <= n {
                    for p in layout_options(&a, id, count) {
                        let what = format!("{example} on {cluster}: {id} with {p:?}");
                        check_split(&c, p.tp as i64).unwrap_or_else(|err| panic!("{what}: {err}"));
                        for s in 0..p.pp as usize {
                            stage_range(c.num_layers as usize, s, p.pp as usize)
                                .unwrap_or_else(|err| panic!("{what}: {err}"));
                        }
                        if matches!(node.op, Op::Generate { .. }) {
                            assert_eq!(p.pp, 1, "{what}: generation through pipeline stages");
                        }
                        checked += 1;
                        cut += usize::from(p.tp > 1);
                        staged += usize::from(p.pp > 1);
                    }
                    count *= 2;
                }
            }
        }
    }
    // The space is not trivial: it holds tensor- and pipeline-parallel layouts.
    assert!(
        checked > 100 && cut > 10 && staged > 10,
        "{checked} {cut} {staged}"
    );
}
