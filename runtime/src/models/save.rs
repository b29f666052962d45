//! Saving a model as a Hugging Face directory that `transformers` loads: `config.json`,
//! `model.safetensors` (tensors under their Hugging Face names, with `format: pt` metadata),
//! the tokenizer files and, for language models, `generation_config.json`. A language model
//! is saved as `*ForCausalLM` (`GPT2LMHeadModel`); value and score models as
//! `*ForSequenceClassification` (a value head is a one-label `score`). Tiny models get a real
//! byte-level `tokenizer.json`. Test `tests/save_load.rs` loads saved models back in Braid and,
//! where Python with transformers is available, in transformers. This module must not change
//! the model it saves.

use std::collections::HashMap;
use std::path::Path;

use safetensors::tensor::{Dtype, TensorView};
use serde_json::{Value, json};
use tch::{Device, Kind};

use crate::error::{Error, Result};
use crate::models::config::Arch;
use crate::models::model::{Head, Model};
use crate::models::tokenizer::{Tokenizer, byte_level_tokenizer_config, byte_level_tokenizer_json};

fn architecture(model: &Model) -> String {
    let c = model.config();
    let lm = model.head() == Head::Lm;
    match (c.arch, c.model_type.as_str()) {
        (Arch::Gpt2, _) if lm => "GPT2LMHeadModel".into(),
        (Arch::Gpt2, _) => "GPT2ForSequenceClassification".into(),
        (_, t) => {
            let base = match t {
                "mistral" => "Mistral",
                "qwen2" => "Qwen2",
                _ => "Llama",
            };
            format!(
                "{base}{}",
                if lm {
                    "ForCausalLM"
                } else {
                    "ForSequenceClassification"
                }
            )
        }
    }
}

fn dtype_name(kind: Kind) -> (&'static str, Dtype) {
    match kind {
        Kind::BFloat16 => ("bfloat16", Dtype::BF16),
        Kind::Half => ("float16", Dtype::F16),
        Kind::Double => ("float64", Dtype::F64),
        _ => ("float32", Dtype::F32),
    }
}

fn write_json(path: &Path, v: &Value) -> Result<()> {
    let text = serde_json::to_string_pretty(v)
        .map_err(|e| Error::file(path, format!("cannot serialise: {e}")))?;
    std::fs::write(path, text + "\n").map_err(|e| Error::file(path, format!("cannot write: {e}")))
}

/// Saves `model` and `tokenizer` into `dir` (created if needed; files there are replaced).
pub fn save_pretrained(model: &Model, tokenizer: &Tokenizer, dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir)
        .map_err(|e| Error::file(dir, format!("cannot create directory: {e}")))?;
    let (dtype, st_dtype) = dtype_name(model.kind());
    let mut config = model.config().clone();
    if model.head() == Head::Value {
        config.num_labels = 1;
    }
    write_json(
        &dir.join("config.json"),
        &config.to_json(&architecture(model), dtype),
    )?;

    // Tensors: contiguous host copies, then one safetensors file.
    let params = model.named_parameters();
    let mut blobs: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::with_capacity(params.len());
    for (name, t) in params {
        let t = t
            .detach()
            .to_device(Device::Cpu)
            .to_kind(model.kind())
            .contiguous();
        let numel = t.numel();
        let mut bytes = vec![0u8; numel * model.kind().elt_size_in_bytes()];
        t.f_copy_data_u8(&mut bytes, numel)?;
        let shape = t.size().iter().map(|&d| d as usize).collect();
        blobs.push((name, shape, bytes));
    }
    let st_path = dir.join("model.safetensors");
    let views = blobs
        .iter()
        .map(|(name, shape, bytes)| {
            TensorView::new(st_dtype, shape.clone(), bytes)
                .map(|v| (name.as_str(), v))
                .map_err(|e| Error::file(&st_path, format!("tensor `{name}`: {e:?}")))
        })
        .collect::<Result<Vec<_>>>()?;
    let metadata: HashMap<String, String> = [("format".to_owned(), "pt".to_owned())].into();
    safetensors::tensor::serialize_to_file(views, &Some(metadata), &st_path)
        .map_err(|e| Error::file(&st_path, format!("cannot write: {e:?}")))?;

    // Tokenizer: the files it came from, or the byte tokenizer written out.
    if tokenizer.is_bytes() {
        write_json(&dir.join("tokenizer.json"), &byte_level_tokenizer_json())?;
        write_json(
            &dir.join("tokenizer_config.json"),
            &byte_level_tokenizer_config(),
        )?;
    } else if let Some((json, config)) = tokenizer.generated_files() {
        write_json(&dir.join("tokenizer.json"), json)?;
        write_json(&dir.join("tokenizer_config.json"), config)?;
    } else {
        for src in tokenizer.files() {
            let Some(name) = src.file_name() else {
                continue;
            };
            let dst = dir.join(name);
            if dst != *src {
                std::fs::copy(src, &dst).map_err(|e| {
                    Error::file(&dst, format!("cannot copy from {}: {e}", src.display()))
                })?;
            }
        }
    }
    if model.head() == Head::Lm {
        let s = tokenizer.special();
        let eos: Value = match s.eos.as_slice() {
            [one] => json!(one),
            many => json!(many),
        };
        write_json(
            &dir.join("generation_config.json"),
            &json!({"bos_token_id": s.bos, "eos_token_id": eos, "pad_token_id": s.pad}),
        )?;
    }
    Ok(())
}
