"""CP strong scaling on N ranks: the draft's branch attention and a whole co-training step.

    # GPUs (NCCL, one GPU per rank from LOCAL_RANK, bf16), 256K tokens per sample; run N = 1 first:
    NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc_per_node 1 -m bench.cp_scaling --out outputs/cp_scaling_1.json
    NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc_per_node 8 -m bench.cp_scaling \\
        --reference outputs/cp_scaling_1.json --out outputs/cp_scaling_8.json
    # CPU (gloo, float32), tiny sizes:
    OMP_NUM_THREADS=1 .venv/bin/python -m torch.distributed.run --standalone --nproc_per_node 2 \\
        -m bench.cp_scaling --reference outputs/cp_scaling_cpu_1.json --out outputs/cp_scaling_cpu_2.json

N (the world size) is the CP degree; every rank holds 1/N of one packed sample of --total tokens
(documents from a long-tailed length mix, bench/_common.document_lengths).
(i)  attention: cp_branch_attention forward+backward on this rank's zigzag rows (ring and
     allgather; Hq/Hkv/D of a real draft, --passes branch passes). N = 1 runs branch_attention on
     all tokens. Document lengths are multiples of 2 * --max-cp so every N <= --max-cp shards the
     same sample.
(ii) cotrain: one co-training step as train.py runs it, without the optimizer: apply_context_parallel
     (ring/allgather attention in the policy) and shard_batch_for_cp (zigzag rows, halo shifts and CP
     branch attention in the draft), forward_packed with TapRecorder, policy cross-entropy, the
     draft's TTT loss (draft_loss), backward of both. Parameters are FSDP2-sharded over CP
     (titan_draft.parallel.parallelize, as torchtitan shards over dp_shard x cp) in --param-dtype
     with float32 gradient reduction; N = 1 runs the same models unsharded under autocast
     (parallelize.training_autocast: torchtitan's rule) on the unpadded batch. Documents have their
     natural lengths: zigzag padding is part of the CP cost.
Times are the median over --iters of the slowest rank's step (a barrier before each). Peak memory
is torch.cuda.max_memory_allocated per rank (n/a on CPU). Efficiency = T(1) / (N * T(N)) with
T(1) from --reference, the JSON of an N = 1 run with the same sizes (a separate run: a CP = 1
pass inside an N-rank job would leave N - 1 ranks idle and need the whole sample's memory).
"""
import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

from bench._common import (
    MIXES,
    document_lengths,
    environment,
    gather_peaks,
    gib,
    median_time,
    sized_model_args,
    write_json,
)
from bench.cp_attention import local_inputs, time_step
from titan_draft.config import parse_config
from titan_draft.data.packing import cu_seqlens_from_lengths, pack
from titan_draft.infra import _compat
from titan_draft.infra.ranks import is_rank0
from titan_draft.models import build_draft
from titan_draft.models.cotrain import CoTrainSpec, DraftFeatures, draft_loss, valid_pairs
from titan_draft.models.draft import Teacher
from titan_draft.models.policy import TapRecorder, forward_packed, policy_from_args
from titan_draft.ops import branch_attention
from titan_draft.parallel import CpGroup, cp_branch_attention
from titan_draft.parallel.context_parallel import apply_context_parallel, shard_batch_for_cp
from titan_draft.parallel.cp_attention import MODES
from titan_draft.parallel.parallelize import (
    cp_mesh,
    loss_scale,
    parallelize_draft,
    parallelize_policy,
    sum_over_dp,
    training_autocast,
)
from titan_draft.plan import build_parallel_dims, build_plan

PARTS = ("attention", "cotrain")
# Keys that must agree between a run and its --reference for the efficiency to mean anything.
SAME_WORK = ("total", "mix", "seed", "max_cp", "passes", "heads", "kv_heads", "head_dim", "policy", "flavor",
             "policy_dim", "policy_layers", "policy_heads", "policy_kv_heads", "vocab", "draft_vocab", "ttt_steps",
             "param_dtype", "ac")


