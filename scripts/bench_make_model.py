"""Makes the benchmark model of scripts/bench_generate.sh: a random Llama with hidden 256,
4 layers, 4 heads, intermediate 1024 and a 1,000-token vocabulary, saved with transformers
into the directory given as the first argument (with the fixtures' byte-level BPE tokenizer,
whose 300 ids fit the vocabulary).

    PYTHONPATH=.pydeps .venv/bin/python scripts/bench_make_model.py /tmp/braid-bench-model
"""

import os
import shutil
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def main():
    out = sys.argv[1]
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=1000,
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=512,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )
    LlamaForCausalLM(config).save_pretrained(out)
    fixture = os.path.join(ROOT, "runtime", "tests", "fixtures", "llama_gqa")
    for name in ["tokenizer.json", "tokenizer_config.json"]:
        shutil.copy(os.path.join(fixture, name), os.path.join(out, name))


if __name__ == "__main__":
    main()
