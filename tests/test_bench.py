"""The RL benches run end to end on CPU at tiny sizes (python -m bench.<name>, as a user runs them) and
write the JSON their README tables are made from:
(a) bench.rl_step --preset tiny: none / frozen / cotrain side by side from one warm-started state (or a
    subset of them, --modes);
(b) bench.rollout_speedup --preset smoke: plain, every fixed K and adaptive K per batch size;
(c) bench.branch_attention on CPU: the row fields of bench/results/branch_attention_h200.json;
(d) bench.linear_logprobs --device cpu --tiny: dense, chunked (eager and compiled) and (CUDA only) liger side by side;
(e) bench.decode_step --preset smoke: plain, verify and whole decode-step costs per batch size;
(f) bench.memory_table: its search on a fake fits rule, and the tiny preset's probes end to end;
(g) bench.train_phase --preset tiny: the RL update alone with and without activation checkpointing, on
    the same rollouts.
"""
import json
import os
import statistics
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_bench(module: str, *args: str, timeout: int = 600) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")  # tiny models: one thread does not crawl when other processes share the cores
    done = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]


def test_rl_step_bench_compares_the_draft_modes_from_one_state(tmp_path):
    out = tmp_path / "rl_step.json"
    run_bench("bench.rl_step", "--preset", "tiny", "--out", str(out), "--profile")
    report = json.loads(out.read_text())
    modes = ("none", "frozen", "cotrain")
    assert tuple(report["table"]) == modes
    rewards = report["reward_per_step"]
    assert all(len(rewards[mode]) == report["skip"] + report["table"][mode]["steps"] for mode in modes)
    # Frozen and cotrain share the first step's draft, prompts and random numbers: the same rollouts. A mode
    # that did not get its own copy of the warm-started state and data streams would differ here.
    assert rewards["frozen"][0] == rewards["cotrain"][0]
    assert report["steps"]["frozen"][0]["acceptance_length"] == report["steps"]["cotrain"][0]["acceptance_length"]
    assert report["steps"]["none"][0]["acceptance_length"] == 1.0  # no draft
    table = report["table"]
    assert table["none"]["draft_s"] == 0
    for mode in ("frozen", "cotrain"):
        assert 0 < table[mode]["draft_share_of_train"] < 1
        assert report["speedups"][f"step_none_over_{mode}"] == table["none"]["step_s"] / table[mode]["step_s"]
    for record in report["steps"]["cotrain"]:
        assert record["rollout_s"] + record["train_s"] <= record["step_s"]  # the step timing holds both parts
        assert record["rollout_capture_s"] == 0  # no CUDA graphs on CPU
    assert table["cotrain"]["rollout_capture_s"] == 0
    # The policy's model FLOP/s: 6 x block parameters per packed token + 6 x head parameters per response
    # token, over the train time less the draft's; no peak to divide by off CUDA.
    policy = report["policy"]
    assert 0 < policy["head_params"] < policy["block_params"] < policy["params"]
    for mode in modes:
        timed = report["steps"][mode][report["skip"]:]
        flops = [6 * (policy["block_params"] * r["packed_tokens"] + policy["head_params"] * r["generated_tokens"])
                 / (r["train_s"] - r["draft_s"]) for r in timed]
        assert table[mode]["policy_train_tflops_per_s"] == statistics.median(flops) / 1e12
        assert table[mode]["policy_train_mfu"] is None and report["peak_flops"] is None
    profile = (tmp_path / "rl_step.profile.txt").read_text()
    for mode in modes:  # one host-time table per mode (CPU), naming the ops the step ran
        assert f"## {mode}: sorted by self_cpu_time_total" in profile
    assert "aten::mm" in profile


