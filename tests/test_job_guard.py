"""One job per dump folder (a lock naming its owner; a dead owner's lock is taken over with a warning), and
torchrun workers that die with their launcher (titan_draft/infra/job_guard.py)."""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from titan_draft.cli import validate as validate_cli
from titan_draft.config import ConfigError
from titan_draft.infra import job_guard
from titan_draft.infra.job_guard import LOCK_NAME, check_dump_folder, lock_dump_folder

ROOT = os.path.join(os.path.dirname(__file__), "..")
CONFIG = os.path.join(ROOT, "train_configs", "sort_tiny_cpu.toml")
OWNER_STARTED = "2030-01-02 03:04:05"


def write_lock(folder, pid: int) -> None:
    record = {"host": socket.gethostname(), "pid": pid, "proc_start": job_guard._proc_start(pid),
              "started": OWNER_STARTED}
    (folder / LOCK_NAME).write_text(json.dumps(record))


def in_use(folder, pid: int) -> str:
    return (f"job.dump_folder: {folder} is in use by another job (host {socket.gethostname()}, pid {pid}, started "
            f"{OWNER_STARTED}); wait for it to end, stop it, or use another job.dump_folder")


def test_second_job_in_a_folder_gets_one_line_naming_the_owner(tmp_path, capsys):
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        write_lock(tmp_path, owner.pid)
        with pytest.raises(ConfigError) as error:
            lock_dump_folder(str(tmp_path))
        assert str(error.value) == in_use(tmp_path, owner.pid)
        code = validate_cli.main(["--job.config_file", CONFIG, "--job.dump_folder", str(tmp_path)])
        assert code == 2 and capsys.readouterr().err == f"config error: {in_use(tmp_path, owner.pid)}\n"
    finally:
        owner.kill()
        owner.wait()


def test_lock_of_a_dead_job_is_taken_over_and_released_at_exit(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    write_lock(tmp_path, gone.pid)
    # A job takes the folder: the stale lock with a warning; while it runs, the lock names it; at exit it is gone.
    job = subprocess.Popen([sys.executable, "-c", "import sys, time; from titan_draft.infra.job_guard import "
                            "lock_dump_folder; lock_dump_folder(sys.argv[1]); print('locked', flush=True); "
                            "time.sleep(float(sys.argv[2]))", str(tmp_path), "3"],
                           cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert job.stdout.readline() == "locked\n"
    record = json.loads((tmp_path / LOCK_NAME).read_text())
    assert record["pid"] == job.pid and record["host"] == socket.gethostname()
    with pytest.raises(ConfigError, match=f"pid {job.pid}, started"):
        check_dump_folder(str(tmp_path))
    _, err = job.communicate(timeout=30)
    assert job.returncode == 0
    assert err == (f"warning: job.dump_folder {tmp_path}: took over the lock of a job that is gone (host "
                   f"{socket.gethostname()}, pid {gone.pid}, started {OWNER_STARTED})\n")
    assert not (tmp_path / LOCK_NAME).exists()
    check_dump_folder(str(tmp_path))


def test_lock_of_a_reused_pid_is_stale(tmp_path, capsys):
    """The pid runs, but it is another process than the one that wrote the lock (its start time differs)."""
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        record = {"host": socket.gethostname(), "pid": other.pid, "proc_start": 1, "started": OWNER_STARTED}
        (tmp_path / LOCK_NAME).write_text(json.dumps(record))
        lock_dump_folder(str(tmp_path))
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
        assert "took over the lock of a job that is gone" in capsys.readouterr().err
        lock_dump_folder(str(tmp_path))  # this process again (several jobs run in one test process)
        job_guard._release(str(tmp_path / LOCK_NAME), job_guard._this_process())
        assert not (tmp_path / LOCK_NAME).exists()
    finally:
        other.kill()
        other.wait()


WORKER = """
import os, sys, time
from titan_draft.infra.job_guard import die_with_launcher
die_with_launcher()
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(120)
"""


def test_worker_dies_with_its_torchrun_launcher(tmp_path):
    """torchrun puts its worker in a session of its own; SIGKILL of the launcher's process group (as of
    `kill -9 -- -<pgid of run_train.sh>`) must still take the worker along."""
    script, pid_file = tmp_path / "worker.py", tmp_path / "worker.pid"
    script.write_text(WORKER)
    launcher = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
                                 str(script), str(pid_file)], cwd=ROOT, start_new_session=True,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                env={**os.environ, "PYTHONPATH": os.path.abspath(ROOT)})
    deadline = time.monotonic() + 120
    while not pid_file.exists():
        assert launcher.poll() is None and time.monotonic() < deadline, "the worker did not start"
        time.sleep(0.1)
    worker = int(pid_file.read_text())
    assert os.getsid(worker) != os.getpgid(launcher.pid)  # out of reach of the group kill itself
    os.killpg(launcher.pid, signal.SIGKILL)
    launcher.wait()
    deadline = time.monotonic() + 5
    while process_runs(worker):
        if time.monotonic() > deadline:
            os.kill(worker, signal.SIGKILL)
            pytest.fail("the worker outlived its launcher")
        time.sleep(0.05)


def process_runs(pid: int) -> bool:
    """Alive and not a zombie (a dead worker re-parented to a subreaper may wait to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_an_adopted_worker_sees_its_launcher_is_gone():
    """The launcher may die before the worker arms its parent-death signal: then init or a subreaper
    has adopted the worker, and it exits instead of training on."""
    assert not job_guard._is_launcher(1)
    assert job_guard._is_launcher(os.getpid())  # a Python process, as torchrun is
