#!/usr/bin/env bash
# The drift demonstration: one job run three times, same config and seed, differing only in
# [draft] mode (cotrain / frozen / none), then notebooks/acceptance_vs_step.ipynb on the three runs.
#   scripts/drift_demo.sh                                   # CPU default: three default jobs, ~3 minutes each
#   CONFIG_FILE=train_configs/sort_gpu.toml RUNS_DIR=outputs/drift_gpu OUT_DIR=outputs/drift_gpu scripts/drift_demo.sh
# Extra arguments are config overrides applied to every run (e.g. --debug.seed 1).
# MODES="frozen" runs a subset (the notebook plots whatever runs RUNS_DIR holds); NOTEBOOK=0 skips it.
# Writes OUT_DIR/acceptance_vs_step.png, rollout_speedup.png and acceptance_summary.json.
set -euo pipefail
cd "$(dirname "$0")/.."
export CONFIG_FILE=${CONFIG_FILE:-train_configs/sort_tiny_cpu.toml}
RUNS_DIR=${RUNS_DIR:-outputs/drift_demo}
OUT_DIR=${OUT_DIR:-docs}
for mode in ${MODES:-cotrain frozen none}; do
  rm -rf "${RUNS_DIR:?}/$mode"  # metrics.jsonl appends: start each run from an empty folder
  echo "=== draft.mode $mode -> $RUNS_DIR/$mode"
  ./run_train.sh --job.dump_folder "$RUNS_DIR/$mode" --draft.mode "$mode" "$@"
done
if [ "${NOTEBOOK:-1}" != 0 ]; then
  .venv/bin/python scripts/execute_notebook.py "$RUNS_DIR" "$OUT_DIR" --executed "$RUNS_DIR/acceptance_vs_step.ipynb"
fi
