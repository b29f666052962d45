"""Loads a model directory saved by Braid with transformers and prints what it computes.

Used by runtime/tests/save_load.rs (test `saved_models_load_in_transformers`), which compares
the output with Braid's. Usage:

    PYTHONPATH=.pydeps .venv/bin/python scripts/check_hf_load.py DIR:lm [DIR:seqcls ...] --ids 1,2,3 --text "hi"

Prints one JSON object per directory, one per line: `logits` (flattened, f32; for `seqcls`
the per-token scores of the one label), and `token_ids` (the tokenizer's ids for --text,
special tokens included). Several directories share one Python start-up, which dominates.
"""

import argparse
import json

import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="+", help="DIR:lm or DIR:seqcls")
    ap.add_argument("--ids", required=True)
    ap.add_argument("--text", default="hello")
    args = ap.parse_args()
    ids = torch.tensor([[int(x) for x in args.ids.split(",")]])
    for spec in args.models:
        path, head = spec.rsplit(":", 1)
        with torch.no_grad():
            if head == "lm":
                model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
                out = model(ids).logits
            else:
                model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32)
                # Per-token scores: the score head applied to every hidden state.
                hidden = model.base_model(ids).last_hidden_state
                out = model.score(hidden)
        tok = AutoTokenizer.from_pretrained(path)
        print(json.dumps({"logits": out.float().reshape(-1).tolist(), "token_ids": tok(args.text)["input_ids"]}))


if __name__ == "__main__":
    main()
