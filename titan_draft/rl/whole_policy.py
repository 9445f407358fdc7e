"""The RL update of a policy held whole on every rank (one process, FSDP2, TP, CP and their mixes).

Its pipelined twin is rl/pipelined_policy.PipelinedPolicy; both are policy holders
(step.PolicyHolder: parts, reference_parts, optimizer, forward_backward, rollout_weights,
checkpoint_states, holds_draft, draft_timer, draft_seconds), which is all train.train_step uses.

Memory: the step runs in micro-batches of whole documents (rl.max_tokens_per_microbatch) whose
gradients accumulate; the LM head reduces each micro-batch to per-row log-probs (in chunks with
rl.logprob_chunk_size); the draft's rows (embeddings, taps, teacher) are kept detached and the draft
then runs its own micro-batches. Every loss is divided by the whole step's count (all micro-batches,
all ranks), so the sum over micro-batches is the one-batch loss.
"""
import contextlib
import copy

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from titan_draft.data.packing import microbatch_ranges
from titan_draft.infra.timing import DeviceTimer
from titan_draft.models.cotrain import DraftFeatures, draft_backward, valid_pairs
from titan_draft.models.draft import Teacher
from titan_draft.models.policy import (HeadRequest, TapRecorder, cast_parameters, job_model_args, policy_from_args,
                                       token_outputs)
from titan_draft.parallel.context_parallel import apply_context_parallel, shard_batch_for_cp
from titan_draft.parallel.parallelize import (batch_group, compute_dtype, cp_mesh, fsdp_wraps, loss_scale,
                                              parallelize_policy, sum_over_dp)
from titan_draft.rl.grpo import grpo_objective
from titan_draft.rl.step import RolloutBatch, StepSums
from torchtitan.components.checkpoint import ModelWrapper
from torchtitan.components.optimizer import OptimizersContainer


def policy_optimizer(parts: list[nn.Module], rl_cfg) -> OptimizersContainer:
    """The RL policy's AdamW over its model parts ([rl] lr, no weight decay)."""
    return OptimizersContainer(parts, torch.optim.AdamW, {"lr": rl_cfg.lr, "weight_decay": 0.0})


def needs_reference(rl_cfg) -> bool:
    """Whether the step reads log p_ref: the KL penalty, or the kl_to_start metric asked for."""
    return rl_cfg.kl_coef > 0 or rl_cfg.kl_to_start_metric


def reference_dtype(cfg, device, param_dtype: torch.dtype) -> torch.dtype:
    """The reference's parameters: the mixed-precision compute dtype where training forwards run in one
    (bf16 on GPU: the reference only runs forwards), else the policy's own (its forwards then match the
    policy's exactly)."""
    dtype = compute_dtype(cfg.training.mixed_precision_param, device)
    return param_dtype if dtype == torch.float32 else dtype


def reference_policy(policy: nn.Module, job) -> nn.Module:
    """A frozen copy of the policy in reference_dtype, laid out as the policy (FSDP modules cannot be
    deep-copied: the same layout, then the sharded state)."""
    cfg = job.cfg
    dtype = reference_dtype(cfg, job.device, next(policy.parameters()).dtype)
    if not fsdp_wraps(job.dims, cfg.training.mixed_precision_param, job.device) and not job.plan.distributed:
        reference = cast_parameters(copy.deepcopy(policy), dtype)  # a plain module
    else:
        reference = parallelize_policy(cast_parameters(policy_from_args(job_model_args(cfg)), dtype), job.dims, cfg)
        set_model_state_dict(reference, get_model_state_dict(policy))
    return reference.requires_grad_(False)


