//! The run: binding a pipeline's parameters to models, datasets and functions, evaluating its
//! settings against their `where` conditions, and the rules that need both (heads, training,
//! unused models), plus schedule pins, which name the run's model calls.

use std::collections::{BTreeMap, BTreeSet};

use braid_diagnostics::{Code, Diagnostic, Span};
use braid_syntax::ast;

use crate::check::Checker;
use crate::hir::*;
use crate::items::closest;

fn err(code: Code, msg: impl Into<String>, span: Span, label: impl Into<String>) -> Diagnostic {
    Diagnostic::new(code, msg, span, label)
}

impl Checker<'_> {
    /// Checks the root file's run, cluster and schedule, and the rules on the root's items.
    pub(crate) fn root(&mut self) {
        let items = &self.modules[0].ast.items;
        let runs: Vec<ast::Run> = items
            .iter()
            .filter_map(|i| {
                if let ast::Item::Run(r) = i {
                    Some(r.clone())
                } else {
                    None
                }
            })
            .collect();
        let clusters: Vec<ast::Cluster> = items
            .iter()
            .filter_map(|i| {
                if let ast::Item::Cluster(c) = i {
                    Some(c.clone())
                } else {
                    None
                }
            })
            .collect();
        let schedules: Vec<ast::Schedule> = items
            .iter()
            .filter_map(|i| {
                if let ast::Item::Schedule(s) = i {
                    Some(s.clone())
                } else {
                    None
                }
            })
            .collect();
        let has_resources = items
            .iter()
            .any(|i| matches!(i, ast::Item::Model(_) | ast::Item::Dataset(_)));
        let has_errors = items.iter().any(|i| matches!(i, ast::Item::Error(_)));
        for extra in runs.iter().skip(1) {
            let d = err(Code::E0403, "a file has more than one `run`", extra.span, "second `run`")
                .with_label(runs[0].span, "first `run`")
                .with_help("a runnable file runs one pipeline; put other runs in their own files that `use` this one");
            self.report(d);
        }
        if runs.is_empty() && has_resources && !has_errors {
            let span = items
                .iter()
                .find_map(|i| match i {
                    ast::Item::Model(d) | ast::Item::Dataset(d) => Some(d.name.span),
                    _ => None,
                })
                .unwrap_or(Span::DUMMY);
            self.report(
                err(Code::E0402, "this file declares models or data but has no `run`", span, "declared here without a `run`")
                    .with_help("add `run PIPELINE(args) { settings }` — for example `run grpo(policy, prompts, reward: my_reward) { steps: 100 }`"),
            );
        }
        for (kind, spans) in [
            (
                "cluster",
                clusters.iter().map(|c| c.span).collect::<Vec<_>>(),
            ),
            ("schedule", schedules.iter().map(|s| s.span).collect()),
        ] {
            for extra in spans.iter().skip(1) {
                let d = err(
                    Code::E0413,
                    format!("a file has more than one `{kind}`"),
                    *extra,
                    format!("second `{kind}`"),
                )
                .with_label(spans[0], format!("first `{kind}`"))
                .with_help(format!("merge them into one `{kind}` block"));
                self.report(d);
            }
        }
        self.program.cluster = clusters.first().and_then(|c| self.cluster(c));
        if let Some(r) = runs.first() {
            self.program.run = self.run(r);
        }
        if let Some(s) = schedules.first() {
            // Pins name the run's model calls; when the run itself has errors they cannot be
            // checked, and saying so would only repeat the run's diagnostics.
            if runs.is_empty() || self.program.run.is_some() {
                self.schedule(s);
            }
            self.program.schedule = Some(lower_schedule(s));
        }
        if self.program.run.is_some() {
            self.unused_models();
        }
    }

    fn run(&mut self, r: &ast::Run) -> Option<Run> {
        let name = r.pipeline.text();
        let global = r
            .pipeline
            .as_single()
            .and_then(|id| self.scopes[0].get(&id.name).copied());
        let pid = match global.map(|g| (g.def, g.span)) {
            Some((Def::Pipeline(p), span)) => {
                self.program.references.push(Reference {
                    span: r.pipeline.span,
                    def: Def::Pipeline(p),
                    def_span: span,
                });
                p
            }
            Some((_, span)) => {
                self.report(
                    err(
                        Code::E0408,
                        format!("`{name}` is not a pipeline"),
                        r.pipeline.span,
                        "not a pipeline",
                    )
                    .with_label(span, "declared here")
                    .with_help("`run` takes a pipeline, such as `grpo` from `use std::grpo`"),
                );
                return None;
            }
            None => {
                let pipelines: Vec<String> = self.scopes[0]
                    .iter()
                    .filter(|(_, g)| matches!(g.def, Def::Pipeline(_)))
                    .map(|(n, _)| n.clone())
                    .collect();
                let suggestion = closest(
                    &name,
                    &pipelines.iter().map(|s| s.as_str()).collect::<Vec<_>>(),
                );
                let help = match &suggestion {
                    Some(s) => format!("did you mean `{s}`?"),
                    None => format!(
                        "import a standard pipeline, e.g. `use std::{name}`, or define `pipeline {name}(…)`"
                    ),
                };
                self.report(
                    err(
                        Code::E0201,
                        format!("unknown pipeline `{name}`"),
                        r.pipeline.span,
                        "not defined",
                    )
                    .with_help(help)
                    .with_suggestion(r.pipeline.span, suggestion.as_deref()),
                );
                return None;
            }
        };
        let pl = self.program.pipelines[pid.0 as usize].clone();
        let mut ok = true;
        // Signature arguments.
        let mut bound: Vec<Option<&ast::Expr>> = vec![None; pl.params.len()];
        for (i, a) in r.args.positional.iter().enumerate() {
            if i < bound.len() {
                bound[i] = Some(a);
            } else {
                self.report(
                    err(
                        Code::E0303,
                        format!(
                            "`{name}` takes {} arguments, but {} were given",
                            pl.params.len(),
                            r.args.positional.len()
                        ),
                        a.span,
                        "surplus argument",
                    )
                    .with_help(format!(
                        "the parameters are: {}",
                        pl.params
                            .iter()
                            .map(|p| p.name.as_str())
                            .collect::<Vec<_>>()
                            .join(", ")
                    )),
                );
                ok = false;
                break;
            }
        }
        for n in &r.args.named {
            match pl.params.iter().position(|p| p.name == n.name.name) {
                Some(i) if bound[i].is_some() => {
                    self.report(
                        err(
                            Code::E0209,
                            format!("argument `{}` is given twice", n.name.name),
                            n.span,
                            "given again",
                        )
                        .with_label(bound[i].map_or(r.span, |e| e.span), "first given here")
                        .with_help("give each argument once"),
                    );
                    ok = false;
                }
                Some(i) => bound[i] = Some(&n.value),
                None => {
                    let names: Vec<&str> = pl.params.iter().map(|p| p.name.as_str()).collect();
                    self.report(crate::check::unknown_argument(
                        &format!("`{name}`"),
                        &n.name,
                        &names,
                    ));
                    ok = false;
                }
            }
        }
        let mut args: Vec<RunArg> = Vec::new();
        let mut arg_spans: Vec<Span> = Vec::new();
        for (i, p) in pl.params.iter().enumerate() {
            let Some(a) = bound[i] else {
                let ast_default = self.pipeline_asts[pid.0 as usize]
                    .1
                    .params
                    .get(i)
                    .and_then(|x| x.default.as_ref());
                match ast_default.map(|d| self.const_eval(d, &BTreeMap::new())) {
                    Some(Ok(v)) => {
                        args.push(RunArg::Value(coerce(v, &p.ty)));
                        arg_spans.push(r.span);
                    }
                    Some(Err(_)) => ok = false,
                    None => {
                        self.report(
                            err(
                                Code::E0302,
                                format!("`{name}` is missing argument `{}`", p.name),
                                r.args.span,
                                format!("`{}` missing", p.name),
                            )
                            .with_label(p.span, "parameter declared here")
                            .with_help(format!("pass it: `{}: …`", p.name)),
                        );
                        ok = false;
                    }
                }
                continue;
            };
            match self.run_arg(p, a) {
                Some(v) => {
                    args.push(v);
                    arg_spans.push(a.span);
                }
                None => ok = false,
            }
        }
        // Settings.
        let mut given: BTreeMap<String, (Value, Span, Span)> = BTreeMap::new();
        // Settings written but invalid (already reported) are not also "missing".
        let mut attempted: BTreeSet<String> = BTreeSet::new();
        let mut seed = 0i64;
        let mut checkpoint_every = 50i64;
        let mut eval: Option<Eval> = None;
        let mut eval_span: Option<Span> = None;
        if let Some(opts) = &r.settings {
            for e in &opts.entries {
                let key = e.key.name.as_str();
                attempted.insert(key.to_string());
                if key == "eval" && !pl.settings.iter().any(|s| s.name == key) {
                    if let Some(first) = eval_span {
                        self.report(
                            err(
                                Code::E0209,
                                "setting `eval` is given twice",
                                e.key.span,
                                "given again",
                            )
                            .with_label(first, "first given here")
                            .with_help("give each setting once"),
                        );
                        ok = false;
                        continue;
                    }
                    eval_span = Some(e.key.span);
                    match self.eval_setting(e, &args) {
                        Some(v) => eval = Some(v),
                        None => ok = false,
                    }
                    continue;
                }
                let setting = pl.settings.iter().find(|s| s.name == key);
                let run_level = braid_stdlib::RUN_SETTINGS.iter().find(|s| s.key == key);
                let ty = match (setting, run_level) {
                    (Some(s), _) => s.ty.clone(),
                    (None, Some(_)) => SigTy::Int,
                    (None, None) => {
                        let mut names: Vec<&str> =
                            pl.settings.iter().map(|s| s.name.as_str()).collect();
                        names.extend(braid_stdlib::RUN_SETTINGS.iter().map(|s| s.key));
                        let suggestion = closest(key, &names);
                        let help = match &suggestion {
                            Some(s) => format!(
                                "did you mean `{s}`? `{name}` has the settings {}",
                                names.join(", ")
                            ),
                            None => format!("`{name}` has the settings {}", names.join(", ")),
                        };
                        self.report(
                            err(
                                Code::E0405,
                                format!("`{name}` has no setting `{key}`"),
                                e.key.span,
                                "unknown setting",
                            )
                            .with_help(help)
                            .with_suggestion(e.key.span, suggestion.as_deref()),
                        );
                        ok = false;
                        continue;
                    }
                };
                if given.contains_key(key) {
                    self.report(
                        err(
                            Code::E0209,
                            format!("setting `{key}` is given twice"),
                            e.key.span,
                            "given again",
                        )
                        .with_label(given[key].1, "first given here")
                        .with_help("give each setting once"),
                    );
                    ok = false;
                    continue;
                }
                let Some(v) = self.option_value(e, &ty) else {
                    ok = false;
                    continue;
                };
                if setting.is_none() {
                    let i = v.as_i64().unwrap_or(0);
                    if key == "seed" {
                        self.range(e, i as f64, i >= 0, ">= 0");
                        seed = i;
                    } else {
                        self.range(e, i as f64, i > 0, "> 0");
                        checkpoint_every = i;
                    }
                    continue;
                }
                let vspan = match &e.value {
                    ast::OptionValue::Expr(x) => x.span,
                    _ => e.span,
                };
                given.insert(key.to_string(), (v, e.key.span, vspan));
            }
        }
        // Every param gets a value: set, or its default evaluated over the earlier ones.
        let (_, past) = self.pipeline_asts[pid.0 as usize];
        let mut env: BTreeMap<String, Value> = BTreeMap::new();
        let mut settings: Vec<(String, Value)> = Vec::new();
        for (si, s) in past.settings.iter().enumerate() {
            let ty = pl.settings.get(si).map_or(SigTy::Error, |x| x.ty.clone());
            let v = match given.get(&s.name.name) {
                Some((v, _, _)) => Some(v.clone()),
                None => match &s.default {
                    Some(d) => self.const_eval(d, &env).ok().map(|v| coerce(v, &ty)),
                    None if attempted.contains(&s.name.name) => {
                        ok = false;
                        None
                    }
                    None => {
                        self.report(
                            err(
                                Code::E0406,
                                format!("`{name}` needs the setting `{}`", s.name.name),
                                r.pipeline.span,
                                format!("`{}` not set", s.name.name),
                            )
                            .with_label(s.name.span, "declared without a default here")
                            .with_help(format!(
                                "set it in the run's block: `{{ {}: … }}`",
                                s.name.name
                            )),
                        );
                        ok = false;
                        None
                    }
                },
            };
            if let Some(v) = v {
                env.insert(s.name.name.clone(), v.clone());
                settings.push((s.name.name.clone(), v));
            }
        }
        {
            for s in &past.settings {
                let Some(w) = &s.where_ else { continue };
                if let Ok(Value::Bool(false)) = self.const_eval(w, &env) {
                    let cond = self.sources.snippet(w.span).to_string();
                    let value = env
                        .get(&s.name.name)
                        .map(|v| v.to_string())
                        .unwrap_or_default();
                    let (primary, label) = match given.get(&s.name.name) {
                        Some((_, _, vspan)) => (*vspan, format!("`{}` is {value}", s.name.name)),
                        None => (r.span, format!("`{}` defaults to {value}", s.name.name)),
                    };
                    let others: Vec<String> = given
                        .iter()
                        .filter(|(k, _)| *k != &s.name.name && cond.contains(k.as_str()))
                        .map(|(k, (v, _, _))| format!("`{k}` is {v}"))
                        .collect();
                    let mut d = err(
                        Code::E0404,
                        format!("`{}` must satisfy `{cond}`", s.name.name),
                        primary,
                        label,
                    )
                    .with_label(w.span, "required here")
                    .with_help(format!(
                        "choose a value of `{}` for which `{cond}` holds",
                        s.name.name
                    ));
                    if !others.is_empty() {
                        d = d.with_note(format!("with {}", others.join(", ")));
                    }
                    self.report(d);
                    ok = false;
                }
            }
        }
        self.model_rules(&pl, &args, &arg_spans);
        ok.then_some(Run {
            pipeline: pid,
            args,
            settings,
            seed,
            checkpoint_every,
            eval,
            span: r.span,
        })
    }

    /// The run's `eval` record. `train` are the run's arguments, whose datasets the held-out
    /// prompts must be kept apart from.
    fn eval_setting(&mut self, e: &ast::OptionEntry, train: &[RunArg]) -> Option<Eval> {
        let invalid = |msg: String, span: Span, label: &str, help: &str| {
            err(Code::E0414, msg, span, label.to_string()).with_help(help.to_string())
        };
        let ast::OptionValue::Record(rec) = &e.value else {
            self.report(invalid(
                "`eval` takes a record".into(),
                e.span,
                "not a record",
                "write `eval: { every: 10, prompts: held_out, n: 1, greedy }`",
            ));
            return None;
        };
        let map = self.option_map("`eval`", Some(rec), braid_stdlib::EVAL_OPTIONS);
        let mut ok = true;
        let int = |cx: &mut Self, key: &str, ok: &mut bool| -> Option<i64> {
            let entry = map.entries.get(key)?;
            let v = cx.option_value(entry, &SigTy::Int)?.as_i64()?;
            if v <= 0 {
                cx.range(entry, v as f64, false, "> 0");
                *ok = false;
                return None;
            }
            Some(v)
        };
        let every = int(self, "every", &mut ok);
        let n = int(self, "n", &mut ok).unwrap_or(1);
        let max_new_tokens = int(self, "max_new_tokens", &mut ok);
        let greedy = match map.entries.get("greedy") {
            Some(g) => self
                .option_value(g, &SigTy::Bool)
                .is_some_and(|v| v == Value::Bool(true)),
            None => false,
        };
        let mut temperature = None;
        if let Some(t) = map.entries.get("temperature")
            && let Some(v) = self.option_value(t, &SigTy::Float)
        {
            let x = v.as_f64().unwrap_or(0.0);
            if x <= 0.0 {
                self.range(t, x, false, "> 0");
                ok = false;
            } else if greedy {
                self.report(
                    invalid(
                        "`eval` is both `greedy` and sampled at a `temperature`".into(),
                        t.span,
                        "a temperature",
                        "keep one: `greedy` decodes the most likely answer, `temperature` samples",
                    )
                    .with_label(map.entries["greedy"].span, "greedy here"),
                );
                ok = false;
            } else {
                temperature = Some(x);
            }
        }
        let Some(every) = every else {
            if !map.entries.contains_key("every") {
                self.report(invalid(
                    "`eval` needs `every`".into(),
                    rec.span,
                    "no `every`",
                    "say how often to evaluate: `eval: { every: 10, prompts: held_out }`",
                ));
            }
            return None;
        };
        let Some(pe) = map.entries.get("prompts") else {
            self.report(invalid(
                "`eval` needs `prompts`".into(),
                rec.span,
                "no `prompts`",
                "name a held-out dataset: `eval: { every: 10, prompts: held_out }`",
            ));
            return None;
        };
        let named = match &pe.value {
            ast::OptionValue::Expr(x) => match &x.kind {
                ast::ExprKind::Path(path) => path.as_single().cloned(),
                _ => None,
            },
            _ => None,
        };
        let global = named
            .as_ref()
            .and_then(|id| self.scopes[0].get(&id.name).copied());
        let dataset = match (&named, global) {
            (Some(id), Some(g)) if matches!(g.def, Def::Dataset(_)) => {
                self.program.references.push(Reference {
                    span: id.span,
                    def: g.def,
                    def_span: g.span,
                });
                match g.def {
                    Def::Dataset(d) => d,
                    _ => return None,
                }
            }
            _ => {
                self.report(invalid(
                    "`prompts` of `eval` must name a dataset".into(),
                    pe.span,
                    "not a dataset",
                    "declare the held-out prompts (`dataset held_out = …`) and name them here",
                ));
                return None;
            }
        };
        let eval_ds = self.program.datasets[dataset.0 as usize].clone();
        for a in train {
            let RunArg::Dataset(t) = a else { continue };
            let td = &self.program.datasets[t.0 as usize];
            let shared = if *t == dataset {
                Some(format!("`{}` is the run's training data", td.name))
            } else {
                match (&td.source, &eval_ds.source) {
                    (DatasetSource::Jsonl { path: a }, DatasetSource::Jsonl { path: b })
                    | (DatasetSource::Parquet { path: a }, DatasetSource::Parquet { path: b })
                        if a == b =>
                    {
                        Some(format!(
                            "`{}` reads the same file as `{}`",
                            eval_ds.name, td.name
                        ))
                    }
                    (
                        DatasetSource::Synthetic {
                            kind: k1,
                            split: s1,
                            ..
                        },
                        DatasetSource::Synthetic {
                            kind: k2,
                            split: s2,
                            ..
                        },
                    ) if k1 == k2 && (*s1 == Split::All || *s1 == *s2) => Some(format!(
                        "`{}` (split \"{}\") draws from the problems `{}` (split \"{}\") trains on",
                        eval_ds.name,
                        s2.as_str(),
                        td.name,
                        s1.as_str()
                    )),
                    _ => None,
                }
            };
            if let Some(why) = shared {
                self.report(
                    invalid(
                        "`eval` would score prompts the policy trains on".into(),
                        pe.span,
                        "not held out",
                        "evaluate on data kept apart from training: for a synthetic generator, train on `split: \"train\"` and evaluate on `split: \"held_out\"`",
                    )
                    .with_label(td.span, "the training data")
                    .with_note(why),
                );
                return None;
            }
        }
        ok.then_some(Eval {
            every,
            prompts: dataset,
            n,
            greedy,
            temperature,
            max_new_tokens,
            span: e.span,
        })
    }

    fn run_arg(&mut self, p: &Param, a: &ast::Expr) -> Option<RunArg> {
        let named = match &a.kind {
            ast::ExprKind::Path(path) => path.as_single().cloned(),
            _ => None,
        };
        let global = named
            .as_ref()
            .and_then(|id| self.scopes[0].get(&id.name).copied());
        if let (Some(id), Some(g)) = (&named, global) {
            self.program.references.push(Reference {
                span: id.span,
                def: g.def,
                def_span: g.span,
            });
        }
        let what = |d: &Def| match d {
            Def::Model(_) => "a model",
            Def::Dataset(_) => "a dataset",
            Def::Fn(_) => "a function",
            Def::Pipeline(_) => "a pipeline",
            _ => "a value",
        };
        match (&p.ty, global.map(|g| g.def)) {
            (SigTy::Model, Some(Def::Model(m))) => Some(RunArg::Model(m)),
            (SigTy::Dataset, Some(Def::Dataset(d))) => Some(RunArg::Dataset(d)),
            (SigTy::Fn(sig), Some(Def::Fn(f))) => {
                let func = &self.program.fns[f.0 as usize];
                let have = func.signature();
                let compatible = have.params.len() == sig.params.len()
                    && have.params.iter().zip(&sig.params).all(|(a, b)| a == b)
                    && (have.ret == sig.ret
                        || matches!(
                            (&*have.ret, &*sig.ret),
                            (
                                SigTy::Float | SigTy::PerSample | SigTy::Int,
                                SigTy::Float | SigTy::PerSample
                            )
                        ));
                if !compatible {
                    let fspan = func.name_span;
                    self.report(
                        err(
                            Code::E0301,
                            format!(
                                "`{}` has type {have}, but `{}` must be {sig}",
                                func.name, p.name
                            ),
                            a.span,
                            format!("expected {sig}"),
                        )
                        .with_label(fspan, format!("`{}` declared here", func.name))
                        .with_help(format!("write a function of type {sig}")),
                    );
                    return None;
                }
                Some(RunArg::Fn(f))
            }
            (SigTy::Model | SigTy::Dataset | SigTy::Fn(_), Some(def)) => {
                self.report(
                    err(
                        Code::E0301,
                        format!("`{}` must be {}, but this is {}", p.name, p.ty, what(&def)),
                        a.span,
                        format!("expected {}", p.ty),
                    )
                    .with_label(p.span, "parameter declared here")
                    .with_help(format!(
                        "pass {} declared in this file",
                        match p.ty {
                            SigTy::Model => "a model",
                            SigTy::Dataset => "a dataset",
                            _ => "a function",
                        }
                    )),
                );
                None
            }
            (SigTy::Model | SigTy::Dataset | SigTy::Fn(_), None) => {
                let text = self.sources.snippet(a.span).to_string();
                self.report(
                    err(
                        Code::E0201,
                        format!("unknown name `{text}`"),
                        a.span,
                        "not defined",
                    )
                    .with_help(format!(
                        "`{}` takes {} declared in this file or imported",
                        p.name, p.ty
                    )),
                );
                None
            }
            (ty, _) => match self.const_eval(a, &BTreeMap::new()) {
                Ok(v) if crate::items::scalar_accepts(ty, &v.ty()) => {
                    Some(RunArg::Value(coerce(v, ty)))
                }
                Ok(v) => {
                    self.report(
                        err(
                            Code::E0301,
                            format!("`{}` must be {ty}, not {}", p.name, v.ty().describe()),
                            a.span,
                            format!("expected {ty}"),
                        )
                        .with_help(format!("pass a {ty}")),
                    );
                    None
                }
                Err(span) => {
                    self.report(
                        err(
                            Code::E0412,
                            format!("`{}` must be a constant", p.name),
                            span,
                            "not a constant",
                        )
                        .with_help("pass a literal"),
                    );
                    None
                }
            },
        }
    }

    /// Heads and training: every model call must find the head it needs, and every trained
    /// model must declare `train:`.
    fn model_rules(&mut self, pl: &Pipeline, args: &[RunArg], arg_spans: &[Span]) {
        let mut reported: BTreeSet<(u32, &'static str)> = BTreeSet::new();
        for call in pl.model_calls() {
            let Some((pi, frozen)) = pl.model_param(call.model) else {
                continue;
            };
            let Some(RunArg::Model(mid)) = args.get(pi as usize) else {
                continue;
            };
            let model = self.program.models[mid.0 as usize].clone();
            let arg_span = arg_spans
                .get(pi as usize)
                .copied()
                .unwrap_or(model.name_span);
            let local_name = pl
                .locals
                .get(call.model.0 as usize)
                .map_or(String::new(), |l| l.name.clone());
            let need = match call.op {
                ModelOp::Generate | ModelOp::Logprobs => Some(Head::Lm),
                ModelOp::Values => Some(Head::Value),
                ModelOp::Score => Some(Head::Score),
                ModelOp::Train => None,
            };
            if let Some(need) = need
                && model.head != need
                && reported.insert((mid.0, call.op.as_str()))
            {
                let d = err(
                    Code::E0410,
                    format!(
                        "`{}` needs a model with a `{}` head, but `{}` has a `{}` head",
                        call.op.as_str(),
                        need.as_str(),
                        model.name,
                        model.head.as_str()
                    ),
                    arg_span,
                    format!("`{}` has head `{}`", model.name, model.head.as_str()),
                )
                .with_label(
                    call.span,
                    format!("`{}({local_name})` here", call.op.as_str()),
                )
                .with_label(model.name_span, "model declared here")
                .with_help(format!(
                    "declare the model with `{{ head: {} }}`, or pass a model that has one",
                    need.as_str()
                ));
                self.report(d);
            }
            if call.op == ModelOp::Train
                && !frozen
                && model.train.is_none()
                && reported.insert((mid.0, "train"))
            {
                let d = err(
                    Code::E0401,
                    format!(
                        "model `{}` is trained by `{}` but declares no `train:`",
                        model.name, pl.name
                    ),
                    arg_span,
                    "trained, but frozen",
                )
                .with_label(model.name_span, "declared without `train:` here")
                .with_label(call.span, format!("`train({local_name})` here"))
                .with_help(format!(
                    "make it trainable: `model {} = … {{ train: adamw(lr: 1e-5) }}`",
                    model.name
                ));
                self.report(d);
            }
        }
    }

    fn unused_models(&mut self) {
        let Some(run) = &self.program.run else { return };
        let mut used: BTreeSet<u32> = run
            .args
            .iter()
            .filter_map(|a| {
                if let RunArg::Model(m) = a {
                    Some(m.0)
                } else {
                    None
                }
            })
            .collect();
        if let Some(s) = &self.program.schedule {
            for p in &s.pins {
                if let PinKind::Speculate {
                    mode: SpeculatePin::Draft { model },
                    ..
                } = &p.kind
                    && let Some(m) = self.program.models.iter().position(|m| &m.name == model)
                {
                    used.insert(m as u32);
                }
            }
        }
        // Frozen copies keep what they copy alive, and are themselves used only if used.
        let root = self.modules[0].file;
        for (i, m) in self.program.models.clone().iter().enumerate() {
            if m.file != root || used.contains(&(i as u32)) {
                continue;
            }
            let copied_by_used = self.program.models.iter().enumerate().any(|(j, o)| {
                used.contains(&(j as u32)) && o.source == ModelSource::Frozen(ModelId(i as u32))
            });
            if copied_by_used {
                continue;
            }
            self.report(
                err(
                    Code::W0002,
                    format!("model `{}` is never used by the run", m.name),
                    m.name_span,
                    "declared here",
                )
                .with_help("pass it to the run, or remove it"),
            );
        }
    }

    fn schedule(&mut self, s: &ast::Schedule) {
        let Some(run) = self.program.run.clone() else {
            if let Some(p) = s.pins.first() {
                self.report(
                    err(
                        Code::E0501,
                        "schedule pins need a `run` to refer to",
                        p.span,
                        "nothing to pin",
                    )
                    .with_help("add a `run`, or remove the `schedule`"),
                );
            }
            return;
        };
        let pl = self.program.pipelines[run.pipeline.0 as usize].clone();
        let calls: Vec<(ModelOp, String, Span)> = pl
            .model_calls()
            .into_iter()
            .map(|c| {
                (
                    c.op,
                    pl.locals
                        .get(c.model.0 as usize)
                        .map_or(String::new(), |l| l.name.clone()),
                    c.span,
                )
            })
            .collect();
        let gpus = match &self.program.cluster {
            Some(Cluster::Gpus { gpus, .. }) => Some(*gpus),
            Some(Cluster::Cpu { ranks }) => Some(*ranks),
            None => None,
        };
        for pin in &s.pins {
            match &pin.kind {
                ast::PinKind::FuseOff | ast::PinKind::MigrateOff => {}
                ast::PinKind::Fuse { from, to } => {
                    self.selector(from, &calls, &pl.name);
                    for t in to {
                        self.selector(t, &calls, &pl.name);
                    }
                }
                ast::PinKind::MigrateBelow { percent, span } => {
                    if !(*percent > 0.0 && *percent < 100.0) {
                        self.report(
                            err(Code::E0411, format!("`migrate below {percent}%` must be between 0% and 100%"), *span, "out of range")
                                .with_help("migrate the long tail when fewer than this share of samples remain, e.g. `migrate below 20%`"),
                        );
                    }
                }
                ast::PinKind::Interleave(sels) => {
                    for sel in sels {
                        if self.selector(sel, &calls, &pl.name) && sel.op.name != "train" {
                            self.report(
                                err(Code::E0301, "`interleave` fuses `train` calls", sel.span, "not a `train` call")
                                    .with_help("interleave the training of two models: `interleave train(policy), train(critic)`"),
                            );
                        }
                    }
                }
                ast::PinKind::Place {
                    target,
                    from,
                    to,
                    layout,
                } => {
                    self.selector(target, &calls, &pl.name);
                    if from.value >= to.value {
                        self.report(
                            err(
                                Code::E0503,
                                format!("device range {}..{} is empty", from.value, to.value),
                                from.span.to(to.span),
                                "empty range",
                            )
                            .with_help("ranges are half-open: `0..8` is devices 0 to 7"),
                        );
                        continue;
                    }
                    if let Some(g) = gpus
                        && to.value > g
                    {
                        self.report(
                            err(
                                Code::E0503,
                                format!(
                                    "device range {}..{} goes past the cluster's {g} device{}",
                                    from.value,
                                    to.value,
                                    if g == 1 { "" } else { "s" }
                                ),
                                to.span,
                                "no such device",
                            )
                            .with_help(format!("devices are numbered 0..{g}")),
                        );
                        continue;
                    }
                    let product: i64 = layout.iter().map(|(_, n)| n.value.max(1)).product();
                    let count = to.value - from.value;
                    for (_, n) in layout {
                        if n.value <= 0 {
                            self.report(
                                err(
                                    Code::E0411,
                                    "a parallel degree must be > 0",
                                    n.span,
                                    "must be > 0",
                                )
                                .with_help("write e.g. `tp 2`"),
                            );
                        }
                    }
                    if !layout.is_empty() && count % product != 0 {
                        self.report(
                            err(Code::E0503, format!("the layout needs a multiple of {product} devices, but {}..{} has {count}", from.value, to.value), pin.span, "layout does not fit")
                                .with_help("make dp × tp × pp divide the number of devices"),
                        );
                    }
                }
                ast::PinKind::Speculate { target, mode } => {
                    if let Some(t) = target {
                        if self.selector(t, &calls, &pl.name) && t.op.name != "generate" {
                            self.report(
                                err(Code::E0301, "`speculate` applies to `generate` calls", t.span, "not a `generate` call")
                                    .with_help("pin speculative decoding of generation: `speculate generate(policy) ngram(3)`"),
                            );
                        }
                    } else {
                        let models: BTreeSet<&String> = calls
                            .iter()
                            .filter(|c| c.0 == ModelOp::Generate)
                            .map(|c| &c.1)
                            .collect();
                        let gens = calls.iter().filter(|c| c.0 == ModelOp::Generate).count();
                        if models.len() > 1 {
                            self.report(
                                err(Code::E0502, format!("`speculate` without a selector matches {gens} `generate` calls"), pin.span, "ambiguous")
                                    .with_help("name the call: `speculate generate(policy) …`"),
                            );
                        }
                    }
                    match mode {
                        ast::SpeculateMode::Ngram { n, max } => {
                            if n.value <= 0 {
                                self.report(
                                    err(
                                        Code::E0411,
                                        "an n-gram length must be > 0",
                                        n.span,
                                        "must be > 0",
                                    )
                                    .with_help("write e.g. `ngram(3)`"),
                                );
                            }
                            let most = i64::from(braid_ir::settings::MAX_DRAFT);
                            if let Some(m) = max
                                && !(1..=most).contains(&m.value)
                            {
                                self.report(
                                    err(
                                        Code::E0411,
                                        format!("a draft length must be from 1 to {most}"),
                                        m.span,
                                        format!("must be from 1 to {most}"),
                                    )
                                    .with_help("write e.g. `max 8`"),
                                );
                            }
                        }
                        ast::SpeculateMode::Draft(d) => {
                            if !self.program.models.iter().any(|m| m.name == d.name) {
                                self.report(
                                    err(Code::E0201, format!("unknown draft model `{}`", d.name), d.span, "not a declared model")
                                        .with_help("declare the draft model with `model NAME = hf(\"…\")`; it must share the policy's tokenizer"),
                                );
                            }
                        }
                        ast::SpeculateMode::Off => {}
                    }
                }
                ast::PinKind::MicroBatch { target, size } => {
                    self.selector(target, &calls, &pl.name);
                    if size.value <= 0 {
                        self.report(
                            err(
                                Code::E0411,
                                "a micro-batch size must be > 0",
                                size.span,
                                "must be > 0",
                            )
                            .with_help("write e.g. `micro_batch train(policy) 8`"),
                        );
                    }
                }
            }
        }
    }

    /// Checks that a selector matches exactly one model call; returns whether it matched.
    fn selector(
        &mut self,
        sel: &ast::Selector,
        calls: &[(ModelOp, String, Span)],
        pipeline: &str,
    ) -> bool {
        let matching: Vec<&(ModelOp, String, Span)> = calls
            .iter()
            .filter(|(op, m, _)| {
                op.as_str() == sel.op.name && sel.model.as_ref().is_none_or(|x| x.name == *m)
            })
            .collect();
        let listing = calls
            .iter()
            .map(|(op, m, _)| format!("{}({m})", op.as_str()))
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect::<Vec<_>>()
            .join(", ");
        match matching.len() {
            0 => {
                let text = match &sel.model {
                    Some(m) => format!("{}({})", sel.op.name, m.name),
                    None => sel.op.name.clone(),
                };
                self.report(
                    err(
                        Code::E0501,
                        format!("`{text}` matches no model call of `{pipeline}`"),
                        sel.span,
                        "matches nothing",
                    )
                    .with_help(format!("the model calls of `{pipeline}` are {listing}")),
                );
                false
            }
            1 => true,
            n => {
                let distinct: BTreeSet<&String> = matching.iter().map(|c| &c.1).collect();
                if sel.model.is_none() && distinct.len() > 1 {
                    self.report(
                        err(
                            Code::E0502,
                            format!("`{}` matches {n} model calls of `{pipeline}`", sel.op.name),
                            sel.span,
                            "ambiguous",
                        )
                        .with_help(format!(
                            "name the model: one of {}",
                            matching
                                .iter()
                                .map(|c| format!("{}({})", c.0.as_str(), c.1))
                                .collect::<Vec<_>>()
                                .join(", ")
                        )),
                    );
                    false
                } else {
                    // Several calls on the same model (e.g. two `generate(policy)`) are pinned together.
                    true
                }
            }
        }
    }
}

