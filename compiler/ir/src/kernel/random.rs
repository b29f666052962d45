//! Random well-typed kernels and inputs made from a byte string, for differential testing of
//! backends (the JIT's property tests and its `cargo fuzz` target share this generator).
//!
//! Every byte string yields a valid kernel (the builder's checks and the verifier pass) and
//! well-formed inputs; running out of bytes reads zeros, so short inputs make small kernels. It
//! must never produce a kernel the verifier rejects — a failure to build is a generator bug,
//! which [`random_case`] reports as an `Err`.

use super::builder::{BuildError, SampleParam};
use super::exec::{Arg, Batch, Ragged, SampleText};
use super::{
    BinOp, FieldValue, Fields, IntField, Kernel, KernelBuilder, ParamKind, ReduceOp, ScalarTy,
    Scope, StrField, Ty, Value,
};

/// A reader of choices from bytes; zeros once the bytes run out.
#[derive(Debug)]
pub struct Bytes<'a> {
    data: &'a [u8],
    pos: usize,
}

impl<'a> Bytes<'a> {
    pub fn new(data: &'a [u8]) -> Bytes<'a> {
        Bytes { data, pos: 0 }
    }

    pub fn byte(&mut self) -> u8 {
        let b = self.data.get(self.pos).copied().unwrap_or(0);
        self.pos += 1;
        b
    }

    /// A number in `0..n` (`0` when `n == 0`).
    pub fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            usize::from(self.byte()) % n
        }
    }

    pub fn u64(&mut self) -> u64 {
        (0..8).fold(0u64, |a, _| (a << 8) | u64::from(self.byte()))
    }

    /// A float, often one of the values where backends tend to differ.
    pub fn f64(&mut self) -> f64 {
        const SPECIAL: [f64; 14] = [
            0.0,
            -0.0,
            1.0,
            -1.0,
            0.5,
            2.5,
            -3.75,
            1e-300,
            1e300,
            f64::NAN,
            f64::INFINITY,
            f64::NEG_INFINITY,
            f64::MIN_POSITIVE,
            f64::EPSILON,
        ];
        match self.below(4) {
            0 => SPECIAL[self.below(SPECIAL.len())],
            1 => f64::from_bits(self.u64()),
            _ => (f64::from(self.byte()) - 128.0) / 16.0,
        }
    }

    pub fn i64(&mut self) -> i64 {
        const SPECIAL: [i64; 6] = [0, 1, -1, 2, i64::MIN, i64::MAX];
        match self.below(3) {
            0 => SPECIAL[self.below(SPECIAL.len())],
            _ => i64::from(self.byte() as i8) / 8,
        }
    }
}

/// An input argument that owns its data.
#[derive(Clone, Debug, PartialEq)]
pub enum OwnedArg {
    PerToken {
        values: Vec<f64>,
        offsets: Vec<usize>,
    },
    PerSample(Vec<f64>),
    Int(i64),
    Float(f64),
    Bool(bool),
    Sample,
}

/// A batch and arguments that own their data.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct OwnedInputs {
    pub n_samples: usize,
    pub lengths: Vec<usize>,
    pub groups: Vec<i64>,
    pub texts: Vec<SampleText>,
    pub args: Vec<OwnedArg>,
}

impl OwnedInputs {
    /// The batch view.
    pub fn batch(&self) -> Batch<'_> {
        Batch {
            n_samples: self.n_samples,
            lengths: Some(&self.lengths),
            groups: Some(&self.groups),
            texts: Some(&self.texts),
        }
    }

    /// The argument views.
    pub fn args(&self) -> Vec<Arg<'_>> {
        self.args
            .iter()
            .map(|a| match a {
                OwnedArg::PerToken { values, offsets } => Arg::PerToken(Ragged { values, offsets }),
                OwnedArg::PerSample(v) => Arg::PerSample(v),
                OwnedArg::Int(i) => Arg::Int(*i),
                OwnedArg::Float(f) => Arg::Float(*f),
                OwnedArg::Bool(b) => Arg::Bool(*b),
                OwnedArg::Sample => Arg::Sample,
            })
            .collect()
    }
}

