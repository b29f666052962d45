//! Semantic checking: from the syntax trees of a root file and its imports to a typed program
//! ([`hir::Program`]) plus diagnostics. Resolution, types, granularity and the pipeline rules
//! all live here. Like the parser, [`check`] never fails: it returns what it could build.
//! This crate does no file I/O; imports are read through a [`Loader`].

mod builtins;
mod check;
pub mod hir;
mod items;
mod load;
mod loss;
pub mod lower_graph;
pub mod lower_kernel;
pub mod lower_loss;
pub mod pretty;
mod resources;
mod run;
mod specialise;
pub mod ty;

use braid_diagnostics::{Diagnostic, SourceMap};

pub use load::{Loader, MemoryLoader, NoImports, join};

/// The result of checking a file: the typed program, every source it read, and diagnostics
/// sorted by position.
#[derive(Debug)]
pub struct Checked {
    pub program: hir::Program,
    pub sources: SourceMap,
    pub diagnostics: Vec<Diagnostic>,
}

impl Checked {
    pub fn has_errors(&self) -> bool {
        self.diagnostics.iter().any(|d| d.is_error())
    }
}

/// Checks the file `name` with contents `text`, reading its imports through `loader`.
pub fn check(name: &str, text: &str, loader: &dyn Loader) -> Checked {
    let mut sources = SourceMap::new();
    let mut diags = Vec::new();
    let modules = load::load_modules(name, text, loader, &mut sources, &mut diags);
    let root = modules[0].file;
    let mut ch = check::Checker {
        sources: &sources,
        modules: &modules,
        scopes: Vec::new(),
        diags,
        program: hir::Program {
            root,
            fns: vec![],
            pipelines: vec![],
            models: vec![],
            datasets: vec![],
            run: None,
            cluster: None,
            schedule: None,
            references: vec![],
        },
        fn_asts: vec![],
        pipeline_asts: vec![],
        fn_calls: vec![],
    };
    ch.collect();
    ch.resources();
    ch.fn_signatures();
    ch.fn_bodies();
    ch.pipelines();
    ch.root();
    let mut diagnostics = ch.diags;
    let program = ch.program;
    diagnostics.dedup();
    braid_diagnostics::sort(&mut diagnostics);
    Checked {
        program,
        sources,
        diagnostics,
    }
}
