//! The data users bring, through `braid run`: a chat dataset whose records' other fields reach
//! a reward; a record without a field the reward reads stops the run before its first step,
//! naming the file and line; a reward model with its own tokenizer (a small BPE, saved with
//! `save_pretrained`) scores each rollout's decoded text re-tokenised, while one that shares the
//! policy's byte vocabulary scores its token ids; a critic with another vocabulary is refused,
//! at compile time when the shapes show it and when the run loads it otherwise.

#![cfg(feature = "runtime")]
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;
use common::Tmp;
use std::path::Path;
use std::process::{Command, Output};

use braid_runtime::models::tokenizer::byte_level_tokenizer_json;
use braid_runtime::{
    ChatMessage, Device, Head, InferOptions, LoadOptions, Model, ModelConfig, Rollout, Tokenizer,
    save_pretrained, score,
};
use serde_json::{Value, json};

fn braid(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_braid"))
        .args(args)
        .output()
        .expect("braid runs")
}

fn tmp(name: &str) -> Tmp {
    Tmp::new("data", name)
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn ok(out: &Output) {
    assert!(out.status.success(), "{}", stderr(out));
}

fn jsonl(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// `braid run FILE` for a few steps into `dir/run`, on one thread.
fn run(file: &Path, dir: &Path) -> Output {
    braid(&[
        "run",
        file.to_str().unwrap(),
        "--run-dir",
        dir.join("run").to_str().unwrap(),
        "--overwrite",
        "--plain",
        "--checkpoint-every",
        "0",
    ])
}

const CHAT_PROGRAM: &str = r#"use std::grpo

model policy = tiny(vocab: "bytes", layers: 1, hidden: 32, heads: 2, seed: 3) {
  train: adamw(lr: 1e-3)
}

dataset chats = jsonl("chats.jsonl") { shuffle, seed: 1 }

// The record's topic selects the reward; its weight scales it.
fn topical(s: Sample) -> float {
  let vowels = count(s.completion, r"[aeiou]") / max(len(s.completion), 1)
  let letters = count(s.completion, r"[a-z]") / max(len(s.completion), 1)
  let r = if field(s, "topic") == "vowels" { vowels } else { letters }
  r * field_float(s, "weight") + 0.01 * field_int(s, "level")
}

run grpo(policy, chats, reward: topical) {
  steps: 2
  batch: 4
  group: 2
  max_new_tokens: 6
}
"#;

fn chat_line(i: usize, with_level: bool) -> String {
    let topic = if i.is_multiple_of(2) {
        "vowels"
    } else {
        "letters"
    };
    let mut v = json!({
        "messages": [
            {"role": "system", "content": "Answer in letters."},
            {"role": "user", "content": format!("word {i}")},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": format!("again {i}")}
        ],
        "topic": topic,
        "weight": if i.is_multiple_of(3) { json!(2) } else { json!(0.5) },
    });
    if with_level {
        v["level"] = json!(i % 4);
    }
    v.to_string()
}

#[test]
fn a_chat_dataset_feeds_its_fields_to_the_reward() {
    let dir = tmp("chat");
    let lines: Vec<String> = (0..8).map(|i| chat_line(i, true)).collect();
    std::fs::write(dir.join("chats.jsonl"), lines.join("\n") + "\n").unwrap();
    let file = dir.join("chat.rlhf");
    std::fs::write(&file, CHAT_PROGRAM).unwrap();
    let out = run(&file, &dir);
    ok(&out);
    let metrics = jsonl(&dir.join("run/metrics.jsonl"));
    assert_eq!(metrics.len(), 2);
    assert!(metrics[1]["reward_mean"].as_f64().unwrap().is_finite());
    // `s.prompt` of a conversation is its last user turn.
    let samples = jsonl(&dir.join("run/samples.jsonl"));
    assert!(!samples.is_empty());
    for s in &samples {
        let p = s["prompt"].as_str().unwrap();
        assert!(p.starts_with("again "), "{p}");
        assert!(s["reward"].as_f64().is_some(), "{s}");
    }
    // The plan lists the fields the reward reads from the dataset.
    let plan: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("run/plan.json")).unwrap()).unwrap();
    let fields = &plan["plan"]["datasets"][0]["fields"];
    assert_eq!(
        fields,
        &json!([
            {"name": "level", "ty": "int"},
            {"name": "topic", "ty": "str"},
            {"name": "weight", "ty": "float"}
        ]),
        "{plan}"
    );

    // A record without `level` stops the run when the data is loaded: no step runs.
    let mut lines = lines;
    lines[5] = chat_line(5, false);
    std::fs::write(dir.join("chats.jsonl"), lines.join("\n") + "\n").unwrap();
    let out = run(&file, &dir);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("chats.jsonl")
            && err.contains("line 6")
            && err.contains("no field `level`")
            && err.contains("field_int"),
        "{err}"
    );
    assert!(jsonl(&dir.join("run/metrics.jsonl")).is_empty());
    // A malformed conversation names its line too.
    lines[5] = chat_line(5, true).replace("\"assistant\"", "\"bot\"");
    std::fs::write(dir.join("chats.jsonl"), lines.join("\n") + "\n").unwrap();
    let err = stderr(&run(&file, &dir));
    assert!(
        err.contains("line 6") && err.contains("role `bot`"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A byte-level BPE that is not the byte tokenizer: byte ids reversed, `merges` pairs merged
/// into tokens of their own, other special tokens, and a chat template of its own.
fn write_bpe_tokenizer(dir: &Path, merges: &[(&str, &str)]) -> usize {
    let mut tj = byte_level_tokenizer_json();
    let vocab = tj["model"]["vocab"].as_object().unwrap().clone();
    let mut new_vocab = serde_json::Map::new();
    for (tok, id) in &vocab {
        new_vocab.insert(tok.clone(), json!(255 - id.as_u64().unwrap()));
    }
    let mut next = 256;
    for (a, b) in merges {
        new_vocab.insert(format!("{a}{b}"), json!(next));
        next += 1;
    }
    let specials = [("<s>", next), ("</s>", next + 1), ("<pad>", next + 2)];
    tj["model"]["vocab"] = Value::Object(new_vocab);
    tj["model"]["merges"] = json!(
        merges
            .iter()
            .map(|(a, b)| format!("{a} {b}"))
            .collect::<Vec<_>>()
    );
    tj["added_tokens"] = json!(
        specials
            .iter()
            .map(
                |(c, id)| json!({"id": id, "content": c, "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": true})
            )
            .collect::<Vec<_>>()
    );
    tj["post_processor"] = json!({
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                 {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<s>": {"id": "<s>", "ids": [next], "tokens": ["<s>"]}}
    });
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("tokenizer.json"), tj.to_string()).unwrap();
    std::fs::write(
        dir.join("tokenizer_config.json"),
        json!({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>",
            "chat_template": "{{ bos_token }}{% for m in messages %}### {{ m.role }}: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}### assistant: {% endif %}"
        })
        .to_string(),
    )
    .unwrap();
    next + 3
}

/// A random tiny Llama with `head` for the tokenizer in `tok_dir`, saved to `out`.
fn save_model_for(tok_dir: &Path, vocab: usize, head: Head, seed: u64, out: &Path) {
    let config = ModelConfig::from_json(
        &tok_dir.join("config.json"),
        json!({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "vocab_size": vocab, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
            "head_dim": 16, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": false,
            "bos_token_id": vocab - 3, "eos_token_id": vocab - 2, "pad_token_id": vocab - 1,
        }),
    )
    .unwrap();
    let tok = Tokenizer::from_dir(tok_dir, &config).unwrap();
    let model = Model::random(config, head, seed, Device::Cpu, tok_dir.to_path_buf()).unwrap();
    save_pretrained(&model, &tok, out).unwrap();
}

const PPO_PROGRAM: &str = r#"use std::ppo

model policy = tiny(vocab: "bytes", layers: 1, hidden: 32, heads: 2, seed: 1) {
  train: adamw(lr: 1e-3)
}
model critic = tiny(vocab: "bytes", layers: 1, hidden: 32, heads: 2, seed: 2) {
  head: value
  train: adamw(lr: 1e-3)
}
model rm = hf("rm") { head: score }

dataset prompts = synthetic::letters(count: 32, seed: 4)

run ppo(policy, prompts, reward_model: rm, critic: critic) {
  steps: 2
  batch: 4
  max_new_tokens: 8
  minibatches: 1
}
"#;

#[test]
fn a_reward_model_with_its_own_tokenizer_scores_the_decoded_text() {
    let dir = tmp("rm");
    let bpe = dir.join("bpe");
    let vocab = write_bpe_tokenizer(&bpe, &[("a", "e"), ("i", "o"), ("ae", "io"), ("x", "y")]);
    save_model_for(&bpe, vocab, Head::Score, 7, &dir.join("rm"));
    let file = dir.join("ppo.rlhf");
    std::fs::write(&file, PPO_PROGRAM).unwrap();
    let out = run(&file, &dir);
    ok(&out);
    assert!(
        stderr(&out).contains("reward model `rm` has its own tokenizer"),
        "{}",
        stderr(&out)
    );
    // Every recorded reward is the reward model's score of the text of the prompt and the
    // completion, rendered with its own chat template and encoded with its own tokenizer.
    let rm_dir = dir.join("rm");
    let rm = Model::load(
        &rm_dir,
        &LoadOptions {
            head: Head::Score,
            dtype: None,
            device: Device::Cpu,
        },
    )
    .unwrap();
    let tok = Tokenizer::from_dir(&rm_dir, rm.config()).unwrap();
    let samples = jsonl(&dir.join("run/samples.jsonl"));
    assert!(samples.len() >= 4);
    let mut longer = 0;
    for s in &samples {
        let (prompt, completion) = (
            s["prompt"].as_str().unwrap(),
            s["completion"].as_str().unwrap(),
        );
        let chat = [
            ChatMessage {
                role: "user".into(),
                content: prompt.into(),
            },
            ChatMessage {
                role: "assistant".into(),
                content: completion.into(),
            },
        ];
        let text = tok.apply_chat_template(&chat, false).unwrap();
        assert!(text.starts_with("<s>### user: "), "{text}");
        let ids = tok.encode(&text, false).unwrap();
        longer += usize::from(ids.len() != text.len());
        let want = score(
            &rm,
            &[Rollout {
                prompt: ids,
                completion: Vec::new(),
            }],
            &InferOptions::default(),
        )
        .unwrap()[0];
        let got = s["reward"].as_f64().unwrap();
        assert!(
            (got - f64::from(want)).abs() < 1e-5,
            "{prompt:?} {completion:?}: the run scored {got}, the re-tokenised text scores {want}"
        );
    }
    // The special token at least is one token for many bytes, so ids and text differ in length.
    assert!(longer > 0);

    // A reward model whose tokenizer has the byte vocabulary (a tiny model saved with
    // `save_pretrained`) scores the policy's token ids as they are.
    let (m, t) = braid_runtime::tiny(&Default::default(), Head::Score, Device::Cpu).unwrap();
    save_pretrained(&m, &t, &dir.join("rm")).unwrap();
    let saved = Tokenizer::from_dir(&dir.join("rm"), m.config()).unwrap();
    assert!(saved.same_vocabulary(&Tokenizer::bytes()));
    assert!(!tok.same_vocabulary(&Tokenizer::bytes()));
    let out = run(&file, &dir);
    ok(&out);
    assert!(
        !stderr(&out).contains("its own tokenizer"),
        "{}",
        stderr(&out)
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_critic_with_another_vocabulary_is_refused() {
    let dir = tmp("critic");
    // Another size than the policy's byte vocabulary: the plan knows, before anything runs.
    let bpe = dir.join("bpe");
    let vocab = write_bpe_tokenizer(&bpe, &[("a", "e")]);
    save_model_for(&bpe, vocab, Head::Value, 3, &dir.join("critic"));
    let (m, t) = braid_runtime::tiny(&Default::default(), Head::Score, Device::Cpu).unwrap();
    save_pretrained(&m, &t, &dir.join("rm")).unwrap();
    let program = PPO_PROGRAM.replace(
        "model critic = tiny(vocab: \"bytes\", layers: 1, hidden: 32, heads: 2, seed: 2) {",
        "model critic = hf(\"critic\") {",
    );
    let file = dir.join("ppo.rlhf");
    std::fs::write(&file, &program).unwrap();
    let out = run(&file, &dir);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("E0506") && err.contains("`critic`"), "{err}");
    // The same size with other tokens (byte ids permuted): the runtime compares vocabularies.
    let permuted = dir.join("permuted");
    let vocab = write_bpe_tokenizer(&permuted, &[]);
    assert_eq!(vocab, 259);
    save_model_for(&permuted, vocab, Head::Value, 3, &dir.join("critic"));
    let out = run(&file, &dir);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("model `critic`")
            && err.contains("another vocabulary")
            && err.contains("`values`"),
        "{err}"
    );
    assert!(!err.contains("E0506"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}
