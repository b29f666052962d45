"""What transformers computes on a GGUF file, for Braid's parity test (runtime/tests/gguf.rs).

    .venv/bin/python scripts/gguf_reference.py MODEL.gguf OUT_DIR

transformers dequantises the file to f32 (`from_pretrained(dir, gguf_file=name)`), and for each
chat prompt this writes to OUT_DIR/reference.json the prompt's token ids (the chat template with
a generation prompt, tokenised) and 32 greedily generated tokens (end-of-sequence ignored, so
every prompt yields 32), and to OUT_DIR/logits.f32 the logits (little-endian f32, [prompts, 2,
vocab]) of one forward pass over prompt + generation at two positions: the last prompt token and
the last generated token. The Rust test compares Braid on the same file against these numbers.
"""

import json
import os
import sys

import torch
from transformers import AutoTokenizer, LlamaForCausalLM

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Tom has 3 apples and buys 5 more. How many apples does he have?",
    "Explain in one sentence what a compiler does.",
    "List three primary colors.",
]
NEW_TOKENS = 32


def main():
    path, out = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    torch.set_num_threads(1)
    d, name = os.path.split(os.path.abspath(path))
    tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    model = LlamaForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32)
    model.eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = tok.pad_token_id
    cases = []
    rows = []
    with torch.no_grad():
        for p in PROMPTS:
            text = tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
            ids = tok(text, add_special_tokens=False)["input_ids"]
            # An explicit mask: generate() would otherwise mask every pad token of the input, and
            # SmolLM2's pad token is <|im_end|>, which its chat template puts in every prompt.
            x = torch.tensor([ids])
            gen = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS, do_sample=False)
            new = gen[0, len(ids):].tolist()
            assert len(new) == NEW_TOKENS
            logits = model(gen).logits[0]
            rows.append(logits[[len(ids) - 1, len(ids) + NEW_TOKENS - 1]].float())
            cases.append({"prompt": p, "text": text, "prompt_ids": ids, "greedy": new,
                          "completion": tok.decode(new, skip_special_tokens=False)})
    os.makedirs(out, exist_ok=True)
    torch.stack(rows).numpy().astype("<f4").tofile(os.path.join(out, "logits.f32"))
    with open(os.path.join(out, "reference.json"), "w") as f:
        json.dump({"vocab": model.config.vocab_size, "cases": cases}, f, indent=1)


if __name__ == "__main__":
    main()
