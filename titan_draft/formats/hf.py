"""Hugging Face interchange: the policy as safetensors + config.json through torchtitan's state-dict
adapters (titan_draft/models/families.py names them per family), its tokenizer from the same
folder (torchtitan's HuggingFaceTokenizer), and an EAGLE-3 draft folder (titan_draft/cli/export_draft.py).

Reading: `families.hf_model_args` turns <folder>/config.json into torchtitan args (model.flavor
"hf"), `load_policy` loads its safetensors (one file or a sharded checkpoint with
model.safetensors.index.json) strictly, and `check_hf_assets` finds, before any process starts,
the folder problems that would otherwise stop a job later; every problem is one ConfigError line
naming the key or file and the fix.
Writing: the model's shape comes from the job config (model.name / model.flavor), as in torchtitan.
Works on parallelized (FSDP/TP) models: the full state dict is gathered with
torch.distributed.checkpoint.state_dict (a collective: call on every rank), and rank 0 writes.
Folders are written under a temporary name and renamed into place.
"""
import json
import os
import shutil

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from torchtitan.components.tokenizer import HuggingFaceTokenizer

from titan_draft.infra.errors import ConfigError
from titan_draft.infra.io import (atomic_directory, full_state_dict, read_json, read_safetensors_with_files,
                                  safetensors_files)
from titan_draft.infra.ranks import is_rank0
from titan_draft.models.families import family
from titan_draft.models.policy import job_model_args

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
LOAD_KEY = "checkpoint.initial_load_path"


def state_dict_adapter(model_name: str, args):
    return family(model_name).adapter_cls(args, None)


def _hf_config(model_name: str, args, state: dict[str, torch.Tensor]) -> dict:
    fam = family(model_name)
    ffn = state["layers.0.feed_forward.w1.weight"].shape[0]
    head_dim = getattr(args, "head_dim", None) or args.dim // args.n_heads
    config = {
        "architectures": [fam.hf_architectures[0]], "model_type": fam.hf_model_type, "head_dim": head_dim,
        "hidden_size": args.dim, "intermediate_size": ffn, "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads, "num_key_value_heads": args.n_kv_heads or args.n_heads,
        "rms_norm_eps": args.norm_eps, "rope_theta": args.rope_theta, "max_position_embeddings": args.max_seq_len,
        "vocab_size": args.vocab_size, "hidden_act": "silu", "tie_word_embeddings": False,
        "torch_dtype": str(state["norm.weight"].dtype).removeprefix("torch."),
    }
    rope = getattr(args, "rope_scaling_args", None)
    if rope is not None and rope.scaling_factor != 1.0:
        config["rope_scaling"] = {"rope_type": "llama3", "factor": rope.scaling_factor,
                                  "low_freq_factor": rope.low_freq_factor, "high_freq_factor": rope.high_freq_factor,
                                  "original_max_position_embeddings": rope.original_max_position_embeddings}
    return config


