//! `braid eval FILE --fn NAME --samples FILE.jsonl`: evaluate a `fn` on recorded samples, the
//! way a user checks a reward or an advantage estimator before launching a job. The function is
//! lowered to a kernel and run by the Cranelift JIT (or the reference interpreter with
//! `--interpret`); one JSON object per sample is printed.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;

use braid_ir::kernel::{
    Arg, Batch, FieldValue, Interpreter, KernelExec, Output, Ragged, SampleText,
};
use braid_sema::hir::{ExprKind, FnId, SigTy, Value};

use crate::diag::{self, DiskLoader, Format};

#[derive(clap::Args)]
pub struct Args {
    /// The `.rlhf` file that defines (or imports) the function.
    file: PathBuf,
    /// The function to evaluate.
    #[arg(long = "fn", value_name = "NAME")]
    function: String,
    /// Samples, one JSON object per line: `prompt`, `completion`, `answer`, `group`, `length`,
    /// a field per PerToken (array of numbers) or PerSample (number) parameter, and the record
    /// fields the function reads (`field_int(s, "difficulty")`).
    #[arg(long, value_name = "FILE.jsonl")]
    samples: PathBuf,
    /// A scalar or string parameter: `--arg gamma=0.99`.
    #[arg(long = "arg", value_name = "NAME=VALUE")]
    args: Vec<String>,
    /// Run the reference interpreter instead of the JIT.
    #[arg(long)]
    interpret: bool,
}

struct Fail(String, u8);

pub fn run(args: Args) -> ExitCode {
    match eval(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(Fail(msg, code)) => {
            if !msg.is_empty() {
                eprintln!("error: {msg}");
            }
            ExitCode::from(code)
        }
    }
}

/// What a JSON value that is not a field value is, in words.
fn json_kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
        _ => "a scalar",
    }
}

/// One parsed line of the samples file.
struct Line {
    number: usize,
    record: serde_json::Map<String, serde_json::Value>,
}

