//! The module graph: the root file, the files it imports with `use "./x.rlhf"`, and the
//! standard-library modules it names with `use std::x`. File access goes through the
//! [`Loader`] the caller provides; this crate does no I/O of its own.

use std::collections::BTreeMap;

use braid_diagnostics::{Code, Diagnostic, FileId, SourceMap, Span};
use braid_syntax::ast;

/// Reads imported files for the checker. `braid check` reads the disk; tests and the language
/// server serve text from memory.
pub trait Loader {
    /// Resolves `path` (as written in `use "…"`) relative to the file named `from`, and returns
    /// the resolved name and its text, or a reason it cannot be read.
    fn load(&self, from: &str, path: &str) -> Result<(String, String), String>;
}

/// A loader that refuses every import: for checking text that has no file around it.
#[derive(Debug, Default)]
pub struct NoImports;

impl Loader for NoImports {
    fn load(&self, _from: &str, path: &str) -> Result<(String, String), String> {
        Err(format!("cannot import `{path}` here: no file system"))
    }
}

/// Serves files from memory by resolved name (paths joined like a file system).
#[derive(Debug, Default, Clone)]
pub struct MemoryLoader {
    pub files: BTreeMap<String, String>,
}

impl Loader for MemoryLoader {
    fn load(&self, from: &str, path: &str) -> Result<(String, String), String> {
        let name = join(from, path);
        self.files
            .get(&name)
            .map(|t| (name.clone(), t.clone()))
            .ok_or_else(|| format!("no file `{name}`"))
    }
}

/// Joins an import path to the folder of the importing file, resolving `.` and `..`.
pub fn join(from: &str, path: &str) -> String {
    if path.starts_with('/') {
        return normalize(path);
    }
    let dir = match from.rfind('/') {
        Some(i) => &from[..=i],
        None => "",
    };
    normalize(&format!("{dir}{path}"))
}

fn normalize(p: &str) -> String {
    let absolute = p.starts_with('/');
    let mut parts: Vec<&str> = Vec::new();
    for seg in p.split('/') {
        match seg {
            "" | "." => {}
            ".." => {
                if parts.last().is_some_and(|l| *l != "..") {
                    parts.pop();
                } else if !absolute {
                    parts.push("..");
                }
            }
            s => parts.push(s),
        }
    }
    let joined = parts.join("/");
    if absolute {
        format!("/{joined}")
    } else {
        joined
    }
}

/// One loaded file of the program.
#[derive(Debug)]
pub struct Module {
    /// `std::grpo` for the standard library, else the resolved file name.
    pub name: String,
    pub file: FileId,
    pub ast: ast::File,
    /// Indices of the modules this one imports, with the span of each `use`.
    pub imports: Vec<(usize, Span)>,
    pub is_std: bool,
}

/// Loads the root and everything it imports. Module 0 is the root.
pub fn load_modules(
    root_name: &str,
    root_text: &str,
    loader: &dyn Loader,
    sources: &mut SourceMap,
    diags: &mut Vec<Diagnostic>,
) -> Vec<Module> {
    let mut modules: Vec<Module> = Vec::new();
    let mut by_name: BTreeMap<String, usize> = BTreeMap::new();
    let root = add_module(
        root_name.to_string(),
        root_text.to_string(),
        false,
        sources,
        diags,
        &mut modules,
    );
    by_name.insert(root_name.to_string(), root);
    // Depth-first, so that a cycle is found with the chain that makes it.
    let mut stack: Vec<usize> = Vec::new();
    visit(
        root,
        &mut stack,
        loader,
        sources,
        diags,
        &mut modules,
        &mut by_name,
    );
    modules
}

fn add_module(
    name: String,
    text: String,
    is_std: bool,
    sources: &mut SourceMap,
    diags: &mut Vec<Diagnostic>,
    modules: &mut Vec<Module>,
) -> usize {
    let display = if is_std {
        braid_stdlib::file_name(name.trim_start_matches("std::"))
    } else {
        name.clone()
    };
    let file = sources.add(display, text.clone());
    let (ast, d) = braid_syntax::parse(&text, file);
    diags.extend(d);
    modules.push(Module {
        name,
        file,
        ast,
        imports: Vec::new(),
        is_std,
    });
    modules.len() - 1
}

