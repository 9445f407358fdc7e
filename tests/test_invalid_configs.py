"""Every configuration that cannot work fails in titan_draft.config.validate, before any process group,
with one line naming the key and the fix."""
import os

import pytest
import torch.distributed as dist

from titan_draft import validate as validate_cli
from titan_draft.config import ConfigError
from titan_draft.train import main as train_main

CONFIG = os.path.join(os.path.dirname(__file__), "..", "train_configs", "sort_tiny_cpu.toml")
GQA = ["--model.flavor", "tiny_gqa"]  # 4 heads, 2 kv heads

CASES = [  # (world size, overrides, exact message)
    (4, ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.tensor_parallel_degree", "2",
         "--rl.prompts_per_step", "3"],
     "rl.prompts_per_step: 3 does not divide among the 2 data-parallel ranks; use a multiple of 2"),
    (4, [*GQA, "--parallelism.tensor_parallel_degree", "4"],
     "parallelism.tensor_parallel_degree: 4 does not divide the 2 policy kv heads (model.flavor); "
     "use a degree that divides it"),
    (2, ["--parallelism.tensor_parallel_degree", "2", "--draft.n_heads", "2", "--draft.n_kv_heads", "1"],
     "parallelism.tensor_parallel_degree: 2 does not divide the 1 draft.n_kv_heads; use a degree that divides it"),
    (2, ["--parallelism.tensor_parallel_degree", "2", "--draft.vocab_size", "15"],
     "parallelism.tensor_parallel_degree: 2 does not divide the 15 draft.vocab_size (the draft's lm_head is split "
     "over it); use a degree that divides it"),
    (2, ["--model.name", "qwen3", "--parallelism.tensor_parallel_degree", "2"],
     "model.name: tensor parallelism is wired for llama3 only, not 'qwen3'; "
     "set parallelism.tensor_parallel_degree = 1"),
    (4, ["--parallelism.data_parallel_shard_degree", "3"],
     "parallelism.data_parallel_shard_degree: 3 x (replicate x tp x cp x pp = 1) = 3 != world size 4; "
     "set it to 4 or -1"),
    (4, ["--parallelism.context_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "2",
         "--rl.prompts_per_step", "5"],
     "rl.prompts_per_step: 5 does not divide among the 2 data-parallel ranks; use a multiple of 2"),
    (4, ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "3"],
     "parallelism.pipeline_parallel_microbatch_size: 3 does not divide the 128 rollouts of a data-parallel rank "
     "(rl.prompts_per_step x rl.group_size / 2); use a divisor of 128"),
    (4, ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"],
     "parallelism.pipeline_parallel_schedule: 'ZBVZeroBubble' cannot run the RL step (torch's zero-bubble runtime "
     "fails on the reference policy's forward-only pass and on FSDP-wrapped stages' weight pass); use 1F1B, GPipe "
     "or Interleaved1F1B"),
    (4, ["--parallelism.pipeline_parallel_degree", "4", "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"],
     "parallelism.pipeline_parallel_schedule: 'Interleaved1F1B' on 4 pipeline ranks needs 8 stages, more than the "
     "policy's 4 layers; use 1F1B or GPipe, or a smaller degree"),
    (2, ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "Bogus"],
     "parallelism.pipeline_parallel_schedule: 'Bogus' is unknown; use 1F1B, GPipe or Interleaved1F1B"),
    (1, ["--checkpoint.async_mode", "async"],
     "checkpoint.async_mode: 'async' is not supported; use 'disabled'"),
    (1, ["--checkpoint.last_save_in_hf"],
     "checkpoint.last_save_in_hf: not supported (a full checkpoint keeps the draft); export with "
     "titan_draft.hf.save_policy and `python -m titan_draft.export_draft`"),
    (1, ["--checkpoint.initial_load_path", "/somewhere"],
     "checkpoint.initial_load_in_hf / initial_load_path: not supported; import Hugging Face weights with "
     "titan_draft.hf.load_policy"),
    (1, ["--checkpoint.keep_latest_k", "1"],
     "checkpoint.keep_latest_k: 1 must be 0 (keep all) or >= 2 (the newest may be mid-save)"),
    (1, ["--checkpoint.interval", "0"],
     "checkpoint.interval: 0 must be >= 1 (RL steps between checkpoints)"),
    (1, ["--comm.train_timeout_seconds", "0"],
     "comm.init_timeout_seconds / train_timeout_seconds: 300 / 0 must be > 0 seconds"),
    (1, ["--draft.tap_layers", "0", "9"],
     "draft.tap_layers: layer 9 is out of range 0..3 for a 4-layer policy; pick layers in 0..3"),
]


@pytest.mark.parametrize("world_size, overrides, message", CASES, ids=[c[2].split(":")[0] for c in CASES])
def test_invalid_config_fails_with_one_line(world_size, overrides, message):
    with pytest.raises(ConfigError) as err:
        validate_cli.check(["--job.config_file", CONFIG, *overrides], world_size)
    assert str(err.value) == message


def test_validate_command_prints_one_line_and_exits_2(capsys):
    code = validate_cli.main(["--world-size", "4", "--job.config_file", CONFIG,
                              "--parallelism.pipeline_parallel_degree", "4", "--parallelism.tensor_parallel_degree",
                              "2"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("config error: parallelism: replicate x tp x cp x pp")


def test_training_job_rejects_before_any_process_group(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ConfigError, match="rl.prompts_per_step"):
        train_main(["--job.config_file", CONFIG, "--parallelism.data_parallel_shard_degree", "4",
                    "--rl.prompts_per_step", "6"])
    assert not dist.is_initialized()
