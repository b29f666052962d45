//! The builder that front ends use to make kernels: one method per construct, language typing
//! rules built in (int-to-float promotion, `/` always float), structured `if` and `scan` through
//! closures.
//!
//! The builder never panics: a misuse (an operand of the wrong type, a parameter declared after
//! an instruction, a value out of scope) is recorded, later calls go on returning values, and
//! [`KernelBuilder::finish`] returns the first error. `finish` also runs the verifier, so a
//! kernel that leaves the builder is valid. The builder must not decide anything a backend
//! decides (evaluation order, materialisation, fusion).
//!
//! ```
//! use braid_ir::kernel::{KernelBuilder, ParamKind, ScalarTy, Scope};
//! // fn gae(r: PerToken, v: PerToken, gamma: float, lambda: float) -> PerToken {
//! //   scan reverse t with acc = 0.0 {
//! //     let delta = r[t] + gamma * v[t + 1] - v[t]; acc = delta + gamma * lambda * acc } }
//! let mut b = KernelBuilder::new("gae", Scope::Sample);
//! let r = b.param(ParamKind::PerToken);
//! let v = b.param(ParamKind::PerToken);
//! let gamma = b.param(ParamKind::Scalar(ScalarTy::Float));
//! let lambda = b.param(ParamKind::Scalar(ScalarTy::Float));
//! let zero = b.float(0.0);
//! let adv = b.scan(true, zero, |b, t, acc| {
//!     let rt = b.index(r, t);
//!     let one = b.int(1);
//!     let t1 = b.add(t, one);
//!     let v_next = b.index(v, t1);
//!     let gv = b.mul(gamma, v_next);
//!     let vt = b.index(v, t);
//!     let s = b.add(rt, gv);
//!     let delta = b.sub(s, vt);
//!     let gl = b.mul(gamma, lambda);
//!     let gla = b.mul(gl, acc);
//!     b.add(delta, gla)
//! });
//! let kernel = b.finish(adv).unwrap();
//! assert_eq!(kernel.params.len(), 4);
//! ```

use super::{
    BinOp, Block, BlockId, HostCall, Inst, IntField, Kernel, Op, ParamKind, ReduceOp, ScalarTy,
    Scope, StrField, Ty, UnOp, Value, verify,
};

/// Why a kernel could not be built.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum BuildError {
    /// A builder method was misused; the message names the method and the operands.
    #[error("{0}")]
    Misuse(String),
    /// The finished kernel failed verification (a builder bug or a misuse not caught earlier).
    #[error("verifier: {0}")]
    Verify(#[from] verify::VerifyError),
}

/// An `if` being built (from [`KernelBuilder::begin_if`] to [`KernelBuilder::end_if`]).
#[derive(Debug)]
#[must_use = "an if must be ended with end_if"]
pub struct IfBuilder {
    cond: Value,
    then_block: BlockId,
    else_block: BlockId,
    then_value: Option<Value>,
    level: usize,
}

/// A `scan` being built (from [`KernelBuilder::begin_scan`] to [`KernelBuilder::end_scan`]).
#[derive(Debug)]
#[must_use = "a scan must be ended with end_scan"]
pub struct ScanBuilder {
    reverse: bool,
    init: Value,
    body: BlockId,
    level: usize,
}

/// A `Sample` parameter, for [`KernelBuilder::sample_int`] and the host-call methods.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SampleParam(pub u32);

/// Builds one [`Kernel`]. See the module doc for an example.
#[derive(Debug)]
pub struct KernelBuilder {
    kernel: Kernel,
    /// The blocks being filled, innermost last; the entry block is at the bottom.
    stack: Vec<BlockId>,
    error: Option<String>,
    /// Whether any instruction other than a parameter has been made.
    started: bool,
}

/// The value handed out after a misuse; it is never in a finished kernel.
const POISON: Value = Value(u32::MAX);

impl KernelBuilder {
    /// Starts a kernel of the given scope.
    pub fn new(name: impl Into<String>, scope: Scope) -> KernelBuilder {
        KernelBuilder {
            kernel: Kernel {
                name: name.into(),
                params: Vec::new(),
                scope,
                host_calls: Vec::new(),
                insts: Vec::new(),
                blocks: vec![Block::default()],
                entry: BlockId(0),
            },
            stack: vec![BlockId(0)],
            error: None,
            started: false,
        }
    }

