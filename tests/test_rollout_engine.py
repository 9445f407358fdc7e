"""The rollout engine against obviously-correct references: torchtitan's own packed forward (no
cache), the training-time draft (ttt_forward + branch_attention), and plain greedy decoding."""
import pytest
import torch

from titan_draft import _compat
from titan_draft.cotrain import local_draft_inputs
from titan_draft.models.draft import EagleDraft, draft_args_for
from titan_draft.models.policy import TapRecorder, build_policy, forward_packed, model_args
from titan_draft.packing import pack
from titan_draft.rollout import RolloutEngine, probs_from_logits

DEVICE = _compat.device()  # the engine runs where the policy does: the CUDA path on a GPU machine

TAPS = [0, 1, 3]
MAX_LEN = 40
VOCAB = 32
NEVER = VOCAB  # an eos id no model can emit


def make(name="llama3", max_batch_size=4, draft_vocab=24, seed=0):
    """float64 policy (GQA 4/2), a random draft over part of the vocabulary, and an engine."""
    args = model_args(name, "tiny_gqa", MAX_LEN)
    policy = build_policy(name, "tiny_gqa", MAX_LEN, seed=seed).double()
    dargs = draft_args_for(args, len(TAPS), draft_vocab_size=draft_vocab, n_heads=4, n_kv_heads=2)
    draft = EagleDraft(dargs)
    draft.init_weights()
    draft.set_vocab(torch.randperm(VOCAB, generator=torch.Generator().manual_seed(seed))[:draft_vocab].sort().values)
    draft.double().to(DEVICE)
    engine = RolloutEngine(args, dargs, TAPS, max_batch_size, MAX_LEN, DEVICE, torch.float64)
    engine.load_weights(policy, draft)
    return policy, draft, engine


@torch.no_grad()
def reference_logits(policy, seqs):
    """torchtitan forward_packed over the sequences as packed documents, with its taps."""
    batch = pack([s.cpu() for s in seqs], [torch.ones(len(s), dtype=torch.bool) for s in seqs]).to(DEVICE)
    with TapRecorder(policy, TAPS) as rec:
        logits = forward_packed(policy, batch)
    return logits, rec.taps(), rec.embeddings(), batch


@pytest.mark.parametrize("name", ["llama3", "qwen3"])
def test_cached_policy_equals_torchtitan_forward_with_rollback(name):
    """Prefill, then windows of 3 positions per row of which a random 1..3 are kept (the rest is
    rolled back): every kept logit and tap equals torchtitan's packed forward of the sequence."""
    policy, _, engine = make(name)
    gen = torch.Generator().manual_seed(1)
    B, P, T = 3, 5, 30
    seqs = torch.randint(0, VOCAB, (B, T), generator=gen).to(DEVICE)
    ref_logits, ref_taps, _, _ = reference_logits(policy, seqs)
    ref_logits, ref_taps = ref_logits.view(B, T, -1), ref_taps.view(B, T, -1)

    logits, taps, _ = engine.policy_forward(seqs[:, :P], torch.arange(P, device=DEVICE).expand(B, P))
    torch.testing.assert_close(logits, ref_logits[:, :P], rtol=0, atol=1e-10)
    torch.testing.assert_close(taps, ref_taps[:, :P], rtol=0, atol=1e-10)
    start = torch.full((B,), P, device=DEVICE)
    rows = torch.arange(B, device=DEVICE)
    checked = 0
    while int(start.max()) + 3 <= T:
        positions = start[:, None] + torch.arange(3, device=DEVICE)
        window = seqs[rows[:, None], positions.clamp(max=T - 1)]
        if checked % 2:  # garbage after the kept part must not matter: it is rolled back
            noise = torch.randint(0, VOCAB, window.shape, generator=gen).to(DEVICE)
            window = noise.where(torch.arange(3, device=DEVICE) > 0, window)
        logits, taps, _ = engine.policy_forward(window, positions)
        torch.testing.assert_close(logits[:, 0], ref_logits[rows, start], rtol=0, atol=1e-10)
        torch.testing.assert_close(taps[:, 0], ref_taps[rows, start], rtol=0, atol=1e-10)
        if checked % 2 == 0:
            torch.testing.assert_close(logits, ref_logits[rows[:, None], positions], rtol=0, atol=1e-10)
        keep = torch.randint(1, 4, (B,), generator=gen) if checked % 2 == 0 else torch.ones(B, dtype=torch.long)
        start = start + keep.to(DEVICE)
        checked += 1
    assert checked > 8


