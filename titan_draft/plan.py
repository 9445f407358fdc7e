"""The run's plan: the job config resolved once, after its checks, into what the code decides by.

`[draft] mode` becomes `speculate` and `train_draft`, an empty `[draft] tap_layers` EAGLE-3's default
layers, `data_parallel_shard_degree = -1` the ranks the other degrees leave, `[checkpoint] folder` its
path under the dump folder. config.validate builds the plan once its inputs are checked and returns
it; train.py hands it to the job, whose parts read it (never those config keys) to decide.
"""
import os
from dataclasses import dataclass

from titan_draft.models import policy_args, tap_layers
from torchtitan.distributed import ParallelDims


@dataclass(frozen=True)
class RunPlan:
    speculate: bool
    """The draft takes part ([draft] mode cotrain or frozen): it warms up, proposes tokens in the rollouts and
    its loss is measured every RL step; false ([draft] mode none): rollouts are the policy's alone."""
    train_draft: bool
    """The draft's optimizer steps in every RL step ([draft] mode cotrain)."""
    tap_layers: tuple[int, ...]
    """Policy layers whose outputs feed the draft ([draft] tap_layers, or models.default_tap_layers)."""
    world_size: int
    dp_replicate: int
    dp_shard: int
    """[parallelism] data_parallel_shard_degree, -1 resolved to the ranks the other degrees leave."""
    cp: int
    tp: int
    pp: int
    checkpoint_folder: str
    """<job.dump_folder>/<checkpoint.folder>: the job's step-N checkpoint folders."""

    @property
    def distributed(self) -> bool:
        """More than one process: meshes exist, and collectives can time out."""
        return self.world_size > 1

    @property
    def dp(self) -> int:
        """The data-parallel ranks (dp_replicate x dp_shard), which split each step's rollouts."""
        return self.dp_replicate * self.dp_shard


def build_plan(cfg, world_size: int) -> RunPlan:
    """The plan of a job config whose [draft] mode and tap_layers and [parallelism] degrees passed
    config.validate, run by `world_size` processes."""
    p = cfg.parallelism
    others = p.data_parallel_replicate_degree * p.context_parallel_degree * p.tensor_parallel_degree * \
        p.pipeline_parallel_degree
    return RunPlan(
        speculate=cfg.draft.mode != "none", train_draft=cfg.draft.mode == "cotrain",
        tap_layers=tuple(tap_layers(cfg.draft, policy_args(cfg).n_layers)), world_size=world_size,
        dp_replicate=p.data_parallel_replicate_degree,
        dp_shard=world_size // others if p.data_parallel_shard_degree == -1 else p.data_parallel_shard_degree,
        cp=p.context_parallel_degree, tp=p.tensor_parallel_degree, pp=p.pipeline_parallel_degree,
        checkpoint_folder=os.path.join(cfg.job.dump_folder, cfg.checkpoint.folder))


def build_parallel_dims(plan: RunPlan) -> ParallelDims:
    """torchtitan's ParallelDims of the run's plan (no mesh yet: building one needs the process group)."""
    return ParallelDims(dp_replicate=plan.dp_replicate, dp_shard=plan.dp_shard, cp=plan.cp, tp=plan.tp, pp=plan.pp,
                        ep=1, etp=1, world_size=plan.world_size)
