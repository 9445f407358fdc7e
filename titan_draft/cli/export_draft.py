"""Export the co-trained draft of a job checkpoint in the EAGLE-3 layout that SGLang and vLLM load.

    python -m titan_draft.cli.export_draft --checkpoint DIR --output OUT [--engine both|vllm|sglang] [job config args]

DIR is a checkpoint step folder (`.../checkpoint/step-N`) or the checkpoint folder itself (then its
latest complete step); it must hold a warmed-up draft (the draft warm-up or RL has run). The job config
gives the model shapes and tap layers, as for training. --engine: the two engines number the tap
layers differently and read them from different keys (titan_draft/formats/eagle3.py); "both" (default) writes
each engine's numbering under its own key, "vllm" or "sglang" only that engine's.
"""
import argparse
import os
import sys
import warnings

import torch
import torch.distributed.checkpoint as dcp

from titan_draft.checkpoint import IN_RL, NOT_STARTED, SFT_DONE, WARMUP_DONE, TrainState, complete_steps
from titan_draft.config import ConfigError, parse_config
from titan_draft.formats.eagle3 import BOTH_ENGINES, ENGINES, export_draft, tap_layer_ids
from titan_draft.models import build_draft, policy_args

PHASES = {NOT_STARTED: "NOT_STARTED (nothing trained)",
          SFT_DONE: "SFT_DONE (the policy after SFT, draft not warmed up)",
          WARMUP_DONE: "WARMUP_DONE (the draft after its warm-up)", IN_RL: "IN_RL (co-training)"}


def checkpoint_step_folder(path: str) -> str:
    """`path` itself if it is a complete DCP checkpoint, else its latest complete step-N folder."""
    if os.path.isfile(os.path.join(path, ".metadata")):
        return path
    if not os.path.isdir(path):
        raise FileNotFoundError(f"--checkpoint {path}: no such folder; give a job's checkpoint folder or a step-N in it")
    steps = complete_steps(path)
    if not steps:
        raise FileNotFoundError(f"--checkpoint {path}: no complete checkpoint (step-N folder with .metadata)")
    return os.path.join(path, f"step-{max(steps)}")


def read_checkpoint(state: dict, folder: str) -> None:
    """dcp.load in this one process (DCP warns on every load without a process group: by design here)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        dcp.load(state, checkpoint_id=folder)


def check_draft_trained(folder: str) -> None:
    """Refuse a checkpoint saved before the draft warm-up (its draft is the random initialisation);
    reads only the checkpoint's TrainState, as JobCheckpoint.resume_phase does."""
    state = TrainState()
    read_checkpoint({"train_state": state}, folder)
    if state.phase < WARMUP_DONE:
        raise ConfigError(f"--checkpoint {folder}: holds phase {PHASES[state.phase]}, its draft is untrained; "
                          f"export a checkpoint from after the draft warm-up (step-{WARMUP_DONE} or later), or "
                          f"resume the job until the warm-up ends")


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The exporter's own arguments, and the job config arguments that follow them."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--output", required=True)
    parser.add_argument("--engine", choices=ENGINES, default=BOTH_ENGINES)
    return parser.parse_known_args(argv)


def main(argv: list[str]) -> None:
    known, job_args = parse_args(argv)
    cfg = parse_config(job_args)
    folder = checkpoint_step_folder(known.checkpoint)
    check_draft_trained(folder)
    args = policy_args(cfg)
    draft, layers = build_draft(cfg, args, torch.device("cpu"))
    tap_layer_ids(layers, args.n_layers, known.engine)  # refuse before reading the weights
    state = {"draft": draft.state_dict(), "tok_embeddings.weight": torch.empty(args.vocab_size, args.dim)}
    read_checkpoint(state, folder)  # in place, into the draft's tensors
    export_draft(draft, layers, known.output, n_layers=args.n_layers, engine=known.engine,
                 embed_tokens=state["tok_embeddings.weight"])
    print(f"wrote the EAGLE-3 draft ({known.engine}) to {known.output}")


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except (ConfigError, FileNotFoundError) as e:
        sys.exit(f"export_draft: {e}")
