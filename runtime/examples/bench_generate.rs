//! Generation throughput of Braid's engine, for `scripts/bench_generate.sh` (which compares it
//! with transformers' `generate` on the same model and prompts). Prints one JSON object.
//!
//! Usage: bench_generate --model DIR [--prompts 32] [--new 64] [--threads 1] [--repeats 5]
//!
//! Sampling uses transformers' defaults for `do_sample=True` (temperature 1, top-k 50) and
//! ignores end-of-sequence tokens, so every run generates prompts × new tokens.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use braid_runtime::{
    EngineOptions, Head, LoadOptions, Model, SamplingParams, Tokenizer, device, generate,
};
use tch::{Device, Kind, Tensor};

struct Opts {
    model: PathBuf,
    prompts: usize,
    new: usize,
    threads: usize,
    repeats: usize,
}

fn parse() -> Result<Opts, String> {
    let mut o = Opts {
        model: PathBuf::new(),
        prompts: 32,
        new: 64,
        threads: 1,
        repeats: 5,
    };
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let value = args.next().ok_or_else(|| format!("{flag} needs a value"))?;
        let num = || value.parse::<usize>().map_err(|e| format!("{flag}: {e}"));
        match flag.as_str() {
            "--model" => o.model = PathBuf::from(&value),
            "--prompts" => o.prompts = num()?,
            "--new" => o.new = num()?,
            "--threads" => o.threads = num()?,
            "--repeats" => o.repeats = num()?,
            other => return Err(format!("unknown option {other}")),
        }
    }
    if o.model.as_os_str().is_empty() {
        return Err("--model is required".into());
    }
    Ok(o)
}

/// CPU seconds used by this process so far (all threads), from /proc; 0 where unavailable.
/// On a shared machine wall time includes waiting for a core; CPU time does not.
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the command name (which is in parentheses and may contain spaces).
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = [11, 12]
        .iter()
        .filter_map(|&i| fields.get(i)?.parse::<f64>().ok())
        .sum();
    ticks / 100.0
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// The prompts both sides use (scripts/bench_hf_generate.py has the same list).
fn prompt_texts(n: usize) -> Vec<String> {
    (0..n)
        .map(|i| {
            let words = [
                "the quick brown fox",
                "jumps over",
                "the lazy dog",
                "while rewards",
            ];
            format!("Prompt {i}: {}", words[..1 + i % words.len()].join(" "))
        })
        .collect()
}

/// Sustained f32 matmul FLOP/s of this machine at the current thread count.
fn matmul_flops() -> f64 {
    let n = 1024i64;
    let a = Tensor::randn([n, n], (Kind::Float, Device::Cpu));
    let b = Tensor::randn([n, n], (Kind::Float, Device::Cpu));
    let _ = a.matmul(&b);
    let mut best = f64::MAX;
    // Best of several: on a shared machine the best run is the one least disturbed.
    for _ in 0..6 {
        let t = Instant::now();
        let _ = a.matmul(&b);
        best = best.min(t.elapsed().as_secs_f64());
    }
    2.0 * (n as f64).powi(3) / best
}

fn run(o: &Opts) -> Result<(), String> {
    device::set_cpu_threads(o.threads);
    let options = LoadOptions {
        head: Head::Lm,
        dtype: None,
        device: Device::Cpu,
    };
    let model = Model::load(&o.model, &options).map_err(|e| e.to_string())?;
    let tok = Tokenizer::from_dir(&o.model, model.config()).map_err(|e| e.to_string())?;
    let ids: Vec<Vec<i64>> = prompt_texts(o.prompts)
        .iter()
        .map(|t| tok.encode(t, true))
        .collect::<Result<_, _>>()
        .map_err(|e| e.to_string())?;
    let params = SamplingParams {
        max_new_tokens: o.new,
        top_k: 50,
        stop_at_eos: false,
        ..SamplingParams::default()
    };
    let engine = EngineOptions {
        max_batch: o.prompts,
        ..EngineOptions::default()
    };
    // Warm-up: first calls allocate and pick kernels.
    generate(
        &model,
        &tok,
        ids.clone(),
        SamplingParams {
            max_new_tokens: 4,
            ..params.clone()
        },
        engine.clone(),
    )
    .map_err(|e| e.to_string())?;
    let mut secs = Vec::new();
    let mut cpu = Vec::new();
    let mut tokens = 0;
    for r in 0..o.repeats {
        let p = SamplingParams {
            seed: r as u64,
            ..params.clone()
        };
        let t = Instant::now();
        let c = cpu_seconds();
        let out =
            generate(&model, &tok, ids.clone(), p, engine.clone()).map_err(|e| e.to_string())?;
        secs.push(t.elapsed().as_secs_f64());
        cpu.push(cpu_seconds() - c);
        tokens = out.iter().map(|s| s.token_ids.len()).sum::<usize>();
    }
    secs.sort_by(f64::total_cmp);
    cpu.sort_by(f64::total_cmp);
    let median = percentile(&secs, 0.5);
    let p90 = percentile(&secs, 0.9);
    // Work per generated token: every weight matrix once (2 FLOPs per weight; the embedding
    // lookup is not a product), plus attention over the context (q·k and p·v).
    let c = model.config();
    let matrices: i64 = model
        .named_parameters()
        .iter()
        .filter(|(n, t)| t.dim() == 2 && n != "model.embed_tokens.weight")
        .map(|(_, t)| t.numel() as i64)
        .sum();
    let avg_prompt = ids.iter().map(Vec::len).sum::<usize>() as f64 / ids.len() as f64;
    let avg_ctx = avg_prompt + o.new as f64 / 2.0;
    let per_token =
        2.0 * matrices as f64 + 4.0 * (c.num_layers * c.num_heads * c.head_dim) as f64 * avg_ctx;
    let gen_flops = per_token * tokens as f64 / median;
    let peak = matmul_flops();
    println!(
        "{}",
        serde_json::json!({
            "engine": "braid",
            "threads": o.threads,
            "tokens": tokens,
            "runs": secs.len(),
            "seconds_median": median,
            "seconds_p90": p90,
            "tokens_per_s_median": tokens as f64 / median,
            "tokens_per_s_at_p90_time": tokens as f64 / p90,
            "cpu_seconds_median": percentile(&cpu, 0.5),
            "tokens_per_cpu_s_median": tokens as f64 / percentile(&cpu, 0.5),
            "generation_gflops": gen_flops / 1e9,
            "matmul_gflops": peak / 1e9,
            "share_of_matmul_peak": gen_flops / peak,
        })
    );
    Ok(())
}

fn main() -> ExitCode {
    match parse().and_then(|o| run(&o)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(1)
        }
    }
}
