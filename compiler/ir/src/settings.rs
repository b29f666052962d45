//! The closed sets of choices a program makes about its models and data, as enums shared by
//! the checker, the planner and the runtime: a model's head and dtype, an optimizer's
//! learning-rate schedule, how a `generate` speculates, and which synthetic dataset to draw.
//!
//! Architecture Invariant: no decision crosses a crate boundary as a string. The checker
//! turns the program's words into these values (an unknown word is a diagnostic there); the
//! plan's JSON form spells them in `snake_case`, and an unknown spelling is a load error naming
//! the field — never a fallback to a default.

use std::fmt;

use serde::{Deserialize, Serialize};

/// What a model computes on top of its final hidden states.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Head {
    /// Next-token logits (`lm_head.weight`, or the embedding when tied).
    Lm,
    /// A scalar per token (a critic). Stored as `score.weight` of shape `[1, hidden]`, the layout
    /// of a transformers `*ForSequenceClassification` with one label, which is what TRL uses as
    /// a value model; a checkpoint without it gets a new head initialised small.
    Value,
    /// A scalar per sequence, read at its last non-pad token (a reward model): `score.weight`
    /// of a sequence-classification checkpoint.
    Score,
}

impl Head {
    pub fn as_str(self) -> &'static str {
        match self {
            Head::Lm => "lm",
            Head::Value => "value",
            Head::Score => "score",
        }
    }

    pub fn parse(s: &str) -> Option<Head> {
        Some(match s {
            "lm" => Head::Lm,
            "value" => Head::Value,
            "score" => Head::Score,
            _ => return None,
        })
    }
}

impl fmt::Display for Head {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The precision a model computes in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Dtype {
    F32,
    Bf16,
    F16,
}

impl Dtype {
    pub fn as_str(self) -> &'static str {
        match self {
            Dtype::F32 => "f32",
            Dtype::Bf16 => "bf16",
            Dtype::F16 => "f16",
        }
    }

    pub fn parse(s: &str) -> Option<Dtype> {
        Some(match s {
            "f32" => Dtype::F32,
            "bf16" => Dtype::Bf16,
            "f16" => Dtype::F16,
            _ => return None,
        })
    }

    /// Bytes per element.
    pub fn bytes(self) -> u64 {
        match self {
            Dtype::F32 => 4,
            Dtype::Bf16 | Dtype::F16 => 2,
        }
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The learning rate after warm-up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LrSchedule {
    Constant,
    /// Half a cosine from the peak down to zero at the last step.
    Cosine,
    /// A straight line from the peak down to zero at the last step.
    Linear,
}

impl LrSchedule {
    pub fn as_str(self) -> &'static str {
        match self {
            LrSchedule::Constant => "constant",
            LrSchedule::Cosine => "cosine",
            LrSchedule::Linear => "linear",
        }
    }

    pub fn parse(s: &str) -> Option<LrSchedule> {
        Some(match s {
            "constant" => LrSchedule::Constant,
            "cosine" => LrSchedule::Cosine,
            "linear" => LrSchedule::Linear,
            _ => return None,
        })
    }
}

impl fmt::Display for LrSchedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// `ngram:N` drafts at most this many tokens.
pub const MAX_DRAFT: u32 = 64;

/// How a `generate` runs speculative decoding.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(tag = "mode", rename_all = "snake_case")]
pub enum Speculation {
    /// Plain decoding: one token per sample per step.
    Off,
    /// Prompt-lookup (n-gram) drafts, with the draft length chosen before every step from
    /// measured costs and acceptance rates (0 where speculation does not pay).
    Auto,
    /// Prompt-lookup drafts of up to `max_draft` tokens at every step where a match exists.
    Ngram { max_draft: u32 },
    /// Drafts from the language model in this directory (relative to the program), which must
    /// share the target's tokenizer; the draft length chosen per step as in `Auto`.
    Draft { dir: String },
}

impl Speculation {
    /// The `braid generate --speculate` spelling: `off`, `auto`, `ngram:N`, `draft:DIR`.
    pub fn to_flag(&self) -> String {
        match self {
            Speculation::Off => "off".into(),
            Speculation::Auto => "auto".into(),
            Speculation::Ngram { max_draft } => format!("ngram:{max_draft}"),
            Speculation::Draft { dir } => format!("draft:{dir}"),
        }
    }

    /// Parses the `--speculate` spelling; `ngram` alone drafts up to `default_ngram` tokens.
    pub fn parse_flag(s: &str, default_ngram: u32) -> Result<Speculation, String> {
        match s {
            "off" => Ok(Speculation::Off),
            "auto" => Ok(Speculation::Auto),
            "ngram" => Ok(Speculation::Ngram {
                max_draft: default_ngram,
            }),
            _ => {
                if let Some(n) = s.strip_prefix("ngram:") {
                    return match n.parse::<u32>() {
                        Ok(n) if (1..=MAX_DRAFT).contains(&n) => {
                            Ok(Speculation::Ngram { max_draft: n })
                        }
                        _ => Err(format!(
                            "`{s}`: the draft length after `ngram:` must be a number from 1 to {MAX_DRAFT}"
                        )),
                    };
                }
                if let Some(dir) = s.strip_prefix("draft:") {
                    if dir.is_empty() {
                        return Err("`draft:` needs a model directory, as in `draft:DIR`".into());
                    }
                    return Ok(Speculation::Draft { dir: dir.into() });
                }
                Err(format!(
                    "unknown mode `{s}` (expected off, auto, ngram, ngram:N or draft:DIR)"
                ))
            }
        }
    }
}

impl fmt::Display for Speculation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_flag())
    }
}

