//! Prompt datasets: JSONL and Parquet files of plain prompts or chat conversations, with field
//! mapping, and the synthetic sources used by demos and tests. A dataset is read once;
//! `next(dataset, n)` draws from a cursor over its records in an order fixed by the dataset's
//! seed (shuffled per epoch when asked), so the draw at any cursor position can be recomputed —
//! a resumed run only needs the cursor.
//!
//! **What a record must hold is checked when it is loaded**, with the file and line (or row) of
//! any record that does not: its prompt (a non-empty text, or a well-formed conversation with a
//! user turn), and every field that the plan's kernels read from this dataset's samples
//! (`DatasetSpec::fields`, from `field_int(s, "difficulty")` and its kin), with a type its
//! reader accepts. Checking at load time rather than when a reward first reads the field means
//! a bad record stops the run before its first step instead of hours into it, and the error can
//! name the line, which a kernel running over a batch of samples no longer knows.

use std::path::{Path, PathBuf};

use braid_ir::graph::{DatasetSource, DatasetSpec, PromptFrom, Split, SyntheticKind};
use braid_ir::kernel::{FieldValue, Fields, RecordField};
use serde_json::{Map, Value};

use crate::error::{Error, Result};
use crate::models::tokenizer::ChatMessage;
use crate::rng::Rng;

/// One prompt and its reference answer (empty when the data has none), with the record's
/// fields that the run's kernels read (`field(s, "name")` in a reward).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Record {
    /// The prompt: a plain prompt's text, or a conversation's last user turn (what `s.prompt`
    /// reads).
    pub prompt: String,
    pub answer: String,
    /// A conversation's turns up to and including its last user turn: the prompt the policy
    /// answers, rendered with its chat template. `None` for a plain prompt.
    pub messages: Option<Vec<ChatMessage>>,
    /// The fields the plan's kernels read, checked present and well-typed when loaded.
    pub fields: Fields,
}

impl Record {
    /// The conversation the prompt is: its turns, or a plain prompt as one user turn.
    pub fn conversation(&self) -> Vec<ChatMessage> {
        match &self.messages {
            Some(m) => m.clone(),
            None => vec![ChatMessage {
                role: "user".into(),
                content: self.prompt.clone(),
            }],
        }
    }
}

/// A loaded dataset.
#[derive(Debug, Clone)]
pub struct Dataset {
    pub name: String,
    pub records: Vec<Record>,
    shuffle: bool,
    seed: u64,
    epochs: Option<i64>,
    pub chat_template: bool,
}

impl Dataset {
    /// Loads a dataset; relative paths are read from `base_dir` (the program's directory).
    pub fn load(spec: &DatasetSpec, base_dir: &Path) -> Result<Dataset> {
        let layout = Layout::of(spec);
        let records = match &spec.source {
            DatasetSource::Jsonl { path } => read_jsonl(&resolve(base_dir, path), &layout)?,
            DatasetSource::Parquet { path } => read_parquet(&resolve(base_dir, path), &layout)?,
            DatasetSource::Synthetic {
                kind,
                count,
                seed,
                digits,
                split,
            } => {
                let records = synthetic(*kind, *count, *seed, *digits, *split)?;
                // Generated records hold the same fields whatever the seed, so one without a
                // field a kernel reads means the source never has it: say which it has.
                for f in &spec.fields {
                    if let Some(r) = records.first()
                        && let Err(why) = f.check(r.fields.get(&f.name))
                    {
                        let has: Vec<&str> = r.fields.keys().map(String::as_str).collect();
                        return Err(Error::invalid(
                            format!("dataset `{}` (synthetic::{kind})", spec.name),
                            format!(
                                "a record {why}; its records have {}",
                                if has.is_empty() {
                                    "no other fields".to_string()
                                } else {
                                    format!("the fields {}", has.join(", "))
                                }
                            ),
                        ));
                    }
                }
                records
            }
        };
        if records.is_empty() {
            return Err(Error::invalid(
                format!("dataset `{}`", spec.name),
                "has no records",
            ));
        }
        Ok(Dataset {
            name: spec.name.clone(),
            records,
            shuffle: spec.shuffle,
            seed: spec.seed as u64,
            epochs: spec.epochs,
            chat_template: spec.chat_template,
        })
    }

    /// How many records `next` may draw in all (`None`: unbounded, epochs repeat).
    pub fn capacity(&self) -> Option<u64> {
        self.epochs
            .map(|e| e.max(0) as u64 * self.records.len() as u64)
    }

    /// The record drawn at cursor position `pos`.
    pub fn at(&self, pos: u64) -> &Record {
        let n = self.records.len() as u64;
        let i = (pos % n) as usize;
        if !self.shuffle {
            return &self.records[i];
        }
        &self.records[self.order(pos / n)[i]]
    }

