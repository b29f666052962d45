//! Running a kernel on a batch: the input and output types, their validation, and the driver
//! every backend runs through.
//!
//! A backend supplies only a [`SampleEval`] — how to evaluate one sample — and [`run_kernel`]
//! does the rest: it checks every input (errors, never panics, on malformed data), runs the
//! scope pre-pass of group and batch kernels, folds the scope reductions in one place (so both
//! backends get the very same statistics), and lays out the outputs. This module must not know
//! how a sample is evaluated.

use super::host::{Fields, RecordField};
use super::{Kernel, Op, ParamKind, ReduceOp, ResultKind, ScalarTy, Scope, Ty, fsem};
use std::collections::BTreeMap;

/// Ragged per-token data: sample `i`'s tokens are `values[offsets[i]..offsets[i + 1]]`;
/// `offsets` has `n_samples + 1` entries, starts at 0, never decreases and ends at
/// `values.len()`.
#[derive(Clone, Copy, Debug)]
pub struct Ragged<'a> {
    pub values: &'a [f64],
    pub offsets: &'a [usize],
}

/// One kernel argument, in parameter order.
#[derive(Clone, Copy, Debug)]
pub enum Arg<'a> {
    /// For a `PerToken` parameter.
    PerToken(Ragged<'a>),
    /// For a `PerSample` parameter: one value per sample.
    PerSample(&'a [f64]),
    /// For an `int` scalar parameter.
    Int(i64),
    /// For a `float` scalar parameter.
    Float(f64),
    /// For a `bool` scalar parameter.
    Bool(bool),
    /// For a `Sample` parameter: its fields come from the [`Batch`].
    Sample,
}

/// The strings of one sample, and the fields of its dataset record, read by host built-ins.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SampleText {
    pub prompt: String,
    pub completion: String,
    pub answer: String,
    /// The record's other fields; a kernel that reads one needs it in every sample.
    pub fields: Fields,
}

/// What a batch provides besides the arguments.
#[derive(Clone, Copy, Debug, Default)]
pub struct Batch<'a> {
    /// The number of samples.
    pub n_samples: usize,
    /// Each sample's token count (`.length`). Optional when a per-token argument gives them;
    /// when both are present they must agree.
    pub lengths: Option<&'a [usize]>,
    /// Each sample's group id (`.group`); needed by group kernels and `.group`.
    pub groups: Option<&'a [i64]>,
    /// Each sample's strings; needed by kernels with host calls.
    pub texts: Option<&'a [SampleText]>,
}

/// A kernel's output.
#[derive(Clone, Debug, PartialEq)]
pub enum Output {
    /// One value per sample.
    PerSample(Vec<f64>),
    /// Ragged per-token values laid out like the inputs.
    PerToken {
        values: Vec<f64>,
        offsets: Vec<usize>,
    },
}

impl Output {
    /// The flat values (per sample, or all tokens in order).
    pub fn values(&self) -> &[f64] {
        match self {
            Output::PerSample(v) | Output::PerToken { values: v, .. } => v,
        }
    }
}

/// Malformed input to a kernel run.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RunError {
    #[error("the kernel takes {expected} arguments, {got} were given")]
    ArgCount { expected: usize, got: usize },
    #[error("argument {index}: the parameter is {expected}, the argument is {got}")]
    ArgKind {
        index: usize,
        expected: String,
        got: String,
    },
    #[error("argument {index}: {message}")]
    BadRagged { index: usize, message: String },
    #[error("argument {index}: {got} per-sample values for {expected} samples")]
    PerSampleLen {
        index: usize,
        expected: usize,
        got: usize,
    },
    #[error("sample {sample}: argument {index} has {got} tokens, the sample has {expected}")]
    LengthMismatch {
        sample: usize,
        index: usize,
        expected: usize,
        got: usize,
    },
    #[error("batch.{field}: {got} entries for {expected} samples")]
    BatchLen {
        field: &'static str,
        expected: usize,
        got: usize,
    },
    #[error("the kernel needs batch.{0}, which was not given")]
    Missing(&'static str),
    #[error(
        "sample {sample}: the kernel reads record field `{name}` as {want} ({reader}), and the sample {found}"
    )]
    Field {
        sample: usize,
        name: String,
        want: &'static str,
        reader: &'static str,
        /// `has none`, `has a string`, …
        found: String,
    },
    #[error("the kernel is invalid: {0}")]
    Invalid(String),
    #[error("sample {sample}: a backend refused its buffers: {message}")]
    Backend { sample: usize, message: String },
}

