//! Model shapes: the handful of numbers the cost model needs about a transformer, read from a
//! Hugging Face `config.json` value, from a `tiny(...)` model's options, or from a named preset.
//!
//! This module only describes shapes and counts parameters and FLOPs; it must not read files
//! (the caller parses `config.json`) and knows nothing about devices.

use serde::{Deserialize, Serialize};

use super::CostError;

/// A decoder-only transformer with (grouped-query) attention and a gated MLP, the shape of
/// LLaMA, Qwen, Mistral and the tiny models Braid builds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelShape {
    pub name: String,
    pub layers: u64,
    pub hidden: u64,
    pub heads: u64,
    pub kv_heads: u64,
    pub intermediate: u64,
    pub vocab: u64,
    /// Whether the output projection shares the embedding matrix.
    pub tied_embeddings: bool,
    /// Parameters as published (config `num_parameters` or the preset); `None` = use
    /// [`ModelShape::counted_params`].
    pub declared_params: Option<u64>,
}

/// Vocabulary of the byte-level tokenizer of tiny models: 256 bytes and 3 specials.
pub const BYTE_VOCAB: u64 = 259;

impl ModelShape {
    /// Reads the fields the cost model needs from a parsed Hugging Face `config.json`,
    /// accepting the LLaMA names and the GPT-2 names (`n_layer`, `n_embd`, `n_head`).
    pub fn from_hf_config(name: &str, config: &serde_json::Value) -> Result<ModelShape, CostError> {
        let get = |keys: &[&str]| -> Option<u64> {
            keys.iter()
                .find_map(|k| config.get(*k).and_then(|v| v.as_u64()))
        };
        let need = |keys: &[&str]| -> Result<u64, CostError> {
            get(keys).ok_or_else(|| {
                CostError(format!(
                    "{name}: config.json has no positive integer `{}`",
                    keys.join("` or `")
                ))
            })
        };
        let layers = need(&["num_hidden_layers", "n_layer"])?;
        let hidden = need(&["hidden_size", "n_embd", "d_model"])?;
        let heads = need(&["num_attention_heads", "n_head"])?;
        let kv_heads = get(&["num_key_value_heads"]).unwrap_or(heads);
        let intermediate = get(&["intermediate_size", "n_inner"]).unwrap_or(4 * hidden);
        let vocab = need(&["vocab_size"])?;
        let tied = config
            .get("tie_word_embeddings")
            .and_then(|v| v.as_bool())
            .unwrap_or(false);
        let shape = ModelShape {
            name: name.to_string(),
            layers,
            hidden,
            heads,
            kv_heads,
            intermediate,
            vocab,
            tied_embeddings: tied,
            declared_params: get(&["num_parameters", "n_params"]),
        };
        shape.check()?;
        Ok(shape)
    }

    /// The shape of a `tiny(layers:, hidden:, heads:, kv_heads:, intermediate:, vocab:)` model
    /// with the language's defaults (`kv_heads = heads`, `intermediate = 4 * hidden`) and the
    /// runtime's layout: untied input and output embeddings (`runtime/src/tiny.rs`).
    pub fn tiny(
        layers: u64,
        hidden: u64,
        heads: u64,
        kv_heads: Option<u64>,
        intermediate: Option<u64>,
        vocab: u64,
    ) -> Result<ModelShape, CostError> {
        let shape = ModelShape {
            name: "tiny".into(),
            layers,
            hidden,
            heads,
            kv_heads: kv_heads.unwrap_or(heads),
            intermediate: intermediate.unwrap_or(4 * hidden),
            vocab,
            tied_embeddings: false,
            declared_params: None,
        };
        shape.check()?;
        Ok(shape)
    }

