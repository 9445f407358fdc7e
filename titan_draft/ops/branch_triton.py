"""The diagonal branch and its log-sum-exp merge as two Triton kernels (DESIGN.md section 3).

The references are attention_kernels.add_branch_torch / branch_backward_torch (plain PyTorch,
same arguments, same results); tests/test_branch_triton.py runs these kernels in
Triton's interpreter on CPU against them in float64, and on a GPU as they are.

Why kernels of their own: the branch is P dot products per query row. Written in PyTorch, every
step of it reads or writes a [P, T, Hq, D]-sized float32 temporary; here one program owns a block
of rows and ALL query heads of one kv head, so q, out, dout are read once, each branch key and
value once (not once per query head), and the merge with the trunk happens in registers:
forward reads q, out, lse, branch_k, branch_v and writes out, lse; backward reads q, dout, out,
lse, branch_k, branch_v and adds into dq, writes dbranch_k, dbranch_v. Nothing else. Both work in
place on the trunk's results (out, lse forward; dq backward): no copies, no temporaries.
"""
import functools

import torch
import triton
import triton.language as tl

# Elements per [rows, heads-of-one-kv-head, head_dim] register tile: 4096 keeps a tile at
# 32 values per thread with 4 warps.
_TILE_ELEMENTS = 4096


@triton.jit(do_not_specialize=["tokens"])
def _branch_merge_forward(q_ptr, bk_ptr, bv_ptr, out_ptr, lse_ptr, scale_ptr, tokens,
                          PASSES: tl.constexpr, KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
                          BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                          BLOCK_T: tl.constexpr):
    """In place: (out, lse) of the trunk become those of trunk + branch, for the rows of this
    program and the GROUP query heads that read kv head program_id(1). All tensors contiguous:
    q, out [T, Hq, D], lse [Hq, T], branch k/v [P, T, Hkv, D]."""
    # 64-bit offsets: rows x row stride passes 2^31 from ~512K tokens at 32 x 128 per row.
    rows = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    kv_head = tl.program_id(1)
    heads = kv_head * GROUP + tl.arange(0, BLOCK_G)
    dims = tl.arange(0, BLOCK_D)
    live = (rows < tokens)[:, None] & (tl.arange(0, BLOCK_G) < GROUP)[None, :]  # [T, G]
    live3 = live[:, :, None] & (dims < HEAD_DIM)[None, None, :]  # [T, G, D]
    live_kv = (rows < tokens)[:, None] & (dims < HEAD_DIM)[None, :]  # [T, D]

    lse_at = lse_ptr + heads[None, :] * tokens + rows[:, None]
    row_at = rows[:, None, None] * (KV_HEADS * GROUP * HEAD_DIM) + heads[None, :, None] * HEAD_DIM + dims
    out_at = out_ptr + row_at
    kv_at = rows[:, None] * (KV_HEADS * HEAD_DIM) + kv_head * HEAD_DIM + dims[None, :]
    pass_stride = tokens.to(tl.int64) * (KV_HEADS * HEAD_DIM)
    trunk_lse = tl.load(lse_at, mask=live, other=0.0)
    compute = trunk_lse.dtype  # float32, or float64 for float64 inputs
    scale = tl.load(scale_ptr).to(compute)
    q = tl.load(q_ptr + row_at, mask=live3, other=0.0).to(compute)
    # Online softmax over the trunk (as one term of weight exp(trunk_lse)) and the P branch keys.
    # A row without trunk keys (lse = -inf) starts from nothing.
    has_trunk = trunk_lse > float("-inf")
    running_max = trunk_lse
    denominator = tl.where(has_trunk, 1.0, 0.0).to(compute)
    numerator = tl.where(has_trunk[:, :, None],
                         tl.load(out_at, mask=live3, other=0.0).to(compute), 0.0)
    key_at, value_at = bk_ptr + kv_at, bv_ptr + kv_at  # pass 0; each pass adds pass_stride
    for _ in tl.static_range(PASSES):
        key = tl.load(key_at, mask=live_kv, other=0.0).to(compute)
        value = tl.load(value_at, mask=live_kv, other=0.0).to(compute)
        key_at, value_at = key_at + pass_stride, value_at + pass_stride
        score = tl.sum(q * key[:, None, :], axis=2) * scale  # [T, G]
        new_max = tl.maximum(running_max, score)
        keep = tl.exp(running_max - new_max)
        weight = tl.exp(score - new_max)
        denominator = denominator * keep + weight
        numerator = numerator * keep[:, :, None] + weight[:, :, None] * value[:, None, :]
        running_max = new_max
    tl.store(out_at, (numerator / denominator[:, :, None]).to(out_ptr.dtype.element_ty), mask=live3)
    tl.store(lse_at, running_max + tl.log(denominator), mask=live)