/// A sample as a backend sees it.
#[derive(Debug)]
pub struct SampleCtx<'a> {
    /// The sample's index in the batch.
    pub index: usize,
    /// Its token count.
    pub len: usize,
    /// Its group id (`0` when the batch has none).
    pub group: i64,
    /// Per parameter: the sample's tokens for a per-token parameter, else empty.
    pub tokens: &'a [&'a [f64]],
    /// The arguments.
    pub args: &'a [Arg<'a>],
    /// Its strings, when the batch has them.
    pub text: Option<&'a SampleText>,
}

impl SampleCtx<'_> {
    /// The value of a non-`Sample`, non-per-token parameter for this sample, as the kernel sees
    /// it (an `Int` as `i64` bits, a `Bool` as 0/1, floats as bits).
    pub fn scalar_bits(&self, param: usize) -> u64 {
        match self.args.get(param) {
            Some(Arg::PerSample(v)) => v.get(self.index).copied().unwrap_or(0.0).to_bits(),
            Some(Arg::Int(i)) => *i as u64,
            Some(Arg::Float(f)) => f.to_bits(),
            Some(Arg::Bool(b)) => u64::from(*b),
            _ => 0,
        }
    }
}

/// How a backend evaluates one sample.
pub trait SampleEval {
    /// Scope pre-pass `level` (1, 2, …; see [`super::verify::scope_levels`]): evaluates what
    /// the values of lower levels need — `scope_vals[r]` holds the reductions of lower levels —
    /// and writes the argument of each scope reduction `r` of this level (in
    /// [`Kernel::scope_reductions`] order) into `outs[r]`: the sample's tokens
    /// (`outs[r].len() == s.len`) for a `Tokens` argument, else one value (an `Int` or `Bool`
    /// converted to float). `outs` of other levels are empty.
    fn prepass(
        &mut self,
        level: u32,
        s: &SampleCtx<'_>,
        scope_vals: &[f64],
        outs: &mut [&mut [f64]],
    ) -> Result<(), RunError>;

    /// Evaluates the kernel for this sample: `scope_vals[r]` is scope reduction `r` (a `Count`
    /// as a float); writes one value (per-sample kernels) or `s.len` values (per-token) to `out`.
    fn eval(
        &mut self,
        s: &SampleCtx<'_>,
        scope_vals: &[f64],
        out: &mut [f64],
    ) -> Result<(), RunError>;
}

/// Runs a kernel on a batch: the one public way to run, whatever the backend.
pub trait KernelExec {
    /// The kernel this runs.
    fn kernel(&self) -> &Kernel;
    /// Runs it on a batch.
    fn run(&self, batch: &Batch<'_>, args: &[Arg<'_>]) -> Result<Output, RunError>;
}

fn arg_kind_name(a: &Arg<'_>) -> &'static str {
    match a {
        Arg::PerToken(_) => "PerToken",
        Arg::PerSample(_) => "PerSample",
        Arg::Int(_) => "int",
        Arg::Float(_) => "float",
        Arg::Bool(_) => "bool",
        Arg::Sample => "Sample",
    }
}

fn param_kind_name(p: ParamKind) -> &'static str {
    match p {
        ParamKind::PerToken => "PerToken",
        ParamKind::PerSample => "PerSample",
        ParamKind::Scalar(ScalarTy::Int) => "int",
        ParamKind::Scalar(ScalarTy::Float) => "float",
        ParamKind::Scalar(ScalarTy::Bool) => "bool",
        ParamKind::Sample => "Sample",
    }
}

