"""The RL update alone (titan_draft.train.train_step), per training setting: what the train phase of an RL
step costs with [compile] off or on and each [activation_checkpoint] mode, at a preset's shapes.

A setting is the preset's job config plus overrides (SETTINGS: eager or compiled, each with activation
checkpointing none / selective / full). Each setting builds its own job, as train.py does (random
initialisation: time and memory depend on shapes, not on what the weights learnt; [draft] mode cotrain, so
the draft trains in the step), and runs train_step on the same rollouts: the preset's prompts_per_step
prompts, group_size times each, their answers random tokens as long as the task's reference answers
(sft_documents; at most the answer budget). The rewards of random answers are meaningless and so are the
updates: this bench reports time and memory only. One setting's training state is on the device at a
time, so settings run one after another (not alternating); the first --skip steps of each (compilation,
the optimizers' first states) are left out of the statistics. A setting that runs out of device memory is
reported as such, and the next one goes on.

Per setting: the median step's seconds (train_step end to end), the draft's part (its draft_time_s), the
policy's training in model TFLOP/s and MFU (bench._job.PolicyFlops: recomputation under activation
checkpointing is not counted, so checkpointing shows as lower FLOP/s), and the peak GiB allocated and
reserved during the timed steps (CUDA). `vs_best_eager` divides the fastest eager setting's median seconds
(the best a user can run without compiling) by the setting's own. --profile appends torch.profiler's per-op
tables of one more step per setting (device time, then host time) to <out>.profile.txt.

  python -m bench.train_phase --preset tiny               # CPU: what tests/test_bench.py runs
  python -m bench.train_phase --preset qwen3_1.7b_tail    # one H200: 512 long-tail rollouts of Qwen3-1.7B
  python -m bench.train_phase --preset qwen3_1.7b_tail --settings eager_full compiled_full
Prints a table and writes bench/results/train_phase_<preset>.json (--out) after every setting.
"""
import argparse
import gc
import os
import statistics

import torch

from bench._common import environment, highest, out_of_memory, profile_steps, timed, write_json
from bench._job import (PolicyFlops, add_job_arguments, add_step_arguments, job_config, new_job, random_rollouts,
                        resolve_preset, resolve_steps)
from titan_draft.data.tasks import build_task
from titan_draft.data.tasks.base import response_budget
from titan_draft.infra.timing import PhasePeak
from titan_draft.models.policy import job_model_args
from titan_draft.train import RLState, train_step

# The test's preset: bench.rl_step's tiny sizes, micro-batches of two rollouts and a chunked head.
TINY_OVERRIDES = ["--model.flavor", "tiny_gqa", "--training.seq_len", "16", "--task.num_items", "2",
                  "--task.alphabet_size", "4", "--rl.prompts_per_step", "4", "--rl.group_size", "4",
                  "--rl.logprob_chunk_size", "8", "--rl.max_tokens_per_microbatch", "32"]
PRESETS = {
    "tiny": dict(config="train_configs/sort_tiny_cpu.toml", overrides=TINY_OVERRIDES, steps=1, skip=1,
                 settings=["eager_none", "eager_full"]),
    "gpu_tail": dict(config="train_configs/arith_gpu_tail.toml", steps=3, skip=1),
    "qwen3_1.7b_tail": dict(config="train_configs/qwen3_1.7b_arith_tail.toml", steps=3, skip=1),
    "qwen3_4b_tail": dict(config="train_configs/qwen3_4b_arith_tail.toml", steps=3, skip=1),
}
# Each side explicit, whatever the preset sets; compiled: torchtitan's default components, model and loss.
COMPILE = {"eager": ["--compile.no-enable"], "compiled": ["--compile.enable"]}
SETTINGS = {f"{compiled}_{ac}": [*overrides, "--activation_checkpoint.mode", ac]
            for compiled, overrides in COMPILE.items() for ac in ("none", "selective", "full")}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_job_arguments(p, PRESETS, default="tiny")
    p.add_argument("--settings", nargs="+", choices=list(SETTINGS), help="default: the preset's, else all")
    add_step_arguments(p, "setting")
    p.add_argument("--profile", action="store_true", help="per-op tables of one more step per setting "
                   "(<out without .json>.profile.txt)")
    args = p.parse_args()
    preset = resolve_preset(args, PRESETS)
    args.settings = args.settings or preset.get("settings", list(SETTINGS))
    resolve_steps(args, p, preset, "train_phase")
    return args


def step_rollouts(cfg, task, generator: torch.Generator):
    """The step's rollouts: prompts_per_step prompts x group_size, answers of the reference answers' lengths."""
    prompts = task.sample_prompts(cfg.rl.prompts_per_step, generator).repeat_interleave(cfg.rl.group_size)
    documents, prompt_lengths = task.sft_documents(len(prompts), generator)
    answers = torch.tensor([len(d) for d in documents]) - prompt_lengths
    answers = answers.clamp(1, response_budget(cfg, task.max_new_tokens))
    return random_rollouts(prompts, answers, task.tokenizer.vocab_size, generator)


def token_counts(rollouts) -> dict:
    """The rollouts' packed tokens (prompts and answers) and generated tokens (answers)."""
    return {"packed_tokens": int((rollouts.prompt_lengths + rollouts.response_lengths).sum()),
            "generated_tokens": int(rollouts.response_lengths.sum())}


