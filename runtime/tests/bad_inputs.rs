//! Bad model directories give an error that names the file and what is wrong, never a panic.
//! Each test copies a good fixture to a scratch directory and breaks one thing.

#![allow(clippy::unwrap_used)] // Test helpers: a failed unwrap is a failed test.

use std::path::{Path, PathBuf};

use braid_runtime::{LoadOptions, Model, Tokenizer};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// A fresh copy of fixture `name`.
fn copy(name: &str, tag: &str) -> PathBuf {
    let dst = std::env::temp_dir().join(format!("braid-bad-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dst);
    std::fs::create_dir_all(&dst).unwrap();
    for entry in std::fs::read_dir(fixture(name)).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), dst.join(entry.file_name())).unwrap();
    }
    dst
}

fn load_error(dir: &Path) -> String {
    match Model::load(dir, &LoadOptions::default()) {
        Ok(_) => panic!("{} loaded", dir.display()),
        Err(e) => e.to_string(),
    }
}

fn edit_config(dir: &Path, f: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>)) {
    let path = dir.join("config.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    f(v.as_object_mut().unwrap());
    std::fs::write(&path, v.to_string()).unwrap();
}

#[test]
fn missing_safetensors() {
    let dir = copy("llama_gqa", "missing-st");
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    let msg = load_error(&dir);
    assert_eq!(
        msg,
        format!(
            "{}: missing (no model.safetensors or model.safetensors.index.json)",
            dir.join("model.safetensors").display()
        )
    );
}

#[test]
fn truncated_safetensors() {
    let dir = copy("llama_gqa", "truncated");
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
    let msg = load_error(&dir);
    assert!(
        msg.starts_with(&format!("{}: not a valid safetensors file", path.display())),
        "{msg}"
    );
    // A header cut in the middle too.
    std::fs::write(&path, &bytes[..20]).unwrap();
    let msg = load_error(&dir);
    assert!(
        msg.starts_with(&format!("{}: not a valid safetensors file", path.display())),
        "{msg}"
    );
}

#[test]
fn missing_shard() {
    let dir = copy("llama_sharded", "shard");
    std::fs::remove_file(dir.join("model-00003-of-00007.safetensors")).unwrap();
    let msg = load_error(&dir);
    assert!(
        msg.starts_with(&format!(
            "{}: cannot open",
            dir.join("model-00003-of-00007.safetensors").display()
        )),
        "{msg}"
    );
}

#[test]
fn unknown_architecture() {
    let dir = copy("llama_gqa", "arch");
    edit_config(&dir, |c| {
        c.insert("model_type".into(), "mamba".into());
    });
    let msg = load_error(&dir);
    assert!(
        msg.starts_with(&format!(
            "{}: unknown architecture `model_type: mamba`",
            dir.join("config.json").display()
        )),
        "{msg}"
    );
}

#[test]
fn missing_config_field() {
    let dir = copy("gpt2", "field");
    edit_config(&dir, |c| {
        c.remove("n_embd");
    });
    assert_eq!(
        load_error(&dir),
        format!(
            "{}: missing field `n_embd`",
            dir.join("config.json").display()
        )
    );
}

#[test]
fn missing_or_broken_config() {
    let dir = copy("llama_gqa", "noconfig");
    std::fs::write(dir.join("config.json"), "{ not json").unwrap();
    let msg = load_error(&dir);
    assert!(
        msg.starts_with(&format!(
            "{}: invalid JSON",
            dir.join("config.json").display()
        )),
        "{msg}"
    );
    std::fs::remove_file(dir.join("config.json")).unwrap();
    let msg = load_error(&dir);
    assert!(
        msg.starts_with(&format!(
            "{}: cannot read",
            dir.join("config.json").display()
        )),
        "{msg}"
    );
}

#[test]
fn weights_that_do_not_match_the_config() {
    let dir = copy("llama_gqa", "shape");
    edit_config(&dir, |c| {
        c.insert("intermediate_size".into(), 48.into());
    });
    let msg = load_error(&dir);
    assert!(
        msg.contains(
            "model.safetensors: tensor `model.layers.0.mlp.gate_proj.weight` has shape [64, 32]"
        ),
        "{msg}"
    );
    let dir = copy("llama_gqa", "layers");
    edit_config(&dir, |c| {
        c.insert("num_hidden_layers".into(), 3.into());
    });
    let msg = load_error(&dir);
    assert!(
        msg.ends_with("model.safetensors: missing tensor `model.layers.2.self_attn.q_proj.weight`"),
        "{msg}"
    );
}

#[test]
fn tokenizer_vocabulary_larger_than_embedding() {
    let dir = copy("llama_gqa", "vocab");
    // Loading with the real vocabulary works; a config with fewer embedding rows than the
    // tokenizer has ids does not.
    let model = Model::load(&dir, &LoadOptions::default()).unwrap();
    let mut config = model.config().clone();
    config.vocab_size = 100;
    let msg = match Tokenizer::from_dir(&dir, &config) {
        Ok(_) => panic!("mismatched tokenizer accepted"),
        Err(e) => e.to_string(),
    };
    assert!(
        msg.starts_with(&format!(
            "{}: the vocabulary does not match the model: token id 299",
            dir.join("tokenizer.json").display()
        )),
        "{msg}"
    );
}

#[test]
fn missing_or_broken_tokenizer() {
    let dir = copy("llama_gqa", "tok");
    let model = Model::load(&dir, &LoadOptions::default()).unwrap();
    std::fs::write(dir.join("tokenizer.json"), "{}").unwrap();
    let msg = Tokenizer::from_dir(&dir, model.config())
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(
        msg.starts_with(&format!(
            "{}: cannot load tokenizer",
            dir.join("tokenizer.json").display()
        )),
        "{msg}"
    );
    std::fs::remove_file(dir.join("tokenizer.json")).unwrap();
    let msg = Tokenizer::from_dir(&dir, model.config())
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(
        msg.starts_with(&format!(
            "{}: missing",
            dir.join("tokenizer.json").display()
        )),
        "{msg}"
    );
}

#[test]
fn not_a_directory() {
    let msg = load_error(Path::new("/nonexistent/model"));
    assert!(
        msg.starts_with("/nonexistent/model: not a model directory"),
        "{msg}"
    );
}
