"""Triton kernels on a CPU: Triton's interpreter must be switched on before Triton is first imported,
so a kernel's CPU test runs its own test file as a script, in a fresh process with TRITON_INTERPRET=1.
The script prints a line starting with "ok" when its checks pass."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_in_interpreter(test_file: str) -> None:
    """Run `test_file` as a script under TRITON_INTERPRET=1; it must exit 0 and print "ok ..."."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, os.path.abspath(test_file)], env=env, cwd=ROOT, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0 and result.stdout.startswith("ok"), result.stdout + result.stderr
