//! `braid generate`: sample completions from a Hugging Face model directory, a GGUF file or a `tiny` model,
//! for one prompt or a JSONL file of prompts. It only parses arguments, reads the prompt file,
//! calls the runtime's engine and prints; it must not contain model or sampling logic.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use braid_runtime::dist::{GroupOptions, ProcessGroup, World};
use braid_runtime::exec::{all_gather_bytes, decode_samples, encode_samples, prompt_block};
use braid_runtime::generation::spec::SpeculateMode;
use braid_runtime::{
    ChatMessage, EngineOptions, Error, Head, Kind, LoadOptions, Model, Sample, SamplingParams,
    TinyConfig, Tokenizer, device, generate, generate_stream, tiny_in,
};

/// `--dtype` of `braid generate`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum DtypeArg {
    F32,
    Bf16,
    F16,
}

impl DtypeArg {
    fn kind(self) -> Kind {
        match self {
            DtypeArg::F32 => Kind::Float,
            DtypeArg::Bf16 => Kind::BFloat16,
            DtypeArg::F16 => Kind::Half,
        }
    }
}

/// Output format of `braid generate`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// The completions as text.
    Text,
    /// One JSON object per sample per line.
    Json,
}

/// Arguments of `braid generate`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// A Hugging Face model directory, a GGUF file (`.gguf`), or `tiny` for a random tiny model with a byte tokenizer.
    #[arg(long)]
    model: String,
    /// The prompt.
    #[arg(long, conflicts_with = "prompts", required_unless_present = "prompts")]
    prompt: Option<String>,
    /// A JSONL file with one `{"prompt": "..."}` object (or JSON string) per line.
    #[arg(long)]
    prompts: Option<PathBuf>,
    /// Most tokens to generate per sample.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..))]
    max_new_tokens: u32,
    /// Take the most likely token at each step.
    #[arg(long, conflicts_with_all = ["temperature", "top_p", "top_k"])]
    greedy: bool,
    /// Sampling temperature.
    #[arg(long, default_value_t = 1.0)]
    temperature: f32,
    /// Nucleus sampling: keep the most likely tokens up to this probability mass.
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Keep only the K most likely tokens (0: all).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Random seed; the same seed gives the same text.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Samples per prompt.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    n: u32,
    /// Stop a sample when its text contains this string (repeatable).
    #[arg(long)]
    stop: Vec<String>,
    /// Render each prompt as a user message with the model's chat template.
    #[arg(long)]
    chat: bool,
    /// Keep generating past end-of-sequence tokens (for benchmarks).
    #[arg(long)]
    ignore_eos: bool,
    /// Most samples decoded together.
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..))]
    max_batch: u32,
    /// Speculative decoding: `off`; `auto` (prompt-lookup drafts, draft length chosen before
    /// each step from measured costs, 0 when it does not pay); `ngram[:N]` (up to N prompt-lookup
    /// drafts at every step, default 4); `draft:DIR` (a draft model sharing the tokenizer, draft
    /// length chosen per step). Greedy text is the same in every mode.
    #[arg(long, default_value = "off", value_parser = parse_speculate)]
    speculate: SpeculateMode,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    format: Format,
    /// Precision the model computes in (also `tiny`'s): default f32 on the CPU; on a GPU the
    /// checkpoint's dtype, else bf16.
    #[arg(long, value_enum)]
    dtype: Option<DtypeArg>,
    /// CPU threads for libtorch.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    threads: Option<u32>,
    /// Tensor-parallel degree: each model replica is cut over this many processes (consecutive
    /// ranks) under `braid launch`; the replicas (processes / tp) split the prompts. The output
    /// is the same as one process's.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    tp: u32,
}

/// Runs `braid generate`.
pub fn run(args: Args) -> ExitCode {
    // Inconsistent sampling options are usage errors (exit 2), like clap's own.
    if let Err(e) = sampling_params(&args).validate() {
        eprintln!("error: {e}");
        return ExitCode::from(2);
    }
    match run_inner(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(1)
        }
    }
}

fn parse_speculate(s: &str) -> Result<SpeculateMode, String> {
    SpeculateMode::parse(s).map_err(|e| e.to_string())
}

