"""The Triton branch kernels (ops/branch_triton.py) against their PyTorch references
(attention_kernels.add_branch_torch / branch_backward_torch).

On CPU they run in Triton's interpreter, which must be switched on before Triton is first
imported (torchtitan imports it with this process): so the CPU test runs this file as a script in
a fresh process with TRITON_INTERPRET=1 (tests/triton_interpreter.py). On a GPU they run as
compiled kernels, in this process.
"""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from triton_interpreter import run_in_interpreter  # noqa: E402

# (tokens, q heads, kv heads, head_dim, passes): query heads per kv head of 1, 2 and 3 (not a
# power of two), head_dim not a power of two, token counts that are not a multiple of a block.
SHAPES = [(13, 4, 2, 8, 1), (37, 6, 2, 20, 3), (5, 4, 4, 8, 2), (70, 3, 1, 16, 5)]


def check_against_reference(device, dtype, out_dtype, tolerance):
    """Largest errors of both kernels over SHAPES, asserting each is within tolerance."""
    from titan_draft.ops import attention_kernels, branch_triton

    generator = torch.Generator().manual_seed(0)
    for tokens, q_heads, kv_heads, head_dim, passes in SHAPES:
        def randn(*shape, dtype=dtype):
            return torch.randn(*shape, generator=generator, dtype=torch.float64).to(device, dtype)

        q, dout = randn(tokens, q_heads, head_dim), randn(tokens, q_heads, head_dim)
        branch_k, branch_v = randn(passes, tokens, kv_heads, head_dim), randn(passes, tokens, kv_heads, head_dim)
        out = randn(tokens, q_heads, head_dim, dtype=out_dtype)
        lse = randn(q_heads, tokens, dtype=torch.promote_types(dtype, torch.float32))
        lse[:, 0] = -float("inf")  # a row that saw no trunk key
        scale = head_dim ** -0.5
        dq = randn(tokens, q_heads, head_dim, dtype=out_dtype)  # the trunk's share, added to
        # Both work in place (out, lse forward; dq backward): each gets its own copies. The
        # kernels' are heads-major (not contiguous) on odd token counts: copied in and dq back.
        def copy(x):
            return x.transpose(0, 1).contiguous().transpose(0, 1) if tokens % 2 else x.clone()

        got_dq, want_dq = copy(dq), dq.clone()
        got = (*branch_triton.add_branch(copy(out), copy(lse), q, branch_k, branch_v, scale),
               *branch_triton.branch_backward(dout, q, branch_k, branch_v, out, lse, scale, got_dq), got_dq)
        want = (*attention_kernels.add_branch_torch(out.clone(), lse.clone(), q, branch_k, branch_v, scale),
                *attention_kernels.branch_backward_torch(dout, q, branch_k, branch_v, out, lse, scale, want_dq),
                want_dq)
        for name, g, w in zip(("out", "lse", "dbranch_k", "dbranch_v", "dq"), got, want):
            assert g.dtype == w.dtype and g.shape == w.shape, name
            error = ((g.double() - w.double()).norm() / w.double().norm()).item()
            assert error < tolerance, (name, (tokens, q_heads, kv_heads, head_dim, passes), error)


def test_interpreted_kernels_match_reference_float64():
    run_in_interpreter(__file__)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_kernels_match_reference():
    check_against_reference("cuda", torch.float64, torch.float64, 1e-12)
    check_against_reference("cuda", torch.float32, torch.float32, 1e-5)
    # bf16 inputs, float32 out as the CP ring merges it: the reference rounds the same inputs.
    check_against_reference("cuda", torch.bfloat16, torch.float32, 1e-2)


if __name__ == "__main__":
    check_against_reference("cpu", torch.float64, torch.float64, 1e-12)
    check_against_reference("cpu", torch.float32, torch.float32, 1e-5)
    print("ok: the branch kernels match")
