"""Helpers shared by the bench/ scripts: length mixes, timing, peak memory, JSON, models.

Every script here runs on CPU (gloo) and, unchanged, under torchrun on GPUs (NCCL, one GPU per
rank from LOCAL_RANK, via titan_draft._compat.device()).
"""
import datetime
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from titan_draft import _compat  # noqa: E402,F401  (before torchtitan)

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


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_time(step, warmup: int, iters: int, device: torch.device, group=None) -> tuple[float, int | None]:
    """(median seconds of step(), peak bytes allocated on `device` during the timed steps or None on CPU).

    With a process group, every timed step starts after a barrier and counts as the slowest rank's
    time (a CP step is done when its last rank is)."""
    for _ in range(warmup):
        step()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(iters):
        if group is not None:
            dist.barrier(group=group)
        synchronize(device)
        start = time.perf_counter()
        step()
        synchronize(device)
        times.append(time.perf_counter() - start)
    if group is not None:
        slowest = torch.tensor(times, dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
        times = slowest.tolist()
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return statistics.median(times), peak


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


def gib(nbytes) -> str:
    return "n/a" if nbytes is None else f"{nbytes / 2 ** 30:.2f}"


def environment() -> dict:
    """Date, device kind and software versions for a result JSON."""
    info = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                torch=torch.__version__, device="cpu")
    if torch.cuda.is_available():
        info.update(device=torch.cuda.get_device_name(_compat.device()), cuda=torch.version.cuda,
                    nccl_nvls_enable=os.environ.get("NCCL_NVLS_ENABLE"))
    return info


def write_json(path: str | None, result: dict) -> None:
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=1)


def policy_model_args(name: str, flavor: str, max_seq_len: int, dim: int = 0, layers: int = 0, heads: int = 0,
                      kv_heads: int = 0, vocab: int = 0):
    """titan_draft's torchtitan model args for (name, flavor), with the given sizes overridden (0 = keep)."""
    from titan_draft.models.policy import model_args

    args = model_args(name, flavor, max_seq_len)
    for field, value in (("dim", dim), ("n_layers", layers), ("n_heads", heads), ("n_kv_heads", kv_heads),
                         ("vocab_size", vocab)):
        if value:
            setattr(args, field, value)
    if name == "qwen3" and (dim or heads):
        args.head_dim = args.dim // args.n_heads
    return args


def build_policy_from_args(args, seed: int = 0) -> torch.nn.Module:
    """A freshly initialised torchtitan policy for `args` on this rank's device, packed attention installed."""
    from titan_draft.models.policy import install_packed_attention

    if type(args).__name__.startswith("Qwen3"):
        from torchtitan.models.qwen3 import Qwen3Model as Model
    else:
        from torchtitan.models.llama3 import Transformer as Model
    torch.manual_seed(seed)
    with torch.device(_compat.device()):
        policy = Model(args)
        with torch.no_grad():
            policy.init_weights()
    install_packed_attention(policy)
    return policy
