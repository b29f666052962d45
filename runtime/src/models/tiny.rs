//! `tiny(...)` models: a Llama-style transformer initialised from a seed with the built-in byte
//! tokenizer, for demos and tests that need no files. The option names are the language's
//! (`vocab`, `layers`, `hidden`, `heads`, `kv_heads`, `intermediate`, `max_len`, `seed`). The
//! same configuration and seed give the same weights on every machine and thread count,
//! because the weights come from Braid's own generator (`rng`), not libtorch's. This module
//! must not read files.

use std::path::PathBuf;

use serde_json::json;
use tch::{Device, Kind};

use crate::error::{Error, Result};
use crate::models::config::ModelConfig;
use crate::models::model::{Head, Model, Weights};
use crate::models::tokenizer::{BYTE_BOS, BYTE_EOS, BYTE_PAD, BYTE_VOCAB, Tokenizer};

/// The vocabulary of a tiny model. Only the byte vocabulary exists.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TinyVocab {
    /// 256 bytes plus `<|bos|>`, `<|eos|>`, `<|pad|>` (ids 256, 257, 258).
    #[default]
    Bytes,
}

impl TinyVocab {
    /// Parses the language's spelling (`"bytes"`).
    pub fn parse(s: &str) -> Result<TinyVocab> {
        match s {
            "bytes" => Ok(TinyVocab::Bytes),
            other => Err(Error::invalid(
                "tiny",
                format!("unknown vocab `{other}` (expected \"bytes\")"),
            )),
        }
    }
}

/// Options of `tiny(...)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TinyConfig {
    pub vocab: TinyVocab,
    /// Transformer layers (default 2).
    pub layers: i64,
    /// Hidden size (default 64).
    pub hidden: i64,
    /// Attention heads (default 4).
    pub heads: i64,
    /// Key/value heads (default 2: grouped-query attention, like current Llama models).
    pub kv_heads: i64,
    /// MLP size (default 4 × hidden = 256).
    pub intermediate: i64,
    /// Longest sequence, prompt and completion together (default 512).
    pub max_len: i64,
    /// Seed of the weights (default 0).
    pub seed: u64,
}

impl Default for TinyConfig {
    fn default() -> Self {
        TinyConfig {
            vocab: TinyVocab::Bytes,
            layers: 2,
            hidden: 64,
            heads: 4,
            kv_heads: 2,
            intermediate: 256,
            max_len: 512,
            seed: 0,
        }
    }
}

impl TinyConfig {
    /// The equivalent Hugging Face Llama configuration.
    pub fn to_model_config(&self) -> Result<ModelConfig> {
        let bad = |what: String| Err(Error::invalid("tiny", what));
        for (name, v) in [
            ("layers", self.layers),
            ("hidden", self.hidden),
            ("heads", self.heads),
            ("kv_heads", self.kv_heads),
            ("intermediate", self.intermediate),
            ("max_len", self.max_len),
        ] {
            if v <= 0 {
                return bad(format!("`{name}` must be positive, found {v}"));
            }
        }
        if self.hidden % self.heads != 0 || (self.hidden / self.heads) % 2 != 0 {
            return bad(format!(
                "`hidden` ({}) must be `heads` ({}) times an even head size",
                self.hidden, self.heads
            ));
        }
        if self.heads % self.kv_heads != 0 {
            return bad(format!(
                "`heads` ({}) must be a multiple of `kv_heads` ({})",
                self.heads, self.kv_heads
            ));
        }
        let v = json!({
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": BYTE_VOCAB,
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.hidden / self.heads,
            "max_position_embeddings": self.max_len,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "hidden_act": "silu",
            "attention_bias": false,
            "mlp_bias": false,
            "tie_word_embeddings": false,
            "bos_token_id": BYTE_BOS,
            "eos_token_id": BYTE_EOS,
            "pad_token_id": BYTE_PAD,
            "initializer_range": 0.02,
        });
        ModelConfig::from_json(std::path::Path::new("tiny"), v)
    }
}

/// A tiny model with the given head on `device`, in f32, and its byte tokenizer.
pub fn tiny(config: &TinyConfig, head: Head, device: Device) -> Result<(Model, Tokenizer)> {
    tiny_in(config, head, Kind::Float, device)
}