    fn fail(&mut self, message: String) -> Value {
        if self.error.is_none() {
            self.error = Some(message);
        }
        POISON
    }

    /// The type of a value made by this builder (`None` for a value from a misuse).
    pub fn ty(&self, v: Value) -> Option<Ty> {
        self.kernel.ty(v)
    }

    fn emit(&mut self, op: Op, ty: Ty) -> Value {
        let v = Value(self.kernel.insts.len() as u32);
        self.kernel.insts.push(Inst { op, ty });
        let block = self.stack.last().copied().unwrap_or(BlockId(0));
        if let Some(b) = self.kernel.blocks.get_mut(block.index()) {
            b.insts.push(v);
        }
        v
    }

    fn emit_inst(&mut self, op: Op, ty: Ty) -> Value {
        self.started = true;
        self.emit(op, ty)
    }

    /// Declares the next parameter (per-token, per-sample or scalar) and returns its value.
    /// Parameters come before any other instruction. Use [`Self::sample_param`] for `Sample`.
    pub fn param(&mut self, kind: ParamKind) -> Value {
        if self.started {
            return self.fail("param: parameters must be declared before any instruction".into());
        }
        let Some(ty) = kind.value_ty() else {
            return self.fail("param: a Sample parameter is declared with sample_param".into());
        };
        let n = self.kernel.params.len() as u32;
        self.kernel.params.push(kind);
        self.emit(Op::Param(n), ty)
    }

    /// Declares the next parameter as a `Sample`.
    pub fn sample_param(&mut self) -> SampleParam {
        if self.started {
            self.fail("sample_param: parameters must be declared before any instruction".into());
        }
        let n = self.kernel.params.len() as u32;
        self.kernel.params.push(ParamKind::Sample);
        SampleParam(n)
    }

    /// An `int` constant.
    pub fn int(&mut self, x: i64) -> Value {
        self.emit_inst(Op::ConstInt(x), Ty::Int)
    }

    /// A `float` constant.
    pub fn float(&mut self, x: f64) -> Value {
        self.emit_inst(Op::ConstFloat(x.to_bits()), Ty::Float)
    }

    /// A `bool` constant.
    pub fn bool(&mut self, x: bool) -> Value {
        self.emit_inst(Op::ConstBool(x), Ty::Bool)
    }

    /// `s.length` or `s.group`.
    pub fn sample_int(&mut self, s: SampleParam, field: IntField) -> Value {
        self.emit_inst(Op::SampleInt { param: s.0, field }, Ty::Int)
    }

    /// `len(x)` of a per-token value: the sample's token count.
    pub fn len(&mut self) -> Value {
        self.emit_inst(Op::Len, Ty::Int)
    }

    /// `float(x)`: an `Int` converted; a `Float` or `Tokens` returned as is.
    pub fn to_float(&mut self, x: Value) -> Value {
        match self.ty(x) {
            Some(Ty::Int) => self.emit_inst(Op::Unary(UnOp::IntToFloat, x), Ty::Float),
            Some(Ty::Float | Ty::Tokens) => x,
            t => self.fail(format!("to_float: operand of type {t:?}")),
        }
    }

    fn unary(&mut self, op: UnOp, x: Value) -> Value {
        let t = self.ty(x);
        let ty = match (op, t) {
            (UnOp::Neg | UnOp::Abs, Some(t @ (Ty::Int | Ty::Float | Ty::Tokens))) => t,
            (UnOp::Not, Some(Ty::Bool)) => Ty::Bool,
            (UnOp::Exp | UnOp::Log | UnOp::Sqrt, Some(Ty::Int)) => {
                let f = self.to_float(x);
                return self.unary(op, f);
            }
            (UnOp::Exp | UnOp::Log | UnOp::Sqrt, Some(t @ (Ty::Float | Ty::Tokens))) => t,
            (UnOp::IntToFloat, Some(Ty::Int)) => Ty::Float,
            _ => return self.fail(format!("{op:?}: operand of type {t:?}")),
        };
        self.emit_inst(Op::Unary(op, x), ty)
    }

