"""Every configuration that cannot work fails in titan_draft.config.validate, before any process group,
with one line naming the key and the fix."""
import os

import pytest
import torch.distributed as dist

from titan_draft.cli import validate as validate_cli
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
    (1, ["--draft.cotrain_lr", "-1"], "draft.cotrain_lr: -1.0 must be >= 0 (0 = draft.lr)"),
    (1, ["--draft.train_fraction", "0"], "draft.train_fraction: 0.0 must be in (0, 1] (1 = every rollout)"),
    (1, ["--rl.logprob_chunk_size", "-1"],
     "rl.logprob_chunk_size: -1 must be >= 0 (rows per chunk of the LM head; 0 = no chunking)"),
    (1, ["--rl.max_tokens_per_microbatch", "-5"],
     "rl.max_tokens_per_microbatch: -5 is below training.seq_len = 64, which one rollout can fill; use 0 "
     "(no micro-batches) or >= 64"),
    (1, ["--rl.max_tokens_per_microbatch", "63"],
     "rl.max_tokens_per_microbatch: 63 is below training.seq_len = 64, which one rollout can fill; use 0 "
     "(no micro-batches) or >= 64"),
    (2, ["--parallelism.tensor_parallel_degree", "2", "--rl.logprob_chunk_size", "8"],
     "rl.logprob_chunk_size: 8 needs the whole LM head on every rank, but tensor parallelism splits it over the "
     "vocabulary; set it to 0"),
    (2, ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "2",
         "--rl.max_tokens_per_microbatch", "200"],
     "rl.max_tokens_per_microbatch: 200 holds less than one pipeline microbatch of full rows per pipeline rank "
     "(parallelism.pipeline_parallel_degree 2 x pipeline_parallel_microbatch_size 2 x training.seq_len 64); use 0 "
     "or >= 256"),
    (1, ["--activation_checkpoint.mode", "memory_budget"],
     "activation_checkpoint.mode: 'memory_budget' needs the model compiled; set compile.enable = true (with 'model' "
     "in compile.components) or use 'none', 'selective' or 'full'"),
    (1, ["--compile.enable", "--compile.components", "model,optimizer"],
     "compile.components: ['optimizer'] unknown; use 'model' and/or 'loss'"),
    (2, ["--compile.enable", "--parallelism.context_parallel_degree", "2"],
     "compile.enable: context parallelism's ring attention is not compiled; set compile.enable = false or "
     "parallelism.context_parallel_degree = 1"),
    (2, ["--compile.enable", "--parallelism.tensor_parallel_degree", "2", "--rl.logprob_chunk_size", "0"],
     "compile.enable: tensor-parallel blocks (replicated norms, no sequence parallelism) fail in a compiled "
     "backward; set compile.enable = false or parallelism.tensor_parallel_degree = 1"),
    (1, ["--checkpoint.async_mode", "async"],
     "checkpoint.async_mode: 'async' is not supported; use 'disabled'"),
    (1, ["--checkpoint.last_save_in_hf"],
     "checkpoint.last_save_in_hf: not supported (a full checkpoint keeps the draft); export with "
     "titan_draft.formats.hf.save_policy and `python -m titan_draft.cli.export_draft`"),
    (1, ["--checkpoint.initial_load_path", "/somewhere"],
     "checkpoint.initial_load_path: '/somewhere' is read as Hugging Face safetensors only; set "
     "checkpoint.initial_load_in_hf = true"),
    (1, ["--checkpoint.initial_load_path", "/somewhere", "--checkpoint.initial_load_in_hf"],
     "checkpoint.initial_load_path: '/somewhere' is not a folder; point it at the Hugging Face model folder that "
     "holds the safetensors"),
    (1, ["--checkpoint.keep_latest_k", "1"],
     "checkpoint.keep_latest_k: 1 must be 0 (keep all) or >= 2 (the newest may be mid-save)"),
    (1, ["--checkpoint.interval", "0"],
     "checkpoint.interval: 0 must be >= 1 (RL steps between checkpoints)"),
    (1, ["--comm.train_timeout_seconds", "0"],
     "comm.init_timeout_seconds / train_timeout_seconds: 300 / 0 must be > 0 seconds"),
    (1, ["--draft.tap_layers", "0", "9"],
     "draft.tap_layers: layer 9 is out of range 0..3 for a 4-layer policy; pick layers in 0..3"),
    (1, ["--parallelism.data_parallel_shard_degree", "1", "--parallelism.tensor_parallel_degree", "2"],
     "parallelism: replicate x tp x cp x pp = 2 does not divide the world size 1; set "
     "parallelism.tensor_parallel_degree to 1, or run a multiple of 2 processes (NGPU)"),
    (6, ["--parallelism.tensor_parallel_degree", "4"],
     "parallelism: replicate x tp x cp x pp = 4 does not divide the world size 6; set "
     "parallelism.tensor_parallel_degree to 2, or run a multiple of 4 processes (NGPU)"),
    # Values that used to pass the check and crash after the warm starts, or run silently wrong.
    (1, ["--rl.lr", "-0.001"], "rl.lr: -0.001 must be > 0 (the policy's learning rate in RL)"),
    (1, ["--rl.lr", "0"], "rl.lr: 0.0 must be > 0 (the policy's learning rate in RL)"),
    (1, ["--rl.sft_lr", "-1"], "rl.sft_lr: -1.0 must be > 0 (the policy's learning rate in SFT)"),
    (1, ["--training.seq_len", "24"],
     "training.seq_len: 24 cannot hold a sort prompt of 12 tokens with its answer (11) or a rollout of 13 new tokens "
     "(rollout.max_new_tokens, 0 = answer + 2); use >= 26"),
    (1, ["--training.seq_len", "22", "--rollout.max_new_tokens", "5"],
     "training.seq_len: 22 cannot hold a sort prompt of 12 tokens with its answer (11) or a rollout of 5 new tokens "
     "(rollout.max_new_tokens, 0 = answer + 2); use >= 24"),
    (1, ["--training.seq_len", "0"], "training.seq_len: 0 must be >= 1"),
    (1, ["--rollout.max_new_tokens", "-1"],
     "rollout.max_new_tokens: -1 must be >= 0 (0 = the task's answer length + 2)"),
    (1, ["--task.alphabet_size", "29"],
     "task.alphabet_size: 29 letters and 4 special tokens do not fit the policy's vocabulary of 32; use 1..28"),
    (1, ["--rl.sft_batch_size", "0"], "rl.sft_batch_size: 0 must be >= 1"),
    (1, ["--rl.clip_eps", "-1"],
     "rl.clip_eps: -1.0 must be > 0 (the ratio is clipped to 1 - clip_eps .. 1 + clip_eps)"),
    (1, ["--task.sft_swap_prob", "2"], "task.sft_swap_prob: 2.0 must be a probability in [0, 1]"),
    (1, ["--task.num_items", "0"], "task.num_items: 0 must be >= 1"),
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


