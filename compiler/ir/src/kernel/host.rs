//! Host built-ins: the string functions a kernel calls on a sample's text, and their one
//! implementation, shared by the interpreter and by the JIT (which calls [`HostFns::call`]
//! through `extern "C"` callbacks, see `docs/kernels.md`, "Host ABI").
//!
//! Patterns and literals are compile-time constants of the kernel; regexes are compiled once per
//! kernel by [`HostFns::compile`]. Nothing here may panic: a callback unwinding into JIT code
//! would abort the process.

use super::exec::SampleText;
use regex::Regex;
use serde::{Deserialize, Serialize};

/// A string field of a `Sample` parameter.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum StrField {
    Prompt,
    Completion,
    Answer,
}

impl StrField {
    /// The name used in the text form and the language (`.prompt`, …).
    pub fn name(self) -> &'static str {
        match self {
            StrField::Prompt => "prompt",
            StrField::Completion => "completion",
            StrField::Answer => "answer",
        }
    }

    fn of(self, t: &SampleText) -> &str {
        match self {
            StrField::Prompt => &t.prompt,
            StrField::Completion => &t.completion,
            StrField::Answer => &t.answer,
        }
    }
}

/// One host built-in call with its constant operands. `param` is the index of a `Sample`
/// parameter of the kernel (all samples' texts come from the batch).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum HostCall {
    /// `count(s, r"re") -> int`: the number of non-overlapping matches.
    CountRegex {
        param: u32,
        field: StrField,
        pattern: String,
    },
    /// `matches(s, r"re") -> bool`: whether the regex matches anywhere.
    MatchesRegex {
        param: u32,
        field: StrField,
        pattern: String,
    },
    /// `contains(s, "lit") -> bool`.
    Contains {
        param: u32,
        field: StrField,
        lit: String,
    },
    /// `starts_with(s, "lit") -> bool`.
    StartsWith {
        param: u32,
        field: StrField,
        lit: String,
    },
    /// `ends_with(s, "lit") -> bool`.
    EndsWith {
        param: u32,
        field: StrField,
        lit: String,
    },
    /// `len(s) -> int`: the number of chars.
    StrLen { param: u32, field: StrField },
    /// `answer_matches(s.completion, s.answer) -> bool`: the last number of the completion (the
    /// last `\boxed{…}`'s number when there is one) equals the answer's number; `,` between
    /// digits and `$` are ignored, `1000.0 == 1000`.
    AnswerMatches {
        param: u32,
        completion: StrField,
        answer: StrField,
    },
}

impl HostCall {
    /// `true` for built-ins that yield a `Bool`, `false` for `Int`.
    pub fn returns_bool(&self) -> bool {
        !matches!(self, HostCall::CountRegex { .. } | HostCall::StrLen { .. })
    }

    /// The `Sample` parameter the call reads.
    pub fn param(&self) -> u32 {
        match self {
            HostCall::CountRegex { param, .. }
            | HostCall::MatchesRegex { param, .. }
            | HostCall::Contains { param, .. }
            | HostCall::StartsWith { param, .. }
            | HostCall::EndsWith { param, .. }
            | HostCall::StrLen { param, .. }
            | HostCall::AnswerMatches { param, .. } => *param,
        }
    }

    /// The regex the call needs compiled, if any.
    pub fn pattern(&self) -> Option<&str> {
        match self {
            HostCall::CountRegex { pattern, .. } | HostCall::MatchesRegex { pattern, .. } => {
                Some(pattern)
            }
            _ => None,
        }
    }
}

/// The host calls of one kernel with their regexes compiled.
#[derive(Clone, Debug)]
pub struct HostFns {
    calls: Vec<(HostCall, Option<Regex>)>,
}

/// A regex of a host call failed to compile.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("host call {index}: invalid regex {pattern:?}: {message}")]
pub struct RegexError {
    pub index: usize,
    pub pattern: String,
    pub message: String,
}

impl HostFns {
    /// Compiles the regexes of `calls`, once.
    pub fn compile(calls: &[HostCall]) -> Result<HostFns, RegexError> {
        let mut out = Vec::with_capacity(calls.len());
        for (index, call) in calls.iter().enumerate() {
            let re = match call.pattern() {
                Some(p) => Some(Regex::new(p).map_err(|e| RegexError {
                    index,
                    pattern: p.to_string(),
                    message: e.to_string(),
                })?),
                None => None,
            };
            out.push((call.clone(), re));
        }
        Ok(HostFns { calls: out })
    }

