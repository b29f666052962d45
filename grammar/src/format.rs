//! `braid fmt`: the canonical layout of a `.rlhf` file.
//!
//! The formatter prints the syntax tree, not the text, so layout is canonical; it keeps every
//! comment (found lexically, placed by position), keeps at most one blank line where the source
//! had any, and keeps a block multi-line when the source wrote it so or when it does not fit in
//! [`WIDTH`] columns. Each decision depends only on the tree and on facts that formatting
//! preserves, so `format(format(x)) == format(x)` (tested on every example and on random
//! mutants). It refuses files with syntax errors rather than guess.

use braid_diagnostics::{Diagnostic, FileId, Span};

use crate::ast::*;
use crate::comments::{self, Comment};

/// The line width the formatter aims for.
pub const WIDTH: usize = 100;
const INDENT: &str = "  ";

/// Formats a file, or returns its syntax errors.
pub fn format(text: &str) -> Result<String, Vec<Diagnostic>> {
    let (file, diags) = crate::parse(text, FileId(0));
    let errors: Vec<Diagnostic> = diags.into_iter().filter(|d| d.is_error()).collect();
    if !errors.is_empty() {
        return Err(errors);
    }
    let mut p = Printer {
        text,
        comments: comments::scan(text),
        next: 0,
        out: String::new(),
        indent: 0,
        last_end: 0,
    };
    p.file(&file);
    Ok(p.out)
}

struct Printer<'a> {
    text: &'a str,
    comments: Vec<Comment>,
    /// The first comment not yet printed.
    next: usize,
    out: String,
    indent: usize,
    /// Source offset of the end of the last thing printed, for blank-line decisions.
    last_end: usize,
}

