"""Block-level attention primitives over packed documents, with backend dispatch.

Conventions shared by every function here:
- Packed layout: q [Tq, Hq, D], k/v [Tk, Hkv, D]; documents are given by a `Varlen`: int32
  cumulative boundaries cu_q / cu_k of the same length N+1, the longest query / key document,
  and whether the mask is causal. Query head h reads key/value head h // (Hq // Hkv)
  (grouped-query attention, as in FlashAttention and SDPA).
- lse is the natural-log softmax normaliser, [Hq, Tq]. It is float32, or float64 when the
  inputs are float64 (so that float64 tests stay exact). Rows that see no key have out = 0 and
  lse = -inf.
- Backward functions take the FINAL out/lse of a larger attention (several blocks merged with
  merge_attn): that is what makes per-block gradients exact (DESIGN.md section 3).
- Gradients come back in the dtype of the tensor they belong to (dq in q's dtype, dk/dv in
  k's dtype). A caller that sums dk/dv over many blocks (the ring) should accumulate in float32
  itself: upcast each block's result, or pass float32 k/v to the math backend.

Backends for attn_forward / attn_backward, chosen by TITAN_DRAFT_ATTN_BACKEND
(auto | cudnn | flash_attn | torch_varlen | math; read at every call):
- cudnn:        cuDNN's fused attention (ops/cudnn_attention.py), documents batched by length;
                auto picks it on Hopper and newer (compute capability >= 9), where it measured
                1.65-1.7x FlashAttention-2 (H200). Documents shorter than CUDNN_MIN_DOCUMENT
                rows go to FlashAttention-2 in one varlen call (no per-shape cuDNN plans for
                them; bench/branch_attention.py measured the two). A cuDNN batch holds at most
                1/CUDNN_MAX_BATCH_SHARE of the block's query rows, or one document, or rows whose
                dQ takes CUDNN_BATCH_FLOOR_BYTES, whichever is most: its backward keeps a float32
                dQ accumulator of every row it holds (one call per document holds one
                document's), while small documents need batching to keep the GPU busy.
- flash_attn:   the flash-attn package's varlen kernels (CUDA, fp16/bf16).
- torch_varlen: PyTorch's own FlashAttention-2 varlen kernels, the aten ops that
                torch.nn.attention.varlen.varlen_attn wraps (CUDA, fp16/bf16).
- math:         plain PyTorch, documents of equal length batched, softmax in float32 (or
                float64); any device and dtype. Memory O(longest document ** 2) per head, and
                batches of documents capped at MATH_BATCH_ELEMENTS scores.
auto picks the first of these that can run the given tensors.
"""
import contextlib
import functools
import importlib.util
import inspect
import math
import os
import warnings
import weakref
from typing import NamedTuple

import torch

import titan_draft.ops.cudnn_attention as cudnn_attention

BACKENDS = ("cudnn", "flash_attn", "torch_varlen", "math")
CUDNN_MIN_DOCUMENT = 1024
CUDNN_MAX_BATCH_SHARE = 8
CUDNN_BATCH_FLOOR_BYTES = 64 << 20
_BACKEND_ENV = "TITAN_DRAFT_ATTN_BACKEND"
_FLASH_DTYPES = (torch.float16, torch.bfloat16)
_INF = math.inf


@functools.cache
def available_backends() -> tuple[str, ...]:
    """Backends that can run in this process (on suitable tensors), best first."""
    names = []
    if torch.cuda.is_available():
        if torch.backends.cudnn.is_available() and torch.cuda.get_device_capability()[0] >= 9:
            names.append("cudnn")
        if _flash_attn_module() is not None:
            names.append("flash_attn")
        if torch.backends.cuda.is_flash_attention_available():
            names.append("torch_varlen")
    names.append("math")
    return tuple(names)


def _flash_attn_module():
    try:
        import flash_attn.flash_attn_interface as interface
    except ImportError:
        return None
    return interface


def _largest_head_dim(backend: str) -> int:
    return 128 if backend == "cudnn" else 256


def _fits(backend: str, q: torch.Tensor) -> bool:
    head_dim = q.shape[-1]
    return backend == "math" or (q.is_cuda and q.dtype in _FLASH_DTYPES and head_dim % 8 == 0
                                 and head_dim <= _largest_head_dim(backend))


