"""Decode attention over a static KV cache that reads only each row's live keys (split-K
"flash-decoding"), as two Triton kernels, with its dense reference beside it.

The rollout engine's steps ask few queries per row (1 for a plain decode step or a draft pass, K + 1
for a verify window) against a cache whose static width (CUDA graphs) is often far above what a
row holds. SDPA with a mask reads the whole width, launches 2-3 kernels, and for S >= 2 queries per
row picks kernels built for long query blocks (bench/results/decode_step_qwen3_1.7b_sdpa_h200.json:
a 5-query verify window cost 2.3x a 1-query step in attention alone). Here one program owns one
row, one kv head and one chunk of cache slots, with all the S x G queries that read that kv head
(G = query heads per kv head) as the rows of one tile: each key and value is read once, only up
to the row's last query position, and GQA needs no copy. Programs split the slots so that small
batches still fill the GPU; a second kernel merges the chunks by their log-sum-exp (with one
chunk per row, from ~33 rows at 8 kv heads, the first kernel writes the output itself).

Inference only (the engine runs under no_grad): no backward. `decode_attention_reference` is the
dense reference (SDPA under the same mask); tests/test_decode_attention.py compares the kernels
to it in float64 in Triton's interpreter on CPU, and in bf16 on a GPU.
"""
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

# Cache slots per key block; a program's chunk is a multiple of it.
BLOCK_N = 64
# Programs to aim for: about two per streaming multiprocessor of an H100/H200 (132).
TARGET_PROGRAMS = 264
# Chunks per (row, kv head) at most: the merge holds one query's chunk outputs in one tile.
MAX_SPLITS = 64


def decode_attention_reference(q, k_cache, v_cache, positions, scale: float | None = None):
    """q [B, S, Hq, D]; caches [B', L, Hkv, D] (B' >= B, row b of the cache is row b of q);
    positions [B, S]: the query at (b, s) attends slots 0..positions[b, s] of row b. Returns
    [B, S, Hq, D]. SDPA over the whole cache under that mask."""
    B, L = q.shape[0], k_cache.shape[1]
    mask = torch.arange(L, device=q.device) <= positions[..., None]  # [B, S, L]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k_cache[:B].transpose(1, 2), v_cache[:B].transpose(1, 2),
                                         attn_mask=mask[:, None], scale=scale,
                                         enable_gqa=q.shape[2] != k_cache.shape[2])
    return out.transpose(1, 2)


@triton.jit
def _chunk_attention(q_ptr, k_ptr, v_ptr, pos_ptr, out_ptr, lse_ptr, o_ptr, scale, S, chunk, splits,
                     stride_qb, stride_qs, stride_qh, stride_kb, stride_kl, stride_kh,
                     stride_vb, stride_vl, stride_vh, stride_ob, stride_os, stride_oh,
                     GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_D: tl.constexpr, BLOCK_KEYS: tl.constexpr, IEEE: tl.constexpr, DIRECT: tl.constexpr):
    """One (row b, kv head, chunk of slots): attention of the S x GROUP queries of that kv head
    (tile row m = s * GROUP + g) over the chunk's visible slots. Writes the chunk's normalised
    output [BLOCK_M, D] and log-sum-exp [BLOCK_M] (-inf where a query sees none of its slots);
    DIRECT (one chunk per row): the output itself, into o."""
    b, kv, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    m = tl.arange(0, BLOCK_M)
    s, g = m // GROUP, m % GROUP
    live = s < S
    d = tl.arange(0, BLOCK_D)
    d_live = d < HEAD_DIM
    pos = tl.load(pos_ptr + b * S + s, mask=live, other=-1)
    start = split * chunk
    end = tl.minimum(start + chunk, tl.max(pos, 0) + 1)  # no query of this row sees past its position
    q = tl.load(q_ptr + b * stride_qb + s[:, None] * stride_qs + (kv * GROUP + g)[:, None] * stride_qh + d[None, :],
                mask=live[:, None] & d_live[None, :], other=0.0)
    compute = tl.float64 if q.dtype == tl.float64 else tl.float32
    running_max = tl.full([BLOCK_M], float("-inf"), compute)
    denominator = tl.zeros([BLOCK_M], compute)
    acc = tl.zeros([BLOCK_M, BLOCK_D], compute)
    for first in range(start, end, BLOCK_KEYS):
        n = first + tl.arange(0, BLOCK_KEYS)
        n_live = n < end
        kv_mask = n_live[:, None] & d_live[None, :]
        k = tl.load(k_ptr + b * stride_kb + n[:, None] * stride_kl + kv * stride_kh + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + b * stride_vb + n[:, None] * stride_vl + kv * stride_vh + d[None, :], mask=kv_mask, other=0.0)
        if IEEE:  # float32 inputs: no TF32 rounding
            scores = tl.dot(q, tl.trans(k), input_precision="ieee").to(compute) * scale
        else:
            scores = tl.dot(q, tl.trans(k)).to(compute) * scale
        scores = tl.where((n[None, :] <= pos[:, None]) & n_live[None, :], scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, 1))
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # a row with nothing visible yet
        p = tl.exp(scores - shift[:, None])
        rescale = tl.exp(running_max - shift)
        denominator = denominator * rescale + tl.sum(p, 1)
        if IEEE:
            acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee").to(compute)
        else:
            acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v).to(compute)
        running_max = new_max
    seen = denominator > 0
    out = acc / tl.where(seen, denominator, 1.0)[:, None]
    if DIRECT:
        tl.store(o_ptr + b * stride_ob + s[:, None] * stride_os + (kv * GROUP + g)[:, None] * stride_oh + d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=live[:, None] & d_live[None, :])
    else:
        lse = tl.where(seen, running_max + tl.log(tl.where(seen, denominator, 1.0)), float("-inf"))
        part = (b * tl.num_programs(1) + kv) * splits + split
        tl.store(out_ptr + part * BLOCK_M * BLOCK_D + m[:, None] * BLOCK_D + d[None, :], out, mask=live[:, None])
        tl.store(lse_ptr + part * BLOCK_M + m, lse, mask=live)


