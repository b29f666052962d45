//! The kernel IR: what one `fn` body computes for one sample, in a typed, structured SSA form.
//!
//! A [`Kernel`] is written for one sample and applied to every sample of a batch by a backend —
//! the reference interpreter in [`interp`] or the Cranelift JIT in `braid-jit`. Both run through
//! the same driver ([`exec`]), which validates the inputs, runs the scope pre-pass of group and
//! batch kernels, and writes the outputs; so the backends differ only in how they evaluate one
//! sample, and the IR's semantics (written in `docs/kernels.md` and on [`Op`]) are defined so that
//! both give bit-identical results: every floating-point operation is specified with its operand
//! order, nothing is reassociated, and transcendental functions call the same Rust functions.
//!
//! This module must not know about any backend, the front end or libtorch: it is data, its text
//! form, its verifier, its builder and its interpreter.

pub mod builder;
pub mod exec;
pub mod host;
pub mod interp;
pub mod random;
mod text;
pub mod verify;

pub use builder::{BuildError, IfBuilder, KernelBuilder, SampleParam, ScanBuilder};
pub use exec::{Arg, Batch, KernelExec, Output, Ragged, RunError, SampleText};
pub use host::{FieldTy, FieldValue, Fields, HostCall, RecordField, StrField};
pub use interp::Interpreter;
pub use verify::{VerifyError, verify};

use serde::{Deserialize, Serialize};
use std::hash::{Hash, Hasher};

/// An SSA value: the index of the instruction that defines it in [`Kernel::insts`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Value(pub u32);

impl Value {
    /// The index of the defining instruction.
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// A block: a region of instructions with parameters and one result (see [`Block`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct BlockId(pub u32);

impl BlockId {
    /// The index of the block in [`Kernel::blocks`].
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// The type of a value inside a kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Ty {
    /// A 64-bit signed integer; arithmetic wraps.
    Int,
    /// An IEEE-754 binary64 float.
    Float,
    /// A boolean.
    Bool,
    /// One `Float` per token of the current sample (all such values have the sample's length).
    Tokens,
}

impl Ty {
    /// The name used in the text form.
    pub fn name(self) -> &'static str {
        match self {
            Ty::Int => "int",
            Ty::Float => "float",
            Ty::Bool => "bool",
            Ty::Tokens => "tokens",
        }
    }
}

/// The type of a scalar parameter: the same value for every sample.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ScalarTy {
    Int,
    Float,
    Bool,
}

impl ScalarTy {
    /// The kernel type of this scalar.
    pub fn ty(self) -> Ty {
        match self {
            ScalarTy::Int => Ty::Int,
            ScalarTy::Float => Ty::Float,
            ScalarTy::Bool => Ty::Bool,
        }
    }
}

/// What a kernel parameter carries (see `docs/kernels.md`, "Data layout").
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ParamKind {
    /// Ragged per-token floats; inside the kernel a [`Ty::Tokens`] value.
    PerToken,
    /// One float per sample; inside the kernel a [`Ty::Float`] value.
    PerSample,
    /// The same value for every sample.
    Scalar(ScalarTy),
    /// A sample: its strings are read by host calls, its ints by [`Op::SampleInt`].
    Sample,
}

impl ParamKind {
    /// The type of [`Op::Param`] for this kind, `None` for a `Sample` (not a value).
    pub fn value_ty(self) -> Option<Ty> {
        match self {
            ParamKind::PerToken => Some(Ty::Tokens),
            ParamKind::PerSample => Some(Ty::Float),
            ParamKind::Scalar(s) => Some(s.ty()),
            ParamKind::Sample => None,
        }
    }
}

/// Over which samples a scope reduction ([`Op::ScopeReduce`]) reduces.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Scope {
    /// `fn …` — no scope reductions; each sample is independent.
    Sample,
    /// `fn … over group` — over the samples sharing the sample's group id.
    Group,
    /// `fn … over batch` — over every sample of the batch.
    Batch,
}

