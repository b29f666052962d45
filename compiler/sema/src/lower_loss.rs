//! Lowering losses to the objective IR (`braid_ir::loss`): the loss a `train` call receives —
//! a call of a loss `fn`, or a sum of them scaled by constants — becomes one [`Objective`],
//! specialised for the run.
//!
//! Every scalar argument is a constant of the run, so it is folded in: strings select branches
//! (an `if variant == "dr_grpo"` keeps only the branch taken), numbers fold (`1.0 - clip` is one
//! constant), and calls of other `fn`s and losses are inlined. `let`s are lowered when first
//! used, so a binding only a branch not taken reads — and the metrics of a loss that branch
//! calls — never reach the objective. Per-token and per-sample arguments become the
//! objective's inputs, one per graph node. Like the other lowerings, this decides nothing the
//! checker has not checked: an input it cannot lower is a [`LowerError`], never a panic.

use std::collections::BTreeMap;

use braid_ir::graph::NodeId;
use braid_ir::loss::{
    BinOp as LBin, InputKind, LayoutValue, Level, Objective, ObjectiveBuilder, ReduceOp,
    UnOp as LUn, Value as LValue,
};

use crate::hir::*;
use crate::lower_kernel::LowerError;
use crate::specialise::fold;

fn err<T>(msg: impl Into<String>) -> Result<T, LowerError> {
    Err(LowerError(msg.into()))
}

/// How deep inlining goes (the checker rejects recursion; this bounds the work regardless).
const MAX_DEPTH: usize = 64;

/// An argument of a loss call in a pipeline, as the graph lowering knows it.
#[derive(Debug, Clone, PartialEq)]
pub enum LossArg {
    /// The value of a graph node: per-token or per-sample.
    Node { node: NodeId, kind: InputKind },
    /// A constant of the run.
    Const(Value),
    /// The model slot the loss is given.
    Model(u32),
}

/// The loss a `train` receives: calls of losses combined linearly.
#[derive(Debug, Clone, PartialEq)]
pub enum LossTree {
    Call {
        f: FnId,
        args: Vec<LossArg>,
    },
    Add(Box<LossTree>, Box<LossTree>),
    Sub(Box<LossTree>, Box<LossTree>),
    Neg(Box<LossTree>),
    /// Times a constant.
    Scale(Box<LossTree>, f64),
    /// Divided by a constant.
    Div(Box<LossTree>, f64),
}

impl LossTree {
    /// The losses it calls, in order, for the objective's name.
    fn names(&self, program: &Program, out: &mut Vec<String>) {
        match self {
            LossTree::Call { f, .. } => {
                if let Some(func) = program.fns.get(f.0 as usize) {
                    out.push(func.name.clone());
                }
            }
            LossTree::Add(a, b) | LossTree::Sub(a, b) => {
                a.names(program, out);
                b.names(program, out);
            }
            LossTree::Neg(a) | LossTree::Scale(a, _) | LossTree::Div(a, _) => a.names(program, out),
        }
    }

    /// The model slots its calls are given.
    pub fn models(&self) -> Vec<u32> {
        match self {
            LossTree::Call { args, .. } => args
                .iter()
                .filter_map(|a| match a {
                    LossArg::Model(m) => Some(*m),
                    _ => None,
                })
                .collect(),
            LossTree::Add(a, b) | LossTree::Sub(a, b) => {
                let mut v = a.models();
                v.extend(b.models());
                v
            }
            LossTree::Neg(a) | LossTree::Scale(a, _) | LossTree::Div(a, _) => a.models(),
        }
    }
}

/// The objective of a loss, and the graph node each of its inputs reads.
pub fn lower_objective(
    program: &Program,
    tree: &LossTree,
) -> Result<(Objective, Vec<NodeId>), LowerError> {
    let mut names = Vec::new();
    tree.names(program, &mut names);
    let mut cx = Lower {
        program,
        b: ObjectiveBuilder::new(names.join(" + ")),
        inputs: BTreeMap::new(),
        nodes: Vec::new(),
    };
    let result = cx.tree(tree)?;
    // An input the specialised loss no longer reads (a KL term with `kl_coef: 0.0`) stays an
    // input: the graph keeps the dataflow the program wrote, which the planner's pins and
    // streaming decisions refer to.
    let objective =
        cx.b.finish(result)
            .map_err(|e| LowerError(format!("loss `{}`: {e}", names.join(" + "))))?;
    Ok((objective, cx.nodes))
}