fn read_prompts(path: &Path) -> Result<Vec<String>, Error> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| Error::file(path, format!("cannot read: {e}")))?;
    let mut prompts = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let v: serde_json::Value = serde_json::from_str(line)
            .map_err(|e| Error::file(path, format!("line {}: invalid JSON: {e}", i + 1)))?;
        let prompt = match &v {
            serde_json::Value::String(s) => s.clone(),
            _ => match v.get("prompt").and_then(serde_json::Value::as_str) {
                Some(s) => s.to_owned(),
                None => {
                    return Err(Error::file(
                        path,
                        format!(
                            "line {}: expected a string or an object with a string field `prompt`",
                            i + 1
                        ),
                    ));
                }
            },
        };
        prompts.push(prompt);
    }
    if prompts.is_empty() {
        return Err(Error::file(path, "no prompts (the file is empty)"));
    }
    Ok(prompts)
}

fn load(name: &str, dtype: Option<DtypeArg>) -> Result<(Model, Tokenizer), Error> {
    let device = device::default_device();
    let dtype = dtype.map(DtypeArg::kind);
    if name == "tiny" {
        // As `Model::load` decides for a checkpoint without a dtype: f32 on the CPU, bf16 on a GPU.
        let kind = dtype.unwrap_or(if device.is_cuda() {
            Kind::BFloat16
        } else {
            Kind::Float
        });
        return tiny_in(&TinyConfig::default(), Head::Lm, kind, device);
    }
    let dir = Path::new(name);
    let model = Model::load(
        dir,
        &LoadOptions {
            head: Head::Lm,
            dtype,
            device,
        },
    )?;
    let tokenizer = Tokenizer::from_dir(dir, model.config())?;
    Ok((model, tokenizer))
}

fn sampling_params(args: &Args) -> SamplingParams {
    SamplingParams {
        max_new_tokens: args.max_new_tokens as usize,
        greedy: args.greedy,
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        seed: args.seed,
        n: args.n as usize,
        stop: args.stop.clone(),
        stop_at_eos: !args.ignore_eos,
    }
}

