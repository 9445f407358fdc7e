"""Speculative vs plain generation in the same RolloutEngine, batch sizes 1..64, on trained models.

The policy is SFT-trained on the sort task (correct answers) until its greedy answers are right
(--min-reward), and the EAGLE-3 draft is warm-started on its taps with K training passes until its
acceptance length at the bench temperature reaches --min-acceptance, with the project's own
training helpers (titan_draft.warmstart). Then, per temperature and batch size, the same prompts
are generated with K = 0 (baseline) and K = --k draft tokens, both through the same engine (CUDA
graphs on the GPU for both); the table reports acceptance length and tokens/s, and how the time of
one speculative decode step splits into the verify forward and the drafting (each timed alone).

  .venv/bin/python bench/rollout_speedup.py --out bench/results/rollout_speedup_cpu.json
  python bench/rollout_speedup.py --device cuda --out $OUT/rollout_speedup_h200.json
"""
import argparse
import datetime
import json
import statistics
import tempfile
import time

import torch

from titan_draft import _compat  # noqa: F401  (before torchtitan)
from titan_draft.models import default_tap_layers
from titan_draft.metrics import MetricsLogger
from titan_draft.models.draft import EagleDraft, draft_args_for
from titan_draft.models.policy import build_policy, model_args
from titan_draft.parallel.parallelize import training_autocast
from titan_draft.rollout import EngineOptions, RolloutEngine
from titan_draft.tasks.sort import SortTask
from titan_draft.warmstart import draft_vocab_from_data, sft_policy, warmup_draft

DEVICE_DEFAULTS = {
    "cpu": dict(flavor="tiny", dtype="float32", num_items=10, k=4, sft_steps=200, sft_lr=3e-3,
                draft_steps=100, draft_lr=1e-3, min_acceptance=2.5, batch_size=16),
    # Measured on the H200 (bf16 autocast, batch 64): the medium policy learns the task at SFT lr 3e-4
    # (teacher-forced exact answers 0.86 after 600 steps) and stalls at 1e-3 (0.06).
    "cuda": dict(flavor="medium", dtype="bfloat16", num_items=20, k=5, sft_steps=500, sft_lr=3e-4,
                 draft_steps=300, draft_lr=5e-4, min_acceptance=3.0, batch_size=64),
}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--flavor", help="policy flavor (titan_draft.models.policy); default tiny on cpu, medium on cuda")
    p.add_argument("--dtype", choices=["float32", "bfloat16"],
                   help="engine dtype, and the training autocast dtype on CUDA (CPU trains in float32)")
    p.add_argument("--num-items", type=int, help="letters to sort (response = num_items + 1 tokens)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--k", type=int, help="draft tokens per verify forward (and draft training passes)")
    p.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 0.0],
                   help="sampling temperatures; the first one is the one the draft is trained to reach --min-acceptance at")
    p.add_argument("--sft-steps", type=int, help="policy SFT steps per round")
    p.add_argument("--sft-lr", type=float, help="first SFT round's learning rate; each later round halves it")
    p.add_argument("--max-sft-rounds", type=int, default=6)
    p.add_argument("--min-reward", type=float, default=0.9, help="greedy exact-answer rate that ends SFT")
    p.add_argument("--draft-steps", type=int, help="draft warm-up steps per round")
    p.add_argument("--draft-lr", type=float, help="first draft round's learning rate; each later round halves it")
    p.add_argument("--max-draft-rounds", type=int, default=6)
    p.add_argument("--min-acceptance", type=float)
    p.add_argument("--batch-size", type=int, help="training batch (documents)")
    p.add_argument("--max-train-s", type=float, default=240.0,
                   help="no new SFT / draft round starts after this many seconds of each")
    p.add_argument("--repeats", type=int, default=5, help="timed generations per (batch size, mode); median")
    p.add_argument("--compile", action="store_true", help="torch.compile the engine's forwards")
    p.add_argument("--no-cuda-graphs", action="store_true", help="run the decode steps eagerly on CUDA too")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="JSON output path")
    args = p.parse_args()
    for key, value in DEVICE_DEFAULTS[args.device].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if args.k < 1:
        p.error("--k must be >= 1")
    return args