    /// Named presets for simulator studies: LLaMA-7B/13B/33B/65B (Touvron et al. 2023, Table 2;
    /// 33B is the paper's "33B", released as "30B"), and the models of ReaL's evaluation —
    /// LLaMA-2 7B/13B/70B and CodeLlama-34B (their Hugging Face `config.json`; 34B and 70B use
    /// grouped-query attention with 8 key-value heads).
    pub fn preset(name: &str) -> Option<ModelShape> {
        let (canon, layers, hidden, heads, kv_heads, intermediate, params) =
            match name.to_ascii_lowercase().as_str() {
                "llama-7b" => ("llama-7b", 32, 4096, 32, 32, 11008, 6_738_415_616),
                "llama-13b" => ("llama-13b", 40, 5120, 40, 40, 13824, 13_015_864_320),
                "llama-33b" | "llama-30b" => ("llama-33b", 60, 6656, 52, 52, 17920, 32_528_943_616),
                "llama-65b" => ("llama-65b", 80, 8192, 64, 64, 22016, 65_285_660_672),
                "llama-2-7b" => ("llama-2-7b", 32, 4096, 32, 32, 11008, 6_738_415_616),
                "llama-2-13b" => ("llama-2-13b", 40, 5120, 40, 40, 13824, 13_015_864_320),
                "codellama-34b" => ("codellama-34b", 48, 8192, 64, 8, 22016, 33_743_970_304),
                "llama-2-70b" => ("llama-2-70b", 80, 8192, 64, 8, 28672, 68_976_648_192),
                _ => return None,
            };
        Some(ModelShape {
            name: canon.into(),
            layers,
            hidden,
            heads,
            kv_heads,
            intermediate,
            vocab: 32000,
            tied_embeddings: false,
            declared_params: Some(params),
        })
    }

    /// The preset a model directory's name refers to (`checkpoints/Llama-13B` →
    /// `llama-13b`, `qwen2.5-0.5b-instruct` → `qwen2.5-0.5b`), for planning without the files:
    /// the last path component, lower-cased, without a `-instruct`, `-chat` or `-hf` suffix.
    pub fn preset_for_path(dir: &str) -> Option<ModelShape> {
        let last = dir
            .trim_end_matches('/')
            .rsplit('/')
            .next()
            .unwrap_or(dir)
            .to_ascii_lowercase();
        let mut name = last.as_str();
        for suffix in ["-instruct", "-chat", "-hf"] {
            name = name.strip_suffix(suffix).unwrap_or(name);
        }
        if name == "qwen2.5-0.5b" {
            return Some(ModelShape {
                name: "qwen2.5-0.5b".into(),
                layers: 24,
                hidden: 896,
                heads: 14,
                kv_heads: 2,
                intermediate: 4864,
                vocab: 151_936,
                tied_embeddings: true,
                declared_params: None,
            });
        }
        ModelShape::preset(name)
    }

