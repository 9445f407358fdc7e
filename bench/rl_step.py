"""End-to-end RL step time per [draft] mode, side by side in one process: none (plain sampling, no
draft), frozen (the warm-started draft proposes and never trains), cotrain (the draft proposes and
trains inside every step).

One job config: a preset's TOML of train_configs/ plus overrides. The job's warm start runs once
(titan_draft.job.build_job + warm_start; --warm-start DIR saves it there, or loads it when DIR holds
one); then every mode steps its own copy of the trained policy, draft, draft optimizer and data
streams, in turn (none frozen cotrain none frozen cotrain ...: drifts of the machine hit all modes
alike). The real-size presets (qwen3_*), and --one-state, hold one mode's training state on the
device at a time: each mode runs all its steps from the warm start, which waits in host memory,
before the next begins (--modes splits them over separate runs of one saved warm start). A step is
titan_draft.train's collect_rollouts + train_step, timed end to end. The first --skip steps of each mode
are left out of the time statistics (allocation, CUDA graph capture, the adaptive-K controller's first
cost measurements); rewards are reported for every step. `capture s` (rollout_capture_s) is the part of
a step's rollouts spent capturing CUDA graphs, which release_caches makes each step pay again. The
draft's share of the RL train time is train_step's own draft_time_s (the draft's forward, backward and
optimizer step) over its train_time_s. The policy's part of the
train time (train_time_s - draft_time_s) is also given as model FLOP/s: 6 x the blocks' parameters
per packed token plus 6 x the output head's per response token (the head runs on response rows
only), over that time; recomputation under activation checkpointing is not counted. On CUDA,
`policy_train_mfu` divides it by the device's bf16 dense peak (torchtitan's get_peak_flops).

  python -m bench.rl_step --preset tiny           # CPU, about a minute: what tests/test_bench.py runs
  python -m bench.rl_step --preset cpu            # CPU, a few minutes (the default job's models)
  python -m bench.rl_step --preset gpu            # one H200: 512 short rollouts per step
  python -m bench.rl_step --preset gpu_long       # one H200: long answers, 8 rollouts per step
  python -m bench.rl_step --preset gpu_tail       # one H200: arith, heavy-tailed answer lengths, 512 rollouts
  python -m bench.rl_step --preset qwen3_1.7b_tail --warm-start outputs/warm_1.7b   # one H200: the same, Qwen3-1.7B
  python -m bench.rl_step --preset qwen3_4b_tail --warm-start outputs/warm_4b       # one H200: Qwen3-4B, 256 rollouts
  python -m bench.rl_step --preset cpu -- --rl.prompts_per_step 64   # any job config override after --
Prints a table and writes bench/results/rl_step_<preset>.json (--out to change; one mode at a time, it is
written after every mode, so a run cut short keeps the modes it finished). --profile also writes
<out>.profile.txt: torch.profiler's per-op tables (device and host time) of one more step per mode.
"""
import argparse
import copy
import dataclasses
import gc
import os
import statistics
import tempfile

import torch

from bench._common import alternate, environment, highest, profile_steps, write_json
from bench._job import (PolicyFlops, add_job_arguments, add_step_arguments, job_config, load_warm_state, new_job,
                        resolve_preset, resolve_steps, warm_started_job, warm_state)
from titan_draft.train import RLState, rollouts_and_update, spec_metrics

# The test's preset: the default job's config at the sizes of tests/test_rl_step.py.
TINY_OVERRIDES = ["--model.flavor", "tiny_gqa", "--training.seq_len", "16", "--task.num_items", "2",
                  "--task.alphabet_size", "4", "--rl.sft_steps", "30", "--rl.sft_batch_size", "16",
                  "--draft.warmup_steps", "3", "--rl.prompts_per_step", "4", "--rl.group_size", "4"]