    /// `-x` (int, float or per-token).
    pub fn neg(&mut self, x: Value) -> Value {
        self.unary(UnOp::Neg, x)
    }
    /// `!x`.
    pub fn not(&mut self, x: Value) -> Value {
        self.unary(UnOp::Not, x)
    }
    /// `exp(x)` (an int is promoted).
    pub fn exp(&mut self, x: Value) -> Value {
        self.unary(UnOp::Exp, x)
    }
    /// `log(x)` (natural; an int is promoted).
    pub fn log(&mut self, x: Value) -> Value {
        self.unary(UnOp::Log, x)
    }
    /// `sqrt(x)` (an int is promoted).
    pub fn sqrt(&mut self, x: Value) -> Value {
        self.unary(UnOp::Sqrt, x)
    }
    /// `abs(x)` (an int stays an int).
    pub fn abs(&mut self, x: Value) -> Value {
        self.unary(UnOp::Abs, x)
    }

    /// Any binary operator with the language's promotions: `Int` with `Float` or `Tokens`
    /// becomes `Float`; `Div` always works on floats; `Tokens` with `Float` is elementwise.
    pub fn binary(&mut self, op: BinOp, a: Value, b: Value) -> Value {
        let (ta, tb) = (self.ty(a), self.ty(b));
        let (Some(ta), Some(tb)) = (ta, tb) else {
            return self.fail(format!("{op:?}: operand from a misuse"));
        };
        use Ty::*;
        match op {
            BinOp::And | BinOp::Or => {
                if (ta, tb) == (Bool, Bool) {
                    self.emit_inst(Op::Binary(op, a, b), Bool)
                } else {
                    self.fail(format!("{op:?}: operands {ta:?}, {tb:?}"))
                }
            }
            BinOp::Eq | BinOp::Ne if (ta, tb) == (Bool, Bool) => {
                self.emit_inst(Op::Binary(op, a, b), Bool)
            }
            _ if ta == Bool || tb == Bool => self.fail(format!("{op:?}: operands {ta:?}, {tb:?}")),
            _ if op.is_comparison() => match (ta, tb) {
                (Int, Int) | (Float, Float) => self.emit_inst(Op::Binary(op, a, b), Bool),
                (Int, Float) | (Float, Int) => {
                    let (a, b) = (self.to_float(a), self.to_float(b));
                    self.emit_inst(Op::Binary(op, a, b), Bool)
                }
                _ => self.fail(format!(
                    "{op:?}: per-token comparisons are not kernel IR ({ta:?}, {tb:?})"
                )),
            },
            _ => {
                let ty = match (ta, tb) {
                    (Int, Int) if op != BinOp::Div => Int,
                    (Int | Float, Int | Float) => Float,
                    _ => Tokens,
                };
                let (a, b) = if ty == Int {
                    (a, b)
                } else {
                    (self.to_float(a), self.to_float(b))
                };
                self.emit_inst(Op::Binary(op, a, b), ty)
            }
        }
    }

    /// `a + b`.
    pub fn add(&mut self, a: Value, b: Value) -> Value {
        self.binary(BinOp::Add, a, b)
    }
    /// `a - b`.
    pub fn sub(&mut self, a: Value, b: Value) -> Value {
        self.binary(BinOp::Sub, a, b)
    }
    /// `a * b`.
    pub fn mul(&mut self, a: Value, b: Value) -> Value {
        self.binary(BinOp::Mul, a, b)
    }
    /// `a / b` (always float).
    pub fn div(&mut self, a: Value, b: Value) -> Value {
        self.binary(BinOp::Div, a, b)
    }
    /// `a % b`.
    pub fn rem(&mut self, a: Value, b: Value) -> Value {
        self.binary(BinOp::Rem, a, b)
    }
    /// `min(a, b)`.
    pub fn min(&mut self, a: Value, b: Value) -> Value {
        self.binary(BinOp::Min, a, b)
    }
    /// `max(a, b)`.
    pub fn max(&mut self, a: Value, b: Value) -> Value {
        self.binary(BinOp::Max, a, b)
    }
    /// `clamp(x, lo, hi)` = `min(max(x, lo), hi)`.
    pub fn clamp(&mut self, x: Value, lo: Value, hi: Value) -> Value {
        let m = self.max(x, lo);
        self.min(m, hi)
    }
    /// A comparison (`BinOp::Eq` … `BinOp::Ge`).
    pub fn cmp(&mut self, op: BinOp, a: Value, b: Value) -> Value {
        if !op.is_comparison() {
            return self.fail(format!("cmp: {op:?} is not a comparison"));
        }
        self.binary(op, a, b)
    }

