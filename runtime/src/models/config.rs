//! Model configuration: what Braid reads from a Hugging Face `config.json` (both the
//! transformers 4.x spelling, `rope_scaling` / `torch_dtype`, and the 5.x spelling,
//! `rope_parameters` / `dtype`) and writes back when it saves a model. This module only
//! interprets JSON; it must not touch tensors or files other than the one it is given.

use std::path::Path;

use serde_json::{Map, Value, json};

use crate::error::{Error, Result};

/// The two transformer bodies Braid implements. Llama covers Llama 2/3, Mistral and Qwen2
/// (they differ only in configuration: biases, windows, rope scaling, tying).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    /// Pre-norm RMSNorm decoder with rotary positions, SwiGLU MLP and grouped-query attention.
    Llama,
    /// GPT-2: learned positions, LayerNorm, fused Conv1D attention, GELU MLP.
    Gpt2,
}

/// How rotary frequencies are rescaled for long contexts.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// Plain RoPE.
    None,
    /// Positions divided by `factor` (equivalently, frequencies).
    Linear { factor: f64 },
    /// Llama 3.1's piecewise rescaling of frequencies.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: f64,
    },
}

/// The MLP non-linearity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// SiLU gate (Llama family).
    Silu,
    /// GELU with the tanh approximation (`gelu_new`, `gelu_pytorch_tanh`).
    GeluTanh,
    /// Exact GELU.
    Gelu,
    /// ReLU.
    Relu,
}

/// Everything the model code needs to know about an architecture instance.
#[derive(Debug, Clone)]
pub struct ModelConfig {
    pub arch: Arch,
    /// `model_type` as written in `config.json` (`llama`, `mistral`, `qwen2`, `gpt2`).
    pub model_type: String,
    pub vocab_size: i64,
    pub hidden_size: i64,
    pub num_layers: i64,
    pub num_heads: i64,
    pub num_kv_heads: i64,
    pub head_dim: i64,
    pub intermediate_size: i64,
    pub max_position_embeddings: i64,
    pub norm_eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: RopeScaling,
    /// Biases on the q, k, v projections (Qwen2, `attention_bias` in Llama configs).
    pub qkv_bias: bool,
    /// Bias on the attention output projection (`attention_bias` in Llama configs).
    pub o_bias: bool,
    pub mlp_bias: bool,
    pub activation: Activation,
    pub tie_word_embeddings: bool,
    /// Sliding attention window per layer (`None`: full attention).
    pub layer_windows: Vec<Option<i64>>,
    pub bos_token_id: Option<i64>,
    pub eos_token_ids: Vec<i64>,
    pub pad_token_id: Option<i64>,
    /// Labels of a sequence-classification head (`num_labels`, 1 for reward models).
    pub num_labels: i64,
    /// The dtype the checkpoint declares (`bfloat16`, `float32`, ...), if any.
    pub declared_dtype: Option<String>,
    /// The JSON this configuration was read from; saving starts from it so that fields Braid
    /// does not interpret survive a load/save round trip.
    pub raw: Value,
}

struct Fields<'a> {
    path: &'a Path,
    map: &'a Map<String, Value>,
}

impl Fields<'_> {
    fn err(&self, what: String) -> Error {
        Error::file(self.path, what)
    }

    fn get(&self, key: &str) -> Option<&Value> {
        self.map.get(key).filter(|v| !v.is_null())
    }

    fn int(&self, key: &str) -> Result<i64> {
        self.opt_int(key)?
            .ok_or_else(|| self.err(format!("missing field `{key}`")))
    }

    fn opt_int(&self, key: &str) -> Result<Option<i64>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_i64()
                .map(Some)
                .ok_or_else(|| self.err(format!("field `{key}` must be an integer, found {v}"))),
        }
    }

    fn positive(&self, key: &str) -> Result<i64> {
        let v = self.int(key)?;
        if v <= 0 {
            return Err(self.err(format!("field `{key}` must be positive, found {v}")));
        }
        Ok(v)
    }

    fn opt_float(&self, key: &str) -> Result<Option<f64>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| self.err(format!("field `{key}` must be a number, found {v}"))),
        }
    }

    fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_bool()
                .map(Some)
                .ok_or_else(|| self.err(format!("field `{key}` must be true or false, found {v}"))),
        }
    }

    fn opt_str(&self, key: &str) -> Result<Option<&str>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_str()
                .map(Some)
                .ok_or_else(|| self.err(format!("field `{key}` must be a string, found {v}"))),
        }
    }

    /// `eos_token_id` may be an integer or a list of integers.
    fn int_or_list(&self, key: &str) -> Result<Vec<i64>> {
        match self.get(key) {
            None => Ok(Vec::new()),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| {
                    v.as_i64().ok_or_else(|| {
                        self.err(format!("field `{key}` must hold integers, found {v}"))
                    })
                })
                .collect(),
            Some(v) => v.as_i64().map(|i| vec![i]).ok_or_else(|| {
                self.err(format!(
                    "field `{key}` must be an integer or a list, found {v}"
                ))
            }),
        }
    }
}

