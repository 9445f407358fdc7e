"""Checkpoints of the whole job through torchtitan's CheckpointManager (DCP), and resuming by phase.

What a checkpoint holds: the policy (torchtitan's "model": the whole policy, or in RL under pipeline
parallelism every rank's stage parts, which DCP joins by FQN), the draft, the RL reference policy,
both optimizers (the draft's once warmed up, the policy's RL AdamW once RL runs), the RNG states
(torch, the data and rollout generators; per rank) and the TrainState (finished phase, RL step).
Folders are torchtitan's `<dump_folder>/<checkpoint.folder>/step-N` with N = progress: 1 after
SFT, 2 after the draft warm-up, 2 + k after RL step k, so the latest folder is the furthest one.
SFT and the draft warm-up are saved at their ends only: their own optimizer and LR schedule end
with them (the draft's optimizer carries on into RL and is saved from then on). RL has no LR schedule.

Complete or absent: DCP writes every data file first and `.metadata` last (to a temporary name,
then renamed: torch/distributed/checkpoint/filesystem.py, FileSystemWriter.finish), and torchtitan's
CheckpointManager only considers step folders that contain `.metadata` (_find_load_step). A save
killed midway leaves a folder without `.metadata`, which the resume ignores; before saving step N
again, a stale step-N folder is removed so that an old `.metadata` never vouches for new data.

Intact: after DCP's files, `checksums.json` (written atomically, last) records every file's size and
SHA-256 and the settings a resume must share (SETTINGS). A step folder counts as complete only with both
`.metadata` and `checksums.json`. The resume compares the settings first (a mismatch is one line naming
the key), then verifies the files, and falls back past a damaged checkpoint to the previous complete
one with a warning naming the file. Ranks hash and verify disjoint shares of the files.

When to save is decided here ([checkpoint] interval counts RL steps; phase ends always save), so
the manager runs with interval 1. Its last-step save (model-only by default, which would drop the
draft and the RL state) is never used: every save, the final one included, is a full one.
"""
import dataclasses
import hashlib
import json
import os
import shutil
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from titan_draft.infra.errors import ConfigError
from titan_draft.infra.io import atomic_file
from titan_draft.infra.ranks import is_rank0
from titan_draft.plan import RunPlan
from torchtitan.components.checkpoint import CheckpointManager, ModelWrapper

# Phases in the order the job runs them; TrainState.phase is the last one finished.
NOT_STARTED, SFT_DONE, WARMUP_DONE, IN_RL = 0, 1, 2, 3

MANIFEST = "checksums.json"
PHASE_NAMES = {SFT_DONE: "SFT", WARMUP_DONE: "the draft warm-up"}


class TrainState(Stateful):
    def __init__(self):
        self.phase, self.rl_step = NOT_STARTED, 0

    @property
    def progress(self) -> int:
        """The checkpoint step id: phases finished, then RL steps."""
        return min(self.phase, WARMUP_DONE) + self.rl_step

    def state_dict(self):
        return {"phase": torch.tensor(self.phase), "rl_step": torch.tensor(self.rl_step)}

    def load_state_dict(self, state_dict):
        self.phase, self.rl_step = int(state_dict["phase"]), int(state_dict["rl_step"])


