//! From pest pairs to the syntax tree, and from pest errors to diagnostics (in one function,
//! [`syntax_error`]).

use braid_diagnostics::{Code, Diagnostic, FileId, Span};
use pest::Parser as _;
use pest::iterators::Pair;

use crate::ast::*;

#[derive(pest_derive::Parser)]
#[grammar = "rlhf.pest"]
struct RlhfParser;

type P<'a> = Pair<'a, Rule>;

/// Parses one file. Never fails: what could not be parsed becomes `Item::Error` nodes, and
/// every problem is a diagnostic with a code and a span.
pub fn parse(text: &str, file: FileId) -> (File, Vec<Diagnostic>) {
    // The file rule cannot fail (`recover` accepts anything), so the first pass runs without
    // pest's error detail, which would make it about 1.6x slower; chunks that failed are
    // re-parsed with detail on, in `recover`.
    let mut b = Builder {
        misused_keywords: std::cell::RefCell::new(Vec::new()),
        text,
        file,
        diags: Vec::new(),
    };
    let items = match RlhfParser::parse(Rule::file, text) {
        Ok(mut pairs) => match pairs.next() {
            Some(file_pair) => b.file(file_pair),
            None => Vec::new(),
        },
        // The `recover` rule accepts any text, so the file rule cannot fail; if it ever does,
        // report it as a syntax error over the whole file rather than panic.
        Err(e) => {
            let d = syntax_error(&e, file, 0, text);
            b.diags.push(d);
            vec![Item::Error(Span::new(file, 0, text.len()))]
        }
    };
    let span = Span::new(file, 0, text.len());
    let mut diags = b.diags;
    diags.extend(b.misused_keywords.into_inner());
    (File { items, span }, diags)
}

/// A grammar rule's name as users should read it in "expected …" messages, or `None` for rules
/// that only structure the grammar.
pub fn readable_rule(rule: Rule) -> Option<&'static str> {
    Some(match rule {
        Rule::ident => "a name",
        Rule::path => "a name",
        Rule::int => "an integer",
        Rule::float => "a number",
        Rule::string | Rule::raw_string => "a string",
        Rule::bool_lit => "`true` or `false`",
        Rule::expr_stmt | Rule::bin_expr | Rule::operand => "an expression",
        Rule::paren | Rule::if_expr => "an expression",
        Rule::scan_expr => "an expression",
        Rule::type_expr | Rule::fn_type => "a type",
        Rule::options => "an options block `{ … }`",
        Rule::option => "an option `key: value`",
        Rule::args | Rule::call_args => "arguments `( … )`",
        Rule::param | Rule::params | Rule::fn_param | Rule::fn_params => "a parameter `name: Type`",
        Rule::metric_stmt => "`metric`",
        Rule::param_decl => "`param`",
        Rule::local_model => "`model`",
        Rule::each_block => "`each`",
        Rule::let_stmt => "`let`",
        Rule::block | Rule::fn_block | Rule::scan_body => "a block `{ … }`",
        Rule::source => "a source such as `tiny(…)` or `jsonl(\"…\")`",
        Rule::selector => "a model call such as `generate(policy)`",
        Rule::use_item => "`use`",
        Rule::model_item => "`model`",
        Rule::dataset_item => "`dataset`",
        Rule::fn_item => "`fn`",
        Rule::pipeline_item => "`pipeline`",
        Rule::run_item => "`run`",
        Rule::cluster_item => "`cluster`",
        Rule::schedule_item => "`schedule`",
        Rule::pin_fuse
        | Rule::pin_migrate
        | Rule::pin_interleave
        | Rule::pin_place
        | Rule::pin_speculate
        | Rule::pin_micro_batch => "a pin",
        Rule::named_arg => "a named argument",
        Rule::bin_op => "an operator",
        Rule::EOI => "end of file",
        Rule::off => "`off`",
        Rule::layout | Rule::layout_kind => "`tp`, `pp` or `dp`",
        Rule::ngram => "`ngram(N)`",
        Rule::draft => "`draft(model)`",
        Rule::over => "`over`",
        Rule::where_clause => "`where`",
        Rule::field => "`.field`",
        Rule::index => "`[index]`",
        _ => return None,
    })
}

/// The one place where pest errors become diagnostics. `offset` is where `text` starts in the
/// file (re-parsed chunks start mid-file).
fn syntax_error(
    e: &pest::error::Error<Rule>,
    file: FileId,
    offset: usize,
    text: &str,
) -> Diagnostic {
    let mut pos = match e.location {
        pest::error::InputLocation::Pos(p) => p,
        pest::error::InputLocation::Span((s, _)) => s,
    };
    if let Some(a) = e.parse_attempts() {
        pos = pos.max(a.max_position);
    }
    let mut expected: Vec<String> = Vec::new();
    if let pest::error::ErrorVariant::ParsingError { positives, .. } = &e.variant {
        for r in positives {
            if let Some(name) = readable_rule(*r) {
                expected.push(name.to_string());
            }
        }
    }
    if let Some(attempts) = e.parse_attempts() {
        for t in attempts.expected_tokens() {
            // pest does not export the token type; its Debug form says which variant it is.
            if format!("{t:?}").starts_with("Sensitive") {
                let token = t.to_string();
                match token.as_str() {
                    "\n" => expected.push("a new line".to_string()),
                    "\r" | "\t" | " " | "//" => {}
                    _ => expected.push(format!("`{token}`")),
                }
            }
        }
    }
    // Tokens that merely start an expression or a name add noise next to "an expression".
    if expected
        .iter()
        .any(|x| x == "an expression" || x == "a name")
    {
        const STARTS: &[&str] = &[
            "`!`", "`\"`", "`(`", "`-`", "`_`", "`false`", "`true`", "`r\"`", "`scan`", "`if`",
        ];
        expected.retain(|x| !STARTS.contains(&x.as_str()));
    }
    expected.sort();
    expected.dedup();
    // Prefer concrete tokens first, then descriptions.
    expected.sort_by_key(|s| !s.starts_with('`'));
    let found = describe_found(text, pos);
    let start = offset + pos;
    let end = start + found.1;
    let what = if expected.is_empty() {
        "a different token".to_string()
    } else if expected.len() == 1 {
        expected[0].clone()
    } else {
        let (last, rest) = expected
            .split_last()
            .map(|(l, r)| (l.clone(), r.to_vec()))
            .unwrap_or_default();
        format!("{} or {}", rest.join(", "), last)
    };
    Diagnostic::new(
        Code::E0101,
        format!("expected {what}, found {}", found.0),
        Span::new(file, start, end),
        format!("expected {what}"),
    )
    .with_help("the item is skipped up to the next line that starts with `use`, `model`, `dataset`, `fn`, `pipeline`, `run`, `cluster` or `schedule`")
}

