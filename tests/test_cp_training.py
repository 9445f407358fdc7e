"""A co-training step under context parallelism equals the same step at CP = 1.

The policy (torchtitan llama3, GQA, float64) runs packed documents of odd lengths through ring or
all-gather attention on zigzag shards (apply_context_parallel once, then a ContextShard per batch);
its cross-entropy on loss_mask rows and the draft's TTT loss (cotrain.draft_loss: the shard's
HaloShift + cp_branch_attention) are normalised by counts over the CP group. Losses, logits and every
parameter gradient (summed over the CP group, as FSDP over dp_shard x cp does) must equal the CP = 1
step on the unpadded batch; so must the step whose draft runs on drawn documents only
(draft.train_fraction < 1: ContextShard.documents).
"""
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from distributed import run_distributed
from titan_draft.data.packing import pack
from titan_draft.models.cotrain import CoTrainSpec, DraftFeatures, draft_loss, valid_pairs
from titan_draft.models.draft import Teacher
from titan_draft.models.draft import EagleDraft, draft_args_for
from titan_draft.models.policy import TapRecorder, build_policy, forward_packed, model_args
from titan_draft.parallel import apply_context_parallel, global_count, pad_documents, shard_batch_for_cp, zigzag_shard
from titan_draft.parallel.cp_attention import MODES

FLAVOR, MAX_LEN, LAYERS, TTT_STEPS, PASS_DECAY = "tiny_gqa", 128, [0, 1, 3], 3, 0.8
LENGTHS = [7, 13, 1, 9, 5]
DRAWN = torch.tensor([1, 2, 4])  # draft.train_fraction < 1: the draft runs on these documents only


def _models():
    policy = build_policy("llama3", FLAVOR, MAX_LEN, seed=0).double()
    torch.manual_seed(1)
    draft = EagleDraft(draft_args_for(model_args("llama3", FLAVOR, MAX_LEN), len(LAYERS)))
    draft.init_weights()
    return policy, draft.double()


def _batch():
    generator = torch.Generator().manual_seed(2)
    sequences = [torch.randint(0, 32, (n,), generator=generator) for n in LENGTHS]
    masks = []
    for n in LENGTHS:
        mask = torch.rand(n, generator=generator) < 0.7
        mask[-1] = False  # the last row has no next token
        masks.append(mask)
    return pack(sequences, masks)


def _step(policy, draft, batch, group, documents=None):
    """Policy cross-entropy and draft TTT loss (both normalised over `group`), backward; logits."""
    shift = batch.shift(TTT_STEPS)
    with TapRecorder(policy, LAYERS) as recorder:
        logits = forward_packed(policy, batch)
    mask = batch.loss_mask
    count = mask.sum().double()
    if group is not None:
        dist.all_reduce(count, group=group)
    policy_loss = F.cross_entropy(logits[mask], shift(batch.tokens, 1)[mask], reduction="sum") / count
    spec = CoTrainSpec(LAYERS, ttt_steps=TTT_STEPS, pass_decay=PASS_DECAY)
    pairs = valid_pairs(mask, shift, TTT_STEPS)
    if group is not None:
        dist.all_reduce(pairs, group=group)
    features = DraftFeatures(batch, recorder.embeddings(), recorder.taps(),
                             Teacher.from_logits(logits, draft.target_ids()))
    scale = 1.0
    if documents is not None:  # as WholePolicy weights a draw: documents / documents drawn
        features, scale = features.documents(documents), (len(batch.cu_seqlens) - 1) / len(documents)
    ttt, _ = draft_loss(draft, features, spec, count=pairs, scale=scale)
    (policy_loss + ttt).backward()
    return policy_loss.detach(), ttt.detach(), logits.detach()


def _grads(*modules):
    return {f"{i}.{name}": p.grad.clone() for i, m in enumerate(modules) for name, p in m.named_parameters()
            if p.grad is not None}


def _training_errors(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    group = mesh.get_group()
    policy, draft = _models()
    batch = _batch()

    references = {}
    for documents in (None, DRAWN):
        policy.zero_grad(set_to_none=True)
        draft.zero_grad(set_to_none=True)
        references[documents is None] = (*_step(policy, draft, batch, None, documents), _grads(policy, draft))
    ref_policy_loss, ref_ttt, ref_logits, ref_grads = references[True]
    padded, real_rows = pad_documents(batch, 2 * world_size)
    ref_logits_padded = torch.zeros(padded.num_tokens, ref_logits.shape[1], dtype=ref_logits.dtype)
    ref_logits_padded[real_rows] = ref_logits
    is_real = torch.zeros(padded.num_tokens, dtype=torch.bool)
    is_real[real_rows] = True
    local_real = zigzag_shard(is_real, padded.cu_seqlens, world_size, rank)
    local_ref_logits = zigzag_shard(ref_logits_padded, padded.cu_seqlens, world_size, rank)

    errors = {}
    cases = {mode: None for mode in MODES} | {"ring_drawn_documents": DRAWN}
    for case, documents in cases.items():
        mode = case.split("_")[0]
        ref_policy_loss, ref_ttt, _, ref_grads = references[documents is None]
        cp_policy = copy.deepcopy(policy)
        apply_context_parallel(cp_policy, mesh, mode)  # once, like TP and FSDP
        cp_policy.zero_grad(set_to_none=True)
        draft.zero_grad(set_to_none=True)
        local = shard_batch_for_cp(batch, mesh, mode)
        policy_loss, ttt, logits = _step(cp_policy, draft, local, group, documents)
        losses = torch.stack([policy_loss, ttt])
        dist.all_reduce(losses, group=group)
        grads = _grads(cp_policy, draft)
        for g in grads.values():
            dist.all_reduce(g, group=group)
        assert grads.keys() == ref_grads.keys()
        errors[case] = {
            "policy_loss": abs(losses[0] - ref_policy_loss).item(),
            "draft_loss": abs(losses[1] - ref_ttt).item(),
            "logits": (logits - local_ref_logits)[local_real].abs().max().item(),
            "policy_grads": max((grads[k] - ref_grads[k]).abs().max().item() for k in grads if k[0] == "0"),
            "draft_grads": max((grads[k] - ref_grads[k]).abs().max().item() for k in grads if k[0] == "1"),
            "count": global_count(local.loss_mask.sum(), mesh).item() - batch.loss_mask.sum().item(),
        }
    ref_policy_loss, ref_ttt, _, ref_grads = references[True]
    errors["scale"] = {"policy_loss": ref_policy_loss.item(), "draft_loss": ref_ttt.item(),
                       "grad_max": max(g.abs().max().item() for g in ref_grads.values()),
                       "drawn_draft_loss_differs": abs(references[False][1] - ref_ttt).item()}
    return errors


@pytest.mark.parametrize("world_size", [2, 4], ids=lambda w: f"cp{w}")
def test_cotraining_step_equals_cp1(world_size):
    results = run_distributed(_training_errors, world_size, timeout=150)
    for rank, errors in enumerate(results):
        assert errors["scale"]["grad_max"] > 1e-3  # the comparison below is not of zeros
        assert errors["scale"]["drawn_draft_loss_differs"] > 1e-6  # drawing documents changes the loss
        for case in (*MODES, "ring_drawn_documents"):
            assert errors[case]["count"] == 0
            assert max(errors[case].values()) < 1e-10, f"rank {rank} {case}: {errors[case]}"