def run_setting(cfg, rollouts, rounds: int, dump_folder: str, report, profile: tuple[str, str] | None = None
                ) -> tuple[list[dict], str | None]:
    """(a record per step, None) of `rounds` train_steps of a new job of `cfg`; the records so far and the
    phase ("build" or "train") where the device ran out of memory. profile: (the setting's name, a file),
    to append per-op tables of one more step to."""
    records, phase = [], "build"
    try:
        job, draft_opt = new_job(cfg, dump_folder)
        state, phase = RLState.create(job, draft_opt), "train"
        flops, tokens = PolicyFlops.of(job.policy, job.device), token_counts(rollouts)
        for i in range(rounds):
            with PhasePeak(job.device) as peak:
                seconds, metrics = timed(lambda: train_step(state, rollouts), job.device)
            record = {"step_s": seconds, "draft_s": metrics.get("draft_time_s", 0.0), **tokens,
                      "peak_gib": peak.gib, "reserved_gib": peak.reserved_gib}
            flops_per_s = flops.per_second({**record, "train_s": seconds})
            record["policy_train_tflops_per_s"], record["policy_train_mfu"] = flops_per_s / 1e12, flops.mfu(flops_per_s)
            records.append(record)
            report(i, record)
        if profile is not None:
            profile_steps({profile[0]: lambda: train_step(state, rollouts)}, job.device, profile[1], append=True)
        phase = None
    except Exception as err:
        if not out_of_memory(err):
            raise
    finally:
        job = draft_opt = state = None  # the setting's training state goes before the next one's
        gc.collect()
        torch._dynamo.reset()  # compiled code holds the setting's modules
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return records, phase


def summarise(records: list[dict]) -> dict:
    """Medians of the timed steps; the highest peaks."""
    def median(key):
        return statistics.median(r[key] for r in records)

    return {"steps": len(records), "step_s": median("step_s"), "draft_s": median("draft_s"),
            "policy_train_tflops_per_s": median("policy_train_tflops_per_s"),
            "policy_train_mfu": median("policy_train_mfu") if records[0]["policy_train_mfu"] is not None else None,
            **highest(records, ("peak_gib", "reserved_gib"))}


def with_ratios(table: dict) -> dict:
    """Each setting's vs_best_eager: the fastest eager setting's seconds over its own (None without one)."""
    eager = [row["step_s"] for name, row in table.items() if name.startswith("eager") and row.get("step_s")]
    best = min(eager, default=None)
    for row in table.values():
        row["vs_best_eager"] = best / row["step_s"] if best and row.get("step_s") else None
    return table


def print_table(a, cfg, table: dict) -> None:
    print(f"\nRL update alone (train_step), median of {a.steps} steps per setting ({a.skip} skipped), "
          f"{cfg.rl.prompts_per_step} prompts x {cfg.rl.group_size}, {cfg.model.name} {cfg.model.flavor}")
    print(f"{'setting':<20} {'step s':>8} {'draft s':>8} {'policy TFLOP/s':>15} {'MFU':>5} {'peak GiB':>9} "
          f"{'reserved':>9} {'vs best eager':>14}")
    for name, t in table.items():
        if t.get("oom"):
            print(f"{name:<20} out of memory ({t['oom']})")
            continue
        mfu = "n/a" if t["policy_train_mfu"] is None else f"{t['policy_train_mfu']:.2f}"
        peak = "n/a" if t["peak_gib"] is None else f"{t['peak_gib']:.1f}"
        reserved = "n/a" if t["reserved_gib"] is None else f"{t['reserved_gib']:.1f}"
        ratio = "n/a" if t["vs_best_eager"] is None else f"{t['vs_best_eager']:.2f}x"
        print(f"{name:<20} {t['step_s']:>8.3f} {t['draft_s']:>8.3f} {t['policy_train_tflops_per_s']:>15.2f} "
              f"{mfu:>5} {peak:>9} {reserved:>9} {ratio:>14}")


def main():
    a = parse_args()
    base = job_config(a.config, a.overrides)
    task = build_task(base, job_model_args(base).vocab_size)
    rollouts = step_rollouts(base, task, torch.Generator().manual_seed(0))  # the same for every setting
    result = {"preset": a.preset, "config": a.config, "overrides": a.overrides, "environment": environment(),
              "steps": a.steps, "skip": a.skip, "settings": {name: SETTINGS[name] for name in a.settings},
              "rollouts": len(rollouts.tokens), "packed_tokens": token_counts(rollouts)["packed_tokens"]}
    table, records = {}, {}
    for name in a.settings:
        cfg = job_config(a.config, [*a.overrides, *SETTINGS[name]])
        cfg.draft.mode = "cotrain"

        def report(i, record, name=name):
            print(f"{name:<20} step {i + 1}/{a.skip + a.steps}: {record['step_s']:.3f} s", flush=True)

        profile = (name, os.path.splitext(a.out)[0] + ".profile.txt") if a.profile else None
        records[name], oom = run_setting(cfg, rollouts, a.skip + a.steps, cfg.job.dump_folder, report, profile)
        timed_steps = records[name][a.skip:]
        table[name] = {**summarise(timed_steps), "oom": None} if timed_steps and not oom else {"oom": oom or "none"}
        write_json(a.out, {**result, "table": with_ratios(table), "records": records})
    print_table(a, base, table)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