def probe(engine, task, k, temperature, seed, n=256):
    """(acceptance length, exact-answer rate) of n fresh prompts."""
    gen = torch.Generator().manual_seed(seed)
    prompts = task.sample_prompts(n, gen)
    out = engine.generate(prompts.padded(task.tokenizer.pad_id).to(engine.device), task.max_new_tokens,
                          num_speculative_tokens=k,
                          temperature=temperature, eos_id=task.tokenizer.eos_id,
                          generator=torch.Generator().manual_seed(seed))
    return out.acceptance_length, float(task.rewards(prompts, list(out.tokens[:, task.prompt_len:])).mean())


def train_models(args, task, device):
    """SFT the policy until it answers right, then warm up the draft until its acceptance is high enough."""
    seq_len = task.prompt_len + task.answer_len + 8
    policy_args = model_args("llama3", args.flavor, seq_len)
    policy = build_policy("llama3", args.flavor, seq_len, seed=args.seed)
    layers = default_tap_layers(policy_args.n_layers)
    draft = EagleDraft(draft_args_for(policy_args, len(layers), draft_vocab_size=20)).to(device)
    draft.init_weights()
    gen = torch.Generator().manual_seed(args.seed)
    metrics = MetricsLogger(tempfile.mkdtemp(prefix="rollout_bench_"), tensorboard=False)
    engine = RolloutEngine(policy_args, draft.args, layers, max(args.batch_sizes + [256]), seq_len, device,
                           getattr(torch, args.dtype), options=EngineOptions(
                               max_speculative_tokens=args.k, compile=args.compile,
                               cuda_graphs=not args.no_cuda_graphs))
    amp = training_autocast(args.dtype, device)
    log = dict(sft_rounds=[], draft_rounds=[])
    t0 = time.perf_counter()
    for round_ in range(args.max_sft_rounds):
        sft_policy(policy, task, args.sft_steps, args.sft_lr / 2 ** round_, args.batch_size, gen, device,
                   metrics, amp=amp)
        engine.load_weights(policy)
        _, reward = probe(engine, task, 0, 0.0, seed=len(log["sft_rounds"]))
        log["sft_rounds"].append(reward)
        print(f"SFT round {len(log['sft_rounds'])}: greedy exact answers {reward:.3f} "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
        if reward >= args.min_reward or time.perf_counter() - t0 > args.max_train_s:
            break
    log["sft_s"] = time.perf_counter() - t0
    draft_vocab_from_data(task, draft, gen)
    t0 = time.perf_counter()
    for round_ in range(args.max_draft_rounds):
        warmup_draft(policy, draft, task, layers, args.draft_steps, args.draft_lr / 2 ** round_, 1.0,
                     args.batch_size, args.k, 0.8, gen, device, metrics, amp=amp)
        engine.load_weights(policy, draft)
        acceptance, _ = probe(engine, task, args.k, args.temperatures[0], seed=100 + len(log["draft_rounds"]))
        log["draft_rounds"].append(acceptance)
        print(f"draft round {len(log['draft_rounds'])}: acceptance length {acceptance:.2f} "
              f"at T = {args.temperatures[0]} ({time.perf_counter() - t0:.0f} s)", flush=True)
        if acceptance >= args.min_acceptance or time.perf_counter() - t0 > args.max_train_s:
            break
    log["draft_s"] = time.perf_counter() - t0
    params = sum(p.numel() for p in policy.parameters()), sum(p.numel() for p in draft.parameters())
    return engine, log, params


def wall_time(fn, device, repeats=20):
    """Median seconds of fn() (warmed up; synchronised on CUDA)."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def step_parts(engine, batch_size, k, temperature, device):
    """Seconds of the verify forward [B, K+1], the plain decode forward [B, 1] and the drafting of
    K tokens (K - 1 draft passes, K draft distributions and samples), each alone, the way the
    engine runs them (captured on CUDA). Run after the generations: it scribbles on the caches."""
    B = batch_size
    zeros = lambda *shape: torch.zeros(*shape, dtype=torch.long, device=device)  # noqa: E731
    verify_in, base_in = zeros(B, k + 1), zeros(B, 1)
    positions = torch.arange(k + 1, device=device).expand(B, -1) + 8
    hidden = torch.zeros(B, engine.draft.args.dim, dtype=engine.dtype, device=device)
    anchor = zeros(B) + 7
    parts = dict(
        verify_s=engine.captured(lambda: engine.policy_forward(verify_in, positions)),
        plain_forward_s=engine.captured(lambda: engine.policy_forward(base_in, positions[:, :1])),
        draft_s=engine.captured(lambda: engine._propose(hidden, anchor, k, temperature, 1.0, engine._rng)),
    )
    return {name: wall_time(fn, device) for name, fn in parts.items()}


def measure(engine, task, args, batch_size, k, temperature):
    gen = torch.Generator().manual_seed(args.seed + batch_size)
    prompts = task.sample_prompts(batch_size, gen)
    prompt_ids = prompts.padded(task.tokenizer.pad_id).to(engine.device)
    run = lambda seed: engine.generate(prompt_ids, task.max_new_tokens, num_speculative_tokens=k,  # noqa: E731
                                       temperature=temperature, eos_id=task.tokenizer.eos_id,
                                       generator=torch.Generator().manual_seed(seed))
    run(0)  # warm-up: CUDA graph capture, allocator, compilation
    results = [run(seed) for seed in range(1, args.repeats + 1)]
    rewards = [float(task.rewards(prompts, list(r.tokens[:, task.prompt_len:])).mean()) for r in results]
    return dict(
        tokens_per_s=statistics.median(r.tokens_per_s for r in results),
        acceptance_length=statistics.mean(r.acceptance_length for r in results),
        per_position_acceptance=torch.stack([r.per_position_acceptance for r in results]).mean(0).tolist(),
        timing={key: statistics.median(r.timing[key] for r in results) for key in results[0].timing},
        decode_steps=statistics.mean(r.num_decode_steps for r in results),
        step_ms=1e3 * statistics.median(r.timing["decode_s"] / max(r.num_decode_steps, 1) for r in results),
        reward=statistics.mean(rewards),
    )


def main():
    args = parse_args()
    device = torch.device(args.device)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here; use --device cpu")
    torch.manual_seed(args.seed)
    task = SortTask(num_items=args.num_items, alphabet_size=16)
    engine, train_log, (policy_params, draft_params) = train_models(args, task, device)
    graphs = "CUDA graphs" if engine.cuda_graphs else "eager"
    print(f"\nllama3 '{args.flavor}' policy {policy_params / 1e6:.1f}M params, draft {draft_params / 1e6:.1f}M, "
          f"K = {args.k}, {args.dtype} on {args.device} ({graphs}{', compiled' if args.compile else ''}), "
          f"response {task.answer_len} tokens")
    rows = []
    report = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        config=vars(args), training=train_log, policy_params=policy_params, draft_params=draft_params,
        response_tokens=task.answer_len, prompt_tokens=task.prompt_len, cuda_graphs=engine.cuda_graphs,
        torch=torch.__version__, device_name=torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        rows=rows,
    )
    for temperature in args.temperatures:
        print(f"\nT = {temperature}")
        print(f"{'batch':>5} | {'accept len':>10} | {'base tok/s':>10} | {'spec tok/s':>10} | {'speedup':>7} | "
              f"{'step ms base/spec':>17} | {'verify/plain fwd ms':>19} | {'draft ms':>8} | {'reward base/spec':>16}")
        for batch_size in args.batch_sizes:
            base = measure(engine, task, args, batch_size, 0, temperature)
            spec = measure(engine, task, args, batch_size, args.k, temperature)
            parts = step_parts(engine, batch_size, args.k, temperature, device)
            speedup = spec["tokens_per_s"] / base["tokens_per_s"]
            rows.append(dict(temperature=temperature, batch_size=batch_size, baseline=base, speculative=spec,
                             speedup=speedup, step_parts_s=parts))
            print(f"{batch_size:>5} | {spec['acceptance_length']:>10.2f} | {base['tokens_per_s']:>10.0f} | "
                  f"{spec['tokens_per_s']:>10.0f} | {speedup:>6.2f}x | "
                  f"{base['step_ms']:>7.2f} /{spec['step_ms']:>7.2f} | "
                  f"{1e3 * parts['verify_s']:>8.2f} /{1e3 * parts['plain_forward_s']:>8.2f} | "
                  f"{1e3 * parts['draft_s']:>8.2f} | {base['reward']:>7.2f} /{spec['reward']:>6.2f}", flush=True)
            with open(args.out, "w") as f:  # after every row: a run cut short still leaves its rows
                json.dump(report, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
