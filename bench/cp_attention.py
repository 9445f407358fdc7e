"""Context-parallel branch attention: load balance, per-rank compute and memory, gloo wall time.

    .venv/bin/python -m bench.cp_attention                      # (a) load balance, runs anywhere
    python -m bench.cp_attention --emulate-ring --out outputs/bench_cp_emulated.json   # (b) one GPU
    .venv/bin/python -m bench.cp_attention --gloo 2 4           # (c) CPU, spawns torchrun itself

(a) Attention work (causal same-document query/key pairs, proportional to FLOPs) of each rank
    for zigzag vs contiguous sharding of the same packed batch, CP = 2..64, on long-tailed length
    mixes: max/mean over ranks of the total, and the ring's critical path (sum over steps of the
    busiest rank's block) relative to the ideal total/CP. Zigzag also pays for padding every
    document to a multiple of 2*CP: shown as padded/real work.
(b) One rank's work of CP = 2..8 at --total tokens, on one device: the real cp_branch_attention
    (ring and allgather, forward+backward) under a "fake" process group whose communication is
    a no-op, so only compute and local copies are timed; CP = 1 is branch_attention on all tokens.
    Peak memory per rank (CUDA max_memory_allocated, inputs included) of ring, allgather and a
    naive dense-mask attention of the local queries against all keys.
(c) Wall time of ring vs allgather forward+backward on N gloo ranks (CPU), medians.
"""
import argparse
import json
import subprocess
import sys

import torch

from bench._common import MIXES, REPO_ROOT, document_lengths, environment, median_time, write_json
from titan_draft.data.packing import cu_seqlens_from_lengths
from titan_draft.infra.ranks import is_rank0
from titan_draft.ops import branch_attention
from titan_draft.parallel import CpGroup, ZigzagLayout, cp_branch_attention
from titan_draft.parallel.cp_attention import MODES


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--total", type=int, default=None, help="packed tokens (default 256K; 4K with --gloo)")
    parser.add_argument("--cp", type=int, nargs="+", default=None, help="CP sizes (default 2..64; 2 4 8 emulated)")
    parser.add_argument("--emulate-ring", action="store_true", help="(b): per-rank compute and memory on one device")
    parser.add_argument("--gloo", type=int, nargs="*", default=None, help="(c): gloo world sizes, e.g. 2 4")
    parser.add_argument("--gloo-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mix", choices=MIXES, default="lognormal", help="length mix of (b) and (c)")
    parser.add_argument("--passes", type=int, default=2, help="branch passes P (the draft's pass P+1)")
    parser.add_argument("--heads", type=int, default=None)
    parser.add_argument("--kv-heads", type=int, default=None)
    parser.add_argument("--head-dim", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="JSON path")
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and not (args.gloo is not None or args.gloo_worker)
    defaults = dict(total=4096 if (args.gloo is not None or args.gloo_worker) else 256 * 1024,
                    cp=[2, 4, 8] if args.emulate_ring else [2, 4, 8, 16, 32, 64],
                    heads=32 if cuda else 4, kv_heads=8 if cuda else 2, head_dim=128 if cuda else 32)
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


# --------------------------------------------------------------------------------------------
# (a) load balance: pure arithmetic
# --------------------------------------------------------------------------------------------


def zigzag_work(lengths: list[int], cp: int) -> tuple[torch.Tensor, float]:
    """work[r, src]: pairs of rank r's queries with rank src's keys; and padded/real pairs."""
    length = torch.tensor(lengths, dtype=torch.float64)
    padded = torch.ceil(length / (2 * cp)) * 2 * cp
    c = padded / (2 * cp)  # chunk length per document
    chunks = torch.arange(2 * cp)
    # Pairs of query chunk i with key chunk j of one document: c^2 below the diagonal, c(c+1)/2 on it.
    below = (chunks[None, :] < chunks[:, None]).double()
    on = torch.eye(2 * cp, dtype=torch.float64)
    pairs = (c ** 2).sum() * below + (c * (c + 1) / 2).sum() * on  # [2cp, 2cp] summed over documents
    held = torch.stack([chunks[:cp], 2 * cp - 1 - chunks[:cp]], dim=1)  # chunks of rank r
    work = pairs[held[:, :, None, None], held[None, None, :, :]].sum((1, 3))  # [r, src]
    real = (length * (length + 1) / 2).sum()
    return work, float(work.sum() / real)


