"""The main job: SFT warm start -> draft warm start -> RL (GRPO) with speculative rollouts and
online draft co-training. Run it with ./run_train.sh (torchrun); read it top to bottom.

How a step flows (README "How a step flows"):
  rl_step(s)
    collect_rollouts(s)   the engine refreshes its policy/draft copies (s.policy.rollout_weights) and
                          samples group_size answers per prompt; draft proposes, policy verifies
                          (lossless: the samples follow the policy exactly)
    train_step(s, r)      rewards -> group advantages -> s.policy.forward_backward(batch): ONE policy
                          forward whose taps and logits also give the draft's TTT loss, both
                          backwards -> clip (over all stages) -> policy optimizer step (skipped when
                          not finite) -> draft optimizer step (own LR, clip, skip/restore rule)
`s.policy` is the policy holder: whole_policy.WholePolicy (one process, FSDP / TP / CP) or
rl/pipelined_policy.PipelinedPolicy (pipeline stages); only their forward_backward differs.
[draft] mode = "cotrain" | "frozen" | "none" switches the draft's update / speculation off; the job reads
it from the run's plan (titan_draft/plan.py: plan.train_draft, plan.speculate), as every setting resolved once.
"""
import json
import os
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from titan_draft.checkpoint import IN_RL, SFT_DONE, WARMUP_DONE, JobCheckpoint, OptimizerState
from titan_draft.config import ConfigError, parse_config, validate
from titan_draft.data.tasks import Prompts
from titan_draft.data.tasks.base import response_budget
from titan_draft.infra.job_guard import die_with_launcher, lock_dump_folder
from titan_draft.infra.metrics import MetricsLogger
from titan_draft.infra.timing import PhasePeak
from titan_draft.job import Job, build_job, warm_start
from titan_draft.models.cotrain import DraftOptimizer, sample_documents
from titan_draft.parallel.parallelize import (compute_dtype, describe_rank, dp_rank_and_degree, init_process_group,
                                              mean_over_dp, optional_mesh, set_collective_timeout, sum_over_dp)
from titan_draft.plan import RunPlan, build_parallel_dims
from titan_draft.rl.grpo import group_advantages
from titan_draft.rl.pipelined_policy import PipelinedPolicy
from titan_draft.rl.step import PolicyHolder, RolloutBatch
from titan_draft.rl.whole_policy import WholePolicy
from titan_draft.rollout import EngineOptions, RolloutEngine
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.utils import clip_grad_norm_


class PolicyDiverged(RuntimeError):
    """rl.stop_after_skips policy updates in a row were skipped (non-finite loss or gradient norm)."""


@dataclass
class RLState:
    """Everything an RL step reads or updates."""

    job: Job
    policy: PolicyHolder  # WholePolicy or PipelinedPolicy
    draft_opt: DraftOptimizer
    engine: RolloutEngine
    policy_skips_in_a_row: int = 0
    policy_updates_skipped: int = 0

    @classmethod
    def create(cls, job: Job, draft_opt: DraftOptimizer) -> "RLState":
        cfg, args = job.cfg, job.policy.model_args
        holder = PipelinedPolicy if job.plan.pp > 1 else WholePolicy
        policy = holder(job)
        # Rollouts run in the training forwards' precision: bf16 on GPU by default, float32 on CPU.
        engine = RolloutEngine(args, job.draft.args if job.plan.speculate else None, job.spec.tap_layers,
                               max_batch_size=cfg.rl.prompts_per_step * cfg.rl.group_size,
                               max_seq_len=cfg.training.seq_len, device=job.device,
                               dtype=compute_dtype(cfg.training.mixed_precision_param, job.device),
                               options=EngineOptions(compile=cfg.rollout.compile,
                                                     few_row_linear=cfg.rollout.few_row_linear))
        draft_opt.set_lr(cfg.draft.cotrain_lr or cfg.draft.lr)  # RL's rate from here on (a resumed state keeps it)
        return cls(job, policy, draft_opt, engine)

    @property
    def cfg(self):
        return self.job.cfg