    /// Names accepted by [`ModelShape::preset`].
    pub const PRESETS: [&'static str; 4] = ["llama-7b", "llama-13b", "llama-33b", "llama-65b"];

    fn check(&self) -> Result<(), CostError> {
        let n = &self.name;
        for (what, v) in [
            ("layers", self.layers),
            ("hidden", self.hidden),
            ("heads", self.heads),
            ("kv_heads", self.kv_heads),
            ("intermediate", self.intermediate),
            ("vocab", self.vocab),
        ] {
            if v == 0 {
                return Err(CostError(format!("{n}: `{what}` must be positive")));
            }
        }
        if !self.hidden.is_multiple_of(self.heads) {
            return Err(CostError(format!(
                "{n}: hidden size {} is not a multiple of {} heads",
                self.hidden, self.heads
            )));
        }
        if !self.heads.is_multiple_of(self.kv_heads) {
            return Err(CostError(format!(
                "{n}: {} heads are not a multiple of {} key-value heads",
                self.heads, self.kv_heads
            )));
        }
        Ok(())
    }

    pub fn head_dim(&self) -> u64 {
        self.hidden / self.heads
    }

    /// Parameters of one transformer layer: q and o projections `h²` each, k and v
    /// `h · kv_heads · head_dim` each, a gated MLP `3 · h · intermediate`, two norms.
    pub fn layer_params(&self) -> u64 {
        let h = self.hidden;
        let kv = self.kv_heads * self.head_dim();
        2 * h * h + 2 * h * kv + 3 * h * self.intermediate + 2 * h
    }

    /// Parameters counted from the shape: layers, embeddings, output head (unless tied), final
    /// norm.
    pub fn counted_params(&self) -> u64 {
        let emb = self.vocab * self.hidden;
        let head = if self.tied_embeddings { 0 } else { emb };
        self.layers * self.layer_params() + emb + head + self.hidden
    }

    /// Parameter tensors: per layer the four attention projections, the gated MLP's three and
    /// two norms; the embedding, the final norm and the output head unless tied (biases, as
    /// Qwen's attention has, are not counted).
    pub fn param_tensors(&self) -> u64 {
        self.layers * 9 + 2 + u64::from(!self.tied_embeddings)
    }

    /// The parameter count used for memory: the declared count when there is one.
    pub fn params(&self) -> u64 {
        self.declared_params
            .unwrap_or_else(|| self.counted_params())
    }

    /// Forward FLOPs for one token attending to `context` earlier tokens: `2` per weight of the
    /// layers and the output head (the embedding lookup is free), plus attention's
    /// `QKᵀ` and `AV`, `4 · h · context` per layer (Kaplan et al. 2020, Table 1).
    pub fn forward_flops_per_token(&self, context: u64) -> f64 {
        let matmul = 2.0 * (self.layers * self.layer_params() + self.vocab * self.hidden) as f64;
        let attn = 4.0 * (self.layers * self.hidden * context) as f64;
        matmul + attn
    }

    /// Bytes of KV cache per token: keys and values for every layer and key-value head.
    pub fn kv_bytes_per_token(&self, dtype_bytes: u64) -> u64 {
        2 * self.layers * self.kv_heads * self.head_dim() * dtype_bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama_presets_count_their_published_parameters() {
        for name in ModelShape::PRESETS {
            let m = ModelShape::preset(name).expect("preset");
            let counted = m.counted_params() as f64;
            let declared = m.params() as f64;
            // The shapes reproduce the published counts to within 0.1 %.
            assert!(
                (counted / declared - 1.0).abs() < 1e-3,
                "{name}: {counted} vs {declared}"
            );
        }
        assert!(ModelShape::preset("LLaMA-30B").is_some());
        assert!(ModelShape::preset("gpt-5").is_none());
    }

    #[test]
    fn reads_llama_and_gpt2_style_configs() {
        let llama = serde_json::json!({
            "num_hidden_layers": 24, "hidden_size": 896, "num_attention_heads": 14,
            "num_key_value_heads": 2, "intermediate_size": 4864, "vocab_size": 151936,
            "tie_word_embeddings": true
        });
        let m = ModelShape::from_hf_config("qwen2.5-0.5b", &llama).expect("reads");
        assert_eq!(
            (m.layers, m.hidden, m.kv_heads, m.head_dim()),
            (24, 896, 2, 64)
        );
        // Qwen2.5-0.5B has 494 M parameters; our count omits only the q/k/v biases.
        let p = m.params() as f64;
        assert!((p / 494e6 - 1.0).abs() < 0.01, "{p}");
        let gpt2 =
            serde_json::json!({"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257});
        let g = ModelShape::from_hf_config("gpt2", &gpt2).expect("reads");
        assert_eq!((g.intermediate, g.kv_heads), (3072, 12));
    }

    #[test]
    fn bad_configs_name_the_missing_or_wrong_field() {
        let e = ModelShape::from_hf_config("m", &serde_json::json!({"hidden_size": 8}))
            .expect_err("missing");
        assert!(e.0.contains("num_hidden_layers"), "{e}");
        let e = ModelShape::tiny(2, 130, 4, None, None, BYTE_VOCAB).expect_err("indivisible");
        assert!(e.0.contains("not a multiple of 4 heads"), "{e}");
        let e = ModelShape::tiny(2, 128, 4, Some(3), None, BYTE_VOCAB).expect_err("gqa");
        assert!(e.0.contains("key-value heads"), "{e}");
    }

    #[test]
    fn tiny_model_counts_by_hand() {
        let m = ModelShape::tiny(2, 128, 4, None, None, BYTE_VOCAB).expect("tiny");
        // Per layer: 4·128² attention + 3·128·512 MLP + 2·128 norms; untied input and output
        // embeddings (259·128 each, as the runtime builds tiny models) and a final norm.
        let layer = 4 * 128 * 128 + 3 * 128 * 512 + 256;
        assert_eq!(m.counted_params(), 2 * layer + 2 * 259 * 128 + 128);
        assert_eq!(m.kv_bytes_per_token(2), 2 * 2 * 4 * 32 * 2);
    }
}