fn check_ragged(index: usize, r: &Ragged<'_>, n: usize) -> Result<(), RunError> {
    let bad = |message: String| RunError::BadRagged { index, message };
    if r.offsets.len() != n + 1 {
        return Err(bad(format!(
            "{} offsets for {n} samples (need n + 1)",
            r.offsets.len()
        )));
    }
    if r.offsets.first() != Some(&0) {
        return Err(bad("offsets must start at 0".into()));
    }
    if let Some(w) = r.offsets.windows(2).position(|w| w[1] < w[0]) {
        return Err(bad(format!("offsets decrease at sample {w}")));
    }
    if r.offsets.last() != Some(&r.values.len()) {
        return Err(bad(format!(
            "offsets end at {:?}, values have {} entries",
            r.offsets.last(),
            r.values.len()
        )));
    }
    Ok(())
}

/// What a kernel needs from the batch besides its arguments.
struct Needs {
    lengths: bool,
    groups: bool,
    texts: bool,
    fields: Vec<RecordField>,
}

fn needs(kernel: &Kernel) -> Needs {
    use super::IntField;
    let mut n = Needs {
        lengths: kernel.result_kind() == Some(ResultKind::PerToken),
        groups: kernel.scope == Scope::Group,
        texts: !kernel.host_calls.is_empty(),
        fields: kernel.record_fields(),
    };
    for inst in &kernel.insts {
        match inst.op {
            Op::Len
            | Op::Scan { .. }
            | Op::SampleInt {
                field: IntField::Length,
                ..
            } => n.lengths = true,
            Op::SampleInt {
                field: IntField::Group,
                ..
            } => n.groups = true,
            _ => {}
        }
    }
    n
}

