//! Kernel IR to Cranelift IR: one function per sample evaluation (`main`) and, for group and
//! batch kernels, one for the scope pre-pass.
//!
//! Every per-token value other than a parameter is materialised into its own scratch slot of
//! `len` floats by a loop at its definition, except an elementwise operation whose only use is
//! as an operand of another elementwise operation of the same block, which is computed inside
//! its user's loop (fused; see `Layout::fused`). Elementwise operations are pure, so neither
//! choice changes a result: each token sees the interpreter's operations in its order. Every float operation
//! is the one the interpreter performs, with the same operands in the same order: IEEE add, sub,
//! mul, div, sqrt, neg and abs are single instructions on both sides; `exp`, `log` and float `%`
//! call the very Rust functions the interpreter calls (`braid_ir::kernel::fsem`); `min`/`max`
//! are emitted as the compare-and-select sequence `fsem::min`/`fsem::max` define; reductions
//! fold left to right like `braid_ir::kernel::exec::reduce`.
//!
//! Memory safety of the generated code rests on three facts, checked by `CompiledKernel`
//! before each call: every per-token buffer (parameter, scratch slot, output) has exactly `len`
//! elements, and loops only visit `0..len`; `Index` compares its index with `len` (unsigned)
//! before loading and reads `0.0` otherwise; the frame's other arrays have the sizes the
//! kernel's layout states. This module must not emit a load whose address is not covered by one
//! of these.

use crate::JitError;
use crate::frame::{
    OFF_GROUP, OFF_HOST, OFF_LEN, OFF_OUT, OFF_RED_OUT, OFF_SCOPE_VALS, OFF_SCRATCH, OFF_SLOTS,
};
use braid_ir::kernel::{
    BinOp, BlockId, IntField, Kernel, Op, ParamKind, ReduceOp, Ty, UnOp, Value,
};
use cranelift_codegen::Context;
use cranelift_codegen::ir::condcodes::{FloatCC, IntCC};
use cranelift_codegen::ir::immediates::Ieee64;
use cranelift_codegen::ir::types::{F64, I8, I64};
use cranelift_codegen::ir::{self, AbiParam, FuncRef, InstBuilder, MemFlagsData, UserFuncName};
use cranelift_frontend::{FunctionBuilder, FunctionBuilderContext};
use cranelift_jit::JITModule;
use cranelift_module::{FuncId, Linkage, Module};

/// Where each per-token value lives: scratch slot numbers, or nowhere for a fused one.
#[derive(Clone, Debug)]
pub(crate) struct Layout {
    /// The number of scratch slots (each `len` floats).
    pub n_scratch: usize,
    /// Per IR value: computed inside its user's loop instead of materialised (an elementwise
    /// per-token operation whose only use is as an operand of another elementwise per-token
    /// operation of the same block).
    pub fused: Vec<bool>,
    /// Per IR value: its scratch slot, for computed per-token values.
    pub slot: Vec<Option<usize>>,
    /// Per IR value: its index among the scope reductions.
    pub reduction: Vec<Option<usize>>,
    /// The scope reductions' arguments, whether each is per-token, and each one's scope level.
    pub reductions: Vec<(Value, bool, u32)>,
    /// The scope level of each value (`braid_ir::kernel::verify::scope_levels`).
    pub level: Vec<u32>,
    /// The highest scope level: the number of pre-passes.
    pub max_level: u32,
}

impl Layout {
    pub(crate) fn of(k: &Kernel) -> Layout {
        let fused = fusable(k);
        let mut slot = vec![None; k.insts.len()];
        let mut n_scratch = 0;
        for (i, inst) in k.insts.iter().enumerate() {
            let computed = matches!(inst.op, Op::Unary(..) | Op::Binary(..) | Op::Scan { .. });
            if inst.ty == Ty::Tokens && computed && !fused[i] {
                slot[i] = Some(n_scratch);
                n_scratch += 1;
            }
        }
        let level = braid_ir::kernel::verify::scope_levels(k);
        let mut reduction = vec![None; k.insts.len()];
        let mut reductions = Vec::new();
        for (r, v) in k.scope_reductions().into_iter().enumerate() {
            reduction[v.index()] = Some(r);
            if let Op::ScopeReduce(_, arg) = k.insts[v.index()].op {
                reductions.push((arg, k.ty(arg) == Some(Ty::Tokens), level[v.index()]));
            }
        }
        Layout {
            n_scratch,
            fused,
            slot,
            reduction,
            max_level: reductions.iter().map(|r| r.2).max().unwrap_or(0),
            reductions,
            level,
        }
    }
}