/// Reads a token id list (`eos_token_id`) from any JSON object, for `generation_config.json`.
pub(crate) fn token_ids_field(path: &Path, value: &Value, key: &str) -> Result<Vec<i64>> {
    let Some(map) = value.as_object() else {
        return Err(Error::file(path, "expected a JSON object"));
    };
    Fields { path, map }.int_or_list(key)
}

impl ModelConfig {
    /// Reads and interprets a `config.json`.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| Error::file(path, format!("cannot read: {e}")))?;
        let value: Value = serde_json::from_str(&text)
            .map_err(|e| Error::file(path, format!("invalid JSON: {e}")))?;
        Self::from_json(path, value)
    }

    /// Interprets a parsed `config.json`; `path` is used in error messages.
    pub fn from_json(path: &Path, value: Value) -> Result<Self> {
        let Some(map) = value.as_object() else {
            return Err(Error::file(path, "expected a JSON object"));
        };
        let f = Fields { path, map };
        let model_type = f.opt_str("model_type")?.map(str::to_owned);
        let model_type = match model_type {
            Some(t) => t,
            None => return Err(f.err("missing field `model_type`".into())),
        };
        let arch = match model_type.as_str() {
            "llama" | "mistral" | "qwen2" => Arch::Llama,
            "gpt2" => Arch::Gpt2,
            other => {
                return Err(f.err(format!(
                    "unknown architecture `model_type: {other}` (Braid supports llama, mistral, qwen2 and gpt2)"
                )));
            }
        };
        let declared_dtype = match f.opt_str("dtype")? {
            Some(d) => Some(d.to_owned()),
            None => f.opt_str("torch_dtype")?.map(str::to_owned),
        };
        let eos_token_ids = f.int_or_list("eos_token_id")?;
        let bos_token_id = f.int_or_list("bos_token_id")?.first().copied();
        let pad_token_id = f.int_or_list("pad_token_id")?.first().copied();
        let num_labels = match f.opt_int("num_labels")? {
            Some(n) => n,
            None => match f.get("id2label").and_then(Value::as_object) {
                Some(labels) => i64::try_from(labels.len()).unwrap_or(1),
                None => 1,
            },
        };
        let config = match arch {
            Arch::Llama => {
                let hidden_size = f.positive("hidden_size")?;
                let num_heads = f.positive("num_attention_heads")?;
                let num_layers = f.positive("num_hidden_layers")?;
                let num_kv_heads = f.opt_int("num_key_value_heads")?.unwrap_or(num_heads);
                let head_dim = f.opt_int("head_dim")?.unwrap_or(hidden_size / num_heads);
                if num_kv_heads <= 0 || num_heads % num_kv_heads != 0 {
                    return Err(f.err(format!(
                        "`num_attention_heads` ({num_heads}) must be a multiple of `num_key_value_heads` ({num_kv_heads})"
                    )));
                }
                if head_dim <= 0 || head_dim % 2 != 0 {
                    return Err(f.err(format!(
                        "head dimension {head_dim} must be positive and even"
                    )));
                }
                let act = f.opt_str("hidden_act")?.unwrap_or("silu");
                if act != "silu" {
                    return Err(f.err(format!("unsupported `hidden_act: {act}` (expected silu)")));
                }
                let (rope_theta, rope_scaling) = rope(&f)?;
                let attention_bias = f.opt_bool("attention_bias")?.unwrap_or(false);
                // Qwen2 has q/k/v biases and no o bias; transformers 5 no longer writes the key.
                let (qkv_bias, o_bias) = if model_type == "qwen2" {
                    (true, false)
                } else {
                    (attention_bias, attention_bias)
                };
                let layer_windows = windows(&f, &model_type, num_layers)?;
                let tie_default = false;
                ModelConfig {
                    arch,
                    model_type: model_type.clone(),
                    vocab_size: f.positive("vocab_size")?,
                    hidden_size,
                    num_layers,
                    num_heads,
                    num_kv_heads,
                    head_dim,
                    intermediate_size: f.positive("intermediate_size")?,
                    max_position_embeddings: f.opt_int("max_position_embeddings")?.unwrap_or(2048),
                    norm_eps: f.opt_float("rms_norm_eps")?.unwrap_or(1e-6),
                    rope_theta,
                    rope_scaling,
                    qkv_bias,
                    o_bias,
                    mlp_bias: f.opt_bool("mlp_bias")?.unwrap_or(false),
                    activation: Activation::Silu,
                    tie_word_embeddings: f.opt_bool("tie_word_embeddings")?.unwrap_or(tie_default),
                    layer_windows,
                    bos_token_id,
                    eos_token_ids,
                    pad_token_id,
                    num_labels,
                    declared_dtype,
                    raw: value.clone(),
                }
            }
            Arch::Gpt2 => {
                let hidden_size = f.positive("n_embd")?;
                let num_heads = f.positive("n_head")?;
                if hidden_size % num_heads != 0 {
                    return Err(f.err(format!(
                        "`n_embd` ({hidden_size}) must be a multiple of `n_head` ({num_heads})"
                    )));
                }
                let activation = match f.opt_str("activation_function")?.unwrap_or("gelu_new") {
                    "gelu_new" | "gelu_pytorch_tanh" => Activation::GeluTanh,
                    "gelu" => Activation::Gelu,
                    "relu" => Activation::Relu,
                    other => {
                        return Err(f.err(format!("unsupported `activation_function: {other}`")));
                    }
                };
                for key in ["scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"] {
                    if f.opt_bool(key)?.unwrap_or(false) {
                        return Err(f.err(format!("unsupported `{key}: true`")));
                    }
                }
                let num_layers = f.positive("n_layer")?;
                ModelConfig {
                    arch,
                    model_type: model_type.clone(),
                    vocab_size: f.positive("vocab_size")?,
                    hidden_size,
                    num_layers,
                    num_heads,
                    num_kv_heads: num_heads,
                    head_dim: hidden_size / num_heads,
                    intermediate_size: f.opt_int("n_inner")?.unwrap_or(4 * hidden_size),
                    max_position_embeddings: f.positive("n_positions")?,
                    norm_eps: f.opt_float("layer_norm_epsilon")?.unwrap_or(1e-5),
                    rope_theta: 0.0,
                    rope_scaling: RopeScaling::None,
                    qkv_bias: true,
                    o_bias: true,
                    mlp_bias: true,
                    activation,
                    tie_word_embeddings: f.opt_bool("tie_word_embeddings")?.unwrap_or(true),
                    layer_windows: vec![None; usize::try_from(num_layers).unwrap_or(0)],
                    bos_token_id,
                    eos_token_ids,
                    pad_token_id,
                    num_labels,
                    declared_dtype,
                    raw: value.clone(),
                }
            }
        };
        Ok(config)
    }

    /// The `config.json` to write when saving. `architecture` is the transformers class name.
    pub fn to_json(&self, architecture: &str, dtype: &str) -> Value {
        let mut v = match &self.raw {
            Value::Object(m) => Value::Object(m.clone()),
            _ => json!({}),
        };
        if let Value::Object(m) = &mut v {
            m.insert("architectures".into(), json!([architecture]));
            m.insert("model_type".into(), json!(self.model_type));
            m.insert("torch_dtype".into(), json!(dtype));
            m.insert("dtype".into(), json!(dtype));
            m.insert("vocab_size".into(), json!(self.vocab_size));
            m.insert(
                "tie_word_embeddings".into(),
                json!(self.tie_word_embeddings),
            );
            if architecture.ends_with("ForSequenceClassification") {
                m.insert("num_labels".into(), json!(self.num_labels));
                let labels: Map<String, Value> = (0..self.num_labels)
                    .map(|i| (i.to_string(), json!(format!("LABEL_{i}"))))
                    .collect();
                let ids: Map<String, Value> = (0..self.num_labels)
                    .map(|i| (format!("LABEL_{i}"), json!(i)))
                    .collect();
                m.insert("id2label".into(), Value::Object(labels));
                m.insert("label2id".into(), Value::Object(ids));
                if self.pad_token_id.is_none() {
                    // Sequence classification in transformers needs a pad id to find the last
                    // token; Braid's reward head uses the attention mask, so any valid id works.
                    if let Some(eos) = self.eos_token_ids.first() {
                        m.insert("pad_token_id".into(), json!(eos));
                    }
                }
            }
        }
        v
    }
}

