"""The RL step and the whole job on a tiny config (CPU, one process):
(a) given the same rollouts, the policy update is bit-identical under [draft] mode cotrain / frozen / none,
    and only cotrain moves the draft;
(b) whole runs are deterministic: same seed -> identical metrics.jsonl (time keys aside), other seed -> not;
(c) notebooks/acceptance_vs_step.ipynb executes on the runs of (b) and its outputs carry their numbers.
"""
import copy
import dataclasses
import json
import math
import os

import pytest
import torch

from scripts.execute_notebook import execute_notebook
from titan_draft.config import parse_config
from titan_draft.infra.metrics import TIMING_KEYS, MetricsLogger, read_metrics
from titan_draft.job import build_job
from titan_draft.models.cotrain import DraftOptimizer
from titan_draft.plan import build_parallel_dims, build_plan
from titan_draft.rl.warmstart import WarmStartRun, draft_vocab_from_data, sft_policy
from titan_draft.train import RLState, collect_rollouts, main, train_step

ROOT = os.path.join(os.path.dirname(__file__), "..")
TINY = ["--job.config_file", os.path.join(ROOT, "train_configs", "sort_tiny_cpu.toml"), "--model.flavor", "tiny_gqa",
        "--training.seq_len", "16", "--task.num_items", "2", "--task.alphabet_size", "4", "--rl.sft_steps", "30",
        "--rl.sft_batch_size", "16", "--draft.warmup_steps", "3", "--rl.prompts_per_step", "4",
        "--rl.group_size", "4", "--training.steps", "3"]
