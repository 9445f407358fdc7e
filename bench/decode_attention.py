"""The rollout engine's cached attention (titan_draft.rollout.cached_model._attend) against SDPA's default
backend with enable_gqa (cuDNN on the H200), side by side in one process, on the engine's cache
layout: B rows, S queries per row (S = 1: a plain decode step; S = K + 1: a verify window), a static
cache of L slots of which the mask keeps slots <= each query's position, GQA (Hq query heads per
Hkv kv heads). Each call is captured in a CUDA graph and replayed, as the engine runs it. On CUDA
the engine's calls of up to 16 queries per row run the decode kernel (ops/decode_attention.py).

  python -m bench.decode_attention                          # one H200: the arith/sort policy's attention
  python -m bench.decode_attention --batch-sizes 1 512 --queries 1 5 --widths 1285 161

Columns: sdpa_ms (SDPA, enable_gqa, default backend), engine_ms (_attend), their ratio; the
table and the JSON (bench/results/decode_attention_<device>.json, --out to change).
"""
import argparse
import os

import torch
import torch.nn.functional as F

from bench._common import REPO_ROOT, device_tag, environment, graph_milliseconds, write_json
from titan_draft.rollout.cached_model import _attend


def sdpa_gqa(q, k_cache, v_cache, mask):
    """The one-call alternative: SDPA's default backend with enable_gqa."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2),
                                         attn_mask=mask[:, None], enable_gqa=True)
    return out.transpose(1, 2)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64, 512])
    p.add_argument("--queries", type=int, nargs="+", default=[1, 2, 5])
    p.add_argument("--widths", type=int, nargs="+", default=[1285, 161, 69],
                   help="cache slots attended (1285: the arith preset's whole cache, 69: the sort preset's)")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--out")
    a = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device).manual_seed(0)
    rows = []
    print(f"{'B':>5} {'S':>3} {'L':>5} {'sdpa_ms':>8} {'engine_ms':>9} {'sdpa/engine':>11}")
    for L in a.widths:
        for B in a.batch_sizes:
            k_cache, v_cache = (torch.randn(B, L, a.kv_heads, a.head_dim, generator=gen, device=device, dtype=dtype)
                                for _ in range(2))
            for S in a.queries:
                q = torch.randn(B, S, a.heads, a.head_dim, generator=gen, device=device, dtype=dtype)
                # Queries at the last S positions of a random length per row (at least S).
                length = torch.randint(S, L + 1, (B,), generator=gen, device=device)
                positions = length[:, None] - S + torch.arange(S, device=device)
                mask = torch.arange(L, device=device) <= positions[..., None]
                engine_call = lambda: _attend(q, k_cache, v_cache, positions, L)  # noqa: E731
                sdpa_call = lambda: sdpa_gqa(q, k_cache, v_cache, mask)  # noqa: E731
                torch.testing.assert_close(engine_call(), sdpa_call(), rtol=2e-2, atol=2e-2)
                sdpa = graph_milliseconds(sdpa_call, device, a.iters)
                engine = graph_milliseconds(engine_call, device, a.iters)
                rows.append(dict(batch=B, queries=S, width=L, sdpa_ms=sdpa, engine_ms=engine,
                                 sdpa_over_engine=sdpa / engine))
                print(f"{B:>5} {S:>3} {L:>5} {sdpa:>8.4f} {engine:>9.4f} {sdpa / engine:>10.2f}x", flush=True)
    out = a.out or os.path.join(REPO_ROOT, "bench", "results", f"decode_attention_{device_tag(device)}.json")
    write_json(out, dict(args=vars(a), **environment(), dtype=str(dtype), rows=rows))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