/// Parses one item with pest's error detail on, so its error can say which tokens were
/// expected. The switch is process-wide and read when a parse starts: a lock keeps concurrent
/// re-parses from turning it off under each other, and it is off again afterwards.
fn parse_with_detail(chunk: &str) -> Result<(), pest::error::Error<Rule>> {
    static DETAIL: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _guard = DETAIL
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    pest::set_error_detail(true);
    let result = RlhfParser::parse(Rule::item_only, chunk).map(|_| ());
    pest::set_error_detail(false);
    result
}

/// The operator span of an unparenthesised comparison, from the (expression, operator) spans
/// recorded while folding.
fn comparison_op_span(e: &Expr, ops_seen: &[(Span, Span)]) -> Option<Span> {
    match &e.kind {
        ExprKind::Binary { op, .. } if op.is_comparison() => ops_seen
            .iter()
            .rev()
            .find(|(expr, _)| *expr == e.span)
            .map(|(_, op)| *op),
        _ => None,
    }
}

/// The end of `text[start..end]` without trailing whitespace and `//` comments.
fn trim_end(text: &str, start: usize, mut end: usize) -> usize {
    // A comment runs to the end of its line, so a span that stops mid-line ends in a token or
    // in spaces; only one that stops at a line break or the end can end in a comment.
    let bytes = text.as_bytes();
    if end > start && !matches!(bytes.get(end), None | Some(b'\n')) {
        while end > start && matches!(bytes[end - 1], b' ' | b'\t' | b'\r' | b'\n') {
            end -= 1;
        }
        return end;
    }
    loop {
        let seg = &text.as_bytes()[start..end];
        let trimmed = seg
            .iter()
            .rposition(|b| !b" \t\r\n".contains(b))
            .map_or(0, |i| i + 1);
        end = start + trimmed;
        // The last line of the span, which a comment would end.
        let line_start = text[start..end]
            .rfind('\n')
            .map_or(start, |i| start + i + 1);
        let line = &text[line_start..end];
        if !line.contains("//") {
            return end;
        }
        match crate::comments::scan(line).first() {
            Some(c) => end = line_start + c.start,
            None => return end,
        }
    }
}

/// The byte range (from the quote to the end of its line) of the first string in `text` that
/// has no closing quote on its line. Comments are skipped like the grammar skips them.
fn unterminated_string(text: &str) -> Option<(usize, usize)> {
    let b = text.as_bytes();
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'/' if b.get(i + 1) == Some(&b'/') => {
                while i < b.len() && b[i] != b'\n' {
                    i += 1;
                }
            }
            b'"' => {
                let raw = i > 0 && b[i - 1] == b'r';
                let start = i;
                i += 1;
                loop {
                    match b.get(i) {
                        None | Some(b'\n') => return Some((start, i)),
                        Some(b'"') => break,
                        Some(b'\\') if !raw => i += 2,
                        Some(_) => i += 1,
                    }
                }
                i += 1;
            }
            _ => i += 1,
        }
    }
    None
}

/// What the parser found at `pos`: a description and its length in bytes.
fn describe_found(text: &str, pos: usize) -> (String, usize) {
    let rest = text.get(pos..).unwrap_or("");
    let Some(c) = rest.chars().next() else {
        return ("end of file".to_string(), 0);
    };
    if c == '\n' {
        return ("end of line".to_string(), 0);
    }
    for op in ["->", "::", "..", "==", "!=", "<=", ">=", "&&", "||"] {
        if rest.starts_with(op) {
            return (format!("`{op}`"), 2);
        }
    }
    if c.is_alphanumeric() || c == '_' {
        let word: String = rest
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        let len = word.len();
        return (format!("`{word}`"), len);
    }
    (format!("`{c}`"), c.len_utf8())
}

struct Builder<'t> {
    file: FileId,
    diags: Vec<Diagnostic>,
    /// Keywords used as names, found where the builder only reads (`ident` takes `&self`).
    misused_keywords: std::cell::RefCell<Vec<Diagnostic>>,
    text: &'t str,
}

/// Reserved words: never names. Pin words (`fuse`, `place`, …) are keywords only in `schedule`.
pub const KEYWORDS: &[&str] = &[
    "use", "model", "dataset", "fn", "pipeline", "param", "each", "in", "run", "cluster",
    "schedule", "let", "if", "else", "scan", "reverse", "with", "where", "true", "false", "over",
];

