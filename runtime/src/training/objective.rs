//! The evaluator of objectives (`braid_ir::loss`): a loss written in the language, lowered and
//! specialised by the compiler, evaluated on one micro-batch as libtorch operations with
//! autograd.
//!
//! A micro-batch is laid out flat: per-token values are `[T]` tensors (token `j` belongs to
//! sample `sample_of[j]`), per-sample values `[N]` tensors, constants stay `f64` on the host
//! (applied as tensor-scalar operations, so that a constant is rounded to the working precision
//! exactly as a hand-written `tensor * 0.2` is), and the loss is a 0-dimensional tensor. The
//! working precision is that of the model's outputs (f32 in training); inputs must already be
//! in it. Every `BatchSum` divides by a count of the *mini-batch* ([`Layout`]), so the
//! micro-batches' losses add up to the mini-batch's and accumulated gradients are its
//! gradient. The only sources of gradients are the model's outputs.
//!
//! Each operation is evaluated as the corresponding hand-written libtorch expression would be,
//! in the same order (see each arm), so that the standard library's losses give the numbers the
//! hand-written losses they replace gave. This module knows objectives, not plans.

use tch::{Kind, Tensor};

use braid_ir::loss::{
    BinOp, Count, LayoutValue, Level, ModelOutput, Objective, Op, ReduceOp, UnOp, const_value,
};

use crate::error::{Error, Result};

/// The layout of a micro-batch inside its mini-batch.
#[derive(Debug)]
pub struct Layout {
    /// Per token: the index of its sample in the micro-batch (int64).
    pub sample_of: Tensor,
    /// Per sample: its number of tokens.
    pub len: Tensor,
    /// Per token: 1 / its sample's number of tokens.
    pub inv_len: Tensor,
    /// Per token: 1 / the number of tokens of the mini-batch's samples of its group.
    pub inv_group_tokens: Tensor,
    /// Per sample: 1 / the number of the mini-batch's samples of its group.
    pub inv_group_samples: Tensor,
    /// Tokens, samples and groups of the whole mini-batch.
    pub minibatch_tokens: f64,
    pub minibatch_samples: f64,
    pub minibatch_groups: f64,
}

impl Layout {
    /// The layout of the micro-batch `lens` (its samples' token counts, with their groups in
    /// `groups`) inside a mini-batch whose samples have `mb_lens` tokens and `mb_groups`
    /// groups. Tensors are f64 on the CPU; [`evaluate`] converts them to the working
    /// precision (rounding each once) and moves them where the model is.
    pub fn new(lens: &[usize], groups: &[usize], mb_lens: &[usize], mb_groups: &[usize]) -> Layout {
        let mut group_tokens: std::collections::BTreeMap<usize, usize> = Default::default();
        let mut group_samples: std::collections::BTreeMap<usize, usize> = Default::default();
        for (&l, &g) in mb_lens.iter().zip(mb_groups) {
            *group_tokens.entry(g).or_default() += l;
            *group_samples.entry(g).or_default() += 1;
        }
        let mut sample_of = Vec::new();
        let mut inv = Vec::new();
        let mut inv_gt = Vec::new();
        let mut inv_gs = Vec::new();
        for (i, (&l, g)) in lens.iter().zip(groups).enumerate() {
            let gt = group_tokens.get(g).copied().unwrap_or(l).max(1) as f64;
            for _ in 0..l {
                sample_of.push(i as i64);
                inv.push(1.0 / l as f64);
                inv_gt.push(1.0 / gt);
            }
            let gs = group_samples.get(g).copied().unwrap_or(1).max(1) as f64;
            inv_gs.push(1.0 / gs);
        }
        let lens_f: Vec<f64> = lens.iter().map(|&l| l as f64).collect();
        Layout {
            sample_of: Tensor::from_slice(&sample_of),
            len: Tensor::from_slice(&lens_f),
            inv_len: Tensor::from_slice(&inv),
            inv_group_tokens: Tensor::from_slice(&inv_gt),
            inv_group_samples: Tensor::from_slice(&inv_gs),
            minibatch_tokens: mb_lens.iter().sum::<usize>() as f64,
            minibatch_samples: mb_lens.len() as f64,
            minibatch_groups: group_samples.len() as f64,
        }
    }
}

