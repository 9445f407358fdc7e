"""The rollout engine against obviously-correct references: torchtitan's own packed forward (no
cache), the training-time draft (ttt_forward + branch_attention), plain greedy decoding, and the
policy's exact distribution of the first response tokens; and its goodput controller."""
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from titan_draft.data.packing import pack
from titan_draft.infra import _compat
from titan_draft.models.draft import EagleDraft, draft_args_for
from titan_draft.models.policy import TapRecorder, build_policy, forward_packed, model_args
from titan_draft.rollout import EngineOptions, GoodputController, RolloutEngine, probs_from_logits
from titan_draft.rollout.cached_model import _attend_folded, block_forward, compile_for_decoding
from titan_draft.rollout.graphs import StepShape
from titan_draft.rollout.measure import measure_steps
from titan_draft.rollout.weights import weights_need_collective

DEVICE = _compat.device()  # the engine runs where the policy does: the CUDA path on a GPU machine

TAPS = [0, 1, 3]
MAX_LEN = 40
VOCAB = 32
NEVER = VOCAB  # an eos id no model can emit


def make(name="llama3", max_batch_size=4, draft_vocab=24, seed=0, **engine_kwargs):
    """float64 policy (GQA 4/2), a random draft over part of the vocabulary, and an engine
    (float64 unless engine_kwargs say otherwise)."""
    args = model_args(name, "tiny_gqa", MAX_LEN)
    policy = build_policy(name, "tiny_gqa", MAX_LEN, seed=seed).double()
    dargs = draft_args_for(args, len(TAPS), draft_vocab_size=draft_vocab, n_heads=4, n_kv_heads=2)
    draft = EagleDraft(dargs)
    draft.init_weights()
    draft.set_vocab(torch.randperm(VOCAB, generator=torch.Generator().manual_seed(seed))[:draft_vocab].sort().values)
    draft.double().to(DEVICE)
    return policy, draft, engine_for(policy, draft, max_batch_size, name=name, **engine_kwargs)


def engine_for(policy, draft, max_batch_size, *, name="llama3", dtype=torch.float64, max_seq_len=MAX_LEN, **options):
    options.setdefault("min_bucket", 1)  # compaction down to one row: the small batches here compact
    engine = RolloutEngine(model_args(name, "tiny_gqa", MAX_LEN), draft.args, TAPS, max_batch_size, max_seq_len,
                           DEVICE, dtype, options=EngineOptions(**options))
    engine.load_weights(policy, draft)
    return engine


class ScheduledK:
    """A stand-in for the goodput controller that plays a fixed sequence of K (cycled, capped)."""

    def __init__(self, schedule):
        self.schedule, self.step = schedule, 0
        self.call_ratio = {}  # no call is judged

    def new_call(self):
        self.step = 0

    def would_draft(self, buckets, max_k, overhead_s=0.0):
        return True  # every call keeps the draft current; the schedule alone picks each step's K

    def observe_call(self, plain_steps, *, drafted=None, seconds=0.0):
        pass

    def choose(self, bucket, max_k):
        self.step += 1
        return min(self.schedule[(self.step - 1) % len(self.schedule)], max_k)

    def observe_cost(self, bucket, K, seconds):
        pass

    def observe_acceptance(self, accepted, drafted):
        pass


def variable_prompts(lengths, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(4, VOCAB, (n,), generator=gen) for n in lengths]


def assert_layout(out, prompts, eos_id, max_new_tokens):
    """Row b: its prompt in columns 0..p_b-1, its response right after (ending at the first eos or
    at the budget), eos_id in every later column."""
    lengths = [len(p) for p in prompts]
    assert out.tokens.shape == (len(prompts), max(lengths) + max_new_tokens)
    assert out.prompt_lengths.tolist() == lengths
    for b, prompt in enumerate(prompts):
        n = int(out.response_lengths[b])
        response = out.tokens[b, lengths[b]:lengths[b] + n]
        assert torch.equal(out.tokens[b, :lengths[b]], prompt.cpu())
        assert 1 <= n <= max_new_tokens and (response[:-1] != eos_id).all()
        assert n == max_new_tokens or int(response[-1]) == eos_id
        assert (out.tokens[b, lengths[b] + n:] == eos_id).all()


def compacted(engine) -> bool:
    """Whether some decode step of the engine ran on fewer slots than its call had rows."""
    return any(isinstance(key, StepShape) and key.rows < key.full for key in engine.graphs.uses)


@torch.no_grad()
def reference_logits(policy, seqs):
    """torchtitan forward_packed over the sequences as packed documents, with its taps."""
    batch = pack([s.cpu() for s in seqs], [torch.ones(len(s), dtype=torch.bool) for s in seqs]).to(DEVICE)
    with TapRecorder(policy, TAPS) as rec:
        logits = forward_packed(policy, batch)
    return logits, rec.taps(), rec.embeddings(), batch


@pytest.mark.parametrize("name,compiled", [("llama3", False), ("qwen3", False), ("qwen3", True)])
def test_cached_policy_equals_torchtitan_forward_with_rollback(name, compiled):
    """Prefill, then windows of 3 positions per row of which a random 1..3 are kept (the rest is
    rolled back): every kept logit and tap equals torchtitan's packed forward of the sequence.
    compiled: the blocks through torch.compile as a compiled engine runs them (in one graph each:
    the first block's, without an incoming MLP output, and the others')."""
    policy, _, engine = make(name)
    if compiled:
        torch._dynamo.reset()
        engine.model.block = compile_for_decoding(block_forward, fullgraph=True)
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
        states = draft.ttt_forward(ref_emb, ref_taps, batch.positions, D, batch.shift(D), batch.draft_attention)
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


def test_draft_state_after_prefill_and_stage_flush_equals_training_time_test():
    """From prompts of different lengths: after prefill, the draft's pass-1 hidden state is
    ttt_forward's at each row's last prompt anchor p_b - 1; after K = 0 steps that staged their
    taps, the flush brings it to the last anchor whose next token is known."""
    policy, draft, engine = make(compact=False, max_speculative_tokens=3)
    engine.controller = ScheduledK([0])
    prompts = variable_prompts([5, 2, 7], seed=12)
    for new_tokens in (1, 4):
        out = engine.generate(prompts, new_tokens, num_speculative_tokens=3, adaptive=True, eos_id=NEVER,
                              generator=torch.Generator().manual_seed(new_tokens))
        assert out.steps_per_k.tolist() == [new_tokens - 1, 0, 0, 0]
        if new_tokens > 1:
            engine.flush_staged(len(prompts), engine.row_state.slots)
        seqs = [out.tokens[b, : len(p) + new_tokens] for b, p in enumerate(prompts)]
        _, ref_taps, ref_emb, batch = reference_logits(policy, seqs)
        with torch.no_grad():
            (states,) = draft.ttt_forward(ref_emb, ref_taps, batch.positions, 1, batch.shift(1), batch.draft_attention)
        last_anchor = batch.cu_seqlens[1:].long() - 2  # the last token of each row has no next token
        torch.testing.assert_close(engine.row_state.hidden[: len(prompts)], states[last_anchor], rtol=0, atol=1e-10)


