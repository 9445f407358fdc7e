"""The policy's block projections at a few rows (decode and verify steps at small batch): cuBLAS,
cuBLASLt and the few-row Triton kernel (titan_draft/ops/skinny_linear.py) side by side in one
process, with the kernel's shipped configuration and the best one of a sweep.

Each projection (q/k/v, wo, gate/up, down in the engine's fused layout, cached_model.fuse_block) is
timed as a CUDA graph of one call per block, each on its own weight matrix, as a decode step runs them
(no weight is read from L2 twice): the median of --iters timed calls (bench._common.graph_milliseconds).
Columns: microseconds per call and the read rate (the weight's bytes over the time) for each kernel;
the sweep's best (BLOCK_N, BLOCK_K, warps, stages).

  python -m bench.skinny_linear                       # one GPU: the Qwen3-1.7B blocks (~2 min with --sweep)
  python -m bench.skinny_linear --sweep --rows 1 16   # also every configuration of the sweep
  python -m bench.skinny_linear --flavor 0.6B --blocks 4

CUDA only (the kernel is Triton's; tests/test_skinny_linear.py checks it on CPU in Triton's
interpreter). Writes bench/results/skinny_linear_<flavor>_<device>.json (--out) and the table beside it.
"""
import argparse
import itertools
import os

import torch
import torch.nn.functional as F

from bench._common import REPO_ROOT, device_tag, environment, graph_milliseconds, write_json
from titan_draft.ops.skinny_linear import _config, launch

SWEEP = list(itertools.product((16, 32, 64), (128, 256, 512), (4, 8), (3, 4, 6)))


def projection_shapes(name: str, flavor: str) -> dict[str, tuple[int, int]]:
    """(out features, in features) of each fused block projection, from a block built on the meta device."""
    from titan_draft.models.policy import build_policy
    from titan_draft.rollout.cached_model import fuse_block

    model = build_policy(name, flavor, 64, device="meta")
    weights = fuse_block(next(iter(model.layers.values())))
    return {key: tuple(getattr(weights, key).shape) for key in ("qkv", "wo", "gate_up", "down")}


def microseconds(calls, device: torch.device, iters: int) -> float:
    """Microseconds per call of `calls`, all of them one CUDA graph (graph_milliseconds)."""
    return 1e3 * graph_milliseconds(lambda: [call() for call in calls], device, iters) / len(calls)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3")
    p.add_argument("--flavor", default="1.7B")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 5, 16], help="rows of x (<= 16)")
    p.add_argument("--blocks", type=int, default=28, help="distinct weight matrices per graph (the model's blocks)")
    p.add_argument("--sweep", action="store_true", help="time every (BLOCK_N, BLOCK_K, warps, stages) of SWEEP too")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--out")
    a = p.parse_args()
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU (the kernel's CPU check is tests/test_skinny_linear.py)")
    device, dtype = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator(device).manual_seed(0)
    rows, lines = [], []

    def say(line):
        print(line, flush=True)
        lines.append(line)

    say(f"{a.model} {a.flavor}, {a.blocks} weights per graph, bf16, {torch.cuda.get_device_name()}")
    say(f"{'proj':>8} {'N':>6} {'K':>5} {'M':>3} | {'cuBLAS us':>9} {'cuBLASLt':>8} {'Triton':>7} "
        f"{'best':>7} | TB/s cuBLAS / Triton / best | best config")
    for name, (N, K) in projection_shapes(a.model, a.flavor).items():
        weights = [torch.randn(N, K, generator=gen, device=device, dtype=dtype) / K ** 0.5 for _ in range(a.blocks)]
        for M in a.rows:
            x = torch.randn(M, K, generator=gen, device=device, dtype=dtype)
            shipped = _config(N, K)
            torch.testing.assert_close(launch(x, weights[0], shipped), F.linear(x, weights[0]), rtol=2e-2, atol=2e-2)
            times = {}
            for library in ("cublas", "cublaslt"):
                torch.backends.cuda.preferred_blas_library(library)
                times[library] = microseconds([lambda w=w: F.linear(x, w) for w in weights], device, a.iters)
            torch.backends.cuda.preferred_blas_library("cublas")
            times["triton"] = microseconds([lambda w=w: launch(x, w, shipped) for w in weights], device, a.iters)
            best_config, best = shipped, times["triton"]
            for config in SWEEP if a.sweep else ():
                try:
                    t = microseconds([lambda w=w: launch(x, w, config) for w in weights], device, a.iters)
                except RuntimeError:  # triton.runtime.errors.OutOfResources: shared memory
                    continue
                if t < best:
                    best_config, best = config, t
            times["best"] = best
            rate = {key: N * K * 2 / t / 1e6 for key, t in times.items()}  # bytes / us -> TB/s
            rows.append(dict(projection=name, N=N, K=K, M=M, cublas_us=times["cublas"], cublaslt_us=times["cublaslt"],
                             triton_us=times["triton"], triton_config=shipped, best_us=best, best_config=best_config,
                             cublas_TBps=rate["cublas"], triton_TBps=rate["triton"], best_TBps=rate["best"]))
            say(f"{name:>8} {N:>6} {K:>5} {M:>3} | {times['cublas']:>9.2f} {times['cublaslt']:>8.2f} "
                f"{times['triton']:>7.2f} {best:>7.2f} | {rate['cublas']:.2f} / {rate['triton']:.2f} / "
                f"{rate['best']:.2f} | {best_config}")
    out = a.out or os.path.join(REPO_ROOT, "bench", "results", f"skinny_linear_{a.flavor}_{device_tag(device)}.json")
    write_json(out, dict(args=vars(a), **environment(), rows=rows))
    with open(os.path.splitext(out)[0] + ".txt", "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
