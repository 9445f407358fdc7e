"""The RL update under pipeline parallelism ([parallelism] pipeline_parallel_degree > 1): PipelinedPolicy,
the pipelined twin of whole_policy.WholePolicy (the same surface; train.train_step uses either).

- Warm starts (SFT, draft warm-up) run the whole policy on every rank, as without PP. At the start
  of RL the policy's full weights are split once into this rank's stage parts (torchtitan's
  pipeline_module_split; FQNs unchanged), and each part is parallelized like the whole policy
  (FSDP2 over dp_shard x cp, per part, the torchtitan way; CP attention installed once). The draft
  stays whole on the last stage.
- The reference policy (KL penalty, or the kl_to_start metric when asked for) is split the same way,
  in whole_policy.reference_dtype, and runs forward-only through its own schedule (schedule.eval): each rank
  holds only its stages of it.
- forward_backward: per schedule step (gradient accumulation over groups of rows, at most
  rl.max_tokens_per_microbatch tokens each), reference log-probs, then the co-training schedule with
  the GRPO loss (GRPOLoss below, the same grpo_objective as WholePolicy) on the last stage's head
  outputs (chunked with rl.logprob_chunk_size, as WholePolicy's head), and the draft's TTT forward
  and backward beside it on the documents it trains on (draft.train_fraction: the step's draw, as
  WholePolicy's). Its sums are shared over the loss group and then the pp group, so every rank returns
  the step's StepSums; clipping (over all stages), the optimizer step and the draft's step are train_step's.
- Rollouts need the whole policy on every rank: each pp rank contributes its parts' full state,
  all-gathered over the pp group (the draft's from the last stage).
- Context parallelism: every rollout row is zigzag-sharded over the cp ranks inside each stage
  (pipeline.RowLayout); rows are padded at their end to a multiple of 2 * cp.
"""
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from titan_draft.infra import _compat
from titan_draft.infra.io import full_state_dict
from titan_draft.infra.timing import DeviceTimer
from titan_draft.models.policy import HeadRequest, cast_parameters, job_model_args, policy_from_args
from titan_draft.ops.linear_logprobs import TokenOutputs
from titan_draft.parallel.context_parallel import apply_context_parallel
from titan_draft.parallel.parallelize import (apply_activation_checkpointing, batch_group, cp_mesh, fsdp_wraps,
                                              loss_scale, parallelize_policy, sum_over_dp)
from titan_draft.parallel.pipeline import (
    PipelineSetup,
    build_pipeline_cotrain,
    build_policy_pipeline,
    last_stage_pp_rank,
    split_policy,
)
from titan_draft.rl.grpo import grpo_objective
from titan_draft.rl.step import RolloutBatch, StepSums
from titan_draft.rl.whole_policy import needs_reference, policy_optimizer, reference_dtype
from torchtitan.components.checkpoint import ModelWrapper
from torchtitan.config import TORCH_DTYPE_MAP


# Columns of the RL target [B, S, 5] (token ids stay exact in float32 below 2**24).
NEXT_TOKEN, RESPONSE, ADVANTAGE, REF_LOGPROB, DRAFTED = range(5)


def grpo_target(next_tokens, response_mask, advantages, ref_logprobs, drafted) -> torch.Tensor:
    """The per-row side data of the GRPO loss as one [B, S, 5] tensor, which the schedule splits into
    microbatches along B like labels (torch pipelining takes one target tensor); drafted: whether the
    row's document is one the draft trains on. float32, or the reference log-probs' dtype when wider."""
    dtype = torch.promote_types(ref_logprobs.dtype, torch.float32)
    return torch.stack([x.to(dtype) for x in (next_tokens, response_mask, advantages, ref_logprobs, drafted)], -1)


class GRPOLoss:
    """Policy loss of the RL step on a grpo_target: titan_draft.rl.grpo.grpo_objective (on-policy clipped
    surrogate + optional KL to the reference), normalised by the step's global count of response rows.
    has_reference=False: the target's REF_LOGPROB column is unused (no KL term, no KL sum). The surface of
    a pipeline's policy loss (parallel/pipeline.CrossEntropyLoss)."""

    def __init__(self, clip_eps: float, kl_coef: float, has_reference: bool = True):
        self.clip_eps, self.kl_coef, self.has_reference = clip_eps, kl_coef, has_reference

    def trained(self, target: torch.Tensor) -> torch.Tensor:
        return target[..., RESPONSE] > 0

    def next_tokens(self, target: torch.Tensor) -> torch.Tensor:
        return target[..., NEXT_TOKEN].long()

    def drafted(self, target: torch.Tensor) -> torch.Tensor:
        return target[:, 0, DRAFTED] > 0

    def __call__(self, outputs: TokenOutputs, target: torch.Tensor, count: torch.Tensor):
        """(loss, detached sums [loss, entropy, log p - log p_ref, clipped rows]) of the trained rows'
        head outputs."""
        rows = target.flatten(0, 1)[self.trained(target).flatten()]
        ref_logprobs = rows[:, REF_LOGPROB] if self.has_reference else None
        return grpo_objective(outputs, rows[:, ADVANTAGE], ref_logprobs, self.clip_eps, self.kl_coef, count)


