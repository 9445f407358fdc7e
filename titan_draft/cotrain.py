"""The draft's side of a training step: its loss from the policy's own forward, and its update.

The policy forward that computes the policy's loss also records the taps; the draft trains on
those detached features with the policy's detached logits as teacher. The draft owns its
optimizer, learning rate and gradient clip, so nothing it does reaches the policy's update.
"""
from functools import partial

import torch
import torch.distributed as dist

from titan_draft.models.draft import DocumentShift, EagleDraft, ttt_loss
from titan_draft.ops import branch_attention
from titan_draft.packing import PackedBatch


def local_draft_inputs(batch: PackedBatch):
    """shift and attention for a batch held whole by this rank (context parallelism has its own)."""
    return DocumentShift(batch.cu_seqlens), partial(_packed_branch_attention, cu_seqlens=batch.cu_seqlens)


def _packed_branch_attention(q, k, v, branch_k, branch_v, cu_seqlens):
    return branch_attention(q, k, v, branch_k, branch_v, cu_seqlens=cu_seqlens)


def draft_loss(draft: EagleDraft, emb: torch.Tensor, taps: torch.Tensor, teacher_logits: torch.Tensor,
               batch: PackedBatch, ttt_steps: int, pass_decay: float, shift=None, attn_fn=None,
               group: dist.ProcessGroup | None = None):
    """(loss, metrics): the TTT loss normalised by the valid (anchor, pass) pairs of all ranks in `group`."""
    if shift is None:
        shift, attn_fn = local_draft_inputs(batch)
    states = draft.ttt_forward(emb.detach(), taps.detach(), batch.positions, ttt_steps, shift, attn_fn)
    total, count, stats = ttt_loss(draft, states, teacher_logits.detach(), batch.loss_mask, shift, pass_decay)
    per_pass = torch.stack([torch.stack(s) for s in stats]).float()  # [D, (agree, n, ce_sum)]
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(count, group=group)
        dist.all_reduce(per_pass, group=group)
    loss = total / count.clamp(min=1)
    return loss, draft_metrics(per_pass)


def draft_metrics(per_pass: torch.Tensor) -> dict[str, float]:
    """draft_loss (unweighted mean cross-entropy over valid pairs) and draft_acc_pass{d} from the
    per-pass sums [D, (agree, n, ce_sum)] of ttt_loss, summed over ranks (and microbatches)."""
    metrics = {"draft_loss": (per_pass[:, 2].sum() / per_pass[:, 1].sum().clamp(min=1)).item()}
    for d in range(per_pass.shape[0]):
        metrics[f"draft_acc_pass{d + 1}"] = (per_pass[d, 0] / per_pass[d, 1].clamp(min=1)).item()
    return metrics


class DraftOptimizer:
    """AdamW + gradient clipping for the draft; a non-finite loss skips the update (and is counted)."""

    def __init__(self, draft: EagleDraft, lr: float, max_norm: float):
        self.params = [p for p in draft.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=lr, weight_decay=0.0)
        self.max_norm = max_norm
        self.skipped = 0

    def step(self, loss: torch.Tensor) -> bool:
        """Apply the gradients already in .grad; returns False (and counts it) when skipped."""
        finite = bool(torch.isfinite(loss))
        if finite:
            torch.nn.utils.clip_grad_norm_(self.params, self.max_norm)
            self.optimizer.step()
        else:
            self.skipped += 1
        self.optimizer.zero_grad(set_to_none=True)
        return finite