    /// `a && b` with `b` evaluated only when `a` is true (an [`Op::If`]).
    pub fn and_then(&mut self, a: Value, b: impl FnOnce(&mut KernelBuilder) -> Value) -> Value {
        self.if_else(a, b, |k| k.bool(false))
    }

    /// `a || b` with `b` evaluated only when `a` is false (an [`Op::If`]).
    pub fn or_else(&mut self, a: Value, b: impl FnOnce(&mut KernelBuilder) -> Value) -> Value {
        self.if_else(a, |k| k.bool(true), b)
    }

    /// `x[i]`: token `i` of a per-token value, `0.0` outside `0..len`.
    pub fn index(&mut self, tokens: Value, i: Value) -> Value {
        match (self.ty(tokens), self.ty(i)) {
            (Some(Ty::Tokens), Some(Ty::Int)) => {
                self.emit_inst(Op::Index { tokens, index: i }, Ty::Float)
            }
            (a, b) => self.fail(format!("index: operands {a:?}, {b:?} (need tokens, int)")),
        }
    }

    /// A reduction of a per-token value over the sample's tokens.
    pub fn reduce(&mut self, op: ReduceOp, x: Value) -> Value {
        match self.ty(x) {
            Some(Ty::Tokens) => self.emit_inst(Op::Reduce(op, x), op.result_ty()),
            t => self.fail(format!("reduce: operand of type {t:?} (need tokens)")),
        }
    }

    /// A reduction over the kernel's scope (group or batch kernels; at the top level, not
    /// inside `if` or `scan`).
    pub fn scope_reduce(&mut self, op: ReduceOp, x: Value) -> Value {
        if self.kernel.scope == Scope::Sample {
            return self.fail("scope_reduce: the kernel's scope is `sample`".into());
        }
        if self.stack.len() != 1 {
            return self.fail("scope_reduce: only at the kernel's top level".into());
        }
        self.emit_inst(Op::ScopeReduce(op, x), op.result_ty())
    }

    fn host(&mut self, call: HostCall) -> Value {
        let ty = call.result_ty();
        let n = self.kernel.host_calls.len() as u32;
        self.kernel.host_calls.push(call);
        self.emit_inst(Op::Host(n), ty)
    }

    /// `count(s.field, r"pattern")`: regex matches, an `Int`.
    pub fn count_regex(&mut self, s: SampleParam, field: StrField, pattern: &str) -> Value {
        self.host(HostCall::CountRegex {
            param: s.0,
            field,
            pattern: pattern.into(),
        })
    }
    /// `matches(s.field, r"pattern")`.
    pub fn matches_regex(&mut self, s: SampleParam, field: StrField, pattern: &str) -> Value {
        self.host(HostCall::MatchesRegex {
            param: s.0,
            field,
            pattern: pattern.into(),
        })
    }
    /// `contains(s.field, "lit")`.
    pub fn contains(&mut self, s: SampleParam, field: StrField, lit: &str) -> Value {
        self.host(HostCall::Contains {
            param: s.0,
            field,
            lit: lit.into(),
        })
    }
    /// `starts_with(s.field, "lit")`.
    pub fn starts_with(&mut self, s: SampleParam, field: StrField, lit: &str) -> Value {
        self.host(HostCall::StartsWith {
            param: s.0,
            field,
            lit: lit.into(),
        })
    }
    /// `ends_with(s.field, "lit")`.
    pub fn ends_with(&mut self, s: SampleParam, field: StrField, lit: &str) -> Value {
        self.host(HostCall::EndsWith {
            param: s.0,
            field,
            lit: lit.into(),
        })
    }
    /// `len(s.field)`: chars, an `Int`.
    pub fn str_len(&mut self, s: SampleParam, field: StrField) -> Value {
        self.host(HostCall::StrLen { param: s.0, field })
    }
    /// `answer_matches(s.completion, s.answer)`.
    pub fn answer_matches(
        &mut self,
        s: SampleParam,
        completion: StrField,
        answer: StrField,
    ) -> Value {
        self.host(HostCall::AnswerMatches {
            param: s.0,
            completion,
            answer,
        })
    }