def parse_args(argv=None):
    gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    p.add_argument("--total", type=int, default=256 * 1024 if gpu else 2048, help="tokens per sample")
    p.add_argument("--mix", choices=MIXES, default="lognormal")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-cp", type=int, default=8, help="(i) document lengths are multiples of 2 * max-cp")
    p.add_argument("--warmup", type=int, default=2 if gpu else 1)
    p.add_argument("--iters", type=int, default=5 if gpu else 3)
    # (i): the draft's attention shape (8B-class EAGLE-3 draft on GPU)
    p.add_argument("--passes", type=int, default=2, help="branch passes P (the draft's pass P+1)")
    p.add_argument("--heads", type=int, default=32 if gpu else 4)
    p.add_argument("--kv-heads", type=int, default=8 if gpu else 2)
    p.add_argument("--head-dim", type=int, default=128 if gpu else 32)
    # (ii): the policy (a torchtitan flavor, sizes overridable; 0 = the flavor's) and its draft
    p.add_argument("--policy", choices=("llama3", "qwen3"), default="llama3")
    p.add_argument("--flavor", default="debugmodel" if gpu else "tiny_gqa")
    p.add_argument("--policy-dim", type=int, default=1024 if gpu else 0)
    p.add_argument("--policy-layers", type=int, default=8 if gpu else 0)
    p.add_argument("--policy-heads", type=int, default=8 if gpu else 0)
    p.add_argument("--policy-kv-heads", type=int, default=2 if gpu else 0)
    p.add_argument("--vocab", type=int, default=4096 if gpu else 0, help="policy vocabulary (logits are [T, V])")
    p.add_argument("--draft-vocab", type=int, default=2048 if gpu else 0, help="0 = the policy's")
    p.add_argument("--ttt-steps", type=int, default=3)
    p.add_argument("--param-dtype", choices=("bfloat16", "float32"), default="bfloat16" if gpu else "float32")
    p.add_argument("--ac", choices=("none", "full"), default="full" if gpu else "none",
                   help="torchtitan activation checkpointing of the policy's layers")
    p.add_argument("--reference", default=None, help="JSON of an N = 1 run with the same sizes (efficiency)")
    p.add_argument("--out", default=None, help="JSON written by rank 0")
    args = p.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", 1))
    if world > args.max_cp:
        p.error(f"--max-cp {args.max_cp} is below the world size {world}; pass --max-cp {world} "
                f"(and the same to the N = 1 reference run)")
    if gpu and world > torch.cuda.device_count():
        p.error(f"{world} ranks but {torch.cuda.device_count()} GPUs: one GPU per rank")
    return args


