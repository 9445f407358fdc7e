#!/usr/bin/env bash
# The main job: sets up .venv on first use, then runs titan_draft.train under torchrun.
#   NGPU=4 CONFIG_FILE=train_configs/sort_tiny_cpu.toml ./run_train.sh --training.steps 2
# Extra arguments are torchtitan-style CLI overrides. Without a GPU, NGPU processes run on gloo.
set -euo pipefail
cd "$(dirname "$0")"
scripts/setup_env.sh
NGPU=${NGPU:-1}
LOG_RANK=${LOG_RANK:-0}
CONFIG_FILE=${CONFIG_FILE:-./train_configs/sort_tiny_cpu.toml}
# Configuration errors are reported in one line here, before any process group starts.
.venv/bin/python -m titan_draft.cli.validate --world-size "$NGPU" --job.config_file "$CONFIG_FILE" "$@"
exec .venv/bin/torchrun --nproc_per_node="$NGPU" --rdzv_backend c10d --rdzv_endpoint=localhost:0 \
  --local-ranks-filter "$LOG_RANK" --role rank --tee 3 \
  -m titan_draft.train --job.config_file "$CONFIG_FILE" "$@"
