//! Saving: a model saved by Braid loads back in Braid with identical outputs and, where Python
//! with transformers is available, in transformers with the same logits (through
//! `scripts/check_hf_load.py`).
//!
//! Python is found through `BRAID_TRANSFORMERS_PYTHON` (a python executable that imports
//! transformers), or else `.venv/bin/python` with `PYTHONPATH=.pydeps` when `.pydeps/transformers`
//! exists. Without either, the transformers check says so on stderr and skips.

// Each test sets one libtorch thread: tests run in parallel threads, and OpenMP threads
// spinning on a small shared machine slow the suite down about tenfold.

#![allow(clippy::unwrap_used)] // Test helpers: a failed unwrap is a failed test.

use std::path::PathBuf;
use std::process::Command;

use braid_runtime::{Head, LoadOptions, Model, TinyConfig, Tokenizer, save_pretrained, tiny};
use tch::{Device, Kind, Tensor};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("braid-save-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

const IDS: [i64; 7] = [256, 104, 101, 108, 108, 111, 33];

fn outputs(model: &Model) -> Vec<f32> {
    let out = tch::no_grad(|| {
        model
            .forward(&Tensor::from_slice(&IDS).unsqueeze(0), None)
            .unwrap()
    });
    Vec::try_from(out.to_kind(Kind::Float).reshape([-1])).unwrap()
}

/// (name, model, tokenizer) of every kind of model Braid saves.
fn models() -> Vec<(&'static str, Model, Tokenizer)> {
    let cfg = TinyConfig {
        seed: 4,
        ..TinyConfig::default()
    };
    let (lm, tok) = tiny(&cfg, Head::Lm, Device::Cpu).unwrap();
    let (critic, tok2) = tiny(&cfg, Head::Value, Device::Cpu).unwrap();
    let gpt2_dir = root().join("runtime/tests/fixtures/gpt2");
    let gpt2 = Model::load(&gpt2_dir, &LoadOptions::default()).unwrap();
    let gpt2_tok = Tokenizer::from_dir(&gpt2_dir, gpt2.config()).unwrap();
    let qwen_dir = root().join("runtime/tests/fixtures/qwen2_bias");
    let qwen = Model::load(&qwen_dir, &LoadOptions::default()).unwrap();
    let qwen_tok = Tokenizer::from_dir(&qwen_dir, qwen.config()).unwrap();
    vec![
        ("tiny_lm", lm, tok),
        ("tiny_value", critic, tok2),
        ("gpt2", gpt2, gpt2_tok),
        ("qwen2", qwen, qwen_tok),
    ]
}

#[test]
fn saved_models_load_back_in_braid() {
    braid_runtime::device::set_cpu_threads(1);
    for (name, model, tok) in models() {
        let dir = scratch(name);
        save_pretrained(&model, &tok, &dir).unwrap();
        let back = Model::load(
            &dir,
            &LoadOptions {
                head: model.head(),
                ..LoadOptions::default()
            },
        )
        .unwrap();
        assert_eq!(outputs(&model), outputs(&back), "{name}");
        let tok_back = Tokenizer::from_dir(&dir, back.config()).unwrap();
        assert_eq!(
            tok.encode("hello, world", true).unwrap(),
            tok_back.encode("hello, world", true).unwrap()
        );
        assert_eq!(tok.special().eos, tok_back.special().eos, "{name}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

fn python() -> Option<(PathBuf, Option<PathBuf>)> {
    if let Ok(p) = std::env::var("BRAID_TRANSFORMERS_PYTHON") {
        return Some((PathBuf::from(p), None));
    }
    let py = root().join(".venv/bin/python");
    let deps = root().join(".pydeps");
    (py.exists() && deps.join("transformers").exists()).then_some((py, Some(deps)))
}

fn transformers_outputs(
    py: &(PathBuf, Option<PathBuf>),
    dirs: &[(PathBuf, Head)],
) -> Vec<serde_json::Value> {
    let ids: Vec<String> = IDS.iter().map(i64::to_string).collect();
    let mut cmd = Command::new(&py.0);
    cmd.arg(root().join("scripts/check_hf_load.py"));
    for (dir, head) in dirs {
        cmd.arg(format!(
            "{}:{}",
            dir.display(),
            if *head == Head::Lm { "lm" } else { "seqcls" }
        ));
    }
    cmd.args(["--ids", &ids.join(","), "--text", "hello, world"]);
    if let Some(deps) = &py.1 {
        cmd.env("PYTHONPATH", deps);
    }
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "check_hf_load.py failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn saved_models_load_in_transformers() {
    braid_runtime::device::set_cpu_threads(1);
    let Some(py) = python() else {
        eprintln!(
            "skipping saved_models_load_in_transformers: no transformers (set BRAID_TRANSFORMERS_PYTHON, \
             or install it with `.venv/bin/python -m pip install --target .pydeps transformers`)"
        );
        return;
    };
    let models = models();
    let mut dirs = Vec::new();
    for (name, model, tok) in &models {
        let dir = scratch(&format!("hf-{name}"));
        save_pretrained(model, tok, &dir).unwrap();
        dirs.push((dir, model.head()));
    }
    let results = transformers_outputs(&py, &dirs);
    assert_eq!(results.len(), models.len());
    for ((name, model, tok), got) in models.iter().zip(&results) {
        let theirs: Vec<f32> = got["logits"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap() as f32)
            .collect();
        let ours = outputs(model);
        assert_eq!(ours.len(), theirs.len(), "{name}");
        let diff = ours
            .iter()
            .zip(&theirs)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(
            diff < 1e-4,
            "{name}: transformers' outputs differ by {diff}"
        );
        let their_ids: Vec<i64> = got["token_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_i64().unwrap())
            .collect();
        assert_eq!(
            their_ids,
            tok.encode("hello, world", true).unwrap(),
            "{name}: tokenizer"
        );
    }
    for (dir, _) in dirs {
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
