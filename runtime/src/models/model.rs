//! Transformer models on libtorch: the Llama family (Llama 2/3, Mistral, Qwen2) and GPT-2,
//! with a language-model, value or score head.
//!
//! Parameters live in a `tch::nn::VarStore` under exactly the Hugging Face tensor names
//! (`model.layers.0.self_attn.q_proj.weight`, `transformer.h.0.attn.c_attn.weight`, ...), so a
//! checkpoint loads and saves by name with no mapping table. Two forwards exist: `forward`
//! (whole padded sequences, with autograd, for inference and later training) and
//! `forward_cached` (appends tokens to a `KvCache`, always under `no_grad`, for generation).
//! Both compute attention through the same function, so they agree (test
//! `engine::tests::greedy_with_cache_equals_full_recompute`). This module must not sample,
//! tokenize or read anything but weights.

use std::path::{Path, PathBuf};

use tch::nn::VarStore;
use tch::{Device, Kind, Tensor};

use crate::error::{Error, Result};
use crate::generation::spec::CostModel;
use crate::kernels::attention::{MAX_QUERIES, decode_attention};
use crate::kernels::gemm;
use crate::kernels::step;
use crate::models::cache::KvCache;
use crate::models::config::{Activation, Arch, ModelConfig, RopeScaling};
use crate::models::gguf::{GgufFile, is_gguf};
use crate::models::parallel::{Cut, Shard};
use crate::models::weights::WeightFiles;
use crate::rng::Rng;

/// What a model computes on top of its final hidden states: the plan's own enum (see
/// `braid_ir::settings::Head`), so that a plan's head reaches the model unchanged.
pub use braid_ir::settings::Head;

/// The libtorch element type of a plan's dtype.
pub fn kind_of(d: braid_ir::settings::Dtype) -> Kind {
    match d {
        braid_ir::settings::Dtype::F32 => Kind::Float,
        braid_ir::settings::Dtype::Bf16 => Kind::BFloat16,
        braid_ir::settings::Dtype::F16 => Kind::Half,
    }
}

/// How to load a model.
#[derive(Debug, Clone, Copy)]
pub struct LoadOptions {
    pub head: Head,
    /// Parameter dtype; `None` means f32 on the CPU and the checkpoint's dtype (or bf16) on GPUs.
    pub dtype: Option<Kind>,
    pub device: Device,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            head: Head::Lm,
            dtype: None,
            device: Device::Cpu,
        }
    }
}

/// Standard deviation of a new value or score head: small, so that a fresh critic starts near
/// zero and does not dominate early losses.
const NEW_HEAD_STD: f64 = 1e-3;

#[derive(Clone, Copy)]
enum Init {
    Normal(f64),
    Zeros,
    Ones,
}

struct Linear {
    weight: Tensor,
    bias: Option<Tensor>,
}

impl Linear {
    fn forward(&self, x: &Tensor) -> Tensor {
        x.linear(&self.weight, self.bias.as_ref())
    }

    /// The product in a cached step (under `no_grad`): Braid's kernel for the thin blocks of
    /// rows decode and verification steps make on the CPU (`gemm.rs`), libtorch otherwise.
    fn forward_step(&self, x: &Tensor) -> Tensor {
        gemm::linear(x, &self.weight, self.bias.as_ref()).unwrap_or_else(|| self.forward(x))
    }
}

/// GPT-2's Conv1D: weight stored as `[in, out]`.
struct Conv1D {
    weight: Tensor,
    bias: Tensor,
}

impl Conv1D {
    fn forward(&self, x: &Tensor) -> Tensor {
        x.matmul(&self.weight) + &self.bias
    }
}

struct LlamaLayer {
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    gate: Linear,
    up: Linear,
    down: Linear,
    input_norm: Tensor,
    post_norm: Tensor,
    window: Option<i64>,
}

struct Gpt2Layer {
    ln1: (Tensor, Tensor),
    c_attn: Conv1D,
    attn_proj: Conv1D,
    ln2: (Tensor, Tensor),
    fc: Conv1D,
    mlp_proj: Conv1D,
}

enum Body {
    Llama {
        embed: Tensor,
        layers: Vec<LlamaLayer>,
        norm: Tensor,
        inv_freq: Tensor,
    },
    Gpt2 {
        wte: Tensor,
        wpe: Tensor,
        layers: Vec<Gpt2Layer>,
        ln_f: (Tensor, Tensor),
    },
}

/// A transformer with one head, its parameters in a `VarStore`.
pub struct Model {
    vs: VarStore,
    config: ModelConfig,
    head: Head,
    body: Body,
    lm_head: Option<Tensor>,
    score: Option<Tensor>,
    kind: Kind,
    device: Device,
    /// Where the weights came from (for error messages); `tiny` for generated models.
    source: PathBuf,
    /// Measured seconds of a decode step by tokens processed, kept across generation requests
    /// so that speculative decoding's policy does not re-learn them every call (an RLHF run
    /// generates with the same model every iteration).
    step_costs: std::sync::Mutex<CostModel>,
    /// Cached steps use libtorch operations only, none of Braid's CPU kernels.
    libtorch_steps: std::sync::atomic::AtomicBool,
    /// Whole-sequence passes and prefills attend through libtorch's fused causal attention
    /// where the batch allows it (`Attention::Causal`): on by default on CUDA, where it is
    /// flash attention; off on the CPU, where the masked path is the one `forward_cached`'s
    /// host kernels are checked against.
    fused_attention: std::sync::atomic::AtomicBool,
    /// Tensor parallelism: this rank's slices and its group (`models::parallel`); `None` on
    /// one process or when the layout's `tp` is 1.
    shard: Option<Shard>,
    /// Pipeline parallelism: the stage this model keeps the parameters of, of how many
    /// (`Model::retain_stage`); `None` when it holds every layer.
    stage: Option<(usize, usize)>,
    /// The shapes of the parameters `release` freed, until `materialize` allocates them again.
    released: Option<Vec<(String, Vec<i64>)>>,
}

/// Collects parameters while the model is built, so that they can be filled afterwards.
struct Builder {
    vs: VarStore,
    kind: Kind,
    params: Vec<(String, Tensor, Init)>,
}

impl Builder {
    fn param(&mut self, name: &str, dims: &[i64], init: Init) -> Result<Tensor> {
        let (prefix, last) = match name.rsplit_once('.') {
            Some((p, l)) => (p, l),
            None => ("", name),
        };
        let mut path = self.vs.root();
        for part in prefix.split('.').filter(|p| !p.is_empty()) {
            path = path.sub(part);
        }
        let t = Tensor::f_empty(dims, (self.kind, self.vs.device()))?;
        let t = path.add(last, t, true);
        self.params.push((name.to_owned(), t.shallow_clone(), init));
        Ok(t)
    }

    fn linear(&mut self, name: &str, out: i64, inp: i64, bias: bool) -> Result<Linear> {
        let weight = self.param(&format!("{name}.weight"), &[out, inp], Init::Normal(0.02))?;
        let bias = if bias {
            Some(self.param(&format!("{name}.bias"), &[out], Init::Zeros)?)
        } else {
            None
        };
        Ok(Linear { weight, bias })
    }

    fn conv1d(&mut self, name: &str, inp: i64, out: i64) -> Result<Conv1D> {
        Ok(Conv1D {
            weight: self.param(&format!("{name}.weight"), &[inp, out], Init::Normal(0.02))?,
            bias: self.param(&format!("{name}.bias"), &[out], Init::Zeros)?,
        })
    }

    fn layer_norm(&mut self, name: &str, dim: i64) -> Result<(Tensor, Tensor)> {
        Ok((
            self.param(&format!("{name}.weight"), &[dim], Init::Ones)?,
            self.param(&format!("{name}.bias"), &[dim], Init::Zeros)?,
        ))
    }
}

/// Where the parameters come from.
pub(crate) enum Weights<'a> {
    /// A checkpoint.
    Files(&'a WeightFiles),
    /// A GGUF file (dequantised tensor by tensor).
    Gguf(&'a GgufFile),
    /// Random initialisation from a seed (tiny models, new heads).
    Random(u64),
}

fn inv_freq(config: &ModelConfig, device: Device) -> Tensor {
    let dim = config.head_dim;
    let exponents = Tensor::arange_start_step(0, dim, 2, (Kind::Int64, device))
        .to_kind(Kind::Float)
        / dim as f64;
    let base = Tensor::full([1], config.rope_theta, (Kind::Float, device));
    let inv = base.pow(&exponents).reciprocal();
    match config.rope_scaling {
        RopeScaling::None => inv,
        RopeScaling::Linear { factor } => inv / factor,
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        } => {
            // transformers' `_compute_llama3_parameters`, in f32 like the reference.
            let low_wavelen = original_max_position_embeddings / low_freq_factor;
            let high_wavelen = original_max_position_embeddings / high_freq_factor;
            let wavelen = inv.reciprocal() * (2.0 * std::f64::consts::PI);
            let scaled = inv.where_self(&wavelen.le(low_wavelen), &(&inv / factor));
            let smooth = (wavelen.reciprocal() * original_max_position_embeddings
                - low_freq_factor)
                / (high_freq_factor - low_freq_factor);
            let smoothed = (smooth.ones_like() - &smooth) * &scaled / factor + &smooth * &scaled;
            let medium = wavelen
                .ge(high_wavelen)
                .logical_and(&wavelen.le(low_wavelen));
            smoothed.where_self(&medium, &scaled)
        }
    }
}

/// Rotary embedding of `x` `[B, H, T, D]` given `cos` and `sin_signed` `[B, 1, T, D]` from
/// `Model::rope`. transformers computes `x * cos + rotate_half(x) * sin` with
/// `rotate_half(x) = [-x2, x1]`; rolling `x` by half gives `[x2, x1]`, and the sign lives in
/// `sin_signed = [-sin, sin]`, which is bit-identical and costs two kernels fewer per call.
fn apply_rope(x: &Tensor, cos: &Tensor, sin_signed: &Tensor) -> Tensor {
    let half = x.size()[3] / 2;
    x * cos + x.roll([half], [3]) * sin_signed
}

fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Tensor {
    let kind = x.kind();
    if kind == Kind::Float {
        // In f32 libtorch's fused kernel computes the same thing in one pass.
        return x.rms_norm([weight.size()[0]], Some(weight), eps);
    }
    // As in transformers: normalise in f32, cast back, then scale.
    let h = x.to_kind(Kind::Float);
    let var = h.pow_tensor_scalar(2).mean_dim(-1, true, Kind::Float);
    let h = h * (var + eps).rsqrt();
    weight * h.to_kind(kind)
}

/// Scaled dot-product attention with grouped-query heads and a boolean mask (`true` = attend).
/// q: `[B, H, T, D]`, k and v: `[B, Hkv, L, D]`, mask: `[B, 1, T, L]`. Returns `[B, T, H*D]`.
/// Grouped heads are handled by folding the `H / Hkv` query heads of a group into the query
/// axis, so keys and values are never copied.
fn attend(q: &Tensor, k: &Tensor, v: &Tensor, mask: &Tensor) -> Tensor {
    attend_with(q, k, v, Attention::Mask(mask))
}

/// How a whole-sequence or prefill pass masks attention.
#[derive(Clone, Copy)]
enum Attention<'a> {
    /// An explicit boolean mask `[B, 1, T, L]` (`true` = attend): padding on either side,
    /// sliding windows, cached rows of different lengths.
    Mask(&'a Tensor),
    /// Plain causal attention over `T` queries and the same `T` keys, without a mask tensor,
    /// so that libtorch can pick its fused kernels (flash attention on CUDA, which refuses an
    /// explicit mask). Only right-padded batches without sliding windows: a real token then
    /// sees exactly the real tokens before it, and what pad positions compute is ignored.
    Causal,
}

/// [`attend`] with either kind of masking. Grouped heads: folded into the query axis under a
/// mask (keys and values are never copied); with `Causal` the fold would break the causal
/// order, so libtorch's grouped-query attention (`enable_gqa`) handles them.
fn attend_with(q: &Tensor, k: &Tensor, v: &Tensor, how: Attention<'_>) -> Tensor {
    let (b, h, t, d) = q.size4().unwrap_or((0, 0, 0, 0));
    let Attention::Mask(mask) = how else {
        let gqa = k.size()[1] != h;
        let o = Tensor::scaled_dot_product_attention(
            q,
            k,
            v,
            None::<&Tensor>,
            0.0,
            true,
            None::<f64>,
            gqa,
        );
        return o.transpose(1, 2).reshape([b, t, h * d]);
    };
    let hkv = k.size()[1];
    let rep = h / hkv;
    let (q, mask) = if rep > 1 {
        (q.reshape([b, hkv, rep * t, d]), mask.repeat([1, 1, rep, 1]))
    } else {
        (q.shallow_clone(), mask.shallow_clone())
    };
    let o =
        Tensor::scaled_dot_product_attention(&q, k, v, Some(&mask), 0.0, false, None::<f64>, false);
    o.reshape([b, h, t, d])
        .transpose(1, 2)
        .reshape([b, t, h * d])
}

/// Boolean attention mask `[B, 1, T, L]` for queries at positions `q_pos` `[B, T]` over keys at
/// positions `k_pos` `[B, L]` with validity `k_valid` `[B, L]`: causal, windowed if asked, and a
/// query always sees its own key (`self_index`), so no row is empty (an empty row would make
/// softmax produce NaN even for pad queries, whose outputs are ignored but reach gradients).
fn build_mask(
    q_pos: &Tensor,
    k_pos: &Tensor,
    k_valid: &Tensor,
    window: Option<i64>,
    self_key: Option<&Tensor>,
) -> Tensor {
    let qp = q_pos.unsqueeze(2); // [B, T, 1]
    let kp = k_pos.unsqueeze(1); // [B, 1, L]
    let mut m = kp.le_tensor(&qp).logical_and(&k_valid.unsqueeze(1));
    if let Some(w) = window {
        m = m.logical_and(&(&qp - &kp).lt(w));
    }
    if let Some(s) = self_key {
        m = m.logical_or(s);
    }
    m.unsqueeze(1)
}

/// What every layer of a whole-sequence forward needs (see `Model::sequences`).
struct Sequences {
    ids: Tensor,
    /// Position of every token `[B, T]` (counting real tokens).
    pos: Tensor,
    /// Real tokens `[B, T]`.
    valid: Tensor,
    /// Each query's own key (so no mask row is empty).
    eye: Tensor,
    /// The mask of layers without a sliding window.
    full: Tensor,
    /// Llama's rotary tables for `pos`.
    rope: Option<(Tensor, Tensor)>,
    /// Layers without a window attend through libtorch's fused causal attention (see
    /// `Attention::Causal`): the batch is right-padded and the fused path is on.
    fused: bool,
}

/// What [`Model::backward_checkpointed`] needs from a checkpointed forward: each layer's
/// input (detached), the embedding's output with its graph, and the last layer's output as a
/// leaf that the loss's gradient reaches.
pub struct Checkpoint {
    sequences: Sequences,
    embedded: Tensor,
    inputs: Vec<Tensor>,
    top: Tensor,
}

/// A sum of `upstream`'s dtype at least f32, for the scalar that checkpointed backward passes
/// differentiate (its value is never used, only its gradient, which is `upstream` exactly).
fn out_kind(upstream: &Tensor) -> Kind {
    match upstream.kind() {
        Kind::Double => Kind::Double,
        _ => Kind::Float,
    }
}

impl Model {
    /// Loads a Hugging Face model directory (`config.json` and safetensors weights) or a GGUF
    /// file (configuration from its metadata, tensors dequantised; see `models::gguf`).
    pub fn load(dir: &Path, options: &LoadOptions) -> Result<Model> {
        if is_gguf(dir) {
            let file = GgufFile::open(dir)?;
            let config = file.config()?;
            let kind = options.dtype.unwrap_or(match options.device {
                Device::Cpu => Kind::Float,
                _ => Kind::BFloat16,
            });
            return Model::build(
                config,
                options.head,
                kind,
                options.device,
                Weights::Gguf(&file),
                dir.to_path_buf(),
            );
        }
        if !dir.is_dir() {
            return Err(Error::file(
                dir,
                "not a model directory (expected config.json and model.safetensors)",
            ));
        }
        let config = ModelConfig::from_file(&dir.join("config.json"))?;
        let weights = WeightFiles::open(dir)?;
        let kind = match options.dtype {
            Some(k) => k,
            None if options.device == Device::Cpu => Kind::Float,
            None => match config.declared_dtype.as_deref() {
                Some("float16") => Kind::Half,
                Some("float32") => Kind::Float,
                _ => Kind::BFloat16,
            },
        };
        Model::build(
            config,
            options.head,
            kind,
            options.device,
            Weights::Files(&weights),
            dir.to_path_buf(),
        )
    }

    /// A model of any supported configuration, in f32, with weights from Braid's seeded
    /// generator (as `tiny` models have): for tests and tools that need a model of a given
    /// shape or vocabulary without a checkpoint. `source` names it in messages.
    pub fn random(
        config: ModelConfig,
        head: Head,
        seed: u64,
        device: Device,
        source: PathBuf,
    ) -> Result<Model> {
        Model::build(
            config,
            head,
            Kind::Float,
            device,
            Weights::Random(seed),
            source,
        )
    }

