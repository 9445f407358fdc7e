"""Export the co-trained draft in the EAGLE-3 layout that SGLang and vLLM load.

    python -m titan_draft.export_draft --checkpoint DIR --output OUT [job config args, e.g. --job.config_file X]

DIR is a checkpoint step folder (`.../checkpoint/step-N`) or the checkpoint folder itself (then
its latest complete step). The job config gives the model shapes and tap layers, as for training.

Layout, as read by SGLang python/sglang/srt/models/llama_eagle3.py (sgl-project/sglang commit
03d5a7771f6082e7737a5f19cae7d1e863087013) and vLLM vllm/model_executor/models/llama_eagle3.py
(vllm-project/vllm commit 00bd1493b3e82d6c13c68ee8a0e1c5a96707e190):
- config.json: architectures ["LlamaForCausalLMEagle3"], model_type "llama", num_hidden_layers 1,
  hidden_size / heads / intermediate_size / rms_norm_eps / rope_theta / max_position_embeddings of
  the draft, vocab_size = the target's, draft_vocab_size, target_hidden_size (fc reads
  3 * target_hidden_size: both engines need exactly three taps), eagle_config with
  eagle_aux_hidden_state_layer_ids = the tap layers (outputs of those decoder layers).
- model.safetensors, names without a "model." prefix (the engines add it): fc.weight [H, 3 H_t];
  midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight [H];
  midlayer.self_attn.{q,k,v}_proj.weight [heads * head_dim, 2 H] (stacked into qkv_proj by the
  engines), o_proj [H, heads * head_dim]; midlayer.mlp.{gate,up,down}_proj.weight; norm.weight;
  lm_head.weight [draft_vocab, H]; d2t int64 [draft_vocab] (target id = draft id + d2t);
  t2d bool [vocab] (both engines skip it); embed_tokens.weight [vocab, H] from the policy (vLLM
  loads it when present, SGLang too; otherwise both share the target's).
- RoPE: the engines rotate q/k in the Hugging Face half-split convention; the draft trains with
  torchtitan's interleaved pairs, so q_proj / k_proj rows are permuted on the way out exactly as
  torchtitan's Llama3StateDictAdapter does for the policy's wq / wk.
"""
import argparse
import json
import os
import sys

import torch
import torch.distributed.checkpoint as dcp

from titan_draft import _compat  # noqa: F401  (before torchtitan)
from titan_draft.hf import atomic_directory, full_state_dict, is_writer

ARCHITECTURE = "LlamaForCausalLMEagle3"


def _rope_adapter(draft):
    """torchtitan's HF permutation of q/k rows (its llama3 adapter), set up for the draft's heads."""
    from torchtitan.models.llama3 import TransformerModelArgs
    from torchtitan.models.llama3.model.state_dict_adapter import Llama3StateDictAdapter

    a = draft.args
    return Llama3StateDictAdapter(TransformerModelArgs(dim=a.dim, n_heads=a.n_heads, n_kv_heads=a.n_kv_heads), None)


def to_engine_layout(draft, state: dict[str, torch.Tensor], embed_tokens: torch.Tensor | None):
    """The draft's full state dict in the engines' names and conventions."""
    adapter, a = _rope_adapter(draft), draft.args
    out = dict(state)
    out["midlayer.self_attn.q_proj.weight"] = adapter._permute(state["midlayer.self_attn.q_proj.weight"], a.n_heads)
    out["midlayer.self_attn.k_proj.weight"] = adapter._permute(state["midlayer.self_attn.k_proj.weight"],
                                                               a.n_kv_heads)
    if embed_tokens is not None:
        out["embed_tokens.weight"] = embed_tokens
    return {k: v.contiguous() for k, v in out.items()}


def from_engine_layout(draft, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of to_engine_layout (the policy's embed_tokens is dropped)."""
    adapter, a = _rope_adapter(draft), draft.args
    out = {k: v for k, v in state.items() if k != "embed_tokens.weight"}
    out["midlayer.self_attn.q_proj.weight"] = adapter._reverse_permute(state["midlayer.self_attn.q_proj.weight"],
                                                                       a.n_heads)
    out["midlayer.self_attn.k_proj.weight"] = adapter._reverse_permute(state["midlayer.self_attn.k_proj.weight"],
                                                                       a.n_kv_heads)
    return out


def engine_config(draft, tap_layers: list[int], dtype: torch.dtype) -> dict:
    a = draft.args
    return {
        "architectures": [ARCHITECTURE], "model_type": "llama", "num_hidden_layers": 1,
        "hidden_size": a.dim, "num_attention_heads": a.n_heads, "num_key_value_heads": a.n_kv_heads,
        "head_dim": a.head_dim, "intermediate_size": a.ffn_dim, "rms_norm_eps": a.norm_eps,
        "rope_theta": a.rope_theta, "max_position_embeddings": a.max_seq_len, "hidden_act": "silu",
        "vocab_size": a.target_vocab_size, "draft_vocab_size": a.draft_vocab_size, "target_hidden_size": a.dim,
        "tie_word_embeddings": False, "torch_dtype": str(dtype).removeprefix("torch."),
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(tap_layers), "use_aux_hidden_state": True},
    }


def export_draft(draft, tap_layers: list[int], output: str, embed_tokens: torch.Tensor | None = None) -> None:
    """Write `output` (config.json + model.safetensors) atomically; a collective on sharded drafts."""
    from safetensors.torch import save_file

    if draft.args.n_taps != 3:
        raise ValueError(f"draft.tap_layers: SGLang and vLLM read exactly 3 tap layers, this draft has "
                         f"{draft.args.n_taps}; train with three tap layers to export")
    state = full_state_dict(draft)
    if not is_writer():
        return
    tensors = to_engine_layout(draft, state, embed_tokens)
    with atomic_directory(output) as tmp:
        save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(engine_config(draft, tap_layers, state["fc.weight"].dtype), f, indent=2)


def checkpoint_step_folder(path: str) -> str:
    """`path` itself if it is a complete DCP checkpoint, else its latest complete step-N folder."""
    if os.path.isfile(os.path.join(path, ".metadata")):
        return path
    steps = [int(name[5:]) for name in os.listdir(path) if name.startswith("step-") and name[5:].isdigit()
             and os.path.isfile(os.path.join(path, name, ".metadata"))]
    if not steps:
        raise FileNotFoundError(f"--checkpoint {path}: no complete checkpoint (step-N folder with .metadata)")
    return os.path.join(path, f"step-{max(steps)}")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--output", required=True)
    known, job_args = parser.parse_known_args(argv)

    from titan_draft.config import parse_config
    from titan_draft.train import build_models

    cfg = parse_config(job_args)
    args, _, draft, layers = build_models(cfg, torch.device("cpu"))
    state = {"draft": draft.state_dict(), "tok_embeddings.weight": torch.empty(args.vocab_size, args.dim)}
    dcp.load(state, checkpoint_id=checkpoint_step_folder(known.checkpoint))  # in place, into the draft's tensors
    export_draft(draft, layers, known.output, embed_tokens=state["tok_embeddings.weight"])
    print(f"wrote the EAGLE-3 draft to {known.output}")


if __name__ == "__main__":
    main(sys.argv[1:])
