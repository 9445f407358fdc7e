"""The rollout engine's decode step at a real size, against the GPU's memory-bandwidth roofline, and
where its time goes.

Per batch size B, as the engine runs them (CUDA graphs on CUDA), side by side in one process:
- plain_step_ms: the policy's forward of one position per row, then sampling (a K = 0 step's target work);
- verify_step_ms[K]: the forward of K + 1 positions per row, then the acceptance rule;
- decode_step_ms[K]: the engine's whole step with K drafts (drafting, verify, acceptance, the
  draft's trunk extension: `rollout.measure.measure_steps`);
- roofline_ms: the bytes a plain step must read (every weight but the embedding table, that table's
  B rows, and the live KV cache: B rows x `--context` positions) over the read bandwidth measured
  in the same run (`x.sum()` over a buffer of the weights' size, best of 10).
Each engine variant (`--variants`: eager kernels; the blocks compiled by torch.compile; compiled
with every projection through cuBLAS instead of the few-row kernel, `rollout.few_row_linear = false`)
is timed on the same shapes; with --profile, a plain step, a verify step and the whole step (drafting
included) at the largest K are each split into their kernels by kind (GEMMs, attention, norms,
compiled Triton, sampling, indexing, ...) and the time the GPU idles between them, from
torch.profiler over graph replays.

Weights are the preset's random initialisation: a step's cost does not depend on their values.

  python -m bench.decode_step                                   # one H200: the qwen3 1.7B preset's shapes
  python -m bench.decode_step --batch-sizes 1 16 --profile      # with the kernel split
  python -m bench.decode_step --preset smoke                    # CPU, seconds: tiny shapes (the test's)
Prints the tables and writes bench/results/decode_step_<preset>_<device>.json (--out to change).
"""
import argparse
import os
import re
from collections import defaultdict
from functools import partial

import torch

from bench._common import REPO_ROOT, device_tag, environment, median_time, synchronize, write_json
from bench._job import add_job_arguments, job_config, resolve_preset
from titan_draft.models import build_models
from titan_draft.parallel.parallelize import compute_dtype
from titan_draft.plan import build_plan
from titan_draft.rollout import EngineOptions, RolloutEngine
from titan_draft.rollout.cached_model import cache_width
from titan_draft.rollout.graphs import StepShape
from titan_draft.rollout.measure import measure_steps
from titan_draft.rollout.sampling import sample_from_logits

PRESETS = {
    "qwen3_1.7b": dict(config="train_configs/qwen3_1.7b_arith_tail.toml", batch_sizes=[1, 16, 128]),
    "smoke": dict(config="train_configs/arith_gpu_tail.toml", batch_sizes=[1, 4], repeats=2,
                  overrides=["--model.flavor", "tiny_gqa", "--training.seq_len", "64", "--draft.vocab_size", "0",
                             "--task.answer_len_min", "10", "--task.answer_len_median", "20",
                             "--task.answer_len_max", "40"],
                  context=16, variants=["eager"]),
}
# Engine variants: the blocks as PyTorch ops or through torch.compile (rollout.compile), both with the
# few-row projections (rollout.few_row_linear); compiled_cublas: compiled, every projection through cuBLAS.
VARIANTS = ["eager", "compiled", "compiled_cublas"]
# Kernel kinds of the profile, the first matching pattern (of the kernel's name) wins.
KERNEL_KINDS = [
    ("compiled (Triton)", r"^triton_"),  # inductor's fused kernels (their names list the ops they fuse)
    ("attention", r"_chunk_attention|_merge_chunks|fmha|flash|attention|cudnn|sdpa|mem_eff"),
    ("GEMM", r"skinny_linear|gemm|gemv|nvjet|cutlass|xmma|cublas|splitk"),
    ("norm", r"rms|norm"),
    ("sampling", r"softmax|exponential|argmax|argmin|distribution|philox|uniform|cumsum|sort|max"),
    ("index / copy", r"index|scatter|gather|copy|cat|fill|memcpy|memset|where|arange"),
    ("elementwise / reduce", r"elementwise|vectorized|unrolled|reduce"),
]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_job_arguments(p, PRESETS, default="qwen3_1.7b" if torch.cuda.is_available() else "smoke")
    p.add_argument("--batch-sizes", type=int, nargs="+", help="default: the preset's")
    p.add_argument("--context", type=int, help="tokens in each row's cache (default 512; smoke 16)")
    p.add_argument("--variants", nargs="+", choices=VARIANTS, help="default: eager and compiled (smoke: eager)")
    p.add_argument("--repeats", type=int, help="timed replays per step, median kept (default 20)")
    p.add_argument("--profile", action="store_true", help="split steps into kernel kinds (torch.profiler)")
    p.add_argument("--out", help="JSON path (default bench/results/decode_step_<preset>_<device>.json)")
    args = p.parse_args()
    preset = resolve_preset(args, PRESETS)
    args.batch_sizes = args.batch_sizes or preset["batch_sizes"]
    args.context = args.context or preset.get("context", 512)
    args.variants = args.variants or preset.get("variants", ["eager", "compiled"])
    args.repeats = args.repeats or preset.get("repeats", 20)
    return args


