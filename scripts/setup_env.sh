#!/usr/bin/env bash
# Create .venv and install titan_draft with its test tools; a no-op when already up to date.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}   # on a GPU machine set TORCH_SPEC to your torch
# Without a GPU, torch comes from PyTorch's CPU wheel index: a Linux torch from the default index is
# the multi-GB CUDA build. Where that index cannot be reached, the configured index's torch is used.
CPU_INDEX=https://download.pytorch.org/whl/cpu

install_torch() {
  if ! command -v nvidia-smi >/dev/null 2>&1; then
    if .venv/bin/python -m pip install -q --retries 0 --timeout 10 --index-url "$CPU_INDEX" "$TORCH_SPEC"; then
      return
    fi
    echo "setup_env.sh: $CPU_INDEX unavailable; installing $TORCH_SPEC from the configured index" >&2
  fi
  .venv/bin/python -m pip install -q "$TORCH_SPEC"
}

if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
if [ ! -f .venv/.installed ] || [ pyproject.toml -nt .venv/.installed ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  install_torch
  .venv/bin/python -m pip install -q -e ".[dev]"
  touch .venv/.installed
fi