fn eval(args: &Args) -> Result<(), Fail> {
    let name = args.file.display().to_string();
    let text = std::fs::read_to_string(&args.file).map_err(|e| Fail(format!("{name}: {e}"), 2))?;
    let checked = braid_sema::check(&name, &text, &DiskLoader);
    if checked.has_errors() {
        diag::print(&checked.diagnostics, &checked.sources, Format::Human);
        return Err(Fail(format!("{name} has errors"), 1));
    }
    let program = &checked.program;
    let Some(fid) = program.fns.iter().position(|f| f.name == args.function) else {
        let names: Vec<&str> = program.fns.iter().map(|f| f.name.as_str()).collect();
        return Err(Fail(
            format!(
                "{name}: no function `{}`; the functions in scope are {}",
                args.function,
                names.join(", ")
            ),
            2,
        ));
    };
    let func = &program.fns[fid];
    // Scalar and string parameters from --arg, else their defaults.
    let mut given: BTreeMap<String, String> = BTreeMap::new();
    for a in &args.args {
        let Some((k, v)) = a.split_once('=') else {
            return Err(Fail(format!("--arg `{a}`: write NAME=VALUE"), 2));
        };
        if !func.params.iter().any(|p| p.name == k) {
            let names: Vec<&str> = func.params.iter().map(|p| p.name.as_str()).collect();
            return Err(Fail(
                format!(
                    "--arg `{k}`: `{}` has no parameter `{k}`; its parameters are {}",
                    func.name,
                    names.join(", ")
                ),
                2,
            ));
        }
        given.insert(k.to_string(), v.to_string());
    }
    let strings: BTreeMap<String, String> = func
        .params
        .iter()
        .filter(|p| p.ty == SigTy::Str)
        .filter_map(|p| given.get(&p.name).map(|v| (p.name.clone(), v.clone())))
        .collect();
    let lowered = braid_sema::lower_kernel::lower_fn(program, FnId(fid as u32), &strings)
        .map_err(|e| Fail(format!("cannot compile `{}`: {e}", func.name), 1))?;

    // The samples.
    let samples_name = args.samples.display().to_string();
    let data = std::fs::read_to_string(&args.samples)
        .map_err(|e| Fail(format!("{samples_name}: {e}"), 2))?;
    let mut lines = Vec::new();
    for (i, l) in data.lines().enumerate() {
        if l.trim().is_empty() {
            continue;
        }
        match serde_json::from_str::<serde_json::Value>(l) {
            Ok(serde_json::Value::Object(record)) => lines.push(Line {
                number: i + 1,
                record,
            }),
            Ok(_) => {
                return Err(Fail(
                    format!("{samples_name}:{}: a sample must be a JSON object", i + 1),
                    1,
                ));
            }
            Err(e) => {
                return Err(Fail(
                    format!("{samples_name}:{}: not valid JSON: {e}", i + 1),
                    1,
                ));
            }
        }
    }
    if lines.is_empty() {
        return Err(Fail(format!("{samples_name}: no samples"), 1));
    }
    let field_str = |l: &Line, key: &str| -> Result<String, Fail> {
        match l.record.get(key) {
            None | Some(serde_json::Value::Null) => Ok(String::new()),
            Some(serde_json::Value::String(s)) => Ok(s.clone()),
            Some(other) => Ok(other.to_string()),
        }
    };
    // The record fields the function reads (`field_int(s, "difficulty")`), checked on every
    // line as a dataset's records are when a run loads them.
    let wanted = lowered.kernel.record_fields();
    let texts: Vec<SampleText> = lines
        .iter()
        .map(|l| {
            let mut fields = braid_ir::kernel::Fields::new();
            for f in &wanted {
                let v = match l.record.get(&f.name) {
                    None => None,
                    Some(v) => Some(serde_json::from_value::<FieldValue>(v.clone()).map_err(
                        |_| {
                            Fail(
                                format!(
                                    "{samples_name}:{}: field `{}` is {}, but `{}` reads {}",
                                    l.number,
                                    f.name,
                                    json_kind(v),
                                    f.ty.reader(),
                                    f.ty.describe()
                                ),
                                1,
                            )
                        },
                    )?),
                };
                f.check(v.as_ref())
                    .map_err(|why| Fail(format!("{samples_name}:{}: {why}", l.number), 1))?;
                if let Some(v) = v {
                    fields.insert(f.name.clone(), v);
                }
            }
            Ok(SampleText {
                prompt: field_str(l, "prompt")?,
                completion: field_str(l, "completion")?,
                answer: field_str(l, "answer")?,
                fields,
            })
        })
        .collect::<Result<_, Fail>>()?;
    let int_field = |key: &str| -> Result<Option<Vec<i64>>, Fail> {
        if !lines.iter().any(|l| l.record.contains_key(key)) {
            return Ok(None);
        }
        lines
            .iter()
            .map(|l| match l.record.get(key).and_then(|v| v.as_i64()) {
                Some(v) if v >= 0 => Ok(v),
                _ => Err(Fail(format!("{samples_name}:{}: field `{key}` must be a non-negative integer on every line", l.number), 1)),
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Some)
    };
    let groups = int_field("group")?;
    let lengths: Option<Vec<usize>> =
        int_field("length")?.map(|v| v.into_iter().map(|x| x as usize).collect());

    // Per-token and per-sample inputs, named like the parameters.
    let mut ragged: BTreeMap<usize, (Vec<f64>, Vec<usize>)> = BTreeMap::new();
    let mut dense: BTreeMap<usize, Vec<f64>> = BTreeMap::new();
    for (i, p) in func.params.iter().enumerate() {
        match p.ty {
            SigTy::PerToken => {
                let mut values = Vec::new();
                let mut offsets = vec![0];
                for l in &lines {
                    let arr = l.record.get(&p.name).and_then(|v| v.as_array()).ok_or_else(|| {
                        Fail(format!("{samples_name}:{}: missing field `{}` (an array of numbers, one per completion token)", l.number, p.name), 1)
                    })?;
                    for x in arr {
                        values.push(x.as_f64().ok_or_else(|| {
                            Fail(
                                format!(
                                    "{samples_name}:{}: `{}` must hold numbers",
                                    l.number, p.name
                                ),
                                1,
                            )
                        })?);
                    }
                    offsets.push(values.len());
                }
                ragged.insert(i, (values, offsets));
            }
            SigTy::PerSample => {
                let mut values = Vec::new();
                for l in &lines {
                    values.push(l.record.get(&p.name).and_then(|v| v.as_f64()).ok_or_else(
                        || {
                            Fail(
                                format!(
                                    "{samples_name}:{}: missing field `{}` (a number)",
                                    l.number, p.name
                                ),
                                1,
                            )
                        },
                    )?);
                }
                dense.insert(i, values);
            }
            _ => {}
        }
    }
    // Per-token inputs of one sample must have the same length (the sample's token count).
    let per_token: Vec<&(Vec<f64>, Vec<usize>)> = ragged.values().collect();
    if let Some(first) = per_token.first() {
        for other in &per_token[1..] {
            for (j, l) in lines.iter().enumerate() {
                let (a, b) = (first.1[j + 1] - first.1[j], other.1[j + 1] - other.1[j]);
                if a != b {
                    return Err(Fail(
                        format!(
                            "{samples_name}:{}: per-token fields have different lengths ({a} and {b})",
                            l.number
                        ),
                        1,
                    ));
                }
            }
        }
        if let Some(lengths) = &lengths {
            for (j, l) in lines.iter().enumerate() {
                if lengths[j] != first.1[j + 1] - first.1[j] {
                    return Err(Fail(
                        format!(
                            "{samples_name}:{}: `length` is {} but per-token fields have {} values",
                            l.number,
                            lengths[j],
                            first.1[j + 1] - first.1[j]
                        ),
                        1,
                    ));
                }
            }
        }
    }
    let mut kargs: Vec<Arg<'_>> = Vec::new();
    for (i, p) in func.params.iter().enumerate() {
        if lowered.param_map.get(i).copied().flatten().is_none() {
            continue;
        }
        let scalar =
            |p: &braid_sema::hir::Param| -> Result<Option<Value>, Fail> {
                if let Some(v) = given.get(&p.name) {
                    return Ok(Some(match p.ty {
                        SigTy::Int => Value::Int(v.parse().map_err(|_| {
                            Fail(format!("--arg {}: `{v}` is not an int", p.name), 2)
                        })?),
                        SigTy::Float => Value::Float(v.parse().map_err(|_| {
                            Fail(format!("--arg {}: `{v}` is not a number", p.name), 2)
                        })?),
                        _ => Value::Bool(v.parse().map_err(|_| {
                            Fail(
                                format!("--arg {}: `{v}` is not `true` or `false`", p.name),
                                2,
                            )
                        })?),
                    }));
                }
                Ok(match &p.default {
                    Some(braid_sema::hir::Expr {
                        kind: ExprKind::Lit(v),
                        ..
                    }) => Some(v.clone()),
                    _ => None,
                })
            };
        let arg = match p.ty {
            SigTy::Sample => Arg::Sample,
            SigTy::PerToken => {
                let (v, o) = &ragged[&i];
                Arg::PerToken(Ragged {
                    values: v,
                    offsets: o,
                })
            }
            SigTy::PerSample => Arg::PerSample(&dense[&i]),
            SigTy::Int | SigTy::Float | SigTy::Bool => match scalar(p)? {
                Some(Value::Int(x)) if p.ty == SigTy::Float => Arg::Float(x as f64),
                Some(Value::Int(x)) => Arg::Int(x),
                Some(Value::Float(x)) => Arg::Float(x),
                Some(Value::Bool(x)) => Arg::Bool(x),
                _ => {
                    return Err(Fail(
                        format!(
                            "`{}` needs a value for `{}`: pass --arg {}=…",
                            func.name, p.name, p.name
                        ),
                        2,
                    ));
                }
            },
            _ => continue,
        };
        kargs.push(arg);
    }
    let batch = Batch {
        n_samples: lines.len(),
        lengths: lengths.as_deref(),
        groups: groups.as_deref(),
        texts: Some(&texts),
    };
    let output = if args.interpret {
        let interp = Interpreter::new(lowered.kernel.clone())
            .map_err(|e| Fail(format!("`{}`: {e}", func.name), 1))?;
        interp.run(&batch, &kargs)
    } else {
        let jit =
            braid_jit::Jit::new().map_err(|e| Fail(format!("cannot start the JIT: {e}"), 1))?;
        let compiled = jit
            .compile(&lowered.kernel)
            .map_err(|e| Fail(format!("cannot compile `{}`: {e}", func.name), 1))?;
        compiled.run(&batch, &kargs)
    };
    let output = output.map_err(|e| Fail(format!("{samples_name}: {e}"), 1))?;
    match output {
        Output::PerSample(values) => {
            for (l, v) in lines.iter().zip(values) {
                println!("{}", serde_json::json!({ "line": l.number, "value": v }));
            }
        }
        Output::PerToken { values, offsets } => {
            for (j, l) in lines.iter().enumerate() {
                println!(
                    "{}",
                    serde_json::json!({ "line": l.number, "values": &values[offsets[j]..offsets[j + 1]] })
                );
            }
        }
    }
    Ok(())
}
