//! Tokenizers: a Hugging Face `tokenizer.json` (through the `tokenizers` crate) or the built-in
//! byte-level tokenizer of `tiny` models, plus chat templates rendered with minijinja.
//!
//! Byte tokenizer ids (fixed; documented in docs/runtime.md): ids 0–255 are the bytes of the
//! UTF-8 text, 256 is `<|bos|>`, 257 is `<|eos|>`, 258 is `<|pad|>`; the vocabulary has 259
//! entries. `byte_level_tokenizer_json` writes the same tokenizer as a byte-level BPE with no
//! merges, so a saved tiny model tokenizes identically in transformers (test
//! `tokenizer::tests::saved_byte_tokenizer_matches_builtin`). This module must not touch model
//! weights.

use std::path::{Path, PathBuf};

use serde_json::{Value, json};

use crate::error::{Error, Result};
use crate::models::config::{ModelConfig, token_ids_field};
use crate::models::gguf::{GgufFile, is_gguf};

/// Id of `<|bos|>` in the byte tokenizer.
pub const BYTE_BOS: i64 = 256;
/// Id of `<|eos|>` in the byte tokenizer.
pub const BYTE_EOS: i64 = 257;
/// Id of `<|pad|>` in the byte tokenizer.
pub const BYTE_PAD: i64 = 258;
/// Size of the byte tokenizer's vocabulary.
pub const BYTE_VOCAB: i64 = 259;

/// The chat template of tiny models: role markers as plain text.
const BYTE_CHAT_TEMPLATE: &str = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}\
{% if add_generation_prompt %}<|assistant|>{% endif %}";

/// Token ids with a special meaning.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SpecialTokens {
    pub bos: Option<i64>,
    /// Generation stops at any of these.
    pub eos: Vec<i64>,
    pub pad: Option<i64>,
}

/// One message of a chat.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

enum Inner {
    Hf(Box<tokenizers::Tokenizer>),
    Bytes,
}

/// A tokenizer with its special tokens and chat template.
pub struct Tokenizer {
    inner: Inner,
    special: SpecialTokens,
    chat_template: Option<String>,
    bos_text: String,
    eos_text: String,
    /// The files it was read from, copied verbatim when a model is saved.
    files: Vec<PathBuf>,
    /// `tokenizer.json` and `tokenizer_config.json` built from a GGUF file's metadata.
    generated: Option<Box<(Value, Value)>>,
    /// Where it came from, for messages (`tiny` for the byte tokenizer).
    source: PathBuf,
}

fn read_json(path: &Path) -> Result<Option<Value>> {
    if !path.exists() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(path)
        .map_err(|e| Error::file(path, format!("cannot read: {e}")))?;
    let v =
        serde_json::from_str(&text).map_err(|e| Error::file(path, format!("invalid JSON: {e}")))?;
    Ok(Some(v))
}

/// `bos_token` and friends are a string or an object with `content`.
fn token_text(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Object(m) => m.get("content").and_then(Value::as_str).map(str::to_owned),
        _ => None,
    }
}

impl Tokenizer {
    /// The built-in byte tokenizer of tiny models.
    pub fn bytes() -> Tokenizer {
        Tokenizer {
            inner: Inner::Bytes,
            special: SpecialTokens {
                bos: Some(BYTE_BOS),
                eos: vec![BYTE_EOS],
                pad: Some(BYTE_PAD),
            },
            chat_template: Some(BYTE_CHAT_TEMPLATE.to_owned()),
            bos_text: "<|bos|>".into(),
            eos_text: "<|eos|>".into(),
            files: Vec::new(),
            generated: None,
            source: PathBuf::from("tiny"),
        }
    }

    /// Reads `tokenizer.json` (and `tokenizer_config.json`, `generation_config.json`,
    /// `chat_template.jinja` where present) from a model directory, or the tokenizer and chat
    /// template in the metadata of a GGUF file, and checks that every token id fits the model's
    /// embedding.
    pub fn from_dir(dir: &Path, config: &ModelConfig) -> Result<Tokenizer> {
        if is_gguf(dir) {
            return Tokenizer::from_gguf(&GgufFile::open(dir)?, config);
        }
        let path = dir.join("tokenizer.json");
        if !path.exists() {
            return Err(Error::file(
                &path,
                "missing (Braid needs a fast tokenizer's tokenizer.json)",
            ));
        }
        let tok = tokenizers::Tokenizer::from_file(&path)
            .map_err(|e| Error::file(&path, format!("cannot load tokenizer: {e}")))?;
        let mut files = vec![path.clone()];
        let tc_path = dir.join("tokenizer_config.json");
        let tc = read_json(&tc_path)?;
        if tc.is_some() {
            files.push(tc_path.clone());
        }
        let jinja = dir.join("chat_template.jinja");
        let mut jinja_template = None;
        if jinja.exists() {
            jinja_template = Some(
                std::fs::read_to_string(&jinja)
                    .map_err(|e| Error::file(&jinja, format!("cannot read: {e}")))?,
            );
        }
        let mut eos: Vec<i64> = Vec::new();
        let gc_path = dir.join("generation_config.json");
        if let Some(gc) = read_json(&gc_path)? {
            eos.extend(token_ids_field(&gc_path, &gc, "eos_token_id")?);
        }
        let mut t = Tokenizer::assemble(tok, &path, tc.as_ref(), eos, config)?;
        if t.chat_template.is_none() && jinja_template.is_some() {
            t.chat_template = jinja_template;
            files.push(jinja);
        }
        t.files = files;
        Ok(t)
    }