def reference_greedy(policy, prompt, max_new_tokens, eos_id):
    """Plain greedy decoding: a full uncached torchtitan forward per token."""
    seq = prompt.clone()
    for _ in range(max_new_tokens):
        logits, _, _, _ = reference_logits(policy, [seq])
        seq = torch.cat([seq, logits[-1].argmax()[None].cpu()])
        if int(seq[-1]) == eos_id:
            break
    return seq


GREEDY_MODES = [dict(num_speculative_tokens=0), dict(num_speculative_tokens=2), dict(num_speculative_tokens=5),
                dict(num_speculative_tokens=3, adaptive=True),
                dict(num_speculative_tokens=3, schedule=[2, 0, 0, 0, 0, 0, 3, 1, 0])]


@pytest.mark.parametrize("mode", GREEDY_MODES, ids=["plain", "K2", "K5", "adaptive", "K_schedule"])
def test_greedy_speculative_equals_plain_greedy(mode):
    """Token for token, batched and row by row, from prompts of different lengths, with a random
    draft (most drafts rejected) and an eos that ends some rows in the middle of the batch (the
    batch is compacted as they finish); K fixed, chosen by the goodput controller, or changing
    between steps on a schedule (with the stage of K = 0 steps filled and flushed)."""
    mode = dict(mode)
    schedule = mode.pop("schedule", None)
    adaptive = mode.pop("adaptive", False) or schedule is not None
    policy, _, engine = make(max_speculative_tokens=3 if schedule else 8)
    if schedule:
        engine.controller = ScheduledK(schedule)
    N = 16
    # An eos that ends two rows early and never comes in the others: rows end at different steps
    # and the batch shrinks to two slots. The first prompts (by seed) whose greedy answers have one
    # (a random policy's greedy answers repeat a few tokens, which differ between devices).
    for seed in range(5, 100):
        prompts = variable_prompts([6, 3, 8, 5], seed=seed)
        free = engine.generate(prompts, N, num_speculative_tokens=0, temperature=0, eos_id=NEVER)
        responses = [free.tokens[b, len(p):] for b, p in enumerate(prompts)]
        eos_id = next((t for t in range(VOCAB) if sum(t in r for r in responses) == 2), None)
        if eos_id is not None:
            break
    refs = [reference_greedy(policy, p, N, eos_id) for p in prompts]
    assert sum(len(r) < len(p) + N for r, p in zip(refs, prompts)) == 2
    out = engine.generate(prompts, N, temperature=0, eos_id=eos_id, adaptive=adaptive, **mode)
    assert_layout(out, prompts, eos_id, N)
    for b, (prompt, ref) in enumerate(zip(prompts, refs)):
        assert torch.equal(out.tokens[b, : len(ref)], ref), b
        assert int(out.response_lengths[b]) == len(ref) - len(prompt)
    assert compacted(engine)
    K = mode["num_speculative_tokens"]
    if K:
        assert 1.0 <= out.acceptance_length <= K + 1
        assert out.per_position_acceptance.shape == out.drafted_per_position.shape == (K,)
        assert out.num_draft_tokens == int(out.drafted_per_position.sum()) > 0
        assert out.num_accepted_tokens == int(out.accepted_per_position.sum())
    if schedule:  # every K ran, and five K = 0 steps in a row overfilled the stage (max_k + 1 = 4 columns)
        assert (out.steps_per_k > 0).all()
    single = engine.generate(prompts[2:3], N, temperature=0, eos_id=eos_id, adaptive=adaptive, **mode)
    assert torch.equal(single.tokens[0], out.tokens[2, :single.tokens.shape[1]])


def test_perfect_draft_accepts_everything():
    """A draft that proposes exactly the policy's greedy tokens is accepted K times per step."""
    policy, _, engine = make(draft_vocab=VOCAB)  # draft ids = target ids: every greedy token is proposable
    gen = torch.Generator().manual_seed(4)
    prompts = torch.randint(4, VOCAB, (2, 5), generator=gen)
    K, N = 3, 17
    plain = engine.generate(prompts, N, num_speculative_tokens=0, temperature=0, eos_id=NEVER)
    target = plain.tokens.to(DEVICE)  # before any capture: a CUDA graph cannot copy from the host

    def oracle(hidden, anchor, K, temperature, top_p, noise, width):
        # t_k must be the token at position anchor + 1 + k of the greedy sequence.
        pos = (anchor[:, None] + 2 + torch.arange(K, device=DEVICE)).clamp(max=target.shape[1] - 1)
        tokens = target[torch.arange(len(anchor), device=DEVICE)[:, None], pos]
        return tokens, F.one_hot(tokens, VOCAB).double()  # draft ids and logits

    engine._propose = oracle
    out = engine.generate(prompts, N, num_speculative_tokens=K, temperature=0, eos_id=NEVER)
    assert torch.equal(out.tokens, plain.tokens)
    assert out.num_decode_steps == (N - 1 + K) // (K + 1)
    assert torch.equal(out.per_position_acceptance[:2], torch.ones(2))