class WholePolicy:
    """The policy (and its reference) whole on this rank, parallelized in place by FSDP / TP / CP."""

    holds_draft = True

    def __init__(self, job):
        """job: titan_draft.job.Job, its policy warm-started (it becomes parts[0], updated in place)."""
        cfg, policy, dims = job.cfg, job.policy, job.dims
        self.cfg, self.plan, self.draft, self.spec, self.dims = cfg, job.plan, job.draft, job.spec, dims
        self.amp = job.amp
        self.parts = [policy]
        self.reference_parts = [reference_policy(policy, job)] if needs_reference(cfg.rl) else []
        self.cp_mesh = cp_mesh(dims)
        if self.cp_mesh is not None:
            for model in self.parts + self.reference_parts:
                apply_context_parallel(model, self.cp_mesh, cfg.draft.cp_mode)
        self.optimizer = policy_optimizer(self.parts, cfg.rl)
        self.draft_timer = DeviceTimer(job.device)  # the draft's forward, backward (and train_step's draft step)

    def forward_backward(self, rollouts: RolloutBatch) -> StepSums:
        """The policy's micro-batches (GRPO loss; taps and teacher kept for the draft), then the draft's
        (its TTT loss); both backwards. Nothing of the draft's reaches the policy: its inputs are detached."""
        rl, device = self.cfg.rl, self.draft.fc.weight.device
        whole = rollouts.packed()
        # The step's normalisers, over every micro-batch and rank, before any forward.
        num_tokens = sum_over_dp(whole.loss_mask.sum().float().to(device), self.dims)
        policy_sums, draft_pieces = torch.zeros(4, dtype=torch.float64, device=device), []
        for documents in microbatch_ranges(rollouts.lengths.tolist(), rl.max_tokens_per_microbatch,
                                           group=batch_group(self.dims)):
            sums, piece = self._policy_backward(rollouts.select(documents), num_tokens)
            policy_sums += sums
            draft_pieces.append(piece)

        per_pass, total = torch.zeros(0, 3, dtype=torch.float64, device=device), torch.zeros((), device=device)
        if self.plan.speculate:
            with self.draft_timer():
                pairs = sum_over_dp(valid_pairs(whole.loss_mask, whole.shift(self.spec.ttt_steps),
                                                self.spec.ttt_steps).to(device), self.dims)
                features = self._draft_features(rollouts, draft_pieces)
                total, per_pass = draft_backward(
                    self.draft, features, self.spec, count=pairs,
                    scale=len(rollouts.tokens) / len(rollouts.drafted()), max_tokens=rl.max_tokens_per_microbatch,
                    group=batch_group(self.dims), train=self.plan.train_draft, grad_scale=loss_scale(self.dims))
            per_pass = sum_over_dp(per_pass, self.dims, "loss")
        policy_sums = torch.cat([sum_over_dp(policy_sums, self.dims, "loss"), num_tokens[None].double()])
        return StepSums(policy_sums, per_pass, sum_over_dp(total, self.dims, "loss"),
                        has_reference=bool(self.reference_parts))

    def _shard(self, batch):
        """This rank's rows of a packed batch (its zigzag share under context parallelism)."""
        return batch if self.cp_mesh is None else shard_batch_for_cp(batch, self.cp_mesh, self.cfg.draft.cp_mode)

    def _policy_backward(self, micro: RolloutBatch, num_tokens: torch.Tensor):
        """One micro-batch's policy forward and backward: (its detached GRPO sums [4], the draft's pieces
        of it: embeddings, taps and teacher of the rows of its drawn documents, or None)."""
        (policy,) = self.parts
        device, chunk = self.draft.fc.weight.device, self.cfg.rl.logprob_chunk_size
        batch = self._shard(micro.packed().to(device))
        rows = batch.loss_mask.nonzero().flatten()  # the response rows: the only ones the losses read
        targets = batch.shift(1)(batch.tokens, 1)[rows]  # across shard edges under CP
        advantages = micro.advantages.to(device).repeat_interleave(batch.cu_seqlens.diff().long())[rows]
        drafting = self.plan.speculate and len(micro.drafted()) > 0
        request = HeadRequest(rows, targets, chunk)
        if drafting:  # the teacher at the response rows of the drawn documents
            _, draft_rows = batch.documents(micro.drafted().to(device))
            in_draft = torch.zeros(batch.num_tokens, dtype=torch.bool, device=device)
            in_draft[draft_rows] = True
            request.teacher_ids, request.teacher_rows = self.draft.target_ids(), in_draft[rows].nonzero().flatten()
        with self.amp, TapRecorder(policy, self.spec.tap_layers) if drafting else contextlib.nullcontext() as taps:
            out = token_outputs(policy, batch, request)
        ref_logprobs = None
        if self.reference_parts:
            with self.amp, torch.no_grad():
                ref_logprobs = token_outputs(self.reference_parts[0], batch, HeadRequest(rows, targets, chunk)).logprobs
        loss, sums = grpo_objective(out, advantages, ref_logprobs, self.cfg.rl.clip_eps, self.cfg.rl.kl_coef,
                                    num_tokens)
        (loss_scale(self.dims) * loss).backward()
        if not drafting:
            return sums, None
        teacher = Teacher.at(batch.loss_mask[draft_rows], out.teacher_logits, out.teacher_argmax)
        return sums, (taps.embeddings()[draft_rows], taps.taps()[draft_rows], teacher)

    def _draft_features(self, rollouts: RolloutBatch, pieces: list) -> DraftFeatures:
        """The drawn documents as one batch (this rank's shard under CP: zigzag rows are per document, so
        the micro-batches' pieces, in order, are its rows) and their pieces joined."""
        batch = self._shard(rollouts.select(rollouts.drafted()).packed().to(self.draft.fc.weight.device))
        emb, taps, teachers = zip(*(piece for piece in pieces if piece is not None))
        return DraftFeatures(batch, torch.cat(emb), torch.cat(taps), Teacher.cat(teachers))

    def draft_seconds(self) -> float:
        return self.draft_timer.pop_seconds()

    def rollout_weights(self, with_draft: bool):
        return self.parts[0], self.draft if with_draft else None

    def checkpoint_states(self) -> dict:
        states = {"policy_optimizer": self.optimizer}
        if self.reference_parts:
            states["start_policy"] = ModelWrapper(self.reference_parts)
        return states
