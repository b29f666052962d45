//! `cargo bench -p braid-sema --bench check`: parse and check a generated 10,000-line program
//! (many reward and advantage functions and pipelines, as a large project would have) and print
//! the median and 90th-percentile wall time of 30 runs. Target: under 100 ms in release builds.

use std::fmt::Write;
use std::time::Instant;

/// A program of at least `lines` lines: groups of functions and a pipeline that uses them.
fn generate(lines: usize) -> String {
    let mut s =
        String::from("use std::advantages\nuse std::kl\nuse std::grpo\nuse std::losses\n\n");
    let mut i = 0;
    while s.lines().count() < lines {
        let _ = write!(
            s,
            "// Reward family {i}.
fn reward_{i}(s: Sample, bonus: float = 0.5) -> float {{
  let vowels = count(s.completion, r\"[aeiou]\")
  let total = max(len(s.completion), 1)
  let share = vowels / total
  if share > 0.3 && s.length < 64 {{ share + bonus }} else {{ share - bonus * 0.1 }}
}}

fn shaped_{i}(r: PerToken, v: PerToken, gamma: float = 0.99) -> PerToken {{
  scan reverse t with acc = 0.0 {{
    let delta = r[t] + gamma * v[t + 1] - v[t]
    acc = delta + gamma * 0.95 * acc
  }}
}}

fn centred_{i}(r: PerSample) -> PerSample over group {{
  (r - mean(r)) / (std(r) + 1e-6)
}}

pipeline algo_{i}(policy: Model, prompts: Dataset, critic: Model) {{
  param steps: int where steps > 0
  param batch: int = 32 where batch > 0 && batch % 4 == 0
  param gamma: float = 0.99 where 0.0 <= gamma && gamma <= 1.0

  model ref = frozen(policy)

  each _ in steps {{
    let rollout = generate(policy, next(prompts, batch), n: 4, max_new_tokens: 64)
    let old_logp = logprobs(policy, rollout)
    let ref_logp = logprobs(ref, rollout)
    let old_v = values(critic, rollout)
    let r = kl_shaped(centred_{i}(reward_{i}(rollout)), old_logp, ref_logp, 0.05)
    let a = shaped_{i}(r, old_v, gamma)
    train(policy, rollout, loss: ppo_loss(policy, old_logp, whiten(a), 0.2))
    train(critic, rollout, loss: value_loss(critic, old_v, a + old_v, 0.2))
  }}
}}

"
        );
        i += 1;
    }
    s
}

fn main() {
    let text = generate(10_000);
    let lines = text.lines().count();
    // BRAID_BENCH_RUNS=1 gives one run, for instruction counts under valgrind.
    let runs: usize = std::env::var("BRAID_BENCH_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(30);
    let mut times = Vec::new();
    for _ in 0..runs {
        let start = Instant::now();
        let checked = braid_sema::check("bench.rlhf", &text, &braid_sema::NoImports);
        times.push(start.elapsed().as_secs_f64() * 1e3);
        assert!(!checked.has_errors(), "{:?}", checked.diagnostics.first());
    }
    let mut parse_times = Vec::new();
    for _ in 0..runs.min(10) {
        let start = Instant::now();
        let (_, d) = braid_syntax::parse(&text, braid_diagnostics::FileId(0));
        parse_times.push(start.elapsed().as_secs_f64() * 1e3);
        assert!(d.is_empty());
    }
    parse_times.sort_by(f64::total_cmp);
    println!(
        "parse alone: median {:.1} ms",
        parse_times[parse_times.len() / 2]
    );
    times.sort_by(f64::total_cmp);
    let median = times[times.len() / 2];
    let p90 = times[times.len() * 9 / 10];
    println!(
        "braid check, {lines} lines ({} bytes): median {median:.1} ms, p90 {p90:.1} ms over {} runs",
        text.len(),
        times.len()
    );
}