class FloatShapes(TorchDispatchMode):
    """Records the shape of every float32 tensor an op returns."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.shapes += [tuple(t.shape) for t in tree_leaves(out)
                        if isinstance(t, torch.Tensor) and t.dtype == torch.float32]
        return out


def test_decode_steps_make_no_float32_tensor_over_several_positions_of_the_vocabulary():
    """A bfloat16 engine's decode steps at top-p 1: every float32 tensor over the target vocabulary
    holds at most one position per row ([B, V]: the race of a plain step, the stop position's
    distributions); the reference made [B, K+1, V] target and [B, K, V] draft probabilities. Eager
    steps: a graph replay would run no op through the recorder."""
    _, _, engine = make(dtype=torch.bfloat16, compact=False, cuda_graphs=False)
    prompts = variable_prompts([5, 3, 6], seed=3)
    with FloatShapes() as recorded:
        out = engine.generate(prompts, 6, num_speculative_tokens=3, temperature=1.0, eos_id=NEVER,
                              generator=torch.Generator().manual_seed(0))
    assert out.num_decode_steps > 0 and out.num_draft_tokens > 0
    over_vocab = [shape for shape in recorded.shapes if shape[-1:] == (VOCAB,)]
    assert over_vocab and all(torch.Size(shape[:-1]).numel() <= len(prompts) for shape in over_vocab), over_vocab


@pytest.mark.parametrize("schedule", [None, [3, 0, 0, 0, 0, 0, 2, 0, 1]], ids=["K3", "K_schedule"])
def test_caches_after_rollback_equal_fresh_prefill(schedule):
    """After sampled speculative generation (many rejections) from prompts of different lengths,
    the policy cache of every row equals a fresh prefill of its accepted tokens, and so do the
    draft's trunk keys (no compaction, so that every row keeps its slot); also when K changes
    between steps and K = 0 steps leave their anchors to a later stage flush."""
    policy, draft, engine = make(compact=False, max_speculative_tokens=3)
    if schedule:
        engine.controller = ScheduledK(schedule)
    B, N, K = 3, 24, 3
    prompts = variable_prompts([5, 2, 7], seed=5)
    out = engine.generate(prompts, N, num_speculative_tokens=K, temperature=1.0, eos_id=NEVER,
                          generator=torch.Generator(DEVICE).manual_seed(5), adaptive=schedule is not None)
    assert out.acceptance_length < K + 1  # there were rejections
    widths = {key.width for key in engine.graphs.uses if isinstance(key, StepShape)}
    if engine.steps_read_live_slots:  # the decode kernel reads each row's live slots at any width
        assert widths == {engine.row_state.slots}
    else:  # early steps attended only the first slots of the caches
        assert min(widths) < engine.row_state.slots
    fresh = engine_for(policy, draft, B)
    seqs = out.tokens.to(DEVICE).clamp(max=VOCAB - 1)  # the eos fill past the ends is never attended
    width = seqs.shape[1]
    _, taps, _ = fresh.policy_forward(seqs[:, :-1], torch.arange(width - 1, device=DEVICE).expand(B, -1))
    fresh.draft_extend(fresh.policy.tok_embeddings(seqs[:, 1:]), taps, torch.zeros(B, dtype=torch.long, device=DEVICE),
                       torch.full((B,), width - 1, device=DEVICE))
    for b, prompt in enumerate(prompts):
        length = len(prompt) + N  # no eos: every row ran to its budget
        for layer in range(len(engine.k_cache)):
            for cache, ref in ((engine.k_cache, fresh.k_cache), (engine.v_cache, fresh.v_cache)):
                torch.testing.assert_close(cache[layer][b, : length - 1], ref[layer][b, : length - 1],
                                           rtol=0, atol=1e-10)
        # The last verify step of a row starts at most K + 1 tokens before its end; the trunk holds
        # every anchor before that step's first position, but for up to max_k + 1 staged K = 0 steps.
        known = length - 1 - (K + 1) - (K + 1 if schedule else 0)
        torch.testing.assert_close(engine.draft_k[b, :known], fresh.draft_k[b, :known], rtol=0, atol=1e-10)
        torch.testing.assert_close(engine.draft_v[b, :known], fresh.draft_v[b, :known], rtol=0, atol=1e-10)


def next_token_probs(policy, seqs, temperature, top_p):
    """The policy's sampling distribution after each sequence, [len(seqs), V] float64."""
    logits, _, _, batch = reference_logits(policy, seqs)
    last = batch.cu_seqlens[1:].long() - 1
    return probs_from_logits(logits.reshape(-1, VOCAB)[last], temperature, top_p).double().cpu()


def response_distributions(policy, prompt, depth, temperature, top_p, eos_id):
    """Exact distribution [depth, V] of response tokens 0..depth-1 after prompt (eos_id in the
    columns after a row has ended), by enumerating every prefix the policy can sample."""
    dist = torch.zeros(depth, VOCAB, dtype=torch.float64)
    live, ended = [(prompt, 1.0)], 0.0  # prefixes still running with their probabilities
    for j in range(depth):
        dist[j, eos_id] += ended
        grown = []
        for (seq, weight), probs in zip(live, next_token_probs(policy, [s for s, _ in live], temperature, top_p)):
            dist[j] += weight * probs
            for t in probs.nonzero()[:, 0].tolist():
                if t == eos_id:
                    ended += weight * float(probs[t])
                else:
                    grown.append((torch.cat([seq, torch.tensor([t])]), weight * float(probs[t])))
        live = grown
    return dist


def assert_follows(samples, probs):
    """Chi-square goodness of fit of token samples [n] to probs [V] at the 0.999 level."""
    counts = torch.bincount(samples, minlength=VOCAB).double()
    expected = probs * len(samples)
    assert counts[expected == 0].sum() == 0
    big = expected >= 5  # pool the rare tokens into one bin
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    stat = float(((obs - exp) ** 2 / exp.clamp(min=1e-12)).sum())
    # 0.999 quantiles of chi-square for df = 1..31 are below 3.3 * df + 11.
    df = len(obs) - 1
    assert stat < 3.3 * df + 11, (stat, df)


LOSSLESS_MODES = [dict(num_speculative_tokens=2), dict(num_speculative_tokens=3, adaptive=True),
                  dict(num_speculative_tokens=3, schedule=[2, 0, 3, 1])]


@pytest.mark.parametrize("mode", LOSSLESS_MODES, ids=["K2", "adaptive", "K_schedule"])
def test_sampled_speculative_generation_is_lossless(mode):
    """End to end at temperature 0.8 / top-p 0.9, from two prompts of different lengths in one
    batch, with an eos that ends many rows early (the batch shrinks as they do): the first three
    response tokens of each prompt's rows follow the policy's exact distributions; with K fixed,
    chosen by the goodput controller, or changing between steps (a K = 0 step, then drafts)."""
    mode = dict(mode)
    schedule = mode.pop("schedule", None)
    adaptive = mode.pop("adaptive", False) or schedule is not None
    policy, _, engine = make(max_batch_size=2000, max_speculative_tokens=3)
    n, depth, eos_id = 1000, 3, 12
    if schedule:
        engine.controller = ScheduledK(schedule)
    elif adaptive:  # every K costs the same: the controller drafts (a random draft on the CPU would not pay)
        engine.controller.cost = {(b, K): 1.0 for b in (*(2 ** i for i in range(11)), 2 * n) for K in range(4)}
        engine._measured.add((2 * n, 3, 0.8, 0.9))
    prompts = [torch.tensor([1, 7, 9, 12, 4]), torch.tensor([3, 30, 2, 17, 5, 5, 11, 8])]
    out = engine.generate([prompts[b % 2] for b in range(2 * n)], 4, temperature=0.8, top_p=0.9, eos_id=eos_id,
                          generator=torch.Generator(DEVICE).manual_seed(6), adaptive=adaptive, **mode)
    for i, prompt in enumerate(prompts):
        dist = response_distributions(policy, prompt, depth, 0.8, 0.9, eos_id)
        assert dist[depth - 1, eos_id] > 0.05  # many rows ended early
        for j in range(depth):
            assert_follows(out.tokens[i::2, len(prompt) + j], dist[j])
    assert compacted(engine) and out.acceptance_length > 1.0  # the draft was used
    if schedule:  # a K = 0 step (taps staged) after compaction, then a drafting step (stage flushed first)
        assert out.steps_per_k[0] > 0 and out.steps_per_k[3] > 0


