"""The policy and the EAGLE-3 draft run against static KV caches: the rollout engine's forwards.

Written against torchtitan's model fields (layers, attention's wq / wk / wv / wo, q_norm / k_norm,
the RoPE buffer): `CachedModels.policy_forward` is torchtitan's forward with the attention op
replaced by a write into a static cache and attention over its slots (cache slot = RoPE position =
token column). The draft's cache follows titan_draft/models/draft.py's conventions (docs/DESIGN.md
2.8): `draft_extend` writes pass-1 ("trunk") keys at anchors, `draft_pass` pass k's branch key.

Attention reads the live part of a cache: on CUDA, steps of up to 16 queries per row go to a
decode kernel that reads each row's slots up to its last query (ops/decode_attention.py); longer
calls (prefill) read the first `width` slots, the smallest of a few widths (the whole cache, then
halvings: `cache_width`) that holds what the call needs, so a call runs in a few static shapes.
The policy's blocks run on their weights in an inference layout (`BlockWeights`: fused q/k/v and
gate/up projections) through one `block_forward`, which torch.compile takes once for all blocks (two
graphs: the first block, which receives no MLP output from a block before it, and the others).
"""
from contextlib import contextmanager
from dataclasses import replace
from functools import partial
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from titan_draft.models.draft import DraftArgs, EagleDraft
from titan_draft.models.families import family_of_args
from titan_draft.ops.decode_attention import decode_attention, decode_attention_reference
from titan_draft.ops.skinny_linear import MAX_ROWS, skinny_linear

# Distinct attended cache widths: the full cache, then halvings (see cache_width).
CACHE_WIDTH_LEVELS = 6
# Graphs torch.compile may keep per compiled function of the engine. Its default, 8, is below the
# step shapes a run meets (row buckets x query windows x cache widths, with rows or queries of 1
# specialised); past the limit a function runs eagerly for every new shape (on the H200 adaptive
# K at batch 16 then ran at 0.67x plain decoding). The acceptance rule compiles one graph per row
# bucket x K (engine.compiled_accept_rule): a call of up to 8,192 rows runs in at most 10 buckets
# (its own row count, then powers of two down to min_bucket 16), which at K <= 8 is 80 graphs.
RECOMPILE_LIMIT = 128
# (row, kv head) pairs from which multi-query attention is folded: on the H200, 64 pairs (16 rows x
# 4 kv heads) ran at 0.6-0.7x SDPA's cuDNN, 256 pairs at 1.4-3.5x (bench/results/decode_attention_h200.json).
FOLDED_MIN_ROW_HEADS = 128
# Queries per row up to which CUDA attention runs the decode kernel (ops/decode_attention.py).
DECODE_KERNEL_MAX_QUERIES = 16
# Multi-query cached attention: the memory-efficient kernel (math where it does not run: float64).
_MULTI_QUERY_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@contextmanager
def _default_dtype(dtype):
    """Build modules with parameters in dtype; rope tables keep the float32 their code asks for."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def compile_for_decoding(fn, **options):
    """torch.compile(fn, **options) for the engine's steps, with torch.compile's per-function graph
    limit raised to RECOMPILE_LIMIT (a process-wide setting: it only ever grows here)."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    return torch.compile(fn, **options)


def _attend(q, k_cache, v_cache, positions, width: int, scale=None):
    """q [B, S, Hq, D] at positions [B, S] against a static cache [B', L, Hkv, D] (row b of q is
    row b of the cache): the query at (b, s) attends slots 0..positions[b, s], all below `width`.

    On CUDA, up to DECODE_KERNEL_MAX_QUERIES queries per row (decode and verify steps, draft passes
    and trunk extensions) go to the decode kernel, which reads each row's live slots only
    (ops/decode_attention.py). Longer ones (prefill) take SDPA over the first width slots under a
    mask, with several queries per row over many (row, kv head) pairs folded (`_attend_folded`):
    there cuDNN, SDPA's choice on Hopper, ran its S >= 2 kernel at 1.4-3.5x the time of the
    memory-efficient kernel (bench/decode_attention.py).
    """
    B, S = q.shape[:2]
    if q.device.type == "cuda" and S <= DECODE_KERNEL_MAX_QUERIES:
        return decode_attention(q, k_cache, v_cache, positions, scale, width)
    if S > 1 and q.device.type == "cuda" and B * k_cache.shape[2] >= FOLDED_MIN_ROW_HEADS:
        return _attend_folded(q, k_cache[:B, :width], v_cache[:B, :width], _visible(positions, width), scale)
    return decode_attention_reference(q, k_cache[:, :width], v_cache[:, :width], positions, scale)