    /// The tokenizer of a GGUF file: the `tokenizer.json` and `tokenizer_config.json` that
    /// `GgufFile::tokenizer_files` builds from its metadata (written out when the model is
    /// saved).
    pub fn from_gguf(file: &GgufFile, config: &ModelConfig) -> Result<Tokenizer> {
        let (json, tc) = file.tokenizer_files()?;
        let tok = tokenizers::Tokenizer::from_bytes(json.to_string().as_bytes()).map_err(|e| {
            Error::file(
                file.path(),
                format!("cannot build the tokenizer from the metadata: {e}"),
            )
        })?;
        let mut t = Tokenizer::assemble(tok, file.path(), Some(&tc), Vec::new(), config)?;
        t.generated = Some(Box::new((json, tc)));
        t.source = file.path().to_path_buf();
        Ok(t)
    }

    /// A tokenizer from its parts: `tc` is `tokenizer_config.json`, `eos` end-of-sequence ids
    /// from `generation_config.json`; `path` names the vocabulary in errors.
    fn assemble(
        tok: tokenizers::Tokenizer,
        path: &Path,
        tc: Option<&Value>,
        mut eos: Vec<i64>,
        config: &ModelConfig,
    ) -> Result<Tokenizer> {
        let max_id = tok
            .get_vocab(true)
            .values()
            .copied()
            .max()
            .map(i64::from)
            .unwrap_or(0);
        if max_id >= config.vocab_size {
            return Err(Error::file(
                path,
                format!(
                    "the vocabulary does not match the model: token id {max_id} but the embedding has {} rows (config.json vocab_size)",
                    config.vocab_size
                ),
            ));
        }
        let get = |k: &str| tc.and_then(|v| v.get(k));
        let bos_text = token_text(get("bos_token")).unwrap_or_default();
        let eos_text = token_text(get("eos_token")).unwrap_or_default();
        let pad_text = token_text(get("pad_token"));
        let id_of = |s: &str| tok.token_to_id(s).map(i64::from);
        let chat_template = match get("chat_template") {
            Some(Value::String(s)) => Some(s.clone()),
            Some(Value::Array(list)) => list
                .iter()
                .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                .and_then(|t| t.get("template"))
                .and_then(Value::as_str)
                .map(str::to_owned),
            _ => None,
        };
        eos.extend(config.eos_token_ids.iter().copied());
        if let Some(id) = id_of(&eos_text) {
            eos.push(id);
        }
        eos.sort_unstable();
        eos.dedup();
        let special = SpecialTokens {
            bos: config.bos_token_id.or_else(|| id_of(&bos_text)),
            eos,
            pad: pad_text.as_deref().and_then(id_of).or(config.pad_token_id),
        };
        Ok(Tokenizer {
            inner: Inner::Hf(Box::new(tok)),
            special,
            chat_template,
            bos_text,
            eos_text,
            files: Vec::new(),
            generated: None,
            source: path.to_path_buf(),
        })
    }

    /// `tokenizer.json` and `tokenizer_config.json` of a tokenizer that was not read from
    /// files (one from a GGUF file's metadata), for saving.
    pub fn generated_files(&self) -> Option<(&Value, &Value)> {
        self.generated.as_deref().map(|(a, b)| (a, b))
    }

    /// Special token ids.
    pub fn special(&self) -> &SpecialTokens {
        &self.special
    }

    /// Replaces the end-of-sequence ids (for models whose files declare them wrongly).
    pub fn set_eos(&mut self, ids: Vec<i64>) {
        self.special.eos = ids;
    }

    /// Number of ids, special tokens included.
    pub fn vocab_size(&self) -> usize {
        match &self.inner {
            Inner::Hf(t) => t.get_vocab_size(true),
            Inner::Bytes => BYTE_VOCAB as usize,
        }
    }

