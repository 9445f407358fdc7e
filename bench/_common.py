"""Helpers shared by the bench/ drivers: length mixes, the one timing loop, peak memory, out-of-memory errors,
per-op profiles, JSON, model sizes.

Every driver runs as `python -m bench.<name>` from the repository root, on CPU (gloo) and, unchanged,
under torchrun on GPUs (NCCL, one GPU per rank from LOCAL_RANK, via titan_draft.infra._compat.device()).
"""
import datetime
import json
import os
import statistics

import torch
import torch.distributed as dist

from titan_draft.infra import _compat
from titan_draft.infra.io import atomic_file
from titan_draft.infra.timing import synchronize, timed  # noqa: F401  (the drivers take them from here)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIXES = ("lognormal", "pareto", "one_long")


def document_lengths(mix: str, total: int, generator: torch.Generator, multiple: int = 1) -> list[int]:
    """Lengths summing to `total`, each a multiple of `multiple`, drawn from a long-tailed mix:
    lognormal (median 1K, sigma 1.5), pareto (alpha 1.1, from 128), one_long (half the tokens in
    one document, the rest lognormal)."""
    lengths = []
    if mix == "one_long":
        lengths.append(total // 2 // multiple * multiple)
    while sum(lengths) < total:
        if mix == "pareto":
            draw = 128 * float(torch.rand((), generator=generator)) ** (-1 / 1.1)
        else:
            draw = float(torch.empty(()).log_normal_(mean=6.9, std=1.5, generator=generator))
        length = max(multiple, round(draw / multiple) * multiple)
        lengths.append(min(length, total - sum(lengths)))
    return lengths


def alternate(steps: dict, rounds: int, device: torch.device, group=None, report=None) -> dict[str, list]:
    """The timing loop of every bench: `rounds` rounds of the named steps in turn (A B C A B C ...:
    drifts of the machine hit all alike), each call timed. Returns {name: [(seconds, result), ...]};
    report(round, name, seconds, result), when given, is called after every call (progress lines)."""
    records = {name: [] for name in steps}
    for i in range(rounds):
        for name, step in steps.items():
            seconds, result = timed(step, device, group)
            records[name].append((seconds, result))
            if report is not None:
                report(i, name, seconds, result)
    return records


def median_time(step, warmup: int, iters: int, device: torch.device, group=None, queued: bool = False
                ) -> tuple[float, int | None]:
    """(median seconds of step() over `iters` timed calls after `warmup` untimed ones, peak bytes
    allocated on `device` during the timed calls or None off CUDA); see `timed` for process groups.
    queued (CUDA, one process): time the calls as a training step runs a GPU op, queued back to back
    (no sync between them, so the host prepares the next call while the GPU runs this one), each
    timed by CUDA events from before its host code to after its last kernel: a call is never shorter
    than its GPU work, nor than its host work where the host is the slower."""
    for _ in range(warmup):
        step()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    if queued and device.type == "cuda" and group is None:
        events = [tuple(torch.cuda.Event(enable_timing=True) for _ in range(2)) for _ in range(iters)]
        for start, end in events:
            start.record()
            step()
            end.record()
        synchronize(device)
        times = [start.elapsed_time(end) / 1e3 for start, end in events]
    else:
        times = [seconds for seconds, _ in alternate({"step": step}, iters, device, group)["step"]]
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return statistics.median(times), peak


GRAPH_REPLAYS = 10  # graph replays per timed call of graph_milliseconds: sub-millisecond calls, timed between syncs


def graph_milliseconds(fn, device: torch.device, iters: int) -> float:
    """Milliseconds of one fn() call (no arguments; it works on tensors it holds), replayed from a
    CUDA graph on CUDA as the engine runs its steps: the median of `iters` timed calls of
    GRAPH_REPLAYS replays each, after the capture and one replay. Off CUDA, fn itself."""
    if device.type == "cuda":
        from titan_draft.rollout.graphs import CapturedCall  # the engine's capture (side-stream warm-up)

        fn = CapturedCall(fn, torch.Generator(device), torch.cuda.graph_pool_handle())

    def replays():
        for _ in range(GRAPH_REPLAYS):
            fn()

    return 1e3 * median_time(replays, 2, iters, device)[0] / GRAPH_REPLAYS


def device_time(step, calls: int, device: torch.device) -> float | None:
    """Seconds of GPU work per call of step(): the summed durations of the kernels, copies and
    fills it runs (torch.profiler), whatever the host adds around them; None off CUDA. Beside a
    queued time it tells a call bound by the GPU from one bound by the host that launches it."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            step()
        synchronize(device)
    return sum(event.self_device_time_total for event in prof.key_averages()) / calls / 1e6


def gather_peaks(peak: int | None, device: torch.device, group=None) -> list[int] | None:
    """Every rank's peak bytes (rank order), or None off CUDA."""
    if peak is None:
        return None
    if group is None:
        return [peak]
    peaks = torch.zeros(dist.get_world_size(group), dtype=torch.int64, device=device)
    peaks[dist.get_rank(group)] = peak
    dist.all_reduce(peaks, group=group)
    return peaks.tolist()


def out_of_memory(err: BaseException | None) -> bool:
    """Whether err, or an exception it was raised from or while handling, is torch's out-of-memory error
    (one raised inside a CUDA graph capture surfaces as the capture's own error)."""
    while err is not None:
        if isinstance(err, torch.OutOfMemoryError):
            return True
        err = err.__cause__ or err.__context__
    return False


def profile_steps(steps: dict, device: torch.device, path: str, append: bool = False) -> None:
    """torch.profiler's per-op tables of one call of each step: by device time, then by host time
    (written to path, or appended to it)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with open(path, "a" if append else "w") as f:
        for name, step in steps.items():
            with profile(activities=activities) as prof:
                step()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
            table = prof.key_averages()
            for sort in (["cuda_time_total"] if device.type == "cuda" else []) + ["self_cpu_time_total"]:
                f.write(f"## {name}: sorted by {sort}\n")
                f.write(table.table(sort_by=sort, row_limit=30, max_name_column_width=60) + "\n")
    print(f"wrote {path}")


def highest(records: list[dict], keys) -> dict:
    """Each key's highest value over the records (peak memory per phase), None where they hold None (off CUDA)."""
    return {key: max(r[key] for r in records) if records[0][key] is not None else None for key in keys}


def gib(nbytes) -> str:
    return "n/a" if nbytes is None else f"{nbytes / 2 ** 30:.2f}"


def environment() -> dict:
    """Date, device kind and software versions for a result JSON."""
    info = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                torch=torch.__version__, device="cpu", threads=torch.get_num_threads())
    if torch.cuda.is_available():
        info.update(device=torch.cuda.get_device_name(_compat.device()), cuda=torch.version.cuda,
                    nccl_nvls_enable=os.environ.get("NCCL_NVLS_ENABLE"))
    return info


