"""models/rope.rotate_pairs against torchtitan llama3's apply_rotary_emb, its reference: equal bit for
bit, forward and gradients, and under torch.compile free of the eager kernels that torchtitan's
complex arithmetic leaves in a compiled function."""
import pytest
import torch
from torch.profiler import profile

from torchtitan.models.llama3.model.args import RoPEScalingArgs
from torchtitan.models.llama3.model.model import apply_rotary_emb, precompute_freqs_cis

from titan_draft.models.rope import rotate_pairs

HEAD_DIM, MAX_LEN, ROWS, SEQ = 16, 64, 3, 7


def inputs(dtype, positions_kind, seed=0):
    generator = torch.Generator().manual_seed(seed)
    freqs_cis = precompute_freqs_cis(HEAD_DIM, MAX_LEN, 500000.0, RoPEScalingArgs())  # llama3 scaling
    xq = torch.randn(ROWS, SEQ, 4, HEAD_DIM, generator=generator).to(dtype)
    xk = torch.randn(ROWS, SEQ, 2, HEAD_DIM, generator=generator).to(dtype)
    shape = {"none": None, "shared": (1, SEQ), "per_row": (ROWS, SEQ)}[positions_kind]
    positions = None if shape is None else torch.randint(0, MAX_LEN, shape, generator=generator)
    return xq, xk, freqs_cis, positions


@pytest.mark.parametrize("positions_kind", ["none", "shared", "per_row"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_equals_torchtitan_bit_for_bit(dtype, positions_kind):
    xq, xk, freqs_cis, positions = inputs(dtype, positions_kind)
    ours = rotate_pairs(xq, xk, freqs_cis, positions)
    theirs = apply_rotary_emb(xq, xk, freqs_cis, positions)
    for a, b in zip(ours, theirs):
        assert a.dtype == b.dtype == dtype and torch.equal(a, b)


@pytest.mark.parametrize("positions_kind", ["none", "per_row"])
def test_gradients_equal_torchtitan(positions_kind):
    grads = []
    for rotary in (rotate_pairs, apply_rotary_emb):
        xq, xk, freqs_cis, positions = inputs(torch.float64, positions_kind)
        xq.requires_grad_(), xk.requires_grad_()
        out_q, out_k = rotary(xq, xk, freqs_cis, positions)
        weight = torch.randn(out_q.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        ((out_q * weight).sum() + out_k.square().sum()).backward()
        grads.append((xq.grad, xk.grad))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def eager_ops_of_compiled(rotary) -> set[str]:
    """The aten ops a compiled call of `rotary` runs outside inductor's generated kernels."""
    torch._dynamo.reset()
    xq, xk, freqs_cis, positions = inputs(torch.bfloat16, "per_row")
    compiled = torch.compile(rotary)
    compiled(xq, xk, freqs_cis, positions)
    with profile() as prof:
        compiled(xq, xk, freqs_cis, positions)
    return {event.name for event in prof.events() if event.name.startswith("aten::")}


def test_compiled_call_runs_no_eager_kernel():
    assert eager_ops_of_compiled(rotate_pairs) <= {"aten::view_as_real"}  # a view: no kernel
    # The reference's complex products stay eager ops under torch.compile (the reason for rotate_pairs).
    assert {"aten::mul", "aten::gather"} <= eager_ops_of_compiled(apply_rotary_emb)
