//! The objective IR: what a loss `fn` (a `fn … -> Loss`) computes on one micro-batch, as a flat
//! SSA list of tensor operations that a trainer evaluates with autograd.
//!
//! An [`Objective`] is specialised: every scalar of the run (clip ranges, coefficients, the
//! estimator's name) was folded in by the lowering (`braid_sema::lower_loss`), so what is left
//! are the per-token and per-sample inputs computed outside the loss ([`Objective::inputs`]:
//! constants for autograd), the trained model's outputs ([`Op::Model`]: the values that carry
//! gradients) and the layout of the micro-batch inside its mini-batch ([`Op::Layout`],
//! [`Count`]). Every value has a [`Level`] — a constant, one number per sample, one per token,
//! or the loss itself — and a [`Ty`]; the verifier checks both.
//!
//! **Gradient accumulation.** A trainer evaluates the objective once per micro-batch and sums
//! the gradients. The IR makes that exact by construction: the only way from per-sample or
//! per-token values to the loss is [`Op::BatchSum`], a sum over the micro-batch's elements
//! divided by a count of the whole *mini-batch* (its tokens, samples or groups) and a
//! constant, and loss-level values combine only linearly (`+`, `-`, scaling by a constant). So
//! the micro-batches' results add up to the mini-batch's objective, and their gradients to its
//! gradient.
//!
//! This module must not know about libtorch, the front end or any trainer: it is data, its
//! text form, its verifier and its builder. The evaluator is `braid_runtime::training::objective`.

pub mod builder;
mod text;
pub mod verify;

pub use builder::{BuildError, ObjectiveBuilder};
pub use verify::{VerifyError, verify};

use serde::{Deserialize, Serialize};

/// An SSA value: the index of the instruction that defines it in [`Objective::insts`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Value(pub u32);

impl Value {
    /// The index of the defining instruction.
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// How many numbers a value holds, from the coarsest constant to the loss. A binary operation
/// broadcasts its operands to the finer of their levels (a per-sample value over its sample's
/// tokens, a constant over everything); the loss level mixes only with itself and constants.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Level {
    /// One number for the whole run: a folded constant.
    Scalar,
    /// One number per sample of the micro-batch.
    Sample,
    /// One number per completion token of the micro-batch.
    Token,
    /// The micro-batch's share of the mini-batch objective: one number.
    Loss,
}

impl Level {
    /// The name used in the text form.
    pub fn name(self) -> &'static str {
        match self {
            Level::Scalar => "scalar",
            Level::Sample => "sample",
            Level::Token => "token",
            Level::Loss => "loss",
        }
    }
}

/// The element type of a value.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Ty {
    /// A float in the working precision of the model's outputs (f32 in training).
    Float,
    /// A boolean (comparisons, `&&`, `||`, `!`).
    Bool,
}

/// What an input carries: values computed outside the loss, constants for autograd.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum InputKind {
    /// One float per completion token (a `PerToken` argument).
    PerToken,
    /// One float per sample (a `PerSample` argument).
    PerSample,
}

impl InputKind {
    pub fn level(self) -> Level {
        match self {
            InputKind::PerToken => Level::Token,
            InputKind::PerSample => Level::Sample,
        }
    }
}

/// An output of the trained model's forward pass on the micro-batch, per completion token, with
/// gradients: the only source of gradients in an objective.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum ModelOutput {
    /// The log-probability of each completion token (at the rollout's sampling temperature);
    /// needs an `lm` head.
    Logp,
    /// The entropy of the next-token distribution at each completion token; needs an `lm` head.
    Entropy,
    /// The value estimate at each completion token; needs a `value` head.
    Value,
}

impl ModelOutput {
    /// The name used in the text form and in the language (`policy.logp`).
    pub fn name(self) -> &'static str {
        match self {
            ModelOutput::Logp => "logp",
            ModelOutput::Entropy => "entropy",
            ModelOutput::Value => "value",
        }
    }

    /// Every output, for lookups by name.
    pub const ALL: &'static [ModelOutput] =
        &[ModelOutput::Logp, ModelOutput::Entropy, ModelOutput::Value];
}

/// Facts about the micro-batch and its mini-batch that the lowering of reductions needs.
/// Counts are of the *mini-batch* (so that a mean divides by the mini-batch's size whatever
/// micro-batch is evaluated); a sample's group is its prompt.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum LayoutValue {
    /// Per token: 1 / the number of tokens of its sample.
    InvLen,
    /// Per sample: its number of tokens (`len(x)` of a per-token value).
    Len,
    /// Per token: 1 / the number of tokens of the mini-batch's samples of its group.
    InvGroupTokens,
    /// Per sample: 1 / the number of the mini-batch's samples of its group.
    InvGroupSamples,
}

