//! The Braid side of `scripts/gpu-check`'s decode benchmark: greedy generation of `--new-tokens`
//! tokens for `--batch` prompts of `--prompt-len` token ids (seeded, never stopping at EOS)
//! with a Hugging Face model directory in bf16, after one short warm-up generation. Prints one
//! JSON object: `{"batch", "new_tokens", "seconds", "tokens_per_s", "device", "sampling"}`.
//!
//! Usage: gpu_check decode --model DIR [--batch 32] [--prompt-len 32] [--new-tokens 128]
//!                         [--device cuda|cpu] [--dtype bf16|f32]
//!
//! `--device cuda` without a GPU is an error (`no GPU found`), never a run on the CPU.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use braid_runtime::rng::Rng;
use braid_runtime::{EngineOptions, LoadOptions, Model, SamplingParams, Tokenizer, generate};
use tch::{Device, Kind};

struct Args {
    model: PathBuf,
    batch: usize,
    prompt_len: usize,
    new_tokens: usize,
    device: Device,
    kind: Kind,
}

fn parse() -> Result<Args, String> {
    let mut args = std::env::args().skip(1);
    match args.next().as_deref() {
        Some("decode") => {}
        Some(other) => return Err(format!("unknown command `{other}` (expected `decode`)")),
        None => return Err("usage: gpu_check decode --model DIR [options]".into()),
    }
    let mut a = Args {
        model: PathBuf::new(),
        batch: 32,
        prompt_len: 32,
        new_tokens: 128,
        device: Device::Cuda(0),
        kind: Kind::BFloat16,
    };
    while let Some(flag) = args.next() {
        let value = args.next().ok_or_else(|| format!("{flag} needs a value"))?;
        let num = || {
            value
                .parse::<usize>()
                .ok()
                .filter(|&n| n > 0)
                .ok_or_else(|| format!("{flag}: `{value}` is not a positive integer"))
        };
        match flag.as_str() {
            "--model" => a.model = PathBuf::from(&value),
            "--batch" => a.batch = num()?,
            "--prompt-len" => a.prompt_len = num()?,
            "--new-tokens" => a.new_tokens = num()?,
            "--device" => {
                a.device = match value.as_str() {
                    "cuda" => Device::Cuda(0),
                    "cpu" => Device::Cpu,
                    _ => return Err(format!("--device: `{value}` (expected cuda or cpu)")),
                }
            }
            "--dtype" => {
                a.kind = match value.as_str() {
                    "bf16" => Kind::BFloat16,
                    "f32" => Kind::Float,
                    _ => return Err(format!("--dtype: `{value}` (expected bf16 or f32)")),
                }
            }
            other => return Err(format!("unknown option {other}")),
        }
    }
    if a.model.as_os_str().is_empty() {
        return Err("--model is required".into());
    }
    if a.device.is_cuda() && !tch::Cuda::is_available() {
        return Err("no GPU found (libtorch sees no CUDA device)".into());
    }
    Ok(a)
}

fn run() -> Result<String, String> {
    let a = parse()?;
    braid_runtime::device::set_cpu_threads(1);
    let model = Model::load(
        &a.model,
        &LoadOptions {
            dtype: Some(a.kind),
            device: a.device,
            ..LoadOptions::default()
        },
    )
    .map_err(|e| e.to_string())?;
    let tok = Tokenizer::from_dir(&a.model, model.config()).map_err(|e| e.to_string())?;
    // Prompt ids inside the tokenizer's vocabulary, away from its special ids.
    let top = tok.vocab_size().max(4) as u64;
    let mut rng = Rng::new(7);
    let prompts: Vec<Vec<i64>> = (0..a.batch)
        .map(|_| {
            (0..a.prompt_len)
                .map(|_| (3 + rng.next_u64() % (top - 3)) as i64)
                .collect()
        })
        .collect();
    let params = |n: usize| SamplingParams {
        greedy: true,
        max_new_tokens: n,
        stop_at_eos: false,
        ..SamplingParams::default()
    };
    let options = EngineOptions {
        max_batch: a.batch,
        ..EngineOptions::default()
    };
    let err = |e: braid_runtime::Error| e.to_string();
    // Warm-up: kernels, allocator, cuBLAS handles.
    generate(&model, &tok, prompts.clone(), params(8), options.clone()).map_err(err)?;
    sync(a.device);
    let start = Instant::now();
    let out = generate(&model, &tok, prompts, params(a.new_tokens), options).map_err(err)?;
    sync(a.device);
    let seconds = start.elapsed().as_secs_f64();
    let tokens: usize = out.iter().map(|s| s.token_ids.len()).sum();
    if tokens != a.batch * a.new_tokens {
        return Err(format!(
            "generated {tokens} tokens, expected {}",
            a.batch * a.new_tokens
        ));
    }
    Ok(serde_json::json!({
        "batch": a.batch,
        "new_tokens": a.new_tokens,
        "seconds": seconds,
        "tokens_per_s": tokens as f64 / seconds,
        "device": format!("{:?}", a.device),
        "sampling": if a.device.is_cuda() { "device" } else { "host" },
    })
    .to_string())
}

fn sync(device: Device) {
    if let Device::Cuda(i) = device {
        tch::Cuda::synchronize(i as i64);
    }
}

fn main() -> ExitCode {
    match run() {
        Ok(line) => {
            println!("{line}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("gpu_check: {e}");
            ExitCode::FAILURE
        }
    }
}
