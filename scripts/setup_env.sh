#!/usr/bin/env bash
# Create .venv and install titan_draft with its test tools; a no-op when already up to date.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}   # the CPU build; on a GPU machine set TORCH_SPEC to yours
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
if [ ! -f .venv/.installed ] || [ pyproject.toml -nt .venv/.installed ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q "$TORCH_SPEC"
  .venv/bin/python -m pip install -q -e ".[dev]"
  touch .venv/.installed
fi
