"""The draft's multi-pass TTT against a naive, independent reading of DESIGN.md section 2.

The naive version below builds every pass's inputs row by row, applies its own RoPE, materialises
the full [T, d*T] (trunk + branch) mask over the keys of all passes so far, and computes the soft
cross-entropy anchor by anchor. The product path is EagleDraft.ttt_forward + DocumentShift +
titan_draft.ops.branch_attention + ttt_loss (and cotrain.draft_loss, which wraps them).
"""
import itertools
import math

import pytest
import torch

from titan_draft.data.packing import DocumentShift, pack
from titan_draft.models.cotrain import (CoTrainSpec, DraftFeatures, draft_loss, draft_metrics, sample_documents,
                                        valid_pairs)
from titan_draft.models.draft import DraftArgs, EagleDraft, Teacher, build_draft_vocab, ttt_loss
from titan_draft.ops import branch_attention

F64 = torch.float64
DIM, N_HEADS, N_KV_HEADS, N_TAPS = 32, 4, 2, 3
TARGET_VOCAB, DRAFT_VOCAB = 24, 11
LENGTHS = [5, 1, 2, 7, 3, 1, 9]  # odd lengths, very short ones included, T = 28
PASS_DECAY = 0.8


def make_draft(seed: int) -> EagleDraft:
    torch.manual_seed(seed)
    args = DraftArgs(dim=DIM, n_heads=N_HEADS, n_kv_heads=N_KV_HEADS, n_taps=N_TAPS,
                     target_vocab_size=TARGET_VOCAB, draft_vocab_size=DRAFT_VOCAB, ffn_dim=48,
                     max_seq_len=64)
    draft = EagleDraft(args)
    draft.init_weights()
    with torch.no_grad():  # weights large enough that every path matters (init std 0.02 is nearly inert)
        for name, p in draft.named_parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / math.sqrt(p.shape[1]))
    draft.set_vocab(torch.randperm(TARGET_VOCAB)[:DRAFT_VOCAB].sort().values)
    return draft.double()


# ---------------------------------------------------------------------------------------------
# naive reference
# ---------------------------------------------------------------------------------------------


