"""The job side of the RL drivers (rl_step, rollout_speedup, memory_table, train_phase): a job config from a
TOML of train_configs/ plus overrides, and a job built (and warm-started) by the library's own functions
(titan_draft.job.build_job + warm_start), exactly as train.py starts one; rollouts of random tokens; the
policy's training FLOPs."""
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torchtitan.tools.utils import get_peak_flops

from bench._common import REPO_ROOT, timed
from titan_draft.config import parse_config, validate
from titan_draft.data.tasks import Prompts
from titan_draft.infra import _compat
from titan_draft.infra.io import atomic_directory, full_state_dict
from titan_draft.infra.metrics import MetricsLogger
from titan_draft.job import Job, build_job, warm_start
from titan_draft.models.cotrain import DraftOptimizer
from titan_draft.parallel.parallelize import fsdp_wraps, init_process_group
from titan_draft.plan import build_parallel_dims, build_plan
from titan_draft.train import Rollouts


def random_rollouts(prompts: Prompts, response_lengths: torch.Tensor, vocab_size: int,
                    generator: torch.Generator) -> Rollouts:
    """Rollouts of `prompts` whose answers are random tokens of the given lengths: what a step's time and
    memory depend on (shapes), without decoding."""
    lengths = prompts.lengths()
    tokens = torch.randint(vocab_size, (len(prompts), int((lengths + response_lengths).max())), generator=generator)
    for row, ids in zip(tokens, prompts.ids):
        row[:len(ids)] = ids
    return Rollouts(prompts, tokens, lengths, response_lengths, metrics={}, counts=torch.zeros(0))


@dataclass(frozen=True)
class PolicyFlops:
    """Model FLOPs of the policy's training on a step's rollouts (see the module docstring)."""
    block_params: int
    head_params: int
    peak_flops: float | None
    """The device's bf16 dense peak FLOP/s; None off CUDA."""

    @classmethod
    def of(cls, policy: torch.nn.Module, device: torch.device) -> "PolicyFlops":
        blocks = sum(p.numel() for name, p in policy.named_parameters() if name.startswith("layers."))
        peak = get_peak_flops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
        return cls(blocks, policy.output.weight.numel(), peak)

    def per_second(self, record: dict) -> float:
        """Model FLOP/s of one step's policy training (its train time less the draft's)."""
        flops = 6 * (self.block_params * record["packed_tokens"] + self.head_params * record["generated_tokens"])
        return flops / (record["train_s"] - record["draft_s"])

    def mfu(self, flops_per_s: float) -> float | None:
        """flops_per_s over the device's bf16 dense peak (None off CUDA)."""
        return flops_per_s / self.peak_flops if self.peak_flops else None


def add_job_arguments(parser, presets: dict, default: str) -> None:
    """--preset (a TOML of train_configs/, overrides, the bench's own settings), --config, and job config
    overrides after --."""
    parser.add_argument("--preset", choices=sorted(presets), default=default)
    parser.add_argument("--config", help="job TOML (default: the preset's)")
    parser.add_argument("overrides", nargs="*", help="job config overrides after --, e.g. -- --rl.sft_steps 100")


def add_step_arguments(parser, per: str) -> None:
    """--steps and --skip (timed and untimed steps per `per`, default: the preset's) and --out."""
    parser.add_argument("--steps", type=int, help=f"timed steps per {per} (after --skip)")
    parser.add_argument("--skip", type=int, help=f"first steps per {per} left out of the time statistics")
    parser.add_argument("--out", help="JSON output path (default bench/results/<bench>_<preset>.json)")


def resolve_steps(args, parser, preset: dict, bench: str) -> None:
    """args.steps and args.skip from the preset where not given, args.out's default; bad counts end in
    one error line."""
    args.steps = preset["steps"] if args.steps is None else args.steps
    args.skip = preset["skip"] if args.skip is None else args.skip
    args.out = args.out or os.path.join(REPO_ROOT, "bench", "results", f"{bench}_{args.preset}.json")
    if args.steps < 1 or args.skip < 0:
        parser.error("--steps must be >= 1 and --skip >= 0")