fn coerce(v: Value, ty: &SigTy) -> Value {
    match (ty, v) {
        (SigTy::Float, Value::Int(i)) => Value::Float(i as f64),
        (_, v) => v,
    }
}

fn lower_selector(s: &ast::Selector) -> Selector {
    Selector {
        op: s.op.name.clone(),
        model: s.model.as_ref().map(|m| m.name.clone()),
        span: s.span,
    }
}

/// The schedule's pins without their syntax: selectors by name, numbers as values. Negative
/// numbers were reported by `schedule`; they lower to the nearest valid value so that the HIR
/// stays well-formed for the language server.
fn lower_schedule(s: &ast::Schedule) -> Schedule {
    let count = |v: i64| v.max(0) as u64;
    let pins = s
        .pins
        .iter()
        .map(|p| {
            let kind = match &p.kind {
                ast::PinKind::FuseOff => PinKind::FuseOff,
                ast::PinKind::MigrateOff => PinKind::MigrateOff,
                ast::PinKind::MigrateBelow { percent, .. } => {
                    PinKind::MigrateBelow(percent / 100.0)
                }
                ast::PinKind::Fuse { from, to } => PinKind::Fuse {
                    from: lower_selector(from),
                    to: to.iter().map(lower_selector).collect(),
                },
                ast::PinKind::Interleave(sels) => {
                    PinKind::Interleave(sels.iter().map(lower_selector).collect())
                }
                ast::PinKind::Place {
                    target,
                    from,
                    to,
                    layout,
                } => {
                    let get = |k: ast::LayoutKind| {
                        layout
                            .iter()
                            .find(|(kind, _)| *kind == k)
                            .map(|(_, v)| v.value.max(1) as u64)
                    };
                    PinKind::Place {
                        target: lower_selector(target),
                        from: count(from.value),
                        to: count(to.value),
                        tp: get(ast::LayoutKind::Tp),
                        pp: get(ast::LayoutKind::Pp),
                        dp: get(ast::LayoutKind::Dp),
                    }
                }
                ast::PinKind::Speculate { target, mode } => PinKind::Speculate {
                    target: target.as_ref().map(lower_selector),
                    mode: match mode {
                        ast::SpeculateMode::Off => SpeculatePin::Off,
                        ast::SpeculateMode::Ngram { n, max } => SpeculatePin::Ngram {
                            n: n.value.max(1) as u64,
                            max: max.as_ref().map(|m| m.value.max(1) as u64),
                        },
                        ast::SpeculateMode::Draft(m) => SpeculatePin::Draft {
                            model: m.name.clone(),
                        },
                    },
                },
                ast::PinKind::MicroBatch { target, size } => PinKind::MicroBatch {
                    target: lower_selector(target),
                    size: size.value.max(1),
                },
            };
            Pin { kind, span: p.span }
        })
        .collect();
    Schedule { pins }
}