def _select_backend(q: torch.Tensor) -> str:
    requested = os.environ.get(_BACKEND_ENV, "auto")
    if requested not in ("auto", *BACKENDS):
        raise ValueError(f"{_BACKEND_ENV}={requested!r}: expected auto or one of {BACKENDS}")
    available = available_backends()
    if requested == "auto":
        return next(b for b in available if _fits(b, q))
    if requested not in available:
        raise ValueError(f"{_BACKEND_ENV}={requested}, but only {available} can run here")
    if not _fits(requested, q):
        raise ValueError(
            f"backend {requested} needs CUDA fp16/bf16 tensors with head_dim % 8 == 0 and <= "
            f"{_largest_head_dim(requested)}; got {q.device} {q.dtype} head_dim {q.shape[-1]}"
        )
    return requested


def _flash_backend(q: torch.Tensor) -> str | None:
    """The FlashAttention-2 backend for cudnn's short documents, or None (cudnn takes them)."""
    return next((b for b in available_backends() if b in ("flash_attn", "torch_varlen") and _fits(b, q)),
                None)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax arithmetic in float32, or float64 for float64 inputs."""
    return torch.promote_types(dtype, torch.float32)


_HOST_BOUNDS: dict[int, tuple] = {}  # id(tensor) -> (weak reference, version, its values)
_HOST_BOUNDS_KEPT = 64


def host_bounds(cu_seqlens: torch.Tensor) -> tuple[int, ...]:
    """cu_seqlens' values on the host, copied once per tensor object (and in-place version):
    every attention layer of a model gets the same boundaries tensor, and each copy from a GPU
    would stall the host until the GPU caught up, leaving the GPU idle while it launches again.
    Inference-mode tensors track no version, so they are read every time."""
    if cu_seqlens.is_inference():
        return tuple(cu_seqlens.tolist())
    kept = _HOST_BOUNDS.get(id(cu_seqlens))
    if kept is not None and kept[0]() is cu_seqlens and kept[1] == cu_seqlens._version:
        return kept[2]
    values = tuple(cu_seqlens.tolist())
    _HOST_BOUNDS[id(cu_seqlens)] = (weakref.ref(cu_seqlens), cu_seqlens._version, values)
    if len(_HOST_BOUNDS) > _HOST_BOUNDS_KEPT:
        del _HOST_BOUNDS[next(iter(_HOST_BOUNDS))]  # the oldest
    return values


class Varlen(NamedTuple):
    """Which keys each query row of a packed block sees: document n is query rows
    cu_q[n]..cu_q[n+1]-1 against key rows cu_k[n]..cu_k[n+1]-1 (int32 [N+1] each); max_q / max_k
    bound the documents' lengths (the flash kernels size their grids by them). When causal,
    cu_q must equal cu_k and query i of a document sees its keys 0..i.
    memo: None, or a dict where backends keep what they derive from the boundaries (the cudnn
    backend's document batches), so that a block's backward reuses its forward's."""

    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    causal: bool
    memo: dict | None = None

    @classmethod
    def packed_causal(cls, cu_seqlens: torch.Tensor, max_len: int) -> "Varlen":
        """Causal attention within each packed document: queries and keys are the same rows."""
        return cls(cu_seqlens, cu_seqlens, max_len, max_len, True, {})


def _check_blocks(q, k, v, varlen: Varlen):
    cu_q, cu_k = varlen.cu_q, varlen.cu_k
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"expected q [Tq, Hq, D], k = v [Tk, Hkv, D]; got {q.shape}, "
                         f"{k.shape}, {v.shape}")
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"query heads {q.shape[1]} must be a multiple of kv heads {k.shape[1]}")
    if cu_q.dtype != torch.int32 or cu_k.dtype != torch.int32 or cu_q.shape != cu_k.shape:
        raise ValueError(f"cu_q / cu_k must be int32 of equal length; got {cu_q.dtype} "
                         f"{tuple(cu_q.shape)}, {cu_k.dtype} {tuple(cu_k.shape)}")


def _no_key_result(q: torch.Tensor):
    out = torch.zeros_like(q)
    lse = torch.full((q.shape[1], q.shape[0]), -_INF, dtype=_compute_dtype(q.dtype), device=q.device)
    return out, lse


# ---------------------------------------------------------------------------------------------
# Public block primitives
# ---------------------------------------------------------------------------------------------


def attn_forward(q, k, v, varlen: Varlen, scale: float):
    """Varlen attention of q against k/v, document by document. Returns (out, lse).

    out [Tq, Hq, D] in q's dtype, lse [Hq, Tq].
    """
    _check_blocks(q, k, v, varlen)
    if q.shape[0] == 0 or k.shape[0] == 0:
        return _no_key_result(q)
    return _FORWARD[_select_backend(q)](q, k, v, varlen, scale)