/// A value while lowering: an IR value, a constant of the run, or the loss's model.
#[derive(Debug, Clone)]
enum Lv {
    V(LValue),
    C(Value),
    Model,
}

/// A `let` of the frame: not lowered yet, or lowered.
#[derive(Debug, Clone)]
enum Binding<'p> {
    Pending(&'p Expr),
    Done(Lv),
}

/// The locals of one inlined function.
type Frame<'p> = BTreeMap<LocalId, Binding<'p>>;

struct Lower<'p> {
    program: &'p Program,
    b: ObjectiveBuilder,
    /// One input per (graph node, kind).
    inputs: BTreeMap<(NodeId, bool), LValue>,
    nodes: Vec<NodeId>,
}

impl<'p> Lower<'p> {
    fn tree(&mut self, t: &LossTree) -> Result<LValue, LowerError> {
        let loss = |this: &mut Self, x: &LossTree| -> Result<LValue, LowerError> {
            let v = this.tree(x)?;
            if this.b.level(v) != Some(Level::Loss) {
                return err("a term of the loss is not a loss");
            }
            Ok(v)
        };
        Ok(match t {
            LossTree::Call { f, args } => {
                let params = self.program.fns.get(f.0 as usize).map(|x| &x.params);
                let mut bound = Vec::new();
                for (i, a) in args.iter().enumerate() {
                    bound.push(match a {
                        LossArg::Node { node, kind } => {
                            let per_token = *kind == InputKind::PerToken;
                            let v = match self.inputs.get(&(*node, per_token)) {
                                Some(v) => *v,
                                None => {
                                    let name = params
                                        .and_then(|p| p.get(i))
                                        .map_or("", |p| p.name.as_str());
                                    let v = self.b.input_named(*kind, name);
                                    self.inputs.insert((*node, per_token), v);
                                    self.nodes.push(*node);
                                    v
                                }
                            };
                            Lv::V(v)
                        }
                        LossArg::Const(c) => Lv::C(c.clone()),
                        LossArg::Model(_) => Lv::Model,
                    });
                }
                match self.call(*f, bound, 0)? {
                    Lv::V(v) => v,
                    _ => return err("a loss call did not lower to a loss"),
                }
            }
            LossTree::Add(a, c) | LossTree::Sub(a, c) => {
                let x = loss(self, a)?;
                let y = loss(self, c)?;
                let op = if matches!(t, LossTree::Add(..)) {
                    LBin::Add
                } else {
                    LBin::Sub
                };
                self.b.binary(op, x, y)
            }
            LossTree::Neg(a) => {
                let x = loss(self, a)?;
                self.b.unary(LUn::Neg, x)
            }
            LossTree::Scale(a, k) | LossTree::Div(a, k) => {
                let x = loss(self, a)?;
                let k = self.b.float(*k);
                let op = if matches!(t, LossTree::Scale(..)) {
                    LBin::Mul
                } else {
                    LBin::Div
                };
                self.b.binary(op, x, k)
            }
        })
    }

