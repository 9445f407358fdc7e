"""Every command of the README's ```bash blocks is checked, in order, from a scratch folder that sees
the checkout's files: those that finish in seconds on CPU run; `./run_train.sh` lines (the developer
runs those by hand) go through the check run_train.sh makes before it starts any process; the export
is parsed and its checkpoint's taps checked against the engine it names. A flag or file that
disappears breaks this test, not a reader."""
import os
import re
import shlex
import subprocess
import sys

import pytest

from titan_draft.cli.export_draft import parse_args as export_args
from titan_draft.cli.validate import check
from titan_draft.cli.validate import main as validate_main
from titan_draft.config import parse_config
from titan_draft.formats.eagle3 import tap_layer_ids
from titan_draft.models import policy_args, tap_layers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(ROOT, "README.md")).read()
DEFAULT_CONFIG = "train_configs/sort_tiny_cpu.toml"  # run_train.sh's CONFIG_FILE default
PYTHON = ".venv/bin/python"


def readme_commands() -> list[list[str]]:
    """The README's ```bash / ```sh commands as words: continued lines joined, comments dropped,
    `a && b` split in two."""
    commands = []
    for block in re.findall(r"```(?:bash|sh)\n(.*?)```", README, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            while "&&" in words:
                cut = words.index("&&")
                commands.append(words[:cut])
                words = words[cut + 1:]
            if words:
                commands.append(words)
    return commands


def split_env(words: list[str]) -> tuple[dict, list[str]]:
    """Leading VAR=value assignments, and the command after them."""
    env = {}
    while re.fullmatch(r"[A-Z_]+=.*", words[0]):
        key, _, value = words[0].partition("=")
        env[key] = value
        words = words[1:]
    return env, words


def check_run_train(env: dict, args: list[str], dump_folders: list[str]) -> None:
    """What run_train.sh checks before any process starts (titan_draft.cli.validate)."""
    assert set(env) <= {"NGPU", "LOG_RANK", "CONFIG_FILE"}, env
    cfg = check(["--job.config_file", env.get("CONFIG_FILE", DEFAULT_CONFIG), *args],
                world_size=int(env.get("NGPU", "1")))
    dump_folders.append(os.path.normpath(cfg.job.dump_folder))


def check_export(args: list[str], dump_folders: list[str]) -> None:
    """The exporter's flags parse, its checkpoint is one of a README job's, and that job's taps can be
    written for the engine named (the check export_draft makes before reading any weight)."""
    known, job_args = export_args(args)
    assert os.path.dirname(os.path.normpath(known.checkpoint)) in dump_folders, known.checkpoint
    cfg = parse_config(job_args)
    n_layers = policy_args(cfg).n_layers
    tap_layer_ids(tap_layers(cfg.draft, n_layers), n_layers, known.engine)


def run_python(args: list[str]) -> None:
    """A README script, importing this checkout's titan_draft (not whichever one is installed)."""
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT})
    assert done.returncode == 0, done.stderr[-2000:]


def test_every_readme_command(tmp_path, monkeypatch, capsys):
    for name in ("train_configs", "scripts", "tests", "titan_draft"):
        os.symlink(os.path.join(ROOT, name), tmp_path / name)
    monkeypatch.chdir(tmp_path)
    commands, dump_folders = readme_commands(), []
    assert len(commands) >= 10, commands
    for words in commands:
        env, (program, *args) = split_env(words)
        if program == "./run_train.sh":
            check_run_train(env, args, dump_folders)
        elif program == "scripts/setup_env.sh":
            assert os.access(program, os.X_OK) and not args
        elif [program, *args[:2]] == [PYTHON, "-m", "pytest"]:
            assert os.path.isdir(args[-1]), args
        elif [program, *args[:2]] == [PYTHON, "-m", "titan_draft.cli.validate"]:
            assert validate_main(args[2:]) == 2  # the README shows it refusing, with the line it prints
            assert "# " + capsys.readouterr().err.strip() in README
        elif [program, *args[:2]] == [PYTHON, "-m", "titan_draft.cli.export_draft"]:
            check_export(args[2:], dump_folders)
        elif [program, *args[:1]] == [PYTHON, "scripts/make_tiny_hf.py"]:
            run_python(args)  # seconds: the local checkpoint the hf_tiny_cpu.toml line below reads
        else:
            pytest.fail(f"README command the test does not know: {shlex.join(words)}; check it here")


def test_readme_is_short():
    assert README.count("\n") <= 300