class NextTokenLogprobs:
    """The 'loss' of a forward-only pipeline run: log p(next token) [B, S] of the microbatch (the
    schedule collects it per microbatch), from target = next tokens [B, S]; the head scores every row,
    chunk_size rows at a time (0: full logits)."""

    def __init__(self, chunk_size: int = 0):
        self.chunk_size = chunk_size

    def head_request(self, target: torch.Tensor) -> HeadRequest:
        return HeadRequest(torch.arange(target.numel(), device=target.device), target.flatten(), self.chunk_size)

    def __call__(self, fields: tuple[torch.Tensor, ...], target: torch.Tensor) -> torch.Tensor:
        return TokenOutputs.from_fields(fields).logprobs.view(target.shape)


def pipeline_replicas(dims) -> list[list[int]]:
    """Global ranks of every pipeline (one per non-pp coordinate), in pp order: pp is the outermost
    dimension of torchtitan's world mesh."""
    return torch.arange(dims.world_size).view(dims.pp, -1).T.tolist()


def all_gather_state(local: dict[str, torch.Tensor], group) -> dict[str, torch.Tensor]:
    """Every rank's (disjoint) entries of `local`, on every rank of `group`."""
    metas = [None] * dist.get_world_size(group)
    dist.all_gather_object(metas, {k: (tuple(v.shape), v.dtype) for k, v in local.items()}, group=group)
    me, device = dist.get_rank(group), _compat.device()
    gathered = {}
    for src, meta in enumerate(metas):
        for name, (shape, dtype) in meta.items():
            wire = torch.uint8 if dtype == torch.bool else dtype  # not every backend sends bool
            tensor = local[name].to(device, wire).contiguous() if src == me else \
                torch.empty(shape, dtype=wire, device=device)
            dist.broadcast(tensor, group=group, group_src=src)
            gathered[name] = tensor.to(dtype)
    return gathered


def pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x [N, ...] and zero rows after it up to `rows` (rows that train nothing: they fill a schedule step)."""
    return torch.cat([x, x.new_zeros(rows - len(x), *x.shape[1:])])


class Weights:
    """A gathered state dict in the shape RolloutEngine.load_weights reads a trained module: state_dict()."""

    def __init__(self, state: dict[str, torch.Tensor]):
        self.state = state

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.state


def activation_dtype(cfg, dims) -> torch.dtype | None:
    """What the stages compute in: FSDP's mixed-precision param dtype when FSDP wraps them, else None
    (the parts' own)."""
    if fsdp_wraps(dims, cfg.training.mixed_precision_param, _compat.device()):
        return TORCH_DTYPE_MAP[cfg.training.mixed_precision_param]
    return None


class PipelinedPolicy:
    """The RL policy and its reference as this rank's pipeline stage parts; the draft on the last stage."""

    def __init__(self, job):
        """job: titan_draft.job.Job, its policy warm-started whole on every rank (split here, once)."""
        cfg, dims = job.cfg, job.dims
        self.cfg, self.plan, self.draft, self.spec, self.dims = cfg, job.plan, job.draft, job.spec, dims
        self.pp_mesh = dims.get_mesh("pp")
        self.schedule = cfg.parallelism.pipeline_parallel_schedule
        weights = full_state_dict(job.policy, every_rank=True)
        # The structure only (meta), which split_policy copies into stage parts.
        self.skeleton = policy_from_args(job_model_args(cfg), device="meta")
        dtype = next(job.policy.parameters()).dtype
        self.parts = self._split(weights, dtype, checkpointed=True)
        self.reference_parts = [] if not needs_reference(cfg.rl) else \
            [part.requires_grad_(False) for part in self._split(weights, reference_dtype(cfg, _compat.device(), dtype))]
        self.optimizer = policy_optimizer(self.parts, cfg.rl)
        # The draft's forward and backward (on the last stage, CoTrainLoss) and train_step's draft step.
        self.draft_timer = DeviceTimer(_compat.device())
        self.shape = self.train = self.reference = None  # (row width, microbatches per schedule step) of both

    def _split(self, weights: dict[str, torch.Tensor], dtype: torch.dtype, *,
               checkpointed: bool = False) -> list[nn.Module]:
        """This rank's stage parts of the policy `weights`, in `dtype`, parallelized as the whole policy
        (activation checkpointing for trained parts)."""
        parts = split_policy(self.skeleton, self.pp_mesh, self.schedule)
        device = _compat.device()
        for part in parts:
            part.to_empty(device=device)
            with torch.no_grad():
                part.init_weights(buffer_device=device)  # the non-persistent RoPE table
            part.load_state_dict({name: weights[name] for name in part.state_dict()})
            cast_parameters(part, dtype)
            if checkpointed:
                apply_activation_checkpointing(part, self.cfg)
            parallelize_policy(part, self.dims, self.cfg)
            if cp_mesh(self.dims) is not None:
                apply_context_parallel(part, cp_mesh(self.dims), self.cfg.draft.cp_mode)
        return parts

    def _pipelines(self, width: int, n_microbatches: int):
        """The co-training and the reference pipelines for schedule steps of n_microbatches rows of `width`
        tokens (built on first use)."""
        if self.shape != (width, n_microbatches):
            cfg, d = self.cfg, self.cfg.draft
            chunk = cfg.rl.logprob_chunk_size
            setup = PipelineSetup(pp_mesh=self.pp_mesh, pipelines=pipeline_replicas(self.dims), schedule=self.schedule,
                                  n_microbatches=n_microbatches,
                                  microbatch_size=cfg.parallelism.pipeline_parallel_microbatch_size, seq_len=width,
                                  dp_group=batch_group(self.dims), cp_mesh=cp_mesh(self.dims),
                                  cp_mode=d.cp_mode, dtype=activation_dtype(cfg, self.dims), logprob_chunk_size=chunk)
            policy_loss = GRPOLoss(cfg.rl.clip_eps, cfg.rl.kl_coef, has_reference=bool(self.reference_parts))
            if self.plan.speculate:
                self.train = build_pipeline_cotrain(self.parts, self.draft, self.spec, setup, policy_loss=policy_loss,
                                                    grad_scale=loss_scale(self.dims), train_draft=self.plan.train_draft,
                                                    draft_timer=self.draft_timer)
            else:
                self.train = build_policy_pipeline(self.parts, setup, policy_loss=policy_loss,
                                                   grad_scale=loss_scale(self.dims))
            if self.reference_parts:
                self.reference = build_policy_pipeline(self.reference_parts, setup, loss=NextTokenLogprobs(chunk))
            self.shape = (width, n_microbatches)
        return self.train, self.reference

    def _width(self, rollouts: RolloutBatch) -> int:
        """The step's row width: the widest data-parallel replica's rollouts, padded to a multiple of 2 cp
        (zigzag chunks). The same on every replica, so that all rebuild their pipelines together (the
        TapChannel's groups are created by every rank) and group their rows alike."""
        cp = cp_mesh(self.dims)
        multiple = 1 if cp is None else 2 * cp.size()
        width = torch.tensor(-(-rollouts.tokens.shape[1] // multiple) * multiple, device=_compat.device())
        group = batch_group(self.dims)
        if group is not None:
            dist.all_reduce(width, dist.ReduceOp.MAX, group=group)
        return int(width)

    def _schedule_steps(self, width: int, rows: int) -> tuple[int, int]:
        """(pipeline microbatches per schedule step, schedule steps) for `rows` rows of `width` tokens;
        gradients accumulate over the schedule steps. rl.max_tokens_per_microbatch = 0, or all rows within
        it: one schedule step. Else the fewest steps of at most that many tokens, all of one microbatch
        count, a multiple of pp (what 1F1B and Interleaved1F1B run; config.validate: the limit holds pp
        microbatches); the last step's missing rows are empty (pad_rows). One count, because torch
        pipelining fixes a schedule's count, and initialising a second schedule within the step would drop
        the FSDP gradients accumulated so far (PipelineStage._post_metadata_inference_cleanup)."""
        microbatch, pp = self.cfg.parallelism.pipeline_parallel_microbatch_size, self.pp_mesh.size()
        max_tokens, microbatches = self.cfg.rl.max_tokens_per_microbatch, rows // microbatch
        most = max_tokens // (microbatch * width) // pp * pp
        if max_tokens == 0 or most >= microbatches:
            return microbatches, 1
        steps = -(-microbatches // most)
        return -(-microbatches // (steps * pp)) * pp, steps

    def forward_backward(self, rollouts: RolloutBatch) -> StepSums:
        """Per schedule step (_schedule_steps): the reference's forward-only schedule, then the co-training
        schedule (fwd + bwd) on this replica's rollouts; every rank returns the step's sums over all
        replicas and stages."""
        device = _compat.device()
        width = self._width(rollouts)
        tokens, next_tokens, mask = (x.to(device) for x in rollouts.rows(width))
        n_microbatches, steps = self._schedule_steps(width, len(tokens))
        train, reference = self._pipelines(width, n_microbatches)
        drafted = torch.zeros(len(tokens), dtype=torch.bool, device=device)
        drafted[rollouts.drafted().to(device)] = True
        train.begin_step(mask, drafted)  # the step's normalisers, over every schedule step, before the first
        per_step = n_microbatches * train.setup.microbatch_size
        tokens, next_tokens, mask, drafted, advantages = (pad_rows(x, steps * per_step) for x in (
            tokens, next_tokens, mask, drafted, rollouts.advantages.to(device)))
        row_advantages, row_drafted = advantages[:, None].expand_as(mask), drafted[:, None].expand_as(mask)
        local = train.layout.shard
        for start in range(0, len(tokens), per_step):
            group = slice(start, start + per_step)
            ref_logprobs = None
            if self.reference_parts:
                ref_logprobs = reference.forward_logprobs(tokens[group], next_tokens[group])
                for part in self.reference_parts:  # forward-only: no backward reshards FSDP's gathered parameters
                    for module in part.modules():
                        if isinstance(module, FSDPModule):
                            module.reshard()
            target = None
            if train.has_last:
                if ref_logprobs is None:  # an unused column (GRPOLoss without reference)
                    ref_logprobs = torch.zeros_like(local(mask[group]), dtype=torch.float32)
                target = grpo_target(local(next_tokens[group]), local(mask[group]), local(row_advantages[group]),
                                     ref_logprobs, local(row_drafted[group]))
            train.run(tokens[group], target)

        # The last stage holds the sums: over dp x cp there, then to every pp rank (zeros elsewhere).
        passes = self.spec.ttt_steps if self.plan.speculate else 0
        zero = torch.zeros((), dtype=torch.float64, device=device)
        sums = StepSums(zero.new_zeros(5), zero.new_zeros(passes, 3), zero, bool(self.reference_parts))
        if self.holds_draft:
            loss = train.loss
            sums.policy[:4] = loss.policy_stats
            if passes:
                sums.draft, sums.draft_loss = loss.draft_stats, torch.as_tensor(loss.draft_sum, device=device)
            sums = StepSums.from_flat(sum_over_dp(sums.flat(), self.dims, "loss"), passes, sums.has_reference)
            sums.policy[4] = loss.policy_count  # already global
        flat = sums.flat()
        dist.all_reduce(flat, group=self.pp_mesh.get_group())
        return StepSums.from_flat(flat, passes, sums.has_reference)

    def draft_seconds(self) -> float:
        """The draft's seconds of the step (draft_timer: forward, backward and step), the last stage's,
        on every pp rank (the others hold no draft work)."""
        seconds = torch.tensor(self.draft_timer.pop_seconds(), dtype=torch.float64, device=_compat.device())
        dist.broadcast(seconds, group=self.pp_mesh.get_group(),
                       group_src=last_stage_pp_rank(self.pp_mesh.size(), self.schedule))
        return float(seconds)

    def rollout_weights(self, with_draft: bool):
        """(policy, draft or None) for RolloutEngine.load_weights: the whole policy gathered from every
        pp rank's parts, the draft from the last stage (collectives over the pp group)."""
        group = self.pp_mesh.get_group()
        local = {}
        for part in self.parts:
            local.update(full_state_dict(part, every_rank=True))
        policy = Weights(all_gather_state(local, group))
        if not with_draft:
            return policy, None
        return policy, Weights(all_gather_state(full_state_dict(self.draft, every_rank=True) if self.holds_draft else {},
                                                 group))

    @property
    def holds_draft(self) -> bool:
        """Whether this rank holds the last stage, where the draft trains."""
        return self.pp_mesh.get_local_rank() == last_stage_pp_rank(self.pp_mesh.size(), self.schedule)

    def checkpoint_states(self) -> dict:
        """What the job's checkpoint tracks in RL: the policy's and the reference's parts (this rank's
        FQNs) and the policy optimizer (the draft and its optimizer only on the last stage: JobCheckpoint)."""
        states = {"model": ModelWrapper(self.parts), "policy_optimizer": self.optimizer}
        if self.reference_parts:
            states["start_policy"] = ModelWrapper(self.reference_parts)
        return states
