//! The objective's text form (its `Display`): one instruction per line with its level and type,
//! then the metrics and the result — for snapshots, `--dump` output and error messages. It
//! prints every field, so two objectives with the same text are the same (up to their name).

use super::{Count, InputKind, Objective, Op, Ty, Value, const_value};
use std::fmt::{self, Display, Formatter};

struct V(Value);

impl Display for V {
    fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
        write!(f, "%{}", self.0.0)
    }
}

impl Display for Objective {
    fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
        write!(f, "loss {}(", self.name)?;
        for (i, k) in self.inputs.iter().enumerate() {
            let kind = match k {
                InputKind::PerToken => "per_token",
                InputKind::PerSample => "per_sample",
            };
            let name = match o_name(self, i) {
                Some(n) => format!(" {n}"),
                None => String::new(),
            };
            write!(f, "{}p{i}{name}: {kind}", if i > 0 { ", " } else { "" })?;
        }
        writeln!(f, ") {{")?;
        for (i, inst) in self.insts.iter().enumerate() {
            let ty = match inst.ty {
                Ty::Float => "",
                Ty::Bool => " bool",
            };
            write!(f, "  %{i}: {}{ty} = ", inst.level.name())?;
            match &inst.op {
                Op::Const(bits) => write!(f, "const {:?}", const_value(*bits))?,
                Op::ConstBool(b) => write!(f, "const {b}")?,
                Op::Input(n) => write!(f, "input p{n}")?,
                Op::Model(o) => write!(f, "model {}", o.name())?,
                Op::Layout(l) => write!(f, "layout {}", l.name())?,
                Op::Unary(u, x) => write!(f, "{} {}", u.name(), V(*x))?,
                Op::Binary(b, x, y) => write!(f, "{} {}, {}", b.name(), V(*x), V(*y))?,
                Op::Select { cond, then, else_ } => {
                    write!(f, "select {}, {}, {}", V(*cond), V(*then), V(*else_))?
                }
                Op::Clamp { x, lo, hi } => write!(f, "clamp {}, {}, {}", V(*x), V(*lo), V(*hi))?,
                Op::Reduce(r, x) => write!(f, "token_{} {}", r.name(), V(*x))?,
                Op::Broadcast(x) => write!(f, "broadcast {}", V(*x))?,
                Op::BatchSum { x, count, scale } => {
                    write!(f, "batch_sum {}", V(*x))?;
                    let scale = const_value(*scale);
                    match (count, scale == 1.0) {
                        (Count::One, true) => {}
                        (Count::One, false) => write!(f, " / {scale:?}")?,
                        (c, true) => write!(f, " / {}", c.name())?,
                        (c, false) => write!(f, " / ({} * {scale:?})", c.name())?,
                    }
                }
            }
            writeln!(f)?;
        }
        for m in &self.metrics {
            writeln!(f, "  metric {} = {}", m.name, V(m.value))?;
        }
        writeln!(f, "  return {}", V(self.result))?;
        writeln!(f, "}}")
    }
}

/// The name of input `i`, if it has one.
fn o_name(o: &Objective, i: usize) -> Option<&str> {
    o.input_names
        .get(i)
        .map(|s| s.as_str())
        .filter(|s| !s.is_empty())
}
