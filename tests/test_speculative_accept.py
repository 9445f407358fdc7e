"""The acceptance rule is lossless: emitted tokens follow the target distribution, whatever the draft."""
import pytest
import torch

from titan_draft.rollout import probs_from_logits, sample, speculative_accept

V, K = 8, 3
# 0.999 quantile of the chi-square distribution with V - 1 = 7 degrees of freedom.
CHI2_7_999 = 24.322


def chi_square(samples: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(samples, minlength=len(probs)).double()
    expected = probs.double() * len(samples)
    return float(((counts - expected) ** 2 / expected).sum())


def random_chain(num_rows: int, generator: torch.Generator):
    """Fixed target distributions per position (full support) and a draft that differs from them
    and never proposes tokens 0 and 5; draft tokens sampled from the draft."""
    target = torch.distributions.Dirichlet(torch.ones(V)).sample((K + 1,)) * 0.9 + 0.1 / V
    draft = torch.rand(K, V, generator=generator) ** 3
    draft[:, [0, 5]] = 0
    draft = draft / draft.sum(-1, keepdim=True)
    draft_tokens = torch.multinomial(draft, num_rows, replacement=True, generator=generator).T
    return target, draft, draft_tokens


def test_emitted_tokens_follow_the_target():
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    n = 200_000
    target, draft, draft_tokens = random_chain(n, gen)
    num_accepted, tokens = speculative_accept(draft_tokens, draft.expand(n, K, V), target.expand(n, K + 1, V), gen)
    assert num_accepted.min() >= 0 and num_accepted.max() <= K
    for j in range(K + 1):
        # Token j is emitted whenever drafts 0..j-1 were accepted; given that, it must follow p_j.
        reached = num_accepted >= j
        assert reached.sum() > 5_000
        stat = chi_square(tokens[reached, j], target[j])
        assert stat < CHI2_7_999, f"emitted position {j}: chi-square {stat:.1f} >= {CHI2_7_999}"
    # Tokens the draft never proposes are still emitted, through the residual.
    assert (tokens[:, 0] == 0).any() and (tokens[:, 0] == 5).any()
    # The statistic has power: the raw draft proposals are far from the target.
    assert chi_square(draft_tokens[:, 0], target[0]) > 100 * CHI2_7_999
    # Past the emitted tokens everything is -1.
    position = torch.arange(K + 1)
    assert (tokens[position > num_accepted[:, None]] == -1).all()
    assert (tokens[position <= num_accepted[:, None]] >= 0).all()


def test_sample_follows_the_weights():
    """The exponential race samples rows of (unnormalised) weights exactly; zero weights never win."""
    gen = torch.Generator().manual_seed(4)
    weights = torch.tensor([0.0, 3.0, 1.0, 0.0, 2.0, 0.5, 1.5, 2.0])
    n = 100_000
    draws = sample(weights.expand(n, V), gen)
    assert draws.shape == (n,)
    assert not ((draws == 0) | (draws == 3)).any()
    support = weights > 0
    counts = torch.bincount(draws, minlength=V).double()[support]
    expected = (weights / weights.sum()).double()[support] * n
    # 0.999 quantile of the chi-square distribution with 6 - 1 = 5 degrees of freedom: 20.515.
    assert float(((counts - expected) ** 2 / expected).sum()) < 20.515

def test_all_accepted_then_bonus_from_last_position():
    gen = torch.Generator().manual_seed(1)
    B = 64
    probs = torch.softmax(torch.randn(B, K, V, generator=gen), -1)
    draft_tokens = torch.multinomial(probs.view(-1, V), 1, generator=gen).view(B, K)
    bonus = torch.zeros(B, 1, V)
    bonus[:, 0, 6] = 1.0
    num_accepted, tokens = speculative_accept(draft_tokens, probs, torch.cat([probs, bonus], 1), gen)
    assert (num_accepted == K).all()
    assert torch.equal(tokens[:, :K], draft_tokens)
    assert (tokens[:, K] == 6).all()


def test_all_rejected_emits_from_residual():
    gen = torch.Generator().manual_seed(2)
    B = 64
    draft_probs = torch.zeros(B, K, V)
    draft_probs[..., 1] = 1.0
    draft_tokens = torch.ones(B, K, dtype=torch.long)
    target = torch.zeros(B, K + 1, V)
    target[..., 2], target[..., 3] = 0.5, 0.5  # p(draft token) = 0: always rejected
    num_accepted, tokens = speculative_accept(draft_tokens, draft_probs, target, gen)
    assert (num_accepted == 0).all()
    assert set(tokens[:, 0].tolist()) == {2, 3}
    assert (tokens[:, 1:] == -1).all()


def test_greedy_probabilities_reduce_to_greedy():
    gen = torch.Generator().manual_seed(3)
    B = 32
    target_logits = torch.randn(B, K + 1, V, generator=gen)
    draft_logits = target_logits[:, :K].clone()
    draft_logits[:, 1] = torch.randn(B, V, generator=gen)  # position 1 usually disagrees
    draft_probs = probs_from_logits(draft_logits, 0.0)
    draft_tokens = draft_logits.argmax(-1)
    num_accepted, tokens = speculative_accept(draft_tokens, draft_probs, probs_from_logits(target_logits, 0.0), gen)
    greedy = target_logits.argmax(-1)
    agree = (draft_tokens == greedy[:, :K]).long().cumprod(-1).sum(-1)
    assert torch.equal(num_accepted, agree)
    for b in range(B):
        m = int(num_accepted[b])
        assert torch.equal(tokens[b, : m + 1], greedy[b, : m + 1])


def test_probs_from_logits_top_p_and_greedy():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    torch.testing.assert_close(probs_from_logits(logits, 1.0, 0.8), torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    torch.testing.assert_close(probs_from_logits(logits, 1.0, 0.81), torch.tensor([[0.5, 0.3, 0.15, 0.0]]) / 0.95)
    torch.testing.assert_close(probs_from_logits(logits, 1.0, 0.1), torch.tensor([[1.0, 0.0, 0.0, 0.0]]))
    torch.testing.assert_close(probs_from_logits(logits, 1.0), torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    torch.testing.assert_close(probs_from_logits(logits, 0.0), torch.tensor([[1.0, 0.0, 0.0, 0.0]]))
    sharp = probs_from_logits(logits, 0.5)
    torch.testing.assert_close(sharp, torch.softmax(2 * logits, -1))


@pytest.mark.parametrize("temperature, top_p, match", [(-1.0, 1.0, "temperature"), (1.0, 0.0, "top_p"),
                                                       (1.0, 1.5, "top_p")])
def test_bad_sampling_arguments(temperature, top_p, match):
    with pytest.raises(ValueError, match=match):
        probs_from_logits(torch.zeros(2, 4), temperature, top_p)


def test_bad_shapes():
    p = torch.full((2, K + 1, V), 1.0 / V)
    tokens = torch.zeros(2, K, dtype=torch.long)
    with pytest.raises(ValueError, match="K >= 1"):
        speculative_accept(tokens[:, :0], p[:, :0], p[:, :1])
    with pytest.raises(ValueError, match="draft_tokens"):
        speculative_accept(tokens[0], p[:, :K], p)
    with pytest.raises(ValueError, match="draft_probs"):
        speculative_accept(tokens, p[:, :K - 1], p)
    with pytest.raises(ValueError, match="target_probs"):
        speculative_accept(tokens, p[:, :K], p[:, :K])
    with pytest.raises(ValueError, match="target_probs"):
        speculative_accept(tokens, p[:, :K], p[..., :-1])