def resolve_preset(args, presets: dict) -> dict:
    """The chosen preset; fills args.config (default: the preset's TOML) and args.overrides (the
    preset's, then the command line's: the last one of a key wins)."""
    preset = presets[args.preset]
    args.config = args.config or os.path.join(REPO_ROOT, preset["config"])
    args.overrides = [*preset.get("overrides", []), *args.overrides]
    return preset


def job_config(config_file: str, overrides: list[str]):
    """The job config of `config_file` with command-line style overrides, checked as train.py checks it."""
    cfg = parse_config(["--job.config_file", config_file, *overrides])
    validate(cfg, 1)
    return cfg


def new_job(cfg, dump_folder: str) -> tuple[Job, DraftOptimizer]:
    """(job, draft optimizer) of `cfg` in one process, as train.py builds them (initial weights: random
    unless the config loads some), logging to `dump_folder`."""
    plan = build_plan(cfg, 1)
    dims = build_parallel_dims(plan)
    if fsdp_wraps(dims, cfg.training.mixed_precision_param, _compat.device()) and not dist.is_initialized():
        init_process_group(cfg)  # train.py's group of one, which FSDP's one-rank mesh needs (GPUs, bf16)
    job = build_job(cfg, MetricsLogger(dump_folder, tensorboard=False), plan=plan, dims=dims)
    return job, DraftOptimizer(job.draft, cfg.draft)


def warm_started_job(cfg, dump_folder: str, saved: str | None = None) -> tuple[Job, DraftOptimizer, float, dict | None]:
    """(job, draft optimizer, seconds of the warm start, its warm_state or None): the job's SFT and draft
    warm-up, logging to `dump_folder`. The draft always warms up ([draft] mode none would skip it): the
    drivers compare speculation on and off from one trained state.

    saved: a folder holding a warm start of this config (loaded: 0 seconds) or where this one is written
    (a GPU's minutes of SFT, reused by later runs). The host copy that was loaded or written is returned,
    so that a caller who needs it does not gather the models again; None without a folder."""
    cfg.draft.mode = "cotrain"
    job, draft_opt = new_job(cfg, dump_folder)
    path = saved and os.path.join(saved, WARM_START_FILE)
    if path and os.path.isfile(path):
        state = torch.load(path, map_location="cpu", weights_only=True)
        load_warm_state(state, job, draft_opt)
        return job, draft_opt, 0.0, state
    seconds, _ = timed(lambda: warm_start(job, draft_opt), job.device)
    state = None
    if path:
        state = warm_state(job, draft_opt)
        with atomic_directory(saved) as folder:
            torch.save(state, os.path.join(folder, WARM_START_FILE))
    return job, draft_opt, seconds, state


WARM_START_FILE = "warm_start.pt"


def warm_state(job: Job, draft_opt: DraftOptimizer) -> dict:
    """What the RL phase starts from, as whole tensors in host memory whatever shards them (a job on one GPU
    is FSDP2-wrapped: DTensor parameters over a mesh of one rank, parallelize.fsdp_wraps): the policy, the
    draft (its vocabulary included), the draft's optimizer and the data streams."""
    host = StateDictOptions(full_state_dict=True, cpu_offload=True)  # as full_state_dict takes the models
    return {"policy": full_state_dict(job.policy), "draft": full_state_dict(job.draft),
            "draft_optimizer": get_optimizer_state_dict(job.draft, draft_opt.optimizer, options=host),
            "generators": {name: g.get_state() for name, g in job.generators.items()}}


def load_warm_state(state: dict, job: Job, draft_opt: DraftOptimizer) -> None:
    """`state` (warm_state's) into a job of the same config, sharded as that job is."""
    options = StateDictOptions(full_state_dict=True)
    # Copies: set_model_state_dict renames the keys of the dict it is given to a compiled model's own
    # (layers.0._orig_mod...), and the same warm start loads into every mode's job.
    set_model_state_dict(job.policy, dict(state["policy"]), options=options)
    set_model_state_dict(job.draft, dict(state["draft"]), options=options)
    set_optimizer_state_dict(job.draft, draft_opt.optimizer, state["draft_optimizer"], options=options)
    for name, g in job.generators.items():
        g.set_state(state["generators"][name].cpu())
