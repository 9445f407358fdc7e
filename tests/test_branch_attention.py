"""branch_attention and its block primitives against dense, obviously-correct references."""
import importlib
import math

import pytest
import torch

from titan_draft.ops import (
    Varlen,
    attn_backward,
    attn_forward,
    available_backends,
    branch_attention,
    branch_attention_reference,
    branch_forward,
    merge_attn,
)

# The package re-exports functions under the modules' names: fetch the modules themselves.
kernels_module = importlib.import_module("titan_draft.ops.attention_kernels")
F64 = torch.float64


def packed_boundaries(lengths, device="cpu"):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                        device=device)


def random_odd_lengths(total_docs, generator):
    """Odd document lengths 1..9, always including a document of length 1."""
    lengths = (torch.randint(0, 5, (total_docs,), generator=generator) * 2 + 1).tolist()
    lengths[0] = 1
    return lengths


def branch_inputs(tokens, q_heads, kv_heads, passes, head_dim=8, dtype=F64, device="cpu"):
    def leaf(*shape):
        return torch.randn(*shape, dtype=F64, device=device).to(dtype).requires_grad_()

    return (leaf(tokens, q_heads, head_dim), leaf(tokens, kv_heads, head_dim),
            leaf(tokens, kv_heads, head_dim), leaf(passes, tokens, kv_heads, head_dim),
            leaf(passes, tokens, kv_heads, head_dim))


def grads(outputs, inputs, grad_out):
    return torch.autograd.grad(outputs, inputs, grad_out)


def relative_error(actual, expected):
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()


# ---------------------------------------------------------------------------------------------
# branch_attention vs the dense reference
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("q_heads,kv_heads", [(4, 2), (3, 3)])
@pytest.mark.parametrize("passes", range(7))
def test_branch_attention_matches_reference_float64(passes, q_heads, kv_heads):
    torch.manual_seed(passes)
    generator = torch.Generator().manual_seed(10 + passes)
    lengths = random_odd_lengths(5, generator)
    cu = packed_boundaries(lengths)
    assert_matches_reference_float64(branch_inputs(sum(lengths), q_heads, kv_heads, passes), cu)