    /// Inlines a call of `f` with its arguments bound, in parameter order. For a loss, its
    /// metrics are declared after its value is lowered.
    fn call(&mut self, f: FnId, args: Vec<Lv>, depth: usize) -> Result<Lv, LowerError> {
        if depth > MAX_DEPTH {
            return err("calls nest too deeply");
        }
        let program = self.program;
        let Some(func) = program.fns.get(f.0 as usize) else {
            return err(format!("no function #{}", f.0));
        };
        if func.scope != Scope::Sample {
            return err(format!(
                "`{}` works over a group or batch and cannot be inlined into a loss",
                func.name
            ));
        }
        let mut frame: Frame<'p> = BTreeMap::new();
        for (li, local) in func.locals.iter().enumerate() {
            if let LocalKind::Param(i) = local.kind {
                let Some(a) = args.get(i as usize) else {
                    return err(format!("`{}`: argument #{i} is missing", func.name));
                };
                // A per-sample value given for a per-token parameter is broadcast over each
                // sample's tokens, so that token reductions of it mean what they say.
                let a = match (&func.params.get(i as usize).map(|p| &p.ty), a) {
                    (Some(SigTy::PerToken), Lv::V(v)) => Lv::V(self.b.broadcast(*v)),
                    _ => a.clone(),
                };
                frame.insert(LocalId(li as u32), Binding::Done(a));
            }
        }
        let value = self.body(&func.body, &mut frame, depth)?;
        if let Some(loss) = &func.loss {
            for m in &loss.metrics {
                match self.expr(&m.value, &mut frame, depth)? {
                    Lv::V(v) if matches!(self.b.level(v), Some(Level::Token | Level::Sample)) => {
                        self.b.metric(m.name.clone(), v)
                    }
                    _ => {
                        return err(format!(
                            "metric `{}` of `{}` is not per token or sample",
                            m.name, func.name
                        ));
                    }
                }
            }
        }
        Ok(value)
    }

    fn body(&mut self, b: &'p Body, frame: &mut Frame<'p>, depth: usize) -> Result<Lv, LowerError> {
        for (l, e) in &b.lets {
            frame.insert(*l, Binding::Pending(e));
        }
        self.expr(&b.value, frame, depth)
    }

    /// An IR value for a value: constants become IR constants.
    fn value(&mut self, v: Lv) -> Result<LValue, LowerError> {
        match v {
            Lv::V(x) => Ok(x),
            Lv::C(Value::Int(i)) => Ok(self.b.float(i as f64)),
            Lv::C(Value::Float(f)) => Ok(self.b.float(f)),
            Lv::C(Value::Bool(x)) => Ok(self.b.bool(x)),
            Lv::C(Value::Str(_)) => err("a string is used where a number is needed"),
            Lv::Model => err("a model is used where a number is needed"),
        }
    }

    fn expr(&mut self, e: &'p Expr, frame: &mut Frame<'p>, depth: usize) -> Result<Lv, LowerError> {
        Ok(match &e.kind {
            ExprKind::Lit(v) => Lv::C(v.clone()),
            ExprKind::Ref(Def::Local(l)) => match frame.get(l).cloned() {
                Some(Binding::Done(v)) => v,
                Some(Binding::Pending(x)) => {
                    let v = self.expr(x, frame, depth)?;
                    frame.insert(*l, Binding::Done(v.clone()));
                    v
                }
                None => return err("a name has no value in the loss"),
            },
            ExprKind::Ref(_) => return err("functions and models are not values in a loss"),
            ExprKind::ModelOutput { output, .. } => Lv::V(self.b.model(*output)),
            ExprKind::Unary { op, operand } => match (op, self.expr(operand, frame, depth)?) {
                (UnaryOp::Neg, Lv::C(Value::Int(i))) => Lv::C(Value::Int(i.wrapping_neg())),
                (UnaryOp::Neg, Lv::C(Value::Float(f))) => Lv::C(Value::Float(-f)),
                (UnaryOp::Not, Lv::C(Value::Bool(b))) => Lv::C(Value::Bool(!b)),
                (UnaryOp::Neg, Lv::V(v)) => Lv::V(self.b.unary(LUn::Neg, v)),
                (UnaryOp::Not, Lv::V(v)) => Lv::V(self.b.unary(LUn::Not, v)),
                _ => return err("this unary operation cannot be lowered"),
            },
            ExprKind::Binary { op, lhs, rhs } => {
                let a = self.expr(lhs, frame, depth)?;
                let c = self.expr(rhs, frame, depth)?;
                self.binary(*op, a, c)?
            }
            ExprKind::If { cond, then, else_ } => match self.expr(cond, frame, depth)? {
                Lv::C(Value::Bool(true)) => self.body(then, frame, depth)?,
                Lv::C(Value::Bool(false)) => self.expr(else_, frame, depth)?,
                Lv::V(c) => {
                    let t = self.body(then, frame, depth)?;
                    let t = self.value(t)?;
                    let x = self.expr(else_, frame, depth)?;
                    let x = self.value(x)?;
                    Lv::V(self.b.select(c, t, x))
                }
                _ => return err("an `if` condition is not a bool"),
            },
            ExprKind::Block(b) => self.body(b, frame, depth)?,
            ExprKind::Call { callee, args, .. } => {
                let mut vals = Vec::new();
                for a in args {
                    vals.push(self.expr(a, frame, depth)?);
                }
                match callee {
                    Callee::Builtin(name) => self.builtin(name, vals)?,
                    Callee::Fn(f) => self.call(*f, vals, depth + 1)?,
                    Callee::Model(_) | Callee::FnValue(_) => {
                        return err("a model call or function parameter inside a loss");
                    }
                }
            }
            ExprKind::Field { .. } | ExprKind::Index { .. } | ExprKind::Scan(_) => {
                return err("sample fields, indexing and `scan` cannot be differentiated");
            }
            ExprKind::Error => return err("the loss has errors"),
        })
    }