impl Printer<'_> {
    fn src(&self, span: Span) -> &str {
        self.text
            .get(span.start as usize..span.end as usize)
            .unwrap_or("")
    }

    fn column(&self) -> usize {
        self.out.len() - self.out.rfind('\n').map_or(0, |i| i + 1)
    }

    fn is_multiline_in_source(&self, span: Span) -> bool {
        self.src(span).contains('\n')
    }

    fn has_comment_within(&self, span: Span) -> bool {
        self.comments[self.next..]
            .iter()
            .any(|c| c.start >= span.start as usize && c.end <= span.end as usize)
    }

    /// Starts a new line at the current indent.
    fn newline(&mut self) {
        while self.out.ends_with(' ') {
            self.out.pop();
        }
        self.out.push('\n');
    }

    fn write_indent(&mut self) {
        for _ in 0..self.indent {
            self.out.push_str(INDENT);
        }
    }

    /// Whether the source has a blank line between `from` and `to`.
    fn blank_between(&self, from: usize, to: usize) -> bool {
        let s = self.text.get(from.min(to)..to).unwrap_or("");
        s.bytes().filter(|&b| b == b'\n').count() >= 2
    }

    /// Prints the comments that start before `pos` on their own lines, and a blank line before
    /// the node at `pos` if the source had one. `first` is true for the first line of a block,
    /// which never starts with a blank line.
    fn leading(&mut self, pos: usize, first: bool) {
        let before = self.next;
        self.leading_comments_only(pos, first);
        let first = first && self.next == before;
        if !first && self.blank_between(self.last_end, pos) {
            self.newline();
        }
    }

    /// Prints a comment that follows `end` on the same source line, then ends the line.
    fn trailing(&mut self, end: usize) {
        self.last_end = self.last_end.max(end);
        if let Some(c) = self.comments.get(self.next).cloned() {
            let between = self.text.get(end.min(c.start)..c.start).unwrap_or("\n");
            if c.start >= end && !between.contains('\n') {
                self.out.push_str("  ");
                self.out.push_str(&c.text);
                self.next += 1;
                self.last_end = c.end;
            }
        }
        self.newline();
    }

    /// Prints one line-level node: leading comments, indent, `body`, trailing comment.
    fn line(&mut self, span: Span, first: bool, body: impl FnOnce(&mut Self)) {
        self.leading(span.start as usize, first);
        self.write_indent();
        body(self);
        self.trailing(span.end as usize);
    }

    /// Prints the comments left before a closing brace at `close`, inside the block.
    fn before_close(&mut self, close: Span, block_empty: bool) {
        self.indent += 1;
        self.leading_comments_only(close.start as usize, block_empty);
        self.indent -= 1;
        self.write_indent();
    }

    fn leading_comments_only(&mut self, pos: usize, first: bool) {
        let mut first = first;
        while self.next < self.comments.len() && self.comments[self.next].start < pos {
            let c = self.comments[self.next].clone();
            self.next += 1;
            if !first && self.blank_between(self.last_end, c.start) {
                self.newline();
            }
            self.write_indent();
            self.out.push_str(&c.text);
            self.newline();
            self.last_end = c.end;
            first = false;
        }
    }

    fn file(&mut self, f: &File) {
        for (i, item) in f.items.iter().enumerate() {
            self.item(item, i == 0);
        }
        self.leading_comments_only(self.text.len() + 1, f.items.is_empty());
        while self.out.ends_with("\n\n") {
            self.out.pop();
        }
        if self.out.starts_with('\n') {
            self.out = self.out.trim_start_matches('\n').to_string();
        }
    }

    fn item(&mut self, item: &Item, first: bool) {
        let span = item.span();
        match item {
            Item::Use(u) => self.line(span, first, |p| {
                p.out.push_str("use ");
                match &u.target {
                    UseTarget::Path(path) => p.out.push_str(&path.text()),
                    UseTarget::File(s) => {
                        let lit = p.src(s.span).to_string();
                        p.out.push_str(&lit);
                    }
                }
            }),
            Item::Model(m) => self.decl("model", m, first),
            Item::Dataset(d) => self.decl("dataset", d, first),
            Item::Fn(f) => self.fn_decl(f, first),
            Item::Pipeline(pl) => self.pipeline(pl, first),
            Item::Run(r) => {
                self.leading(span.start as usize, first);
                self.write_indent();
                self.out.push_str("run ");
                self.out.push_str(&r.pipeline.text());
                self.args(&r.args);
                if let Some(o) = &r.settings {
                    self.out.push(' ');
                    self.options(o);
                }
                self.trailing(span.end as usize);
            }
            Item::Cluster(c) => {
                self.leading(span.start as usize, first);
                self.write_indent();
                self.out.push_str("cluster ");
                self.options(&c.options);
                self.trailing(span.end as usize);
            }
            Item::Schedule(s) => {
                self.leading(span.start as usize, first);
                self.write_indent();
                if s.pins.is_empty() && !self.has_comment_within(s.span) {
                    self.out.push_str("schedule {}");
                } else {
                    self.out.push_str("schedule {");
                    self.newline();
                    self.indent += 1;
                    for (i, pin) in s.pins.iter().enumerate() {
                        self.line(pin.span, i == 0, |p| p.pin(pin));
                    }
                    self.indent -= 1;
                    self.before_close(s.close, s.pins.is_empty());
                    self.out.push('}');
                }
                self.trailing(span.end as usize);
            }
            Item::Error(_) => {
                // `format` refuses files with errors, so error items never reach the printer.
                let t = self.src(span).to_string();
                self.out.push_str(&t);
                self.newline();
            }
        }
    }

    fn decl(&mut self, kw: &str, m: &ModelDecl, first: bool) {
        self.leading(m.span.start as usize, first);
        self.write_indent();
        self.out.push_str(kw);
        self.out.push(' ');
        self.out.push_str(&m.name.name);
        self.out.push_str(" = ");
        self.source(&m.source);
        if let Some(o) = &m.options {
            self.out.push(' ');
            self.options(o);
        }
        self.trailing(m.span.end as usize);
    }

    fn source(&mut self, s: &Source) {
        self.out.push_str(&s.path.text());
        self.args(&s.args);
    }

    fn options(&mut self, o: &Options) {
        if o.entries.is_empty() && !self.has_comment_within(o.span) {
            self.out.push_str("{}");
            return;
        }
        let flat = self.flat_options(o);
        let multiline = self.is_multiline_in_source(o.span) || self.has_comment_within(o.span);
        match flat {
            Some(f) if !multiline && self.column() + f.len() <= WIDTH => self.out.push_str(&f),
            _ => {
                self.out.push('{');
                self.newline();
                self.indent += 1;
                for (i, e) in o.entries.iter().enumerate() {
                    self.line(e.span, i == 0, |p| p.option_entry(e));
                }
                self.indent -= 1;
                self.before_close(
                    Span {
                        start: o.span.end.saturating_sub(1),
                        ..o.span
                    },
                    o.entries.is_empty(),
                );
                self.out.push('}');
            }
        }
    }

    fn option_entry(&mut self, e: &OptionEntry) {
        self.out.push_str(&e.key.name);
        match &e.value {
            OptionValue::Flag => {}
            OptionValue::Expr(x) => {
                self.out.push_str(": ");
                self.expr(x);
            }
            OptionValue::Record(r) => {
                self.out.push_str(": ");
                self.options(r);
            }
        }
    }

    fn flat_options(&self, o: &Options) -> Option<String> {
        let mut parts = Vec::new();
        for e in &o.entries {
            let mut s = e.key.name.clone();
            match &e.value {
                OptionValue::Flag => {}
                OptionValue::Expr(x) => {
                    s.push_str(": ");
                    s.push_str(&self.flat(x)?);
                }
                OptionValue::Record(r) => {
                    if self.is_multiline_in_source(r.span) {
                        return None;
                    }
                    s.push_str(": ");
                    s.push_str(&self.flat_options(r)?);
                }
            }
            parts.push(s);
        }
        Some(format!("{{ {} }}", parts.join(", ")))
    }

    fn params(&self, ps: &[Param]) -> Option<String> {
        Some(self.param_texts(ps)?.join(", "))
    }

    fn param_texts(&self, ps: &[Param]) -> Option<Vec<String>> {
        let mut parts = Vec::new();
        for p in ps {
            let mut s = format!("{}: {}", p.name.name, type_text(&p.ty));
            if let Some(d) = &p.default {
                s.push_str(" = ");
                s.push_str(&self.flat(d)?);
            }
            if let Some(w) = &p.where_ {
                s.push_str(" where ");
                s.push_str(&self.flat(w)?);
            }
            parts.push(s);
        }
        Some(parts)
    }

    fn fn_decl(&mut self, f: &FnDecl, first: bool) {
        self.leading(f.span.start as usize, first);
        self.write_indent();
        self.out.push_str("fn ");
        self.out.push_str(&f.name.name);
        self.out.push('(');
        let params = self.param_texts(&f.params).unwrap_or_default();
        let flat = params.join(", ");
        // One parameter per line when the source wrote them so, or when the signature does not
        // fit: both facts survive formatting, so the choice is stable.
        let multiline_in_source = match (f.params.first(), f.params.last()) {
            (Some(a), Some(b)) => self.is_multiline_in_source(Span::new(
                a.span.file,
                a.span.start as usize,
                b.span.end as usize,
            )),
            _ => false,
        };
        // `) -> RET over SCOPE {`
        let tail =
            5 + type_text(&f.ret).len() + f.over.as_ref().map_or(0, |o| 6 + o.name.len()) + 2;
        if multiline_in_source || self.column() + flat.len() + tail > WIDTH {
            self.newline();
            self.indent += 1;
            for (i, (p, text)) in f.params.iter().zip(&params).enumerate() {
                self.line(p.span, i == 0, |pr| {
                    pr.out.push_str(text);
                    pr.out.push(',');
                });
            }
            self.indent -= 1;
            self.write_indent();
        } else {
            self.out.push_str(&flat);
        }
        self.out.push_str(") -> ");
        self.out.push_str(&type_text(&f.ret));
        if let Some(o) = &f.over {
            self.out.push_str(" over ");
            self.out.push_str(&o.name);
        }
        self.out.push(' ');
        self.block_lines(&f.body);
        self.trailing(f.span.end as usize);
    }

    /// A block always printed on several lines: `{`, its lets and value, `}`.
    fn block_lines(&mut self, b: &Block) {
        self.out.push('{');
        self.newline();
        self.indent += 1;
        for (i, l) in b.lets.iter().enumerate() {
            self.line(l.span, i == 0, |p| p.let_stmt(l));
        }
        let v = &b.value;
        self.line(v.span, b.lets.is_empty(), |p| p.expr(v));
        self.indent -= 1;
        self.before_close(b.close, false);
        self.out.push('}');
    }

    fn let_stmt(&mut self, l: &Let) {
        self.out.push_str(if l.metric { "metric " } else { "let " });
        self.out.push_str(&l.name.name);
        self.out.push_str(" = ");
        self.expr(&l.value);
    }

    fn pipeline(&mut self, pl: &Pipeline, first: bool) {
        self.leading(pl.span.start as usize, first);
        self.write_indent();
        self.out.push_str("pipeline ");
        self.out.push_str(&pl.name.name);
        self.out.push('(');
        let params = self.params(&pl.params).unwrap_or_default();
        self.out.push_str(&params);
        self.out.push_str(") {");
        self.newline();
        self.indent += 1;
        let mut first_member = true;
        for s in &pl.settings {
            self.line(s.span, first_member, |p| {
                p.out.push_str("param ");
                p.out.push_str(&s.name.name);
                p.out.push_str(": ");
                p.out.push_str(&type_text(&s.ty));
                if let Some(d) = &s.default {
                    p.out.push_str(" = ");
                    p.expr(d);
                }
                if let Some(w) = &s.where_ {
                    p.out.push_str(" where ");
                    p.expr(w);
                }
            });
            first_member = false;
        }
        for m in &pl.models {
            self.decl("model", m, first_member);
            first_member = false;
        }
        if let Some(e) = &pl.each {
            self.leading(e.span.start as usize, first_member);
            self.write_indent();
            self.out.push_str("each ");
            self.out.push_str(&e.var.name);
            self.out.push_str(" in ");
            self.expr(&e.count);
            self.out.push_str(" {");
            self.newline();
            self.indent += 1;
            for (i, s) in e.stmts.iter().enumerate() {
                self.line(s.span(), i == 0, |p| match s {
                    Stmt::Let(l) => p.let_stmt(l),
                    Stmt::Expr(x) => p.expr(x),
                });
            }
            self.indent -= 1;
            self.before_close(e.close, e.stmts.is_empty());
            self.out.push('}');
            self.trailing(e.span.end as usize);
        }
        self.indent -= 1;
        self.before_close(
            Span {
                start: pl.span.end.saturating_sub(1),
                ..pl.span
            },
            false,
        );
        self.out.push('}');
        self.trailing(pl.span.end as usize);
    }

    fn pin(&mut self, pin: &Pin) {
        let sel = |s: &Selector| match &s.model {
            Some(m) => format!("{}({})", s.op.name, m.name),
            None => s.op.name.clone(),
        };
        let text = match &pin.kind {
            PinKind::FuseOff => "fuse off".to_string(),
            PinKind::Fuse { from, to } => {
                format!(
                    "fuse {} -> {}",
                    sel(from),
                    to.iter().map(sel).collect::<Vec<_>>().join(", ")
                )
            }
            PinKind::MigrateOff => "migrate off".to_string(),
            PinKind::MigrateBelow { span, .. } => format!("migrate below {}%", self.src(*span)),
            PinKind::Interleave(s) => format!(
                "interleave {}",
                s.iter().map(sel).collect::<Vec<_>>().join(", ")
            ),
            PinKind::Place {
                target,
                from,
                to,
                layout,
            } => {
                let mut s = format!("place {} on {}..{}", sel(target), from.value, to.value);
                for (k, n) in layout {
                    s.push_str(&format!(" {} {}", k.as_str(), n.value));
                }
                s
            }
            PinKind::Speculate { target, mode } => {
                let mut s = "speculate".to_string();
                if let Some(t) = target {
                    s.push(' ');
                    s.push_str(&sel(t));
                }
                match mode {
                    SpeculateMode::Off => s.push_str(" off"),
                    SpeculateMode::Ngram { n, max } => {
                        s.push_str(&format!(" ngram({})", n.value));
                        if let Some(m) = max {
                            s.push_str(&format!(" max {}", m.value));
                        }
                    }
                    SpeculateMode::Draft(d) => s.push_str(&format!(" draft({})", d.name)),
                }
                s
            }
            PinKind::MicroBatch { target, size } => {
                format!("micro_batch {} {}", sel(target), size.value)
            }
        };
        self.out.push_str(&text);
    }

    fn args(&mut self, a: &Args) {
        self.out.push('(');
        let mut first = true;
        for e in &a.positional {
            if !first {
                self.out.push_str(", ");
            }
            first = false;
            self.expr(e);
        }
        for n in &a.named {
            if !first {
                self.out.push_str(", ");
            }
            first = false;
            self.out.push_str(&n.name.name);
            if !n.shorthand {
                self.out.push_str(": ");
                self.expr(&n.value);
            }
        }
        self.out.push(')');
    }

    /// Prints an expression at the current position. `if` and `scan` may span several lines.
    fn expr(&mut self, e: &Expr) {
        match &e.kind {
            ExprKind::If { cond, then, else_ } => {
                let flat = self.flat(e);
                let multiline =
                    self.is_multiline_in_source(e.span) || self.has_comment_within(e.span);
                match flat {
                    Some(f) if !multiline && self.column() + f.len() <= WIDTH => {
                        self.out.push_str(&f)
                    }
                    _ => {
                        self.out.push_str("if ");
                        self.expr(cond);
                        self.out.push(' ');
                        self.block_lines(then);
                        self.out.push_str(" else ");
                        match &else_.kind {
                            ExprKind::Block(b) => self.block_lines(b),
                            _ => self.expr(else_),
                        }
                    }
                }
            }
            ExprKind::Block(b) => self.block_lines(b),
            ExprKind::Scan(s) => {
                self.out.push_str("scan ");
                if s.reverse {
                    self.out.push_str("reverse ");
                }
                self.out
                    .push_str(&format!("{} with {} = ", s.var.name, s.acc.name));
                self.expr(&s.init);
                self.out.push_str(" {");
                self.newline();
                self.indent += 1;
                for (i, l) in s.lets.iter().enumerate() {
                    self.line(l.span, i == 0, |p| p.let_stmt(l));
                }
                let target_span = s.target.span.to(s.value.span);
                self.line(target_span, s.lets.is_empty(), |p| {
                    p.out.push_str(&s.target.name);
                    p.out.push_str(" = ");
                    p.expr(&s.value);
                });
                self.indent -= 1;
                self.before_close(s.close, false);
                self.out.push('}');
            }
            ExprKind::Call { callee, args } => {
                self.expr(callee);
                self.args(args);
            }
            ExprKind::Field { base, name } => {
                self.expr(base);
                self.out.push('.');
                self.out.push_str(&name.name);
            }
            ExprKind::Index { base, index } => {
                self.expr(base);
                self.out.push('[');
                self.expr(index);
                self.out.push(']');
            }
            ExprKind::Unary { op, operand } => {
                self.out.push(if *op == UnaryOp::Neg { '-' } else { '!' });
                self.expr(operand);
            }
            ExprKind::Binary { op, lhs, rhs } => {
                self.expr(lhs);
                self.out.push(' ');
                self.out.push_str(op.as_str());
                self.out.push(' ');
                self.expr(rhs);
            }
            ExprKind::Paren(inner) => {
                self.out.push('(');
                self.expr(inner);
                self.out.push(')');
            }
            _ => {
                let t = self.flat(e).unwrap_or_default();
                self.out.push_str(&t);
            }
        }
    }

    /// The one-line form of an expression, or `None` if it needs several lines.
    fn flat(&self, e: &Expr) -> Option<String> {
        Some(match &e.kind {
            ExprKind::Int(_) | ExprKind::Float(_) | ExprKind::Str(_) | ExprKind::Bool(_) => {
                self.src(e.span).to_string()
            }
            ExprKind::Path(p) => p.text(),
            ExprKind::Call { callee, args } => {
                let mut parts: Vec<String> = Vec::new();
                for x in &args.positional {
                    parts.push(self.flat(x)?);
                }
                for n in &args.named {
                    if n.shorthand {
                        parts.push(n.name.name.clone());
                    } else {
                        parts.push(format!("{}: {}", n.name.name, self.flat(&n.value)?));
                    }
                }
                format!("{}({})", self.flat(callee)?, parts.join(", "))
            }
            ExprKind::Field { base, name } => format!("{}.{}", self.flat(base)?, name.name),
            ExprKind::Index { base, index } => {
                format!("{}[{}]", self.flat(base)?, self.flat(index)?)
            }
            ExprKind::Unary { op, operand } => {
                format!(
                    "{}{}",
                    if *op == UnaryOp::Neg { "-" } else { "!" },
                    self.flat(operand)?
                )
            }
            ExprKind::Binary { op, lhs, rhs } => {
                format!("{} {} {}", self.flat(lhs)?, op.as_str(), self.flat(rhs)?)
            }
            ExprKind::Paren(inner) => format!("({})", self.flat(inner)?),
            ExprKind::If { cond, then, else_ } => {
                if !then.lets.is_empty() {
                    return None;
                }
                let else_text = match &else_.kind {
                    ExprKind::Block(b) if b.lets.is_empty() => {
                        format!("{{ {} }}", self.flat(&b.value)?)
                    }
                    ExprKind::Block(_) => return None,
                    _ => self.flat(else_)?,
                };
                format!(
                    "if {} {{ {} }} else {}",
                    self.flat(cond)?,
                    self.flat(&then.value)?,
                    else_text
                )
            }
            ExprKind::Block(_) | ExprKind::Scan(_) | ExprKind::Error => return None,
        })
    }
}