/// Checks the inputs and runs `eval` over every sample (see the module doc).
/// `kernel` must have passed [`super::verify()`].
pub fn run_kernel(
    kernel: &Kernel,
    batch: &Batch<'_>,
    args: &[Arg<'_>],
    eval: &mut dyn SampleEval,
) -> Result<Output, RunError> {
    let n = batch.n_samples;
    if args.len() != kernel.params.len() {
        return Err(RunError::ArgCount {
            expected: kernel.params.len(),
            got: args.len(),
        });
    }
    let mut lengths: Option<Vec<usize>> = batch.lengths.map(<[usize]>::to_vec);
    if let Some(l) = &lengths
        && l.len() != n
    {
        return Err(RunError::BatchLen {
            field: "lengths",
            expected: n,
            got: l.len(),
        });
    }
    for (index, (p, a)) in kernel.params.iter().zip(args).enumerate() {
        let ok = matches!(
            (p, a),
            (ParamKind::PerToken, Arg::PerToken(_))
                | (ParamKind::PerSample, Arg::PerSample(_))
                | (ParamKind::Scalar(ScalarTy::Int), Arg::Int(_))
                | (ParamKind::Scalar(ScalarTy::Float), Arg::Float(_))
                | (ParamKind::Scalar(ScalarTy::Bool), Arg::Bool(_))
                | (ParamKind::Sample, Arg::Sample)
        );
        if !ok {
            return Err(RunError::ArgKind {
                index,
                expected: param_kind_name(*p).into(),
                got: arg_kind_name(a).into(),
            });
        }
        match a {
            Arg::PerToken(r) => {
                check_ragged(index, r, n)?;
                let got: Vec<usize> = r.offsets.windows(2).map(|w| w[1] - w[0]).collect();
                match &lengths {
                    None => lengths = Some(got),
                    Some(expected) => {
                        if let Some(sample) = (0..n).find(|&i| expected[i] != got[i]) {
                            return Err(RunError::LengthMismatch {
                                sample,
                                index,
                                expected: expected[sample],
                                got: got[sample],
                            });
                        }
                    }
                }
            }
            Arg::PerSample(v) if v.len() != n => {
                return Err(RunError::PerSampleLen {
                    index,
                    expected: n,
                    got: v.len(),
                });
            }
            _ => {}
        }
    }
    let need = needs(kernel);
    let lengths = match lengths {
        Some(l) => l,
        None if need.lengths => return Err(RunError::Missing("lengths")),
        None => vec![0; n],
    };
    if let Some(g) = batch.groups
        && g.len() != n
    {
        return Err(RunError::BatchLen {
            field: "groups",
            expected: n,
            got: g.len(),
        });
    }
    if need.groups && batch.groups.is_none() {
        return Err(RunError::Missing("groups"));
    }
    if let Some(t) = batch.texts
        && t.len() != n
    {
        return Err(RunError::BatchLen {
            field: "texts",
            expected: n,
            got: t.len(),
        });
    }
    if need.texts && batch.texts.is_none() {
        return Err(RunError::Missing("texts"));
    }
    // Every record field the kernel reads, in every sample, with a type its reader accepts:
    // checked here, once, so that host calls (which cannot fail) never meet a missing one.
    if let Some(texts) = batch.texts {
        for (sample, t) in texts.iter().enumerate() {
            for f in &need.fields {
                let v = t.fields.get(&f.name);
                if !v.is_some_and(|v| f.ty.accepts(v)) {
                    return Err(RunError::Field {
                        sample,
                        name: f.name.clone(),
                        want: f.ty.describe(),
                        reader: f.ty.reader(),
                        found: v.map_or("has none".into(), |v| format!("has {}", v.describe())),
                    });
                }
            }
        }
    }
    let kind = kernel
        .result_kind()
        .ok_or_else(|| RunError::Invalid("no result".into()))?;

    let mut offsets = Vec::with_capacity(n + 1);
    offsets.push(0usize);
    for l in &lengths {
        let last = offsets.last().copied().unwrap_or(0);
        offsets.push(last + l);
    }
    let total = offsets.last().copied().unwrap_or(0);

    // Per-sample views of the arguments, rebuilt for each sample.
    let mut tokens: Vec<&[f64]> = vec![&[]; args.len()];
    let ctx = |i: usize| -> (usize, i64, Option<&SampleText>) {
        (
            lengths[i],
            batch.groups.map_or(0, |g| g[i]),
            batch.texts.map(|t| &t[i]),
        )
    };

    // The scope pre-passes and the folds of scope reductions: pass `L` evaluates what the
    // reductions of level `L` reduce (with the values of lower levels known) and folds them.
    let reductions = kernel.scope_reductions();
    let nr = reductions.len();
    let mut scope_vals = vec![0.0f64; n * nr];
    if nr > 0 {
        let levels = super::verify::scope_levels(kernel);
        let red: Vec<(ReduceOp, bool, u32)> = reductions
            .iter()
            .map(|v| match kernel.insts[v.index()].op {
                Op::ScopeReduce(op, arg) => {
                    (op, kernel.ty(arg) == Some(Ty::Tokens), levels[v.index()])
                }
                _ => (ReduceOp::Sum, false, 0),
            })
            .collect();
        // The samples of each scope, in ascending order.
        let scopes: Vec<Vec<usize>> = match kernel.scope {
            Scope::Group => {
                let mut by_group: BTreeMap<i64, Vec<usize>> = BTreeMap::new();
                let groups = batch.groups.unwrap_or(&[]);
                for (i, g) in groups.iter().enumerate() {
                    by_group.entry(*g).or_default().push(i);
                }
                by_group.into_values().collect()
            }
            Scope::Batch | Scope::Sample => vec![(0..n).collect()],
        };
        let max_level = red.iter().map(|r| r.2).max().unwrap_or(0);
        for level in 1..=max_level {
            // Only this level's reductions get buffers; the others get empty slices.
            let mut store: Vec<Vec<f64>> = red
                .iter()
                .map(|&(_, tok, l)| match (l == level, tok) {
                    (false, _) => Vec::new(),
                    (true, true) => vec![0.0; total],
                    (true, false) => vec![0.0; n],
                })
                .collect();
            for i in 0..n {
                fill(&mut tokens, args, i);
                let (len, group, text) = ctx(i);
                let s = SampleCtx {
                    index: i,
                    len,
                    group,
                    tokens: &tokens,
                    args,
                    text,
                };
                let mut outs: Vec<&mut [f64]> = store
                    .iter_mut()
                    .zip(&red)
                    .map(|(v, &(_, tok, l))| match (l == level, tok) {
                        (false, _) => &mut v[..],
                        (true, true) => &mut v[offsets[i]..offsets[i + 1]],
                        (true, false) => &mut v[i..i + 1],
                    })
                    .collect();
                eval.prepass(level, &s, &scope_vals[i * nr..(i + 1) * nr], &mut outs)?;
            }
            for (r, (&(op, tok, l), vals)) in red.iter().zip(&store).enumerate() {
                if l != level {
                    continue;
                }
                for members in &scopes {
                    let offsets = &offsets;
                    let elems = || {
                        members.iter().flat_map(move |&i| {
                            let range = if tok {
                                offsets[i]..offsets[i + 1]
                            } else {
                                i..i + 1
                            };
                            vals[range].iter().copied()
                        })
                    };
                    let x = reduce(op, elems);
                    for &i in members {
                        scope_vals[i * nr + r] = x;
                    }
                }
            }
        }
    }

    let mut out = vec![
        0.0f64;
        if kind == ResultKind::PerToken {
            total
        } else {
            n
        }
    ];
    for i in 0..n {
        fill(&mut tokens, args, i);
        let (len, group, text) = ctx(i);
        let s = SampleCtx {
            index: i,
            len,
            group,
            tokens: &tokens,
            args,
            text,
        };
        let range = if kind == ResultKind::PerToken {
            offsets[i]..offsets[i + 1]
        } else {
            i..i + 1
        };
        eval.eval(&s, &scope_vals[i * nr..(i + 1) * nr], &mut out[range])?;
    }
    Ok(match kind {
        ResultKind::PerSample => Output::PerSample(out),
        ResultKind::PerToken => Output::PerToken {
            values: out,
            offsets,
        },
    })
}

/// Points `tokens[p]` at sample `i`'s slice of each per-token argument (offsets checked).
fn fill<'a>(tokens: &mut [&'a [f64]], args: &[Arg<'a>], i: usize) {
    for (slot, a) in tokens.iter_mut().zip(args) {
        if let Arg::PerToken(r) = a {
            *slot = &r.values[r.offsets[i]..r.offsets[i + 1]];
        }
    }
}

