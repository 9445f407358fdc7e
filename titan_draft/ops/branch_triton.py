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


@triton.jit
def _branch_merge_forward(q_ptr, bk_ptr, bv_ptr, out_ptr, lse_ptr, scale_ptr, tokens,
                          stride_qt, stride_qh, stride_bp, stride_bt, stride_bh,
                          stride_ot, stride_oh, stride_lh,
                          PASSES: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
                          HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr):
    """In place: (out, lse) of the trunk become those of trunk + branch, for the rows of this
    program and the GROUP query heads that read kv head program_id(1)."""
    # 64-bit offsets: rows x row stride passes 2^31 from ~512K tokens at 32 x 128 per row.
    rows = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    kv_head = tl.program_id(1)
    heads = kv_head * GROUP + tl.arange(0, BLOCK_G)
    dims = tl.arange(0, BLOCK_D)
    live = (rows < tokens)[:, None] & (tl.arange(0, BLOCK_G) < GROUP)[None, :]  # [T, G]
    live3 = live[:, :, None] & (dims < HEAD_DIM)[None, None, :]  # [T, G, D]
    live_kv = (rows < tokens)[:, None] & (dims < HEAD_DIM)[None, :]  # [T, D]

    lse_at = lse_ptr + heads[None, :] * stride_lh + rows[:, None]
    out_at = out_ptr + rows[:, None, None] * stride_ot + heads[None, :, None] * stride_oh + dims
    kv_at = rows[:, None] * stride_bt + kv_head * stride_bh + dims[None, :]
    trunk_lse = tl.load(lse_at, mask=live, other=0.0)
    compute = trunk_lse.dtype  # float32, or float64 for float64 inputs
    scale = tl.load(scale_ptr).to(compute)
    q = tl.load(q_ptr + rows[:, None, None] * stride_qt + heads[None, :, None] * stride_qh + dims,
                mask=live3, other=0.0).to(compute)
    # Online softmax over the trunk (as one term of weight exp(trunk_lse)) and the P branch keys.
    # A row without trunk keys (lse = -inf) starts from nothing.
    has_trunk = trunk_lse > float("-inf")
    running_max = trunk_lse
    denominator = tl.where(has_trunk, 1.0, 0.0).to(compute)
    numerator = tl.where(has_trunk[:, :, None],
                         tl.load(out_at, mask=live3, other=0.0).to(compute), 0.0)
    key_at, value_at = bk_ptr + kv_at, bv_ptr + kv_at  # pass 0; each pass adds stride_bp
    for _ in tl.static_range(PASSES):
        key = tl.load(key_at, mask=live_kv, other=0.0).to(compute)
        value = tl.load(value_at, mask=live_kv, other=0.0).to(compute)
        key_at, value_at = key_at + stride_bp, value_at + stride_bp
        score = tl.sum(q * key[:, None, :], axis=2) * scale  # [T, G]
        new_max = tl.maximum(running_max, score)
        keep = tl.exp(running_max - new_max)
        weight = tl.exp(score - new_max)
        denominator = denominator * keep + weight
        numerator = numerator * keep[:, :, None] + weight[:, :, None] * value[:, None, :]
        running_max = new_max
    tl.store(out_at, (numerator / denominator[:, :, None]).to(out_ptr.dtype.element_ty), mask=live3)
    tl.store(lse_at, running_max + tl.log(denominator), mask=live)


@triton.jit
def _branch_backward(q_ptr, bk_ptr, bv_ptr, out_ptr, lse_ptr, dout_ptr, scale_ptr,
                     dq_ptr, dbk_ptr, dbv_ptr, tokens,
                     stride_qt, stride_qh, stride_bp, stride_bt, stride_bh,
                     stride_ot, stride_oh, stride_lh, stride_dqt, stride_dqh,
                     PASSES: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
                     HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr):
    """Gradients of the branch part given the FINAL out/lse: w = exp(s - lse),
    dv_b = sum_g w dout, ds = w (<dout, v_b> - <dout, out>) scale, dq = sum_p ds k_b,
    dk_b = sum_g ds q, dq added into dq_ptr (its trunk part). q and dout share one layout, out
    and dq each have their own; bk, bv, dbk, dbv share another."""
    rows = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)  # as in forward
    kv_head = tl.program_id(1)
    heads = kv_head * GROUP + tl.arange(0, BLOCK_G)
    dims = tl.arange(0, BLOCK_D)
    live = (rows < tokens)[:, None] & (tl.arange(0, BLOCK_G) < GROUP)[None, :]
    live3 = live[:, :, None] & (dims < HEAD_DIM)[None, None, :]
    live_kv = (rows < tokens)[:, None] & (dims < HEAD_DIM)[None, :]

    row_at = rows[:, None, None] * stride_qt + heads[None, :, None] * stride_qh + dims
    out_at = rows[:, None, None] * stride_ot + heads[None, :, None] * stride_oh + dims
    kv_at = rows[:, None] * stride_bt + kv_head * stride_bh + dims[None, :]
    lse = tl.load(lse_ptr + heads[None, :] * stride_lh + rows[:, None], mask=live, other=0.0)
    compute = lse.dtype
    lse = tl.where(lse == float("-inf"), 0.0, lse)
    scale = tl.load(scale_ptr).to(compute)
    q = tl.load(q_ptr + row_at, mask=live3, other=0.0).to(compute)
    dout = tl.load(dout_ptr + row_at, mask=live3, other=0.0).to(compute)
    row_delta = tl.sum(dout * tl.load(out_ptr + out_at, mask=live3, other=0.0).to(compute), axis=2)
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
        pass_at += stride_bp
    dq_at = dq_ptr + rows[:, None, None] * stride_dqt + heads[None, :, None] * stride_dqh + dims
    dq += tl.load(dq_at, mask=live3, other=0.0).to(compute)  # the trunk's share, rounded once
    tl.store(dq_at, dq.to(dq_ptr.dtype.element_ty), mask=live3)