    /// Whether this is the built-in byte tokenizer.
    pub fn is_bytes(&self) -> bool {
        matches!(self.inner, Inner::Bytes)
    }

    /// The files this tokenizer was read from (empty for the byte tokenizer).
    pub fn files(&self) -> &[PathBuf] {
        &self.files
    }

    /// Token ids of `text`; with `add_special_tokens`, as the tokenizer's post-processor says
    /// (the byte tokenizer prepends `<|bos|>`).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<i64>> {
        match &self.inner {
            Inner::Hf(t) => {
                let enc = t
                    .encode(text, add_special_tokens)
                    .map_err(|e| Error::invalid("tokenizer", format!("cannot encode: {e}")))?;
                Ok(enc.get_ids().iter().map(|&i| i64::from(i)).collect())
            }
            Inner::Bytes => {
                let mut ids = Vec::with_capacity(text.len() + 1);
                if add_special_tokens {
                    ids.push(BYTE_BOS);
                }
                ids.extend(text.bytes().map(i64::from));
                Ok(ids)
            }
        }
    }

    /// Text of token ids, without special tokens. Incomplete UTF-8 at the end becomes U+FFFD.
    pub fn decode(&self, ids: &[i64]) -> Result<String> {
        match &self.inner {
            Inner::Hf(t) => {
                let ids: Vec<u32> = ids.iter().filter_map(|&i| u32::try_from(i).ok()).collect();
                t.decode(&ids, true)
                    .map_err(|e| Error::invalid("tokenizer", format!("cannot decode: {e}")))
            }
            Inner::Bytes => {
                let bytes: Vec<u8> = ids.iter().filter_map(|&i| u8::try_from(i).ok()).collect();
                Ok(String::from_utf8_lossy(&bytes).into_owned())
            }
        }
    }

    /// Renders the chat template with `messages`; `add_generation_prompt` opens an assistant
    /// turn. Errors if the model has no template or the template fails.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String> {
        let source = self.source.display().to_string();
        let Some(template) = &self.chat_template else {
            return Err(Error::invalid(source, "the tokenizer has no chat template"));
        };
        let mut env = minijinja::Environment::new();
        // Hugging Face templates are written for Jinja2 in Python and call Python string and
        // dict methods (`.strip()`, `.startswith()`, `.items()`); pycompat provides them.
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    msg,
                ))
            },
        );
        let tmpl = env
            .template_from_str(template)
            .map_err(|e| Error::invalid(source.clone(), format!("bad chat template: {e}")))?;
        tmpl.render(minijinja::context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_text,
            eos_token => self.eos_text,
        })
        .map_err(|e| Error::invalid(source, format!("chat template failed: {e}")))
    }

    /// The chat template, if any.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// Every id with its token's text (byte-level tokens as the vocabulary file writes them),
    /// ordered by id.
    pub fn vocabulary(&self) -> Vec<(u32, String)> {
        match &self.inner {
            Inner::Hf(t) => {
                let mut v: Vec<(u32, String)> =
                    t.get_vocab(true).into_iter().map(|(s, i)| (i, s)).collect();
                v.sort();
                v
            }
            // The same entries as `byte_level_tokenizer_json`, so that a saved tiny model's
            // tokenizer has the vocabulary of the built-in one.
            Inner::Bytes => byte_to_char()
                .into_iter()
                .enumerate()
                .map(|(i, c)| (i as u32, c.to_string()))
                .chain([
                    (BYTE_BOS as u32, "<|bos|>".to_string()),
                    (BYTE_EOS as u32, "<|eos|>".to_string()),
                    (BYTE_PAD as u32, "<|pad|>".to_string()),
                ])
                .collect(),
        }
    }

    /// Whether every id means the same token in both tokenizers: then one model's token ids
    /// can be read by the other as they are. (How each splits a text may still differ — merges
    /// are not compared — but ids never mean different tokens.)
    pub fn same_vocabulary(&self, other: &Tokenizer) -> bool {
        match (&self.inner, &other.inner) {
            (Inner::Bytes, Inner::Bytes) => true,
            _ => self.vocab_size() == other.vocab_size() && self.vocabulary() == other.vocabulary(),
        }
    }

    /// Where it came from (`tiny` for the byte tokenizer), for messages.
    pub fn source(&self) -> &Path {
        &self.source
    }
}