def attn_backward(dout, q, k, v, out, lse, varlen: Varlen, scale: float):
    """Gradients (dq, dk, dv) of this block, computed with the GIVEN (final, merged) out and lse.

    The softmax-jacobian term uses rowsum(dout * out) of the given out. The flash backends read
    out in q's dtype (a merged float32 out is rounded to it first, as every FA2 backward does).
    """
    _check_blocks(q, k, v, varlen)
    if q.shape[0] == 0 or k.shape[0] == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    return _BACKWARD[_select_backend(q)](dout, q, k, v, out, lse, varlen, scale)


def autocast_off(device_type: str):
    """A context with autocast off on `device_type` (nothing to enter where it is off already)."""
    if not torch.is_autocast_enabled(device_type):
        return contextlib.nullcontext()
    return torch.autocast(device_type, enabled=False)


def outside_autocast(forward):
    """For an attention forward (an autograd.Function's, ctx first): run it with autocast off. Its
    primitives pick their arithmetic from the input dtypes (float32 softmax, flash kernels for bf16);
    under autocast the math backend's float32 einsums would silently run in bf16, unlike the backward,
    which autocast never reaches and which recomputes probabilities from the forward's lse."""
    @functools.wraps(forward)
    def wrapper(ctx, q, *args):
        with autocast_off(q.device.type):
            return forward(ctx, q, *args)
    return wrapper


def merge_attn(out_a, lse_a, out_b, lse_b):
    """Exact merge of two attentions over disjoint key sets: (out [T, H, D], lse [H, T]).

    Computed in float32 (float64 for float64 inputs); -inf on either side (no keys there) is
    fine, and rows with no key on both sides stay out = 0, lse = -inf.
    """
    dtype = _compute_dtype(torch.promote_types(out_a.dtype, out_b.dtype))
    lse_a, lse_b = lse_a.to(dtype), lse_b.to(dtype)
    lse = torch.logaddexp(lse_a, lse_b)
    # Weights exp(lse_x - lse) <= 1 never overflow; a row with lse = -inf has both weights 0.
    finite_lse = lse.masked_fill(lse == -_INF, 0.0)
    weight_a = torch.exp(lse_a - finite_lse).T.unsqueeze(-1)
    weight_b = torch.exp(lse_b - finite_lse).T.unsqueeze(-1)
    out = out_a.to(dtype) * weight_a + out_b.to(dtype) * weight_b
    return out, lse


# ---------------------------------------------------------------------------------------------
# Diagonal branch: query row t sees branch_k[p, t] for every p, nothing else
# ---------------------------------------------------------------------------------------------


_HAS_TRITON = importlib.util.find_spec("triton") is not None

# The PyTorch branch runs in float32 on this many query rows at a time, so its temporaries stay
# bounded however long the packed sequence is.
ROWS_PER_CHUNK = 16384


def _row_chunks(tokens):
    for start in range(0, tokens, ROWS_PER_CHUNK):
        yield slice(start, min(start + ROWS_PER_CHUNK, tokens))


def _triton_branch():
    """ops/branch_triton.py (imported on first GPU use: Triton costs a second to import)."""
    import titan_draft.ops.branch_triton as branch_triton
    return branch_triton


