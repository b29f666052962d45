//! AdamW (Loshchilov & Hutter, 2019) with decoupled weight decay, global gradient-norm
//! clipping, and warm-up followed by a constant, cosine or linear schedule, with mixed
//! precision. Written here rather than taken from libtorch's C++ optimizer so that its whole
//! state (moments, step, master weights, loss scale) can be saved in a checkpoint and restored
//! bit for bit.
//!
//! **Mixed precision.** The optimizer's state is f32 whatever the model's dtype: the moments,
//! and, for a bf16 or f16 model, an f32 master copy of every trained parameter. The model's
//! own parameters are the low-precision copy that forward and backward run on; after every
//! micro-batch's backward, [`AdamW::accumulate`] adds their gradients into f32 accumulators,
//! and [`AdamW::step`] updates the masters and rounds them into the model's parameters. An
//! update smaller than half a bf16 step (about 0.4 % of a weight) would round away if the
//! optimizer wrote into bf16 weights directly; the master keeps it, and the low-precision copy
//! changes once the updates add up. For an f32 model the master is the parameter itself.
//!
//! **Loss scaling (f16).** f16's smallest normal number is 6e-5, so small gradients flush to
//! zero. With an f16 model the loss is multiplied by a scale before the backward
//! ([`AdamW::scale_loss`]) and the gradients are divided by it before the update; a step whose
//! gradients overflowed (inf or NaN) is skipped — no parameter, moment or step count changes —
//! and the scale halves; after 2000 steps without overflow it doubles (PyTorch's
//! `GradScaler` policy and defaults). Skipped steps of every dtype are counted.

use std::collections::HashMap;
use std::path::Path;

use braid_ir::graph::{LrSchedule, Optimizer as Config};
use tch::{Kind, Tensor};

use crate::error::{Error, Result};
use crate::models::model::Model;
use crate::models::save::write_safetensors;

/// The loss scale an f16 model starts with (PyTorch's `GradScaler` default, 2^16).
pub const INITIAL_LOSS_SCALE: f64 = 65536.0;
/// Steps without overflow after which the loss scale doubles.
pub const LOSS_SCALE_GROWTH_INTERVAL: i64 = 2000;

/// One trained parameter.
struct Param {
    name: String,
    /// The model's tensor (its dtype): forward and backward run on it, gradients land on it.
    model: Tensor,
    /// The f32 master the update is applied to: `model` itself when the model is f32.
    master: Tensor,
    /// f32 gradient summed over a step's micro-batches (bf16 and f16 models only).
    grad: Option<Tensor>,
}

/// f16's dynamic loss scale.
#[derive(Debug, Clone, Copy, PartialEq)]
struct LossScaler {
    scale: f64,
    /// Steps since the last overflow or growth.
    good_steps: i64,
}

/// What one optimizer step did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepOutcome {
    /// The global gradient norm before clipping (after unscaling).
    pub norm: f64,
    /// The gradients were not finite: nothing was updated.
    pub skipped: bool,
}

pub struct AdamW {
    config: Config,
    params: Vec<Param>,
    m: Vec<Tensor>,
    v: Vec<Tensor>,
    scaler: Option<LossScaler>,
    /// Optimizer steps taken.
    pub step: i64,
    /// Optimizer steps skipped for non-finite gradients, over the whole run.
    pub skipped: i64,
}

impl AdamW {
    /// An optimizer for `model`'s trainable parameters. An f32 model's parameters are their
    /// own masters; a bf16 or f16 model gets f32 masters equal to its parameters (use
    /// [`AdamW::with_masters`] when full-precision values exist, as when the model was loaded
    /// in f32 and converted).
    pub fn new(model: &Model, config: Config) -> Result<AdamW> {
        let masters = tch::no_grad(|| {
            model
                .named_parameters()
                .into_iter()
                .map(|(name, t)| {
                    let master = if t.kind() == Kind::Float {
                        t.shallow_clone()
                    } else {
                        t.detach().to_kind(Kind::Float)
                    };
                    (name, master)
                })
                .collect::<Vec<_>>()
        });
        AdamW::with_masters(model, config, masters)
    }