/// GPT-2's map from bytes to printable characters, used by byte-level BPE vocabularies.
fn byte_to_char() -> Vec<char> {
    let mut printable: Vec<u32> = (u32::from(b'!')..=u32::from(b'~')).collect();
    printable.extend(0xA1..=0xAC);
    printable.extend(0xAE..=0xFF);
    let mut map = vec!['\0'; 256];
    let mut extra = 0u32;
    for b in 0..256u32 {
        let c = if printable.contains(&b) {
            b
        } else {
            extra += 1;
            255 + extra
        };
        map[b as usize] = char::from_u32(c).unwrap_or('\u{FFFD}');
    }
    map
}

/// The byte tokenizer as a Hugging Face `tokenizer.json`: byte-level BPE without merges (every
/// byte is one token, id = byte value), the three special tokens, and a post-processor that
/// prepends `<|bos|>`.
pub fn byte_level_tokenizer_json() -> Value {
    let chars = byte_to_char();
    let vocab: serde_json::Map<String, Value> = chars
        .iter()
        .enumerate()
        .map(|(i, c)| (c.to_string(), json!(i)))
        .collect();
    let added: Vec<Value> = [
        (BYTE_BOS, "<|bos|>"),
        (BYTE_EOS, "<|eos|>"),
        (BYTE_PAD, "<|pad|>"),
    ]
    .iter()
    .map(|(id, content)| {
        json!({"id": id, "content": content, "single_word": false, "lstrip": false, "rstrip": false,
                   "normalized": false, "special": true})
    })
    .collect();
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<|bos|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "<|bos|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<|bos|>": {"id": "<|bos|>", "ids": [BYTE_BOS], "tokens": ["<|bos|>"]}}
        },
        "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": vocab, "merges": []}
    })
}

/// `tokenizer_config.json` of a saved tiny model.
pub fn byte_level_tokenizer_config() -> Value {
    json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|bos|>",
        "eos_token": "<|eos|>",
        "pad_token": "<|pad|>",
        "model_max_length": 1_000_000,
        "chat_template": BYTE_CHAT_TEMPLATE,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_tokenizer_round_trips_utf8() {
        let t = Tokenizer::bytes();
        let ids = t.encode("héllo ✓", true).unwrap();
        assert_eq!(ids[0], BYTE_BOS);
        assert_eq!(ids.len(), 1 + "héllo ✓".len());
        assert_eq!(t.decode(&ids).unwrap(), "héllo ✓");
    }

    #[test]
    fn saved_byte_tokenizer_matches_builtin() {
        let json = byte_level_tokenizer_json().to_string();
        let hf = tokenizers::Tokenizer::from_bytes(json.as_bytes()).unwrap();
        let builtin = Tokenizer::bytes();
        for text in [
            "hello world",
            "  two  spaces\nnew line",
            "héllo ✓ 日本",
            "<|eos|> literal",
        ] {
            let a: Vec<i64> = hf
                .encode(text, true)
                .unwrap()
                .get_ids()
                .iter()
                .map(|&i| i64::from(i))
                .collect();
            let b = builtin.encode(text, true).unwrap();
            if text.contains("<|eos|>") {
                // An added special token in the text is one token for transformers; the
                // built-in tokenizer treats text as bytes only.
                assert!(a.contains(&BYTE_EOS));
                continue;
            }
            assert_eq!(a, b, "{text:?}");
            let ids: Vec<u32> = b.iter().map(|&i| i as u32).collect();
            assert_eq!(hf.decode(&ids, true).unwrap(), text);
        }
        assert_eq!(hf.get_vocab_size(true), BYTE_VOCAB as usize);
    }

    #[test]
    fn chat_templates_may_use_python_methods_and_tojson() {
        let mut t = Tokenizer::bytes();
        t.chat_template = Some(
            "{% for m in messages %}{% if m.role.startswith('u') %}{{ m.content.strip() | tojson }}{% endif %}\
             {% if loop.index > 1 %}{% break %}{% endif %}{% endfor %}{{ raise_exception('done') if add_generation_prompt }}"
                .into(),
        );
        let msgs = vec![
            ChatMessage {
                role: "user".into(),
                content: "  hi  ".into(),
            },
            ChatMessage {
                role: "assistant".into(),
                content: "x".into(),
            },
            ChatMessage {
                role: "user".into(),
                content: "never".into(),
            },
        ];
        assert_eq!(t.apply_chat_template(&msgs, false).unwrap(), "\"hi\"");
        let err = t
            .apply_chat_template(&msgs, true)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.starts_with("tiny: chat template failed"), "{err}");
    }

    #[test]
    fn chat_template_renders() {
        let t = Tokenizer::bytes();
        let msgs = vec![ChatMessage {
            role: "user".into(),
            content: "hi".into(),
        }];
        assert_eq!(
            t.apply_chat_template(&msgs, true).unwrap(),
            "<|user|>hi\n<|assistant|>"
        );
    }
}
