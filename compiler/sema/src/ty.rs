//! Types and granularity.
//!
//! `SigTy` is a type as written in a signature (`PerToken`, `fn(Sample) -> float`). `Ty` is
//! the type of an expression after checking: pipeline-level per-token and per-sample values
//! carry the rollout they belong to, so that mixing two rollouts is a type error; inside a
//! `fn` body a `PerToken` parameter is `Ty::Tokens` (one sample's tokens) and a `PerSample`
//! parameter is a `float`.

use std::fmt;

/// The identity of a rollout: the `generate` call that made it, numbered within its pipeline.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RolloutId(pub u32);

/// The identity of a prompt batch: the `next` call that drew it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BatchId(pub u32);

/// When a value is complete, from finest to coarsest. Sample-level fusion can start a consumer
/// as soon as its inputs' granularity allows: per sample, when its group is done, or only when
/// the whole batch is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Granularity {
    /// The same for every sample (a constant, a setting).
    Scalar,
    PerSample,
    PerGroup,
    PerBatch,
}

impl Granularity {
    pub fn as_str(self) -> &'static str {
        match self {
            Granularity::Scalar => "scalar",
            Granularity::PerSample => "per-sample",
            Granularity::PerGroup => "per-group",
            Granularity::PerBatch => "per-batch",
        }
    }
}

/// The scope of reductions in a `fn`: `over group`, `over batch`, or one sample.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Scope {
    Sample,
    Group,
    Batch,
}

impl Scope {
    pub fn granularity(self) -> Granularity {
        match self {
            Scope::Sample => Granularity::PerSample,
            Scope::Group => Granularity::PerGroup,
            Scope::Batch => Granularity::PerBatch,
        }
    }
}

/// A type as written in a signature.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum SigTy {
    Int,
    Float,
    Bool,
    Str,
    Model,
    Dataset,
    PromptBatch,
    Rollout,
    Sample,
    PerToken,
    PerSample,
    Loss,
    Fn(FnSig),
    /// A type that did not resolve (already reported).
    Error,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct FnSig {
    pub params: Vec<SigTy>,
    pub ret: Box<SigTy>,
}

impl SigTy {
    pub fn from_name(name: &str) -> Option<SigTy> {
        Some(match name {
            "int" => SigTy::Int,
            "float" => SigTy::Float,
            "bool" => SigTy::Bool,
            "string" => SigTy::Str,
            "Model" => SigTy::Model,
            "Dataset" => SigTy::Dataset,
            "PromptBatch" => SigTy::PromptBatch,
            "Rollout" => SigTy::Rollout,
            "Sample" => SigTy::Sample,
            "PerToken" => SigTy::PerToken,
            "PerSample" => SigTy::PerSample,
            "Loss" => SigTy::Loss,
            _ => return None,
        })
    }

    /// The type names users may write.
    pub const NAMES: &'static [&'static str] = &[
        "int",
        "float",
        "bool",
        "string",
        "Model",
        "Dataset",
        "PromptBatch",
        "Rollout",
        "Sample",
        "PerToken",
        "PerSample",
        "Loss",
    ];

    /// Whether a parameter of this type makes a `fn` per-sample.
    pub fn is_sample_valued(&self) -> bool {
        matches!(self, SigTy::Sample | SigTy::PerToken | SigTy::PerSample)
    }

    pub fn is_scalar(&self) -> bool {
        matches!(self, SigTy::Int | SigTy::Float | SigTy::Bool | SigTy::Str)
    }

    /// The type of a parameter inside a `fn` body.
    pub fn in_fn_body(&self) -> Ty {
        match self {
            SigTy::Int => Ty::Int,
            SigTy::Float | SigTy::PerSample => Ty::Float,
            SigTy::Bool => Ty::Bool,
            SigTy::Str => Ty::Str,
            SigTy::Sample => Ty::Sample,
            SigTy::PerToken => Ty::Tokens,
            SigTy::Fn(s) => Ty::Fn(s.clone()),
            SigTy::Error => Ty::Error,
            SigTy::Model => Ty::Model,
            SigTy::Dataset => Ty::Dataset,
            SigTy::Loss => Ty::Loss(None, None),
            SigTy::PromptBatch | SigTy::Rollout => Ty::Error,
        }
    }
}