    fn binary(&mut self, op: BinaryOp, a: Lv, c: Lv) -> Result<Lv, LowerError> {
        use BinaryOp as B;
        if let (Lv::C(x), Lv::C(y)) = (&a, &c) {
            return match fold(op, x, y) {
                Some(v) => Ok(Lv::C(v)),
                None => err(format!("`{}` of these constants", op.as_str())),
            };
        }
        // `&&` and `||` with one constant side: the identities, so that a constant condition
        // stays constant where it decides.
        if matches!(op, B::And | B::Or) {
            for (k, other) in [(&a, &c), (&c, &a)] {
                if let Lv::C(Value::Bool(k)) = k {
                    return Ok(match (op, *k) {
                        (B::And, true) | (B::Or, false) => other.clone(),
                        (B::And, false) => Lv::C(Value::Bool(false)),
                        _ => Lv::C(Value::Bool(true)),
                    });
                }
            }
        }
        let bop = match op {
            B::Add => LBin::Add,
            B::Sub => LBin::Sub,
            B::Mul => LBin::Mul,
            B::Div => LBin::Div,
            B::Rem => LBin::Rem,
            B::Eq => LBin::Eq,
            B::Ne => LBin::Ne,
            B::Lt => LBin::Lt,
            B::Le => LBin::Le,
            B::Gt => LBin::Gt,
            B::Ge => LBin::Ge,
            B::And => LBin::And,
            B::Or => LBin::Or,
        };
        let x = self.value(a)?;
        let y = self.value(c)?;
        Ok(Lv::V(self.b.binary(bop, x, y)))
    }

