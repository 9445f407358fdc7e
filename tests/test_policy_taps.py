"""The policy's packed forward and its TapRecorder, against manual and per-document forwards."""
import copy

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from titan_draft.data.packing import pack
from titan_draft.models.policy import TapRecorder, build_policy, forward_packed, model_args, varlen_metadata

LENGTHS = [5, 1, 8, 2, 7]
TAPS = [0, 1, 3]
NAMES = ["llama3", "qwen3"]


def packed_batch(seed, vocab=32):
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(0, vocab, (n,), generator=g) for n in LENGTHS]
    return docs, pack(docs, [torch.ones(n, dtype=torch.bool) for n in LENGTHS])


def rope_buffer(model):
    return model.freqs_cis if hasattr(model, "freqs_cis") else model.rope_cache


@pytest.fixture(scope="module", params=NAMES)
def policy(request):
    return request.param, build_policy(request.param, "tiny_gqa", 32, seed=0)


def test_taps_equal_manual_layer_by_layer_forward(policy):
    name, model = policy
    docs, batch = packed_batch(1)
    with TapRecorder(model, TAPS) as rec:
        logits = forward_packed(model, batch)

    meta = varlen_metadata(batch)
    h = model.tok_embeddings(batch.tokens[None])
    emb = h[0]
    hidden = []
    for i in range(len(model.layers)):
        h = model.layers[str(i)](h, rope_buffer(model), attention_masks=meta, positions=batch.positions[None])
        hidden.append(h[0])
    manual_logits = model.output(model.norm(h))[0]

    assert torch.equal(rec.embeddings(), emb)
    assert torch.equal(rec.taps(), torch.cat([hidden[i] for i in TAPS], dim=-1))
    assert rec.taps().shape == (batch.num_tokens, len(TAPS) * model_args(name, "tiny_gqa", 32).dim)
    assert torch.equal(logits, manual_logits)
    # detached: nothing the draft does can reach the policy
    assert logits.requires_grad
    assert rec.taps().grad_fn is None and not rec.taps().requires_grad
    assert rec.embeddings().grad_fn is None and not rec.embeddings().requires_grad
    # the hooks are gone after the with-block
    rec.outputs.clear()
    forward_packed(model, batch)
    assert rec.outputs == {}


def test_packed_forward_equals_each_document_alone_with_plain_causal_sdpa(policy):
    """Block-diagonal attention and restarting positions: each document of the packed batch gets
    exactly the logits of a stock torchtitan model (SDPA, causal, default positions) run on it alone."""
    name, model = policy
    docs, batch = packed_batch(2)
    packed = forward_packed(model, batch)

    args = model_args(name, "tiny_gqa", 32)
    args.attn_type, args.attn_mask_type = "sdpa", "causal"
    if name == "llama3":
        from torchtitan.models.llama3 import Transformer as Model
    else:
        from torchtitan.models.qwen3 import Qwen3Model as Model
    stock = Model(args)
    stock.load_state_dict(model.state_dict())
    with torch.no_grad():
        separate = torch.cat([stock(doc[None])[0] for doc in docs])
    torch.testing.assert_close(packed.detach(), separate, rtol=1e-5, atol=1e-5)

    # and documents really do not see each other: changing one document changes only its rows
    other = [d.clone() for d in docs]
    other[2] = (other[2] + 1) % 32
    changed = forward_packed(model, pack(other, [torch.ones(n, dtype=torch.bool) for n in LENGTHS])).detach()
    rows = torch.cat([torch.full((n,), k) for k, n in enumerate(LENGTHS)])
    assert torch.equal(changed[rows != 2], packed.detach()[rows != 2])
    assert not torch.allclose(changed[rows == 2], packed.detach()[rows == 2])


def test_tap_recorder_under_activation_checkpointing(policy):
    name, model = policy
    docs, batch = packed_batch(3)
    torch.manual_seed(0)
    with TapRecorder(model, TAPS) as rec:
        logits = forward_packed(model, batch)
    want_taps, want_emb = rec.taps().clone(), rec.embeddings().clone()
    model.zero_grad(set_to_none=True)
    logits.square().mean().backward()
    want_grads = {n: p.grad.clone() for n, p in model.named_parameters()}

    wrapped = copy.deepcopy(model)
    wrapped.zero_grad(set_to_none=True)
    for i in range(len(wrapped.layers)):
        wrapped.layers[str(i)] = checkpoint_wrapper(wrapped.layers[str(i)], preserve_rng_state=False)
    assert type(wrapped.layers["1"]).__name__ == "CheckpointWrapper"
    with TapRecorder(wrapped, TAPS) as rec:
        logits_w = forward_packed(wrapped, batch)
        logits_w.square().mean().backward()  # recomputation inside backward must not overwrite the taps
    assert torch.equal(logits_w, logits)
    assert torch.equal(rec.taps(), want_taps)
    assert torch.equal(rec.embeddings(), want_emb)
    assert rec.taps().grad_fn is None
    got = {n.replace("._checkpoint_wrapped_module", ""): p.grad for n, p in wrapped.named_parameters()}
    assert got.keys() == want_grads.keys()
    for n in want_grads:
        torch.testing.assert_close(got[n], want_grads[n], rtol=1e-5, atol=1e-7)
