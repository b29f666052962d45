//! The builder the lowering uses to make objectives: one method per operation, constants folded
//! as they are made, and the rewrites that give every reduction to the loss its canonical form.
//!
//! **Folding.** An operation on constants is evaluated here, in f64, with the semantics the
//! evaluator gives the same operation on tensors (so `1.0 - clip` is one constant, and an `if`
//! on a constant condition keeps only the branch taken).
//!
//! **Canonical reductions.** Every reduction to the loss becomes one [`Op::BatchSum`]:
//! `batch_sum(sum(x))` sums `x` over the tokens directly; `batch_sum(mean(x))` sums
//! `x * inv_len` (one pass over the tokens instead of a per-sample mean and a second sum — and
//! the operation order of the usual "sequence mean"); `batch_mean` divides by the mini-batch's
//! token or sample count, `group_mean` weights each element by 1 / its group's size and divides
//! by the number of groups; and a loss divided by a constant folds the constant into the
//! divisor, so that a reduction divides once.
//!
//! The builder never panics: a misuse is recorded, later calls return a poisoned value, and
//! [`ObjectiveBuilder::finish`] returns the first error. `finish` removes instructions nothing
//! uses and runs the verifier, so an objective that leaves the builder is valid.
//!
//! ```
//! use braid_ir::loss::{ModelOutput, ObjectiveBuilder, InputKind};
//! // batch_mean(-(adv * exp(policy.logp - old_logp)))
//! let mut b = ObjectiveBuilder::new("pg");
//! let old = b.input(InputKind::PerToken);
//! let adv = b.input(InputKind::PerSample);
//! let logp = b.model(ModelOutput::Logp);
//! let d = b.binary(braid_ir::loss::BinOp::Sub, logp, old);
//! let ratio = b.unary(braid_ir::loss::UnOp::Exp, d);
//! let pg = b.binary(braid_ir::loss::BinOp::Mul, adv, ratio);
//! let pg = b.unary(braid_ir::loss::UnOp::Neg, pg);
//! let loss = b.batch_mean(pg);
//! let objective = b.finish(loss).unwrap();
//! assert_eq!(objective.inputs.len(), 2);
//! ```

use std::collections::HashMap;

use super::verify::{self, result_of};
use super::{
    BinOp, Count, InputKind, Inst, LayoutValue, Level, Metric, ModelOutput, Objective, Op,
    ReduceOp, Ty, UnOp, Value, const_value,
};

/// Why an objective could not be built.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum BuildError {
    /// A builder method was misused; the message says how.
    #[error("{0}")]
    Misuse(String),
    /// The finished objective failed verification.
    #[error("verifier: {0}")]
    Verify(#[from] verify::VerifyError),
}

/// The value handed out after a misuse; it is never in a finished objective.
const POISON: Value = Value(u32::MAX);

/// Builds one [`Objective`]. See the module doc.
#[derive(Debug)]
pub struct ObjectiveBuilder {
    o: Objective,
    /// Leaves already made (constants, inputs read once, model outputs, layout facts), so that
    /// each appears once.
    leaves: HashMap<Op, Value>,
    error: Option<String>,
}

impl ObjectiveBuilder {
    pub fn new(name: impl Into<String>) -> ObjectiveBuilder {
        ObjectiveBuilder {
            o: Objective {
                name: name.into(),
                inputs: Vec::new(),
                input_names: Vec::new(),
                insts: Vec::new(),
                result: POISON,
                metrics: Vec::new(),
            },
            leaves: HashMap::new(),
            error: None,
        }
    }

    fn fail(&mut self, message: String) -> Value {
        if self.error.is_none() {
            self.error = Some(message);
        }
        POISON
    }

    /// The level of a value made by this builder.
    pub fn level(&self, v: Value) -> Option<Level> {
        self.o.inst(v).map(|i| i.level)
    }

    /// The type of a value made by this builder.
    pub fn ty(&self, v: Value) -> Option<Ty> {
        self.o.inst(v).map(|i| i.ty)
    }

    /// The float a value is, when it is a constant.
    pub fn float_const(&self, v: Value) -> Option<f64> {
        match self.o.inst(v)?.op {
            Op::Const(bits) => Some(const_value(bits)),
            _ => None,
        }
    }

    /// The bool a value is, when it is a constant.
    pub fn bool_const(&self, v: Value) -> Option<bool> {
        match self.o.inst(v)?.op {
            Op::ConstBool(b) => Some(b),
            _ => None,
        }
    }

    fn push(&mut self, op: Op) -> Value {
        if self.error.is_some() {
            return POISON;
        }
        let insts = &self.o.insts;
        match result_of(&op, &self.o.inputs, |v| {
            insts.get(v.index()).map(|i| (i.level, i.ty))
        }) {
            Ok((level, ty)) => {
                self.o.insts.push(Inst { op, level, ty });
                Value(self.o.insts.len() as u32 - 1)
            }
            Err(m) => self.fail(m),
        }
    }

