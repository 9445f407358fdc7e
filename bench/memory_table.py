"""The most rollouts per RL step that fit on one GPU, with all memory levers on and with each one off.

The levers: rl.logprob_chunk_size (the chunked LM head), rl.max_tokens_per_microbatch (micro-batches),
[activation_checkpoint] mode, rollout.release_caches (the engine gives its KV caches back before
training). A lever set is the preset's job config ("all_on": every lever as the preset sets it) with
the named levers off (0, 0, "none", false). The table is for [draft] mode cotrain, the mode that holds
the most: the draft in the engine, and its training rows, update and optimizer in the step.

Memory depends on shapes, not on what the weights have learnt, so every job starts from random
initialisation (no warm start) and every probe is the worst case: each rollout at full length (its
prompt + the whole answer budget). A probe of N rollouts (N / group_size prompts of the task) runs:
  rollout phase: the engine's weight refresh and its buffers for N rows at full length, every decode
    step a call of N rows can run (each row bucket, 0..K drafts) captured and run at full length
    (rollout.measure.measure_steps, as adaptive K's first call at a batch size does), the prompts'
    prefill; then the caches are given back if rollout.release_caches says so (as collect_rollouts).
    Not run: the decode loop itself, whose compaction gathers one buffer's running rows at a time (a
    transient below one layer's KV cache);
  train phase: titan_draft.train.train_step on the N rollouts, every answer the budget's length in
    random tokens (its advantages are the task's rewards of those, whatever they are: memory does not
    depend on values).
Each phase's peak is titan_draft.infra.timing.PhasePeak's, as the job's memory_peak_gib_rollout /
_train: allocated, and beside it reserved (which also holds the CUDA graphs' pool). Before its first
probe a job makes its first step, a train_step of one group, so that the optimizers' states exist as
from a job's second step on. A probe fits when nothing runs out of device memory and both phases'
allocated peaks are <= --limit-gib (default: the device's memory).

Search, per lever set, in prompts (rollouts = prompts x the preset's group_size): double from the
preset's prompts_per_step, up while it fits, down while it does not, then bisect between the last fit
and the first failure to one prompt; never past --max-rollouts.

A lever set's probes run in a spawned process that holds its job on one GPU; after a probe that ran
out of memory that process is replaced (whatever the failed allocation left, half-captured CUDA
graphs included, goes with it). Lever sets run side by side, one per visible GPU. Off CUDA there are
no memory statistics: every probe runs end to end, fits and reports memory as null, so the search
stops at --max-rollouts (what the tiny preset's test runs).

  python -m bench.memory_table --preset tiny               # CPU: what tests/test_bench.py runs
  python -m bench.memory_table --preset qwen3_1.7b_tail    # GPU(s): the lever sets spread over the visible GPUs
  python -m bench.memory_table --preset qwen3_4b_tail
  python -m bench.memory_table --preset qwen3_4b_tail --levers all_on release_caches_off --limit-gib 80
Prints a table and writes bench/results/memory_table_<preset>.json (--out) after every probe;
--resume goes on with that file when it was made with the same settings (its probes are not made again,
its other lever sets stay), so a search cut short, or split over runs by --levers, adds up to one table.
"""
import argparse
import gc
import json
import multiprocessing
import os
import queue
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from bench._common import REPO_ROOT, environment, out_of_memory, write_json
from bench._job import add_job_arguments, job_config, new_job, random_rollouts, resolve_preset
from titan_draft.data.tasks import Prompts
from titan_draft.data.tasks.base import response_budget
from titan_draft.infra.timing import PhasePeak
from titan_draft.rollout.measure import measure_steps
from titan_draft.train import RLState, Rollouts, train_step

# The test's preset: bench.rl_step's tiny sizes with every lever on (one chunk of 8 rows, micro-batches of
# two rollouts of training.seq_len).
TINY_OVERRIDES = ["--model.flavor", "tiny_gqa", "--training.seq_len", "16", "--task.num_items", "2",
                  "--task.alphabet_size", "4", "--rl.prompts_per_step", "4", "--rl.group_size", "4",
                  "--rl.logprob_chunk_size", "8", "--rl.max_tokens_per_microbatch", "32",
                  "--activation_checkpoint.mode", "full"]
