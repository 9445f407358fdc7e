"""scripts/setup_env.sh without a GPU takes torch from PyTorch's CPU wheel index, and from the configured
index when that one fails; with a GPU, from the configured index. Run against a stand-in .venv/bin/python
that logs its pip calls and fails those given --index-url, so nothing is downloaded."""
import os
import shutil
import stat
import subprocess

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def executable(path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def run_setup(tmp_path, *, gpu: bool, cpu_index_works: bool) -> tuple[list[str], str]:
    """setup_env.sh in a copy of the checkout's layout; returns the pip calls and stderr."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(os.path.join(ROOT, "scripts", "setup_env.sh"), tmp_path / "scripts")
    (tmp_path / "pyproject.toml").write_text("")
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    refuse = "" if cpu_index_works else 'case "$*" in *--index-url*) exit 1;; esac\n'
    executable(tmp_path / ".venv" / "bin" / "python",
               f'#!/bin/sh\necho "$*" >> "{tmp_path}/pip_calls"\n{refuse}')
    tools = tmp_path / "tools"  # PATH: the shell's own tools, and nvidia-smi only on the "GPU" machine
    tools.mkdir()
    for name in ("dirname", "touch"):
        os.symlink(shutil.which(name), tools / name)
    if gpu:
        executable(tools / "nvidia-smi", "#!/bin/sh\n")
    done = subprocess.run([shutil.which("bash"), str(tmp_path / "scripts" / "setup_env.sh")], env={"PATH": str(tools)},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / ".venv" / ".installed").exists()
    return (tmp_path / "pip_calls").read_text().splitlines(), done.stderr


UPGRADE_PIP, PROJECT = "-m pip install -q --upgrade pip", "-m pip install -q -e .[dev]"
FROM_CPU_INDEX = f"-m pip install -q --retries 0 --timeout 10 --index-url {CPU_INDEX} torch==2.13.0"
FROM_CONFIGURED = "-m pip install -q torch==2.13.0"


def test_cpu_machine_installs_torch_from_the_cpu_index(tmp_path):
    calls, stderr = run_setup(tmp_path, gpu=False, cpu_index_works=True)
    assert calls == [UPGRADE_PIP, FROM_CPU_INDEX, PROJECT] and stderr == ""


def test_cpu_index_unreachable_falls_back_to_the_configured_index(tmp_path):
    calls, stderr = run_setup(tmp_path, gpu=False, cpu_index_works=False)
    assert calls == [UPGRADE_PIP, FROM_CPU_INDEX, FROM_CONFIGURED, PROJECT]
    assert stderr == f"setup_env.sh: {CPU_INDEX} unavailable; installing torch==2.13.0 from the configured index\n"


def test_gpu_machine_uses_the_configured_index(tmp_path):
    calls, _ = run_setup(tmp_path, gpu=True, cpu_index_works=False)
    assert calls == [UPGRADE_PIP, FROM_CONFIGURED, PROJECT]