def _grouped(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[..., Hq, D] -> [..., Hkv, G, D]: query heads grouped by the kv head they read."""
    return x.unflatten(-2, (kv_heads, -1))


def _branch_scores(q, branch_k, scale):
    """Scores of the P diagonal keys, [P, T, Hkv, G], in the compute dtype."""
    q_grouped = _grouped(q.to(_compute_dtype(q.dtype)), branch_k.shape[2])
    return (q_grouped.unsqueeze(0) * branch_k.to(q_grouped.dtype).unsqueeze(3)).sum(-1) * scale


def _probs(scores, lse):
    """exp(scores - lse); a row whose lse is -inf (no key anywhere) gets probability 0."""
    return torch.exp(scores - lse.masked_fill(lse == -_INF, 0.0))


def branch_forward(q, branch_k, branch_v, scale: float):
    """Attention of each query row over its P diagonal branch keys. Returns (out, lse).

    q [T, Hq, D], branch_k/v [P, T, Hkv, D]. out [T, Hq, D] and lse [Hq, T] in float32 (float64
    for float64 inputs): the branch is only ever merged with the trunk, which needs that
    precision. P = 0 gives out = 0, lse = -inf.
    """
    scores = _branch_scores(q, branch_k, scale)
    lse = torch.logsumexp(scores, dim=0)  # [T, Hkv, G]
    probs = _probs(scores, lse)
    out = (probs.unsqueeze(-1) * branch_v.to(probs.dtype).unsqueeze(3)).sum(0)
    return out.flatten(1, 2), lse.flatten(1, 2).T.contiguous()


def _has_branch(branch_k) -> bool:
    return branch_k is not None and branch_k.shape[0] > 0


def add_branch(out, lse, q, branch_k, branch_v, scale: float):
    """The trunk's (out, lse) with the branch merged in: merge_attn(out, lse,
    *branch_forward(q, branch_k, branch_v, scale)), written into the given out (its dtype kept) and
    lse (float32, float64 for float64 inputs) IN PLACE and returned: callers pass the trunk's own
    fresh results and use the returned pair (the Triton kernel copies a non-contiguous one first).
    On a GPU one Triton kernel (ops/branch_triton.py), else add_branch_torch. Without a branch
    (None, or P = 0): (out, lse) as given."""
    if not _has_branch(branch_k):
        return out, lse
    if q.is_cuda and _HAS_TRITON:
        return _triton_branch().add_branch(out, lse, q, branch_k, branch_v, scale)
    return add_branch_torch(out, lse, q, branch_k, branch_v, scale)


def branch_backward(dout, q, branch_k, branch_v, out, lse, scale: float, dq):
    """Gradients of the branch part given the FINAL out/lse: its share of dq added into dq in
    place, (dbranch_k, dbranch_v) returned; on a GPU one Triton kernel (ops/branch_triton.py),
    else branch_backward_torch."""
    if q.is_cuda and _HAS_TRITON:
        return _triton_branch().branch_backward(dout, q, branch_k, branch_v, out, lse, scale, dq)
    return branch_backward_torch(dout, q, branch_k, branch_v, out, lse, scale, dq)


def branch_grads(dq, dout, q, branch_k, branch_v, out, lse, scale: float):
    """The branch's gradients (dbranch_k, dbranch_v) given the FINAL out/lse, its share of dq added
    into dq in place: (None, None) without a branch, zeros for P = 0."""
    if branch_k is None:
        return None, None
    if branch_k.shape[0] == 0:
        return torch.zeros_like(branch_k), torch.zeros_like(branch_v)
    return branch_backward(dout, q, branch_k, branch_v, out, lse, scale, dq)


def add_branch_torch(out, lse, q, branch_k, branch_v, scale: float):
    """add_branch in plain PyTorch, ROWS_PER_CHUNK rows at a time (the Triton kernel's reference):
    out and lse are overwritten with the merged result and returned."""
    for rows in _row_chunks(q.shape[0]):
        chunk_out, lse[:, rows] = merge_attn(
            out[rows], lse[:, rows], *branch_forward(q[rows], branch_k[:, rows], branch_v[:, rows], scale))
        out[rows] = chunk_out.to(out.dtype)
    return out, lse


def branch_backward_torch(dout, q, branch_k, branch_v, out, lse, scale: float, dq):
    """Closed-form gradients of the branch part, given the FINAL out/lse, in plain PyTorch
    (the Triton kernel's reference): w = exp(s - lse); dv_b = w dout;
    ds = w (<dout, v_b> - <dout, out>); dq += scale sum_p ds k_b; dk_b = scale ds q.
    Returns (dbranch_k, dbranch_v); dq is updated in place."""
    dbranch_k, dbranch_v = torch.empty_like(branch_k), torch.empty_like(branch_v)
    for rows in _row_chunks(q.shape[0]):
        dq_rows, dbranch_k[:, rows], dbranch_v[:, rows] = _branch_backward_rows(
            dout[rows], q[rows], branch_k[:, rows], branch_v[:, rows], out[rows], lse[:, rows], scale)
        dq[rows] = (dq[rows].to(dq_rows.dtype) + dq_rows).to(dq.dtype)
    return dbranch_k, dbranch_v


def _branch_backward_rows(dout, q, branch_k, branch_v, out, lse, scale: float):
    kv_heads = branch_k.shape[2]
    scores = _branch_scores(q, branch_k, scale)
    dtype = scores.dtype
    probs = _probs(scores, lse.to(dtype).T.unflatten(-1, (kv_heads, -1)))  # [P, T, Hkv, G]
    dout_g = _grouped(dout.to(dtype), kv_heads).unsqueeze(0)  # [1, T, Hkv, G, D]
    row_delta = (dout_g * _grouped(out.to(dtype), kv_heads)).sum(-1)  # [1, T, Hkv, G]
    dprobs = (dout_g * branch_v.to(dtype).unsqueeze(3)).sum(-1)
    dscores = (probs * (dprobs - row_delta) * scale).unsqueeze(-1)  # [P, T, Hkv, G, 1]
    dq = (dscores * branch_k.to(dtype).unsqueeze(3)).sum(0).flatten(1, 2)  # in the compute dtype
    dbranch_k = (dscores * _grouped(q.to(dtype), kv_heads).unsqueeze(0)).sum(3)
    dbranch_v = (probs.unsqueeze(-1) * dout_g).sum(3)
    return dq, dbranch_k.to(branch_k.dtype), dbranch_v.to(branch_v.dtype)


# ---------------------------------------------------------------------------------------------
# math backend: plain PyTorch, documents of equal length batched together
# ---------------------------------------------------------------------------------------------

# A batch of documents keeps its scores below this many elements (the longest document alone may not).
MATH_BATCH_ELEMENTS = 1 << 24


def _document_batches(varlen: Varlen, heads):
    """Documents that have both queries and keys, batched by (query length, key length): yields the
    index tensors (query rows [N, Lq], key rows [N, Lk]) of N such documents at a time."""
    bounds_q, bounds_k = host_bounds(varlen.cu_q), host_bounds(varlen.cu_k)
    firsts = {}
    for q0, q1, k0, k1 in zip(bounds_q, bounds_q[1:], bounds_k, bounds_k[1:]):
        if varlen.causal and (q0, q1) != (k0, k1):
            raise ValueError("causal attention needs cu_q == cu_k")
        if q1 > q0 and k1 > k0:
            firsts.setdefault((q1 - q0, k1 - k0), []).append((q0, k0))
    device = varlen.cu_q.device
    for (len_q, len_k), starts in firsts.items():
        starts = torch.tensor(starts, device=device)
        rows_q = starts[:, :1] + torch.arange(len_q, device=device)
        rows_k = starts[:, 1:] + torch.arange(len_k, device=device)
        per_batch = max(1, MATH_BATCH_ELEMENTS // (heads * len_q * len_k))
        for i in range(0, len(starts), per_batch):
            yield rows_q[i:i + per_batch], rows_k[i:i + per_batch]


def _document_probs(q_docs, k_docs, lse_docs, causal, scale):
    """Scores and probabilities of N documents, [N, Hkv, G, Lq, Lk]; lse_docs None = compute it."""
    scores = torch.einsum("nqhgd,nkhd->nhgqk", _grouped(q_docs, k_docs.shape[2]), k_docs) * scale
    if causal:
        length = q_docs.shape[1]
        future = torch.ones(length, length, dtype=torch.bool, device=q_docs.device).triu(1)
        scores = scores.masked_fill(future, -_INF)
    if lse_docs is None:
        lse_docs = torch.logsumexp(scores, dim=-1)
    finite_lse = lse_docs.masked_fill(lse_docs == -_INF, 0.0)
    return torch.exp(scores - finite_lse.unsqueeze(-1)), lse_docs


def _math_forward(q, k, v, varlen: Varlen, scale):
    dtype = _compute_dtype(q.dtype)
    out, lse = _no_key_result(q)
    for rows_q, rows_k in _document_batches(varlen, q.shape[1]):
        probs, lse_docs = _document_probs(q[rows_q].to(dtype), k[rows_k].to(dtype), None, varlen.causal,
                                          scale)
        out_docs = torch.einsum("nhgqk,nkhd->nqhgd", probs, v[rows_k].to(dtype))
        out[rows_q] = out_docs.flatten(2, 3).to(q.dtype)
        lse[:, rows_q] = lse_docs.flatten(1, 2).transpose(0, 1)  # [N, Hq, Lq] -> [Hq, N, Lq]
    return out, lse


def _math_backward(dout, q, k, v, out, lse, varlen: Varlen, scale):
    dtype = _compute_dtype(q.dtype)
    kv_heads = k.shape[1]
    dq = torch.zeros(q.shape, dtype=dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=dtype, device=k.device)
    dv = torch.zeros(v.shape, dtype=dtype, device=v.device)
    for rows_q, rows_k in _document_batches(varlen, q.shape[1]):
        q_docs, k_docs, v_docs = q[rows_q].to(dtype), k[rows_k].to(dtype), v[rows_k].to(dtype)
        lse_docs = lse[:, rows_q].to(dtype).transpose(0, 1).unflatten(1, (kv_heads, -1))  # [N, Hkv, G, Lq]
        probs, _ = _document_probs(q_docs, k_docs, lse_docs, varlen.causal, scale)
        dout_docs = _grouped(dout[rows_q].to(dtype), kv_heads)
        row_delta = (dout_docs * _grouped(out[rows_q].to(dtype), kv_heads)).sum(-1)  # [N, Lq, Hkv, G]
        dprobs = torch.einsum("nqhgd,nkhd->nhgqk", dout_docs, v_docs)
        dscores = probs * (dprobs - row_delta.permute(0, 2, 3, 1).unsqueeze(-1)) * scale
        dq[rows_q] = torch.einsum("nhgqk,nkhd->nqhgd", dscores, k_docs).flatten(2, 3)
        dk[rows_k] = torch.einsum("nhgqk,nqhgd->nkhd", dscores, _grouped(q_docs, kv_heads))
        dv[rows_k] = torch.einsum("nhgqk,nqhgd->nkhd", probs, dout_docs)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# ---------------------------------------------------------------------------------------------
# CUDA backends. Both run FlashAttention-2 varlen kernels, which mark a query row with no key by
# lse = +inf (so that exp(s - lse) = 0 in their backward): translate to and from our -inf.
# ---------------------------------------------------------------------------------------------


def _lse_from_flash(lse, q):
    if tuple(lse.shape) != (q.shape[1], q.shape[0]):
        raise RuntimeError(f"flash kernel returned lse of shape {tuple(lse.shape)}; expected the "
                           f"unpadded varlen layout {(q.shape[1], q.shape[0])}")
    return lse.masked_fill(lse == _INF, -_INF)


def _lse_to_flash(lse):
    return lse.float().masked_fill(lse == -_INF, _INF).contiguous()


def _expand_kv_heads(x, groups):
    return x.repeat_interleave(groups, dim=1)


def _reduce_kv_heads(dx, groups):
    return dx.unflatten(1, (-1, groups)).sum(2)


_torch_flash_needs_expanded_kv = False


def _with_kv_heads_fallback(kernel, q, k, v):
    """Run kernel(k, v) with native GQA; if PyTorch's flash kernel refuses Hkv < Hq, run it on
    kv heads repeated to Hq from then on (reducing dk/dv back is the caller's job)."""
    global _torch_flash_needs_expanded_kv
    groups = q.shape[1] // k.shape[1]
    if groups > 1 and not _torch_flash_needs_expanded_kv:
        try:
            return kernel(k, v), 1
        except RuntimeError as error:
            warnings.warn(f"PyTorch flash kernel refused GQA ({error}); expanding kv heads")
            _torch_flash_needs_expanded_kv = True
    if groups == 1:
        return kernel(k, v), 1
    return kernel(_expand_kv_heads(k, groups), _expand_kv_heads(v, groups)), groups


def _torch_varlen_forward(q, k, v, varlen: Varlen, scale):
    # The op varlen_attn calls (torch 2.11 and 2.13): positional schema (q, k, v, cu_q, cu_k,
    # max_q, max_k, dropout_p, is_causal, return_debug_mask, *, scale, ...) -> (out, lse, ...).
    def kernel(k_, v_):
        return torch.ops.aten._flash_attention_forward(
            q.contiguous(), k_.contiguous(), v_.contiguous(), varlen.cu_q, varlen.cu_k, varlen.max_q,
            varlen.max_k, 0.0, varlen.causal, False, scale=scale)

    (out, lse, *_), _ = _with_kv_heads_fallback(kernel, q, k, v)
    return out, _lse_from_flash(lse, q)


def _torch_varlen_backward(dout, q, k, v, out, lse, varlen: Varlen, scale):
    # Without dropout the kernel never reads the rng state; pass what varlen.py passes.
    rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)
    unused = torch.empty(0, device=q.device)

    def kernel(k_, v_):
        return torch.ops.aten._flash_attention_backward(
            dout.to(q.dtype).contiguous(), q.contiguous(), k_.contiguous(), v_.contiguous(),
            out.to(q.dtype).contiguous(), _lse_to_flash(lse), varlen.cu_q, varlen.cu_k, varlen.max_q,
            varlen.max_k, 0.0, varlen.causal, rng_state, unused, scale=scale)

    (dq, dk, dv), groups = _with_kv_heads_fallback(kernel, q, k, v)
    if groups > 1:
        dk, dv = _reduce_kv_heads(dk, groups), _reduce_kv_heads(dv, groups)
    return dq, dk.to(k.dtype), dv.to(v.dtype)


def _call_flash_attn(function, window_size, **kwargs):
    """Call a flash-attn internal with the keywords its installed version knows: the window is a
    tuple in flash-attn < 2.6 and two ints after; softcap etc. only exist in newer versions."""
    signature = inspect.signature(getattr(function, "_init_fn", function))
    kwargs.update(window_size=window_size, window_size_left=window_size[0],
                  window_size_right=window_size[1], softcap=0.0, alibi_slopes=None,
                  block_table=None)
    return function(**{name: value for name, value in kwargs.items()
                       if name in signature.parameters})


def _flash_window(causal):
    return (-1, 0) if causal else (-1, -1)


def _flash_attn_forward(q, k, v, varlen: Varlen, scale):
    interface = _flash_attn_module()
    result = _call_flash_attn(
        interface._flash_attn_varlen_forward, _flash_window(varlen.causal),
        q=q.contiguous(), k=k.contiguous(), v=v.contiguous(), cu_seqlens_q=varlen.cu_q,
        cu_seqlens_k=varlen.cu_k, max_seqlen_q=varlen.max_q, max_seqlen_k=varlen.max_k, dropout_p=0.0,
        softmax_scale=scale, causal=varlen.causal, return_softmax=False)
    # flash-attn >= 2.6 returns (out, lse, S_dmask, rng_state); 2.5 returns
    # (out, q, k, v, out_padded, lse, S_dmask, rng_state): lse is third from the end in both.
    return result[0], _lse_from_flash(result[-3], q)


def _flash_attn_backward(dout, q, k, v, out, lse, varlen: Varlen, scale):
    interface = _flash_attn_module()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    _call_flash_attn(
        interface._flash_attn_varlen_backward, _flash_window(varlen.causal),
        dout=dout.to(q.dtype).contiguous(), q=q.contiguous(), k=k.contiguous(),
        v=v.contiguous(), out=out.to(q.dtype).contiguous(), softmax_lse=_lse_to_flash(lse),
        dq=dq, dk=dk, dv=dv, cu_seqlens_q=varlen.cu_q, cu_seqlens_k=varlen.cu_k,
        max_seqlen_q=varlen.max_q, max_seqlen_k=varlen.max_k, dropout_p=0.0, softmax_scale=scale,
        causal=varlen.causal,
        deterministic=False, rng_state=None)
    return dq, dk, dv


# ---------------------------------------------------------------------------------------------
# cudnn backend: long documents batched by length through cuDNN (ops/cudnn_attention.py), the
# short ones through FlashAttention-2 in one varlen call.
# ---------------------------------------------------------------------------------------------


class _CudnnSplit(NamedTuple):
    # The cuDNN groups, and rest_written: every query (key) row is in a cuDNN group or a short
    # document, none in a document without keys (queries): results start uninitialized, no zero fill.
    layout: cudnn_attention.Layout
    short_q: torch.Tensor | None  # rows of the short documents, and their own Varlen
    short_k: torch.Tensor | None
    short_varlen: Varlen | None
    flash: str | None


def _split_for_cudnn(q, k, varlen: Varlen) -> _CudnnSplit:
    """The block's documents for cuDNN and for FlashAttention-2 (or math, where FA2 cannot run);
    kept in varlen.memo when there is one, so that the backward reuses the forward's."""
    floor_rows = CUDNN_BATCH_FLOOR_BYTES // (4 * q.shape[1] * q.shape[2])  # float32 dQ per row
    max_batch_rows = max(q.shape[0] // CUDNN_MAX_BATCH_SHARE, floor_rows)
    key = ("cudnn", q.shape[0], k.shape[0], CUDNN_MIN_DOCUMENT, max_batch_rows)
    if varlen.memo is not None and key in varlen.memo:
        return varlen.memo[key]
    bounds = host_bounds(varlen.cu_q), host_bounds(varlen.cu_k)
    flash = _flash_backend(q) or "math"
    # cuDNN refuses a one-by-one attention; FA2 takes the short documents in one call.
    min_length = max(CUDNN_MIN_DOCUMENT if flash != "math" else 1, 2)
    split = _cached_split(bounds[0], bounds[1], varlen.causal, min_length, max_batch_rows,
                          (q.shape[0], k.shape[0]), q.device, flash)
    if varlen.memo is not None:
        varlen.memo[key] = split
    return split


def span_rows(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The rows of the spans [start, start + length) laid end to end (what gathers them into one batch)."""
    firsts = torch.cumsum(lengths, 0) - lengths  # where each span starts among the gathered rows
    return torch.arange(int(lengths.sum()), device=lengths.device) + (starts - firsts).repeat_interleave(lengths)


@functools.lru_cache(maxsize=16)
def _cached_split(bounds_q, bounds_k, causal, min_length, max_batch_rows, tokens, device, flash
                  ) -> _CudnnSplit:
    """_split_for_cudnn's result for given boundaries: every layer of a model sees the same
    documents, so they share one split (and its index tensors)."""
    groups, short = cudnn_attention.split_documents(
        list(bounds_q), list(bounds_k), causal=causal, min_length=min_length,
        max_batch_rows=max_batch_rows, tokens=tokens, device=device)
    with_keys = [(q1 - q0, k1 - k0) for q0, q1, k0, k1 in zip(bounds_q, bounds_q[1:], bounds_k, bounds_k[1:])
                 if q1 > q0 and k1 > k0]
    all_rows_written = (sum(n for n, _ in with_keys) == tokens[0], sum(n for _, n in with_keys) == tokens[1])
    layout = cudnn_attention.Layout(groups, all_rows_written)
    if not groups or not short:  # all documents to one kernel: nothing to gather
        return _CudnnSplit(layout, None, None, None, flash)

    def rows_and_bounds(spans):
        starts, lengths = (torch.tensor(x) for x in zip(*spans))
        lengths = lengths - starts
        cu = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
        rows = span_rows(starts, lengths)
        return (cudnn_attention.to_device(rows, device),
                cudnn_attention.to_device(cu.to(torch.int32), device), int(lengths.max()))

    short_q, cu_q, max_q = rows_and_bounds([(q0, q1) for q0, q1, _, _ in short])
    short_k, cu_k, max_k = rows_and_bounds([(k0, k1) for _, _, k0, k1 in short])
    return _CudnnSplit(layout, short_q, short_k, Varlen(cu_q, cu_k, max_q, max_k, causal), flash)


def _cudnn_forward(q, k, v, varlen: Varlen, scale):
    split = _split_for_cudnn(q, k, varlen)
    if not split.layout.groups:
        return _FORWARD[split.flash](q, k, v, varlen, scale)
    out, lse = cudnn_attention.forward(q, k, v, split.layout, scale=scale, lse_dtype=_compute_dtype(q.dtype))
    if split.short_varlen is not None:
        short_out, short_lse = _FORWARD[split.flash](
            q.index_select(0, split.short_q), k.index_select(0, split.short_k),
            v.index_select(0, split.short_k), split.short_varlen, scale)
        out.index_copy_(0, split.short_q, short_out)
        lse.index_copy_(1, split.short_q, short_lse)
    return out, lse


def _cudnn_backward(dout, q, k, v, out, lse, varlen: Varlen, scale):
    split = _split_for_cudnn(q, k, varlen)
    if not split.layout.groups:
        return _BACKWARD[split.flash](dout, q, k, v, out, lse, varlen, scale)
    dout, q, k, v = (x.contiguous() for x in (dout.to(q.dtype), q, k, v))
    out = out.to(q.dtype).contiguous()
    # p = 0 in rows that saw no key: -inf -> +inf, in one kernel (NaN kept as it is). A causal
    # row always sees a key, its own: nothing to do there.
    keyless_as_inf = lse if varlen.causal else torch.nan_to_num(lse, nan=math.nan, posinf=_INF, neginf=_INF)
    dq, dk, dv = cudnn_attention.backward(dout, q, k, v, out, keyless_as_inf, split.layout, scale=scale)
    if split.short_varlen is not None:
        rows_q, rows_k = split.short_q, split.short_k
        short = _BACKWARD[split.flash](
            dout.index_select(0, rows_q), q.index_select(0, rows_q), k.index_select(0, rows_k),
            v.index_select(0, rows_k), out.index_select(0, rows_q), lse.index_select(1, rows_q),
            split.short_varlen, scale)
        for target, grad, rows in zip((dq, dk, dv), short, (rows_q, rows_k, rows_k)):
            target.index_copy_(0, rows, grad.to(target.dtype))
    return dq, dk, dv


_FORWARD = dict(cudnn=_cudnn_forward, flash_attn=_flash_attn_forward,
                torch_varlen=_torch_varlen_forward, math=_math_forward)
_BACKWARD = dict(cudnn=_cudnn_backward, flash_attn=_flash_attn_backward,
                 torch_varlen=_torch_varlen_backward, math=_math_backward)
