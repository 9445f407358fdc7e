"""Per-token log-probs from hidden states and the LM head, forward + backward of sum(logprobs * u) for a
random u, side by side in one process: the dense reference (full logits, chunk 0), the chunked
titan_draft.ops.linear_logprobs at several chunk sizes, eager and compiled (`_compiled`: each chunk's
statistics and its logits' gradient through torch.compile, what [compile] components "loss" runs), and
liger-kernel's fused linear cross-entropy (reduction="none", logprobs = -its per-token loss) where it
imports.

    python -m bench.linear_logprobs                       # one GPU: the Qwen3-1.7B head, R 8K and 32K rows
    python -m bench.linear_logprobs --device cpu --tiny   # shapes only, seconds, no speed claim

Columns per (rows R, variant): ms (median of --iters calls after --warmup, queued and timed by CUDA
events: bench._common.median_time); peak GiB (CUDA max allocated during the timed calls minus what
was allocated before them, the inputs and the reference gradients; the returned gradients count);
dense/ (the speed-up over dense); grad_err: |grad - grad of the first chunked variant| / |that grad|
over hidden and weight together (bf16 rounding gives a few 1e-3; far more means wrong gradients:
liger-kernel before its PR #1298 scales every row's gradient by u[0] under reduction="none",
linkedin/Liger-Kernel issue #968).
JSON: bench/results/linear_logprobs_<device>[_tiny].json (--out to change).
"""
import argparse
import os

import torch

from bench._common import REPO_ROOT, device_tag, environment, median_time, write_json
from titan_draft.ops.linear_logprobs import linear_token_outputs


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="hidden 64, vocabulary 1000, small R and chunks")
    p.add_argument("--rows", type=int, nargs="+", default=None)
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--vocab", type=int, default=None)
    p.add_argument("--chunks", type=int, nargs="+", default=None)
    p.add_argument("--compiled-chunks", type=int, nargs="*", default=None,
                   help="chunk sizes also timed compiled (default: every --chunks size; --tiny: the first)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=7)
    p.add_argument("--out")
    a = p.parse_args()
    sizes = (dict(rows=[128, 512], hidden=64, vocab=1000, chunks=[32, 128]) if a.tiny else
             dict(rows=[8192, 32768], hidden=2048, vocab=151936, chunks=[1024, 4096, 8192]))
    for name, value in sizes.items():
        if getattr(a, name) is None:
            setattr(a, name, value)
    if a.compiled_chunks is None:
        a.compiled_chunks = a.chunks[:1] if a.tiny else a.chunks
    return a


def liger_loss():
    """(liger's fused linear cross-entropy module with reduction="none", or None, and why / its version)."""
    try:
        import liger_kernel
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except ImportError:
        return None, "not installed"
    version = getattr(liger_kernel, "__version__", "installed")
    return LigerFusedLinearCrossEntropyLoss(reduction="none"), version


def step_fn(variant, hidden, weight, targets, upstream, liger):
    """One forward + backward of sum(logprobs * upstream), by linear_token_outputs for a variant
    (chunk_size, compiled) or, for None, by liger; returns the gradients of hidden and weight."""
    def step():
        if variant is None:
            loss = liger(weight, hidden, targets)
            # Newer releases return an output object or a tuple; the per-token loss comes first.
            loss = loss.loss if hasattr(loss, "loss") else loss[0] if isinstance(loss, tuple) else loss
            logprobs = -loss
        else:
            chunk_size, compiled = variant
            logprobs = linear_token_outputs(hidden, weight, targets, chunk_size=chunk_size, compiled=compiled).logprobs
        return torch.autograd.grad((logprobs * upstream).sum(), (hidden, weight))
    return step


def relative_error(grads, reference) -> float:
    error = sum(float((g.float() - r.float()).norm()) ** 2 for g, r in zip(grads, reference)) ** 0.5
    return error / sum(float(r.float().norm()) ** 2 for r in reference) ** 0.5


def measure(a, rows, variants, liger, device, dtype, generator):
    """One result row per variant ({name: (chunk size, compiled), None for liger}) at `rows` rows; a variant
    out of memory gets ms = None."""
    hidden = torch.randn(rows, a.hidden, generator=generator).to(device, dtype).requires_grad_()
    weight = (torch.randn(a.vocab, a.hidden, generator=generator) * a.hidden ** -0.5).to(device, dtype)
    weight.requires_grad_()
    targets = torch.randint(a.vocab, (rows,), generator=generator).to(device)
    upstream = torch.randn(rows, generator=generator).to(device)
    reference = step_fn((a.chunks[0], False), hidden, weight, targets, upstream, liger)()
    results = []
    for name, variant in variants.items():
        step = step_fn(variant, hidden, weight, targets, upstream, liger)
        row = dict(rows=rows, variant=name, ms=None, peak_gib=None, grad_err=None)
        try:
            row["grad_err"] = relative_error(step(), reference)
            baseline = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
            seconds, peak = median_time(step, a.warmup, a.iters, device, queued=True)
            row["ms"] = 1e3 * seconds
            row["peak_gib"] = None if peak is None else (peak - baseline) / 2 ** 30
        except torch.OutOfMemoryError:
            row["error"] = "out of memory"
        if device.type == "cuda":
            torch.cuda.empty_cache()
        results.append(row)
    dense_ms = next(row["ms"] for row in results if row["variant"] == "dense")
    for row in results:
        row["dense_over"] = None if dense_ms is None or row["ms"] is None else dense_ms / row["ms"]
    return results


def format_row(row) -> str:
    def number(value, digits=2):
        return "-" if value is None else f"{value:.{digits}f}"
    return (f"{row['rows']:>7} {row['variant']:>20} {number(row['ms']):>9} {number(row['peak_gib']):>9} "
            f"{number(row['dense_over']):>8} {number(row['grad_err'], 5):>9}")


HEADER = f"{'rows':>7} {'variant':>20} {'ms':>9} {'peak GiB':>9} {'dense/':>8} {'grad_err':>9}"


def main():
    a = parse_args()
    device = torch.device(a.device)
    dtype = torch.bfloat16
    liger, liger_status = liger_loss()
    if liger is not None and device.type != "cuda":
        liger, liger_status = None, f"{liger_status}, needs CUDA"
    variants = {"dense": (0, False), **{f"chunk_{size}": (size, False) for size in a.chunks},
                **{f"chunk_{size}_compiled": (size, True) for size in a.compiled_chunks}}
    if liger is not None:
        variants["liger"] = None
    print(f"device {device} hidden {a.hidden} vocab {a.vocab} dtype {dtype} liger-kernel: {liger_status}")
    print(HEADER, flush=True)
    generator = torch.Generator().manual_seed(0)
    rows = []
    for count in a.rows:
        for row in measure(a, count, variants, liger, device, dtype, generator):
            rows.append(row)
            print(format_row(row), flush=True)
    out = a.out or os.path.join(REPO_ROOT, "bench", "results",
                                f"linear_logprobs_{device_tag(device)}{'_tiny' if a.tiny else ''}.json")
    write_json(out, dict(args=vars(a), environment=environment(), dtype=str(dtype), liger_kernel=liger_status,
                         rows=rows))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