# Tokens today's default path sampled before variable-length prompts, compaction and adaptive K
# existed (generated with the engine of commit c038c3a): equal-length prompts must keep every draw.
PINNED_PROMPTS_SEED, PINNED_EOS = 21, 9
PINNED = {
    0: dict(tokens=[[9, 11, 8, 20, 12, 24, 8, 14, 9, 9, 9, 9, 9, 9, 9],
                    [24, 28, 31, 4, 26, 13, 10, 13, 17, 0, 22, 17, 11, 26, 20],
                    [19, 13, 26, 4, 22, 18, 26, 1, 31, 26, 7, 29, 26, 7, 31],
                    [27, 24, 29, 17, 17, 1, 12, 25, 27, 19, 2, 2, 21, 29, 28]],
            counts=(30, 30, 9)),
    3: dict(tokens=[[9, 11, 8, 20, 12, 24, 31, 28, 9, 9, 9, 9, 9, 9, 9],
                    [24, 28, 31, 4, 26, 13, 16, 15, 24, 25, 17, 11, 5, 14, 6],
                    [19, 13, 26, 4, 22, 18, 15, 21, 1, 12, 9, 9, 9, 9, 9],
                    [27, 24, 29, 17, 17, 1, 25, 23, 18, 6, 5, 2, 6, 20, 7]],
            counts=(20, 26, 7)),
}


@pytest.mark.skipif(DEVICE.type != "cpu", reason="pinned CPU random stream")
@pytest.mark.parametrize("K", [0, 3])
def test_equal_length_prompts_sample_what_they_sampled_before(K):
    """[B, P] prompts at temperature 1 / top-p 0.9: the same tokens and counters as before this
    engine learnt variable lengths, compaction and adaptive K (the batch shrinks to 2 slots here)."""
    _, _, engine = make()
    prompts = torch.randint(4, VOCAB, (4, 5), generator=torch.Generator().manual_seed(PINNED_PROMPTS_SEED))
    out = engine.generate(prompts, 10, num_speculative_tokens=K, temperature=1.0, top_p=0.9, eos_id=PINNED_EOS,
                          generator=torch.Generator().manual_seed(22))
    assert out.tokens.tolist() == PINNED[K]["tokens"]
    assert (out.num_verify_forwards, out.emitted_tokens, out.num_decode_steps) == PINNED[K]["counts"]
    assert compacted(engine) == (K == 3)


@pytest.mark.parametrize("K, schedule", [(3, None), (3, [0, 3, 0, 0, 2, 1])], ids=["K3", "K_schedule"])
def test_compaction_changes_no_sample(K, schedule):
    """float32 (the CPU training precision), sampled, prompts of different lengths, rows ending at
    their own eos: the engine that compacts the batch as rows finish samples exactly the tokens of
    the one that keeps every row in its slot (random numbers are drawn per original row)."""
    policy, draft, _ = make()
    prompts = variable_prompts([3 + b % 5 for b in range(16)], seed=9)
    outs = []
    for compact in (True, False):
        engine = engine_for(policy, draft, 16, dtype=torch.float32, compact=compact)
        if schedule:
            engine.controller = ScheduledK(schedule)
        outs.append(engine.generate(prompts, 14, num_speculative_tokens=K, adaptive=schedule is not None,
                                    temperature=1.0, eos_id=6, generator=torch.Generator().manual_seed(10)))
        assert compacted(engine) == compact
    assert torch.equal(outs[0].tokens, outs[1].tokens)
    assert torch.equal(outs[0].response_lengths, outs[1].response_lengths)
    assert torch.equal(outs[0].accepted_per_position, outs[1].accepted_per_position)
    assert len(set(outs[0].response_lengths.tolist())) > 3  # rows ended at many different steps


def test_controller_picks_plain_decoding_when_drafting_does_not_pay():
    """Each draft token costs half a plain step and is accepted 30% of the time: goodput
    (1 + 0.3 K) / (1 + 0.5 K) falls with K, so K = 0."""
    controller = GoodputController(4)
    controller.observe_acceptance([299] * 4, [999] * 4)  # with the prior's 1 of 1: 300 / 1000 each
    for K in range(5):
        controller.observe_cost(64, K, 1.0 + 0.5 * K)
    assert controller.acceptance_rates() == pytest.approx([0.3] * 4)
    assert controller.choose(64, 4) == 0


def test_controller_picks_the_goodput_optimal_k():
    """Rates 0.8, 0.6, 0.3, 0.1 per position: 1, 1.8, 2.4, 2.7, 2.8 expected tokens for K = 0..4;
    at costs 1, 1.2, 1.5, 2, 2.6 that is 1, 1.5, 1.6, 1.35, 1.08 tokens per second: K = 2 (not the
    most accepted tokens, K = 4, nor the cheapest step, K = 0). A cap on K is respected."""
    controller = GoodputController(4)
    controller.observe_acceptance([499, 299, 149, 49], [624, 499, 499, 499])
    # and 175 more row-steps that drafted position 0 only, accepted 0.8 of the time overall
    controller.observe_acceptance([300, 0, 0, 0], [375, 0, 0, 0])
    for K, cost in enumerate([1.0, 1.2, 1.5, 2.0, 2.6]):
        controller.observe_cost(8, K, cost)
    assert controller.acceptance_rates() == pytest.approx([0.8, 0.6, 0.3, 0.1])
    assert [controller.expected_tokens(K) for K in range(5)] == pytest.approx([1, 1.8, 2.4, 2.7, 2.8])
    assert controller.choose(8, 4) == 2
    assert controller.choose(8, 1) == 1


def test_controller_explores_then_refreshes():
    """Every K gets a measured cost in a bucket (largest first) before any is judged; costs are a
    running mean; unused positions drift back to the optimistic prior as calls decay the counts;
    rates never rise with the position."""
    controller = GoodputController(3)
    tried = []
    for _ in range(4):
        tried.append(controller.choose(2, 3))
        controller.observe_cost(2, tried[-1], 1.0)
    assert tried == [3, 2, 1, 0]
    assert controller.choose(4, 3) == 3  # another bucket is measured on its own
    controller.observe_cost(2, 0, 2.0)
    assert controller.cost[2, 0] == pytest.approx(1.25)
    controller.observe_acceptance([0, 50, 0], [100, 100, 0])
    assert controller.acceptance_rates() == pytest.approx([1 / 101, 1 / 101, 1 / 101])
    for _ in range(40):
        controller.new_call()
    assert controller.acceptance_rates() == pytest.approx([1.0] * 3, rel=1e-6)