/// A reduction over the values `elems()` yields, in order (see [`ReduceOp`] for each formula).
/// `elems` is called twice by `Std` (mean first, then the squared deviations). `Count` is
/// returned as a float.
pub fn reduce<I: Iterator<Item = f64>>(op: ReduceOp, elems: impl Fn() -> I) -> f64 {
    match op {
        ReduceOp::Sum => elems().fold(0.0, |a, x| a + x),
        ReduceOp::Mean => mean(elems()),
        ReduceOp::Max => elems().fold(f64::NEG_INFINITY, fsem::max),
        ReduceOp::Min => elems().fold(f64::INFINITY, fsem::min),
        ReduceOp::Count => elems().fold(0i64, |c, x| c + i64::from(x != 0.0)) as f64,
        ReduceOp::Std => {
            let m = mean(elems());
            let (s, n) = elems().fold((0.0, 0i64), |(s, n), x| (s + (x - m) * (x - m), n + 1));
            if n == 0 { 0.0 } else { (s / n as f64).sqrt() }
        }
    }
}

fn mean(elems: impl Iterator<Item = f64>) -> f64 {
    let (s, n) = elems.fold((0.0, 0i64), |(s, n), x| (s + x, n + 1));
    if n == 0 { 0.0 } else { s / n as f64 }
}