PRESETS = {
    "tiny": dict(config="train_configs/sort_tiny_cpu.toml", overrides=TINY_OVERRIDES, steps=2, skip=1),
    "cpu": dict(config="train_configs/sort_tiny_cpu.toml", steps=8, skip=1),
    "gpu": dict(config="train_configs/sort_gpu.toml", steps=20, skip=2),
    "gpu_long": dict(config="train_configs/sort_gpu_long.toml", steps=10, skip=2),
    "gpu_tail": dict(config="train_configs/arith_gpu_tail.toml", steps=20, skip=2),
    "qwen3_1.7b_tail": dict(config="train_configs/qwen3_1.7b_arith_tail.toml", steps=10, skip=2, one_state=True),
    "qwen3_4b_tail": dict(config="train_configs/qwen3_4b_arith_tail.toml", steps=10, skip=2, one_state=True),
}
MODES = ("none", "frozen", "cotrain")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_job_arguments(p, PRESETS, default="gpu" if torch.cuda.is_available() else "cpu")
    add_step_arguments(p, "mode")
    p.add_argument("--profile", action="store_true", help="per-op tables of one more step per mode")
    p.add_argument("--one-state", action=argparse.BooleanOptionalAction, default=None,
                   help="hold one mode's training state on the device at a time (default: the preset's; "
                   "the qwen3_* presets do)")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                   help="[draft] modes to run (default all; the none / mode ratios need none)")
    p.add_argument("--warm-start", help="folder of a saved warm start of this config: loaded if there, else "
                   "written there after the warm start")
    args = p.parse_args()
    preset = resolve_preset(args, PRESETS)
    args.one_state = preset.get("one_state", False) if args.one_state is None else args.one_state
    resolve_steps(args, p, preset, "rl_step")
    return args


def mode_state(cfg, warm: dict, mode: str) -> RLState:
    """The RL state of [draft] mode `mode`: a job of `cfg` built on the device as train.py builds one, holding
    the warm start `warm` (bench._job.warm_state's), so that every mode starts RL from the same trained state
    and draws the same prompts."""
    cfg = copy.deepcopy(cfg)
    cfg.draft.mode = mode
    job, draft_opt = new_job(cfg, tempfile.mkdtemp(prefix=f"rl_step_bench_{mode}_"))
    load_warm_state(warm, job, draft_opt)
    return RLState.create(job, draft_opt)


def one_mode(cfg, warm: dict, mode: str, rounds: int, device, report, profile_path: str | None = None) -> list:
    """`rounds` timed steps of one mode, the only training state on the device (the warm start waits in host
    memory); freed after its steps (and after one more, profiled, when profile_path is given: appended there)."""
    state = mode_state(cfg, warm, mode)
    steps = alternate({mode: step_of(state)}, rounds, device, report=report)[mode]
    if profile_path is not None:
        profile_steps({mode: step_of(state)}, device, profile_path, append=True)
    state.job.metrics.close()
    del state
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return steps


def step_of(state: RLState):
    """One RL step of `state` (collect_rollouts + train_step) returning what the bench reports of it (peak
    memory per phase: None off CUDA)."""
    def step() -> dict:
        rollouts, stats = rollouts_and_update(state)
        m = rollouts.metrics
        record = {"rollout_s": m["rollout_time_s"], "train_s": stats["train_time_s"],
                  "draft_s": stats.get("draft_time_s", 0.0), "acceptance_length": m["tokens_per_verify_forward"],
                  "generated_tokens": int(rollouts.response_lengths.sum()), "response_len_max": m["response_len_max"],
                  "packed_tokens": int(rollouts.prompt_lengths.sum() + rollouts.response_lengths.sum()),
                  "rollout_tokens_per_s": m["rollout_tokens_per_s"], "reward_mean": stats["reward_mean"],
                  **{key: stats.get(key) for key in ("memory_peak_gib_rollout", "memory_peak_gib_train")},
                  "draft_acc_pass1": stats.get("draft_acc_pass1"),
                  **{key: m[key] for key in ("rollout_weights_s", "rollout_measure_s", "rollout_prefill_s",
                                             "rollout_decode_s", "rollout_unreplayed_calls", "rollout_capture_s",
                                             "rollout_call_ratio_drafting", "rollout_call_ratio_plain")}}
        if state.job.plan.speculate:
            record["spec"] = spec_metrics(rollouts.counts)
        return record

    return step