MODES = ("cotrain", "frozen", "none")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models: one thread is as fast as two and does not crawl when other processes share the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def params(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def same(a, b):
    return all(torch.equal(a[k], b[k]) for k in a)


def test_policy_update_is_the_same_in_every_draft_mode(tmp_path):
    cfg = parse_config([*TINY, "--job.dump_folder", str(tmp_path)])
    metrics = MetricsLogger(str(tmp_path), tensorboard=False)
    plan = build_plan(cfg, 1)
    job = build_job(cfg, metrics, plan=plan, dims=build_parallel_dims(plan))
    policy, draft, task = job.policy, job.draft, job.task
    # A partly trained policy, so that some groups hold both rewards and the GRPO update is not zero.
    cfg.rl.sft_steps = 30
    sft_policy(policy, task, cfg.rl, cfg.lr_scheduler, WarmStartRun(job.generators["data"], job.device, metrics))
    draft_vocab_from_data(task, draft, job.generators["data"])
    state = RLState.create(job, DraftOptimizer(draft, cfg.draft))
    rollouts = collect_rollouts(state)  # speculative (cotrain's engine); the same rollouts feed every mode
    rewards = task.rewards(rollouts.prompts, rollouts.responses())
    assert rewards.view(-1, cfg.rl.group_size).std(1).gt(0).any(), "no group with mixed rewards: the test is void"

    policy_before, draft_before = params(policy), params(draft)
    after = {}
    for mode in MODES:  # a fresh state per mode on copies of the models (torchtitan's optimizers do not deep-copy)
        mode_cfg = copy.deepcopy(cfg)
        mode_cfg.draft.mode = mode
        mode_policy, mode_draft, mode_opt = copy.deepcopy((policy, draft, state.draft_opt))
        s = RLState.create(dataclasses.replace(job, cfg=mode_cfg, plan=build_plan(mode_cfg, 1), policy=mode_policy,
                                               draft=mode_draft), mode_opt)
        stats = train_step(s, copy.deepcopy(rollouts))
        after[mode] = params(s.policy.parts[0]), params(s.job.draft), stats
    assert not same(after["cotrain"][0], policy_before)  # the policy did move
    for mode in ("frozen", "none"):
        assert same(after[mode][0], after["cotrain"][0]), mode  # bit-identical policy update
        assert after[mode][2]["policy_loss"] == after["cotrain"][2]["policy_loss"]
        assert same(after[mode][1], draft_before), mode  # frozen / none leave the draft alone
    assert not same(after["cotrain"][1], draft_before)  # co-training moved it
    assert after["frozen"][2]["draft_loss"] == after["cotrain"][2]["draft_loss"]  # same forward, before the update
    assert "draft_loss" not in after["none"][2]
    for mode in ("cotrain", "frozen"):  # the draft's part of the step is timed, and is a part of it
        assert 0 < after[mode][2]["draft_time_s"] < after[mode][2]["train_time_s"], mode
    assert "draft_time_s" not in after["none"][2]

    # draft.train_fraction 0.5: the same policy update; the draft trained on half of the rollouts (and
    # draft.cotrain_lr: RL's own draft learning rate, draft.lr otherwise)
    assert state.draft_opt.optimizer.param_groups[0]["lr"] == cfg.draft.lr
    half_cfg = copy.deepcopy(cfg)
    half_cfg.draft.train_fraction, half_cfg.draft.cotrain_lr = 0.5, 3e-4
    half_policy, half_draft, half_opt = copy.deepcopy((policy, draft, state.draft_opt))
    s = RLState.create(dataclasses.replace(job, cfg=half_cfg, policy=half_policy, draft=half_draft), half_opt)
    assert half_opt.optimizer.param_groups[0]["lr"] == 3e-4
    stats = train_step(s, copy.deepcopy(rollouts))
    assert same(params(half_policy), after["cotrain"][0]) and stats["policy_loss"] == after["cotrain"][2]["policy_loss"]
    assert not same(params(half_draft), draft_before) and not same(params(half_draft), after["cotrain"][1])
    assert stats["draft_loss"] != after["cotrain"][2]["draft_loss"]  # measured on the drawn rollouts
    metrics.close()


@pytest.mark.parametrize("mode", ["frozen", "cotrain"])
def test_a_frozen_draft_reaches_the_engine_once(tmp_path, mode):
    """collect_rollouts hands the engine a co-trained draft in every step (it changed), a frozen one in the
    first only (it never changes: each later copy would cost a drafting call the draft's weight copy)."""
    cfg = parse_config([*TINY, "--job.dump_folder", str(tmp_path), "--draft.mode", mode])
    plan = build_plan(cfg, 1)
    job = build_job(cfg, MetricsLogger(str(tmp_path), tensorboard=False), plan=plan, dims=build_parallel_dims(plan))
    state = RLState.create(job, DraftOptimizer(job.draft, cfg.draft))
    given, load = [], state.engine.load_weights
    state.engine.load_weights = lambda policy, draft=None: (given.append(draft is not None), load(policy, draft))
    for _ in range(3):
        collect_rollouts(state)
    assert given == ([True] * 3 if mode == "cotrain" else [True, False, False])
    assert same(params(state.engine.draft), params(job.draft))


def run_job(folder, *overrides):
    main([*TINY, "--job.dump_folder", str(folder), *overrides])
    return read_metrics(os.path.join(folder, "metrics.jsonl"))


def without_time(records):
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in records]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Short whole runs: seed 0 in every mode (the notebook's input), seed 0 again and seed 1 (cotrain)."""
    root = tmp_path_factory.mktemp("rl_runs")
    records = {mode: run_job(root / "seed0" / mode, "--draft.mode", mode) for mode in MODES}
    records["cotrain_again"] = run_job(root / "again", "--draft.mode", "cotrain")
    records["cotrain_seed1"] = run_job(root / "seed1", "--draft.mode", "cotrain", "--debug.seed", "1")
    return root, records


def test_whole_runs_are_deterministic(runs):
    _, records = runs
    first, again, other = records["cotrain"], records["cotrain_again"], records["cotrain_seed1"]
    phases = {r["phase"] for r in first}
    assert phases == {"sft", "draft_warmup", "rl"}
    assert [r["step"] for r in first if r["phase"] == "rl"] == [1, 2, 3]
    assert without_time(first) == without_time(again)
    rl = [r for r in without_time(first) if r["phase"] == "rl"]
    rl_other = [r for r in without_time(other) if r["phase"] == "rl"]
    assert all(a != b for a, b in zip(rl, rl_other))  # another seed: other prompts, samples and weights
    # Every mode runs the same SFT (warm-up data has its own stream): identical SFT records.
    sft = [without_time(r for r in records[m] if r["phase"] == "sft") for m in MODES]
    assert sft[0] == sft[1] == sft[2]
    assert not any(r["phase"] == "draft_warmup" for r in records["none"])


def test_notebook_plots_the_runs(runs, tmp_path):
    root, records = runs
    out = tmp_path / "out"
    execute_notebook(root / "seed0", out)
    for png in ("acceptance_vs_step.png", "rollout_speedup.png", "response_lengths.png"):
        with open(out / png, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n", png
    with open(out / "acceptance_summary.json") as f:
        summary = json.load(f)
    window = summary["window_steps"]
    assert set(summary["runs"]) == set(MODES)
    for mode in MODES:
        rl = [r for r in records[mode] if r["phase"] == "rl"]
        got = summary["runs"][mode]
        assert got["rl_steps"] == len(rl) == 3
        for key in ("tokens_per_verify_forward", "reward_mean"):
            assert math.isclose(got[f"{key}_first{window}"], sum(r[key] for r in rl[:window]) / len(rl[:window]))
            assert math.isclose(got[f"{key}_last{window}"], sum(r[key] for r in rl[-window:]) / len(rl[-window:]))
        tps = sum(r["rollout_tokens_per_s"] for r in rl) / len(rl)
        assert math.isclose(got["rollout_tokens_per_s"], tps)
    assert summary["runs"]["none"]["tokens_per_verify_forward_first5"] == 1.0  # no speculation: one token per forward
    warm = [r for r in records["cotrain"] if r["phase"] == "draft_warmup"]
    assert math.isclose(summary["runs"]["cotrain"]["draft_acc_pass1_end_of_warmup"], warm[-1]["draft_acc_pass1"])
    cot, fro = summary["runs"]["cotrain"], summary["runs"]["frozen"]
    assert math.isclose(summary["cotrain_minus_frozen_acceptance_last"],
                        cot[f"tokens_per_verify_forward_last{window}"] - fro[f"tokens_per_verify_forward_last{window}"])