/// An integer field of a `Sample` parameter.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum IntField {
    /// `.length`: the number of completion tokens (the sample's token count).
    Length,
    /// `.group`: the sample's group id.
    Group,
}

/// Unary operators.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum UnOp {
    /// Negation: `Int` (wrapping), `Float`, `Tokens` (elementwise sign flip).
    Neg,
    /// Boolean not.
    Not,
    /// `exp`: calls Rust's `f64::exp` in every backend.
    Exp,
    /// `log` (natural): calls Rust's `f64::ln` in every backend.
    Log,
    /// `sqrt`: IEEE-754 correctly rounded.
    Sqrt,
    /// `abs`: `Int` (wrapping: `abs(i64::MIN) == i64::MIN`), `Float`/`Tokens` (clears the sign).
    Abs,
    /// `float(i)`: `Int` to `Float`, rounding to nearest.
    IntToFloat,
}

/// Binary operators. Operands have equal types except that `Tokens` mixes with `Float`
/// (elementwise, the scalar broadcast); the builder inserts `IntToFloat` where the language
/// promotes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum BinOp {
    Add,
    Sub,
    Mul,
    /// Float division (the language's `/` always yields a float).
    Div,
    /// `Int`: remainder with the sign of the dividend, and `x % 0 == 0`, `x % -1 == 0`;
    /// `Float`: Rust's `%` (C `fmod`), called in every backend.
    Rem,
    /// `min(a, b)`: `Int` as usual; floats: `if a < b || a.is_nan() { a } else { b }`.
    Min,
    /// `max(a, b)`: `Int` as usual; floats: `if a > b || a.is_nan() { a } else { b }`.
    Max,
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
    /// Boolean and of two evaluated operands (the builder lowers `&&` to [`Op::If`] instead).
    And,
    /// Boolean or of two evaluated operands (the builder lowers `||` to [`Op::If`] instead).
    Or,
}

impl BinOp {
    /// Whether this is a comparison (result `Bool`).
    pub fn is_comparison(self) -> bool {
        matches!(
            self,
            BinOp::Eq | BinOp::Ne | BinOp::Lt | BinOp::Le | BinOp::Gt | BinOp::Ge
        )
    }
}

/// Reductions over tokens (or, for scope reductions of per-sample values, over samples).
/// Values are visited in order — samples by ascending index, tokens by ascending position — and
/// folded left to right; see each variant for the exact formula.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ReduceOp {
    /// `((0.0 + x0) + x1) + …`.
    Sum,
    /// `sum / n` (as floats); `0.0` when `n == 0`.
    Mean,
    /// Fold of float `max` (see [`BinOp::Max`]) from `-inf`; NaN propagates.
    Max,
    /// Fold of float `min` (see [`BinOp::Min`]) from `+inf`; NaN propagates.
    Min,
    /// The number of elements `!= 0.0` (NaN counts), an `Int`.
    Count,
    /// Population standard deviation: `m = mean`, `sqrt(((0.0 + (x0-m)*(x0-m)) + …) / n)`;
    /// `0.0` when `n == 0`.
    Std,
}

impl ReduceOp {
    /// The result type of the reduction.
    pub fn result_ty(self) -> Ty {
        match self {
            ReduceOp::Count => Ty::Int,
            _ => Ty::Float,
        }
    }

    /// The name used in the text form.
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Mean => "mean",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
            ReduceOp::Count => "count",
            ReduceOp::Std => "std",
        }
    }
}