    /// The permutation of epoch `epoch` (Fisher–Yates from the dataset's seed and the epoch).
    fn order(&self, epoch: u64) -> Vec<usize> {
        let mut idx: Vec<usize> = (0..self.records.len()).collect();
        Rng::new(self.seed ^ epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15)).shuffle(&mut idx);
        idx
    }

    /// `n` records from cursor `pos`, checking the epoch limit.
    pub fn draw(&self, pos: u64, n: u64) -> Result<Vec<Record>> {
        if let Some(cap) = self.capacity()
            && pos + n > cap
        {
            return Err(Error::invalid(
                format!("dataset `{}`", self.name),
                format!(
                    "is exhausted: {} records × {} epochs = {cap} prompts, and the run needs more; raise `epochs` or lower `steps`",
                    self.records.len(),
                    self.epochs.unwrap_or(0)
                ),
            ));
        }
        // One permutation per epoch the draw touches, not one per record.
        let len = self.records.len() as u64;
        let mut order: Option<(u64, Vec<usize>)> = None;
        let mut out = Vec::with_capacity(n as usize);
        for p in pos..pos + n {
            let (epoch, i) = (p / len, (p % len) as usize);
            let r = if self.shuffle {
                if order.as_ref().is_none_or(|(e, _)| *e != epoch) {
                    order = Some((epoch, self.order(epoch)));
                }
                order.as_ref().map_or(i, |(_, o)| o[i])
            } else {
                i
            };
            out.push(self.records[r].clone());
        }
        Ok(out)
    }
}

fn resolve(base: &Path, path: &str) -> PathBuf {
    let p = Path::new(path);
    if p.is_absolute() {
        p.to_path_buf()
    } else {
        base.join(p)
    }
}

/// How a file's records are read: which fields hold the prompt, the conversation and the
/// answer, and which other fields the run's kernels need.
#[derive(Debug, Clone, PartialEq)]
pub struct Layout {
    pub prompt_field: String,
    pub answer_field: String,
    pub messages_field: String,
    pub prompt_from: PromptFrom,
    pub fields: Vec<RecordField>,
}

impl Layout {
    pub fn of(spec: &DatasetSpec) -> Layout {
        Layout {
            prompt_field: spec.prompt_field.clone(),
            answer_field: spec.answer_field.clone(),
            messages_field: spec.messages_field.clone(),
            prompt_from: spec.prompt_from,
            fields: spec.fields.clone(),
        }
    }

    /// Plain prompts in `prompt`, answers in `answer`, nothing else read.
    pub fn plain(prompt: &str, answer: &str) -> Layout {
        Layout {
            prompt_field: prompt.into(),
            answer_field: answer.into(),
            messages_field: "messages".into(),
            prompt_from: PromptFrom::Text,
            fields: Vec::new(),
        }
    }
}

/// How errors name a record's parts: a JSONL line's fields, a Parquet row's columns.
#[derive(Clone, Copy)]
struct Words {
    field: &'static str,
    /// Where the keys a missing-field error lists come from.
    has: &'static str,
}

const JSONL: Words = Words {
    field: "field",
    has: "the line has",
};
const PARQUET: Words = Words {
    field: "column",
    has: "the row has",
};

/// Reads a JSONL file: one object per line with a prompt or a conversation, an optional answer
/// and the fields the layout asks for. Empty lines are skipped.
pub fn read_jsonl(path: &Path, layout: &Layout) -> Result<Vec<Record>> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| Error::file(path, format!("cannot read: {e}")))?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let at = |what: String| Error::file(path, format!("line {}: {what}", i + 1));
        let v: Value =
            serde_json::from_str(line).map_err(|e| at(format!("not valid JSON: {e}")))?;
        let Some(obj) = v.as_object() else {
            return Err(at("expected a JSON object".into()));
        };
        out.push(record(obj, layout, JSONL).map_err(at)?);
    }
    if out.is_empty() {
        return Err(Error::file(path, "has no records"));
    }
    Ok(out)
}

/// Reads a Parquet file: one record per row, read like a JSONL line (a string column for the
/// prompt, or a list of `{role, content}` structs for a conversation; the answer a string or
/// number column). Uncompressed and snappy column chunks are read (snappy is pandas' and
/// pyarrow's default).
pub fn read_parquet(path: &Path, layout: &Layout) -> Result<Vec<Record>> {
    use parquet::file::reader::{FileReader, SerializedFileReader};
    let file =
        std::fs::File::open(path).map_err(|e| Error::file(path, format!("cannot read: {e}")))?;
    let reader = SerializedFileReader::new(file)
        .map_err(|e| Error::file(path, format!("not a readable Parquet file: {e}")))?;
    let rows = reader
        .get_row_iter(None)
        .map_err(|e| Error::file(path, format!("cannot read rows: {e}")))?;
    let mut out = Vec::new();
    for (i, row) in rows.enumerate() {
        let at = |what: String| Error::file(path, format!("row {}: {what}", i + 1));
        let row = row.map_err(|e| at(format!("cannot decode: {e}")))?;
        let obj: Map<String, Value> = row
            .get_column_iter()
            .map(|(name, field)| (name.clone(), parquet_json(field)))
            .collect();
        out.push(record(&obj, layout, PARQUET).map_err(at)?);
    }
    if out.is_empty() {
        return Err(Error::file(path, "has no rows"));
    }
    Ok(out)
}

