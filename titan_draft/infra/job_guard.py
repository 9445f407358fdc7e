"""Guards around a training job's processes and its dump folder.

Workers die with their launcher: torchrun starts every worker in a session of its own, so killing the
launcher (SIGKILL, or the launcher's process group) would leave the workers training and writing
checkpoints into the folder a restart uses. `die_with_launcher` asks Linux for a parent-death signal.

One job per dump folder: rank 0 holds `<dump_folder>/job.lock`, a JSON record of its host, pid and
start time, from before the process group exists until it exits. A lock whose process is gone (same
host, pid dead or reused) is taken over with a warning; any other lock stops the new job with one line
naming the folder and the owner.
"""
import atexit
import ctypes
import fcntl
import json
import os
import signal
import socket
import sys
import time

from titan_draft.infra.errors import ConfigError
from titan_draft.infra.ranks import is_rank0

LOCK_NAME = "job.lock"
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_launcher() -> None:
    """Under torchrun on Linux: the kernel SIGKILLs this process when its launcher dies. Call it first."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if not _is_launcher(os.getppid()):  # it died before the signal was armed: we were re-parented
        sys.exit("the torchrun launcher of this worker is gone; exiting")


def _is_launcher(pid: int) -> bool:
    """Whether `pid` can be this worker's launcher: a Python process (torchrun, or a launcher built on
    torch's elastic agent), not the init process or a subreaper that adopted an orphan."""
    if pid == 1:
        return False
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
    except OSError:
        return True
    return b"python" in cmdline or b"torchrun" in cmdline


def lock_dump_folder(folder: str) -> None:
    """Take `folder`'s job lock on global rank 0 (other ranks return), released when this process exits.
    Raises ConfigError naming the owner if another live job holds it."""
    if not is_rank0():
        return
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, LOCK_NAME)
    mine = _this_process()
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(mine, f)
    try:
        while not _try_lock(path, tmp, mine):
            pass
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    atexit.register(_release, path, mine)


def check_dump_folder(folder: str) -> None:
    """Raise ConfigError if a live job holds `folder`'s lock (before starting a new one there)."""
    owner = _read(os.path.join(folder, LOCK_NAME))
    if owner is not None and not _same_process(owner, _this_process()) and _alive(owner):
        raise _in_use(folder, owner)


def _try_lock(path: str, tmp: str, mine: dict) -> bool:
    """One attempt: True once `path` is ours; False if the lock changed under us (try again)."""
    try:
        os.link(tmp, path)  # atomic, and never a half-written lock
        return True
    except FileExistsError:
        pass
    try:
        f = open(path)
    except FileNotFoundError:
        return False
    with f:
        owner = _parse(f.read())
        if _same_process(owner, mine):
            return True  # this process took it before (several jobs run in one test process)
        if owner is not None and _alive(owner):
            raise _in_use(os.path.dirname(path), owner)
        # The owner is gone. Holding flock on the old lock's inode lets one taker replace it: a second
        # taker, once it gets the flock, sees the new owner in the file and starts over.
        fcntl.flock(f, fcntl.LOCK_EX)
        if _read(path) != owner:  # None == None: still the same unreadable lock
            return False
        os.replace(tmp, path)
    print(f"warning: job.dump_folder {os.path.dirname(path)}: took over the lock of a job that is gone "
          f"({_describe(owner)})", file=sys.stderr, flush=True)
    return True


def _release(path: str, mine: dict) -> None:
    if _same_process(_read(path), mine):
        os.unlink(path)


def _this_process() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "proc_start": _proc_start(os.getpid()),
            "started": time.strftime("%Y-%m-%d %H:%M:%S")}


def _same_process(a: dict | None, b: dict | None) -> bool:
    keys = ("host", "pid", "proc_start")
    return a is not None and b is not None and all(a.get(k) == b.get(k) for k in keys)


def _proc_start(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22): tells a reused pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _alive(owner: dict) -> bool:
    """Whether the lock's process still runs; a lock from another host is taken to be alive."""
    if owner.get("host") != socket.gethostname():
        return True
    try:
        os.kill(owner["pid"], 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    return owner.get("proc_start") in (None, _proc_start(owner["pid"]))


def _read(path: str) -> dict | None:
    try:
        with open(path) as f:
            return _parse(f.read())
    except FileNotFoundError:
        return None


def _parse(text: str) -> dict | None:
    try:
        record = json.loads(text)
    except ValueError:
        return None
    return record if isinstance(record, dict) and "pid" in record else None


def _describe(owner: dict | None) -> str:
    if owner is None:
        return "its lock file is unreadable"
    return f"host {owner.get('host')}, pid {owner.get('pid')}, started {owner.get('started')}"


def _in_use(folder: str, owner: dict) -> ConfigError:
    hint = "" if owner.get("host") == socket.gethostname() else \
        f" (if that job is gone, delete {os.path.join(folder, LOCK_NAME)})"
    return ConfigError(f"job.dump_folder: {folder} is in use by another job ({_describe(owner)}){hint}; wait for "
                       "it to end, stop it, or use another job.dump_folder")