PRESETS = {
    "tiny": dict(config="train_configs/sort_tiny_cpu.toml", overrides=TINY_OVERRIDES, max_rollouts=32),
    # Activation checkpointing on (full) in its "on" sets: the 1.7B preset runs without it, being faster so.
    "qwen3_1.7b_tail": dict(config="train_configs/qwen3_1.7b_arith_tail.toml", max_rollouts=4096,
                            overrides=["--activation_checkpoint.mode", "full"]),
    "qwen3_4b_tail": dict(config="train_configs/qwen3_4b_arith_tail.toml", max_rollouts=4096),
}
# Each lever: the config key that switches it, and the override that turns it off.
LEVERS = {
    "logprob_chunk_size": ("rl.logprob_chunk_size", ["--rl.logprob_chunk_size", "0"]),
    "max_tokens_per_microbatch": ("rl.max_tokens_per_microbatch", ["--rl.max_tokens_per_microbatch", "0"]),
    "activation_checkpoint": ("activation_checkpoint.mode", ["--activation_checkpoint.mode", "none"]),
    "release_caches": ("rollout.release_caches", ["--rollout.no-release-caches"]),
}
LEVER_SETS = {"all_on": (), **{f"{lever}_off": (lever,) for lever in LEVERS}, "all_off": tuple(LEVERS)}
DEFAULT_LEVER_SETS = [name for name in LEVER_SETS if name != "all_off"]
PHASES = ("rollout", "train")
MEMORY_KEYS = [f"{kind}_gib_{phase}" for phase in PHASES for kind in ("peak", "reserved")]


def most_prompts(fits, start: int, cap: int, resolution: int = 1) -> int:
    """The most prompts p in 1..cap with fits(p), or 0 when one does not fit; fits must be monotone (what
    fits, fits with fewer). Doubling from `start` (up while it fits, down while it does not), then
    bisection between the last fit and the first failure until they are `resolution` prompts apart
    (1: the exact most; more: a lower bound within that many prompts, in fewer probes)."""
    p = max(1, min(start, cap))
    if fits(p):
        fit, fail = p, None
        while fail is None and fit < cap:
            p = min(2 * fit, cap)
            fit, fail = (p, None) if fits(p) else (fit, p)
        if fail is None:
            return cap
    else:
        fit, fail = None, p
        while fit is None:
            if fail == 1:
                return 0
            p = fail // 2
            fit, fail = (p, fail) if fits(p) else (None, p)
    while fail - fit > resolution:
        p = (fit + fail) // 2
        fit, fail = (p, fail) if fits(p) else (fit, p)
    return fit


def rollout_phase(s: RLState, prompts: Prompts, budget: int) -> None:
    """The rollout phase of `prompts` at its largest, without decoding every token (see the module
    docstring): weights, buffers, every decode step at full length, prefill, then collect_rollouts' rule
    for the caches."""
    ro, engine = s.cfg.rollout, s.engine
    engine.load_weights(*s.policy.rollout_weights(True))
    rows, longest = len(prompts), int(prompts.lengths().max())
    engine.reserve(rows, longest + budget + engine.max_k + 1)  # what generate reserves for this budget
    # The longest a running row gets is longest + budget - 1 tokens; one measured replay per step is enough.
    measure_steps(engine, rows, ro.num_speculative_tokens, ro.temperature, ro.top_p, longest + budget - 1, repeats=1)
    engine.generate(prompts.ids, 1, num_speculative_tokens=ro.num_speculative_tokens, temperature=ro.temperature,
                    top_p=ro.top_p, eos_id=s.job.task.tokenizer.eos_id, generator=s.job.generators["rollout"])
    if ro.release_caches:
        engine.release_caches()


@dataclass(frozen=True)
class ProbeSettings:
    """What a probe process builds its job from."""
    config: str
    overrides: tuple[str, ...]
    dump_folder: str
    max_prompts: int  # the most prompts any probe takes