def contiguous_work(lengths: list[int], cp: int) -> torch.Tensor:
    """work[r, src] for the packed stream cut into cp equal contiguous pieces (no padding)."""
    cu = cu_seqlens_from_lengths(lengths).long()
    total = int(cu[-1])
    piece = -(-total // cp)
    rows = torch.arange(total)
    doc_start = torch.repeat_interleave(cu[:-1], cu.diff())
    work = torch.zeros(cp, cp, dtype=torch.float64)
    for src in range(cp):
        lo, hi = src * piece, min((src + 1) * piece, total)
        visible = (torch.minimum(rows + 1, torch.tensor(hi)) - torch.maximum(doc_start, torch.tensor(lo))).clamp(min=0)
        work[:, src] = torch.zeros(cp, dtype=torch.float64).index_add_(0, rows // piece, visible.double())
    return work


def balance(work: torch.Tensor) -> tuple[float, float]:
    """(max/mean of per-rank totals, ring critical path / ideal), step s: rank r holds (r - s) mod cp."""
    cp = work.shape[0]
    per_rank = work.sum(1)
    ranks = torch.arange(cp)
    critical = sum(float(work[ranks, (ranks - s) % cp].max()) for s in range(cp))
    return float(per_rank.max() / per_rank.mean()), critical / float(work.sum() / cp)


def load_balance(args) -> list[dict]:
    rows = []
    for mix in MIXES:
        lengths = document_lengths(mix, args.total, torch.Generator().manual_seed(args.seed))
        for cp in args.cp:
            zz, overhead = zigzag_work(lengths, cp)
            contiguous = contiguous_work(lengths, cp)
            (zz_max, zz_ring), (ct_max, ct_ring) = balance(zz), balance(contiguous)
            rows.append(dict(mix=mix, documents=len(lengths), longest=max(lengths), cp=cp,
                             zigzag_max_over_mean=zz_max, zigzag_ring_over_ideal=zz_ring,
                             zigzag_padded_over_real=overhead, contiguous_max_over_mean=ct_max,
                             contiguous_ring_over_ideal=ct_ring))
    print(f"(a) load balance, {args.total} tokens: per-rank attention pairs (ring = critical path / ideal)")
    print(f"{'mix':>10} {'docs':>5} {'longest':>8} {'CP':>3} | {'zigzag max/mean':>15} {'ring':>6} "
          f"{'pad':>6} | {'contig max/mean':>15} {'ring':>6}")
    for r in rows:
        print(f"{r['mix']:>10} {r['documents']:>5} {r['longest']:>8} {r['cp']:>3} | "
              f"{r['zigzag_max_over_mean']:>15.4f} {r['zigzag_ring_over_ideal']:>6.3f} "
              f"{r['zigzag_padded_over_real']:>6.3f} | {r['contiguous_max_over_mean']:>15.3f} "
              f"{r['contiguous_ring_over_ideal']:>6.3f}")
    return rows


# --------------------------------------------------------------------------------------------
# (b) and (c): timing the real op
# --------------------------------------------------------------------------------------------


def local_inputs(args, tokens, device, dtype, generator):
    def leaf(*shape):
        return torch.randn(*shape, generator=generator).to(device, dtype).requires_grad_()

    q = leaf(tokens, args.heads, args.head_dim)
    k, v = leaf(tokens, args.kv_heads, args.head_dim), leaf(tokens, args.kv_heads, args.head_dim)
    branch_k = leaf(args.passes, tokens, args.kv_heads, args.head_dim)
    branch_v = leaf(args.passes, tokens, args.kv_heads, args.head_dim)
    return q, k, v, branch_k, branch_v


def time_step(args, fn, inputs, device, group=None):
    """(median seconds of forward+backward of fn(*inputs), peak bytes or None); see median_time."""
    grad = torch.randn_like(inputs[0])

    def step():
        for x in inputs:
            x.grad = None
        out, _ = fn(*inputs)
        out.backward(grad)

    return median_time(step, args.warmup, args.iters, device, group)


def dense_local_attention(q, k_all, v_all, branch_k, branch_v, visible):
    """Naive CP baseline: local queries against all keys with an explicit [T_local, T] mask."""
    groups = q.shape[1] // k_all.shape[1]
    scores = torch.einsum("thd,shd->hts", q.float(), k_all.float().repeat_interleave(groups, 1))
    scores = scores.masked_fill(~visible, float("-inf")) * q.shape[-1] ** -0.5
    branch = torch.einsum("thd,pthd->htp", q.float(), branch_k.float().repeat_interleave(groups, 2))
    probs = torch.softmax(torch.cat([scores, branch * q.shape[-1] ** -0.5], -1), -1)
    out = torch.einsum("hts,shd->thd", probs[..., : k_all.shape[0]], v_all.float().repeat_interleave(groups, 1))
    out = out + torch.einsum("htp,pthd->thd", probs[..., k_all.shape[0]:],
                             branch_v.float().repeat_interleave(groups, 2))
    return out.to(q.dtype), None


def emulate_ring(args) -> list[dict]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    generator = torch.Generator().manual_seed(args.seed)
    lengths = document_lengths(args.mix, args.total, generator, multiple=2 * max(args.cp))
    cu = cu_seqlens_from_lengths(lengths).to(device)
    rows = []
    t1, _ = time_step(args, lambda *x: branch_attention(*x, cu_seqlens=cu),
                      local_inputs(args, args.total, device, dtype, generator), device)
    rows.append(dict(cp=1, mode="single", seconds=t1, speedup=1.0, efficiency=1.0, peak_gib=None))
    for cp in args.cp:
        rank = cp - 1
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=cp)
        mesh = init_device_mesh(device.type, (cp,))
        inputs = local_inputs(args, args.total // cp, device, dtype, generator)
        for mode in MODES:
            seconds, peak = time_step(args, lambda *x: cp_branch_attention(*x, cu_seqlens=cu,
                                                                           cp=CpGroup(mesh, mode)), inputs, device)
            rows.append(dict(cp=cp, mode=mode, seconds=seconds, speedup=t1 / seconds,
                             efficiency=t1 / seconds / cp, peak_gib=peak and peak / 2 ** 30))
        layout = ZigzagLayout(cu, cp, rank)
        try:
            global_rows = layout.global_rows()
            document = torch.repeat_interleave(torch.arange(len(lengths), device=device), cu.diff().long())
            keys = torch.arange(args.total, device=device)
            visible = (document[global_rows][:, None] == document[None, :]) & (keys[None, :] <= global_rows[:, None])
            k_all = torch.randn(args.total, args.kv_heads, args.head_dim, device=device, dtype=dtype,
                                requires_grad=True)
            dense_inputs = (inputs[0], k_all, k_all.detach().clone().requires_grad_(), *inputs[3:])
            seconds, peak = time_step(args, lambda *x: dense_local_attention(*x, visible), dense_inputs, device)
            rows.append(dict(cp=cp, mode="dense", seconds=seconds, speedup=t1 / seconds,
                             efficiency=t1 / seconds / cp, peak_gib=peak and peak / 2 ** 30))
        except torch.OutOfMemoryError:
            rows.append(dict(cp=cp, mode="dense", seconds=None, speedup=None, efficiency=None, peak_gib="OOM"))
        finally:
            visible = k_all = dense_inputs = None
            dist.destroy_process_group()
    print(f"(b) one rank's forward+backward at {args.total} tokens ({args.mix}, {len(lengths)} documents), "
          f"{device.type} {dtype}, Hq {args.heads} Hkv {args.kv_heads} D {args.head_dim} P {args.passes}; "
          f"communication not included")
    print(f"{'CP':>3} {'mode':>10} {'ms':>10} {'speedup':>8} {'eff.':>6} {'peak GiB':>9}")
    for r in rows:
        ms = "-" if r["seconds"] is None else f"{1e3 * r['seconds']:.2f}"
        speed = "-" if r["speedup"] is None else f"{r['speedup']:.2f}"
        eff = "-" if r["efficiency"] is None else f"{r['efficiency']:.2f}"
        peak = r["peak_gib"] if isinstance(r["peak_gib"], str) or r["peak_gib"] is None else f"{r['peak_gib']:.2f}"
        print(f"{r['cp']:>3} {r['mode']:>10} {ms:>10} {speed:>8} {eff:>6} {str(peak):>9}")
    return rows


def gloo_worker(args):
    """One torchrun rank of (c): rank 0 prints one JSON line per mode."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    cp, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (cp,))
    generator = torch.Generator().manual_seed(args.seed)
    lengths = document_lengths(args.mix, args.total, generator, multiple=2 * cp)
    cu = cu_seqlens_from_lengths(lengths)
    inputs = local_inputs(args, args.total // cp, torch.device("cpu"), torch.float32,
                          torch.Generator().manual_seed(args.seed + rank))
    for mode in MODES:
        seconds, _ = time_step(args, lambda *x: cp_branch_attention(*x, cu_seqlens=cu, cp=CpGroup(mesh, mode)),
                               inputs, torch.device("cpu"), group=mesh.get_group())
        if is_rank0():
            print("RESULT " + json.dumps(dict(cp=cp, mode=mode, documents=len(lengths), seconds=seconds)), flush=True)
    dist.destroy_process_group()


def gloo_wall_times(args) -> list[dict]:
    rows = []
    for world in args.gloo or [2, 4]:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
                   "-m", "bench.cp_attention", "--gloo-worker", "--total", str(args.total), "--mix", args.mix,
                   "--passes", str(args.passes), "--heads", str(args.heads), "--kv-heads", str(args.kv_heads),
                   "--head-dim", str(args.head_dim), "--warmup", str(args.warmup), "--iters", str(args.iters),
                   "--seed", str(args.seed)]
        # From the repository root: the workers import the bench package as this process does.
        done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=REPO_ROOT)
        if done.returncode != 0:
            raise RuntimeError(f"gloo run with {world} ranks failed:\n{done.stderr[-3000:]}")
        rows += [json.loads(line[len("RESULT "):]) for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    print(f"(c) gloo, CPU float32, {args.total} tokens ({args.mix}), Hq {args.heads} Hkv {args.kv_heads} "
          f"D {args.head_dim} P {args.passes}: forward+backward, slowest rank, median of {args.iters}")
    print(f"{'ranks':>5} {'docs':>5} {'mode':>10} {'ms':>10}")
    for r in rows:
        print(f"{r['cp']:>5} {r['documents']:>5} {r['mode']:>10} {1e3 * r['seconds']:>10.1f}")
    return rows


def main():
    args = parse_args()
    if args.gloo_worker:
        return gloo_worker(args)
    if args.emulate_ring:
        result = {"emulated_ring": emulate_ring(args)}
    elif args.gloo is not None:
        result = {"gloo": gloo_wall_times(args)}
    else:
        result = {"load_balance": load_balance(args)}
    result.update(args=vars(args), **environment())
    write_json(args.out, result)


if __name__ == "__main__":
    main()
