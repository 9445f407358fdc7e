"""Device time of code blocks inside a training step, measured without synchronising the device."""
import contextlib
import time

import torch


class DeviceTimer:
    """Sums the time of the blocks run under `with timer():` until `pop_seconds()`.

    On CUDA each block is bracketed by two events on the current stream, so nothing waits: the
    events are read in pop_seconds, after the step has synchronised anyway. Elsewhere ops finish
    before they return, so the wall clock is the device time."""

    def __init__(self, device: torch.device):
        self.on_cuda = torch.device(device).type == "cuda"
        self._events: list[tuple] = []
        self._seconds = 0.0

    @contextlib.contextmanager
    def __call__(self):
        if self.on_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events.append((start, end))
        else:
            start = time.perf_counter()
            yield
            self._seconds += time.perf_counter() - start

    def pop_seconds(self) -> float:
        """Seconds of the blocks since the last call (waits for the last block's end on CUDA)."""
        if self._events:
            self._events[-1][1].synchronize()
        seconds = self._seconds + sum(start.elapsed_time(end) for start, end in self._events) / 1e3
        self._events, self._seconds = [], 0.0
        return seconds


class PhasePeak:
    """The most device memory allocated during a `with` block (a phase of the step), in GiB: torch.cuda's
    peak statistic, reset on entry. Only CUDA devices keep one: elsewhere `gib` stays None."""

    def __init__(self, device: torch.device):
        self.on_cuda = torch.device(device).type == "cuda"
        self.gib = None

    def __enter__(self):
        if self.on_cuda:
            torch.cuda.reset_peak_memory_stats()
        return self

    def __exit__(self, *exc):
        if self.on_cuda:
            self.gib = torch.cuda.max_memory_allocated() / 2**30