def test_draft_inference_equals_training_time_test():
    """Pass 1 over a prompt (the trunk) then passes 2..4 at one anchor, fed the true next tokens,
    give the hidden states of ttt_forward (packed documents, branch_attention) at that anchor."""
    policy, draft, engine = make()
    gen = torch.Generator().manual_seed(2)
    B, T, D = 3, 17, 4
    seqs = torch.randint(0, VOCAB, (B, T), generator=gen).to(DEVICE)
    _, ref_taps, ref_emb, batch = reference_logits(policy, seqs)
    with torch.no_grad():
        states = draft.ttt_forward(ref_emb, ref_taps, batch.positions, D, *local_draft_inputs(batch))
    states = [s.view(B, T, -1) for s in states]

    anchor = torch.tensor([9, 5, 11], device=DEVICE)  # anchors of different rows differ
    n_anchors = int(anchor.max()) + 1
    _, taps, emb = engine.policy_forward(seqs[:, :n_anchors], torch.arange(n_anchors, device=DEVICE).expand(B, -1))
    torch.testing.assert_close(taps, ref_taps.view(B, T, -1)[:, :n_anchors], rtol=0, atol=1e-10)
    next_emb = engine.policy.tok_embeddings(seqs[:, 1:n_anchors + 1])
    hidden = engine.draft_extend(next_emb, taps, torch.zeros_like(anchor), anchor + 1)
    rows = torch.arange(B, device=DEVICE)
    torch.testing.assert_close(hidden, states[0][rows, anchor], rtol=0, atol=1e-10)
    for k in range(2, D + 1):
        emb_k = engine.policy.tok_embeddings(seqs[rows, anchor + k])
        hidden = engine.draft_pass(k, emb_k, hidden, anchor)
        torch.testing.assert_close(hidden, states[k - 1][rows, anchor], rtol=0, atol=1e-10)


def reference_greedy(policy, prompt, max_new_tokens, eos_id):
    """Plain greedy decoding: a full uncached torchtitan forward per token."""
    seq = prompt.clone()
    for _ in range(max_new_tokens):
        logits, _, _, _ = reference_logits(policy, [seq])
        seq = torch.cat([seq, logits[-1].argmax()[None].cpu()])
        if int(seq[-1]) == eos_id:
            break
    return seq


def test_greedy_speculative_equals_plain_greedy():
    """Token for token, batched and row by row, with a random draft (most drafts rejected) and an
    eos that ends some rows in the middle of the batch."""
    policy, _, engine = make()
    gen = torch.Generator().manual_seed(3)
    B, P, N = 4, 6, 16
    prompts = torch.randint(4, VOCAB, (B, P), generator=gen)
    free = engine.generate(prompts, N, num_speculative_tokens=0, temperature=0, eos_id=NEVER)
    # An eos that some rows emit and others never do: rows end at different steps.
    responses = free.tokens[:, P:]
    eos_id = next(int(t) for t in responses.flatten() if not all(t in r for r in responses))
    refs = [reference_greedy(policy, p, N, eos_id) for p in prompts]
    assert any(len(r) < P + N for r in refs) and any(len(r) == P + N for r in refs)
    for K in (0, 2, 5):
        out = engine.generate(prompts, N, num_speculative_tokens=K, temperature=0, eos_id=eos_id)
        for b, ref in enumerate(refs):
            assert torch.equal(out.tokens[b, : len(ref)], ref), (K, b)
            assert int(out.response_lengths[b]) == len(ref) - P
            assert (out.tokens[b, len(ref):] == eos_id).all()
        if K:
            assert 1.0 <= out.acceptance_length <= K + 1
            assert out.per_position_acceptance.shape == (K,)
        single = engine.generate(prompts[2:3], N, num_speculative_tokens=K, temperature=0, eos_id=eos_id)
        assert torch.equal(single.tokens[0], out.tokens[2])


def test_perfect_draft_accepts_everything():
    """A draft that proposes exactly the policy's greedy tokens is accepted K times per step."""
    policy, _, engine = make()
    gen = torch.Generator().manual_seed(4)
    prompts = torch.randint(4, VOCAB, (2, 5), generator=gen)
    K, N = 3, 17
    plain = engine.generate(prompts, N, num_speculative_tokens=0, temperature=0, eos_id=NEVER)
    target = plain.tokens.to(DEVICE)  # before any capture: a CUDA graph cannot copy from the host

    def oracle(hidden, anchor, K, temperature, top_p, generator):
        # t_k must be the token at position anchor + 1 + k of the greedy sequence.
        pos = (anchor[:, None] + 2 + torch.arange(K, device=DEVICE)).clamp(max=target.shape[1] - 1)
        tokens = target[torch.arange(len(anchor), device=DEVICE)[:, None], pos]
        probs = torch.zeros(*tokens.shape, VOCAB, dtype=torch.float64, device=DEVICE)
        return tokens, probs.scatter_(-1, tokens[..., None], 1.0)

    engine._propose = oracle
    out = engine.generate(prompts, N, num_speculative_tokens=K, temperature=0, eos_id=NEVER)
    assert torch.equal(out.tokens, plain.tokens)
    assert out.num_decode_steps == (N - 1 + K) // (K + 1)
    assert torch.equal(out.per_position_acceptance[:2], torch.ones(2))


