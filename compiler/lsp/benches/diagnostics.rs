//! `cargo bench -p braid-lsp --bench diagnostics`: the latency an editor sees between sending
//! `textDocument/didChange` for a generated 2,000-line program and receiving its
//! `publishDiagnostics`, through the real server loop on lsp-server's in-memory connection
//! (no stdio framing). Prints the median and 90th percentile of 30 changes. Target: under 20 ms
//! in release builds. Not a test: nothing fails when it is slow.

use std::fmt::Write;
use std::time::{Duration, Instant};

use lsp_server::{Connection, Message, Notification, Request, RequestId};
use serde_json::json;

/// A runnable program of at least `lines` lines: many reward functions and pipelines, and a run.
fn generate(lines: usize) -> String {
    let mut s = String::from(
        "use std::grpo\nuse std::advantages\nuse std::losses\n\nmodel policy = tiny(layers: 2, hidden: 64) {\n  train: adamw(lr: 3e-4)\n}\n\ndataset prompts = synthetic::letters(count: 64)\n\n",
    );
    let mut i = 0;
    while s.lines().count() < lines.saturating_sub(4) {
        let _ = write!(
            s,
            "// Reward family {i}.
fn reward_{i}(s: Sample) -> float {{
  let bonus = 0.5
  let vowels = count(s.completion, r\"[aeiou]\")
  let total = max(len(s.completion), 1)
  let share = vowels / total
  if share > 0.3 && s.length < 64 {{ share + bonus }} else {{ share - bonus * 0.1 }}
}}

fn centred_{i}(r: PerSample) -> PerSample over group {{
  (r - mean(r)) / (std(r) + 1e-6)
}}

pipeline algo_{i}(policy: Model, prompts: Dataset, reward: fn(Sample) -> float) {{
  param steps: int where steps > 0
  param batch: int = 32 where batch > 0
  each _ in steps {{
    let rollout = generate(policy, next(prompts, batch), n: 4, max_new_tokens: 64)
    let old_logp = logprobs(policy, rollout)
    let adv = centred_{i}(reward(rollout))
    train(policy, rollout, loss: ppo_loss(policy, old_logp, adv, 0.2))
  }}
}}

"
        );
        i += 1;
    }
    s.push_str("run grpo(policy, prompts, reward: reward_0) {\n  steps: 10\n}\n");
    s
}

fn main() {
    let text = generate(2000);
    let lines = text.lines().count();
    let (server, client) = Connection::memory();
    let handle = std::thread::spawn(move || braid_lsp::serve(&server));
    let uri = "file:///bench/big.rlhf";
    let send = |m: Message| client.sender.send(m).expect("server alive");
    send(Message::Request(Request::new(
        RequestId::from(1),
        "initialize".into(),
        json!({"processId": null, "capabilities": {}}),
    )));
    let published = || loop {
        match client.receiver.recv().expect("server alive") {
            Message::Notification(n) if n.method == "textDocument/publishDiagnostics" => {
                return n.params["diagnostics"].as_array().map_or(0, Vec::len);
            }
            _ => {}
        }
    };
    send(Message::Notification(Notification::new(
        "textDocument/didOpen".into(),
        json!({"textDocument": {"uri": uri, "languageId": "rlhf", "version": 0, "text": text}}),
    )));
    let diags = published();
    assert_eq!(diags, 0, "the generated program checks clean");
    let mut times: Vec<Duration> = Vec::new();
    let mut cpu_times: Vec<Duration> = Vec::new();
    for version in 1..=30 {
        // Alternate two texts so that every change is a real edit.
        let changed = if version % 2 == 0 {
            text.clone()
        } else {
            text.replace("steps: 10", "steps: 11")
        };
        let (start, cpu) = (Instant::now(), process_cpu());
        send(Message::Notification(Notification::new(
            "textDocument/didChange".into(),
            json!({"textDocument": {"uri": uri, "version": version}, "contentChanges": [{"text": changed}]}),
        )));
        published();
        times.push(start.elapsed());
        if let (Some(a), Some(b)) = (cpu, process_cpu()) {
            cpu_times.push(b.saturating_sub(a));
        }
    }
    send(Message::Request(Request::new(
        RequestId::from(2),
        "shutdown".into(),
        serde_json::Value::Null,
    )));
    send(Message::Notification(Notification::new(
        "exit".into(),
        serde_json::Value::Null,
    )));
    let _ = handle.join();
    // For comparison, the check alone (parse and check, stdlib imports included): what the
    // server adds on top of it is the message handling.
    // On a loaded machine wall time includes waiting for a core, so the CPU time of this thread
    // (Linux's schedstat) is printed next to it.
    let mut check_times: Vec<Duration> = Vec::new();
    let mut check_cpu: Vec<Duration> = Vec::new();
    for _ in 0..30 {
        let (start, cpu) = (Instant::now(), thread_cpu());
        let checked = braid_sema::check("/bench/big.rlhf", &text, &braid_sema::NoImports);
        std::hint::black_box(&checked);
        check_times.push(start.elapsed());
        if let (Some(a), Some(b)) = (cpu, thread_cpu()) {
            check_cpu.push(b.saturating_sub(a));
        }
    }
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let stats = |t: &mut Vec<Duration>| {
        t.sort();
        (ms(t[t.len() / 2]), ms(t[t.len() * 9 / 10]))
    };
    let (median, p90) = stats(&mut times);
    let (check_median, check_p90) = stats(&mut check_times);
    println!(
        "didChange → publishDiagnostics, {lines} lines, 30 runs: median {median:.2} ms, p90 {p90:.2} ms (wall)"
    );
    if cpu_times.len() == 30 {
        let (cpu_median, cpu_p90) = stats(&mut cpu_times);
        println!(
            "didChange → publishDiagnostics: median {cpu_median:.2} ms, p90 {cpu_p90:.2} ms (CPU time of all threads)"
        );
    }
    println!("braid_sema::check alone: median {check_median:.2} ms, p90 {check_p90:.2} ms (wall)");
    if check_cpu.len() == 30 {
        let (cpu_median, cpu_p90) = stats(&mut check_cpu);
        println!(
            "braid_sema::check alone: median {cpu_median:.2} ms, p90 {cpu_p90:.2} ms (CPU time)"
        );
    }
    if let Ok(load) = std::fs::read_to_string("/proc/loadavg") {
        println!(
            "load average (1 min): {}",
            load.split_whitespace().next().unwrap_or("?")
        );
    }
}

/// CPU time of every thread of this process (server and client), from each thread's schedstat.
fn process_cpu() -> Option<Duration> {
    let mut total = Duration::ZERO;
    for task in std::fs::read_dir("/proc/self/task").ok()? {
        let text = std::fs::read_to_string(task.ok()?.path().join("schedstat")).ok()?;
        let ns: u64 = text.split_whitespace().next()?.parse().ok()?;
        total += Duration::from_nanos(ns);
    }
    Some(total)
}

/// CPU time of the calling thread: the first field of `/proc/thread-self/schedstat` (ns).
fn thread_cpu() -> Option<Duration> {
    let text = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    let ns: u64 = text.split_whitespace().next()?.parse().ok()?;
    Some(Duration::from_nanos(ns))
}
