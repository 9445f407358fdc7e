"""The few-row linear kernel (ops/skinny_linear.py) against F.linear.

On CPU it runs in Triton's interpreter, which must be switched on before Triton is first imported:
the CPU test runs this file as a script in a fresh process with TRITON_INTERPRET=1
(tests/triton_interpreter.py), the kernel alone and in the rollout engine's blocks. On a GPU it runs
compiled, in this process.
"""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from triton_interpreter import run_in_interpreter  # noqa: E402

# (rows, out features, in features): one row, K not a multiple of the K block, N not a multiple of
# the N block on both sides of the 4096 switch, the most rows, strided rows of x.
SHAPES = [(1, 40, 64), (5, 100, 300), (16, 4100, 70), (3, 17, 520), (2, 33, 96)]


def largest_error(device, dtype) -> float:
    from titan_draft.ops.skinny_linear import skinny_linear, skinny_linear_reference

    generator = torch.Generator().manual_seed(0)
    worst = 0.0
    for i, (M, N, K) in enumerate(SHAPES):
        x = torch.randn(M, 2 * K if i == len(SHAPES) - 1 else K, generator=generator, dtype=torch.float64)[:, :K]
        w = torch.randn(N, K, generator=generator, dtype=torch.float64)
        x, w = x.to(device, dtype), w.to(device, dtype)
        out = skinny_linear(x, w)
        assert out.shape == (M, N) and out.dtype == dtype
        worst = max(worst, float((out.double() - skinny_linear_reference(x, w).double()).abs().max()))
    return worst


def engine_with_few_row_kernels_equals_reference_ops() -> int:
    """rollout.few_row_linear: the rollout engine's blocks with the few-row kernels emit the tokens and
    statistics of the same engine on cuBLAS's ops (F.linear): float64 (the sums differ in order
    only), plain sampled, greedy and sampled speculative steps, two calls each (3 rows x up to 4
    positions: every decode and verify step takes the kernels). Returns the kernel calls made."""
    import titan_draft.rollout.cached_model as cached_model
    from test_rollout_engine import engine_for, make, variable_prompts

    calls = 0
    kernel = cached_model.skinny_linear

    def counted(*args):
        nonlocal calls
        calls += 1
        return kernel(*args)

    cached_model.skinny_linear = counted
    policy, draft, _ = make()
    few_row, reference = (engine_for(policy, draft, 4, few_row_linear=on) for on in (True, False))
    assert reference.model._block_shape["few_rows"] == 0
    few_row.model._block_shape["few_rows"] = cached_model.MAX_ROWS  # CUDA's setting (on CPU: the interpreter's)
    for K, temperature in ((0, 1.0), (3, 0.0), (3, 1.0)):
        for call in range(2):
            a, b = (engine.generate(variable_prompts([5, 3, 7], seed=8 + call), 10, num_speculative_tokens=K,
                                    temperature=temperature, eos_id=5, generator=torch.Generator().manual_seed(call))
                    for engine in (few_row, reference))
            assert torch.equal(a.tokens, b.tokens), (K, temperature, call)
            assert (a.num_verify_forwards, a.emitted_tokens) == (b.num_verify_forwards, b.emitted_tokens)
    cached_model.skinny_linear = kernel
    return calls


def main():  # the CPU check: run in a fresh process under TRITON_INTERPRET=1
    error = largest_error("cpu", torch.float64)
    assert error < 1e-10, error
    calls = engine_with_few_row_kernels_equals_reference_ops()
    assert calls > 0
    print("ok", error, calls)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU test runs the compiled kernel")
def test_kernel_equals_reference_float64_in_triton_interpreter():
    run_in_interpreter(__file__)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_kernel_equals_reference_on_gpu():
    assert largest_error("cuda", torch.float32) < 1e-3
    assert largest_error("cuda", torch.bfloat16) < 0.25  # bf16 output rounding of sums of ~500 terms
    assert engine_with_few_row_kernels_equals_reference_ops() > 0


def test_too_many_rows_get_a_clear_error():
    from titan_draft.ops.skinny_linear import MAX_ROWS, skinny_linear

    with pytest.raises(ValueError, match="at most 16"):
        skinny_linear(torch.zeros(MAX_ROWS + 1, 8), torch.zeros(4, 8))


if __name__ == "__main__":
    main()