def _launch_shape(q, branch_k):
    """(grid, constexpr keywords) for a [T, Hq, D] query and [P, T, Hkv, D] branch."""
    tokens, q_heads, head_dim = q.shape
    passes, _, kv_heads, _ = branch_k.shape
    group = q_heads // kv_heads
    block_g, block_d = triton.next_power_of_2(group), triton.next_power_of_2(head_dim)
    block_t = max(1, _TILE_ELEMENTS // (block_g * block_d))
    grid = (triton.cdiv(tokens, block_t), kv_heads)
    return grid, dict(PASSES=passes, GROUP=group, BLOCK_G=block_g, HEAD_DIM=head_dim,
                      BLOCK_D=block_d, BLOCK_T=block_t)


@functools.lru_cache(maxsize=8)
def _scale_tensor(scale: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # Passed through memory, not as a kernel scalar (always float32): float64 stays exact. Cached:
    # one fill kernel per (scale, dtype, device), not per call; the kernels only read it.
    return torch.full((1,), scale, dtype=dtype, device=device)


def _rows_last(x: torch.Tensor, rows_dim: int) -> torch.Tensor:
    """x itself where the kernels can address it (unit stride along `rows_dim` for lse, along the
    last dim otherwise), else a contiguous copy."""
    return x if x.stride(rows_dim) == 1 else x.contiguous()


def add_branch(out, lse, q, branch_k, branch_v, scale: float):
    """attention_kernels.add_branch_torch as one kernel: the branch merged into the trunk's out
    [T, Hq, D] and lse [Hq, T] IN PLACE (a copy first only where a layout needs one); returns them."""
    q, branch_k, branch_v = q.contiguous(), branch_k.contiguous(), branch_v.contiguous()
    out, lse = _rows_last(out, -1), _rows_last(lse, 1)
    grid, shape = _launch_shape(q, branch_k)
    _branch_merge_forward[grid](
        q, branch_k, branch_v, out, lse, _scale_tensor(scale, lse.dtype, lse.device), q.shape[0],
        q.stride(0), q.stride(1), branch_k.stride(0), branch_k.stride(1), branch_k.stride(2),
        out.stride(0), out.stride(1), lse.stride(0), **shape)
    return out, lse


def branch_backward(dout, q, branch_k, branch_v, out, lse, scale: float, dq):
    """attention_kernels.branch_backward_torch as one kernel: the branch's share of dq added into
    dq (any float dtype, unit last stride) in place; returns (dbranch_k, dbranch_v)."""
    q, dout = q.contiguous(), dout.contiguous()  # one layout for both
    branch_k, branch_v = branch_k.contiguous(), branch_v.contiguous()
    out, lse = _rows_last(out, -1), _rows_last(lse, 1)
    if dq.stride(-1) != 1:
        raise ValueError(f"dq must have unit stride in its last dim, got strides {dq.stride()}")
    dbranch_k, dbranch_v = torch.empty_like(branch_k), torch.empty_like(branch_v)
    grid, shape = _launch_shape(q, branch_k)
    _branch_backward[grid](
        q, branch_k, branch_v, out, lse, dout, _scale_tensor(scale, lse.dtype, lse.device), dq,
        dbranch_k, dbranch_v, q.shape[0], q.stride(0), q.stride(1), branch_k.stride(0),
        branch_k.stride(1), branch_k.stride(2), out.stride(0), out.stride(1), lse.stride(0),
        dq.stride(0), dq.stride(1), **shape)
    return dbranch_k, dbranch_v
