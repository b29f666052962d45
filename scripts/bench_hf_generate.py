"""transformers' side of scripts/bench_generate.sh: `generate` throughput on the benchmark
model with the same prompts as Braid (runtime/examples/bench_generate.rs), sampling with
transformers' defaults (temperature 1, top-k 50), end-of-sequence ignored. Prints one JSON
object.

    PYTHONPATH=.pydeps .venv/bin/python scripts/bench_hf_generate.py DIR --threads 1 --repeats 5
"""

import argparse
import json
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def prompt_texts(n):
    words = ["the quick brown fox", "jumps over", "the lazy dog", "while rewards"]
    return [f"Prompt {i}: " + " ".join(words[: 1 + i % len(words)]) for i in range(n)]


def percentile(sorted_values, p):
    i = round((len(sorted_values) - 1) * p)
    return sorted_values[min(i, len(sorted_values) - 1)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(args.model)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    inputs = tok(prompt_texts(args.prompts), return_tensors="pt", padding=True)
    kw = dict(do_sample=True, top_k=50, temperature=1.0, max_new_tokens=args.new, min_new_tokens=args.new,
              pad_token_id=tok.pad_token_id)
    with torch.no_grad():
        model.generate(**inputs, **dict(kw, max_new_tokens=4, min_new_tokens=4))  # warm-up
        secs = []
        cpu = []
        tokens = 0
        for r in range(args.repeats):
            torch.manual_seed(r)
            t = time.perf_counter()
            c = time.process_time()
            out = model.generate(**inputs, **kw)
            secs.append(time.perf_counter() - t)
            cpu.append(time.process_time() - c)
            tokens = (out.shape[1] - inputs["input_ids"].shape[1]) * out.shape[0]
    secs.sort()
    median = statistics.median(secs)
    p90 = percentile(secs, 0.9)
    print(json.dumps({
        "engine": "transformers",
        "threads": args.threads,
        "tokens": tokens,
        "runs": len(secs),
        "seconds_median": median,
        "seconds_p90": p90,
        "tokens_per_s_median": tokens / median,
        "tokens_per_s_at_p90_time": tokens / p90,
        "cpu_seconds_median": statistics.median(cpu),
        "tokens_per_cpu_s_median": tokens / statistics.median(cpu),
    }))


if __name__ == "__main__":
    main()
