"""Branch attention against the fastest plain causal attention PyTorch runs on the same tokens,
and against FlexAttention with the EAGLE-3 TTT mask: forward + backward, all in one process.

    python -m bench.branch_attention --out bench/results/branch_attention_h200.json
    python -m bench.branch_attention --device cpu --tokens 512 1024      # shapes only, no speed claim

Columns of each row (tokens, docs, passes P):
- limit_ms: the fastest of what a user could run for PLAIN causal attention over the same
  documents (no branch): `sdpa` (F.scaled_dot_product_attention, causal, default backend: cuDNN
  on an H200, one call per document) and `fa2_varlen` (PyTorch's FlashAttention-2 varlen kernels,
  one call); limit_kernel names the winner.
- trunk_ms: branch_attention without a branch (P = 0), the backend auto picks.
- branch_ms: branch_attention with P branch passes.
- flex_ms: FlexAttention (compiled) over the trunk keys plus the P*T branch keys with the TTT
  mask (document-causal trunk + diagonal branch), block mask built once per shape outside the
  timing; null where it was not run (--flex-max-tokens, out of memory, or no CUDA).
- *_peak_gib: peak allocated memory of each (inputs included), CUDA only.
- *_gpu_ms: the GPU's work in one call of each (kernel, copy and fill durations summed over 3
  profiled calls, bench._common.device_time), CUDA only and below --long-tokens. Where a time is
  well above its GPU work, the host launching the call is what bounds it.
Times: median of --iters timed calls after --warmup untimed ones (bench._common). --timing queued
(default): calls back to back, as the layers of a training step run, each timed by CUDA events
(median_time's queued); --timing synced: each call alone between two device syncs, so the host's
launch latency adds to every call.
--profile T... writes a torch.profiler per-kernel table of one branch_attention step at each T.
"""
import argparse
import os

import torch
import torch.nn.functional as F

from bench._common import device_time, environment, median_time, write_json
from titan_draft.ops import attention_kernels, available_backends, branch_attention