def test_controller_keeps_its_k_against_small_differences():
    """A bucket switches K only for more than switch_gain (5%) more expected tokens per second."""
    controller = GoodputController(2)
    controller.observe_acceptance([999, 999], [999, 999])  # every draft accepted: 1, 2, 3 tokens
    for K, cost in enumerate([1.0, 2.0, 3.0]):
        controller.observe_cost(8, K, cost)
    assert controller.choose(8, 2) == 0  # 1 token/s for every K: the first best
    controller.cost[8, 2] = 3.0 / 1.04  # 4% better
    assert controller.choose(8, 2) == 0
    controller.cost[8, 2] = 3.0 / 1.06  # 6% better
    assert controller.choose(8, 2) == 2
    assert controller.choose(16, 2) == 2  # an unmeasured bucket explores, largest K first


def test_controller_drafts_a_call_only_when_its_saving_beats_the_draft_prefill():
    """Position 0 accepted 80%: K = 1 emits 1.8 tokens per 1.2 s step, 0.667 s per plain step it replaces,
    so a call of 30 plain steps in the bucket saves 30 x (1 - 0.667) = 10 s: it drafts when the draft's
    prefill costs less. Before any call is observed the best K alone decides."""
    controller = GoodputController(1)
    controller.observe_acceptance([799], [999])
    controller.observe_cost(8, 0, 1.0)
    controller.observe_cost(8, 1, 1.2)
    assert controller.call_saving([8], 1) == 0.0  # no call observed: no steps to save on
    assert controller.would_draft([8], 1, overhead_s=1e9)
    controller.observe_call({8: 30.0})
    assert controller.call_saving([8], 1) == pytest.approx(10.0)
    assert controller.would_draft([8], 1, overhead_s=9.0)
    assert not controller.would_draft([8], 1, overhead_s=11.0)
    assert controller.call_saving([8, 16], 1) is None and controller.would_draft([8, 16], 1, 11.0)  # 16 unmeasured
    controller.observe_call({16: 4.0})  # running means: the 8-row bucket's steps fall by cost_weight
    assert controller.plain_steps == pytest.approx({8: 22.5, 16: 4.0})


def test_controller_judges_calls_by_their_own_times():
    """A call's ratio is its seconds over its work at the plain step cost: 30 plain steps of 1 s in a
    call that took 36 s (drafting) gives 1.2, one of 27 s (plain) 0.9. After the first drafting
    call comes a plain one, whatever the model says; then the lower ratio decides (here plain,
    although the model expects drafting to save 10 s), and the other kind runs again after
    explore_every calls without it."""
    controller = GoodputController(1, explore_every=3)
    controller.observe_acceptance([799], [999])
    controller.observe_cost(8, 0, 1.0)
    controller.observe_cost(8, 1, 1.2)
    controller.observe_call({8: 30.0})
    assert controller.would_draft([8], 1)  # the model: a 10 s saving
    controller.observe_call({8: 30.0}, drafted=True, seconds=36.0)
    assert controller.call_ratio == {True: pytest.approx(1.2)}
    assert not controller.would_draft([8], 1)  # a plain call, to compare
    controller.observe_call({8: 30.0}, seconds=50.0)  # not timed (a step ran eagerly): plain again
    assert controller.call_ratio == {True: pytest.approx(1.2)}
    assert not controller.would_draft([8], 1)
    controller.observe_call({8: 30.0}, drafted=False, seconds=27.0)
    assert controller.call_ratio == {True: pytest.approx(1.2), False: pytest.approx(0.9)}
    assert [controller.would_draft([8], 1) for _ in range(6)] == [False, True, False, False, False, True]
    controller.observe_call({8: 30.0}, drafted=True, seconds=12.0)  # ratio 0.4: 1.2 + 0.25 x (0.4 - 1.2) = 1.0
    assert controller.call_ratio[True] == pytest.approx(1.0)
    controller.observe_call({8: 30.0}, drafted=True, seconds=12.0)  # 0.85 < 0.9: drafting wins
    assert [controller.would_draft([8], 1) for _ in range(5)] == [True, True, False, True, True]
    # While no plain call is timed, plain calls run, and every explore_every-th call drafts again.
    controller = GoodputController(1, explore_every=3)
    controller.observe_cost(8, 0, 1.0)
    controller.observe_call({8: 30.0}, drafted=True, seconds=36.0)
    assert [controller.would_draft([8], 1) for _ in range(8)] == [False, False, False, True] * 2


def test_only_calls_of_replayed_steps_are_timed():
    """An adaptive call that runs as plain decoding gets a call ratio when every decode step replayed
    a graph (on CPU: no graph, every run counts), and none when one did not (here a run counted as
    unreplayed, as an eager run or a capture on CUDA is)."""
    _, _, engine = make()
    prompts = variable_prompts([4, 6, 5], seed=11)
    for eager_step in (False, True):
        engine.controller = GoodputController(engine.max_k)
        engine.controller.would_draft = lambda buckets, max_k, overhead_s=0.0: False
        if eager_step:
            run = engine.graphs.run

            def counted_run(key, fn):
                engine.graphs.unreplayed += isinstance(key, StepShape)
                return run(key, fn)
            engine.graphs.run = counted_run
        out = engine.generate(prompts, 12, num_speculative_tokens=3, adaptive=True, temperature=0, eos_id=NEVER)
        assert out.num_drafts == 0 and engine.controller.plain_steps
        assert (False in engine.controller.call_ratio) == (not eager_step)
        assert out.call_ratios == ({} if eager_step else {"plain": engine.controller.call_ratio[False]})
    assert engine.generate(prompts, 12, num_speculative_tokens=3, temperature=0, eos_id=NEVER).call_ratios == {}