def test_rl_step_bench_runs_a_subset_of_modes_one_state_at_a_time(tmp_path):
    out, warm = tmp_path / "rl_step.json", str(tmp_path / "warm")
    run_bench("bench.rl_step", "--preset", "tiny", "--modes", "frozen", "cotrain", "--one-state", "--profile",
              "--warm-start", warm, "--out", str(out), "--", "--draft.train_fraction", "0.5")
    report = json.loads(out.read_text())
    assert tuple(report["table"]) == tuple(report["reward_per_step"]) == ("frozen", "cotrain")
    assert report["speedups"] == {}  # no none to compare with
    assert report["draft"]["train_fraction"] == 0.5  # the report carries the [draft] settings
    # Each mode from the same warm start and data streams, one after the other: the same first rollouts.
    assert report["reward_per_step"]["frozen"][0] == report["reward_per_step"]["cotrain"][0]
    profile = (tmp_path / "rl_step.profile.txt").read_text()  # each mode's tables, appended after its steps
    assert profile.index("## frozen: sorted by") < profile.index("## cotrain: sorted by")
    # A later run of one mode from the saved warm start: loaded, not made again, and the same steps.
    again = tmp_path / "again.json"
    run_bench("bench.rl_step", "--preset", "tiny", "--modes", "frozen", "--warm-start", warm, "--out", str(again),
              "--", "--draft.train_fraction", "0.5")
    loaded = json.loads(again.read_text())
    assert report["warm_start_s"] > 0 and loaded["warm_start_s"] == 0
    assert loaded["reward_per_step"]["frozen"] == report["reward_per_step"]["frozen"]


def test_rollout_speedup_bench_smoke(tmp_path):
    out = tmp_path / "rollout_speedup.json"
    run_bench("bench.rollout_speedup", "--preset", "smoke", "--out", str(out))
    report = json.loads(out.read_text())
    k_max = report["k_max"]
    assert [row["batch"] for row in report["rows"]] == [1, 4]
    for row in report["rows"]:
        fixed = {int(k): v for k, v in row["fixed_k_tok_s"].items()}
        assert sorted(fixed) == list(range(1, k_max + 1))
        assert fixed[row["best_fixed_k"]] == max(fixed.values())
        assert row["adaptive_over_plain"] == row["adaptive_tok_s"] / row["plain_tok_s"]
        assert row["adaptive_over_best_fixed"] == row["adaptive_tok_s"] / max(fixed.values())
        columns = row["columns"]
        assert columns["plain"]["acceptance_length"] == 1.0
        assert len(columns["plain"]["steps_per_k"]) == 1  # every step K = 0
        fixed_steps = columns[f"K={k_max}"]["steps_per_k"]
        assert fixed_steps[:k_max] == [0] * k_max and fixed_steps[k_max] > 0  # every step K = K_max
        assert all(c["generated_tokens"] >= row["batch"] for c in columns.values())
        calls = {1: 2, 4: 1}[row["batch"]]  # 2 prompts per row: batch 1 generates twice per round (one round)
        assert all(sum(c["steps_per_k"]) == calls * c["decode_steps"] for c in columns.values())
        assert sorted(int(k) for k in row["verify_step_ms"]) == list(range(1, k_max + 1))
        assert sorted(int(k) for k in row["decode_step_ms"]) == list(range(k_max + 1))
        assert row["plain_step_ms"] > 0 and row["roofline_ms"] is None  # the roofline needs a GPU's bandwidth
        assert row["plain_step_bytes"] > 0


def test_decode_step_bench_smoke(tmp_path):
    out = tmp_path / "decode_step.json"
    run_bench("bench.decode_step", "--preset", "smoke", "--out", str(out), "--profile")
    report = json.loads(out.read_text())
    assert [(row["variant"], row["batch"]) for row in report["rows"]] == [("eager", 1), ("eager", 4)]
    k_max = len(report["rows"][0]["decode_step_ms"]) - 1
    for row in report["rows"]:
        verify = {int(k): ms for k, ms in row["verify_step_ms"].items()}
        assert sorted(verify) == list(range(1, k_max + 1)) and row["plain_step_ms"] > 0
        assert {int(k): r for k, r in row["verify_over_plain"].items()} == {
            k: ms / row["plain_step_ms"] for k, ms in verify.items()}
        # every weight but the embedding table, its B rows, B x context positions of keys and values
        assert row["plain_step_bytes"] > report["weight_bytes"] // 2
        # kernel profiles need CUDA (torch.profiler's device times of graph replays)
        assert row["profile"] == {"plain": None, f"verify K={k_max}": None, f"whole step K={k_max}": None}