/// Whether a value is an elementwise per-token operation (computed by a loop over tokens).
fn elementwise(k: &Kernel, v: Value) -> bool {
    k.insts
        .get(v.index())
        .is_some_and(|i| i.ty == Ty::Tokens && matches!(i.op, Op::Unary(..) | Op::Binary(..)))
}

/// Which values are fused into their user (see [`Layout::fused`]). Fusing changes no result:
/// the user's loop computes, for each token, the very operations the fused value's loop would
/// have, in the same order, from operands that are not overwritten in between (a scratch slot
/// is written only by its own instruction, and both instructions are in one block).
fn fusable(k: &Kernel) -> Vec<bool> {
    let n = k.insts.len();
    let mut uses = vec![0u32; n];
    let mut user: Vec<Option<Value>> = vec![None; n];
    let mut block_of = vec![usize::MAX; n];
    for (b, block) in k.blocks.iter().enumerate() {
        for &x in &block.insts {
            block_of[x.index()] = b;
        }
        if let Some(r) = block.result {
            // A block's result is used by a construct, never fused.
            uses[r.index()] += 2;
        }
    }
    for (i, inst) in k.insts.iter().enumerate() {
        let operands: Vec<Value> = match &inst.op {
            Op::Unary(_, a) | Op::Reduce(_, a) | Op::ScopeReduce(_, a) => vec![*a],
            Op::Binary(_, a, b) => vec![*a, *b],
            Op::Index { tokens, index } => vec![*tokens, *index],
            Op::If { cond, .. } => vec![*cond],
            Op::Scan { init, .. } => vec![*init],
            _ => vec![],
        };
        for a in operands {
            if let Some(u) = uses.get_mut(a.index()) {
                *u += 1;
                user[a.index()] = Some(Value(i as u32));
            }
        }
    }
    // Scope reductions read their arguments in the pre-pass: keep those materialised.
    for v in k.scope_reductions() {
        if let Op::ScopeReduce(_, a) = k.insts[v.index()].op {
            uses[a.index()] += 2;
        }
    }
    (0..n)
        .map(|i| {
            let v = Value(i as u32);
            elementwise(k, v)
                && uses[i] == 1
                && user[i].is_some_and(|u| elementwise(k, u) && block_of[u.index()] == block_of[i])
        })
        .collect()
}

/// The host functions a kernel function may call, declared in the module.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Imports {
    pub exp: FuncId,
    pub log: FuncId,
    pub fmod: FuncId,
    pub host: FuncId,
}

/// Symbol names of the host ABI (see `docs/kernels.md`).
pub(crate) const SYM_EXP: &str = "braid_exp";
pub(crate) const SYM_LOG: &str = "braid_log";
pub(crate) const SYM_FMOD: &str = "braid_fmod";
pub(crate) const SYM_HOST: &str = "braid_host_call";

pub(crate) fn declare_imports(m: &mut JITModule) -> Result<Imports, JitError> {
    let ptr = m.target_config().pointer_type();
    let mut f1 = m.make_signature();
    f1.params.push(AbiParam::new(F64));
    f1.returns.push(AbiParam::new(F64));
    let mut f2 = m.make_signature();
    f2.params.push(AbiParam::new(F64));
    f2.params.push(AbiParam::new(F64));
    f2.returns.push(AbiParam::new(F64));
    let mut h = m.make_signature();
    h.params.push(AbiParam::new(ptr));
    h.params.push(AbiParam::new(I64));
    h.returns.push(AbiParam::new(I64));
    let d = |m: &mut JITModule, name: &str, sig: &ir::Signature| {
        m.declare_function(name, Linkage::Import, sig)
            .map_err(|e| JitError::Codegen(e.to_string()))
    };
    Ok(Imports {
        exp: d(m, SYM_EXP, &f1)?,
        log: d(m, SYM_LOG, &f1)?,
        fmod: d(m, SYM_FMOD, &f2)?,
        host: d(m, SYM_HOST, &h)?,
    })
}

/// Builds and defines one kernel function: `main`, or pre-pass `Some(level)`.
/// What [`define`] compiles: a verified kernel with its layout.
pub(crate) struct Unit<'a> {
    pub kernel: &'a Kernel,
    pub layout: &'a Layout,
    pub imports: Imports,
}

