"""The main job: SFT warm start -> draft warm start -> RL (GRPO) with speculative rollouts and
online draft co-training. Run it with ./run_train.sh (torchrun); read it top to bottom.

One RL step:
  1. rollouts: the speculative engine samples group_size answers per prompt (draft proposes,
     policy verifies; lossless, so the samples follow the policy exactly);
  2. rewards -> group-relative advantages;
  3. ONE policy forward over the packed rollouts records the taps; from it come the policy's GRPO
     loss and the draft's TTT loss (teacher = the policy's detached logits, inputs = detached taps);
  4. separate optimizers and clips for policy and draft; the draft loss never reaches the policy;
  5. the engine's copies are refreshed from the updated weights.
[draft] mode = "cotrain" | "frozen" | "none" switches step 3's draft update / speculation off.
With pipeline parallelism, steps 3-4 run through the pipeline schedule (policy stages over the pp
ranks, the draft on the last): titan_draft/parallel/pipeline_rl.py.
"""
import contextlib
import copy
import os
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from titan_draft import _compat
from titan_draft.checkpoint import IN_RL, SFT_DONE, WARMUP_DONE, JobCheckpoint, OptimizerState
from titan_draft.config import parse_config, tap_layers, validate
from titan_draft.cotrain import DraftOptimizer, draft_loss
from titan_draft.grpo import group_advantages, grpo_objective, next_token_logprobs, rollout_batch
from titan_draft.metrics import MetricsLogger
from titan_draft.models.draft import EagleDraft, draft_args_for
from titan_draft.models.policy import TapRecorder, build_policy, forward_packed, model_args
from titan_draft.parallel import apply_context_parallel
from titan_draft.parallel.parallelize import (build_parallel_dims, cp_mesh, describe_rank, dp_rank_and_degree,
                                              init_process_group, loss_group, loss_scale, mean_over_dp,
                                              parallelize_draft, parallelize_policy, set_collective_timeout,
                                              sum_over_dp, compute_dtype, training_autocast)
from titan_draft.parallel.pipeline_rl import PipelinedPolicy
from titan_draft.rollout import RolloutEngine
from titan_draft.tasks import Prompts, Task, build_task
from titan_draft.warmstart import draft_vocab_from_data, sft_policy, warmup_draft
from torchtitan.components.checkpoint import ModelWrapper


def build_models(cfg, device):
    """Policy and draft, initialised from the config's seed."""
    max_len = cfg.training.seq_len
    args = model_args(cfg.model.name, cfg.model.flavor, max_len)
    policy = build_policy(cfg.model.name, cfg.model.flavor, max_len, seed=cfg.debug.seed)
    layers = tap_layers(cfg, args.n_layers)
    d = cfg.draft
    draft = EagleDraft(draft_args_for(args, len(layers), d.vocab_size, d.n_heads, d.n_kv_heads)).to(device)
    draft.init_weights()
    return args, policy, draft, layers