def read_bandwidth(nbytes: int, device: torch.device) -> float | None:
    """Bytes per second at which the device reads a buffer of nbytes (x.sum(), best of 10); None off CUDA."""
    if device.type != "cuda":
        return None
    x = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=device)
    x.sum()
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        x.sum()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del x
    return nbytes / min(times)


def plain_step_bytes(engine: RolloutEngine, batch: int, context: int) -> int:
    """What a plain decode step must read: every policy weight but the embedding table, its B rows, and
    the live keys and values (B rows x context positions in every layer)."""
    policy = engine.policy
    table = policy.tok_embeddings.weight
    weights = sum(p.nbytes for p in policy.parameters()) - table.nbytes + batch * table[0].nbytes
    kv = sum(cache[0, 0].nbytes for cache in engine.model.caches()[:2 * len(engine.k_cache)]) * batch * context
    return weights + kv


def target_step(engine: RolloutEngine, batch: int, k: int, *, context: int, temperature: float):
    """The target's work of a step with k drafts, as the engine's step runs it (no host sync), as a
    `captured` call: the policy's forward of k + 1 positions after `context` cached ones, then
    sampling (k = 0) or the acceptance rule (top-p 1) against fixed proposals of a uniform draft."""
    device = engine.device
    tokens = torch.zeros(batch, k + 1, dtype=torch.long, device=device)
    positions = torch.arange(k + 1, device=device) + context - 1
    positions = positions.expand(batch, -1)
    width = cache_width(engine.row_state.slots, context + engine.max_k)
    draft_ids = torch.zeros(batch, k, dtype=torch.long, device=device)
    draft_logits = torch.zeros(batch, k, len(engine._target_ids), dtype=engine.dtype, device=device)

    def call():
        logits, _, _ = engine.model.policy_forward(tokens, positions, width)
        if k:
            engine._accept(draft_ids, draft_logits, logits, temperature=temperature, top_p=1.0, noise=engine._rng)
        else:
            sample_from_logits(logits, temperature, top_p=1.0, rng=engine._rng)
    return captured(engine, ("target", batch, k, context, temperature), call)


def captured(engine: RolloutEngine, key: tuple, fn):
    """fn as one of the engine's captured calls under key (the first fn given for a key stays): kept
    with the engine's own graphs, since a graph of their shared pool must not go while others live."""
    steps = engine.graphs.steps
    if key not in steps:
        steps[key] = engine.graphs.captured(fn)
    return steps[key]


def whole_step(engine: RolloutEngine, batch: int):
    """The engine's captured decode step of `batch` rows with max_k drafts (measure_steps captures
    it), or None (no CUDA graphs)."""
    return next((call for key, call in engine.graphs.steps.items()
                 if isinstance(key, StepShape) and key.full == key.rows == batch and key.k == engine.max_k), None)