    /// An optimizer whose f32 masters are `masters` (by parameter name, as
    /// `Model::convert_keeping_masters` returns them); every trainable parameter needs one of
    /// its shape.
    pub fn with_masters(
        model: &Model,
        config: Config,
        masters: Vec<(String, Tensor)>,
    ) -> Result<AdamW> {
        let mut by_name: std::collections::BTreeMap<String, Tensor> = masters.into_iter().collect();
        let mut params = Vec::new();
        for (name, t) in model.named_parameters() {
            if !t.requires_grad() {
                continue;
            }
            let master = by_name.remove(&name).ok_or_else(|| {
                Error::invalid("optimizer", format!("no master weight for `{name}`"))
            })?;
            if master.size() != t.size() || master.kind() != Kind::Float {
                return Err(Error::invalid(
                    "optimizer",
                    format!(
                        "the master of `{name}` is {:?} {:?}; the parameter is {:?}",
                        master.kind(),
                        master.size(),
                        t.size()
                    ),
                ));
            }
            let low = t.kind() != Kind::Float;
            let grad = low.then(|| t.zeros_like().to_kind(Kind::Float));
            params.push(Param {
                name,
                model: t,
                master,
                grad,
            });
        }
        let zeros = |p: &Param| p.master.zeros_like();
        let m = params.iter().map(zeros).collect();
        let v = params.iter().map(zeros).collect();
        let scaler = (model.kind() == Kind::Half).then_some(LossScaler {
            scale: INITIAL_LOSS_SCALE,
            good_steps: 0,
        });
        Ok(AdamW {
            config,
            params,
            m,
            v,
            scaler,
            step: 0,
            skipped: 0,
        })
    }

    /// The trained parameters (the model's tensors), in a fixed order (shallow copies: the
    /// same storage, so their gradients are the parameters' own).
    pub fn parameters(&self) -> Vec<Tensor> {
        self.params
            .iter()
            .map(|p| p.model.shallow_clone())
            .collect()
    }

    /// A bf16 or f16 model's f32 gradient accumulators, in the order of `parameters` (what
    /// data-parallel replicas sum before a step); `None` for an f32 model, whose gradients are
    /// its parameters' own.
    pub fn accumulators(&self) -> Option<Vec<Tensor>> {
        self.params
            .iter()
            .map(|p| p.grad.as_ref().map(Tensor::shallow_clone))
            .collect()
    }

    /// The learning rate of optimizer step `step` (0-based) of `total`.
    pub fn lr_at(&self, step: i64, total: i64) -> f64 {
        lr_at(&self.config, step, total)
    }

    /// Whether the masters are separate f32 copies (a bf16 or f16 model).
    pub fn has_masters(&self) -> bool {
        self.params.iter().any(|p| p.grad.is_some())
    }

    /// The current loss scale: 1 except for f16 models.
    pub fn loss_scale(&self) -> f64 {
        self.scaler.map_or(1.0, |s| s.scale)
    }

    /// Sets the loss scale (f16 models only; tests force overflows with it).
    pub fn set_loss_scale(&mut self, scale: f64) {
        if let Some(s) = self.scaler.as_mut() {
            s.scale = scale;
        }
    }

    /// The loss to call `backward` on: `loss` times the loss scale (f16), else `loss` itself.
    pub fn scale_loss(&self, loss: &Tensor) -> Tensor {
        match self.scaler {
            Some(s) => loss * s.scale,
            None => loss.shallow_clone(),
        }
    }

    /// Moves the gradients a backward left on a low-precision model's parameters into the f32
    /// accumulators (and zeroes them there), so that summing micro-batches does not round in
    /// bf16 or f16. Nothing to do for an f32 model, whose gradients accumulate in f32 already.
    pub fn accumulate(&mut self) {
        tch::no_grad(|| {
            for p in &mut self.params {
                let Some(acc) = p.grad.as_mut() else {
                    continue;
                };
                let mut g = p.model.grad();
                if g.defined() {
                    let _ = acc.f_add_(&g.to_kind(Kind::Float));
                    let _ = g.zero_();
                }
            }
        });
    }

    /// The f32 gradient of parameter `i`, not yet unscaled, or `None` when it has none.
    fn raw_grad(&self, i: usize) -> Option<Tensor> {
        let p = &self.params[i];
        match &p.grad {
            Some(acc) => Some(acc.shallow_clone()),
            None => {
                let g = p.model.grad();
                g.defined().then(|| g.to_kind(Kind::Float))
            }
        }
    }

