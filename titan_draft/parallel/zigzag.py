"""Zigzag sharding of packed documents for context parallelism (DESIGN.md section 3).

Every document is padded to a multiple of 2W (W = CP size) and cut into 2W equal chunks; rank r
holds chunks r and 2W-1-r of every document, in document order. Causal attention work is then
the same on every rank, document by document. Positions (RoPE ids) travel with the tokens, and
the local document boundaries are the padded global ones divided by W.
"""
from dataclasses import dataclass
from functools import cached_property

import torch

from titan_draft.data.packing import PackedBatch, cu_seqlens_from_lengths, positions_from_cu_seqlens
from titan_draft.ops.attention_kernels import host_bounds


def _document_chunks(cu_seqlens: torch.Tensor, cp_size: int) -> tuple[list[int], list[int]]:
    """(document starts, chunk length of each document); raises if a length is not divisible."""
    bounds = host_bounds(cu_seqlens)
    starts, chunks = bounds[:-1], []
    for i, (start, end) in enumerate(zip(bounds, bounds[1:])):
        if (end - start) % (2 * cp_size) != 0:
            raise ValueError(f"cu_seqlens: document {i} has length {end - start}, not a multiple of "
                             f"2 * cp_size = {2 * cp_size}; pad it first (titan_draft.parallel."
                             f"pad_documents)")
        chunks.append((end - start) // (2 * cp_size))
    return starts, chunks


def _spans_to_rows(spans: list[tuple[int, int]], device) -> torch.Tensor:
    """Concatenated aranges of [start, end) spans, as one int64 index tensor."""
    lengths = torch.tensor([end - start for start, end in spans], dtype=torch.long)
    starts = torch.tensor([start for start, _ in spans], dtype=torch.long)
    offsets = torch.arange(int(lengths.sum())) - torch.repeat_interleave(lengths.cumsum(0) - lengths, lengths)
    return (torch.repeat_interleave(starts, lengths) + offsets).to(device)


def zigzag_rows(cu_seqlens: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Global row index of each of rank cp_rank's local rows (int64, on cu_seqlens' device)."""
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank: {cp_rank} is out of range 0..{cp_size - 1}")
    starts, chunks = _document_chunks(cu_seqlens, cp_size)
    spans = []
    for start, c in zip(starts, chunks):
        for chunk in (cp_rank, 2 * cp_size - 1 - cp_rank):
            spans.append((start + chunk * c, start + (chunk + 1) * c))
    return _spans_to_rows(spans, cu_seqlens.device)


def zigzag_shard(x: torch.Tensor, cu_seqlens: torch.Tensor, cp_size: int, cp_rank: int, dim: int = 0):
    """Rank cp_rank's rows of x along dim: chunk r then chunk 2W-1-r of every document."""
    rows = zigzag_rows(cu_seqlens, cp_size, cp_rank)
    if x.shape[dim] != int(cu_seqlens[-1]):
        raise ValueError(f"x has {x.shape[dim]} rows along dim {dim}, but cu_seqlens describes "
                         f"{int(cu_seqlens[-1])}")
    return x.index_select(dim, rows.to(x.device))


def zigzag_unshard(shards: list[torch.Tensor], cu_seqlens: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """Inverse of zigzag_shard: the global tensor from every rank's shard (rank order)."""
    cp_size = len(shards)
    rows = torch.cat([zigzag_rows(cu_seqlens, cp_size, r) for r in range(cp_size)])
    return torch.cat(shards, dim).index_select(dim, torch.argsort(rows).to(shards[0].device))


@dataclass(frozen=True)
class ZigzagLayout:
    """Index bookkeeping of one rank's zigzag rows, shared by the CP attention and halo ops.

    Local rows of document i are [lo_i, lo_i + 2 c_i): the front chunk (global chunk r) then the
    back chunk (global chunk 2W-1-r), c_i = padded length / 2W.
    """

    cu_seqlens: torch.Tensor  # padded global boundaries, int32
    cp_size: int
    cp_rank: int

    @cached_property
    def _chunks(self) -> tuple[list[int], list[int]]:
        return _document_chunks(self.cu_seqlens.cpu(), self.cp_size)

    @property
    def device(self):
        return self.cu_seqlens.device

    @cached_property
    def chunk_lengths(self) -> list[int]:
        return self._chunks[1]

    @cached_property
    def max_chunk(self) -> int:
        return max(self.chunk_lengths, default=0)

    @cached_property
    def local_cu_seqlens(self) -> torch.Tensor:
        return (self.cu_seqlens // self.cp_size).to(torch.int32)

    @cached_property
    def half_cu_seqlens(self) -> torch.Tensor:
        """Boundaries of one chunk per document (front halves, back halves, or a remote shard's)."""
        return (self.cu_seqlens // (2 * self.cp_size)).to(torch.int32)

    def _local_chunk_rows(self, back: bool) -> torch.Tensor:
        lo = host_bounds(self.local_cu_seqlens)
        return _spans_to_rows([(start + back * c, start + (back + 1) * c)
                               for start, c in zip(lo, self.chunk_lengths)], self.device)

    @cached_property
    def front_rows(self) -> torch.Tensor:
        """Local indices of the front chunks (global chunk r of every document)."""
        return self._local_chunk_rows(back=False)

    @cached_property
    def back_rows(self) -> torch.Tensor:
        """Local indices of the back chunks (global chunk 2W-1-r of every document)."""
        return self._local_chunk_rows(back=True)

    def global_rows(self, rank: int | None = None) -> torch.Tensor:
        return zigzag_rows(self.cu_seqlens, self.cp_size, self.cp_rank if rank is None else rank)

    def chunk_range_rows(self, first: int, last: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Global rows of chunks first..last-1 of every document, their cu_seqlens and longest run."""
        starts = self._chunks[0]
        spans = [(s + first * c, s + last * c) for s, c in zip(starts, self.chunk_lengths)]
        lengths = [end - start for start, end in spans]
        return _spans_to_rows(spans, self.device), cu_seqlens_from_lengths(lengths).to(self.device), \
            max(lengths, default=0)


def pad_documents(batch: PackedBatch, multiple: int, pad_token: int = 0) -> tuple[PackedBatch, torch.Tensor]:
    """Pad every document at its end to a multiple of `multiple` rows.

    Padding rows get pad_token, positions that continue the document's count (so RoPE ids of real
    rows are unchanged) and loss_mask False. Returns (padded batch, row of each original row in
    the padded batch). Real document ends are batch.cu_seqlens: shifts (HaloShift) take them so that
    shifted inputs and targets read zeros, never padding, past a document's real end.
    """
    if multiple < 1:
        raise ValueError(f"multiple: {multiple} must be >= 1")
    lengths = batch.cu_seqlens.diff().long().cpu()
    padded = (lengths + multiple - 1) // multiple * multiple
    cu = cu_seqlens_from_lengths(padded).to(batch.cu_seqlens.device)
    doc_starts = torch.repeat_interleave(cu[:-1].long().cpu(), lengths)
    source_rows = (doc_starts + positions_from_cu_seqlens(batch.cu_seqlens.cpu())).to(batch.tokens.device)
    total = int(cu[-1])

    def scatter(x, fill):
        out = torch.full((total, *x.shape[1:]), fill, dtype=x.dtype, device=x.device)
        out[source_rows] = x
        return out

    positions = positions_from_cu_seqlens(cu).to(batch.positions.device)
    positions[source_rows] = batch.positions
    padded_batch = PackedBatch(
        tokens=scatter(batch.tokens, pad_token),
        positions=positions,
        cu_seqlens=cu,
        loss_mask=scatter(batch.loss_mask, False),
        max_seqlen=int(padded.max()) if len(padded) else 0,
    )
    return padded_batch, source_rows


def shard_batch(padded: PackedBatch, cp_size: int, cp_rank: int) -> PackedBatch:
    """Rank cp_rank's zigzag rows of a padded batch, with local cu_seqlens = padded / cp_size."""
    tokens, positions, loss_mask = (zigzag_shard(x, padded.cu_seqlens, cp_size, cp_rank)
                                    for x in (padded.tokens, padded.positions, padded.loss_mask))
    return PackedBatch(tokens, positions, (padded.cu_seqlens // cp_size).to(torch.int32), loss_mask,
                       padded.max_seqlen // cp_size)
