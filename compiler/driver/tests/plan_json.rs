//! The executable plan's JSON form: for every example and every stdlib pipeline, planned for a
//! CPU, one GPU and a 32×8 cluster, `plan → JSON → plan` is the identity and `braid plan`'s
//! report of the plan read back is the report of the plan as planned; plans read back verify.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};

use braid_cost::cluster::ClusterSpec;
use braid_cost::cost::ModelShape;
use braid_driver::{ModelConfigs, Options, Presets};
use braid_ir::exec_plan::ExecPlan;
use braid_passes::annotated::Annotated;
use braid_passes::render::{report, to_text};

/// Imports from the file system (the standard library is built in).
struct Disk;

impl braid_sema::Loader for Disk {
    fn load(&self, from: &str, path: &str) -> Result<(String, String), String> {
        let name = braid_sema::join(from, path);
        std::fs::read_to_string(&name)
            .map(|t| (name.clone(), t))
            .map_err(|e| e.to_string())
    }
}

/// `config.json` beside the examples, else a preset.
struct Configs(PathBuf);

impl ModelConfigs for Configs {
    fn shape(&self, dir: &str) -> Result<ModelShape, String> {
        let path = self.0.join(dir).join("config.json");
        if let Ok(text) = std::fs::read_to_string(&path) {
            let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| e.to_string())?;
            return ModelShape::from_hf_config(dir, &json).map_err(|e| e.to_string());
        }
        Presets.shape(dir)
    }
}

fn examples_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples")
}

const MODELS: &str = r#"
model policy = tiny(vocab: "bytes", layers: 2, hidden: 32, heads: 2) {
  train: adamw(lr: 1e-3)
}
model critic = tiny(vocab: "bytes", layers: 2, hidden: 32, heads: 2) {
  head: value
  train: adamw(lr: 1e-3)
}
model rm = tiny(vocab: "bytes", layers: 1, hidden: 32, heads: 2) {
  head: score
}
dataset prompts = synthetic::letters(count: 64)
fn r(s: Sample) -> float { len(s.completion) }
"#;

/// (name, program text) for every example and every stdlib pipeline.
fn programs() -> Vec<(String, String)> {
    let mut out = Vec::new();
    for ex in ["quickstart", "ppo_tiny", "grpo_math", "smollm2_arith"] {
        let path = examples_dir().join(format!("{ex}.rlhf"));
        if let Ok(text) = std::fs::read_to_string(&path) {
            out.push((path.display().to_string(), text));
        }
    }
    for (module, run) in [
        (
            "grpo",
            "run grpo(policy, prompts, reward: r) {\n  steps: 3\n  batch: 4\n  group: 2\n}",
        ),
        (
            "grpo",
            "run grpo(policy, prompts, reward: r) {\n  steps: 3\n  batch: 4\n  group: 2\n  variant: \"dr_grpo\"\n}",
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
            "ppo",
            "run ppo_fn(policy, prompts, reward: r, critic: critic) {\n  steps: 3\n  batch: 4\n}",
        ),
    ] {
        out.push((
            format!("{module}.rlhf"),
            format!("use std::{module}\n{MODELS}\n{run}\n"),
        ));
    }
    out
}

fn text(a: &Annotated) -> String {
    to_text(&report(a))
}

#[test]
fn plans_round_trip_through_json_and_report_the_same() {
    let configs = Configs(examples_dir());
    let mut checked = 0;
    for (name, src) in programs() {
        for cluster in ["cpu", "1x1xH100", "32x8xH800"] {
            let options = Options {
                cluster: Some(ClusterSpec::parse(cluster).unwrap()),
                ..Options::default()
            };
            let c = braid_driver::compile(&name, &src, &Disk, &configs, &options, &mut |_, _| {});
            assert!(
                c.internal.is_none(),
                "{name} on {cluster}: {:?}",
                c.internal
            );
            let Some(plan) = c.exec_plan() else {
                // Only a plan that does not fit has no executable plan — or one whose model
                // file this test cannot read (a GGUF file needs the runtime's reader).
                use braid_diagnostics::Code;
                assert!(
                    c.diagnostics
                        .iter()
                        .any(|d| matches!(d.code, Code::E0504 | Code::E0505)),
                    "{name} on {cluster}: no plan and no E0504"
                );
                continue;
            };
            plan.verify()
                .unwrap_or_else(|e| panic!("{name} on {cluster}: {e}"));
            let json = plan.to_json();
            let back =
                ExecPlan::from_json(&json).unwrap_or_else(|e| panic!("{name} on {cluster}: {e}"));
            assert_eq!(
                back, plan,
                "{name} on {cluster}: the round trip changed the plan"
            );
            assert_eq!(back.to_json(), json, "{name} on {cluster}: JSON not stable");
            let planned = c.planned.as_ref().unwrap();
            assert_eq!(
                text(&Annotated::from_exec_plan(&back)),
                text(planned),
                "{name} on {cluster}: the report of the plan read back differs"
            );
            checked += 1;
        }
    }
    assert!(checked >= 30, "only {checked} plans checked");
}