impl fmt::Display for SigTy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SigTy::Int => f.write_str("int"),
            SigTy::Float => f.write_str("float"),
            SigTy::Bool => f.write_str("bool"),
            SigTy::Str => f.write_str("string"),
            SigTy::Model => f.write_str("Model"),
            SigTy::Dataset => f.write_str("Dataset"),
            SigTy::PromptBatch => f.write_str("PromptBatch"),
            SigTy::Rollout => f.write_str("Rollout"),
            SigTy::Sample => f.write_str("Sample"),
            SigTy::PerToken => f.write_str("PerToken"),
            SigTy::PerSample => f.write_str("PerSample"),
            SigTy::Loss => f.write_str("Loss"),
            SigTy::Fn(s) => write!(f, "{s}"),
            SigTy::Error => f.write_str("{unknown}"),
        }
    }
}

impl fmt::Display for FnSig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ps: Vec<String> = self.params.iter().map(|p| p.to_string()).collect();
        write!(f, "fn({}) -> {}", ps.join(", "), self.ret)
    }
}

/// The type of a checked expression.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Ty {
    Int,
    Float,
    Bool,
    Str,
    /// The value of a statement with no result (`train(…)`).
    Unit,
    Model,
    Dataset,
    PromptBatch(BatchId),
    Rollout(RolloutId, BatchId),
    /// One sample, in a `fn` body.
    Sample,
    /// One sample's per-token values, in a `fn` body.
    Tokens,
    /// One sample's per-token booleans, in the body of a loss (a comparison of per-token
    /// values, evaluated elementwise).
    TokenBools,
    PerToken(RolloutId),
    PerSample(RolloutId),
    /// A loss over the samples of a rollout, computed with the outputs of a model (a
    /// Model-typed local of the pipeline). `None`: not known here — inside a loss body, where
    /// the loss belongs to the body's own model and to whatever rollout it is trained on.
    Loss(Option<RolloutId>, Option<crate::hir::LocalId>),
    Fn(FnSig),
    /// `adamw(...)` in a `train:` option.
    Optimizer,
    /// The type of something already reported as wrong; compatible with everything.
    Error,
}

impl Ty {
    pub fn is_error(&self) -> bool {
        matches!(self, Ty::Error)
    }

    pub fn is_numeric_scalar(&self) -> bool {
        matches!(self, Ty::Int | Ty::Float | Ty::Error)
    }

    /// The rollout a value belongs to, if it belongs to one.
    pub fn rollout(&self) -> Option<RolloutId> {
        match self {
            Ty::Rollout(r, _) | Ty::PerToken(r) | Ty::PerSample(r) => Some(*r),
            Ty::Loss(r, _) => *r,
            _ => None,
        }
    }

    /// The name users see in messages and hover.
    pub fn describe(&self) -> String {
        match self {
            Ty::Int => "int".into(),
            Ty::Float => "float".into(),
            Ty::Bool => "bool".into(),
            Ty::Str => "string".into(),
            Ty::Unit => "()".into(),
            Ty::Model => "Model".into(),
            Ty::Dataset => "Dataset".into(),
            Ty::PromptBatch(_) => "PromptBatch".into(),
            Ty::Rollout(..) => "Rollout".into(),
            Ty::Sample => "Sample".into(),
            Ty::Tokens => "PerToken".into(),
            Ty::TokenBools => "per-token bool".into(),
            Ty::PerToken(_) => "PerToken".into(),
            Ty::PerSample(_) => "PerSample".into(),
            Ty::Loss(..) => "Loss".into(),
            Ty::Fn(s) => s.to_string(),
            Ty::Optimizer => "Optimizer".into(),
            Ty::Error => "{unknown}".into(),
        }
    }
}

impl fmt::Display for Ty {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Ty::PerToken(r) => write!(f, "PerToken<r{}>", r.0),
            Ty::PerSample(r) => write!(f, "PerSample<r{}>", r.0),
            Ty::Rollout(r, b) => write!(f, "Rollout<r{}, b{}>", r.0, b.0),
            Ty::PromptBatch(b) => write!(f, "PromptBatch<b{}>", b.0),
            Ty::Loss(Some(r), Some(m)) => write!(f, "Loss<r{}, l{}>", r.0, m.0),
            Ty::Loss(Some(r), None) => write!(f, "Loss<r{}>", r.0),
            _ => f.write_str(&self.describe()),
        }
    }
}
