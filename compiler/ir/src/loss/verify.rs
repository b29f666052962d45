//! The objective verifier: the invariants an evaluator relies on, checked once — every operand
//! defined before its use, each operation's levels and types, the loss reached only through
//! `BatchSum` and combined only linearly (what makes gradient accumulation exact), metrics of
//! per-token or per-sample values, and a result that carries a gradient. It
//! must not change the objective.

use super::{BinOp, Level, Objective, Op, Ty, UnOp, Value, const_value};

/// A broken objective invariant.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("objective `{objective}`: {message}")]
pub struct VerifyError {
    pub objective: String,
    pub message: String,
}

/// The level and type an operation yields from its operands' `(level, type)`, or why it is
/// malformed. The builder uses this too, so that it never makes what the verifier rejects.
pub fn result_of(
    op: &Op,
    inputs: &[super::InputKind],
    of: impl Fn(Value) -> Option<(Level, Ty)>,
) -> Result<(Level, Ty), String> {
    let get = |v: Value| of(v).ok_or_else(|| format!("%{} is used before it is defined", v.0));
    let float = |v: Value, what: &str| -> Result<Level, String> {
        match get(v)? {
            (l, Ty::Float) => Ok(l),
            (_, Ty::Bool) => Err(format!("{what} of %{} must be a float, not a bool", v.0)),
        }
    };
    let not_loss = |l: Level, what: &str| -> Result<Level, String> {
        if l == Level::Loss {
            Err(format!(
                "{what} does not apply to the loss (it combines only linearly)"
            ))
        } else {
            Ok(l)
        }
    };
    Ok(match op {
        Op::Const(_) => (Level::Scalar, Ty::Float),
        Op::ConstBool(_) => (Level::Scalar, Ty::Bool),
        Op::Input(n) => match inputs.get(*n as usize) {
            Some(k) => (k.level(), Ty::Float),
            None => return Err(format!("input {n} does not exist")),
        },
        Op::Model(_) => (Level::Token, Ty::Float),
        Op::Layout(l) => (l.level(), Ty::Float),
        Op::Unary(UnOp::Not, x) => match get(*x)? {
            (l, Ty::Bool) => (not_loss(l, "not")?, Ty::Bool),
            _ => return Err(format!("not of %{} must be a bool", x.0)),
        },
        Op::Unary(UnOp::Neg, x) => (float(*x, "neg")?, Ty::Float),
        Op::Unary(u, x) => (not_loss(float(*x, u.name())?, u.name())?, Ty::Float),
        Op::Binary(b, x, y) => {
            let (lx, tx) = get(*x)?;
            let (ly, ty) = get(*y)?;
            let (want, out) = if b.is_logic() {
                (Ty::Bool, Ty::Bool)
            } else if b.is_comparison() {
                (Ty::Float, Ty::Bool)
            } else {
                (Ty::Float, Ty::Float)
            };
            if tx != want || ty != want {
                return Err(format!(
                    "{} of %{} and %{}: wrong operand types",
                    b.name(),
                    x.0,
                    y.0
                ));
            }
            let level = match (lx, ly) {
                (Level::Loss, Level::Loss) if matches!(b, BinOp::Add | BinOp::Sub) => Level::Loss,
                (Level::Loss, Level::Scalar) if matches!(b, BinOp::Mul | BinOp::Div) => Level::Loss,
                (Level::Scalar, Level::Loss) if *b == BinOp::Mul => Level::Loss,
                (Level::Loss, _) | (_, Level::Loss) => {
                    return Err(format!(
                        "{} of %{} and %{}: the loss adds to the loss and scales by constants only",
                        b.name(),
                        x.0,
                        y.0
                    ));
                }
                (a, c) => a.max(c),
            };
            (level, out)
        }
        Op::Select { cond, then, else_ } => {
            let (lc, tc) = get(*cond)?;
            if tc != Ty::Bool {
                return Err(format!("select condition %{} must be a bool", cond.0));
            }
            let (lt, tt) = get(*then)?;
            let (le, te) = get(*else_)?;
            if tt != te {
                return Err(format!(
                    "select of %{} and %{}: different types",
                    then.0, else_.0
                ));
            }
            let l = not_loss(lc, "select")?
                .max(not_loss(lt, "select")?)
                .max(not_loss(le, "select")?);
            (l, tt)
        }
        Op::Clamp { x, lo, hi } => {
            let l = not_loss(float(*x, "clamp")?, "clamp")?
                .max(not_loss(float(*lo, "clamp")?, "clamp")?)
                .max(not_loss(float(*hi, "clamp")?, "clamp")?);
            (l, Ty::Float)
        }
        Op::Reduce(r, x) => {
            if float(*x, r.name())? != Level::Token {
                return Err(format!(
                    "{} of %{}: a token reduction needs a per-token value",
                    r.name(),
                    x.0
                ));
            }
            (Level::Sample, Ty::Float)
        }
        Op::Broadcast(x) => match get(*x)? {
            (Level::Sample, t) => (Level::Token, t),
            (l, _) => {
                return Err(format!(
                    "broadcast of %{}: needs a per-sample value, not a {} value",
                    x.0,
                    l.name()
                ));
            }
        },
        Op::BatchSum { x, scale, .. } => {
            let l = float(*x, "batch_sum")?;
            if !matches!(l, Level::Sample | Level::Token) {
                return Err(format!(
                    "batch_sum of %{}: needs a per-sample or per-token value, not a {} value",
                    x.0,
                    l.name()
                ));
            }
            if const_value(*scale).is_nan() {
                return Err(format!("batch_sum of %{}: the scale is NaN", x.0));
            }
            (Level::Loss, Ty::Float)
        }
    })
}

/// Verifies an objective.
pub fn verify(o: &Objective) -> Result<(), VerifyError> {
    let err = |message: String| VerifyError {
        objective: o.name.clone(),
        message,
    };
    if !o.input_names.is_empty() && o.input_names.len() != o.inputs.len() {
        return Err(err(format!(
            "{} input names for {} inputs",
            o.input_names.len(),
            o.inputs.len()
        )));
    }
    for (i, inst) in o.insts.iter().enumerate() {
        let got = result_of(&inst.op, &o.inputs, |v| {
            (v.index() < i).then(|| (o.insts[v.index()].level, o.insts[v.index()].ty))
        })
        .map_err(|m| err(format!("%{i}: {m}")))?;
        if got != (inst.level, inst.ty) {
            return Err(err(format!(
                "%{i}: recorded as {} {:?}, computes {} {:?}",
                inst.level.name(),
                inst.ty,
                got.0.name(),
                got.1
            )));
        }
    }
    let level = |v: Value| o.inst(v).map(|i| (i.level, i.ty));
    match level(o.result) {
        Some((Level::Loss, Ty::Float)) => {}
        Some((l, _)) => {
            return Err(err(format!(
                "the result %{} is a {} value, not the loss",
                o.result.0,
                l.name()
            )));
        }
        None => return Err(err(format!("the result %{} does not exist", o.result.0))),
    }
    if !o.gradients()[o.result.index()] {
        return Err(err(
            "the loss carries no gradient: it depends on no model output".into(),
        ));
    }
    for m in &o.metrics {
        if m.name.is_empty() {
            return Err(err("a metric has no name".into()));
        }
        match level(m.value) {
            Some((Level::Token | Level::Sample, _)) => {}
            Some((l, _)) => {
                return Err(err(format!(
                    "metric `{}` is a {} value (metrics are per-token or per-sample)",
                    m.name,
                    l.name()
                )));
            }
            None => return Err(err(format!("metric `{}` has no value", m.name))),
        }
    }
    Ok(())
}