/// A random kernel with inputs for it.
#[derive(Clone, Debug)]
pub struct RandomCase {
    pub kernel: Kernel,
    pub inputs: OwnedInputs,
}

const TEXTS: [&str; 6] = [
    "the answer is 42",
    "\\boxed{1,000}",
    "aeiou xyz",
    "",
    "$1000.0 total",
    "7 then 8",
];
const PATTERNS: [&str; 3] = ["[aeiou]", "\\d+", "a|x"];

/// Makes a kernel and inputs from bytes (see the module doc).
pub fn random_case(data: &[u8]) -> Result<RandomCase, BuildError> {
    let mut u = Bytes::new(data);
    let scope = match u.below(5) {
        0 => Scope::Group,
        1 => Scope::Batch,
        _ => Scope::Sample,
    };
    let mut g = Gen {
        u,
        b: KernelBuilder::new("random", scope),
        budget: 24,
        sample: None,
    };
    let mut pool: Vec<Value> = Vec::new();
    let n_params = 1 + g.u.below(4);
    let mut kinds = Vec::new();
    for _ in 0..n_params {
        let kind = match g.u.below(7) {
            0..=2 => ParamKind::PerToken,
            3 => ParamKind::PerSample,
            4 => ParamKind::Scalar(ScalarTy::Float),
            5 => ParamKind::Scalar(ScalarTy::Int),
            _ => ParamKind::Scalar(ScalarTy::Bool),
        };
        kinds.push(kind);
        let v = g.b.param(kind);
        pool.push(v);
    }
    if g.u.below(3) == 0 {
        g.sample = Some(g.b.sample_param());
        kinds.push(ParamKind::Sample);
    }
    let n = 4 + g.u.below(12);
    for _ in 0..n {
        g.step(&mut pool, 0, scope != Scope::Sample);
    }
    let result = g.combine(&pool);
    let kernel = g.b.finish(result)?;
    let inputs = random_inputs(&mut g.u, &kinds);
    Ok(RandomCase { kernel, inputs })
}

/// The record fields the generated kernels read (`n`: int, `x`: float, `b`: bool, `t`:
/// string). One sample in sixteen lacks `n` or holds another type in `x`, so that the driver's
/// field check (shared by both backends) is exercised too.
fn random_fields(u: &mut Bytes<'_>) -> Fields {
    let mut f = Fields::new();
    match u.below(16) {
        0 => {}
        1 => {
            f.insert("n".into(), FieldValue::Str("3".into()));
        }
        _ => {
            f.insert("n".into(), FieldValue::Int(u.i64() % 100));
        }
    }
    let x = match u.below(16) {
        0 => FieldValue::Bool(true),
        1..=4 => FieldValue::Int(u.i64()),
        _ => FieldValue::Float(u.f64()),
    };
    f.insert("x".into(), x);
    f.insert("b".into(), FieldValue::Bool(u.below(2) == 1));
    f.insert(
        "t".into(),
        FieldValue::Str(TEXTS[u.below(TEXTS.len())].into()),
    );
    f
}

