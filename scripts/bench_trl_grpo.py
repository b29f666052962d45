"""The TRL side of scripts/bench_trl: GRPO with TRL's GRPOTrainer on the workload of
bench/grpo_trl_compare.rlhf, on the CPU, in one process with one libtorch thread. Prints one
JSON object (per-step mean reward, per-step seconds, samples per second of the training loop).

    .venv-trl/bin/python scripts/bench_trl_grpo.py --model bench/work/tiny_llama \
        --prompts bench/work/prompts.jsonl --steps 20 --lr 2e-4 --beta 0.04 --seed 1

Settings mirror std::grpo with the program's run settings: 8 prompts x 4 generations per step
(per_device_train_batch_size 32 completions, one optimizer step per generation), 64 new tokens,
temperature 1 with no top-k/top-p cut, clip 0.2, KL coefficient beta with TRL's k3 estimator,
loss_type "grpo" (per-sequence token mean, then the mean over sequences), advantages scaled by
the group's std, AdamW at a constant learning rate, gradient norm clipped to 1, prompts in file
order (no shuffling), no activation checkpointing (TRL's default is on). The reward is the share of vowels in the completion, as in the program.
"""

import argparse
import json
import os
import re
import sys
import tempfile
import time

import torch

torch.set_num_threads(1)
torch.set_num_interop_threads(1)

from datasets import Dataset  # noqa: E402
from transformers import AutoTokenizer, TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

VOWEL = re.compile(r"[aeiou]")
REWARDS = []  # mean reward of each call (one call per generation batch = per step)


def vowel_share(prompts, completions, **kwargs):
    out = [len(VOWEL.findall(c)) / max(len(c), 1) for c in completions]
    REWARDS.append(sum(out) / len(out))
    return out


class StepTimer(TrainerCallback):
    def __init__(self):
        self.begin = []
        self.end = []
        self.threads = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.threads = torch.get_num_threads()

    def on_step_begin(self, args, state, control, **kwargs):
        self.begin.append(time.perf_counter())

    def on_step_end(self, args, state, control, **kwargs):
        self.end.append(time.perf_counter())


def timed_method(obj, name, sink):
    """Wraps obj.name so that each call's wall seconds are appended to sink."""
    inner = getattr(obj, name)

    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return inner(*a, **k)
        finally:
            sink.append(time.perf_counter() - t0)

    setattr(obj, name, wrapper)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--beta", type=float, default=0.04)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()

    t_process = time.perf_counter()
    with open(args.prompts) as f:
        prompts = [json.loads(line)["prompt"] for line in f if line.strip()]
    prompts = prompts[: args.steps * args.batch]
    dataset = Dataset.from_dict({"prompt": prompts})
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    out_dir = tempfile.mkdtemp(prefix="braid-bench-trl-")
    config = GRPOConfig(
        output_dir=out_dir,
        use_cpu=True,
        seed=args.seed,
        max_steps=args.steps,
        per_device_train_batch_size=args.batch * args.group,
        gradient_accumulation_steps=1,
        num_generations=args.group,
        max_completion_length=args.new,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        max_grad_norm=1.0,
        beta=args.beta,
        epsilon=0.2,
        num_iterations=1,
        loss_type="grpo",
        scale_rewards="group",
        shuffle_dataset=False,
        use_vllm=False,
        bf16=False,
        fp16=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
        # TRL defaults to activation checkpointing (recomputing activations in the backward
        # pass); off here, as memory is no concern for this model and it would only slow TRL.
        gradient_checkpointing=False,
        model_init_kwargs={"dtype": torch.float32},
    )
    timer = StepTimer()
    trainer = GRPOTrainer(
        model=args.model,
        reward_funcs=vowel_share,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[timer],
    )
    # Where a step's time goes: generation, then generation plus the reference log-probs and
    # rewards (TRL computes no separate old log-probs when on-policy); the rest is training.
    gen_s, prep_s = [], []
    timed_method(trainer, "_generate_single_turn", gen_s)
    timed_method(trainer, "_generate_and_score_completions", prep_s)
    t_train = time.perf_counter()
    trainer.train()
    t_done = time.perf_counter()

    steps = len(timer.end)
    loop_s = timer.end[-1] - timer.begin[0]
    samples = steps * args.batch * args.group
    log = [e for e in trainer.state.log_history if "reward" in e]
    print(
        json.dumps(
            {
                "system": "trl",
                "trl_version": __import__("trl").__version__,
                "transformers_version": __import__("transformers").__version__,
                "torch_version": torch.__version__,
                "threads": timer.threads,
                "steps": steps,
                "samples": samples,
                "loop_seconds": loop_s,
                "samples_per_s": samples / loop_s,
                "step_seconds": [e - b for b, e in zip(timer.begin, timer.end)],
                "time_generate": gen_s[:steps],
                "time_infer": [p - g for p, g in zip(prep_s, gen_s)][:steps],
                "time_train": [
                    (e - b) - p for b, e, p in zip(timer.begin, timer.end, prep_s)
                ],
                "train_call_seconds": t_done - t_train,
                "setup_seconds": t_train - t_process,
                "reward": REWARDS[:steps],
                "kl": [e.get("kl") for e in log],
                "completion_length": [e.get("completions/mean_length") for e in log],
            }
        )
    )


if __name__ == "__main__":
    sys.exit(main())