@dataclass
class Rollouts:
    prompts: Prompts  # this rank's prompts, each group_size times in a row
    tokens: torch.Tensor  # [N, W]: row n = its prompt, then its response, then eos
    prompt_lengths: torch.Tensor  # [N]
    response_lengths: torch.Tensor  # [N], an emitted eos included
    metrics: dict
    counts: torch.Tensor  # speculation counters, summed over ranks later (spec_metrics)

    def responses(self) -> list[torch.Tensor]:
        return [row[p:p + r] for row, p, r in zip(self.tokens, self.prompt_lengths.tolist(),
                                                 self.response_lengths.tolist())]


def collect_rollouts(s: RLState) -> Rollouts:
    """group_size samples per prompt from the current policy, drafted when speculating."""
    cfg, job = s.cfg, s.job
    ro, rl, speculate = cfg.rollout, cfg.rl, job.plan.speculate
    t0 = time.perf_counter()
    # A co-trained draft changes in every step; a frozen one only reaches the engine once.
    with_draft = speculate and (job.plan.train_draft or not s.engine.holds_draft_weights)
    s.engine.load_weights(*s.policy.rollout_weights(with_draft))
    weights_s = time.perf_counter() - t0
    # Every rank draws the whole step's prompts (same stream as one process) and rolls out its share.
    prompts = job.task.sample_prompts(rl.prompts_per_step, job.generators["data"])
    prompts = prompts.shard(*dp_rank_and_degree(job.dims)).repeat_interleave(rl.group_size)
    result = s.engine.generate(prompts.ids, response_budget(cfg, job.task.max_new_tokens),
                               num_speculative_tokens=ro.num_speculative_tokens if speculate else 0,
                               adaptive=ro.adaptive, temperature=ro.temperature, top_p=ro.top_p,
                               eos_id=job.task.tokenizer.eos_id, generator=job.generators["rollout"])
    counts = torch.tensor([result.num_drafts, result.num_draft_tokens, result.num_accepted_tokens,
                           *result.accepted_per_position.tolist(), *result.drafted_per_position.tolist()],
                          dtype=torch.float64)
    lengths = result.response_lengths.cpu()
    if ro.release_caches:  # the training phase gets their memory
        s.engine.release_caches()
    return Rollouts(prompts, result.tokens.cpu(), result.prompt_lengths.cpu(), lengths, {
        "tokens_per_verify_forward": result.acceptance_length,  # docs/DESIGN.md 4.3
        "rollout_tokens_per_s": result.tokens_per_s,
        "rollout_time_s": time.perf_counter() - t0,
        # Where the rollout time went: the weight refresh (the draft's inside generate, where a call
        # drafts: RolloutEngine.load_weights), adaptive K's step measurement (the first
        # call only), the prompts, the decode loop (the last three timed between device syncs), how
        # many engine calls ran without a CUDA graph replay, and the seconds of those that captured one.
        "rollout_weights_s": weights_s + result.timing["draft_weights_s"],
        "rollout_measure_s": result.timing["measure_s"],
        "rollout_prefill_s": result.timing["prefill_s"],
        "rollout_decode_s": result.timing["decode_s"],
        "rollout_unreplayed_calls": float(result.unreplayed_calls),
        "rollout_capture_s": result.timing["capture_s"],
        # What adaptive K judges calls by: seconds over their work at the plain step costs, per kind
        # (0 until a call of that kind was timed; GoodputController.call_ratio).
        **{f"rollout_call_ratio_{kind}": result.call_ratios.get(kind, 0.0) for kind in ("drafting", "plain")},
        # The response-length distribution (means over data-parallel ranks of each rank's numbers).
        "response_len_mean": lengths.float().mean().item(),
        "response_len_p90": lengths.float().quantile(0.9).item(),
        "response_len_max": float(lengths.max()),
    }, counts)


