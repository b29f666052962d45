//! End-to-end tests of the `braid` binary: `check`, `fmt` and `--help`.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;
use std::process::{Command, Output};

fn braid(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_braid"))
        .args(args)
        .env("NO_COLOR", "1")
        .output()
        .unwrap()
}

fn rlhf_in(dir: &str) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "rlhf"))
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

fn examples_and_stdlib() -> Vec<String> {
    let mut v = rlhf_in("examples");
    v.extend(rlhf_in("stdlib/std"));
    v
}

#[test]
fn every_example_and_stdlib_module_checks_clean() {
    let files = examples_and_stdlib();
    assert!(files.len() >= 11, "{files:?}");
    let mut args = vec!["check"];
    args.extend(files.iter().map(|s| s.as_str()));
    let out = braid(&args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(
        stderr.contains("no problems"),
        "examples must have no warnings either:\n{stderr}"
    );
}

#[test]
fn error_gallery_reports_the_code_each_file_names() {
    let files = rlhf_in("examples/errors");
    assert!(!files.is_empty());
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap();
        let first = text.lines().next().unwrap_or("");
        let code = first
            .split(|c: char| !c.is_ascii_alphanumeric())
            .find(|w| {
                w.len() == 5
                    && (w.starts_with('E') || w.starts_with('W'))
                    && w[1..].chars().all(|c| c.is_ascii_digit())
            })
            .unwrap_or_else(|| panic!("{f}: the first line must name the code it shows"));
        let out = braid(&["check", "--format", "json", &f]);
        assert_eq!(out.status.code(), Some(1), "{f} must fail to check");
        let stdout = String::from_utf8_lossy(&out.stdout);
        let codes: Vec<String> = stdout
            .lines()
            .map(|l| {
                serde_json::from_str::<serde_json::Value>(l).unwrap()["code"]
                    .as_str()
                    .unwrap()
                    .to_string()
            })
            .collect();
        assert!(
            codes.iter().any(|c| c == code),
            "{f}: expected {code}, got {codes:?}"
        );
    }
}

#[test]
fn check_exit_codes() {
    assert_eq!(
        braid(&["check", "tests/ui/E0304-mixed-rollouts.rlhf"])
            .status
            .code(),
        Some(1)
    );
    assert_eq!(
        braid(&["check", "tests/ui/W0001-unused-let.rlhf"])
            .status
            .code(),
        Some(0),
        "warnings alone exit 0"
    );
    let missing = braid(&["check", "no/such/file.rlhf"]);
    assert_eq!(missing.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&missing.stderr).contains("no/such/file.rlhf"));
    assert_eq!(
        braid(&["check", "--no-such-flag", "x.rlhf"]).status.code(),
        Some(2)
    );
    assert_eq!(braid(&["check"]).status.code(), Some(2));
}

#[test]
fn check_json_output_has_code_span_and_help() {
    let out = braid(&[
        "check",
        "--format",
        "json",
        "tests/ui/E0304-mixed-rollouts.rlhf",
    ]);
    assert_eq!(out.status.code(), Some(1));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let diags: Vec<serde_json::Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(diags.len(), 1, "{stdout}");
    let d = &diags[0];
    assert_eq!(d["code"], "E0304");
    assert_eq!(d["name"], "mixed-rollouts");
    assert_eq!(d["severity"], "error");
    assert!(d["help"].as_str().unwrap().contains("by_prompt"));
    let primary = d["labels"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["primary"] == true)
        .unwrap();
    assert_eq!(primary["line"], 11);
    assert!(
        primary["file"]
            .as_str()
            .unwrap()
            .ends_with("E0304-mixed-rollouts.rlhf")
    );
}