def measure_attention(args, mesh, device, dtype) -> list[dict]:
    """(i): rows of {mode, seconds, peaks}: forward+backward of this rank's share of the sample."""
    cp = 1 if mesh is None else mesh.size()
    rank = 0 if mesh is None else mesh.get_local_rank()
    group = None if mesh is None else mesh.get_group()
    lengths = document_lengths(args.mix, args.total, torch.Generator().manual_seed(args.seed),
                               multiple=2 * args.max_cp)
    cu = cu_seqlens_from_lengths(lengths).to(device)
    inputs = local_inputs(args, args.total // cp, device, dtype, torch.Generator().manual_seed(args.seed + rank))
    if mesh is None:
        modes = {"single": lambda *x: branch_attention(*x, cu_seqlens=cu)}
    else:
        modes = {mode: lambda *x, mode=mode: cp_branch_attention(*x, cu_seqlens=cu, cp=CpGroup(mesh, mode))
                 for mode in MODES}
    rows = []
    for mode, fn in modes.items():
        seconds, peak = time_step(args, fn, inputs, device, group)
        rows.append(dict(part="attention", mode=mode, documents=len(lengths), seconds=seconds,
                         peak_bytes=gather_peaks(peak, device, group)))
    return rows


def random_sample(args, vocab: int):
    """One packed sample: --total tokens in documents of the length mix; the first quarter of each
    document is prompt (not trained), as are the last rows (no next token)."""
    generator = torch.Generator().manual_seed(args.seed)
    lengths = document_lengths(args.mix, args.total, generator)
    sequences = [torch.randint(0, vocab, (n,), generator=generator) for n in lengths]
    masks = [torch.arange(n) >= n // 4 for n in lengths]
    for mask in masks:
        mask[-1] = False
    return pack(sequences, masks)


def build_cotrain(args, world: int):
    """Config, ParallelDims (cp = world), policy and draft parallelised as train.py does, tap layers."""
    cfg = parse_config(["--model.name", args.policy, "--model.hf_assets_path", ".", "--model.flavor", args.flavor,
                        "--training.seq_len", str(args.total), "--training.mixed_precision_param", args.param_dtype,
                        "--training.mixed_precision_reduce", "float32",
                        "--parallelism.context_parallel_degree", str(world),
                        "--parallelism.data_parallel_shard_degree", "1",
                        "--activation_checkpoint.mode", args.ac, "--draft.ttt_steps", str(args.ttt_steps),
                        "--draft.vocab_size", str(args.draft_vocab)])
    dims = build_parallel_dims(build_plan(cfg, world))
    if world > 1:  # one process: no meshes (the helpers below see no parallelism)
        dims.build_mesh()
    margs = sized_model_args(args.policy, args.flavor, args.total, dim=args.policy_dim, layers=args.policy_layers,
                             heads=args.policy_heads, kv_heads=args.policy_kv_heads, vocab=args.vocab)
    policy = policy_from_args(margs, seed=args.seed)
    draft, layers = build_draft(cfg, margs, _compat.device())
    if args.ac != "none":
        from torchtitan.distributed.activation_checkpoint import apply_ac

        apply_ac(policy, cfg.activation_checkpoint)  # before FSDP, as torchtitan orders it
    parallelize_policy(policy, dims, cfg)
    parallelize_draft(draft, dims, cfg)
    return cfg, dims, margs, policy, draft, layers


def measure_cotrain(args, device) -> list[dict]:
    """(ii): rows of {mode, seconds, peaks} for one co-training step (forward + backward, no optimizer)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    cfg, dims, margs, policy, draft, layers = build_cotrain(args, world)
    spec = CoTrainSpec.from_config(cfg.draft, layers)
    sample = random_sample(args, margs.vocab_size).to(device)
    mesh = cp_mesh(dims)
    # torchtitan's rule: FSDP does mixed precision, a single device uses AMP.
    amp = training_autocast(args.param_dtype, device, dims)
    group = None if mesh is None else mesh.get_group()
    rows = []
    for mode in MODES if mesh is not None else ("single",):
        batch = sample
        if mesh is not None:  # this mode's attention in the policy, this rank's zigzag rows of the sample
            apply_context_parallel(policy, mesh, mode)
            batch = shard_batch_for_cp(sample, mesh, mode)
        targets = batch.shift(1)(batch.tokens, 1)
        count = sum_over_dp(batch.loss_mask.sum().float(), dims, "loss")
        pairs = sum_over_dp(valid_pairs(batch.loss_mask, batch.shift(spec.ttt_steps), spec.ttt_steps), dims, "loss")

        def step():
            policy.zero_grad(set_to_none=True)
            draft.zero_grad(set_to_none=True)
            with amp:
                with TapRecorder(policy, layers) as recorder:
                    logits = forward_packed(policy, batch)
                mask = batch.loss_mask
                policy_loss = F.cross_entropy(logits[mask].float(), targets[mask], reduction="sum") / count
                features = DraftFeatures(batch, recorder.embeddings(), recorder.taps(),
                                         Teacher.from_logits(logits, draft.target_ids()))
                ttt, _ = draft_loss(draft, features, spec, count=pairs)
            loss = policy_loss + cfg.draft.loss_weight * ttt
            (loss_scale(dims) * loss).backward()
            last_loss[0] = loss.detach().float()

        last_loss = [None]
        seconds, peak = median_time(step, args.warmup, args.iters, device, group)
        # Every rank's loss is its rows' share of the global loss (global normalisers): the sum over
        # CP ranks is the whole sample's loss, which must match the N = 1 run (same work, same weights).
        loss = sum_over_dp(last_loss[0], dims, "loss")
        rows.append(dict(part="cotrain", mode=mode, documents=len(sample.cu_seqlens) - 1, seconds=seconds,
                         peak_bytes=gather_peaks(peak, device, group), loss=loss.item()))
    return rows


def add_efficiency(rows: list[dict], world: int, reference: dict | None, args) -> None:
    """Efficiency T(1) / (N * T(N)) against the reference run's N = 1 rows of the same part."""
    if reference is None:
        return
    mismatch = {k: (reference["args"].get(k), getattr(args, k)) for k in SAME_WORK
                if reference["args"].get(k) != getattr(args, k)}
    if mismatch or reference["world_size"] != 1:
        raise SystemExit(f"--reference {args.reference}: not an N = 1 run of the same work "
                         f"(world size {reference['world_size']}, differing (reference, this run): {mismatch})")
    single = {r["part"]: r for r in reference["rows"]}
    for r in rows:
        if r["part"] in single:
            r["speedup"] = single[r["part"]]["seconds"] / r["seconds"]
            r["efficiency"] = r["speedup"] / world
        if "loss" in r and "loss" in single.get(r["part"], {}):
            r["loss_rel_diff_vs_reference"] = abs(r["loss"] / single[r["part"]]["loss"] - 1)


def print_table(rows, world, args, device, dtype):
    print(f"CP = {world}, {args.total} tokens per sample ({args.mix}), {device.type} {dtype}; attention Hq "
          f"{args.heads} Hkv {args.kv_heads} D {args.head_dim} P {args.passes}; cotrain {args.policy} "
          f"{args.flavor} (dim {args.policy_dim or '-'}, layers {args.policy_layers or '-'}, vocab "
          f"{args.vocab or '-'}), TTT {args.ttt_steps}, AC {args.ac}; median of {args.iters}, slowest rank")
    print(f"{'part':>9} {'mode':>9} {'CP':>3} {'ms':>10} {'speedup':>8} {'eff.':>6} {'peak GiB/rank (max)':>20} "
          f"{'loss':>10} {'vs N=1':>8}")
    for r in rows:
        speed = f"{r['speedup']:.2f}" if "speedup" in r else "-"
        eff = f"{r['efficiency']:.3f}" if "efficiency" in r else "-"
        peak = gib(max(r["peak_bytes"])) if r["peak_bytes"] else "n/a"
        loss = f"{r['loss']:.5f}" if "loss" in r else "-"
        rel = f"{r['loss_rel_diff_vs_reference']:.1e}" if "loss_rel_diff_vs_reference" in r else "-"
        print(f"{r['part']:>9} {r['mode']:>9} {world:>3} {1e3 * r['seconds']:>10.2f} {speed:>8} {eff:>6} {peak:>20} "
              f"{loss:>10} {rel:>8}")


def main(argv=None):
    args = parse_args(argv)
    reference = None
    if args.reference:
        with open(args.reference) as f:
            reference = json.load(f)
    device = _compat.device()
    dtype = getattr(torch, args.param_dtype)
    world = int(os.environ.get("WORLD_SIZE", 1))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    mesh = None
    if "RANK" in os.environ:
        dist.init_process_group(_compat.backend())
        if world > 1:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("cp",))
    try:
        rows = []
        if "attention" in args.parts:
            rows += measure_attention(args, mesh, device, dtype)
        if "cotrain" in args.parts:
            rows += measure_cotrain(args, device)
        add_efficiency(rows, world, reference, args)
        if is_rank0():
            print_table(rows, world, args, device, dtype)
            write_json(args.out, dict(args=vars(args), **environment(), world_size=world,
                                      backend=dist.get_backend() if dist.is_initialized() else None, rows=rows))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
