//! The syntax tree of a `.rlhf` file, as written: every node keeps its [`Span`].
//!
//! The tree is what the parser could build; parts it could not parse are `Item::Error` or
//! `ExprKind::Error` nodes, and the diagnostics say why. Nothing here is resolved or typed:
//! names are plain strings, and meaning comes later, in `braid-sema`.

use braid_diagnostics::Span;

#[derive(Debug, Clone, PartialEq)]
pub struct Ident {
    pub name: String,
    pub span: Span,
}

/// `a::b::c`.
#[derive(Debug, Clone, PartialEq)]
pub struct Path {
    pub segments: Vec<Ident>,
    pub span: Span,
}

impl Path {
    /// The segments joined by `::`.
    pub fn text(&self) -> String {
        self.segments
            .iter()
            .map(|s| s.name.as_str())
            .collect::<Vec<_>>()
            .join("::")
    }

    /// The single segment of a one-segment path.
    pub fn as_single(&self) -> Option<&Ident> {
        match self.segments.as_slice() {
            [one] => Some(one),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct File {
    pub items: Vec<Item>,
    pub span: Span,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Item {
    Use(Use),
    Model(ModelDecl),
    Dataset(DatasetDecl),
    Fn(FnDecl),
    Pipeline(Pipeline),
    Run(Run),
    Cluster(Cluster),
    Schedule(Schedule),
    /// Text the parser skipped after an error.
    Error(Span),
}

impl Item {
    pub fn span(&self) -> Span {
        match self {
            Item::Use(x) => x.span,
            Item::Model(x) | Item::Dataset(x) => x.span,
            Item::Fn(x) => x.span,
            Item::Pipeline(x) => x.span,
            Item::Run(x) => x.span,
            Item::Cluster(x) => x.span,
            Item::Schedule(x) => x.span,
            Item::Error(s) => *s,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub enum UseTarget {
    /// `use std::grpo`
    Path(Path),
    /// `use "./shared.rlhf"`
    File(StrLit),
}

#[derive(Debug, Clone, PartialEq)]
pub struct Use {
    pub target: UseTarget,
    pub span: Span,
}

/// `model NAME = SOURCE { options }` and `dataset NAME = SOURCE { options }`, at top level or
/// (models only) inside a pipeline.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelDecl {
    pub name: Ident,
    pub source: Source,
    pub options: Option<Options>,
    pub span: Span,
}

pub type DatasetDecl = ModelDecl;

/// `tiny(...)`, `hf("dir")`, `frozen(m)`, `jsonl("f")`, `synthetic::letters(...)`.
#[derive(Debug, Clone, PartialEq)]
pub struct Source {
    pub path: Path,
    pub args: Args,
    pub span: Span,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Options {
    pub entries: Vec<OptionEntry>,
    pub span: Span,
}

#[derive(Debug, Clone, PartialEq)]
pub struct OptionEntry {
    pub key: Ident,
    pub value: OptionValue,
    pub span: Span,
}

#[derive(Debug, Clone, PartialEq)]
pub enum OptionValue {
    /// A bare key: `key` means `key: true`.
    Flag,
    Expr(Expr),
    /// A nested record: `fields: { prompt: "question" }`.
    Record(Options),
}

#[derive(Debug, Clone, PartialEq)]
pub struct FnDecl {
    pub name: Ident,
    pub params: Vec<Param>,
    pub ret: TypeExpr,
    /// `over group` / `over batch`: the scope of reductions in the body.
    pub over: Option<Ident>,
    pub body: Block,
    pub span: Span,
}

/// A signature parameter: `name: Type = default`, and for `fn` parameters an optional
/// `where CONDITION` on the values it accepts.
#[derive(Debug, Clone, PartialEq)]
pub struct Param {
    pub name: Ident,
    pub ty: TypeExpr,
    pub default: Option<Expr>,
    pub where_: Option<Expr>,
    pub span: Span,
}

#[derive(Debug, Clone, PartialEq)]
pub enum TypeExpr {
    Named(Ident),
    Fn {
        params: Vec<TypeExpr>,
        ret: Box<TypeExpr>,
        span: Span,
    },
}

impl TypeExpr {
    pub fn span(&self) -> Span {
        match self {
            TypeExpr::Named(i) => i.span,
            TypeExpr::Fn { span, .. } => *span,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Pipeline {
    pub name: Ident,
    pub params: Vec<Param>,
    pub settings: Vec<ParamDecl>,
    pub models: Vec<ModelDecl>,
    /// Exactly one in a valid pipeline; the parser reports E0108 otherwise and keeps the first.
    pub each: Option<Each>,
    pub span: Span,
}

/// `param NAME: TYPE = DEFAULT where CONDITION`.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamDecl {
    pub name: Ident,
    pub ty: TypeExpr,
    pub default: Option<Expr>,
    pub where_: Option<Expr>,
    pub span: Span,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Each {
    pub var: Ident,
    pub count: Expr,
    pub stmts: Vec<Stmt>,
    /// The span of the closing `}` (comments before it belong inside the block).
    pub close: Span,
    pub span: Span,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Stmt {
    Let(Let),
    Expr(Expr),
}

impl Stmt {
    pub fn span(&self) -> Span {
        match self {
            Stmt::Let(l) => l.span,
            Stmt::Expr(e) => e.span,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Let {
    pub name: Ident,
    pub value: Expr,
    /// `metric NAME = EXPR` in a `fn` body: a diagnostic the loss declares, not a binding.
    pub metric: bool,
    pub span: Span,
}

/// `{ let…; expr }`
#[derive(Debug, Clone, PartialEq)]
pub struct Block {
    pub lets: Vec<Let>,
    pub value: Box<Expr>,
    pub close: Span,
    pub span: Span,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Run {
    pub pipeline: Path,
    pub args: Args,
    pub settings: Option<Options>,
    pub span: Span,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Cluster {
    pub options: Options,
    pub span: Span,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Schedule {
    pub pins: Vec<Pin>,
    pub close: Span,
    pub span: Span,
}

/// A model-call selector: `generate(policy)` or a bare `generate`.
#[derive(Debug, Clone, PartialEq)]
pub struct Selector {
    pub op: Ident,
    pub model: Option<Ident>,
    pub span: Span,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayoutKind {
    Tp,
    Pp,
    Dp,
}

impl LayoutKind {
    pub fn as_str(self) -> &'static str {
        match self {
            LayoutKind::Tp => "tp",
            LayoutKind::Pp => "pp",
            LayoutKind::Dp => "dp",
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub enum SpeculateMode {
    Off,
    Ngram { n: IntLit, max: Option<IntLit> },
    Draft(Ident),
}

#[derive(Debug, Clone, PartialEq)]
pub struct IntLit {
    pub value: i64,
    pub span: Span,
}

#[derive(Debug, Clone, PartialEq)]
pub enum PinKind {
    FuseOff,
    Fuse {
        from: Selector,
        to: Vec<Selector>,
    },
    MigrateOff,
    /// `migrate below 20%`: the percentage as written.
    MigrateBelow {
        percent: f64,
        span: Span,
    },
    Interleave(Vec<Selector>),
    Place {
        target: Selector,
        from: IntLit,
        to: IntLit,
        layout: Vec<(LayoutKind, IntLit)>,
    },
    Speculate {
        target: Option<Selector>,
        mode: SpeculateMode,
    },
    MicroBatch {
        target: Selector,
        size: IntLit,
    },
}

#[derive(Debug, Clone, PartialEq)]
pub struct Pin {
    pub kind: PinKind,
    pub span: Span,
}

#[derive(Debug, Clone, PartialEq)]
pub struct StrLit {
    /// The value with escapes resolved.
    pub value: String,
    pub raw: bool,
    pub span: Span,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnaryOp {
    Neg,
    Not,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BinaryOp {
    Or,
    And,
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
    Add,
    Sub,
    Mul,
    Div,
    Rem,
}

impl BinaryOp {
    pub fn as_str(self) -> &'static str {
        match self {
            BinaryOp::Or => "||",
            BinaryOp::And => "&&",
            BinaryOp::Eq => "==",
            BinaryOp::Ne => "!=",
            BinaryOp::Lt => "<",
            BinaryOp::Le => "<=",
            BinaryOp::Gt => ">",
            BinaryOp::Ge => ">=",
            BinaryOp::Add => "+",
            BinaryOp::Sub => "-",
            BinaryOp::Mul => "*",
            BinaryOp::Div => "/",
            BinaryOp::Rem => "%",
        }
    }

    /// Binding strength: higher binds tighter. Used by the formatter to place parentheses.
    pub fn precedence(self) -> u8 {
        match self {
            BinaryOp::Or => 1,
            BinaryOp::And => 2,
            BinaryOp::Eq
            | BinaryOp::Ne
            | BinaryOp::Lt
            | BinaryOp::Le
            | BinaryOp::Gt
            | BinaryOp::Ge => 3,
            BinaryOp::Add | BinaryOp::Sub => 4,
            BinaryOp::Mul | BinaryOp::Div | BinaryOp::Rem => 5,
        }
    }

    pub fn is_comparison(self) -> bool {
        self.precedence() == 3
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct NamedArg {
    pub name: Ident,
    pub value: Expr,
    /// Written as a bare name after a named argument: `max_new_tokens` for
    /// `max_new_tokens: max_new_tokens`.
    pub shorthand: bool,
    pub span: Span,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Args {
    pub positional: Vec<Expr>,
    pub named: Vec<NamedArg>,
    pub span: Span,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Scan {
    pub reverse: bool,
    pub var: Ident,
    pub acc: Ident,
    pub init: Box<Expr>,
    pub lets: Vec<Let>,
    /// The name assigned at the end of the body (must be `acc`).
    pub target: Ident,
    pub value: Box<Expr>,
    pub close: Span,
}

#[derive(Debug, Clone, PartialEq)]
pub enum ExprKind {
    Int(i64),
    Float(f64),
    Str(StrLit),
    Bool(bool),
    Path(Path),
    Call {
        callee: Box<Expr>,
        args: Args,
    },
    Field {
        base: Box<Expr>,
        name: Ident,
    },
    Index {
        base: Box<Expr>,
        index: Box<Expr>,
    },
    Unary {
        op: UnaryOp,
        operand: Box<Expr>,
    },
    Binary {
        op: BinaryOp,
        lhs: Box<Expr>,
        rhs: Box<Expr>,
    },
    Paren(Box<Expr>),
    If {
        cond: Box<Expr>,
        then: Block,
        else_: Box<Expr>,
    },
    /// An `else` branch that is a block (an `else if` is an `If` expression).
    Block(Block),
    Scan(Scan),
    /// Something that failed to parse; a diagnostic was reported.
    Error,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Expr {
    pub kind: ExprKind,
    pub span: Span,
}