class OptimizerState(Stateful):
    """A plain torch optimizer as DCP state (fully qualified parameter names, sharded moments)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self):
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state_dict):
        set_optimizer_state_dict(self.model, self.optimizer, optim_state_dict=state_dict)


class RNGState(Stateful):
    """The global torch RNG (and the accelerator's) plus named generators, kept per rank: data-parallel
    ranks draw different rollout samples. Resuming needs the same world size."""

    def __init__(self, generators: dict[str, torch.Generator]):
        self.generators = generators
        self.key = f"rank{_rank_and_size()[0]}"

    def state_dict(self):
        states = {"torch": torch.get_rng_state(), **{k: g.get_state() for k, g in self.generators.items()}}
        if torch.cuda.is_available():
            states["cuda"] = torch.cuda.get_rng_state()
        return {self.key: states}

    def load_state_dict(self, state_dict):
        states = state_dict[self.key]
        torch.set_rng_state(states["torch"])
        if "cuda" in states:
            torch.cuda.set_rng_state(states["cuda"])
        for name, generator in self.generators.items():
            generator.set_state(states[name])


class JobCheckpoint:
    """torchtitan's CheckpointManager over the job's states; objects that appear in later phases
    (optimizers, the reference policy) are registered with `track` when they exist."""

    def __init__(self, cfg, policy: torch.nn.Module, draft: torch.nn.Module, generators: dict[str, torch.Generator],
                 *, plan: RunPlan):
        self.train_state = TrainState()
        self.states = {"draft": ModelWrapper(draft), "rng": RNGState(generators), "train_state": self.train_state}
        # The plan's folder whole: torchtitan joins it to its (empty) base folder.
        config = dataclasses.replace(cfg.checkpoint, interval=1, folder=plan.checkpoint_folder)
        self.manager = CheckpointManager(dataloader=None, model_parts=[policy], optimizers=None, lr_schedulers=None,
                                         states=self.states, checkpoint_config=config, sd_adapter=None)
        for unused in ("dataloader", "optimizer", "lr_scheduler"):  # torchtitan's slots this job leaves empty
            self.states.pop(unused)
        self.enabled, self.load_step = cfg.checkpoint.enable, cfg.checkpoint.load_step
        self.interval, self.total_rl_steps = cfg.checkpoint.interval, cfg.training.steps
        self.settings = job_settings(cfg, plan, draft.args)
        self._resume_step = None  # chosen once, by resume_phase()

    def track(self, **states: Stateful) -> None:
        self.states.update(states)

    def track_rl(self, states: dict[str, Stateful], draft_trains_here: bool = True) -> None:
        """RL's states (RLState.checkpoint_states). Under pipeline parallelism "model" becomes this
        rank's stage parts, and the draft and its optimizer are kept only on the last stage, where
        they train: the other ranks' copies are stale and must never be what a checkpoint holds."""
        self.states.update(states)
        if not draft_trains_here:
            for name in ("draft", "draft_optimizer"):
                self.states.pop(name, None)

    def resume_phase(self) -> int:
        """The phase of the latest complete, intact checkpoint (NOT_STARTED if none); reads only its
        TrainState, and says which checkpoint the job resumes from."""
        step = self._load_step()
        if step == -1:
            return NOT_STARTED
        folder = self.manager._create_checkpoint_id(step)
        dcp.load({"train_state": self.train_state}, checkpoint_id=folder)
        _say(resume_message(folder, self.train_state, self.total_rl_steps))
        return self.train_state.phase

    def load(self) -> None:
        """Everything tracked so far, from the checkpoint resume_phase() read."""
        self.manager.load(step=self._load_step())

    def _load_step(self) -> int:
        if self._resume_step is None:
            self._resume_step = self._find_intact_step()
        return self._resume_step

    def _find_intact_step(self) -> int:
        """[checkpoint] load_step if intact, else the newest intact step (-1: none)."""
        if not self.enabled:
            return -1
        if self.load_step != -1:
            folder = self.manager._create_checkpoint_id(self.load_step)
            problem = check_checkpoint(folder, self.settings)
            if problem is not None:
                raise ConfigError(f"checkpoint.load_step: {problem}; pick another step, or -1 for the newest intact "
                                  "one")
            return self.load_step
        for step in sorted(complete_steps(self.manager.folder), reverse=True):
            problem = check_checkpoint(self.manager._create_checkpoint_id(step), self.settings)
            if problem is None:
                return step
            _warn(f"{problem}; falling back to the previous complete checkpoint")
        return -1

    def save(self, phase: int, rl_step: int = 0) -> None:
        """Record the progress and save: phase ends always, RL steps at [checkpoint] interval and the last."""
        self.train_state.phase, self.train_state.rl_step = phase, rl_step
        if not self.enabled:
            return
        last = phase == IN_RL and rl_step == self.total_rl_steps
        if phase == IN_RL and not last and rl_step % self.interval != 0:
            return
        step = self.train_state.progress
        folder = self.manager._create_checkpoint_id(step)
        if is_rank0() and os.path.isdir(folder):
            shutil.rmtree(folder)  # a partial save of a killed run
        if dist.is_initialized():
            dist.barrier()
        self.manager.save(step)
        write_manifest(folder, self.settings)

    def close(self) -> None:
        self.manager.close()


def job_settings(cfg, plan: RunPlan, draft_args) -> dict:
    """What a resume must share with the job that saved: every saved tensor's shape and which rank saved
    what (the RNG states are per rank)."""
    return {"model.name": cfg.model.name, "model.flavor": cfg.model.flavor, "world size (NGPU)": plan.world_size,
            "parallelism.data_parallel_replicate_degree": plan.dp_replicate,
            "parallelism.data_parallel_shard_degree": plan.dp_shard,
            "parallelism.tensor_parallel_degree": plan.tp,
            "parallelism.context_parallel_degree": plan.cp,
            "parallelism.pipeline_parallel_degree": plan.pp,
            "draft.tap_layers": list(plan.tap_layers), "draft.vocab_size": draft_args.draft_vocab_size,
            "draft.n_heads": draft_args.n_heads, "draft.n_kv_heads": draft_args.n_kv_heads, "task.name": cfg.task.name}


def complete_steps(checkpoint_folder: str) -> list[int]:
    """Steps whose DCP save finished (`.metadata` written), as torchtitan counts them."""
    if not os.path.isdir(checkpoint_folder):
        return []
    return [int(name[5:]) for name in os.listdir(checkpoint_folder) if name.startswith("step-") and name[5:].isdigit()
            and os.path.isfile(os.path.join(checkpoint_folder, name, ".metadata"))]


def check_checkpoint(folder: str, settings: dict | None = None) -> str | None:
    """None if `folder` is a complete, intact checkpoint; else what is wrong, naming the file. Raises
    ConfigError when it was saved with other `settings` (job_settings)."""
    if not os.path.isfile(os.path.join(folder, ".metadata")):
        return f"checkpoint {folder} is incomplete (no .metadata)"
    try:
        with open(os.path.join(folder, MANIFEST)) as f:
            manifest = json.load(f)
    except (OSError, ValueError):
        return f"checkpoint {folder} has no readable {MANIFEST} (its save did not finish)"
    for key, value in (settings or {}).items():
        saved = manifest["settings"].get(key, value)
        if saved != value:
            raise ConfigError(f"{key}: the checkpoint {folder} was saved with {saved!r}, this job has {value!r}; "
                              "resume with the same setting, or use another job.dump_folder")
    names = sorted(manifest["files"])
    rank, world_size = _rank_and_size()
    problems = _gather({name: _file_problem(os.path.join(folder, name), manifest["files"][name])
                        for name in names[rank::world_size]})
    return next((problems[name] for name in names if problems[name] is not None), None)


def write_manifest(folder: str, settings: dict) -> None:
    """Every file's size and SHA-256, and the job's settings, into `folder`/checksums.json (atomically)."""
    names = sorted(name for name in os.listdir(folder) if os.path.isfile(os.path.join(folder, name)))
    rank, world_size = _rank_and_size()
    files = _gather({name: _file_record(os.path.join(folder, name)) for name in names[rank::world_size]})
    if is_rank0():
        with atomic_file(os.path.join(folder, MANIFEST)) as f:
            json.dump({"settings": settings, "files": files}, f, indent=1)
    if world_size > 1:
        dist.barrier()


def resume_message(folder: str, state: TrainState, total_rl_steps: int) -> str:
    if state.phase < IN_RL:
        return f"resuming from {folder} (after {PHASE_NAMES[state.phase]})"
    if state.rl_step >= total_rl_steps:
        return (f"already done: {folder} holds RL step {state.rl_step} of {total_rl_steps} (training.steps); "
                "raise training.steps to train further")
    return f"resuming from {folder} (after RL step {state.rl_step} of {total_rl_steps})"


def _file_record(path: str) -> dict:
    with open(path, "rb") as f:
        return {"size": os.path.getsize(path), "sha256": hashlib.file_digest(f, "sha256").hexdigest()}


def _file_problem(path: str, record: dict) -> str | None:
    if not os.path.isfile(path):
        return f"checkpoint file {path} is missing"
    actual = _file_record(path)
    if actual["size"] != record["size"]:
        return f"checkpoint file {path} has {actual['size']} bytes, {record['size']} were saved"
    if actual["sha256"] != record["sha256"]:
        return f"checkpoint file {path} is damaged (its SHA-256 differs from the one recorded at save)"
    return None


def _rank_and_size() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _gather(share: dict) -> dict:
    """The union of every rank's `share`."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return share
    shares = [None] * dist.get_world_size()
    dist.all_gather_object(shares, share)
    return {k: v for s in shares for k, v in s.items()}


def _say(message: str) -> None:
    if is_rank0():
        print(message, flush=True)


def _warn(message: str) -> None:
    if is_rank0():
        print(f"warning: {message}", file=sys.stderr, flush=True)
