//! AdamW (Loshchilov & Hutter, 2019) with decoupled weight decay, global gradient-norm
//! clipping, and warm-up followed by a constant, cosine or linear schedule. Written here rather
//! than taken from libtorch's C++ optimizer so that its whole state (moments and step) can be
//! saved in a checkpoint and restored bit for bit.

use std::path::Path;

use braid_ir::graph::{LrSchedule, Optimizer as Config};
use tch::{Kind, Tensor};

use crate::error::{Error, Result};
use crate::models::model::Model;

pub struct AdamW {
    config: Config,
    params: Vec<(String, Tensor)>,
    m: Vec<Tensor>,
    v: Vec<Tensor>,
    /// Optimizer steps taken.
    pub step: i64,
}

impl AdamW {
    pub fn new(model: &Model, config: Config) -> Result<AdamW> {
        let params: Vec<(String, Tensor)> = model
            .named_parameters()
            .into_iter()
            .filter(|(_, t)| t.requires_grad())
            .collect();
        let m = params
            .iter()
            .map(|(_, t)| t.zeros_like().to_kind(Kind::Float))
            .collect();
        let v = params
            .iter()
            .map(|(_, t)| t.zeros_like().to_kind(Kind::Float))
            .collect();
        Ok(AdamW {
            config,
            params,
            m,
            v,
            step: 0,
        })
    }

    /// The trained parameters, in a fixed order (shallow copies: the same storage, so their
    /// gradients are the parameters' own).
    pub fn parameters(&self) -> Vec<Tensor> {
        self.params.iter().map(|(_, t)| t.shallow_clone()).collect()
    }

    /// The learning rate of optimizer step `step` (0-based) of `total`.
    pub fn lr_at(&self, step: i64, total: i64) -> f64 {
        lr_at(&self.config, step, total)
    }

    pub fn zero_grad(&self) {
        for (_, p) in &self.params {
            let mut g = p.grad();
            if g.defined() {
                let _ = g.zero_();
            }
        }
    }

    /// The global L2 norm of the gradients.
    pub fn grad_norm(&self) -> f64 {
        let mut sq = 0.0;
        for (_, p) in &self.params {
            let g = p.grad();
            if g.defined() {
                sq += g
                    .to_kind(Kind::Float)
                    .pow_tensor_scalar(2)
                    .sum(Kind::Float)
                    .double_value(&[]);
            }
        }
        sq.sqrt()
    }

    /// Clips gradients to `max_norm` (if given), takes one step at `lr`, and returns the norm
    /// before clipping. A non-finite norm skips the update (and is returned, to be logged).
    pub fn step(&mut self, lr: f64, max_norm: Option<f64>) -> f64 {
        let norm = self.grad_norm();
        if !norm.is_finite() {
            self.zero_grad();
            return norm;
        }
        let scale = match max_norm {
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
            for (i, (_, p)) in self.params.iter().enumerate() {
                let g = p.grad();
                if !g.defined() {
                    continue;
                }
                let g = g.to_kind(Kind::Float) * scale;
                let m = &mut self.m[i];
                let new_m = &*m * b1 + &g * (1.0 - b1);
                m.copy_(&new_m);
                let v = &mut self.v[i];
                let new_v = &*v * b2 + g.square() * (1.0 - b2);
                v.copy_(&new_v);
                let update = (&new_m / bc1) / ((&new_v / bc2).sqrt() + eps);
                let pf = p.to_kind(Kind::Float);
                let new_p = &pf * (1.0 - lr * wd) - update * lr;
                let mut dst = p.shallow_clone();
                dst.copy_(&new_p.to_kind(p.kind()));
            }
        });
        self.zero_grad();
        norm
    }

    /// Writes the moments and the step count to a safetensors file.
    pub fn save(&self, path: &Path) -> Result<()> {
        let mut named: Vec<(String, Tensor)> = Vec::new();
        for (i, (name, _)) in self.params.iter().enumerate() {
            named.push((format!("m.{name}"), self.m[i].shallow_clone()));
            named.push((format!("v.{name}"), self.v[i].shallow_clone()));
        }
        named.push(("step".into(), Tensor::from_slice(&[self.step])));
        Tensor::write_safetensors(&named, path)
            .map_err(|e| Error::file(path, format!("cannot write optimizer state: {e}")))
    }

    /// Restores what `save` wrote; every parameter's moments must be present with its shape.
    pub fn load(&mut self, path: &Path) -> Result<()> {
        let tensors = Tensor::read_safetensors(path)
            .map_err(|e| Error::file(path, format!("cannot read optimizer state: {e}")))?;
        let map: std::collections::HashMap<String, Tensor> = tensors.into_iter().collect();
        let get = |key: &str, like: &Tensor| -> Result<Tensor> {
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
        };
        for (i, (name, p)) in self.params.iter().enumerate() {
            let m = get(&format!("m.{name}"), p)?;
            let v = get(&format!("v.{name}"), p)?;
            tch::no_grad(|| {
                self.m[i].copy_(&m);
                self.v[i].copy_(&v);
            });
        }
        let step = map
            .get("step")
            .and_then(|t| i64::try_from(t.reshape([-1]).get(0)).ok())
            .ok_or_else(|| Error::file(path, "missing `step`"))?;
        self.step = step;
        Ok(())
    }
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

    /// One step on a known gradient against the AdamW formulas written out: with m = 0.1 g,
    /// v = 0.001 g², bias corrections 0.1 and 0.001, the update is g / (|g| + eps') = sign(g).
    #[test]
    fn first_step_matches_the_formula() {
        crate::device::set_cpu_threads(1);
        let (m, _) = tiny(
            &TinyConfig {
                layers: 1,
                hidden: 8,
                heads: 2,
                kv_heads: 1,
                intermediate: 16,
                ..TinyConfig::default()
            },
            crate::models::model::Head::Lm,
            Device::Cpu,
        )
        .unwrap();
        let mut c = config(LrSchedule::Constant, 0);
        c.weight_decay = 0.1;
        let mut opt = AdamW::new(&m, c).unwrap();
        let (name, p) = (opt.params[0].0.clone(), opt.params[0].1.shallow_clone());
        let before = p.detach().copy();
        let loss = (&p * 3.0).sum(Kind::Float);
        loss.backward();
        let norm = opt.step(0.01, None);
        let n: f64 = p.numel() as f64;
        assert!((norm - (9.0 * n).sqrt()).abs() < 1e-3, "{name}: {norm}");
        // p1 = p0 (1 - lr wd) - lr * sign(3)
        let expect = &before * (1.0 - 0.01 * 0.1) - 0.01;
        let diff = (p.detach() - expect).abs().max().double_value(&[]);
        assert!(diff < 1e-6, "{diff}");
        // Clipping scales the gradient but Adam normalises it: the norm is still reported.
        let loss = (&p * 3.0).sum(Kind::Float);
        loss.backward();
        let n2 = opt.step(0.01, Some(1.0));
        assert!((n2 - (9.0 * n).sqrt()).abs() < 1e-3);
        assert_eq!(opt.step, 2);
    }
}
