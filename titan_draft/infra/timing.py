"""The project's timers: `DeviceTimer` (device time of code blocks, without synchronising the device)
and `timed` (one call between device syncs, the slowest rank's with a process group); `PhasePeak`,
the peak memory of a phase."""
import contextlib
import time

import torch
import torch.distributed as dist


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA runs asynchronously; CPU ops are done when they return)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, group=None):
    """(seconds, fn()'s result) of one call, from a device sync to the device sync after it. With a
    process group, the call starts after a barrier and its time is the slowest rank's (a step of
    several ranks is done when its last rank is)."""
    if group is not None:
        dist.barrier(group=group)
    synchronize(device)
    start = time.perf_counter()
    result = fn()
    synchronize(device)
    seconds = time.perf_counter() - start
    if group is not None:
        slowest = torch.tensor([seconds], dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
        seconds = float(slowest)
    return seconds, result


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
    peak statistic, reset on entry. `reserved_gib`: the most the caching allocator held meanwhile, which
    also counts memory no live tensor uses (CUDA graphs' private pools between their captures, cached free
    blocks, fragmentation). Only CUDA devices keep them: elsewhere both stay None."""

    def __init__(self, device: torch.device):
        self.on_cuda = torch.device(device).type == "cuda"
        self.gib = self.reserved_gib = None

    def __enter__(self):
        if self.on_cuda:
            torch.cuda.reset_peak_memory_stats()
        return self

    def __exit__(self, *exc):
        if self.on_cuda:
            self.gib = torch.cuda.max_memory_allocated() / 2**30
            self.reserved_gib = torch.cuda.max_memory_reserved() / 2**30