    /// Builds a model from a configuration with parameters filled from `weights`.
    pub(crate) fn build(
        config: ModelConfig,
        head: Head,
        kind: Kind,
        device: Device,
        weights: Weights<'_>,
        source: PathBuf,
    ) -> Result<Model> {
        if !matches!(
            kind,
            Kind::Float | Kind::BFloat16 | Kind::Half | Kind::Double
        ) {
            return Err(Error::invalid(
                "dtype",
                format!("{kind:?} is not a floating-point dtype"),
            ));
        }
        let vs = VarStore::new(device);
        let mut b = Builder {
            vs,
            kind,
            params: Vec::new(),
        };
        let c = &config;
        let (h, v) = (c.hidden_size, c.vocab_size);
        let body = match c.arch {
            Arch::Llama => {
                let embed = b.param("model.embed_tokens.weight", &[v, h], Init::Normal(0.02))?;
                let mut layers = Vec::new();
                for i in 0..c.num_layers {
                    let p = format!("model.layers.{i}");
                    let (qd, kvd) = (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim);
                    layers.push(LlamaLayer {
                        q: b.linear(&format!("{p}.self_attn.q_proj"), qd, h, c.qkv_bias)?,
                        k: b.linear(&format!("{p}.self_attn.k_proj"), kvd, h, c.qkv_bias)?,
                        v: b.linear(&format!("{p}.self_attn.v_proj"), kvd, h, c.qkv_bias)?,
                        o: b.linear(&format!("{p}.self_attn.o_proj"), h, qd, c.o_bias)?,
                        gate: b.linear(
                            &format!("{p}.mlp.gate_proj"),
                            c.intermediate_size,
                            h,
                            c.mlp_bias,
                        )?,
                        up: b.linear(
                            &format!("{p}.mlp.up_proj"),
                            c.intermediate_size,
                            h,
                            c.mlp_bias,
                        )?,
                        down: b.linear(
                            &format!("{p}.mlp.down_proj"),
                            h,
                            c.intermediate_size,
                            c.mlp_bias,
                        )?,
                        input_norm: b.param(
                            &format!("{p}.input_layernorm.weight"),
                            &[h],
                            Init::Ones,
                        )?,
                        post_norm: b.param(
                            &format!("{p}.post_attention_layernorm.weight"),
                            &[h],
                            Init::Ones,
                        )?,
                        window: c.layer_windows.get(i as usize).copied().flatten(),
                    });
                }
                let norm = b.param("model.norm.weight", &[h], Init::Ones)?;
                Body::Llama {
                    embed,
                    layers,
                    norm,
                    inv_freq: inv_freq(c, device),
                }
            }
            Arch::Gpt2 => {
                let wte = b.param("transformer.wte.weight", &[v, h], Init::Normal(0.02))?;
                let wpe = b.param(
                    "transformer.wpe.weight",
                    &[c.max_position_embeddings, h],
                    Init::Normal(0.01),
                )?;
                let mut layers = Vec::new();
                for i in 0..c.num_layers {
                    let p = format!("transformer.h.{i}");
                    layers.push(Gpt2Layer {
                        ln1: b.layer_norm(&format!("{p}.ln_1"), h)?,
                        c_attn: b.conv1d(&format!("{p}.attn.c_attn"), h, 3 * h)?,
                        attn_proj: b.conv1d(&format!("{p}.attn.c_proj"), h, h)?,
                        ln2: b.layer_norm(&format!("{p}.ln_2"), h)?,
                        fc: b.conv1d(&format!("{p}.mlp.c_fc"), h, c.intermediate_size)?,
                        mlp_proj: b.conv1d(&format!("{p}.mlp.c_proj"), c.intermediate_size, h)?,
                    });
                }
                let ln_f = b.layer_norm("transformer.ln_f", h)?;
                Body::Gpt2 {
                    wte,
                    wpe,
                    layers,
                    ln_f,
                }
            }
        };
        let embedding = match &body {
            Body::Llama { embed, .. } => embed.shallow_clone(),
            Body::Gpt2 { wte, .. } => wte.shallow_clone(),
        };
        let (lm_head, score) = match head {
            Head::Lm if c.tie_word_embeddings => (Some(embedding), None),
            Head::Lm => (
                Some(b.param("lm_head.weight", &[v, h], Init::Normal(0.02))?),
                None,
            ),
            Head::Value => (
                None,
                Some(b.param("score.weight", &[1, h], Init::Normal(NEW_HEAD_STD))?),
            ),
            Head::Score => (
                None,
                Some(b.param(
                    "score.weight",
                    &[c.num_labels.max(1), h],
                    Init::Normal(NEW_HEAD_STD),
                )?),
            ),
        };
        let params = std::mem::take(&mut b.params);
        fill(&params, &weights, c)?;
        Ok(Model {
            vs: b.vs,
            config,
            head,
            body,
            lm_head,
            score,
            kind,
            device,
            source,
            step_costs: std::sync::Mutex::new(CostModel::default()),
            libtorch_steps: std::sync::atomic::AtomicBool::new(false),
            fused_attention: std::sync::atomic::AtomicBool::new(device.is_cuda()),
            shard: None,
            stage: None,
            released: None,
        })
    }

    /// Cuts this model for tensor parallelism over `comm` (`models::parallel` says how): every
    /// rank of the group calls it on the same model and keeps its slices. A group of one rank
    /// leaves the model as it is. Refuses a model already cut, or one whose heads or
    /// feed-forward width the group does not divide.
    pub fn shard(mut self, comm: std::sync::Arc<crate::dist::TensorParallel>) -> Result<Model> {
        if self.shard.is_some() {
            return Err(Error::invalid(
                "tensor parallelism",
                format!("{} is already tensor-parallel", self.source.display()),
            ));
        }
        if comm.size() == 1 {
            return Ok(self);
        }
        let shard = Shard::new(&self.config, comm, self.device)?;
        let arch = self.config.arch;
        tch::no_grad(|| -> Result<()> {
            // A pipeline stage cuts only what it holds (`retain_stage` emptied the rest).
            for (name, var) in self.held_parameters() {
                let cut = shard.cut(&name, arch);
                if cut == Cut::Whole {
                    continue;
                }
                let local = shard.slice(&var, cut)?;
                let mut v = var.shallow_clone();
                v.set_data(&local);
            }
            Ok(())
        })?;
        self.shard = Some(shard);
        Ok(self)
    }

    /// The layers pipeline stage `stage` of `stages` runs: `stage·L/stages ..
    /// (stage+1)·L/stages`, as the planner splits them (`braid_ir::transfer`).
    pub fn stage_layers(&self, stage: usize, stages: usize) -> Result<std::ops::Range<usize>> {
        stage_range(self.num_layers(), stage, stages)
    }
}

/// The layers pipeline stage `stage` of `stages` runs of a model with `layers` layers (see
/// `Model::stage_layers`); refuses a split into unequal stages. What the planner's layouts must
/// meet.
pub fn stage_range(layers: usize, stage: usize, stages: usize) -> Result<std::ops::Range<usize>> {
    if stages == 0 || stage >= stages || !layers.is_multiple_of(stages) {
        return Err(Error::invalid(
            "pipeline parallelism",
            format!(
                "{layers} layers do not split into {stages} equal stages (pp must divide the layer count)"
            ),
        ));
    }
    let per = layers / stages;
    Ok(stage * per..(stage + 1) * per)
}

impl Model {
    /// Whether pipeline stage `stage` of `stages` keeps parameter `name`: its layers'; the
    /// embedding on the first stage (and the last, when tied to the head); the final norm and
    /// the head on the last; GPT-2's position embedding on the first.
    pub fn stage_holds(&self, name: &str, stage: usize, stages: usize) -> bool {
        let last = stage + 1 == stages;
        let layer = name
            .strip_prefix("model.layers.")
            .or_else(|| name.strip_prefix("transformer.h."))
            .and_then(|rest| rest.split('.').next())
            .and_then(|i| i.parse::<usize>().ok());
        if let Some(i) = layer {
            let per = self.num_layers() / stages.max(1);
            return i / per.max(1) == stage;
        }
        match name {
            "model.embed_tokens.weight" | "transformer.wte.weight" => {
                stage == 0 || (last && self.config.tie_word_embeddings && self.head == Head::Lm)
            }
            "transformer.wpe.weight" => stage == 0,
            _ => last,
        }
    }

    /// Releases the parameters pipeline stage `stage` of `stages` does not run (their tensors
    /// become empty), so that a stage holds only its share of the model; `held_parameters`
    /// lists what stays.
    pub fn retain_stage(&mut self, stage: usize, stages: usize) -> Result<()> {
        self.stage_layers(stage, stages)?;
        tch::no_grad(|| -> Result<()> {
            for (name, var) in self.named_parameters() {
                if !self.stage_holds(&name, stage, stages) {
                    let empty = Tensor::f_empty([0], (var.kind(), var.device()))?;
                    let mut v = var.shallow_clone();
                    v.set_data(&empty);
                }
            }
            Ok(())
        })?;
        self.stage = Some((stage, stages));
        Ok(())
    }

    /// Frees the storage of every parameter this rank holds (their tensors become empty),
    /// remembering their shapes: a copy of a model in a layout used only part of an iteration
    /// (ReaL frees a source layout after its reshard). [`Model::materialize`] allocates them
    /// again, before a reshard writes their values; until then the model must not run.
    pub fn release(&mut self) -> Result<()> {
        if self.released.is_some() {
            return Ok(());
        }
        let mut shapes = Vec::new();
        tch::no_grad(|| -> Result<()> {
            for (name, var) in self.held_parameters() {
                shapes.push((name, var.size()));
                let empty = Tensor::f_empty([0], (var.kind(), var.device()))?;
                let mut v = var.shallow_clone();
                v.set_data(&empty);
            }
            Ok(())
        })?;
        self.released = Some(shapes);
        Ok(())
    }

    /// Bytes of the parameters this rank holds, and of those `release` freed.
    pub fn weight_bytes(&self) -> (usize, usize) {
        let held = self
            .held_parameters()
            .iter()
            .map(|(_, t)| t.numel() * t.kind().elt_size_in_bytes())
            .sum();
        let freed = self.released.as_ref().map_or(0, |v| {
            v.iter()
                .map(|(_, size)| {
                    size.iter().product::<i64>().max(0) as usize * self.kind.elt_size_in_bytes()
                })
                .sum()
        });
        (held, freed)
    }

    /// Whether `release` freed the parameters (and `materialize` has not run since).
    pub fn is_released(&self) -> bool {
        self.released.is_some()
    }

    /// Allocates the parameters `release` freed, zeroed, in their dtype on the model's device.
    pub fn materialize(&mut self) -> Result<()> {
        let Some(shapes) = self.released.take() else {
            return Ok(());
        };
        let vars: std::collections::BTreeMap<String, Tensor> =
            self.named_parameters().into_iter().collect();
        tch::no_grad(|| -> Result<()> {
            for (name, size) in shapes {
                if let Some(var) = vars.get(&name) {
                    let t = Tensor::f_zeros(&size, (var.kind(), self.device))?;
                    let mut v = var.shallow_clone();
                    v.set_data(&t);
                }
            }
            Ok(())
        })
    }

    /// The pipeline stage this model keeps (`retain_stage`) and the number of stages, or
    /// `None` when it is whole.
    pub fn pipeline_stage(&self) -> Option<(usize, usize)> {
        self.stage
    }

    /// The parameters this rank holds: all of them, or a pipeline stage's share.
    pub fn held_parameters(&self) -> Vec<(String, Tensor)> {
        self.named_parameters()
            .into_iter()
            .filter(|(name, _)| match self.stage {
                Some((s, n)) => self.stage_holds(name, s, n),
                None => true,
            })
            .collect()
    }

    /// The token embedding's parameter (the head's too when tied).
    pub fn embedding_parameter(&self) -> Option<Tensor> {
        match &self.body {
            Body::Llama { embed, .. } => Some(embed.shallow_clone()),
            Body::Gpt2 { wte, .. } => Some(wte.shallow_clone()),
        }
    }

