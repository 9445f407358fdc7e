"""Context parallelism for a training step: installed once in the models, each batch sharded.

Like TP and FSDP, `apply_context_parallel(model, cp_mesh, mode)` is applied once to a plain policy
(torchtitan: `[parallelism] context_parallel_degree`, mesh `parallel_dims.get_mesh("cp")`;
titan_draft: `[draft] cp_mode`): its attention becomes the packed ring (or all-gather), which
reads the GLOBAL document boundaries from the attention metadata the model receives. Every batch
is then sharded by `shard_batch_for_cp`, and the shard carries what its rows need:

    local = shard_batch_for_cp(batch, cp_mesh, cfg.draft.cp_mode)   # this rank's zigzag rows
    logits = forward_packed(policy, local)        # metadata = local.attention_cu_seqlens (global)
    shift = local.shift(D)                        # next rows across shard edges (HaloShift)
    pass_logits = draft(emb, taps, local.positions, D, shift, local.draft_attention)
    loss = loss_sum / (count summed over cp)      # the same normaliser as at CP = 1

The gradients of parameters replicated over CP are summed over the CP group by FSDP (torchtitan
shards over dp_shard x cp), as for any data-parallel split of the tokens.
"""
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist

from titan_draft.data.packing import PackedBatch, cu_seqlens_from_lengths
from titan_draft.parallel.cp_attention import MODES, CpGroup, cp_branch_attention
from titan_draft.parallel.halo import HaloShift
from titan_draft.parallel.zigzag import pad_documents, shard_batch


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"draft.cp_mode: '{mode}' is not supported; use one of {MODES}")


def apply_context_parallel(model, cp_mesh, mode: str = "ring") -> None:
    """Make every attention of `model` the packed CP op over `cp_mesh` (once, like TP and FSDP)."""
    from titan_draft.models.policy import install_packed_attention  # the CP ops never need torchtitan

    _check_mode(mode)
    install_packed_attention(model, partial(cp_branch_attention, cp=CpGroup(cp_mesh, mode)))


@dataclass
class ContextShard(PackedBatch):
    """This rank's zigzag rows of a padded packed batch (local cu_seqlens = padded / cp size)."""

    global_cu_seqlens: torch.Tensor  # padded global boundaries: what the ring attention reads
    doc_lengths: torch.Tensor  # real document lengths: shifts read zeros past them, never padding
    cp_mesh: object
    mode: str

    @property
    def attention_cu_seqlens(self) -> torch.Tensor:
        return self.global_cu_seqlens

    def draft_attention(self, q, k, v, branch_k=None, branch_v=None, scale=None):
        return cp_branch_attention(q, k, v, branch_k, branch_v, cu_seqlens=self.global_cu_seqlens,
                                   cp=CpGroup(self.cp_mesh, self.mode), scale=scale)

    def documents(self, index: torch.Tensor) -> tuple["ContextShard", torch.Tensor]:
        """This rank's rows of documents `index` (ascending) as a shard of their own (every rank of the
        CP group must pass the same index), and their rows in this shard."""
        local, rows = super().documents(index)
        index = index.to(self.global_cu_seqlens.device).long()
        return ContextShard(local.tokens, local.positions, local.cu_seqlens, local.loss_mask, local.max_seqlen,
                            global_cu_seqlens=cu_seqlens_from_lengths(self.global_cu_seqlens.diff()[index]),
                            doc_lengths=self.doc_lengths[index.to(self.doc_lengths.device)], cp_mesh=self.cp_mesh,
                            mode=self.mode), rows

    def document_lengths(self) -> list[int]:
        return self.doc_lengths.tolist()

    def shift(self, max_shift: int) -> HaloShift:
        return HaloShift(self.global_cu_seqlens, self.cp_mesh, max_shift, doc_lengths=self.doc_lengths)


def shard_batch_for_cp(batch: PackedBatch, cp_mesh, mode: str = "ring") -> ContextShard:
    """Pad every document to a multiple of 2 x cp size and keep this rank's zigzag rows."""
    _check_mode(mode)
    cp_size, cp_rank = cp_mesh.size(), cp_mesh.get_local_rank()
    padded, _ = pad_documents(batch, 2 * cp_size)
    local = shard_batch(padded, cp_size, cp_rank)
    return ContextShard(local.tokens, local.positions, local.cu_seqlens, local.loss_mask, local.max_seqlen,
                        global_cu_seqlens=padded.cu_seqlens, doc_lengths=batch.cu_seqlens.diff(), cp_mesh=cp_mesh,
                        mode=mode)


def global_count(count: torch.Tensor, cp_mesh) -> torch.Tensor:
    """Sum of a (detached) token or pair count over the CP group: the loss normaliser."""
    total = count.detach().clone()
    dist.all_reduce(total, group=cp_mesh.get_group())
    return total
