"""The job's parts before RL: what it is built from (`build_job`) and its warm starts (`warm_start`).

train.py runs them, then RL; bench/ drivers call the same two functions.
"""
from dataclasses import dataclass

import torch

from titan_draft.checkpoint import NOT_STARTED, SFT_DONE, WARMUP_DONE, JobCheckpoint, OptimizerState
from titan_draft.data.tasks import build_task
from titan_draft.formats.eagle3 import load_draft
from titan_draft.formats.hf import load_policy
from titan_draft.infra import _compat
from titan_draft.infra.metrics import MetricsLogger
from titan_draft.models import build_models
from titan_draft.models.cotrain import CoTrainSpec, DraftOptimizer
from titan_draft.parallel.parallelize import (apply_activation_checkpointing, dp_rank_and_degree, parallelize_draft,
                                              parallelize_policy, training_autocast)
from titan_draft.plan import RunPlan
from titan_draft.rl.warmstart import WarmStartRun, draft_vocab_from_data, sft_policy, warmup_draft
from torchtitan.distributed import ParallelDims


@dataclass
class Job:
    """What every phase of the job reads: config and plan, task, models, where they run, the data streams."""

    cfg: object
    plan: RunPlan
    task: object
    policy: torch.nn.Module
    draft: torch.nn.Module
    spec: CoTrainSpec
    device: torch.device
    generators: dict  # data (prompts, SFT), rollout (sampling), warmup (the draft warm-up's documents)
    metrics: MetricsLogger
    dims: ParallelDims  # its meshes (built on first use; none in one process)

    @property
    def amp(self):
        """The training forwards' precision (parallelize.training_autocast)."""
        return training_autocast(self.cfg.training.mixed_precision_param, self.device, self.dims)


def build_job(cfg, metrics: MetricsLogger, *, plan: RunPlan, dims: ParallelDims) -> Job:
    """The task, the policy and draft (initial weights loaded, parallelized over `dims`: in place, nothing
    in one process), the seeded generators."""
    device = _compat.device()
    seed = cfg.debug.seed if cfg.debug.seed is not None else 0
    torch.manual_seed(seed)
    generators = {
        "data": torch.Generator().manual_seed(seed + 1),  # the same prompts on every rank (each takes its share)
        "rollout": torch.Generator(device=device).manual_seed(seed + 2 + 1000 * dp_rank_and_degree(dims)[0]),
        # The draft warm-up has its own data stream, so that every [draft] mode (none skips the warm-up)
        # starts RL on the same prompts.
        "warmup": torch.Generator().manual_seed(seed + 3),
    }
    args, policy, draft = build_models(cfg, device)
    if cfg.checkpoint.initial_load_path:  # a Hugging Face policy (a resumed checkpoint overrides it later)
        load_policy(policy, cfg.model.name, args, cfg.checkpoint.initial_load_path)
    if cfg.draft.init_path:  # a published EAGLE-3 draft, its vocabulary maps included
        load_draft(draft, cfg.draft.init_path, plan.tap_layers, n_layers=args.n_layers)
    task = build_task(cfg, args.vocab_size)
    apply_activation_checkpointing(policy, cfg)
    parallelize_policy(policy, dims, cfg)
    parallelize_draft(draft, dims, cfg)
    return Job(cfg, plan, task, policy, draft, CoTrainSpec.from_config(cfg.draft, plan.tap_layers), device, generators,
               metrics, dims)


def warm_start_run(job: Job, stream: str) -> WarmStartRun:
    """A warm start's settings: the data stream job.generators[stream], the job's device, metrics and
    precision, and the RL step's memory settings."""
    rl = job.cfg.rl
    return WarmStartRun(job.generators[stream], job.device, job.metrics, job.amp, chunk_size=rl.logprob_chunk_size,
                        max_tokens=rl.max_tokens_per_microbatch)


def warm_start(job: Job, draft_opt: DraftOptimizer, checkpoint: JobCheckpoint | None = None,
               resume_phase: int = NOT_STARTED) -> None:
    """SFT, then the draft's vocabulary and warm-up, each skipped when `resume_phase` has it; saved at their ends."""
    cfg = job.cfg
    if resume_phase < SFT_DONE:
        sft_policy(job.policy, job.task, cfg.rl, cfg.lr_scheduler, warm_start_run(job, "data"))
        if checkpoint is not None:
            checkpoint.save(SFT_DONE)
    if resume_phase < WARMUP_DONE:
        if not cfg.draft.init_path:  # a loaded draft brings its own vocabulary
            draft_vocab_from_data(job.task, job.draft, job.generators["data"])
        if job.plan.speculate:
            warmup_draft(job.policy, job.draft, job.task, job.spec, optimizer=draft_opt, steps=cfg.draft.warmup_steps,
                         batch_size=cfg.rl.sft_batch_size,
                         run=warm_start_run(job, "warmup"))
        if checkpoint is not None:
            checkpoint.track(draft_optimizer=OptimizerState(job.draft, draft_opt.optimizer))
            checkpoint.save(WARMUP_DONE)