pub(crate) fn define(
    m: &mut JITModule,
    ctx: &mut Context,
    fctx: &mut FunctionBuilderContext,
    unit: &Unit<'_>,
    prepass: Option<u32>,
) -> Result<FuncId, JitError> {
    let (k, layout, imports) = (unit.kernel, unit.layout, unit.imports);
    let tc = m.target_config();
    let mut sig = m.make_signature();
    sig.params.push(AbiParam::new(tc.pointer_type()));
    let name = match prepass {
        Some(l) => format!("prepass{l}"),
        None => "main".to_string(),
    };
    let id = m
        .declare_function(&name, Linkage::Local, &sig)
        .map_err(|e| JitError::Codegen(e.to_string()))?;
    ctx.func.signature = sig;
    ctx.func.name = UserFuncName::user(0, id.as_u32());
    {
        let mut b = FunctionBuilder::new(&mut ctx.func, fctx);
        let fr = FuncRefs {
            exp: m.declare_func_in_func(imports.exp, b.func),
            log: m.declare_func_in_func(imports.log, b.func),
            fmod: m.declare_func_in_func(imports.fmod, b.func),
            host: m.declare_func_in_func(imports.host, b.func),
        };
        let entry = b.create_block();
        b.append_block_params_for_function_params(entry);
        b.switch_to_block(entry);
        let frame = b.block_params(entry)[0];
        let t = MemFlagsData::trusted();
        let len = b.ins().load(I64, t, frame, OFF_LEN);
        let slots = b.ins().load(I64, t, frame, OFF_SLOTS);
        let scratch = b.ins().load(I64, t, frame, OFF_SCRATCH);
        let mut slot_base = vec![None; k.insts.len()];
        for (i, s) in layout.slot.iter().enumerate() {
            if let Some(s) = s {
                let bytes = b.ins().imul_imm_s(len, 8 * (*s as i64));
                slot_base[i] = Some(b.ins().iadd(scratch, bytes));
            }
        }
        let mut g = Gen {
            k,
            b,
            vals: vec![None; k.insts.len()],
            frame,
            len,
            slots,
            slot_base,
            layout,
            prepass,
            fr,
        };
        g.insts(k.entry)?;
        if let Some(level) = prepass {
            g.write_reduction_args(level)?;
        } else {
            g.write_result()?;
        }
        g.b.ins().return_(&[]);
        g.b.seal_all_blocks();
        g.b.finalize(tc);
    }
    m.define_function(id, ctx)
        .map_err(|e| JitError::Codegen(format!("{e:?}")))?;
    m.clear_context(ctx);
    Ok(id)
}

struct FuncRefs {
    exp: FuncRef,
    log: FuncRef,
    fmod: FuncRef,
    host: FuncRef,
}

struct Gen<'a, 'b> {
    k: &'a Kernel,
    b: FunctionBuilder<'b>,
    /// The Cranelift value of each IR value (a pointer for per-token values).
    vals: Vec<Option<ir::Value>>,
    frame: ir::Value,
    len: ir::Value,
    slots: ir::Value,
    slot_base: Vec<Option<ir::Value>>,
    layout: &'a Layout,
    /// `Some(L)` in pre-pass `L`: values of scope level `L` or more are not computed.
    prepass: Option<u32>,
    fr: FuncRefs,
}

fn internal(what: &str, v: Value) -> JitError {
    JitError::Codegen(format!("internal: {what} %{}", v.0))
}

fn cl_ty(t: Ty) -> ir::Type {
    match t {
        Ty::Int | Ty::Tokens => I64,
        Ty::Float => F64,
        Ty::Bool => I8,
    }
}

impl Gen<'_, '_> {
    fn val(&self, v: Value) -> Result<ir::Value, JitError> {
        self.vals
            .get(v.index())
            .copied()
            .flatten()
            .ok_or_else(|| internal("no value for", v))
    }

    fn ty(&self, v: Value) -> Ty {
        self.k.ty(v).unwrap_or(Ty::Float)
    }

    fn trusted() -> MemFlagsData {
        MemFlagsData::trusted()
    }

    /// `ptr[t]` for a per-token buffer; `t` must be in `0..len` (see the module doc).
    fn load_tok(&mut self, ptr: ir::Value, t: ir::Value) -> ir::Value {
        let off = self.b.ins().ishl_imm_s(t, 3);
        let addr = self.b.ins().iadd(ptr, off);
        self.b.ins().load(F64, Self::trusted(), addr, 0)
    }