def assert_matches_reference_float64(inputs, cu):
    """branch_attention equals the dense reference: out and lse to 1e-12, every input's gradient to 1e-10."""
    out, lse = branch_attention(*inputs, cu_seqlens=cu)
    out_ref, lse_ref = branch_attention_reference(*inputs, cu_seqlens=cu)
    torch.testing.assert_close(out, out_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, lse_ref.detach(), rtol=1e-12, atol=1e-12)

    grad_out = torch.randn_like(out)
    for got, want in zip(grads(out, inputs, grad_out), grads(out_ref, inputs, grad_out)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("batch_elements", [1, 300, kernels_module.MATH_BATCH_ELEMENTS])
def test_math_backend_batches_equal_length_documents_exactly(monkeypatch, batch_elements):
    """The math path runs documents of one length as a batch (capped at MATH_BATCH_ELEMENTS scores:
    1 = one document at a time, 300 = a few per batch); every cap gives the dense reference."""
    monkeypatch.setattr(kernels_module, "MATH_BATCH_ELEMENTS", batch_elements)
    torch.manual_seed(5)
    lengths = [3, 5, 3, 1, 3, 5, 1, 7, 3]
    assert_matches_reference_float64(branch_inputs(sum(lengths), 4, 2, 2), packed_boundaries(lengths))


def test_host_bounds_copies_each_boundaries_tensor_once():
    """Every layer passes the same cu_seqlens: its values are read from the device once, and read
    again after an in-place change."""
    cu_seqlens = torch.tensor([0, 3, 7], dtype=torch.int32)
    first = kernels_module.host_bounds(cu_seqlens)
    assert first == (0, 3, 7) and kernels_module.host_bounds(cu_seqlens) is first
    cu_seqlens[1] = 4
    assert kernels_module.host_bounds(cu_seqlens) == (0, 4, 7)
    with torch.inference_mode():
        inference = torch.tensor([0, 2, 7], dtype=torch.int32)
        assert kernels_module.host_bounds(inference) == (0, 2, 7)
        inference[1] = 5
        assert kernels_module.host_bounds(inference) == (0, 5, 7)


def test_one_document_when_cu_seqlens_is_none():
    torch.manual_seed(0)
    inputs = branch_inputs(11, 4, 2, 2)
    out, lse = branch_attention(*inputs)
    out_ref, lse_ref = branch_attention_reference(*inputs)
    torch.testing.assert_close(out, out_ref)
    torch.testing.assert_close(lse, lse_ref.detach())
    grad_out = torch.randn_like(out)
    for got, want in zip(grads(out, inputs, grad_out), grads(out_ref, inputs, grad_out)):
        torch.testing.assert_close(got, want)


def test_without_branch_is_plain_causal_attention():
    torch.manual_seed(1)
    q, k, v, _, _ = branch_inputs(9, 2, 1, 0)
    cu = packed_boundaries([4, 5])
    out, lse = branch_attention(q, k, v, cu_seqlens=cu)
    # Row 0 of each document sees only its own key: out = v there, lse = scale * <q, k>.
    for row in (0, 4):
        torch.testing.assert_close(out[row], v[row].expand(2, -1))
        own_score = (q[row] * k[row]).sum(-1) / math.sqrt(8)
        torch.testing.assert_close(lse[:, row], own_score)
    out_ref, _ = branch_attention_reference(q, k, v, cu_seqlens=cu)
    torch.testing.assert_close(out, out_ref)


def test_branch_chunks_give_the_same_result(monkeypatch):
    torch.manual_seed(2)
    inputs = branch_inputs(23, 4, 2, 3)
    cu = packed_boundaries([1, 9, 13])
    grad_out = torch.randn(23, 4, 8, dtype=F64)
    out_whole, _ = branch_attention(*inputs, cu_seqlens=cu)
    grads_whole = grads(out_whole, inputs, grad_out)
    monkeypatch.setattr(kernels_module, "ROWS_PER_CHUNK", 5)
    out_chunked, _ = branch_attention(*inputs, cu_seqlens=cu)
    torch.testing.assert_close(out_chunked, out_whole)
    for got, want in zip(grads(out_chunked, inputs, grad_out), grads_whole):
        torch.testing.assert_close(got, want)


def test_lse_is_not_differentiable():
    inputs = branch_inputs(5, 2, 2, 1)
    out, lse = branch_attention(*inputs)
    assert out.requires_grad and not lse.requires_grad


@pytest.mark.parametrize("dtype,out_tol,grad_tol", [(torch.float32, 1e-5, 1e-5),
                                                    (torch.bfloat16, 1e-2, 1e-2)])
def test_low_precision_close_to_float64_reference(dtype, out_tol, grad_tol):
    """Tolerances: relative norm error; bf16 inputs/outputs carry ~3 significant digits."""
    torch.manual_seed(3)
    cu = packed_boundaries([1, 17, 30, 16])
    exact = branch_inputs(64, 4, 2, 3)
    low = [x.detach().to(dtype).requires_grad_() for x in exact]
    exact = [x.detach().to(dtype).to(F64).requires_grad_() for x in low]  # same rounded values

    out, lse = branch_attention(*low, cu_seqlens=cu)
    out_ref, lse_ref = branch_attention_reference(*exact, cu_seqlens=cu)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert relative_error(out, out_ref) < out_tol
    assert relative_error(lse, lse_ref) < 1e-6

    grad_out = torch.randn(out.shape, dtype=F64)
    got = grads(out, low, grad_out.to(dtype))
    want = grads(out_ref, exact, grad_out)
    for name, g, w in zip(["q", "k", "v", "branch_k", "branch_v"], got, want):
        assert g.dtype == dtype
        assert relative_error(g, w) < grad_tol, name


def test_autocast_leaves_branch_attention_unchanged():
    """Under autocast (the training forwards on GPU) the op computes exactly as outside it: its
    float32 softmax arithmetic must not be downcast, or the backward's recomputed probabilities
    would not match the forward's lse."""
    torch.manual_seed(4)
    cu = packed_boundaries([1, 17, 30, 16])
    inputs = [x.detach().to(torch.bfloat16).requires_grad_() for x in branch_inputs(64, 4, 2, 3)]
    grad_out = torch.randn(64, 4, 8, dtype=torch.bfloat16)
    plain = branch_attention(*inputs, cu_seqlens=cu)
    plain_grads = grads(plain[0], inputs, grad_out)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast = branch_attention(*inputs, cu_seqlens=cu)
    for got, want in zip([*autocast, *grads(autocast[0], inputs, grad_out)], [*plain, *plain_grads]):
        assert torch.equal(got, want)


def test_error_messages():
    q, k, v, bk, bv = branch_inputs(6, 4, 2, 2)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        branch_attention(q[:, :3], k, v)
    with pytest.raises(ValueError, match=r"branch_k and branch_v must both be \[P, T, Hkv, Dh\]"):
        branch_attention(q, k, v, bk[:, :5], bv[:, :5])
    with pytest.raises(ValueError, match="both branch_k and branch_v"):
        branch_attention(q, k, v, bk, None)
    with pytest.raises(ValueError, match="k and v must both be"):
        branch_attention(q, k[:5], v[:5])
    with pytest.raises(ValueError, match="from 0 to T = 6"):
        branch_attention(q, k, v, cu_seqlens=packed_boundaries([2, 3]))
    with pytest.raises(ValueError, match="int32"):
        branch_attention(q, k, v, cu_seqlens=torch.tensor([0, 6]))


# ---------------------------------------------------------------------------------------------
# Block primitives
# ---------------------------------------------------------------------------------------------


def dense_block_attention(q, k, v, cu_q, cu_k, causal, scale):
    """Masked dense attention with autograd; rows with no key give out = 0, lse = -inf."""
    doc_q = torch.repeat_interleave(torch.arange(len(cu_q) - 1), (cu_q[1:] - cu_q[:-1]).long())
    doc_k = torch.repeat_interleave(torch.arange(len(cu_k) - 1), (cu_k[1:] - cu_k[:-1]).long())
    visible = doc_q[:, None] == doc_k[None, :]
    if causal:
        pos_q = torch.arange(len(doc_q)) - cu_q[doc_q]
        pos_k = torch.arange(len(doc_k)) - cu_k[doc_k]
        visible &= pos_k[None, :] <= pos_q[:, None]
    has_key = visible.any(1)
    groups = q.shape[1] // k.shape[1]
    keys, values = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = torch.einsum("qhd,khd->hqk", q, keys) * scale
    # Key-less rows softmax over everything (finite) and are then zeroed: no NaN in autograd.
    scores = scores.masked_fill(~(visible | ~has_key[:, None]), -math.inf)
    out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values) * has_key[:, None, None]
    lse = torch.logsumexp(scores, -1).masked_fill(~has_key, -math.inf)
    return out, lse.detach()