@triton.jit(do_not_specialize=["tokens"])
def _branch_backward(q_ptr, bk_ptr, bv_ptr, out_ptr, lse_ptr, dout_ptr, scale_ptr,
                     dq_ptr, dbk_ptr, dbv_ptr, tokens,
                     PASSES: tl.constexpr, KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
                     BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                     BLOCK_T: tl.constexpr):
    """Gradients of the branch part given the FINAL out/lse: w = exp(s - lse),
    dv_b = sum_g w dout, ds = w (<dout, v_b> - <dout, out>) scale, dq = sum_p ds k_b,
    dk_b = sum_g ds q, dq added into dq_ptr (its trunk part). Layouts as in the forward; dout
    and dq as q, dbk and dbv as bk."""
    rows = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)  # as in forward
    kv_head = tl.program_id(1)
    heads = kv_head * GROUP + tl.arange(0, BLOCK_G)
    dims = tl.arange(0, BLOCK_D)
    live = (rows < tokens)[:, None] & (tl.arange(0, BLOCK_G) < GROUP)[None, :]
    live3 = live[:, :, None] & (dims < HEAD_DIM)[None, None, :]
    live_kv = (rows < tokens)[:, None] & (dims < HEAD_DIM)[None, :]

    row_at = rows[:, None, None] * (KV_HEADS * GROUP * HEAD_DIM) + heads[None, :, None] * HEAD_DIM + dims
    kv_at = rows[:, None] * (KV_HEADS * HEAD_DIM) + kv_head * HEAD_DIM + dims[None, :]
    pass_stride = tokens.to(tl.int64) * (KV_HEADS * HEAD_DIM)
    lse = tl.load(lse_ptr + heads[None, :] * tokens + rows[:, None], mask=live, other=0.0)
    compute = lse.dtype
    lse = tl.where(lse == float("-inf"), 0.0, lse)
    scale = tl.load(scale_ptr).to(compute)
    q = tl.load(q_ptr + row_at, mask=live3, other=0.0).to(compute)
    dout = tl.load(dout_ptr + row_at, mask=live3, other=0.0).to(compute)
    row_delta = tl.sum(dout * tl.load(out_ptr + row_at, mask=live3, other=0.0).to(compute), axis=2)
    dq = tl.zeros([BLOCK_T, BLOCK_G, BLOCK_D], dtype=compute)
    pass_at = kv_at  # int64 offsets in the [P, T, Hkv, D] layout of bk, bv, dbk, dbv
    for _ in tl.static_range(PASSES):
        key = tl.load(bk_ptr + pass_at, mask=live_kv, other=0.0).to(compute)
        value = tl.load(bv_ptr + pass_at, mask=live_kv, other=0.0).to(compute)
        prob = tl.exp(tl.sum(q * key[:, None, :], axis=2) * scale - lse)  # [T, G]
        dscore = prob * (tl.sum(dout * value[:, None, :], axis=2) - row_delta) * scale
        dq += dscore[:, :, None] * key[:, None, :]
        tl.store(dbk_ptr + pass_at,
                 tl.sum(dscore[:, :, None] * q, axis=1).to(dbk_ptr.dtype.element_ty), mask=live_kv)
        tl.store(dbv_ptr + pass_at,
                 tl.sum(prob[:, :, None] * dout, axis=1).to(dbv_ptr.dtype.element_ty), mask=live_kv)
        pass_at += pass_stride
    dq_at = dq_ptr + row_at
    dq += tl.load(dq_at, mask=live3, other=0.0).to(compute)  # the trunk's share, rounded once
    tl.store(dq_at, dq.to(dq_ptr.dtype.element_ty), mask=live3)


@functools.lru_cache(maxsize=64)
def _launch_shape(q_shape: torch.Size, branch_shape: torch.Size):
    """(grid, constexpr keywords) for a [T, Hq, D] query and [P, T, Hkv, D] branch (cached: it
    is worked out on the host at every call, in Python)."""
    tokens, q_heads, head_dim = q_shape
    passes, _, kv_heads, _ = branch_shape
    group = q_heads // kv_heads
    block_g, block_d = triton.next_power_of_2(group), triton.next_power_of_2(head_dim)
    block_t = max(1, _TILE_ELEMENTS // (block_g * block_d))
    grid = (triton.cdiv(tokens, block_t), kv_heads)
    return grid, dict(PASSES=passes, KV_HEADS=kv_heads, GROUP=group, BLOCK_G=block_g,
                      HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_T=block_t)


@functools.lru_cache(maxsize=8)
def _scale_tensor(scale: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # Passed through memory, not as a kernel scalar (always float32): float64 stays exact. Cached:
    # one fill kernel per (scale, dtype, device), not per call; the kernels only read it.
    return torch.full((1,), scale, dtype=dtype, device=device)


def add_branch(out, lse, q, branch_k, branch_v, scale: float):
    """attention_kernels.add_branch_torch as one kernel: the branch merged into the trunk's out
    [T, Hq, D] and lse [Hq, T] IN PLACE (into contiguous copies first where they are not
    contiguous); returns them."""
    q, branch_k, branch_v, out, lse = (x.contiguous() for x in (q, branch_k, branch_v, out, lse))
    grid, shape = _launch_shape(q.shape, branch_k.shape)
    _branch_merge_forward[grid](q, branch_k, branch_v, out, lse, _scale_tensor(scale, lse.dtype, lse.device),
                                q.shape[0], **shape)
    return out, lse


def branch_backward(dout, q, branch_k, branch_v, out, lse, scale: float, dq):
    """attention_kernels.branch_backward_torch as one kernel: the branch's share of dq added into
    dq (any float dtype) in place; returns (dbranch_k, dbranch_v)."""
    q, dout, branch_k, branch_v, out, lse = (x.contiguous() for x in (q, dout, branch_k, branch_v, out, lse))
    dq_rows = dq.contiguous()  # dq itself, unless its layout needs a copy (then copied back)
    dbranch_k, dbranch_v = torch.empty_like(branch_k), torch.empty_like(branch_v)
    grid, shape = _launch_shape(q.shape, branch_k.shape)
    _branch_backward[grid](q, branch_k, branch_v, out, lse, dout, _scale_tensor(scale, lse.dtype, lse.device),
                           dq_rows, dbranch_k, dbranch_v, q.shape[0], **shape)
    if dq_rows is not dq:
        dq.copy_(dq_rows)
    return dbranch_k, dbranch_v