/// The trained model's outputs on the micro-batch, `[T]`, with autograd.
#[derive(Debug, Default)]
pub struct Outputs<'a> {
    pub logp: Option<&'a Tensor>,
    pub entropy: Option<&'a Tensor>,
    pub value: Option<&'a Tensor>,
}

/// The loss of a micro-batch and the sums of its metrics.
#[derive(Debug)]
pub struct Evaluated {
    /// The micro-batch's share of the mini-batch loss, with autograd.
    pub loss: Tensor,
    /// Per declared metric: its name, the sum of its values over the micro-batch's tokens or
    /// samples, and how many there were.
    pub metrics: Vec<(String, f64, f64)>,
}

/// A value during evaluation.
enum V {
    Float(f64),
    Bool(bool),
    T(Tensor),
}

/// Evaluates an objective on a micro-batch. `inputs[k]` is input `k`: `[T]` for a per-token
/// input, `[N]` for a per-sample one, in the working precision, on the model's device.
pub fn evaluate(
    o: &Objective,
    inputs: &[Tensor],
    outputs: &Outputs<'_>,
    layout: &Layout,
) -> Result<Evaluated> {
    let bad = |what: String| Error::invalid(format!("loss `{}`", o.name), what);
    braid_ir::loss::verify(o).map_err(|e| bad(e.to_string()))?;
    if inputs.len() != o.inputs.len() {
        return Err(bad(format!(
            "takes {} inputs, {} given",
            o.inputs.len(),
            inputs.len()
        )));
    }
    let reference = outputs
        .logp
        .or(outputs.value)
        .or(outputs.entropy)
        .ok_or_else(|| bad("the model produced no outputs".into()))?;
    let (kind, device) = (reference.kind(), reference.device());
    let n = layout.len.size1()?;
    let t = layout.sample_of.size1()?;
    let on = |x: &Tensor| x.to_device(device).to_kind(kind);
    let sample_of = layout.sample_of.to_device(device);
    let len = on(&layout.len);
    for (k, (x, want)) in inputs.iter().zip(&o.inputs).enumerate() {
        let size = match want.level() {
            Level::Token => t,
            _ => n,
        };
        if x.size() != [size] {
            return Err(bad(format!(
                "input {k} has shape {:?}, expected [{size}]",
                x.size()
            )));
        }
    }
    let mut vals: Vec<V> = Vec::with_capacity(o.insts.len());
    for inst in &o.insts {
        let get = |v: braid_ir::loss::Value| -> Result<&V> {
            vals.get(v.index())
                .ok_or_else(|| bad(format!("%{} is used before it is defined", v.0)))
        };
        let level = |v: braid_ir::loss::Value| o.inst(v).map(|i| i.level);
        // A per-sample tensor where a per-token one is needed is broadcast over the tokens.
        let at = |x: &Tensor, from: Option<Level>, to: Level| -> Tensor {
            if from == Some(Level::Sample) && to == Level::Token {
                x.index_select(0, &sample_of)
            } else {
                x.shallow_clone()
            }
        };
        let v = match &inst.op {
            Op::Const(bits) => V::Float(const_value(*bits)),
            Op::ConstBool(b) => V::Bool(*b),
            Op::Input(k) => V::T(
                inputs
                    .get(*k as usize)
                    .ok_or_else(|| bad(format!("input {k} is missing")))?
                    .shallow_clone(),
            ),
            Op::Model(out) => {
                let x = match out {
                    ModelOutput::Logp => outputs.logp,
                    ModelOutput::Entropy => outputs.entropy,
                    ModelOutput::Value => outputs.value,
                };
                V::T(
                    x.ok_or_else(|| {
                        bad(format!(
                            "reads `.{}`, which this model's head does not give",
                            out.name()
                        ))
                    })?
                    .shallow_clone(),
                )
            }
            Op::Layout(l) => V::T(match l {
                LayoutValue::InvLen => on(&layout.inv_len),
                LayoutValue::Len => len.shallow_clone(),
                LayoutValue::InvGroupTokens => on(&layout.inv_group_tokens),
                LayoutValue::InvGroupSamples => on(&layout.inv_group_samples),
            }),
            Op::Unary(u, x) => match (u, get(*x)?) {
                (UnOp::Neg, V::Float(c)) => V::Float(-c),
                (UnOp::Not, V::Bool(b)) => V::Bool(!b),
                (UnOp::Neg, V::T(x)) => V::T(-x),
                (UnOp::Not, V::T(x)) => V::T(x.logical_not()),
                (UnOp::Exp, V::T(x)) => V::T(x.exp()),
                (UnOp::Log, V::T(x)) => V::T(x.log()),
                (UnOp::Sqrt, V::T(x)) => V::T(x.sqrt()),
                (UnOp::Abs, V::T(x)) => V::T(x.abs()),
                (UnOp::StopGrad, V::T(x)) => V::T(x.detach()),
                (u, _) => return Err(bad(format!("{} of a constant", u.name()))),
            },
            Op::Broadcast(x) => match get(*x)? {
                V::T(x) => V::T(x.index_select(0, &sample_of)),
                _ => return Err(bad("broadcast of a constant".into())),
            },
            Op::Binary(op, a, b) => {
                let (la, lb) = (level(*a), level(*b));
                let to = la.max(lb).unwrap_or(Level::Scalar);
                match (get(*a)?, get(*b)?) {
                    (V::T(x), V::T(y)) => V::T(binary_tt(*op, &at(x, la, to), &at(y, lb, to))),
                    (V::T(x), V::Float(c)) => V::T(
                        binary_tc(*op, x, *c)
                            .ok_or_else(|| bad(format!("{} of a float", op.name())))?,
                    ),
                    (V::Float(c), V::T(y)) => V::T(
                        binary_ct(*op, *c, y)
                            .ok_or_else(|| bad(format!("{} of a float", op.name())))?,
                    ),
                    (V::T(x), V::Bool(c)) | (V::Bool(c), V::T(x)) => V::T(match (op, c) {
                        (BinOp::And, true) | (BinOp::Or, false) => x.shallow_clone(),
                        (BinOp::And, false) => x.zeros_like(),
                        _ => x.ones_like(),
                    }),
                    (V::Float(x), V::Float(y)) => scalar_binary(*op, *x, *y)
                        .ok_or_else(|| bad(format!("{} of floats", op.name())))?,
                    (V::Bool(x), V::Bool(y)) if op.is_logic() => V::Bool(match op {
                        BinOp::And => *x && *y,
                        _ => *x || *y,
                    }),
                    _ => return Err(bad(format!("{} of mismatched operands", op.name()))),
                }
            }
            Op::Select { cond, then, else_ } => {
                let to = inst.level;
                let c = match get(*cond)? {
                    V::T(c) => at(c, level(*cond), to),
                    V::Bool(b) => {
                        // A constant condition (the builder folds these): the branch taken.
                        let taken = if *b { *then } else { *else_ };
                        vals.push(clone(get(taken)?));
                        continue;
                    }
                    V::Float(_) => return Err(bad("a float condition".into())),
                };
                let branch = |v: braid_ir::loss::Value| -> Result<Tensor> {
                    Ok(match get(v)? {
                        V::T(x) => at(x, level(v), to),
                        V::Float(f) => Tensor::full(c.size(), *f, (kind, device)),
                        V::Bool(b) => Tensor::full(c.size(), i64::from(*b), (Kind::Bool, device)),
                    })
                };
                let (x, y) = (branch(*then)?, branch(*else_)?);
                V::T(x.where_self(&c, &y))
            }
            Op::Clamp { x: xv, lo, hi } => {
                let to = inst.level;
                let x = match get(*xv)? {
                    V::T(x) => at(x, level(*xv), to),
                    _ => return Err(bad("clamp of a constant".into())),
                };
                V::T(match (get(*lo)?, get(*hi)?) {
                    (V::Float(l), V::Float(h)) => x.clamp(*l, *h),
                    (l, h) => {
                        let m = match l {
                            V::Float(l) => x.clamp_min(*l),
                            V::T(l) => x.maximum(&at(l, level(*lo), to)),
                            V::Bool(_) => return Err(bad("a bool bound".into())),
                        };
                        match h {
                            V::Float(h) => m.clamp_max(*h),
                            V::T(h) => m.minimum(&at(h, level(*hi), to)),
                            V::Bool(_) => return Err(bad("a bool bound".into())),
                        }
                    }
                })
            }
            Op::Reduce(r, x) => {
                let x = match get(*x)? {
                    V::T(x) => x,
                    _ => return Err(bad("a token reduction of a constant".into())),
                };
                let segment_sum =
                    |y: &Tensor| Tensor::zeros([n], (y.kind(), device)).index_add(0, &sample_of, y);
                V::T(match r {
                    ReduceOp::Sum => segment_sum(x),
                    ReduceOp::Mean => segment_sum(x) / len.clamp_min(1.0),
                    ReduceOp::Max => Tensor::full([n], f64::NEG_INFINITY, (kind, device))
                        .scatter_reduce(0, &sample_of, x, "amax"),
                    ReduceOp::Min => Tensor::full([n], f64::INFINITY, (kind, device))
                        .scatter_reduce(0, &sample_of, x, "amin"),
                    ReduceOp::Std => {
                        let m = segment_sum(x) / len.clamp_min(1.0);
                        let d = x - m.index_select(0, &sample_of);
                        (segment_sum(&(&d * &d)) / len.clamp_min(1.0)).sqrt()
                    }
                    ReduceOp::Count => segment_sum(&x.ne(0.0).to_kind(kind)),
                })
            }
            Op::BatchSum { x, count, scale } => {
                let x = match get(*x)? {
                    V::T(x) => x,
                    _ => return Err(bad("a batch sum of a constant".into())),
                };
                let c = match count {
                    Count::One => None,
                    Count::Tokens => Some(layout.minibatch_tokens),
                    Count::Samples => Some(layout.minibatch_samples),
                    Count::Groups => Some(layout.minibatch_groups),
                };
                let scale = const_value(*scale);
                let sum = x.sum(x.kind());
                // As `sum / count` (or `sum / (count * scale)`), dividing once.
                V::T(match (c, scale == 1.0) {
                    (None, true) => sum,
                    (None, false) => sum / scale,
                    (Some(c), true) => sum / c.max(1.0),
                    (Some(c), false) => sum / (c.max(1.0) * scale),
                })
            }
        };
        vals.push(v);
    }
    let loss = match vals.get(o.result.index()) {
        Some(V::T(l)) => l.shallow_clone(),
        _ => return Err(bad("the result is not a tensor".into())),
    };
    let mut metrics = Vec::new();
    for m in &o.metrics {
        let Some(V::T(v)) = vals.get(m.value.index()) else {
            return Err(bad(format!("metric `{}` is not a tensor", m.name)));
        };
        let v = v.detach();
        let count = v.numel() as f64;
        let sum = v.to_kind(Kind::Double).sum(Kind::Double).double_value(&[]);
        metrics.push((m.name.clone(), sum, count));
    }
    Ok(Evaluated { loss, metrics })
}