@dataclass
class RLState:
    """Everything an RL step reads or updates."""
    cfg: object
    task: Task
    policy: torch.nn.Module | None  # None under pipeline parallelism: `pipeline` holds its stages
    start_policy: torch.nn.Module | None  # reference for the KL metric / penalty (ditto)
    draft: EagleDraft
    policy_opt: torch.optim.Optimizer
    draft_opt: DraftOptimizer
    engine: RolloutEngine
    layers: list[int]
    device: torch.device
    data_gen: torch.Generator
    rollout_gen: torch.Generator
    dims: object = None  # torchtitan ParallelDims of a multi-process run
    pipeline: PipelinedPolicy | None = None  # the policy's and the reference's stages under PP
    amp: contextlib.AbstractContextManager = contextlib.nullcontext()  # the training forwards' precision

    @classmethod
    def create(cls, cfg, args, task, policy, draft, draft_opt, layers, device, data_gen, rollout_gen, dims=None):
        rl, precision = cfg.rl, cfg.training.mixed_precision_param
        # Rollouts run in the training forwards' precision: bf16 on GPU by default, float32 on CPU.
        engine = RolloutEngine(args, draft.args if cfg.draft.mode != "none" else None, layers,
                               max_batch_size=rl.prompts_per_step * rl.group_size, max_seq_len=cfg.training.seq_len,
                               device=device, dtype=compute_dtype(precision, device))
        amp = training_autocast(precision, device, dims)
        if dims is not None and dims.pp_enabled:  # the warm-started policy becomes this rank's stages
            pipeline = PipelinedPolicy(cfg, policy, draft, layers, dims)
            return cls(cfg, task, None, None, draft, pipeline.optimizer, draft_opt, engine, layers, device, data_gen,
                       rollout_gen, dims, pipeline, amp)
        if dims is None:
            start_policy = copy.deepcopy(policy)
        else:  # FSDP modules cannot be deep-copied: the same layout, then the (sharded) state
            start_policy = parallelize_policy(build_policy(cfg.model.name, cfg.model.flavor, cfg.training.seq_len),
                                              dims, cfg)
            start_policy.load_state_dict(policy.state_dict())
        return cls(cfg, task, policy, start_policy.requires_grad_(False), draft,
                   torch.optim.AdamW(policy.parameters(), lr=rl.lr, weight_decay=0.0), draft_opt, engine,
                   layers, device, data_gen, rollout_gen, dims, amp=amp)

    def checkpoint_states(self) -> dict:
        """The RL states the job's checkpoint tracks (under PP: this rank's stage parts)."""
        if self.pipeline is not None:
            return self.pipeline.checkpoint_states()
        return {"policy_optimizer": OptimizerState(self.policy, self.policy_opt),
                "start_policy": ModelWrapper(self.start_policy)}


@dataclass
class Rollouts:
    prompts: Prompts  # N prompts (group_size copies in a row) and their references
    tokens: torch.Tensor  # [N, P + max_new]
    response_lengths: torch.Tensor  # [N]
    metrics: dict


def collect_rollouts(s: RLState) -> Rollouts:
    """Steps 1: group_size samples per prompt from the current policy, drafted when speculating."""
    ro, rl, task = s.cfg.rollout, s.cfg.rl, s.task
    speculate = s.cfg.draft.mode != "none"
    t0 = time.perf_counter()
    if s.pipeline is not None:  # every rank rolls out with the whole policy, gathered from the stages
        s.engine.load_weights(*s.pipeline.rollout_weights(speculate))
    else:
        s.engine.load_weights(s.policy, s.draft if speculate else None)
    # Every rank draws the whole step's prompts (same stream as one process) and rolls out its share.
    dp_rank, dp_degree = dp_rank_and_degree(s.dims)
    prompts = task.sample_prompts(rl.prompts_per_step, s.data_gen).shard(dp_rank, dp_degree)
    prompts = prompts.repeat_interleave(rl.group_size)
    result = s.engine.generate(prompts.padded(task.tokenizer.pad_id).to(s.device),
                               ro.max_new_tokens or task.max_new_tokens,
                               num_speculative_tokens=ro.num_speculative_tokens if speculate else 0,
                               temperature=ro.temperature, top_p=ro.top_p, eos_id=task.tokenizer.eos_id,
                               generator=s.rollout_gen)
    return Rollouts(prompts, result.tokens.cpu(), result.response_lengths.cpu(), {
        "acceptance_length": result.acceptance_length,
        "rollout_tokens_per_s": result.tokens_per_s,
        "rollout_time_s": time.perf_counter() - t0,
    })


