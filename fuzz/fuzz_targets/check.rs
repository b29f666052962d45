//! Fuzz the front end: any text must parse and check without a panic, every diagnostic must
//! carry a span inside its file, and formatting must be idempotent on what it accepts.
//! `cargo +nightly fuzz run check -- -max_total_time=60` (seeds: `examples/`, `tests/ui/`).

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let checked = braid_sema::check("fuzz.rlhf", &text, &braid_sema::NoImports);
    for d in &checked.diagnostics {
        let span = d.span();
        let file = checked.sources.get(span.file).expect("diagnostic span in a known file");
        assert!(span.start <= span.end && span.end as usize <= file.text.len());
    }
    if let Ok(once) = braid_syntax::format::format(&text) {
        let twice = braid_syntax::format::format(&once).expect("formatted output parses");
        assert_eq!(once, twice, "fmt is not idempotent");
    }
});