fn rope(f: &Fields<'_>) -> Result<(f64, RopeScaling)> {
    // transformers 5 writes `rope_parameters` (with `rope_theta` inside); 4.x writes
    // `rope_theta` at the top level and an optional `rope_scaling`.
    let params = f.get("rope_parameters").or_else(|| f.get("rope_scaling"));
    let mut theta = f.opt_float("rope_theta")?;
    let mut scaling = RopeScaling::None;
    if let Some(p) = params {
        let Some(pm) = p.as_object() else {
            return Err(f.err(format!("`rope_parameters` must be an object, found {p}")));
        };
        let inner = Fields {
            path: f.path,
            map: pm,
        };
        if let Some(t) = inner.opt_float("rope_theta")? {
            theta = Some(t);
        }
        let kind = match inner.opt_str("rope_type")? {
            Some(k) => k,
            None => inner.opt_str("type")?.unwrap_or("default"),
        };
        let factor = |inner: &Fields<'_>| -> Result<f64> {
            inner
                .opt_float("factor")?
                .ok_or_else(|| f.err("missing field `factor` in rope scaling".into()))
        };
        scaling = match kind {
            "default" => RopeScaling::None,
            "linear" => RopeScaling::Linear {
                factor: factor(&inner)?,
            },
            "llama3" => RopeScaling::Llama3 {
                factor: factor(&inner)?,
                low_freq_factor: inner.opt_float("low_freq_factor")?.unwrap_or(1.0),
                high_freq_factor: inner.opt_float("high_freq_factor")?.unwrap_or(4.0),
                original_max_position_embeddings: inner
                    .opt_float("original_max_position_embeddings")?
                    .ok_or_else(|| {
                        f.err(
                            "missing field `original_max_position_embeddings` in rope scaling"
                                .into(),
                        )
                    })?,
            },
            other => return Err(f.err(format!("unsupported rope scaling type `{other}`"))),
        };
    }
    Ok((theta.unwrap_or(10000.0), scaling))
}

