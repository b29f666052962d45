//! Models from GGUF files (llama.cpp's format): the file is memory-mapped, its header,
//! metadata and tensor descriptors are parsed and bounds-checked by the `gguf-rs-lib` crate,
//! and Braid turns them into what a Hugging Face directory would hold — a `config.json`
//! (`config_json`), a `tokenizer.json` with its `tokenizer_config.json` (`tokenizer_files`), and
//! tensors under Hugging Face names, dequantised to f32 (`dequant`) and copied into the model's
//! parameters in its dtype (`copy_into`). A model loaded this way saves as a normal Hugging Face
//! directory.
//!
//! llama.cpp's converter reorders the rows of the query and key projections of Llama-family
//! models (`permute` in `convert_hf_to_gguf.py`) so that its interleaved rotary embedding sees
//! the pairs transformers' half-split rotation uses; `copy_into` undoes it, as transformers'
//! GGUF loader does (`LlamaTensorProcessor`). Qwen2 files are converted without it.
//!
//! Every problem with a file — truncated, corrupt, an unknown architecture or tensor type, a
//! shape that disagrees with the metadata — is an error naming the file; nothing here panics on
//! file contents.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Cursor;
use std::path::{Path, PathBuf};

use gguf_rs_lib::format::metadata::{Metadata, MetadataValue};
use gguf_rs_lib::reader::GGUFFileReader;
use memmap2::Mmap;
use serde_json::{Map, Value, json};
use tch::Tensor;

use crate::error::{Error, Result};
use crate::models::config::ModelConfig;
use crate::models::dequant::{GgmlType, dequantize};

/// Whether `path` names a GGUF file (by its extension or its first four bytes).
pub fn is_gguf(path: &Path) -> bool {
    if path.is_dir() {
        return false;
    }
    if path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
    {
        return true;
    }
    let mut magic = [0u8; 4];
    File::open(path)
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut magic))
        .is_ok_and(|()| &magic == b"GGUF")
}

struct TensorDesc {
    ty: GgmlType,
    /// ggml's dimension order: `dims[0]` is the fastest-varying (a row's length).
    dims: Vec<u64>,
    /// Absolute byte range in the file.
    start: usize,
    len: usize,
}

/// An open GGUF file.
pub struct GgufFile {
    path: PathBuf,
    mmap: Mmap,
    metadata: Metadata,
    tensors: BTreeMap<String, TensorDesc>,
    arch: String,
}

fn tensor_error(path: &Path, e: impl std::fmt::Display) -> Error {
    Error::file(
        path,
        format!("not a valid GGUF file (truncated or corrupt): {e}"),
    )
}

