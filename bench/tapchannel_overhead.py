"""Cost of the TapChannel: pipeline co-training steps with it, against a twin without transport.

    .venv/bin/python -m bench.tapchannel_overhead --nproc 2                 # CPU, gloo (spawns itself)
    .venv/bin/python -m bench.tapchannel_overhead --nproc 2 --schedule Interleaved1F1B
    # GPUs, NCCL, one GPU per rank (LOCAL_RANK), bf16; PP = 2 or 4; Interleaved1F1B needs layers >= 2 * PP:
    NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc_per_node 4 -m bench.tapchannel_overhead \
        --schedule Interleaved1F1B --dim 2048 --layers 16 --heads 16 --vocab 32768 --seq 4096 \
        --out outputs/bench_tapchannel_overhead_pp4_interleaved.json

"channel": build_pipeline_cotrain as training uses it. "twin": the same model, batch and schedule,
built the same way, whose producer stages compute the same tap features but drop them, and whose
draft stage reads the taps of the channel run from a local buffer filled before the step: the
compute is identical, the transport is gone. Steps alternate A B A B after warm-up; a step's time
is the slowest rank's, from a barrier to the end of the step (fresh gradients, forward, backward, no
optimizer).
The last line is `overhead_ratio <median channel step / median twin step>`.
"""
import argparse
import copy
import os
import socket
import statistics

import torch
import torch.distributed as dist

from bench._common import alternate, cast_parameters, environment, sized_model_args, write_json
from titan_draft.infra import _compat
from titan_draft.infra.ranks import is_rank0
from titan_draft.models.cotrain import CoTrainSpec
from titan_draft.models.draft import EagleDraft, draft_args_for
from titan_draft.models.policy import policy_from_args
from titan_draft.parallel.pipeline import IGNORE, PipelineSetup, build_pipeline_cotrain, split_policy


def arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=2, help="ranks to spawn when not under torchrun (CPU)")
    p.add_argument("--schedule", default="1F1B")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--microbatch", type=int, default=2, help="documents (rows) per microbatch")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--tap-layers", type=int, nargs="+", default=None, help="default: 1, L/2-1, L-1")
    p.add_argument("--ttt-steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=8, help="measured steps of each kind")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="policy and draft dtype (default bfloat16 on GPU: flash kernels; float32 on CPU)")
    p.add_argument("--out", default="outputs/bench_tapchannel_overhead.json")
    return p


def build_models(args, seed: int = 0):
    margs = sized_model_args("llama3", "tiny", args.seq, dim=args.dim, layers=args.layers, heads=args.heads,
                             kv_heads=args.heads, vocab=args.vocab)
    dtype = getattr(torch, args.dtype or ("float32" if _compat.ON_CPU else "bfloat16"))
    policy = cast_parameters(policy_from_args(margs, seed), dtype)
    taps = args.tap_layers or sorted({1, args.layers // 2 - 1, args.layers - 1})
    with torch.device(_compat.device()):
        draft = EagleDraft(draft_args_for(margs, n_taps=len(taps)))
        draft.init_weights()
    return policy, cast_parameters(draft, dtype), CoTrainSpec(tap_layers=taps, ttt_steps=args.ttt_steps)


def random_batch(args, rows: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, args.vocab, (rows, args.seq), generator=g)
    labels = tokens.roll(-1, dims=1)
    labels[:, : args.seq // 4] = IGNORE  # the prompt
    labels[:, -1] = IGNORE
    return tokens.to(_compat.device()), labels.to(_compat.device())


def build(args, policy, draft, spec):
    """The co-training pipeline on a (1, world) mesh: one pipeline over all ranks, on copies of the models."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    mesh = init_device_mesh(_compat.device().type, (1, world), mesh_dim_names=("dp", "pp"))
    setup = PipelineSetup(pp_mesh=mesh["pp"], pipelines=mesh.mesh.tolist(), schedule=args.schedule,
                          n_microbatches=args.microbatches, microbatch_size=args.microbatch, seq_len=args.seq)
    parts = split_policy(copy.deepcopy(policy), setup.pp_mesh, args.schedule)
    return build_pipeline_cotrain(parts, copy.deepcopy(draft), spec, setup)


class PrefilledTaps:
    """The TapChannel's interface without transport: puts are dropped, gets read a local buffer."""

    def __init__(self, buffers: dict[int, list[torch.Tensor]]):
        self.buffers, self.in_step = buffers, False
        self.next = {}

    def begin_step(self, n_microbatches, rows):
        self.in_step, self.next = True, {s: 0 for s in self.buffers}

    def put(self, stage, features):
        pass

    def get(self, stage):
        m = self.next[stage]
        self.next[stage] = m + 1
        return self.buffers[stage][m].clone()  # the channel returns a fresh tensor too

    def end_step(self):
        self.in_step = False


def twin_of(run, received):
    """Point a pipeline's stages and loss at prefilled buffers instead of its TapChannel."""
    taps = PrefilledTaps(received)
    for stage in run.stages:
        stage.submod.channel = taps
    run.loss.channel = taps
    run.channel = taps
    return run


def recording_gets(channel):
    """Wrap channel.get to keep a copy of what the draft stage received: {stage: [microbatch tensors]}."""
    received, get = {}, channel.get

    def recorded(stage):
        out = get(stage)
        received.setdefault(stage, []).append(out.clone())
        return out

    channel.get = recorded
    return received


def step_of(run, tokens, labels):
    """One step of `run` from fresh gradients (the policy part, and the draft on the last stage)."""
    def step():
        for stage in run.stages:
            stage.submod.zero_grad(set_to_none=True)
        run.step(tokens, labels)

    return step


def main(args):
    policy, draft, spec = build_models(args)
    tokens, labels = random_batch(args, args.microbatch * args.microbatches)
    channel_run = build(args, policy, draft, spec)
    received = recording_gets(channel_run.channel)
    channel_run.step(tokens, labels)  # fills the twin's buffers (and warms the channel run up)
    del channel_run.channel.get  # back to the class's get: the measured steps record nothing
    twin = twin_of(build(args, policy, draft, spec), received)

    runs = {"channel": step_of(channel_run, tokens, labels), "twin": step_of(twin, tokens, labels)}
    records = alternate(runs, args.warmup + args.steps, _compat.device(), dist.group.WORLD)
    times = {name: [seconds for seconds, _ in timed[args.warmup:]] for name, timed in records.items()}
    if is_rank0():
        print(f"{'step':>4} {'channel ms':>11} {'twin ms':>9}")
        for i, (a, b) in enumerate(zip(times["channel"], times["twin"])):
            print(f"{i:>4} {1e3 * a:>11.2f} {1e3 * b:>9.2f}")
        med = {k: statistics.median(v) for k, v in times.items()}
        ratio = med["channel"] / med["twin"]
        print(f"median channel {1e3 * med['channel']:.2f} ms, twin {1e3 * med['twin']:.2f} ms "
              f"({args.schedule}, pp={dist.get_world_size()}, {args.microbatches} x {args.microbatch} x "
              f"{args.seq} tokens, dim {args.dim}, {args.layers} layers, taps {spec.tap_layers}, "
              f"{dist.get_backend()})")
        print(f"overhead_ratio {ratio:.4f}")
        write_json(args.out, dict(args=vars(args), **environment(), backend=dist.get_backend(),
                                  world_size=dist.get_world_size(), times_s=times, median_s=med, overhead_ratio=ratio))


def _spawned(rank, world_size, port, args, entry):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    launch(entry, args)


def launch(entry, args: argparse.Namespace):
    """Run entry(args) on every rank: under torchrun as is, else spawn --nproc CPU ranks (gloo)."""
    if "RANK" not in os.environ:
        import torch.multiprocessing as mp

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(_spawned, args=(args.nproc, port, args, entry), nprocs=args.nproc, join=True)
        return
    if torch.cuda.is_available():
        torch.cuda.set_device(_compat.device())
    dist.init_process_group(_compat.backend())
    try:
        entry(args)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    launch(main, arg_parser().parse_args())