fn type_text(t: &TypeExpr) -> String {
    match t {
        TypeExpr::Named(i) => i.name.clone(),
        TypeExpr::Fn { params, ret, .. } => format!(
            "fn({}) -> {}",
            params.iter().map(type_text).collect::<Vec<_>>().join(", "),
            type_text(ret)
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fmt(s: &str) -> String {
        format(s).unwrap_or_else(|d| panic!("{d:#?}"))
    }

    #[test]
    fn canonical_spacing_and_comments_kept() {
        let src = "// head\nuse   std::grpo\n\n\n\nmodel p=tiny( layers:2 ){train:adamw(lr:3e-4)} // trailing\nfn f(s:Sample)->float{\n// inside\nlet x=1\nx+2*(3-1)\n}\n";
        let out = fmt(src);
        assert_eq!(
            out,
            "// head\nuse std::grpo\n\nmodel p = tiny(layers: 2) { train: adamw(lr: 3e-4) }  // trailing\nfn f(s: Sample) -> float {\n  // inside\n  let x = 1\n  x + 2 * (3 - 1)\n}\n"
        );
        assert_eq!(fmt(&out), out);
    }

    #[test]
    fn multiline_options_stay_multiline() {
        let src = "run grpo(a, b, reward: r) {\n  steps: 60, batch: 16\n  group: 4\n}\n";
        let out = fmt(src);
        assert_eq!(
            out,
            "run grpo(a, b, reward: r) {\n  steps: 60\n  batch: 16\n  group: 4\n}\n"
        );
        assert_eq!(fmt(&out), out);
    }

    #[test]
    fn refuses_files_with_syntax_errors() {
        assert!(format("model = \n").is_err());
    }
}