/// A tiny model in `kind` (a model's `dtype`): the weights are drawn in f32 from the seed, as
/// for `tiny`, and rounded once into `kind`, so a bf16 tiny model is the f32 one rounded.
pub fn tiny_in(
    config: &TinyConfig,
    head: Head,
    kind: Kind,
    device: Device,
) -> Result<(Model, Tokenizer)> {
    let mc = config.to_model_config()?;
    let model = Model::build(
        mc,
        head,
        kind,
        device,
        Weights::Random(config.seed),
        PathBuf::from("tiny"),
    )?;
    Ok((model, Tokenizer::bytes()))
}

#[cfg(test)]
mod tests {
    // Each test sets one libtorch thread: tests run in parallel threads, and OpenMP threads
    // spinning on a small shared machine slow the suite down about tenfold.
    use super::*;
    use tch::Tensor;

    #[test]
    fn same_seed_same_weights_other_seed_other_weights() {
        crate::device::set_cpu_threads(1);
        let cfg = TinyConfig {
            layers: 1,
            hidden: 16,
            heads: 2,
            kv_heads: 1,
            intermediate: 32,
            ..TinyConfig::default()
        };
        let (a, _) = tiny(&cfg, Head::Lm, Device::Cpu).unwrap();
        let (b, _) = tiny(&cfg, Head::Lm, Device::Cpu).unwrap();
        let (c, _) = tiny(&TinyConfig { seed: 1, ..cfg }, Head::Lm, Device::Cpu).unwrap();
        let ids = Tensor::from_slice(&[256i64, 104, 105]).unsqueeze(0);
        let la = a.forward(&ids, None).unwrap();
        assert!(la.equal(&b.forward(&ids, None).unwrap()));
        assert!(!la.equal(&c.forward(&ids, None).unwrap()));
        assert_eq!(la.size(), vec![1, 3, BYTE_VOCAB]);
    }

    /// `dtype: bf16` on a tiny model computes in bf16: parameters, hidden states and logits
    /// are bf16, and they are the f32 model's weights rounded once.
    #[test]
    fn a_bf16_tiny_model_computes_in_bf16() {
        crate::device::set_cpu_threads(1);
        let cfg = TinyConfig {
            layers: 1,
            hidden: 32,
            heads: 2,
            kv_heads: 1,
            intermediate: 64,
            ..TinyConfig::default()
        };
        let (f, _) = tiny(&cfg, Head::Lm, Device::Cpu).unwrap();
        let (b, _) = tiny_in(&cfg, Head::Lm, Kind::BFloat16, Device::Cpu).unwrap();
        assert_eq!(b.kind(), Kind::BFloat16);
        for ((name, pf), (_, pb)) in f.named_parameters().iter().zip(b.named_parameters()) {
            assert_eq!(pb.kind(), Kind::BFloat16, "{name}");
            assert!(
                pf.to_kind(Kind::BFloat16).equal(&pb),
                "{name} is not f32 rounded"
            );
        }
        let ids = Tensor::from_slice(&[256i64, 104, 105]).unsqueeze(0);
        let (hf, hb) = tch::no_grad(|| {
            (
                f.forward(&ids, None).unwrap(),
                b.forward(&ids, None).unwrap(),
            )
        });
        assert_eq!(hb.kind(), Kind::BFloat16);
        assert_eq!(b.hidden_states(&ids, None).unwrap().kind(), Kind::BFloat16);
        let diff = (hf - hb.to_kind(Kind::Float)).abs().max().double_value(&[]);
        // Close to f32 but not equal: it really computed in 8 mantissa bits.
        assert!(diff > 0.0 && diff < 0.05, "{diff}");
    }

    #[test]
    fn inconsistent_options_are_errors() {
        crate::device::set_cpu_threads(1);
        let err = TinyConfig {
            heads: 3,
            ..TinyConfig::default()
        }
        .to_model_config()
        .err()
        .map(|e| e.to_string());
        assert!(err.unwrap_or_default().starts_with("tiny: `hidden` (64)"));
        assert!(TinyVocab::parse("words").is_err());
    }
}