fn clone(v: &V) -> V {
    match v {
        V::Float(f) => V::Float(*f),
        V::Bool(b) => V::Bool(*b),
        V::T(t) => V::T(t.shallow_clone()),
    }
}

/// Tensor with tensor, same shape.
fn binary_tt(op: BinOp, x: &Tensor, y: &Tensor) -> Tensor {
    match op {
        BinOp::Add => x + y,
        BinOp::Sub => x - y,
        BinOp::Mul => x * y,
        BinOp::Div => x / y,
        BinOp::Rem => x.fmod_tensor(y),
        BinOp::Min => x.minimum(y),
        BinOp::Max => x.maximum(y),
        BinOp::Eq => x.eq_tensor(y),
        BinOp::Ne => x.ne_tensor(y),
        BinOp::Lt => x.lt_tensor(y),
        BinOp::Le => x.le_tensor(y),
        BinOp::Gt => x.gt_tensor(y),
        BinOp::Ge => x.ge_tensor(y),
        BinOp::And => x.logical_and(y),
        BinOp::Or => x.logical_or(y),
    }
}

/// Tensor with a constant on the right: the tensor-scalar operation (`None` for logic, which
/// takes bools).
fn binary_tc(op: BinOp, x: &Tensor, c: f64) -> Option<Tensor> {
    Some(match op {
        BinOp::Add => x + c,
        BinOp::Sub => x - c,
        BinOp::Mul => x * c,
        BinOp::Div => x / c,
        BinOp::Rem => x.fmod(c),
        BinOp::Min => x.clamp_max(c),
        BinOp::Max => x.clamp_min(c),
        BinOp::Eq => x.eq(c),
        BinOp::Ne => x.ne(c),
        BinOp::Lt => x.lt(c),
        BinOp::Le => x.le(c),
        BinOp::Gt => x.gt(c),
        BinOp::Ge => x.ge(c),
        BinOp::And | BinOp::Or => return None,
    })
}

