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

When to save is decided here ([checkpoint] interval counts RL steps; phase ends always save), so
the manager runs with interval 1. Its last-step save (model-only by default, which would drop the
draft and the RL state) is never used: every save, the final one included, is a full one.
"""
import dataclasses
import os
import shutil
import signal

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from titan_draft import _compat  # noqa: F401  (before torchtitan)
from torchtitan.components.checkpoint import CheckpointManager, ModelWrapper

# Phases in the order the job runs them; TrainState.phase is the last one finished.
NOT_STARTED, SFT_DONE, WARMUP_DONE, IN_RL = 0, 1, 2, 3

# Test hook: SIGKILL this process inside the save of this progress step, after the data files and
# before `.metadata` (tests/test_checkpoint_resume.py).
KILL_DURING_SAVE_ENV = "TITAN_DRAFT_TEST_KILL_DURING_SAVE"


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
        self.key = f"rank{dist.get_rank() if dist.is_initialized() else 0}"

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

    def __init__(self, cfg, policy: torch.nn.Module, draft: torch.nn.Module, generators: dict[str, torch.Generator]):
        self.train_state = TrainState()
        self.states = {"draft": ModelWrapper(draft), "rng": RNGState(generators), "train_state": self.train_state}
        config = dataclasses.replace(cfg.checkpoint, interval=1)
        self.manager = CheckpointManager(dataloader=None, model_parts=[policy], optimizers=None, lr_schedulers=None,
                                         states=self.states, checkpoint_config=config, sd_adapter=None,
                                         base_folder=cfg.job.dump_folder)
        for unused in ("dataloader", "optimizer", "lr_scheduler"):  # torchtitan's slots this job leaves empty
            self.states.pop(unused)
        self.enabled, self.load_step = cfg.checkpoint.enable, cfg.checkpoint.load_step
        self.interval, self.total_rl_steps = cfg.checkpoint.interval, cfg.training.steps

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
        """The phase of the latest complete checkpoint (NOT_STARTED if none); reads only its TrainState."""
        step = self._load_step()
        if step == -1:
            return NOT_STARTED
        dcp.load({"train_state": self.train_state}, checkpoint_id=self.manager._create_checkpoint_id(step))
        return self.train_state.phase

    def load(self) -> None:
        """Everything tracked so far, from the checkpoint resume_phase() read."""
        self.manager.load(step=self._load_step())

    def _load_step(self) -> int:
        if not self.enabled:
            return -1
        return self.load_step if self.load_step != -1 else self.manager._find_load_step()

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
        if (not dist.is_initialized() or dist.get_rank() == 0) and os.path.isdir(folder):
            shutil.rmtree(folder)  # a partial save of a killed run
        if dist.is_initialized():
            dist.barrier()
        if os.environ.get(KILL_DURING_SAVE_ENV) == str(step):
            _kill_before_metadata()
        self.manager.save(step)

    def close(self) -> None:
        self.manager.close()


def _kill_before_metadata() -> None:
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    def finish(*_args, **_kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    FileSystemWriter.finish = finish
