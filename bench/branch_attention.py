"""Forward+backward cost of branch attention against plain causal varlen attention and the
naive materialised version, on the same packed tokens.

    .venv/bin/python -m bench.branch_attention --device cpu
    python -m bench.branch_attention --device cuda --out outputs/bench_branch_attention.json

plain  = branch_attention without a branch (P = 0): the same primitives, trunk only.
branch = branch_attention with P = 2 and 3 branch passes.
naive  = branch_attention_reference (dense [Hq, T, T + P*T] scores), P = 3.
Times are medians over --iters runs after --warmup runs. Peak memory (torch.cuda
max_memory_allocated, inputs included) is measured on CUDA only: torch's CPU allocator is not
visible to tracemalloc, so CPU rows leave it out.
"""
import argparse
import os

import torch

from bench._common import median_time, write_json
from titan_draft.ops import available_backends, branch_attention, branch_attention_reference

BRANCH_PASSES = (2, 3)
NAIVE_PASSES = 3


def parse_args():
    on_gpu = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if on_gpu else "cpu")
    parser.add_argument("--dtype", default=None, help="default bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--tokens", type=int, nargs="+", default=None)
    parser.add_argument("--heads", type=int, default=None)
    parser.add_argument("--kv-heads", type=int, default=None)
    parser.add_argument("--head-dim", type=int, default=None)
    parser.add_argument("--docs", type=int, default=4, help="packed documents, random lengths")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--naive-max-gib", type=float, default=None,
                        help="skip the naive run when its score matrix alone exceeds this "
                             "(default: try and catch OOM on cuda, 2 GiB on cpu)")
    parser.add_argument("--out", default=None, help="JSON path")
    args = parser.parse_args()
    cuda = args.device.startswith("cuda")
    defaults = dict(dtype="bfloat16" if cuda else "float32",
                    tokens=[4096 * 2 ** i for i in range(7)] if cuda else [512, 1024, 2048],
                    heads=32 if cuda else 4, kv_heads=8 if cuda else 2,
                    head_dim=128 if cuda else 32, naive_max_gib=float("inf") if cuda else 2.0)
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def random_boundaries(tokens, docs, generator):
    """cu_seqlens of `docs` documents of random lengths (at least 1) summing to `tokens`."""
    cuts = torch.randperm(tokens - 1, generator=generator)[: docs - 1].add(1).sort().values
    return torch.tensor([0, *cuts.tolist(), tokens], dtype=torch.int32)


def make_inputs(args, tokens, passes, generator):
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)

    def leaf(*shape):
        return torch.randn(*shape, generator=generator).to(device, dtype).requires_grad_()

    q = leaf(tokens, args.heads, args.head_dim)
    k, v = leaf(tokens, args.kv_heads, args.head_dim), leaf(tokens, args.kv_heads, args.head_dim)
    inputs = [q, k, v]
    if passes:
        inputs += [leaf(passes, tokens, args.kv_heads, args.head_dim) for _ in range(2)]
    return inputs


def measure(args, attention, inputs, cu_seqlens):
    """Median forward+backward milliseconds, and peak GiB on cuda (None on cpu)."""
    grad_out = torch.randn_like(inputs[0])

    def step():
        out, _ = attention(*inputs[:3], *(inputs[3:] or (None, None)), cu_seqlens=cu_seqlens)
        torch.autograd.grad(out, inputs, grad_out)

    seconds, peak = median_time(step, args.warmup, args.iters, inputs[0].device)
    return 1e3 * seconds, None if peak is None else peak / 2**30


def measure_naive(args, tokens, generator, cu_seqlens):
    score_gib = args.heads * tokens * tokens * (1 + NAIVE_PASSES) * 4 / 2**30
    if score_gib > args.naive_max_gib:
        return "skipped", None
    inputs = make_inputs(args, tokens, NAIVE_PASSES, generator)
    try:
        return measure(args, branch_attention_reference, inputs, cu_seqlens)
    except torch.cuda.OutOfMemoryError:  # the same class as torch.OutOfMemoryError
        return "OOM", None
    finally:
        del inputs
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()


def main():
    args = parse_args()
    generator = torch.Generator().manual_seed(0)
    backend = os.environ.get("TITAN_DRAFT_ATTN_BACKEND", "auto")
    print(f"device {args.device} dtype {args.dtype} heads {args.heads}/{args.kv_heads} "
          f"head_dim {args.head_dim} docs {args.docs} backend {backend} "
          f"(available {available_backends()})")
    rows = []
    header = (f"{'tokens':>8} {'P':>2} {'plain ms':>10} {'branch ms':>10} {'throughput':>10} "
              f"{'mem ratio':>9} {'naive ms':>10}")
    print(header)
    for tokens in args.tokens:
        cu_seqlens = random_boundaries(tokens, args.docs, generator).to(args.device)
        plain_ms, plain_gib = measure(args, branch_attention, make_inputs(args, tokens, 0, generator),
                                      cu_seqlens)
        naive_ms, naive_gib = measure_naive(args, tokens, generator, cu_seqlens)
        for passes in BRANCH_PASSES:
            branch_ms, branch_gib = measure(args, branch_attention,
                                            make_inputs(args, tokens, passes, generator), cu_seqlens)
            row = dict(tokens=tokens, passes=passes, plain_ms=plain_ms, branch_ms=branch_ms,
                       throughput_pct=100 * plain_ms / branch_ms, plain_peak_gib=plain_gib,
                       branch_peak_gib=branch_gib,
                       peak_mem_ratio=branch_gib / plain_gib if plain_gib else None,
                       naive_ms=naive_ms if passes == NAIVE_PASSES else None,
                       naive_peak_gib=naive_gib if passes == NAIVE_PASSES else None)
            rows.append(row)
            mem = f"{row['peak_mem_ratio']:.3f}" if row["peak_mem_ratio"] else "-"
            naive = row["naive_ms"]
            naive = f"{naive:.1f}" if isinstance(naive, float) else (naive or "")
            print(f"{tokens:>8} {passes:>2} {plain_ms:>10.2f} {branch_ms:>10.2f} "
                  f"{row['throughput_pct']:>9.1f}% {mem:>9} {naive:>10}")
    if args.out:
        write_json(args.out, dict(config=vars(args), backend=backend, rows=rows))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