impl LayoutValue {
    pub fn level(self) -> Level {
        match self {
            LayoutValue::InvLen | LayoutValue::InvGroupTokens => Level::Token,
            LayoutValue::Len | LayoutValue::InvGroupSamples => Level::Sample,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            LayoutValue::InvLen => "inv_len",
            LayoutValue::Len => "len",
            LayoutValue::InvGroupTokens => "inv_group_tokens",
            LayoutValue::InvGroupSamples => "inv_group_samples",
        }
    }
}

/// A count of the mini-batch that a [`Op::BatchSum`] divides by.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Count {
    /// Divide by nothing (a sum).
    One,
    /// The mini-batch's completion tokens.
    Tokens,
    /// The mini-batch's samples.
    Samples,
    /// The mini-batch's groups (prompts with at least one sample in it).
    Groups,
}

impl Count {
    pub fn name(self) -> &'static str {
        match self {
            Count::One => "one",
            Count::Tokens => "tokens",
            Count::Samples => "samples",
            Count::Groups => "groups",
        }
    }
}

/// Unary operators.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum UnOp {
    /// Negation (also of the loss).
    Neg,
    /// Boolean not.
    Not,
    Exp,
    /// The natural logarithm.
    Log,
    Sqrt,
    Abs,
    /// The value, cut from the gradient: its derivative is zero (`detach`).
    StopGrad,
}

impl UnOp {
    pub fn name(self) -> &'static str {
        match self {
            UnOp::Neg => "neg",
            UnOp::Not => "not",
            UnOp::Exp => "exp",
            UnOp::Log => "log",
            UnOp::Sqrt => "sqrt",
            UnOp::Abs => "abs",
            UnOp::StopGrad => "stop_grad",
        }
    }
}

/// Binary operators, elementwise after broadcasting to the finer level.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum BinOp {
    /// Also `loss + loss`.
    Add,
    /// Also `loss - loss`.
    Sub,
    /// Also `loss * constant` and `constant * loss`.
    Mul,
    /// Also `loss / constant`.
    Div,
    /// The float remainder with the sign of the dividend (C `fmod`).
    Rem,
    /// The smaller; NaN propagates.
    Min,
    /// The larger; NaN propagates.
    Max,
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
    /// Boolean and (both operands evaluated).
    And,
    /// Boolean or (both operands evaluated).
    Or,
}

impl BinOp {
    /// Whether this is a comparison (float operands, a `Bool` result).
    pub fn is_comparison(self) -> bool {
        matches!(
            self,
            BinOp::Eq | BinOp::Ne | BinOp::Lt | BinOp::Le | BinOp::Gt | BinOp::Ge
        )
    }

    /// Whether this is `&&` or `||` (bool operands and result).
    pub fn is_logic(self) -> bool {
        matches!(self, BinOp::And | BinOp::Or)
    }

    pub fn name(self) -> &'static str {
        match self {
            BinOp::Add => "add",
            BinOp::Sub => "sub",
            BinOp::Mul => "mul",
            BinOp::Div => "div",
            BinOp::Rem => "rem",
            BinOp::Min => "min",
            BinOp::Max => "max",
            BinOp::Eq => "eq",
            BinOp::Ne => "ne",
            BinOp::Lt => "lt",
            BinOp::Le => "le",
            BinOp::Gt => "gt",
            BinOp::Ge => "ge",
            BinOp::And => "and",
            BinOp::Or => "or",
        }
    }
}

/// Reductions over each sample's tokens (per-token to per-sample), in token order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ReduceOp {
    Sum,
    /// `sum / len`; `0.0` for a sample without tokens.
    Mean,
    /// From `-inf`; NaN propagates.
    Max,
    /// From `+inf`; NaN propagates.
    Min,
    /// Population standard deviation around the mean; `0.0` without tokens.
    Std,
    /// The number of tokens whose value is not `0.0` (NaN counts), as a float.
    Count,
}

impl ReduceOp {
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Mean => "mean",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
            ReduceOp::Std => "std",
            ReduceOp::Count => "count",
        }
    }
}

