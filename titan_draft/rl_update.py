"""The RL update of a policy held whole on every rank (one process, FSDP2, TP, CP and their mixes).

Its pipelined twin is parallel/pipeline_rl.PipelinedPolicy; both are "policy holders" with the
same surface, which is all train.train_step uses:
  parts / reference_parts   the model parts (here: one) of the policy and of the start-of-RL reference
  optimizer                 torchtitan's OptimizersContainer over `parts`
  forward_backward(batch)   one forward and backward of the GRPO loss and the draft's TTT loss -> StepSums
  rollout_weights(draft)    (policy, draft) to refresh the rollout engine from
  checkpoint_states()       what the job's checkpoint tracks in RL
  holds_draft               whether the draft trains on this rank
  draft_timer               the device time of the draft's part of the step (train_step's draft_time_s)
"""
import copy

import torch
from torch import nn

from titan_draft.cotrain import draft_loss
from titan_draft.grpo import grpo_objective, next_token_logprobs
from titan_draft.models.policy import TapRecorder, forward_packed, job_model_args, policy_from_args
from titan_draft.parallel.context_parallel import apply_context_parallel, shard_batch_for_cp
from titan_draft.parallel.parallelize import cp_mesh, loss_group, loss_scale, parallelize_policy, sum_over_dp
from titan_draft.step import RolloutBatch, StepSums
from titan_draft.timing import DeviceTimer
from torchtitan.components.checkpoint import ModelWrapper
from torchtitan.components.optimizer import OptimizersContainer


def policy_optimizer(parts: list[nn.Module], rl_cfg) -> OptimizersContainer:
    """The RL policy's AdamW over its model parts ([rl] lr, no weight decay)."""
    return OptimizersContainer(parts, torch.optim.AdamW, {"lr": rl_cfg.lr, "weight_decay": 0.0})


class WholePolicy:
    """The policy (and its reference) whole on this rank, parallelized in place by FSDP / TP / CP."""

    holds_draft = True

    def __init__(self, job):
        """job: titan_draft.job.Job, its policy warm-started (it becomes parts[0], updated in place)."""
        cfg, policy, dims = job.cfg, job.policy, job.dims
        self.cfg, self.draft, self.spec, self.dims, self.amp = cfg, job.draft, job.spec, dims, job.amp
        if dims is None:
            reference = copy.deepcopy(policy)
        else:  # FSDP modules cannot be deep-copied: the same layout, then the (sharded) state
            reference = parallelize_policy(policy_from_args(job_model_args(cfg)), dims, cfg)
            reference.load_state_dict(policy.state_dict())
        self.cp_mesh = cp_mesh(dims)
        if self.cp_mesh is not None:
            for model in (policy, reference):
                apply_context_parallel(model, self.cp_mesh, cfg.draft.cp_mode)
        self.parts, self.reference_parts = [policy], [reference.requires_grad_(False)]
        self.optimizer = policy_optimizer(self.parts, cfg.rl)
        self.draft_timer = DeviceTimer(job.device)  # the draft's forward, backward (and train_step's draft step)

    def forward_backward(self, rollouts: RolloutBatch) -> StepSums:
        """One policy forward (GRPO loss; taps and logits for the draft), the reference's forward, the
        draft's TTT loss; both backwards. Nothing of the draft's reaches the policy: its inputs are detached."""
        mode, device = self.cfg.draft.mode, self.draft.fc.weight.device
        (policy,), (reference,) = self.parts, self.reference_parts
        batch = rollouts.packed().to(device)
        if self.cp_mesh is not None:  # this rank's zigzag rows of every document
            batch = shard_batch_for_cp(batch, self.cp_mesh, self.cfg.draft.cp_mode)
        row_advantages = rollouts.advantages.to(device).repeat_interleave(batch.cu_seqlens.diff().long())
        next_tokens = batch.shift(1)(batch.tokens, 1)  # across shard edges under CP

        with self.amp, TapRecorder(policy, self.spec.tap_layers) as taps:
            logits = forward_packed(policy, batch)
        with self.amp, torch.no_grad():
            ref_logprobs = next_token_logprobs(forward_packed(reference, batch), next_tokens)
        # Losses are normalised by counts over all ranks holding rows (FSDP averages: hence the scale).
        num_tokens = sum_over_dp(batch.loss_mask.sum().float(), self.dims, "loss")
        loss, sums = grpo_objective(logits, next_tokens, row_advantages, batch.loss_mask, ref_logprobs,
                                    self.cfg.rl.clip_eps, self.cfg.rl.kl_coef, num_tokens)
        (loss_scale(self.dims) * loss).backward()

        per_pass, total = torch.zeros(0, 3, device=device), torch.zeros((), device=device)
        if mode != "none":
            with self.draft_timer():
                with self.amp, torch.set_grad_enabled(mode == "cotrain"):
                    total, per_pass = draft_loss(self.draft, taps.embeddings(), taps.taps(), logits, batch,
                                                 self.spec, group=loss_group(self.dims),
                                                 documents=rollouts.draft_documents)
                if mode == "cotrain":
                    (loss_scale(self.dims) * self.spec.loss_weight * total).backward()
        policy_sums = torch.cat([sum_over_dp(sums, self.dims, "loss"), num_tokens[None]])
        return StepSums(policy_sums.double(), per_pass, sum_over_dp(total.detach(), self.dims, "loss"))

    def rollout_weights(self, with_draft: bool):
        return self.parts[0], self.draft if with_draft else None

    def checkpoint_states(self) -> dict:
        return {"policy_optimizer": self.optimizer, "start_policy": ModelWrapper(self.reference_parts)}
