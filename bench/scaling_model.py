"""Analytic scaling model of context parallelism (CP) and the pipeline TapChannel (PP); docs/scaling_model.md.

    .venv/bin/python -m bench.scaling_model                                  # predictions + 122B extrapolation
    .venv/bin/python -m bench.scaling_model --load-balance outputs/bench_cp_balance.json \\
        --emulated outputs/bench_cp_emulated.json --scaling outputs/cp_scaling_*.json \\
        --tapchannel outputs/bench_tapchannel_overhead*.json --out outputs/scaling_model.json

Plain functions of sequence lengths, model shape and degrees (no torch needed but for the length
mixes). Given measured JSON files (bench/cp_attention.py (a) and (b), bench/cp_scaling.py,
bench/tapchannel_overhead.py) it prints predicted next to measured. Conventions: a "pair" is one
(query, key) of the causal same-document attention; W = CP degree; b = bytes per element.
"""
import argparse
import glob
import json
import os

# --------------------------------------------------------------------------------------------
# Assumptions for predictions (stated in docs/scaling_model.md)
# --------------------------------------------------------------------------------------------
H200 = dict(
    dense_bf16_flops=989e12,       # datasheet peak, dense bf16
    attn_fwd_flops=336e12,         # measured: PyTorch FA2 causal fwd, H200 (DESIGN.md section 5)
    attn_bwd_flops=336e12 * 0.75,  # assumed: FA2 backward reaches ~75% of its forward throughput
    linear_mfu=0.5,                # assumed fraction of dense peak reached by the GEMMs
    nvlink_bytes_per_s=450e9,      # NVLink 4 per direction per GPU (900 GB/s bidirectional)
    p2p_efficiency=0.7,            # assumed fraction of it one NCCL P2P ring hop reaches
    ib_bytes_per_s=50e9,           # one 400 Gb/s NDR NIC per GPU
    hbm_bytes=141e9,
    gpus_per_node=8,
)


# --------------------------------------------------------------------------------------------
# CP: compute
# --------------------------------------------------------------------------------------------


