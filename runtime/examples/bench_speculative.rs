//! Decode throughput with speculative decoding (`auto`, and `ngram:8` for reference) against
//! plain decoding (`off`), in one run, on three workloads built from a seeded tiny Llama
//! (hidden 256, 4 layers, 4 heads, intermediate 1024, byte vocabulary, 512 positions):
//!
//! * **copy** — completions that repeat spans of their prompts. Each prompt is 16 random
//!   bytes followed by the model's own greedy continuation of them (48 tokens, generated
//!   before timing); random models fall into repetition loops, so the prompt already holds the
//!   loop the completion goes on with. 32 prompts in a batch of 32, 128 greedy tokens each;
//!   `copy-8` and `copy-small`: 8 and 4 such prompts in a batch of 8 and of 4.
//! * **random** — 32 prompts of 16 random bytes, sampled at temperature 1 (the tiny model's
//!   distribution is close to uniform over bytes, so the text is random and n-gram drafts are
//!   almost never right). 128 tokens each; `random-8` and `random-small`: 8 and 4 prompts in
//!   a batch of 8 and of 4.
//! * **tail** — a long-tailed batch of 64 copy-heavy prompts: 56 of them nearly fill the
//!   512-position context (464-token prompts, so they stop after 48 tokens, finish `length`),
//!   8 are short and generate 448 tokens. Reported: overall throughput and the throughput of
//!   the tail (steps with at most 8 running samples), from the engine's step log.
//!
//! Every configuration runs `--repeats` times (default 5), modes interleaved; the median is
//! reported. Greedy outputs are checked to be identical across modes. One libtorch thread.
//!
//! `--size small` runs the same workloads on the default tiny model (hidden 64, 2 layers), whose
//! decode steps are dominated by per-step overhead rather than arithmetic.
//!
//! Usage: cargo run --release -p braid-runtime --example bench_speculative
//!        [-- --repeats 5 --only copy|copy-8|copy-small|random|random-8|random-small|tail --size small|medium]

use std::process::ExitCode;
use std::time::Instant;

use braid_runtime::generation::spec::{SpeculateMode, StepRecord};
use braid_runtime::rng::Rng;
use braid_runtime::{
    EngineOptions, Head, Model, Sample, SamplingParams, TinyConfig, Tokenizer, device, generate,
    generate_stream, tiny,
};
use tch::Device;

struct Workload {
    name: &'static str,
    prompts: Vec<Vec<i64>>,
    params: SamplingParams,
    max_batch: usize,
}

struct Run {
    secs: f64,
    cpu: f64,
    tokens: usize,
    samples: Vec<Sample>,
    log: Vec<StepRecord>,
}

fn run(m: &Model, tok: &Tokenizer, w: &Workload, mode: &SpeculateMode) -> Result<Run, String> {
    let options = EngineOptions {
        max_batch: w.max_batch,
        speculate: mode.clone(),
        first_prompt: 0,
        ..EngineOptions::default()
    };
    let t = Instant::now();
    let c = cpu_seconds();
    let mut stream = generate_stream(m, tok, w.prompts.clone(), w.params.clone(), options)
        .map_err(|e| e.to_string())?;
    let mut samples = Vec::new();
    for s in stream.by_ref() {
        samples.push(s.map_err(|e| e.to_string())?);
    }
    let secs = t.elapsed().as_secs_f64();
    let cpu = cpu_seconds() - c;
    samples.sort_by_key(|s| (s.prompt_index, s.sample_index));
    let tokens = samples.iter().map(|s| s.token_ids.len()).sum();
    Ok(Run {
        secs,
        cpu,
        tokens,
        samples,
        log: stream.step_log().to_vec(),
    })
}

/// CPU seconds used by this process so far, from /proc (0 where unavailable): on a machine
/// shared with other work, wall time includes waiting for a core and CPU time does not.
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime, in clock ticks (100 per second on Linux).
    [11, 12]
        .iter()
        .filter_map(|&i| fields.get(i).and_then(|f| f.parse::<f64>().ok()))
        .sum::<f64>()
        / 100.0
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    let n = xs.len();
    if n == 0 {
        return f64::NAN;
    }
    if n % 2 == 1 {
        xs[n / 2]
    } else {
        (xs[n / 2 - 1] + xs[n / 2]) / 2.0
    }
}

fn random_bytes(rng: &mut Rng, n: usize) -> Vec<i64> {
    // Printable ASCII, after the byte tokenizer's <|bos|>.
    let mut ids = vec![256];
    ids.extend((0..n).map(|_| 32 + (rng.next_u64() % 95) as i64));
    ids
}