    pub fn zero_grad(&self) {
        tch::no_grad(|| {
            for p in &self.params {
                let mut g = p.model.grad();
                if g.defined() {
                    let _ = g.zero_();
                }
                if let Some(acc) = &p.grad {
                    let _ = acc.shallow_clone().zero_();
                }
            }
        });
    }

    /// The global L2 norm of the gradients (unscaled), with one device synchronisation.
    pub fn grad_norm(&self) -> f64 {
        let inv = 1.0 / self.loss_scale();
        let squares: Vec<Tensor> = (0..self.params.len())
            .filter_map(|i| self.raw_grad(i))
            .map(|g| g.square().sum(Kind::Float))
            .collect();
        if squares.is_empty() {
            return 0.0;
        }
        let total = Tensor::stack(&squares, 0)
            .sum(Kind::Double)
            .double_value(&[]);
        total.sqrt() * inv
    }

    /// The sum of the squares of the gradients (unscaled), each parameter's weighted by
    /// `weight(name)`: what a model cut over several ranks sums over them, counting a
    /// parameter that several ranks hold once (their weights summing to one), before the
    /// square root that gives the norm (`step_with_norm`).
    pub fn grad_squares(&self, weight: &dyn Fn(&str) -> f64) -> f64 {
        let inv = 1.0 / self.loss_scale();
        let mut total = 0.0;
        for i in 0..self.params.len() {
            let w = weight(&self.params[i].name);
            if w == 0.0 {
                continue;
            }
            if let Some(g) = self.raw_grad(i)
                && g.numel() > 0
            {
                total += w * g.square().sum(Kind::Double).double_value(&[]);
            }
        }
        total * inv * inv
    }

    /// Clips gradients to `max_norm` (if given), takes one step at `lr`, and returns the norm
    /// before clipping. Non-finite gradients skip the step: no parameter, moment or step count
    /// changes, the skip is counted, and an f16 model's loss scale halves.
    pub fn step(&mut self, lr: f64, max_norm: Option<f64>) -> StepOutcome {
        let norm = self.grad_norm();
        self.step_with_norm(lr, max_norm, norm)
    }

    /// `step` with the gradient norm given: the norm over every rank a model is cut across
    /// (from `grad_squares`), so that all of them clip, and skip, alike.
    pub fn step_with_norm(&mut self, lr: f64, max_norm: Option<f64>, norm: f64) -> StepOutcome {
        let scale_used = self.loss_scale();
        if !norm.is_finite() {
            self.zero_grad();
            self.skipped += 1;
            if let Some(s) = self.scaler.as_mut() {
                s.scale *= 0.5;
                s.good_steps = 0;
            }
            return StepOutcome {
                norm,
                skipped: true,
            };
        }
        if let Some(s) = self.scaler.as_mut() {
            s.good_steps += 1;
            if s.good_steps >= LOSS_SCALE_GROWTH_INTERVAL {
                s.scale *= 2.0;
                s.good_steps = 0;
            }
        }
        let unscale = 1.0 / scale_used;
        let clip = match max_norm {
            Some(c) if c > 0.0 && norm > c => c / (norm + 1e-6),
            _ => 1.0,
        };
        self.step += 1;
        let t = self.step as f64;
        let (b1, b2) = (self.config.beta1, self.config.beta2);
        let bc1 = 1.0 - b1.powf(t);
        let bc2 = 1.0 - b2.powf(t);
        let (eps, wd) = (self.config.eps, self.config.weight_decay);
        tch::no_grad(|| {
            for i in 0..self.params.len() {
                let Some(g) = self.raw_grad(i) else {
                    continue;
                };
                let g = g * (unscale * clip);
                let m = &mut self.m[i];
                let new_m = &*m * b1 + &g * (1.0 - b1);
                m.copy_(&new_m);
                let v = &mut self.v[i];
                let new_v = &*v * b2 + g.square() * (1.0 - b2);
                v.copy_(&new_v);
                let update = (&new_m / bc1) / ((&new_v / bc2).sqrt() + eps);
                let p = &self.params[i];
                let new_p = &p.master * (1.0 - lr * wd) - update * lr;
                let mut master = p.master.shallow_clone();
                master.copy_(&new_p);
                if p.grad.is_some() {
                    // Refresh the low-precision copy the next forward runs on.
                    let mut low = p.model.shallow_clone();
                    low.copy_(&master);
                }
            }
        });
        self.zero_grad();
        StepOutcome {
            norm,
            skipped: false,
        }
    }

