"""The draft's side of a training step: its loss from the policy's own forward, and its update.

The policy forward that computes the policy's loss also records the taps; the draft trains on
those detached features with the policy's detached logits as teacher (docs/DESIGN.md section 2).
The draft owns its optimizer, learning rate and gradient clip, so nothing it does reaches the
policy's update. The whole-batch layouts (one process, FSDP/TP/CP) and the warm-up collect the
draft's rows as DraftFeatures and run `draft_backward` (micro-batched `draft_step`); the pipeline's
last stage runs `draft_step` per microbatch. All step through one DraftOptimizer.
"""
import math
import warnings
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from titan_draft.data.packing import PackedBatch, microbatch_ranges
from titan_draft.models.draft import EagleDraft, Teacher, ttt_loss


@dataclass
class CoTrainSpec:
    """The draft's training settings, resolved from the [draft] section (tap layers made explicit)."""

    tap_layers: list[int]
    ttt_steps: int = 3
    pass_decay: float = 0.8
    loss_weight: float = 1.0

    @classmethod
    def from_config(cls, draft_cfg, tap_layers: list[int]) -> "CoTrainSpec":
        return cls(list(tap_layers), draft_cfg.ttt_steps, draft_cfg.pass_decay, draft_cfg.loss_weight)


def draft_loss(draft: EagleDraft, features: "DraftFeatures", spec: CoTrainSpec, *, count: torch.Tensor,
               scale: float = 1.0):
    """(loss, per-pass sums [D, (agree, n, ce_sum)] of these rows): the TTT loss sum x scale / count.

    count: the valid (anchor, pass) pairs the step normalises by (valid_pairs of ALL its documents, over
    every rank and micro-batch); scale: (documents of the step / documents drawn), so that the loss over
    documents drawn uniformly without replacement (sample_documents) is an exactly unbiased estimate of
    the loss over all of them (docs/DESIGN.md 2.5); 1 when every document trains. The batch says how its
    rows attend and shift (whole, or a context-parallel shard)."""
    batch = features.batch
    shift = batch.shift(spec.ttt_steps)
    pass_logits = draft(features.emb.detach(), features.taps.detach(), batch.positions, spec.ttt_steps, shift,
                        batch.draft_attention)
    total, _, stats = ttt_loss(draft, pass_logits, features.teacher, batch.loss_mask, shift, spec.pass_decay)
    per_pass = torch.stack([torch.stack(s) for s in stats]).double()  # exact counts; sums over micro-batches
    return total * scale / count.clamp(min=1), per_pass


@dataclass
class DraftFeatures:
    """What the draft trains on, taken from the policy's forward: the packed documents (or this rank's
    context-parallel shard of them) and, per row, the token embeddings, the taps and the Teacher."""

    batch: PackedBatch
    emb: torch.Tensor
    taps: torch.Tensor
    teacher: Teacher

    def documents(self, index: range | torch.Tensor) -> "DraftFeatures":
        """Documents `index` of the batch (a range, or ascending indices), as features of their own."""
        if isinstance(index, range):
            if len(index) == len(self.batch.cu_seqlens) - 1:
                return self
            index = torch.arange(index.start, index.stop)
        batch, rows = self.batch.documents(index)
        return DraftFeatures(batch, self.emb[rows], self.taps[rows], self.teacher.rows(rows))


def draft_backward(draft: EagleDraft, features: DraftFeatures, spec: CoTrainSpec, *, count: torch.Tensor,
                   scale: float = 1.0, max_tokens: int = 0, group=None, train: bool = True,
                   grad_scale: float = 1.0):
    """The TTT loss of `features` in micro-batches of whole documents (at most max_tokens rows each; 0:
    one), each backpropagated right away when `train` (times grad_scale x spec.loss_weight). Returns the
    detached loss (the sum over micro-batches) and the per-pass sums of these rows. group: the ranks that
    must run as many micro-batches (packing.microbatch_ranges)."""
    total = torch.zeros((), device=features.emb.device)
    per_pass = torch.zeros(spec.ttt_steps, 3, dtype=torch.float64, device=features.emb.device)
    for index in microbatch_ranges(features.batch.document_lengths(), max_tokens, group=group):
        loss, stats = draft_step(draft, features.documents(index), spec, count=count, scale=scale, train=train,
                                 grad_scale=grad_scale)
        total, per_pass = total + loss, per_pass + stats
    return total, per_pass


def draft_step(draft: EagleDraft, features: DraftFeatures, spec: CoTrainSpec, *, count: torch.Tensor,
               scale: float = 1.0, train: bool = True, grad_scale: float = 1.0):
    """draft_loss of `features`, backpropagated at once when `train` (times grad_scale x spec.loss_weight):
    (the detached loss, the per-pass sums). One micro-batch of draft_backward, one pipeline microbatch."""
    with torch.set_grad_enabled(train):
        loss, per_pass = draft_loss(draft, features, spec, count=count, scale=scale)
    if train:
        (grad_scale * spec.loss_weight * loss).backward()
    return loss.detach(), per_pass


def valid_pairs(loss_mask: torch.Tensor, shift, ttt_steps: int) -> torch.Tensor:
    """The number of (anchor, pass) pairs ttt_loss trains on: pass d at row t when row t + d of its
    document is trained."""
    mask = loss_mask.to(torch.float32)
    return sum(shift(mask, d).sum() for d in range(1, ttt_steps + 1))