def device_tag(device: torch.device) -> str:
    """A short name of the device for result file names: cpu, h200, a100, ..."""
    if device.type != "cuda":
        return device.type
    return torch.cuda.get_device_name(device).split()[-1].lower()


def write_json(path: str | None, result: dict) -> None:
    """Write `result` to `path` (folders made) atomically: a reader never sees half a file."""
    if not path:
        return
    with atomic_file(path) as f:
        json.dump(result, f, indent=1)


def sized_model_args(name: str, flavor: str, max_seq_len: int, *, dim: int = 0, layers: int = 0, heads: int = 0,
                     kv_heads: int = 0, vocab: int = 0):
    """titan_draft.models.policy.model_args for (name, flavor), with the given sizes overridden (0 = keep)."""
    from titan_draft.models.policy import model_args  # torchtitan: only for the drivers that build models

    args = model_args(name, flavor, max_seq_len)
    for field, value in (("dim", dim), ("n_layers", layers), ("n_heads", heads), ("n_kv_heads", kv_heads),
                         ("vocab_size", vocab)):
        if value:
            setattr(args, field, value)
    if name == "qwen3" and (dim or heads):
        args.head_dim = args.dim // args.n_heads
    return args


def cast_parameters(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """`module` with its parameters in `dtype`. Not Module.to(dtype): that would also cast the complex
    RoPE tables (torchtitan's freqs_cis) to a real dtype, dropping their imaginary part."""
    with torch.no_grad():
        for p in module.parameters():
            p.data = p.data.to(dtype)
    return module
