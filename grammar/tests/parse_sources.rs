//! Every example and stdlib source parses without diagnostics.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use braid_diagnostics::FileId;

fn rlhf_files(dir: &std::path::Path, out: &mut Vec<std::path::PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() && p.file_name().is_some_and(|n| n != "errors") {
            rlhf_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rlhf") {
            out.push(p);
        }
    }
}

#[test]
fn examples_and_stdlib_parse_cleanly() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap();
    let mut files = Vec::new();
    rlhf_files(&root.join("examples"), &mut files);
    rlhf_files(&root.join("stdlib/std"), &mut files);
    assert!(files.len() >= 9, "{files:?}");
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap();
        let (ast, diags) = braid_syntax::parse(&text, FileId(0));
        assert!(diags.is_empty(), "{}: {:#?}", f.display(), diags);
        assert!(
            !ast.items
                .iter()
                .any(|i| matches!(i, braid_syntax::ast::Item::Error(_))),
            "{}",
            f.display()
        );
    }
}