    fn builtin(&mut self, name: &str, vals: Vec<Lv>) -> Result<Lv, LowerError> {
        let arg = |i: usize| -> Result<Lv, LowerError> {
            vals.get(i)
                .cloned()
                .ok_or_else(|| LowerError(format!("`{name}` misses argument {}", i + 1)))
        };
        let float_of = |v: &Value| v.as_f64();
        let un = |this: &mut Self, op: LUn, f: fn(f64) -> f64| -> Result<Lv, LowerError> {
            Ok(match arg(0)? {
                Lv::C(c) => match float_of(&c) {
                    Some(x) => Lv::C(Value::Float(f(x))),
                    None => return err(format!("`{name}` of a non-number")),
                },
                v => {
                    let x = this.value(v)?;
                    Lv::V(this.b.unary(op, x))
                }
            })
        };
        Ok(match name {
            "exp" => un(self, LUn::Exp, f64::exp)?,
            "log" => un(self, LUn::Log, f64::ln)?,
            "sqrt" => un(self, LUn::Sqrt, f64::sqrt)?,
            "abs" => match arg(0)? {
                Lv::C(Value::Int(i)) => Lv::C(Value::Int(i.wrapping_abs())),
                _ => un(self, LUn::Abs, f64::abs)?,
            },
            "float" => match arg(0)? {
                Lv::C(Value::Int(i)) => Lv::C(Value::Float(i as f64)),
                v => v,
            },
            "stop_grad" => match arg(0)? {
                Lv::C(c) => Lv::C(c),
                v => {
                    let x = self.value(v)?;
                    Lv::V(self.b.unary(LUn::StopGrad, x))
                }
            },
            "clamp" => {
                let (x, lo, hi) = (arg(0)?, arg(1)?, arg(2)?);
                if let (Lv::C(x), Lv::C(lo), Lv::C(hi)) = (&x, &lo, &hi) {
                    let (Some(x), Some(lo), Some(hi)) = (x.as_f64(), lo.as_f64(), hi.as_f64())
                    else {
                        return err("`clamp` of non-numbers");
                    };
                    let m = braid_ir::kernel::fsem::max(x, lo);
                    return Ok(Lv::C(Value::Float(braid_ir::kernel::fsem::min(m, hi))));
                }
                let (x, lo, hi) = (self.value(x)?, self.value(lo)?, self.value(hi)?);
                Lv::V(self.b.clamp(x, lo, hi))
            }
            "min" | "max" if vals.len() == 2 => {
                let (a, c) = (arg(0)?, arg(1)?);
                if let (Lv::C(x), Lv::C(y)) = (&a, &c) {
                    let v = match (x, y) {
                        (Value::Int(p), Value::Int(q)) => {
                            Value::Int(if name == "min" { *p.min(q) } else { *p.max(q) })
                        }
                        _ => {
                            let (Some(p), Some(q)) = (x.as_f64(), y.as_f64()) else {
                                return err(format!("`{name}` of non-numbers"));
                            };
                            Value::Float(if name == "min" {
                                braid_ir::kernel::fsem::min(p, q)
                            } else {
                                braid_ir::kernel::fsem::max(p, q)
                            })
                        }
                    };
                    return Ok(Lv::C(v));
                }
                let (x, y) = (self.value(a)?, self.value(c)?);
                let op = if name == "min" { LBin::Min } else { LBin::Max };
                Lv::V(self.b.binary(op, x, y))
            }
            "min" | "max" | "sum" | "mean" | "std" | "count" => {
                let op = match name {
                    "min" => ReduceOp::Min,
                    "max" => ReduceOp::Max,
                    "sum" => ReduceOp::Sum,
                    "mean" => ReduceOp::Mean,
                    "std" => ReduceOp::Std,
                    _ => ReduceOp::Count,
                };
                self.reduce(op, arg(0)?)?
            }
            "len" => match arg(0)? {
                Lv::C(Value::Str(s)) => Lv::C(Value::Int(s.chars().count() as i64)),
                Lv::V(v) if self.b.level(v) == Some(Level::Token) => {
                    Lv::V(self.b.layout(LayoutValue::Len))
                }
                // A per-sample number is one element.
                _ => Lv::C(Value::Int(1)),
            },
            "batch_sum" | "batch_mean" | "group_mean" => {
                let x = match arg(0)? {
                    Lv::V(v) if matches!(self.b.level(v), Some(Level::Token | Level::Sample)) => v,
                    _ => {
                        return err(format!(
                            "`{name}` of a value that is not per token or sample"
                        ));
                    }
                };
                Lv::V(match name {
                    "batch_sum" => self.b.batch_sum(x),
                    "batch_mean" => self.b.batch_mean(x),
                    _ => self.b.group_mean(x),
                })
            }
            other => return err(format!("`{other}` cannot be used in a loss")),
        })
    }

    /// A reduction over a sample's tokens; of a per-sample number, the number itself (its
    /// standard deviation is 0, its count 1 when it is not 0), as in kernels.
    fn reduce(&mut self, op: ReduceOp, x: Lv) -> Result<Lv, LowerError> {
        if let Lv::V(v) = &x
            && self.b.level(*v) == Some(Level::Token)
        {
            return Ok(Lv::V(self.b.reduce(op, *v)));
        }
        Ok(match (op, x) {
            (ReduceOp::Std, _) => Lv::C(Value::Float(0.0)),
            (ReduceOp::Count, Lv::C(c)) => {
                Lv::C(Value::Int(i64::from(c.as_f64().is_none_or(|f| f != 0.0))))
            }
            (ReduceOp::Count, v) => {
                let x = self.value(v)?;
                let zero = self.b.float(0.0);
                let one = self.b.float(1.0);
                let ne = self.b.binary(LBin::Ne, x, zero);
                Lv::V(self.b.select(ne, one, zero))
            }
            (_, Lv::C(Value::Int(i))) => Lv::C(Value::Float(i as f64)),
            (_, v) => v,
        })
    }
}
