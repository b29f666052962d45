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
use tch::{Kind, Tensor};

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

fn dtype_name(kind: Kind) -> &'static str {
    match kind {
        Kind::BFloat16 => "bfloat16",
        Kind::Half => "float16",
        Kind::Double => "float64",
        _ => "float32",
    }
}

/// The safetensors element type of a libtorch kind.
fn safetensors_dtype(kind: Kind) -> Option<Dtype> {
    Some(match kind {
        Kind::Float => Dtype::F32,
        Kind::BFloat16 => Dtype::BF16,
        Kind::Half => Dtype::F16,
        Kind::Double => Dtype::F64,
        Kind::Int64 => Dtype::I64,
        _ => return None,
    })
}

/// Writes `tensors` (name, tensor, on any device, in their own dtype) to one safetensors file
/// with `format: pt` metadata. Device tensors reach host memory through pinned buffers
/// (`device::host_copies`).
pub fn write_safetensors(path: &Path, tensors: &[(String, Tensor)]) -> Result<()> {
    let host = crate::device::host_copies(tensors);
    let mut blobs: Vec<(&str, Dtype, Vec<usize>, Vec<u8>)> = Vec::with_capacity(host.len());
    for (name, t) in &host {
        let kind = t.kind();
        let dtype = safetensors_dtype(kind).ok_or_else(|| {
            Error::file(
                path,
                format!("tensor `{name}`: cannot write a {kind:?} tensor"),
            )
        })?;
        let t = t.contiguous();
        let numel = t.numel();
        let mut bytes = vec![0u8; numel * kind.elt_size_in_bytes()];
        t.f_copy_data_u8(&mut bytes, numel)?;
        let shape = t.size().iter().map(|&d| d as usize).collect();
        blobs.push((name.as_str(), dtype, shape, bytes));
    }
    let views = blobs
        .iter()
        .map(|(name, dtype, shape, bytes)| {
            TensorView::new(*dtype, shape.clone(), bytes)
                .map(|v| (*name, v))
                .map_err(|e| Error::file(path, format!("tensor `{name}`: {e:?}")))
        })
        .collect::<Result<Vec<_>>>()?;
    let metadata: HashMap<String, String> = [("format".to_owned(), "pt".to_owned())].into();
    safetensors::tensor::serialize_to_file(views, &Some(metadata), path)
        .map_err(|e| Error::file(path, format!("cannot write: {e:?}")))
}

fn write_json(path: &Path, v: &Value) -> Result<()> {
    let text = serde_json::to_string_pretty(v)
        .map_err(|e| Error::file(path, format!("cannot serialise: {e}")))?;
    std::fs::write(path, text + "\n").map_err(|e| Error::file(path, format!("cannot write: {e}")))
}

/// Saves `model` and `tokenizer` into `dir` (created if needed; files there are replaced). A
/// tensor-parallel model is gathered whole first: every rank of its group must call this, and
/// its first rank writes.
pub fn save_pretrained(model: &Model, tokenizer: &Tokenizer, dir: &Path) -> Result<()> {
    let (tp, tp_rank) = model.tensor_parallel();
    let held = if tp > 1 {
        model.gather_parameters()?
    } else {
        model.held_parameters()
    };
    if tp_rank > 0 {
        return Ok(());
    }
    std::fs::create_dir_all(dir)
        .map_err(|e| Error::file(dir, format!("cannot create directory: {e}")))?;
    let dtype = dtype_name(model.kind());
    let mut config = model.config().clone();
    if model.head() == Head::Value {
        config.num_labels = 1;
    }
    write_json(
        &dir.join("config.json"),
        &config.to_json(&architecture(model), dtype),
    )?;

    // Tensors: one safetensors file in the model's dtype; a pipeline stage writes its own
    // file of a sharded checkpoint (the first stage the index too, and a parameter that
    // several stages hold is written by the first of them).
    let file_of = |name: &str| -> (usize, String) {
        match model.pipeline_stage() {
            Some((_, n)) => {
                let s = (0..n).find(|s| model.stage_holds(name, *s, n)).unwrap_or(0);
                (s, format!("model-{:05}-of-{n:05}.safetensors", s + 1))
            }
            None => (0, "model.safetensors".to_string()),
        }
    };
    let here = model.pipeline_stage().map_or(0, |(s, _)| s);
    let mut file = "model.safetensors".to_string();
    let mut params: Vec<(String, Tensor)> = Vec::new();
    for (name, t) in held {
        let (s, f) = file_of(&name);
        if s == here {
            params.push((name, t.detach().to_kind(model.kind())));
            file = f;
        }
    }
    if let Some((_, n)) = model.pipeline_stage() {
        file = format!("model-{:05}-of-{n:05}.safetensors", here + 1);
        if here == 0 {
            let map: serde_json::Map<String, Value> = model
                .named_parameters()
                .into_iter()
                .map(|(name, _)| {
                    let f = file_of(&name).1;
                    (name, json!(f))
                })
                .collect();
            write_json(
                &dir.join("model.safetensors.index.json"),
                &json!({"metadata": {}, "weight_map": map}),
            )?;
        }
    }
    write_safetensors(&dir.join(&file), &params)?;
    if here > 0 {
        // The first stage writes the configuration and the tokenizer.
        return Ok(());
    }

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