/// The operation of an instruction. The result type is stored beside it in [`Inst::ty`] and
/// checked by the verifier.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Op {
    /// An integer constant.
    ConstInt(i64),
    /// A float constant, stored as its bits so that the IR has `Eq` and `Hash` (`-0.0` and NaN
    /// payloads are kept).
    ConstFloat(u64),
    /// A boolean constant.
    ConstBool(bool),
    /// The value of parameter `n` for the current sample (not for `Sample` parameters).
    Param(u32),
    /// An integer field of `Sample` parameter `param`.
    SampleInt { param: u32, field: IntField },
    /// The sample's token count, an `Int` (`len(x)` of any per-token value).
    Len,
    /// A unary operator.
    Unary(UnOp, Value),
    /// A binary operator.
    Binary(BinOp, Value, Value),
    /// `tokens[index]`: token `index` of a `Tokens` value, `0.0` when `index` is outside
    /// `0..len`.
    Index { tokens: Value, index: Value },
    /// A reduction of a `Tokens` value over the current sample's tokens.
    Reduce(ReduceOp, Value),
    /// A reduction over the kernel's scope (group or batch): of a per-sample value (`Int`,
    /// `Float`, `Bool`, converted to float) over the scope's samples, or of a `Tokens` value over
    /// all tokens of the scope's samples. Only in the entry block of group and batch kernels. Its
    /// argument may depend on other scope reductions: each level of nesting is one more
    /// pre-pass (see [`verify::scope_levels`]).
    ScopeReduce(ReduceOp, Value),
    /// Evaluates `then_block` when `cond` is true, else `else_block` (only the taken one), and
    /// yields its result. Both blocks have no parameters.
    If {
        cond: Value,
        then_block: BlockId,
        else_block: BlockId,
    },
    /// `scan [reverse] t with acc = init { … }`: visits `t` over `0..len` (descending when
    /// `reverse`), evaluating `body` with parameters `(t: Int, acc: Float)`; its `Float` result is
    /// the new accumulator and element `t` of the resulting `Tokens`.
    Scan {
        reverse: bool,
        init: Value,
        body: BlockId,
    },
    /// Parameter `index` of block `block` (defined by the construct that owns the block).
    BlockParam { block: BlockId, index: u32 },
    /// A host built-in: entry `n` of [`Kernel::host_calls`], of the call's
    /// [`HostCall::result_ty`] (`Int`, `Bool`, or a record field's `Float`).
    Host(u32),
}

/// An instruction: an operation and its result type.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Inst {
    pub op: Op,
    pub ty: Ty,
}

/// A region: parameters, instructions evaluated in order, and the value it yields. Values
/// defined in enclosing blocks (before the construct that owns this block) are visible.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Block {
    pub params: Vec<Value>,
    pub insts: Vec<Value>,
    pub result: Option<Value>,
}

/// A kernel: a `fn` body compiled for one sample.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Kernel {
    /// The `fn`'s name; not part of the structural hash.
    pub name: String,
    /// Parameters in order; `Op::Param(n)` and host calls refer to them by index.
    pub params: Vec<ParamKind>,
    /// The scope of [`Op::ScopeReduce`].
    pub scope: Scope,
    /// Host built-ins called by `Op::Host(n)`.
    pub host_calls: Vec<HostCall>,
    /// Every instruction; a [`Value`] indexes this arena.
    pub insts: Vec<Inst>,
    /// Every block; `Op::If` and `Op::Scan` own theirs.
    pub blocks: Vec<Block>,
    /// The block evaluated per sample; its result is the kernel's result.
    pub entry: BlockId,
}

/// What a kernel produces per sample.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ResultKind {
    /// One float per sample (an `Int` or `Bool` result is converted: `true` is `1.0`).
    PerSample,
    /// One float per token of each sample.
    PerToken,
}

impl Kernel {
    /// The type of a value.
    pub fn ty(&self, v: Value) -> Option<Ty> {
        self.insts.get(v.index()).map(|i| i.ty)
    }

    /// A block by id.
    pub fn block(&self, b: BlockId) -> Option<&Block> {
        self.blocks.get(b.index())
    }

    /// The value the entry block yields.
    pub fn result(&self) -> Option<Value> {
        self.block(self.entry).and_then(|b| b.result)
    }

