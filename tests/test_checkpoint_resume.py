"""Kill the training job (SIGKILL) mid-run and inside a checkpoint save; each resume continues from the
latest COMPLETE checkpoint, says which, and the RL metrics equal those of an uninterrupted run with the same
seed, one row per step. The same holds for a pipeline-parallel job under torchrun (2 gloo ranks, the
launcher's process group killed: the workers die with it), whose progress lines reach the --tee log whole."""
import json
import os
import re
import signal
import subprocess
import sys
import time

from titan_draft.checkpoint import check_checkpoint, complete_steps as checkpoint_steps
from titan_draft.infra.metrics import TIMING_KEYS

ROOT = os.path.join(os.path.dirname(__file__), "..")
KILL_DURING_SAVE = os.path.join(os.path.dirname(__file__), "kill_during_save.py")
TINY = ["--job.config_file", os.path.join(ROOT, "train_configs", "sort_tiny_cpu.toml"), "--model.flavor", "tiny_gqa",
        "--training.seq_len", "16", "--task.num_items", "2", "--task.alphabet_size", "4", "--rl.sft_steps", "15",
        "--draft.warmup_steps", "2", "--rl.prompts_per_step", "4", "--rl.group_size", "4", "--rl.sft_batch_size", "16",
        "--training.steps", "4", "--checkpoint.enable", "--checkpoint.interval", "1",
        "--metrics.no-enable-tensorboard"]


PIPELINE = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "4"]


def start(folder, pipeline=False, kill_in_save_of=None):
    """The job as one process, or (pipeline) as 2 torchrun ranks (as run_train.sh starts them), the launcher
    in a process group of its own; kill_in_save_of: SIGKILLed inside the save of that progress step."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                "--local-ranks-filter", "0", "--role", "rank", "--tee", "3"] if pipeline else [sys.executable]
    train = ["-m", "titan_draft.train"] if kill_in_save_of is None else [KILL_DURING_SAVE, str(kill_in_save_of)]
    return subprocess.Popen([*launcher, *train, *TINY, *(PIPELINE if pipeline else []), "--job.dump_folder",
                             str(folder)],
                            cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.path.abspath(ROOT)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def kill_after_first_rl_step(run, folder):
    """SIGKILL the job's process group as soon as its first RL step is logged (like `kill -9 -- -<pgid>`);
    every process the job started must be gone within seconds."""
    deadline = time.monotonic() + 240
    while 1 not in rl_metrics(folder):
        assert run.poll() is None and time.monotonic() < deadline, "the run ended before its first RL step"
        time.sleep(0.2)
    workers = children(run.pid)
    os.killpg(run.pid, signal.SIGKILL)
    run.wait()
    deadline = time.monotonic() + 5
    while any(os.path.exists(f"/proc/{pid}") and not zombie(pid) for pid in workers):
        assert time.monotonic() < deadline, f"workers {workers} outlived their launcher"
        time.sleep(0.05)


def children(pid: int) -> list[int]:
    ppid_of = {}
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid_of[int(name)] = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError):
            pass
    return [child for child, parent in ppid_of.items() if parent == pid]


def zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return False


def finish(process, timeout=240):
    out, err = process.communicate(timeout=timeout)
    return process.returncode, out, err


def assert_one_row_per_step(folder):
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        keys = [(r["phase"], r["step"]) for r in map(json.loads, f)]
    assert len(keys) == len(set(keys)), "a resumed run appended the steps it redid again"


def rl_metrics(folder) -> dict[int, dict]:
    """The last record of every RL step (a resumed run appends the steps it redoes)."""
    path = os.path.join(folder, "metrics.jsonl")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    return {r["step"]: {k: v for k, v in r.items() if k not in TIMING_KEYS} for r in records if r["phase"] == "rl"}


def complete_steps(folder) -> list[int]:
    """Steps a resume may load (check_checkpoint: `.metadata` AND the manifest written after it; a SIGKILL
    can fall between the two)."""
    root = os.path.join(folder, "checkpoint")
    return sorted(step for step in checkpoint_steps(root)
                  if check_checkpoint(os.path.join(root, f"step-{step}")) is None)


def test_sigkill_mid_run_and_inside_save_resume_exactly(tmp_path):
    reference, resumed = tmp_path / "uninterrupted", tmp_path / "killed"
    uninterrupted = start(reference)

    # 1. SIGKILL as soon as the first RL step is logged (its checkpoint may or may not be written).
    kill_after_first_rl_step(start(resumed), resumed)
    killed_at = complete_steps(resumed)[-1]
    assert killed_at >= 2  # SFT (step-1) and warm-up (step-2) were saved

    # 2. Resume; SIGKILL inside the save of RL step 3 (progress id 5): data files written, no .metadata.
    code, out, err = finish(start(resumed, kill_in_save_of=5))
    assert code == -signal.SIGKILL, err[-2000:]
    assert out.startswith(f"resuming from {resumed}/checkpoint/step-{killed_at} ("), out[:2000]
    partial = os.path.join(resumed, "checkpoint", "step-5")
    assert os.path.isdir(partial) and os.listdir(partial) and not os.path.exists(os.path.join(partial, ".metadata"))
    assert complete_steps(resumed)[-1] == 4

    # 3. Resume from step-4 (RL step 2), not the partial step-5, and run to the end.
    code, out, err = finish(start(resumed))
    assert code == 0, err[-2000:]
    assert out.startswith(f"resuming from {resumed}/checkpoint/step-4 (after RL step 2 of 4)\n"), out[:2000]
    code, _, err = finish(uninterrupted)
    assert code == 0, err[-2000:]
    assert_one_row_per_step(resumed)

    want, got = rl_metrics(reference), rl_metrics(resumed)
    assert sorted(want) == sorted(got) == [1, 2, 3, 4]
    assert any(r["policy_loss"] != 0 for r in want.values()) and want[1]["draft_loss"] != want[4]["draft_loss"]
    for step in want:  # bit-exact: the same computation from restored weights, moments and RNG states
        assert got[step] == want[step], step
    assert complete_steps(resumed) == complete_steps(reference) == [1, 2, 3, 4, 5, 6]


def test_pipeline_parallel_job_killed_resumes_exactly(tmp_path):
    """PP = 2: each rank saves and restores its own stages (the draft on the last), bit for bit."""
    reference, resumed = tmp_path / "uninterrupted", tmp_path / "killed"
    uninterrupted = start(reference, pipeline=True)
    kill_after_first_rl_step(start(resumed, pipeline=True), resumed)
    assert complete_steps(resumed)[-1] >= 2
    code, out, err = finish(start(resumed, pipeline=True))
    assert code == 0, err[-2000:]
    # The killed rank 0 left its dump-folder lock behind; the resume takes it over, saying whose it was.
    assert "took over the lock of a job that is gone" in err, err[-2000:]
    code, _, err = finish(uninterrupted)
    assert code == 0, err[-2000:]
    progress_lines = [line for line in err.splitlines() if "sft: " in line]
    assert progress_lines and all(re.fullmatch(r"\[rank0\]:sft: \d+/15 \(\d+%\)  .* loss \d\.\d{3}", line)
                                  for line in progress_lines), progress_lines
    assert_one_row_per_step(resumed)
    want, got = rl_metrics(reference), rl_metrics(resumed)
    assert sorted(want) == sorted(got) == [1, 2, 3, 4]
    for step in want:
        assert got[step] == want[step], step
    with open(resumed / "metrics.jsonl") as f:  # the resume restored the warm starts instead of redoing them
        assert sum(json.loads(line)["phase"] == "sft" for line in f) == 15
