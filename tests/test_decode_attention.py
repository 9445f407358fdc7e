"""The decode-attention kernels (ops/decode_attention.py) against their dense reference.

On CPU they run in Triton's interpreter, which must be switched on before Triton is first imported:
the CPU test runs this file as a script in a fresh process with TRITON_INTERPRET=1
(tests/triton_interpreter.py). On a GPU they run as compiled kernels, in this process.
"""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from triton_interpreter import run_in_interpreter  # noqa: E402

# (rows, queries per row, q heads, kv heads, head_dim, cache slots, width): GQA groups of 1, 2 and 3,
# a head_dim that is not a power of two, widths over several key blocks and chunks, fewer slots than a block.
# One (row, kv head) pair: the most chunks (MAX_SPLITS caps them; 36 here, not a power of two).
# The last: enough (row, kv head) pairs for one chunk per row (no merge kernel).
SHAPES = [(3, 1, 4, 2, 16, 200, 200), (2, 5, 6, 2, 20, 150, 130), (4, 3, 4, 4, 8, 40, 40), (1, 4, 16, 8, 32, 700, 600),
          (1, 2, 2, 1, 16, 5000, 4500), (34, 2, 16, 8, 16, 90, 80)]


def largest_error(device, dtype) -> float:
    from titan_draft.ops.decode_attention import decode_attention, decode_attention_reference

    generator = torch.Generator().manual_seed(0)
    worst = 0.0
    for rows, S, Hq, Hkv, D, slots, width in SHAPES:
        def randn(*shape):
            return torch.randn(*shape, generator=generator, dtype=torch.float64).to(device, dtype)

        q = randn(rows, S, Hq, D)
        k_cache, v_cache = randn(rows + 1, slots, Hkv, D), randn(rows + 1, slots, Hkv, D)  # a cache row too many
        last = torch.randint(0, width - S + 1, (rows,), generator=generator)
        last[0] = 0  # a row whose first query sees slot 0 alone
        positions = (last[:, None] + torch.arange(S)).to(device)  # a window of consecutive positions
        if S > 1:  # and a row whose queries sit at arbitrary positions
            positions[-1] = torch.randint(0, width, (S,), generator=generator).to(device)
        out = decode_attention(q, k_cache, v_cache, positions, D ** -0.5, width)
        ref = decode_attention_reference(q, k_cache, v_cache, positions, D ** -0.5)
        worst = max(worst, float((out.double() - ref.double()).abs().max()))
    return worst


def main():  # the CPU check: run in a fresh process under TRITON_INTERPRET=1
    error = largest_error("cpu", torch.float64)
    assert error < 1e-10, error
    print("ok", error)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU test runs the compiled kernels")
def test_kernels_equal_reference_float64_in_triton_interpreter():
    run_in_interpreter(__file__)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_kernels_equal_reference_on_gpu():
    assert largest_error("cuda", torch.float32) < 1e-5
    assert largest_error("cuda", torch.bfloat16) < 2e-2


if __name__ == "__main__":
    main()