/// Prompts that end in the model's own greedy continuation of a random prefix.
fn copy_prompts(
    m: &Model,
    tok: &Tokenizer,
    rng: &mut Rng,
    count: usize,
    continuation: usize,
) -> Result<Vec<Vec<i64>>, String> {
    let prefixes: Vec<Vec<i64>> = (0..count).map(|_| random_bytes(rng, 16)).collect();
    let params = SamplingParams {
        greedy: true,
        max_new_tokens: continuation,
        stop_at_eos: false,
        ..SamplingParams::default()
    };
    let options = EngineOptions {
        max_batch: 64,
        ..EngineOptions::default()
    };
    let out = generate(m, tok, prefixes.clone(), params, options).map_err(|e| e.to_string())?;
    Ok(prefixes
        .into_iter()
        .zip(out)
        .map(|(mut p, s)| {
            p.extend(s.token_ids);
            p
        })
        .collect())
}

/// Tokens per second of the steps with at most `rows` running samples.
fn tail_rate(log: &[StepRecord], rows: usize) -> (usize, f64) {
    let (tokens, secs) = log
        .iter()
        .filter(|s| s.rows <= rows)
        .fold((0, 0.0), |(t, s), r| (t + r.emitted, s + r.secs));
    (tokens, tokens as f64 / secs.max(1e-12))
}

/// Mean draft length chosen, by batch size bucket.
fn draft_by_batch(log: &[StepRecord]) -> String {
    let buckets = [(33, 64), (17, 32), (9, 16), (5, 8), (2, 4), (1, 1)];
    let mut parts = Vec::new();
    for (lo, hi) in buckets {
        let steps: Vec<&StepRecord> = log
            .iter()
            .filter(|s| s.rows >= lo && s.rows <= hi)
            .collect();
        if steps.is_empty() {
            continue;
        }
        let k = steps.iter().map(|s| s.draft_len as f64).sum::<f64>() / steps.len() as f64;
        parts.push(format!("B {lo}-{hi}: K {k:.1}"));
    }
    parts.join(", ")
}

fn main() -> ExitCode {
    match main_inner() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(1)
        }
    }
}

