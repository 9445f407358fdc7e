"""A CUDA graph's first replay against its later ones, with and without uploading it at capture
(titan_draft/rollout/graphs.upload, cudaGraphUpload), for chains of small kernels like a decode step's.

CUDA puts an instantiated graph on the device in its first launch unless it was uploaded before, so
the first replay costs more than later ones; the engine uploads every graph it captures, because
adaptive K times replays as step costs. Each chain (--layers L: L x (matmul [16 x 512] @ [512 x 512],
tanh, scale, add), about 3 L kernels) is captured --repeats times as the engine captures
(rollout/graphs.capture); per capture, the first replay and the
median of 10 later ones are timed between device syncs; the table gives the medians over captures.

  python -m bench.graph_upload                       # one GPU, seconds
  python -m bench.graph_upload --layers 25 100 300

CUDA only. Writes bench/results/graph_upload_<device>.json (--out) and prints the table.
"""
import argparse
import os
import statistics
import time

import torch

from bench._common import REPO_ROOT, device_tag, environment, write_json
from titan_draft.rollout.graphs import capture, upload


def chain(x: torch.Tensor, weights: list[torch.Tensor], layers: int):
    """A function of no arguments updating x in place through `layers` small layers."""
    def run():
        y = x
        for i in range(layers):
            y = torch.tanh(y @ weights[i % len(weights)]) * 0.5 + y
        x.copy_(y)
    return run


def replay_ms(graph: torch.cuda.CUDAGraph) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, nargs="+", default=[25, 100, 300])
    p.add_argument("--repeats", type=int, default=5, help="captures per row")
    p.add_argument("--out", help="JSON path (default bench/results/graph_upload_<device>.json)")
    a = p.parse_args()
    if not torch.cuda.is_available():
        p.error("CUDA graphs need a GPU")
    device = torch.device("cuda")
    x = torch.randn(16, 512, device=device)
    weights = [torch.randn(512, 512, device=device) for _ in range(8)]
    generator = torch.Generator(device)
    rows = []
    print(f"{'layers':>6} {'uploaded':>8} {'first ms':>9} {'later ms':>9} {'first / later':>13}")
    for layers in a.layers:
        for uploaded in (False, True):
            first, later = [], []
            for _ in range(a.repeats):
                graph = capture(chain(x, weights, layers), generator)
                if uploaded:
                    upload(graph)
                torch.cuda.synchronize()
                first.append(replay_ms(graph))
                later.append(statistics.median(replay_ms(graph) for _ in range(10)))
            row = dict(layers=layers, uploaded=uploaded, first_replay_ms=statistics.median(first),
                       later_replay_ms=statistics.median(later))
            rows.append(row)
            print(f"{layers:>6} {str(uploaded):>8} {row['first_replay_ms']:>9.3f} {row['later_replay_ms']:>9.3f} "
                  f"{row['first_replay_ms'] / row['later_replay_ms']:>13.2f}")
    out = a.out or os.path.join(REPO_ROOT, "bench", "results", f"graph_upload_{device_tag(device)}.json")
    write_json(out, {**environment(), "repeats": a.repeats, "rows": rows})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
