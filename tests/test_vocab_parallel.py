"""Vocab-parallel draft head under tensor parallelism: ttt_loss equals the single-process loss.

With TP the draft's lm_head is split over the draft vocabulary (ColwiseParallel), logits() returns
each rank's slice, and the soft cross-entropy all-reduces its max, sum of exponentials and dot
product. On 2 gloo ranks, in float64, for every pass count: the loss, the valid pair count, the
per-pass agreement counts and every parameter's gradient equal one process with the whole head.
"""
import copy
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from distributed import run_distributed  # noqa: E402

from titan_draft.data.packing import DocumentShift  # noqa: E402
from titan_draft.models.draft import DraftArgs, EagleDraft, Teacher, soft_cross_entropy, ttt_loss  # noqa: E402
from titan_draft.ops import branch_attention  # noqa: E402

LENGTHS = [5, 1, 7, 3, 9]
DIM, TARGET_VOCAB, DRAFT_VOCAB = 32, 24, 12


def make_inputs(seed: int):
    torch.manual_seed(seed)
    draft = EagleDraft(DraftArgs(dim=DIM, n_heads=4, n_kv_heads=2, n_taps=3, target_vocab_size=TARGET_VOCAB,
                                 draft_vocab_size=DRAFT_VOCAB, ffn_dim=48, max_seq_len=64)).double()
    draft.init_weights()
    with torch.no_grad():  # weights large enough for every path to matter
        for p in draft.parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if p.dim() == 1 else torch.randn_like(p) / math.sqrt(p.shape[1]))
    draft.set_vocab(torch.randperm(TARGET_VOCAB)[:DRAFT_VOCAB].sort().values)
    T = sum(LENGTHS)
    emb, taps = torch.randn(T, DIM, dtype=torch.float64), torch.randn(T, 3 * DIM, dtype=torch.float64)
    teacher = 2 * torch.randn(T, TARGET_VOCAB, dtype=torch.float64)
    return draft, emb, taps, teacher, torch.rand(T) < 0.7


def loss_and_grads(draft, emb, taps, teacher, mask, ttt_steps):
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    positions = torch.cat([torch.arange(n) for n in LENGTHS])
    shift = DocumentShift(cu)
    pass_logits = draft(emb, taps, positions, ttt_steps, shift,
                        lambda q, k, v, bk, bv: branch_attention(q, k, v, bk, bv, cu_seqlens=cu))
    total, count, stats = ttt_loss(draft, pass_logits, Teacher.from_logits(teacher, draft.target_ids()), mask, shift, 0.8)
    (total / count).backward()
    grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
             for n, p in draft.named_parameters()}
    return total.detach(), count, torch.tensor([[float(x) for x in s] for s in stats]), grads


def vocab_parallel_worker(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world_size,))
    results = []
    for ttt_steps in (1, 2, 3, 4):
        draft, emb, taps, teacher, mask = make_inputs(ttt_steps)
        split = copy.deepcopy(draft)
        parallelize_module(split, mesh, {"lm_head": ColwiseParallel()})
        split.vocab_parallel_group = mesh.get_group()
        whole = loss_and_grads(draft, emb, taps, teacher, mask, ttt_steps)
        parallel = loss_and_grads(split, emb, taps, teacher, mask, ttt_steps)
        results.append((whole, parallel))
    # the argmax with a tie across the two slices picks the lower id, as torch.argmax does
    logits = torch.zeros(2, DRAFT_VOCAB // world_size, dtype=torch.float64)
    logits[:, 1] = 5.0
    _, best = soft_cross_entropy(logits, torch.full((2, DRAFT_VOCAB), 1 / DRAFT_VOCAB, dtype=torch.float64),
                                 mesh.get_group())
    return results, best


def test_vocab_parallel_head_equals_whole_head():
    for results, best in run_distributed(vocab_parallel_worker, 2, timeout=120):
        assert best.tolist() == [1, 1]
        for (loss, count, stats, grads), (p_loss, p_count, p_stats, p_grads) in results:
            torch.testing.assert_close(p_loss, loss, rtol=1e-12, atol=0)
            assert p_count == count
            torch.testing.assert_close(p_stats, stats, rtol=1e-12, atol=1e-12)
            for name, grad in grads.items():
                assert grad.abs().sum() > 0, name
                torch.testing.assert_close(p_grads[name], grad, rtol=1e-10, atol=1e-12, msg=name)

