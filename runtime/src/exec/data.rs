//! Prompt datasets: JSONL files with field mapping, and the synthetic sources used by demos and
//! tests. A dataset is read once; `next(dataset, n)` draws from a cursor over its records in an
//! order fixed by the dataset's seed (shuffled per epoch when asked), so the draw at any cursor
//! position can be recomputed — a resumed run only needs the cursor.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use braid_ir::graph::{DatasetSource, DatasetSpec, Split, SyntheticKind};

use crate::error::{Error, Result};
use crate::rng::Rng;

/// One prompt and its reference answer (empty when the data has none), with the record's
/// other fields (`s.field("name")` in a reward).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Record {
    pub prompt: String,
    pub answer: String,
    pub extra: BTreeMap<String, serde_json::Value>,
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
        let records = match &spec.source {
            DatasetSource::Jsonl { path } => {
                let p = resolve(base_dir, path);
                read_jsonl(&p, &spec.prompt_field, &spec.answer_field)?
            }
            DatasetSource::Parquet { path } => {
                let p = resolve(base_dir, path);
                read_parquet(&p, &spec.prompt_field, &spec.answer_field)?
            }
            DatasetSource::Synthetic {
                kind,
                count,
                seed,
                digits,
                split,
            } => synthetic(*kind, *count, *seed, *digits, *split)?,
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

/// Reads a JSONL file: one object per line with the prompt (and optionally the answer) under
/// the mapped field names. Empty lines are skipped.
pub fn read_jsonl(path: &Path, prompt_field: &str, answer_field: &str) -> Result<Vec<Record>> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| Error::file(path, format!("cannot read: {e}")))?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let at = |what: String| Error::file(path, format!("line {}: {what}", i + 1));
        let v: serde_json::Value =
            serde_json::from_str(line).map_err(|e| at(format!("not valid JSON: {e}")))?;
        let Some(obj) = v.as_object() else {
            return Err(at("expected a JSON object".into()));
        };
        let prompt = match obj.get(prompt_field) {
            Some(serde_json::Value::String(s)) => s.clone(),
            Some(other) => {
                return Err(at(format!(
                    "field `{prompt_field}` must be a string, found {other}"
                )));
            }
            None => {
                let keys: Vec<&str> = obj.keys().map(|k| k.as_str()).collect();
                return Err(at(format!(
                    "missing field `{prompt_field}` (the prompt); the line has {}; map another field with `fields: {{ prompt: \"…\" }}`",
                    if keys.is_empty() {
                        "no fields".to_string()
                    } else {
                        keys.join(", ")
                    }
                )));
            }
        };
        if prompt.is_empty() {
            return Err(at(format!("field `{prompt_field}` is empty")));
        }
        let answer = match obj.get(answer_field) {
            Some(serde_json::Value::String(s)) => s.clone(),
            Some(serde_json::Value::Number(n)) => n.to_string(),
            Some(serde_json::Value::Null) | None => String::new(),
            Some(other) => {
                return Err(at(format!(
                    "field `{answer_field}` must be a string or a number, found {other}"
                )));
            }
        };
        out.push(Record {
            prompt,
            answer,
            ..Record::default()
        });
    }
    if out.is_empty() {
        return Err(Error::file(path, "has no records"));
    }
    Ok(out)
}

/// Reads a Parquet file: one record per row, the prompt (a string column) and optionally the
/// answer (a string or number column) under the mapped column names. Uncompressed and snappy
/// column chunks are read (snappy is pandas' and pyarrow's default).
pub fn read_parquet(path: &Path, prompt_field: &str, answer_field: &str) -> Result<Vec<Record>> {
    use parquet::file::reader::{FileReader, SerializedFileReader};
    use parquet::record::Field;
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
        let mut prompt = None;
        let mut answer = String::new();
        let mut names = Vec::new();
        for (name, field) in row.get_column_iter() {
            names.push(name.clone());
            if name == prompt_field {
                prompt = Some(match field {
                    Field::Str(s) => s.clone(),
                    Field::Null => return Err(at(format!("column `{prompt_field}` is null"))),
                    other => {
                        return Err(at(format!(
                            "column `{prompt_field}` must be a string, found {other}"
                        )));
                    }
                });
            } else if name == answer_field {
                answer = match field {
                    Field::Null => String::new(),
                    Field::Str(s) => s.clone(),
                    Field::Bool(_)
                    | Field::Group(_)
                    | Field::ListInternal(_)
                    | Field::MapInternal(_) => {
                        return Err(at(format!(
                            "column `{answer_field}` must be a string or a number, found {field}"
                        )));
                    }
                    other => other.to_string(),
                };
            }
        }
        let Some(prompt) = prompt else {
            return Err(at(format!(
                "missing column `{prompt_field}` (the prompt); the file has {}; map another column with `fields: {{ prompt: \"…\" }}`",
                names.join(", ")
            )));
        };
        if prompt.is_empty() {
            return Err(at(format!("column `{prompt_field}` is empty")));
        }
        out.push(Record {
            prompt,
            answer,
            ..Record::default()
        });
    }
    if out.is_empty() {
        return Err(Error::file(path, "has no rows"));
    }
    Ok(out)
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
    let mut extra = BTreeMap::new();
    extra.insert("difficulty".to_string(), serde_json::json!(steps));
    Record {
        prompt: format!("{story} Reply with the number after \"Answer:\"."),
        answer: answer.to_string(),
        extra,
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
            shuffle,
            seed: 3,
            chat_template: false,
            epochs,
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
            let d = r.extra.get("difficulty").and_then(|v| v.as_i64());
            assert!(matches!(d, Some(1 | 2)), "{:?}", r.extra);
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
        let r = read_parquet(&p, "question", "answer").unwrap();
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
        let e = read_parquet(&p, "prompt", "answer")
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
        let e = read_parquet(&p, "question", "answer")
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
        let e = read_jsonl(&p, "q", "a").unwrap_err().to_string();
        assert!(
            e.contains("d.jsonl") && e.contains("line 3") && e.contains("`q`"),
            "{e}"
        );
        std::fs::write(&p, "{\"q\": \"hi\", \"a\": 3}\nnot json\n").unwrap();
        let e = read_jsonl(&p, "q", "a").unwrap_err().to_string();
        assert!(e.contains("line 2") && e.contains("not valid JSON"), "{e}");
        std::fs::write(&p, "{\"q\": \"hi\", \"a\": 3}\n").unwrap();
        let r = read_jsonl(&p, "q", "a").unwrap();
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
}