def summarise(steps: list[dict], flops: PolicyFlops) -> dict:
    """Medians of the timed steps (means for acceptance and reward)."""
    def median(fn):
        return statistics.median(fn(s) for s in steps)

    policy_flops = median(flops.per_second)
    return {"steps": len(steps), "step_s": median(lambda s: s["step_s"]), "rollout_s": median(lambda s: s["rollout_s"]),
            "train_s": median(lambda s: s["train_s"]), "draft_s": median(lambda s: s["draft_s"]),
            "draft_share_of_train": median(lambda s: s["draft_s"] / s["train_s"]),
            "rollout_share": median(lambda s: s["rollout_s"] / s["step_s"]),
            "rollout_capture_s": median(lambda s: s["rollout_capture_s"]),
            "acceptance_length": statistics.mean(s["acceptance_length"] for s in steps),
            "rollout_tokens_per_s": median(lambda s: s["rollout_tokens_per_s"]),
            "step_tokens_per_s": median(lambda s: s["generated_tokens"] / s["step_s"]),
            "policy_train_tflops_per_s": policy_flops / 1e12,
            "policy_train_mfu": flops.mfu(policy_flops),
            "reward_mean": statistics.mean(s["reward_mean"] for s in steps),
            **highest(steps, ("memory_peak_gib_rollout", "memory_peak_gib_train"))}


def print_tables(a, cfg, table: dict, records: dict, speedups: dict) -> None:
    ro = cfg.rollout
    print(f"\nRL step, median of {a.steps} steps per mode ({a.skip} skipped), {cfg.rl.prompts_per_step} prompts x "
          f"{cfg.rl.group_size} samples, K = {ro.num_speculative_tokens}{' (adaptive)' if ro.adaptive else ''}, "
          f"task {cfg.task.name}")
    print(f"{'mode':<8} {'step s':>8} {'rollout s':>10} {'capture s':>10} {'train s':>8} {'draft s':>8} "
          f"{'draft %':>8} {'rollout %':>10} {'accept':>7} {'rollout tok/s':>14} {'step tok/s':>11} {'reward':>7} "
          f"{'policy TFLOP/s':>15} {'MFU':>5}")
    for mode, t in table.items():
        mfu = "n/a" if t["policy_train_mfu"] is None else f"{t['policy_train_mfu']:.2f}"
        print(f"{mode:<8} {t['step_s']:>8.3f} {t['rollout_s']:>10.3f} {t['rollout_capture_s']:>10.3f} "
              f"{t['train_s']:>8.3f} {t['draft_s']:>8.3f} "
              f"{100 * t['draft_share_of_train']:>7.1f}% {100 * t['rollout_share']:>9.1f}% "
              f"{t['acceptance_length']:>7.2f} {t['rollout_tokens_per_s']:>14.0f} {t['step_tokens_per_s']:>11.0f} "
              f"{t['reward_mean']:>7.3f} {t['policy_train_tflops_per_s']:>15.2f} {mfu:>5}")
    for mode in ("frozen", "cotrain"):
        if f"step_none_over_{mode}" not in speedups:
            continue
        print(f"step time none / {mode} = {speedups[f'step_none_over_{mode}']:.3f}   rollout time none / {mode} = "
              f"{speedups[f'rollout_none_over_{mode}']:.3f}")
    print("\nreward per RL step (* = left out of the time statistics)")
    print(f"{'step':>5} " + " ".join(f"{mode:>8}" for mode in records))
    for i in range(a.skip + a.steps):
        print(f"{i + 1:>4}{'*' if i < a.skip else ' '} " + " ".join(f"{records[m][i]['reward_mean']:>8.3f}"
                                                                   for m in records))


