"""Pipeline-parallel co-training equals the single-process run, for every schedule torchtitan offers.

For PP=2, PP=4 and PP=2 x DP=2 (gloo, CPU, float32): the policy loss, the draft loss, the policy's
gradients (every parameter of every stage) and the draft's gradients match one process running
the whole policy and the draft on the same batch; the schedule's own P2P operations are the
same with and without the TapChannel; the draft's forward and every one of its gradients run inside
the draft timer's blocks (draft_time_s), one block per microbatch.
"""
import contextlib
import copy
import inspect
import os
import sys
from functools import partial

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from distributed import run_distributed  # noqa: E402

from titan_draft.data.packing import DocumentShift, pack  # noqa: E402
from titan_draft.models.cotrain import CoTrainSpec  # noqa: E402
from titan_draft.models.draft import EagleDraft, Teacher, draft_args_for, ttt_loss  # noqa: E402
from titan_draft.models.policy import TapRecorder, forward_packed, install_packed_attention, model_args  # noqa: E402
from titan_draft.ops import branch_attention  # noqa: E402
from titan_draft.parallel.pipeline import (IGNORE, PipelineSetup, build_pipeline_cotrain, build_policy_pipeline,  # noqa: E402
                                          split_policy)

SEQ_LEN, MICROBATCH, N_MICROBATCHES = 12, 2, 4
SPEC = CoTrainSpec(tap_layers=[1, 3, 5], ttt_steps=3, pass_decay=0.8, loss_weight=0.5)
ALL_SCHEDULES = ["GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble"]


def tiny_policy_and_draft(seed: int = 0):
    """llama3, dim 32, 6 layers (enough for 8 virtual stages), GQA; a draft on three taps."""
    from torchtitan.models.llama3 import Transformer

    args = model_args("llama3", "tiny_gqa", SEQ_LEN)
    args.dim, args.n_layers = 32, 6
    torch.manual_seed(seed)
    policy = Transformer(args)
    with torch.no_grad():
        policy.init_weights()
    install_packed_attention(policy)
    draft = EagleDraft(draft_args_for(args, n_taps=len(SPEC.tap_layers)))
    draft.init_weights()
    return policy, draft


def random_batch(rows: int, seed: int = 1):
    """[rows, S] documents of random length (padded), prompt rows untrained, labels = next token."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(4, 32, (rows, SEQ_LEN), generator=g)
    labels = torch.full((rows, SEQ_LEN), IGNORE)
    for b in range(rows):
        length = int(torch.randint(SEQ_LEN // 2, SEQ_LEN + 1, (1,), generator=g))
        prompt = int(torch.randint(1, length // 2, (1,), generator=g))
        tokens[b, length:] = 0
        labels[b, prompt: length - 1] = tokens[b, prompt + 1: length]
    return tokens, labels


def single_process(policy, draft, tokens, labels):
    """The obviously-correct reference: whole policy and draft, one packed batch, one process."""
    trained = labels != IGNORE
    batch = pack(list(tokens), list(trained))
    with TapRecorder(policy, SPEC.tap_layers) as rec:
        logits = forward_packed(policy, batch)
    policy_loss = F.cross_entropy(logits, labels.flatten(), ignore_index=IGNORE, reduction="sum") / trained.sum()
    shift = DocumentShift(batch.cu_seqlens)
    pass_logits = draft(rec.embeddings(), rec.taps(), batch.positions, SPEC.ttt_steps, shift,
                        partial(branch_attention, cu_seqlens=batch.cu_seqlens))
    teacher = Teacher.from_logits(logits, draft.target_ids())
    total, count, _ = ttt_loss(draft, pass_logits, teacher, batch.loss_mask, shift, SPEC.pass_decay)
    draft_loss = total / count
    (policy_loss + SPEC.loss_weight * draft_loss).backward()
    return policy_loss.item(), draft_loss.item()


def record_schedule_p2p(pp_group):
    """Patch isend/irecv to log the ops issued on the schedule's group; returns (log, undo).

    Every P2P path of torch pipelining (direct isend/irecv, batch_isend_irecv) ends in these two.
    """
    log, originals = [], {name: getattr(c10d, name) for name in ("isend", "irecv")}

    def recording(name):
        original, signature = originals[name], inspect.signature(originals[name])

        def op(*args, **kwargs):
            a = signature.bind(*args, **kwargs).arguments
            if a.get("group") == pp_group:
                peer = a.get("dst", a.get("src", a.get("group_dst", a.get("group_src"))))
                log.append((name, peer, tuple(a["tensor"].shape), a["tensor"].dtype))
            return original(*args, **kwargs)

        return op

    for name in originals:
        setattr(c10d, name, recording(name))
        setattr(dist, name, getattr(c10d, name))

    def undo():
        for name, original in originals.items():
            setattr(c10d, name, original)
            setattr(dist, name, original)

    return log, undo


class BlockTimer:
    """A draft_timer (timing.DeviceTimer's interface: a context per block) that knows whether a block is open."""

    def __init__(self):
        self.open, self.blocks = False, 0

    @contextlib.contextmanager
    def __call__(self):
        self.open, self.blocks = True, self.blocks + 1
        try:
            yield
        finally:
            self.open = False


def record_draft_work(draft, timer: BlockTimer) -> list[bool]:
    """Whether the timer's block was open at each forward of the draft's first layer and each gradient
    accumulated into one of its parameters."""
    seen = []
    draft.fc.register_forward_pre_hook(lambda *_: seen.append(timer.open))
    for p in draft.parameters():
        p.register_post_accumulate_grad_hook(lambda _: seen.append(timer.open))
    return seen


def max_rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))