    /// A pipeline stage's forward on whole sequences: the embedding of `ids` (first stage,
    /// `input` `None`) or `input` `[B, T, hidden]`, through `layers`, then the final norm when
    /// `last`. Positions and masks come from `ids` and `attention_mask` on every stage.
    pub fn stage_forward(
        &self,
        ids: &Tensor,
        attention_mask: Option<&Tensor>,
        input: Option<&Tensor>,
        layers: std::ops::Range<usize>,
        last: bool,
    ) -> Result<Tensor> {
        let s = self.sequences(ids, attention_mask);
        let mut x = match input {
            Some(x) => x.shallow_clone(),
            None => self.embed_sequences(&s)?,
        };
        for i in layers {
            x = self.layer_on_sequences(i, x, &s)?;
        }
        Ok(if last { self.final_norm(&x) } else { x })
    }

    /// The tensor-parallel degree (1 when the model is whole) and this rank's place in it.
    pub fn tensor_parallel(&self) -> (usize, usize) {
        match &self.shard {
            Some(s) => (s.size as usize, s.rank as usize),
            None => (1, 0),
        }
    }

    /// This rank's part of parameter `name`, given the whole tensor: its tensor-parallel slice
    /// (padded vocabulary rows included), or the tensor itself on a whole model.
    pub fn local_part(&self, name: &str, whole: &Tensor) -> Result<Tensor> {
        match &self.shard {
            Some(s) => s.slice(whole, s.cut(name, self.config.arch)),
            None => Ok(whole.shallow_clone()),
        }
    }

    /// Whether parameter `name` is whole on every rank of this model's tensor-parallel group
    /// (always true on a whole model): its gradient is the same on each of them, so a norm
    /// over the group counts it once.
    pub fn replicated_across_tp(&self, name: &str) -> bool {
        match &self.shard {
            Some(s) => s.cut(name, self.config.arch) == Cut::Whole,
            None => true,
        }
    }

    /// Every parameter this rank holds (`held_parameters`) whole: on a tensor-parallel model
    /// gathered from the group's slices (every rank of the group must call it), otherwise the
    /// parameters themselves, detached.
    pub fn gather_parameters(&self) -> Result<Vec<(String, Tensor)>> {
        self.gather_by_name(|t| t.detach())
    }

    /// The parameters' gradients whole (see `gather_parameters`); a parameter without a
    /// gradient gives an undefined tensor on every rank.
    pub fn gather_gradients(&self) -> Result<Vec<(String, Tensor)>> {
        self.gather_by_name(|t| t.grad())
    }

    fn gather_by_name(&self, of: impl Fn(&Tensor) -> Tensor) -> Result<Vec<(String, Tensor)>> {
        let mut out = Vec::new();
        for (name, var) in self.held_parameters() {
            let local = of(&var);
            let whole = match &self.shard {
                Some(s) if local.defined() => s.unslice(&local, s.cut(&name, self.config.arch))?,
                _ => local,
            };
            out.push((name, whole));
        }
        Ok(out)
    }

    /// Log-probabilities of `targets` `[N]` and, when asked, the entropy of each row, under
    /// `log_softmax(logits / temperature)` of this language model's head on `hidden`
    /// `[N, hidden]`, in f32 and differentiable. Tensor-parallel models compute them from
    /// their vocabulary slice without gathering the logits (`Shard::logprobs`).
    pub fn token_logprobs(
        &self,
        hidden: &Tensor,
        targets: &Tensor,
        temperature: f64,
        entropy: bool,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let logits = self.apply_head(hidden)?.to_kind(Kind::Float) / temperature.max(1e-6);
        let targets = targets.to_device(logits.device());
        if let Some(s) = &self.shard {
            return s.logprobs(&logits, &targets, entropy);
        }
        let lsm = logits.log_softmax(-1, Kind::Float);
        let logp = lsm.gather(1, &targets.unsqueeze(1), false).squeeze_dim(1);
        let ent = entropy.then(|| -(lsm.exp() * &lsm).sum_dim_intlist(-1, false, Kind::Float));
        Ok((logp, ent))
    }

    /// Converts every parameter to `kind` in place and returns the values they held before,
    /// detached and named as in `named_parameters`: built in f32 and converted to bf16 or f16,
    /// a trained model keeps these as its f32 master weights (see `training::optim`). No
    /// parameter is copied twice: each master keeps the storage the parameter had, and the
    /// parameter gets new storage in `kind`. Everything that shares a parameter (the layers'
    /// tensors, a tied head) sees the conversion.
    pub fn convert_keeping_masters(&mut self, kind: Kind) -> Result<Vec<(String, Tensor)>> {
        let mut masters = Vec::new();
        tch::no_grad(|| -> Result<()> {
            for (name, var) in self.named_parameters() {
                let master = var.detach();
                let low = var.f_to_kind(kind)?;
                let mut v = var.shallow_clone();
                v.set_data(&low);
                masters.push((name, master));
            }
            Ok(())
        })?;
        self.kind = kind;
        Ok(masters)
    }

    /// Moves the parameters to host memory until [`Model::reload`] — pinned on a GPU, so the
    /// way back is one DMA transfer per tensor; on the CPU they are in host memory already and
    /// nothing moves. The executor does this for a frozen model that the plan offloads between
    /// its calls; the model must not be called while offloaded.
    pub fn offload(&mut self) -> Result<()> {
        tch::no_grad(|| {
            for (_, var) in self.named_parameters() {
                let host = crate::device::to_host_pinned(&var);
                let mut v = var.shallow_clone();
                v.set_data(&host);
            }
        });
        Ok(())
    }

    /// Brings offloaded parameters back to the model's device (a no-op when they are there).
    pub fn reload(&mut self) -> Result<()> {
        let device = self.device;
        tch::no_grad(|| {
            for (_, var) in self.named_parameters() {
                let back = crate::device::from_host(&var, device);
                let mut v = var.shallow_clone();
                v.set_data(&back);
            }
        });
        Ok(())
    }

    /// The configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The parameters, named as in Hugging Face checkpoints (for optimisers and saving).
    pub fn var_store(&self) -> &VarStore {
        &self.vs
    }

    /// The parameters, mutably (to freeze them or change their dtype or device).
    pub fn var_store_mut(&mut self) -> &mut VarStore {
        &mut self.vs
    }

    /// The head this model was built with.
    pub fn head(&self) -> Head {
        self.head
    }

    /// Parameter dtype.
    pub fn kind(&self) -> Kind {
        self.kind
    }

    /// Device of the parameters.
    pub fn device(&self) -> Device {
        self.device
    }

    /// Where the weights came from (a directory, or `tiny`).
    pub fn source(&self) -> &Path {
        &self.source
    }

    /// Calls `f` with the decode-step costs measured so far with this model (see `CostModel`).
    pub(crate) fn with_step_costs<R>(&self, f: impl FnOnce(&CostModel) -> R) -> R {
        match self.step_costs.lock() {
            Ok(c) => f(&c),
            Err(poisoned) => f(&poisoned.into_inner()),
        }
    }

    /// Records a decode step over `tokens` tokens that took `secs`.
    pub(crate) fn observe_step(&self, tokens: usize, secs: f64) {
        if let Ok(mut c) = self.step_costs.lock() {
            c.observe(tokens, secs);
        }
    }

    /// An empty KV cache with `rows` rows for this model.
    pub fn new_cache(&self, rows: usize) -> KvCache {
        let c = &self.config;
        KvCache::new(
            c.num_layers as usize,
            self.kv_heads_held(),
            c.head_dim,
            rows,
            self.kind,
            self.device,
        )
    }

    /// Checks that token ids are inside the vocabulary (the embedding would abort otherwise).
    pub fn check_ids(&self, ids: &[i64], source_name: &str) -> Result<()> {
        if let Some(bad) = ids.iter().find(|&&t| t < 0 || t >= self.config.vocab_size) {
            return Err(Error::invalid(
                source_name,
                format!(
                    "token id {bad} outside the vocabulary of {} ({})",
                    self.config.vocab_size,
                    self.source.display()
                ),
            ));
        }
        Ok(())
    }

    /// Final hidden states `[B, T, hidden]` of whole sequences, with autograd when enabled.
    /// `ids`: `[B, T]` int64; `attention_mask`: `[B, T]` with 1 for real tokens and 0 for
    /// padding (left or right); positions count real tokens only, so a padded sequence gives the
    /// same states as the unpadded one.
    pub fn hidden_states(&self, ids: &Tensor, attention_mask: Option<&Tensor>) -> Result<Tensor> {
        let s = self.sequences(ids, attention_mask);
        let mut x = self.embed_sequences(&s)?;
        for i in 0..self.num_layers() {
            x = self.layer_on_sequences(i, x, &s)?;
        }
        Ok(self.final_norm(&x))
    }

    /// [`Model::hidden_states`] with activation checkpointing, for training: the layers run
    /// without autograd and only each layer's input is kept; the returned hidden states have
    /// autograd from the last layer's output (a leaf) through the final norm. After the loss's
    /// `backward`, [`Model::backward_checkpointed`] recomputes the layers one at a time, last
    /// first, and carries the gradient down to the embedding. The forward values are the same
    /// operations on the same inputs, so the gradients are those of the plain forward.
    pub fn hidden_states_checkpointed(
        &self,
        ids: &Tensor,
        attention_mask: Option<&Tensor>,
    ) -> Result<(Tensor, Checkpoint)> {
        let s = self.sequences(ids, attention_mask);
        // The embedding keeps its graph: its gradient is the last thing the backward adds.
        let embedded = self.embed_sequences(&s)?;
        let mut inputs = Vec::with_capacity(self.num_layers());
        let mut x = embedded.detach();
        tch::no_grad(|| -> Result<()> {
            for i in 0..self.num_layers() {
                inputs.push(x.shallow_clone());
                x = self.layer_on_sequences(i, x.shallow_clone(), &s)?;
            }
            Ok(())
        })?;
        let top = x.detach().set_requires_grad(true);
        let hidden = self.final_norm(&top);
        Ok((
            hidden,
            Checkpoint {
                sequences: s,
                embedded,
                inputs,
                top,
            },
        ))
    }