/// A Parquet value as the JSON a JSONL file would hold: numbers, strings and booleans as
/// themselves, lists as arrays, structs as objects; a float that JSON cannot write (NaN, ±∞)
/// is `null`, and dates, times, decimals and bytes are their text.
fn parquet_json(f: &parquet::record::Field) -> Value {
    use parquet::record::Field as F;
    let float = |x: f64| serde_json::Number::from_f64(x).map_or(Value::Null, Value::Number);
    match f {
        F::Null => Value::Null,
        F::Bool(b) => Value::Bool(*b),
        F::Byte(n) => Value::from(*n),
        F::Short(n) => Value::from(*n),
        F::Int(n) => Value::from(*n),
        F::Long(n) => Value::from(*n),
        F::UByte(n) => Value::from(*n),
        F::UShort(n) => Value::from(*n),
        F::UInt(n) => Value::from(*n),
        F::ULong(n) => Value::from(*n),
        F::Float16(x) => float(f64::from(*x)),
        F::Float(x) => float(f64::from(*x)),
        F::Double(x) => float(*x),
        F::Str(s) => Value::String(s.clone()),
        F::Group(row) => Value::Object(
            row.get_column_iter()
                .map(|(k, v)| (k.clone(), parquet_json(v)))
                .collect(),
        ),
        F::ListInternal(list) => Value::Array(list.elements().iter().map(parquet_json).collect()),
        other => Value::String(other.to_string()),
    }
}

/// One record from a JSON object (a JSONL line, or a Parquet row as JSON); the error says what
/// is wrong, and the caller adds the file and line.
fn record(
    obj: &Map<String, Value>,
    layout: &Layout,
    words: Words,
) -> std::result::Result<Record, String> {
    let Words { field, has } = words;
    let present = |k: &str| obj.get(k).is_some_and(|v| !v.is_null());
    let keys = || {
        let keys: Vec<&str> = obj.keys().map(String::as_str).collect();
        if keys.is_empty() {
            "nothing".to_string()
        } else {
            keys.join(", ")
        }
    };
    let (pf, mf) = (&layout.prompt_field, &layout.messages_field);
    let conversation = match layout.prompt_from {
        PromptFrom::Text => false,
        PromptFrom::Messages => true,
        PromptFrom::Either => match (present(pf), present(mf)) {
            (true, false) => false,
            (false, true) => true,
            (true, true) => {
                return Err(format!(
                    "has both a prompt (`{pf}`) and a conversation (`{mf}`); say which one holds the prompt with `fields: {{ prompt: \"{pf}\" }}` or `fields: {{ messages: \"{mf}\" }}`"
                ));
            }
            (false, false) => {
                return Err(format!(
                    "has no prompt: no {field} `{pf}` (a text) and no {field} `{mf}` (chat messages); {has} {}; map the right one with `fields: {{ prompt: \"…\" }}` or `fields: {{ messages: \"…\" }}`",
                    keys()
                ));
            }
        },
    };
    let (prompt, messages, trailing) = if conversation {
        let Some(v) = obj.get(mf).filter(|v| !v.is_null()) else {
            return Err(format!(
                "missing {field} `{mf}` (the conversation); {has} {}; map another {field} with `fields: {{ messages: \"…\" }}`",
                keys()
            ));
        };
        let (turns, answer) = parse_conversation(v).map_err(|why| format!("`{mf}`: {why}"))?;
        let prompt = turns.last().map(|m| m.content.clone()).unwrap_or_default();
        (prompt, Some(turns), answer)
    } else {
        let prompt = match obj.get(pf) {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Null) => return Err(format!("{field} `{pf}` is null")),
            Some(other) => return Err(format!("{field} `{pf}` must be a string, found {other}")),
            None => {
                return Err(format!(
                    "missing {field} `{pf}` (the prompt); {has} {}; map another {field} with `fields: {{ prompt: \"…\" }}`",
                    keys()
                ));
            }
        };
        if prompt.is_empty() {
            return Err(format!("{field} `{pf}` is empty"));
        }
        (prompt, None, None)
    };
    let af = &layout.answer_field;
    let answer = match obj.get(af) {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Number(n)) => n.to_string(),
        // A conversation without an answer field answers itself with its trailing assistant
        // turn, when it has one.
        Some(Value::Null) | None => trailing.unwrap_or_default(),
        Some(other) => {
            return Err(format!(
                "{field} `{af}` must be a string or a number, found {other}"
            ));
        }
    };
    let mut fields = Fields::new();
    for f in &layout.fields {
        let v = match obj.get(&f.name) {
            None => None,
            Some(v) => Some(
                serde_json::from_value::<FieldValue>(v.clone()).map_err(|_| {
                    format!(
                        "{field} `{}` is {}, but `{}` reads {}",
                        f.name,
                        json_kind(v),
                        f.ty.reader(),
                        f.ty.describe()
                    )
                })?,
            ),
        };
        f.check(v.as_ref())?;
        if let Some(v) = v {
            fields.insert(f.name.clone(), v);
        }
    }
    Ok(Record {
        prompt,
        answer,
        messages,
        fields,
    })
}

/// What a JSON value that is not a field value is, in words.
fn json_kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
        _ => "a scalar",
    }
}

/// The roles a conversation's messages may have.
const ROLES: [&str; 3] = ["system", "user", "assistant"];