def pipeline_worker(rank, world_size, pp_degrees, schedules):
    """For each pp degree (dp = world_size / pp), every schedule: errors against the single process."""
    return {pp: pipeline_errors(rank, world_size, pp, schedules) for pp in pp_degrees}


def pipeline_errors(rank, world_size, pp, schedules):
    from torch.distributed.device_mesh import init_device_mesh

    dp = world_size // pp
    mesh = init_device_mesh("cpu", (dp, pp), mesh_dim_names=("dp", "pp"))
    pp_mesh, dp_rank = mesh["pp"], mesh["dp"].get_local_rank()
    dp_group = mesh["dp"].get_group() if dp > 1 else None
    pipelines = mesh.mesh.tolist()

    policy0, draft0 = tiny_policy_and_draft()
    rows = N_MICROBATCHES * MICROBATCH
    tokens, labels = random_batch(dp * rows)
    ref_policy, ref_draft = copy.deepcopy(policy0), copy.deepcopy(draft0)
    ref_losses = single_process(ref_policy, ref_draft, tokens, labels)
    ref_policy_grads = {n: p.grad for n, p in ref_policy.named_parameters()}
    ref_draft_grads = {n: p.grad for n, p in ref_draft.named_parameters()}
    mine = slice(dp_rank * rows, (dp_rank + 1) * rows)

    results = {}
    for schedule in schedules:
        logs = {}
        for taps in (False, True):
            policy, draft = copy.deepcopy(policy0), copy.deepcopy(draft0)
            setup = PipelineSetup(pp_mesh=pp_mesh, pipelines=pipelines, schedule=schedule,
                                  n_microbatches=N_MICROBATCHES, microbatch_size=MICROBATCH, seq_len=SEQ_LEN,
                                  dp_group=dp_group)
            parts = split_policy(policy, pp_mesh, schedule)
            timer = BlockTimer()
            draft_work = record_draft_work(draft, timer)
            run = build_pipeline_cotrain(parts, draft, SPEC, setup, draft_timer=timer) if taps else \
                build_policy_pipeline(parts, setup)
            logs[taps], undo = record_schedule_p2p(pp_mesh.get_group())
            try:
                losses = run.step(tokens[mine], labels[mine])
            finally:
                undo()
        errors = {}
        for part in run.parts:
            for name, p in part.named_parameters():
                grad = p.grad.clone()
                if dp_group is not None:
                    dist.all_reduce(grad, group=dp_group)
                errors[f"policy.{name}"] = max_rel_err(grad, ref_policy_grads[name])
        if run.has_last:
            for name, p in draft.named_parameters():
                grad = p.grad.clone()
                if dp_group is not None:
                    dist.all_reduce(grad, group=dp_group)
                errors[f"draft.{name}"] = max_rel_err(grad, ref_draft_grads[name])
            loss_sums = torch.tensor(losses)
            if dp_group is not None:
                dist.all_reduce(loss_sums, group=dp_group)
            errors["policy_loss"] = abs(loss_sums[0].item() - ref_losses[0]) / abs(ref_losses[0])
            errors["draft_loss"] = abs(loss_sums[1].item() - ref_losses[1]) / abs(ref_losses[1])
        results[schedule] = dict(errors=errors, same_p2p=logs[True] == logs[False], n_p2p=len(logs[True]),
                                 puts=dict(run.channel.put_count), gets=dict(run.channel.get_count),
                                 draft_work=draft_work, timer_blocks=timer.blocks, has_last=run.has_last,
                                 draft_params=len(list(draft.parameters())))
    return results


