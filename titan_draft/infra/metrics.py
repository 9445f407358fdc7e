"""Metrics: one line per step on stdout, metrics.jsonl and TensorBoard under the dump folder.

A resumed job redoes the steps after its checkpoint: when it logs a (phase, step) that metrics.jsonl
already holds, the file is cut just before that record, so every step keeps one row, the newest."""
import json
import math
import os
import sys
import time

import torch

from titan_draft.infra.ranks import is_rank0

# Wall-clock measurements: the only metrics that may differ between two runs with one seed.
TIMING_KEYS = frozenset({"rollout_time_s", "rollout_weights_s", "rollout_measure_s", "rollout_prefill_s",
                         "rollout_decode_s", "rollout_capture_s", "rollout_tokens_per_s", "train_time_s",
                         "draft_time_s", "rollout_call_ratio_drafting", "rollout_call_ratio_plain"})
# In metrics.jsonl and TensorBoard, not on the console line, whose one acceptance figure is
# spec_acceptance_length, the one vLLM and NeMo RL users know (docs/DESIGN.md 4.3 defines both), and
# whose one CUDA-graph figure is rollout_unreplayed_calls.
FILE_ONLY_KEYS = frozenset({"tokens_per_verify_forward", "rollout_capture_s", "rollout_call_ratio_drafting",
                            "rollout_call_ratio_plain"})


class MetricsLogger:
    """Rank 0 writes; other ranks, and a logger made with enabled=False, keep quiet. Every record carries
    `phase` and `step`."""

    def __init__(self, dump_folder: str, tensorboard: bool = True, enabled: bool = True):
        self.enabled = enabled and is_rank0()
        self.start = time.time()
        self._tb = None
        if not self.enabled:
            return
        os.makedirs(dump_folder, exist_ok=True)
        self.path = os.path.join(dump_folder, "metrics.jsonl")
        self._offsets = _record_offsets(self.path)
        self._file = open(self.path, "a", buffering=1)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(os.path.join(dump_folder, "tb"))

    def log(self, phase: str, step: int, values: dict, echo: bool = True) -> None:
        if not self.enabled:
            return
        values = {k: _plain(v) for k, v in values.items()}
        if (phase, step) in self._offsets:  # a resumed run redoes this step: drop it and all after it
            cut = self._offsets[(phase, step)]
            self._file.truncate(cut)
            self._offsets = {key: offset for key, offset in self._offsets.items() if offset < cut}
        self._file.write(json.dumps({"phase": phase, "step": step, **values}) + "\n")
        if self._tb is not None:
            for key, value in values.items():
                if isinstance(value, (int, float)) and math.isfinite(value):
                    self._tb.add_scalar(f"{phase}/{key}", value, step)
        if echo:
            from tqdm import tqdm

            shown = "  ".join(f"{k} {_short(v)}" for k, v in values.items() if k not in FILE_ONLY_KEYS)
            tqdm.write(f"[{phase} {step:>4}] {shown}")  # above any progress bar, not through it
            sys.stdout.flush()

    def close(self) -> None:
        if self.enabled:
            self._file.close()
            if self._tb is not None:
                self._tb.close()


def _record_offsets(path: str) -> dict[tuple[str, int], int]:
    """Byte offset of the first record of every (phase, step) in a metrics.jsonl. A last line cut short
    by a killed run is removed from the file."""
    offsets, end = {}, 0
    if not os.path.exists(path):
        return offsets
    with open(path, "rb") as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:
                break
            if not line.endswith(b"\n"):
                break
            offsets.setdefault((record["phase"], record["step"]), end)
            end += len(line)
    if end != os.path.getsize(path):
        os.truncate(path, end)
    return offsets


def progress(iterable, desc: str, enabled: bool = True, interval: float = 10.0):
    """Progress of a long loop on stderr, silent on non-zero ranks: a bar (tqdm) on a terminal; in a
    log file or pipe (torchrun --tee) a whole line every `interval` seconds and at the end, since a bar's
    carriage-return redraws reach a log as fragments. Both take set_postfix(name=value, ...)."""
    if enabled and sys.stderr.isatty():
        from tqdm import tqdm

        return tqdm(iterable, desc=desc, dynamic_ncols=True, mininterval=1.0)
    return ProgressLines(iterable, desc, enabled, interval)


class ProgressLines:
    """`desc: done/total (percent)  rate  eta  postfix` lines, for logs."""

    def __init__(self, iterable, desc: str, enabled: bool, interval: float):
        self.iterable, self.desc, self.enabled, self.interval = iterable, desc, enabled, interval
        self.total = len(iterable) if hasattr(iterable, "__len__") else None
        self.postfix = {}

    def set_postfix(self, refresh: bool = False, **values) -> None:
        self.postfix = values

    def __iter__(self):
        start = last = time.monotonic()
        for done, item in enumerate(self.iterable, 1):
            yield item  # the loop body runs here, so the line below shows its postfix
            now = time.monotonic()
            if self.enabled and (now - last >= self.interval or done == self.total):
                last = now
                print(self._line(done, now - start), file=sys.stderr, flush=True)

    def _line(self, done: int, elapsed: float) -> str:
        rate = done / max(elapsed, 1e-9)
        if self.total:
            head = f"{self.desc}: {done}/{self.total} ({100 * done // self.total}%)"
            head += f"  {rate:.3g} it/s  eta {(self.total - done) / rate:.0f} s"
        else:
            head = f"{self.desc}: {done}  {rate:.3g} it/s"
        return "  ".join([head, *(f"{k} {v}" for k, v in self.postfix.items())])


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