/// A conversation in the common Hugging Face chat format, `[{"role": …, "content": …}, …]`:
/// an optional system message first, then turns alternating between `user` and `assistant`,
/// starting with the user, every one with text. Returns the turns up to the last user turn
/// (the prompt) and the content of a trailing assistant turn (a reference answer). Messages
/// are numbered from 1 in errors.
pub fn parse_conversation(
    v: &Value,
) -> std::result::Result<(Vec<ChatMessage>, Option<String>), String> {
    let Some(items) = v.as_array() else {
        return Err(format!(
            "must be an array of {{\"role\": …, \"content\": …}} messages, found {}",
            json_kind(v).replace("a scalar", "a scalar value")
        ));
    };
    if items.is_empty() {
        return Err("the conversation has no messages".into());
    }
    let mut turns: Vec<ChatMessage> = Vec::with_capacity(items.len());
    for (i, m) in items.iter().enumerate() {
        let n = i + 1;
        let Some(m) = m.as_object() else {
            return Err(format!(
                "message {n} must be an object with `role` and `content`, found {m}"
            ));
        };
        let role = match m.get("role") {
            Some(Value::String(r)) => r.clone(),
            Some(other) => {
                return Err(format!(
                    "message {n}: `role` must be a string, found {other}"
                ));
            }
            None => return Err(format!("message {n} has no `role`")),
        };
        if !ROLES.contains(&role.as_str()) {
            return Err(format!(
                "message {n} has role `{role}`; roles are `system`, `user` and `assistant`"
            ));
        }
        let content = match m.get("content") {
            Some(Value::String(c)) => c.clone(),
            Some(Value::Null) | None => {
                return Err(format!("message {n} ({role}) has no `content`"));
            }
            Some(other) => {
                return Err(format!(
                    "message {n} ({role}): `content` must be a string, found {other}"
                ));
            }
        };
        if content.trim().is_empty() {
            return Err(format!("message {n} ({role}) has empty content"));
        }
        match (role.as_str(), turns.last().map(|t| t.role.as_str())) {
            ("system", Some(_)) => {
                return Err(format!(
                    "message {n} is a `system` message after the first; only the first message may be the system prompt"
                ));
            }
            ("assistant", None | Some("system")) => {
                return Err(format!(
                    "message {n} is an `assistant` turn before any `user` turn; a conversation starts with the user"
                ));
            }
            (r, Some(prev)) if r == prev => {
                return Err(format!(
                    "messages {} and {n} are both `{r}` turns; turns alternate between `user` and `assistant`",
                    n - 1
                ));
            }
            _ => {}
        }
        turns.push(ChatMessage { role, content });
    }
    let Some(last_user) = turns.iter().rposition(|t| t.role == "user") else {
        return Err("the conversation has no `user` turn; the prompt is the conversation up to its last user turn".into());
    };
    // Alternation leaves at most one turn after the last user turn: the assistant's answer.
    let answer = turns.get(last_user + 1).map(|t| t.content.clone());
    turns.truncate(last_user + 1);
    Ok((turns, answer))
}

/// The synthetic sources: `letters` (a few random lowercase letters followed by a space),
/// `arithmetic` (`a + b =` with `digits`-digit operands and the sum as the answer) and
/// `word_problems` (one- and two-step arithmetic stories asking for `Answer: N`). `split`
/// keeps the part of the generated problems whose text hashes into it (`held_out`: one in
/// eight), drawing until `count` are kept, so a training and a held-out source of the same
/// generator never share a problem.
pub fn synthetic(
    kind: SyntheticKind,
    count: i64,
    seed: i64,
    digits: i64,
    split: Split,
) -> Result<Vec<Record>> {
    let name = format!("synthetic::{kind}");
    if count <= 0 {
        return Err(Error::invalid(
            name,
            format!("`count` must be positive, found {count}"),
        ));
    }
    if kind == SyntheticKind::Arithmetic && !(1..=9).contains(&digits) {
        return Err(Error::invalid(
            name,
            format!("`digits` must be between 1 and 9, found {digits}"),
        ));
    }
    let mut rng = Rng::new(seed as u64 ^ 0x5EED_DA7A);
    let mut out = Vec::with_capacity(count as usize);
    // Every draw has a one-in-eight chance of being held out, so a split needs about eight
    // (held out) or 8/7 (train) draws per record; the bound only stops a generator whose
    // space is too small for `count` distinct draws into the part asked for.
    let max_draws = (count as u64).saturating_mul(64).max(4096);
    let mut draws = 0u64;
    while (out.len() as i64) < count {
        if draws == max_draws {
            return Err(Error::invalid(
                name,
                format!(
                    "generated only {} of {count} problems of split `{}` in {max_draws} draws",
                    out.len(),
                    split.as_str()
                ),
            ));
        }
        draws += 1;
        let r = match kind {
            SyntheticKind::Letters => {
                let len = 3 + (rng.next_u64() % 4) as usize;
                let mut s: String = (0..len)
                    .map(|_| (b'a' + (rng.next_u64() % 26) as u8) as char)
                    .collect();
                s.push(' ');
                Record {
                    prompt: s,
                    ..Record::default()
                }
            }
            SyntheticKind::Arithmetic => {
                let hi = 10u64.pow(digits as u32);
                let a = rng.next_u64() % hi;
                let b = rng.next_u64() % hi;
                Record {
                    prompt: format!("{a} + {b} ="),
                    answer: (a + b).to_string(),
                    ..Record::default()
                }
            }
            SyntheticKind::WordProblems => word_problem(&mut rng),
        };
        if in_split(&r.prompt, split) {
            out.push(r);
        }
    }
    Ok(out)
}

/// Whether a problem with this text belongs to `split` (FNV-1a of the text, one in eight
/// held out).
fn in_split(text: &str, split: Split) -> bool {
    let h = text.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    });
    let held_out = h % 8 == 0;
    match split {
        Split::All => true,
        Split::Train => !held_out,
        Split::HeldOut => held_out,
    }
}