def _attend_folded(q, k_cache, v_cache, mask, scale=None):
    """_attend with the G = Hq / Hkv query heads that share a kv head as G * S query rows of that
    head, through the memory-efficient kernel (which takes no GQA; math where it does not run)."""
    B, S, Hq, D = q.shape
    Hkv, L = k_cache.shape[2], mask.shape[-1]
    G = Hq // Hkv
    folded = q.view(B, S, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, G * S, D)
    folded_mask = mask[:, None, None].expand(B, 1, G, S, L).reshape(B, 1, G * S, L)
    with sdpa_kernel(_MULTI_QUERY_BACKENDS):
        out = F.scaled_dot_product_attention(folded, k_cache.transpose(1, 2), v_cache.transpose(1, 2),
                                             attn_mask=folded_mask, scale=scale)
    return out.view(B, Hkv, G, S, D).permute(0, 3, 1, 2, 4).reshape(B, S, Hq, D)


def _visible(last: torch.Tensor, width: int) -> torch.Tensor:
    """The attention mask [*last.shape, width] of queries that see cache slots 0..last (every
    cache holds slot = RoPE position) among the first `width` slots."""
    return torch.arange(width, device=last.device) <= last[..., None]


def cache_width(slots: int, needed: int) -> int:
    """Cache slots a step attends: the smallest of slots, slots / 2, slots / 4, ... (rounded up,
    CACHE_WIDTH_LEVELS in all) that holds `needed`. Attention then reads the live part of the
    caches, not all of it, in a few step shapes (CUDA graphs) per call."""
    width = slots
    for _ in range(CACHE_WIDTH_LEVELS - 1):
        half = -(-width // 2)
        if half < needed:
            break
        width = half
    return width


class BlockWeights(NamedTuple):
    """A transformer block's weights in the inference layout: the q, k and v projections as one
    matrix, the MLP's gate (w1) and up (w3) projections as one, so that a decode step runs 4 GEMMs
    per block instead of 7 (fewer, larger launches: a batch-1 step is launch-bound). The module's
    own parameters are views of the fused matrices, so weights loaded by name fill them."""
    attention_norm: torch.Tensor
    qkv: torch.Tensor
    q_norm: torch.Tensor | None
    """qwen3's per-head RMSNorm weights (None for llama3)."""
    k_norm: torch.Tensor | None
    wo: torch.Tensor
    ffn_norm: torch.Tensor
    gate_up: torch.Tensor | None
    """None for a mixture-of-experts block: its MoE module runs as it is."""
    down: torch.Tensor | None


def _fuse_rows(linears: list[nn.Linear]) -> torch.Tensor:
    """One matrix of the linears' weights stacked by output rows; each linear's weight becomes a
    view of its rows."""
    fused = torch.cat([linear.weight.detach() for linear in linears])
    start = 0
    for linear in linears:
        rows = linear.weight.shape[0]
        linear.weight = nn.Parameter(fused[start:start + rows], requires_grad=False)
        start += rows
    return fused


def fuse_block(block) -> BlockWeights:
    """The inference layout of a torchtitan llama3 / qwen3 TransformerBlock (see BlockWeights)."""
    attn = block.attention
    norm = lambda module: None if module is None else module.weight  # noqa: E731
    dense = not getattr(block, "moe_enabled", False)
    ffn = block.feed_forward if dense else None
    return BlockWeights(
        attention_norm=block.attention_norm.weight, qkv=_fuse_rows([attn.wq, attn.wk, attn.wv]),
        q_norm=norm(getattr(attn, "q_norm", None)), k_norm=norm(getattr(attn, "k_norm", None)), wo=attn.wo.weight,
        ffn_norm=block.ffn_norm.weight, gate_up=_fuse_rows([ffn.w1, ffn.w3]) if dense else None,
        down=ffn.w2.weight if dense else None)


def _project(x: torch.Tensor, w: torch.Tensor, few_rows: int) -> torch.Tensor:
    """x [B, S, K] @ w [N, K].T. A step of at most `few_rows` rows x positions (decode and verify
    steps of a few rows) goes to the few-row kernel, which streams the weights once
    (ops/skinny_linear.py); more rows to cuBLAS."""
    rows = x.shape[0] * x.shape[1]
    if rows <= few_rows:
        return skinny_linear(x.reshape(rows, x.shape[-1]), w).view(*x.shape[:-1], w.shape[0])
    return F.linear(x, w)


def block_forward(stream, delta, weights: BlockWeights, rope, positions, rows, width: int, k_cache, v_cache, *,
                  rotary, n_heads: int, n_kv_heads: int, head_dim: int, eps: float, scaling: float | None,
                  few_rows: int = 0, ffn=None):
    """torchtitan's TransformerBlock.forward on BlockWeights, with attention over a static cache:
    the new keys/values go to slots `positions` of rows `rows`, and each query attends the slots
    up to its position (all below `width`). ffn: the MoE module of a block without gate_up.

    The residual stream comes in two parts, stream + delta (delta: the previous block's MLP output,
    None before the first block), and leaves in two: the block adds its own MLP output in the next
    block, where a compiled step fuses that add into the next block's first norm (an add at the
    block's end follows the MLP's GEMM in a kernel of its own). Returns (the stream this block
    received, i.e. the previous block's output; the stream after attention; the MLP's output)."""
    entered = h = stream if delta is None else stream + delta
    B, S, dim = h.shape
    x = F.rms_norm(h, (dim,), weights.attention_norm, eps)
    q, k, v = _project(x, weights.qkv, few_rows).split([n_heads * head_dim, n_kv_heads * head_dim, n_kv_heads * head_dim], -1)
    q, k, v = q.view(B, S, n_heads, head_dim), k.view(B, S, n_kv_heads, head_dim), v.view(B, S, n_kv_heads, head_dim)
    if weights.q_norm is not None:  # qwen3
        q = F.rms_norm(q, (head_dim,), weights.q_norm, eps)
        k = F.rms_norm(k, (head_dim,), weights.k_norm, eps)
    q, k = rotary(q, k, rope, positions)
    k_cache[rows, positions] = k
    v_cache[rows, positions] = v
    out = _attend(q, k_cache, v_cache, positions, width, scale=scaling)
    h = h + _project(out.flatten(2), weights.wo, few_rows)
    x = F.rms_norm(h, (dim,), weights.ffn_norm, eps)
    if weights.gate_up is None:
        return entered, h, ffn(x)
    gate, up = _project(x, weights.gate_up, few_rows).chunk(2, dim=-1)
    return entered, h, _project(F.silu(gate) * up, weights.down, few_rows)


class CachedModels:
    """Inference copies of the policy (a torchtitan llama3 / qwen3 model) and of the draft (or
    none), with their KV caches. The caches come with `allocate` and go with `release`; every
    forward writes and reads them in place, with no host synchronisation."""

    def __init__(self, policy_args, draft_args: DraftArgs | None, tap_layers, max_slots: int, device, dtype,
                 compile: bool = False, few_row_linear: bool = False):
        """max_slots: the most cache slots (RoPE positions) any call uses. compile: torch.compile the
        policy's block forward (one compiled function serves every block: their weights are inputs).
        few_row_linear: on CUDA, the block projections of calls of at most MAX_ROWS rows x positions
        run the few-row kernel (ops/skinny_linear.py) instead of cuBLAS."""
        family = family_of_args(policy_args)
        rope_name = family.rope_buffer
        self.tap_layers = sorted(tap_layers)
        if draft_args is not None and len(self.tap_layers) != draft_args.n_taps:
            raise ValueError(f"tap_layers: {len(self.tap_layers)} layers given but the draft reads "
                             f"{draft_args.n_taps} taps; pass the draft's tap layers")
        self.device, self.dtype = device, dtype
        with torch.device(device), _default_dtype(dtype):
            self.policy = family.model_cls(replace(policy_args, max_seq_len=max_slots))
        self.policy.eval().requires_grad_(False)
        self._rope_table = lambda: getattr(self.policy, rope_name)
        self.block_weights = [fuse_block(block) for block in self.policy.layers.values()]
        attn = self.policy.layers["0"].attention
        self._block_shape = dict(rotary=family.apply_rotary_emb, n_heads=attn.n_heads, n_kv_heads=attn.n_kv_heads,
                                 head_dim=attn.head_dim, eps=policy_args.norm_eps,
                                 scaling=getattr(attn, "scaling", None),
                                 few_rows=MAX_ROWS if few_row_linear and torch.device(device).type == "cuda" else 0)
        self.block = compile_for_decoding(block_forward) if compile else block_forward
        self.draft = None
        if draft_args is not None:
            with torch.device(device), _default_dtype(dtype):
                self.draft = EagleDraft(replace(draft_args, max_seq_len=max_slots))
            self.draft.eval().requires_grad_(False)
        self.release()

    def allocate(self, rows: int, slots: int) -> None:
        """KV caches of `rows` rows of `slots` slots, zeroed."""
        zeros = partial(torch.zeros, device=self.device, dtype=self.dtype)
        attn = self.policy.layers["0"].attention
        cache_shape = (rows, slots, attn.n_kv_heads, attn.head_dim)
        self.k_cache = [zeros(cache_shape) for _ in self.policy.layers]
        self.v_cache = [zeros(cache_shape) for _ in self.policy.layers]
        if self.draft is not None:
            # Slot = anchor for the trunk; pass k's branch key goes to slot anchor + k - 1 (see draft_pass).
            args = self.draft.args
            self.draft_k = zeros(rows, slots, args.n_kv_heads, args.head_dim)
            self.draft_v = zeros(rows, slots, args.n_kv_heads, args.head_dim)

    def release(self) -> None:
        self.k_cache, self.v_cache = [], []
        self.draft_k = self.draft_v = None

    def caches(self) -> list[torch.Tensor]:
        """Every KV cache, indexed by row (dim 0); none when released."""
        caches = [*self.k_cache, *self.v_cache]
        if self.draft is not None and caches:
            caches += [self.draft_k, self.draft_v]
        return caches

    # --- the policy ----------------------------------------------------------------------------------
    def policy_forward(self, tokens: torch.Tensor, positions: torch.Tensor, width: int):
        """Cached forward of tokens [B, S] at positions [B, S] (cache slot = position).

        Writes their keys/values into the cache, attends slots <= each query's position among the
        first `width` (every position lies below it), and returns logits [B, S, V], tap features
        [B, S, n_taps * dim] (tap layers' outputs, ascending) and the token embeddings [B, S, dim].
        """
        B = tokens.shape[0]
        rows = torch.arange(B, device=tokens.device)[:, None]
        rope = self._rope_table()
        emb = self.policy.tok_embeddings(tokens)
        h, delta, taps = emb, None, []
        for i, (layer, weights) in enumerate(zip(self.policy.layers.values(), self.block_weights)):
            previous_output, h, delta = self.block(h, delta, weights, rope, positions, rows, width, self.k_cache[i],
                                                   self.v_cache[i], **self._block_shape,
                                                   ffn=layer.moe if weights.gate_up is None else None)
            if i - 1 in self.tap_layers:
                taps.append(previous_output)
        h = h + delta  # the last block's output
        if len(self.policy.layers) - 1 in self.tap_layers:
            taps.append(h)
        logits = self.policy.output(self.policy.norm(h))
        return logits, torch.cat(taps, dim=-1), emb

    # --- the draft -----------------------------------------------------------------------------------
    def draft_extend(self, next_emb, taps, start, count, width: int):
        """Pass 1 at anchors start..start+W-1 of each row (the first count[b] are real).

        next_emb [B, W, dim]: policy embeddings of x_{i+1}; taps [B, W, n_taps * dim]: taps at i.
        Writes their trunk keys and returns pass 1's hidden at the last real anchor, [B, dim].
        width: the cache slots attention reads, above every anchor.
        """
        B, W, _ = next_emb.shape
        rows = torch.arange(B, device=next_emb.device)
        anchors = start[:, None] + torch.arange(W, device=next_emb.device)
        hidden = self.draft.fc(taps)
        q, k, v = self.draft.project_qkv(next_emb.flatten(0, 1), hidden.flatten(0, 1), anchors.flatten())
        self.draft_k[rows[:, None], anchors] = k.view(B, W, *k.shape[1:])
        self.draft_v[rows[:, None], anchors] = v.view(B, W, *v.shape[1:])
        out = _attend(q.view(B, W, *q.shape[1:]), self.draft_k, self.draft_v, anchors, width)  # trunk slots <= anchor
        hidden = self.draft.complete(out, hidden)
        return hidden[rows, count - 1]

    def draft_pass(self, k: int, emb, hidden, anchor, width: int):
        """Pass k >= 2 at anchor [B]: input e(t_{k-1}) [B, dim] and pass k-1's hidden [B, dim];
        returns pass k's hidden [B, dim]. width: the cache slots attention reads.

        Its key goes to slot anchor + k - 1, its RoPE position, so that slots <= anchor + k - 1
        are exactly what pass k attends: the trunk (anchors <= anchor) and passes 2..k's branch keys.
        Those slots belong to anchors whose next token is not known yet: garbage under the rollback
        rule, overwritten by the trunk extension after the verify step.
        """
        B = emb.shape[0]
        rows = torch.arange(B, device=emb.device)
        slot = anchor + k - 1
        q, key, value = self.draft.project_qkv(emb, hidden, slot)
        self.draft_k[rows, slot] = key
        self.draft_v[rows, slot] = value
        out = _attend(q[:, None], self.draft_k, self.draft_v, slot[:, None], width)
        return self.draft.complete(out[:, 0], hidden)
