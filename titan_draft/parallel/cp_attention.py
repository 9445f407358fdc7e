"""Branch-aware context-parallel attention: the trunk rides the ring, the branch stays local.

Inputs are a rank's zigzag rows (titan_draft.parallel.zigzag). The trunk (causal attention over
the pass-1 keys of each packed document) needs keys from every rank; the branch (the diagonal
keys of passes 2..d) is position-aligned with the rank's own queries, so it never moves. The two
meet through an exact log-sum-exp merge (DESIGN.md section 3). Two ways to bring the keys:

- ring: K/V hop one rank per step (prefetched with batch_isend_irecv). Step 0 is the local
  causal block; at step s <= r all local queries see the FRONT halves of the arriving shard, at
  s > r the BACK halves of the local queries see all of it: every non-first step is half a block.
  Backward replays the ring feeding every block the final out/lse; dK/dV accumulate in fp32 and
  travel with their shard, then hop home once.
- allgather: K/V gathered with a DTensor Shard(0) -> Replicate redistribution (gradients come back
  reduce-scattered by autograd), then three local blocks per rank: the local causal block, all
  local queries vs chunks 0..r-1 of every document, and the back queries vs chunks r+1..2W-2-r.
  Simpler and fewer launches; O(total tokens) K/V memory per rank.

titan_draft.ops.branch_attention is the single-process reference both equal.
"""
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from titan_draft.ops.attention_kernels import (
    Varlen,
    add_branch,
    attn_backward,
    attn_forward,
    branch_grads,
    host_bounds,
    merge_attn,
    outside_autocast,
)
from titan_draft.ops.branch_attention import _validate as validate_branch_inputs
from titan_draft.parallel.zigzag import ZigzagLayout

MODES = ("ring", "allgather")


@dataclass(frozen=True)
class CpGroup:
    """The context-parallel ranks (a 1-D DeviceMesh) and how attention brings keys across them:
    mode "ring" or "allgather" (module docstring)."""

    mesh: DeviceMesh
    mode: str = "ring"

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode: '{self.mode}' is not a CP attention mode; use one of {MODES}")


@dataclass(frozen=True)
class Block:
    """One varlen attention call: queries q[q_rows] vs keys k[kv_rows] (None = all rows)."""

    q_rows: torch.Tensor | None
    kv_rows: torch.Tensor | None
    varlen: Varlen


def _rows(x, rows, dim=0):
    return x if rows is None else x.index_select(dim, rows)


def _block_forward(q, k, v, block: Block, scale):
    return attn_forward(_rows(q, block.q_rows), _rows(k, block.kv_rows), _rows(v, block.kv_rows),
                        block.varlen, scale)


def _merge_rows(out, lse, block_out, block_lse, rows):
    """Merge a block's partial result into the accumulators at `rows` (None = all rows)."""
    if out is None:  # first block: it covers all rows (the local causal block)
        return block_out.to(block_lse.dtype), block_lse
    if rows is None:
        return merge_attn(out, lse, block_out, block_lse)
    merged_out, merged_lse = merge_attn(out[rows], lse[:, rows], block_out, block_lse)
    return out.index_copy(0, rows, merged_out), lse.index_copy(1, rows, merged_lse)


def _block_backward(dout, q, k, v, out, lse, block: Block, scale):
    rows = block.q_rows
    return attn_backward(_rows(dout, rows), _rows(q, rows), _rows(k, block.kv_rows),
                         _rows(v, block.kv_rows), _rows(out, rows), _rows(lse, rows, dim=1),
                         block.varlen, scale)


def _accumulate(acc, grad, rows):
    if rows is None:
        acc += grad
    else:
        acc.index_add_(0, rows, grad.to(acc.dtype))


def _finish_forward(ctx, inputs, out, lse, scale):
    """Merge the branch as one more LSE step; save what backward needs; return (out, lse).
    inputs: forward's (q, k, v, branch_k, branch_v)."""
    q, k, v, branch_k, branch_v = inputs
    out, lse = add_branch(out, lse, q, branch_k, branch_v, scale)
    out = out.to(q.dtype)
    ctx.save_for_backward(q, k, v, branch_k, branch_v, out, lse)
    ctx.scale = scale
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)  # lse's gradient stays None: no zeros made for it
    return out, lse


# ---------------------------------------------------------------------------------------------
# ring
# ---------------------------------------------------------------------------------------------


def ring_blocks(layout: ZigzagLayout) -> list[Block]:
    """The block of each ring step on this rank; step s holds the shard of rank (r - s) mod W."""
    full, half = layout.local_cu_seqlens, layout.half_cu_seqlens
    longest, chunk = 2 * layout.max_chunk, layout.max_chunk
    blocks = [Block(None, None, Varlen.packed_causal(full, longest))]
    for step in range(1, layout.cp_size):
        if step <= layout.cp_rank:  # the shard comes from an earlier rank: its front chunks are visible
            blocks.append(Block(None, layout.front_rows, Varlen(full, half, longest, chunk, False, {})))
        else:  # a later rank: only our back chunks see it, all of it
            blocks.append(Block(layout.back_rows, None, Varlen(half, full, chunk, longest, False, {})))
    return blocks