    /// The backward pass through the layers of a checkpointed forward (see
    /// [`Model::hidden_states_checkpointed`]), once the loss's `backward` has reached its top:
    /// for each layer from the last, its forward runs again with autograd from its kept input,
    /// and `sum(output · upstream)` is differentiated, which gives the layer's parameters their
    /// gradient and the input the gradient for the layer below. Only one layer's activations
    /// exist at a time. Does nothing when no gradient reached the top.
    pub fn backward_checkpointed(&self, ck: Checkpoint) -> Result<()> {
        let mut upstream = ck.top.grad();
        if !upstream.defined() {
            return Ok(());
        }
        for i in (0..self.num_layers()).rev() {
            let input = ck.inputs[i].detach().set_requires_grad(true);
            let out = self.layer_on_sequences(i, input.shallow_clone(), &ck.sequences)?;
            (out * &upstream).f_sum(out_kind(&upstream))?.f_backward()?;
            upstream = input.grad();
            if !upstream.defined() {
                return Ok(());
            }
        }
        (&ck.embedded * &upstream)
            .f_sum(out_kind(&upstream))?
            .f_backward()?;
        Ok(())
    }

    fn num_layers(&self) -> usize {
        match &self.body {
            Body::Llama { layers, .. } => layers.len(),
            Body::Gpt2 { layers, .. } => layers.len(),
        }
    }

    /// Positions, masks and rotary tables of a batch of whole sequences, for every layer.
    fn sequences(&self, ids: &Tensor, attention_mask: Option<&Tensor>) -> Sequences {
        let (b, t) = ids.size2().unwrap_or((0, 0));
        let dev = self.device;
        let (pos, valid, right_padded) = match attention_mask {
            Some(m) => {
                let m = m.to_device(dev);
                let pos = (m.to_kind(Kind::Int64).cumsum(1, Kind::Int64) - 1).clamp_min(0);
                let valid = m.to_kind(Kind::Bool);
                // Right-padded when no real token follows a pad: one small reduction, read
                // only where the fused path could use it.
                let right = self.fused_attention_enabled()
                    && t > 1
                    && valid
                        .narrow(1, 1, t - 1)
                        .logical_and(&valid.narrow(1, 0, t - 1).logical_not())
                        .any()
                        .int64_value(&[])
                        == 0;
                (pos, valid, right)
            }
            None => (
                Tensor::arange(t, (Kind::Int64, dev))
                    .unsqueeze(0)
                    .expand([b, t], true),
                Tensor::ones([b, t], (Kind::Bool, dev)),
                self.fused_attention_enabled(),
            ),
        };
        let eye = Tensor::eye(t, (Kind::Bool, dev)).unsqueeze(0);
        let full = build_mask(&pos, &pos, &valid, None, Some(&eye));
        let rope = match &self.body {
            Body::Llama { inv_freq, .. } => Some(self.rope(inv_freq, &pos)),
            Body::Gpt2 { .. } => None,
        };
        Sequences {
            ids: ids.to_device(dev),
            pos,
            valid,
            eye,
            full,
            rope,
            fused: right_padded,
        }
    }

    /// The embeddings of the sequences' tokens (and GPT-2's positions).
    fn embed_sequences(&self, s: &Sequences) -> Result<Tensor> {
        Ok(match &self.body {
            Body::Llama { embed, .. } => self.embed_tokens(embed, &s.ids)?,
            Body::Gpt2 { wte, wpe, .. } => {
                self.embed_tokens(wte, &s.ids)? + Tensor::embedding(wpe, &s.pos, -1, false, false)
            }
        })
    }

    /// Token embeddings: vocab-parallel under tensor parallelism.
    fn embed_tokens(&self, table: &Tensor, ids: &Tensor) -> Result<Tensor> {
        match &self.shard {
            Some(s) => s.embed(table, ids),
            None => Ok(Tensor::embedding(table, ids, -1, false, false)),
        }
    }

    /// Key/value heads this rank holds (all of them on one process).
    fn kv_heads_held(&self) -> i64 {
        match &self.shard {
            Some(s) => s.kv_heads,
            None => self.config.num_kv_heads,
        }
    }

    /// Query heads on this rank.
    fn local_heads(&self) -> i64 {
        match &self.shard {
            Some(s) => s.heads,
            None => self.config.num_heads,
        }
    }

    /// Keys or values `[B, Hkv, L, D]` as this rank's queries read them: with key/value heads
    /// kept whole under tensor parallelism, the head of each local query head's group.
    fn kv_for_queries(&self, kv: Tensor) -> Tensor {
        match self.shard.as_ref().and_then(|s| s.kv_map.as_ref()) {
            Some(map) => kv.index_select(1, map),
            None => kv,
        }
    }

    /// A replicated activation entering column-parallel products (Megatron's `f`).
    fn tp_enter(&self, x: &Tensor) -> Result<Tensor> {
        match &self.shard {
            Some(s) => Ok(s.comm.copy(x)?),
            None => Ok(x.shallow_clone()),
        }
    }

    /// A parameter kept whole on every rank but used partially by each (key/value projections
    /// when the group does not divide their heads): its gradient is summed over the group.
    fn tp_whole_param(&self, p: &Tensor) -> Result<Tensor> {
        match &self.shard {
            Some(s) if !s.kv_split => Ok(s.comm.copy(p)?),
            _ => Ok(p.shallow_clone()),
        }
    }

    /// A row-parallel product: `x · Wᵀ` summed over the group, then the whole bias.
    fn row_linear(&self, l: &Linear, x: &Tensor, step: bool) -> Result<Tensor> {
        match &self.shard {
            Some(s) => {
                let partial = s.comm.reduce_sum(&x.linear(&l.weight, None::<&Tensor>))?;
                Ok(match &l.bias {
                    Some(b) => partial + b,
                    None => partial,
                })
            }
            None if step => Ok(l.forward_step(x)),
            None => Ok(l.forward(x)),
        }
    }

    /// GPT-2's row-parallel Conv1D (weight `[in, out]`).
    fn row_conv(&self, l: &Conv1D, x: &Tensor) -> Result<Tensor> {
        match &self.shard {
            Some(s) => Ok(s.comm.reduce_sum(&x.matmul(&l.weight))? + &l.bias),
            None => Ok(l.forward(x)),
        }
    }

    /// Transformer layer `i` on whole sequences.
    fn layer_on_sequences(&self, i: usize, x: Tensor, s: &Sequences) -> Result<Tensor> {
        match &self.body {
            Body::Llama { layers, .. } => {
                let layer = &layers[i];
                let Some((cos, sin)) = &s.rope else {
                    return Ok(x);
                };
                let (q, k, v) = self.llama_qkv(layer, &x, (cos, sin), false)?;
                let (k, v) = (self.kv_for_queries(k), self.kv_for_queries(v));
                let a = match layer.window {
                    Some(w) => {
                        let mask = build_mask(&s.pos, &s.pos, &s.valid, Some(w), Some(&s.eye));
                        attend(&q, &k, &v, &mask)
                    }
                    None if s.fused => attend_with(&q, &k, &v, Attention::Causal),
                    None => attend(&q, &k, &v, &s.full),
                };
                self.llama_rest(layer, x, &a, false)
            }
            Body::Gpt2 { layers, .. } => {
                let layer = &layers[i];
                let (q, k, v) = self.gpt2_qkv(layer, &x)?;
                let a = if s.fused {
                    attend_with(&q, &k, &v, Attention::Causal)
                } else {
                    attend(&q, &k, &v, &s.full)
                };
                self.gpt2_rest(layer, x, &a)
            }
        }
    }

    /// The final norm after the last layer.
    fn final_norm(&self, x: &Tensor) -> Tensor {
        match &self.body {
            Body::Llama { norm, .. } => rms_norm(x, norm, self.config.norm_eps),
            Body::Gpt2 { ln_f, .. } => x.layer_norm(
                [self.config.hidden_size],
                Some(&ln_f.0),
                Some(&ln_f.1),
                self.config.norm_eps,
                false,
            ),
        }
    }

    /// Head outputs of whole sequences: logits `[B, T, V]` (Lm), values `[B, T]` (Value) or
    /// per-token scores `[B, T, num_labels]` (Score).
    /// Under tensor parallelism the logits are gathered whole, without gradient (training
    /// reads log-probabilities through [`Model::token_logprobs`] instead).
    pub fn forward(&self, ids: &Tensor, attention_mask: Option<&Tensor>) -> Result<Tensor> {
        let h = self.hidden_states(ids, attention_mask)?;
        let out = self.apply_head(&h)?;
        match (&self.shard, self.head) {
            (Some(s), Head::Lm) => s.gather_logits(&out),
            _ => Ok(out),
        }
    }

    /// Applies this model's head to hidden states `[..., hidden]`. A tensor-parallel language
    /// model gives its vocabulary slice of the logits `[..., ⌈V/tp⌉]` (padding columns hold
    /// zeros' products; `Shard::logprobs` masks them).
    pub fn apply_head(&self, hidden: &Tensor) -> Result<Tensor> {
        Ok(match (self.head, &self.lm_head, &self.score) {
            (Head::Lm, Some(w), _) => self.tp_enter(hidden)?.linear(w, None::<&Tensor>),
            (Head::Value, _, Some(w)) => hidden.linear(w, None::<&Tensor>).squeeze_dim(-1),
            (_, _, Some(w)) => hidden.linear(w, None::<&Tensor>),
            // Unreachable by construction: `build` creates the weight each head needs.
            _ => hidden.shallow_clone(),
        })
    }