fn visit(
    m: usize,
    stack: &mut Vec<usize>,
    loader: &dyn Loader,
    sources: &mut SourceMap,
    diags: &mut Vec<Diagnostic>,
    modules: &mut Vec<Module>,
    by_name: &mut BTreeMap<String, usize>,
) {
    stack.push(m);
    let uses: Vec<ast::Use> = modules[m]
        .ast
        .items
        .iter()
        .filter_map(|i| match i {
            ast::Item::Use(u) => Some(u.clone()),
            _ => None,
        })
        .collect();
    let from = modules[m].name.clone();
    for u in uses {
        let (key, loaded): (String, Option<(String, bool)>) = match &u.target {
            ast::UseTarget::Path(path) => {
                let segs: Vec<&str> = path.segments.iter().map(|s| s.name.as_str()).collect();
                match segs.as_slice() {
                    ["std", name] => match braid_stdlib::module(name) {
                        Some(sm) => (format!("std::{name}"), Some((sm.source.to_string(), true))),
                        None => {
                            diags.push(unknown_module(&path.text(), path.span));
                            continue;
                        }
                    },
                    _ => {
                        diags.push(unknown_module(&path.text(), path.span));
                        continue;
                    }
                }
            }
            ast::UseTarget::File(s) => {
                if modules[m].is_std {
                    continue;
                }
                match loader.load(&from, &s.value) {
                    Ok((name, text)) => (name, Some((text, false))),
                    Err(why) => {
                        diags.push(
                            Diagnostic::new(Code::E0204, format!("cannot import `{}`: {why}", s.value), s.span, "imported here")
                                .with_help("paths are relative to the importing file; check the name and that the file exists"),
                        );
                        continue;
                    }
                }
            }
        };
        if let Some(&existing) = by_name.get(&key) {
            if let Some(pos) = stack.iter().position(|&s| s == existing) {
                let chain: Vec<String> = stack[pos..]
                    .iter()
                    .map(|&i| modules[i].name.clone())
                    .chain([modules[existing].name.clone()])
                    .collect();
                diags.push(
                    Diagnostic::new(
                        Code::E0205,
                        format!("import cycle: {}", chain.join(" → ")),
                        u.span,
                        "this import closes the cycle",
                    )
                    .with_help("move what both files need into a third file that imports neither"),
                );
                continue;
            }
            modules[m].imports.push((existing, u.span));
            continue;
        }
        let Some((text, is_std)) = loaded else {
            continue;
        };
        let idx = add_module(key.clone(), text, is_std, sources, diags, modules);
        by_name.insert(key, idx);
        modules[m].imports.push((idx, u.span));
        visit(idx, stack, loader, sources, diags, modules, by_name);
    }
    stack.pop();
}

fn unknown_module(text: &str, span: Span) -> Diagnostic {
    let names: Vec<String> = braid_stdlib::MODULES
        .iter()
        .map(|m| format!("std::{}", m.name))
        .collect();
    Diagnostic::new(
        Code::E0203,
        format!("no standard-library module `{text}`"),
        span,
        "unknown module",
    )
    .with_help(format!(
        "the modules are {}; a file is imported with `use \"./file.rlhf\"`",
        names.join(", ")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn join_resolves_relative_paths() {
        assert_eq!(join("examples/a.rlhf", "./b.rlhf"), "examples/b.rlhf");
        assert_eq!(join("examples/x/a.rlhf", "../b.rlhf"), "examples/b.rlhf");
        assert_eq!(join("a.rlhf", "b.rlhf"), "b.rlhf");
        assert_eq!(join("/r/a.rlhf", "../b.rlhf"), "/b.rlhf");
    }
}
