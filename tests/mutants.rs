//! Robustness on broken input: random mutations of the examples, the standard library and the
//! UI fixtures (deleted, duplicated and swapped characters and tokens) never panic the parser,
//! the checker or the formatter; every diagnostic carries a code and a span inside its file;
//! and the formatter is idempotent on every mutant it accepts. Deterministic: a fixed seed.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::panic::{AssertUnwindSafe, catch_unwind};

/// SplitMix64: a tiny seeded generator, so the mutants are the same on every run.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next() % n as u64) as usize
        }
    }
}

fn corpus() -> Vec<(String, String)> {
    let mut out = Vec::new();
    for dir in ["examples", "examples/errors", "stdlib/std", "tests/ui"] {
        let Ok(rd) = std::fs::read_dir(dir) else {
            continue;
        };
        let mut paths: Vec<_> = rd
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|x| x == "rlhf"))
            .collect();
        paths.sort();
        for p in paths {
            out.push((
                p.to_string_lossy().into_owned(),
                std::fs::read_to_string(&p).unwrap(),
            ));
        }
    }
    out
}

/// Token boundaries: runs of word characters, runs of spaces, and single other characters.
fn tokens(s: &str) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut chars = s.char_indices().peekable();
    while let Some((i, c)) = chars.next() {
        let class = |c: char| {
            if c.is_alphanumeric() || c == '_' {
                0
            } else if c == ' ' {
                1
            } else {
                2
            }
        };
        let k = class(c);
        let mut end = i + c.len_utf8();
        if k != 2 {
            while let Some(&(j, d)) = chars.peek() {
                if class(d) != k {
                    break;
                }
                end = j + d.len_utf8();
                chars.next();
            }
        }
        out.push((i, end));
    }
    out
}

fn char_boundaries(s: &str) -> Vec<usize> {
    s.char_indices().map(|(i, _)| i).collect()
}

fn mutate(s: &str, rng: &mut Rng) -> String {
    let mut s = s.to_string();
    for _ in 0..1 + rng.below(3) {
        let kind = rng.below(6);
        if kind < 3 {
            let b = char_boundaries(&s);
            if b.len() < 2 {
                continue;
            }
            let i = rng.below(b.len() - 1);
            let (start, end) = (b[i], b[i + 1]);
            let c = s[start..end].to_string();
            match kind {
                0 => s.replace_range(start..end, ""),
                1 => s.insert_str(start, &c),
                _ => {
                    if i + 2 < b.len() {
                        let next = s[end..b[i + 2]].to_string();
                        s.replace_range(start..b[i + 2], &format!("{next}{c}"));
                    }
                }
            }
        } else {
            let t = tokens(&s);
            if t.len() < 2 {
                continue;
            }
            let i = rng.below(t.len() - 1);
            let (a, b) = t[i];
            let tok = s[a..b].to_string();
            match kind {
                3 => s.replace_range(a..b, ""),
                4 => s.insert_str(a, &tok),
                _ => {
                    let (c, d) = t[i + 1];
                    let next = s[c..d].to_string();
                    s.replace_range(a..d, &format!("{next}{tok}"));
                }
            }
        }
    }
    s
}

#[test]
fn ten_thousand_mutants_never_panic_and_every_error_has_code_and_span() {
    let corpus = corpus();
    assert!(corpus.len() > 20);
    let mut rng = Rng(0x5eed_b4a1d);
    let mut with_errors = 0usize;
    let mut formatted = 0usize;
    let total = 10_000;
    for n in 0..total {
        let (name, text) = &corpus[n % corpus.len()];
        let mutant = mutate(text, &mut rng);
        let result = catch_unwind(AssertUnwindSafe(|| {
            braid_sema::check(name, &mutant, &braid_sema::NoImports)
        }));
        let checked = match result {
            Ok(c) => c,
            Err(_) => panic!("the checker panicked on a mutant of {name}:\n---\n{mutant}\n---"),
        };
        if checked.has_errors() {
            with_errors += 1;
        }
        for d in &checked.diagnostics {
            let span = d.span();
            assert!(
                !span.is_dummy(),
                "{name}: {} without a span on mutant:\n{mutant}",
                d.code
            );
            let file = checked
                .sources
                .get(span.file)
                .expect("span in a known file");
            assert!(
                span.start <= span.end && span.end as usize <= file.text.len(),
                "{name}: {} span out of its file",
                d.code
            );
            assert!(d.help.is_some(), "{name}: {} without help", d.code);
        }
        let fmt = catch_unwind(AssertUnwindSafe(|| braid_syntax::format::format(&mutant)));
        match fmt {
            Err(_) => panic!("the formatter panicked on a mutant of {name}:\n---\n{mutant}\n---"),
            Ok(Ok(once)) => {
                formatted += 1;
                let twice = braid_syntax::format::format(&once)
                    .unwrap_or_else(|d| panic!("formatted output does not parse: {d:?}\n{once}"));
                assert_eq!(
                    once, twice,
                    "fmt is not idempotent on a mutant of {name}:\n---\n{mutant}\n---"
                );
            }
            Ok(Err(_)) => {}
        }
    }
    // The mutations must actually break programs, and leave some parseable.
    assert!(
        with_errors > total / 4,
        "only {with_errors} mutants had errors"
    );
    assert!(formatted > total / 10, "only {formatted} mutants parsed");
}

#[test]
fn formatting_preserves_the_typed_program() {
    for (name, text) in corpus() {
        let Ok(formatted) = braid_syntax::format::format(&text) else {
            continue;
        };
        assert_eq!(
            braid_syntax::format::format(&formatted).as_deref().ok(),
            Some(formatted.as_str()),
            "{name}: not idempotent"
        );
        let before = braid_sema::check(&name, &text, &braid_sema::NoImports);
        let after = braid_sema::check(&name, &formatted, &braid_sema::NoImports);
        assert_eq!(
            braid_sema::pretty::program(&before.program),
            braid_sema::pretty::program(&after.program),
            "{name}: formatting changed the program"
        );
        let codes =
            |c: &braid_sema::Checked| c.diagnostics.iter().map(|d| d.code).collect::<Vec<_>>();
        assert_eq!(
            codes(&before),
            codes(&after),
            "{name}: formatting changed the diagnostics"
        );
    }
}