def train_on(s: RLState, r: Rollouts) -> dict:
    """Steps 2-4: advantages, one policy forward, the policy's and the draft's separate updates."""
    t1 = time.perf_counter()
    prompt_ids = r.prompts.padded(s.task.tokenizer.pad_id)
    P = prompt_ids.shape[1]
    rewards = s.task.rewards(r.prompts, [row[:n] for row, n in zip(r.tokens[:, P:], r.response_lengths.tolist())])
    advantages = group_advantages(rewards, s.cfg.rl.group_size)
    if s.pipeline is not None:  # through the pipeline schedule (titan_draft/parallel/pipeline_rl.py)
        totals, draft_stats = s.pipeline.update(prompt_ids, r.tokens, r.response_lengths, advantages, s.draft_opt)
    else:
        totals, draft_stats = _update(s, r, prompt_ids, advantages)
    with torch.no_grad():
        reward_sum, num_samples = sum_over_dp(torch.stack([rewards.sum(), torch.tensor(float(len(rewards)))])
                                              .to(s.device), s.dims).tolist()
    policy_loss, entropy_sum, kl_sum, clipped, tokens = totals.tolist()
    return {"reward_mean": reward_sum / num_samples, **draft_stats, "policy_loss": policy_loss,
            "entropy": entropy_sum / tokens, "kl_to_start": kl_sum / tokens, "clip_frac": clipped / tokens,
            "train_time_s": time.perf_counter() - t1}


def _update(s: RLState, r: Rollouts, prompt_ids: torch.Tensor, advantages: torch.Tensor):
    """Steps 3-4 on the whole policy: returns the totals over all ranks [policy loss, entropy, log p -
    log p_ref, clipped rows, response rows] and the draft's metrics."""
    cfg, d, rl = s.cfg, s.cfg.draft, s.cfg.rl
    batch = rollout_batch(prompt_ids, r.tokens, r.response_lengths).to(s.device)
    shift = draft_attn = None
    if cp_mesh(s.dims) is not None:  # this rank's zigzag rows of every document; ring attention in both policies
        apply_context_parallel(s.start_policy, batch, cp_mesh(s.dims), d.cp_mode, max_shift=d.ttt_steps)
        batch, shift, draft_attn = apply_context_parallel(s.policy, batch, cp_mesh(s.dims), d.cp_mode,
                                                          max_shift=d.ttt_steps)
    row_advantages = advantages.to(s.device).repeat_interleave(batch.cu_seqlens.diff().long())
    # The next token of every row: across shard edges under CP.
    next_tokens = batch.tokens.roll(-1) if shift is None else shift(batch.tokens, 1)

    # One policy forward: GRPO loss for the policy; taps and logits for the draft.
    with s.amp, TapRecorder(s.policy, s.layers) as rec:
        logits = forward_packed(s.policy, batch)
    with s.amp, torch.no_grad():
        ref_logprobs = next_token_logprobs(forward_packed(s.start_policy, batch), next_tokens)
    # Losses are normalised by counts over all ranks holding rows (FSDP averages: hence the scale).
    mask = batch.loss_mask
    num_tokens = sum_over_dp(mask.sum().float(), s.dims, "loss")
    policy_loss, sums = grpo_objective(logits, next_tokens, row_advantages, mask, ref_logprobs, rl.clip_eps,
                                       rl.kl_coef, num_tokens)
    (loss_scale(s.dims) * policy_loss).backward()
    torch.nn.utils.clip_grad_norm_(s.policy.parameters(), cfg.training.max_norm)
    s.policy_opt.step()
    s.policy_opt.zero_grad(set_to_none=True)

    # The draft's update: its inputs are detached, so nothing here reaches the policy.
    draft_stats = {}
    if d.mode != "none":
        with s.amp, torch.set_grad_enabled(d.mode == "cotrain"):
            loss, draft_stats = draft_loss(s.draft, rec.embeddings(), rec.taps(), logits, batch, d.ttt_steps,
                                           d.pass_decay, shift, draft_attn, group=loss_group(s.dims))
        if d.mode == "cotrain":
            (loss_scale(s.dims) * d.loss_weight * loss).backward()
            s.draft_opt.step(sum_over_dp(loss.detach(), s.dims, "loss"))  # one rank's NaN: every rank skips
            draft_stats["draft_updates_skipped"] = s.draft_opt.skipped
    totals = torch.cat([sum_over_dp(sums, s.dims, "loss"), num_tokens[None]])
    return totals, draft_stats


def rl_step(s: RLState) -> dict:
    """One RL step (see the module docstring); returns its metrics."""
    rollouts = collect_rollouts(s)
    return {**mean_over_dp(rollouts.metrics, s.dims), **train_on(s, rollouts)}


