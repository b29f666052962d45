"""Makes runtime/tests/fixtures/gguf/blocks.gguf: for every tensor type Braid dequantises, a
tensor `q.TYPE` of 2 x 512 values and beside it `expected.TYPE`, the same values dequantised
to f32 by gguf-py (the reference implementation that ships with llama.cpp). Types gguf-py can
quantise are quantised from random normals; for the K-quants (which it only dequantises) the
blocks are random bytes with finite f16 scales. The Rust test
`runtime/tests/gguf.rs::dequantised_blocks_match_gguf_py` compares Braid's dequantisation with
the expected tensors. Regenerate with:

    scripts/setup_models && .venv/bin/python scripts/make_gguf_fixtures.py
"""

import os

import numpy as np
import gguf
from gguf import GGMLQuantizationType as T
from gguf import quants

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "runtime", "tests", "fixtures", "gguf", "blocks.gguf")
ROWS, COLS = 2, 512
# Byte offsets of each K-quant block's f16 scales (d, and dmin where there is one).
K_SCALES = {T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}


def main():
    rng = np.random.default_rng(18)
    w = gguf.GGUFWriter(OUT, "llama")
    for ty in [T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0]:
        x = rng.standard_normal((ROWS, COLS)).astype(np.float32)
        q = x if ty == T.F32 else quants.quantize(x, ty)
        add(w, ty, q)
    for ty, offsets in K_SCALES.items():
        per_block, block_bytes = gguf.GGML_QUANT_SIZES[ty]
        blocks = rng.integers(0, 256, size=(ROWS * COLS // per_block, block_bytes), dtype=np.uint8)
        for off in offsets:
            scales = (rng.uniform(0.01, 0.1, size=blocks.shape[0]) * rng.choice([-1, 1], blocks.shape[0])).astype(np.float16)
            blocks[:, off:off + 2] = scales.view(np.uint8).reshape(-1, 2)
        add(w, ty, blocks.reshape(ROWS, -1))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def add(w, ty, data):
    w.add_tensor(f"q.{ty.name}", data, raw_dtype=ty)
    expected = quants.dequantize(data, ty).astype(np.float32).reshape(ROWS, COLS)
    w.add_tensor(f"expected.{ty.name}", expected, raw_dtype=T.F32)


if __name__ == "__main__":
    main()