/// The operation of an instruction; the result's level and type are stored beside it in
/// [`Inst`] and checked by the verifier.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Op {
    /// A float constant, stored as its bits so that the IR has `Eq` and `Hash` and survives
    /// JSON (which has no NaN or infinity).
    Const(u64),
    /// A boolean constant.
    ConstBool(bool),
    /// Input `n` of [`Objective::inputs`] for the micro-batch's samples or tokens.
    Input(u32),
    /// An output of the trained model on the micro-batch, with gradients.
    Model(ModelOutput),
    /// A fact of the micro-batch's layout (no gradient).
    Layout(LayoutValue),
    Unary(UnOp, Value),
    Binary(BinOp, Value, Value),
    /// Elementwise `if cond { then } else { else_ }`: both are evaluated, each element takes
    /// one (the gradient flows only into the taken one).
    Select {
        cond: Value,
        then: Value,
        else_: Value,
    },
    /// `x` limited to `[lo, hi]`: `min(max(x, lo), hi)`.
    Clamp {
        x: Value,
        lo: Value,
        hi: Value,
    },
    /// A reduction of a per-token value over each sample's tokens: one number per sample.
    Reduce(ReduceOp, Value),
    /// A per-sample value at each of its sample's tokens (a per-sample argument of a per-token
    /// parameter).
    Broadcast(Value),
    /// The sum of a per-token or per-sample value over the micro-batch's elements, divided by
    /// `count` of the mini-batch times `scale`: the micro-batch's share of a mini-batch
    /// reduction. The only way to the loss level.
    BatchSum {
        x: Value,
        count: Count,
        scale: u64,
    },
}

/// An instruction: an operation, and the level and type of its result.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Inst {
    pub op: Op,
    pub level: Level,
    pub ty: Ty,
}

/// A diagnostic the loss declares (`metric NAME = EXPR`): the trainer reports the mean of the
/// value over every token (per-token values) or sample (per-sample values) the `train` call
/// processes, computed without gradients. A boolean counts as 1 or 0, so its mean is a share.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Metric {
    pub name: String,
    pub value: Value,
}

/// A loss, specialised for its run: see the module documentation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Objective {
    /// The loss `fn`s it was lowered from, for messages (`ppo_loss`, `ppo_loss + kl_loss`).
    pub name: String,
    /// The inputs in order; `Op::Input(n)` reads input `n`.
    pub inputs: Vec<InputKind>,
    /// The parameter each input is bound to in the loss it was lowered from (`old_logp`, `adv`),
    /// for messages and tools; empty, or one per input.
    #[serde(default)]
    pub input_names: Vec<String>,
    /// Every instruction, each after its operands; a [`Value`] indexes this list.
    pub insts: Vec<Inst>,
    /// The loss: a loss-level float.
    pub result: Value,
    /// The declared diagnostics, in declaration order. A name may repeat (the losses of a sum
    /// may declare the same metric): the trainer reports the mean over all its declarations.
    pub metrics: Vec<Metric>,
}

impl Objective {
    /// The instruction defining a value.
    pub fn inst(&self, v: Value) -> Option<&Inst> {
        self.insts.get(v.index())
    }

    /// The index of the input bound to the parameter `name`, if any.
    pub fn input_named(&self, name: &str) -> Option<usize> {
        self.input_names.iter().position(|n| n == name)
    }

    /// The model outputs the objective reads (what the trainer's forward pass must provide).
    pub fn outputs(&self) -> Vec<ModelOutput> {
        let mut out: Vec<ModelOutput> = self
            .insts
            .iter()
            .filter_map(|i| match i.op {
                Op::Model(o) => Some(o),
                _ => None,
            })
            .collect();
        out.sort();
        out.dedup();
        out
    }

    /// The operands of an operation, in order.
    pub fn operands(op: &Op) -> Vec<Value> {
        match op {
            Op::Const(_) | Op::ConstBool(_) | Op::Input(_) | Op::Model(_) | Op::Layout(_) => {
                Vec::new()
            }
            Op::Unary(_, x) | Op::Reduce(_, x) | Op::Broadcast(x) | Op::BatchSum { x, .. } => {
                vec![*x]
            }
            Op::Binary(_, a, b) => vec![*a, *b],
            Op::Select { cond, then, else_ } => vec![*cond, *then, *else_],
            Op::Clamp { x, lo, hi } => vec![*x, *lo, *hi],
        }
    }

    /// For every value, whether it carries a gradient: whether it depends on a model output
    /// other than through `stop_grad`. Comparisons and the other boolean operations carry none
    /// (their derivative is zero), and a `Select`'s condition passes none on.
    pub fn gradients(&self) -> Vec<bool> {
        let mut g = vec![false; self.insts.len()];
        for (i, inst) in self.insts.iter().enumerate() {
            let of = |v: &Value| g.get(v.index()).copied().unwrap_or(false);
            g[i] = match &inst.op {
                Op::Model(_) => true,
                Op::Unary(UnOp::StopGrad, _) => false,
                _ if inst.ty == Ty::Bool => false,
                Op::Select { then, else_, .. } => of(then) || of(else_),
                op => Objective::operands(op).iter().any(of),
            };
        }
        g
    }
}

/// The float value of a constant's bits.
pub fn const_value(bits: u64) -> f64 {
    f64::from_bits(bits)
}

#[cfg(test)]
mod tests;