def _ring_pass(send: torch.Tensor, group, rank: int, size: int):
    """Post send-to-next / receive-from-previous; returns (receive buffer, requests)."""
    recv = torch.empty_like(send)
    ops = [dist.P2POp(dist.isend, send, group=group, group_peer=(rank + 1) % size),
           dist.P2POp(dist.irecv, recv, group=group, group_peer=(rank - 1) % size)]
    return recv, dist.batch_isend_irecv(ops)


def _wait(requests):
    for request in requests:
        request.wait()


class _Ring(NamedTuple):
    """This rank on the ring: its zigzag rows and the process group the K/V shards hop over."""

    layout: ZigzagLayout
    group: dist.ProcessGroup


class _RingBranchAttention(torch.autograd.Function):
    @staticmethod
    @outside_autocast
    def forward(ctx, q, k, v, branch_k, branch_v, ring: _Ring, scale):
        layout, group = ring
        rank, size = layout.cp_rank, layout.cp_size
        blocks = ring_blocks(layout)
        kv = torch.stack([k, v])
        out = lse = None
        for step, block in enumerate(blocks):
            if step + 1 < size:  # prefetch the next shard while this one computes
                next_kv, requests = _ring_pass(kv, group, rank, size)
            block_out, block_lse = _block_forward(q, kv[0], kv[1], block, scale)
            out, lse = _merge_rows(out, lse, block_out, block_lse, block.q_rows)
            if step + 1 < size:
                _wait(requests)
                kv = next_kv
        ctx.ring, ctx.blocks = ring, blocks  # the backward reuses the blocks' memos
        return _finish_forward(ctx, (q, k, v, branch_k, branch_v), out, lse, scale)

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, branch_k, branch_v, out, lse = ctx.saved_tensors
        (layout, group), scale = ctx.ring, ctx.scale
        rank, size = layout.cp_rank, layout.cp_size
        acc_dtype = lse.dtype
        dq = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
        kv = torch.stack([k, v])
        dkv_requests = None
        for step, block in enumerate(ctx.blocks):
            if step + 1 < size:
                next_kv, kv_requests = _ring_pass(kv, group, rank, size)
            dq_block, dk_block, dv_block = _block_backward(dout, q, kv[0], kv[1], out, lse, block, scale)
            _accumulate(dq, dq_block.to(acc_dtype), block.q_rows)
            # Gradients of the shard we hold: ours, plus what the ranks before us added (in flight).
            dkv = torch.zeros(kv.shape, dtype=acc_dtype, device=kv.device)
            _accumulate(dkv.transpose(0, 1), torch.stack([dk_block, dv_block], dim=1), block.kv_rows)
            if dkv_requests is not None:
                _wait(dkv_requests)
                dkv += dkv_in
            if size > 1:  # after the last step this is the hop home
                dkv_in, dkv_requests = _ring_pass(dkv, group, rank, size)
            if step + 1 < size:
                _wait(kv_requests)
                kv = next_kv
        if size > 1:
            _wait(dkv_requests)
            dkv = dkv_in
        dbranch_k, dbranch_v = branch_grads(dq, dout, q, branch_k, branch_v, out, lse, scale)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), dbranch_k, dbranch_v, None, None


# ---------------------------------------------------------------------------------------------
# allgather
# ---------------------------------------------------------------------------------------------


def allgather_blocks(layout: ZigzagLayout) -> list[Block]:
    """Blocks of the local queries against the gathered K/V (rank-major rows: rank j's shard at
    [j*T_local, (j+1)*T_local)): local causal, all vs chunks < r, back vs chunks r+1..2W-2-r."""
    rank, size = layout.cp_rank, layout.cp_size
    local_tokens = int(layout.local_cu_seqlens[-1])
    gathered_row = torch.argsort(torch.cat([layout.global_rows(j) for j in range(size)]))
    full, half = layout.local_cu_seqlens, layout.half_cu_seqlens
    longest, chunk = 2 * layout.max_chunk, layout.max_chunk
    own = torch.arange(rank * local_tokens, (rank + 1) * local_tokens, device=layout.device)
    blocks = [Block(None, own, Varlen.packed_causal(full, longest))]
    if rank > 0:
        rows, cu, max_k = layout.chunk_range_rows(0, rank)
        blocks.append(Block(None, gathered_row[rows], Varlen(full, cu, longest, max_k, False, {})))
    if rank < size - 1:
        rows, cu, max_k = layout.chunk_range_rows(rank + 1, 2 * size - 1 - rank)
        blocks.append(Block(layout.back_rows, gathered_row[rows], Varlen(half, cu, chunk, max_k, False, {})))
    return blocks