def block_inputs(tokens_q, tokens_k, q_heads=4, kv_heads=2, head_dim=8):
    q = torch.randn(tokens_q, q_heads, head_dim, dtype=F64, requires_grad=True)
    k = torch.randn(tokens_k, kv_heads, head_dim, dtype=F64, requires_grad=True)
    v = torch.randn(tokens_k, kv_heads, head_dim, dtype=F64, requires_grad=True)
    return q, k, v


@pytest.mark.parametrize("causal", [True, False])
def test_attn_forward_backward_match_dense(causal):
    torch.manual_seed(4)
    lengths_q = [3, 1, 0, 7, 4]
    lengths_k = lengths_q if causal else [5, 0, 2, 7, 1]  # empty key range for document 1
    cu_q, cu_k = packed_boundaries(lengths_q), packed_boundaries(lengths_k)
    q, k, v = block_inputs(sum(lengths_q), sum(lengths_k))
    scale = 0.3
    args = (Varlen(cu_q, cu_k, max(lengths_q), max(lengths_k), causal), scale)

    out, lse = attn_forward(q, k, v, *args)
    out_ref, lse_ref = dense_block_attention(q, k, v, cu_q, cu_k, causal, scale)
    torch.testing.assert_close(out, out_ref)
    torch.testing.assert_close(lse, lse_ref)
    if not causal:
        keyless_row = 3  # the single query of document 1
        assert lse[:, keyless_row].eq(-math.inf).all() and out[keyless_row].eq(0).all()

    grad_out = torch.randn_like(out)
    got = attn_backward(grad_out, q, k, v, out, lse, *args)
    want = grads(out_ref, (q, k, v), grad_out)
    for g, w in zip(got, want):
        assert not g.isnan().any()
        torch.testing.assert_close(g, w)