    fn leaf(&mut self, op: Op) -> Value {
        if let Some(v) = self.leaves.get(&op) {
            return *v;
        }
        let v = self.push(op.clone());
        if v != POISON {
            self.leaves.insert(op, v);
        }
        v
    }

    /// A new input of the given kind, and its value.
    pub fn input(&mut self, kind: InputKind) -> Value {
        self.input_named(kind, "")
    }

    /// A new input bound to the loss's parameter `name`, and its value.
    pub fn input_named(&mut self, kind: InputKind, name: &str) -> Value {
        self.o.inputs.push(kind);
        self.o.input_names.push(name.to_string());
        let n = self.o.inputs.len() as u32 - 1;
        self.leaf(Op::Input(n))
    }

    /// An output of the trained model.
    pub fn model(&mut self, out: ModelOutput) -> Value {
        self.leaf(Op::Model(out))
    }

    /// A fact of the micro-batch's layout.
    pub fn layout(&mut self, l: LayoutValue) -> Value {
        self.leaf(Op::Layout(l))
    }

    pub fn float(&mut self, x: f64) -> Value {
        self.leaf(Op::Const(x.to_bits()))
    }

    pub fn bool(&mut self, b: bool) -> Value {
        self.leaf(Op::ConstBool(b))
    }

    /// A unary operation; on a constant, its value.
    pub fn unary(&mut self, op: UnOp, x: Value) -> Value {
        if let Some(c) = self.float_const(x) {
            let folded = match op {
                UnOp::Neg => Some(-c),
                UnOp::Exp => Some(c.exp()),
                UnOp::Log => Some(c.ln()),
                UnOp::Sqrt => Some(c.sqrt()),
                UnOp::Abs => Some(c.abs()),
                // A constant has no gradient to stop.
                UnOp::StopGrad => Some(c),
                UnOp::Not => None,
            };
            if let Some(f) = folded {
                return self.float(f);
            }
        }
        if let (UnOp::Not, Some(b)) = (op, self.bool_const(x)) {
            return self.bool(!b);
        }
        self.push(Op::Unary(op, x))
    }

    /// A binary operation; on constants, its value. A loss divided by a constant folds into
    /// the divisor of its `BatchSum`.
    pub fn binary(&mut self, op: BinOp, a: Value, b: Value) -> Value {
        if let (Some(x), Some(y)) = (self.float_const(a), self.float_const(b)) {
            let num = |f: f64| Some(Ok(f));
            let folded = match op {
                BinOp::Add => num(x + y),
                BinOp::Sub => num(x - y),
                BinOp::Mul => num(x * y),
                BinOp::Div => num(x / y),
                BinOp::Rem => num(x % y),
                BinOp::Min => num(nan_or(x, y, x.min(y))),
                BinOp::Max => num(nan_or(x, y, x.max(y))),
                BinOp::Eq => Some(Err(x == y)),
                BinOp::Ne => Some(Err(x != y)),
                BinOp::Lt => Some(Err(x < y)),
                BinOp::Le => Some(Err(x <= y)),
                BinOp::Gt => Some(Err(x > y)),
                BinOp::Ge => Some(Err(x >= y)),
                BinOp::And | BinOp::Or => None,
            };
            match folded {
                Some(Ok(f)) => return self.float(f),
                Some(Err(c)) => return self.bool(c),
                None => {}
            }
        }
        if let (Some(x), Some(y)) = (self.bool_const(a), self.bool_const(b)) {
            match op {
                BinOp::And => return self.bool(x && y),
                BinOp::Or => return self.bool(x || y),
                _ => {}
            }
        }
        if op == BinOp::Div
            && let Some(k) = self.float_const(b)
            && let Some(Op::BatchSum { x, count, scale }) = self.o.inst(a).map(|i| i.op.clone())
        {
            let scale = (const_value(scale) * k).to_bits();
            return self.push(Op::BatchSum { x, count, scale });
        }
        self.push(Op::Binary(op, a, b))
    }

    /// Elementwise selection; with a constant condition, the branch it takes.
    pub fn select(&mut self, cond: Value, then: Value, else_: Value) -> Value {
        match self.bool_const(cond) {
            Some(true) => then,
            Some(false) => else_,
            None => self.push(Op::Select { cond, then, else_ }),
        }
    }

    /// `x` limited to `[lo, hi]`.
    pub fn clamp(&mut self, x: Value, lo: Value, hi: Value) -> Value {
        if let (Some(c), Some(l), Some(h)) = (
            self.float_const(x),
            self.float_const(lo),
            self.float_const(hi),
        ) {
            let m = nan_or(c, l, c.max(l));
            return self.float(nan_or(m, h, m.min(h)));
        }
        self.push(Op::Clamp { x, lo, hi })
    }

    /// A reduction of a per-token value over each sample's tokens.
    pub fn reduce(&mut self, op: ReduceOp, x: Value) -> Value {
        self.push(Op::Reduce(op, x))
    }

    /// A per-sample value at each token of its sample; a per-token or constant value as it is.
    pub fn broadcast(&mut self, x: Value) -> Value {
        match self.level(x) {
            Some(Level::Sample) => self.push(Op::Broadcast(x)),
            _ => x,
        }
    }