def test_caches_after_rollback_equal_fresh_prefill():
    """After sampled speculative generation (many rejections), the policy cache of every row equals
    a fresh prefill of its accepted tokens, and so do the draft's trunk keys."""
    policy, draft, engine = make()
    gen = torch.Generator().manual_seed(5)
    B, P, N, K = 3, 5, 24, 3
    prompts = torch.randint(4, VOCAB, (B, P), generator=gen)
    out = engine.generate(prompts, N, num_speculative_tokens=K, temperature=1.0, eos_id=NEVER,
                          generator=torch.Generator(DEVICE).manual_seed(5))
    assert out.acceptance_length < K + 1  # there were rejections
    fresh = RolloutEngine(model_args("llama3", "tiny_gqa", MAX_LEN), draft.args, TAPS, B, MAX_LEN, DEVICE, torch.float64)
    fresh.load_weights(policy, draft)
    length = P + N  # no eos: every row ran to its budget
    seqs = out.tokens.to(DEVICE)
    _, taps, _ = fresh.policy_forward(seqs[:, : length - 1], torch.arange(length - 1, device=DEVICE).expand(B, -1))
    for layer in range(len(engine.k_cache)):
        torch.testing.assert_close(engine.k_cache[layer][:B, : length - 1], fresh.k_cache[layer][:B, : length - 1],
                                   rtol=0, atol=1e-10)
        torch.testing.assert_close(engine.v_cache[layer][:B, : length - 1], fresh.v_cache[layer][:B, : length - 1],
                                   rtol=0, atol=1e-10)
    fresh.draft_extend(fresh.policy.tok_embeddings(seqs[:, 1:length]), taps, torch.zeros(B, dtype=torch.long, device=DEVICE),
                       torch.full((B,), length - 1, device=DEVICE))
    # The last verify step of a row starts at most K + 1 tokens before its end; the trunk holds
    # every anchor before that step's first position.
    known = length - 1 - (K + 1)
    torch.testing.assert_close(engine.draft_k[:B, :known], fresh.draft_k[:B, :known], rtol=0, atol=1e-10)
    torch.testing.assert_close(engine.draft_v[:B, :known], fresh.draft_v[:B, :known], rtol=0, atol=1e-10)


def test_sampled_speculative_generation_is_lossless():
    """End to end at temperature 0.8 / top-p 0.9: the distribution of the second response token
    (which follows an accepted or rejected draft) equals the policy's exact marginal."""
    policy, _, engine = make(max_batch_size=2000)
    prompt = torch.tensor([1, 7, 9, 4, 12])
    P, n = len(prompt), 2000
    gen = torch.Generator(DEVICE).manual_seed(6)
    out = engine.generate(prompt.expand(n, P).contiguous(), 3, num_speculative_tokens=2, temperature=0.8,
                          top_p=0.9, eos_id=NEVER, generator=gen)
    first = probs_from_logits(reference_logits(policy, [prompt])[0][-1], 0.8, 0.9)
    support = first.nonzero()[:, 0].cpu()
    seqs = [torch.cat([prompt, t[None]]) for t in support]
    second = probs_from_logits(torch.stack([reference_logits(policy, [s])[0][-1] for s in seqs]), 0.8, 0.9)
    marginal = (first[support, None] * second).sum(0).double().cpu()
    counts = torch.bincount(out.tokens[:, P + 1], minlength=VOCAB).double()
    expected = marginal * n
    assert counts[expected == 0].sum() == 0
    big = expected >= 5  # pool the rare tokens into one bin
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    stat = float(((obs - exp) ** 2 / exp.clamp(min=1e-12)).sum())
    # 0.999 quantiles of chi-square for df = 1..31 are below 3.3 * df + 11.
    df = len(obs) - 1
    assert stat < 3.3 * df + 11, (stat, df)
    assert out.acceptance_length > 1.0  # the draft was used


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs")
@pytest.mark.parametrize("K, temperature", [(0, 1.0), (3, 0.0), (3, 1.0)])
def test_cuda_graph_steps_equal_eager_steps(K, temperature):
    """Decode steps replayed from CUDA graphs give the tokens and statistics of the same steps run
    eagerly (same seed: the graphs draw the same random numbers), over several calls."""
    policy, draft, graphed = make()
    eager = RolloutEngine(model_args("llama3", "tiny_gqa", MAX_LEN), draft.args, TAPS, 4, MAX_LEN, DEVICE,
                          torch.float64, cuda_graphs=False)
    eager.load_weights(policy, draft)
    assert graphed.cuda_graphs and not eager.cuda_graphs
    gen = torch.Generator().manual_seed(8)
    for call in range(3):
        prompts = torch.randint(4, VOCAB, (3, 5), generator=gen)
        a, b = (e.generate(prompts, 20, num_speculative_tokens=K, temperature=temperature, eos_id=NEVER,
                           generator=torch.Generator().manual_seed(call)) for e in (graphed, eager))
        assert torch.equal(a.tokens, b.tokens), call
        assert (a.num_verify_forwards, a.emitted_tokens, a.num_decode_steps) == \
            (b.num_verify_forwards, b.emitted_tokens, b.num_decode_steps)
    assert graphed._steps[(3, K, temperature, 1.0)].graph is not None  # the steps were replayed