class Prober:
    """One lever set's job (random initialisation, [draft] mode cotrain) and its probes, in this process."""

    def __init__(self, settings: ProbeSettings):
        cfg = job_config(settings.config, list(settings.overrides))
        cfg.rl.prompts_per_step = settings.max_prompts  # the engine's bound on rows (RLState.create)
        job, draft_opt = new_job(cfg, settings.dump_folder)  # the draft's vocabulary: its default ids (shapes only)
        self.state = RLState.create(job, draft_opt)
        self.budget = response_budget(cfg, job.task.max_new_tokens)
        total = torch.cuda.get_device_properties(job.device).total_memory if job.device.type == "cuda" else None
        self.info = {"environment": environment(), "device_gib": total and total / 2**30}
        self.stepped = False  # whether the job has made its first step (one group: the optimizers' states)

    def rollouts(self, prompts: int) -> Rollouts:
        job = self.state.job
        batch = job.task.sample_prompts(prompts, job.generators["data"]).repeat_interleave(self.state.cfg.rl.group_size)
        return random_rollouts(batch, torch.full((len(batch),), self.budget), job.task.tokenizer.vocab_size,
                               job.generators["data"])

    def probe(self, prompts: int) -> dict:
        """Both phases of `prompts` prompts (after the job's first step, on one group, if it has not made it):
        the peak GiB allocated and reserved in each (PhasePeak; None off CUDA, or when the phase did not
        complete), which one ran out of memory (first_step, rollout, train; None: none), seconds in all and
        per phase (phase_seconds: what a probe's time goes to, for planning device time)."""
        s, start = self.state, time.perf_counter()
        rollouts = self.rollouts(prompts)
        record = {"prompts": prompts, "rollouts": len(rollouts.tokens), "tokens_per_rollout": rollouts.tokens.shape[1],
                  "oom": None, **dict.fromkeys(MEMORY_KEYS), "phase_seconds": {}}
        phase, phase_start = "first_step", time.perf_counter()

        def next_phase(name: str) -> None:
            nonlocal phase, phase_start
            record["phase_seconds"][phase] = time.perf_counter() - phase_start
            phase, phase_start = name, time.perf_counter()

        try:
            if not self.stepped:  # from a job's second step on, the optimizers' states are there
                train_step(s, self.rollouts(1))
                self.stepped = True
            next_phase("rollout")
            with PhasePeak(s.job.device) as peak:
                rollout_phase(s, rollouts.prompts, self.budget)
            record.update(peak_gib_rollout=peak.gib, reserved_gib_rollout=peak.reserved_gib)
            next_phase("train")
            with PhasePeak(s.job.device) as peak:
                train_step(s, rollouts)
            record.update(peak_gib_train=peak.gib, reserved_gib_train=peak.reserved_gib)
        except Exception as err:
            if not out_of_memory(err):
                raise
            record["oom"] = phase
        record["phase_seconds"][phase] = time.perf_counter() - phase_start
        record["seconds"] = time.perf_counter() - start
        s.engine.release_caches()  # the next probe starts without them (release_caches = false kept them)
        gc.collect()
        if s.job.device.type == "cuda":
            torch.cuda.empty_cache()
        return {**record, **self.info}


_prober = None  # a probe process's Prober


def probe_in_process(settings: ProbeSettings, prompts: int) -> dict:
    global _prober
    if _prober is None:
        _prober = Prober(settings)
    return _prober.probe(prompts)


def use_device(device: int | None) -> None:
    """A probe process computes on GPU `device` (None: the default device)."""
    if device is not None:
        os.environ["LOCAL_RANK"] = str(device)  # titan_draft.infra._compat.device()
        torch.cuda.set_device(device)  # PhasePeak's statistics are the current device's