fn run_inner(args: &Args) -> Result<(), Error> {
    if let Some(t) = args.threads {
        device::set_cpu_threads(t as usize);
    }
    let texts = match (&args.prompt, &args.prompts) {
        (Some(p), _) => vec![p.clone()],
        (None, Some(path)) => read_prompts(path)?,
        (None, None) => return Err(Error::invalid("--prompt", "give --prompt or --prompts")),
    };
    let params = sampling_params(args);
    // Under a launcher, the processes form `world.size / tp` replicas of `tp` consecutive
    // ranks; each replica generates a block of the prompts (each sample's random stream from
    // its index in the whole batch, as in one process) and rank 0 prints them all.
    let world = World::from_env().map_err(|e| Error::invalid("launch", e.to_string()))?;
    let tp = args.tp as usize;
    if world.size % tp != 0 {
        return Err(Error::invalid(
            "--tp",
            if world.size == 1 {
                format!(
                    "tensor parallelism over {tp} processes needs {tp} of them: run it under \
                     `braid launch --nproc-per-node {tp} generate …` (or torchrun)"
                )
            } else {
                format!("--tp {tp} does not divide the {} processes", world.size)
            },
        ));
    }
    let (replicas, replica) = (world.size / tp, world.rank / tp);
    let group = if world.size > 1 {
        Some(ProcessGroup::init(
            &world,
            GroupOptions::gloo(Duration::from_secs(1800)),
        )?)
    } else {
        None
    };
    let (model, tokenizer) = load(&args.model, args.dtype)?;
    let (model, tp_group) = match &group {
        Some(g) if tp > 1 => {
            let members: Vec<usize> = (replica * tp..(replica + 1) * tp).collect();
            let sub = g.subgroup(&members)?;
            let model = model.shard(Arc::new(sub.tensor_parallel()?))?;
            (model, Some(sub))
        }
        _ => (model, None),
    };
    let mut ids = Vec::with_capacity(texts.len());
    for text in &texts {
        ids.push(if args.chat {
            let msg = ChatMessage {
                role: "user".into(),
                content: text.clone(),
            };
            tokenizer.encode(&tokenizer.apply_chat_template(&[msg], true)?, false)?
        } else {
            tokenizer.encode(text, true)?
        });
    }
    let block = if replicas > 1 {
        prompt_block(ids.len(), replicas, replica)
    } else {
        0..ids.len()
    };
    let options = EngineOptions {
        max_batch: args.max_batch as usize,
        speculate: args.speculate.clone(),
        first_prompt: block.start,
        ..EngineOptions::default()
    };
    let many = texts.len() * args.n as usize > 1;
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let samples: Box<dyn Iterator<Item = Result<Sample, Error>>> = if let Some(group) = group {
        let mine: Vec<Sample> = generate(
            &model,
            &tokenizer,
            ids[block.clone()].to_vec(),
            params,
            options,
        )?
        .into_iter()
        .map(|mut s| {
            s.prompt_index += block.start;
            s
        })
        .collect();
        // Every rank of a tensor-parallel replica generated the same samples: its first
        // rank speaks for it.
        let tagged: Vec<(usize, Sample)> = if world.rank % tp == 0 {
            mine.into_iter().map(|s| (0, s)).collect()
        } else {
            Vec::new()
        };
        let all = all_gather_bytes(&group, encode_samples(&tagged))?;
        // Sub-groups are dropped, not shut down (`ProcessGroup::shutdown`).
        drop(model);
        drop(tp_group);
        group.shutdown()?;
        if world.rank != 0 {
            return Ok(());
        }
        let mut every = Vec::new();
        for part in all {
            every.extend(decode_samples(&part)?.into_iter().map(|(_, s)| s));
        }
        every.sort_by_key(|s| (s.prompt_index, s.sample_index));
        Box::new(every.into_iter().map(Ok))
    } else {
        Box::new(generate_stream(&model, &tokenizer, ids, params, options)?)
    };
    for sample in samples {
        let s = sample?;
        let line = match args.format {
            Format::Json => serde_json::json!({
                "prompt_index": s.prompt_index,
                "sample_index": s.sample_index,
                "prompt": texts[s.prompt_index],
                "completion": s.text,
                "token_ids": s.token_ids,
                "logprobs": s.logprobs,
                "finish_reason": s.finish,
            })
            .to_string(),
            Format::Text if many => format!(
                "--- prompt {}, sample {} ---\n{}{}",
                s.prompt_index, s.sample_index, texts[s.prompt_index], s.text
            ),
            Format::Text => format!("{}{}", texts[s.prompt_index], s.text),
        };
        // A closed pipe (`braid generate ... | head`) ends the run quietly.
        if writeln!(out, "{line}").is_err() {
            return Ok(());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(tag: &str, text: &str) -> PathBuf {
        let p = std::env::temp_dir().join(format!("braid-gen-{}-{tag}.jsonl", std::process::id()));
        std::fs::write(&p, text).unwrap();
        p
    }

    #[test]
    fn empty_prompt_file_is_an_error_naming_it() {
        let p = file("empty", "\n\n");
        let msg = read_prompts(&p)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert_eq!(
            msg,
            format!("{}: no prompts (the file is empty)", p.display())
        );
    }

    #[test]
    fn bad_lines_are_errors_naming_the_line() {
        let p = file("bad", "{\"prompt\": \"ok\"}\n{\"text\": 3}\n");
        let msg = read_prompts(&p)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            msg.starts_with(&format!("{}: line 2: expected a string", p.display())),
            "{msg}"
        );
        let p = file("json", "{\"prompt\": \"ok\"}\nnot json\n");
        let msg = read_prompts(&p)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            msg.starts_with(&format!("{}: line 2: invalid JSON", p.display())),
            "{msg}"
        );
    }

    #[test]
    fn speculate_values_parse_or_say_what_is_expected() {
        assert_eq!(parse_speculate("auto"), Ok(SpeculateMode::Auto));
        assert_eq!(parse_speculate("ngram:6"), Ok(SpeculateMode::Ngram(6)));
        let e = parse_speculate("fast").unwrap_err();
        assert!(
            e.contains("expected off, auto, ngram, ngram:N or draft:DIR"),
            "{e}"
        );
    }

    #[test]
    fn prompts_are_objects_or_strings() {
        let p = file("good", "{\"prompt\": \"a\"}\n\"b\"\n");
        assert_eq!(
            read_prompts(&p).unwrap(),
            vec!["a".to_owned(), "b".to_owned()]
        );
    }
}