def test_backward_with_merged_out_lse_is_exact_over_key_blocks():
    """Two key blocks merged with merge_attn equal one attention over their union, and each
    block's backward fed the merged out/lse gives that block's share of the exact gradient."""
    torch.manual_seed(5)
    lengths_q = [4, 6, 1]
    lengths_a, lengths_b = [2, 0, 3], [5, 4, 0]
    cu_q, cu_a, cu_b = map(packed_boundaries, (lengths_q, lengths_a, lengths_b))
    q, k_a, v_a = block_inputs(sum(lengths_q), sum(lengths_a))
    _, k_b, v_b = block_inputs(sum(lengths_q), sum(lengths_b))
    scale = 0.5

    # The union, document by document: keys of block a, then of block b.
    def union(x_a, x_b):
        parts = []
        for n in range(len(lengths_q)):
            parts += [x_a[cu_a[n]:cu_a[n + 1]], x_b[cu_b[n]:cu_b[n + 1]]]
        return torch.cat(parts)

    cu_union = packed_boundaries([a + b for a, b in zip(lengths_a, lengths_b)])
    out_ref, lse_ref = dense_block_attention(q, union(k_a, k_b), union(v_a, v_b), cu_q,
                                             cu_union, False, scale)

    varlen_a, varlen_b = Varlen(cu_q, cu_a, 6, 3, False), Varlen(cu_q, cu_b, 6, 5, False)
    out_a, lse_a = attn_forward(q, k_a, v_a, varlen_a, scale)
    out_b, lse_b = attn_forward(q, k_b, v_b, varlen_b, scale)
    out, lse = merge_attn(out_a, lse_a, out_b, lse_b)
    torch.testing.assert_close(out, out_ref)
    torch.testing.assert_close(lse, lse_ref)

    grad_out = torch.randn_like(out)
    dq_a, dk_a, dv_a = attn_backward(grad_out, q, k_a, v_a, out, lse, varlen_a, scale)
    dq_b, dk_b, dv_b = attn_backward(grad_out, q, k_b, v_b, out, lse, varlen_b, scale)
    want = grads(out_ref, (q, k_a, k_b, v_a, v_b), grad_out)
    torch.testing.assert_close(dq_a + dq_b, want[0])
    torch.testing.assert_close(dk_a, want[1])
    torch.testing.assert_close(dk_b, want[2])
    torch.testing.assert_close(dv_a, want[3])
    torch.testing.assert_close(dv_b, want[4])


