"""Zigzag sharding of packed documents: exact layout, round trip, padding, local batches."""
import pytest
import torch

from titan_draft.data.packing import cu_seqlens_from_lengths, pack
from titan_draft.parallel import (
    ZigzagLayout,
    pad_documents,
    shard_batch,
    zigzag_rows,
    zigzag_shard,
    zigzag_unshard,
)


def test_hand_example_layout():
    # Documents of 8 and 4 rows, CP 2: chunks of 2 and 1 rows; rank r holds chunks r and 3 - r.
    cu = torch.tensor([0, 8, 12], dtype=torch.int32)
    x = torch.arange(12)
    assert zigzag_shard(x, cu, 2, 0).tolist() == [0, 1, 6, 7, 8, 11]
    assert zigzag_shard(x, cu, 2, 1).tolist() == [2, 3, 4, 5, 9, 10]
    # CP 1 keeps everything in order.
    assert zigzag_shard(x, cu, 1, 0).tolist() == list(range(12))


@pytest.mark.parametrize("cp_size", [1, 2, 3, 4, 8])
def test_round_trip_along_any_dim(cp_size):
    lengths = [2 * cp_size * n for n in (3, 1, 5, 2)]
    cu = cu_seqlens_from_lengths(lengths)
    x = torch.randn(2, int(cu[-1]), 3)
    shards = [zigzag_shard(x, cu, cp_size, r, dim=1) for r in range(cp_size)]
    assert all(s.shape == (2, int(cu[-1]) // cp_size, 3) for s in shards)
    assert torch.equal(zigzag_unshard(shards, cu, dim=1), x)


def test_every_row_on_exactly_one_rank():
    cu = cu_seqlens_from_lengths([12, 36, 6])
    rows = torch.cat([zigzag_rows(cu, 3, r) for r in range(3)])
    assert sorted(rows.tolist()) == list(range(54))


def test_rejects_undivisible_documents():
    cu = torch.tensor([0, 8, 13], dtype=torch.int32)
    with pytest.raises(ValueError, match="document 1 has length 5.*pad_documents"):
        zigzag_shard(torch.arange(13), cu, 2, 0)
    with pytest.raises(ValueError, match="cp_rank: 2"):
        zigzag_shard(torch.arange(8), cu[:2], 2, 2)


def test_layout_chunks():
    cu = cu_seqlens_from_lengths([8, 4])
    layout = ZigzagLayout(cu, 2, 1)
    assert layout.local_cu_seqlens.tolist() == [0, 4, 6]
    assert layout.half_cu_seqlens.tolist() == [0, 2, 3]
    assert layout.front_rows.tolist() == [0, 1, 4]
    assert layout.back_rows.tolist() == [2, 3, 5]
    global_rows = layout.global_rows()
    assert global_rows[layout.front_rows].tolist() == [2, 3, 9]  # chunk 1 of each document
    assert global_rows[layout.back_rows].tolist() == [4, 5, 10]  # chunk 2
    rows, cu_k, longest = layout.chunk_range_rows(0, 2)
    assert rows.tolist() == [0, 1, 2, 3, 8, 9] and cu_k.tolist() == [0, 4, 6] and longest == 4


def test_pad_documents_masks_padding_and_keeps_positions():
    batch = pack([torch.tensor([5, 6, 7, 8, 9]), torch.tensor([3, 4, 5])],
                 [torch.tensor([0, 1, 1, 1, 0]), torch.tensor([1, 1, 0])])
    padded, source_rows = pad_documents(batch, 4, pad_token=0)
    assert padded.cu_seqlens.tolist() == [0, 8, 12]
    assert source_rows.tolist() == [0, 1, 2, 3, 4, 8, 9, 10]
    assert padded.tokens.tolist() == [5, 6, 7, 8, 9, 0, 0, 0, 3, 4, 5, 0]
    assert padded.positions.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]
    assert padded.loss_mask.tolist() == [False, True, True, True, False, False, False, False,
                                         True, True, False, False]
    assert padded.max_seqlen == 8

    local = shard_batch(padded, 2, 1)
    assert local.tokens.tolist() == [7, 8, 9, 0, 4, 5]
    assert local.positions.tolist() == [2, 3, 4, 5, 1, 2]
    assert local.cu_seqlens.tolist() == [0, 4, 6] and local.max_seqlen == 4