def padded_length(length: int, cp: int) -> int:
    """Zigzag pads every document to a multiple of 2 * cp."""
    return -(-length // (2 * cp)) * 2 * cp


def causal_pairs(lengths) -> int:
    """Causal same-document pairs of a packed sample: sum L (L + 1) / 2."""
    return sum(n * (n + 1) // 2 for n in lengths)


def zigzag_pairs_per_rank(lengths, cp: int) -> float:
    """Pairs each rank computes under zigzag CP, padding included. Rank r holds chunks r and 2W-1-r of
    c = Lp / 2W rows: (r + 2W-1-r) c^2 below the diagonal + 2 c (c+1)/2 on it = c (Lp + 1), the same
    for every rank: sum Lp (Lp + 1) / (2 W)."""
    return sum(p * (p + 1) for p in (padded_length(n, cp) for n in lengths)) / (2 * cp)


def padding_overhead(lengths, cp: int) -> float:
    """Padded pairs / real pairs: the zigzag's only imbalance-free loss (1 / it bounds efficiency)."""
    return cp * zigzag_pairs_per_rank(lengths, cp) / causal_pairs(lengths)


def attention_flops(pairs: float, heads: int, head_dim: int, branch_keys: int = 0, tokens: int = 0) -> dict:
    """Forward and backward FLOPs of attention over `pairs` (QK^T and PV: 2 x 2 flops per pair per
    head-dim; FA2 backward recomputes QK^T and does 4 more matmuls: 5 x 2). The branch adds
    `branch_keys` diagonal keys per query for `tokens` queries."""
    n = pairs + branch_keys * tokens
    return dict(forward=4 * n * heads * head_dim, backward=10 * n * heads * head_dim)


# --------------------------------------------------------------------------------------------
# CP: communication (per rank, one attention call, forward + backward)
# --------------------------------------------------------------------------------------------


def kv_shard_bytes(tokens: int, cp: int, kv_heads: int, head_dim: int, b: int) -> float:
    """K and V of one rank's rows."""
    return 2 * tokens / cp * kv_heads * head_dim * b


def ring_bytes(tokens, cp, kv_heads, head_dim, b=2) -> dict:
    """Bytes each rank sends (and receives) in cp_branch_attention(mode='ring'): forward W-1 K/V hops;
    backward W-1 K/V hops plus W hops of the float32 dK/dV accumulators (the last is the hop home)."""
    kv, dkv = kv_shard_bytes(tokens, cp, kv_heads, head_dim, b), kv_shard_bytes(tokens, cp, kv_heads, head_dim, 4)
    forward = (cp - 1) * kv
    backward = (cp - 1) * kv + (cp if cp > 1 else 0) * dkv
    return dict(per_step=kv, forward=forward, backward=backward, total=forward + backward)


def allgather_bytes(tokens, cp, kv_heads, head_dim, b=2) -> dict:
    """All-gather of K/V (forward) and reduce-scatter of dK/dV in K's dtype (backward): each rank
    receives / sends (W-1)/W of the whole K/V once each way."""
    kv = kv_shard_bytes(tokens, cp, kv_heads, head_dim, b)
    return dict(forward=(cp - 1) * kv, backward=(cp - 1) * kv, total=2 * (cp - 1) * kv)


def ring_overlap(lengths, cp, heads, kv_heads, head_dim, b=2, hw=H200, link_bytes_per_s=None) -> dict:
    """Per ring step: compute (1/W of the rank's pairs) vs the K/V hop. Overlap holds when
    compute >= communication; the ratio is what the ring can hide."""
    tokens = sum(padded_length(n, cp) for n in lengths)
    link = (link_bytes_per_s or hw["nvlink_bytes_per_s"]) * hw["p2p_efficiency"]
    step_pairs = zigzag_pairs_per_rank(lengths, cp) / cp
    flops = attention_flops(step_pairs, heads, head_dim)
    compute = dict(forward=flops["forward"] / hw["attn_fwd_flops"], backward=flops["backward"] / hw["attn_bwd_flops"])
    kv = kv_shard_bytes(tokens, cp, kv_heads, head_dim, b)
    comm = dict(forward=kv / link, backward=(kv + kv_shard_bytes(tokens, cp, kv_heads, head_dim, 4)) / link)
    return dict(compute_s=compute, comm_s=comm,
                hidden=all(compute[k] >= comm[k] for k in compute),
                compute_over_comm=min(compute[k] / comm[k] for k in compute))


def single_document_overlap_threshold(heads, kv_heads, b=2, hw=H200, link_bytes_per_s=None) -> float:
    """Tokens per rank above which one long document hides the forward K/V hop: a step's pairs are
    (T/W)^2 / 2, so 2 (T/W)^2 Hq D / F >= 2 (T/W) Hkv D b / B gives T/W >= Hkv b F / (Hq B)."""
    link = (link_bytes_per_s or hw["nvlink_bytes_per_s"]) * hw["p2p_efficiency"]
    return kv_heads * b * hw["attn_fwd_flops"] / (heads * link)


# --------------------------------------------------------------------------------------------
# CP: memory per rank of one branch-attention call (what bench/cp_attention.py (b) measures)
# --------------------------------------------------------------------------------------------


def attention_memory(tokens, cp, heads, kv_heads, head_dim, passes, mode, b=2) -> float:
    """Peak bytes of one rank in bench/cp_attention.py (b): its leaves and their grads (q, k, v,
    branch K/V), the saved out (q's dtype) and float32 lse, plus the op's peak working set:
    ring: K/V stack + receive buffer (b), backward fp32 dQ, dK/dV accumulator + in-flight copy;
    allgather: gathered K/V of all rows (b) and their fp32 dK/dV; dense: fp32 scores and
    probabilities [Hq, T/W, T] + bool mask (the naive baseline)."""
    t = tokens / cp
    q, kv = t * heads * head_dim, t * kv_heads * head_dim
    leaves = (q + 2 * kv + 2 * passes * kv) * b * 2 + q * b  # leaves + grads + upstream grad
    saved = q * b + heads * t * 4
    if mode == "ring":
        work = max(2 * 2 * kv * b + q * 4, 2 * 2 * kv * b + q * 4 + 2 * 2 * kv * 4)
    elif mode == "allgather":
        work = 2 * kv * cp * b + q * 4 + 2 * kv * cp * 4
    elif mode == "dense":
        work = 2 * heads * t * tokens * 4 + t * tokens + 2 * kv * cp * b
    elif mode == "single":
        work = q * 4 + 2 * kv * 4
    else:
        raise ValueError(f"mode: {mode!r}; use ring, allgather, dense or single")
    return leaves + saved + work


# --------------------------------------------------------------------------------------------
# Whole models: parameters, step compute, memory (for the extrapolation)
# --------------------------------------------------------------------------------------------


def dense_params(layers, dim, heads, kv_heads, head_dim, ffn, vocab) -> float:
    attn = dim * heads * head_dim * 2 + dim * kv_heads * head_dim * 2
    return layers * (attn + 3 * dim * ffn) + 2 * vocab * dim


def draft_params(dim, heads, kv_heads, head_dim, taps, draft_vocab) -> float:
    """EagleDraft: fc (taps*d -> d), one layer on 2d inputs, SwiGLU 4d, LM head over the draft vocabulary."""
    return taps * dim * dim + 2 * dim * (heads + 2 * kv_heads) * head_dim + heads * head_dim * dim \
        + 3 * dim * 4 * dim + draft_vocab * dim


# A dense stand-in for the 122B class (the reference 122B policy may be MoE: see the doc).
POLICY_122B = dict(layers=64, dim=12288, heads=96, kv_heads=8, head_dim=128, ffn=40960, vocab=151936,
                   taps=3, draft_vocab=32000, ttt_steps=3)


def cotrain_step(model, lengths, layout=(1, 1, 1, 1), ac=True, b=2, hw=H200) -> dict:
    """Per-rank time and memory of one co-training step (policy + draft forward and backward) of one
    packed sample under layout = (cp, tp, pp, dp): CP x TP x PP (DP = dp replicas, each with its own
    samples; FSDP shards the parameter state over dp x cp). The draft lives on the last PP stage (its
    cost is added there)."""
    m = model
    cp, tp, pp, dp = layout
    tokens = sum(lengths)
    t_rank = sum(padded_length(n, cp) for n in lengths) / cp
    p_policy = dense_params(m["layers"], m["dim"], m["heads"], m["kv_heads"], m["head_dim"], m["ffn"], m["vocab"])
    p_draft = draft_params(m["dim"], m["heads"], m["kv_heads"], m["head_dim"], m["taps"], m["draft_vocab"])
    pairs = zigzag_pairs_per_rank(lengths, cp)
    attn = attention_flops(pairs, m["heads"] // tp, m["head_dim"])
    recompute = 1 if ac else 0  # full AC: one more forward of every policy layer
    linear_flops = (6 + 2 * recompute) * p_policy / (tp * pp) * t_rank
    attn_flops = m["layers"] / pp * ((1 + recompute) * attn["forward"] + attn["backward"])
    draft_attn = attention_flops(pairs, m["heads"] // tp, m["head_dim"], branch_keys=m["ttt_steps"] - 1, tokens=t_rank)
    draft_flops = 6 * p_draft / tp * t_rank * m["ttt_steps"] + m["ttt_steps"] * (draft_attn["forward"]
                                                                                   + draft_attn["backward"])
    compute_s = (linear_flops / (hw["dense_bf16_flops"] * hw["linear_mfu"])
                 + attn_flops / hw["attn_fwd_flops"] * 0.5 + attn_flops / hw["attn_bwd_flops"] * 0.5
                 + draft_flops / (hw["dense_bf16_flops"] * hw["linear_mfu"]))
    # Communication: CP ring per attention call (policy layers on this stage + D draft passes).
    intra = cp * tp <= hw["gpus_per_node"]
    link = (hw["nvlink_bytes_per_s"] if intra else hw["ib_bytes_per_s"]) * hw["p2p_efficiency"]
    ring = ring_bytes(sum(padded_length(n, cp) for n in lengths), cp, max(1, m["kv_heads"] // tp), m["head_dim"], b)
    cp_calls = m["layers"] / pp * (1 + recompute) + m["ttt_steps"]
    cp_comm_s = cp_calls * ring["total"] / link
    overlap = ring_overlap(lengths, cp, m["heads"] // tp, max(1, m["kv_heads"] // tp), m["head_dim"], b, hw,
                           None if intra else hw["ib_bytes_per_s"])
    # TP: 2 all-reduces of [t_rank, d] per layer forward, 2 backward (ring all-reduce: 2 (tp-1)/tp).
    tp_bytes = 4 * m["layers"] / pp * t_rank * m["dim"] * b * 2 * (tp - 1) / tp
    tp_comm_s = tp_bytes / (hw["nvlink_bytes_per_s"] * hw["p2p_efficiency"])
    # Memory: fp32 master + grad + Adam m, v (16 B/param) sharded over TP x PP x FSDP (dp x cp);
    # activations per layer ~ 34 d bytes per token (bf16, flash attention: Korthikanti et al.), TP-split
    # except the layer input; full AC keeps only the layer inputs plus one layer's working set.
    state = 16 * (p_policy / (tp * pp) + p_draft / tp) / (dp * cp)
    per_layer = 34 * m["dim"] * t_rank / tp
    act = (m["layers"] / pp * m["dim"] * t_rank * b + per_layer) if ac else m["layers"] / pp * per_layer
    logits = 3 * t_rank * m["vocab"] * 4 / tp  # fp32 logits, log-softmax and grad on the last stage
    draft_act = m["ttt_steps"] * (per_layer * 1.5 + 3 * t_rank * m["draft_vocab"] * 4)
    taps = (1 + m["taps"]) * t_rank * m["dim"] * b
    return dict(tokens=tokens, tokens_per_rank=t_rank, gpus=cp * tp * pp * dp, policy_params=p_policy,
                draft_params=p_draft, compute_s=compute_s, cp_comm_s=cp_comm_s, cp_comm_hidden=overlap["hidden"],
                ring_compute_over_comm=overlap["compute_over_comm"], tp_comm_s=tp_comm_s,
                state_gb=state / 1e9, activation_gb=(act + logits + draft_act + taps) / 1e9,
                memory_gb=(state + act + logits + draft_act + taps) / 1e9, cp_link="NVLink" if intra else "IB")


# --------------------------------------------------------------------------------------------
# PP: TapChannel volume, slot memory, bubbles
# --------------------------------------------------------------------------------------------


def tapchannel_bytes_per_microbatch(mb_tokens, dim, taps_on_stage, has_embeddings, b=2) -> float:
    """One stage's put per microbatch: [S, B, width], width = dim x (embeddings? + its tap layers)."""
    return mb_tokens * dim * (int(has_embeddings) + taps_on_stage) * b


def schedule_bytes_per_microbatch(mb_tokens, dim, b=2) -> float:
    """The schedule's own P2P per stage boundary per microbatch: activation forward + its grad backward."""
    return 2 * mb_tokens * dim * b


def tap_stages(layers, tap_layers, pp, virtual=1) -> list[int]:
    """Tap layers held by each of pp * virtual stages (torchtitan's even split)."""
    stages = pp * virtual
    per = [layers // stages + (1 if s < layers % stages else 0) for s in range(stages)]
    bounds = [sum(per[:s]) for s in range(stages + 1)]
    return [sum(bounds[s] <= t < bounds[s + 1] for t in tap_layers) for s in range(stages)]


def tapchannel_slot_bytes(mb_tokens, dim, widths_by_stage: dict[int, int], pp, b=2) -> float:
    """Landing slots on the draft stage: 2 (pp - r) per producer stage r (DESIGN.md 1b)."""
    return sum(2 * (pp - min(r, pp - 1)) * mb_tokens * dim * w * b for r, w in widths_by_stage.items())


def bubble_fraction(pp, microbatches, virtual=1) -> float:
    """Idle fraction of a step: 1F1B (virtual = 1) and interleaved 1F1B (virtual stages per rank)."""
    return (pp - 1) / (virtual * microbatches + pp - 1)


def tapchannel_overhead(mb_tokens, dim, layers, tap_layers, *, schedule: tuple[int, int, int], step_s, b=2,
                        link_bytes_per_s=H200["nvlink_bytes_per_s"] * H200["p2p_efficiency"]) -> dict:
    """Predicted TapChannel cost: its bytes per step, the transfer time if nothing overlapped (an upper
    bound: the puts are asynchronous and land while later microbatches compute), relative to the step.
    schedule = (pp, microbatches, virtual stages per rank)."""
    pp, microbatches, virtual = schedule
    taps = tap_stages(layers, tap_layers, pp, virtual)
    per_mb = sum(tapchannel_bytes_per_microbatch(mb_tokens, dim, n, s == 0, b)
                 for s, n in enumerate(taps) if s < pp * virtual - 1 and (n or s == 0))
    sched = schedule_bytes_per_microbatch(mb_tokens, dim, b) * (pp * virtual - 1)
    transfer = per_mb * microbatches / link_bytes_per_s
    return dict(channel_bytes_per_mb=per_mb, schedule_bytes_per_mb=sched, channel_over_schedule=per_mb / sched,
                unhidden_upper_bound=transfer / step_s if step_s else None)


# --------------------------------------------------------------------------------------------
# Comparisons against measured JSON
# --------------------------------------------------------------------------------------------


def lengths_of(args: dict) -> list[int]:
    import torch

    from bench._common import document_lengths

    return document_lengths(args["mix"], args["total"], torch.Generator().manual_seed(args["seed"]),
                            multiple=args.get("multiple", 1))


def compare_load_balance(path) -> list[dict]:
    """bench/cp_attention.py (a): zigzag max/mean (model: exactly 1) and padded/real pairs (model: formula)."""
    import torch

    from bench._common import document_lengths

    with open(path) as f:
        data = json.load(f)
    rows = []
    for r in data["load_balance"]:
        lengths = document_lengths(r["mix"], data["args"]["total"], torch.Generator().manual_seed(data["args"]["seed"]))
        rows.append(dict(mix=r["mix"], cp=r["cp"], measured_max_over_mean=r["zigzag_max_over_mean"],
                         predicted_max_over_mean=1.0, measured_padded_over_real=r["zigzag_padded_over_real"],
                         predicted_padded_over_real=padding_overhead(lengths, r["cp"])))
    print(f"load balance ({path}): predicted vs measured")
    print(f"{'mix':>10} {'CP':>3} {'max/mean pred':>13} {'meas':>8} {'pad pred':>9} {'meas':>8}")
    for r in rows:
        print(f"{r['mix']:>10} {r['cp']:>3} {r['predicted_max_over_mean']:>13.4f} {r['measured_max_over_mean']:>8.4f} "
              f"{r['predicted_padded_over_real']:>9.4f} {r['measured_padded_over_real']:>8.4f}")
    return rows


def compare_emulated(path) -> list[dict]:
    """bench/cp_attention.py (b): per-rank compute efficiency bound (1 / padding) and peak memory."""
    with open(path) as f:
        data = json.load(f)
    a = data["args"]
    lengths = lengths_of(dict(a, multiple=2 * max(a["cp"])))
    b = 4 if data.get("device", "cpu") == "cpu" else 2  # (b) runs bf16 on GPUs, float32 on CPU
    rows = []
    for r in data["emulated_ring"]:
        cp, mode = r["cp"], r["mode"]
        pred_eff = 1 / padding_overhead(lengths, cp) if cp > 1 else 1.0
        pred_mem = attention_memory(a["total"], cp, a["heads"], a["kv_heads"], a["head_dim"], a["passes"], mode, b)
        rows.append(dict(cp=cp, mode=mode, measured_efficiency=r["efficiency"], predicted_efficiency_bound=pred_eff,
                         measured_peak_gib=r["peak_gib"], predicted_peak_gib=pred_mem / 2 ** 30))
    print(f"emulated per-rank compute and memory ({path}): predicted vs measured (no communication)")
    print(f"{'CP':>3} {'mode':>10} {'eff. bound':>10} {'meas':>6} {'GiB pred':>9} {'meas':>8}")
    for r in rows:
        eff = "-" if r["measured_efficiency"] is None else f"{r['measured_efficiency']:.3f}"
        peak = r["measured_peak_gib"]
        peak = peak if isinstance(peak, str) or peak is None else f"{peak:.2f}"
        print(f"{r['cp']:>3} {r['mode']:>10} {r['predicted_efficiency_bound']:>10.3f} {eff:>6} "
              f"{r['predicted_peak_gib']:>9.2f} {str(peak):>8}")
    return rows


def compare_scaling(paths) -> list[dict]:
    """bench/cp_scaling.py: measured efficiency vs the padding bound, ring/allgather bytes per rank,
    and whether the model says the ring hides its hops (GPU runs; CPU runs are printed as measured)."""
    rows = []
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        a, world = data["args"], data["world_size"]
        for r in data["rows"]:
            if r["part"] != "attention":
                lengths = lengths_of(a)
                comm = None
            else:
                lengths = lengths_of(dict(a, multiple=2 * a["max_cp"]))
                b = 2 if a["param_dtype"] == "bfloat16" else 4
                fn = ring_bytes if r["mode"] == "ring" else allgather_bytes
                comm = fn(a["total"], world, a["kv_heads"], a["head_dim"], b)["total"] if world > 1 else 0
            rows.append(dict(file=os.path.basename(path), device=data.get("device"), part=r["part"], mode=r["mode"],
                             cp=world, seconds=r["seconds"], measured_efficiency=r.get("efficiency"),
                             padding_bound=1 / padding_overhead(lengths, world) if world > 1 else 1.0,
                             predicted_comm_bytes_per_rank=comm,
                             peak_gib=max(r["peak_bytes"]) / 2 ** 30 if r.get("peak_bytes") else None))
    print("cp_scaling runs: measured efficiency vs the padding bound (1 / padded-over-real pairs)")
    print(f"{'device':>24} {'part':>9} {'mode':>9} {'CP':>3} {'ms':>9} {'eff.':>6} {'bound':>6} {'comm MB/rank':>12} "
          f"{'peak GiB':>8}")
    for r in rows:
        eff = "-" if r["measured_efficiency"] is None else f"{r['measured_efficiency']:.3f}"
        comm = "-" if r["predicted_comm_bytes_per_rank"] is None else f"{r['predicted_comm_bytes_per_rank'] / 1e6:.2f}"
        peak = "n/a" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}"
        print(f"{str(r['device'])[:24]:>24} {r['part']:>9} {r['mode']:>9} {r['cp']:>3} {1e3 * r['seconds']:>9.1f} "
              f"{eff:>6} {r['padding_bound']:>6.3f} {comm:>12} {peak:>8}")
    return rows


def compare_tapchannel(paths) -> list[dict]:
    rows = []
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        a, pp = data["args"], data["world_size"]
        virtual = 2 if a["schedule"].startswith("Interleaved") else 1
        taps = a["tap_layers"] or sorted({1, a["layers"] // 2 - 1, a["layers"] - 1})
        b = 2 if (a.get("dtype") or ("bfloat16" if data.get("device", "cpu") != "cpu" else "float32")) == "bfloat16" \
            else 4
        model = tapchannel_overhead(a["microbatch"] * a["seq"], a["dim"], a["layers"], taps,
                                    schedule=(pp, a["microbatches"], virtual), step_s=data["median_s"]["twin"], b=b)
        rows.append(dict(file=os.path.basename(path), schedule=a["schedule"], pp=pp, device=data.get("device"),
                         measured_overhead=data["overhead_ratio"] - 1, **model,
                         bubble=bubble_fraction(pp, a["microbatches"], virtual)))
    print("TapChannel: measured overhead vs the model's volume (channel / schedule bytes per microbatch)")
    print(f"{'schedule':>16} {'PP':>3} {'device':>10} {'meas. overhead':>14} {'chan/sched bytes':>16} {'bubble':>7}")
    for r in rows:
        print(f"{r['schedule']:>16} {r['pp']:>3} {str(r['device'])[:10]:>10} {r['measured_overhead']:>+14.3%} "
              f"{r['channel_over_schedule']:>16.2f} {r['bubble']:>7.3f}")
    return rows


# --------------------------------------------------------------------------------------------
# Predictions and the 122B extrapolation
# --------------------------------------------------------------------------------------------

LAYOUTS = [  # (cp, tp, pp, dp): GPUs = product
    (8, 8, 1, 1), (8, 4, 2, 1), (4, 8, 2, 1), (16, 4, 1, 1), (8, 8, 2, 1), (16, 8, 1, 1), (16, 4, 2, 1),
    (32, 4, 1, 1), (8, 8, 4, 1),
]


def predictions(total: int, mix: str, seed: int) -> dict:
    import torch

    from bench._common import document_lengths

    out = {}
    draft = dict(heads=32, kv_heads=8, head_dim=128)
    print(f"(1) draft branch attention (Hq 32, Hkv 8, D 128, bf16) at {total} tokens: per rank, per call")
    print(f"{'mix':>10} {'CP':>3} {'pairs/rank':>12} {'pad':>6} {'ring MB':>8} {'allg MB':>8} {'ring step: comp/comm':>21}")
    rows = []
    for m in ("lognormal", "one_long", "single"):
        lengths = [total] if m == "single" else document_lengths(m, total, torch.Generator().manual_seed(seed))
        for cp in (1, 2, 4, 8, 16, 32):
            ring = ring_bytes(total, cp, draft["kv_heads"], draft["head_dim"])
            allg = allgather_bytes(total, cp, draft["kv_heads"], draft["head_dim"])
            ov = ring_overlap(lengths, cp, **draft) if cp > 1 else None
            rows.append(dict(mix=m, cp=cp, pairs_per_rank=zigzag_pairs_per_rank(lengths, cp),
                             padded_over_real=padding_overhead(lengths, cp), ring_bytes=ring["total"],
                             allgather_bytes=allg["total"], ring_compute_over_comm=ov and ov["compute_over_comm"]))
            r = rows[-1]
            ratio = "-" if ov is None else f"{ov['compute_over_comm']:.1f}"
            print(f"{m:>10} {cp:>3} {r['pairs_per_rank']:>12.3e} {r['padded_over_real']:>6.3f} "
                  f"{ring['total'] / 1e6:>8.1f} {allg['total'] / 1e6:>8.1f} {ratio:>21}")
    out["attention"] = rows
    print(f"one long document hides the forward ring hop above "
          f"{single_document_overlap_threshold(32, 8):.0f} tokens per rank (NVLink), "
          f"{single_document_overlap_threshold(32, 8, link_bytes_per_s=H200['ib_bytes_per_s']):.0f} (IB)")
    mem = []
    print(f"(2) per-rank memory of one draft attention call at {total} tokens (GiB)")
    print(f"{'CP':>3} {'ring':>8} {'allgather':>10} {'dense mask':>11}")
    for cp in (1, 2, 4, 8, 16):
        r = {mode: attention_memory(total, cp, 32, 8, 128, 2, mode) / 2 ** 30 for mode in ("ring", "allgather", "dense")}
        mem.append(dict(cp=cp, **r))
        print(f"{cp:>3} {r['ring']:>8.2f} {r['allgather']:>10.2f} {r['dense']:>11.1f}")
    out["attention_memory"] = mem

    m = POLICY_122B
    lengths = document_lengths(mix, total, torch.Generator().manual_seed(seed))
    print(f"(3) {total} tokens per sample ({mix}), dense 122B stand-in: L {m['layers']} d {m['dim']} Hq {m['heads']} "
          f"Hkv {m['kv_heads']} D {m['head_dim']} ffn {m['ffn']} vocab {m['vocab']}, "
          f"{dense_params(m['layers'], m['dim'], m['heads'], m['kv_heads'], m['head_dim'], m['ffn'], m['vocab']) / 1e9:.1f}B "
          f"params; full AC; one sample per CP group")
    print(f"{'CP':>3} {'TP':>3} {'PP':>3} {'GPUs':>5} {'tok/rank':>9} {'compute s':>9} {'CP comm s':>9} {'hidden':>6} "
          f"{'TP comm s':>9} {'mem GB':>7} {'fits':>5}")
    layouts = []
    for cp, tp, pp, dp in LAYOUTS:
        r = cotrain_step(m, lengths, (cp, tp, pp, dp))
        r.update(cp=cp, tp=tp, pp=pp, dp=dp, fits=r["memory_gb"] < H200["hbm_bytes"] / 1e9 * 0.9)
        layouts.append(r)
        print(f"{cp:>3} {tp:>3} {pp:>3} {r['gpus']:>5} {r['tokens_per_rank']:>9.0f} {r['compute_s']:>9.2f} "
              f"{r['cp_comm_s']:>9.2f} {str(r['cp_comm_hidden']):>6} {r['tp_comm_s']:>9.2f} {r['memory_gb']:>7.1f} "
              f"{str(r['fits']):>5}")
    out["extrapolation_122b"] = layouts
    pp_rows = []
    print("(4) TapChannel vs schedule bytes per microbatch, 122B stand-in, taps (1, 31, 60), 4K-token microbatches")
    print(f"{'PP':>3} {'virt':>4} {'channel MB':>10} {'schedule MB':>11} {'ratio':>6} {'bubble m=16':>11}")
    for pp in (2, 4, 8):
        for virtual in (1, 2):
            r = tapchannel_overhead(4096, m["dim"], m["layers"], [1, 31, 60], schedule=(pp, 16, virtual),
                                    step_s=None)
            r.update(pp=pp, virtual=virtual, bubble=bubble_fraction(pp, 16, virtual))
            pp_rows.append(r)
            print(f"{pp:>3} {virtual:>4} {r['channel_bytes_per_mb'] / 1e6:>10.1f} {r['schedule_bytes_per_mb'] / 1e6:>11.1f} "
                  f"{r['channel_over_schedule']:>6.2f} {r['bubble']:>11.3f}")
    out["tapchannel_122b"] = pp_rows
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--total", type=int, default=256 * 1024)
    p.add_argument("--mix", default="lognormal")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--load-balance", default=None, help="JSON of bench/cp_attention.py (a)")
    p.add_argument("--emulated", default=None, help="JSON of bench/cp_attention.py --emulate-ring (b)")
    p.add_argument("--scaling", nargs="*", default=[], help="JSONs of bench/cp_scaling.py (globs allowed)")
    p.add_argument("--tapchannel", nargs="*", default=[], help="JSONs of bench/tapchannel_overhead.py")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    result = dict(assumptions=H200, policy_122b=POLICY_122B, predictions=predictions(args.total, args.mix, args.seed))
    expand = lambda pats: sorted({f for pat in pats for f in glob.glob(pat)})  # noqa: E731
    if args.load_balance:
        result["load_balance"] = compare_load_balance(args.load_balance)
    if args.emulated:
        result["emulated"] = compare_emulated(args.emulated)
    if args.scaling:
        result["scaling"] = compare_scaling(expand(args.scaling))
    if args.tapchannel:
        result["tapchannel"] = compare_tapchannel(expand(args.tapchannel))
    if args.out:
        from bench._common import write_json

        write_json(args.out, result)


if __name__ == "__main__":
    main()
