"""Shifted inputs across zigzag shard edges (docs/DESIGN.md section 3.8): the context-parallel twin of packing.DocumentShift.

Pass d of the draft at anchor i reads row i + d (token embedding, teacher logits, loss mask) of
the same document. For the last d rows of a local chunk that row lives in the chunk that follows
it globally: on a neighbouring rank, on this rank's other chunk, or (for tiny chunks) further
away. Every rank derives the same exchange plan from the global boundaries, so each knows which
of its rows the others need without asking: one batched P2P exchange of at most d rows per chunk
edge, differentiable (the backward sends the halo's gradient home).
"""
from dataclasses import dataclass

import torch
import torch.distributed as dist

from titan_draft.parallel.cp_attention import zigzag_layout


@dataclass
class ShiftPlan:
    source: torch.Tensor  # [T_local] row of cat([x, halo]) that local row t reads
    inside: torch.Tensor  # [T_local] bool: t + d is in t's document (before its real end)
    send_rows: dict[int, torch.Tensor]  # peer -> local rows that peer needs from us
    recv_counts: dict[int, int]  # peer -> rows we need from it (the halo is these, in peer order)


class _HaloExchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, plan: ShiftPlan, group):
        received = {peer: x.new_empty((n, *x.shape[1:])) for peer, n in plan.recv_counts.items()}
        ops = [dist.P2POp(dist.isend, x.index_select(0, rows).contiguous(), group=group, group_peer=peer)
               for peer, rows in plan.send_rows.items()]
        ops += [dist.P2POp(dist.irecv, buf, group=group, group_peer=peer) for peer, buf in received.items()]
        _exchange(ops)
        ctx.plan, ctx.group, ctx.shape = plan, group, x.shape
        return torch.cat([received[peer] for peer in sorted(received)]) if received else \
            x.new_empty((0, *x.shape[1:]))

    @staticmethod
    def backward(ctx, grad_halo):
        plan = ctx.plan
        grad_x = grad_halo.new_zeros(ctx.shape)
        returned = {peer: grad_halo.new_empty((len(rows), *ctx.shape[1:]))
                    for peer, rows in plan.send_rows.items()}
        pieces = grad_halo.split([plan.recv_counts[peer] for peer in sorted(plan.recv_counts)])
        ops = [dist.P2POp(dist.isend, piece.contiguous(), group=ctx.group, group_peer=peer)
               for peer, piece in zip(sorted(plan.recv_counts), pieces)]
        ops += [dist.P2POp(dist.irecv, buf, group=ctx.group, group_peer=peer) for peer, buf in returned.items()]
        _exchange(ops)
        for peer, rows in plan.send_rows.items():
            grad_x.index_add_(0, rows, returned[peer])
        return grad_x, None, None


def _exchange(ops):
    if ops:
        for request in dist.batch_isend_irecv(ops):
            request.wait()


class HaloShift:
    """shift(x, d) for zigzag-local rows: local row t gets global row g(t) + d when that row is in
    the same document and before its real end (doc_lengths, default: the padded lengths), else
    zeros. x is [T_local, ...]; d in 0..max_shift. Equals DocumentShift on the unsharded rows.
    """

    def __init__(self, cu_seqlens_global: torch.Tensor, cp_mesh, max_shift: int,
                 doc_lengths: torch.Tensor | None = None):
        self.layout = zigzag_layout(cu_seqlens_global, cp_mesh)
        self.group = cp_mesh.get_group()
        self.max_shift = max_shift
        padded = cu_seqlens_global.diff().long().cpu()
        lengths = padded if doc_lengths is None else torch.as_tensor(doc_lengths).long().cpu()
        if lengths.shape != padded.shape or bool((lengths > padded).any()):
            raise ValueError(f"doc_lengths: needs one real length per document, each <= its padded "
                             f"length {padded.tolist()}; got {lengths.tolist()}")
        starts = cu_seqlens_global[:-1].long().cpu()
        self._real_end = torch.repeat_interleave(starts + lengths, padded)  # per global row
        self._plans: dict[int, ShiftPlan] = {}

    def _plan(self, d: int) -> ShiftPlan:
        if d in self._plans:
            return self._plans[d]
        layout, size, rank = self.layout, self.layout.cp_size, self.layout.cp_rank
        total = len(self._real_end)
        rows = [layout.global_rows(j).cpu() for j in range(size)]
        owner = torch.empty(total, dtype=torch.long)
        local_pos = torch.empty(total, dtype=torch.long)
        for j, r in enumerate(rows):
            owner[r], local_pos[r] = j, torch.arange(len(r))

        def needs(j):
            """(source rows, inside, remote) of rank j's local rows."""
            src = rows[j] + d
            inside = src < self._real_end[rows[j]]
            src = src.clamp(max=total - 1)
            return src, inside, inside & (owner[src] != j)

        src, inside, remote = needs(rank)
        source = torch.where(inside & ~remote, local_pos[src], 0)
        recv_counts, offset = {}, len(src)
        for peer in range(size):
            wanted = (remote & (owner[src] == peer)).nonzero().flatten()
            if len(wanted):
                source[wanted] = offset + torch.arange(len(wanted))
                recv_counts[peer], offset = len(wanted), offset + len(wanted)
        send_rows = {}
        for peer in range(size):
            if peer != rank:
                peer_src, _, peer_remote = needs(peer)
                mine = peer_src[peer_remote & (owner[peer_src] == rank)]
                if len(mine):
                    send_rows[peer] = local_pos[mine].to(layout.device)
        plan = ShiftPlan(source.to(layout.device), inside.to(layout.device), send_rows, recv_counts)
        self._plans[d] = plan
        return plan

    def __call__(self, x: torch.Tensor, d: int) -> torch.Tensor:
        if not 0 <= d <= self.max_shift:
            raise ValueError(f"shift: d = {d} is outside 0..max_shift = {self.max_shift}; build the "
                             f"HaloShift with max_shift >= {d} (the draft's ttt_steps)")
        if x.dtype == torch.bool:  # not every backend sends bool
            return self(x.to(torch.uint8), d).bool()
        plan = self._plan(d)
        halo = _HaloExchange.apply(x, plan, self.group)
        out = torch.cat([x, halo]).index_select(0, plan.source)
        return out * plan.inside.view(-1, *([1] * (x.dim() - 1))).to(out.dtype)