def test_adaptive_generation_follows_the_cost_table():
    """Through the engine: when drafting is priced out every step runs K = 0 (no draft work, the
    plain tokens) and the call runs as plain decoding (its prefill skips the draft); when drafting
    is free every step drafts the maximum."""
    _, _, engine = make()
    prompts = variable_prompts([4, 6, 5], seed=11)
    plain = engine.generate(prompts, 12, num_speculative_tokens=0, temperature=0, eos_id=NEVER)
    for priced_out in (True, False):
        engine.controller = GoodputController(engine.max_k)
        # Seconds far above the real step times, which the controller blends in: the table decides.
        engine.controller.cost = {(b, K): 1e6 * (1 + 10 * K * priced_out) for b in (1, 2, 3) for K in range(4)}
        out = engine.generate(prompts, 12, num_speculative_tokens=3, adaptive=True, temperature=0, eos_id=NEVER)
        assert torch.equal(out.tokens, plain.tokens)
        steps = out.steps_per_k.tolist()
        assert steps == ([out.num_decode_steps, 0, 0, 0] if priced_out else [0, 0, 0, out.num_decode_steps])
        assert (out.num_drafts == 0) == priced_out
        prefills = [key for key in engine.graphs.uses if isinstance(key, tuple) and key[:3] == ("prefill", 3, 6)]
        assert [key[3] for key in prefills] == [False, True][:2 - priced_out]  # (rows, P, with the draft?)
        # The call's plain steps (its one 3-row bucket): one per step without drafts, up to K + 1 with.
        (plain_steps,) = engine.controller.plain_steps.values()
        if priced_out:
            assert engine.controller.plain_steps == {3: out.num_decode_steps}
        assert out.num_decode_steps <= plain_steps <= 4 * out.num_decode_steps
    # Drafting pays in the steps, but the draft's prefill over the prompts costs more than it saves.
    engine.draft_prefill_s_per_token = 1e9
    out = engine.generate(prompts, 12, num_speculative_tokens=3, adaptive=True, temperature=0, eos_id=NEVER)
    assert out.num_drafts == 0 and torch.equal(out.tokens, plain.tokens)


def test_adaptive_first_call_measures_every_step_shape_without_changing_the_samples():
    """The first adaptive call at a batch size times every (active-row bucket, K) step before its
    prefill, and the controller starts from those costs; the measurement leaves the call's samples
    as they are (it runs before the call seeds its generator, and prefill resets the state)."""
    policy, draft, engine = make()
    prompts = variable_prompts([5, 3, 7], seed=9)
    first = engine.generate(prompts, 12, num_speculative_tokens=3, adaptive=True, eos_id=5,
                            generator=torch.Generator().manual_seed(1))
    assert set(engine.controller.cost) == {(b, k) for b in (1, 2, 3) for k in range(4)}
    assert engine.draft_prefill_s_per_token > 0  # and what the draft's prefill costs per prompt token
    assert first.timing["measure_s"] > 0
    again = engine.generate(prompts, 12, num_speculative_tokens=3, adaptive=True, eos_id=5)
    assert again.timing["measure_s"] == 0  # once per batch size

    outs = []
    for measured in (True, False):
        engine = engine_for(policy, draft, 4)
        engine.controller = ScheduledK([2, 0, 3, 1])
        if not measured:
            engine._measured.add((3, 3, 1.0, 1.0))
        outs.append(engine.generate(prompts, 12, num_speculative_tokens=3, adaptive=True, eos_id=5,
                                    generator=torch.Generator().manual_seed(1)))
    assert outs[0].timing["measure_s"] > 0 and outs[1].timing["measure_s"] == 0
    assert torch.equal(outs[0].tokens, outs[1].tokens)
    assert outs[0].steps_per_k.tolist() == outs[1].steps_per_k.tolist()


def test_measurement_uses_every_step_shape_the_call_uses_where_steps_read_live_slots():
    """Where decode steps read each row's live slots (CUDA's decode kernel; forced here on CPU, where
    the reference attention then reads all slots), every step and flush key of an adaptive call
    (which CUDA captures as a graph) was already used by the call's measurement, so none is
    captured in the middle of the rollouts; and the samples equal those of the narrowest widths."""
    policy, draft, engine = make()
    prompts = variable_prompts([5, 3, 7], seed=9)
    want = engine.generate(prompts, 30, num_speculative_tokens=3, adaptive=True, temperature=0, eos_id=NEVER)
    engine = engine_for(policy, draft, 4)
    engine.steps_read_live_slots = True
    engine.reserve(3, 7 + 30 + engine.max_k + 1)
    measure_steps(engine, 3, 3, 0.0, 1.0, 7)
    engine._measured.add((3, 3, 0.0, 1.0))  # the call below measures no more
    measured = set(engine.graphs.uses)
    assert {key.width for key in measured if isinstance(key, StepShape)} == {engine.row_state.slots}
    got = engine.generate(prompts, 30, num_speculative_tokens=3, adaptive=True, temperature=0, eos_id=NEVER)
    used = {key for key in engine.graphs.uses if key not in measured or engine.graphs.uses[key] > 1}
    steps = {key for key in used if isinstance(key, StepShape) or key[0] == "flush"}
    assert steps and steps <= measured, steps - measured
    assert torch.equal(got.tokens, want.tokens)
    # So does a call that adaptive K runs as plain decoding (its steps stage no taps).
    engine.controller.would_draft = lambda buckets, max_k, overhead_s=0.0: False
    before = dict(engine.graphs.uses)
    engine.generate(prompts, 30, num_speculative_tokens=3, adaptive=True, temperature=0, eos_id=NEVER)
    plain = {key for key in engine.graphs.uses if isinstance(key, StepShape) and engine.graphs.uses[key] > before.get(key, 0)}
    assert plain and all(not key.stage and not key.k for key in plain) and plain <= measured, plain - measured