/// A constant on the left: `c + x` is `x + c` (addition and multiplication commute exactly),
/// `c - x` is `-(x - c)` (rounding is symmetric), comparisons flip; a division or remainder
/// needs the constant as a tensor.
fn binary_ct(op: BinOp, c: f64, x: &Tensor) -> Option<Tensor> {
    Some(match op {
        BinOp::Add => x + c,
        BinOp::Mul => x * c,
        BinOp::Sub => -(x - c),
        BinOp::Div => x.full_like(c) / x,
        BinOp::Rem => x.full_like(c).fmod_tensor(x),
        BinOp::Min => x.clamp_max(c),
        BinOp::Max => x.clamp_min(c),
        BinOp::Eq => x.eq(c),
        BinOp::Ne => x.ne(c),
        BinOp::Lt => x.gt(c),
        BinOp::Le => x.ge(c),
        BinOp::Gt => x.lt(c),
        BinOp::Ge => x.le(c),
        BinOp::And | BinOp::Or => return None,
    })
}

fn scalar_binary(op: BinOp, x: f64, y: f64) -> Option<V> {
    let nan = x.is_nan() || y.is_nan();
    Some(match op {
        BinOp::Add => V::Float(x + y),
        BinOp::Sub => V::Float(x - y),
        BinOp::Mul => V::Float(x * y),
        BinOp::Div => V::Float(x / y),
        BinOp::Rem => V::Float(x % y),
        BinOp::Min => V::Float(if nan { f64::NAN } else { x.min(y) }),
        BinOp::Max => V::Float(if nan { f64::NAN } else { x.max(y) }),
        BinOp::Eq => V::Bool(x == y),
        BinOp::Ne => V::Bool(x != y),
        BinOp::Lt => V::Bool(x < y),
        BinOp::Le => V::Bool(x <= y),
        BinOp::Gt => V::Bool(x > y),
        BinOp::Ge => V::Bool(x >= y),
        BinOp::And | BinOp::Or => return None,
    })
}
