"""The EAGLE-3 draft and its multi-pass training-time test (TTT).

Conventions (docs/DESIGN.md section 2), for an anchor i of a document and pass d = 1..D:
- input: concat(input_layernorm(e(x_{i+d})), hidden_norm(h^{d-1}_i)); h^0 = fc(taps at i);
  h^d is the pre-norm output of the decoder layer; gradients flow across passes;
- RoPE position of pass d's query and key: pos(i) + d - 1;
- attention: the pass-1 keys of anchors j <= i of the same document (the causal "trunk") plus the
  pass-2..d keys of anchor i itself (the "branch" diagonal) -> titan_draft.ops.branch_attention;
- target: softmax of the policy logits at row i + d restricted to the draft vocabulary.
At inference the same layer runs with a KV cache: the trunk is the cache of accepted positions and
the branch is the chain of drafted tokens at the last anchor.

Module names follow the EAGLE-3 checkpoint layout read by SGLang and vLLM (fc, midlayer.*, norm,
lm_head, d2t, t2d); export only permutes q/k rows to their RoPE convention (cli/export_draft.py).
"""
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from torchtitan.models.llama3.model.model import precompute_freqs_cis
from torchtitan.models.llama3.model.args import RoPEScalingArgs

from titan_draft.models.rope import rotate_pairs


@dataclass
class DraftArgs:
    dim: int  # = the policy's hidden size (the draft reads its embeddings and hidden states)
    n_heads: int
    n_kv_heads: int
    n_taps: int
    target_vocab_size: int
    draft_vocab_size: int
    ffn_dim: int
    max_seq_len: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


def draft_args_for(policy_args, n_taps: int, draft_vocab_size: int = 0, n_heads: int = 0,
                   n_kv_heads: int = 0) -> DraftArgs:
    """Draft shape from the policy's torchtitan args (config zeros mean "as the policy")."""
    heads = n_heads or policy_args.n_heads
    kv = n_kv_heads or (heads if n_heads else (policy_args.n_kv_heads or heads))
    return DraftArgs(
        dim=policy_args.dim, n_heads=heads, n_kv_heads=kv, n_taps=n_taps,
        target_vocab_size=policy_args.vocab_size,
        draft_vocab_size=draft_vocab_size or policy_args.vocab_size,
        ffn_dim=4 * policy_args.dim, max_seq_len=policy_args.max_seq_len,
        rope_theta=policy_args.rope_theta, norm_eps=policy_args.norm_eps,
    )


class SelfAttentionProjections(nn.Module):
    def __init__(self, a: DraftArgs):
        super().__init__()
        self.q_proj = nn.Linear(2 * a.dim, a.n_heads * a.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * a.dim, a.n_kv_heads * a.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * a.dim, a.n_kv_heads * a.head_dim, bias=False)
        self.o_proj = nn.Linear(a.n_heads * a.head_dim, a.dim, bias=False)


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    """The draft's one decoder layer; its attention input is 2*dim wide (embedding, hidden)."""

    def __init__(self, a: DraftArgs):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(a.dim, eps=a.norm_eps)
        self.hidden_norm = nn.RMSNorm(a.dim, eps=a.norm_eps)
        self.self_attn = SelfAttentionProjections(a)
        self.post_attention_layernorm = nn.RMSNorm(a.dim, eps=a.norm_eps)
        self.mlp = SwiGLU(a.dim, a.ffn_dim)


AttnFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
ShiftFn = Callable[[torch.Tensor, int], torch.Tensor]


