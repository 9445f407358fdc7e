"""Sampling and speculative acceptance from logits (what the engine runs) against the dense reference on
probabilities over the whole vocabulary (probs_from_logits, sample, speculative_accept): in float64,
from the same generator state, the same tokens and the same random numbers drawn."""
import pytest
import torch

from titan_draft.rollout.sampling import (RowNoise, accept_drawn, log_normalisers, log_normalisers_by_position,
                                          probs_from_logits, sample, sample_from_logits, speculative_accept,
                                          speculative_accept_from_logits)

V, V_DRAFT, B = 40, 24, 48
SETTINGS = [(0.0, 1.0), (0.7, 1.0), (1.0, 1.0), (1.0, 0.8), (0.7, 0.9)]  # (temperature, top_p)


def noises(seed: int, rows: int):
    """Two RowNoise objects on generators in the same state: a plain batch, or (odd seeds) the rows
    that a compacted batch of rows + 3 still runs, in a shuffled slot order."""
    slots = torch.randperm(rows + 3, generator=torch.Generator().manual_seed(seed))[:rows] if seed % 2 else None
    return [RowNoise(torch.Generator().manual_seed(seed), rows + 3, slots) for _ in range(2)]


def assert_same_draws(noise, ref_noise, temperature):
    """At temperature > 0 both paths consumed the same random numbers; at 0 only the reference draws."""
    if temperature > 0:
        assert torch.equal(noise.generator.get_state(), ref_noise.generator.get_state())


@pytest.mark.parametrize("temperature, top_p", SETTINGS)
@pytest.mark.parametrize("shape", [(B, V), (B, 3, V)])
def test_sample_from_logits_equals_the_reference(temperature, top_p, shape):
    for seed in range(4):
        logits = 3 * torch.randn(shape, generator=torch.Generator().manual_seed(100 + seed), dtype=torch.float64)
        logits[..., 5] = -torch.inf  # a masked token is never drawn
        noise, ref_noise = noises(seed, shape[0])
        tokens = sample_from_logits(logits, temperature, top_p, noise)
        ref = sample(probs_from_logits(logits, temperature, top_p), ref_noise)
        assert torch.equal(tokens, ref)
        assert (tokens != 5).all()
        assert_same_draws(noise, ref_noise, temperature)


def chain(K: int, temperature: float, top_p: float, seed: int):
    """A draft over V_DRAFT of the V target ids (target_ids), its logits and sampled ids [B, K], and
    target logits [B, K+1, V]: rows 0..7 make every draft the target's near-certain choice (all
    accepted, then the bonus), rows 8..15 give the first draft probability 0 (rejected at once), the
    other rows are random (partial chains)."""
    gen = torch.Generator().manual_seed(seed)
    target_ids = torch.randperm(V, generator=gen)[:V_DRAFT].sort().values
    draft_logits = 2 * torch.randn(B, K, V_DRAFT, generator=gen, dtype=torch.float64)
    draft_ids = sample(probs_from_logits(draft_logits, temperature, top_p), gen)
    target_logits = 2 * torch.randn(B, K + 1, V, generator=gen, dtype=torch.float64)
    # Random rows: target close to the draft where the draft is defined, so that chains run on.
    target_logits[8:, :K, target_ids] += 2 * draft_logits[8:]
    tokens = target_ids[draft_ids]
    rows = torch.arange(8)[:, None]
    target_logits[rows, torch.arange(K), tokens[:8]] = 50.0
    target_logits[8:16, 0].scatter_(-1, tokens[8:16, :1], -torch.inf)
    return target_ids, draft_ids, draft_logits, target_logits


@pytest.mark.parametrize("temperature, top_p", SETTINGS)
@pytest.mark.parametrize("K", [1, 2, 3, 4])
def test_speculative_accept_from_logits_equals_the_reference(K, temperature, top_p):
    """The draft's vocabulary is a strict subset of the target's: the reference gets its
    probabilities scattered into the target vocabulary, the new path its logits and the id map."""
    counts = torch.zeros(K + 1, dtype=torch.long)
    for seed in range(3):
        target_ids, draft_ids, draft_logits, target_logits = chain(K, temperature, top_p, seed)
        noise, ref_noise = noises(seed, B)
        num_accepted, tokens = speculative_accept_from_logits(
            draft_ids, draft_logits, target_logits, target_ids=target_ids, temperature=temperature, top_p=top_p,
            rng=noise)
        draft_probs = torch.zeros(B, K, V, dtype=torch.float64)
        draft_probs[..., target_ids] = probs_from_logits(draft_logits, temperature, top_p)
        ref_accepted, ref_tokens = speculative_accept(target_ids[draft_ids], draft_probs,
                                                      probs_from_logits(target_logits, temperature, top_p), ref_noise)
        assert torch.equal(num_accepted, ref_accepted)
        assert torch.equal(tokens, ref_tokens)
        assert_same_draws(noise, ref_noise, temperature)
        assert (num_accepted[:8] == K).all() and (num_accepted[8:16] == 0).all()
        counts += torch.bincount(num_accepted, minlength=K + 1)
    if temperature > 0:  # the random rows stop at every position
        assert (counts > 0).all(), counts


