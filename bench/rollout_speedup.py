"""Speculative vs plain generation in the same RolloutEngine, batch sizes 1..64, on trained models.

The policy is SFT-trained on the sort task (correct answers) and the EAGLE-3 draft warm-started on
its taps, with the project's own training helpers (titan_draft.warmstart), until the draft's
acceptance length reaches --min-acceptance. Then, per batch size, the same prompts are generated
with K = 0 (baseline) and K = --k draft tokens; the table reports acceptance length and tokens/s.

  .venv/bin/python bench/rollout_speedup.py --out /tmp/rollout_cpu.json            # minutes on 2 idle cores
  python bench/rollout_speedup.py --device cuda --out /tmp/rollout_gpu.json
"""
import argparse
import json
import statistics
import tempfile
import time

import torch

from titan_draft import _compat  # noqa: F401  (before torchtitan)
from titan_draft.config import default_tap_layers
from titan_draft.metrics import MetricsLogger
from titan_draft.models.draft import EagleDraft, draft_args_for
from titan_draft.models.policy import build_policy, model_args
from titan_draft.rollout import RolloutEngine
from titan_draft.task import SortTask
from titan_draft.warmstart import draft_vocab_from_data, sft_policy, warmup_draft

DEVICE_DEFAULTS = {
    "cpu": dict(flavor="tiny", dtype="float32", sft_steps=200, draft_steps=100, batch_size=16),
    "cuda": dict(flavor="small", dtype="bfloat16", sft_steps=400, draft_steps=300, batch_size=32),
}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--flavor", help="policy flavor (titan_draft.models.policy); default tiny on cpu, small on cuda")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], help="engine dtype")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--k", type=int, default=4, help="draft tokens per verify forward")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--sft-steps", type=int)
    p.add_argument("--draft-steps", type=int, help="draft warm-up steps per round")
    p.add_argument("--max-draft-rounds", type=int, default=4)
    p.add_argument("--min-acceptance", type=float, default=2.0)
    p.add_argument("--repeats", type=int, default=3, help="timed generations per (batch size, mode); median")
    p.add_argument("--compile", action="store_true", help="torch.compile the engine's decode steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="JSON output path")
    args = p.parse_args()
    for key, value in DEVICE_DEFAULTS[args.device].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if args.k < 1:
        p.error("--k must be >= 1")
    return args


def train_models(args, task, device):
    """SFT the policy, then warm up the draft until its measured acceptance length is high enough."""
    seq_len = task.prompt_len + task.answer_len + 8
    policy_args = model_args("llama3", args.flavor, seq_len)
    policy = build_policy("llama3", args.flavor, seq_len, seed=args.seed)
    layers = default_tap_layers(policy_args.n_layers)
    draft = EagleDraft(draft_args_for(policy_args, len(layers), draft_vocab_size=20)).to(device)
    draft.init_weights()
    gen = torch.Generator().manual_seed(args.seed)
    metrics = MetricsLogger(tempfile.mkdtemp(prefix="rollout_bench_"), tensorboard=False)
    log = {}
    t0 = time.perf_counter()
    sft_policy(policy, task, args.sft_steps, 3e-3, args.batch_size, 0.0, gen, device, metrics)
    log["sft_s"] = time.perf_counter() - t0
    draft_vocab_from_data(task, draft, gen, 0.0)
    engine = RolloutEngine(policy_args, draft.args, layers, max(args.batch_sizes), seq_len, device,
                           getattr(torch, args.dtype), compile=args.compile)
    optimizer, rounds, t0 = None, [], time.perf_counter()
    for _ in range(args.max_draft_rounds):
        optimizer = warmup_draft(policy, draft, task, layers, args.draft_steps, 1e-3, 1.0, args.batch_size,
                                 3, 0.8, 0.0, gen, device, metrics)
        engine.load_weights(policy, draft)
        probe = engine.generate(task.sample_prompts(64, gen).to(device), task.answer_len + 2,
                                num_speculative_tokens=args.k, temperature=args.temperature,
                                eos_id=task.tokenizer.eos_id, generator=torch.Generator(device).manual_seed(1))
        rounds.append(probe.acceptance_length)
        print(f"draft warm-up round {len(rounds)}: acceptance length {probe.acceptance_length:.2f}", flush=True)
        if probe.acceptance_length >= args.min_acceptance:
            break
    log["draft_s"], log["draft_rounds_acceptance"] = time.perf_counter() - t0, rounds
    params = sum(p.numel() for p in policy.parameters()), sum(p.numel() for p in draft.parameters())
    return engine, log, params


def measure(engine, task, args, batch_size, k, device):
    gen = torch.Generator().manual_seed(args.seed + batch_size)
    prompts = task.sample_prompts(batch_size, gen).to(device)
    run = lambda seed: engine.generate(prompts, task.answer_len + 2, num_speculative_tokens=k,  # noqa: E731
                                       temperature=args.temperature, eos_id=task.tokenizer.eos_id,
                                       generator=torch.Generator(device).manual_seed(seed))
    run(0)  # warm-up (allocator, compilation)
    results = [run(seed) for seed in range(1, args.repeats + 1)]
    rewards = [float(task.rewards(prompts.cpu(), r.tokens[:, task.prompt_len:]).mean()) for r in results]
    return dict(
        tokens_per_s=statistics.median(r.tokens_per_s for r in results),
        acceptance_length=statistics.mean(r.acceptance_length for r in results),
        per_position_acceptance=torch.stack([r.per_position_acceptance for r in results]).mean(0).tolist(),
        timing={key: statistics.mean(r.timing[key] for r in results) for key in results[0].timing},
        decode_steps=statistics.mean(r.num_decode_steps for r in results),
        reward=statistics.mean(rewards),
    )


def main():
    args = parse_args()
    device = torch.device(args.device)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here; use --device cpu")
    torch.manual_seed(args.seed)
    task = SortTask(num_items=10, alphabet_size=16)
    engine, train_log, (policy_params, draft_params) = train_models(args, task, device)
    rows = []
    print(f"\nllama3 '{args.flavor}' policy {policy_params / 1e6:.2f}M params, draft {draft_params / 1e6:.2f}M, "
          f"K = {args.k}, T = {args.temperature}, {args.dtype} on {args.device}"
          f"{' (compiled)' if args.compile else ''}")
    print(f"{'batch':>5} | {'accept len':>10} | {'base tok/s':>10} | {'spec tok/s':>10} | {'speedup':>7} | "
          f"{'draft/verify/other s (spec)':>27} | {'reward base/spec':>16}")
    for batch_size in args.batch_sizes:
        base = measure(engine, task, args, batch_size, 0, device)
        spec = measure(engine, task, args, batch_size, args.k, device)
        speedup = spec["tokens_per_s"] / base["tokens_per_s"]
        rows.append(dict(batch_size=batch_size, baseline=base, speculative=spec, speedup=speedup))
        t = spec["timing"]
        print(f"{batch_size:>5} | {spec['acceptance_length']:>10.2f} | {base['tokens_per_s']:>10.0f} | "
              f"{spec['tokens_per_s']:>10.0f} | {speedup:>6.2f}x | "
              f"{t['draft_s']:>8.3f} /{t['verify_s']:>7.3f} /{t['other_s']:>7.3f} | "
              f"{base['reward']:>7.2f} /{spec['reward']:>6.2f}", flush=True)
    report = dict(config=vars(args), training=train_log, policy_params=policy_params, draft_params=draft_params,
                  torch=torch.__version__,
                  device_name=torch.cuda.get_device_name() if args.device == "cuda" else "cpu", rows=rows)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