    /// `text == "lit"`, a `Bool`.
    pub fn str_equals(&mut self, s: SampleParam, field: StrField, lit: &str) -> Value {
        self.host(HostCall::Equals {
            param: s.0,
            field,
            lit: lit.into(),
        })
    }
    /// `a == b` on two texts of one sample, a `Bool`.
    pub fn texts_equal(&mut self, s: SampleParam, a: StrField, b: StrField) -> Value {
        self.host(HostCall::TextsEqual { param: s.0, a, b })
    }
    /// `field_int(s, "name")` / `field_float` / `field_bool`: a record field of type `ty`.
    pub fn record_field(&mut self, s: SampleParam, name: &str, ty: ScalarTy) -> Value {
        self.host(HostCall::Field {
            param: s.0,
            name: name.into(),
            ty,
        })
    }

    fn new_block(&mut self) -> BlockId {
        let id = BlockId(self.kernel.blocks.len() as u32);
        self.kernel.blocks.push(Block::default());
        id
    }

    fn fill_block(&mut self, block: BlockId, f: impl FnOnce(&mut KernelBuilder) -> Value) -> Value {
        self.stack.push(block);
        let r = f(self);
        self.stack.pop();
        r
    }

    fn set_result(&mut self, block: BlockId, r: Value) {
        if let Some(b) = self.kernel.blocks.get_mut(block.index()) {
            b.result = Some(r);
        }
    }

    /// Converts the result of `block` to float (inside it) when it is an int.
    fn promote_result(&mut self, block: BlockId, r: Value) -> Value {
        if self.ty(r) == Some(Ty::Int) {
            self.fill_block(block, |b| b.to_float(r))
        } else {
            r
        }
    }

    /// Starts `if cond { … } else { … }`: instructions made next go to the `then` branch until
    /// [`Self::begin_else`]. Use this form (or [`Self::if_else`]) — the explicit one lets a
    /// lowering keep one `&mut` context across both branches.
    pub fn begin_if(&mut self, cond: Value) -> IfBuilder {
        if self.ty(cond) != Some(Ty::Bool) {
            self.fail(format!("begin_if: condition of type {:?}", self.ty(cond)));
        }
        self.started = true;
        let then_block = self.new_block();
        let else_block = self.new_block();
        self.stack.push(then_block);
        IfBuilder {
            cond,
            then_block,
            else_block,
            then_value: None,
            level: self.stack.len(),
        }
    }

    /// Ends the `then` branch with its value and starts the `else` branch.
    pub fn begin_else(&mut self, h: &mut IfBuilder, then_value: Value) {
        if self.stack.len() != h.level
            || self.stack.last() != Some(&h.then_block)
            || h.then_value.is_some()
        {
            self.fail("begin_else: not in the then branch of this if".into());
            return;
        }
        self.stack.pop();
        h.then_value = Some(then_value);
        self.stack.push(h.else_block);
    }

    /// Ends the `else` branch with its value and returns the `if`'s value (an int branch joined
    /// with a float one is promoted).
    pub fn end_if(&mut self, h: IfBuilder, else_value: Value) -> Value {
        let Some(mut rt) = h.then_value else {
            return self.fail("end_if: begin_else was not called".into());
        };
        if self.stack.len() != h.level || self.stack.last() != Some(&h.else_block) {
            return self.fail("end_if: not in the else branch of this if".into());
        }
        self.stack.pop();
        let (tb, eb) = (h.then_block, h.else_block);
        let mut re = else_value;
        let ty = match (self.ty(rt), self.ty(re)) {
            (Some(a), Some(b)) if a == b => a,
            (Some(Ty::Int), Some(Ty::Float)) => {
                rt = self.promote_result(tb, rt);
                Ty::Float
            }
            (Some(Ty::Float), Some(Ty::Int)) => {
                re = self.promote_result(eb, re);
                Ty::Float
            }
            (a, b) => return self.fail(format!("end_if: branches of types {a:?} and {b:?}")),
        };
        self.set_result(tb, rt);
        self.set_result(eb, re);
        self.emit(
            Op::If {
                cond: h.cond,
                then_block: tb,
                else_block: eb,
            },
            ty,
        )
    }

