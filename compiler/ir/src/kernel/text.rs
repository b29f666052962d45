//! The kernel's text form (its `Display`): one instruction per line, nested blocks indented,
//! for snapshots, `--dump` output and error messages. It must print every field that the
//! structural hash covers, so that two kernels with the same text have the same structure.

use super::{BlockId, HostCall, IntField, Kernel, Op, ParamKind, ScalarTy, Scope, UnOp, Value};
use std::fmt::{self, Display, Formatter};

impl Display for Kernel {
    fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
        write!(f, "kernel {}(", self.name)?;
        for (i, p) in self.params.iter().enumerate() {
            let name = match p {
                ParamKind::PerToken => "per_token",
                ParamKind::PerSample => "per_sample",
                ParamKind::Scalar(ScalarTy::Int) => "int",
                ParamKind::Scalar(ScalarTy::Float) => "float",
                ParamKind::Scalar(ScalarTy::Bool) => "bool",
                ParamKind::Sample => "sample",
            };
            write!(f, "{}p{i}: {name}", if i > 0 { ", " } else { "" })?;
        }
        let scope = match self.scope {
            Scope::Sample => "sample",
            Scope::Group => "group",
            Scope::Batch => "batch",
        };
        writeln!(f, ") over {scope} {{")?;
        for (i, h) in self.host_calls.iter().enumerate() {
            writeln!(f, "  host{i} = {}", HostText(h))?;
        }
        self.fmt_block(f, self.entry, 1, "return")?;
        writeln!(f, "}}")
    }
}

struct HostText<'a>(&'a HostCall);

impl Display for HostText<'_> {
    fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
        match self.0 {
            HostCall::CountRegex {
                param,
                field,
                pattern,
            } => {
                write!(f, "count_regex p{param}.{}, {pattern:?}", field.name())
            }
            HostCall::MatchesRegex {
                param,
                field,
                pattern,
            } => {
                write!(f, "matches_regex p{param}.{}, {pattern:?}", field.name())
            }
            HostCall::Contains { param, field, lit } => {
                write!(f, "contains p{param}.{}, {lit:?}", field.name())
            }
            HostCall::StartsWith { param, field, lit } => {
                write!(f, "starts_with p{param}.{}, {lit:?}", field.name())
            }
            HostCall::EndsWith { param, field, lit } => {
                write!(f, "ends_with p{param}.{}, {lit:?}", field.name())
            }
            HostCall::StrLen { param, field } => write!(f, "str_len p{param}.{}", field.name()),
            HostCall::AnswerMatches {
                param,
                completion,
                answer,
            } => {
                write!(
                    f,
                    "answer_matches p{param}.{}, p{param}.{}",
                    completion.name(),
                    answer.name()
                )
            }
            HostCall::Equals { param, field, lit } => {
                write!(f, "str_eq p{param}.{}, {lit:?}", field.name())
            }
            HostCall::TextsEqual { param, a, b } => {
                write!(f, "str_eq p{param}.{}, p{param}.{}", a.name(), b.name())
            }
            HostCall::Field { param, name, ty } => {
                let ty = match ty {
                    ScalarTy::Int => "int",
                    ScalarTy::Float => "float",
                    ScalarTy::Bool => "bool",
                };
                write!(f, "field_{ty} p{param}, {name:?}")
            }
        }
    }
}

fn v(x: &Value) -> String {
    format!("%{}", x.0)
}

impl Kernel {
    fn fmt_block(
        &self,
        f: &mut Formatter<'_>,
        id: BlockId,
        depth: usize,
        end: &str,
    ) -> fmt::Result {
        let pad = "  ".repeat(depth);
        let Some(block) = self.block(id) else {
            return writeln!(f, "{pad}<missing block{}>", id.0);
        };
        for &x in &block.insts {
            let Some(inst) = self.insts.get(x.index()) else {
                writeln!(f, "{pad}<missing %{}>", x.0)?;
                continue;
            };
            write!(f, "{pad}%{}: {} = ", x.0, inst.ty.name())?;
            match &inst.op {
                Op::ConstInt(i) => writeln!(f, "const {i}")?,
                Op::ConstFloat(bits) => writeln!(f, "const {:?}", f64::from_bits(*bits))?,
                Op::ConstBool(b) => writeln!(f, "const {b}")?,
                Op::Param(n) => writeln!(f, "param p{n}")?,
                Op::SampleInt { param, field } => {
                    let name = match field {
                        IntField::Length => "length",
                        IntField::Group => "group",
                    };
                    writeln!(f, "sample_int p{param}.{name}")?
                }
                Op::Len => writeln!(f, "len")?,
                Op::Unary(op, a) => {
                    let name = match op {
                        UnOp::Neg => "neg",
                        UnOp::Not => "not",
                        UnOp::Exp => "exp",
                        UnOp::Log => "log",
                        UnOp::Sqrt => "sqrt",
                        UnOp::Abs => "abs",
                        UnOp::IntToFloat => "to_float",
                    };
                    writeln!(f, "{name} {}", v(a))?
                }
                Op::Binary(op, a, b) => {
                    writeln!(f, "{} {}, {}", format!("{op:?}").to_lowercase(), v(a), v(b))?
                }
                Op::Index { tokens, index } => writeln!(f, "index {}[{}]", v(tokens), v(index))?,
                Op::Reduce(op, a) => writeln!(f, "reduce.{} {}", op.name(), v(a))?,
                Op::ScopeReduce(op, a) => writeln!(f, "scope_reduce.{} {}", op.name(), v(a))?,
                Op::Host(n) => writeln!(f, "call host{n}")?,
                Op::BlockParam { block, index } => {
                    writeln!(f, "block_param block{}.{index}", block.0)?
                }
                Op::If {
                    cond,
                    then_block,
                    else_block,
                } => {
                    writeln!(f, "if {} {{", v(cond))?;
                    self.fmt_block(f, *then_block, depth + 1, "yield")?;
                    writeln!(f, "{pad}}} else {{")?;
                    self.fmt_block(f, *else_block, depth + 1, "yield")?;
                    writeln!(f, "{pad}}}")?;
                }
                Op::Scan {
                    reverse,
                    init,
                    body,
                } => {
                    let params: Vec<String> = self
                        .block(*body)
                        .map(|b| {
                            b.params
                                .iter()
                                .map(|p| {
                                    let ty = self.ty(*p).map_or("?", |t| t.name());
                                    format!("{}: {ty}", v(p))
                                })
                                .collect()
                        })
                        .unwrap_or_default();
                    let dir = if *reverse { "scan reverse" } else { "scan" };
                    writeln!(f, "{dir} init {} ({}) {{", v(init), params.join(", "))?;
                    self.fmt_block(f, *body, depth + 1, "yield")?;
                    writeln!(f, "{pad}}}")?;
                }
            }
        }
        match block.result {
            Some(r) => writeln!(f, "{pad}{end} {}", v(&r)),
            None => writeln!(f, "{pad}{end} <none>"),
        }
    }
}
