//! The one table of diagnostic codes.
//!
//! A code is stable once published: it appears in docs, fixtures, editor integrations and
//! users' notes. Codes are grouped by phase: `E01xx` syntax, `E02xx` names and imports, `E03xx`
//! types and granularity, `E04xx` pipeline semantics, `E05xx` planning, `Wxxxx` warnings.
//! Every code has a doc entry in `docs/diagnostics.md`, a fixture `tests/ui/<CODE>-<name>.rlhf`
//! and a rendered snapshot; `tests/ui.rs` fails when one is missing.

use serde::Serialize;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Severity {
    Error,
    Warning,
}

macro_rules! codes {
    ($($code:ident => $name:literal, $sev:ident, $summary:literal;)*) => {
        /// A diagnostic code. `Code::E0304.name() == "mixed-rollouts"`.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub enum Code { $($code,)* }

        impl Code {
            /// Every code, in table order.
            pub const ALL: &'static [Code] = &[$(Code::$code,)*];

            pub fn as_str(self) -> &'static str {
                match self { $(Code::$code => stringify!($code),)* }
            }

            /// The kebab-case name, stable like the code.
            pub fn name(self) -> &'static str {
                match self { $(Code::$code => $name,)* }
            }

            pub fn severity(self) -> Severity {
                match self { $(Code::$code => Severity::$sev,)* }
            }

            /// One line saying what the code is about.
            pub fn summary(self) -> &'static str {
                match self { $(Code::$code => $summary,)* }
            }
        }
    };
}