/// The generators of `synthetic::…` datasets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SyntheticKind {
    /// Three to six random lowercase letters and a space.
    Letters,
    /// `A + B =` with `digits`-digit operands; the answer is the sum.
    Arithmetic,
    /// Arithmetic word problems of one or two steps; the answer is the number, the record's
    /// `difficulty` its number of steps.
    WordProblems,
}

/// Where a dataset's records hold their prompts: `fields: { prompt: … }` names a text field,
/// `fields: { messages: … }` an array of chat messages (system, user and assistant turns); a
/// dataset that names neither takes, per record, whichever of `prompt` and `messages` it has.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum PromptFrom {
    /// The prompt field or the messages field, whichever the record has (both is an error).
    #[default]
    Either,
    /// The prompt field (mapped explicitly).
    Text,
    /// The messages field (mapped explicitly).
    Messages,
}

/// Which part of a synthetic dataset's problems a source draws: every generated problem
/// belongs to one part by a hash of its text, so the training and held-out parts of one
/// generator never share a problem, whatever their seeds and counts.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum Split {
    /// Every generated problem.
    #[default]
    All,
    /// The problems not held out (seven in eight).
    Train,
    /// The held-out problems (one in eight), for evaluation.
    HeldOut,
}

impl Split {
    pub fn as_str(self) -> &'static str {
        match self {
            Split::All => "all",
            Split::Train => "train",
            Split::HeldOut => "held_out",
        }
    }

    pub fn parse(s: &str) -> Option<Split> {
        Some(match s {
            "all" => Split::All,
            "train" => Split::Train,
            "held_out" => Split::HeldOut,
            _ => return None,
        })
    }
}

impl SyntheticKind {
    pub fn as_str(self) -> &'static str {
        match self {
            SyntheticKind::Letters => "letters",
            SyntheticKind::Arithmetic => "arithmetic",
            SyntheticKind::WordProblems => "word_problems",
        }
    }

    pub fn parse(s: &str) -> Option<SyntheticKind> {
        Some(match s {
            "letters" => SyntheticKind::Letters,
            "arithmetic" => SyntheticKind::Arithmetic,
            "word_problems" => SyntheticKind::WordProblems,
            _ => return None,
        })
    }
}

impl fmt::Display for SyntheticKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spellings_round_trip() {
        for h in [Head::Lm, Head::Value, Head::Score] {
            assert_eq!(Head::parse(h.as_str()), Some(h));
        }
        for d in [Dtype::F32, Dtype::Bf16, Dtype::F16] {
            assert_eq!(Dtype::parse(d.as_str()), Some(d));
        }
        for s in [LrSchedule::Constant, LrSchedule::Cosine, LrSchedule::Linear] {
            assert_eq!(LrSchedule::parse(s.as_str()), Some(s));
        }
        for k in [
            SyntheticKind::Letters,
            SyntheticKind::Arithmetic,
            SyntheticKind::WordProblems,
        ] {
            assert_eq!(SyntheticKind::parse(k.as_str()), Some(k));
        }
        for s in [Split::All, Split::Train, Split::HeldOut] {
            assert_eq!(Split::parse(s.as_str()), Some(s));
        }
        for s in [
            Speculation::Off,
            Speculation::Auto,
            Speculation::Ngram { max_draft: 3 },
            Speculation::Draft { dir: "m".into() },
        ] {
            assert_eq!(Speculation::parse_flag(&s.to_flag(), 8), Ok(s));
        }
        assert!(Speculation::parse_flag("ngram:0", 8).is_err());
        assert!(Speculation::parse_flag("ngram:65", 8).is_err());
        assert!(Speculation::parse_flag("draft:", 8).is_err());
        assert!(Speculation::parse_flag("fast", 8).is_err());
        assert_eq!(Head::parse("lm_head"), None);
    }

    #[test]
    fn json_spellings_are_snake_case_and_unknown_ones_fail() {
        assert_eq!(serde_json::to_string(&Dtype::Bf16).unwrap(), "\"bf16\"");
        assert_eq!(
            serde_json::to_string(&Speculation::Ngram { max_draft: 4 }).unwrap(),
            r#"{"mode":"ngram","max_draft":4}"#
        );
        assert!(serde_json::from_str::<Head>("\"policy\"").is_err());
        assert!(serde_json::from_str::<LrSchedule>("\"exponential\"").is_err());
    }
}