fn random_inputs(u: &mut Bytes<'_>, kinds: &[ParamKind]) -> OwnedInputs {
    let n = u.below(6);
    let lengths: Vec<usize> = (0..n).map(|_| u.below(7)).collect();
    let groups: Vec<i64> = (0..n).map(|_| u.below(3) as i64).collect();
    let texts: Vec<SampleText> = (0..n)
        .map(|_| SampleText {
            prompt: TEXTS[u.below(TEXTS.len())].into(),
            completion: TEXTS[u.below(TEXTS.len())].into(),
            answer: ["42", "1000", "8"][u.below(3)].into(),
            fields: random_fields(u),
        })
        .collect();
    let mut offsets = vec![0usize];
    for l in &lengths {
        offsets.push(offsets.last().copied().unwrap_or(0) + l);
    }
    let total = offsets.last().copied().unwrap_or(0);
    let args = kinds
        .iter()
        .map(|k| match k {
            ParamKind::PerToken => OwnedArg::PerToken {
                values: (0..total).map(|_| u.f64()).collect(),
                offsets: offsets.clone(),
            },
            ParamKind::PerSample => OwnedArg::PerSample((0..n).map(|_| u.f64()).collect()),
            ParamKind::Scalar(ScalarTy::Float) => OwnedArg::Float(u.f64()),
            ParamKind::Scalar(ScalarTy::Int) => OwnedArg::Int(u.i64()),
            ParamKind::Scalar(ScalarTy::Bool) => OwnedArg::Bool(u.below(2) == 1),
            ParamKind::Sample => OwnedArg::Sample,
        })
        .collect();
    OwnedInputs {
        n_samples: n,
        lengths,
        groups,
        texts,
        args,
    }
}

struct Gen<'a> {
    u: Bytes<'a>,
    b: KernelBuilder,
    /// Instructions left to make; bounds the kernel's size whatever the bytes say.
    budget: usize,
    sample: Option<SampleParam>,
}

