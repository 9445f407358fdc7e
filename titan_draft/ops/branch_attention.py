"""Branch attention of the multi-pass draft (DESIGN.md sections 2 and 3).

The pass-d query at anchor t sees the pass-1 keys of its document at anchors <= t (the trunk:
causal varlen attention) and the same-anchor key of each later pass (the branch: a diagonal,
P keys per query). branch_attention computes the trunk with the attention_kernels primitives
(cuDNN or FlashAttention-2 on a GPU), the branch in closed form (one Triton kernel each way on a
GPU), and merges both through their log-sum-exp; branch_attention_reference is the same thing
written densely, to check it against.

With no branch (the policy's attention) it is plain causal attention per packed document, served by
one opaque custom op with its backward (`titan_draft::packed_attention`): torch.compile takes a
block that calls it whole (fullgraph), the op reading the documents' bounds on the host at run time.
"""
import functools

import torch

from titan_draft.ops.attention_kernels import (
    Varlen,
    _compute_dtype,
    add_branch,
    attn_backward,
    attn_forward,
    autocast_off,
    branch_grads,
    host_bounds,
    outside_autocast,
)


@functools.lru_cache(maxsize=16)
def _one_document(tokens: int, device: torch.device) -> torch.Tensor:
    """cu_seqlens of a single document of `tokens` rows (made once per length and device; read only)."""
    return torch.tensor([0, tokens], dtype=torch.int32, device=device)


def _validate(q, k, v, branch_k, branch_v, cu_seqlens):
    """Check shapes; return (cu_seqlens on q's device, the same as a tuple, P)."""
    if q.dim() != 3:
        raise ValueError(f"q must be [T, Hq, Dh], got shape {tuple(q.shape)}")
    tokens, q_heads, head_dim = q.shape
    if k.dim() != 3 or k.shape != v.shape or k.shape[0] != tokens or k.shape[2] != head_dim:
        raise ValueError(f"k and v must both be [T, Hkv, Dh] = [{tokens}, Hkv, {head_dim}], "
                         f"got {tuple(k.shape)} and {tuple(v.shape)}")
    kv_heads = k.shape[1]
    if q_heads % kv_heads != 0:
        raise ValueError(f"query heads ({q_heads}) must be a multiple of kv heads ({kv_heads})")
    if (branch_k is None) != (branch_v is None):
        raise ValueError("give both branch_k and branch_v, or neither")
    passes = 0
    if branch_k is not None:
        expected = (branch_k.shape[0], tokens, kv_heads, head_dim)
        if branch_k.dim() != 4 or tuple(branch_k.shape) != expected or branch_v.shape != branch_k.shape:
            raise ValueError(f"branch_k and branch_v must both be [P, T, Hkv, Dh] = [P, {tokens}, "
                             f"{kv_heads}, {head_dim}], got {tuple(branch_k.shape)} and "
                             f"{tuple(branch_v.shape)}")
        passes = branch_k.shape[0]
    if cu_seqlens is None:
        cu_seqlens = _one_document(tokens, q.device)
    if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be a 1-D int32 tensor [N+1], got {cu_seqlens.dtype} "
                         f"of shape {tuple(cu_seqlens.shape)}")
    bounds = host_bounds(cu_seqlens)
    if bounds[0] != 0 or bounds[-1] != tokens:
        raise ValueError(f"cu_seqlens must run from 0 to T = {tokens}, got {bounds[0]} .. "
                         f"{bounds[-1]}")
    lengths = [end - start for start, end in zip(bounds, bounds[1:])]
    if min(lengths) < 0:
        raise ValueError("cu_seqlens must be non-decreasing")
    return cu_seqlens.to(q.device), bounds, passes


class _BranchAttention(torch.autograd.Function):
    @staticmethod
    @outside_autocast
    def forward(ctx, q, k, v, branch_k, branch_v, varlen: Varlen, scale):
        out, lse = add_branch(*attn_forward(q, k, v, varlen, scale), q, branch_k, branch_v, scale)
        ctx.save_for_backward(q, k, v, branch_k, branch_v, out, lse)
        ctx.varlen, ctx.scale = varlen, scale
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)  # lse's gradient stays None: no zeros made for it
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, branch_k, branch_v, out, lse = ctx.saved_tensors
        varlen, scale = ctx.varlen, ctx.scale
        # Both parts see the final out/lse: that is what makes the split exact.
        dq, dk, dv = attn_backward(dout, q, k, v, out, lse, varlen, scale)
        dbranch_k, dbranch_v = branch_grads(dq, dout, q, branch_k, branch_v, out, lse, scale)
        return dq, dk, dv, dbranch_k, dbranch_v, None, None