fn windows(f: &Fields<'_>, model_type: &str, num_layers: i64) -> Result<Vec<Option<i64>>> {
    let n = usize::try_from(num_layers).unwrap_or(0);
    let window = f.opt_int("sliding_window")?;
    let Some(window) = window else {
        return Ok(vec![None; n]);
    };
    if let Some(Value::Array(types)) = f.get("layer_types") {
        if types.len() != n {
            return Err(f.err(format!(
                "`layer_types` has {} entries for {n} layers",
                types.len()
            )));
        }
        return Ok(types
            .iter()
            .map(|t| (t.as_str() == Some("sliding_attention")).then_some(window))
            .collect());
    }
    Ok(match model_type {
        "mistral" => vec![Some(window); n],
        "qwen2" if f.opt_bool("use_sliding_window")?.unwrap_or(false) => {
            let first = f.opt_int("max_window_layers")?.unwrap_or(num_layers);
            (0..num_layers)
                .map(|i| (i >= first).then_some(window))
                .collect()
        }
        _ => vec![None; n],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(v: Value) -> Result<ModelConfig> {
        ModelConfig::from_json(Path::new("m/config.json"), v)
    }

    #[test]
    fn unknown_architecture_names_file_and_type() {
        let err = parse(json!({"model_type": "bert", "vocab_size": 10}))
            .err()
            .map(|e| e.to_string());
        let msg = err.unwrap_or_default();
        assert!(
            msg.starts_with("m/config.json: unknown architecture"),
            "{msg}"
        );
        assert!(msg.contains("bert"), "{msg}");
    }

    #[test]
    fn missing_field_is_named() {
        let err = parse(
            json!({"model_type": "llama", "vocab_size": 10, "num_attention_heads": 2,
            "num_hidden_layers": 1, "intermediate_size": 8}),
        )
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
        assert_eq!(err, "m/config.json: missing field `hidden_size`");
    }

    #[test]
    fn rope_parameters_of_both_transformers_versions() {
        let base = json!({"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "num_attention_heads": 2,
            "num_hidden_layers": 1, "intermediate_size": 8});
        let mut v4 = base.clone();
        v4["rope_theta"] = json!(500000.0);
        v4["rope_scaling"] = json!({"type": "linear", "factor": 2.0});
        let c = parse(v4).unwrap();
        assert_eq!(c.rope_theta, 500000.0);
        assert_eq!(c.rope_scaling, RopeScaling::Linear { factor: 2.0 });
        let mut v5 = base;
        v5["rope_parameters"] = json!({"rope_type": "llama3", "rope_theta": 7.0, "factor": 8.0,
            "original_max_position_embeddings": 64});
        let c = parse(v5).unwrap();
        assert_eq!(c.rope_theta, 7.0);
        assert!(matches!(c.rope_scaling, RopeScaling::Llama3 { factor, .. } if factor == 8.0));
    }
}
