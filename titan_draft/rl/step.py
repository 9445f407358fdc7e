"""What one RL update reads and returns, for every layout: `RolloutBatch` in, `StepSums` out.

The two policy holders (whole_policy.WholePolicy: one process, FSDP / TP / CP; rl/pipelined_policy.
PipelinedPolicy: pipeline stages) differ only in how they run the forward and backward; both
read a RolloutBatch and return StepSums, from which train.train_step takes its metrics and the
draft's skip decision.
"""
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from titan_draft.data.packing import PackedBatch, pack_documents, trained_rows
from titan_draft.models.cotrain import draft_metrics


@dataclass
class RolloutBatch:
    """One data-parallel replica's rollouts: row n = its prompt in columns 0..prompt_lengths[n]-1, its
    response right after (response_lengths[n] tokens), anything after that."""

    tokens: torch.Tensor  # [N, W] int64
    prompt_lengths: torch.Tensor  # [N] int64
    response_lengths: torch.Tensor  # [N] int64
    advantages: torch.Tensor  # [N] float32, the document's GRPO advantage
    draft_documents: torch.Tensor | None = None  # rows the draft trains on (cotrain.sample_documents); None: all

    @property
    def lengths(self) -> torch.Tensor:
        return self.prompt_lengths + self.response_lengths

    def select(self, documents: range | torch.Tensor) -> "RolloutBatch":
        """Documents `documents` (a range, or ascending indices) as a batch of their own; the draft's
        documents among them renumbered."""
        index = torch.as_tensor(documents)
        drawn = None
        if self.draft_documents is not None:
            drawn = torch.isin(index, self.draft_documents).nonzero().flatten()
        return RolloutBatch(self.tokens[index], self.prompt_lengths[index], self.response_lengths[index],
                            self.advantages[index], draft_documents=drawn)

    def drafted(self) -> torch.Tensor:
        """The indices of the documents the draft trains on (all when draft_documents is None)."""
        return torch.arange(len(self.tokens)) if self.draft_documents is None else self.draft_documents

    def packed(self) -> PackedBatch:
        """The documents packed, trained on their response rows (packing.trained_rows)."""
        return pack_documents([row[:n] for row, n in zip(self.tokens, self.lengths.tolist())], self.prompt_lengths)

    def rows(self, width: int):
        """Whole rows padded at their end to `width` columns (the pipeline's layout): tokens [N, width],
        next tokens [N, width] and the trained rows [N, width] (the same rule as packed())."""
        tokens = torch.nn.functional.pad(self.tokens, (0, width - self.tokens.shape[1]))
        return tokens, tokens.roll(-1, dims=1), trained_rows(self.prompt_lengths, self.lengths, width)


@dataclass
class StepSums:
    """A step's sums over all ranks (data, context and pipeline parallel): what its metrics and the
    draft's skip rule read."""

    policy: torch.Tensor  # float64 [5]: GRPO loss, entropy, log p - log p_ref, clipped rows, response rows
    draft: torch.Tensor  # [D, 3]: per pass (agreeing argmax, valid pairs, cross-entropy); D = 0: no draft
    draft_loss: torch.Tensor  # the draft's loss (summed over the ranks that hold rows): skip its update if not finite
    has_reference: bool = True  # whether log p_ref was computed (else kl_to_start is not reported)

    def flat(self) -> torch.Tensor:
        """float64 [policy (5), draft (D x 3), draft_loss]: the sums as one tensor, for one all-reduce."""
        return torch.cat([self.policy.double(), self.draft.double().flatten(), self.draft_loss.double().reshape(1)])

    @classmethod
    def from_flat(cls, flat: torch.Tensor, passes: int, has_reference: bool) -> "StepSums":
        return cls(flat[:5], flat[5:5 + 3 * passes].view(passes, 3), flat[-1], has_reference)

    def policy_metrics(self) -> dict[str, float]:
        loss, entropy, kl, clipped, rows = self.policy.tolist()
        metrics = {"policy_loss": loss, "entropy": entropy / rows, "clip_frac": clipped / rows}
        if self.has_reference:
            metrics["kl_to_start"] = kl / rows
        return metrics

    def draft_metrics(self) -> dict[str, float]:
        """draft_loss and draft_acc_pass{d} (none without a draft)."""
        return draft_metrics(self.draft) if len(self.draft) else {}


class PolicyHolder(Protocol):
    """What train.train_step and the checkpoint use of a policy holder: whole_policy.WholePolicy (one process,
    FSDP / TP / CP) and rl/pipelined_policy.PipelinedPolicy (pipeline stages) both are one."""

    parts: list[nn.Module]  # the policy's model parts on this rank
    reference_parts: list[nn.Module]  # the start-of-RL reference's, or none when nothing reads log p_ref
    optimizer: object  # torchtitan's OptimizersContainer over `parts`
    holds_draft: bool  # whether the draft trains on this rank
    draft_timer: object  # timing.DeviceTimer of the draft's part of the step (train_step's draft_time_s)

    def forward_backward(self, rollouts: RolloutBatch) -> StepSums:
        """The GRPO loss's and the draft's TTT loss's forwards and backwards over this rank's rollouts."""

    def draft_seconds(self) -> float:
        """The draft's seconds of the step on draft_timer (its forward, backward and optimizer step; under
        pipeline parallelism the last stage's, where the draft runs); the timer starts over."""

    def rollout_weights(self, with_draft: bool) -> tuple:
        """(policy, draft or None): modules whose state_dict() the rollout engine loads."""

    def checkpoint_states(self) -> dict:
        """What the job's checkpoint tracks in RL."""
