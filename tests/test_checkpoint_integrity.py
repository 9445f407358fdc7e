"""Checkpoints carry checksums and the settings a resume must share (titan_draft/checkpoint.py): a damaged
file is named and skipped for the previous complete checkpoint, a different setting is named with both
values, and the resume says where it starts (or that the job is already done)."""
import json
import os
import shutil

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from titan_draft.checkpoint import IN_RL, MANIFEST, SFT_DONE, WARMUP_DONE, JobCheckpoint
from titan_draft.config import ConfigError, parse_config
from titan_draft.parallel.parallelize import init_process_group
from titan_draft.models import build_models
from titan_draft.plan import build_plan

ROOT = os.path.join(os.path.dirname(__file__), "..")
TINY = ["--job.config_file", os.path.join(ROOT, "train_configs", "sort_tiny_cpu.toml"), "--model.flavor", "tiny_gqa",
        "--training.seq_len", "16", "--task.num_items", "2", "--task.alphabet_size", "4", "--training.steps", "2",
        "--checkpoint.enable", "--checkpoint.interval", "1"]
DAMAGED = "is damaged (its SHA-256 differs from the one recorded at save); falling back to the previous complete " \
          "checkpoint"


def job_checkpoint(folder, *overrides) -> JobCheckpoint:
    cfg = parse_config([*TINY, "--job.dump_folder", str(folder), *overrides])
    _, policy, draft = build_models(cfg, torch.device("cpu"))
    return JobCheckpoint(cfg, policy, draft, {"data": torch.Generator().manual_seed(0)}, plan=build_plan(cfg, 1))


@pytest.fixture
def process_group():
    """The job's group of one process (as titan_draft.train runs without torchrun)."""
    init_process_group(parse_config(TINY))
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """step-1 .. step-4 of a 2-RL-step job: after SFT, after the warm-up, after RL steps 1 and 2."""
    folder = tmp_path_factory.mktemp("saved")
    init_process_group(parse_config(TINY))
    try:
        checkpoint = job_checkpoint(folder)
        for phase, rl_step in [(SFT_DONE, 0), (WARMUP_DONE, 0), (IN_RL, 1), (IN_RL, 2)]:
            checkpoint.save(phase, rl_step)
    finally:
        dist.destroy_process_group()
    return folder


def copy_of(saved, tmp_path):
    shutil.copytree(saved, tmp_path / "job")
    return tmp_path / "job"


def zero(path, offset: int, count: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        assert any(f.read(count)), "these bytes are zeros already"
        f.seek(offset)
        f.write(bytes(count))


def test_finished_job_says_it_is_done(saved, tmp_path, process_group, capsys):
    job = copy_of(saved, tmp_path)
    checkpoint = job_checkpoint(job)
    assert checkpoint.resume_phase() == IN_RL and checkpoint.train_state.rl_step == 2
    assert capsys.readouterr().out == (f"already done: {job}/checkpoint/step-4 holds RL step 2 of 2 (training.steps); "
                                       "raise training.steps to train further\n")
    checkpoint = job_checkpoint(job, "--training.steps", "3")
    assert checkpoint.resume_phase() == IN_RL
    assert capsys.readouterr().out == f"resuming from {job}/checkpoint/step-4 (after RL step 2 of 3)\n"


def test_damaged_checkpoints_are_named_and_skipped(saved, tmp_path, process_group, capsys):
    job = copy_of(saved, tmp_path)
    steps = job / "checkpoint"
    # step-4: 64 KB of zeros in the middle of its data file.
    size = os.path.getsize(steps / "step-4" / "__0_0.distcp")
    zero(steps / "step-4" / "__0_0.distcp", size // 2, 64 * 1024)
    # step-3: 4 KB of zeros inside the bytes of its largest tensor, which DCP alone loads without a word.
    storage = FileSystemReader(str(steps / "step-3")).read_metadata().storage_data
    index, where = max(storage.items(), key=lambda item: item[1].length)
    zero(steps / "step-3" / where.relative_path, where.offset + where.length // 2, 4096)
    shape = FileSystemReader(str(steps / "step-3")).read_metadata().state_dict_metadata[index.fqn].size
    damaged, intact = {index.fqn: torch.empty(shape)}, {index.fqn: torch.empty(shape)}
    dcp.load(damaged, checkpoint_id=str(steps / "step-3"))
    dcp.load(intact, checkpoint_id=str(steps / "step-2"))  # the same weights, saved one step before
    assert not torch.equal(damaged[index.fqn], intact[index.fqn])
    # step-2: its save was killed after DCP's .metadata, before the checksums.
    os.remove(steps / "step-2" / MANIFEST)

    checkpoint = job_checkpoint(job)
    assert checkpoint.resume_phase() == SFT_DONE
    out, err = capsys.readouterr()
    assert err.splitlines() == [
        f"warning: checkpoint file {steps}/step-4/__0_0.distcp {DAMAGED}",
        f"warning: checkpoint file {steps}/step-3/{where.relative_path} {DAMAGED}",
        f"warning: checkpoint {steps}/step-2 has no readable {MANIFEST} (its save did not finish); falling back to the "
        "previous complete checkpoint"]
    assert out == f"resuming from {steps}/step-1 (after SFT)\n"

    with pytest.raises(ConfigError) as error:  # a step asked for by name is not replaced by another
        job_checkpoint(job, "--checkpoint.load_step", "3").resume_phase()
    assert str(error.value) == (f"checkpoint.load_step: checkpoint file {steps}/step-3/{where.relative_path} is "
                                "damaged (its SHA-256 differs from the one recorded at save); pick another step, or -1 "
                                "for the newest intact one")


def test_resume_with_other_settings_names_the_key(saved, tmp_path, process_group):
    job = copy_of(saved, tmp_path)
    with pytest.raises(ConfigError) as error:
        job_checkpoint(job, "--model.flavor", "tiny").resume_phase()
    assert str(error.value) == (f"model.flavor: the checkpoint {job}/checkpoint/step-4 was saved with 'tiny_gqa', this "
                                "job has 'tiny'; resume with the same setting, or use another job.dump_folder")
    manifest = job / "checkpoint" / "step-4" / MANIFEST  # as if saved by 2 processes
    record = json.loads(manifest.read_text())
    record["settings"]["world size (NGPU)"] = 2
    manifest.write_text(json.dumps(record))
    with pytest.raises(ConfigError) as error:
        job_checkpoint(job).resume_phase()
    assert str(error.value) == (f"world size (NGPU): the checkpoint {job}/checkpoint/step-4 was saved with 2, this job "
                                "has 1; resume with the same setting, or use another job.dump_folder")