codes! {
    // Syntax.
    E0101 => "unexpected-token", Error, "the parser met something it did not expect";
    E0102 => "unterminated-string", Error, "a string literal has no closing quote on its line";
    E0103 => "invalid-number", Error, "a number literal is out of range";
    E0104 => "invalid-escape", Error, "a string contains an unknown escape sequence";
    E0105 => "chained-comparison", Error, "comparisons cannot be chained";
    E0106 => "positional-after-named", Error, "a positional argument follows a named one";
    E0107 => "pipeline-body-order", Error, "a pipeline's params, models and `each` are out of order";
    E0108 => "pipeline-needs-one-each", Error, "a pipeline must have exactly one `each`";
    E0109 => "scan-accumulator-mismatch", Error, "a `scan` must end by assigning its accumulator";
    // Names and imports.
    E0201 => "unknown-name", Error, "a name is not defined in scope";
    E0202 => "duplicate-definition", Error, "a name is defined twice in one scope";
    E0203 => "unknown-module", Error, "a `use std::…` names no standard-library module";
    E0204 => "import-not-found", Error, "a `use \"…\"` file cannot be read";
    E0205 => "import-cycle", Error, "files import each other in a cycle";
    E0206 => "unknown-field", Error, "a field does not exist on this type";
    E0207 => "unknown-option", Error, "an option key is not accepted here";
    E0208 => "unknown-argument", Error, "a named argument matches no parameter";
    E0209 => "duplicate-argument", Error, "an argument or option is given twice";
    E0210 => "unknown-source", Error, "a model or dataset source is not known";
    // Types and granularity.
    E0301 => "type-mismatch", Error, "a value has the wrong type";
    E0302 => "missing-argument", Error, "a required argument is missing";
    E0303 => "too-many-arguments", Error, "a call has more positional arguments than parameters";
    E0304 => "mixed-rollouts", Error, "values of two different rollouts are combined";
    E0305 => "not-callable", Error, "something that is not a function is called";
    E0306 => "invalid-operands", Error, "an operator does not apply to these types";
    E0307 => "branch-type-mismatch", Error, "the branches of an `if` have different types";
    E0308 => "invalid-option-value", Error, "an option's value is not one it accepts";
    E0309 => "scan-needs-tokens", Error, "`scan` is used outside a per-token function";
    E0310 => "invalid-index", Error, "only per-token values are indexed, and by an int";
    E0311 => "granularity-mismatch", Error, "a group or batch function is used where one sample is all there is";
    E0312 => "unaligned-rollouts", Error, "two rollouts come from different prompt batches";
    E0313 => "recursive-fn", Error, "functions call each other in a cycle";
    E0314 => "invalid-regex", Error, "a regular expression does not compile";
    E0315 => "unknown-type", Error, "a type name is not known";
    E0316 => "pattern-not-literal", Error, "a pattern or string argument must be a literal";
    E0317 => "loss-without-gradient", Error, "a loss does not depend on the trained model's outputs";
    E0318 => "not-differentiable", Error, "a loss uses something that cannot be differentiated";
    // Pipeline semantics.
    E0401 => "train-frozen-model", Error, "a model without `train:` is trained";
    E0402 => "missing-run", Error, "a file declares models or data but no `run`";
    E0403 => "multiple-runs", Error, "a file has more than one `run`";
    E0404 => "where-violated", Error, "a run setting violates its parameter's `where` condition";
    E0405 => "unknown-setting", Error, "a run setting matches no parameter of the pipeline";
    E0406 => "missing-setting", Error, "a pipeline parameter without default is not set";
    E0407 => "model-call-outside-pipeline", Error, "a model call or built-in is used where it does not belong (e.g. inside a `fn`)";
    E0408 => "run-not-pipeline", Error, "`run` names something that is not a pipeline";
    E0409 => "control-flow-in-pipeline", Error, "a pipeline body uses `if` or `scan`";
    E0410 => "head-mismatch", Error, "a model call needs a different head than the model has";
    E0411 => "option-out-of-range", Error, "an option's value is outside its allowed range";
    E0412 => "setting-not-constant", Error, "a run setting or default is not a constant";
    E0413 => "duplicate-block", Error, "a file has more than one `cluster` or `schedule`";
    E0414 => "invalid-eval", Error, "the run's `eval` is incomplete, contradictory, or evaluates on training prompts";
    E0415 => "loss-of-another-model", Error, "a loss computed with one model's outputs trains another model";
    E0416 => "option-needs-training", Error, "a model option that only changes training is set on a model without `train:`";
    // Planning.
    E0501 => "pin-matches-nothing", Error, "a schedule pin names no model call of the run";
    E0502 => "ambiguous-pin", Error, "a schedule pin matches more than one model call";
    E0503 => "invalid-device-range", Error, "a `place` pin names devices the cluster does not have";
    E0504 => "plan-exceeds-memory", Error, "a model call, or the models a device holds, do not fit its memory";
    E0505 => "unknown-model-shape", Error, "a model's architecture cannot be read from its directory or a preset";
    E0506 => "token-misaligned", Error, "a model reads the generated tokens of a model with another vocabulary";
    // Warnings.
    W0001 => "unused-let", Warning, "a `let` binding is never used";
    W0002 => "unused-model", Warning, "a declared model is never used by the run";
    W0003 => "unused-value", Warning, "a statement computes a value that nothing uses";
    W0004 => "stop-grad-of-constant", Warning, "`stop_grad` of a value that carries no gradient";
}

impl std::fmt::Display for Code {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Serialize for Code {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

/// Looks a code up by its text (`"E0304"`) or its name (`"mixed-rollouts"`).
pub fn lookup(text: &str) -> Option<Code> {
    Code::ALL
        .iter()
        .copied()
        .find(|c| c.as_str() == text || c.name() == text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_and_names_are_unique_and_well_formed() {
        let mut seen = std::collections::BTreeSet::new();
        for c in Code::ALL {
            assert!(seen.insert(c.as_str()), "duplicate code {c}");
            assert!(seen.insert(c.name()), "duplicate name {}", c.name());
            let name_ok = c
                .name()
                .chars()
                .all(|ch| ch.is_ascii_lowercase() || ch == '-');
            assert!(name_ok, "{c}: name must be kebab-case");
            let warn = c.as_str().starts_with('W');
            assert_eq!(
                warn,
                c.severity() == Severity::Warning,
                "{c}: W codes are the warnings"
            );
        }
        assert_eq!(lookup("E0304"), Some(Code::E0304));
        assert_eq!(lookup("mixed-rollouts"), Some(Code::E0304));
    }
}