impl Gen<'_> {
    fn of(&self, pool: &[Value], pred: impl Fn(Ty) -> bool) -> Vec<Value> {
        pool.iter()
            .copied()
            .filter(|v| self.b.ty(*v).is_some_and(&pred))
            .collect()
    }

    /// A value of the pool satisfying `pred`, half the time one of the three latest (so that
    /// values feed each other and the result observes much of the kernel).
    fn pick(&mut self, pool: &[Value], pred: impl Fn(Ty) -> bool) -> Option<Value> {
        let c = self.of(pool, pred);
        if c.is_empty() {
            return None;
        }
        let i = if self.u.below(2) == 0 {
            c.len() - 1 - self.u.below(c.len().min(3))
        } else {
            self.u.below(c.len())
        };
        Some(c[i])
    }

    /// The kernel's result: the sum of a few numeric values (recent ones first), so that a
    /// difference anywhere they depend on shows in the output.
    fn combine(&mut self, pool: &[Value]) -> Value {
        let mut numeric = self.of(pool, Self::numeric);
        // A recent comparison joins the sum as 1.0 or 0.0.
        if let Some(&c) = self.of(pool, |t| t == Ty::Bool).last() {
            let mut h = self.b.begin_if(c);
            let one = self.b.float(1.0);
            self.b.begin_else(&mut h, one);
            let zero = self.b.float(0.0);
            numeric.push(self.b.end_if(h, zero));
        }
        let mut r: Option<Value> = None;
        for v in numeric.iter().rev().take(1 + self.u.below(4)) {
            r = Some(match r {
                None => *v,
                Some(acc) => self.b.add(acc, *v),
            });
        }
        match r {
            Some(v) => v,
            None => self.pick_any(pool),
        }
    }

    fn pick_any(&mut self, pool: &[Value]) -> Value {
        match self.pick(pool, |_| true) {
            Some(v) => v,
            None => self.b.float(0.0),
        }
    }

    /// A value of type `ty` from the pool, or a fresh constant (for `Tokens`: a parameter or
    /// `None` when there is none).
    fn value_of(&mut self, pool: &[Value], ty: Ty) -> Option<Value> {
        if let Some(v) = self.pick(pool, |t| t == ty)
            && self.u.below(4) != 0
        {
            return Some(v);
        }
        let v = match ty {
            Ty::Int => {
                let i = self.u.i64();
                self.b.int(i)
            }
            Ty::Float => {
                let f = self.u.f64();
                self.b.float(f)
            }
            Ty::Bool => {
                let c = self.u.below(2) == 1;
                self.b.bool(c)
            }
            Ty::Tokens => return self.pick(pool, |t| t == Ty::Tokens),
        };
        Some(v)
    }

    fn numeric(t: Ty) -> bool {
        matches!(t, Ty::Int | Ty::Float | Ty::Tokens)
    }

    /// Makes one instruction (or construct) and adds its value to `pool`.
    fn step(&mut self, pool: &mut Vec<Value>, depth: usize, top_scope: bool) {
        if self.budget == 0 {
            return;
        }
        self.budget -= 1;
        let made = match self.u.below(16) {
            0 => {
                let ty = [Ty::Int, Ty::Float, Ty::Bool][self.u.below(3)];
                self.value_of(pool, ty)
            }
            1 | 2 => {
                let Some(a) = self.pick(pool, Self::numeric) else {
                    return;
                };
                let op = [
                    BinOp::Add,
                    BinOp::Sub,
                    BinOp::Mul,
                    BinOp::Div,
                    BinOp::Rem,
                    BinOp::Min,
                    BinOp::Max,
                ][self.u.below(7)];
                let Some(b) = self.pick(pool, Self::numeric) else {
                    return;
                };
                Some(self.b.binary(op, a, b))
            }
            3 => {
                let Some(a) = self.pick(pool, Self::numeric) else {
                    return;
                };
                let v = match self.u.below(5) {
                    0 => self.b.neg(a),
                    1 => self.b.exp(a),
                    2 => self.b.log(a),
                    3 => self.b.sqrt(a),
                    _ => self.b.abs(a),
                };
                Some(v)
            }
            4 => {
                let Some(a) = self.pick(pool, |t| matches!(t, Ty::Int | Ty::Float)) else {
                    return;
                };
                let b = if self.u.below(3) == 0 {
                    a
                } else {
                    let Some(b) = self.pick(pool, |t| matches!(t, Ty::Int | Ty::Float)) else {
                        return;
                    };
                    b
                };
                let op = [
                    BinOp::Eq,
                    BinOp::Ne,
                    BinOp::Lt,
                    BinOp::Le,
                    BinOp::Gt,
                    BinOp::Ge,
                ][self.u.below(6)];
                Some(self.b.cmp(op, a, b))
            }
            5 => {
                let Some(a) = self.pick(pool, |t| t == Ty::Bool) else {
                    return;
                };
                let v = match self.u.below(3) {
                    0 => self.b.not(a),
                    1 => {
                        let Some(b) = self.pick(pool, |t| t == Ty::Bool) else {
                            return;
                        };
                        self.b.binary(BinOp::And, a, b)
                    }
                    _ => {
                        let Some(b) = self.pick(pool, |t| t == Ty::Bool) else {
                            return;
                        };
                        self.b.binary(BinOp::Or, a, b)
                    }
                };
                Some(v)
            }
            6 | 7 => {
                let Some(x) = self.pick(pool, |t| t == Ty::Tokens) else {
                    return;
                };
                let Some(i) = self.value_of(pool, Ty::Int) else {
                    return;
                };
                Some(self.b.index(x, i))
            }
            8 => {
                let Some(x) = self.pick(pool, |t| t == Ty::Tokens) else {
                    return;
                };
                let op = self.reduce_op();
                Some(self.b.reduce(op, x))
            }
            9 if top_scope && depth == 0 => {
                let Some(x) = self.pick(pool, |_| true) else {
                    return;
                };
                let op = self.reduce_op();
                Some(self.b.scope_reduce(op, x))
            }
            10 if depth < 3 => self.if_else(pool, depth, top_scope),
            11 if depth < 3 => self.scan(pool, depth, top_scope),
            12 => {
                let v = match self.u.below(3) {
                    0 => self.b.len(),
                    _ => match self.sample {
                        Some(s) => {
                            let f = if self.u.below(2) == 0 {
                                IntField::Length
                            } else {
                                IntField::Group
                            };
                            self.b.sample_int(s, f)
                        }
                        None => self.b.len(),
                    },
                };
                Some(v)
            }
            13 => {
                let Some(s) = self.sample else { return };
                let f = [
                    StrField::Prompt,
                    StrField::Completion,
                    StrField::Answer,
                    StrField::Record("t".into()),
                ][self.u.below(4)]
                .clone();
                let v = match self.u.below(12) {
                    0 => self
                        .b
                        .count_regex(s, f, PATTERNS[self.u.below(PATTERNS.len())]),
                    1 => self
                        .b
                        .matches_regex(s, f, PATTERNS[self.u.below(PATTERNS.len())]),
                    2 => self.b.contains(s, f, "a"),
                    3 => self.b.starts_with(s, f, "the"),
                    4 => self.b.ends_with(s, f, "}"),
                    5 => self.b.str_len(s, f),
                    6 => self.b.str_equals(s, f, TEXTS[self.u.below(TEXTS.len())]),
                    7 => self.b.texts_equal(s, f, StrField::Completion),
                    8 => self.b.record_field(s, "n", ScalarTy::Int),
                    9 => self.b.record_field(s, "x", ScalarTy::Float),
                    10 => self.b.record_field(s, "b", ScalarTy::Bool),
                    _ => self
                        .b
                        .answer_matches(s, StrField::Completion, StrField::Answer),
                };
                Some(v)
            }
            14 => {
                let Some(x) = self.pick(pool, |t| matches!(t, Ty::Int | Ty::Float | Ty::Tokens))
                else {
                    return;
                };
                let Some(lo) = self.value_of(pool, Ty::Float) else {
                    return;
                };
                let Some(hi) = self.value_of(pool, Ty::Float) else {
                    return;
                };
                Some(self.b.clamp(x, lo, hi))
            }
            _ => {
                let Some(a) = self.pick(pool, |t| t == Ty::Int) else {
                    return;
                };
                Some(self.b.to_float(a))
            }
        };
        if let Some(v) = made {
            pool.push(v);
        }
    }

    fn reduce_op(&mut self) -> ReduceOp {
        [
            ReduceOp::Sum,
            ReduceOp::Mean,
            ReduceOp::Max,
            ReduceOp::Min,
            ReduceOp::Count,
            ReduceOp::Std,
        ][self.u.below(6)]
    }

    /// Builds a nested block: a few steps, then a value of type `ty`, which it returns.
    fn nested(&mut self, pool: &[Value], depth: usize, ty: Ty, extra: &[Value]) -> Value {
        let mut inner: Vec<Value> = pool.iter().chain(extra).copied().collect();
        for _ in 0..self.u.below(4) {
            self.step(&mut inner, depth + 1, false);
        }
        match self.value_of(&inner, ty) {
            Some(v) => v,
            None => self.b.float(0.0),
        }
    }

    fn if_else(&mut self, pool: &[Value], depth: usize, _top: bool) -> Option<Value> {
        let c = self.pick(pool, |t| t == Ty::Bool)?;
        let has_tokens = self.pick(pool, |t| t == Ty::Tokens).is_some();
        let ty = match self.u.below(4) {
            0 => Ty::Int,
            1 => Ty::Bool,
            2 if has_tokens => Ty::Tokens,
            _ => Ty::Float,
        };
        let mut h = self.b.begin_if(c);
        let t = self.nested(pool, depth, ty, &[]);
        self.b.begin_else(&mut h, t);
        let e = self.nested(pool, depth, ty, &[]);
        let v = self.b.end_if(h, e);
        Some(v)
    }

    fn scan(&mut self, pool: &[Value], depth: usize, _top: bool) -> Option<Value> {
        let init = self.value_of(pool, Ty::Float)?;
        let reverse = self.u.below(2) == 1;
        let (s, t, acc) = self.b.begin_scan(reverse, init);
        let r = self.nested(pool, depth, Ty::Float, &[t, acc]);
        let v = self.b.end_scan(s, r);
        Some(v)
    }
}