def test_log_normalisers_equal_logsumexp():
    gen = torch.Generator().manual_seed(7)
    logits = 4 * torch.randn(5, 3, V, generator=gen, dtype=torch.float64)
    for temperature in (0.6, 1.0):
        ref = torch.logsumexp(logits / temperature, -1)
        for fn in (log_normalisers, log_normalisers_by_position):
            torch.testing.assert_close(fn(logits, temperature), ref, rtol=0, atol=1e-12)
    # Reduced-precision logits are normalised in float32.
    for fn in (log_normalisers, log_normalisers_by_position):
        low = fn(logits.bfloat16(), 0.6)
        assert low.dtype == torch.float32
        torch.testing.assert_close(low, torch.logsumexp(logits.bfloat16().float() / 0.6, -1), rtol=0, atol=1e-5)


def test_bad_shapes_name_the_argument():
    K = 2
    target_ids = torch.arange(V_DRAFT)
    ids = torch.zeros(B, K, dtype=torch.long)
    draft_logits, target_logits = torch.zeros(B, K, V_DRAFT), torch.zeros(B, K + 1, V)
    accept = speculative_accept_from_logits
    with pytest.raises(ValueError, match="K >= 1"):
        accept(ids[:, :0], draft_logits[:, :0], target_logits[:, :1], target_ids=target_ids, temperature=1.0)
    with pytest.raises(ValueError, match="draft_logits"):
        accept(ids, draft_logits[:, :1], target_logits, target_ids=target_ids, temperature=1.0)
    with pytest.raises(ValueError, match="target_ids"):
        accept(ids, draft_logits, target_logits, target_ids=target_ids[:-1], temperature=1.0)
    with pytest.raises(ValueError, match="target_logits"):
        accept(ids, draft_logits, target_logits[:, :K], target_ids=target_ids, temperature=1.0)
    with pytest.raises(ValueError, match="temperature"):
        accept(ids, draft_logits, target_logits, target_ids=target_ids, temperature=-1.0)


def test_compiled_acceptance_rule_equals_the_eager_rule_one_graph_per_shape():
    """The engine's compiled acceptance rule (`engine.compiled_accept_rule`, static shapes) emits what
    the eager rule emits on the shapes a run meets (row buckets incl. 1, K = 1 and 4, top-p on and
    off) from the same random numbers, in one graph per shape with no graph break (a step shape is a
    row bucket x K: cached_model.RECOMPILE_LIMIT covers those of calls of up to 8,192 rows at K <= 8).
    float64 logits: the fused log-normalisers round differently from the eager ones, by far less
    than any accept test's margin."""
    from torch._dynamo.utils import counters

    from titan_draft.rollout.engine import compiled_accept_rule

    torch._dynamo.reset()
    counters.clear()
    rule = compiled_accept_rule()
    shapes = [(K, top_p, rows) for K in (1, 4) for top_p in (1.0, 0.9) for rows in (B, 1)]
    for K, top_p, rows in shapes:
        target_ids, draft_ids, draft_logits, target_logits = chain(K, 0.8, top_p, seed=K)
        args = draft_ids[:rows], draft_logits[:rows], target_logits[:rows]
        outputs = [speculative_accept_from_logits(*args, target_ids=target_ids, temperature=0.8, top_p=top_p,
                                                  rng=torch.Generator().manual_seed(rows), rule=fn)
                   for fn in (accept_drawn, rule)]
        for eager, compiled in zip(*outputs):
            assert torch.equal(eager, compiled), (K, top_p, rows)
        rule(*args, target_ids, torch.rand(rows, K), torch.ones(rows, V, dtype=torch.float64),
             0.8, top_p)  # a shape seen before: no new graph
    assert counters["stats"]["unique_graphs"] == len(shapes), dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])
