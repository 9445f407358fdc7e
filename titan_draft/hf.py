"""Hugging Face interchange: the policy as safetensors + config.json through torchtitan's state-dict
adapters (llama3: Llama3StateDictAdapter, qwen3: Qwen3StateDictAdapter), its tokenizer from the same
folder (torchtitan's HuggingFaceTokenizer), and an EAGLE-3 draft folder (titan_draft/export_draft.py).

The model's shape comes from the job config (model.name / model.flavor), as in torchtitan; the
weights must match it exactly (strict load). Works on parallelized (FSDP/TP) models: the full state
dict is gathered with torch.distributed.checkpoint.state_dict (a collective: call on every rank),
and rank 0 writes. Folders are written under a temporary name and renamed into place.
"""
import contextlib
import glob
import json
import os
import shutil

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from titan_draft import _compat  # noqa: F401  (before torchtitan)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def state_dict_adapter(model_name: str, args):
    if model_name == "llama3":
        from torchtitan.models.llama3.model.state_dict_adapter import Llama3StateDictAdapter as Adapter
    elif model_name == "qwen3":
        from torchtitan.models.qwen3.model.state_dict_adapter import Qwen3StateDictAdapter as Adapter
    else:
        raise ValueError(f"model.name: '{model_name}' has no Hugging Face adapter; use 'llama3' or 'qwen3'")
    return Adapter(args, None)


def is_writer() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


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


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded CPU state dict on rank 0 (empty elsewhere); a collective on sharded models."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def read_safetensors(folder: str) -> dict[str, torch.Tensor]:
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors files")
    state = {}
    for file in files:
        state.update(load_file(file))
    return state


def _hf_config(model_name: str, args, state: dict[str, torch.Tensor]) -> dict:
    ffn = state["layers.0.feed_forward.w1.weight"].shape[0]
    config = {
        "architectures": ["LlamaForCausalLM" if model_name == "llama3" else "Qwen3ForCausalLM"],
        "model_type": "llama" if model_name == "llama3" else "qwen3",
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
    if model_name == "qwen3":
        config["head_dim"] = args.head_dim
    return config


def save_policy(policy: torch.nn.Module, model_name: str, args, output: str, tokenizer_dir: str | None = None) -> None:
    """model.safetensors (HF names) + config.json (+ the tokenizer files of tokenizer_dir) in `output`."""
    state = full_state_dict(policy)
    if not is_writer():
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
    """Load HF safetensors from `folder` into `policy` (plain or FSDP/TP; every rank reads the files).
    Returns the folder's tokenizer (torchtitan HuggingFaceTokenizer), or None if it has none."""
    from titan_draft.tasks.hf_tokenizer import load_hf_tokenizer

    native = state_dict_adapter(model_name, args).from_hf(read_safetensors(folder))
    set_model_state_dict(policy, native, options=StateDictOptions(full_state_dict=True, strict=True))
    return load_hf_tokenizer(folder) if os.path.exists(os.path.join(folder, "tokenizer.json")) else None


def load_draft(draft: torch.nn.Module, folder: str) -> None:
    """Load an EAGLE-3 draft folder (the layout export_draft writes) into `draft` (plain module)."""
    from titan_draft.export_draft import from_engine_layout

    draft.load_state_dict(from_engine_layout(draft, read_safetensors(folder)), strict=True)