const NAMES: &[&str] = &[
    "Ava", "Ben", "Chloe", "Dan", "Ella", "Finn", "Grace", "Hugo", "Iris", "Jack", "Lena", "Max",
    "Nora", "Omar", "Pia", "Sam",
];
const ITEMS: &[&str] = &[
    "apples", "books", "marbles", "stickers", "pencils", "cookies", "shells", "stamps",
];

/// One word problem: a story of one or two arithmetic steps, its answer and its difficulty
/// (the number of steps). Numbers stay small enough for a small model's arithmetic.
fn word_problem(rng: &mut Rng) -> Record {
    let pick =
        |rng: &mut Rng, list: &[&'static str]| list[(rng.next_u64() % list.len() as u64) as usize];
    let num = |rng: &mut Rng, lo: u64, hi: u64| lo + rng.next_u64() % (hi - lo + 1);
    let name = pick(rng, NAMES);
    let item = pick(rng, ITEMS);
    let (story, answer, steps) = match rng.next_u64() % 6 {
        0 => {
            let (a, b) = (num(rng, 2, 40), num(rng, 2, 40));
            (
                format!(
                    "{name} has {a} {item}. {name} gets {b} more. How many {item} does {name} have now?"
                ),
                a + b,
                1,
            )
        }
        1 => {
            let a = num(rng, 10, 60);
            let b = num(rng, 1, a - 1);
            (
                format!(
                    "{name} has {a} {item} and gives {b} of them away. How many {item} are left?"
                ),
                a - b,
                1,
            )
        }
        2 => {
            let (a, b) = (num(rng, 2, 9), num(rng, 2, 9));
            (
                format!(
                    "{name} fills {a} boxes with {b} {item} each. How many {item} is that in all?"
                ),
                a * b,
                1,
            )
        }
        3 => {
            let (k, q) = (num(rng, 2, 6), num(rng, 2, 9));
            (
                format!(
                    "{name} shares {} {item} equally among {k} friends. How many {item} does each friend get?",
                    k * q
                ),
                q,
                1,
            )
        }
        4 => {
            let (a, b) = (num(rng, 5, 30), num(rng, 2, 20));
            let c = num(rng, 1, a + b - 1);
            (
                format!(
                    "{name} has {a} {item}, buys {b} more and then loses {c}. How many {item} does {name} have now?"
                ),
                a + b - c,
                2,
            )
        }
        _ => {
            let (a, b, c) = (num(rng, 2, 6), num(rng, 2, 9), num(rng, 1, 15));
            (
                format!(
                    "{name} buys {a} bags with {b} {item} in each and already had {c}. How many {item} does {name} have?"
                ),
                a * b + c,
                2,
            )
        }
    };
    let mut fields = Fields::new();
    fields.insert("difficulty".to_string(), FieldValue::Int(steps));
    Record {
        prompt: format!("{story} Reply with the number after \"Answer:\"."),
        answer: answer.to_string(),
        messages: None,
        fields,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    fn spec(source: DatasetSource, shuffle: bool, epochs: Option<i64>) -> DatasetSpec {
        DatasetSpec {
            name: "d".into(),
            source,
            prompt_field: "prompt".into(),
            answer_field: "answer".into(),
            messages_field: "messages".into(),
            prompt_from: PromptFrom::Either,
            shuffle,
            seed: 3,
            chat_template: false,
            epochs,
            fields: Vec::new(),
        }
    }

    #[test]
    fn shuffled_epochs_visit_every_record_once() {
        let d = Dataset::load(
            &spec(
                DatasetSource::Synthetic {
                    kind: SyntheticKind::Letters,
                    count: 10,
                    seed: 1,
                    digits: 2,
                    split: Split::All,
                },
                true,
                None,
            ),
            Path::new("."),
        )
        .unwrap();
        for epoch in 0..3u64 {
            let mut seen: Vec<String> = (0..10)
                .map(|i| d.at(epoch * 10 + i).prompt.clone())
                .collect();
            seen.sort();
            let mut all: Vec<String> = d.records.iter().map(|r| r.prompt.clone()).collect();
            all.sort();
            assert_eq!(seen, all);
        }
        // A draw across an epoch boundary gives what `at` gives record by record.
        let drawn = d.draw(7, 6).unwrap();
        let one_by_one: Vec<Record> = (7..13).map(|p| d.at(p).clone()).collect();
        assert_eq!(drawn, one_by_one);
        // Two epochs differ in order (with overwhelming probability for this seed).
        let e0: Vec<_> = (0..10).map(|i| d.at(i).clone()).collect();
        let e1: Vec<_> = (10..20).map(|i| d.at(i).clone()).collect();
        assert_ne!(e0, e1);
    }

    #[test]
    fn train_and_held_out_word_problems_are_disjoint_and_answered() {
        let train = synthetic(SyntheticKind::WordProblems, 400, 7, 2, Split::Train).unwrap();
        let held = synthetic(SyntheticKind::WordProblems, 50, 7, 2, Split::HeldOut).unwrap();
        let other_seed = synthetic(SyntheticKind::WordProblems, 50, 8, 2, Split::HeldOut).unwrap();
        assert_eq!((train.len(), held.len()), (400, 50));
        let train_prompts: BTreeSet<&str> = train.iter().map(|r| r.prompt.as_str()).collect();
        for r in held.iter().chain(&other_seed) {
            assert!(!train_prompts.contains(r.prompt.as_str()), "{}", r.prompt);
            assert!(r.answer.parse::<u64>().is_ok(), "{}", r.answer);
            let d = r.fields.get("difficulty");
            assert!(matches!(d, Some(FieldValue::Int(1 | 2))), "{:?}", r.fields);
        }
        // Deterministic from the seed; the whole generator is the union of its splits.
        assert_eq!(
            held,
            synthetic(SyntheticKind::WordProblems, 50, 7, 2, Split::HeldOut).unwrap()
        );
        let all = synthetic(SyntheticKind::WordProblems, 64, 7, 2, Split::All).unwrap();
        assert!(all.iter().any(|r| in_split(&r.prompt, Split::HeldOut)));
        // A two-step story's answer is its arithmetic.
        let r = train
            .iter()
            .find(|r| r.prompt.contains("and then loses"))
            .unwrap();
        let n: Vec<i64> = r
            .prompt
            .split(|c: char| !c.is_ascii_digit())
            .filter_map(|w| w.parse().ok())
            .collect();
        assert_eq!(n[0] + n[1] - n[2], r.answer.parse::<i64>().unwrap());
    }

    #[test]
    fn epoch_limit_is_an_error() {
        let d = Dataset::load(
            &spec(
                DatasetSource::Synthetic {
                    kind: SyntheticKind::Arithmetic,
                    count: 4,
                    seed: 0,
                    digits: 2,
                    split: Split::All,
                },
                false,
                Some(2),
            ),
            Path::new("."),
        )
        .unwrap();
        assert!(d.draw(0, 8).is_ok());
        let e = d.draw(6, 4).unwrap_err().to_string();
        assert!(e.contains("exhausted"), "{e}");
        let r = &d.records[0];
        let (a, b) = r.prompt.trim_end_matches(" =").split_once(" + ").unwrap();
        assert_eq!(
            a.parse::<u64>().unwrap() + b.parse::<u64>().unwrap(),
            r.answer.parse::<u64>().unwrap()
        );
    }

    /// Writes a snappy-compressed Parquet file with a string column and an optional int column.
    fn write_parquet(path: &Path, prompts: &[&str], answers: &[Option<i64>]) {
        use parquet::basic::Compression;
        use parquet::data_type::ByteArray;
        use parquet::file::properties::WriterProperties;
        use parquet::file::writer::SerializedFileWriter;
        use parquet::schema::parser::parse_message_type;
        use std::sync::Arc;
        let schema = Arc::new(
            parse_message_type(
                "message s { REQUIRED BYTE_ARRAY question (UTF8); OPTIONAL INT64 answer; }",
            )
            .unwrap(),
        );
        let props = Arc::new(
            WriterProperties::builder()
                .set_compression(Compression::SNAPPY)
                .build(),
        );
        let file = std::fs::File::create(path).unwrap();
        let mut w = SerializedFileWriter::new(file, schema, props).unwrap();
        let mut rg = w.next_row_group().unwrap();
        let mut col = rg.next_column().unwrap().unwrap();
        let vals: Vec<ByteArray> = prompts.iter().map(|p| ByteArray::from(*p)).collect();
        col.typed::<parquet::data_type::ByteArrayType>()
            .write_batch(&vals, None, None)
            .unwrap();
        col.close().unwrap();
        let mut col = rg.next_column().unwrap().unwrap();
        let present: Vec<i64> = answers.iter().flatten().copied().collect();
        let defs: Vec<i16> = answers.iter().map(|a| i16::from(a.is_some())).collect();
        col.typed::<parquet::data_type::Int64Type>()
            .write_batch(&present, Some(&defs), None)
            .unwrap();
        col.close().unwrap();
        rg.close().unwrap();
        w.close().unwrap();
    }

    #[test]
    fn parquet_rows_become_records_and_bad_columns_name_the_row() {
        let dir = std::env::temp_dir().join(format!("braid-pq-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("d.parquet");
        write_parquet(&p, &["1 + 2 =", "3 + 4 ="], &[Some(3), None]);
        let r = read_parquet(&p, &Layout::plain("question", "answer")).unwrap();
        assert_eq!(
            r,
            vec![
                Record {
                    prompt: "1 + 2 =".into(),
                    answer: "3".into(),
                    ..Record::default()
                },
                Record {
                    prompt: "3 + 4 =".into(),
                    answer: String::new(),
                    ..Record::default()
                }
            ]
        );
        let e = read_parquet(&p, &Layout::plain("prompt", "answer"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("d.parquet")
                && e.contains("row 1")
                && e.contains("`prompt`")
                && e.contains("question"),
            "{e}"
        );
        std::fs::write(&p, b"not parquet").unwrap();
        let e = read_parquet(&p, &Layout::plain("question", "answer"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("d.parquet") && e.contains("Parquet"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn bad_jsonl_lines_name_the_file_and_line() {
        let dir = std::env::temp_dir().join(format!("braid-data-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("d.jsonl");
        std::fs::write(&p, "{\"q\": \"hi\", \"a\": 3}\n\n{\"x\": 1}\n").unwrap();
        let e = read_jsonl(&p, &Layout::plain("q", "a"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("d.jsonl") && e.contains("line 3") && e.contains("`q`"),
            "{e}"
        );
        std::fs::write(&p, "{\"q\": \"hi\", \"a\": 3}\nnot json\n").unwrap();
        let e = read_jsonl(&p, &Layout::plain("q", "a"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("line 2") && e.contains("not valid JSON"), "{e}");
        std::fs::write(&p, "{\"q\": \"hi\", \"a\": 3}\n").unwrap();
        let r = read_jsonl(&p, &Layout::plain("q", "a")).unwrap();
        assert_eq!(
            r,
            vec![Record {
                prompt: "hi".into(),
                answer: "3".into(),
                ..Record::default()
            }]
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    fn difficulty() -> Vec<RecordField> {
        vec![RecordField {
            name: "difficulty".into(),
            ty: braid_ir::kernel::FieldTy::Int,
        }]
    }

    fn msgs(turns: &[(&str, &str)]) -> Vec<ChatMessage> {
        turns
            .iter()
            .map(|(role, content)| ChatMessage {
                role: (*role).into(),
                content: (*content).into(),
            })
            .collect()
    }

    #[test]
    fn conversations_are_prompts_and_their_trailing_turn_an_answer() {
        let dir = std::env::temp_dir().join(format!("braid-chat-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("chat.jsonl");
        std::fs::write(
            &p,
            concat!(
                r#"{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}], "difficulty": 1}"#,
                "\n",
                r#"{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "3+3?"}], "answer": 6, "difficulty": 2}"#,
                "\n",
                r#"{"prompt": "plain 1+1 =", "answer": "2", "difficulty": 1, "other": [1]}"#,
                "\n"
            ),
        )
        .unwrap();
        let layout = Layout {
            fields: difficulty(),
            prompt_from: PromptFrom::Either,
            ..Layout::plain("prompt", "answer")
        };
        let r = read_jsonl(&p, &layout).unwrap();
        assert_eq!(r.len(), 3);
        assert_eq!(r[0].prompt, "2+2?");
        assert_eq!(r[0].answer, "4", "the trailing assistant turn");
        assert_eq!(
            r[0].messages,
            Some(msgs(&[("system", "Be brief."), ("user", "2+2?")]))
        );
        assert_eq!(r[1].prompt, "3+3?");
        assert_eq!(
            r[1].answer, "6",
            "the answer field wins over no trailing turn"
        );
        assert_eq!(r[1].messages.as_ref().map(Vec::len), Some(3));
        assert_eq!(r[2].messages, None);
        assert_eq!(r[2].conversation(), msgs(&[("user", "plain 1+1 =")]));
        // Only the fields a kernel reads are kept.
        assert_eq!(
            r.iter()
                .map(|x| x.fields.get("difficulty").cloned())
                .collect::<Vec<_>>(),
            vec![
                Some(FieldValue::Int(1)),
                Some(FieldValue::Int(2)),
                Some(FieldValue::Int(1))
            ]
        );
        assert!(!r[2].fields.contains_key("other"));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn malformed_conversations_and_missing_fields_name_the_file_and_line() {
        let dir = std::env::temp_dir().join(format!("braid-chat-bad-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("bad.jsonl");
        let good = r#"{"messages": [{"role": "user", "content": "ok"}], "difficulty": 1}"#;
        let layout = Layout {
            fields: difficulty(),
            prompt_from: PromptFrom::Either,
            ..Layout::plain("prompt", "answer")
        };
        let cases = [
            (
                r#"{"messages": [{"role": "bot", "content": "x"}], "difficulty": 1}"#,
                "message 1 has role `bot`",
            ),
            (
                r#"{"messages": [{"role": "user", "content": "  "}], "difficulty": 1}"#,
                "message 1 (user) has empty content",
            ),
            (
                r#"{"messages": [{"role": "system", "content": "s"}], "difficulty": 1}"#,
                "no `user` turn",
            ),
            (
                r#"{"messages": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "u"}], "difficulty": 1}"#,
                "before any `user` turn",
            ),
            (
                r#"{"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], "difficulty": 1}"#,
                "messages 1 and 2 are both `user` turns",
            ),
            (
                r#"{"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}], "difficulty": 1}"#,
                "message 2 is a `system` message after the first",
            ),
            (r#"{"messages": [], "difficulty": 1}"#, "no messages"),
            (r#"{"messages": "hi", "difficulty": 1}"#, "must be an array"),
            (
                r#"{"messages": [{"role": "user"}], "difficulty": 1}"#,
                "message 1 (user) has no `content`",
            ),
            (
                r#"{"prompt": "p", "messages": [{"role": "user", "content": "u"}], "difficulty": 1}"#,
                "has both a prompt",
            ),
            (r#"{"text": "p", "difficulty": 1}"#, "has no prompt"),
            (
                r#"{"messages": [{"role": "user", "content": "u"}]}"#,
                "has no field `difficulty`, which `field_int(s, \"difficulty\")` reads",
            ),
            (
                r#"{"messages": [{"role": "user", "content": "u"}], "difficulty": "hard"}"#,
                "field `difficulty` is a string, but `field_int` reads an int (read it with `field`)",
            ),
            (
                r#"{"messages": [{"role": "user", "content": "u"}], "difficulty": [1]}"#,
                "field `difficulty` is an array",
            ),
        ];
        for (line, want) in cases {
            std::fs::write(&p, format!("{good}\n\n{line}\n")).unwrap();
            let e = read_jsonl(&p, &layout).unwrap_err().to_string();
            assert!(
                e.contains("bad.jsonl") && e.contains("line 3") && e.contains(want),
                "{line}: {e}"
            );
        }
        // An explicit mapping reads only that field.
        std::fs::write(&p, format!("{good}\n")).unwrap();
        let e = read_jsonl(&p, &Layout::plain("prompt", "answer"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("missing field `prompt`"), "{e}");
        let only_messages = Layout {
            prompt_from: PromptFrom::Messages,
            messages_field: "conv".into(),
            ..Layout::plain("prompt", "answer")
        };
        std::fs::write(&p, "{\"prompt\": \"p\"}\n").unwrap();
        let e = read_jsonl(&p, &only_messages).unwrap_err().to_string();
        assert!(e.contains("line 1: missing field `conv`"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_synthetic_source_without_a_read_field_is_an_error_naming_it() {
        let mut s = spec(
            DatasetSource::Synthetic {
                kind: SyntheticKind::Letters,
                count: 4,
                seed: 0,
                digits: 2,
                split: Split::All,
            },
            false,
            None,
        );
        s.fields = difficulty();
        let e = Dataset::load(&s, Path::new(".")).unwrap_err().to_string();
        assert!(
            e.contains("synthetic::letters") && e.contains("no field `difficulty`"),
            "{e}"
        );
        s.source = DatasetSource::Synthetic {
            kind: SyntheticKind::WordProblems,
            count: 4,
            seed: 0,
            digits: 2,
            split: Split::All,
        };
        assert!(Dataset::load(&s, Path::new(".")).is_ok());
    }

    /// Writes a Parquet file of conversations (a list of `{role, content}` structs, as
    /// `datasets` and pyarrow write them) with an optional int column.
    fn write_chat_parquet(path: &Path, rows: &[Vec<(&str, &str)>], difficulty: &[Option<i64>]) {
        use parquet::data_type::{ByteArray, ByteArrayType, Int64Type};
        use parquet::file::properties::WriterProperties;
        use parquet::file::writer::SerializedFileWriter;
        use parquet::schema::parser::parse_message_type;
        use std::sync::Arc;
        let schema = Arc::new(
            parse_message_type(
                "message s {
                  REQUIRED group messages (LIST) {
                    REPEATED group list {
                      REQUIRED group element {
                        REQUIRED BYTE_ARRAY role (UTF8);
                        REQUIRED BYTE_ARRAY content (UTF8);
                      }
                    }
                  }
                  OPTIONAL INT64 difficulty;
                }",
            )
            .unwrap(),
        );
        let file = std::fs::File::create(path).unwrap();
        let mut w =
            SerializedFileWriter::new(file, schema, Arc::new(WriterProperties::builder().build()))
                .unwrap();
        let mut rg = w.next_row_group().unwrap();
        for part in 0..2 {
            let mut vals = Vec::new();
            let (mut defs, mut reps) = (Vec::new(), Vec::new());
            for row in rows {
                if row.is_empty() {
                    defs.push(0);
                    reps.push(0);
                }
                for (i, (role, content)) in row.iter().enumerate() {
                    vals.push(ByteArray::from(if part == 0 { *role } else { *content }));
                    defs.push(1);
                    reps.push(i16::from(i > 0));
                }
            }
            let mut col = rg.next_column().unwrap().unwrap();
            col.typed::<ByteArrayType>()
                .write_batch(&vals, Some(&defs), Some(&reps))
                .unwrap();
            col.close().unwrap();
        }
        let mut col = rg.next_column().unwrap().unwrap();
        let present: Vec<i64> = difficulty.iter().flatten().copied().collect();
        let defs: Vec<i16> = difficulty.iter().map(|a| i16::from(a.is_some())).collect();
        col.typed::<Int64Type>()
            .write_batch(&present, Some(&defs), None)
            .unwrap();
        col.close().unwrap();
        rg.close().unwrap();
        w.close().unwrap();
    }

    #[test]
    fn parquet_conversations_and_fields_are_read_like_jsonl() {
        let dir = std::env::temp_dir().join(format!("braid-chat-pq-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("chat.parquet");
        let rows = vec![
            vec![
                ("system", "Be brief."),
                ("user", "2+2?"),
                ("assistant", "4"),
            ],
            vec![("user", "3+3?")],
        ];
        write_chat_parquet(&p, &rows, &[Some(1), Some(2)]);
        let layout = Layout {
            fields: difficulty(),
            prompt_from: PromptFrom::Messages,
            ..Layout::plain("prompt", "answer")
        };
        let r = read_parquet(&p, &layout).unwrap();
        assert_eq!(r.len(), 2);
        assert_eq!(
            r[0].messages,
            Some(msgs(&[("system", "Be brief."), ("user", "2+2?")]))
        );
        assert_eq!((r[0].prompt.as_str(), r[0].answer.as_str()), ("2+2?", "4"));
        assert_eq!((r[1].prompt.as_str(), r[1].answer.as_str()), ("3+3?", ""));
        assert_eq!(r[1].fields.get("difficulty"), Some(&FieldValue::Int(2)));
        // A null field and a bad role name the row.
        write_chat_parquet(&p, &rows, &[Some(1), None]);
        let e = read_parquet(&p, &layout).unwrap_err().to_string();
        assert!(
            e.contains("chat.parquet") && e.contains("row 2") && e.contains("`difficulty` is null"),
            "{e}"
        );
        write_chat_parquet(
            &p,
            &[vec![("user", "a")], vec![("robot", "b")]],
            &[Some(1), Some(1)],
        );
        let e = read_parquet(&p, &layout).unwrap_err().to_string();
        assert!(e.contains("row 2") && e.contains("role `robot`"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