def test_bad_inputs():
    policy, draft, engine = make(max_batch_size=2)
    prompts = torch.ones(2, 5, dtype=torch.long)
    cases = [
        (dict(prompts=torch.ones(3, 5, dtype=torch.long)), "max_batch_size"),
        (dict(prompts=torch.ones(2, MAX_LEN, dtype=torch.long)), "max_seq_len"),
        (dict(prompts=prompts.int()), "int64"),
        (dict(num_speculative_tokens=-1), "num_speculative_tokens"),
        (dict(num_speculative_tokens=99), "num_speculative_tokens"),
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
    ]
    for override, match in cases:
        kwargs = dict(prompts=prompts, max_new_tokens=4, num_speculative_tokens=2, eos_id=2) | override
        with pytest.raises(ValueError, match=match):
            engine.generate(kwargs.pop("prompts"), kwargs.pop("max_new_tokens"), **kwargs)
    no_draft = RolloutEngine(model_args("llama3", "tiny_gqa", MAX_LEN), None, TAPS, 2, MAX_LEN, DEVICE, torch.float64)
    with pytest.raises(ValueError, match="needs a draft"):
        no_draft.generate(prompts, 4, num_speculative_tokens=2, eos_id=2)
    with pytest.raises(ValueError, match="load_weights"):
        no_draft.load_weights(policy, draft)
    other = build_policy("llama3", "tiny", MAX_LEN, seed=0)
    with pytest.raises(ValueError, match="load_weights"):
        engine.load_weights(other)
    with pytest.raises(ValueError, match="tap_layers"):
        RolloutEngine(model_args("llama3", "tiny_gqa", MAX_LEN), draft.args, [1, 2], 2, MAX_LEN, DEVICE)


def _load_sharded_worker(rank, world_size):
    """On each rank: the same models, FSDP2-sharded; the engine loads them (gathering the DTensor
    shards) and must then hold exactly the unsharded weights and generate the same tokens."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    policy, draft, reference = make()
    prompts = torch.randint(4, VOCAB, (2, 5), generator=torch.Generator().manual_seed(7))
    want = reference.generate(prompts, 10, num_speculative_tokens=3, temperature=0, eos_id=NEVER).tokens
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in policy.layers.values():
        fully_shard(layer, mesh=mesh)
    fully_shard(policy, mesh=mesh)
    fully_shard(draft, mesh=mesh)
    engine = RolloutEngine(model_args("llama3", "tiny_gqa", MAX_LEN), draft.args, TAPS, 2, MAX_LEN, DEVICE,
                           torch.float64)
    engine.load_weights(policy, draft)
    same = all(torch.equal(a, b) for a, b in zip(engine.policy.state_dict().values(),
                                                 reference.policy.state_dict().values()))
    same &= all(torch.equal(a, b) for a, b in zip(engine.draft.state_dict().values(),
                                                  reference.draft.state_dict().values()))
    got = engine.generate(prompts, 10, num_speculative_tokens=3, temperature=0, eos_id=NEVER).tokens
    return same, torch.equal(got, want)


@pytest.mark.skipif(DEVICE.type != "cpu", reason="gloo ranks on CPU")
def test_load_weights_from_fsdp_sharded_modules():
    from distributed import run_distributed

    assert run_distributed(_load_sharded_worker, 2, timeout=150) == [(True, True), (True, True)]