def test_branch_attention_bench_rows(tmp_path):
    out = tmp_path / "branch_attention.json"
    run_bench("bench.branch_attention", "--device", "cpu", "--tokens", "128", "--docs", "1", "4",
              "--passes", "1", "2", "--warmup", "0", "--iters", "1", "--out", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert [(row["docs"], row["passes"]) for row in rows] == [(1, 1), (1, 2), (4, 1), (4, 2)]
    for row in rows:
        assert row["tokens"] == 128 and row["limit_kernel"] == "sdpa"  # FA2 varlen needs CUDA
        assert row["limit_ms"] == row["limits_ms"]["sdpa"] > 0 and row["trunk_ms"] > 0 and row["branch_ms"] > 0
        assert row["flex_ms"] is None and row["limit_peak_gib"] is None  # CUDA only
        assert row["limit_gpu_ms"] is row["branch_gpu_ms"] is row["flex_gpu_ms"] is None
        assert row["branch_vs_limit"] == row["limit_ms"] / row["branch_ms"]
    assert (tmp_path / "branch_attention.txt").read_text().count("\n") >= 6


def test_decode_attention_bench_rows(tmp_path):
    out = tmp_path / "decode_attention.json"
    run_bench("bench.decode_attention", "--batch-sizes", "1", "3", "--queries", "1", "3", "--widths", "17",
              "--iters", "1", "--out", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert [(row["batch"], row["queries"], row["width"]) for row in rows] == [(1, 1, 17), (1, 3, 17), (3, 1, 17),
                                                                              (3, 3, 17)]
    assert all(row["sdpa_ms"] > 0 and row["engine_ms"] > 0 for row in rows)


def test_linear_logprobs_bench_tiny(tmp_path):
    out = tmp_path / "linear_logprobs.json"
    run_bench("bench.linear_logprobs", "--device", "cpu", "--tiny", "--warmup", "1", "--iters", "1", "--out", str(out))
    report = json.loads(out.read_text())
    assert report["liger_kernel"] == "not installed" or report["liger_kernel"].endswith(", needs CUDA")
    variants = ["dense", "chunk_32", "chunk_128", "chunk_32_compiled"]  # no liger off CUDA
    assert [(row["rows"], row["variant"]) for row in report["rows"]] == [(r, v) for r in (128, 512) for v in variants]
    for row in report["rows"]:
        assert row["ms"] > 0 and row["peak_gib"] is None  # CUDA only
        assert row["grad_err"] < 2e-2  # every variant's gradients agree with chunk_32's (bf16 rounding)
        assert row["grad_err"] == 0 if row["variant"] == "chunk_32" else row["grad_err"] > 0
    dense = {row["rows"]: row["ms"] for row in report["rows"] if row["variant"] == "dense"}
    assert all(row["dense_over"] == dense[row["rows"]] / row["ms"] for row in report["rows"])


def test_memory_table_search_doubles_then_bisects():
    from bench.memory_table import most_prompts

    def search(limit: int, start: int, cap: int, resolution: int = 1) -> tuple[int, list[int]]:
        probed = []

        def fits(prompts: int) -> bool:
            probed.append(prompts)
            return prompts <= limit

        return most_prompts(fits, start, cap, resolution), probed

    assert search(75, 8, 512) == (75, [8, 16, 32, 64, 128, 96, 80, 72, 76, 74, 75])  # up, then bisection
    assert search(5, 64, 512) == (5, [64, 32, 16, 8, 4, 6, 5])  # down, then bisection
    assert search(1000, 8, 100) == (100, [8, 16, 32, 64, 100])  # the cap
    assert search(1000, 64, 10) == (10, [10])  # a start past the cap
    assert search(0, 8, 512) == (0, [8, 4, 2, 1])  # nothing fits
    assert search(75, 8, 512, resolution=8) == (72, [8, 16, 32, 64, 128, 96, 80, 72])  # within 8: 3 probes less
    for limit in range(0, 20):  # every case: the right answer, no probe twice, at most ~2 log2(cap) probes
        for start in range(1, 20):
            for cap in range(1, 20):
                found, probed = search(limit, start, cap)
                assert found == min(limit, cap) and len(set(probed)) == len(probed) <= 10


def test_memory_table_knows_out_of_memory_raised_inside_another_error():
    from bench._common import out_of_memory

    try:
        try:
            raise torch.OutOfMemoryError("CUDA out of memory")
        except torch.OutOfMemoryError:
            raise RuntimeError("the capture failed")  # as a CUDA graph capture's exit would
    except RuntimeError as err:
        assert out_of_memory(err)
    assert not out_of_memory(RuntimeError("a bug")) and not out_of_memory(None)


def test_memory_table_rollout_phase_holds_full_length_rows_as_release_caches_says(tmp_path):
    from bench.memory_table import PRESETS, REPO_ROOT, ProbeSettings, Prober, rollout_phase

    tiny = PRESETS["tiny"]
    for release in (True, False):
        lever = [] if release else ["--rollout.no-release-caches"]
        overrides = [*tiny["overrides"], "--draft.mode", "cotrain", *lever]
        prober = Prober(ProbeSettings(os.path.join(REPO_ROOT, tiny["config"]), tuple(overrides), str(tmp_path),
                                      max_prompts=2))
        rollouts, engine = prober.rollouts(2), prober.state.engine
        assert (rollouts.response_lengths == prober.budget).all()  # every answer at the whole budget
        rollout_phase(prober.state, rollouts.prompts, prober.budget)
        if release:
            assert engine.cache_bytes == 0
        else:  # kept for training: 8 rows of the longest prompt + the budget + a verify window (as generate sizes them)
            assert engine.row_state.rows == 8 and engine.row_state.slots >= rollouts.tokens.shape[1] + engine.max_k + 1


def test_memory_table_tiny_probes_end_to_end(tmp_path):
    out = tmp_path / "memory_table.json"
    # all_off turns every lever off at once; 18 rollouts cap the search at 4 prompts of 4 (whole groups).
    args = ("--preset", "tiny", "--levers", "all_on", "all_off", "--max-rollouts", "18", "--out", str(out))
    run_bench("bench.memory_table", *args)
    report = json.loads(out.read_text())
    assert report["environment"]["device"] == "cpu" and report["limit_gib"] is None
    assert report["draft_mode"] == "cotrain" and report["group_size"] == 4
    assert list(report["table"]) == ["all_on", "all_off"]
    assert report["table"]["all_off"]["levers_off"] == ["logprob_chunk_size", "max_tokens_per_microbatch",
                                                        "activation_checkpoint", "release_caches"]
    for name, row in report["table"].items():
        assert (row["max_rollouts"], row["max_prompts"], row["capped"], row["probes"]) == (16, 4, True, 1)
        assert row["fails_at_rollouts"] is None
        (probe,) = report["probes"][name]
        assert (probe["prompts"], probe["rollouts"], probe["fits"], probe["oom"]) == (4, 16, True, None)
        assert 0 < probe["tokens_per_rollout"] <= 16 and probe["seconds"] > 0  # training.seq_len = 16
        phases = probe["phase_seconds"]  # the job's first step, then the probe's two phases
        assert list(phases) == ["first_step", "rollout", "train"] and sum(phases.values()) <= probe["seconds"]
        for key in ("peak_gib_rollout", "reserved_gib_rollout", "peak_gib_train", "reserved_gib_train"):
            assert row[key] is None and probe[key] is None  # no memory statistics off CUDA
    run_bench("bench.memory_table", *args, "--resume")  # every probe is in the file: none is made again
    assert json.loads(out.read_text()) == report


def test_skinny_linear_bench_times_the_engines_fused_projections():
    from bench.skinny_linear import projection_shapes

    # Qwen3-1.7B: 16 query + 2 x 8 kv heads of 128, dim 2,048, MLP 6,144 (gate and up stacked)
    assert projection_shapes("qwen3", "1.7B") == {"qkv": (4096, 2048), "wo": (2048, 2048), "gate_up": (12288, 2048),
                                                  "down": (2048, 6144)}


def test_train_phase_bench_times_updates_of_the_same_rollouts_per_setting(tmp_path):
    out = tmp_path / "train_phase.json"
    run_bench("bench.train_phase", "--preset", "tiny", "--profile", "--out", str(out))
    report = json.loads(out.read_text())
    profile = (tmp_path / "train_phase.profile.txt").read_text()
    assert all(f"## {name}: sorted by self_cpu_time_total" in profile for name in ("eager_none", "eager_full"))
    assert report["rollouts"] == 16 and report["packed_tokens"] > 16  # 4 prompts x 4, with their answers
    assert list(report["table"]) == list(report["records"]) == ["eager_none", "eager_full"]
    assert report["settings"]["eager_full"] == ["--compile.no-enable", "--activation_checkpoint.mode", "full"]
    for name, row in report["table"].items():
        steps = report["records"][name]
        assert len(steps) == 2 and row["steps"] == 1 and row["oom"] is None  # one skipped, one timed
        assert row["step_s"] == steps[1]["step_s"] > row["draft_s"] > 0 and row["peak_gib"] is None  # CPU
        assert row["policy_train_tflops_per_s"] > 0 and row["policy_train_mfu"] is None
        assert {s["packed_tokens"] for s in steps} == {report["packed_tokens"]}
    table = report["table"]
    best = min(row["step_s"] for row in table.values())
    assert all(row["vs_best_eager"] == best / row["step_s"] for row in table.values())


def test_rl_step_bench_one_state_keeps_the_modes_a_cut_short_run_finished(tmp_path, monkeypatch):
    """One mode at a time, the JSON is written after every mode: a run stopped in its second mode
    (here by an error; on a GPU by a time limit) keeps the first mode's steps and table."""
    from bench import rl_step

    finish_one_mode = rl_step.one_mode

    def one_mode(cfg, warm, mode, *args):
        if mode == "cotrain":
            raise KeyboardInterrupt("cut short")
        return finish_one_mode(cfg, warm, mode, *args)

    out = tmp_path / "rl_step.json"
    monkeypatch.setattr(rl_step, "one_mode", one_mode)
    monkeypatch.setattr(sys, "argv", ["rl_step", "--preset", "tiny", "--modes", "none", "cotrain", "--one-state",
                                      "--steps", "1", "--skip", "0", "--out", str(out)])
    with pytest.raises(KeyboardInterrupt, match="cut short"):
        rl_step.main()
    report = json.loads(out.read_text())
    assert list(report["table"]) == list(report["steps"]) == ["none"]
    assert report["table"]["none"]["steps"] == 1


def test_one_warm_start_loads_into_several_compiled_jobs(tmp_path):
    """bench.rl_step loads one warm start into each mode's job; with [compile] on, the policy's blocks are
    torch.compile wrappers (nothing compiles until a forward). A second load gets the same weights."""
    from bench._job import job_config, load_warm_state, new_job, warm_state
    from bench.rl_step import TINY_OVERRIDES

    cfg = job_config(os.path.join(ROOT, "train_configs", "sort_tiny_cpu.toml"), [*TINY_OVERRIDES, "--compile.enable"])
    source, source_opt = new_job(cfg, str(tmp_path / "source"))
    state = warm_state(source, source_opt)
    for seed in (1, 2):
        torch.manual_seed(seed)
        job, draft_opt = new_job(cfg, str(tmp_path / f"job{seed}"))
        for p in job.policy.parameters():
            p.data.normal_()
        load_warm_state(state, job, draft_opt)
        for (name, got), want in zip(job.policy.state_dict().items(), source.policy.state_dict().values()):
            assert torch.equal(got, want), name