class EagleDraft(nn.Module):
    def __init__(self, args: DraftArgs):
        super().__init__()
        self.args = args
        self.fc = nn.Linear(args.n_taps * args.dim, args.dim, bias=False)
        self.midlayer = MidLayer(args)
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.lm_head = nn.Linear(args.dim, args.draft_vocab_size, bias=False)
        # d2t[i]: target id of draft id i minus i (the EAGLE-3 offset convention); t2d: target ids in the draft vocab.
        self.register_buffer("d2t", torch.zeros(args.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(args.target_vocab_size, dtype=torch.bool))
        self.register_buffer("freqs_cis", self._freqs(), persistent=False)
        # Set by tensor parallelism when lm_head is split over the vocabulary (parallelize_draft):
        # logits() then returns this rank's contiguous slice of the draft vocabulary.
        self.vocab_parallel_group: dist.ProcessGroup | None = None

    def _freqs(self):
        no_scaling = RoPEScalingArgs(scaling_factor=1.0, low_freq_factor=1.0, high_freq_factor=4.0)
        return precompute_freqs_cis(self.args.head_dim, self.args.max_seq_len + 64, self.args.rope_theta, no_scaling)

    @torch.no_grad()
    def init_weights(self, buffer_device=None):
        self.freqs_cis = self._freqs().to(buffer_device or self.fc.weight.device)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
            elif isinstance(m, nn.RMSNorm):
                m.reset_parameters()

    @torch.no_grad()
    def set_vocab(self, draft_to_target: torch.Tensor) -> None:
        """Install the draft vocabulary given the target id of every draft id (ascending)."""
        ids = draft_to_target.to(self.d2t.device)
        self.d2t.copy_(ids - torch.arange(len(ids), device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True

    def target_ids(self) -> torch.Tensor:
        """Target-vocabulary id of each draft id."""
        return self.d2t + torch.arange(len(self.d2t), device=self.d2t.device)

    # --- the three pieces that training (TTT) and inference (KV cache) share -------------------------
    def project_qkv(self, emb: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor):
        """q [T, Hq, Dh], k/v [T, Hkv, Dh] for rows with embedding `emb`, previous hidden `hidden`."""
        a, layer = self.args, self.midlayer
        x = torch.cat([layer.input_layernorm(emb), layer.hidden_norm(hidden)], dim=-1)
        attn = layer.self_attn
        T = x.shape[0]
        q = attn.q_proj(x).view(1, T, -1, a.head_dim)
        k = attn.k_proj(x).view(1, T, -1, a.head_dim)
        v = attn.v_proj(x).view(1, T, -1, a.head_dim)
        q, k = rotate_pairs(q, k, self.freqs_cis, positions[None])
        return q[0], k[0], v[0]

    def complete(self, attn_out: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Output projection, residual on the previous hidden, MLP: the next pre-norm hidden h^d."""
        layer = self.midlayer
        h = hidden + layer.self_attn.o_proj(attn_out.flatten(-2))
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [T, V_draft]."""
        return self.lm_head(self.norm(hidden))

    # --- training-time test ------------------------------------------------------------------------
    def ttt_forward(self, emb: torch.Tensor, taps: torch.Tensor, positions: torch.Tensor, ttt_steps: int,
                    shift: ShiftFn, attn_fn: AttnFn) -> list[torch.Tensor]:
        """Hidden states h^1..h^D [T, dim] of all anchors for D = ttt_steps passes.

        emb [T, dim]: the policy's token embeddings (row t embeds x_t); taps [T, n_taps*dim];
        shift(x, d) returns x at row t+d of the same document (zeros past its end);
        attn_fn is titan_draft.ops.branch_attention or its context-parallel twin (same signature).
        """
        hidden = self.fc(taps)
        trunk_k = trunk_v = None
        branch_k, branch_v, states = [], [], []
        for d in range(1, ttt_steps + 1):
            q, k, v = self.project_qkv(shift(emb, d), hidden, positions + d - 1)
            if d == 1:
                trunk_k, trunk_v = k, v
            else:
                branch_k.append(k)
                branch_v.append(v)
            bk = torch.stack(branch_k) if branch_k else None
            bv = torch.stack(branch_v) if branch_v else None
            out, _ = attn_fn(q, trunk_k, trunk_v, bk, bv)
            hidden = self.complete(out, hidden)
            states.append(hidden)
        return states

    def forward(self, emb: torch.Tensor, taps: torch.Tensor, positions: torch.Tensor, ttt_steps: int,
                shift: ShiftFn, attn_fn: AttnFn) -> list[torch.Tensor]:
        """The training forward: draft-vocabulary logits [T, V_draft] of every pass (ttt_forward's states
        through the head), what ttt_loss scores. One call is the whole draft's work on a (micro-)batch, so
        FSDP2 wraps the draft as one unit (parallelize_draft): one gather and one reduction per call."""
        return [self.logits(hidden) for hidden in self.ttt_forward(emb, taps, positions, ttt_steps, shift, attn_fn)]


@dataclass
class Teacher:
    """What the draft learns from the policy, per packed row (detached): the policy's logits at the draft
    vocabulary's target ids [T, Vd] (ttt_loss softmaxes them: the draft's target renormalised over its
    vocabulary) and the argmax over the policy's WHOLE vocabulary [T] (the agreement metric)."""

    logits: torch.Tensor
    argmax: torch.Tensor

    @classmethod
    def from_logits(cls, logits: torch.Tensor, target_ids: torch.Tensor) -> "Teacher":
        """From full policy logits [T, V]."""
        logits = logits.detach()
        return cls(logits[:, target_ids], logits.argmax(-1))

    @classmethod
    def at(cls, trained: torch.Tensor, logits: torch.Tensor, argmax: torch.Tensor) -> "Teacher":
        """A teacher of len(trained) rows from the values of the rows where `trained` is set, in order
        (zeros elsewhere: ttt_loss reads a teacher row only where the loss mask is set)."""
        teacher = cls(logits.new_zeros(len(trained), logits.shape[1]), argmax.new_zeros(len(trained)))
        teacher.logits[trained], teacher.argmax[trained] = logits, argmax
        return teacher

    def rows(self, index: torch.Tensor) -> "Teacher":
        return Teacher(self.logits[index], self.argmax[index])

    @classmethod
    def cat(cls, teachers: list["Teacher"]) -> "Teacher":
        return cls(torch.cat([t.logits for t in teachers]), torch.cat([t.argmax for t in teachers]))


def ttt_loss(draft: EagleDraft, pass_logits: list[torch.Tensor], teacher: Teacher, loss_mask: torch.Tensor,
             shift: ShiftFn, pass_decay: float):
    """Soft cross-entropy of every pass against the policy, restricted to the draft vocabulary.

    pass_logits: the draft's logits of passes 1..D (EagleDraft.forward); teacher: the policy's rows
    (Teacher); loss_mask [T] marks rows whose next token is trained.
    Pass d at anchor i is trained on teacher row i + d when that row is in the same document and
    masked in. Returns (weighted loss SUM, number of valid (anchor, pass) pairs, per-pass stats)
    so that callers normalise by the count over all ranks and micro-batches.
    """
    target_ids = draft.target_ids()
    # float32 arithmetic for bf16/fp16 drafts, but never below the draft's own precision (float64 tests).
    dtype = torch.promote_types(pass_logits[0].dtype, torch.float32) if pass_logits else torch.float32
    total = teacher.logits.new_zeros((), dtype=dtype)
    count = teacher.logits.new_zeros((), dtype=torch.float32)
    stats = []
    for d, logits in enumerate(pass_logits, start=1):
        valid = shift(loss_mask.to(torch.float32), d) > 0
        logits = logits.to(dtype)
        target = F.softmax(shift(teacher.logits, d).to(dtype), dim=-1)
        ce, best = soft_cross_entropy(logits, target, draft.vocab_parallel_group)
        n = valid.sum()
        total = total + pass_decay ** (d - 1) * (ce * valid).sum()
        count = count + n
        agree = (target_ids[best] == shift(teacher.argmax, d)) & valid
        stats.append((agree.sum().detach(), n.detach(), (ce * valid).sum().detach()))
    return total, count, stats


def soft_cross_entropy(logits: torch.Tensor, target: torch.Tensor, vocab_group: dist.ProcessGroup | None = None):
    """Per row: -sum(target * log_softmax(logits)) and the argmax of logits (a draft id).

    target [T, V] sums to 1 over the vocabulary. With vocab_group, logits are this rank's
    contiguous slice of the vocabulary (a vocab-parallel lm_head) and target is the full
    distribution: no rank ever holds all the logits.
    """
    if vocab_group is None:
        return -(target * F.log_softmax(logits, dim=-1)).sum(-1), logits.argmax(-1)
    rank, width = dist.get_rank(vocab_group), logits.shape[-1]
    local_target = target[:, rank * width:(rank + 1) * width]
    ce = _VocabParallelSoftCrossEntropy.apply(logits, local_target, vocab_group)
    with torch.no_grad():  # the global argmax: the lowest id among the ranks' maxima that tie the max
        local_max, local_arg = logits.max(-1)
        global_max = local_max.clone()
        dist.all_reduce(global_max, dist.ReduceOp.MAX, group=vocab_group)
        candidate = torch.where(local_max == global_max, local_arg + rank * width, target.shape[-1])
        dist.all_reduce(candidate, dist.ReduceOp.MIN, group=vocab_group)
    return ce, candidate


class _VocabParallelSoftCrossEntropy(torch.autograd.Function):
    """Soft cross-entropy over a vocabulary split across `group`: ce = lse - <target, logits>,
    with the max, sum of exponentials and dot product all-reduced. Every rank ends with the same
    (replicated) loss and backpropagates it itself, so the backward needs no communication:
    d ce / d logits = softmax - target, on the local slice."""

    @staticmethod
    def forward(ctx, logits, target, group):
        row_max = logits.max(-1).values
        dist.all_reduce(row_max, dist.ReduceOp.MAX, group=group)
        exp = (logits - row_max[:, None]).exp()
        sums = torch.stack([exp.sum(-1), (target * logits).sum(-1)])
        dist.all_reduce(sums, group=group)
        ctx.save_for_backward(exp / sums[0][:, None], target)
        return row_max + sums[0].log() - sums[1]

    @staticmethod
    def backward(ctx, grad):
        softmax, target = ctx.saved_tensors
        return grad[:, None] * (softmax - target), None, None


def build_draft_vocab(token_counts: torch.Tensor, draft_vocab_size: int) -> torch.Tensor:
    """Target ids of the draft vocabulary: the most frequent tokens, in ascending id order."""
    top = torch.topk(token_counts.float(), draft_vocab_size, sorted=True).indices
    return top.sort().values