def one_line_error(capsys, argv) -> str:
    """What `python -m titan_draft.cli.validate argv` prints, checked to be one line and exit code 2."""
    code = validate_cli.main(argv)
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    return err


def test_mistyped_toml_value_is_named_with_its_type(tmp_path, capsys):
    with open(CONFIG) as f:
        text = f.read()
    bad = tmp_path / "bad.toml"
    bad.write_text(text.replace("lr = 6e-4", 'lr = "abc"'))
    assert one_line_error(capsys, ["--job.config_file", str(bad)]) == \
        "config error: rl.lr: 'abc' has type str, expected float; fix it in the config file\n"
    bad.write_text(text.replace("tap_layers = [0, 1, 2]", 'tap_layers = [0, "1"]'))
    assert one_line_error(capsys, ["--job.config_file", str(bad)]) == \
        "config error: draft.tap_layers: [0, '1'] has type list, expected list[int]; fix it in the config file\n"


def test_missing_or_malformed_config_file_is_one_line(tmp_path, capsys):
    missing = tmp_path / "missing.toml"
    assert one_line_error(capsys, ["--job.config_file", str(missing)]) == \
        f"config error: job.config_file: cannot read {missing} (No such file or directory)\n"
    malformed = tmp_path / "malformed.toml"
    malformed.write_text("[rl\nlr = 1\n")
    assert one_line_error(capsys, [f"--job.config_file={malformed}"]) == \
        f"config error: job.config_file: {malformed} is not valid TOML: Expected ']' at the end of a table " \
        "declaration (at line 1, column 4)\n"


def test_training_job_rejects_before_any_process_group(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ConfigError, match="rl.prompts_per_step"):
        train_main(["--job.config_file", CONFIG, "--parallelism.data_parallel_shard_degree", "4",
                    "--rl.prompts_per_step", "6"])
    assert not dist.is_initialized()