/// A plan file from another format version, or edited into inconsistency, is refused with an
/// error naming the field — never a panic.
#[test]
fn edited_plans_are_refused_naming_the_field() {
    let configs = Configs(examples_dir());
    let path = examples_dir().join("ppo_tiny.rlhf");
    let src = std::fs::read_to_string(&path).unwrap();
    let options = Options {
        cluster: Some(ClusterSpec::parse("1x8xH100").unwrap()),
        ..Options::default()
    };
    let c = braid_driver::compile(
        &path.display().to_string(),
        &src,
        &Disk,
        &configs,
        &options,
        &mut |_, _| {},
    );
    let plan = c.exec_plan().unwrap();
    let good: serde_json::Value = serde_json::from_str(&plan.to_json()).unwrap();
    let first_call = plan
        .decisions
        .placements
        .keys()
        .next()
        .unwrap()
        .0
        .to_string();
    type Edit = Box<dyn Fn(&mut serde_json::Value)>;
    let cases: Vec<(&str, Edit, &str)> = vec![
        ("version", Box::new(|v| v["version"] = 99.into()), "version"),
        (
            "format",
            Box::new(|v| v["format"] = "onnx".into()),
            "format",
        ),
        (
            "head",
            Box::new(|v| v["plan"]["models"][0]["head"] = "policy".into()),
            "plan.models[0].head",
        ),
        (
            "dtype",
            Box::new(|v| v["plan"]["models"][0]["dtype"] = serde_json::Value::Null),
            "plan.models[0].dtype",
        ),
        (
            "schedule",
            Box::new(|v| v["plan"]["models"][0]["optimizer"]["schedule"] = "exponential".into()),
            "schedule",
        ),
        (
            "unknown field",
            Box::new(|v| v["decisions"]["surprise"] = 1.into()),
            "surprise",
        ),
        (
            "tp",
            {
                let k = first_call.clone();
                Box::new(move |v| v["decisions"]["placements"][&k]["tp"] = 3.into())
            },
            "decisions.placements",
        ),
        (
            "count",
            {
                let k = first_call.clone();
                Box::new(move |v| v["decisions"]["placements"][&k]["count"] = 64.into())
            },
            "decisions.placements",
        ),
        (
            "outside the cluster",
            {
                let k = first_call.clone();
                Box::new(move |v| v["decisions"]["placements"][&k]["first"] = 1000.into())
            },
            "outside the cluster",
        ),
        (
            "missing placement",
            {
                let k = first_call.clone();
                Box::new(move |v| {
                    v["decisions"]["placements"]
                        .as_object_mut()
                        .unwrap()
                        .remove(&k);
                })
            },
            "decisions.placements",
        ),
        (
            "model index",
            Box::new(|v| {
                for node in v["plan"]["graph"]["nodes"].as_array_mut().unwrap() {
                    if let Some(g) = node[1]["op"].get_mut("Generate") {
                        g["model"] = 42.into();
                    }
                }
            }),
            "plan.graph",
        ),
        (
            "edge to nowhere",
            Box::new(|v| {
                v["plan"]["graph"]["edges"]
                    .as_array_mut()
                    .unwrap()
                    .push(serde_json::json!([0, 999, {"Data": {"port": 0, "ty": "Rollout", "gran": "Sample"}}]));
            }),
            "999",
        ),
        (
            "steps",
            Box::new(|v| v["plan"]["steps"] = (-1).into()),
            "plan.steps",
        ),
        (
            "shapes",
            Box::new(|v| {
                v["shapes"].as_array_mut().unwrap().pop();
            }),
            "shapes",
        ),
        (
            "lengths",
            Box::new(|v| v["workload"]["lengths"] = serde_json::json!({"kind": "fixed", "len": 0})),
            "workload.lengths",
        ),
        ("type", Box::new(|v| v["seed"] = "seven".into()), "seed"),
    ];
    for (what, edit, field) in &cases {
        let mut v = good.clone();
        edit(&mut v);
        let err = ExecPlan::from_json(&v.to_string())
            .expect_err(&format!("{what}: an edited plan was accepted"));
        let msg = err.to_string();
        assert!(
            msg.contains(field),
            "{what}: `{msg}` does not name `{field}`"
        );
    }
    // Truncated anywhere: an error, never a panic.
    let text = plan.to_json();
    for cut in (0..text.len()).step_by(97) {
        let cut = (cut..text.len())
            .find(|c| text.is_char_boundary(*c))
            .unwrap_or(0);
        assert!(
            ExecPlan::from_json(&text[..cut]).is_err(),
            "truncated at {cut}"
        );
    }
}