def test_merge_attn_handles_empty_sides():
    out = torch.randn(3, 2, 4)
    lse = torch.tensor([[0.5, -math.inf, 2.0], [1.0, -math.inf, -math.inf]])
    nothing_out, nothing_lse = torch.zeros(3, 2, 4), torch.full((2, 3), -math.inf)
    merged_out, merged_lse = merge_attn(out, lse, nothing_out, nothing_lse)
    assert not merged_out.isnan().any()
    torch.testing.assert_close(merged_lse, lse)
    keyed = lse.T.isfinite()
    torch.testing.assert_close(merged_out[keyed], out[keyed])
    assert merged_out[~keyed].eq(0).all()
    swapped_out, swapped_lse = merge_attn(nothing_out, nothing_lse, out, lse)
    torch.testing.assert_close(swapped_out, merged_out)
    torch.testing.assert_close(swapped_lse, merged_lse)


def test_branch_forward_without_passes_sees_nothing():
    q = torch.randn(5, 4, 8)
    out, lse = branch_forward(q, torch.empty(0, 5, 2, 8), torch.empty(0, 5, 2, 8), 0.3)
    assert out.eq(0).all() and lse.eq(-math.inf).all() and lse.shape == (4, 5)


def test_backend_selection(monkeypatch):
    assert available_backends()[-1] == "math"
    q, k, v = block_inputs(4, 4)
    varlen = Varlen.packed_causal(packed_boundaries([4]), 4)
    monkeypatch.setenv("TITAN_DRAFT_ATTN_BACKEND", "nonsense")
    with pytest.raises(ValueError, match="expected auto or one of"):
        attn_forward(q, k, v, varlen, 1.0)
    if "torch_varlen" not in available_backends():
        monkeypatch.setenv("TITAN_DRAFT_ATTN_BACKEND", "torch_varlen")
        with pytest.raises(ValueError, match="can run here"):
            attn_forward(q, k, v, varlen, 1.0)
    monkeypatch.setenv("TITAN_DRAFT_ATTN_BACKEND", "math")
    out, _ = attn_forward(q, k, v, varlen, 1.0)
    torch.testing.assert_close(out[0], v[0].repeat_interleave(2, 0))


# ---------------------------------------------------------------------------------------------
# CUDA: every available kernel backend against the math path, bf16 (run on the GPU machine)
# ---------------------------------------------------------------------------------------------

CUDA_BACKENDS = [b for b in available_backends() if b != "math"]
# (backend, CUDNN_MIN_DOCUMENT): cudnn also with every document through cuDNN, not only the long ones.
CUDA_CASES = [(b, None) for b in CUDA_BACKENDS] + [("cudnn", 1)] * ("cudnn" in CUDA_BACKENDS)


def run_with_backend(monkeypatch, backend, function, *args):
    monkeypatch.setenv("TITAN_DRAFT_ATTN_BACKEND", backend)
    return function(*args)