def rms_norm(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope(x, positions, theta):
    """x [T, H, Dh]: rotate adjacent pairs (x0, x1) by angle pos * theta^(-2j/Dh), in x's dtype."""
    half = x.shape[-1] // 2
    freqs = 1.0 / theta ** (torch.arange(half, dtype=F64) * 2 / x.shape[-1])
    angle = positions.to(F64)[:, None] * freqs[None]  # [T, half]
    cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(-2)


def naive_ttt_loss(draft, emb, taps, teacher, loss_mask, lengths, ttt_steps, pass_decay):
    a, m = draft.args, draft.midlayer
    attn = m.self_attn
    eps = a.norm_eps
    T = emb.shape[0]
    doc, start, end = [], [], []
    s = 0
    for n, length in enumerate(lengths):
        doc += [n] * length
        start += [s] * length
        end += [s + length] * length
        s += length
    pos = torch.tensor([i - start[i] for i in range(T)])
    group = a.n_heads // a.n_kv_heads

    h = taps @ draft.fc.weight.T  # h^0
    keys, values, states = [], [], []
    for d in range(1, ttt_steps + 1):
        # inputs row by row: e(x_{i+d}) (zero past the document end) and h^{d-1}_i
        inside = torch.tensor([i + d < end[i] for i in range(T)], dtype=F64)
        e = emb[torch.tensor([min(i + d, T - 1) for i in range(T)])] * inside[:, None]
        x = torch.cat([rms_norm(e, m.input_layernorm.weight, eps), rms_norm(h, m.hidden_norm.weight, eps)], -1)
        q = (x @ attn.q_proj.weight.T).view(T, a.n_heads, a.head_dim)
        k = (x @ attn.k_proj.weight.T).view(T, a.n_kv_heads, a.head_dim)
        v = (x @ attn.v_proj.weight.T).view(T, a.n_kv_heads, a.head_dim)
        q, k = rope(q, pos + d - 1, a.rope_theta), rope(k, pos + d - 1, a.rope_theta)
        keys.append(k)
        values.append(v)
        K = torch.cat(keys).repeat_interleave(group, dim=1)  # [d*T, Hq, Dh]
        V = torch.cat(values).repeat_interleave(group, dim=1)
        mask = [[False] * (d * T) for _ in range(T)]
        for i in range(T):
            for j in range(T):
                mask[i][j] = j <= i and doc[j] == doc[i]  # pass-1 keys: the causal trunk
            for p in range(2, d + 1):
                mask[i][(p - 1) * T + i] = True  # pass-p key at the same anchor: the branch
        mask = torch.tensor(mask)
        scores = torch.einsum("thd,shd->hts", q, K) / math.sqrt(a.head_dim)
        probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
        out = torch.einsum("hts,shd->thd", probs, V).reshape(T, -1)
        h = h + out @ attn.o_proj.weight.T
        u = rms_norm(h, m.post_attention_layernorm.weight, eps)
        mlp = m.mlp
        h = h + (torch.nn.functional.silu(u @ mlp.gate_proj.weight.T) * (u @ mlp.up_proj.weight.T)) @ mlp.down_proj.weight.T
        states.append(h)

    ids = draft.target_ids()
    total, count = 0.0, 0
    for d, hd in enumerate(states, start=1):
        logp = torch.log_softmax(rms_norm(hd, draft.norm.weight, eps) @ draft.lm_head.weight.T, dim=-1)
        pairs = [(i, i + d) for i in range(T) if i + d < end[i] and loss_mask[i + d]]
        if not pairs:
            continue
        anchor, row = (torch.tensor(c) for c in zip(*pairs))
        target = torch.softmax(teacher[row][:, ids], dim=-1)  # teacher row i + d, draft vocabulary only
        total = total + pass_decay ** (d - 1) * -(target * logp[anchor]).sum()
        count += len(pairs)
    return total / count, count


# ---------------------------------------------------------------------------------------------
# the comparison
# ---------------------------------------------------------------------------------------------


def features(draft, batch, emb, taps, teacher_logits):
    return DraftFeatures(batch, emb, taps, Teacher.from_logits(teacher_logits, draft.target_ids()))


def pairs(batch, ttt_steps):
    return valid_pairs(batch.loss_mask, batch.shift(ttt_steps), ttt_steps)


def rel_err(actual, expected):
    return ((actual - expected).norm() / expected.norm().clamp(min=1e-300)).item()


def inputs(seed):
    g = torch.Generator().manual_seed(seed)
    T = sum(LENGTHS)
    emb = torch.randn(T, DIM, generator=g, dtype=F64)
    taps = torch.randn(T, N_TAPS * DIM, generator=g, dtype=F64)
    teacher = 2 * torch.randn(T, TARGET_VOCAB, generator=g, dtype=F64)
    loss_mask = torch.rand(T, generator=g) < 0.7
    return emb, taps, teacher, loss_mask


@pytest.mark.parametrize("ttt_steps", [1, 2, 3, 4])
def test_ttt_forward_and_loss_match_naive(ttt_steps):
    draft = make_draft(ttt_steps)
    emb, taps, teacher, loss_mask = inputs(100 + ttt_steps)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    positions = torch.cat([torch.arange(n) for n in LENGTHS])
    params = dict(draft.named_parameters())

    # product path (emb and taps as leaves, to also check the gradient through DocumentShift)
    emb_a, taps_a = emb.clone().requires_grad_(), taps.clone().requires_grad_()
    shift = DocumentShift(cu)
    pass_logits = draft(emb_a, taps_a, positions, ttt_steps, shift,
                        lambda q, k, v, bk, bv: branch_attention(q, k, v, bk, bv, cu_seqlens=cu))
    total, count, stats = ttt_loss(draft, pass_logits, Teacher.from_logits(teacher, draft.target_ids()), loss_mask,
                                   shift, PASS_DECAY)
    loss = total / count
    got = torch.autograd.grad(loss, [*params.values(), emb_a, taps_a])

    # naive path
    emb_b, taps_b = emb.clone().requires_grad_(), taps.clone().requires_grad_()
    ref, ref_count = naive_ttt_loss(draft, emb_b, taps_b, teacher, loss_mask, LENGTHS, ttt_steps, PASS_DECAY)
    want = torch.autograd.grad(ref, [*params.values(), emb_b, taps_b])

    assert int(count) == ref_count > 0
    assert sum(int(n) for _, n, _ in stats) == ref_count
    # float64 up to torchtitan's apply_rotary_emb, which rotates in float32 (q.float()).
    torch.testing.assert_close(loss.double(), ref, rtol=1e-8, atol=0)
    for name, g_got, g_want in zip([*params, "emb", "taps"], got, want):
        assert g_want.abs().sum() > 0, name
        assert rel_err(g_got, g_want) < 1e-6, (name, rel_err(g_got, g_want))


def test_cotrain_draft_loss_is_the_same_loss():
    """cotrain.draft_loss (the path training uses) gives the naive loss and gradients too."""
    draft = make_draft(7)
    emb, taps, teacher, loss_mask = inputs(7)
    tokens = torch.zeros(sum(LENGTHS), dtype=torch.long)
    batch = pack(list(tokens.split(LENGTHS)), list(loss_mask.split(LENGTHS)))
    loss, per_pass = draft_loss(draft, features(draft, batch, emb, taps, teacher),
                                CoTrainSpec([0], ttt_steps=3, pass_decay=PASS_DECAY), count=pairs(batch, 3))
    metrics = draft_metrics(per_pass)
    got = torch.autograd.grad(loss, list(draft.parameters()))
    ref, _ = naive_ttt_loss(draft, emb, taps, teacher, loss_mask, LENGTHS, 3, PASS_DECAY)
    want = torch.autograd.grad(ref, list(draft.parameters()))
    torch.testing.assert_close(loss.double(), ref, rtol=1e-8, atol=0)
    for g_got, g_want in zip(got, want):
        assert rel_err(g_got, g_want) < 1e-6
    assert set(metrics) == {"draft_loss", "draft_acc_pass1", "draft_acc_pass2", "draft_acc_pass3"}


def test_packed_documents_are_the_documents_packed_alone():
    g = torch.Generator().manual_seed(3)
    docs = [torch.randint(0, 50, (n,), generator=g) for n in LENGTHS]
    masks = [torch.rand(n, generator=g) < 0.6 for n in LENGTHS]
    batch = pack(docs, masks)
    index = torch.tensor([0, 3, 5, 6])
    sub, rows = batch.documents(index)
    alone = pack([docs[i] for i in index], [masks[i] for i in index])
    for field in ("tokens", "positions", "cu_seqlens", "loss_mask"):
        assert torch.equal(getattr(sub, field), getattr(alone, field)), field
    assert sub.max_seqlen == alone.max_seqlen == 9
    assert torch.equal(batch.tokens[rows], alone.tokens)


def test_sampled_documents_give_an_unbiased_loss_and_gradient():
    """draft.train_fraction: the draft loss on k of the N documents, reweighted, averaged over all C(N, k)
    equally likely draws, equals the loss and gradients over all N documents exactly (float64)."""
    draft = make_draft(11)
    emb, taps, teacher, loss_mask = inputs(11)
    batch = pack(list(torch.zeros(sum(LENGTHS), dtype=torch.long).split(LENGTHS)), list(loss_mask.split(LENGTHS)))
    spec = CoTrainSpec([0], ttt_steps=3, pass_decay=PASS_DECAY)
    params = list(draft.parameters())
    whole, count = features(draft, batch, emb, taps, teacher), pairs(batch, 3)
    full = draft_loss(draft, whole, spec, count=count)[0]
    want = torch.autograd.grad(full, params)
    draws = list(itertools.combinations(range(len(LENGTHS)), 3))
    scale = len(LENGTHS) / 3  # documents / documents drawn, as WholePolicy weights a draw

    def drawn_loss(draw):
        return draft_loss(draft, whole.documents(torch.tensor(draw)), spec, count=count, scale=scale)

    mean_loss, mean_grads = 0.0, [torch.zeros_like(p) for p in params]
    for draw in draws:
        loss, per_pass = drawn_loss(draw)
        mean_loss += loss.item() / len(draws)
        for acc, g in zip(mean_grads, torch.autograd.grad(loss, params)):
            acc += g / len(draws)
        assert per_pass[0, 1] < sum(int(n) for n in loss_mask)  # the metrics count the drawn documents only
    assert mean_loss == pytest.approx(full.item(), rel=1e-12)
    for got, expected in zip(mean_grads, want):  # float64 up to torchtitan's float32 RoPE (as above)
        assert rel_err(got, expected) < 1e-6
    # one draw is not the full loss (the comparison above is not trivially of equal terms)
    assert abs(drawn_loss(draws[0])[0] - full) > 1e-3


def test_sample_documents_draws_a_fraction_without_replacement():
    g = torch.Generator().manual_seed(0)
    state = g.get_state()
    assert sample_documents(10, 1.0, g) is None and torch.equal(g.get_state(), state)  # 1: nothing drawn
    drawn = sample_documents(10, 0.25, g)
    assert len(drawn) == 3 and drawn.tolist() == sorted(set(drawn.tolist())) and 0 <= drawn.min() <= drawn.max() < 10
    assert len(sample_documents(3, 0.01, g)) == 1  # at least one document
    counts = torch.zeros(10)
    for _ in range(2000):  # every document equally likely
        counts[sample_documents(10, 0.3, g)] += 1
    assert (counts / 2000 - 0.3).abs().max() < 0.05


def test_ttt_loss_counts_valid_pairs_on_hand_example():
    # docs: A = rows 0..3, B = row 4, C = rows 5..7. B's only row is marked on purpose: an anchor
    # of A or B that wrongly reached across the document boundary would count it.
    cu = torch.tensor([0, 4, 5, 8], dtype=torch.int32)
    loss_mask = torch.tensor([0, 1, 1, 0, 1, 1, 1, 0], dtype=torch.bool)
    # valid (i, d) <=> i + d in the same document and loss_mask[i + d]:
    #   d=1: (0,1) (1,1) (5,1) [(3,1) -> row 4 is another document; (4,1) -> row 5 likewise]
    #   d=2: (0,2)             [(5,2) -> row 7 unmasked; (2,2) -> row 4 another document]
    #   d=3: none              [(0,3) -> row 3 unmasked]
    expected_per_pass = [3, 1, 0]
    torch.manual_seed(0)
    draft = make_draft(0)
    T, D = 8, 3
    pass_logits = [torch.randn(T, draft.args.draft_vocab_size, dtype=F64) for _ in range(D)]
    teacher = Teacher.from_logits(torch.randn(T, TARGET_VOCAB, dtype=F64), draft.target_ids())
    total, count, stats = ttt_loss(draft, pass_logits, teacher, loss_mask, DocumentShift(cu), PASS_DECAY)
    assert int(count) == sum(expected_per_pass) == 4
    assert [int(n) for _, n, _ in stats] == expected_per_pass
    # the pass with no valid pair contributes nothing, and a loss that only sees pass 1 equals pass 1's sum
    assert float(stats[2][2]) == 0.0
    total1, _, stats1 = ttt_loss(draft, pass_logits[:1], teacher, loss_mask, DocumentShift(cu), PASS_DECAY)
    torch.testing.assert_close(total1.double(), stats1[0][2].double())


def test_build_draft_vocab_top_n_ascending_and_maps_consistent():
    counts = torch.tensor([5, 100, 3, 50, 7, 0, 80, 1])
    ids = build_draft_vocab(counts, 3)
    assert ids.tolist() == [1, 3, 6]  # the 3 most frequent (100, 80, 50), in ascending id order

    g = torch.Generator().manual_seed(3)
    counts = torch.randperm(40, generator=g) * 3  # distinct counts: no ties
    ids = build_draft_vocab(counts, 13)
    want = sorted(torch.argsort(counts, descending=True)[:13].tolist())
    assert ids.tolist() == want

    args = DraftArgs(dim=16, n_heads=2, n_kv_heads=1, n_taps=1, target_vocab_size=40, draft_vocab_size=13,
                     ffn_dim=32, max_seq_len=8)
    draft = EagleDraft(args)
    draft.set_vocab(torch.arange(13) * 3)  # an earlier vocabulary: set_vocab must forget it
    draft.set_vocab(ids)
    assert draft.target_ids().tolist() == want
    for i in range(13):
        assert int(draft.d2t[i]) + i == want[i]
    assert draft.t2d.tolist() == [t in want for t in range(40)]
    assert int(draft.t2d.sum()) == 13