class ProbeProcess:
    """A spawned process holding one lever set's Prober on one device, replaced after a probe that ran out
    of memory."""

    def __init__(self, settings: ProbeSettings, device: int | None):
        self.settings, self.device, self.pool = settings, device, None

    def probe(self, prompts: int) -> dict:
        if self.pool is None:
            self.pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), initializer=use_device,
                                            initargs=(self.device,))
        record = self.pool.submit(probe_in_process, self.settings, prompts).result()
        if record["oom"]:
            self.close()
        return record

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()
            self.pool = None


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_job_arguments(p, PRESETS, default="qwen3_1.7b_tail" if torch.cuda.is_available() else "tiny")
    p.add_argument("--levers", nargs="+", choices=list(LEVER_SETS), default=DEFAULT_LEVER_SETS,
                   help="lever sets to search (default: all_on and each lever off alone)")
    p.add_argument("--limit-gib", type=float, help="a probe fits when both phases' allocated peaks are at most "
                   "this (default: the device's memory)")
    p.add_argument("--max-rollouts", type=int, help="the most rollouts probed (default: the preset's)")
    p.add_argument("--resolution", type=int, default=1, help="prompts between the answer and the smallest "
                   "size that failed at which the search stops (default 1: the exact most; e.g. 8 probes less)")
    p.add_argument("--out", help="JSON output path (default bench/results/memory_table_<preset>.json)")
    p.add_argument("--resume", action="store_true", help="take the probes of --out when it holds this run's settings")
    args = p.parse_args()
    preset = resolve_preset(args, PRESETS)
    args.max_rollouts = args.max_rollouts or preset["max_rollouts"]
    if args.resolution < 1:
        p.error(f"--resolution: {args.resolution} must be >= 1 (prompts)")
    args.out = args.out or os.path.join(REPO_ROOT, "bench", "results", f"memory_table_{args.preset}.json")
    return p, args


def lever_set_overrides(p, a) -> tuple[dict[str, list[str]], object]:
    """({lever set: its job config overrides}, the all-on config); every lever must be on in the latter."""
    base = [*a.overrides, "--draft.mode", "cotrain"]
    cfg = job_config(a.config, base)
    for lever, (key, _) in LEVERS.items():
        section, field = key.split(".")
        value = getattr(getattr(cfg, section), field)
        if value in (0, "none", False):
            p.error(f"{key}: {value!r} turns the {lever} lever off in the job config, where every lever must be "
                    "on (the lever sets turn them off); drop that override")
    overrides = {}
    for name in a.levers:
        overrides[name] = [*base, *(o for lever in LEVER_SETS[name] for o in LEVERS[lever][1])]
        job_config(a.config, overrides[name])  # a bad combination fails here, before any probe
    return overrides, cfg


class TableRun:
    """One run's searches (a thread per lever set, each with its probe process) and its report, written
    after every probe. With --resume the report of --out goes on (when made with the same settings): its
    probes are not made again, and its other lever sets stay in it."""

    def __init__(self, a, overrides: dict[str, list[str]], *, group: int, start: int, cap: int, dump_folder: str):
        self.a, self.overrides, self.group, self.start, self.cap = a, overrides, group, start, cap
        self.dump_folder, self.lock = dump_folder, threading.Lock()
        run = {"preset": a.preset, "config": os.path.relpath(a.config, REPO_ROOT), "overrides": a.overrides,
               "limit_gib": a.limit_gib, "max_rollouts": a.max_rollouts, "resolution": a.resolution}
        self.report = {"run": run, "draft_mode": "cotrain", "group_size": group, "start_prompts": start,
                       "table": {}, "probes": {}}
        if a.resume and os.path.isfile(a.out):
            with open(a.out) as f:
                previous = json.load(f)
            if previous["run"] != run:
                raise SystemExit(f"--resume: {a.out} was made with other settings ({previous['run']}, this run: "
                                 f"{run}); leave out --resume or pick another --out")
            self.report = previous
        for name in a.levers:
            self.report["probes"].setdefault(name, [])

    def search(self, name: str, device: int | None) -> None:
        """Lever set `name`'s most prompts, from its probes so far and new ones made on `device`."""
        done = {record["prompts"]: record for record in self.report["probes"][name]}
        settings = ProbeSettings(self.a.config, tuple(self.overrides[name]), self.dump_folder, max_prompts=self.cap)
        process = ProbeProcess(settings, device)

        def fits(prompts: int) -> bool:
            if prompts not in done:
                done[prompts] = self.add_probe(name, process.probe(prompts))
            return done[prompts]["fits"]

        try:
            best = most_prompts(fits, self.start, self.cap, self.a.resolution)
        finally:
            process.close()
        at_best = done.get(best, {})
        failed = [prompts for prompts, record in done.items() if not record["fits"] and prompts > best]
        fails_at = min(failed) * self.group if failed else None
        row = {"levers_off": list(LEVER_SETS[name]), "max_rollouts": best * self.group, "max_prompts": best,
               "fails_at_rollouts": fails_at, "capped": best == self.cap,
               **{key: at_best.get(key) for key in MEMORY_KEYS}, "probes": len(done)}
        with self.lock:
            table = {**self.report["table"], name: row}
            self.report["table"] = {key: table[key] for key in LEVER_SETS if key in table}
            write_json(self.a.out, self.report)

    def add_probe(self, name: str, record: dict) -> dict:
        """The probe process's record with `fits` decided, added to the report (written) and printed."""
        environment, device_gib = record.pop("environment"), record.pop("device_gib")
        measured_on = self.report.get("environment", environment)["device"]
        if measured_on != environment["device"]:
            raise RuntimeError(f"--resume: {self.a.out} holds probes made on {measured_on}, this run's are on "
                               f"{environment['device']}; leave out --resume or pick another --out")
        limit = self.a.limit_gib or device_gib
        peaks = (record["peak_gib_rollout"], record["peak_gib_train"])
        record["fits"] = record["oom"] is None and (limit is None or all(peak <= limit for peak in peaks))
        with self.lock:
            self.report.update(environment=environment, limit_gib=limit)
            self.report["probes"][name].append(record)
            write_json(self.a.out, self.report)
            print(f"{name:<29} {record['rollouts']:>6} rollouts: {describe(record)}", flush=True)
        return record


