"""Metrics: one line per step on stdout, metrics.jsonl and TensorBoard under the dump folder."""
import json
import math
import os
import sys
import time

import torch


class MetricsLogger:
    """Rank 0 writes; other ranks keep quiet. Every record carries `phase` and `step`."""

    def __init__(self, dump_folder: str, rank: int = 0, tensorboard: bool = True):
        self.enabled = rank == 0
        self.start = time.time()
        self._tb = None
        if not self.enabled:
            return
        os.makedirs(dump_folder, exist_ok=True)
        self.path = os.path.join(dump_folder, "metrics.jsonl")
        self._file = open(self.path, "a", buffering=1)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(os.path.join(dump_folder, "tb"))

    def log(self, phase: str, step: int, values: dict, echo: bool = True) -> None:
        if not self.enabled:
            return
        values = {k: _plain(v) for k, v in values.items()}
        self._file.write(json.dumps({"phase": phase, "step": step, **values}) + "\n")
        if self._tb is not None:
            for key, value in values.items():
                if isinstance(value, (int, float)) and math.isfinite(value):
                    self._tb.add_scalar(f"{phase}/{key}", value, step)
        if echo:
            from tqdm import tqdm

            shown = "  ".join(f"{k} {_short(v)}" for k, v in values.items())
            tqdm.write(f"[{phase} {step:>4}] {shown}")  # above any progress bar, not through it
            sys.stdout.flush()

    def close(self) -> None:
        if self.enabled:
            self._file.close()
            if self._tb is not None:
                self._tb.close()


def progress(iterable, desc: str, enabled: bool = True):
    """A progress bar for long loops (tqdm), silent on non-zero ranks. Redrawn every second on a
    terminal; every 10 s when the output is a pipe or a log file (torchrun --tee), so logs stay short."""
    from tqdm import tqdm

    interval = 1.0 if sys.stderr.isatty() else 10.0
    return tqdm(iterable, desc=desc, disable=not enabled, dynamic_ncols=True, mininterval=interval,
                maxinterval=interval)


def _plain(v):
    if isinstance(v, torch.Tensor):
        v = v.item() if v.numel() == 1 else v.tolist()
    return v


def _short(v):
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def read_metrics(path: str, phase: str | None = None) -> list[dict]:
    """The records of a metrics.jsonl, optionally of one phase."""
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    return [r for r in records if phase is None or r["phase"] == phase]