    fn store_tok(&mut self, ptr: ir::Value, t: ir::Value, x: ir::Value) {
        let off = self.b.ins().ishl_imm_s(t, 3);
        let addr = self.b.ins().iadd(ptr, off);
        self.b.ins().store(Self::trusted(), x, addr, 0);
    }

    /// Element `t` of a per-token value, or the value itself for a float.
    fn elem(&mut self, v: Value, t: ir::Value) -> Result<ir::Value, JitError> {
        if self.layout.fused.get(v.index()).copied().unwrap_or(false) {
            return self.fused_elem(v, t);
        }
        let x = self.val(v)?;
        Ok(if self.ty(v) == Ty::Tokens {
            self.load_tok(x, t)
        } else {
            x
        })
    }

    /// Element `t` of a fused value, computed in place (see [`Layout::fused`]).
    fn fused_elem(&mut self, v: Value, t: ir::Value) -> Result<ir::Value, JitError> {
        match self.k.insts[v.index()].op {
            Op::Unary(op, a) => {
                let e = self.elem(a, t)?;
                self.funary(op, e)
            }
            Op::Binary(op, a, b) => {
                let ea = self.elem(a, t)?;
                let eb = self.elem(b, t)?;
                self.fbin(op, ea, eb)
            }
            _ => Err(internal("fused non-elementwise", v)),
        }
    }

    /// Emits a loop over `t` in `0..len` (descending when `reverse`).
    fn for_tokens(
        &mut self,
        reverse: bool,
        mut body: impl FnMut(&mut Self, ir::Value) -> Result<(), JitError>,
    ) -> Result<(), JitError> {
        let var = self.b.declare_var(I64);
        let start = if reverse {
            self.len
        } else {
            self.b.ins().iconst(I64, 0)
        };
        self.b.def_var(var, start);
        let header = self.b.create_block();
        let lbody = self.b.create_block();
        let exit = self.b.create_block();
        self.b.ins().jump(header, &[]);
        self.b.switch_to_block(header);
        let cur = self.b.use_var(var);
        let more = if reverse {
            self.b.ins().icmp_imm_s(IntCC::NotEqual, cur, 0)
        } else {
            self.b.ins().icmp(IntCC::UnsignedLessThan, cur, self.len)
        };
        self.b.ins().brif(more, lbody, &[], exit, &[]);
        self.b.switch_to_block(lbody);
        let (t, next) = if reverse {
            let t = self.b.ins().iadd_imm_s(cur, -1);
            (t, t)
        } else {
            (cur, self.b.ins().iadd_imm_s(cur, 1))
        };
        body(self, t)?;
        self.b.def_var(var, next);
        self.b.ins().jump(header, &[]);
        self.b.switch_to_block(exit);
        Ok(())
    }

    fn insts(&mut self, id: BlockId) -> Result<(), JitError> {
        let k = self.k;
        let block = k
            .block(id)
            .ok_or_else(|| JitError::Codegen(format!("no block{}", id.0)))?;
        for &x in &block.insts {
            if self
                .prepass
                .is_some_and(|l| self.layout.level.get(x.index()).copied().unwrap_or(0) >= l)
            {
                continue;
            }
            let v = self.inst(x)?;
            self.vals[x.index()] = Some(v);
        }
        Ok(())
    }

    fn block_value(&mut self, id: BlockId) -> Result<ir::Value, JitError> {
        self.insts(id)?;
        let r = self
            .k
            .block(id)
            .and_then(|b| b.result)
            .ok_or_else(|| JitError::Codegen("no result".into()))?;
        self.val(r)
    }

    fn float_of(&mut self, x: ir::Value, ty: Ty) -> ir::Value {
        match ty {
            Ty::Int => self.b.ins().fcvt_from_sint(F64, x),
            Ty::Bool => {
                let w = self.b.ins().uextend(I64, x);
                self.b.ins().fcvt_from_sint(F64, w)
            }
            Ty::Float | Ty::Tokens => x,
        }
    }

    fn write_result(&mut self) -> Result<(), JitError> {
        let r = self
            .k
            .result()
            .ok_or_else(|| JitError::Codegen("no result".into()))?;
        let out = self.b.ins().load(I64, Self::trusted(), self.frame, OFF_OUT);
        self.write_value(r, out)
    }