    /// Per-sample or per-token, from the result's type.
    pub fn result_kind(&self) -> Option<ResultKind> {
        let ty = self.ty(self.result()?)?;
        Some(if ty == Ty::Tokens {
            ResultKind::PerToken
        } else {
            ResultKind::PerSample
        })
    }

    /// The scope reductions of the entry block, in order; their results are numbered by this
    /// order (the pre-pass fills one value per reduction and sample).
    pub fn scope_reductions(&self) -> Vec<Value> {
        let Some(entry) = self.block(self.entry) else {
            return Vec::new();
        };
        entry
            .insts
            .iter()
            .copied()
            .filter(|v| {
                matches!(
                    self.insts.get(v.index()).map(|i| &i.op),
                    Some(Op::ScopeReduce(..))
                )
            })
            .collect()
    }

    /// The dataset record fields the kernel reads, each with the type it is read as, sorted
    /// and without repeats: what every sample's record must hold.
    pub fn record_fields(&self) -> Vec<RecordField> {
        let mut out: Vec<RecordField> = self
            .host_calls
            .iter()
            .flat_map(HostCall::record_fields)
            .collect();
        out.sort();
        out.dedup();
        out
    }

    /// A structural hash: equal for kernels equal in everything but their name, stable across
    /// runs, processes and Rust versions (FNV-1a over the derived `Hash` stream), so it can key
    /// a cache of compiled kernels.
    pub fn structural_hash(&self) -> u64 {
        let mut h = Fnv1a::default();
        self.params.hash(&mut h);
        self.scope.hash(&mut h);
        self.host_calls.hash(&mut h);
        self.insts.hash(&mut h);
        self.blocks.hash(&mut h);
        self.entry.hash(&mut h);
        h.finish()
    }

    /// Whether two kernels are equal in everything but their name (what a cache hit must check,
    /// since a 64-bit hash can collide).
    pub fn same_structure(&self, other: &Kernel) -> bool {
        self.params == other.params
            && self.scope == other.scope
            && self.host_calls == other.host_calls
            && self.insts == other.insts
            && self.blocks == other.blocks
            && self.entry == other.entry
    }
}

/// FNV-1a, 64 bits: tiny, deterministic, and independent of `std`'s unspecified hasher.
struct Fnv1a(u64);

impl Default for Fnv1a {
    fn default() -> Self {
        Fnv1a(0xcbf2_9ce4_8422_2325)
    }
}

impl Hasher for Fnv1a {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 ^= u64::from(*b);
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }

    // `usize` lengths are hashed as 8 bytes on every platform, so the hash does not depend on
    // the pointer width.
    fn write_usize(&mut self, i: usize) {
        self.write(&(i as u64).to_le_bytes());
    }
}

/// Float semantics shared by every backend: the interpreter calls these, and the JIT either
/// emits the same instruction sequence (documented beside each) or calls these very functions.
pub mod fsem {
    /// `max(a, b)` on floats: `a` when `a > b` or `a` is NaN, else `b`.
    pub fn max(a: f64, b: f64) -> f64 {
        if a > b || a.is_nan() { a } else { b }
    }

    /// `min(a, b)` on floats: `a` when `a < b` or `a` is NaN, else `b`.
    pub fn min(a: f64, b: f64) -> f64 {
        if a < b || a.is_nan() { a } else { b }
    }

    /// Integer remainder: Rust's `%` except that a divisor of `0` or `-1` yields `0` (no trap).
    pub fn irem(a: i64, b: i64) -> i64 {
        if b == 0 || b == -1 { 0 } else { a % b }
    }

    /// `exp`: the host ABI's `braid_exp`.
    pub extern "C" fn exp(x: f64) -> f64 {
        x.exp()
    }

    /// `log`: the host ABI's `braid_log`.
    pub extern "C" fn log(x: f64) -> f64 {
        x.ln()
    }

    /// Float `%`: the host ABI's `braid_fmod`.
    pub extern "C" fn fmod(a: f64, b: f64) -> f64 {
        a % b
    }
}

#[cfg(test)]
mod tests;
