"""Files: written whole or not at all (a file or a folder), Hugging Face folders read (one safetensors
file or shards), and full state dicts of (possibly sharded) modules. Shared by the Hugging Face policy
interchange (formats/hf.py), the model families (models/families.py), the EAGLE-3 draft format
(formats/eagle3.py) and the checkpoint's manifest (checkpoint.py).
"""
import contextlib
import glob
import json
import os
import shutil

import torch
from safetensors import safe_open
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from titan_draft.infra.errors import ConfigError

INDEX_FILE = "model.safetensors.index.json"


@contextlib.contextmanager
def atomic_file(path: str):
    """Yield a text file open under a temporary name next to `path` (its folder made); on success it is
    synced to disk and replaces `path` in one rename, so a reader never sees half a file."""
    path = os.path.abspath(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@contextlib.contextmanager
def atomic_directory(path: str):
    """Yield a temporary folder next to `path`; on success it replaces `path` in one rename."""
    path = os.path.abspath(path)
    tmp = f"{path}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        yield tmp
        for name in os.listdir(tmp):
            with open(os.path.join(tmp, name), "rb") as f:
                os.fsync(f.fileno())
        old = f"{path}.old-{os.getpid()}"
        if os.path.exists(path):
            os.rename(path, old)
        os.rename(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def full_state_dict(model: torch.nn.Module, *, every_rank: bool = False) -> dict[str, torch.Tensor]:
    """The unsharded state dict (a collective on sharded models): on rank 0 only, in CPU memory, for
    writing files; or, with every_rank, on every rank's device (to hand weights on to other ranks)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=not every_rank)
    return get_model_state_dict(model, options=options)


def read_json(path: str, key: str) -> dict:
    """A JSON file that `key` points at; a missing or broken file is one ConfigError line."""
    if not os.path.isfile(path):
        raise ConfigError(f"{key}: {path} not found; point {key} at a Hugging Face model folder")
    try:
        with open(path) as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{key}: {path} is not valid JSON ({e}); restore the file from the checkpoint") from None


def safetensors_files(folder: str, key: str) -> list[str]:
    """The weight files of a Hugging Face folder: those its model.safetensors.index.json lists (a
    sharded checkpoint: every listed shard must be there), else every *.safetensors in it."""
    index = os.path.join(folder, INDEX_FILE)
    if os.path.isfile(index):
        weight_map = read_json(index, key).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ConfigError(f"{key}: {index} has no 'weight_map'; restore the index saved with the shards")
        files = [os.path.join(folder, name) for name in sorted(set(weight_map.values()))]
        for file in files:
            if not os.path.isfile(file):
                raise ConfigError(f"{key}: {file} is listed in {INDEX_FILE} but missing; copy every shard "
                                  "of the checkpoint into the folder")
        return files
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise ConfigError(f"{key}: {folder} has no *.safetensors files; point it at a Hugging Face model folder "
                          "(model.safetensors or the shards and model.safetensors.index.json)")
    return files


def read_safetensors(folder: str, key: str) -> dict[str, torch.Tensor]:
    """All tensors of a Hugging Face folder (sharded or not); `key` names the folder in errors."""
    return read_safetensors_with_files(folder, key)[0]


def read_safetensors_with_files(folder: str, key: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """All tensors of a Hugging Face folder (sharded or not) and, per tensor name, its file."""
    state, source = {}, {}
    for file in safetensors_files(folder, key):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                if name in state:
                    raise ConfigError(f"{key}: '{name}' is in both {source[name]} and {file}; remove the stray "
                                      "file from the folder")
                state[name], source[name] = f.get_tensor(name), file
    return state, source