    /// Writes a value to `dst`: all tokens, or one float.
    fn write_value(&mut self, v: Value, dst: ir::Value) -> Result<(), JitError> {
        let x = self.val(v)?;
        let ty = self.ty(v);
        if ty == Ty::Tokens {
            self.for_tokens(false, |g, t| {
                let e = g.load_tok(x, t);
                g.store_tok(dst, t, e);
                Ok(())
            })
        } else {
            let f = self.float_of(x, ty);
            self.b.ins().store(Self::trusted(), f, dst, 0);
            Ok(())
        }
    }

    fn write_reduction_args(&mut self, level: u32) -> Result<(), JitError> {
        let table = self
            .b
            .ins()
            .load(I64, Self::trusted(), self.frame, OFF_RED_OUT);
        for (r, &(arg, _, l)) in self.layout.reductions.iter().enumerate() {
            if l != level {
                continue;
            }
            let dst = self
                .b
                .ins()
                .load(I64, Self::trusted(), table, (r * 8) as i32);
            self.write_value(arg, dst)?;
        }
        Ok(())
    }

    fn fconst(&mut self, x: f64) -> ir::Value {
        self.b.ins().f64const(Ieee64::with_bits(x.to_bits()))
    }

    fn call1(&mut self, f: FuncRef, args: &[ir::Value]) -> ir::Value {
        let call = self.b.ins().call(f, args);
        self.b.inst_results(call)[0]
    }

    /// `fsem::max` (`fsem::min` when `min`): `a` when `a > b` (`a < b`) or `a` is NaN, else `b`.
    fn fminmax(&mut self, min: bool, a: ir::Value, b: ir::Value) -> ir::Value {
        let cc = if min {
            FloatCC::LessThan
        } else {
            FloatCC::GreaterThan
        };
        let better = self.b.ins().fcmp(cc, a, b);
        let nan = self.b.ins().fcmp(FloatCC::Unordered, a, a);
        let pick_a = self.b.ins().bor(better, nan);
        self.b.ins().select(pick_a, a, b)
    }

    /// A float binary operation on two scalars.
    fn fbin(&mut self, op: BinOp, a: ir::Value, b: ir::Value) -> Result<ir::Value, JitError> {
        let ins = self.b.ins();
        Ok(match op {
            BinOp::Add => ins.fadd(a, b),
            BinOp::Sub => ins.fsub(a, b),
            BinOp::Mul => ins.fmul(a, b),
            BinOp::Div => ins.fdiv(a, b),
            BinOp::Rem => {
                let f = self.fr.fmod;
                self.call1(f, &[a, b])
            }
            BinOp::Min => self.fminmax(true, a, b),
            BinOp::Max => self.fminmax(false, a, b),
            BinOp::Eq => ins.fcmp(FloatCC::Equal, a, b),
            BinOp::Ne => ins.fcmp(FloatCC::NotEqual, a, b),
            BinOp::Lt => ins.fcmp(FloatCC::LessThan, a, b),
            BinOp::Le => ins.fcmp(FloatCC::LessThanOrEqual, a, b),
            BinOp::Gt => ins.fcmp(FloatCC::GreaterThan, a, b),
            BinOp::Ge => ins.fcmp(FloatCC::GreaterThanOrEqual, a, b),
            BinOp::And | BinOp::Or => return Err(JitError::Codegen("boolean op on floats".into())),
        })
    }

    fn ibin(&mut self, op: BinOp, a: ir::Value, b: ir::Value) -> Result<ir::Value, JitError> {
        let ins = self.b.ins();
        Ok(match op {
            BinOp::Add => ins.iadd(a, b),
            BinOp::Sub => ins.isub(a, b),
            BinOp::Mul => ins.imul(a, b),
            BinOp::Rem => {
                // `fsem::irem`: a divisor of 0 or -1 yields 0; `srem` would trap on both.
                let zero = self.b.ins().icmp_imm_s(IntCC::Equal, b, 0);
                let m1 = self.b.ins().icmp_imm_s(IntCC::Equal, b, -1);
                let bad = self.b.ins().bor(zero, m1);
                let one = self.b.ins().iconst(I64, 1);
                let d = self.b.ins().select(bad, one, b);
                let r = self.b.ins().srem(a, d);
                let z = self.b.ins().iconst(I64, 0);
                self.b.ins().select(bad, z, r)
            }
            BinOp::Min => ins.smin(a, b),
            BinOp::Max => ins.smax(a, b),
            BinOp::Eq => ins.icmp(IntCC::Equal, a, b),
            BinOp::Ne => ins.icmp(IntCC::NotEqual, a, b),
            BinOp::Lt => ins.icmp(IntCC::SignedLessThan, a, b),
            BinOp::Le => ins.icmp(IntCC::SignedLessThanOrEqual, a, b),
            BinOp::Gt => ins.icmp(IntCC::SignedGreaterThan, a, b),
            BinOp::Ge => ins.icmp(IntCC::SignedGreaterThanOrEqual, a, b),
            BinOp::Div | BinOp::And | BinOp::Or => {
                return Err(JitError::Codegen(format!("{op:?} on ints")));
            }
        })
    }

