"""The transformers and TRL side of scripts/gpu-check, and the model it measures.

    python scripts/gpu_check_reference.py make-model OUT [--shape qwen2-0.5b|tiny] [--device cuda]
    python scripts/gpu_check_reference.py decode --model DIR --batch B [--prompt-len 32]
        [--new-tokens 128] [--device cuda]
    python scripts/gpu_check_reference.py grpo --model DIR --prompts FILE [--steps 4]
        [--batch 8] [--group 8] [--new-tokens 256] [--device cuda]

make-model: a Qwen2-0.5B-shaped Qwen2ForCausalLM (24 layers, hidden 896, 14 heads, 2 key-value
heads, intermediate 4864, vocabulary 151936, tied embeddings, q/k/v biases) with transformers'
random initialisation (seed 0), saved in bf16 with the fixtures' byte-level tokenizer (300 ids;
the random model's other ids decode to nothing). `--shape tiny` makes a small one for
`scripts/gpu-check --smoke` on the CPU.

decode: model.generate, greedy, exactly --new-tokens tokens per prompt (min_new_tokens), bf16,
after one short warm-up generation; prints {"batch", "new_tokens", "seconds", "tokens_per_s"}.

grpo: TRL's GRPOTrainer with Braid's std::grpo settings (see scripts/bench_trl_grpo.py for the
CPU comparison they come from): 8 prompts x 8 generations x 256 new tokens per step, one
optimizer step per generation batch, temperature 1 without top-k/top-p, clip 0.2, KL 0.04 (k3,
with a reference model), loss_type "grpo", advantages scaled by the group's std, AdamW at
lr 1e-6 (constant), gradient norm clipped to 1, bf16, no vLLM, no activation checkpointing
(TRL's default is on; Braid's programs opt in). Prints per-step seconds.
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
FIXTURE = os.path.join(ROOT, "runtime", "tests", "fixtures", "llama_gqa")


def device_of(name):
    if name == "cuda":
        if not torch.cuda.is_available():
            sys.exit("gpu_check_reference: no GPU found (torch.cuda.is_available() is False)")
        return torch.device("cuda", 0)
    return torch.device("cpu")


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_model(args):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    shapes = {
        "qwen2-0.5b": dict(
            vocab_size=151936,
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            max_position_embeddings=32768,
            rope_theta=1000000.0,
            tie_word_embeddings=True,
        ),
        "tiny": dict(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=1024,
            rope_theta=10000.0,
            tie_word_embeddings=True,
        ),
    }
    device = device_of(args.device)
    torch.manual_seed(0)
    config = Qwen2Config(
        **shapes[args.shape],
        rms_norm_eps=1e-6,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        torch_dtype="bfloat16",
    )
    with torch.device(device):
        model = Qwen2ForCausalLM(config)
    model.to(torch.bfloat16).save_pretrained(args.out)
    for name in ["tokenizer.json", "tokenizer_config.json"]:
        shutil.copy(os.path.join(FIXTURE, name), os.path.join(args.out, name))
    print(json.dumps({"model": args.out, "parameters": sum(p.numel() for p in model.parameters())}))


def load(path, device):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device)
    model.eval()
    return model


def decode(args):
    device = device_of(args.device)
    model = load(args.model, device)
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, 300, (args.batch, args.prompt_len), generator=g).to(device)
    mask = torch.ones_like(ids)

    def run(n):
        with torch.no_grad():
            return model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=n,
                min_new_tokens=n,
                pad_token_id=2,
            )

    run(8)
    sync(device)
    t0 = time.perf_counter()
    out = run(args.new_tokens)
    sync(device)
    seconds = time.perf_counter() - t0
    tokens = (out.shape[1] - args.prompt_len) * args.batch
    if tokens != args.batch * args.new_tokens:
        sys.exit(f"gpu_check_reference: generated {tokens} tokens, expected {args.batch * args.new_tokens}")
    print(
        json.dumps(
            {
                "batch": args.batch,
                "new_tokens": args.new_tokens,
                "seconds": seconds,
                "tokens_per_s": tokens / seconds,
                "transformers_version": __import__("transformers").__version__,
            }
        )
    )


def grpo(args):
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    device_of(args.device)

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.begin, self.end = [], []

        def on_step_begin(self, a, state, control, **kwargs):
            self.begin.append(time.perf_counter())

        def on_step_end(self, a, state, control, **kwargs):
            if args.device == "cuda":
                torch.cuda.synchronize()
            self.end.append(time.perf_counter())

    def length_reward(prompts, completions, **kwargs):
        return [len(c) / 256.0 for c in completions]

    with open(args.prompts) as f:
        prompts = [json.loads(line)["prompt"] for line in f if line.strip()]
    prompts = prompts[: args.steps * args.batch]
    dataset = Dataset.from_dict({"prompt": prompts})
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="braid-gpu-check-trl-"),
        use_cpu=args.device == "cpu",
        seed=1,
        max_steps=args.steps,
        per_device_train_batch_size=args.batch * args.group,
        gradient_accumulation_steps=1,
        num_generations=args.group,
        max_completion_length=args.new_tokens,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        learning_rate=1e-6,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=0.04,
        epsilon=0.2,
        num_iterations=1,
        loss_type="grpo",
        scale_rewards="group",
        shuffle_dataset=False,
        use_vllm=False,
        bf16=True,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
        gradient_checkpointing=False,
        model_init_kwargs={"dtype": torch.bfloat16},
    )
    timer = StepTimer()
    trainer = GRPOTrainer(
        model=args.model,
        reward_funcs=length_reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[timer],
    )
    trainer.train()
    steps = [e - b for b, e in zip(timer.begin, timer.end)]
    print(
        json.dumps(
            {
                "system": "trl",
                "trl_version": __import__("trl").__version__,
                "transformers_version": __import__("transformers").__version__,
                "torch_version": torch.__version__,
                "step_seconds": steps,
            }
        )
    )


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="command", required=True)
    m = sub.add_parser("make-model")
    m.add_argument("out")
    m.add_argument("--shape", choices=["qwen2-0.5b", "tiny"], default="qwen2-0.5b")
    m.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    d = sub.add_parser("decode")
    d.add_argument("--model", required=True)
    d.add_argument("--batch", type=int, required=True)
    d.add_argument("--prompt-len", type=int, default=32)
    d.add_argument("--new-tokens", type=int, default=128)
    d.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    g = sub.add_parser("grpo")
    g.add_argument("--model", required=True)
    g.add_argument("--prompts", required=True)
    g.add_argument("--steps", type=int, default=4)
    g.add_argument("--batch", type=int, default=8)
    g.add_argument("--group", type=int, default=8)
    g.add_argument("--new-tokens", type=int, default=256)
    g.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = ap.parse_args()
    {"make-model": make_model, "decode": decode, "grpo": grpo}[args.command](args)


if __name__ == "__main__":
    main()