def gather_rows(x: torch.Tensor, cp_mesh) -> torch.Tensor:
    """All ranks' rows of x, rank-major; the backward reduce-scatters the gradient."""
    gathered = DTensor.from_local(x, cp_mesh, [Shard(0)]).redistribute(cp_mesh, [Replicate()])
    return gathered.to_local(grad_placements=[Partial()])


class _GatheredBranchAttention(torch.autograd.Function):
    @staticmethod
    @outside_autocast
    def forward(ctx, q, k_all, v_all, branch_k, branch_v, layout, scale):
        out = lse = None
        ctx.blocks = allgather_blocks(layout)  # the backward reuses the blocks' memos
        for block in ctx.blocks:
            block_out, block_lse = _block_forward(q, k_all, v_all, block, scale)
            out, lse = _merge_rows(out, lse, block_out, block_lse, block.q_rows)
        return _finish_forward(ctx, (q, k_all, v_all, branch_k, branch_v), out, lse, scale)

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k_all, v_all, branch_k, branch_v, out, lse = ctx.saved_tensors
        acc_dtype = lse.dtype
        dq = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
        dk = torch.zeros(k_all.shape, dtype=acc_dtype, device=q.device)
        dv = torch.zeros(v_all.shape, dtype=acc_dtype, device=q.device)
        for block in ctx.blocks:
            dq_block, dk_block, dv_block = _block_backward(dout, q, k_all, v_all, out, lse, block,
                                                           ctx.scale)
            _accumulate(dq, dq_block.to(acc_dtype), block.q_rows)
            _accumulate(dk, dk_block, block.kv_rows)
            _accumulate(dv, dv_block, block.kv_rows)
        dbranch_k, dbranch_v = branch_grads(dq, dout, q, branch_k, branch_v, out, lse, ctx.scale)
        return (dq.to(q.dtype), dk.to(k_all.dtype), dv.to(v_all.dtype), dbranch_k, dbranch_v,
                None, None)


# ---------------------------------------------------------------------------------------------
# entry point
# ---------------------------------------------------------------------------------------------


@lru_cache(maxsize=16)
def _cached_layout(bounds: tuple[int, ...], device: str, cp_size: int, cp_rank: int) -> ZigzagLayout:
    layout = ZigzagLayout(torch.tensor(bounds, dtype=torch.int32, device=device), cp_size, cp_rank)
    layout.chunk_lengths  # raises here if a document is not a multiple of 2 * cp_size
    return layout


def zigzag_layout(cu_seqlens: torch.Tensor, cp_mesh) -> ZigzagLayout:
    """This rank's layout for the global padded cu_seqlens (cached: every layer asks again)."""
    if cp_mesh is None or cp_mesh.ndim != 1:
        raise ValueError("cp_mesh: needs a 1-D DeviceMesh over the context-parallel ranks, e.g. "
                         "init_device_mesh('cuda', (cp,)) or parallel_dims.get_mesh('cp')")
    if cu_seqlens is None or cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1:
        raise ValueError("cu_seqlens: needs the GLOBAL padded document boundaries as a 1-D int32 "
                         "tensor (see titan_draft.parallel.pad_documents)")
    return _cached_layout(host_bounds(cu_seqlens), str(cu_seqlens.device), cp_mesh.size(),
                          cp_mesh.get_local_rank())


def cp_branch_attention(q, k, v, branch_k=None, branch_v=None, *, cu_seqlens, cp: CpGroup, scale=None):
    """branch_attention over zigzag-sharded rows: out [T_local, Hq, D], lse [Hq, T_local].

    q/k/v/branch_k/branch_v are this rank's zigzag rows (shapes as branch_attention with
    T = T_local); cu_seqlens are the GLOBAL padded boundaries (every document a multiple of
    2 * cp size); cp the CP ranks and mode, e.g. CpGroup(cp_mesh, "ring"). Gradients flow to q, k,
    v, branch_k, branch_v as in branch_attention; lse is non-differentiable.
    """
    layout = zigzag_layout(cu_seqlens, cp.mesh)
    local_tokens = host_bounds(cu_seqlens)[-1] // layout.cp_size
    if q.dim() < 1 or q.shape[0] != local_tokens:
        raise ValueError(f"q: {q.shape[0] if q.dim() else 0} rows, but the global cu_seqlens give "
                         f"{local_tokens} per rank; pass this rank's zigzag rows (zigzag_shard) with "
                         f"the GLOBAL padded cu_seqlens")
    validate_branch_inputs(q, k, v, branch_k, branch_v, layout.local_cu_seqlens)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if cp.mode == "ring":
        ring = _Ring(layout, cp.mesh.get_group())
        return _RingBranchAttention.apply(q, k, v, branch_k, branch_v, ring, scale)
    k_all, v_all = gather_rows(k, cp.mesh), gather_rows(v, cp.mesh)
    return _GatheredBranchAttention.apply(q, k_all, v_all, branch_k, branch_v, layout, scale)
