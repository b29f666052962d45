//! Host built-ins: the string functions a kernel calls on a sample's text, the reads of its
//! dataset record's other fields, and their one implementation, shared by the interpreter and
//! by the JIT (which calls [`HostFns::call`] through `extern "C"` callbacks, see
//! `docs/kernels.md`, "Host ABI").
//!
//! Patterns, literals and field names are compile-time constants of the kernel; regexes are
//! compiled once per kernel by [`HostFns::compile`]. Nothing here may panic: a callback
//! unwinding into JIT code would abort the process. A record field a call reads is checked to
//! be present, with a type the call accepts, by the driver before any sample is evaluated
//! ([`super::exec::run_kernel`]), so a call never has to report a missing field.

use std::collections::BTreeMap;

use super::exec::SampleText;
use super::{ScalarTy, Ty};
use regex::Regex;
use serde::{Deserialize, Serialize};

/// A string of a `Sample` parameter: one of its own texts, or a string field of the dataset
/// record its prompt came from.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum StrField {
    Prompt,
    Completion,
    Answer,
    /// `field(s, "name")`: the record's string field `name`.
    Record(String),
}

impl StrField {
    /// How the text form and messages write it: `prompt`, `field("topic")`.
    pub fn name(&self) -> String {
        match self {
            StrField::Prompt => "prompt".into(),
            StrField::Completion => "completion".into(),
            StrField::Answer => "answer".into(),
            StrField::Record(n) => format!("field({n:?})"),
        }
    }

    fn of<'t>(&self, t: &'t SampleText) -> &'t str {
        match self {
            StrField::Prompt => &t.prompt,
            StrField::Completion => &t.completion,
            StrField::Answer => &t.answer,
            // Checked by the driver before evaluation (see the module doc).
            StrField::Record(n) => match t.fields.get(n) {
                Some(FieldValue::Str(s)) => s,
                _ => "",
            },
        }
    }
}

/// The type a kernel reads a record field as: `field` (a string), `field_int`, `field_float`,
/// `field_bool`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FieldTy {
    Str,
    Int,
    Float,
    Bool,
}

impl FieldTy {
    /// The built-in that reads a field as this type.
    pub fn reader(self) -> &'static str {
        match self {
            FieldTy::Str => "field",
            FieldTy::Int => "field_int",
            FieldTy::Float => "field_float",
            FieldTy::Bool => "field_bool",
        }
    }

    /// `a string`, `an int`, …: for messages.
    pub fn describe(self) -> &'static str {
        match self {
            FieldTy::Str => "a string",
            FieldTy::Int => "an int",
            FieldTy::Float => "a number",
            FieldTy::Bool => "a bool",
        }
    }

    /// Whether a value can be read as this type: exactly its own type, except that an int
    /// reads as a float (JSON writes `2` for the float 2.0). Nothing else converts: a string
    /// holding digits is not a number, and a number is not a string.
    pub fn accepts(self, v: &FieldValue) -> bool {
        matches!(
            (self, v),
            (FieldTy::Str, FieldValue::Str(_))
                | (FieldTy::Int, FieldValue::Int(_))
                | (FieldTy::Float, FieldValue::Float(_) | FieldValue::Int(_))
                | (FieldTy::Bool, FieldValue::Bool(_))
        )
    }
}

impl From<ScalarTy> for FieldTy {
    fn from(t: ScalarTy) -> FieldTy {
        match t {
            ScalarTy::Int => FieldTy::Int,
            ScalarTy::Float => FieldTy::Float,
            ScalarTy::Bool => FieldTy::Bool,
        }
    }
}

/// A field of a dataset record that a kernel reads, with the type it reads it as.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct RecordField {
    pub name: String,
    pub ty: FieldTy,
}

impl RecordField {
    /// Checks a record's value of this field (`None`: the record has none). The error says
    /// what is wrong in words, for a message that names the record's file and line.
    pub fn check(&self, v: Option<&FieldValue>) -> Result<(), String> {
        let reader = self.ty.reader();
        match v {
            None => Err(format!(
                "has no field `{}`, which `{reader}(s, \"{}\")` reads",
                self.name, self.name
            )),
            Some(v) if !self.ty.accepts(v) => Err(format!(
                "field `{}` is {}, but `{reader}` reads {} (read it with `{}`)",
                self.name,
                v.describe(),
                self.ty.describe(),
                v.ty().reader()
            )),
            Some(_) => Ok(()),
        }
    }
}

/// The value of a record field. Deserialises from a JSON scalar (untagged): `true`, `2`,
/// `2.5`, `"x"`; an integer beyond `i64` becomes a float. Arrays, objects and `null` are not
/// field values.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum FieldValue {
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
}

impl FieldValue {
    /// `a string`, `an int`, …: for messages.
    pub fn describe(&self) -> &'static str {
        match self {
            FieldValue::Bool(_) => "a bool",
            FieldValue::Int(_) => "an int",
            FieldValue::Float(_) => "a float",
            FieldValue::Str(_) => "a string",
        }
    }

    /// Its own type.
    pub fn ty(&self) -> FieldTy {
        match self {
            FieldValue::Bool(_) => FieldTy::Bool,
            FieldValue::Int(_) => FieldTy::Int,
            FieldValue::Float(_) => FieldTy::Float,
            FieldValue::Str(_) => FieldTy::Str,
        }
    }
}