    fn funary(&mut self, op: UnOp, a: ir::Value) -> Result<ir::Value, JitError> {
        Ok(match op {
            UnOp::Neg => self.b.ins().fneg(a),
            UnOp::Abs => self.b.ins().fabs(a),
            UnOp::Sqrt => self.b.ins().sqrt(a),
            UnOp::Exp => {
                let f = self.fr.exp;
                self.call1(f, &[a])
            }
            UnOp::Log => {
                let f = self.fr.log;
                self.call1(f, &[a])
            }
            UnOp::Not | UnOp::IntToFloat => {
                return Err(JitError::Codegen(format!("{op:?} on floats")));
            }
        })
    }

    /// A local reduction of the per-token buffer `p`.
    fn reduce(&mut self, op: ReduceOp, p: ir::Value) -> Result<ir::Value, JitError> {
        let zero = self.fconst(0.0);
        Ok(match op {
            ReduceOp::Sum => self.sum(p, None)?,
            ReduceOp::Mean => self.mean(p)?,
            ReduceOp::Max | ReduceOp::Min => {
                let min = op == ReduceOp::Min;
                let start = self.fconst(if min {
                    f64::INFINITY
                } else {
                    f64::NEG_INFINITY
                });
                let acc = self.b.declare_var(F64);
                self.b.def_var(acc, start);
                self.for_tokens(false, |g, t| {
                    let x = g.load_tok(p, t);
                    let a = g.b.use_var(acc);
                    let r = g.fminmax(min, a, x);
                    g.b.def_var(acc, r);
                    Ok(())
                })?;
                self.b.use_var(acc)
            }
            ReduceOp::Count => {
                let acc = self.b.declare_var(I64);
                let z = self.b.ins().iconst(I64, 0);
                self.b.def_var(acc, z);
                self.for_tokens(false, |g, t| {
                    let x = g.load_tok(p, t);
                    let nz = g.b.ins().fcmp(FloatCC::NotEqual, x, zero);
                    let nz = g.b.ins().uextend(I64, nz);
                    let a = g.b.use_var(acc);
                    let r = g.b.ins().iadd(a, nz);
                    g.b.def_var(acc, r);
                    Ok(())
                })?;
                self.b.use_var(acc)
            }
            ReduceOp::Std => {
                let m = self.mean(p)?;
                let s = self.sum(p, Some(m))?;
                let n = self.b.ins().fcvt_from_sint(F64, self.len);
                let var = self.b.ins().fdiv(s, n);
                let sd = self.b.ins().sqrt(var);
                let empty = self.b.ins().icmp_imm_s(IntCC::Equal, self.len, 0);
                self.b.ins().select(empty, zero, sd)
            }
        })
    }

    /// `((0.0 + x0) + x1) + …`, or of `(x - m) * (x - m)` when `dev` is `Some(m)`.
    fn sum(&mut self, p: ir::Value, dev: Option<ir::Value>) -> Result<ir::Value, JitError> {
        let zero = self.fconst(0.0);
        let acc = self.b.declare_var(F64);
        self.b.def_var(acc, zero);
        self.for_tokens(false, |g, t| {
            let mut x = g.load_tok(p, t);
            if let Some(m) = dev {
                let d = g.b.ins().fsub(x, m);
                x = g.b.ins().fmul(d, d);
            }
            let a = g.b.use_var(acc);
            let r = g.b.ins().fadd(a, x);
            g.b.def_var(acc, r);
            Ok(())
        })?;
        Ok(self.b.use_var(acc))
    }

    fn mean(&mut self, p: ir::Value) -> Result<ir::Value, JitError> {
        let s = self.sum(p, None)?;
        let n = self.b.ins().fcvt_from_sint(F64, self.len);
        let m = self.b.ins().fdiv(s, n);
        let empty = self.b.ins().icmp_imm_s(IntCC::Equal, self.len, 0);
        let zero = self.fconst(0.0);
        Ok(self.b.ins().select(empty, zero, m))
    }