    /// Evaluates call `index` on one sample's text: an `Int`, or `0`/`1` for a `Bool`.
    /// An index out of range yields `0` (the verifier rules it out; this never panics).
    pub fn call(&self, index: usize, text: &SampleText) -> i64 {
        let Some((call, re)) = self.calls.get(index) else {
            return 0;
        };
        match (call, re) {
            (HostCall::CountRegex { field, .. }, Some(re)) => {
                i64::try_from(re.find_iter(field.of(text)).count()).unwrap_or(i64::MAX)
            }
            (HostCall::MatchesRegex { field, .. }, Some(re)) => {
                i64::from(re.is_match(field.of(text)))
            }
            (HostCall::CountRegex { .. } | HostCall::MatchesRegex { .. }, None) => 0,
            (HostCall::Contains { field, lit, .. }, _) => {
                i64::from(field.of(text).contains(lit.as_str()))
            }
            (HostCall::StartsWith { field, lit, .. }, _) => {
                i64::from(field.of(text).starts_with(lit.as_str()))
            }
            (HostCall::EndsWith { field, lit, .. }, _) => {
                i64::from(field.of(text).ends_with(lit.as_str()))
            }
            (HostCall::StrLen { field, .. }, _) => {
                i64::try_from(field.of(text).chars().count()).unwrap_or(i64::MAX)
            }
            (
                HostCall::AnswerMatches {
                    completion, answer, ..
                },
                _,
            ) => i64::from(answer_matches(completion.of(text), answer.of(text))),
        }
    }
}

/// Numeric answer matching (see [`HostCall::AnswerMatches`]).
pub fn answer_matches(completion: &str, answer: &str) -> bool {
    match (final_number(completion), final_number(answer)) {
        (Some(a), Some(b)) => a == b,
        _ => false,
    }
}

/// The number a text ends on: the last number inside the last `\boxed{…}` when the text has
/// one, else the last number of the text.
pub fn final_number(text: &str) -> Option<f64> {
    if let Some(start) = text.rfind("\\boxed{") {
        let inner = &text[start + "\\boxed{".len()..];
        let inner = inner.find('}').map_or(inner, |end| &inner[..end]);
        if let Some(n) = last_number(inner) {
            return Some(n);
        }
    }
    last_number(text)
}

/// The last number of a text: an optional `-`, digits with `,` allowed between digits, an
/// optional fraction; `$` before it is skipped by the scan.
fn last_number(text: &str) -> Option<f64> {
    let bytes = text.as_bytes();
    let mut i = bytes.len();
    // Find the last digit, then widen to the number's start and end.
    while i > 0 && !bytes[i - 1].is_ascii_digit() {
        i -= 1;
    }
    if i == 0 {
        return None;
    }
    let end = i;
    let mut start = end;
    while start > 0 {
        let c = bytes[start - 1];
        let between_digits = (c == b',' || c == b'.')
            && start >= 2
            && bytes[start - 2].is_ascii_digit()
            && bytes.get(start).is_some_and(u8::is_ascii_digit);
        if c.is_ascii_digit() || between_digits {
            start -= 1;
        } else {
            break;
        }
    }
    let negative = start > 0 && bytes[start - 1] == b'-'
        || start > 1 && bytes[start - 1] == b'$' && bytes[start - 2] == b'-';
    let digits: String = text[start..end].chars().filter(|c| *c != ',').collect();
    // Several dots (a date such as 1.2.3) are not a number we can compare; take the tail.
    let digits = match digits.matches('.').count() {
        0 | 1 => digits,
        _ => digits.rsplit('.').next().unwrap_or_default().to_string(),
    };
    let v: f64 = digits.parse().ok()?;
    Some(if negative { -v } else { v })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn final_numbers() {
        assert_eq!(final_number("so the answer is 1,000."), Some(1000.0));
        assert_eq!(final_number("$12.50 total"), Some(12.5));
        assert_eq!(final_number("x = -3"), Some(-3.0));
        assert_eq!(final_number("\\boxed{42} and then 7"), Some(42.0));
        assert_eq!(final_number("1000.0"), Some(1000.0));
        assert_eq!(final_number("no digits"), None);
    }

    #[test]
    fn answer_matching() {
        assert!(answer_matches("The total is $1,000.", "1000"));
        assert!(answer_matches("\\boxed{1000.0}", "1000"));
        assert!(!answer_matches("The total is 999", "1000"));
        assert!(!answer_matches("nothing", "1000"));
    }

    #[test]
    fn calls() {
        let t = SampleText {
            prompt: "p".into(),
            completion: "banana".into(),
            answer: "".into(),
        };
        let f = HostFns::compile(&[
            HostCall::CountRegex {
                param: 0,
                field: StrField::Completion,
                pattern: "[aeiou]".into(),
            },
            HostCall::StrLen {
                param: 0,
                field: StrField::Completion,
            },
            HostCall::EndsWith {
                param: 0,
                field: StrField::Completion,
                lit: "na".into(),
            },
            HostCall::MatchesRegex {
                param: 0,
                field: StrField::Prompt,
                pattern: "^q".into(),
            },
        ])
        .unwrap();
        assert_eq!(f.call(0, &t), 3);
        assert_eq!(f.call(1, &t), 6);
        assert_eq!(f.call(2, &t), 1);
        assert_eq!(f.call(3, &t), 0);
        assert_eq!(f.call(9, &t), 0);
        assert!(
            HostFns::compile(&[HostCall::CountRegex {
                param: 0,
                field: StrField::Prompt,
                pattern: "(".into()
            }])
            .is_err()
        );
    }
}