def parse_args():
    on_gpu = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if on_gpu else "cpu")
    parser.add_argument("--tokens", type=int, nargs="+", default=None)
    parser.add_argument("--docs", type=int, nargs="+", default=[1, 4],
                        help="equal packed documents per row")
    parser.add_argument("--passes", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--heads", type=int, default=None)
    parser.add_argument("--kv-heads", type=int, default=None)
    parser.add_argument("--head-dim", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=7)
    parser.add_argument("--long-tokens", type=int, default=131072,
                        help="from this length on: 1 warm-up and 3 timed calls")
    parser.add_argument("--flex-max-tokens", type=int, default=65536)
    parser.add_argument("--timing", choices=("queued", "synced"), default="queued")
    parser.add_argument("--cudnn-max-batch-share", type=int, default=None,
                        help="attention_kernels.CUDNN_MAX_BATCH_SHARE for this run (1: one cuDNN "
                             "batch per document length, no memory cap)")
    parser.add_argument("--profile", type=int, nargs="*", default=[],
                        help="profile one step at each of these token counts")
    parser.add_argument("--out", default=None, help="JSON path (a .txt table is written beside it)")
    args = parser.parse_args()
    cuda = args.device.startswith("cuda")
    defaults = dict(tokens=[4096 * 2 ** i for i in range(7)] if cuda else [512, 1024],
                    heads=32 if cuda else 4, kv_heads=8 if cuda else 2, head_dim=128 if cuda else 32)
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


class Inputs:
    """q, k, v (and P branch keys/values) over `docs` equal documents of tokens / docs rows."""

    def __init__(self, args, tokens, docs, passes, generator):
        device = torch.device(args.device)
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

        def leaf(*shape):
            return torch.randn(*shape, generator=generator).to(device, dtype).requires_grad_()

        self.q = leaf(tokens, args.heads, args.head_dim)
        self.k, self.v = (leaf(tokens, args.kv_heads, args.head_dim) for _ in range(2))
        self.branch = [leaf(passes, tokens, args.kv_heads, args.head_dim) for _ in range(2)] if passes else []
        self.cu_seqlens = torch.arange(0, tokens + 1, tokens // docs, dtype=torch.int32, device=device)
        self.grad_out = torch.randn(self.q.shape, generator=generator).to(device, dtype)

    @property
    def leaves(self):
        return [self.q, self.k, self.v, *self.branch]


def ours(inputs: Inputs):
    """branch_attention (P = 0 when the inputs have no branch)."""
    def step():
        out, _ = branch_attention(inputs.q, inputs.k, inputs.v, *(inputs.branch or (None, None)),
                                  cu_seqlens=inputs.cu_seqlens)
        torch.autograd.grad(out, inputs.leaves, inputs.grad_out)
    return step


def sdpa_per_document(inputs: Inputs):
    bounds = inputs.cu_seqlens.tolist()

    def step():
        outs = []
        for start, end in zip(bounds, bounds[1:]):
            q, k, v = (x[start:end].transpose(0, 1).unsqueeze(0) for x in (inputs.q, inputs.k, inputs.v))
            outs.append(F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                        .squeeze(0).transpose(0, 1))
        torch.autograd.grad(torch.cat(outs), inputs.leaves, inputs.grad_out)
    return step


def fa2_varlen(inputs: Inputs):
    """PyTorch's FlashAttention-2 varlen kernels through the torch_varlen backend (P = 0)."""
    step = ours(inputs)

    def run():
        previous = os.environ.get("TITAN_DRAFT_ATTN_BACKEND")
        os.environ["TITAN_DRAFT_ATTN_BACKEND"] = "torch_varlen"
        try:
            step()
        finally:
            if previous is None:
                del os.environ["TITAN_DRAFT_ATTN_BACKEND"]
            else:
                os.environ["TITAN_DRAFT_ATTN_BACKEND"] = previous
    return run


def flex_ttt(inputs: Inputs):
    """FlexAttention over [trunk keys; branch keys of pass 1..P] with the TTT mask."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    tokens = inputs.q.shape[0]
    passes = inputs.branch[0].shape[0]
    lengths = inputs.cu_seqlens.diff()
    document = torch.repeat_interleave(torch.arange(len(lengths), device=lengths.device), lengths)
    key_document = torch.cat([document, document.new_full((passes * tokens,), -1)])

    def ttt(b, h, q_idx, kv_idx):
        trunk = (key_document[kv_idx] == document[q_idx]) & (kv_idx <= q_idx)
        branch = (kv_idx >= tokens) & ((kv_idx - tokens) % tokens == q_idx)
        return trunk | branch

    # _compile: built blockwise; the eager build materialises the whole T x (1+P)T mask.
    block_mask = create_block_mask(ttt, 1, None, tokens, (1 + passes) * tokens, device=lengths.device,
                                   _compile=True)
    attend = torch.compile(flex_attention)

    def step():
        keys, values = ([x, b.flatten(0, 1)] for x, b in zip((inputs.k, inputs.v), inputs.branch))
        q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (inputs.q, torch.cat(keys), torch.cat(values)))
        out = attend(q, k, v, block_mask=block_mask, enable_gqa=True).squeeze(0).transpose(0, 1)
        torch.autograd.grad(out, inputs.leaves, inputs.grad_out)
    return step


def timed(args, step, device, tokens):
    """(median ms, peak GiB, GPU work ms) of step; see the module docstring."""
    long = tokens >= args.long_tokens
    warmup, iters = (1, 3) if long else (args.warmup, args.iters)
    seconds, peak = median_time(step, warmup, iters, device, queued=args.timing == "queued")
    gpu_seconds = None if long else device_time(step, 3, device)
    return (1e3 * seconds, None if peak is None else peak / 2 ** 30,
            None if gpu_seconds is None else 1e3 * gpu_seconds)


def free(device):
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measure_row(args, tokens, docs, generator, device):
    """Rows for every P at one (tokens, docs): the plain limits and trunk once, then per P."""
    plain = Inputs(args, tokens, docs, 0, generator)
    limits = {"sdpa": timed(args, sdpa_per_document(plain), device, tokens)}
    if device.type == "cuda" and "torch_varlen" in available_backends():
        limits["fa2_varlen"] = timed(args, fa2_varlen(plain), device, tokens)
    limit_kernel = min(limits, key=lambda name: limits[name][0])
    trunk = timed(args, ours(plain), device, tokens)
    del plain
    free(device)
    rows = []
    for passes in args.passes:
        inputs = Inputs(args, tokens, docs, passes, generator)
        branch = timed(args, ours(inputs), device, tokens)
        flex = (None, None, None)
        if device.type == "cuda" and tokens <= args.flex_max_tokens:
            try:
                flex = timed(args, flex_ttt(inputs), device, tokens)
            except torch.OutOfMemoryError:
                print(f"flex: out of memory at {tokens} tokens", flush=True)
        del inputs
        free(device)
        limit_ms, limit_gib, limit_gpu_ms = limits[limit_kernel]
        rows.append(dict(
            tokens=tokens, docs=docs, passes=passes, limit_ms=limit_ms, limit_kernel=limit_kernel,
            limits_ms={name: value[0] for name, value in limits.items()}, trunk_ms=trunk[0],
            branch_ms=branch[0], flex_ms=flex[0], limit_peak_gib=limit_gib, trunk_peak_gib=trunk[1],
            branch_peak_gib=branch[1], flex_peak_gib=flex[1], limit_gpu_ms=limit_gpu_ms,
            trunk_gpu_ms=trunk[2], branch_gpu_ms=branch[2], flex_gpu_ms=flex[2],
            trunk_vs_limit=limit_ms / trunk[0], branch_vs_limit=limit_ms / branch[0],
            flex_over_branch=None if flex[0] is None else flex[0] / branch[0],
            trunk_mem_vs_limit=None if limit_gib is None else trunk[1] / limit_gib,
            branch_mem_vs_limit=None if limit_gib is None else branch[1] / limit_gib))
    return rows


def format_row(row):
    def number(value, digits=2):
        return "-" if value is None else f"{value:.{digits}f}"
    return (f"{row['tokens']:>7} {row['docs']:>4} {row['passes']:>2} {number(row['limit_ms']):>9} "
            f"{row['limit_kernel']:>10} {number(row['trunk_ms']):>9} {number(row['branch_ms']):>9} "
            f"{number(row['flex_ms']):>9} {number(row['trunk_vs_limit']):>6} "
            f"{number(row['branch_vs_limit']):>7} {number(row['flex_over_branch']):>9} "
            f"{number(row['branch_mem_vs_limit']):>8} {number(row['limit_gpu_ms']):>9} "
            f"{number(row['branch_gpu_ms']):>9}")


HEADER = (f"{'tokens':>7} {'docs':>4} {'P':>2} {'limit ms':>9} {'limit':>10} {'trunk ms':>9} "
          f"{'branch ms':>9} {'flex ms':>9} {'limit/':>6} {'limit/':>7} {'flex/':>9} {'mem vs':>8} "
          f"{'limit gpu':>9} {'branch':>9}\n"
          f"{'':>76} {'trunk':>6} {'branch':>7} {'branch':>9} {'limit':>8} {'ms':>9} {'gpu ms':>9}")


def profile(args, device, tokens):
    """Per-kernel CUDA time of one branch_attention forward + backward (P = 2, 4 documents)."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    step = ours(Inputs(args, tokens, 4, 2, torch.Generator().manual_seed(1)))
    for _ in range(3):
        step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch_profile(activities=activities) as prof:
        step()
        torch.cuda.synchronize() if device.type == "cuda" else None
    sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    return prof.key_averages().table(sort_by=sort, row_limit=25, max_name_column_width=70)


def main():
    args = parse_args()
    if args.cudnn_max_batch_share is not None:
        attention_kernels.CUDNN_MAX_BATCH_SHARE = args.cudnn_max_batch_share
    device = torch.device(args.device)
    generator = torch.Generator().manual_seed(0)
    print(f"device {device} heads {args.heads}/{args.kv_heads} head_dim {args.head_dim} "
          f"backends {available_backends()} (auto picks the first that fits)")
    lines = [HEADER]
    print(HEADER, flush=True)
    rows = []
    for tokens in args.tokens:
        for docs in args.docs:
            for row in measure_row(args, tokens, docs, generator, device):
                rows.append(row)
                lines.append(format_row(row))
                print(lines[-1], flush=True)
            if args.out:  # what is measured so far survives a cut-off run
                write_json(args.out, dict(config=vars(args), environment=environment(), rows=rows))
    for tokens in args.profile:
        table = profile(args, device, tokens)
        lines += ["", f"profile: branch_attention P = 2, 4 documents, {tokens} tokens", table]
        print(lines[-2], table, sep="\n", flush=True)
    if args.out:
        with open(os.path.splitext(args.out)[0] + ".txt", "w") as handle:
            handle.write("\n".join(lines) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
