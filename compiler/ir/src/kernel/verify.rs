//! The kernel verifier: the invariants every backend relies on, checked once, so that a backend
//! may assume them (the JIT's bounds reasoning and the interpreter's lookups depend on it).
//!
//! It checks structure (every instruction in exactly one block, every block owned by exactly one
//! construct, operands defined before use in the same or an enclosing block, nesting at most
//! [`MAX_DEPTH`]), types (each operation's operand and result types), and the rules of scope
//! reductions and host calls. It must not change the kernel.

use super::host::HostFns;
use super::{BinOp, BlockId, Kernel, Op, ParamKind, Scope, Ty, UnOp, Value};

/// How deeply `if` and `scan` may nest; keeps every recursive walk of a kernel shallow.
pub const MAX_DEPTH: usize = 64;

/// A broken kernel invariant.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("kernel `{kernel}`: {message}")]
pub struct VerifyError {
    pub kernel: String,
    pub message: String,
}

struct Verifier<'k> {
    k: &'k Kernel,
    /// Whether each value is visible at the current point of the walk.
    visible: Vec<bool>,
    /// How often each instruction appears in a block (params included).
    placed: Vec<u32>,
    /// How often each block is owned by a construct (the entry by the kernel).
    owned: Vec<u32>,
    /// The scope level of each value (see [`scope_levels`]).
    level: Vec<u32>,
}

/// Verifies a kernel.
pub fn verify(k: &Kernel) -> Result<(), VerifyError> {
    let err = |message: String| VerifyError {
        kernel: k.name.clone(),
        message,
    };
    let mut v = Verifier {
        k,
        visible: vec![false; k.insts.len()],
        placed: vec![0; k.insts.len()],
        owned: vec![0; k.blocks.len()],
        level: vec![0; k.insts.len()],
    };
    for b in &k.blocks {
        for x in b.params.iter().chain(&b.insts) {
            match v.placed.get_mut(x.index()) {
                Some(p) => *p += 1,
                None => {
                    return Err(err(format!(
                        "block lists %{} which is not an instruction",
                        x.0
                    )));
                }
            }
        }
    }
    if let Some(i) = v.placed.iter().position(|&p| p != 1) {
        return Err(err(format!(
            "%{i} appears in {} blocks (must be exactly one)",
            v.placed[i]
        )));
    }
    let entry = k
        .block(k.entry)
        .ok_or_else(|| err("no entry block".into()))?;
    if !entry.params.is_empty() {
        return Err(err("the entry block has parameters".into()));
    }
    v.block(k.entry, 0).map_err(err)?;
    if let Some(b) = v.owned.iter().position(|&o| o != 1) {
        return Err(err(format!(
            "block{b} is owned {} times (must be once)",
            v.owned[b]
        )));
    }
    let mut params_seen = vec![false; k.params.len()];
    for inst in &k.insts {
        if let Op::Param(n) = inst.op
            && let Some(seen) = params_seen.get_mut(n as usize)
        {
            *seen = true;
        }
    }
    HostFns::compile(&k.host_calls).map_err(|e| err(e.to_string()))?;
    for (i, call) in k.host_calls.iter().enumerate() {
        if k.params.get(call.param() as usize) != Some(&ParamKind::Sample) {
            return Err(err(format!(
                "host call {i} reads parameter {} which is not a Sample",
                call.param()
            )));
        }
        // A record has no field without a name; the language only writes literal names.
        if call.record_fields().iter().any(|f| f.name.is_empty()) {
            return Err(err(format!(
                "host call {i} reads a record field with no name"
            )));
        }
        let uses = k
            .insts
            .iter()
            .filter(|x| x.op == Op::Host(i as u32))
            .count();
        if uses != 1 {
            return Err(err(format!(
                "host call {i} is used {uses} times (must be once)"
            )));
        }
    }
    Ok(())
}

