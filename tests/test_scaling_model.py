"""The scaling model's formulas against counted quantities (docs/scaling_model.md)."""
import pytest
import torch

from bench import scaling_model as sm
from bench.cp_attention import zigzag_work
from titan_draft.data.packing import cu_seqlens_from_lengths
from titan_draft.parallel import ZigzagLayout

LENGTHS = [7, 13, 1, 40, 5, 22]


@pytest.mark.parametrize("cp", [1, 2, 4, 8])
def test_zigzag_pairs_equal_counted_pairs(cp):
    # bench/cp_attention.py (a) counts chunk-pair blocks; the model's closed form must give every rank the same.
    work, padded_over_real = zigzag_work(LENGTHS, cp)
    per_rank = work.sum(1)
    assert torch.allclose(per_rank, torch.full_like(per_rank, sm.zigzag_pairs_per_rank(LENGTHS, cp)), rtol=0, atol=1e-9)
    assert sm.padding_overhead(LENGTHS, cp) == pytest.approx(padded_over_real, rel=1e-12)


@pytest.mark.parametrize("cp", [2, 4])
def test_zigzag_pairs_equal_mask_count(cp):
    # Independent count: a rank's real rows (ZigzagLayout) against the padded causal same-document mask.
    padded = [sm.padded_length(n, cp) for n in LENGTHS]
    cu = cu_seqlens_from_lengths(padded)
    document = torch.repeat_interleave(torch.arange(len(padded)), cu.diff().long())
    rows = torch.arange(int(cu[-1]))
    visible = (document[:, None] == document[None, :]) & (rows[None, :] <= rows[:, None])
    for rank in range(cp):
        mine = ZigzagLayout(cu, cp, rank).global_rows()
        assert int(visible[mine].sum()) == sm.zigzag_pairs_per_rank(LENGTHS, cp)


def test_communication_volumes():
    tokens, cp, kv_heads, head_dim = 1024, 4, 2, 16
    kv = 2 * tokens // cp * kv_heads * head_dim * 2  # K and V of one shard, bf16
    ring = sm.ring_bytes(tokens, cp, kv_heads, head_dim, b=2)
    assert ring["forward"] == (cp - 1) * kv
    assert ring["backward"] == (cp - 1) * kv + cp * 2 * kv  # fp32 dK/dV: W hops, the last one home
    assert sm.allgather_bytes(tokens, cp, kv_heads, head_dim, b=2)["total"] == 2 * (cp - 1) * kv
    assert sm.ring_bytes(tokens, 1, kv_heads, head_dim)["total"] == 0


def test_pipeline_formulas():
    assert sm.bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert sm.bubble_fraction(4, 8, virtual=2) == pytest.approx(3 / 19)
    assert sm.tap_stages(8, [1, 3, 7], 2) == [2, 1]
    assert sm.tap_stages(8, [1, 3, 7], 2, virtual=2) == [1, 1, 0, 1]
    # stage 0 sends embeddings + its taps; the last stage's taps stay local
    model = sm.tapchannel_overhead(256, 64, 8, [1, 3, 7], schedule=(2, 4, 1), step_s=None)
    assert model["channel_bytes_per_mb"] == 256 * 64 * 3 * 2
    assert model["schedule_bytes_per_mb"] == 2 * 256 * 64 * 2