impl GgufFile {
    /// Maps and parses `path`.
    pub fn open(path: &Path) -> Result<GgufFile> {
        let file = File::open(path).map_err(|e| Error::file(path, format!("cannot open: {e}")))?;
        // SAFETY: as in `weights::map_file`: a read-only mapping that lives as long as the
        // `GgufFile`; Braid never writes a model file while loading it.
        #[allow(unsafe_code)]
        let mmap = unsafe { Mmap::map(&file) }
            .map_err(|e| Error::file(path, format!("cannot map: {e}")))?;
        let reader =
            GGUFFileReader::new(Cursor::new(&mmap[..])).map_err(|e| tensor_error(path, e))?;
        let data_start = reader.tensor_data_offset();
        let mut tensors = BTreeMap::new();
        for info in reader.tensor_infos() {
            let id = info.tensor_type() as u32;
            let Some(ty) = GgmlType::from_id(id) else {
                return Err(Error::file(
                    path,
                    format!(
                        "tensor `{}` has type {:?}, which Braid does not read (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K-Q6_K)",
                        info.name(),
                        info.tensor_type()
                    ),
                ));
            };
            let dims = info.shape().dims().to_vec();
            let count = dims
                .iter()
                .try_fold(1usize, |a, &d| a.checked_mul(usize::try_from(d).ok()?))
                .ok_or_else(|| {
                    tensor_error(path, format!("tensor `{}` is too large", info.name()))
                })?;
            let len = ty
                .bytes_for(count)
                .map_err(|e| Error::file(path, format!("tensor `{}`: {e}", info.name())))?;
            // The reader has checked every range against the file's length; the sums are
            // re-checked here so that a slice can never be out of bounds.
            let start = data_start
                .checked_add(info.data_offset())
                .and_then(|s| usize::try_from(s).ok())
                .filter(|s| s.checked_add(len).is_some_and(|end| end <= mmap.len()))
                .ok_or_else(|| {
                    tensor_error(
                        path,
                        format!(
                            "the data of tensor `{}` lies past the end of the file",
                            info.name()
                        ),
                    )
                })?;
            tensors.insert(
                info.name().to_owned(),
                TensorDesc {
                    ty,
                    dims,
                    start,
                    len,
                },
            );
        }
        let metadata = reader.metadata().clone();
        let arch = match metadata.get("general.architecture") {
            Some(MetadataValue::String(s)) => s.clone(),
            Some(v) => {
                return Err(Error::file(
                    path,
                    format!(
                        "metadata `general.architecture` must be a string, found {}",
                        v.value_type()
                    ),
                ));
            }
            None => {
                return Err(Error::file(path, "missing metadata `general.architecture`"));
            }
        };
        Ok(GgufFile {
            path: path.to_path_buf(),
            mmap,
            metadata,
            tensors,
            arch,
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn err(&self, what: impl Into<String>) -> Error {
        Error::file(&self.path, what)
    }

    fn value(&self, key: &str) -> Option<&MetadataValue> {
        self.metadata.get(key)
    }

    fn opt_uint(&self, key: &str) -> Result<Option<i64>> {
        match self.value(key) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .and_then(|u| i64::try_from(u).ok())
                .map(Some)
                .ok_or_else(|| self.err(format!("metadata `{key}` must be an unsigned integer"))),
        }
    }

    fn uint(&self, key: &str) -> Result<i64> {
        self.opt_uint(key)?
            .ok_or_else(|| self.err(format!("missing metadata `{key}`")))
    }

    fn opt_float(&self, key: &str) -> Result<Option<f64>> {
        match self.value(key) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| self.err(format!("metadata `{key}` must be a number"))),
        }
    }

    fn opt_str(&self, key: &str) -> Result<Option<&str>> {
        match self.value(key) {
            None => Ok(None),
            Some(MetadataValue::String(s)) => Ok(Some(s)),
            Some(_) => Err(self.err(format!("metadata `{key}` must be a string"))),
        }
    }

    fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        match self.value(key) {
            None => Ok(None),
            Some(MetadataValue::Bool(b)) => Ok(Some(*b)),
            Some(_) => Err(self.err(format!("metadata `{key}` must be true or false"))),
        }
    }

    fn array(&self, key: &str) -> Result<Option<&[MetadataValue]>> {
        match self.value(key) {
            None => Ok(None),
            Some(MetadataValue::Array(a)) => Ok(Some(&a.values)),
            Some(_) => Err(self.err(format!("metadata `{key}` must be an array"))),
        }
    }

    fn strings(&self, key: &str) -> Result<Option<Vec<&str>>> {
        let Some(items) = self.array(key)? else {
            return Ok(None);
        };
        items
            .iter()
            .map(|v| match v {
                MetadataValue::String(s) => Ok(s.as_str()),
                _ => Err(self.err(format!("metadata `{key}` must be an array of strings"))),
            })
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }

    /// The `config.json` a Hugging Face directory of this model would hold (transformers'
    /// names; what `ModelConfig::from_json` reads and `save_pretrained` writes).
    pub fn config_json(&self) -> Result<Value> {
        let a = self.arch.as_str();
        let model_type = match a {
            "llama" | "qwen2" => a,
            other => {
                return Err(self.err(format!(
                    "architecture `{other}` (general.architecture) is not supported; Braid reads llama and qwen2 GGUF files"
                )));
            }
        };
        let key = |k: &str| format!("{a}.{k}");
        let hidden = self.uint(&key("embedding_length"))?;
        let heads = self.uint(&key("attention.head_count"))?;
        let kv_heads = self
            .opt_uint(&key("attention.head_count_kv"))?
            .unwrap_or(heads);
        let head_dim = match self.opt_uint(&key("attention.key_length"))? {
            Some(d) => d,
            None if heads > 0 => hidden / heads,
            None => 0,
        };
        if let Some(rope_dim) = self.opt_uint(&key("rope.dimension_count"))?
            && rope_dim != head_dim
        {
            return Err(self.err(format!(
                "rotary embedding over {rope_dim} of {head_dim} head dimensions (`{a}.rope.dimension_count`): partial rotary embeddings are not supported"
            )));
        }
        let tokens = self.array("tokenizer.ggml.tokens")?.map(<[_]>::len);
        let vocab = match (self.opt_uint(&key("vocab_size"))?, tokens) {
            (Some(v), _) => v,
            (None, Some(n)) => i64::try_from(n).unwrap_or(i64::MAX),
            (None, None) => match self.tensors.get("token_embd.weight") {
                Some(t) if t.dims.len() == 2 => i64::try_from(t.dims[1]).unwrap_or(i64::MAX),
                _ => return Err(self.err(format!("missing metadata `{a}.vocab_size`"))),
            },
        };
        let mut m = Map::new();
        m.insert("model_type".into(), json!(model_type));
        m.insert("vocab_size".into(), json!(vocab));
        m.insert("hidden_size".into(), json!(hidden));
        m.insert(
            "intermediate_size".into(),
            json!(self.uint(&key("feed_forward_length"))?),
        );
        m.insert(
            "num_hidden_layers".into(),
            json!(self.uint(&key("block_count"))?),
        );
        m.insert("num_attention_heads".into(), json!(heads));
        m.insert("num_key_value_heads".into(), json!(kv_heads));
        m.insert("head_dim".into(), json!(head_dim));
        m.insert("hidden_act".into(), json!("silu"));
        if let Some(n) = self.opt_uint(&key("context_length"))? {
            m.insert("max_position_embeddings".into(), json!(n));
        }
        if let Some(eps) = self.opt_float(&key("attention.layer_norm_rms_epsilon"))? {
            // Stored as f32; the f64 of that f32 (9.999999747e-6) is what transformers reads too.
            m.insert("rms_norm_eps".into(), json!(eps));
        }
        let theta = self.opt_float(&key("rope.freq_base"))?.unwrap_or(10000.0);
        m.insert("rope_theta".into(), json!(theta));
        match self.opt_str(&key("rope.scaling.type"))? {
            None | Some("none") => {}
            Some("linear") => {
                let factor = self
                    .opt_float(&key("rope.scaling.factor"))?
                    .ok_or_else(|| {
                        self.err(format!("missing metadata `{a}.rope.scaling.factor`"))
                    })?;
                m.insert(
                    "rope_scaling".into(),
                    json!({"rope_type": "linear", "factor": factor}),
                );
            }
            Some(other) => {
                return Err(self.err(format!(
                    "rope scaling `{other}` (`{a}.rope.scaling.type`) is not supported (none, linear)"
                )));
            }
        }
        m.insert(
            "tie_word_embeddings".into(),
            json!(!self.tensors.contains_key("output.weight")),
        );
        for (hf, gguf) in [
            ("bos_token_id", "tokenizer.ggml.bos_token_id"),
            ("eos_token_id", "tokenizer.ggml.eos_token_id"),
            ("pad_token_id", "tokenizer.ggml.padding_token_id"),
        ] {
            if let Some(id) = self.opt_uint(gguf)? {
                m.insert(hf.into(), json!(id));
            }
        }
        Ok(Value::Object(m))
    }

    /// The model configuration, read from the metadata.
    pub fn config(&self) -> Result<ModelConfig> {
        ModelConfig::from_json(&self.path, self.config_json()?)
    }

    /// `tokenizer.json` and `tokenizer_config.json` of the file's tokenizer: a byte-level BPE
    /// (`tokenizer.ggml.model = gpt2`) built as transformers' GGUF converter builds it (GPT-2's
    /// pre-tokenizer, every control token an added special token), so both tokenize alike.
    pub fn tokenizer_files(&self) -> Result<(Value, Value)> {
        let model = self.opt_str("tokenizer.ggml.model")?.unwrap_or("");
        if model != "gpt2" {
            return Err(self.err(format!(
                "tokenizer `{model}` (tokenizer.ggml.model) is not supported; Braid reads byte-level BPE (gpt2) tokenizers from GGUF files"
            )));
        }
        let tokens = self
            .strings("tokenizer.ggml.tokens")?
            .ok_or_else(|| self.err("missing metadata `tokenizer.ggml.tokens`"))?;
        let merges = self.strings("tokenizer.ggml.merges")?.unwrap_or_default();
        let types: Vec<i64> = match self.array("tokenizer.ggml.token_type")? {
            None => Vec::new(),
            Some(items) => items
                .iter()
                .map(|v| {
                    v.as_i64().ok_or_else(|| {
                        self.err("metadata `tokenizer.ggml.token_type` must hold integers")
                    })
                })
                .collect::<Result<_>>()?,
        };
        if !types.is_empty() && types.len() != tokens.len() {
            return Err(self.err(format!(
                "{} token types for {} tokens (tokenizer.ggml.token_type)",
                types.len(),
                tokens.len()
            )));
        }
        let mut vocab = Map::new();
        let mut added = Vec::new();
        for (id, tok) in tokens.iter().enumerate() {
            if vocab.insert((*tok).to_owned(), json!(id)).is_some() {
                return Err(self.err(format!(
                    "token `{tok}` appears twice in tokenizer.ggml.tokens"
                )));
            }
            // llama.cpp's token types: 3 = control, 4 = user-defined; both are whole tokens
            // that the text never splits (transformers marks control tokens special).
            match types.get(id) {
                Some(3) | Some(4) => added.push(json!({
                    "id": id, "content": tok, "single_word": false, "lstrip": false,
                    "rstrip": false, "normalized": false, "special": types[id] == 3,
                })),
                _ => {}
            }
        }
        let token_at = |key: &str| -> Result<Option<String>> {
            match self.opt_uint(key)? {
                None => Ok(None),
                Some(id) => usize::try_from(id)
                    .ok()
                    .and_then(|i| tokens.get(i))
                    .map(|t| Some((*t).to_owned()))
                    .ok_or_else(|| {
                        self.err(format!(
                            "metadata `{key}` is {id}, past the vocabulary of {}",
                            tokens.len()
                        ))
                    }),
            }
        };
        let bos = token_at("tokenizer.ggml.bos_token_id")?;
        let eos = token_at("tokenizer.ggml.eos_token_id")?;
        let pad = token_at("tokenizer.ggml.padding_token_id")?;
        let unk = token_at("tokenizer.ggml.unknown_token_id")?;
        let add_bos = self
            .opt_bool("tokenizer.ggml.add_bos_token")?
            .unwrap_or(false);
        let seq = |id: &str, type_id: u32| json!({"Sequence": {"id": id, "type_id": type_id}});
        let (single, pair, special) = match (&bos, add_bos) {
            (Some(b), true) => {
                let id = self.uint("tokenizer.ggml.bos_token_id")?;
                let tok = json!({"SpecialToken": {"id": b, "type_id": 0}});
                (
                    vec![tok.clone(), seq("A", 0)],
                    vec![tok, seq("A", 0), seq("B", 1)],
                    json!({ b.as_str(): {"id": b, "ids": [id], "tokens": [b]} }),
                )
            }
            _ => (vec![seq("A", 0)], vec![seq("A", 0), seq("B", 1)], json!({})),
        };
        let tokenizer = json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": added,
            "normalizer": null,
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
            "post_processor": {"type": "TemplateProcessing", "single": single, "pair": pair, "special_tokens": special},
            "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
            "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                      "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                      "vocab": vocab, "merges": merges},
        });
        let mut config = Map::new();
        config.insert("tokenizer_class".into(), json!("PreTrainedTokenizerFast"));
        config.insert("add_bos_token".into(), json!(add_bos));
        for (k, v) in [
            ("bos_token", bos),
            ("eos_token", eos),
            ("pad_token", pad),
            ("unk_token", unk),
        ] {
            if let Some(v) = v {
                config.insert(k.into(), json!(v));
            }
        }
        if let Some(t) = self.opt_str("tokenizer.chat_template")? {
            config.insert("chat_template".into(), json!(t));
        }
        config.insert(
            "model_max_length".into(),
            json!(self.opt_uint(&format!("{}.context_length", self.arch))?),
        );
        Ok((tokenizer, Value::Object(config)))
    }

    /// The GGUF name of a Hugging Face parameter name, and whether its rows were permuted for
    /// llama.cpp's rotary embedding (`Some(heads)`: undo with that many heads).
    fn gguf_name(&self, hf: &str, config: &ModelConfig) -> Option<(String, Option<i64>)> {
        let llama_rope = self.arch == "llama";
        let name = match hf {
            "model.embed_tokens.weight" => return Some(("token_embd.weight".into(), None)),
            "model.norm.weight" => return Some(("output_norm.weight".into(), None)),
            "lm_head.weight" => return Some(("output.weight".into(), None)),
            other => other,
        };
        let rest = name.strip_prefix("model.layers.")?;
        let (layer, rest) = rest.split_once('.')?;
        let (module, suffix) = rest.rsplit_once('.')?;
        let (part, permute) = match module {
            "input_layernorm" => ("attn_norm", None),
            "post_attention_layernorm" => ("ffn_norm", None),
            "self_attn.q_proj" => ("attn_q", Some(config.num_heads)),
            "self_attn.k_proj" => ("attn_k", Some(config.num_kv_heads)),
            "self_attn.v_proj" => ("attn_v", None),
            "self_attn.o_proj" => ("attn_output", None),
            "mlp.gate_proj" => ("ffn_gate", None),
            "mlp.up_proj" => ("ffn_up", None),
            "mlp.down_proj" => ("ffn_down", None),
            _ => return None,
        };
        Some((
            format!("blk.{layer}.{part}.{suffix}"),
            permute.filter(|_| llama_rope),
        ))
    }

    /// Whether the file holds the tensor that Hugging Face calls `hf`.
    pub(crate) fn contains(&self, hf: &str, config: &ModelConfig) -> bool {
        self.gguf_name(hf, config)
            .is_some_and(|(n, _)| self.tensors.contains_key(&n))
    }

    /// The names of the file's tensors, in order.
    pub fn tensor_names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    /// The tensor `name` (a GGUF name) dequantised to f32, with its shape in torch's order.
    pub fn tensor_f32(&self, name: &str) -> Result<(Vec<i64>, Vec<f32>)> {
        let desc = self
            .tensors
            .get(name)
            .ok_or_else(|| self.err(format!("missing tensor `{name}`")))?;
        let shape = desc
            .dims
            .iter()
            .rev()
            .map(|&d| i64::try_from(d).unwrap_or(i64::MAX))
            .collect();
        let (per_block, block_bytes) = desc.ty.block();
        let bytes = &self.mmap[desc.start..desc.start + desc.len];
        let values = dequantize(desc.ty, bytes, desc.len / block_bytes * per_block)
            .map_err(|e| self.err(format!("tensor `{name}`: {e}")))?;
        Ok((shape, values))
    }

    /// Dequantises the tensor that Hugging Face calls `hf` and copies it into `dst`
    /// (converting to its dtype and device), after checking the shape.
    pub(crate) fn copy_into(&self, hf: &str, config: &ModelConfig, dst: &mut Tensor) -> Result<()> {
        let (name, permute) = self
            .gguf_name(hf, config)
            .ok_or_else(|| self.err(format!("no GGUF tensor corresponds to `{hf}`")))?;
        if !self.tensors.contains_key(&name) {
            return Err(self.err(format!("missing tensor `{name}` (for `{hf}`)")));
        }
        // ggml lists dimensions fastest first; torch lists them slowest first.
        let (shape, values) = self.tensor_f32(&name)?;
        if shape != dst.size() {
            return Err(self.err(format!(
                "tensor `{name}` has shape {shape:?}, the metadata implies {:?}",
                dst.size()
            )));
        }
        let mut src = Tensor::f_from_slice(&values)?.f_reshape(&shape)?;
        if let Some(heads) = permute {
            src = unpermute_rows(&src, heads)
                .map_err(|e| self.err(format!("tensor `{name}`: {e}")))?;
        }
        tch::no_grad(|| dst.f_copy_(&src))?;
        Ok(())
    }
}

/// Undoes llama.cpp's `permute(w, heads)`: within each head, GGUF row `2i + j` is Hugging Face
/// row `j·(d/2) + i` (d rows per head), for weights `[rows, in]` and biases `[rows]`.
fn unpermute_rows(w: &Tensor, heads: i64) -> std::result::Result<Tensor, String> {
    let size = w.size();
    let rows = size.first().copied().unwrap_or(0);
    if heads <= 0 || rows % (2 * heads) != 0 {
        return Err(format!(
            "{rows} rows do not split into {heads} rotary heads"
        ));
    }
    let half = rows / heads / 2;
    let mut split = vec![heads, half, 2];
    split.extend_from_slice(&size[1..]);
    Ok(w.reshape(&split)
        .transpose(1, 2)
        .reshape(&size)
        .contiguous())
}
