"""Context parallelism for a co-training step: shard the packed batch, wire the CP ops in.

On each rank of the CP group (torchtitan: `[parallelism] context_parallel_degree`, mesh
`parallel_dims.get_mesh("cp")`; titan_draft: `[draft] cp_mode`):

    local, shift, draft_attn = apply_context_parallel(policy, batch, cp_mesh, cfg.draft.cp_mode,
                                                      max_shift=cfg.draft.ttt_steps)
    logits = forward_packed(policy, local)              # ring attention inside, local rows
    targets = shift(local.tokens, 1)                    # next token, across shard edges
    loss_sum = cross_entropy(logits[m], targets[m], reduction="sum"), m = local.loss_mask
    loss = loss_sum / global_count(m.sum(), cp_mesh)    # same normaliser as at CP = 1
    states = draft.ttt_forward(emb, taps, local.positions, D, shift, draft_attn)

The gradients of parameters replicated over CP are summed over the CP group by FSDP (torchtitan
shards over dp_shard x cp), as for any data-parallel split of the tokens.
"""
import torch
import torch.distributed as dist

from titan_draft.packing import PackedBatch
from titan_draft.parallel.cp_attention import MODES, cp_branch_attention
from titan_draft.parallel.halo import HaloShift
from titan_draft.parallel.zigzag import pad_documents, shard_batch


def apply_context_parallel(policy, batch: PackedBatch, cp_mesh, mode: str = "ring", max_shift: int = 1):
    """Pad and zigzag-shard `batch`, install CP attention into `policy` (None: skip).

    Returns (local_batch, shift, draft_attn_fn): this rank's rows (tokens, positions, loss_mask,
    local cu_seqlens); a HaloShift for shifts 0..max_shift that reads zeros past every document's
    real end (never the padding); and the draft's branch attention over the CP group,
    `draft_attn_fn(q, k, v, branch_k, branch_v)`. Call install_packed_attention(policy) to undo.
    """
    if mode not in MODES:
        raise ValueError(f"draft.cp_mode: '{mode}' is not supported; use one of {MODES}")
    cp_size, cp_rank = cp_mesh.size(), cp_mesh.get_local_rank()
    padded, _ = pad_documents(batch, 2 * cp_size)
    local = shard_batch(padded, cp_size, cp_rank)
    cu_seqlens = padded.cu_seqlens

    def policy_attn(q, k, v, cu_seqlens=None, scale=None):
        # The policy hands over its local boundaries; the ring needs the global ones.
        return cp_branch_attention(q, k, v, None, None, padded.cu_seqlens, cp_mesh, mode, scale=scale)

    def draft_attn(q, k, v, branch_k=None, branch_v=None, scale=None):
        return cp_branch_attention(q, k, v, branch_k, branch_v, cu_seqlens, cp_mesh, mode, scale=scale)

    if policy is not None:
        # Imported here: the policy pulls in torchtitan, which the CP ops themselves never need.
        from titan_draft.models.policy import install_packed_attention

        install_packed_attention(policy, policy_attn)
    shift = HaloShift(cu_seqlens, cp_mesh, max_shift, doc_lengths=batch.cu_seqlens.diff())
    return local, shift, draft_attn


def global_count(count: torch.Tensor, cp_mesh) -> torch.Tensor:
    """Sum of a (detached) token or pair count over the CP group: the loss normaliser."""
    total = count.detach().clone()
    dist.all_reduce(total, group=cp_mesh.get_group())
    return total