def save_policy(policy: torch.nn.Module, model_name: str, args, output: str, tokenizer_dir: str | None = None) -> None:
    """model.safetensors (HF names) + config.json (+ the tokenizer files of tokenizer_dir) in `output`."""
    state = full_state_dict(policy)
    if not is_rank0():
        return
    hf_state = {k: v.contiguous() for k, v in state_dict_adapter(model_name, args).to_hf(state).items()}
    with atomic_directory(output) as tmp:
        save_file(hf_state, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(_hf_config(model_name, args, state), f, indent=2)
        for name in TOKENIZER_FILES:
            if tokenizer_dir and os.path.exists(os.path.join(tokenizer_dir, name)):
                shutil.copy(os.path.join(tokenizer_dir, name), tmp)


def load_policy(policy: torch.nn.Module, model_name: str, args, folder: str):
    """Load the Hugging Face safetensors of `folder` (one file, or shards listed by
    model.safetensors.index.json) into `policy` (plain or FSDP/TP; every rank reads the files),
    through torchtitan's state-dict adapter; strict: every weight of the policy, nothing else.
    A checkpoint with tied embeddings (tie_word_embeddings in its config.json, no lm_head.weight)
    fills the policy's untied output weight with a copy of the embedding.
    Returns the folder's tokenizer (torchtitan HuggingFaceTokenizer), or None if it has none."""
    hf_state, source = read_safetensors_with_files(folder, LOAD_KEY)
    config_file = os.path.join(folder, "config.json")
    tied = os.path.isfile(config_file) and read_json(config_file, LOAD_KEY).get("tie_word_embeddings", False)
    if tied and "lm_head.weight" not in hf_state and "model.embed_tokens.weight" in hf_state:
        hf_state["lm_head.weight"] = hf_state["model.embed_tokens.weight"]  # copied into the untied output
        source["lm_head.weight"] = f"{source['model.embed_tokens.weight']} (tied to model.embed_tokens.weight)"
    native = _native_state(state_dict_adapter(model_name, args), hf_state, source, get_model_state_dict(policy),
                           folder)
    set_model_state_dict(policy, native, options=StateDictOptions(full_state_dict=True, strict=True))
    return HuggingFaceTokenizer(folder) if os.path.exists(os.path.join(folder, "tokenizer.json")) else None


def _native_state(adapter, hf_state: dict, source: dict, want: dict, folder: str) -> dict[str, torch.Tensor]:
    """hf_state (read from `folder`; source: tensor name -> file) in the policy's names, one tensor
    at a time (so that an error names the tensor and its file), checked against the policy's names
    and shapes `want`."""
    fix = "use the config.json saved with these weights (model.flavor 'hf') or the matching model.flavor"
    native = {}
    for hf_name, tensor in hf_state.items():
        if hf_name.endswith("rotary_emb.inv_freq"):
            continue  # a recomputed buffer that old checkpoints carry
        try:
            ((name, value),) = adapter.from_hf({hf_name: tensor}).items()
        except (KeyError, RuntimeError):
            raise ConfigError(f"{LOAD_KEY}: {source[hf_name]}: '{hf_name}' {tuple(tensor.shape)} has no place in "
                              f"the policy; {fix}") from None
        if name not in want:
            raise ConfigError(f"{LOAD_KEY}: {source[hf_name]}: '{hf_name}' has no place in the policy (it has no "
                              f"'{name}'); {fix}")
        if tuple(value.shape) != tuple(want[name].shape):
            raise ConfigError(f"{LOAD_KEY}: {source[hf_name]}: '{hf_name}' is {tuple(tensor.shape)} but the "
                              f"policy's '{name}' is {tuple(want[name].shape)}; {fix}")
        native[name] = value
    missing = [name for name in want if name not in native]
    if missing:
        hf_names = list(adapter.to_hf({name: want[name] for name in missing}))
        raise ConfigError(f"{LOAD_KEY}: no tensor '{hf_names[0]}' (the policy's '{missing[0]}'"
                          f"{f' and {len(missing) - 1} more' if len(missing) > 1 else ''}) in the safetensors "
                          f"files of {folder}; {fix}")
    return native


def tokenizer_vocab_size(folder: str) -> int:
    """Token ids a Hugging Face tokenizer folder can produce: the largest id + 1 (tokenizer.json with
    its added tokens, and the added_tokens_decoder of tokenizer_config.json)."""
    path = os.path.join(folder, "tokenizer.json")
    try:
        ids = list(Tokenizer.from_file(path).get_vocab(with_added_tokens=True).values())
    except Exception as e:  # the tokenizers library raises its own exception types for broken files
        raise ConfigError(f"model.hf_assets_path: {path} cannot be read by the tokenizers library ({e}); restore "
                          "the model's tokenizer.json") from None
    config_file = os.path.join(folder, "tokenizer_config.json")
    if os.path.isfile(config_file):
        ids += [int(i) for i in read_json(config_file, "model.hf_assets_path").get("added_tokens_decoder", {})]
    return max(ids) + 1


def check_hf_assets(cfg, *, needs_tokenizer: bool) -> None:
    """Raise ConfigError (one line) for Hugging Face inputs that cannot work, before any process starts.

    needs_tokenizer: the task tokenizes text with the tokenizer of model.hf_assets_path. Checks:
    model.flavor 'hf' has a readable config.json of a supported architecture that matches
    model.name; the tokenizer is there and fits the policy's embedding; checkpoint.initial_load_path
    is a Hugging Face folder with every safetensors file it lists.
    """
    m, ck = cfg.model, cfg.checkpoint
    vocab_size = job_model_args(cfg).vocab_size  # flavor 'hf': reads and checks config.json
    if needs_tokenizer:
        if not os.path.isfile(os.path.join(m.hf_assets_path, "tokenizer.json")):
            raise ConfigError(f"model.hf_assets_path: {os.path.join(m.hf_assets_path, 'tokenizer.json')} not "
                              f"found; the task tokenizes text with it: point model.hf_assets_path at the "
                              "model's Hugging Face folder")
        size = tokenizer_vocab_size(m.hf_assets_path)
        if size > vocab_size:
            raise ConfigError(f"model.hf_assets_path: the tokenizer has {size} token ids but the policy's embedding "
                              f"has {vocab_size} rows; use the model's own tokenizer, or a model (model.flavor) "
                              f"with vocab_size >= {size}")
    if ck.initial_load_path:
        if not ck.initial_load_in_hf:
            raise ConfigError(f"checkpoint.initial_load_path: '{ck.initial_load_path}' is read as Hugging Face "
                              "safetensors only; set checkpoint.initial_load_in_hf = true")
        if not os.path.isdir(ck.initial_load_path):
            raise ConfigError(f"checkpoint.initial_load_path: '{ck.initial_load_path}' is not a folder; point it at "
                              "the Hugging Face model folder that holds the safetensors")
        safetensors_files(ck.initial_load_path, LOAD_KEY)
