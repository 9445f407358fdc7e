"""titan_draft.train, SIGKILLed inside the checkpoint save of progress step STEP: after DCP has written the
data files, before its `.metadata` (FileSystemWriter.finish writes it).

    PYTHONPATH=. python tests/kill_during_save.py STEP [train arguments]
"""
import os
import runpy
import signal
import sys

from torch.distributed.checkpoint.filesystem import FileSystemWriter

step_folder = f"step-{sys.argv.pop(1)}"
finish = FileSystemWriter.finish


def finish_or_die(self, *args, **kwargs):
    if os.path.basename(os.fspath(self.path)) == step_folder:
        os.kill(os.getpid(), signal.SIGKILL)
    return finish(self, *args, **kwargs)


FileSystemWriter.finish = finish_or_die
runpy.run_module("titan_draft.train", run_name="__main__", alter_sys=True)