def spec_metrics(counts: torch.Tensor) -> dict[str, float]:
    """Speculation metrics under the names vLLM and NeMo RL use, from the counters of all ranks:
    spec_num_drafts (verify steps that proposed), spec_num_draft_tokens, spec_num_accepted_tokens,
    spec_acceptance_length = 1 + accepted / drafts, spec_acceptance_rate = accepted / drafted tokens,
    spec_acceptance_rate_pos_<i> = accepted at draft position i / drafted at position i."""
    drafts, drafted, accepted = counts[:3].tolist()
    per_position = counts[3:].view(2, -1)
    out = {"spec_num_drafts": drafts, "spec_num_draft_tokens": drafted, "spec_num_accepted_tokens": accepted,
           "spec_acceptance_length": 1 + accepted / max(drafts, 1), "spec_acceptance_rate": accepted / max(drafted, 1)}
    for i, (acc, tried) in enumerate(zip(*per_position.tolist())):
        out[f"spec_acceptance_rate_pos_{i}"] = acc / max(tried, 1)
    return out


def train_step(s: RLState, r: Rollouts) -> dict:
    """Rewards and advantages, the policy holder's forward/backward, then the policy's and the draft's
    separate updates; returns the step's training metrics."""
    cfg, job, plan = s.cfg, s.job, s.job.plan
    t1 = time.perf_counter()
    rewards = job.task.rewards(r.prompts, r.responses())
    # The rollouts the draft runs on this step (all of them unless draft.train_fraction < 1).
    documents = sample_documents(len(r.tokens), cfg.draft.train_fraction, job.generators["rollout"]) \
        if plan.speculate else None
    batch = RolloutBatch(r.tokens, r.prompt_lengths, r.response_lengths, group_advantages(rewards, cfg.rl.group_size),
                         draft_documents=documents)
    sums = s.policy.forward_backward(batch)

    params = [p for part in s.policy.parts for p in part.parameters()]
    grad_norm = clip_grad_norm_(params, cfg.training.max_norm, pp_mesh=optional_mesh(job.dims, "pp"))
    if bool(torch.isfinite(sums.policy[0])) and bool(torch.isfinite(grad_norm)):
        s.policy.optimizer.step()
        s.policy_skips_in_a_row = 0
    else:  # a non-finite update would poison the weights (and every checkpoint after it)
        s.policy_updates_skipped += 1
        s.policy_skips_in_a_row += 1
    s.policy.optimizer.zero_grad(set_to_none=True)
    if plan.train_draft:
        with s.policy.draft_timer():
            s.draft_opt.step(sums.draft_loss)  # the same total on every rank: all skip together

    with torch.no_grad():
        reward_sum, num_samples = sum_over_dp(torch.stack([rewards.sum(), torch.tensor(float(len(rewards)))])
                                              .to(job.device), job.dims).tolist()
    draft = sums.draft_metrics()
    if plan.speculate:  # the draft's share of train_time_s (its forward, backward and step)
        draft["draft_time_s"] = s.policy.draft_seconds()
    if plan.train_draft:
        draft["draft_updates_skipped"] = s.draft_opt.skipped
    metrics = {"reward_mean": reward_sum / num_samples, **draft, **sums.policy_metrics(),
               "train_time_s": time.perf_counter() - t1, "policy_updates_skipped": s.policy_updates_skipped}
    if plan.train_draft:
        metrics["draft_restores"] = s.draft_opt.restores
    if s.policy_skips_in_a_row >= cfg.rl.stop_after_skips > 0:
        raise PolicyDiverged(f"rl: the policy's loss or gradient norm was not finite in {s.policy_skips_in_a_row} RL "
                             "steps in a row (those updates were skipped, the weights are the last finite ones); "
                             "lower rl.lr or raise rl.stop_after_skips")
    return metrics


def rollouts_and_update(s: RLState) -> tuple[Rollouts, dict]:
    """collect_rollouts then train_step: (the rollouts, the training metrics), the latter on CUDA with the
    peak memory of each phase (memory_peak_gib_rollout, memory_peak_gib_train, this rank's)."""
    with PhasePeak(s.job.device) as rollout_memory:
        rollouts = collect_rollouts(s)
    with PhasePeak(s.job.device) as train_memory:
        trained = train_step(s, rollouts)
    if rollout_memory.gib is not None:
        trained.update(memory_peak_gib_rollout=rollout_memory.gib, memory_peak_gib_train=train_memory.gib)
    return rollouts, trained