def main():
    a = parse_args()
    cfg = job_config(a.config, a.overrides)
    job, draft_opt, warm_start_s, warm = warm_started_job(cfg, tempfile.mkdtemp(prefix="rl_step_bench_"), a.warm_start)
    print(f"warm start (SFT, draft warm-up): {warm_start_s:.1f} s ({cfg.model.flavor} policy, task "
          f"{cfg.task.name}, {job.device})", flush=True)

    def progress(i, mode, seconds, r):
        memory = "" if r["memory_peak_gib_rollout"] is None else \
            f" peak GiB rollout {r['memory_peak_gib_rollout']:.1f} train {r['memory_peak_gib_train']:.1f}"
        print(f"step {i + 1:>3} {mode:<8} {seconds:.3f} s (rollout {r['rollout_s']:.3f}, train {r['train_s']:.3f}, "
              f"draft {r['draft_s']:.3f}) acceptance {r['acceptance_length']:.2f} reward {r['reward_mean']:.3f}"
              f"{memory}", flush=True)

    rounds = a.skip + a.steps
    profile_path = os.path.splitext(a.out)[0] + ".profile.txt" if a.profile else None
    flops = PolicyFlops.of(job.policy, job.device)
    device, params = job.device, sum(p.numel() for p in job.policy.parameters())
    draft_params = sum(p.numel() for p in job.draft.parameters())
    warm = warm if warm is not None else warm_state(job, draft_opt)
    job.metrics.close()
    del job, draft_opt  # each mode builds its own job from `warm`
    gc.collect()

    def report_of(timed: dict) -> dict:
        """The JSON report of the modes in `timed` (mode -> its (seconds, record) steps)."""
        records = {mode: [{"step_s": seconds, **r} for seconds, r in steps] for mode, steps in timed.items()}
        table = {mode: summarise(records[mode][a.skip:], flops) for mode in timed}
        speedups = {}
        for mode in [m for m in ("frozen", "cotrain") if m in table and "none" in table]:
            speedups[f"step_none_over_{mode}"] = table["none"]["step_s"] / table[mode]["step_s"]
            speedups[f"rollout_none_over_{mode}"] = table["none"]["rollout_s"] / table[mode]["rollout_s"]
        return {"preset": a.preset, "config": a.config, "overrides": a.overrides, **environment(),
                "policy": {"name": cfg.model.name, "flavor": cfg.model.flavor,
                           "params": params,
                           "block_params": flops.block_params, "head_params": flops.head_params},
                "peak_flops": flops.peak_flops,
                "draft_params": draft_params,
                "task": dataclasses.asdict(cfg.task), "rl": dataclasses.asdict(cfg.rl),
                "draft": dataclasses.asdict(cfg.draft),
                "rollout": dataclasses.asdict(cfg.rollout), "warm_start_s": warm_start_s, "skip": a.skip,
                "table": table, "speedups": speedups,
                "reward_per_step": {mode: [r["reward_mean"] for r in records[mode]] for mode in timed},
                "steps": records}

    if a.one_state:
        if profile_path:
            open(profile_path, "w").close()  # each mode appends its tables after its timed steps
        timed = {}
        for mode in a.modes:
            timed[mode] = one_mode(cfg, warm, mode, rounds, device, progress, profile_path)
            report = report_of(timed)
            write_json(a.out, report)  # after every mode: a run cut short keeps the modes it finished
    else:
        states = {mode: mode_state(cfg, warm, mode) for mode in a.modes}
        report = report_of(alternate({mode: step_of(states[mode]) for mode in a.modes}, rounds, device,
                                     report=progress))
        write_json(a.out, report)
    print_tables(a, cfg, report["table"], report["steps"], report["speedups"])
    if profile_path and not a.one_state:
        profile_steps({mode: step_of(states[mode]) for mode in a.modes}, device, profile_path)
    if not a.one_state:
        for state in states.values():
            state.job.metrics.close()
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