#[test]
fn terminal_output_has_no_colour_when_piped() {
    let out = Command::new(env!("CARGO_BIN_EXE_braid"))
        .args(["check", "tests/ui/E0304-mixed-rollouts.rlhf"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("E0304(mixed-rollouts)"), "{stderr}");
    assert!(
        !stderr.contains('\u{1b}'),
        "piped output must not contain escape codes"
    );
}

#[test]
fn examples_and_stdlib_are_formatted() {
    let files = examples_and_stdlib();
    let mut args = vec!["fmt", "--check"];
    args.extend(files.iter().map(|s| s.as_str()));
    let out = braid(&args);
    assert_eq!(
        out.status.code(),
        Some(0),
        "unformatted: {}",
        String::from_utf8_lossy(&out.stdout)
    );
}

#[test]
fn fmt_rewrites_files_and_check_mode_reports_them() {
    let dir = tempdir();
    let file = dir.join("messy.rlhf");
    std::fs::write(
        &file,
        "use std::grpo\nfn r(s:Sample)->float{ 1.0 }   // keep me\n",
    )
    .unwrap();
    let f = file.to_string_lossy().into_owned();
    let check = braid(&["fmt", "--check", &f]);
    assert_eq!(check.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&check.stdout).contains("messy.rlhf"));
    assert_eq!(
        std::fs::read_to_string(&file).unwrap(),
        "use std::grpo\nfn r(s:Sample)->float{ 1.0 }   // keep me\n",
        "--check must not write"
    );
    assert_eq!(braid(&["fmt", &f]).status.code(), Some(0));
    assert_eq!(
        std::fs::read_to_string(&file).unwrap(),
        "use std::grpo\nfn r(s: Sample) -> float {\n  1.0  // keep me\n}\n"
    );
    assert_eq!(braid(&["fmt", "--check", &f]).status.code(), Some(0));
    std::fs::write(&file, "fn broken( {\n").unwrap();
    assert_eq!(
        braid(&["fmt", &f]).status.code(),
        Some(1),
        "files with syntax errors are refused"
    );
    assert_eq!(
        std::fs::read_to_string(&file).unwrap(),
        "fn broken( {\n",
        "and left untouched"
    );
}

#[test]
fn help_lists_every_subcommand() {
    let out = braid(&["--help"]);
    let text = String::from_utf8_lossy(&out.stdout);
    for cmd in [
        "check", "fmt", "eval", "generate", "lsp", "report", "run", "plan", "sim",
    ] {
        assert!(
            text.contains(&format!("  {cmd} ")),
            "`{cmd}` missing:\n{text}"
        );
    }
}

#[test]
fn quickstart_typed_program_snapshot() {
    let text = std::fs::read_to_string("examples/quickstart.rlhf").unwrap();
    let checked = braid_sema::check("examples/quickstart.rlhf", &text, &braid_sema::NoImports);
    assert!(checked.diagnostics.is_empty(), "{:?}", checked.diagnostics);
    insta::assert_snapshot!(
        "quickstart_hir",
        braid_sema::pretty::program(&checked.program)
    );
}

fn tempdir() -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "braid-cli-test-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn generate_speculate_keeps_greedy_text_and_rejects_bad_values() {
    let run = |mode: &str| {
        braid(&[
            "generate",
            "--model",
            "tiny",
            "--prompt",
            "abcabcabc",
            "--greedy",
            "--max-new-tokens",
            "24",
            "--ignore-eos",
            "--threads",
            "1",
            "--format",
            "json",
            "--speculate",
            mode,
        ])
    };
    // Same tokens and text; log-probabilities equal to rounding (other matrix shapes).
    let parse = |out: &Output| -> serde_json::Value {
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let off = parse(&run("off"));
    for mode in ["auto", "ngram", "ngram:8"] {
        let spec = parse(&run(mode));
        assert_eq!(spec["token_ids"], off["token_ids"], "{mode}");
        assert_eq!(spec["completion"], off["completion"], "{mode}");
        let lp = |v: &serde_json::Value| -> Vec<f64> {
            v["logprobs"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap())
                .collect()
        };
        for (a, b) in lp(&spec).iter().zip(lp(&off)) {
            assert!((a - b).abs() < 1e-4, "{mode}: {a} vs {b}");
        }
    }
    let bad = run("ngram:0");
    assert_eq!(bad.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&bad.stderr);
    assert!(
        stderr.contains("the draft length after `ngram:` must be a number from 1 to 64"),
        "{stderr}"
    );
    let missing = run("draft:/nonexistent/braid-draft");
    assert_eq!(missing.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&missing.stderr);
    assert!(
        stderr.starts_with("error: /nonexistent/braid-draft: "),
        "{stderr}"
    );
}
