"""Packed documents: many variable-length sequences in one token stream, as varlen attention wants."""
from dataclasses import dataclass

import torch


@dataclass
class PackedBatch:
    tokens: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, restarting at 0 in every document
    cu_seqlens: torch.Tensor  # [N+1] int32 document boundaries
    loss_mask: torch.Tensor  # [T] bool: rows whose next token is trained (response rows)
    max_seqlen: int

    @property
    def num_tokens(self) -> int:
        return self.tokens.numel()

    def to(self, device) -> "PackedBatch":
        return PackedBatch(self.tokens.to(device), self.positions.to(device), self.cu_seqlens.to(device),
                           self.loss_mask.to(device), self.max_seqlen)


def cu_seqlens_from_lengths(lengths: list[int] | torch.Tensor) -> torch.Tensor:
    lengths = torch.as_tensor(lengths, dtype=torch.int32)
    return torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))


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


def pack_rows(rows: torch.Tensor, first_trained_row: int, lengths: torch.Tensor | None = None) -> PackedBatch:
    """Pack a [n, L] batch of documents (each cut to lengths[i]); rows >= first_trained_row are trained,
    except the last row of a document, which has no next token."""
    n, L = rows.shape
    lengths = torch.full((n,), L) if lengths is None else lengths
    seqs, masks = [], []
    for row, length in zip(rows, lengths.tolist()):
        mask = torch.zeros(length, dtype=torch.bool)
        mask[first_trained_row : length - 1] = True
        seqs.append(row[:length])
        masks.append(mask)
    return pack(seqs, masks)
