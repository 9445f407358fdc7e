"""GRPO: group-relative advantages and the clipped, token-level policy-gradient loss (docs/DESIGN.md section 6)."""
import torch

from titan_draft.ops.linear_logprobs import TokenOutputs


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """(r - mean of its group) / (std of its group + eps); rewards [N] ordered group by group."""
    r = rewards.float().view(-1, group_size)
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + eps)).flatten()


def grpo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              clip_eps: float, ref_logprobs: torch.Tensor | None = None, kl_coef: float = 0.0,
              num_tokens: torch.Tensor | int | None = None):
    """Clipped surrogate (+ k3 KL to the reference) summed over response tokens / num_tokens.

    All tensors are per row [T]; advantages are the document's advantage on each of its rows.
    num_tokens defaults to the local count of masked rows (pass the global count under data parallel).
    """
    mask = mask.float()
    ratio = torch.exp(logprobs - old_logprobs)
    surrogate = torch.minimum(ratio * advantages, ratio.clamp(1 - clip_eps, 1 + clip_eps) * advantages)
    per_token = -surrogate
    if ref_logprobs is not None and kl_coef > 0:
        log_ratio = ref_logprobs - logprobs
        per_token = per_token + kl_coef * (log_ratio.exp() - log_ratio - 1)
    n = mask.sum() if num_tokens is None else num_tokens
    loss = (per_token * mask).sum() / n
    clipped = ((ratio - 1).abs() > clip_eps).float()
    return loss, {"clip_frac": ((clipped * mask).sum() / mask.sum().clamp(min=1)).item()}


def grpo_objective(outputs: TokenOutputs, advantages: torch.Tensor, ref_logprobs: torch.Tensor | None,
                   clip_eps: float, kl_coef: float, num_tokens: torch.Tensor):
    """The RL step's policy loss over response rows, and its metric sums.

    On-policy: the old log-probabilities are the current ones, detached (one update per batch of
    rollouts). Per response row [R]: the policy head's log-probs and entropy (TokenOutputs), the
    document's advantage, the reference policy's log-probs (None: no KL term, no KL sum). Returns
    (grpo_loss normalised by num_tokens, detached float64 sums [loss, entropy, log p - log p_ref,
    clipped rows]). Every layout and micro-batch calls this one function.
    """
    logprobs = outputs.logprobs
    every_row = torch.ones_like(logprobs, dtype=torch.bool)
    loss, stats = grpo_loss(logprobs, logprobs.detach(), advantages, every_row, clip_eps, ref_logprobs, kl_coef,
                            num_tokens=num_tokens)
    with torch.no_grad():
        kl = (logprobs - ref_logprobs).sum() if ref_logprobs is not None else torch.zeros_like(loss)
        sums = torch.stack([loss.double(), outputs.entropy.double().sum(), kl.double(),
                            torch.tensor(stats["clip_frac"] * len(logprobs), dtype=torch.float64, device=loss.device)])
    return loss, sums