def sample_documents(num_documents: int, fraction: float, generator: torch.Generator) -> torch.Tensor | None:
    """ceil(fraction x num_documents) document indices drawn uniformly without replacement, ascending; None
    (nothing drawn, the generator untouched) when fraction is 1: every document."""
    if fraction >= 1:
        return None
    drawn = max(1, math.ceil(fraction * num_documents))
    order = torch.randperm(num_documents, generator=generator, device=generator.device)
    return order[:drawn].sort().values.cpu()


def draft_metrics(per_pass: torch.Tensor) -> dict[str, float]:
    """draft_loss (unweighted mean cross-entropy over valid pairs) and draft_acc_pass{d} from the
    per-pass sums [D, (agree, n, ce_sum)] of ttt_loss, summed over ranks (and microbatches)."""
    metrics = {"draft_loss": (per_pass[:, 2].sum() / per_pass[:, 1].sum().clamp(min=1)).item()}
    for d in range(per_pass.shape[0]):
        metrics[f"draft_acc_pass{d + 1}"] = (per_pass[d, 0] / per_pass[d, 1].clamp(min=1)).item()
    return metrics


class DraftOptimizer:
    """AdamW + gradient clipping for the draft, from the [draft] section.

    A non-finite loss skips the update (counted). After `draft.restore_after_skips` skips in a row the
    draft and its optimizer go back to their state before the last applied update (the one that made
    every later loss non-finite), with a warning; counted in `restores`. 0 turns restoring off.
    """

    def __init__(self, draft: EagleDraft, draft_cfg):
        self.draft = draft
        self.params = [p for p in draft.parameters() if p.requires_grad]
        # Fused on GPUs (one kernel for every parameter, as torchtitan's default): the draft is small, so its
        # step is launch-bound.
        fused = all(p.is_cuda for p in self.params) or None
        self.optimizer = torch.optim.AdamW(self.params, lr=draft_cfg.lr, weight_decay=0.0, fused=fused)
        self.max_norm, self.restore_after = draft_cfg.max_norm, draft_cfg.restore_after_skips
        self.skipped = self.restores = self.skips_in_a_row = 0
        # The parameters and AdamW's state before the last applied update (restore_after_skips): buffers
        # kept across updates, refilled by copies; only the parameters where AdamW had no state yet.
        self._before_last_update: list[torch.Tensor] | None = None

    def set_lr(self, lr: float) -> None:
        """The learning rate of the next updates (co-training's, after the warm-up's)."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def step(self, loss: torch.Tensor) -> bool:
        """Apply the gradients already in .grad; returns False (and counts it) when skipped. `loss` must be
        the same on every rank holding a shard of the draft (summed over them), so all skip together."""
        finite = bool(torch.isfinite(loss))
        # Pipeline ranks without the last stage hold the draft but never run it: nothing to apply.
        if finite and any(p.grad is not None for p in self.params):
            if self.restore_after:
                self._snapshot()
            torch.nn.utils.clip_grad_norm_(self.params, self.max_norm)
            self.optimizer.step()
        if finite:
            self.skips_in_a_row = 0
        else:
            self.skipped += 1
            self.skips_in_a_row += 1
            if self.restore_after and self.skips_in_a_row >= self.restore_after:
                self._restore()
        self.optimizer.zero_grad(set_to_none=True)
        return finite

    def _state_tensors(self) -> list[torch.Tensor]:
        """The parameters, then AdamW's state tensors of each (none before its first step), as this rank's
        local tensors (foreach copies have no DTensor rule; a state tensor is sharded as its parameter)."""
        state = self.optimizer.state
        tensors = [*self.params, *(state[p][key] for p in self.params if p in state for key in sorted(state[p]))]
        return [t.to_local() if isinstance(t, DTensor) else t for t in tensors]

    @torch.no_grad()
    def _snapshot(self) -> None:
        """Copy what _restore puts back into the saved buffers: one foreach copy per update, not a clone of
        every tensor and a deep copy of the optimizer's state dict (the draft's step is launch-bound)."""
        tensors = self._state_tensors()
        if self._before_last_update is None or len(self._before_last_update) != len(tensors):
            self._before_last_update = [t.detach().clone() for t in tensors]
        else:
            torch._foreach_copy_(self._before_last_update, tensors)

    @torch.no_grad()
    def _restore(self) -> None:
        """Counted on every rank alike; ranks that never updated the draft (pipeline ranks without the
        last stage) have nothing to put back."""
        if self._before_last_update is not None:
            if len(self._before_last_update) == len(self.params):  # the update that broke it was AdamW's first
                self.optimizer.state.clear()
            torch._foreach_copy_(self._state_tensors(), self._before_last_update)
        self.restores += 1
        self.skips_in_a_row = 0
        warnings.warn(f"draft: {self.restore_after} non-finite draft losses in a row; the draft and its optimizer "
                      "are back to their state before the last update (lower draft.lr if this repeats)",
                      stacklevel=2)

    def metrics(self) -> dict[str, int]:
        return {"draft_updates_skipped": self.skipped, "draft_restores": self.restores}