def branch_attention(q, k, v, branch_k=None, branch_v=None, cu_seqlens=None, scale=None):
    """Trunk (causal within each packed document) plus diagonal branch attention.

    q [T, Hq, Dh]; k, v [T, Hkv, Dh] pass-1 keys/values; branch_k, branch_v [P, T, Hkv, Dh] or
    None (P may be 0): query row t also sees branch_k[p, t] for every p. cu_seqlens int32 [N+1]
    document boundaries (None = one document). scale defaults to Dh ** -0.5.
    Returns out [T, Hq, Dh] in q's dtype and lse [Hq, T] (float32; float64 for float64 inputs).
    Differentiable w.r.t. q, k, v, branch_k, branch_v through out; lse is returned for
    inspection and is marked non-differentiable (no gradient flows back through it).
    Memory beyond inputs and outputs: the attention kernels' O(T); on CPU also float32 branch
    temporaries of attention_kernels.ROWS_PER_CHUNK rows.
    """
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if branch_k is None and branch_v is None:
        if cu_seqlens is None:
            cu_seqlens = _one_document(q.shape[0], q.device)
        return torch.ops.titan_draft.packed_attention(q, k, v, cu_seqlens, scale)
    return _BranchAttention.apply(q, k, v, branch_k, branch_v, _checked_varlen(q, k, v, branch_k, branch_v, cu_seqlens),
                                  scale)


def _checked_varlen(q, k, v, branch_k, branch_v, cu_seqlens) -> Varlen:
    """The packed documents of cu_seqlens as a causal Varlen, the shapes checked (_validate)."""
    cu_seqlens, bounds, _ = _validate(q, k, v, branch_k, branch_v, cu_seqlens)
    return Varlen.packed_causal(cu_seqlens, max(end - start for start, end in zip(bounds, bounds[1:])))


@torch.library.custom_op("titan_draft::packed_attention", mutates_args=())
def _packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """branch_attention with no branch: (out, lse)."""
    with autocast_off(q.device.type):
        return attn_forward(q, k, v, _checked_varlen(q, k, v, None, None, cu_seqlens), scale)


@_packed_attention.register_fake
def _(q, k, v, cu_seqlens, scale):
    return torch.empty_like(q), q.new_empty(q.shape[1], q.shape[0], dtype=_compute_dtype(q.dtype))


@torch.library.custom_op("titan_draft::packed_attention_backward", mutates_args=())
def _packed_attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               out: torch.Tensor, lse: torch.Tensor, cu_seqlens: torch.Tensor,
                               scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of packed_attention, from its out and lse."""
    return attn_backward(dout, q, k, v, out, lse, _checked_varlen(q, k, v, None, None, cu_seqlens), scale)


@_packed_attention_backward.register_fake
def _(dout, q, k, v, out, lse, cu_seqlens, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _packed_setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens)
    ctx.scale = scale
    ctx.mark_non_differentiable(lse)


def _packed_backward(ctx, dout, _dlse):
    q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
    dq, dk, dv = torch.ops.titan_draft.packed_attention_backward(dout.contiguous(), q, k, v, out, lse, cu_seqlens,
                                                                  ctx.scale)
    return dq, dk, dv, None, None


_packed_attention.register_autograd(_packed_backward, setup_context=_packed_setup_context)


def branch_attention_reference(q, k, v, branch_k=None, branch_v=None, cu_seqlens=None,
                               scale=None):
    """Dense version of branch_attention: the full [Hq, T, T + P*T] score matrix with an explicit
    mask, softmax in float32 (float64 for float64 inputs), plain autograd. O(T^2) memory."""
    cu_seqlens, _, passes = _validate(q, k, v, branch_k, branch_v, cu_seqlens)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    tokens, q_heads, head_dim = q.shape
    kv_heads = k.shape[1]
    dtype = torch.promote_types(q.dtype, torch.float32)

    keys, values = k, v
    if branch_k is not None:
        keys = torch.cat([k, branch_k.reshape(passes * tokens, kv_heads, head_dim)])
        values = torch.cat([v, branch_v.reshape(passes * tokens, kv_heads, head_dim)])
    # Query head h reads kv head h // (Hq // Hkv).
    keys = keys.to(dtype).repeat_interleave(q_heads // kv_heads, dim=1)
    values = values.to(dtype).repeat_interleave(q_heads // kv_heads, dim=1)
    scores = torch.einsum("thd,shd->hts", q.to(dtype), keys) * scale

    position = torch.arange(tokens, device=q.device)
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    document = torch.repeat_interleave(torch.arange(lengths.numel(), device=q.device), lengths)
    trunk_visible = (document[:, None] == document[None, :]) & (position[None, :] <= position[:, None])
    branch_visible = torch.eye(tokens, dtype=torch.bool, device=q.device).repeat(1, passes)
    visible = torch.cat([trunk_visible, branch_visible], dim=1)  # [T, T + P*T]

    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("hts,shd->thd", torch.softmax(scores, dim=-1), values)
    return out.to(q.dtype), lse