def main(argv: list[str]) -> None:
    cfg = parse_config(argv)
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    args = model_args(cfg.model.name, cfg.model.flavor, cfg.training.seq_len)
    validate(cfg, world_size, args.n_layers, args.vocab_size)  # before any process group
    init_process_group(cfg)
    dims = build_parallel_dims(cfg, world_size) if world_size > 1 else None
    try:
        run(cfg, args, dims)
    except (RuntimeError, dist.DistError) as err:  # collective timeouts included: say where
        if dims is None:
            raise
        raise RuntimeError(f"{describe_rank(dims)} failed (collective timeouts: [comm] "
                           f"init_timeout_seconds / train_timeout_seconds): {err}") from err
    finally:
        dist.destroy_process_group()


def run(cfg, args, dims) -> None:
    device = _compat.device()
    seed = cfg.debug.seed if cfg.debug.seed is not None else 0
    torch.manual_seed(seed)
    data_gen = torch.Generator().manual_seed(seed + 1)  # the same prompts on every rank (each takes its share)
    rollout_gen = torch.Generator(device=device).manual_seed(seed + 2 + 1000 * dp_rank_and_degree(dims)[0])
    # The draft warm-up has its own data stream, so that every [draft] mode (none skips the warm-up)
    # starts RL on the same prompts.
    warmup_gen = torch.Generator().manual_seed(seed + 3)
    metrics = MetricsLogger(cfg.job.dump_folder, rank=dist.get_rank())
    task = build_task(cfg, args.vocab_size)
    _, policy, draft, layers = build_models(cfg, device)
    if dims is not None:
        parallelize_policy(policy, dims, cfg)
        parallelize_draft(draft, dims, cfg)
    d, rl = cfg.draft, cfg.rl
    amp = training_autocast(cfg.training.mixed_precision_param, device, dims)
    checkpoint = JobCheckpoint(cfg, policy, draft, {"data": data_gen, "rollout": rollout_gen})
    resume_phase = checkpoint.resume_phase()
    draft_opt = DraftOptimizer(draft, d.lr, d.max_norm)

    # --- warm starts (skipped when a checkpoint has them) ---------------------------------------
    if resume_phase >= WARMUP_DONE:
        checkpoint.track(draft_optimizer=OptimizerState(draft, draft_opt.optimizer))
    if resume_phase in (SFT_DONE, WARMUP_DONE):
        checkpoint.load()
    if resume_phase < SFT_DONE:
        sft_policy(policy, task, rl.sft_steps, rl.sft_lr, rl.sft_batch_size, data_gen, device, metrics, amp=amp)
        checkpoint.save(SFT_DONE)
    if resume_phase < WARMUP_DONE:
        draft_vocab_from_data(task, draft, data_gen)
        if d.mode != "none":
            draft_opt = warmup_draft(policy, draft, task, layers, d.warmup_steps, d.lr, d.max_norm,
                                     rl.sft_batch_size, d.ttt_steps, d.pass_decay, warmup_gen, device, metrics,
                                     amp=amp)
        checkpoint.track(draft_optimizer=OptimizerState(draft, draft_opt.optimizer))
        checkpoint.save(WARMUP_DONE)

    # --- RL ---------------------------------------------------------------------------------------
    rl_state = RLState.create(cfg, args, task, policy, draft, draft_opt, layers, device, data_gen, rollout_gen,
                              dims)
    checkpoint.track_rl(rl_state.checkpoint_states(), draft_trains_here=rl_state.pipeline is None or
                        rl_state.pipeline.holds_draft)
    if resume_phase == IN_RL:
        checkpoint.load()
    first_step = checkpoint.train_state.rl_step + 1
    for step in range(first_step, cfg.training.steps + 1):
        metrics.log("rl", step, rl_step(rl_state))
        if step == first_step and dims is not None:  # this run's first step is done: tighter timeout
            set_collective_timeout(dims, cfg.comm.train_timeout_seconds)
        checkpoint.save(IN_RL, step)
    checkpoint.close()
    metrics.close()


if __name__ == "__main__":
    main(sys.argv[1:])