fn main_inner() -> Result<(), String> {
    let mut repeats = 5usize;
    let mut only: Option<String> = None;
    let mut small = false;
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        match (flag.as_str(), args.next()) {
            ("--repeats", Some(v)) => repeats = v.parse().map_err(|e| format!("--repeats: {e}"))?,
            ("--only", Some(v)) => only = Some(v),
            ("--size", Some(v)) if v == "small" || v == "medium" => small = v == "small",
            (other, _) => {
                return Err(format!(
                    "unknown option {other} (expected --repeats N, --only copy|copy-8|copy-small|random|random-8|random-small|tail, --size small|medium)"
                ));
            }
        }
    }
    device::set_cpu_threads(1);
    let cfg = if small {
        // The default tiny model: per-step overhead dominates, as in memory-bound decoding.
        TinyConfig {
            seed: 1,
            ..TinyConfig::default()
        }
    } else {
        TinyConfig {
            layers: 4,
            hidden: 256,
            heads: 4,
            kv_heads: 4,
            intermediate: 1024,
            max_len: 512,
            seed: 1,
            ..TinyConfig::default()
        }
    };
    let (m, tok) = tiny(&cfg, Head::Lm, Device::Cpu).map_err(|e| e.to_string())?;
    let mut rng = Rng::new(7);
    let greedy = |n: usize| SamplingParams {
        greedy: true,
        max_new_tokens: n,
        stop_at_eos: false,
        ..SamplingParams::default()
    };
    let copy = Workload {
        name: "copy",
        prompts: copy_prompts(&m, &tok, &mut rng, 32, 48)?,
        params: greedy(128),
        max_batch: 32,
    };
    let random = Workload {
        name: "random",
        prompts: (0..32).map(|_| random_bytes(&mut rng, 16)).collect(),
        params: SamplingParams {
            max_new_tokens: 128,
            temperature: 1.0,
            seed: 3,
            stop_at_eos: false,
            ..SamplingParams::default()
        },
        max_batch: 32,
    };
    let copy_small = Workload {
        name: "copy-small",
        prompts: copy_prompts(&m, &tok, &mut rng, 4, 48)?,
        params: greedy(128),
        max_batch: 4,
    };
    let random_small = Workload {
        name: "random-small",
        prompts: (0..4).map(|_| random_bytes(&mut rng, 16)).collect(),
        params: SamplingParams {
            seed: 4,
            ..random.params.clone()
        },
        max_batch: 4,
    };
    let mut tail_prompts = copy_prompts(&m, &tok, &mut rng, 56, 447)?;
    tail_prompts.extend(copy_prompts(&m, &tok, &mut rng, 8, 47)?);
    let tail = Workload {
        name: "tail",
        prompts: tail_prompts,
        params: greedy(448),
        max_batch: 64,
    };
    // Made after the others so that their prompts do not change.
    let copy_8 = Workload {
        name: "copy-8",
        prompts: copy_prompts(&m, &tok, &mut rng, 8, 48)?,
        params: greedy(128),
        max_batch: 8,
    };
    let random_8 = Workload {
        name: "random-8",
        prompts: (0..8).map(|_| random_bytes(&mut rng, 16)).collect(),
        params: SamplingParams {
            seed: 5,
            ..random.params.clone()
        },
        max_batch: 8,
    };
    let modes = [
        SpeculateMode::Off,
        SpeculateMode::Auto,
        SpeculateMode::Ngram(8),
    ];
    println!(
        "model: tiny Llama hidden {} x {} layers, intermediate {}, vocab 259; 1 thread; median of {repeats} runs",
        cfg.hidden, cfg.layers, cfg.intermediate
    );
    for w in [
        &copy,
        &copy_8,
        &copy_small,
        &random,
        &random_8,
        &random_small,
        &tail,
    ] {
        if only.as_deref().is_some_and(|o| o != w.name) {
            continue;
        }
        // Warm-up (allocations, kernel choice), then interleaved timed runs.
        for mode in &modes {
            run(&m, &tok, w, mode)?;
        }
        let mut rates: Vec<Vec<f64>> = vec![Vec::new(); modes.len()];
        let mut cpu_rates: Vec<Vec<f64>> = vec![Vec::new(); modes.len()];
        let mut tails: Vec<Vec<f64>> = vec![Vec::new(); modes.len()];
        let mut last: Vec<Option<Run>> = (0..modes.len()).map(|_| None).collect();
        for _ in 0..repeats {
            for (i, mode) in modes.iter().enumerate() {
                let r = run(&m, &tok, w, mode)?;
                rates[i].push(r.tokens as f64 / r.secs);
                cpu_rates[i].push(r.tokens as f64 / r.cpu.max(1e-3));
                tails[i].push(tail_rate(&r.log, 8).1);
                last[i] = Some(r);
            }
        }
        let base = median(rates[0].clone());
        let base_cpu = median(cpu_rates[0].clone());
        let base_tail = median(tails[0].clone());
        let Some(off) = last[0].as_ref() else {
            return Err("no runs".into());
        };
        println!(
            "\n[{}] {} prompts, {} tokens generated, max batch {}",
            w.name,
            w.prompts.len(),
            off.tokens,
            w.max_batch
        );
        for (i, mode) in modes.iter().enumerate() {
            let Some(r) = last[i].as_ref() else {
                continue;
            };
            if w.params.greedy || !matches!(mode, SpeculateMode::Draft(_)) {
                let same = r
                    .samples
                    .iter()
                    .zip(&off.samples)
                    .all(|(a, b)| a.token_ids == b.token_ids);
                if !same {
                    return Err(format!("{}: {mode} changed the text", w.name));
                }
            }
            let drafted: usize = r.log.iter().map(|s| s.drafted).sum();
            let accepted: usize = r.log.iter().map(|s| s.accepted).sum();
            let rate = median(rates[i].clone());
            let cpu_rate = median(cpu_rates[i].clone());
            let mut line = format!(
                "  {:<8} {:>6.0} tok/s {:>5.2}x | {:>6.0} tok/CPU-s {:>5.2}x | steps {:>4}  drafted {:>6}  accepted {:>6} ({:>3.0} %)",
                mode.to_string(),
                rate,
                rate / base,
                cpu_rate,
                cpu_rate / base_cpu,
                r.log.len(),
                drafted,
                accepted,
                100.0 * accepted as f64 / drafted.max(1) as f64,
            );
            if w.name == "tail" {
                let (tail_tokens, _) = tail_rate(&r.log, 8);
                let t = median(tails[i].clone());
                line.push_str(&format!(
                    "\n           tail (<= 8 running): {t:.0} tok/s, {:.2}x, {tail_tokens} tokens",
                    t / base_tail
                ));
            }
            if std::env::var_os("BENCH_VERBOSE").is_some() {
                let mut by_k: std::collections::BTreeMap<usize, (usize, f64)> = Default::default();
                for st in r.log.iter().filter(|st| st.rows == w.max_batch) {
                    let e = by_k.entry(st.draft_len).or_default();
                    e.0 += 1;
                    e.1 += st.secs;
                }
                let parts: Vec<String> = by_k
                    .iter()
                    .map(|(k, (n, s))| format!("K{k}: {:.1} ms x{n}", 1e3 * s / *n as f64))
                    .collect();
                line.push_str(&format!(
                    "\n           full-batch step times: {}",
                    parts.join(", ")
                ));
            }
            if *mode == SpeculateMode::Auto {
                line.push_str(&format!(
                    "\n           draft length chosen: {}",
                    draft_by_batch(&r.log)
                ));
            }
            println!("{line}");
        }
    }
    Ok(())
}