@triton.jit
def _merge_chunks(part_out_ptr, part_lse_ptr, o_ptr, splits, stride_ob, stride_os, stride_oh,
                  GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_SPLITS: tl.constexpr):
    """One (row b, kv head, query m = s * GROUP + g): the chunks' outputs for that query weighted by
    exp(chunk lse - total lse), into o. All of the query's chunks form one tile: two loads and no
    loop, over the rows that are queries only."""
    b, kv, m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    s, g = m // GROUP, m % GROUP
    c = tl.arange(0, BLOCK_SPLITS)
    d = tl.arange(0, BLOCK_D)
    live = c < splits
    part = (b * tl.num_programs(1) + kv) * splits + c
    lse = tl.load(part_lse_ptr + part * BLOCK_M + m, mask=live, other=float("-inf"))
    top = tl.max(lse, 0)
    weight = tl.exp(lse - tl.where(top == float("-inf"), 0.0, top))  # (a query that sees no slot: all 0)
    outs = tl.load(part_out_ptr + (part * BLOCK_M + m)[:, None] * BLOCK_D + d[None, :], mask=live[:, None], other=0.0)
    total = tl.sum(weight, 0)
    out = tl.sum(weight[:, None] * outs, 0) / tl.where(total > 0, total, 1.0)
    tl.store(o_ptr + b * stride_ob + s * stride_os + (kv * GROUP + g) * stride_oh + d,
             out.to(o_ptr.dtype.element_ty), mask=d < HEAD_DIM)


@torch.library.custom_op("titan_draft::decode_attention", mutates_args=())
def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor,
                     scale: float | None, width: int) -> torch.Tensor:
    """decode_attention_reference's result (q [B, S, Hq, D], caches [B', L, Hkv, D] with a
    contiguous last dim, positions [B, S]), reading slots 0..max_s positions[b, s] of each row
    only. width: the slots any query may see (above every position); it sets the number of chunks,
    so the launch shape is static for a CUDA graph. An opaque op for torch.compile."""
    q = q if q.stride(-1) == 1 else q.contiguous()  # the kernels step the head dim by 1
    B, S, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    group = Hq // Hkv
    block_m = max(16, triton.next_power_of_2(S * group))  # tl.dot's smallest tile
    block_d = max(16, triton.next_power_of_2(D))
    wanted = min(MAX_SPLITS, max(1, TARGET_PROGRAMS // (B * Hkv)))
    chunk = BLOCK_N * triton.cdiv(triton.cdiv(width, wanted), BLOCK_N)
    splits = triton.cdiv(width, chunk)
    out = torch.empty_like(q)
    direct = splits == 1  # one chunk per row: its output is the answer, no merge
    # (direct: one-element stand-ins, never written: a kernel's pointer arguments must be real)
    parts = torch.empty(1 if direct else B * Hkv * splits * block_m * block_d, device=q.device,
                        dtype=torch.float64 if q.dtype == torch.float64 else torch.float32)
    lse = torch.empty(1 if direct else B * Hkv * splits * block_m, device=q.device, dtype=parts.dtype)
    positions = positions.contiguous()
    _chunk_attention[(B, Hkv, splits)](
        q, k_cache, v_cache, positions, parts, lse, out, scale if scale is not None else D ** -0.5, S, chunk, splits,
        q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1), out.stride(2),
        GROUP=group, HEAD_DIM=D, BLOCK_M=block_m, BLOCK_D=block_d, BLOCK_KEYS=BLOCK_N, IEEE=q.dtype == torch.float32,
        DIRECT=direct)
    if not direct:
        _merge_chunks[(B, Hkv, S * group)](parts, lse, out, splits, out.stride(0), out.stride(1), out.stride(2),
                                           GROUP=group, HEAD_DIM=D, BLOCK_M=block_m, BLOCK_D=block_d,
                                           BLOCK_SPLITS=triton.next_power_of_2(splits))
    return out


@decode_attention.register_fake
def _(q, k_cache, v_cache, positions, scale, width):
    return torch.empty_like(q)