def rl_step(s: RLState, step: int) -> dict:
    """RL step `step` (see the module docstring); returns its metrics."""
    rollouts, trained = rollouts_and_update(s)
    metrics = {**mean_over_dp(rollouts.metrics, s.job.dims), **trained}
    if s.job.plan.speculate:
        metrics.update(spec_metrics(sum_over_dp(rollouts.counts.to(s.job.device), s.job.dims).cpu()))
    _dump_samples(s, rollouts, step)
    return metrics


def _dump_samples(s: RLState, r: Rollouts, step: int) -> None:
    """rollout.dump_samples of this step's rollouts (rank 0's share) to <dump_folder>/rollouts/step_<k>.jsonl."""
    count = s.cfg.rollout.dump_samples
    if not count or not s.job.metrics.enabled:
        return
    tokenizer, responses = s.job.task.tokenizer, r.responses()[:count]
    prompts = Prompts(r.prompts.ids[:count], r.prompts.references[:count])
    rewards = s.job.task.rewards(prompts, responses)  # of the dumped rows only
    folder = os.path.join(s.cfg.job.dump_folder, "rollouts")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"step_{step}.jsonl"), "w") as f:
        for prompt, response, reward in zip(prompts.ids, responses, rewards.tolist()):
            ids = response.tolist()
            f.write(json.dumps({"step": step, "prompt": tokenizer.decode(prompt.tolist()),
                                "response": tokenizer.decode(ids), "response_ids": ids, "reward": reward}) + "\n")


def main(argv: list[str]) -> None:
    die_with_launcher()  # torchrun's workers live in sessions of their own
    cfg = parse_config(argv)
    plan = validate(cfg, int(os.environ.get("WORLD_SIZE", 1)))  # before any process group
    lock_dump_folder(cfg.job.dump_folder)  # rank 0: one job per dump folder
    init_process_group(cfg)
    dims = build_parallel_dims(plan)
    try:
        run(cfg, plan=plan, dims=dims)
    except PolicyDiverged as err:
        print(f"stopped: {err}", file=sys.stderr)
        raise SystemExit(3) from None
    except (RuntimeError, dist.DistError) as err:  # collective timeouts included: say where
        if not plan.distributed:
            raise
        raise RuntimeError(f"{describe_rank(dims)} failed (collective timeouts: [comm] "
                           f"init_timeout_seconds / train_timeout_seconds): {err}") from err
    finally:
        dist.destroy_process_group()


def run(cfg, *, plan: RunPlan, dims: ParallelDims) -> None:
    metrics = MetricsLogger(cfg.job.dump_folder)
    job = build_job(cfg, metrics, plan=plan, dims=dims)
    checkpoint = JobCheckpoint(cfg, job.policy, job.draft, {"data": job.generators["data"],
                                                            "rollout": job.generators["rollout"]}, plan=plan)
    resume_phase = checkpoint.resume_phase()
    draft_opt = DraftOptimizer(job.draft, cfg.draft)
    if resume_phase >= WARMUP_DONE:
        checkpoint.track(draft_optimizer=OptimizerState(job.draft, draft_opt.optimizer))
    if resume_phase in (SFT_DONE, WARMUP_DONE):
        checkpoint.load()
    warm_start(job, draft_opt, checkpoint, resume_phase)

    state = RLState.create(job, draft_opt)
    checkpoint.track_rl(state.policy.checkpoint_states(), draft_trains_here=state.policy.holds_draft)
    if resume_phase == IN_RL:
        checkpoint.load()
    first_step = checkpoint.train_state.rl_step + 1
    for step in range(first_step, cfg.training.steps + 1):
        metrics.log("rl", step, rl_step(state, step))
        if step == first_step and plan.distributed:  # this run's first step is done: tighter timeout
            set_collective_timeout(dims, cfg.comm.train_timeout_seconds)
        checkpoint.save(IN_RL, step)
    checkpoint.close()
    metrics.close()


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