    /// `if cond { then } else { otherwise }` with one closure per branch (each builds its branch
    /// and returns the branch's value); see [`Self::begin_if`] for the explicit form.
    pub fn if_else(
        &mut self,
        cond: Value,
        then: impl FnOnce(&mut KernelBuilder) -> Value,
        otherwise: impl FnOnce(&mut KernelBuilder) -> Value,
    ) -> Value {
        let mut h = self.begin_if(cond);
        let t = then(self);
        self.begin_else(&mut h, t);
        let e = otherwise(self);
        self.end_if(h, e)
    }

    /// Starts `scan [reverse] t with acc = init { … }`: returns the scan's handle, `t` (an
    /// `Int`) and `acc` (a `Float`); instructions made next form the body until
    /// [`Self::end_scan`].
    pub fn begin_scan(&mut self, reverse: bool, init: Value) -> (ScanBuilder, Value, Value) {
        let init = match self.ty(init) {
            Some(Ty::Int) => self.to_float(init),
            Some(Ty::Float) => init,
            t => self.fail(format!("begin_scan: initial accumulator of type {t:?}")),
        };
        self.started = true;
        let body = self.new_block();
        let t = self.emit_param(body, 0, Ty::Int);
        let acc = self.emit_param(body, 1, Ty::Float);
        self.stack.push(body);
        (
            ScanBuilder {
                reverse,
                init,
                body,
                level: self.stack.len(),
            },
            t,
            acc,
        )
    }

    /// Ends a scan's body with the new accumulator and returns the per-token result.
    pub fn end_scan(&mut self, s: ScanBuilder, next_acc: Value) -> Value {
        if self.stack.len() != s.level || self.stack.last() != Some(&s.body) {
            return self.fail("end_scan: not in the body of this scan".into());
        }
        self.stack.pop();
        let r = match self.ty(next_acc) {
            Some(Ty::Int) => self.promote_result(s.body, next_acc),
            Some(Ty::Float) => next_acc,
            t => return self.fail(format!("end_scan: accumulator update of type {t:?}")),
        };
        self.set_result(s.body, r);
        self.emit(
            Op::Scan {
                reverse: s.reverse,
                init: s.init,
                body: s.body,
            },
            Ty::Tokens,
        )
    }

    /// `scan [reverse] t with acc = init { … }`: the closure gets `t` (an `Int`) and `acc` (a
    /// `Float`) and returns the new accumulator; the result is a per-token value.
    pub fn scan(
        &mut self,
        reverse: bool,
        init: Value,
        body: impl FnOnce(&mut KernelBuilder, Value, Value) -> Value,
    ) -> Value {
        let (s, t, acc) = self.begin_scan(reverse, init);
        let r = body(self, t, acc);
        self.end_scan(s, r)
    }

    fn emit_param(&mut self, block: BlockId, index: u32, ty: Ty) -> Value {
        let v = Value(self.kernel.insts.len() as u32);
        self.kernel.insts.push(Inst {
            op: Op::BlockParam { block, index },
            ty,
        });
        if let Some(b) = self.kernel.blocks.get_mut(block.index()) {
            b.params.push(v);
        }
        v
    }

    /// Ends the kernel with `result` (per-token when it is a `Tokens` value, else per-sample)
    /// and verifies it.
    pub fn finish(mut self, result: Value) -> Result<Kernel, BuildError> {
        if let Some(e) = self.error {
            return Err(BuildError::Misuse(e));
        }
        if self.stack.len() != 1 {
            return Err(BuildError::Misuse(
                "finish: an if or scan was not ended".into(),
            ));
        }
        let entry = self.kernel.entry;
        self.set_result(entry, result);
        verify::verify(&self.kernel)?;
        Ok(self.kernel)
    }
}
