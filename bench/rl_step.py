"""End-to-end RL step time: speculative rollouts with online draft co-training vs no speculation.

One process, one job config. The warm starts run once (SFT policy, draft warm-up: titan_draft.warmstart,
as the job does); then two identical copies of the trained state step side by side, alternating
A B A B: A = [draft] mode cotrain (the draft proposes, the policy verifies; the draft trains inside
every step), B = mode none (plain sampling, no draft). Each step is titan_draft.train's own
collect_rollouts + train_on. The first --skip steps of each mode are left out of the statistics
(allocation, CUDA graph capture); the table gives medians over the rest.

  .venv/bin/python bench/rl_step.py --out outputs/rl_step_cpu.json                # CPU: a few minutes
  python bench/rl_step.py --preset gpu --out outputs/rl_step_gpu.json            # one H200
  python bench/rl_step.py --preset gpu_long --out outputs/rl_step_gpu_long.json  # one H200, long answers
  .venv/bin/python bench/rl_step.py --out x.json -- --rl.prompts_per_step 64     # any config override
"""
import argparse
import copy
import json
import statistics
import tempfile
import time

import torch

from titan_draft import _compat
from titan_draft.config import parse_config, validate
from titan_draft.metrics import MetricsLogger
from titan_draft.models.policy import model_args
from titan_draft.parallel.parallelize import training_autocast
from titan_draft.tasks import build_task
from titan_draft.train import RLState, build_models, collect_rollouts, train_on
from titan_draft.warmstart import draft_vocab_from_data, sft_policy, warmup_draft

PRESETS = {
    "cpu": dict(config="train_configs/sort_tiny_cpu.toml", steps=8, skip=1),
    "gpu": dict(config="train_configs/sort_gpu.toml", steps=20, skip=2),
    "gpu_long": dict(config="train_configs/sort_gpu_long.toml", steps=10, skip=2),
}
MODES = ("cotrain", "none")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="gpu" if torch.cuda.is_available() else "cpu")
    p.add_argument("--config", help="job TOML (default: the preset's)")
    p.add_argument("--steps", type=int, help="timed RL steps per mode (after --skip)")
    p.add_argument("--skip", type=int, help="first RL steps per mode left out of the statistics")
    p.add_argument("--out", required=True, help="JSON output path")
    p.add_argument("overrides", nargs="*", help="job config overrides after --, e.g. -- --rl.sft_steps 100")
    args = p.parse_args()
    for key, value in PRESETS[args.preset].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.steps < 1 or args.skip < 0:
        p.error("--steps must be >= 1 and --skip >= 0")
    return args


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def warm_start(cfg, device, folder):
    """The job's warm starts (same calls and generators as titan_draft.train.run): (model args, task, tap
    layers), the trained (policy, draft, draft optimizer, data and rollout generators), and their times."""
    seed = cfg.debug.seed if cfg.debug.seed is not None else 0
    torch.manual_seed(seed)
    data_gen, warmup_gen = torch.Generator().manual_seed(seed + 1), torch.Generator().manual_seed(seed + 3)
    rollout_gen = torch.Generator(device=device).manual_seed(seed + 2)
    args = model_args(cfg.model.name, cfg.model.flavor, cfg.training.seq_len)
    task = build_task(cfg, args.vocab_size)
    _, policy, draft, layers = build_models(cfg, device)
    d, rl = cfg.draft, cfg.rl
    metrics = MetricsLogger(folder, tensorboard=False)
    amp = training_autocast(cfg.training.mixed_precision_param, device)
    times = {}
    t0 = time.perf_counter()
    sft_policy(policy, task, rl.sft_steps, rl.sft_lr, rl.sft_batch_size, data_gen, device, metrics, amp=amp)
    times["sft_s"] = time.perf_counter() - t0
    draft_vocab_from_data(task, draft, data_gen)
    t0 = time.perf_counter()
    draft_opt = warmup_draft(policy, draft, task, layers, d.warmup_steps, d.lr, d.max_norm, rl.sft_batch_size,
                             d.ttt_steps, d.pass_decay, warmup_gen, device, metrics, amp=amp)
    times["draft_warmup_s"] = time.perf_counter() - t0
    metrics.close()
    return (args, task, layers), (policy, draft, draft_opt, data_gen, rollout_gen), times


def clone_generator(g: torch.Generator) -> torch.Generator:
    """A generator on the same device in the same state (CPU or CUDA)."""
    clone = torch.Generator(device=g.device)
    clone.set_state(g.get_state())
    return clone


def timed_step(state, device) -> dict:
    """One RL step (collect_rollouts + train_on), timed end to end after a device sync."""
    sync(device)
    t0 = time.perf_counter()
    rollouts = collect_rollouts(state)
    stats = train_on(state, rollouts)
    sync(device)
    step_s = time.perf_counter() - t0
    tokens = int(rollouts.response_lengths.sum())
    return {"step_s": step_s, "rollout_s": rollouts.metrics["rollout_time_s"], "train_s": stats["train_time_s"],
            "acceptance_length": rollouts.metrics["acceptance_length"], "generated_tokens": tokens,
            "rollout_tokens_per_s": rollouts.metrics["rollout_tokens_per_s"], "reward_mean": stats["reward_mean"],
            "draft_acc_pass1": stats.get("draft_acc_pass1")}


