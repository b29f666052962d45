"""Makes the parity fixtures of braid-runtime (runtime/tests/fixtures/) with transformers.

Each fixture is a tiny random Hugging Face model directory (config.json, model.safetensors or
shards, tokenizer files) plus expected.json with what transformers computes on it:
  input_ids, logits (f32, flattened [1, T, V]), greedy (prompt ids and 16 greedily generated
  tokens), and for reward models the score of a right-padded batch.
The Rust tests (runtime/tests/parity.rs) compare Braid against these numbers; they do not need
Python. Regenerate with:

    .venv/bin/python -m pip install --target .pydeps transformers
    PYTHONPATH=.pydeps .venv/bin/python scripts/make_fixtures.py
"""

import json
import os
import shutil
import sys

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "runtime", "tests", "fixtures")
VOCAB = 320
TEXT = [
    "Braid compiles RLHF pipelines and runs them on libtorch.",
    "The quick brown fox jumps over the lazy dog.",
    "Generation streams finished samples to inference while decoding continues.",
    "Rewards, values and log-probabilities are computed in micro-batches.",
]


def make_tokenizer():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TEXT * 4, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def llama_kwargs(**extra):
    kw = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        initializer_range=0.2,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )
    kw.update(extra)
    return kw


def greedy(model, prompt):
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 2
    ids = torch.tensor([prompt])
    out = model.generate(ids, max_new_tokens=16, do_sample=False, return_dict_in_generate=True, output_scores=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    margins = []
    for s in out.scores:
        top = torch.topk(s[0].float(), 2).values
        margins.append(float(top[0] - top[1]))
    return tokens, min(margins)


def write(name, model, tok, causal=True, shard=None):
    path = os.path.join(ROOT, name)
    shutil.rmtree(path, ignore_errors=True)
    model.eval()
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(path, **kwargs)
    tok.save_pretrained(path)
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(3, 280, (1, 10), generator=g)
    expected = {"transformers": transformers.__version__, "input_ids": input_ids[0].tolist()}
    with torch.no_grad():
        if causal:
            logits = model(input_ids).logits.float()
            expected["logits"] = [round(x, 7) for x in logits.reshape(-1).tolist()]
            expected["vocab"] = logits.shape[-1]
            prompt = input_ids[0, :6].tolist()
            tokens, margin = greedy(model, prompt)
            expected["greedy"] = {"prompt": prompt, "tokens": tokens}
            print(f"{name}: greedy min top-2 margin {margin:.4f}", file=sys.stderr)
            if margin < 1e-3:
                print(f"warning: {name} has a near-tie in greedy decoding", file=sys.stderr)
        else:
            a = input_ids[0].tolist()
            b = input_ids[0, :6].tolist() + [2] * 4  # right-padded with the pad id
            batch = torch.tensor([a, b])
            mask = torch.tensor([[1] * 10, [1] * 6 + [0] * 4])
            scores = model(batch, attention_mask=mask).logits.float()
            expected["score_batch"] = {"ids": [a, b[:6]], "scores": [round(x, 7) for x in scores[:, 0].tolist()]}
    with open(os.path.join(path, "expected.json"), "w") as f:
        json.dump(expected, f)


def main():
    os.makedirs(ROOT, exist_ok=True)
    tok = make_tokenizer()

    torch.manual_seed(0)
    write("llama_gqa", LlamaForCausalLM(LlamaConfig(**llama_kwargs())), tok)

    torch.manual_seed(0)
    write("llama_sharded", LlamaForCausalLM(LlamaConfig(**llama_kwargs())), tok, shard="20KB")

    torch.manual_seed(1)
    write("llama_tied", LlamaForCausalLM(LlamaConfig(**llama_kwargs(tie_word_embeddings=True))), tok)

    torch.manual_seed(2)
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    write("llama3_rope", LlamaForCausalLM(LlamaConfig(**llama_kwargs(rope_parameters=rope, head_dim=16,
                                                                       num_attention_heads=2,
                                                                       num_key_value_heads=1))), tok)

    torch.manual_seed(3)
    linear = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}
    write("llama_linear_rope", LlamaForCausalLM(LlamaConfig(**llama_kwargs(rope_parameters=linear))), tok)

    torch.manual_seed(4)
    write("qwen2_bias", Qwen2ForCausalLM(Qwen2Config(**llama_kwargs())), tok)

    torch.manual_seed(5)
    write("mistral_window", MistralForCausalLM(MistralConfig(**llama_kwargs(sliding_window=8))), tok)

    torch.manual_seed(6)
    gpt2 = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, initializer_range=0.2,
                      bos_token_id=0, eos_token_id=1, pad_token_id=2)
    write("gpt2", GPT2LMHeadModel(gpt2), tok)

    torch.manual_seed(7)
    rm = LlamaForSequenceClassification(LlamaConfig(**llama_kwargs(num_labels=1)))
    write("llama_rm", rm, tok, causal=False)

    total = 0
    for d, _, files in os.walk(ROOT):
        total += sum(os.path.getsize(os.path.join(d, f)) for f in files)
    print(f"fixtures: {total / 1e6:.2f} MB", file=sys.stderr)


if __name__ == "__main__":
    main()