def test_draft_weights_are_copied_by_the_first_call_that_drafts():
    """load_weights leaves the draft's copy (after the first) for the next call that drafts: a call
    that runs as plain decoding keeps the old draft weights and reports no draft weight time; the
    next drafting call copies them (draft_weights_s > 0) and samples as an engine loaded at once."""
    policy, draft, engine = make()
    prompts = variable_prompts([4, 6, 5], seed=11)
    old = {k: v.clone() for k, v in engine.model.draft.state_dict().items()}
    trained = EagleDraft(draft.args)
    trained.init_weights()
    trained.set_vocab(draft.target_ids().cpu())
    trained.double().to(DEVICE)
    engine.load_weights(policy, trained)
    assert all(torch.equal(v, old[k]) for k, v in engine.model.draft.state_dict().items())  # not yet
    plain = engine.generate(prompts, 12, num_speculative_tokens=0, temperature=0, eos_id=NEVER)
    assert plain.timing["draft_weights_s"] == 0.0
    assert all(torch.equal(v, old[k]) for k, v in engine.model.draft.state_dict().items())
    out = engine.generate(prompts, 12, num_speculative_tokens=3, temperature=0, eos_id=NEVER)
    assert out.timing["draft_weights_s"] > 0 and engine.draft_refresh_s == out.timing["draft_weights_s"]
    assert all(torch.equal(v, trained.state_dict()[k]) for k, v in engine.model.draft.state_dict().items())
    reference = engine_for(policy, trained, 4)
    again = reference.generate(prompts, 12, num_speculative_tokens=3, temperature=0, eos_id=NEVER)
    assert torch.equal(out.tokens, again.tokens) and out.num_accepted_tokens == again.num_accepted_tokens
    # Reading `draft` brings a pending copy in; the weight time of a drafting call counts in would_draft.
    engine.load_weights(policy, draft)
    assert all(torch.equal(v, draft.state_dict()[k]) for k, v in engine.draft.state_dict().items())
    engine.load_weights(policy, trained)
    seen = []
    engine.controller.would_draft = lambda buckets, max_k, overhead_s=0.0: seen.append(overhead_s) or False
    engine.draft_refresh_s = 5.0
    engine.generate(prompts, 12, num_speculative_tokens=3, adaptive=True, temperature=0, eos_id=NEVER)
    assert seen == [pytest.approx(5.0 + engine.draft_prefill_s_per_token * 3 * 6)]  # 3 prompts, longest 6


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs")
@pytest.mark.parametrize("K, temperature", [(0, 1.0), (3, 0.0), (3, 1.0)])
def test_cuda_graph_steps_equal_eager_steps(K, temperature):
    """Decode steps replayed from CUDA graphs give the tokens and statistics of the same steps run
    eagerly (same seed: the graphs draw the same random numbers), over several calls, from prompts
    of different lengths with an eos that ends rows early (graphs of smaller buckets)."""
    policy, draft, graphed = make()
    eager = engine_for(policy, draft, 4, cuda_graphs=False)
    assert graphed.cuda_graphs and not eager.cuda_graphs
    for call in range(3):
        prompts = variable_prompts([5, 3, 7], seed=8 + call)
        a, b = (e.generate(prompts, 20, num_speculative_tokens=K, temperature=temperature, eos_id=5,
                           generator=torch.Generator().manual_seed(call)) for e in (graphed, eager))
        assert torch.equal(a.tokens, b.tokens), call
        assert (a.num_verify_forwards, a.emitted_tokens, a.num_decode_steps) == \
            (b.num_verify_forwards, b.emitted_tokens, b.num_decode_steps)
    replayed = [key for key, step in graphed.graphs.steps.items()
                if isinstance(key, StepShape) and (key.rows, key.k) == (3, K) and step.graph is not None]
    assert replayed


def test_unreplayed_calls_count_the_calls_without_a_graph_replay():
    """Every engine call of a generate runs eagerly before its shape's capture: counted. On CPU
    (no CUDA graphs) nothing is counted; on CUDA the same greedy call repeated reaches 0, once
    every shape it uses has been captured."""
    policy, draft, engine = make()
    counts = [engine.generate(variable_prompts([5, 3, 7], seed=8), 12, num_speculative_tokens=3,
                              temperature=0.0, eos_id=5).unreplayed_calls for _ in range(4)]
    if engine.cuda_graphs:
        assert counts[0] > 0 and counts[-1] == 0, counts
    else:
        assert counts == [0, 0, 0, 0]


def expected_buffer_bytes(engine, rows, slots):
    """The state buffers' bytes by their shapes: policy and draft k/v caches and the token buffer
    [rows, slots, ...], the draft's hidden state and staged taps, and four per-row vectors."""
    args, dargs, item = model_args("llama3", "tiny_gqa", MAX_LEN), engine.draft.args, engine.dtype.itemsize
    caches = rows * slots * (args.n_layers * 2 * args.n_kv_heads * (args.dim // args.n_heads)
                             + 2 * dargs.n_kv_heads * dargs.head_dim) * item
    tokens = rows * slots * 8
    draft_state = rows * dargs.dim * item + rows * (engine.max_k + 1) * dargs.n_taps * dargs.dim * item
    return caches + tokens + draft_state + rows * (8 + 8 + 8 + 1)  # lengths, limit, row_of_slot, done


def test_buffers_are_sized_by_the_calls_and_released_without_changing_a_sample():
    """generate allocates its rows x (longest prompt + budget + max_k + 1, rounded up to 128) slots;
    a call that fits (fewer rows, a shorter budget) reuses the buffers; a longer budget reallocates;
    release_caches gives them back. The samples of a seeded call are the same on fresh, released,
    reallocated and reused buffers."""
    policy, draft, _ = make()
    engine = engine_for(policy, draft, 4, max_seq_len=300, max_speculative_tokens=3)
    assert engine.cache_bytes == 0  # nothing before the first call
    prompts = variable_prompts([5, 3, 7], seed=13)

    def call(rows, new_tokens):
        return engine.generate(prompts[:rows], new_tokens, num_speculative_tokens=3, temperature=1.0, eos_id=6,
                               generator=torch.Generator().manual_seed(new_tokens))

    short = call(3, 20)  # 7 + 20 + 3 + 1 = 31 slots -> 128
    assert (engine.row_state.rows, engine.row_state.slots) == (3, 128)
    assert engine.cache_bytes == expected_buffer_bytes(engine, 3, 128)
    cache = engine.k_cache[0]
    single = call(1, 20)
    assert engine.k_cache[0] is cache and engine.row_state.rows == 3  # a smaller batch fits
    del cache

    allocated = torch.cuda.memory_allocated(DEVICE) if DEVICE.type == "cuda" else 0
    held = engine.cache_bytes
    engine.release_caches()
    assert (engine.cache_bytes, engine.row_state.rows, engine.row_state.slots, engine.k_cache) == (0, 0, 0, [])
    assert not engine.graphs.steps  # no captured step reads the released buffers
    if DEVICE.type == "cuda":  # the buffers went back to the allocator
        assert allocated - torch.cuda.memory_allocated(DEVICE) >= held
    assert torch.equal(call(3, 20).tokens, short.tokens)  # allocated again

    long = call(3, 150)  # 7 + 150 + 4 = 161 slots: new buffers
    assert (engine.row_state.rows, engine.row_state.slots) == (3, 256)
    assert engine.cache_bytes == expected_buffer_bytes(engine, 3, 256)
    fresh = engine_for(policy, draft, 4, max_seq_len=300, max_speculative_tokens=3)
    assert torch.equal(fresh.generate(prompts, 150, num_speculative_tokens=3, temperature=1.0, eos_id=6,
                                      generator=torch.Generator().manual_seed(150)).tokens, long.tokens)
    cache = engine.k_cache[0]
    assert torch.equal(call(3, 20).tokens, short.tokens)  # the shorter call after it reuses its buffers
    assert torch.equal(call(1, 20).tokens, single.tokens)
    assert engine.k_cache[0] is cache and engine.row_state.slots == 256
    assert (long.response_lengths < 150).any()  # eos ended rows (on CPU and CUDA inits alike)


def test_folded_multi_query_attention_equals_sdpa_gqa():
    """The CUDA path for several queries per row (GQA heads folded into query rows) equals SDPA's
    enable_gqa attention under the engine's causal cache mask, in float64, values and scale."""
    gen = torch.Generator().manual_seed(3)
    B, S, Hq, Hkv, D, L = 3, 5, 8, 2, 16, 23
    q = torch.randn(B, S, Hq, D, generator=gen, dtype=torch.float64)
    k_cache, v_cache = (torch.randn(B, L, Hkv, D, generator=gen, dtype=torch.float64) for _ in range(2))
    positions = torch.tensor([4, 11, 17])[:, None] + torch.arange(S)
    mask = torch.arange(L) <= positions[..., None]
    for scale in (None, 0.3):
        want = F.scaled_dot_product_attention(q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2),
                                              attn_mask=mask[:, None], scale=scale, enable_gqa=True).transpose(1, 2)
        torch.testing.assert_close(_attend_folded(q, k_cache, v_cache, mask, scale), want, rtol=0, atol=1e-12)