def summarise(steps: list[dict]) -> dict:
    med = lambda key: statistics.median(s[key] for s in steps)  # noqa: E731
    step_s, rollout_s = med("step_s"), med("rollout_s")
    return {"steps": len(steps), "step_s": step_s, "rollout_s": rollout_s, "train_s": med("train_s"),
            "rollout_share": statistics.median(s["rollout_s"] / s["step_s"] for s in steps),
            "acceptance_length": statistics.mean(s["acceptance_length"] for s in steps),
            "rollout_tokens_per_s": med("rollout_tokens_per_s"),
            "step_tokens_per_s": statistics.median(s["generated_tokens"] / s["step_s"] for s in steps),
            "reward_mean": statistics.mean(s["reward_mean"] for s in steps)}


def main():
    a = parse_args()
    device = _compat.device()
    argv = ["--job.config_file", a.config, *a.overrides]
    cfg = parse_config(argv)
    args = model_args(cfg.model.name, cfg.model.flavor, cfg.training.seq_len)
    validate(cfg, 1, args.n_layers, args.vocab_size)
    cfg.draft.mode = "cotrain"  # the warm starts include the draft's
    folder = tempfile.mkdtemp(prefix="rl_step_bench_")
    (args, task, layers), trained, warm_times = warm_start(cfg, device, folder)
    print(f"warm starts: SFT {warm_times['sft_s']:.1f} s, draft warm-up {warm_times['draft_warmup_s']:.1f} s "
          f"({cfg.model.flavor} policy, {cfg.task.num_items} items, {device})", flush=True)

    states = {}
    for mode in MODES:  # identical copies of the trained models, optimizer and generators; the job's RL state
        mode_cfg = copy.deepcopy(cfg)
        mode_cfg.draft.mode = mode
        policy, draft, draft_opt = copy.deepcopy(trained[:3])  # one deepcopy: the optimizer keeps its draft
        data_gen, rollout_gen = (clone_generator(g) for g in trained[3:])
        states[mode] = RLState.create(mode_cfg, args, task, policy, draft, draft_opt, layers, device, data_gen,
                                      rollout_gen)
    del trained
    records = {mode: [] for mode in MODES}
    for i in range(a.skip + a.steps):  # A B A B: drifts of the machine hit both modes alike
        for mode in MODES:
            r = timed_step(states[mode], device)
            if i >= a.skip:
                records[mode].append(r)
            print(f"step {i + 1:>3} {mode:<8} {r['step_s']:.3f} s (rollout {r['rollout_s']:.3f}, train "
                  f"{r['train_s']:.3f}) acceptance {r['acceptance_length']:.2f} reward {r['reward_mean']:.3f}",
                  flush=True)

    table = {mode: summarise(records[mode]) for mode in MODES}
    speedup = table["none"]["step_s"] / table["cotrain"]["step_s"]
    rollout_speedup = table["none"]["rollout_s"] / table["cotrain"]["rollout_s"]
    header = (f"{'mode':<8} {'step s':>8} {'rollout s':>10} {'train s':>8} {'rollout %':>10} {'accept':>7} "
              f"{'rollout tok/s':>14} {'step tok/s':>11}")
    print(f"\nRL step, median of {a.steps} steps per mode ({a.skip} skipped), {cfg.rl.prompts_per_step} prompts x "
          f"{cfg.rl.group_size} samples, K = {cfg.rollout.num_speculative_tokens}, {device}")
    print(header)
    for mode, t in table.items():
        print(f"{mode:<8} {t['step_s']:>8.3f} {t['rollout_s']:>10.3f} {t['train_s']:>8.3f} "
              f"{100 * t['rollout_share']:>9.1f}% {t['acceptance_length']:>7.2f} {t['rollout_tokens_per_s']:>14.0f} "
              f"{t['step_tokens_per_s']:>11.0f}")
    print(f"step time none / cotrain = {speedup:.3f}   rollout time none / cotrain = {rollout_speedup:.3f}")

    report = {"config": a.config, "overrides": a.overrides, "device": str(device),
              "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "threads": torch.get_num_threads(),
              "policy": {"name": cfg.model.name, "flavor": cfg.model.flavor,
                         "params": sum(p.numel() for p in states["none"].policy.parameters())},
              "draft_params": sum(p.numel() for p in states["cotrain"].draft.parameters()),
              "task": {"num_items": cfg.task.num_items, "answer_tokens": cfg.task.num_items + 1},
              "rl": {"prompts_per_step": cfg.rl.prompts_per_step, "group_size": cfg.rl.group_size,
                     "num_speculative_tokens": cfg.rollout.num_speculative_tokens},
              "warm_start": warm_times, "skip": a.skip, "table": table,
              "step_speedup_none_over_cotrain": speedup, "rollout_speedup_none_over_cotrain": rollout_speedup,
              "steps": records}
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