/// The record fields of one sample, by name.
pub type Fields = BTreeMap<String, FieldValue>;

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
    /// `text == "lit"` -> bool (`!=` is its negation).
    Equals {
        param: u32,
        field: StrField,
        lit: String,
    },
    /// `a == b` on two texts of the same sample -> bool.
    TextsEqual {
        param: u32,
        a: StrField,
        b: StrField,
    },
    /// `field_int(s, "name")`, `field_float`, `field_bool`: the record's field as an `Int`, a
    /// `Float` (an int field converted) or a `Bool`.
    Field {
        param: u32,
        name: String,
        ty: ScalarTy,
    },
}

impl HostCall {
    /// The type the call yields: `Int` or `Bool`, or a record field's type. A `Float` travels
    /// through the host ABI's `i64` as its bits.
    pub fn result_ty(&self) -> Ty {
        match self {
            HostCall::CountRegex { .. } | HostCall::StrLen { .. } => Ty::Int,
            HostCall::Field { ty, .. } => ty.ty(),
            _ => Ty::Bool,
        }
    }

    /// The record fields the call reads, with the type it reads each as.
    pub fn record_fields(&self) -> Vec<RecordField> {
        let text = |f: &StrField| match f {
            StrField::Record(name) => Some(RecordField {
                name: name.clone(),
                ty: FieldTy::Str,
            }),
            _ => None,
        };
        match self {
            HostCall::CountRegex { field, .. }
            | HostCall::MatchesRegex { field, .. }
            | HostCall::Contains { field, .. }
            | HostCall::StartsWith { field, .. }
            | HostCall::EndsWith { field, .. }
            | HostCall::StrLen { field, .. }
            | HostCall::Equals { field, .. } => text(field).into_iter().collect(),
            HostCall::AnswerMatches {
                completion: a,
                answer: b,
                ..
            }
            | HostCall::TextsEqual { a, b, .. } => text(a).into_iter().chain(text(b)).collect(),
            HostCall::Field { name, ty, .. } => vec![RecordField {
                name: name.clone(),
                ty: (*ty).into(),
            }],
        }
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
            | HostCall::AnswerMatches { param, .. }
            | HostCall::Equals { param, .. }
            | HostCall::TextsEqual { param, .. }
            | HostCall::Field { param, .. } => *param,
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

    /// Evaluates call `index` on one sample's text: an `Int`, `0`/`1` for a `Bool`, or a
    /// `Float`'s bits. An index out of range, or a record field the driver has not checked,
    /// yields `0` (neither happens after verification and the driver's checks; this never
    /// panics).
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
            (HostCall::Equals { field, lit, .. }, _) => i64::from(field.of(text) == lit),
            (HostCall::TextsEqual { a, b, .. }, _) => i64::from(a.of(text) == b.of(text)),
            (HostCall::Field { name, ty, .. }, _) => match (ty, text.fields.get(name)) {
                (ScalarTy::Int, Some(FieldValue::Int(i))) => *i,
                (ScalarTy::Float, Some(FieldValue::Float(x))) => x.to_bits() as i64,
                (ScalarTy::Float, Some(FieldValue::Int(i))) => (*i as f64).to_bits() as i64,
                (ScalarTy::Bool, Some(FieldValue::Bool(b))) => i64::from(*b),
                _ => 0,
            },
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
            ..SampleText::default()
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

    #[test]
    fn record_fields_read_as_their_type_and_string_equality() {
        let mut fields = Fields::new();
        fields.insert("difficulty".into(), FieldValue::Int(2));
        fields.insert("weight".into(), FieldValue::Float(0.5));
        fields.insert("hard".into(), FieldValue::Bool(true));
        fields.insert("topic".into(), FieldValue::Str("math".into()));
        let t = SampleText {
            prompt: "p".into(),
            completion: "math".into(),
            answer: "".into(),
            fields,
        };
        let topic = StrField::Record("topic".into());
        let calls = [
            HostCall::Field {
                param: 0,
                name: "difficulty".into(),
                ty: ScalarTy::Int,
            },
            HostCall::Field {
                param: 0,
                name: "difficulty".into(),
                ty: ScalarTy::Float,
            },
            HostCall::Field {
                param: 0,
                name: "weight".into(),
                ty: ScalarTy::Float,
            },
            HostCall::Field {
                param: 0,
                name: "hard".into(),
                ty: ScalarTy::Bool,
            },
            HostCall::Equals {
                param: 0,
                field: topic.clone(),
                lit: "math".into(),
            },
            HostCall::TextsEqual {
                param: 0,
                a: topic.clone(),
                b: StrField::Completion,
            },
            HostCall::StrLen {
                param: 0,
                field: topic.clone(),
            },
        ];
        let f = HostFns::compile(&calls).unwrap();
        assert_eq!(f.call(0, &t), 2);
        assert_eq!(f64::from_bits(f.call(1, &t) as u64), 2.0);
        assert_eq!(f64::from_bits(f.call(2, &t) as u64), 0.5);
        assert_eq!(f.call(3, &t), 1);
        assert_eq!(f.call(4, &t), 1);
        assert_eq!(f.call(5, &t), 1);
        assert_eq!(f.call(6, &t), 4);
        assert_eq!(calls[1].result_ty(), Ty::Float);
        assert_eq!(
            calls[5].record_fields(),
            vec![RecordField {
                name: "topic".into(),
                ty: FieldTy::Str
            }]
        );
        // Only an int widens; nothing else converts.
        assert!(FieldTy::Float.accepts(&FieldValue::Int(1)));
        assert!(!FieldTy::Int.accepts(&FieldValue::Float(1.0)));
        assert!(!FieldTy::Str.accepts(&FieldValue::Int(1)));
        assert!(!FieldTy::Int.accepts(&FieldValue::Str("1".into())));
    }
}