def kernel_profile(call, engine: RolloutEngine, replays: int = 10) -> dict | None:
    """One captured call split by kernel kind: {kind: {"ms", "kernels"}} per call, the call's time
    (graph replays back to back) and `idle_ms`, the part of it with no kernel running; None off CUDA."""
    if engine.device.type != "cuda" or call is None:
        return None
    from torch.profiler import ProfilerActivity, profile

    call()
    synchronize(engine.device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start.record()
        for _ in range(replays):
            call()
        end.record()
        synchronize(engine.device)
    kinds = defaultdict(lambda: dict(ms=0.0, kernels=0))
    top = defaultdict(float)
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA or event.device_time <= 0:
            continue
        name = event.name
        kind = next((k for k, pattern in KERNEL_KINDS if re.search(pattern, name, re.IGNORECASE)), "other")
        kinds[kind]["ms"] += event.device_time / 1e3 / replays
        kinds[kind]["kernels"] += 1 / replays
        top[name[:90]] += event.device_time / 1e3 / replays
    step_ms = start.elapsed_time(end) / replays
    busy = sum(k["ms"] for k in kinds.values())
    return dict(step_ms=step_ms, busy_ms=busy, idle_ms=step_ms - busy, kinds=dict(kinds),
                top_kernels=dict(sorted(top.items(), key=lambda item: -item[1])[:15]))


def build_engine(cfg, policy, draft, layers, batch: int, variant: str) -> RolloutEngine:
    device = next(policy.parameters()).device
    engine = RolloutEngine(policy.model_args, draft.args, layers, batch, cfg.training.seq_len, device,
                           compute_dtype(cfg.training.mixed_precision_param, device),
                           options=EngineOptions(max_speculative_tokens=cfg.rollout.num_speculative_tokens,
                                                 compile=variant != "eager",
                                                 few_row_linear=variant != "compiled_cublas"))
    engine.load_weights(policy, draft)
    return engine


def step_costs(engine: RolloutEngine, batch: int, context: int, temperature: float, top_p: float, repeats: int,
               bandwidth: float | None) -> dict:
    """plain_step_ms, verify_step_ms {K: ms}, verify_over_plain, decode_step_ms {K: ms} (K = 0..max_k),
    plain_step_bytes and roofline_ms (None without a bandwidth) of `engine` at `batch` rows of
    `context` cached tokens. Scribbles on the engine's state: run it between generations."""
    engine.reserve(batch, context + engine.max_k + 1)
    target = partial(target_step, engine, batch, context=context, temperature=temperature)
    seconds = partial(median_time, warmup=1, iters=repeats, device=engine.device, queued=True)
    plain = seconds(target(0))[0]
    verify = {k: seconds(target(k))[0] for k in range(1, engine.max_k + 1)}
    steps = measure_steps(engine, batch, engine.max_k, temperature, top_p, context, repeats=repeats)
    nbytes = plain_step_bytes(engine, batch, context)
    roofline_ms = None if bandwidth is None else 1e3 * nbytes / bandwidth
    return dict(plain_step_ms=1e3 * plain, verify_step_ms={k: 1e3 * s for k, s in verify.items()},
                verify_over_plain={k: s / plain for k, s in verify.items()},
                decode_step_ms={k: 1e3 * steps[batch, k] for k in range(engine.max_k + 1)},
                plain_step_bytes=nbytes, roofline_ms=roofline_ms,
                roofline_over_plain=roofline_ms and roofline_ms / (1e3 * plain))


def measure(cfg, models, a, batch: int, variant: str, bandwidth: float | None) -> dict:
    """One row: every step kind at `batch` rows for one engine variant."""
    policy, draft, layers = models
    engine = build_engine(cfg, policy, draft, layers, batch, variant)
    T = cfg.rollout.temperature
    row = dict(variant=variant, batch=batch, context=a.context,
               **step_costs(engine, batch, a.context, T, cfg.rollout.top_p, a.repeats, bandwidth))
    if a.profile:
        target = partial(target_step, engine, batch, context=a.context, temperature=T)
        row["profile"] = {"plain": kernel_profile(target(0), engine),
                          f"verify K={engine.max_k}": kernel_profile(target(engine.max_k), engine),
                          f"whole step K={engine.max_k}": kernel_profile(whole_step(engine, batch), engine)}
    return row


def print_row(row: dict) -> None:
    verify = " ".join(f"{ms:6.2f}" for ms in row["verify_step_ms"].values())
    steps = " ".join(f"{ms:6.2f}" for ms in row["decode_step_ms"].values())
    roof = "   n/a" if row["roofline_ms"] is None else f"{row['roofline_ms']:6.3f} {row['roofline_over_plain']:5.2f}"
    worst = max(row["verify_over_plain"].values())
    print(f"{row['variant']:>9} {row['batch']:>5} {row['plain_step_ms']:7.3f} {roof} | {verify} | max {worst:4.2f}x "
          f"| {steps}", flush=True)
    for name, prof in (row.get("profile") or {}).items():
        if prof is None:
            continue
        parts = ", ".join(f"{kind} {v['ms']:.3f} ms ({v['kernels']:.0f})"
                          for kind, v in sorted(prof["kinds"].items(), key=lambda kv: -kv[1]["ms"]))
        print(f"          {name}: {prof['step_ms']:.3f} ms = idle {prof['idle_ms']:.3f} + {parts}")


def main():
    a = parse_args()
    cfg = job_config(a.config, a.overrides)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    _, policy, draft = build_models(cfg, device)
    layers = build_plan(cfg, 1).tap_layers
    weight_bytes = sum(p.numel() for p in policy.parameters()) * 2
    bandwidth = read_bandwidth(weight_bytes, device)
    print(f"{cfg.model.name} '{cfg.model.flavor}': {weight_bytes / 2 ** 30:.2f} GiB of bf16 weights; read bandwidth "
          f"{'n/a' if bandwidth is None else f'{bandwidth / 1e12:.2f} TB/s'}; context {a.context}")
    print(f"{'variant':>9} {'batch':>5} {'plain':>7} {'roof':>6} {'frac':>5} | verify ms K=1..{cfg.rollout.num_speculative_tokens} "
          f"| verify/plain | whole step ms K=0..{cfg.rollout.num_speculative_tokens}")
    out = a.out or os.path.join(REPO_ROOT, "bench", "results", f"decode_step_{a.preset}_{device_tag(device)}.json")
    report = dict(preset=a.preset, config=a.config, overrides=a.overrides, args=vars(a), **environment(),
                  read_bandwidth_bytes_s=bandwidth, weight_bytes=weight_bytes, rows=[])
    for batch in a.batch_sizes:
        for variant in a.variants:
            report["rows"].append(measure(cfg, (policy, draft, layers), a, batch, variant, bandwidth))
            print_row(report["rows"][-1])
            write_json(out, report)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
