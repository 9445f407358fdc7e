"""titan_draft.config.validate: one test per rule; the CLI entry; the shipped configs; precedence."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from titan_draft.cli.validate import check
from titan_draft.config import ConfigError, parse_config, validate
from titan_draft.models import build_models, tap_layers

ROOT = Path(__file__).resolve().parents[1]
TOML = ROOT / "train_configs" / "sort_tiny_cpu.toml"
N_LAYERS, VOCAB = 4, 32  # the tiny policy of that config


@pytest.fixture(scope="module")
def base_cfg():
    return parse_config(["--job.config_file", str(TOML)])


def cfg_with(base_cfg, **changes):
    """A copy of the shipped config with "section.key" values replaced."""
    import copy

    cfg = copy.deepcopy(base_cfg)
    for dotted, value in changes.items():
        section, key = dotted.split("__")
        setattr(getattr(cfg, section), key, value)
    return cfg


def expect_error(cfg, key, world_size=1):
    with pytest.raises(ConfigError) as err:
        validate(cfg, world_size)
    message = str(err.value)
    assert message.startswith(key), message
    assert "\n" not in message
    return message


def passes_rule(cfg, key, world_size=1):
    """The rule named `key` accepts cfg (a later rule, e.g. what titan_draft.train supports yet, may not)."""
    try:
        validate(cfg, world_size)
    except ConfigError as err:
        assert not str(err).startswith(key), str(err)


def test_base_config_is_valid(base_cfg):
    validate(base_cfg, 1)


@pytest.mark.parametrize("layers", [[0, 1, 4], [-1, 1, 2]])
def test_tap_layer_out_of_range(base_cfg, layers):
    msg = expect_error(cfg_with(base_cfg, draft__tap_layers=layers), "draft.tap_layers:")
    assert "out of range 0..3" in msg


@pytest.mark.parametrize("layers", [[0, 1, 1], [2, 1, 3]])
def test_tap_layers_distinct_and_ascending(base_cfg, layers):
    msg = expect_error(cfg_with(base_cfg, draft__tap_layers=layers), "draft.tap_layers:")
    assert "distinct and ascending" in msg


def test_default_tap_layers_used_when_empty(base_cfg):
    # empty = (1, L//2-1, L-4) as in EAGLE-3: for 8 layers [1, 3, 4]; for 4 layers {1, 1, 0} -> [0, 1]
    cfg = cfg_with(base_cfg, draft__tap_layers=[])
    assert tap_layers(cfg.draft, 8) == [1, 3, 4] and tap_layers(cfg.draft, 32) == [1, 15, 28]
    assert tap_layers(cfg.draft, N_LAYERS) == [0, 1]
    plan = validate(cfg, 1)
    _, _, draft = build_models(cfg, torch.device("cpu"))  # what the job builds with them
    assert plan.tap_layers == (0, 1) and draft.args.n_taps == 2
    assert tap_layers(cfg_with(base_cfg, draft__tap_layers=[0, 2]).draft, 8) == [0, 2]  # explicit ones win


@pytest.mark.parametrize("steps", [0, -2])
def test_ttt_steps_at_least_one(base_cfg, steps):
    expect_error(cfg_with(base_cfg, draft__ttt_steps=steps), "draft.ttt_steps:")


def test_draft_vocab_not_larger_than_policy(base_cfg):
    expect_error(cfg_with(base_cfg, draft__vocab_size=VOCAB + 1), "draft.vocab_size:")
    validate(cfg_with(base_cfg, draft__vocab_size=VOCAB), 1)  # equal is fine
    validate(cfg_with(base_cfg, draft__vocab_size=0), 1)  # 0 = all


def test_pass_decay_positive(base_cfg):
    expect_error(cfg_with(base_cfg, draft__pass_decay=0.0), "draft.pass_decay:")


def test_draft_lr_positive(base_cfg):
    expect_error(cfg_with(base_cfg, draft__lr=0.0), "draft.lr")


@pytest.mark.parametrize("size", [1, 0])
def test_group_size_at_least_two(base_cfg, size):
    expect_error(cfg_with(base_cfg, rl__group_size=size), "rl.group_size:")


def test_prompts_per_step_at_least_one(base_cfg):
    expect_error(cfg_with(base_cfg, rl__prompts_per_step=0), "rl.prompts_per_step:")


def test_num_speculative_tokens_at_least_one(base_cfg):
    expect_error(cfg_with(base_cfg, rollout__num_speculative_tokens=0), "rollout.num_speculative_tokens:")


def test_temperature_not_negative(base_cfg):
    expect_error(cfg_with(base_cfg, rollout__temperature=-0.1), "rollout.temperature:")
    validate(cfg_with(base_cfg, rollout__temperature=0.0), 1)  # greedy is fine


@pytest.mark.parametrize("top_p", [0.0, -0.5, 1.01])
def test_top_p_in_unit_interval(base_cfg, top_p):
    expect_error(cfg_with(base_cfg, rollout__top_p=top_p), "rollout.top_p:")


def test_degrees_must_divide_world_size(base_cfg):
    cfg = cfg_with(base_cfg, parallelism__tensor_parallel_degree=2, parallelism__data_parallel_replicate_degree=2)
    msg = expect_error(cfg, "parallelism:", world_size=6)
    assert "= 4 does not divide the world size 6" in msg
    validate(cfg, 8)  # 8 = 2 (shard, inferred from -1) x replicate 2 x tp 2


def test_plan_is_the_config_resolved(base_cfg):
    cfg = cfg_with(base_cfg, parallelism__tensor_parallel_degree=2, parallelism__data_parallel_replicate_degree=2,
                   draft__tap_layers=[])
    plan = validate(cfg, 8)
    assert (plan.world_size, plan.dp_replicate, plan.dp_shard, plan.cp, plan.tp, plan.pp) == (8, 2, 2, 1, 2, 1)
    assert plan.dp == 4 and plan.distributed and plan.tap_layers == (0, 1)  # -1 and the default taps resolved
    assert plan.checkpoint_folder == os.path.join(cfg.job.dump_folder, cfg.checkpoint.folder)
    decisions = {mode: validate(cfg_with(base_cfg, draft__mode=mode), 1) for mode in ("cotrain", "frozen", "none")}
    assert {mode: (p.speculate, p.train_draft) for mode, p in decisions.items()} == {
        "cotrain": (True, True), "frozen": (True, False), "none": (False, False)}
    assert not decisions["none"].distributed and decisions["none"].dp == 1


def test_degree_at_least_one(base_cfg):
    expect_error(cfg_with(base_cfg, parallelism__pipeline_parallel_degree=0),
                 "parallelism.pipeline_parallel_degree:")


def test_shard_degree_must_match_world_size(base_cfg):
    cfg = cfg_with(base_cfg, parallelism__data_parallel_shard_degree=3, parallelism__tensor_parallel_degree=2)
    msg = expect_error(cfg, "parallelism.data_parallel_shard_degree:", world_size=4)
    assert "set it to 2" in msg
    validate(cfg_with(cfg, parallelism__data_parallel_shard_degree=2), 4)


def test_seq_len_divisible_by_twice_cp(base_cfg):
    cfg = cfg_with(base_cfg, parallelism__context_parallel_degree=4, training__seq_len=68)
    msg = expect_error(cfg, "training.seq_len:", world_size=4)
    assert "8" in msg
    passes_rule(cfg_with(cfg, training__seq_len=72), "training.seq_len", world_size=4)


def test_pipeline_degree_not_above_layers(base_cfg):
    cfg = cfg_with(base_cfg, parallelism__pipeline_parallel_degree=N_LAYERS + 1)
    expect_error(cfg, "parallelism.pipeline_parallel_degree:", world_size=N_LAYERS + 1)
    passes_rule(cfg_with(base_cfg, parallelism__pipeline_parallel_degree=N_LAYERS),
                "parallelism.pipeline_parallel_degree: 4 exceeds", world_size=N_LAYERS)


def test_unknown_toml_key_through_the_cli(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text(TOML.read_text().replace("ttt_steps = 3", "ttt_steps = 3\nbogus_key = 1"))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "titan_draft.cli.validate", "--job.config_file", str(bad)],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1, lines
    assert lines[0].startswith("config error:") and "bogus_key" in lines[0]


@pytest.mark.parametrize("path", sorted((ROOT / "train_configs").glob("*.toml")), ids=lambda p: p.name)
def test_shipped_configs_validate(path, tmp_path):
    argv = ["--job.config_file", str(path)]
    cfg = parse_config(argv)
    if cfg.model.flavor == "hf":  # the user's model and data: made here (tiny, random), the recipe kept
        from scripts.make_tiny_hf import write_demo_inputs

        inputs = write_demo_inputs(str(tmp_path), cfg.model.name, vocab_size=384, train_problems=16,
                                   test_problems=4, seed=0)
        argv += ["--model.hf_assets_path", inputs.model, "--checkpoint.initial_load_path", inputs.model,
                 "--training.dataset_path", inputs.train, "--draft.vocab_size", str(min(cfg.draft.vocab_size, 384)),
                 "--task.prompt_field", "prompt", "--task.answer_field", "answer"]  # the made file's fields
    check(argv, world_size=1)


def test_cli_overrides_take_precedence_over_toml():
    base = parse_config(["--job.config_file", str(TOML)])
    assert base.draft.tap_layers == [0, 1, 2] and base.draft.ttt_steps == 3
    cfg = parse_config(["--job.config_file", str(TOML), "--draft.tap_layers", "0", "2", "3",
                        "--draft.ttt_steps", "5", "--rollout.temperature", "0.5"])
    assert cfg.draft.tap_layers == [0, 2, 3]
    assert cfg.draft.ttt_steps == 5
    assert cfg.rollout.temperature == 0.5
    assert cfg.draft.vocab_size == base.draft.vocab_size == 20  # untouched keys keep the TOML's value
    validate(cfg, 1)