def use_cudnn_min_document(monkeypatch, min_document):
    if min_document is not None:
        monkeypatch.setattr(kernels_module, "CUDNN_MIN_DOCUMENT", min_document)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend,min_document", CUDA_CASES)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_cuda_block_primitives_match_math(monkeypatch, backend, min_document, causal, head_dim):
    use_cudnn_min_document(monkeypatch, min_document)
    torch.manual_seed(6)
    lengths_q = [1, 300, 0, 777, 129, 1100, 1024, 1024]
    lengths_k = lengths_q if causal else [64, 0, 5, 900, 129, 1100, 2048, 1024]
    cu_q, cu_k = packed_boundaries(lengths_q, "cuda"), packed_boundaries(lengths_k, "cuda")
    q = torch.randn(sum(lengths_q), 8, head_dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(sum(lengths_k), 2, head_dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    grad_out = torch.randn_like(q)
    args = (Varlen(cu_q, cu_k, max(lengths_q), max(lengths_k), causal), head_dim ** -0.5)

    results = {}
    for name in (backend, "math"):
        out, lse = run_with_backend(monkeypatch, name, attn_forward, q, k, v, *args)
        # Backward with a float32 out/lse, as the ring passes its merged accumulators.
        dq, dk, dv = run_with_backend(monkeypatch, name, attn_backward, grad_out, q, k, v,
                                      out.float(), lse, *args)
        results[name] = (out, lse, dq, dk, dv)
    for got, want in zip(results[backend], results["math"]):
        assert got.shape == want.shape and got.dtype == want.dtype
        assert not got.isnan().any()
    out, lse = results[backend][:2]
    assert (lse.isinf() == results["math"][1].isinf()).all()
    finite = lse.isfinite()
    torch.testing.assert_close(lse[finite], results["math"][1][finite], atol=1e-3, rtol=1e-3)
    for got, want in zip(results[backend][2:] + (out,), results["math"][2:] + (results["math"][0],)):
        assert relative_error(got, want) < 2e-2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend,min_document", CUDA_CASES)
@pytest.mark.parametrize("lengths", [[1, 511, 1000, 536], [2048], [1024, 1024], [1500, 548]])
def test_cuda_branch_attention_matches_math(monkeypatch, backend, min_document, lengths):
    use_cudnn_min_document(monkeypatch, min_document)
    torch.manual_seed(7)
    cu = packed_boundaries(lengths, "cuda")
    inputs = [x.detach().cuda().requires_grad_()
              for x in branch_inputs(2048, 32, 8, 3, head_dim=128, dtype=torch.bfloat16)]
    grad_out = torch.randn(2048, 32, 128, device="cuda", dtype=torch.bfloat16)
    results = {}
    for name in (backend, "math"):
        monkeypatch.setenv("TITAN_DRAFT_ATTN_BACKEND", name)
        out, lse = branch_attention(*inputs, cu_seqlens=cu)
        results[name] = (out, lse, *grads(out, inputs, grad_out))
    for got, want in zip(results[backend], results["math"]):
        assert relative_error(got, want) < 2e-2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("passes", [1, 2, 5])
def test_cuda_triton_branch_matches_reference_float64(passes):
    """On a GPU the branch and its merge run as Triton kernels (ops/branch_triton.py) and the trunk
    on the math backend (float64): still the dense reference, GQA, odd packed documents."""
    torch.manual_seed(passes)
    lengths = random_odd_lengths(5, torch.Generator().manual_seed(10 + passes))
    assert_matches_reference_float64(branch_inputs(sum(lengths), 4, 2, passes, device="cuda"),
                                     packed_boundaries(lengths, "cuda"))


# ---------------------------------------------------------------------------------------------
# cudnn backend's document batching (ops/cudnn_attention.py), on CPU: cuDNN's two batch calls
# replaced by dense float64 ones, everything around them (buckets, padding, views, gathers,
# scatters, the short documents' other kernel) as on the GPU.
# ---------------------------------------------------------------------------------------------

cudnn_module = importlib.import_module("titan_draft.ops.cudnn_attention")


def dense_batch_scores(q, k, causal, scale):
    keys = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
    scores = q @ keys.transpose(-1, -2) * scale  # [B, Hq, Lq, Lk]
    if causal:
        future = torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1)
        scores = scores.masked_fill(future, -math.inf)
    return scores


def dense_batch_forward(q, k, v, *, causal, scale):
    scores = dense_batch_scores(q, k, causal, scale)
    values = v.repeat_interleave(q.shape[1] // v.shape[1], 1)
    return scores.softmax(-1) @ values, torch.logsumexp(scores, -1, keepdim=True)


def dense_batch_backward(dout, q, k, v, out, lse, *, causal, scale):
    """Gradients from the GIVEN out/lse, as cuDNN's backward computes them (lse = +inf: p = 0)."""
    groups = q.shape[1] // k.shape[1]
    probs = torch.exp(dense_batch_scores(q, k, causal, scale) - lse)
    values = v.repeat_interleave(groups, 1)
    dscores = probs * (dout @ values.transpose(-1, -2) - (dout * out).sum(-1, keepdim=True)) * scale
    keys = k.repeat_interleave(groups, 1)

    def per_kv_head(x):
        return x.unflatten(1, (k.shape[1], groups)).sum(2)

    return (dscores @ keys, per_kv_head(dscores.transpose(-1, -2) @ q),
            per_kv_head(probs.transpose(-1, -2) @ dout))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("min_document", [1, 18])
@pytest.mark.parametrize("max_batch_share", [1, 8])
def test_cudnn_document_batches_match_dense(monkeypatch, causal, min_document, max_batch_share):
    """Padded buckets (17 -> 18, 33 -> 36 rows), a view of consecutive equal documents (16, 16),
    empty documents, with min_document 18 the short ones through another backend, and batches
    of every document of a shape (share 1) or of one document each (share 8: at most 118 // 8
    rows): forward, lse and gradients (fed the final out/lse) equal the dense attention in float64,
    whether results start as zeros (rows without keys or queries) or uninitialized (NaN here)."""
    monkeypatch.setattr(cudnn_module, "batch_forward", dense_batch_forward)
    monkeypatch.setattr(cudnn_module, "batch_backward", dense_batch_backward)
    monkeypatch.setattr(kernels_module, "CUDNN_MIN_DOCUMENT", min_document)
    monkeypatch.setattr(kernels_module, "CUDNN_MAX_BATCH_SHARE", max_batch_share)
    monkeypatch.setattr(kernels_module, "CUDNN_BATCH_FLOOR_BYTES", 0)
    # Results that start uninitialized start as NaN here: a row no kernel wrote would show.
    monkeypatch.setattr(cudnn_module, "uninitialized",
                        lambda shape, **kwargs: torch.full(shape, math.nan, **kwargs))
    # The short documents' kernel: FlashAttention-2 on a GPU, played here by the math backend.
    monkeypatch.setattr(kernels_module, "_flash_backend", lambda q: "torch_varlen")
    monkeypatch.setitem(kernels_module._FORWARD, "torch_varlen", kernels_module._math_forward)
    monkeypatch.setitem(kernels_module._BACKWARD, "torch_varlen", kernels_module._math_backward)
    torch.manual_seed(8)
    lengths_q = [16, 16, 17, 0, 33, 3, 17, 16]
    lengths_k = lengths_q if causal else [16, 16, 20, 4, 33, 0, 20, 9]
    cu_q, cu_k = packed_boundaries(lengths_q), packed_boundaries(lengths_k)
    q, k, v = block_inputs(sum(lengths_q), sum(lengths_k))
    varlen = Varlen(cu_q, cu_k, max(lengths_q), max(lengths_k), causal)
    assert cudnn_module.length_bucket(17) == 18 and cudnn_module.length_bucket(33) == 36

    split = kernels_module._split_for_cudnn(q, k, varlen)
    # Share 1: one batch per shape. Share 8: one per document, the 3-row one aside (14 // 3 > 1).
    groups = {(True, 1): (4, 7), (False, 1): (4, 6), (True, 18): (1, 1), (False, 18): (1, 1)}
    assert len(split.layout.groups) == groups[causal, min_document][max_batch_share == 8]
    assert (split.short_varlen is None) == (min_document == 1)
    # Causal: every row is some kernel's. Full: 3 queries without keys, 4 keys without queries.
    assert split.layout.rest_written == ((True, True) if causal else (False, False))
    out, lse = kernels_module._cudnn_forward(q, k, v, varlen, 0.3)
    out_ref, lse_ref = dense_block_attention(q, k, v, cu_q, cu_k, causal, 0.3)
    torch.testing.assert_close(out, out_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, lse_ref, rtol=1e-12, atol=1e-12)
    grad_out = torch.randn_like(out)
    got = kernels_module._cudnn_backward(grad_out, q, k, v, out, lse, varlen, 0.3)
    for g, w in zip(got, grads(out_ref, (q, k, v), grad_out)):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)
