"""GRPO loss and gradient against hand formulas, written token by token in plain tensor code."""
import math

import pytest
import torch

from titan_draft.models.policy import build_policy, forward_packed
from titan_draft.ops.linear_logprobs import logits_token_outputs
from titan_draft.rl.grpo import group_advantages, grpo_loss
from titan_draft.rl.step import RolloutBatch

V, P, GROUP, N_PROMPTS, MAX_R = 12, 3, 4, 2, 5
CLIP, KL, EPS = 0.2, 0.1, 1e-6
F64 = torch.float64


def test_group_advantages_hand_example():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    adv = group_advantages(rewards, 4)
    # group 1: mean 1/4, std (unbiased) sqrt((9/16 + 3/16) / 3) = 1/2
    # group 2: mean 1/2, std sqrt(4 * 1/4 / 3) = 1/sqrt(3)
    # group 3: all equal -> 0 (no signal), not nan
    s3 = math.sqrt(3) / 2
    want = [1.5, -0.5, -0.5, -0.5, s3, s3, -s3, -s3, 0.0, 0.0, 0.0, 0.0]
    torch.testing.assert_close(adv, torch.tensor(want), rtol=1e-5, atol=1e-5)
    assert torch.isfinite(adv).all()


def rollouts(seed):
    g = torch.Generator().manual_seed(seed)
    n = N_PROMPTS * GROUP
    prompts = torch.randint(0, V, (N_PROMPTS, P), generator=g).repeat_interleave(GROUP, 0)
    response = torch.randint(0, V, (n, MAX_R), generator=g)
    lengths = torch.randint(1, MAX_R + 1, (n,), generator=g)
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0])  # two mixed groups
    return prompts, torch.cat([prompts, response], 1), lengths, rewards