def test_bad_inputs():
    policy, draft, engine = make(max_batch_size=2)
    prompts = torch.ones(2, 5, dtype=torch.long)
    cases = [
        (dict(prompts=torch.ones(3, 5, dtype=torch.long)), "max_batch_size"),
        (dict(prompts=torch.ones(2, MAX_LEN, dtype=torch.long)), "max_seq_len"),
        (dict(prompts=prompts.int()), "int64"),
        (dict(prompts=[torch.ones(3, dtype=torch.long), torch.ones(0, dtype=torch.long)]), "non-empty"),
        (dict(prompts=[]), "empty list"),
        (dict(prompts=[torch.ones(3, dtype=torch.long), torch.ones(MAX_LEN, dtype=torch.long)]), "max_seq_len"),
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
    # The copy is a collective exactly where a shard spans ranks (load_weights then copies the draft at once),
    # read from a module or from a state dict (the pipeline's gathered Weights).
    from titan_draft.rl.pipelined_policy import Weights

    sharded = world_size > 1
    collective = weights_need_collective(draft) == weights_need_collective(Weights(draft.state_dict())) == sharded
    collective &= not weights_need_collective(reference.draft)
    return same, torch.equal(got, want), collective


@pytest.mark.skipif(DEVICE.type != "cpu", reason="gloo ranks on CPU")
@pytest.mark.parametrize("world_size", [1, 2])
def test_load_weights_from_fsdp_sharded_modules(world_size):
    """Over two ranks the shards are gathered; on one rank the local tensors are whole (no gather, no
    collective)."""
    from distributed import run_distributed

    assert run_distributed(_load_sharded_worker, world_size, timeout=150) == [(True, True, True)] * world_size


@pytest.mark.parametrize("min_bucket, compact", [(1, True), (16, True), (20, True), (16, False)])
def test_buckets_are_those_the_running_rows_map_to(min_bucket, compact):
    """`_buckets(B0)` (what measure_steps captures and would_draft weighs; log2(B0) calls of `_bucket`) is
    the set of `_bucket` over 1..B0 running rows, for every call size up to 300 and at 512 and 513."""
    policy, draft, _ = make()
    engine = engine_for(policy, draft, 4, min_bucket=min_bucket, compact=compact)
    for B0 in [*range(1, 301), 512, 513]:
        assert engine.buckets(B0) == sorted({engine._bucket(running, B0) for running in range(1, B0 + 1)}), B0


def test_compiled_step_functions_keep_a_graph_per_shape_past_the_default_limit():
    """The engine compiles its step functions through compile_for_decoding, whose graph limit per
    function (RECOMPILE_LIMIT) is above the step shapes a run meets: every one of 10 static shapes
    gets its own graph, where torch.compile's default limit of 8 ran the rest eagerly."""
    from torch._dynamo.utils import counters

    from titan_draft.rollout.cached_model import RECOMPILE_LIMIT, compile_for_decoding

    torch._dynamo.reset()
    counters.clear()
    step = compile_for_decoding(lambda x: x * 2 + 1, dynamic=False)
    for rows in range(1, 11):
        x = torch.randn(rows, 3)
        assert torch.equal(step(x), x * 2 + 1)
    assert counters["stats"]["unique_graphs"] == 10
    assert torch._dynamo.config.recompile_limit >= RECOMPILE_LIMIT > 10


def test_capture_seconds_count_the_calls_that_captured_a_graph():
    """rollout_capture_s (RolloutResult.timing["capture_s"]): 0 without CUDA graphs; on CUDA above 0 in the
    first calls, which capture their shapes, 0 once every shape replays, and above 0 again after
    release_caches, which drops the graphs."""
    policy, draft, engine = make()

    def capture_s():
        return engine.generate(variable_prompts([5, 3, 7], seed=8), 12, num_speculative_tokens=3, temperature=0.0,
                               eos_id=5).timing["capture_s"]

    seconds = [capture_s() for _ in range(4)]
    engine.release_caches()
    seconds.append(capture_s())
    if engine.cuda_graphs:
        assert sum(seconds[:3]) > 0 and seconds[3] == 0 and seconds[4] > 0, seconds
    else:
        assert seconds == [0.0] * 5


def test_graphs_capture_again_at_first_use_only_the_keys_used_often_before_a_clear():
    """StepGraphs' rule, with captures recorded instead of made (CPU): a key is captured at its
    CAPTURE_AFTER-th use; after clear() (release_caches) at its first use if the buffers before used it
    that often, else again at its CAPTURE_AFTER-th; capture_at_next_use captures at the next use."""
    from titan_draft.rollout.graphs import CAPTURE_AFTER, StepGraphs

    assert CAPTURE_AFTER == 3
    graphs, captures, calls = StepGraphs(enabled=True, generator=torch.Generator()), [], []
    graphs.captured = lambda fn: captures.append(fn.args[0]) or fn  # record the capture; the "graph" runs fn

    def use(name, times):
        for _ in range(times):
            graphs.run(name, partial(calls.append, name))

    use("often", 5)
    use("twice", 2)
    assert captures == ["often"] and len(calls) == 7  # captured at its third use; the call ran every time
    graphs.clear()
    captures.clear()
    use("often", 1)
    use("twice", 2)
    assert captures == ["often"]  # "twice" ran eagerly again
    use("twice", 1)
    assert captures == ["often", "twice"]  # its third use since the clear
    graphs.capture_at_next_use("new")
    use("new", 1)
    assert captures[-1] == "new" and graphs.uses == {"often": 6, "twice": 5, "new": 1}