    /// `apply_head` for hidden states of a cached step (`forward_cached`), without gradients:
    /// the language-model head of a few rows on the CPU goes through Braid's kernel. A
    /// tensor-parallel language model gathers the whole logits (every rank of the group gets
    /// the same bytes, so every rank samples the same token).
    pub fn apply_head_cached(&self, hidden: &Tensor) -> Result<Tensor> {
        tch::no_grad(|| match (self.head, &self.lm_head, &self.shard) {
            (Head::Lm, Some(_), Some(s)) => s.gather_logits(&self.apply_head(hidden)?),
            (Head::Lm, Some(w), None) if self.host_step_enabled() => {
                match gemm::linear(hidden, w, None) {
                    Some(t) => Ok(t),
                    None => self.apply_head(hidden),
                }
            }
            _ => self.apply_head(hidden),
        })
    }

    /// Appends `ids` (`[rows, T]`) to every row of `cache` and returns the final hidden states
    /// `[rows, T, hidden]` of the new tokens. Row `r` advances by `valid[r]` positions: a
    /// right-padded prefill passes each prompt's true length, and the pad tokens' entries stay
    /// past the row's length, where the mask hides them. Runs under `no_grad`.
    pub fn forward_cached(
        &self,
        cache: &mut KvCache,
        ids: &Tensor,
        valid: &[i64],
    ) -> Result<Tensor> {
        tch::no_grad(|| self.forward_cached_inner(cache, ids, valid))
    }

    fn forward_cached_inner(
        &self,
        cache: &mut KvCache,
        ids: &Tensor,
        valid: &[i64],
    ) -> Result<Tensor> {
        let dev = self.device;
        let (b, t) = ids.size2().unwrap_or((0, 0));
        let lens = cache.lens().to_vec();
        let used = lens.iter().map(|l| l + t).max().unwrap_or(t);
        cache.reserve(used);
        // Cached steps (prefill, decode, verification) of a Llama body on the CPU in f32 run on
        // host memory (`step.rs`); it declines what it does not handle.
        if self.host_step_enabled()
            && let Some(out) = self.llama_host_step(cache, ids, &lens)
        {
            cache.advance(valid);
            return Ok(out);
        }
        let cap = cache.capacity();
        let hkv = self.kv_heads_held();
        let hd = self.config.head_dim;
        // Where the new keys go: row-major over (row, kv head, new token).
        let mut bh = Vec::with_capacity((b * hkv * t) as usize);
        let mut at = Vec::with_capacity((b * hkv * t) as usize);
        let mut q_pos = Vec::with_capacity((b * t) as usize);
        for (r, &l) in lens.iter().enumerate() {
            for h in 0..hkv {
                for i in 0..t {
                    bh.push(r as i64 * hkv + h);
                    at.push(l + i);
                }
            }
            q_pos.extend((0..t).map(|i| l + i));
        }
        let bh = Tensor::from_slice(&bh).to_device(dev);
        let at = Tensor::from_slice(&at).to_device(dev);
        let pos = Tensor::from_slice(&q_pos).to_device(dev).reshape([b, t]);
        let k_pos = Tensor::arange(used, (Kind::Int64, dev))
            .unsqueeze(0)
            .expand([b, used], true);
        let k_valid = Tensor::ones([b, used], (Kind::Bool, dev));
        let mask_for = |w: Option<i64>| build_mask(&pos, &k_pos, &k_valid, w, None);
        let full = mask_for(None);
        let ids = ids.to_device(dev);
        // Decode and verification steps (a few new tokens per row) attend with a kernel of
        // their own on the CPU (`attention.rs`); it declines what it does not handle.
        let kernels = self.host_step_enabled();
        let few_queries = t <= MAX_QUERIES && kernels;
        // A prefill into empty rows is plain causal attention over the new tokens: the fused
        // kernel where it is on (right padding leaves stale entries past each row's length,
        // which later steps mask).
        let fresh = self.fused_attention_enabled() && t > 1 && lens.iter().all(|&l| l == 0);
        let write_and_read =
            |cache: &mut KvCache, l: usize, k: &Tensor, v: &Tensor| -> (Tensor, Tensor) {
                let idx = [Some(bh.shallow_clone()), Some(at.shallow_clone())];
                let _ = cache.keys[l].view([b * hkv, cap, hd]).index_put_(
                    &idx,
                    &k.reshape([b * hkv * t, hd]),
                    false,
                );
                let _ = cache.values[l].view([b * hkv, cap, hd]).index_put_(
                    &idx,
                    &v.reshape([b * hkv * t, hd]),
                    false,
                );
                (
                    cache.keys[l].narrow(2, 0, used),
                    cache.values[l].narrow(2, 0, used),
                )
            };
        let out = match &self.body {
            Body::Llama {
                embed,
                layers,
                norm,
                inv_freq,
            } => {
                let (cos, sin) = self.rope(inv_freq, &pos);
                let mut x = self.embed_tokens(embed, &ids)?;
                for (l, layer) in layers.iter().enumerate() {
                    let mask = if layer.window.is_some() {
                        mask_for(layer.window)
                    } else {
                        full.shallow_clone()
                    };
                    let (q, k, v) = self.llama_qkv(layer, &x, (&cos, &sin), kernels)?;
                    let (kc, vc) = write_and_read(cache, l, &k, &v);
                    // Keys and values as this rank's queries read them (only the attention that
                    // runs expands them, see `kv_for_queries`).
                    let a = (few_queries && layer.window.is_none())
                        .then(|| decode_attention(&q, &cache.keys[l], &cache.values[l], &lens))
                        .flatten()
                        .unwrap_or_else(|| {
                            if fresh && layer.window.is_none() {
                                let (k, v) = (self.kv_for_queries(k), self.kv_for_queries(v));
                                attend_with(&q, &k, &v, Attention::Causal)
                            } else {
                                let (kc, vc) = (self.kv_for_queries(kc), self.kv_for_queries(vc));
                                attend(&q, &kc, &vc, &mask)
                            }
                        });
                    x = self.llama_rest(layer, x, &a, kernels)?;
                }
                rms_norm(&x, norm, self.config.norm_eps)
            }
            Body::Gpt2 {
                wte,
                wpe,
                layers,
                ln_f,
            } => {
                let mut x =
                    self.embed_tokens(wte, &ids)? + Tensor::embedding(wpe, &pos, -1, false, false);
                for (l, layer) in layers.iter().enumerate() {
                    let (q, k, v) = self.gpt2_qkv(layer, &x)?;
                    let (kc, vc) = write_and_read(cache, l, &k, &v);
                    let a = few_queries
                        .then(|| decode_attention(&q, &cache.keys[l], &cache.values[l], &lens))
                        .flatten()
                        .unwrap_or_else(|| {
                            if fresh {
                                attend_with(&q, &k, &v, Attention::Causal)
                            } else {
                                attend(&q, &kc, &vc, &full)
                            }
                        });
                    x = self.gpt2_rest(layer, x, &a)?;
                }
                x.layer_norm(
                    [self.config.hidden_size],
                    Some(&ln_f.0),
                    Some(&ln_f.1),
                    self.config.norm_eps,
                    false,
                )
            }
        };
        cache.advance(valid);
        Ok(out)
    }