fn children(p: P<'_>) -> Vec<P<'_>> {
    inner(p).collect()
}

/// The children of a pair, without keyword tokens (they carry no information the builder needs).
fn inner(p: P<'_>) -> impl Iterator<Item = P<'_>> {
    p.into_inner().filter(|c| !is_keyword(c.as_rule()))
}

fn is_keyword(r: Rule) -> bool {
    matches!(
        r,
        Rule::kw_below
            | Rule::kw_cluster
            | Rule::kw_dataset
            | Rule::kw_each
            | Rule::kw_else
            | Rule::kw_fn
            | Rule::kw_fuse
            | Rule::kw_if
            | Rule::kw_in
            | Rule::kw_interleave
            | Rule::kw_let
            | Rule::kw_max
            | Rule::kw_metric
            | Rule::kw_micro_batch
            | Rule::kw_migrate
            | Rule::kw_model
            | Rule::kw_on
            | Rule::kw_over
            | Rule::kw_param
            | Rule::kw_pipeline
            | Rule::kw_place
            | Rule::kw_run
            | Rule::kw_scan
            | Rule::kw_schedule
            | Rule::kw_speculate
            | Rule::kw_use
            | Rule::kw_where
            | Rule::kw_with
    )
}

impl Builder<'_> {
    /// The span of a pair without the whitespace and comments pest may have consumed after
    /// its last token (implicit whitespace before an optional part that turned out absent).
    fn span(&self, p: &P<'_>) -> Span {
        let s = p.as_span();
        Span::new(
            self.file,
            s.start(),
            trim_end(self.text, s.start(), s.end()),
        )
    }

    fn file(&mut self, p: P<'_>) -> Vec<Item> {
        let mut items = Vec::new();
        for c in inner(p) {
            match c.as_rule() {
                Rule::EOI => {}
                Rule::recover => items.push(self.recover(c)),
                _ => items.push(self.item(c)),
            }
        }
        items
    }

    /// Re-parses skipped text as one item to say what went wrong in it.
    fn recover(&mut self, p: P<'_>) -> Item {
        let span = self.span(&p);
        let chunk = p.as_str();
        let offset = p.as_span().start();
        match parse_with_detail(chunk) {
            Err(e) => {
                let pos = match e.location {
                    pest::error::InputLocation::Pos(p) => p,
                    pest::error::InputLocation::Span((s, _)) => s,
                };
                // An unterminated string makes the parser fail after it; say what really went
                // wrong.
                let d = match unterminated_string(chunk).filter(|(s, _)| *s <= pos) {
                    Some((s, e)) => Diagnostic::new(
                        Code::E0102,
                        "unterminated string",
                        Span::new(self.file, offset + s, offset + e),
                        "this string has no closing `\"`",
                    )
                    .with_help(
                        "close the string with `\"` on the same line; write a line break as `\\n`",
                    ),
                    None => syntax_error(&e, self.file, offset, chunk),
                };
                self.diags.push(d);
            }
            Ok(_) => {
                // The item parses alone but was not followed by a line break: the error is at
                // its end, where a second item starts on the same line.
                let trimmed = chunk.trim_end();
                let d = Diagnostic::new(
                    Code::E0101,
                    "expected a new line or `;` after this item",
                    Span::new(self.file, offset + trimmed.len(), offset + trimmed.len()),
                    "expected a new line",
                )
                .with_help("put each item on its own line");
                self.diags.push(d);
            }
        }
        Item::Error(span)
    }

    fn item(&mut self, p: P<'_>) -> Item {
        let span = self.span(&p);
        match p.as_rule() {
            Rule::use_item => {
                let Some(c) = inner(p).next() else {
                    return Item::Error(span);
                };
                let target = match c.as_rule() {
                    Rule::string => UseTarget::File(self.string(c)),
                    _ => UseTarget::Path(self.path(c)),
                };
                Item::Use(Use { target, span })
            }
            Rule::model_item => Item::Model(self.model_decl(p)),
            Rule::dataset_item => Item::Dataset(self.model_decl(p)),
            Rule::fn_item => Item::Fn(self.fn_decl(p)),
            Rule::pipeline_item => Item::Pipeline(self.pipeline(p)),
            Rule::run_item => {
                let mut it = inner(p);
                let (Some(path), Some(args)) = (it.next(), it.next()) else {
                    return Item::Error(span);
                };
                let pipeline = self.path(path);
                let args = self.args(args);
                let settings = it.next().map(|o| self.options(o));
                Item::Run(Run {
                    pipeline,
                    args,
                    settings,
                    span,
                })
            }
            Rule::cluster_item => match inner(p).next() {
                Some(o) => Item::Cluster(Cluster {
                    options: self.options(o),
                    span,
                }),
                None => Item::Error(span),
            },
            Rule::schedule_item => {
                let pins = inner(p).map(|c| self.pin(c)).collect();
                let close = Span::new(
                    self.file,
                    span.end.saturating_sub(1) as usize,
                    span.end as usize,
                );
                Item::Schedule(Schedule { pins, close, span })
            }
            _ => Item::Error(span),
        }
    }

    fn model_decl(&mut self, p: P<'_>) -> ModelDecl {
        let span = self.span(&p);
        let mut it = inner(p);
        let name = it
            .next()
            .map(|c| self.ident(c))
            .unwrap_or_else(|| self.missing_ident(span));
        let source = match it.next() {
            Some(s) => self.source(s),
            None => Source {
                path: Path {
                    segments: vec![],
                    span,
                },
                args: self.empty_args(span),
                span,
            },
        };
        let options = it.next().map(|o| self.options(o));
        ModelDecl {
            name,
            source,
            options,
            span,
        }
    }

    fn source(&mut self, p: P<'_>) -> Source {
        let span = self.span(&p);
        let mut it = inner(p);
        let path = match it.next() {
            Some(c) => self.path(c),
            None => Path {
                segments: vec![],
                span,
            },
        };
        let args = match it.next() {
            Some(a) => self.args(a),
            None => self.empty_args(span),
        };
        Source { path, args, span }
    }

    fn empty_args(&self, span: Span) -> Args {
        Args {
            positional: vec![],
            named: vec![],
            span,
        }
    }

    fn missing_ident(&self, span: Span) -> Ident {
        Ident {
            name: String::new(),
            span,
        }
    }

    fn options(&mut self, p: P<'_>) -> Options {
        let span = self.span(&p);
        let mut entries: Vec<OptionEntry> = Vec::new();
        for o in inner(p) {
            let ospan = self.span(&o);
            let mut it = inner(o);
            let Some(k) = it.next() else { continue };
            let key = self.ident(k);
            let value = match it.next() {
                None => OptionValue::Flag,
                Some(v) if v.as_rule() == Rule::options => OptionValue::Record(self.options(v)),
                Some(v) => OptionValue::Expr(self.expr(v)),
            };
            entries.push(OptionEntry {
                key,
                value,
                span: ospan,
            });
        }
        Options { entries, span }
    }

    fn fn_decl(&mut self, p: P<'_>) -> FnDecl {
        let span = self.span(&p);
        let mut name = self.missing_ident(span);
        let mut params = Vec::new();
        let mut ret = TypeExpr::Named(self.missing_ident(span));
        let mut over = None;
        let mut body = None;
        for c in inner(p) {
            match c.as_rule() {
                Rule::ident => name = self.ident(c),
                Rule::fn_params => params = self.params(c),
                Rule::type_expr => ret = self.type_expr(c),
                Rule::over => over = inner(c).next().map(|i| self.ident(i)),
                Rule::fn_block => body = Some(self.block(c)),
                _ => {}
            }
        }
        let body = body.unwrap_or_else(|| Block {
            lets: vec![],
            value: Box::new(Expr {
                kind: ExprKind::Error,
                span,
            }),
            close: span,
            span,
        });
        FnDecl {
            name,
            params,
            ret,
            over,
            body,
            span,
        }
    }

    fn params(&mut self, p: P<'_>) -> Vec<Param> {
        inner(p)
            .map(|c| {
                let span = self.span(&c);
                let mut it = inner(c);
                let name = it
                    .next()
                    .map(|i| self.ident(i))
                    .unwrap_or_else(|| self.missing_ident(span));
                let ty = match it.next() {
                    Some(t) => self.type_expr(t),
                    None => TypeExpr::Named(self.missing_ident(span)),
                };
                let mut default = None;
                let mut where_ = None;
                for rest in it {
                    match rest.as_rule() {
                        Rule::where_clause => where_ = inner(rest).next().map(|e| self.expr(e)),
                        _ => default = Some(self.expr(rest)),
                    }
                }
                Param {
                    name,
                    ty,
                    default,
                    where_,
                    span,
                }
            })
            .collect()
    }

    fn type_expr(&mut self, p: P<'_>) -> TypeExpr {
        let span = self.span(&p);
        let Some(ty) = inner(p).next() else {
            return TypeExpr::Named(self.missing_ident(span));
        };
        match ty.as_rule() {
            Rule::fn_type => {
                let mut tys: Vec<TypeExpr> = inner(ty).map(|t| self.type_expr(t)).collect();
                let ret = tys
                    .pop()
                    .unwrap_or_else(|| TypeExpr::Named(self.missing_ident(span)));
                TypeExpr::Fn {
                    params: tys,
                    ret: Box::new(ret),
                    span,
                }
            }
            _ => TypeExpr::Named(self.ident(ty)),
        }
    }

    fn pipeline(&mut self, p: P<'_>) -> Pipeline {
        let span = self.span(&p);
        let mut name = self.missing_ident(span);
        let mut params = Vec::new();
        let mut settings = Vec::new();
        let mut models = Vec::new();
        let mut each: Option<Each> = None;
        // Members must come as params, then models, then one `each`.
        let mut stage = 0u8;
        for c in inner(p) {
            let cspan = self.span(&c);
            let (kind_stage, what) = match c.as_rule() {
                Rule::param_decl => (0, "`param`"),
                Rule::local_model => (1, "`model`"),
                Rule::each_block => (2, "`each`"),
                _ => (3, ""),
            };
            if kind_stage < 3 {
                if kind_stage < stage || (kind_stage == 2 && each.is_some()) {
                    if kind_stage == 2 {
                        self.diags.push(
                            Diagnostic::new(
                                Code::E0108,
                                "a pipeline has more than one `each`",
                                cspan,
                                "second `each`",
                            )
                            .with_label(each.as_ref().map_or(span, |e| e.span), "first `each`")
                            .with_help("a pipeline describes one iteration: merge the bodies into one `each`"),
                        );
                        continue;
                    }
                    let after = if stage == 2 { "`each`" } else { "`model`" };
                    self.diags.push(
                        Diagnostic::new(
                            Code::E0107,
                            format!("{what} after {after} in pipeline body"),
                            cspan,
                            format!("{what} here"),
                        )
                        .with_help("write a pipeline's `param`s first, then its local `model`s, then its `each`"),
                    );
                }
                stage = stage.max(kind_stage);
            }
            match c.as_rule() {
                Rule::ident => name = self.ident(c),
                Rule::params => params = self.params(c),
                Rule::param_decl => settings.push(self.param_decl(c)),
                Rule::local_model => models.push(self.model_decl(c)),
                Rule::each_block if each.is_none() => {
                    each = Some(self.each(c));
                }
                _ => {}
            }
        }
        if each.is_none() {
            self.diags.push(
                Diagnostic::new(
                    Code::E0108,
                    format!("pipeline `{}` has no `each`", name.name),
                    name.span,
                    "no `each` in this pipeline",
                )
                .with_help("add the body of one iteration: `each step in steps { … }`"),
            );
        }
        Pipeline {
            name,
            params,
            settings,
            models,
            each,
            span,
        }
    }

    fn param_decl(&mut self, p: P<'_>) -> ParamDecl {
        let span = self.span(&p);
        let mut name = self.missing_ident(span);
        let mut ty = TypeExpr::Named(self.missing_ident(span));
        let mut default = None;
        let mut where_ = None;
        for c in inner(p) {
            match c.as_rule() {
                Rule::ident => name = self.ident(c),
                Rule::type_expr => ty = self.type_expr(c),
                Rule::where_clause => where_ = inner(c).next().map(|e| self.expr(e)),
                _ => default = Some(self.expr(c)),
            }
        }
        ParamDecl {
            name,
            ty,
            default,
            where_,
            span,
        }
    }

    fn each(&mut self, p: P<'_>) -> Each {
        let span = self.span(&p);
        let mut it = inner(p);
        let var = it
            .next()
            .map(|i| self.ident(i))
            .unwrap_or_else(|| self.missing_ident(span));
        let count = match it.next() {
            Some(e) => self.expr(e),
            None => Expr {
                kind: ExprKind::Error,
                span,
            },
        };
        let stmts = it.map(|s| self.stmt(s)).collect();
        let close = Span::new(
            self.file,
            span.end.saturating_sub(1) as usize,
            span.end as usize,
        );
        Each {
            var,
            count,
            stmts,
            close,
            span,
        }
    }

    fn stmt(&mut self, p: P<'_>) -> Stmt {
        match p.as_rule() {
            Rule::let_stmt => Stmt::Let(self.let_stmt(p)),
            _ => {
                let span = self.span(&p);
                match inner(p).next() {
                    Some(e) => Stmt::Expr(self.expr(e)),
                    None => Stmt::Expr(Expr {
                        kind: ExprKind::Error,
                        span,
                    }),
                }
            }
        }
    }

    fn let_stmt(&mut self, p: P<'_>) -> Let {
        let span = self.span(&p);
        let mut it = inner(p);
        let name = it
            .next()
            .map(|i| self.ident(i))
            .unwrap_or_else(|| self.missing_ident(span));
        let value = match it.next() {
            Some(e) => self.expr(e),
            None => Expr {
                kind: ExprKind::Error,
                span,
            },
        };
        Let {
            name,
            value,
            metric: false,
            span,
        }
    }

    /// `metric NAME = EXPR`: kept among the block's `let`s, in order, marked as a metric.
    fn metric_stmt(&mut self, p: P<'_>) -> Let {
        let mut l = self.let_stmt(p);
        l.metric = true;
        l
    }

    fn block(&mut self, p: P<'_>) -> Block {
        let span = self.span(&p);
        let mut lets = Vec::new();
        let mut value = None;
        for c in inner(p) {
            match c.as_rule() {
                Rule::let_stmt => lets.push(self.let_stmt(c)),
                Rule::metric_stmt => lets.push(self.metric_stmt(c)),
                _ => value = Some(self.expr(c)),
            }
        }
        let value = Box::new(value.unwrap_or(Expr {
            kind: ExprKind::Error,
            span,
        }));
        let close = Span::new(
            self.file,
            span.end.saturating_sub(1) as usize,
            span.end as usize,
        );
        Block {
            lets,
            value,
            close,
            span,
        }
    }

    fn pin(&mut self, p: P<'_>) -> Pin {
        let span = self.span(&p);
        let rule = p.as_rule();
        let kids = children(p);
        let kind = match rule {
            Rule::pin_fuse => {
                if kids.first().is_some_and(|k| k.as_rule() == Rule::off) {
                    PinKind::FuseOff
                } else {
                    let mut sels: Vec<Selector> =
                        kids.into_iter().map(|k| self.selector(k)).collect();
                    let from = if sels.is_empty() {
                        self.missing_selector(span)
                    } else {
                        sels.remove(0)
                    };
                    PinKind::Fuse { from, to: sels }
                }
            }
            Rule::pin_migrate => match kids.into_iter().next() {
                Some(k) if k.as_rule() == Rule::off => PinKind::MigrateOff,
                Some(k) => {
                    let s = self.span(&k);
                    let percent = k
                        .as_str()
                        .replace('_', "")
                        .parse::<f64>()
                        .unwrap_or(f64::NAN);
                    PinKind::MigrateBelow { percent, span: s }
                }
                None => PinKind::MigrateOff,
            },
            Rule::pin_interleave => {
                PinKind::Interleave(kids.into_iter().map(|k| self.selector(k)).collect())
            }
            Rule::pin_place => {
                let mut it = kids.into_iter();
                let target = match it.next() {
                    Some(k) => self.selector(k),
                    None => self.missing_selector(span),
                };
                let from = it
                    .next()
                    .map(|k| self.int_lit(k))
                    .unwrap_or(IntLit { value: 0, span });
                let to = it
                    .next()
                    .map(|k| self.int_lit(k))
                    .unwrap_or(IntLit { value: 0, span });
                let mut layout = Vec::new();
                for l in it {
                    let mut li = inner(l);
                    if let (Some(k), Some(n)) = (li.next(), li.next()) {
                        let kind = match k.as_str().trim() {
                            "tp" => LayoutKind::Tp,
                            "pp" => LayoutKind::Pp,
                            _ => LayoutKind::Dp,
                        };
                        layout.push((kind, self.int_lit(n)));
                    }
                }
                PinKind::Place {
                    target,
                    from,
                    to,
                    layout,
                }
            }
            Rule::pin_speculate => {
                let mut target = None;
                let mut mode = SpeculateMode::Off;
                for k in kids {
                    match k.as_rule() {
                        Rule::selector => target = Some(self.selector(k)),
                        Rule::ngram => {
                            let mut ints = inner(k).map(|i| self.int_lit(i));
                            let n = ints.next().unwrap_or(IntLit { value: 0, span });
                            mode = SpeculateMode::Ngram {
                                n,
                                max: ints.next(),
                            };
                        }
                        Rule::draft => {
                            if let Some(i) = inner(k).next() {
                                mode = SpeculateMode::Draft(self.ident(i));
                            }
                        }
                        _ => mode = SpeculateMode::Off,
                    }
                }
                PinKind::Speculate { target, mode }
            }
            _ => {
                let mut it = kids.into_iter();
                let target = match it.next() {
                    Some(k) => self.selector(k),
                    None => self.missing_selector(span),
                };
                let size = it
                    .next()
                    .map(|k| self.int_lit(k))
                    .unwrap_or(IntLit { value: 0, span });
                PinKind::MicroBatch { target, size }
            }
        };
        Pin { kind, span }
    }

    fn missing_selector(&self, span: Span) -> Selector {
        Selector {
            op: self.missing_ident(span),
            model: None,
            span,
        }
    }

    fn selector(&mut self, p: P<'_>) -> Selector {
        let span = self.span(&p);
        let mut it = inner(p);
        let op = it
            .next()
            .map(|i| self.ident(i))
            .unwrap_or_else(|| self.missing_ident(span));
        let model = it.next().map(|i| self.ident(i));
        Selector { op, model, span }
    }

    fn int_lit(&mut self, p: P<'_>) -> IntLit {
        let span = self.span(&p);
        let value = self.int_value(p.as_str(), span);
        IntLit { value, span }
    }

    fn int_value(&mut self, text: &str, span: Span) -> i64 {
        match text.replace('_', "").parse::<i64>() {
            Ok(v) => v,
            Err(_) => {
                self.diags.push(
                    Diagnostic::new(
                        Code::E0103,
                        format!("integer `{text}` is too large"),
                        span,
                        "out of range",
                    )
                    .with_help(format!(
                        "integers range up to {}; write a float (`{text}.0`) for larger values",
                        i64::MAX
                    )),
                );
                0
            }
        }
    }

    fn ident(&self, p: P<'_>) -> Ident {
        let name = p.as_str();
        let span = self.span(&p);
        if KEYWORDS.contains(&name) {
            self.misused_keywords.borrow_mut().push(
                Diagnostic::new(
                    Code::E0101,
                    format!("`{name}` is a keyword, not a name"),
                    span,
                    "reserved word",
                )
                .with_help(format!("choose another name, such as `{name}_`")),
            );
        }
        Ident {
            name: name.to_string(),
            span,
        }
    }

    fn path(&self, p: P<'_>) -> Path {
        let span = self.span(&p);
        let segments = inner(p).map(|i| self.ident(i)).collect();
        Path { segments, span }
    }

    fn string(&mut self, p: P<'_>) -> StrLit {
        let span = self.span(&p);
        let raw = p.as_rule() == Rule::raw_string;
        let mut inner_text = "";
        let mut inner_start = span.start as usize;
        let mut terminated = false;
        for c in inner(p) {
            match c.as_rule() {
                Rule::string_inner | Rule::raw_inner => {
                    inner_text = c.as_str();
                    inner_start = c.as_span().start();
                }
                Rule::string_end => terminated = c.as_str() == "\"",
                _ => {}
            }
        }
        if !terminated {
            self.diags.push(
                Diagnostic::new(
                    Code::E0102,
                    "unterminated string",
                    span,
                    "this string has no closing `\"`",
                )
                .with_help(
                    "close the string with `\"` on the same line; write a line break as `\\n`",
                ),
            );
        }
        let value = if raw {
            inner_text.to_string()
        } else {
            self.unescape(inner_text, inner_start)
        };
        StrLit { value, raw, span }
    }

    fn unescape(&mut self, s: &str, start: usize) -> String {
        let mut out = String::with_capacity(s.len());
        let mut chars = s.char_indices().peekable();
        while let Some((i, c)) = chars.next() {
            if c != '\\' {
                out.push(c);
                continue;
            }
            let Some((j, e)) = chars.next() else { break };
            let ok = match e {
                'n' => Some('\n'),
                't' => Some('\t'),
                'r' => Some('\r'),
                '0' => Some('\0'),
                '\\' => Some('\\'),
                '"' => Some('"'),
                '\'' => Some('\''),
                'u' => {
                    // \u{XXXX}
                    let rest = &s[j + 1..];
                    let parsed = rest.strip_prefix('{').and_then(|r| {
                        let close = r.find('}')?;
                        let hex = &r[..close];
                        let cp = u32::from_str_radix(hex, 16).ok()?;
                        Some((char::from_u32(cp)?, close + 2))
                    });
                    match parsed {
                        Some((ch, consumed)) => {
                            for _ in 0..consumed {
                                chars.next();
                            }
                            Some(ch)
                        }
                        None => None,
                    }
                }
                _ => None,
            };
            match ok {
                Some(ch) => out.push(ch),
                None => {
                    let end = j + e.len_utf8();
                    let span = Span::new(self.file, start + i, start + end);
                    self.diags.push(
                        Diagnostic::new(Code::E0104, format!("unknown escape `\\{e}`"), span, "unknown escape")
                            .with_help("escapes are `\\n`, `\\t`, `\\r`, `\\0`, `\\\\`, `\\\"`, `\\'` and `\\u{…}`; for a regex write a raw string `r\"…\"`"),
                    );
                }
            }
        }
        out
    }

    fn args(&mut self, p: P<'_>) -> Args {
        let span = self.span(&p);
        let mut positional = Vec::new();
        let mut named: Vec<NamedArg> = Vec::new();
        for a in inner(p) {
            if a.as_rule() == Rule::named_arg {
                let aspan = self.span(&a);
                let mut it = inner(a);
                // An argument's name is a label, not a binding: keywords are allowed
                // (`adamw(schedule: "cosine")`).
                let name = it
                    .next()
                    .map(|i| Ident {
                        name: i.as_str().to_string(),
                        span: self.span(&i),
                    })
                    .unwrap_or_else(|| self.missing_ident(aspan));
                let value = match it.next() {
                    Some(e) => self.expr(e),
                    None => Expr {
                        kind: ExprKind::Error,
                        span: aspan,
                    },
                };
                named.push(NamedArg {
                    name,
                    value,
                    shorthand: false,
                    span: aspan,
                });
                continue;
            }
            let e = self.expr(a);
            if named.is_empty() {
                positional.push(e);
                continue;
            }
            // After a named argument, a bare name `x` means `x: x`.
            if let ExprKind::Path(path) = &e.kind
                && let Some(id) = path.as_single()
            {
                named.push(NamedArg {
                    name: id.clone(),
                    value: e.clone(),
                    shorthand: true,
                    span: e.span,
                });
                continue;
            }
            let first_named = named[0].span;
            self.diags.push(
                Diagnostic::new(
                    Code::E0106,
                    "positional argument after a named argument",
                    e.span,
                    "positional argument",
                )
                .with_label(first_named, "first named argument")
                .with_help(
                    "move positional arguments before named ones, or name this one: `name: value`",
                ),
            );
        }
        Args {
            positional,
            named,
            span,
        }
    }

    fn expr(&mut self, p: P<'_>) -> Expr {
        let span = self.span(&p);
        match p.as_rule() {
            Rule::expr_stmt => match inner(p).next() {
                Some(e) => self.expr(e),
                None => Expr {
                    kind: ExprKind::Error,
                    span,
                },
            },
            Rule::if_expr => {
                let mut it = inner(p);
                let cond = it.next().map(|c| self.expr(c));
                let then = it.next().map(|b| self.block(b));
                let else_ = it.next().map(|e| match e.as_rule() {
                    Rule::block => {
                        let b = self.block(e);
                        Expr {
                            span: b.span,
                            kind: ExprKind::Block(b),
                        }
                    }
                    _ => self.expr(e),
                });
                match (cond, then, else_) {
                    (Some(c), Some(t), Some(e)) => Expr {
                        kind: ExprKind::If {
                            cond: Box::new(c),
                            then: t,
                            else_: Box::new(e),
                        },
                        span,
                    },
                    _ => Expr {
                        kind: ExprKind::Error,
                        span,
                    },
                }
            }
            Rule::scan_expr => self.scan(p),
            Rule::bin_expr => self.bin_expr(p),
            Rule::operand => {
                // unary_op* primary (call_args | field | index)*: postfix binds tighter.
                let mut unary_ops = Vec::new();
                let mut e: Option<Expr> = None;
                for k in inner(p) {
                    match k.as_rule() {
                        Rule::unary_op => unary_ops.push((k.as_str() == "-", self.span(&k))),
                        Rule::call_args | Rule::field | Rule::index => {
                            if let Some(base) = e.take() {
                                e = Some(self.postfix(base, k));
                            }
                        }
                        _ => e = Some(self.expr(k)),
                    }
                }
                let mut e = e.unwrap_or(Expr {
                    kind: ExprKind::Error,
                    span,
                });
                for (neg, op_span) in unary_ops.into_iter().rev() {
                    let op = if neg { UnaryOp::Neg } else { UnaryOp::Not };
                    let s = op_span.to(e.span);
                    e = Expr {
                        kind: ExprKind::Unary {
                            op,
                            operand: Box::new(e),
                        },
                        span: s,
                    };
                }
                e
            }
            Rule::paren => match inner(p).next() {
                Some(inner) => Expr {
                    kind: ExprKind::Paren(Box::new(self.expr(inner))),
                    span,
                },
                None => Expr {
                    kind: ExprKind::Error,
                    span,
                },
            },
            Rule::int => {
                let v = self.int_value(p.as_str(), span);
                Expr {
                    kind: ExprKind::Int(v),
                    span,
                }
            }
            Rule::float => {
                let text = p.as_str().replace('_', "");
                match text.parse::<f64>() {
                    Ok(v) if v.is_finite() => Expr {
                        kind: ExprKind::Float(v),
                        span,
                    },
                    _ => {
                        self.diags.push(
                            Diagnostic::new(
                                Code::E0103,
                                format!("number `{}` is out of range", p.as_str()),
                                span,
                                "not a finite float",
                            )
                            .with_help("floats range up to about 1.8e308"),
                        );
                        Expr {
                            kind: ExprKind::Float(0.0),
                            span,
                        }
                    }
                }
            }
            Rule::string | Rule::raw_string => Expr {
                kind: ExprKind::Str(self.string(p)),
                span,
            },
            Rule::bool_lit => Expr {
                kind: ExprKind::Bool(p.as_str().starts_with('t')),
                span,
            },
            Rule::path => Expr {
                kind: ExprKind::Path(self.path(p)),
                span,
            },
            _ => Expr {
                kind: ExprKind::Error,
                span,
            },
        }
    }

    fn scan(&mut self, p: P<'_>) -> Expr {
        let span = self.span(&p);
        let mut reverse = false;
        let mut idents = Vec::new();
        let mut init = None;
        let mut body = None;
        for c in inner(p) {
            match c.as_rule() {
                Rule::reverse => reverse = true,
                Rule::ident => idents.push(self.ident(c)),
                Rule::scan_body => body = Some(c),
                _ => init = Some(self.expr(c)),
            }
        }
        let (Some(var), Some(acc), Some(init), Some(body)) =
            (idents.first().cloned(), idents.get(1).cloned(), init, body)
        else {
            return Expr {
                kind: ExprKind::Error,
                span,
            };
        };
        let bspan = self.span(&body);
        let mut lets = Vec::new();
        let mut target = None;
        let mut value = None;
        for c in inner(body) {
            match c.as_rule() {
                Rule::let_stmt => lets.push(self.let_stmt(c)),
                Rule::ident => target = Some(self.ident(c)),
                _ => value = Some(self.expr(c)),
            }
        }
        let target = target.unwrap_or_else(|| self.missing_ident(bspan));
        if target.name != acc.name {
            self.diags.push(
                Diagnostic::new(
                    Code::E0109,
                    format!(
                        "`scan` body assigns `{}`, not its accumulator `{}`",
                        target.name, acc.name
                    ),
                    target.span,
                    "assigned here",
                )
                .with_label(acc.span, "the accumulator")
                .with_help(format!(
                    "end the body with `{} = …`; use `let` for other names",
                    acc.name
                )),
            );
        }
        let value = value.unwrap_or(Expr {
            kind: ExprKind::Error,
            span: bspan,
        });
        let close = Span::new(
            self.file,
            bspan.end.saturating_sub(1) as usize,
            bspan.end as usize,
        );
        let scan = Scan {
            reverse,
            var,
            acc,
            init: Box::new(init),
            lets,
            target,
            value: Box::new(value),
            close,
        };
        Expr {
            kind: ExprKind::Scan(scan),
            span,
        }
    }

    fn postfix(&mut self, base: Expr, op: P<'_>) -> Expr {
        let op_span = self.span(&op);
        let s = base.span.to(op_span);
        let kind = match op.as_rule() {
            Rule::call_args => {
                let args = match inner(op).next() {
                    Some(a) => self.args(a),
                    None => self.empty_args(op_span),
                };
                ExprKind::Call {
                    callee: Box::new(base),
                    args,
                }
            }
            Rule::field => {
                let name = match inner(op).next() {
                    Some(i) => self.ident(i),
                    None => self.missing_ident(op_span),
                };
                ExprKind::Field {
                    base: Box::new(base),
                    name,
                }
            }
            _ => {
                let index = match inner(op).next() {
                    Some(i) => self.expr(i),
                    None => Expr {
                        kind: ExprKind::Error,
                        span: op_span,
                    },
                };
                ExprKind::Index {
                    base: Box::new(base),
                    index: Box::new(index),
                }
            }
        };
        Expr { kind, span: s }
    }

    /// A flat `operand (op operand)*` list, folded by precedence (all operators are
    /// left-associative). A comparison whose operand is itself an unparenthesised comparison is
    /// E0105: the language does not chain comparisons.
    fn bin_expr(&mut self, p: P<'_>) -> Expr {
        let span = self.span(&p);
        let mut operands: Vec<Expr> = Vec::new();
        let mut ops: Vec<(BinaryOp, Span)> = Vec::new();
        for k in inner(p) {
            if k.as_rule() == Rule::bin_op {
                let op = match k.as_str().trim() {
                    "||" => BinaryOp::Or,
                    "&&" => BinaryOp::And,
                    "==" => BinaryOp::Eq,
                    "!=" => BinaryOp::Ne,
                    "<" => BinaryOp::Lt,
                    "<=" => BinaryOp::Le,
                    ">" => BinaryOp::Gt,
                    ">=" => BinaryOp::Ge,
                    "+" => BinaryOp::Add,
                    "-" => BinaryOp::Sub,
                    "*" => BinaryOp::Mul,
                    "/" => BinaryOp::Div,
                    _ => BinaryOp::Rem,
                };
                ops.push((op, self.span(&k)));
            } else {
                operands.push(self.expr(k));
            }
        }
        if operands.is_empty() {
            return Expr {
                kind: ExprKind::Error,
                span,
            };
        }
        let mut operands = operands.into_iter();
        let mut ops = ops.into_iter().peekable();
        let first = operands.next().unwrap_or(Expr {
            kind: ExprKind::Error,
            span,
        });
        self.climb(first, &mut operands, &mut ops, 0, &mut Vec::new())
    }

    fn climb(
        &mut self,
        mut lhs: Expr,
        operands: &mut std::vec::IntoIter<Expr>,
        ops: &mut std::iter::Peekable<std::vec::IntoIter<(BinaryOp, Span)>>,
        min_prec: u8,
        ops_seen: &mut Vec<(Span, Span)>,
    ) -> Expr {
        while let Some(&(op, op_span)) = ops.peek() {
            let prec = op.precedence();
            if prec < min_prec {
                break;
            }
            ops.next();
            let mut rhs = operands.next().unwrap_or(Expr {
                kind: ExprKind::Error,
                span: op_span,
            });
            while let Some(&(next, _)) = ops.peek() {
                if next.precedence() <= prec {
                    break;
                }
                rhs = self.climb(rhs, operands, ops, prec + 1, ops_seen);
            }
            let s = lhs.span.to(rhs.span);
            if op.is_comparison()
                && let Some(first) = comparison_op_span(&lhs, ops_seen)
            {
                self.diags.push(
                    Diagnostic::new(
                        Code::E0105,
                        "comparisons cannot be chained",
                        op_span,
                        "second comparison",
                    )
                    .with_label(first, "first comparison")
                    .with_help("join two comparisons with `&&`: `a < b && b < c`"),
                );
                // The chain's meaning is unknown; typing it would only add a second error.
                lhs = Expr {
                    kind: ExprKind::Error,
                    span: s,
                };
                continue;
            }
            ops_seen.push((s, op_span));
            lhs = Expr {
                kind: ExprKind::Binary {
                    op,
                    lhs: Box::new(lhs),
                    rhs: Box::new(rhs),
                },
                span: s,
            };
        }
        lhs
    }
}