def check(results, schedules):
    for rank, per_rank in enumerate(results):
        for schedule in schedules:
            r = per_rank[schedule]
            assert r["same_p2p"], f"{schedule} rank {rank}: the schedule's P2P ops changed with the TapChannel"
            assert r["n_p2p"] > 0, f"{schedule} rank {rank}: recorded no schedule P2P ops"
            assert all(n == N_MICROBATCHES for n in {**r["puts"], **r["gets"]}.values()), (schedule, rank, r)
            if r["has_last"]:  # forward once and every parameter's gradient once per microbatch, all timed
                assert r["timer_blocks"] == N_MICROBATCHES and all(r["draft_work"]), (schedule, rank)
                assert len(r["draft_work"]) == N_MICROBATCHES * (1 + r["draft_params"]), (schedule, rank)
            else:
                assert r["timer_blocks"] == 0 and not r["draft_work"], (schedule, rank)
            worst = max(r["errors"], key=r["errors"].get)
            assert r["errors"][worst] < 1e-5, f"{schedule} rank {rank}: {worst} rel err {r['errors'][worst]:.2e}"
    # Every gradient and both losses were compared somewhere.
    for schedule in schedules:
        keys = set().union(*(per_rank[schedule]["errors"] for per_rank in results))
        assert {"policy_loss", "draft_loss", "draft.fc.weight", "policy.tok_embeddings.weight",
                "policy.output.weight", "policy.layers.5.feed_forward.w1.weight"} <= keys


@pytest.mark.parametrize("world_size,pp_degrees", [(2, [2]), (4, [4, 2])], ids=["pp2", "pp4+pp2xdp2"])
def test_pipeline_cotrain_equals_single_process(world_size, pp_degrees):
    results = run_distributed(pipeline_worker, world_size, pp_degrees, ALL_SCHEDULES, timeout=170)
    for pp in pp_degrees:
        check([per_rank[pp] for per_rank in results], ALL_SCHEDULES)


def test_bad_settings_name_the_argument():
    policy, draft = tiny_policy_and_draft()
    setup = PipelineSetup(pp_mesh=None, pipelines=[[0]], schedule="1F1B", n_microbatches=2, microbatch_size=1,
                          seq_len=8)
    with pytest.raises(ValueError, match=r"spec.tap_layers: \[3, 1\] must be distinct, ascending and in 0..5"):
        build_pipeline_cotrain([policy], draft, CoTrainSpec(tap_layers=[3, 1]), setup)
    with pytest.raises(ValueError, match=r"spec.tap_layers: \[1, 6\]"):
        build_pipeline_cotrain([policy], draft, CoTrainSpec(tap_layers=[1, 6]), setup)
    with pytest.raises(ValueError, match="draft: built for 3 taps of width 32, the policy gives 2 of width 32"):
        build_pipeline_cotrain([policy], draft, CoTrainSpec(tap_layers=[1, 3]), setup)