    /// Writes the moments, the step and skip counts and the loss scale to a safetensors file
    /// (the f32 masters go to their own file, [`AdamW::save_masters`]).
    pub fn save(&self, path: &Path) -> Result<()> {
        let mut named: Vec<(String, Tensor)> = Vec::new();
        for (i, p) in self.params.iter().enumerate() {
            named.push((format!("m.{}", p.name), self.m[i].shallow_clone()));
            named.push((format!("v.{}", p.name), self.v[i].shallow_clone()));
        }
        named.push(("step".into(), Tensor::from_slice(&[self.step])));
        named.push(("skipped".into(), Tensor::from_slice(&[self.skipped])));
        if let Some(s) = self.scaler {
            named.push(("loss_scale".into(), Tensor::from_slice(&[s.scale])));
            named.push((
                "loss_scale_good_steps".into(),
                Tensor::from_slice(&[s.good_steps]),
            ));
        }
        write_safetensors(path, &named)
    }

    /// Restores what `save` wrote; every parameter's moments must be present with its shape.
    pub fn load(&mut self, path: &Path) -> Result<()> {
        let map = read_tensors(path, "optimizer state")?;
        for i in 0..self.params.len() {
            let name = self.params[i].name.clone();
            let like = self.params[i].master.shallow_clone();
            let m = get_like(&map, path, &format!("m.{name}"), &like)?;
            let v = get_like(&map, path, &format!("v.{name}"), &like)?;
            tch::no_grad(|| {
                self.m[i].copy_(&m);
                self.v[i].copy_(&v);
            });
        }
        self.step = scalar_i64(&map, path, "step")?;
        self.skipped = scalar_i64(&map, path, "skipped")?;
        if let Some(s) = self.scaler.as_mut() {
            s.scale = map
                .get("loss_scale")
                .and_then(|t| f64::try_from(t.reshape([-1]).get(0)).ok())
                .ok_or_else(|| Error::file(path, "missing `loss_scale` (an f16 model's)"))?;
            s.good_steps = scalar_i64(&map, path, "loss_scale_good_steps")?;
        }
        Ok(())
    }

    /// Writes the f32 master weights under the parameters' Hugging Face names (a bf16 or f16
    /// model's checkpoint; an f32 model's masters are its saved weights).
    pub fn save_masters(&self, path: &Path) -> Result<()> {
        let named: Vec<(String, Tensor)> = self
            .params
            .iter()
            .map(|p| (p.name.clone(), p.master.shallow_clone()))
            .collect();
        write_safetensors(path, &named)
    }

    /// Restores the f32 masters `save_masters` wrote and rounds them into the model's
    /// parameters, so the model computes exactly what it computed when they were saved.
    pub fn load_masters(&mut self, path: &Path) -> Result<()> {
        let map = read_tensors(path, "master weights")?;
        for p in &self.params {
            let t = get_like(&map, path, &p.name, &p.master)?;
            tch::no_grad(|| {
                let mut master = p.master.shallow_clone();
                master.copy_(&t);
                let mut low = p.model.shallow_clone();
                low.copy_(&master);
            });
        }
        Ok(())
    }

    /// The f32 master weights by name (the parameters themselves for an f32 model).
    pub fn masters(&self) -> Vec<(String, Tensor)> {
        self.params
            .iter()
            .map(|p| (p.name.clone(), p.master.shallow_clone()))
            .collect()
    }
}

fn read_tensors(path: &Path, what: &str) -> Result<HashMap<String, Tensor>> {
    let tensors = Tensor::read_safetensors(path)
        .map_err(|e| Error::file(path, format!("cannot read {what}: {e}")))?;
    Ok(tensors.into_iter().collect())
}