/// The scope level of each value: 0 for a value that depends on no scope reduction, else
/// `1 + ` the level of the argument of the deepest scope reduction it depends on (through
/// operands or nested blocks); a scope reduction has level `1 + level(argument)`. Pre-pass `L`
/// evaluates the values of level `< L` and folds the reductions of level `L`. `kernel` must be
/// verified.
pub fn scope_levels(k: &Kernel) -> Vec<u32> {
    let mut v = Verifier {
        k,
        visible: vec![false; k.insts.len()],
        placed: vec![0; k.insts.len()],
        owned: vec![0; k.blocks.len()],
        level: vec![0; k.insts.len()],
    };
    // A verified kernel passes the walk; on an unverified one the partial answer is returned.
    let _ = v.block(k.entry, 0);
    v.level
}

impl Verifier<'_> {
    fn ty(&self, x: Value) -> Result<Ty, String> {
        if !self.visible.get(x.index()).copied().unwrap_or(false) {
            return Err(format!("%{} is used where it is not defined", x.0));
        }
        Ok(self.k.insts[x.index()].ty)
    }

    /// Walks a block at nesting `depth`; returns the highest scope level of anything in it.
    /// Leaves the block's values invisible afterwards.
    fn block(&mut self, id: BlockId, depth: usize) -> Result<u32, String> {
        if depth > MAX_DEPTH {
            return Err(format!("if/scan nested deeper than {MAX_DEPTH}"));
        }
        let k = self.k;
        let block = k
            .block(id)
            .ok_or_else(|| format!("block{} does not exist", id.0))?;
        match self.owned.get_mut(id.index()) {
            Some(o) => *o += 1,
            None => return Err(format!("block{} does not exist", id.0)),
        }
        let mut dep = 0;
        for (i, p) in block.params.iter().enumerate() {
            if k.insts[p.index()].op
                != (Op::BlockParam {
                    block: id,
                    index: i as u32,
                })
            {
                return Err(format!(
                    "%{} is parameter {i} of block{} but is not its BlockParam",
                    p.0, id.0
                ));
            }
            self.visible[p.index()] = true;
        }
        for &x in &block.insts {
            let d = self
                .inst(x, id, depth)
                .map_err(|e| format!("%{}: {e}", x.0))?;
            self.level[x.index()] = d;
            dep = dep.max(d);
            self.visible[x.index()] = true;
        }
        let result = block
            .result
            .ok_or_else(|| format!("block{} has no result", id.0))?;
        self.ty(result)
            .map_err(|e| format!("result of block{}: {e}", id.0))?;
        dep = dep.max(self.level[result.index()]);
        for x in block.params.iter().chain(&block.insts) {
            self.visible[x.index()] = false;
        }
        Ok(dep)
    }

    /// Checks one instruction; returns its scope level.
    fn inst(&mut self, x: Value, block: BlockId, depth: usize) -> Result<u32, String> {
        use Ty::*;
        let k = self.k;
        let inst = &k.insts[x.index()];
        let want = |ok: bool, what: &str| {
            if ok {
                Ok(())
            } else {
                Err(format!("{what} (result {:?})", inst.ty))
            }
        };
        let mut dep = 0;
        match &inst.op {
            Op::ConstInt(_) => want(inst.ty == Int, "int constant")?,
            Op::ConstFloat(_) => want(inst.ty == Float, "float constant")?,
            Op::ConstBool(_) => want(inst.ty == Bool, "bool constant")?,
            Op::Param(n) => {
                let kind = k
                    .params
                    .get(*n as usize)
                    .ok_or_else(|| format!("parameter {n} does not exist"))?;
                want(block == k.entry, "a parameter outside the entry block")?;
                want(
                    kind.value_ty() == Some(inst.ty),
                    &format!("parameter {n} is {kind:?}"),
                )?;
            }
            Op::SampleInt { param, .. } => {
                want(
                    k.params.get(*param as usize) == Some(&ParamKind::Sample),
                    "sample field of a non-Sample",
                )?;
                want(inst.ty == Int, "sample int field")?;
            }
            Op::Len => want(inst.ty == Int, "len")?,
            Op::Unary(op, a) => {
                let ta = self.ty(*a)?;
                dep = self.level[a.index()];
                let ok = match op {
                    UnOp::Neg | UnOp::Abs => matches!(ta, Int | Float | Tokens) && inst.ty == ta,
                    UnOp::Not => ta == Bool && inst.ty == Bool,
                    UnOp::Exp | UnOp::Log | UnOp::Sqrt => {
                        matches!(ta, Float | Tokens) && inst.ty == ta
                    }
                    UnOp::IntToFloat => ta == Int && inst.ty == Float,
                };
                want(ok, &format!("{op:?} of {ta:?}"))?;
            }
            Op::Binary(op, a, b) => {
                let (ta, tb) = (self.ty(*a)?, self.ty(*b)?);
                dep = self.level[a.index()].max(self.level[b.index()]);
                let ok = match op {
                    BinOp::And | BinOp::Or => (ta, tb, inst.ty) == (Bool, Bool, Bool),
                    BinOp::Eq | BinOp::Ne => {
                        ta == tb && matches!(ta, Int | Float | Bool) && inst.ty == Bool
                    }
                    BinOp::Lt | BinOp::Le | BinOp::Gt | BinOp::Ge => {
                        ta == tb && matches!(ta, Int | Float) && inst.ty == Bool
                    }
                    BinOp::Div => match (ta, tb) {
                        (Float, Float) => inst.ty == Float,
                        (Tokens, Tokens | Float) | (Float, Tokens) => inst.ty == Tokens,
                        _ => false,
                    },
                    BinOp::Add | BinOp::Sub | BinOp::Mul | BinOp::Rem | BinOp::Min | BinOp::Max => {
                        match (ta, tb) {
                            (Int, Int) => inst.ty == Int,
                            (Float, Float) => inst.ty == Float,
                            (Tokens, Tokens | Float) | (Float, Tokens) => inst.ty == Tokens,
                            _ => false,
                        }
                    }
                };
                want(ok, &format!("{op:?} of {ta:?}, {tb:?}"))?;
            }
            Op::Index { tokens, index } => {
                let (ta, tb) = (self.ty(*tokens)?, self.ty(*index)?);
                dep = self.level[tokens.index()].max(self.level[index.index()]);
                want((ta, tb, inst.ty) == (Tokens, Int, Float), "index")?;
            }
            Op::Reduce(op, a) => {
                let ta = self.ty(*a)?;
                dep = self.level[a.index()];
                want(ta == Tokens && inst.ty == op.result_ty(), "reduce")?;
            }
            Op::ScopeReduce(op, a) => {
                let ta = self.ty(*a)?;
                want(
                    k.scope != Scope::Sample,
                    "a scope reduction in a sample kernel",
                )?;
                want(
                    block == k.entry,
                    "a scope reduction outside the entry block",
                )?;
                want(
                    inst.ty == op.result_ty(),
                    &format!("scope reduce of {ta:?}"),
                )?;
                dep = self.level[a.index()] + 1;
            }
            Op::If {
                cond,
                then_block,
                else_block,
            } => {
                want(self.ty(*cond)? == Bool, "if condition")?;
                dep = self.level[cond.index()];
                for b in [*then_block, *else_block] {
                    let blk = k
                        .block(b)
                        .ok_or_else(|| format!("block{} does not exist", b.0))?;
                    want(blk.params.is_empty(), "an if branch with parameters")?;
                    dep = dep.max(self.block(b, depth + 1)?);
                    let r = blk.result.map(|r| k.insts[r.index()].ty);
                    want(
                        r == Some(inst.ty),
                        &format!("branch block{} yields {r:?}", b.0),
                    )?;
                }
            }
            Op::Scan { init, body, .. } => {
                want(self.ty(*init)? == Float && inst.ty == Tokens, "scan init")?;
                dep = self.level[init.index()];
                let blk = k
                    .block(*body)
                    .ok_or_else(|| format!("block{} does not exist", body.0))?;
                let ptys: Vec<Ty> = blk.params.iter().map(|p| k.insts[p.index()].ty).collect();
                want(ptys == [Int, Float], "a scan body must take (int, float)")?;
                dep = dep.max(self.block(*body, depth + 1)?);
                let r = blk.result.map(|r| k.insts[r.index()].ty);
                want(r == Some(Float), "a scan body must yield a float")?;
            }
            Op::BlockParam { .. } => {
                return Err("a block parameter listed as an instruction".into());
            }
            Op::Host(n) => {
                let call = k
                    .host_calls
                    .get(*n as usize)
                    .ok_or_else(|| format!("host call {n} does not exist"))?;
                want(inst.ty == call.result_ty(), "host call")?;
            }
        }
        Ok(dep)
    }
}
