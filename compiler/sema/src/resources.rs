//! Models, datasets and the cluster: their sources and options, checked against the tables in
//! `braid-stdlib`.

use std::collections::BTreeMap;

use braid_diagnostics::{Code, Diagnostic, Span};
use braid_stdlib::OptionSpec;
use braid_syntax::ast;

use crate::check::{Checker, unknown_argument};
use crate::hir::*;
use crate::items::closest;

fn err(code: Code, msg: impl Into<String>, span: Span, label: impl Into<String>) -> Diagnostic {
    Diagnostic::new(code, msg, span, label)
}

/// The options of a block by key, after reporting unknown and repeated keys.
pub(crate) struct OptionMap<'o> {
    pub entries: BTreeMap<&'static str, &'o ast::OptionEntry>,
}

impl Checker<'_> {
    pub(crate) fn option_map<'o>(
        &mut self,
        what: &str,
        opts: Option<&'o ast::Options>,
        specs: &[OptionSpec],
    ) -> OptionMap<'o> {
        let mut entries: BTreeMap<&'static str, &'o ast::OptionEntry> = BTreeMap::new();
        let Some(opts) = opts else {
            return OptionMap { entries };
        };
        for e in &opts.entries {
            match specs.iter().find(|s| s.key == e.key.name) {
                None => {
                    let keys: Vec<&str> = specs.iter().map(|s| s.key).collect();
                    let suggestion = closest(&e.key.name, &keys);
                    let help = match &suggestion {
                        Some(s) => {
                            format!("did you mean `{s}`? {what} accepts {}", keys.join(", "))
                        }
                        None => format!("{what} accepts {}", keys.join(", ")),
                    };
                    self.report(
                        err(
                            Code::E0207,
                            format!("{what} has no option `{}`", e.key.name),
                            e.key.span,
                            "unknown option",
                        )
                        .with_help(help)
                        .with_suggestion(e.key.span, suggestion.as_deref()),
                    );
                }
                Some(spec) => {
                    if let Some(prev) = entries.get(spec.key) {
                        self.report(
                            err(
                                Code::E0209,
                                format!("option `{}` is given twice", spec.key),
                                e.key.span,
                                "given again",
                            )
                            .with_label(prev.key.span, "first given here")
                            .with_help("give each option once"),
                        );
                        continue;
                    }
                    entries.insert(spec.key, e);
                }
            }
        }
        OptionMap { entries }
    }

    /// The constant value of an option, reporting a non-constant or wrongly typed one.
    pub(crate) fn option_value(&mut self, e: &ast::OptionEntry, want: &SigTy) -> Option<Value> {
        let x = match &e.value {
            ast::OptionValue::Flag => {
                return if *want == SigTy::Bool {
                    Some(Value::Bool(true))
                } else {
                    self.bad_option(e, want)
                };
            }
            ast::OptionValue::Record(r) => {
                self.report(
                    err(
                        Code::E0308,
                        format!("`{}` takes a {want}, not a record", e.key.name),
                        r.span,
                        "record here",
                    )
                    .with_help(format!("write `{}: <{want}>`", e.key.name)),
                );
                return None;
            }
            ast::OptionValue::Expr(x) => x,
        };
        match self.const_eval(x, &BTreeMap::new()) {
            Err(span) => {
                self.report(
                    err(
                        Code::E0412,
                        format!("option `{}` must be a constant", e.key.name),
                        span,
                        "not a constant",
                    )
                    .with_help("write a literal such as `3e-4`, `true` or \"text\""),
                );
                None
            }
            Ok(v) => {
                let ok = matches!(
                    (want, &v),
                    (SigTy::Int, Value::Int(_))
                        | (SigTy::Float, Value::Int(_) | Value::Float(_))
                        | (SigTy::Bool, Value::Bool(_))
                        | (SigTy::Str, Value::Str(_))
                );
                if ok {
                    Some(match (want, v) {
                        (SigTy::Float, Value::Int(i)) => Value::Float(i as f64),
                        (_, v) => v,
                    })
                } else {
                    self.bad_option(e, want)
                }
            }
        }
    }

    fn bad_option(&mut self, e: &ast::OptionEntry, want: &SigTy) -> Option<Value> {
        self.report(
            err(
                Code::E0308,
                format!("option `{}` takes a {want}", e.key.name),
                e.span,
                format!("expected {want}"),
            )
            .with_help(format!("write `{}: <{want}>`", e.key.name)),
        );
        None
    }

    /// An enumerated option written bare (`dtype: bf16`) or as a string.
    fn enum_option(&mut self, e: &ast::OptionEntry, values: &[&str]) -> Option<String> {
        let text = match &e.value {
            ast::OptionValue::Expr(ast::Expr {
                kind: ast::ExprKind::Path(p),
                ..
            }) => p.as_single().map(|i| i.name.clone()),
            ast::OptionValue::Expr(ast::Expr {
                kind: ast::ExprKind::Str(s),
                ..
            }) => Some(s.value.clone()),
            _ => None,
        };
        match text {
            Some(t) if values.contains(&t.as_str()) => Some(t),
            _ => {
                let help = match text.as_deref().and_then(|t| closest(t, values)) {
                    Some(s) => format!(
                        "did you mean `{s}`? `{}` is one of {}",
                        e.key.name,
                        values.join(", ")
                    ),
                    None => format!("`{}` is one of {}", e.key.name, values.join(", ")),
                };
                self.report(
                    err(
                        Code::E0308,
                        format!(
                            "`{}` cannot be `{}`",
                            e.key.name,
                            text.unwrap_or_else(|| "that".into())
                        ),
                        e.span,
                        "not an accepted value",
                    )
                    .with_help(help),
                );
                None
            }
        }
    }

    pub(crate) fn range(&mut self, e: &ast::OptionEntry, v: f64, ok: bool, rule: &str) {
        if !ok {
            self.report(
                err(
                    Code::E0411,
                    format!("`{}` is {v}, but it must be {rule}", e.key.name),
                    e.span,
                    format!("must be {rule}"),
                )
                .with_help(format!("choose a value {rule}")),
            );
        }
    }

    pub(crate) fn model(&mut self, mi: usize, d: &ast::ModelDecl, index: usize) {
        let src = d.source.path.text();
        let source = match src.as_str() {
            "tiny" => self.tiny(&d.source).map(ModelSource::Tiny),
            "hf" => self
                .string_arg(&d.source, "hf", "dir")
                .map(|dir| ModelSource::Hf { dir }),
            "frozen" => {
                let target = d
                    .source
                    .args
                    .positional
                    .first()
                    .and_then(|a| match &a.kind {
                        ast::ExprKind::Path(p) => p.as_single().cloned(),
                        _ => None,
                    });
                match target {
                    Some(id) if d.source.args.positional.len() == 1 => {
                        match self.scopes[mi].get(&id.name).copied() {
                            Some(g) => match g.def {
                                Def::Model(m) => {
                                    self.program.references.push(Reference {
                                        span: id.span,
                                        def: g.def,
                                        def_span: g.span,
                                    });
                                    Some(ModelSource::Frozen(m))
                                }
                                _ => {
                                    self.report(
                                        err(
                                            Code::E0301,
                                            format!(
                                                "`frozen` copies a model; `{}` is not one",
                                                id.name
                                            ),
                                            id.span,
                                            "not a model",
                                        )
                                        .with_label(g.span, "declared here")
                                        .with_help("pass a declared model: `frozen(policy)`"),
                                    );
                                    None
                                }
                            },
                            None => {
                                self.report(
                                    err(
                                        Code::E0201,
                                        format!("unknown model `{}`", id.name),
                                        id.span,
                                        "not defined",
                                    )
                                    .with_help("declare the model first with `model NAME = …`"),
                                );
                                None
                            }
                        }
                    }
                    _ => {
                        self.report(
                            err(
                                Code::E0302,
                                "`frozen` takes one model",
                                d.source.span,
                                "expected `frozen(model)`",
                            )
                            .with_help("copy one declared model: `model ref = frozen(policy)`"),
                        );
                        None
                    }
                }
            }
            other => {
                let names: Vec<&str> = braid_stdlib::MODEL_SOURCES.iter().map(|b| b.name).collect();
                let suggestion = closest(other, &names);
                let help = match &suggestion {
                    Some(s) => {
                        format!("did you mean `{s}`? Model sources are {}", names.join(", "))
                    }
                    None => format!("model sources are {}", names.join(", ")),
                };
                self.report(
                    err(
                        Code::E0210,
                        format!("unknown model source `{other}`"),
                        d.source.path.span,
                        "unknown source",
                    )
                    .with_help(help)
                    .with_suggestion(d.source.path.span, suggestion.as_deref()),
                );
                None
            }
        };
        let opts = self.option_map("a model", d.options.as_ref(), braid_stdlib::MODEL_OPTIONS);
        let mut model = self.program.models[index].clone();
        if let Some(s) = source {
            model.source = s;
        }
        if let Some(e) = opts.entries.get("dtype") {
            model.dtype = self
                .enum_option(e, &["f32", "bf16", "f16"])
                .map(|t| match t.as_str() {
                    "bf16" => Dtype::Bf16,
                    "f16" => Dtype::F16,
                    _ => Dtype::F32,
                });
        }
        if let Some(e) = opts.entries.get("head")
            && let Some(h) = self.enum_option(e, &["lm", "value", "score"])
        {
            model.head = match h.as_str() {
                "value" => Head::Value,
                "score" => Head::Score,
                _ => Head::Lm,
            };
        }
        if let Some(e) = opts.entries.get("grad_clip")
            && let Some(v) = self.option_value(e, &SigTy::Float).and_then(|v| v.as_f64())
        {
            self.range(e, v, v > 0.0, "> 0");
            model.grad_clip = Some(v);
        }
        if let Some(e) = opts.entries.get("max_len")
            && let Some(v) = self.option_value(e, &SigTy::Int).and_then(|v| v.as_i64())
        {
            self.range(e, v as f64, v > 0, "> 0");
            model.max_len = Some(v);
        }
        if let Some(e) = opts.entries.get("train") {
            model.train = self.adamw(e);
        }
        if let Some(e) = opts.entries.get("gradient_checkpointing")
            && let Some(Value::Bool(b)) = self.option_value(e, &SigTy::Bool)
        {
            model.gradient_checkpointing = b;
            // Recomputation saves memory in the backward pass only; a model without an
            // optimizer has none, and the option would silently do nothing.
            if b && model.train.is_none() && !opts.entries.contains_key("train") {
                self.report(
                    err(
                        Code::E0416,
                        format!(
                            "`gradient_checkpointing` only changes how `{}` is trained, and it declares no `train:`",
                            d.name.name
                        ),
                        e.span,
                        "set on a model that is not trained",
                    )
                    .with_help(
                        "remove `gradient_checkpointing`, or make the model trainable with `train: adamw(lr: …)`",
                    ),
                );
                model.gradient_checkpointing = false;
            }
        }
        if model.train.is_some()
            && let ModelSource::Frozen(_) = model.source
        {
            let e = opts.entries.get("train").map_or(d.span, |e| e.span);
            self.report(
                err(
                    Code::E0401,
                    format!(
                        "`{}` is a frozen copy and cannot declare `train:`",
                        d.name.name
                    ),
                    e,
                    "`train:` here",
                )
                .with_help("train the original model; a frozen copy is a fixed reference"),
            );
            model.train = None;
        }
        self.program.models[index] = model;
    }

    fn adamw(&mut self, e: &ast::OptionEntry) -> Option<AdamW> {
        let ast::OptionValue::Expr(x) = &e.value else {
            self.report(
                err(
                    Code::E0308,
                    "`train` takes an optimizer",
                    e.span,
                    "expected `adamw(…)`",
                )
                .with_help("write `train: adamw(lr: 3e-4)`"),
            );
            return None;
        };
        let ast::ExprKind::Call { callee, args } = &x.kind else {
            self.report(
                err(
                    Code::E0308,
                    "`train` takes an optimizer",
                    x.span,
                    "expected `adamw(…)`",
                )
                .with_help("write `train: adamw(lr: 3e-4)`"),
            );
            return None;
        };
        let name = match &callee.kind {
            ast::ExprKind::Path(p) => p.text(),
            _ => String::new(),
        };
        if name != "adamw" {
            self.report(
                err(Code::E0308, format!("unknown optimizer `{name}`"), callee.span, "unknown optimizer")
                    .with_help("the optimizer is `adamw(lr: …, weight_decay: …, eps: …, beta1: …, beta2: …, warmup: …, schedule: …)`"),
            );
            return None;
        }
        if let Some(p) = args.positional.first() {
            self.report(
                err(
                    Code::E0106,
                    "`adamw` takes named arguments only",
                    p.span,
                    "positional argument",
                )
                .with_help("name it: `adamw(lr: 3e-4)`"),
            );
        }
        let mut opt = AdamW {
            lr: f64::NAN,
            weight_decay: 0.0,
            eps: 1e-8,
            beta1: 0.9,
            beta2: 0.999,
            warmup: 0,
            schedule: LrSchedule::Constant,
        };
        let mut seen: BTreeMap<String, Span> = BTreeMap::new();
        for n in &args.named {
            if let Some(prev) = seen.insert(n.name.name.clone(), n.span) {
                self.report(
                    err(
                        Code::E0209,
                        format!("argument `{}` is given twice", n.name.name),
                        n.span,
                        "given again",
                    )
                    .with_label(prev, "first given here")
                    .with_help("give each argument once"),
                );
                continue;
            }
            let entry = ast::OptionEntry {
                key: n.name.clone(),
                value: ast::OptionValue::Expr(n.value.clone()),
                span: n.span,
            };
            match n.name.name.as_str() {
                "lr" | "weight_decay" | "eps" | "beta1" | "beta2" => {
                    let Some(v) = self
                        .option_value(&entry, &SigTy::Float)
                        .and_then(|v| v.as_f64())
                    else {
                        continue;
                    };
                    match n.name.name.as_str() {
                        "lr" => {
                            self.range(&entry, v, v > 0.0, "> 0");
                            opt.lr = v;
                        }
                        "weight_decay" => {
                            self.range(&entry, v, v >= 0.0, ">= 0");
                            opt.weight_decay = v;
                        }
                        "eps" => {
                            self.range(&entry, v, v > 0.0, "> 0");
                            opt.eps = v;
                        }
                        "beta1" => {
                            self.range(&entry, v, (0.0..1.0).contains(&v), "in [0, 1)");
                            opt.beta1 = v;
                        }
                        _ => {
                            self.range(&entry, v, (0.0..1.0).contains(&v), "in [0, 1)");
                            opt.beta2 = v;
                        }
                    }
                }
                "warmup" => {
                    if let Some(v) = self
                        .option_value(&entry, &SigTy::Int)
                        .and_then(|v| v.as_i64())
                    {
                        self.range(&entry, v as f64, v >= 0, ">= 0");
                        opt.warmup = v;
                    }
                }
                "schedule" => {
                    if let Some(s) = self.enum_option(&entry, &["constant", "cosine", "linear"]) {
                        opt.schedule = match s.as_str() {
                            "cosine" => LrSchedule::Cosine,
                            "linear" => LrSchedule::Linear,
                            _ => LrSchedule::Constant,
                        };
                    }
                }
                _ => {
                    let names = [
                        "lr",
                        "weight_decay",
                        "eps",
                        "beta1",
                        "beta2",
                        "warmup",
                        "schedule",
                    ];
                    self.report(unknown_argument("`adamw`", &n.name, &names));
                }
            }
        }
        if opt.lr.is_nan() {
            if !seen.contains_key("lr") {
                self.report(
                    err(
                        Code::E0302,
                        "`adamw` is missing argument `lr`",
                        x.span,
                        "`lr` missing",
                    )
                    .with_help("set the learning rate: `adamw(lr: 3e-4)`"),
                );
            }
            return None;
        }
        Some(opt)
    }

    fn tiny(&mut self, s: &ast::Source) -> Option<TinyConfig> {
        let names = [
            "vocab",
            "layers",
            "hidden",
            "heads",
            "kv_heads",
            "intermediate",
            "max_len",
            "seed",
        ];
        let mut vals: BTreeMap<&str, (i64, Span)> = BTreeMap::new();
        if let Some(p) = s.args.positional.first() {
            self.report(
                err(
                    Code::E0106,
                    "`tiny` takes named arguments only",
                    p.span,
                    "positional argument",
                )
                .with_help("name it: `tiny(layers: 2, hidden: 64)`"),
            );
        }
        let mut ok = true;
        for n in &s.args.named {
            let Some(key) = names.iter().copied().find(|k| *k == n.name.name) else {
                self.report(unknown_argument("`tiny`", &n.name, &names));
                ok = false;
                continue;
            };
            let entry = ast::OptionEntry {
                key: n.name.clone(),
                value: ast::OptionValue::Expr(n.value.clone()),
                span: n.span,
            };
            if key == "vocab" {
                match self.option_value(&entry, &SigTy::Str) {
                    Some(Value::Str(v)) if v == "bytes" => {}
                    Some(_) => {
                        self.report(
                            err(Code::E0308, "a tiny model's vocabulary can only be \"bytes\"", n.value.span, "not \"bytes\"")
                                .with_help("write `vocab: \"bytes\"` (256 byte tokens plus specials), or use `hf(\"dir\")` for a real tokenizer"),
                        );
                        ok = false;
                    }
                    None => ok = false,
                }
                continue;
            }
            match self
                .option_value(&entry, &SigTy::Int)
                .and_then(|v| v.as_i64())
            {
                Some(v) => {
                    let min = if key == "seed" { 0 } else { 1 };
                    if v < min {
                        self.range(
                            &entry,
                            v as f64,
                            false,
                            if min == 0 { ">= 0" } else { "> 0" },
                        );
                        ok = false;
                    }
                    vals.insert(key, (v, n.span));
                }
                None => ok = false,
            }
        }
        let get = |k: &str, d: i64| vals.get(k).map_or(d, |x| x.0);
        let hidden = get("hidden", 64);
        let heads = get("heads", 4);
        let kv_heads = get("kv_heads", heads);
        let cfg = TinyConfig {
            layers: get("layers", 2),
            hidden,
            heads,
            kv_heads,
            intermediate: get("intermediate", 4 * hidden),
            max_len: get("max_len", 512),
            seed: get("seed", 0),
        };
        if ok && heads > 0 && hidden % heads != 0 {
            let span = vals
                .get("heads")
                .or(vals.get("hidden"))
                .map_or(s.span, |x| x.1);
            self.report(
                err(
                    Code::E0411,
                    format!("`hidden` ({hidden}) must be a multiple of `heads` ({heads})"),
                    span,
                    "does not divide",
                )
                .with_help(
                    "each head gets hidden / heads dimensions: pick heads that divide hidden",
                ),
            );
            ok = false;
        }
        if ok && kv_heads > 0 && heads % kv_heads != 0 {
            let span = vals.get("kv_heads").map_or(s.span, |x| x.1);
            self.report(
                err(Code::E0411, format!("`heads` ({heads}) must be a multiple of `kv_heads` ({kv_heads})"), span, "does not divide")
                    .with_help("grouped-query attention shares each key/value head among heads / kv_heads query heads"),
            );
            ok = false;
        }
        ok.then_some(cfg)
    }

    /// The single string argument of a source such as `hf("dir")` or `jsonl("file")`.
    fn string_arg(&mut self, s: &ast::Source, what: &str, param: &str) -> Option<String> {
        let arg = s.args.positional.first().or_else(|| {
            s.args
                .named
                .iter()
                .find(|n| n.name.name == param)
                .map(|n| &n.value)
        });
        match arg.map(|a| &a.kind) {
            Some(ast::ExprKind::Str(lit)) if s.args.positional.len() + s.args.named.len() == 1 => {
                Some(lit.value.clone())
            }
            _ => {
                self.report(
                    err(
                        Code::E0301,
                        format!("`{what}` takes one string: the {param}"),
                        s.span,
                        "expected a string",
                    )
                    .with_help(format!("write `{what}(\"path\")`, relative to this file")),
                );
                None
            }
        }
    }

    pub(crate) fn dataset(&mut self, _mi: usize, d: &ast::DatasetDecl, index: usize) {
        let src = d.source.path.text();
        let mut ds = self.program.datasets[index].clone();
        match src.as_str() {
            "jsonl" => {
                if let Some(path) = self.string_arg(&d.source, "jsonl", "path") {
                    ds.source = DatasetSource::Jsonl { path };
                }
            }
            "parquet" => {
                if let Some(path) = self.string_arg(&d.source, "parquet", "path") {
                    ds.source = DatasetSource::Parquet { path };
                }
            }
            "synthetic::letters" | "synthetic::arithmetic" | "synthetic::word_problems" => {
                let kind = match src.as_str() {
                    "synthetic::letters" => SyntheticKind::Letters,
                    "synthetic::arithmetic" => SyntheticKind::Arithmetic,
                    _ => SyntheticKind::WordProblems,
                };
                let allowed: &[&str] = match kind {
                    SyntheticKind::Arithmetic => &["count", "seed", "digits", "split"],
                    _ => &["count", "seed", "split"],
                };
                let mut split = Split::All;
                let mut vals: BTreeMap<String, i64> = BTreeMap::new();
                if let Some(p) = d.source.args.positional.first() {
                    self.report(
                        err(
                            Code::E0106,
                            format!("`{src}` takes named arguments only"),
                            p.span,
                            "positional argument",
                        )
                        .with_help("name it: `count: 512`"),
                    );
                }
                for n in &d.source.args.named {
                    if !allowed.contains(&n.name.name.as_str()) {
                        self.report(unknown_argument(&format!("`{src}`"), &n.name, allowed));
                        continue;
                    }
                    let entry = ast::OptionEntry {
                        key: n.name.clone(),
                        value: ast::OptionValue::Expr(n.value.clone()),
                        span: n.span,
                    };
                    if n.name.name == "split" {
                        if let Some(Value::Str(s)) = self.option_value(&entry, &SigTy::Str) {
                            match Split::parse(&s) {
                                Some(v) => split = v,
                                None => self.report(
                                    err(
                                        Code::E0308,
                                        format!("`split` is \"all\", \"train\" or \"held_out\", not \"{s}\""),
                                        n.value.span,
                                        "unknown split",
                                    )
                                    .with_help("train on `split: \"train\"` and evaluate on `split: \"held_out\"` of the same generator"),
                                ),
                            }
                        }
                        continue;
                    }
                    if let Some(v) = self
                        .option_value(&entry, &SigTy::Int)
                        .and_then(|v| v.as_i64())
                    {
                        let min = if n.name.name == "seed" { 0 } else { 1 };
                        self.range(
                            &entry,
                            v as f64,
                            v >= min,
                            if min == 0 { ">= 0" } else { "> 0" },
                        );
                        vals.insert(n.name.name.clone(), v);
                    }
                }
                ds.source = DatasetSource::Synthetic {
                    kind,
                    count: vals.get("count").copied().unwrap_or(256),
                    seed: vals.get("seed").copied().unwrap_or(0),
                    digits: vals.get("digits").copied().unwrap_or(2),
                    split,
                };
            }
            other => {
                let names: Vec<&str> = braid_stdlib::DATASET_SOURCES
                    .iter()
                    .map(|b| b.name)
                    .collect();
                let suggestion = closest(other, &names);
                let help = match &suggestion {
                    Some(s) => format!(
                        "did you mean `{s}`? Dataset sources are {}",
                        names.join(", ")
                    ),
                    None => format!("dataset sources are {}", names.join(", ")),
                };
                self.report(
                    err(
                        Code::E0210,
                        format!("unknown dataset source `{other}`"),
                        d.source.path.span,
                        "unknown source",
                    )
                    .with_help(help)
                    .with_suggestion(d.source.path.span, suggestion.as_deref()),
                );
            }
        }
        let opts = self.option_map(
            "a dataset",
            d.options.as_ref(),
            braid_stdlib::DATASET_OPTIONS,
        );
        if let Some(e) = opts.entries.get("fields") {
            match &e.value {
                ast::OptionValue::Record(r) => {
                    let fields = self.option_map("`fields`", Some(r), braid_stdlib::FIELD_OPTIONS);
                    if let Some(f) = fields.entries.get("prompt")
                        && let Some(Value::Str(s)) = self.option_value(f, &SigTy::Str)
                    {
                        ds.prompt_field = s;
                    }
                    if let Some(f) = fields.entries.get("answer")
                        && let Some(Value::Str(s)) = self.option_value(f, &SigTy::Str)
                    {
                        ds.answer_field = s;
                    }
                    if let Some(f) = fields.entries.get("messages")
                        && let Some(Value::Str(s)) = self.option_value(f, &SigTy::Str)
                    {
                        ds.messages_field = s;
                    }
                    ds.prompt_from = match (
                        fields.entries.get("prompt"),
                        fields.entries.get("messages"),
                    ) {
                        (Some(p), Some(m)) => {
                            self.report(
                                err(
                                    Code::E0308,
                                    "`fields` names both a prompt field and a messages field",
                                    m.span,
                                    "a second source of prompts",
                                )
                                .with_label(p.span, "the prompt field")
                                .with_help("a record's prompt is either a text (`prompt: \"…\"`) or a conversation (`messages: \"…\"`); keep the one the data holds"),
                            );
                            PromptFrom::Either
                        }
                        (Some(_), None) => PromptFrom::Text,
                        (None, Some(_)) => PromptFrom::Messages,
                        (None, None) => PromptFrom::Either,
                    };
                }
                _ => self.report(
                    err(
                        Code::E0308,
                        "`fields` takes a record",
                        e.span,
                        "expected `{ prompt: \"…\", answer: \"…\" }`",
                    )
                    .with_help(
                        "map record fields: `fields: { prompt: \"question\", answer: \"answer\" }`",
                    ),
                ),
            }
        }
        if let Some(e) = opts.entries.get("shuffle")
            && let Some(Value::Bool(b)) = self.option_value(e, &SigTy::Bool)
        {
            ds.shuffle = b;
        }
        if let Some(e) = opts.entries.get("chat_template")
            && let Some(Value::Bool(b)) = self.option_value(e, &SigTy::Bool)
        {
            ds.chat_template = b;
        }
        if let Some(e) = opts.entries.get("seed")
            && let Some(v) = self.option_value(e, &SigTy::Int).and_then(|v| v.as_i64())
        {
            self.range(e, v as f64, v >= 0, ">= 0");
            ds.seed = v;
        }
        if let Some(e) = opts.entries.get("epochs")
            && let Some(v) = self.option_value(e, &SigTy::Int).and_then(|v| v.as_i64())
        {
            self.range(e, v as f64, v > 0, "> 0");
            ds.epochs = Some(v);
        }
        self.program.datasets[index] = ds;
    }

    pub(crate) fn cluster(&mut self, c: &ast::Cluster) -> Option<Cluster> {
        let opts = self.option_map("`cluster`", Some(&c.options), braid_stdlib::CLUSTER_OPTIONS);
        let mut cpu = false;
        if let Some(e) = opts.entries.get("cpu") {
            cpu = matches!(self.option_value(e, &SigTy::Bool), Some(Value::Bool(true)));
        }
        let cpus = opts.entries.get("cpus").and_then(|e| {
            let v = self.option_value(e, &SigTy::Int).and_then(|v| v.as_i64())?;
            self.range(e, v as f64, v > 0, "> 0");
            Some((v.max(1), e.span))
        });
        let gpus = opts.entries.get("gpus").and_then(|e| {
            let v = self.option_value(e, &SigTy::Int).and_then(|v| v.as_i64())?;
            self.range(e, v as f64, v > 0, "> 0");
            Some((v, e.span))
        });
        let nodes = opts.entries.get("nodes").and_then(|e| {
            let v = self.option_value(e, &SigTy::Int).and_then(|v| v.as_i64())?;
            self.range(e, v as f64, v > 0, "> 0");
            Some((v, e.span))
        });
        let gpu = opts.entries.get("gpu").and_then(|e| {
            let Some(Value::Str(s)) = self.option_value(e, &SigTy::Str) else {
                return None;
            };
            if !braid_stdlib::DEVICES.contains(&s.as_str()) {
                let help = match closest(&s, braid_stdlib::DEVICES) {
                    Some(x) => format!(
                        "did you mean \"{x}\"? Known GPUs: {}",
                        braid_stdlib::DEVICES.join(", ")
                    ),
                    None => format!("known GPUs: {}", braid_stdlib::DEVICES.join(", ")),
                };
                self.report(
                    err(
                        Code::E0308,
                        format!("unknown GPU type \"{s}\""),
                        e.span,
                        "unknown GPU",
                    )
                    .with_help(help),
                );
                return None;
            }
            Some(s)
        });
        if cpu || cpus.is_some() {
            if let Some((_, span)) = gpus {
                self.report(
                    err(
                        Code::E0308,
                        "a cluster is either `cpu` or GPUs, not both",
                        span,
                        "GPUs given with `cpu`",
                    )
                    .with_help("remove `cpu`, or remove the GPU options"),
                );
            }
            return Some(Cluster::Cpu {
                ranks: cpus.map_or(1, |c| c.0),
            });
        }
        let Some((g, gspan)) = gpus else {
            // Without a GPU count or `cpu` the block says nothing the planner can use; an
            // invalid count was reported already.
            if !opts.entries.contains_key("gpus") {
                self.report(
                    err(
                        Code::E0308,
                        "`cluster` needs `gpus: N`, `cpus: N` or `cpu`",
                        c.options.span,
                        "no devices given",
                    )
                    .with_help(
                        "write `cluster { gpus: 8, gpu: \"H100-80G\" }`, `cluster { cpus: 4 }` or `cluster { cpu }`",
                    ),
                );
            }
            return None;
        };
        let n = nodes.map_or(1, |x| x.0);
        if g % n != 0 {
            self.report(
                err(
                    Code::E0411,
                    format!("{g} GPUs cannot be spread evenly over {n} nodes"),
                    nodes.map_or(gspan, |x| x.1),
                    "does not divide",
                )
                .with_help("make `gpus` a multiple of `nodes`"),
            );
        }
        Some(Cluster::Gpus {
            gpus: g,
            gpu: gpu.unwrap_or_else(|| "H100-80G".to_string()),
            nodes: n,
        })
    }
}