/// Tensor `key` of a file, checked against `like`'s shape, as f32 on `like`'s device.
fn get_like(
    map: &HashMap<String, Tensor>,
    path: &Path,
    key: &str,
    like: &Tensor,
) -> Result<Tensor> {
    let t = map
        .get(key)
        .ok_or_else(|| Error::file(path, format!("missing `{key}`")))?;
    if t.size() != like.size() {
        return Err(Error::file(
            path,
            format!(
                "`{key}` has shape {:?}, the model needs {:?}",
                t.size(),
                like.size()
            ),
        ));
    }
    Ok(t.to_kind(Kind::Float).to_device(like.device()))
}

fn scalar_i64(map: &HashMap<String, Tensor>, path: &Path, key: &str) -> Result<i64> {
    map.get(key)
        .and_then(|t| i64::try_from(t.reshape([-1]).get(0)).ok())
        .ok_or_else(|| Error::file(path, format!("missing `{key}`")))
}

/// Linear warm-up over `warmup` steps, then the schedule down to zero at `total`.
pub fn lr_at(c: &Config, step: i64, total: i64) -> f64 {
    if c.warmup > 0 && step < c.warmup {
        return c.lr * (step + 1) as f64 / c.warmup as f64;
    }
    let span = (total - c.warmup).max(1) as f64;
    let progress = ((step - c.warmup) as f64 / span).clamp(0.0, 1.0);
    match c.schedule {
        LrSchedule::Cosine => c.lr * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos()),
        LrSchedule::Linear => c.lr * (1.0 - progress),
        LrSchedule::Constant => c.lr,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::tiny::{TinyConfig, tiny};
    use tch::Device;

    fn config(schedule: LrSchedule, warmup: i64) -> Config {
        Config {
            lr: 1e-3,
            weight_decay: 0.0,
            eps: 1e-8,
            beta1: 0.9,
            beta2: 0.999,
            warmup,
            schedule,
        }
    }

    #[test]
    fn schedules() {
        let c = config(LrSchedule::Cosine, 2);
        assert!((lr_at(&c, 0, 10) - 5e-4).abs() < 1e-12);
        assert!((lr_at(&c, 1, 10) - 1e-3).abs() < 1e-12);
        assert!((lr_at(&c, 2, 10) - 1e-3).abs() < 1e-12);
        assert!((lr_at(&c, 6, 10) - 5e-4).abs() < 1e-12);
        assert!(lr_at(&c, 10, 10).abs() < 1e-12);
        let l = config(LrSchedule::Linear, 0);
        assert!((lr_at(&l, 5, 10) - 5e-4).abs() < 1e-12);
        assert!((lr_at(&config(LrSchedule::Constant, 0), 9, 10) - 1e-3).abs() < 1e-12);
    }

    fn small() -> TinyConfig {
        TinyConfig {
            layers: 1,
            hidden: 8,
            heads: 2,
            kv_heads: 1,
            intermediate: 16,
            ..TinyConfig::default()
        }
    }

    /// A bf16 (or f16) copy of the f32 tiny model and an optimizer whose masters are the f32
    /// weights, as the executor builds trained low-precision models.
    fn mixed(kind: Kind, c: Config) -> (crate::models::model::Model, AdamW) {
        let (mut m, _) = tiny(&small(), crate::models::model::Head::Lm, Device::Cpu).unwrap();
        let masters = m.convert_keeping_masters(kind).unwrap();
        let opt = AdamW::with_masters(&m, c, masters).unwrap();
        (m, opt)
    }

    /// One step on a known gradient against the AdamW formulas written out: with m = 0.1 g,
    /// v = 0.001 g², bias corrections 0.1 and 0.001, the update is g / (|g| + eps') = sign(g).
    #[test]
    fn first_step_matches_the_formula() {
        crate::device::set_cpu_threads(1);
        let (m, _) = tiny(&small(), crate::models::model::Head::Lm, Device::Cpu).unwrap();
        let mut c = config(LrSchedule::Constant, 0);
        c.weight_decay = 0.1;
        let mut opt = AdamW::new(&m, c).unwrap();
        assert!(!opt.has_masters());
        let (name, p) = (
            opt.params[0].name.clone(),
            opt.params[0].model.shallow_clone(),
        );
        let before = p.detach().copy();
        let loss = (&p * 3.0).sum(Kind::Float);
        loss.backward();
        let out = opt.step(0.01, None);
        assert!(!out.skipped);
        let n: f64 = p.numel() as f64;
        assert!(
            (out.norm - (9.0 * n).sqrt()).abs() < 1e-3,
            "{name}: {}",
            out.norm
        );
        // p1 = p0 (1 - lr wd) - lr * sign(3)
        let expect = &before * (1.0 - 0.01 * 0.1) - 0.01;
        let diff = (p.detach() - expect).abs().max().double_value(&[]);
        assert!(diff < 1e-6, "{diff}");
        // Clipping scales the gradient but Adam normalises it: the norm is still reported.
        let loss = (&p * 3.0).sum(Kind::Float);
        loss.backward();
        let n2 = opt.step(0.01, Some(1.0)).norm;
        assert!((n2 - (9.0 * n).sqrt()).abs() < 1e-3);
        assert_eq!(opt.step, 2);
    }

    /// A bf16 model trains its f32 masters: an update far below bf16's resolution changes the
    /// master (exactly as the f32 formula says) and leaves the bf16 copy where rounding puts
    /// it; once the updates add up, the copy moves too. Writing the update into the bf16
    /// weights directly would lose all of it.
    #[test]
    fn bf16_models_update_f32_masters_and_refresh_their_copy() {
        crate::device::set_cpu_threads(1);
        let lr = 1e-5;
        let (_, mut opt) = mixed(Kind::BFloat16, config(LrSchedule::Constant, 0));
        assert!(opt.has_masters());
        let p = opt.params[0].model.shallow_clone();
        let master0 = opt.params[0].master.copy();
        assert_eq!(p.kind(), Kind::BFloat16);
        for step in 1..=400 {
            (&p * 3.0).sum(Kind::Float).backward();
            opt.accumulate();
            assert!(!opt.step(lr, None).skipped);
            let master = &opt.params[0].master;
            // Adam's steady update with a constant gradient is lr · sign(g) per step.
            let want = &master0 - lr * step as f64;
            let diff = (master - want).abs().max().double_value(&[]);
            assert!(
                diff < 1e-7 * step as f64,
                "step {step}: master off by {diff}"
            );
            assert!(
                p.equal(&master.to_kind(Kind::BFloat16)),
                "the copy is the master rounded"
            );
        }
        // 400 steps of 1e-5 moved the weights by 4e-3: most bf16 values changed.
        let changed = p
            .to_kind(Kind::Float)
            .ne_tensor(&master0.to_kind(Kind::BFloat16).to_kind(Kind::Float))
            .to_kind(Kind::Float)
            .mean(Kind::Float)
            .double_value(&[]);
        assert!(changed > 0.5, "only {changed} of the bf16 copy changed");
    }

    /// Micro-batch gradients of a bf16 model are summed in f32: two accumulated backwards give
    /// the gradient of their sum.
    #[test]
    fn low_precision_gradients_accumulate_in_f32() {
        crate::device::set_cpu_threads(1);
        let (_, mut opt) = mixed(Kind::BFloat16, config(LrSchedule::Constant, 0));
        let p = opt.params[0].model.shallow_clone();
        (&p * 1.0).sum(Kind::Float).backward();
        opt.accumulate();
        (&p * 2.0 / 1024.0).sum(Kind::Float).backward();
        opt.accumulate();
        let acc = opt.params[0].grad.as_ref().unwrap();
        assert_eq!(acc.kind(), Kind::Float);
        let want = 1.0 + 2.0 / 1024.0; // not representable in bf16 (8 mantissa bits)
        let diff = (acc - want).abs().max().double_value(&[]);
        assert!(diff < 1e-7, "{diff}");
        assert_eq!(p.grad().abs().max().double_value(&[]), 0.0);
    }

    /// f16 with loss scaling: an overflowing backward skips the step — no parameter, master,
    /// moment or step count changes — counts the skip and halves the scale; the next step,
    /// without overflow, updates, and its gradients are unscaled.
    #[test]
    fn an_f16_overflow_skips_the_step_and_leaves_the_weights_alone() {
        crate::device::set_cpu_threads(1);
        let (m, mut opt) = mixed(Kind::Half, config(LrSchedule::Constant, 0));
        assert_eq!(opt.loss_scale(), INITIAL_LOSS_SCALE);
        let before: Vec<(String, Tensor)> = m
            .named_parameters()
            .into_iter()
            .map(|(n, t)| (n, t.detach().copy()))
            .collect();
        let masters: Vec<Tensor> = opt.params.iter().map(|p| p.master.copy()).collect();
        let ids = Tensor::from_slice(&[256i64, 1, 2, 3]).unsqueeze(0);
        let loss = |m: &crate::models::model::Model| {
            m.forward(&ids, None)
                .unwrap()
                .to_kind(Kind::Float)
                .log_softmax(-1, Kind::Float)
                .mean(Kind::Float)
        };
        // A scale no f16 gradient survives.
        opt.set_loss_scale(1e30);
        opt.scale_loss(&loss(&m)).backward();
        opt.accumulate();
        let out = opt.step(1e-3, Some(1.0));
        assert!(out.skipped && !out.norm.is_finite(), "{out:?}");
        assert_eq!((opt.step, opt.skipped), (0, 1));
        assert_eq!(opt.loss_scale(), 5e29);
        for ((name, t), (_, b)) in m.named_parameters().iter().zip(&before) {
            assert!(t.equal(b), "{name} changed on a skipped step");
        }
        for (p, b) in opt.params.iter().zip(&masters) {
            assert!(p.master.equal(b), "master of {} changed", p.name);
        }
        assert!(opt.m.iter().all(|m| m.abs().max().double_value(&[]) == 0.0));
        // At the default scale the same loss trains, with the unscaled gradient's norm.
        opt.set_loss_scale(INITIAL_LOSS_SCALE);
        let l = loss(&m);
        opt.scale_loss(&l).backward();
        opt.accumulate();
        let out = opt.step(1e-3, Some(1.0));
        assert!(!out.skipped, "{out:?}");
        assert_eq!((opt.step, opt.skipped), (1, 1));
        let (m32, _) = tiny(&small(), crate::models::model::Head::Lm, Device::Cpu).unwrap();
        loss(&m32).backward();
        let norm32: f64 = m32
            .named_parameters()
            .iter()
            .map(|(_, t)| t.grad().square().sum(Kind::Double).double_value(&[]))
            .sum::<f64>()
            .sqrt();
        assert!(
            (out.norm / norm32 - 1.0).abs() < 0.05,
            "f16 norm {} vs f32 {norm32}",
            out.norm
        );
        assert!(
            m.named_parameters()
                .iter()
                .zip(&before)
                .any(|((_, t), (_, b))| !t.equal(b))
        );
    }

    /// The whole optimizer state survives a save and a load: moments, counts, loss scale and
    /// masters, with the model's copy rounded from the restored masters.
    #[test]
    fn state_and_masters_round_trip_through_files() {
        crate::device::set_cpu_threads(1);
        let dir = std::env::temp_dir().join(format!("braid-optim-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (m, mut opt) = mixed(Kind::Half, config(LrSchedule::Constant, 0));
        let p = opt.params[1].model.shallow_clone();
        (&p * 0.5).sum(Kind::Float).backward();
        opt.accumulate();
        opt.step(1e-3, None);
        opt.set_loss_scale(1024.0);
        opt.save(&dir.join("opt.safetensors")).unwrap();
        opt.save_masters(&dir.join("master.safetensors")).unwrap();
        let (m2, mut opt2) = mixed(Kind::Half, config(LrSchedule::Constant, 0));
        opt2.load(&dir.join("opt.safetensors")).unwrap();
        opt2.load_masters(&dir.join("master.safetensors")).unwrap();
        assert_eq!((opt2.step, opt2.skipped, opt2.loss_scale()), (1, 0, 1024.0));
        for (a, b) in opt.params.iter().zip(&opt2.params) {
            assert!(a.master.equal(&b.master), "{}", a.name);
        }
        for ((n, a), (_, b)) in m.named_parameters().iter().zip(m2.named_parameters()) {
            assert!(a.equal(&b), "{n}");
        }
        for (a, b) in opt.m.iter().zip(&opt2.m) {
            assert!(a.equal(b));
        }
        let err = opt2
            .load(&dir.join("missing.safetensors"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("missing.safetensors"), "{err}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
