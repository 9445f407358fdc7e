"""Packed documents: many variable-length sequences in one token stream, as varlen attention wants.

A PackedBatch also says how its rows attend and shift (`attention_cu_seqlens`, `draft_attention`,
`shift`): a batch held whole by this rank attends within its own documents. Context parallelism
holds a zigzag share instead (parallel/context_parallel.py, `ContextShard`), which overrides the
three with the ring and the halo shift; nothing else in a training step changes.
"""
import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist

from titan_draft.infra import _compat
from titan_draft.ops import branch_attention
from titan_draft.ops.attention_kernels import span_rows


@dataclass
class PackedBatch:
    tokens: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, restarting at 0 in every document
    cu_seqlens: torch.Tensor  # [N+1] int32 boundaries of this rank's documents
    loss_mask: torch.Tensor  # [T] bool: rows whose next token is trained (response rows)
    max_seqlen: int

    @property
    def num_tokens(self) -> int:
        return self.tokens.numel()

    def to(self, device) -> "PackedBatch":
        moved = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        moved.update(tokens=self.tokens.to(device), positions=self.positions.to(device),
                     cu_seqlens=self.cu_seqlens.to(device), loss_mask=self.loss_mask.to(device))
        return type(self)(**moved)

    @property
    def attention_cu_seqlens(self) -> torch.Tensor:
        """The document boundaries the policy's attention metadata carries (models/policy.varlen_metadata)."""
        return self.cu_seqlens

    def draft_attention(self, q, k, v, branch_k=None, branch_v=None, scale=None):
        """The draft's trunk + branch attention over these rows (ops/branch_attention.py)."""
        return branch_attention(q, k, v, branch_k, branch_v, cu_seqlens=self.cu_seqlens, scale=scale)

    def documents(self, index: torch.Tensor) -> tuple["PackedBatch", torch.Tensor]:
        """(the documents `index` (ascending) as a batch of their own, their rows in this batch)."""
        rows, lengths = document_rows(self.cu_seqlens, index)
        return PackedBatch(self.tokens[rows], self.positions[rows], cu_seqlens_from_lengths(lengths),
                           self.loss_mask[rows], int(lengths.max())), rows

    def document_lengths(self) -> list[int]:
        """The lengths of the batch's documents (a context-parallel shard: of the whole documents)."""
        return self.cu_seqlens.diff().tolist()

    def shift(self, max_shift: int) -> "DocumentShift":
        """shift(x, d) for d <= max_shift: row t reads row t + d of its document (the draft's targets)."""
        return DocumentShift(self.cu_seqlens)


class DocumentShift:
    """shift(x, d): row t gets x[t + d] when t + d is in the same document, else zeros."""

    def __init__(self, cu_seqlens: torch.Tensor):
        T = int(cu_seqlens[-1])
        doc_end = torch.repeat_interleave(cu_seqlens[1:].long(), cu_seqlens.diff().long())
        self.rows = torch.arange(T, device=cu_seqlens.device)
        self.doc_end = doc_end

    def __call__(self, x: torch.Tensor, d: int) -> torch.Tensor:
        src = self.rows + d
        inside = src < self.doc_end
        out = x[src.clamp(max=len(self.rows) - 1)]
        return out * inside.view(-1, *([1] * (x.dim() - 1))).to(out.dtype)


def cu_seqlens_from_lengths(lengths: list[int] | torch.Tensor) -> torch.Tensor:
    lengths = torch.as_tensor(lengths, dtype=torch.int32)
    return torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))


def document_rows(cu_seqlens: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the rows of documents `index` in order, their lengths) in a batch with boundaries cu_seqlens."""
    index = index.to(cu_seqlens.device).long()
    starts, lengths = cu_seqlens[index].long(), cu_seqlens.diff()[index].long()
    return span_rows(starts, lengths), lengths


def positions_from_cu_seqlens(cu_seqlens: torch.Tensor) -> torch.Tensor:
    lengths = cu_seqlens.diff().long()
    starts = cu_seqlens[:-1].long().repeat_interleave(lengths)
    return torch.arange(int(cu_seqlens[-1]), device=cu_seqlens.device) - starts


def pack(sequences: list[torch.Tensor], loss_masks: list[torch.Tensor]) -> PackedBatch:
    """Concatenate documents; loss_masks[i][t] says whether row t's next-token prediction is trained."""
    lengths = [len(s) for s in sequences]
    cu = cu_seqlens_from_lengths(lengths)
    return PackedBatch(
        tokens=torch.cat(sequences).long(),
        positions=positions_from_cu_seqlens(cu),
        cu_seqlens=cu,
        loss_mask=torch.cat(loss_masks).bool(),
        max_seqlen=max(lengths),
    )


def trained_rows(prompt_lengths: torch.Tensor, lengths: torch.Tensor, width: int) -> torch.Tensor:
    """[N, width] bool: the rows of each document whose next token is trained, the one rule of every
    training path (SFT, packed RL, pipelined RL): from the prompt's last row (it predicts the first
    response token) to the row before the document's last (which has no next token)."""
    columns = torch.arange(width)
    return (columns >= prompt_lengths.cpu()[:, None] - 1) & (columns < lengths.cpu()[:, None] - 1)


def pack_documents(documents: list[torch.Tensor], prompt_lengths: torch.Tensor) -> PackedBatch:
    """Pack prompt + response documents, trained on their response rows (trained_rows)."""
    lengths = torch.tensor([len(doc) for doc in documents])
    mask = trained_rows(torch.as_tensor(prompt_lengths), lengths, int(lengths.max()))
    return pack(list(documents), [m[:n] for m, n in zip(mask, lengths.tolist())])


def microbatch_ranges(lengths: list[int], max_tokens: int, group=None) -> list[range]:
    """Consecutive documents in groups of at most max_tokens tokens (0: one group).

    Greedy, in order. Every rank of `group` (data-parallel ranks with other documents: FSDP's
    collectives need each to run as many forwards and backwards) gets the largest count any of them
    needs: the group of most documents is halved until there are that many. A document longer than
    max_tokens is a group of its own."""
    groups = _greedy_groups(lengths, max_tokens)
    count = len(groups)
    if group is not None and dist.get_world_size(group) > 1:
        most = torch.tensor(count, device=_compat.device())
        dist.all_reduce(most, dist.ReduceOp.MAX, group=group)
        count = int(most)
    if count > len(lengths):
        raise ValueError(f"{count} micro-batches asked of {len(lengths)} documents: give every rank as many "
                         "documents")
    while len(groups) < count:
        widest = max(range(len(groups)), key=lambda g: len(groups[g]))
        g = groups[widest]
        middle = g.start + len(g) // 2
        groups[widest:widest + 1] = [range(g.start, middle), range(middle, g.stop)]
    return groups


def _greedy_groups(lengths: list[int], max_tokens: int) -> list[range]:
    groups, start, tokens = [], 0, 0
    for i, n in enumerate(lengths):
        if i > start and max_tokens and tokens + n > max_tokens:
            groups.append(range(start, i))
            start, tokens = i, 0
        tokens += n
    groups.append(range(start, len(lengths)))
    return groups