def main():
    p, a = parse_args()
    overrides, cfg = lever_set_overrides(p, a)
    group = cfg.rl.group_size
    cap = a.max_rollouts // group
    if cap < 1:
        p.error(f"--max-rollouts: {a.max_rollouts} is below one group (rl.group_size = {group})")
    devices = list(range(torch.cuda.device_count())) or [None]  # counted without a CUDA context here
    free = queue.Queue()
    for device in devices:
        free.put(device)
    with tempfile.TemporaryDirectory(prefix="memory_table_") as dump_folder:
        run = TableRun(a, overrides, group=group, start=cfg.rl.prompts_per_step, cap=cap, dump_folder=dump_folder)

        def search_on_a_free_device(name: str) -> None:
            device = free.get()
            try:
                run.search(name, device)
            finally:
                free.put(device)

        with ThreadPoolExecutor(len(devices)) as threads:
            list(threads.map(search_on_a_free_device, a.levers))
    print_table(run.report)
    print(f"wrote {a.out}")


def describe(record: dict) -> str:
    verdict = f"out of memory in {record['oom']}" if record["oom"] else \
        "fits" if record["fits"] else "over the limit"
    return f"{verdict}; GiB {memory(record)}; {record['seconds']:.1f} s"


def memory(row: dict) -> str:
    """Peak GiB allocated / reserved per phase."""
    return ", ".join(f"{phase} {gib(row[f'peak_gib_{phase}'])} / {gib(row[f'reserved_gib_{phase}'])}"
                     for phase in PHASES)


def gib(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def print_table(report: dict) -> None:
    run, limit = report["run"], report.get("limit_gib")
    print(f"\nMost rollouts per RL step that fit, {run['preset']}: [draft] mode cotrain, every rollout at full "
          f"length, groups of {report['group_size']}, at most {run['max_rollouts']} rollouts, limit "
          f"{'none (no memory statistics)' if limit is None else f'{limit:.1f} GiB'}")
    print(f"{'lever set':<29} {'rollouts':>8}  peak GiB allocated / reserved at that size{'':<14} {'probes':>6}")
    for name, row in report["table"].items():
        most = f"{row['max_rollouts']}{'+' if row['capped'] else ''}"
        if row["fails_at_rollouts"] and row["fails_at_rollouts"] > row["max_rollouts"] + report["group_size"]:
            most += f" (< {row['fails_at_rollouts']})"
        print(f"{name:<29} {most:>8}  {memory(row):<56} {row['probes']:>6}")
    print("(+: every probe fitted, up to --max-rollouts)")


if __name__ == "__main__":
    main()