    fn inst(&mut self, x: Value) -> Result<ir::Value, JitError> {
        let k = self.k;
        if self.layout.fused.get(x.index()).copied().unwrap_or(false) {
            // Computed inside its user's loop; this placeholder is never read (dead code).
            return Ok(self.b.ins().iconst(I64, 0));
        }
        let inst = &k.insts[x.index()];
        let t = Self::trusted();
        Ok(match &inst.op {
            Op::ConstInt(i) => self.b.ins().iconst(I64, *i),
            Op::ConstFloat(bits) => self.b.ins().f64const(Ieee64::with_bits(*bits)),
            Op::ConstBool(c) => self.b.ins().iconst(I8, i64::from(*c)),
            Op::Param(n) => {
                let off = (*n as i32) * 8;
                match (k.params.get(*n as usize), inst.ty) {
                    (Some(ParamKind::PerToken), _) => self.b.ins().load(I64, t, self.slots, off),
                    (_, Ty::Float) => self.b.ins().load(F64, t, self.slots, off),
                    (_, Ty::Int) => self.b.ins().load(I64, t, self.slots, off),
                    (_, Ty::Bool) => {
                        let w = self.b.ins().load(I64, t, self.slots, off);
                        self.b.ins().icmp_imm_s(IntCC::NotEqual, w, 0)
                    }
                    _ => return Err(internal("parameter type of", x)),
                }
            }
            Op::SampleInt { field, .. } => match field {
                IntField::Length => self.len,
                IntField::Group => self.b.ins().load(I64, t, self.frame, OFF_GROUP),
            },
            Op::Len => self.len,
            Op::Unary(op, a) => {
                let ta = self.ty(*a);
                let av = self.val(*a)?;
                match (op, ta) {
                    (UnOp::Neg, Ty::Int) => self.b.ins().ineg(av),
                    (UnOp::Abs, Ty::Int) => self.b.ins().iabs(av),
                    (UnOp::Not, _) => self.b.ins().bxor_imm_s(av, 1),
                    (UnOp::IntToFloat, _) => self.b.ins().fcvt_from_sint(F64, av),
                    (_, Ty::Tokens) => {
                        let dst =
                            self.slot_base[x.index()].ok_or_else(|| internal("no slot for", x))?;
                        let (op, a) = (*op, *a);
                        self.for_tokens(false, |g, t| {
                            let e = g.elem(a, t)?;
                            let r = g.funary(op, e)?;
                            g.store_tok(dst, t, r);
                            Ok(())
                        })?;
                        dst
                    }
                    _ => self.funary(*op, av)?,
                }
            }
            Op::Binary(op, a, b) => {
                let (ta, tb) = (self.ty(*a), self.ty(*b));
                match (ta, tb) {
                    (Ty::Int, Ty::Int) => {
                        let (av, bv) = (self.val(*a)?, self.val(*b)?);
                        self.ibin(*op, av, bv)?
                    }
                    (Ty::Bool, Ty::Bool) => {
                        let (av, bv) = (self.val(*a)?, self.val(*b)?);
                        match op {
                            BinOp::And => self.b.ins().band(av, bv),
                            BinOp::Or => self.b.ins().bor(av, bv),
                            BinOp::Eq => self.b.ins().icmp(IntCC::Equal, av, bv),
                            BinOp::Ne => self.b.ins().icmp(IntCC::NotEqual, av, bv),
                            _ => return Err(internal("bool operands of", x)),
                        }
                    }
                    (Ty::Float, Ty::Float) => {
                        let (av, bv) = (self.val(*a)?, self.val(*b)?);
                        self.fbin(*op, av, bv)?
                    }
                    _ => {
                        let dst =
                            self.slot_base[x.index()].ok_or_else(|| internal("no slot for", x))?;
                        let (op, a, b) = (*op, *a, *b);
                        self.for_tokens(false, |g, t| {
                            let ea = g.elem(a, t)?;
                            let eb = g.elem(b, t)?;
                            let r = g.fbin(op, ea, eb)?;
                            g.store_tok(dst, t, r);
                            Ok(())
                        })?;
                        dst
                    }
                }
            }
            Op::Index { tokens, index } => {
                let p = self.val(*tokens)?;
                let i = self.val(*index)?;
                // In range iff `0 <= i < len`, one unsigned comparison; else 0.0 without a load.
                let inb = self.b.ins().icmp(IntCC::UnsignedLessThan, i, self.len);
                let load = self.b.create_block();
                let merge = self.b.create_block();
                self.b.append_block_param(merge, F64);
                let zero = self.fconst(0.0);
                self.b.ins().brif(inb, load, &[], merge, &[zero.into()]);
                self.b.switch_to_block(load);
                let e = self.load_tok(p, i);
                self.b.ins().jump(merge, &[e.into()]);
                self.b.switch_to_block(merge);
                self.b.block_params(merge)[0]
            }
            Op::Reduce(op, a) => {
                let p = self.val(*a)?;
                self.reduce(*op, p)?
            }
            Op::ScopeReduce(op, _) => {
                let r = self.layout.reduction[x.index()]
                    .ok_or_else(|| internal("no reduction slot for", x))?;
                let table = self.b.ins().load(I64, t, self.frame, OFF_SCOPE_VALS);
                let f = self.b.ins().load(F64, t, table, (r * 8) as i32);
                if *op == ReduceOp::Count {
                    self.b.ins().fcvt_to_sint_sat(I64, f)
                } else {
                    f
                }
            }
            Op::If {
                cond,
                then_block,
                else_block,
            } => {
                let c = self.val(*cond)?;
                let tb = self.b.create_block();
                let eb = self.b.create_block();
                let merge = self.b.create_block();
                self.b.append_block_param(merge, cl_ty(inst.ty));
                self.b.ins().brif(c, tb, &[], eb, &[]);
                self.b.switch_to_block(tb);
                let r = self.block_value(*then_block)?;
                self.b.ins().jump(merge, &[r.into()]);
                self.b.switch_to_block(eb);
                let r = self.block_value(*else_block)?;
                self.b.ins().jump(merge, &[r.into()]);
                self.b.switch_to_block(merge);
                self.b.block_params(merge)[0]
            }
            Op::Scan {
                reverse,
                init,
                body,
            } => {
                let dst = self.slot_base[x.index()].ok_or_else(|| internal("no slot for", x))?;
                let init = self.val(*init)?;
                let params = k.block(*body).map(|b| b.params.clone()).unwrap_or_default();
                let (Some(&pt), Some(&pa)) = (params.first(), params.get(1)) else {
                    return Err(internal("scan without parameters", x));
                };
                let acc = self.b.declare_var(F64);
                self.b.def_var(acc, init);
                let body = *body;
                self.for_tokens(*reverse, |g, t| {
                    g.vals[pt.index()] = Some(t);
                    let a = g.b.use_var(acc);
                    g.vals[pa.index()] = Some(a);
                    let r = g.block_value(body)?;
                    g.store_tok(dst, t, r);
                    g.b.def_var(acc, r);
                    Ok(())
                })?;
                dst
            }
            Op::BlockParam { .. } => self.val(x)?,
            Op::Host(n) => {
                let env = self.b.ins().load(I64, t, self.frame, OFF_HOST);
                let idx = self.b.ins().iconst(I64, i64::from(*n));
                let f = self.fr.host;
                let r = self.call1(f, &[env, idx]);
                match inst.ty {
                    Ty::Bool => self.b.ins().icmp_imm_s(IntCC::NotEqual, r, 0),
                    // A record field's float crosses the host ABI as its bits.
                    Ty::Float => self.b.ins().bitcast(F64, MemFlagsData::new(), r),
                    _ => r,
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use braid_ir::kernel::{KernelBuilder, ParamKind, Scope};

    #[test]
    fn single_use_elementwise_chains_are_fused() {
        // kl_k3: d = ref - logp (two uses: kept); e = exp(d) and x = e - d (one elementwise use
        // each: fused); r = x - 1.0 (the result: kept).
        let mut b = KernelBuilder::new("kl_k3", Scope::Sample);
        let logp = b.param(ParamKind::PerToken);
        let refp = b.param(ParamKind::PerToken);
        let d = b.sub(refp, logp);
        let e = b.exp(d);
        let x = b.sub(e, d);
        let one = b.float(1.0);
        let r = b.sub(x, one);
        let k = b.finish(r).expect("builds");
        let l = Layout::of(&k);
        assert_eq!(
            [d, e, x, r].map(|v| l.fused[v.index()]),
            [false, true, true, false]
        );
        assert_eq!(l.n_scratch, 2);
    }
}
