"""CUDA graphs of the engine's in-place calls (prefill, decode steps, flushes), one per key.

A call is a function of no arguments and no outputs that works on static-shape tensors living in
engine buffers, with no host synchronisation inside, so it can be captured once and replayed.
`StepGraphs.run` replays a key's graph once the key has been used CAPTURE_AFTER times and runs it
eagerly before; elsewhere than CUDA every call runs eagerly. Both run the same code. After the graphs
are dropped (the engine's buffers given back or grown), a key the previous buffers used that often is
captured again at its first use; one they used less runs eagerly again (a capture costs more than
an eager run, which costs more than a replay). A decode step's key is its `StepShape`: every field
of it that differs is another graph to capture.
"""
import ctypes
import functools
import gc
import time
from dataclasses import dataclass

import torch

# A key (decode-step shape, ...) runs eagerly this many times before it is captured as a CUDA graph.
CAPTURE_AFTER = 3


@dataclass(frozen=True)
class StepShape:
    """The static shape of a decode step (its CUDA graph key)."""
    full: int
    """Rows of the call: random numbers are drawn for all of them (RowNoise)."""
    rows: int
    """Slots the step runs: the active-row bucket."""
    k: int
    """Draft tokens."""
    temperature: float
    top_p: float
    stage: bool
    """A K = 0 step keeps its taps for the draft's trunk (adaptive K)."""
    width: int
    """Cache slots its attention may read (RolloutEngine.step_width): on CUDA all of them, the decode
    kernel's chunk count."""


class CapturedCall:
    """fn() (no arguments, no outputs: it works on tensors it holds) as a CUDA graph.

    The first call runs fn eagerly on a side stream, as a real call, so that lazy initialisation
    (cuBLAS handles, allocator growth) happens outside capture; then fn is captured. Every later
    call replays the graph. Random numbers come from `generator`, registered with the graph so
    that every replay draws fresh ones. Tensors fn allocates live in `pool` and must not outlive
    the call (graphs sharing a pool may then replay in any order).
    """

    def __init__(self, fn, generator: torch.Generator, pool):
        self.fn, self.generator, self.pool, self.graph = fn, generator, pool, None

    def __call__(self) -> None:
        if self.graph is not None:
            self.graph.replay()
            return
        graph = capture(self.fn, self.generator, self.pool)
        upload(graph)
        self.graph = graph


def capture(fn, generator: torch.Generator, pool=None) -> torch.cuda.CUDAGraph:
    """fn run eagerly on a side stream (a real call: lazy initialisation happens outside capture), then
    captured as a graph that draws its random numbers from `generator` and allocates in `pool`. Not
    uploaded (`upload`)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    graph.register_generator_state(generator)
    # No cyclic garbage collection during the capture: it could free a dropped engine's graphs
    # (an engine and its captured steps form a reference cycle), and destroying a graph while a
    # stream captures invalidates the capture ("operation not permitted when stream is capturing").
    collecting = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool):
            fn()
    finally:
        if collecting:
            gc.enable()
    return graph


@functools.cache
def _cuda_runtime() -> ctypes.CDLL | None:
    """The CUDA runtime library torch has loaded (None where torch was not built with CUDA, or the
    library cannot be found by that name)."""
    if torch.version.cuda is None:
        return None
    try:
        return ctypes.CDLL(f"libcudart.so.{torch.version.cuda.split('.')[0]}")
    except OSError:
        return None


def upload(graph: torch.cuda.CUDAGraph) -> None:
    """Put an instantiated graph on the device now (cudaGraphUpload), which CUDA otherwise does in its
    first launch: that replay then takes 1.5-2.2x a later one, and adaptive K would time it as the
    step's cost (bench.graph_upload on an H100: 0.61 / 1.66 / 4.59 ms against 0.28 / 1.03 / 3.10 ms for
    graphs of ~75 / 300 / 900 kernels; 1.01x uploaded). Without the runtime library by name the first
    launch keeps that cost."""
    runtime = _cuda_runtime()
    if runtime is None:
        return
    status = runtime.cudaGraphUpload(ctypes.c_void_p(graph.raw_cuda_graph_exec()),
                                     ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
    if status != 0:
        raise RuntimeError(f"cudaGraphUpload failed with CUDA error {status}")


class StepGraphs:
    """The captured calls of one engine, by key, and how often each key was used.

    enabled: capture at all (CUDA with cuda_graphs). generator: the engine's generator, whose
    state every graph registers. The graphs share one private memory pool, taken at the first
    capture. A key is captured at its CAPTURE_AFTER-th use since the last `clear()`, or at its first
    use when it had reached that count between the two clears before (a shape the rollouts use many
    times is captured again at once after release_caches; one they use once or twice is not).
    `uses` counts every use, across clears.
    """

    def __init__(self, enabled: bool, generator: torch.Generator):
        self.enabled, self.generator = enabled, generator
        self.steps: dict[object, CapturedCall] = {}
        self.uses: dict[object, int] = {}
        self._uses_now: dict[object, int] = {}  # since the last clear()
        self._uses_before: dict[object, int] = {}  # between the two clears before
        self.unreplayed = 0  # run() calls (since the caller last zeroed it) that were not graph replays
        # Host seconds of the run() calls (since the caller last zeroed it) that captured a graph, each with
        # its eager run (which the capture waits for): what release_caches costs the next call.
        self.capture_s = 0.0
        self.pool = None

    def captured(self, fn):
        """fn (no arguments, no outputs) as a CapturedCall when enabled, else fn itself."""
        if not self.enabled:
            return fn
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        return CapturedCall(fn, self.generator, self.pool)

    def run(self, key, fn) -> bool:
        """fn(), replayed from its CUDA graph once its key has been used CAPTURE_AFTER times (eagerly
        before: the many (bucket, K) keys a long tail or adaptive K visits only a few times never
        pay a capture); True when the call was not a replay (not a representative time)."""
        self.uses[key] = self.uses.get(key, 0) + 1
        uses = self._uses_now[key] = self._uses_now.get(key, 0) + 1
        if not self.enabled or max(uses, self._uses_before.get(key, 0)) < CAPTURE_AFTER:
            fn()
            self.unreplayed += self.enabled
            return self.enabled
        if key not in self.steps:
            start = time.perf_counter()
            self.steps[key] = self.captured(fn)
            self.steps[key]()
            self.capture_s += time.perf_counter() - start
            self.unreplayed += 1
            return True
        self.steps[key]()
        return False

    def capture_at_next_use(self, key) -> None:
        """Make key's next run capture it (unless the key has been used since the last clear)."""
        self._uses_now.setdefault(key, CAPTURE_AFTER - 1)

    def clear(self) -> None:
        """Drop the graphs, and with the last of them the pool's claim on its memory. A pool whose
        graphs are gone cannot take new captures: the next capture takes a new one."""
        self.steps.clear()
        self.pool = None
        self._uses_before, self._uses_now = self._uses_now, {}