    /// Whether cached steps may use Braid's CPU kernels: the host-memory step (`step.rs`), the
    /// product kernel (`gemm.rs`) and the attention kernel (`attention.rs`). Tests and
    /// benchmarks turn them off to compare with libtorch operations.
    fn host_step_enabled(&self) -> bool {
        // Tensor-parallel layers reduce over their group between products, which the host
        // kernels do not.
        self.shard.is_none()
            && !self
                .libtorch_steps
                .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Whether whole-sequence passes and fresh prefills may use fused causal attention.
    fn fused_attention_enabled(&self) -> bool {
        self.fused_attention
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Turns fused causal attention on or off (on by default on CUDA only); tests turn it on
    /// on the CPU to check it against the masked path.
    #[doc(hidden)]
    pub fn set_fused_attention(&self, on: bool) {
        self.fused_attention
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Makes cached steps use libtorch operations only, none of Braid's CPU kernels (for tests
    /// and benchmarks that compare the two).
    #[doc(hidden)]
    pub fn set_libtorch_steps(&self, on: bool) {
        self.libtorch_steps
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// A cached step of a Llama body on host memory (`step.rs`) — a prefill, a decode step or
    /// a verification block — or `None` where that path does not apply: another architecture
    /// or device, a dtype other than f32, a sliding window, an odd head size, a tensor that is
    /// not contiguous, or a token id outside the vocabulary (left to libtorch's error).
    fn llama_host_step(&self, cache: &mut KvCache, ids: &Tensor, lens: &[i64]) -> Option<Tensor> {
        let Body::Llama {
            embed,
            layers,
            norm,
            inv_freq,
        } = &self.body
        else {
            return None;
        };
        let c = &self.config;
        let (b, t) = ids.size2().ok()?;
        if self.device != Device::Cpu
            || self.kind != Kind::Float
            || t < 1
            || layers.iter().any(|l| l.window.is_some())
            || ids.device() != Device::Cpu
            || lens.len() != b as usize
            || c.head_dim % 2 != 0
        {
            return None;
        }
        let (rows, t_) = (b as usize, t as usize);
        let hidden = c.hidden_size as usize;
        let ids_host = Vec::<i64>::try_from(ids.reshape([-1])).ok()?;
        let table = step::host(embed)?;
        let vocab = table.len() / hidden.max(1);
        let mut x = Vec::with_capacity(rows * t_ * hidden);
        for &id in &ids_host {
            let id = usize::try_from(id).ok().filter(|&i| i < vocab)?;
            x.extend_from_slice(&table[id * hidden..(id + 1) * hidden]);
        }
        let q_pos: Vec<i64> = lens
            .iter()
            .flat_map(|&l| (0..t).map(move |i| l + i))
            .collect();
        let pos = Tensor::from_slice(&q_pos).reshape([b, t]);
        let (cos, sin) = self.rope(inv_freq, &pos);
        let (cos, sin) = (cos.contiguous(), sin.contiguous());
        fn lin(l: &Linear) -> Option<step::Lin<'_>> {
            Some(step::Lin {
                w: step::host(&l.weight)?,
                b: match &l.bias {
                    Some(b) => Some(step::host(b)?),
                    None => None,
                },
            })
        }
        let views = layers
            .iter()
            .map(|l| {
                Some(step::LayerView {
                    q: lin(&l.q)?,
                    k: lin(&l.k)?,
                    v: lin(&l.v)?,
                    o: lin(&l.o)?,
                    gate: lin(&l.gate)?,
                    up: lin(&l.up)?,
                    down: lin(&l.down)?,
                    input_norm: step::host(&l.input_norm)?,
                    post_norm: step::host(&l.post_norm)?,
                })
            })
            .collect::<Option<Vec<_>>>()?;
        let cap = cache.capacity() as usize;
        let mut caches = cache
            .keys
            .iter_mut()
            .zip(cache.values.iter_mut())
            .map(|(k, v)| Some((step::host_mut(k)?, step::host_mut(v)?)))
            .collect::<Option<Vec<_>>>()?;
        let dims = step::Dims {
            rows,
            t: t_,
            hidden,
            heads: c.num_heads as usize,
            kv_heads: c.num_kv_heads as usize,
            head_dim: c.head_dim as usize,
            intermediate: c.intermediate_size as usize,
            cap,
            eps: c.norm_eps as f32,
        };
        let kv = dims.rows * dims.kv_heads * cap * dims.head_dim;
        if caches.iter().any(|(k, v)| k.len() != kv || v.len() != kv) {
            return None;
        }
        step::llama_layers(
            &mut x,
            &views,
            &mut caches,
            lens,
            (step::host(&cos)?, step::host(&sin)?),
            dims,
        );
        let mut out = vec![0f32; x.len()];
        step::rms_norm(&x, step::host(norm)?, dims.eps, &mut out);
        Some(Tensor::from_slice(&out).reshape([b, t, c.hidden_size]))
    }

    /// cos and signed sin (`[-sin, sin]`, see `apply_rope`) `[B, 1, T, D]` for positions `[B, T]`,
    /// computed in f32 as transformers does.
    fn rope(&self, inv_freq: &Tensor, pos: &Tensor) -> (Tensor, Tensor) {
        let freqs = pos.to_kind(Kind::Float).unsqueeze(-1) * inv_freq.view([1, 1, -1]);
        let (c, s) = (freqs.cos(), freqs.sin());
        let cos = Tensor::cat(&[&c, &c], -1).unsqueeze(1);
        let sin_signed = Tensor::cat(&[&(-&s), &s], -1).unsqueeze(1);
        (cos.to_kind(self.kind), sin_signed.to_kind(self.kind))
    }

    /// Queries, keys and values of a Llama layer; `step` marks a cached step under `no_grad`,
    /// whose products may use Braid's kernel (`Linear::forward_step`).
    fn llama_qkv(
        &self,
        layer: &LlamaLayer,
        x: &Tensor,
        (cos, sin): (&Tensor, &Tensor),
        step: bool,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let c = &self.config;
        let (b, t, _) = x.size3().unwrap_or((0, 0, 0));
        let h = self.tp_enter(&rms_norm(x, &layer.input_norm, c.norm_eps))?;
        let lin = |l: &Linear| {
            if step {
                l.forward_step(&h)
            } else {
                l.forward(&h)
            }
        };
        let kv = |l: &Linear| -> Result<Tensor> {
            if self.shard.is_none() {
                return Ok(lin(l));
            }
            let w = self.tp_whole_param(&l.weight)?;
            let bias = l
                .bias
                .as_ref()
                .map(|b| self.tp_whole_param(b))
                .transpose()?;
            Ok(h.linear(&w, bias.as_ref()))
        };
        let (heads, kv_heads) = (self.local_heads(), self.kv_heads_held());
        let q = lin(&layer.q)
            .view([b, t, heads, c.head_dim])
            .transpose(1, 2);
        let k = kv(&layer.k)?
            .view([b, t, kv_heads, c.head_dim])
            .transpose(1, 2);
        let v = kv(&layer.v)?
            .view([b, t, kv_heads, c.head_dim])
            .transpose(1, 2);
        let q = apply_rope(&q, cos, sin);
        let k = apply_rope(&k, cos, sin);
        Ok((q, k, v))
    }

    /// The rest of a Llama layer after attention; `step` as in `llama_qkv`.
    fn llama_rest(
        &self,
        layer: &LlamaLayer,
        x: Tensor,
        attn: &Tensor,
        step: bool,
    ) -> Result<Tensor> {
        let lin = |l: &Linear, x: &Tensor| {
            if step {
                l.forward_step(x)
            } else {
                l.forward(x)
            }
        };
        let x = x + self.row_linear(&layer.o, attn, step)?;
        let h = self.tp_enter(&rms_norm(&x, &layer.post_norm, self.config.norm_eps))?;
        let m = self.row_linear(
            &layer.down,
            &(lin(&layer.gate, &h).silu() * lin(&layer.up, &h)),
            step,
        )?;
        Ok(x + m)
    }

    fn gpt2_qkv(&self, layer: &Gpt2Layer, x: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        let c = &self.config;
        let (b, t, _) = x.size3().unwrap_or((0, 0, 0));
        let h = self.tp_enter(&x.layer_norm(
            [c.hidden_size],
            Some(&layer.ln1.0),
            Some(&layer.ln1.1),
            c.norm_eps,
            false,
        ))?;
        let heads = self.local_heads();
        let qkv = layer.c_attn.forward(&h);
        let parts = qkv.split(heads * c.head_dim, 2);
        let shape = |t_: &Tensor| t_.view([b, t, heads, c.head_dim]).transpose(1, 2);
        Ok((shape(&parts[0]), shape(&parts[1]), shape(&parts[2])))
    }

    fn gpt2_rest(&self, layer: &Gpt2Layer, x: Tensor, attn: &Tensor) -> Result<Tensor> {
        let c = &self.config;
        let x = x + self.row_conv(&layer.attn_proj, attn)?;
        let h = self.tp_enter(&x.layer_norm(
            [c.hidden_size],
            Some(&layer.ln2.0),
            Some(&layer.ln2.1),
            c.norm_eps,
            false,
        ))?;
        let h = layer.fc.forward(&h);
        let h = match c.activation {
            Activation::GeluTanh => h.gelu("tanh"),
            Activation::Gelu => h.gelu("none"),
            Activation::Relu => h.relu(),
            Activation::Silu => h.silu(),
        };
        Ok(x + self.row_conv(&layer.mlp_proj, &h)?)
    }

    /// The tensors to save, by Hugging Face name (a tied `lm_head.weight` is not listed: it is
    /// the embedding).
    pub fn named_parameters(&self) -> Vec<(String, Tensor)> {
        let mut v: Vec<(String, Tensor)> = self.vs.variables().into_iter().collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    }
}

/// Fills parameters from a checkpoint or a seeded generator.
fn fill(
    params: &[(String, Tensor, Init)],
    weights: &Weights<'_>,
    config: &ModelConfig,
) -> Result<()> {
    match weights {
        Weights::Gguf(file) => {
            let mut new_heads = Vec::new();
            for (name, t, init) in params {
                if name == "score.weight" && !file.contains(name, config) {
                    // GGUF files hold language models: a value or score head starts new.
                    new_heads.push((name.clone(), t.shallow_clone(), *init));
                    continue;
                }
                let mut dst = t.shallow_clone();
                file.copy_into(name, config, &mut dst)?;
            }
            fill_random(&new_heads, 0)
        }
        Weights::Files(files) => {
            // Checkpoints of base models (LlamaModel, GPT2Model) have no `model.` /
            // `transformer.` prefix; accept both spellings.
            let mut new_heads = Vec::new();
            for (name, t, init) in params {
                let stripped = name
                    .strip_prefix("model.")
                    .or_else(|| name.strip_prefix("transformer."));
                let src = if files.contains(name) {
                    name.as_str()
                } else if let Some(s) = stripped.filter(|s| files.contains(s)) {
                    s
                } else if name == "score.weight" {
                    new_heads.push((name.clone(), t.shallow_clone(), *init));
                    continue;
                } else {
                    let hint = if name == "lm_head.weight" {
                        " (the checkpoint has no language-model head; is it a reward or value model?)"
                    } else {
                        ""
                    };
                    return Err(Error::file(
                        files.first_path(),
                        format!("missing tensor `{name}`{hint}"),
                    ));
                };
                let mut dst = t.shallow_clone();
                files.copy_into(src, &mut dst)?;
            }
            fill_random(&new_heads, 0)
        }
        Weights::Random(seed) => fill_random(params, *seed),
    }
}

fn fill_random(params: &[(String, Tensor, Init)], seed: u64) -> Result<()> {
    let mut rng = Rng::new(seed);
    for (_, t, init) in params {
        let n = t.numel();
        let data: Vec<f32> = match init {
            Init::Normal(std) => (0..n).map(|_| (rng.normal() * std) as f32).collect(),
            Init::Zeros => vec![0.0; n],
            Init::Ones => vec![1.0; n],
        };
        let src = Tensor::f_from_slice(&data)?.f_reshape(t.size())?;
        let mut dst = t.shallow_clone();
        tch::no_grad(|| dst.f_copy_(&src))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    // Each test sets one libtorch thread: tests run in parallel threads, and OpenMP threads
    // spinning on a small shared machine slow the suite down about tenfold.
    use super::*;
    use crate::models::tiny::{TinyConfig, tiny};

    #[test]
    fn gradients_reach_every_parameter() {
        crate::device::set_cpu_threads(1);
        let (m, _) = tiny(
            &TinyConfig {
                layers: 1,
                ..TinyConfig::default()
            },
            Head::Lm,
            Device::Cpu,
        )
        .unwrap();
        let ids = Tensor::from_slice(&[256i64, 1, 2, 3, 258, 258]).reshape([2, 3]);
        let mask = Tensor::from_slice(&[1i64, 1, 1, 1, 0, 0]).reshape([2, 3]);
        let loss = m
            .forward(&ids, Some(&mask))
            .unwrap()
            .log_softmax(-1, Kind::Float)
            .mean(Kind::Float);
        loss.backward();
        for (name, t) in m.var_store().variables() {
            assert!(t.requires_grad(), "{name}");
            assert!(t.grad().defined(), "{name} has no gradient");
            assert!(
                t.grad().isfinite().all().int64_value(&[]) == 1,
                "{name}: non-finite gradient"
            );
        }
    }

    #[test]
    fn a_released_model_frees_its_weights_and_takes_them_back() {
        crate::device::set_cpu_threads(1);
        let (mut m, _) = tiny(&TinyConfig::default(), Head::Lm, Device::Cpu).unwrap();
        let (src, _) = tiny(&TinyConfig::default(), Head::Lm, Device::Cpu).unwrap();
        let ids = Tensor::from_slice(&[256i64, 72, 105, 33]).reshape([1, 4]);
        let before = tch::no_grad(|| m.forward(&ids, None)).unwrap();
        let (held, freed) = m.weight_bytes();
        assert!(held > 0 && freed == 0);
        m.release().unwrap();
        assert!(m.is_released());
        assert_eq!(
            m.weight_bytes(),
            (0, held),
            "every byte freed, its size kept"
        );
        m.materialize().unwrap();
        assert!(!m.is_released());
        assert_eq!(m.weight_bytes(), (held, 0));
        let zero = m
            .held_parameters()
            .iter()
            .all(|(_, t)| t.abs().sum(Kind::Float).double_value(&[]) == 0.0);
        assert!(
            zero,
            "materialized storage is zeroed until a reshard fills it"
        );
        let from: std::collections::BTreeMap<String, Tensor> =
            src.named_parameters().into_iter().collect();
        tch::no_grad(|| {
            for (name, t) in m.held_parameters() {
                t.shallow_clone().copy_(&from[&name]);
            }
        });
        let after = tch::no_grad(|| m.forward(&ids, None)).unwrap();
        assert_eq!(
            (before - after).abs().max().double_value(&[]),
            0.0,
            "the layers read the refilled storage"
        );
    }

    #[test]
    fn padding_on_either_side_does_not_change_outputs() {
        crate::device::set_cpu_threads(1);
        let (m, _) = tiny(&TinyConfig::default(), Head::Lm, Device::Cpu).unwrap();
        let seq = [256i64, 72, 105, 33];
        let plain = tch::no_grad(|| {
            m.forward(&Tensor::from_slice(&seq).unsqueeze(0), None)
                .unwrap()
        });
        let left = Tensor::from_slice(&[258i64, 258, 256, 72, 105, 33]).unsqueeze(0);
        let left_mask = Tensor::from_slice(&[0i64, 0, 1, 1, 1, 1]).unsqueeze(0);
        let right = Tensor::from_slice(&[256i64, 72, 105, 33, 258, 258]).unsqueeze(0);
        let right_mask = Tensor::from_slice(&[1i64, 1, 1, 1, 0, 0]).unsqueeze(0);
        let l = tch::no_grad(|| m.forward(&left, Some(&left_mask)).unwrap()).narrow(1, 2, 4);
        let r = tch::no_grad(|| m.forward(&right, Some(&right_mask)).unwrap()).narrow(1, 0, 4);
        assert!(plain.allclose(&l, 1e-5, 1e-5, false));
        assert!(plain.allclose(&r, 1e-5, 1e-5, false));
    }

    /// Cached steps on host memory (`step.rs`) against the same steps as libtorch operations:
    /// a prefill of rows of different lengths, decode steps, and a verification block of
    /// several tokens per row, on a model with grouped-query attention. (The parity tests
    /// cover attention biases and rope scaling through the engine, which uses this path.)
    #[test]
    fn host_steps_agree_with_libtorch_steps() {
        crate::device::set_cpu_threads(1);
        let cfg = TinyConfig {
            layers: 3,
            hidden: 96,
            heads: 6,
            kv_heads: 2,
            intermediate: 200,
            ..TinyConfig::default()
        };
        let (m, _) = tiny(&cfg, Head::Lm, Device::Cpu).unwrap();
        let run = |libtorch: bool| {
            m.set_libtorch_steps(libtorch);
            let mut cache = m.new_cache(3);
            // A prefill longer than the attention kernel's decode limit, right-padded; only the
            // positions valid in every row are compared (what pad positions compute is not
            // specified).
            let prompt = Tensor::arange_start(3, 63, (Kind::Int64, Device::Cpu)).reshape([3, 20]);
            let prefill = m.forward_cached(&mut cache, &prompt, &[20, 7, 13]).unwrap();
            let mut outs = vec![prefill.narrow(1, 0, 7)];
            for step in 0..4i64 {
                let ids = Tensor::from_slice(&[step + 60, step + 70, step + 80]).unsqueeze(1);
                outs.push(m.forward_cached(&mut cache, &ids, &[1, 1, 1]).unwrap());
            }
            let block = Tensor::arange_start(100, 112, (Kind::Int64, Device::Cpu)).reshape([3, 4]);
            outs.push(m.forward_cached(&mut cache, &block, &[4, 4, 4]).unwrap());
            m.set_libtorch_steps(false);
            (outs, cache.lens().to_vec())
        };
        let (host, host_lens) = run(false);
        let (lib, lib_lens) = run(true);
        assert_eq!(host_lens, lib_lens);
        for (i, (h, l)) in host.iter().zip(&lib).enumerate() {
            assert_eq!(h.size(), l.size());
            let diff = (h - l).abs().max().double_value(&[]);
            assert!(
                diff < 1e-4,
                "call {i}: host and libtorch steps differ by {diff}"
            );
        }
    }

    /// The fused causal attention CUDA uses (libtorch's `scaled_dot_product_attention` with
    /// `is_causal` and grouped-query heads, no mask), run here on the CPU, agrees with the
    /// masked path: right-padded whole sequences (positions valid in every row), unpadded
    /// ones, and a prefill into a fresh cache. Left padding keeps the mask.
    #[test]
    fn fused_causal_attention_agrees_with_the_masked_path() {
        crate::device::set_cpu_threads(1);
        let cfg = TinyConfig {
            layers: 2,
            hidden: 96,
            heads: 6,
            kv_heads: 2,
            intermediate: 200,
            ..TinyConfig::default()
        };
        let (m, _) = tiny(&cfg, Head::Lm, Device::Cpu).unwrap();
        let ids = Tensor::arange_start(3, 39, (Kind::Int64, Device::Cpu)).reshape([2, 18]);
        let mut mask = vec![1i64; 36];
        for x in &mut mask[18 + 11..] {
            *x = 0;
        }
        let mask = Tensor::from_slice(&mask).reshape([2, 18]);
        let run = |fused: bool| {
            m.set_fused_attention(fused);
            m.set_libtorch_steps(true);
            let padded = tch::no_grad(|| m.forward(&ids, Some(&mask)).unwrap());
            let plain = tch::no_grad(|| m.forward(&ids, None).unwrap());
            let mut cache = m.new_cache(2);
            let prefill = m.forward_cached(&mut cache, &ids, &[18, 11]).unwrap();
            m.set_fused_attention(false);
            m.set_libtorch_steps(false);
            (padded, plain, prefill)
        };
        let (a, b, c) = run(true);
        let (x, y, z) = run(false);
        let close = |p: &Tensor, q: &Tensor, what: &str| {
            let d = (p - q).abs().max().double_value(&[]);
            assert!(d < 1e-5, "{what}: fused and masked differ by {d}");
        };
        // Row 1's pad positions compute different things on the two paths; only real ones.
        close(&a.get(0), &x.get(0), "right-padded row 0");
        close(
            &a.get(1).narrow(0, 0, 11),
            &x.get(1).narrow(0, 0, 11),
            "right-padded row 1",
        );
        close(&b, &y, "unpadded");
        close(&c.get(0), &z.get(0), "prefill row 0");
        close(
            &c.get(1).narrow(0, 0, 11),
            &z.get(1).narrow(0, 0, 11),
            "prefill row 1",
        );
    }

    #[test]
    fn cache_rollback_recomputes_the_same_logits() {
        crate::device::set_cpu_threads(1);
        let (m, _) = tiny(&TinyConfig::default(), Head::Lm, Device::Cpu).unwrap();
        let mut cache = m.new_cache(1);
        let prompt = Tensor::from_slice(&[256i64, 10, 20, 30]).unsqueeze(0);
        let _ = m.forward_cached(&mut cache, &prompt, &[4]).unwrap();
        // Append three drafted tokens at once, then roll back two and re-append one.
        let drafts = Tensor::from_slice(&[40i64, 50, 60]).unsqueeze(0);
        let h3 = m.forward_cached(&mut cache, &drafts, &[3]).unwrap();
        assert_eq!(cache.lens(), &[7]);
        cache.truncate(0, 5).unwrap();
        let h1 = m
            .forward_cached(&mut cache, &Tensor::from_slice(&[50i64]).unsqueeze(0), &[1])
            .unwrap();
        assert!(h3.narrow(1, 1, 1).allclose(&h1, 1e-5, 1e-5, false));
        assert!(cache.truncate(0, 9).is_err());
    }
}