def hand_terms(tokens, lengths, rewards, W, W_ref, old_shift):
    """Per response token (n, t): the bigram logprob by hand, its advantage, the old/ref logprobs."""
    items = []
    r = rewards.view(-1, GROUP)
    for n in range(len(tokens)):
        grp = r[n // GROUP]
        mean = grp.sum() / GROUP
        std = math.sqrt(((grp - mean) ** 2).sum() / (GROUP - 1))
        adv = (rewards[n] - mean) / (std + EPS)
        for t in range(P - 1, P + int(lengths[n]) - 1):  # rows that predict a response token
            x, y = int(tokens[n, t]), int(tokens[n, t + 1])
            logp = W[x, y] - torch.logsumexp(W[x], 0)
            ref = (W_ref[x, y] - torch.logsumexp(W_ref[x], 0)).detach()
            items.append(dict(x=x, y=y, logp=logp, ref=ref, old=logp.detach() - old_shift(n, t), adv=float(adv)))
    return items


def packed_rollouts(prompts, tokens, lengths):
    """The rollouts packed as the RL step packs them (advantages are not part of the packing)."""
    n = len(tokens)
    return RolloutBatch(tokens, torch.full((n,), prompts.shape[1]), lengths, torch.zeros(n)).packed()


@pytest.mark.parametrize("off_policy", [False, True])
def test_grpo_step_matches_hand_loss_and_gradient(off_policy):
    """A bigram policy (logits = W[x_t]) through RolloutBatch.packed / logits_token_outputs / grpo_loss."""
    torch.manual_seed(0)
    prompts, tokens, lengths, rewards = rollouts(1)
    W = torch.randn(V, V, dtype=F64, requires_grad=True)
    W_ref = W.detach() + 0.3 * torch.randn(V, V, dtype=F64)
    g = torch.Generator().manual_seed(5)
    shifts = (torch.rand(len(tokens), P + MAX_R, generator=g, dtype=F64) - 0.5) if off_policy else None

    def old_shift(n, t):  # old = current - shift: ratio exp(shift) in [0.61, 1.65] -> clipping active
        return float(shifts[n, t]) if off_policy else 0.0

    # the product path
    batch = packed_rollouts(prompts, tokens, lengths)
    logits = W[batch.tokens]
    logprobs = logits_token_outputs(logits, batch.tokens.roll(-1)).logprobs.double()
    ref_logprobs = logits_token_outputs(W_ref[batch.tokens], batch.tokens.roll(-1)).logprobs.double()
    starts = batch.cu_seqlens[:-1].long().repeat_interleave(batch.cu_seqlens.diff().long())
    doc = torch.arange(len(tokens)).repeat_interleave(batch.cu_seqlens.diff().long())
    row_shift = shifts[doc, batch.positions] if off_policy else torch.zeros_like(logprobs)
    old = logprobs.detach() - row_shift
    advantages = group_advantages(rewards, GROUP).double()
    row_adv = advantages.repeat_interleave(batch.cu_seqlens.diff().long())
    loss, stats = grpo_loss(logprobs, old, row_adv, batch.loss_mask, CLIP, ref_logprobs, KL)
    (grad,) = torch.autograd.grad(loss, W)
    assert torch.equal(starts + batch.positions, torch.arange(batch.num_tokens))

    # by hand
    items = hand_terms(tokens, lengths, rewards, W, W_ref, old_shift)
    N = len(items)
    assert N == int(lengths.sum()) == int(batch.loss_mask.sum())
    hand_loss, hand_grad, clipped = 0.0, torch.zeros(V, V, dtype=F64), 0
    for it in items:
        logp, A = it["logp"].detach(), it["adv"]
        ratio = torch.exp(logp - it["old"])
        surrogate = min(ratio * A, min(max(ratio, 1 - CLIP), 1 + CLIP) * A)
        kl = torch.exp(it["ref"] - logp) - (it["ref"] - logp) - 1
        hand_loss += (-surrogate + KL * kl) / N
        # d(per-token)/d logp: the surrogate's gradient is 0 where the clipped side is strictly smaller
        clip_wins = (A > 0 and ratio > 1 + CLIP) or (A < 0 and ratio < 1 - CLIP)
        dlogp = (0.0 if clip_wins else -ratio * A) + KL * (1 - torch.exp(it["ref"] - logp))
        # d logp / d W[x, :] = onehot(y) - softmax(W[x])
        d_row = -torch.softmax(W.detach()[it["x"]], 0)
        d_row[it["y"]] += 1
        hand_grad[it["x"]] += dlogp / N * d_row
        clipped += abs(float(ratio) - 1) > CLIP

    # group_advantages computes in float32 (rewards.float()),
    # so the float64 hand values agree to float32 precision.
    torch.testing.assert_close(loss, torch.as_tensor(hand_loss, dtype=F64), rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(grad, hand_grad, rtol=1e-5, atol=1e-7)
    assert stats["clip_frac"] == pytest.approx(clipped / N)
    if off_policy:
        assert 0 < clipped < N  # clipping is active on some tokens, not all
        clip_wins_any = any(
            (it["adv"] > 0 and math.exp(float(it["logp"] - it["old"])) > 1 + CLIP)
            or (it["adv"] < 0 and math.exp(float(it["logp"] - it["old"])) < 1 - CLIP) for it in items)
        assert clip_wins_any  # and some tokens lose their gradient to the clip
    else:
        assert clipped == 0


def test_grpo_on_tiny_policy_equals_hand_loss_from_its_logits():
    """The real packed policy: grpo_loss over logits_token_outputs' log-probs equals the hand formula applied to its
    logits row by row (row t of a document scores token t+1), parameter gradients included."""
    policy = build_policy("llama3", "tiny_gqa", 32, seed=0)
    prompts, tokens, lengths, rewards = rollouts(2)
    batch = packed_rollouts(prompts, tokens, lengths)
    logits = forward_packed(policy, batch)
    old_shift = torch.linspace(-0.4, 0.4, batch.num_tokens)
    logprobs = logits_token_outputs(logits, batch.tokens.roll(-1)).logprobs
    row_adv = group_advantages(rewards, GROUP).repeat_interleave(batch.cu_seqlens.diff().long())
    loss, _ = grpo_loss(logprobs, logprobs.detach() - old_shift, row_adv, batch.loss_mask, CLIP,
                        logprobs.detach() + 0.1, KL)
    got = torch.autograd.grad(loss, list(policy.parameters()), retain_graph=True)

    terms, starts = [], batch.cu_seqlens.tolist()
    for n in range(len(tokens)):
        for t in range(P - 1, P + int(lengths[n]) - 1):
            row = starts[n] + t
            logp = torch.log_softmax(logits[row], 0)[tokens[n, t + 1]]
            ratio = torch.exp(logp - (logp.detach() - old_shift[row]))
            A = float(row_adv[row])
            surrogate = torch.minimum(ratio * A, ratio.clamp(1 - CLIP, 1 + CLIP) * A)
            ref = logp.detach() + 0.1
            terms.append(-surrogate + KL * (torch.exp(ref - logp) - (ref - logp) - 1))
    hand = torch.stack(terms).mean()
    want = torch.autograd.grad(hand, list(policy.parameters()))
    torch.testing.assert_close(loss, hand, rtol=1e-5, atol=1e-6)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert sum(float(b.abs().sum()) for b in want) > 0