    /// The sum over the micro-batch of a per-token or per-sample value (its share of the
    /// mini-batch's sum).
    pub fn batch_sum(&mut self, x: Value) -> Value {
        self.reduction(x, Count::One)
    }

    /// The mean over the mini-batch: of its tokens for a per-token value, of its samples for a
    /// per-sample one.
    pub fn batch_mean(&mut self, x: Value) -> Value {
        let count = match self.level(x) {
            Some(Level::Token) => Count::Tokens,
            _ => Count::Samples,
        };
        self.reduction(x, count)
    }

    /// The mean over the mini-batch's groups of each group's mean (over the group's tokens for
    /// a per-token value, its samples for a per-sample one).
    pub fn group_mean(&mut self, x: Value) -> Value {
        let weight = match self.level(x) {
            Some(Level::Token) => LayoutValue::InvGroupTokens,
            _ => LayoutValue::InvGroupSamples,
        };
        let w = self.layout(weight);
        let xw = self.binary(BinOp::Mul, x, w);
        self.push(Op::BatchSum {
            x: xw,
            count: Count::Groups,
            scale: 1f64.to_bits(),
        })
    }

    /// A `BatchSum` of `x` divided by `count`, with a token reduction under it folded into one
    /// pass over the tokens.
    fn reduction(&mut self, x: Value, count: Count) -> Value {
        let x = match self.o.inst(x).map(|i| i.op.clone()) {
            Some(Op::Reduce(ReduceOp::Sum, y)) => y,
            Some(Op::Reduce(ReduceOp::Mean, y)) => {
                let inv = self.layout(LayoutValue::InvLen);
                self.binary(BinOp::Mul, y, inv)
            }
            _ => x,
        };
        self.push(Op::BatchSum {
            x,
            count,
            scale: 1f64.to_bits(),
        })
    }

    /// Declares a metric. The same name may be declared again (by two losses of a sum): the
    /// trainer reports the mean over all elements of all its declarations.
    pub fn metric(&mut self, name: impl Into<String>, value: Value) {
        self.o.metrics.push(Metric {
            name: name.into(),
            value,
        });
    }

    /// The objective with `result` as its loss, without the instructions nothing uses,
    /// verified.
    pub fn finish(mut self, result: Value) -> Result<Objective, BuildError> {
        if let Some(e) = self.error.take() {
            return Err(BuildError::Misuse(e));
        }
        if self.o.inst(result).is_none() {
            return Err(BuildError::Misuse(format!(
                "the result %{} was not made by this builder",
                result.0
            )));
        }
        // Dead-code elimination: instructions reachable from the result and the metrics, in
        // their original order, renumbered.
        let n = self.o.insts.len();
        let mut live = vec![false; n];
        live[result.index()] = true;
        for m in &self.o.metrics {
            if let Some(l) = live.get_mut(m.value.index()) {
                *l = true;
            }
        }
        for i in (0..n).rev() {
            if live[i] {
                for v in Objective::operands(&self.o.insts[i].op) {
                    if let Some(l) = live.get_mut(v.index()) {
                        *l = true;
                    }
                }
            }
        }
        let mut new_index = vec![POISON; n];
        let mut insts = Vec::new();
        let map = |new_index: &[Value], v: Value| new_index.get(v.index()).copied().unwrap_or(v);
        for (i, inst) in self.o.insts.iter().enumerate() {
            if !live[i] {
                continue;
            }
            let op = match &inst.op {
                Op::Unary(u, x) => Op::Unary(*u, map(&new_index, *x)),
                Op::Binary(b, x, y) => Op::Binary(*b, map(&new_index, *x), map(&new_index, *y)),
                Op::Select { cond, then, else_ } => Op::Select {
                    cond: map(&new_index, *cond),
                    then: map(&new_index, *then),
                    else_: map(&new_index, *else_),
                },
                Op::Clamp { x, lo, hi } => Op::Clamp {
                    x: map(&new_index, *x),
                    lo: map(&new_index, *lo),
                    hi: map(&new_index, *hi),
                },
                Op::Reduce(r, x) => Op::Reduce(*r, map(&new_index, *x)),
                Op::Broadcast(x) => Op::Broadcast(map(&new_index, *x)),
                Op::BatchSum { x, count, scale } => Op::BatchSum {
                    x: map(&new_index, *x),
                    count: *count,
                    scale: *scale,
                },
                leaf => leaf.clone(),
            };
            new_index[i] = Value(insts.len() as u32);
            insts.push(Inst {
                op,
                level: inst.level,
                ty: inst.ty,
            });
        }
        self.o.insts = insts;
        self.o.result = map(&new_index, result);
        for m in &mut self.o.metrics {
            m.value = map(&new_index, m.value);
        }
        verify::verify(&self.o)?;
        Ok(self.o)
    }
}

/// NaN when either operand is NaN (as libtorch's `minimum`, `maximum` and `clamp`), else `r`.
fn nan_or(a: f64, b: f64, r: f64) -> f64 {
    if a.is_nan() || b.is_nan() {
        f64::NAN
    } else {
        r
    }
}
