"""The EAGLE-3 draft checkpoint format that SGLang and vLLM load, both ways: our EagleDraft -> a folder
(`export_draft`, behind `python -m titan_draft.cli.export_draft`) and a published folder -> our EagleDraft
(`load_draft`, behind `--draft.init_path`).

Layout, as read by SGLang python/sglang/srt/models/llama_eagle3.py (sgl-project/sglang 03d5a77) and
vLLM vllm/model_executor/models/llama_eagle3.py (vllm-project/vllm 00bd149):
- config.json: architectures ["LlamaForCausalLMEagle3"], model_type "llama", num_hidden_layers 1,
  hidden_size / heads / head_dim / intermediate_size / rms_norm_eps / rope_theta / max_position_embeddings
  of the draft, vocab_size = the target's, draft_vocab_size, target_hidden_size (fc reads
  3 * target_hidden_size: both engines need exactly three taps), eagle_config.use_aux_hidden_state, and
  the tap layer ids (below).
- model.safetensors, names without a "model." prefix (the engines add it): fc.weight [H, 3 H_t];
  midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight [H];
  midlayer.self_attn.{q,k,v}_proj.weight [heads * head_dim, 2 H] (stacked into qkv_proj by the
  engines), o_proj [H, heads * head_dim]; midlayer.mlp.{gate,up,down}_proj.weight; norm.weight;
  lm_head.weight [draft_vocab, H]; d2t int64 [draft_vocab] (target id = draft id + d2t);
  t2d bool [vocab] (both engines skip it); embed_tokens.weight [vocab, H] from the policy (vLLM
  loads it when present, SGLang too; otherwise both share the target's).
- RoPE: the engines rotate q/k in the Hugging Face half-split convention; the draft trains with
  torchtitan's interleaved pairs, so q_proj / k_proj rows are permuted on the way out (and back on
  the way in) exactly as torchtitan's Llama3StateDictAdapter does for the policy's wq / wk.

Tap layer ids. Here tap i is the output of decoder layer i (models/policy.py TapRecorder). Both engines
instead capture the residual stream entering a decoder layer (hidden_states + residual, just before
layer j runs, j in layer order, each layer once), i.e. the output of layer j - 1. What they read:
- vLLM (vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py da84445 get_eagle3_aux_layers_from_config,
  vllm/v1/worker/gpu_model_runner.py 4e17906 _get_eagle3_aux_layers_from_config,
  vllm/model_executor/models/llama.py e06c9ba LlamaModel.forward / get_eagle3_aux_hidden_state_layers):
  ids from the top level of the draft config, `eagle_aux_hidden_state_layer_ids` (some versions then fall
  back to `eagle_config.eagle_aux_hidden_state_layer_ids`), used as they are: id j = output of layer
  j - 1. No ids: the target's default (2, L//2, L-3). So tap t is written as t + 1, top level.
- SGLang (python/sglang/srt/model_executor/model_runner.py 0005834 __init__ reads
  `eagle_config["eagle_aux_hidden_state_layer_ids"]` only; python/sglang/srt/models/llama.py bf7a0e2
  LlamaModel.forward / set_eagle3_layers_to_capture, the same in qwen3.py): explicit ids get + 1
  ("for the ith layer, it takes the output of the (i-1)th layer"), so id t = output of layer t.
  No ids: capture before (2, L//2, L-3). So tap t is written as t, inside eagle_config.
- Neither can feed the output of the last layer L - 1 (no layer L is entered): taps must lie in
  0..L-2. Without ids both feed the outputs of layers (1, L//2-1, L-4), this project's default taps
  (a published draft without ids is read that way).
`engine="both"` (the default) writes each engine's ids where that engine reads them: t + 1 at the top
level (vLLM reads eagle_config only when the top level has none) and t inside eagle_config (SGLang reads
nothing else), so one folder serves both engines for any taps they can feed.
"""
import json
import os

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from titan_draft.infra.errors import ConfigError
from titan_draft.infra.io import atomic_directory, full_state_dict, read_safetensors
from titan_draft.infra.ranks import is_rank0

ARCHITECTURE = "LlamaForCausalLMEagle3"
ARCHITECTURES = (ARCHITECTURE, "Eagle3LlamaForCausalLM")  # vLLM's registry knows both names
VLLM, SGLANG, BOTH_ENGINES = "vllm", "sglang", "both"
ENGINES = (BOTH_ENGINES, VLLM, SGLANG)
IDS_KEY = "eagle_aux_hidden_state_layer_ids"
ENGINE_TAPS = 3  # fc reads 3 * target_hidden_size in both engines
EMBED_KEY = "embed_tokens.weight"  # the policy's embeddings; our draft reads the policy's own


# --- tap layer ids ----------------------------------------------------------------------------------
def engine_default_taps(n_layers: int) -> list[int]:
    """Outputs of the layers both engines feed a draft whose config names no ids: they capture the
    state entering layers (2, L//2, L-3), each once, in layer order."""
    return [j - 1 for j in sorted({2, n_layers // 2, n_layers - 3})]


def tap_layer_ids(tap_layers: list[int], n_layers: int, engine: str = BOTH_ENGINES) -> dict:
    """The config.json entries that make `engine` feed the draft exactly the outputs of `tap_layers`."""
    taps = list(tap_layers)
    if len(taps) != ENGINE_TAPS:
        raise ConfigError(f"draft.tap_layers: SGLang and vLLM read exactly {ENGINE_TAPS} tap layers, this draft has "
                          f"{len(taps)} ({taps}); train with three tap layers to export")
    if taps != sorted(set(taps)) or not 0 <= taps[0] <= taps[-1] <= n_layers - 2:
        raise ConfigError(f"draft.tap_layers: {taps} cannot be fed by SGLang or vLLM to a {n_layers}-layer policy: "
                          f"they capture the state entering a decoder layer, so only distinct ascending outputs of "
                          f"layers 0..{n_layers - 2} (not the last layer's); train with such taps to export")
    if engine not in ENGINES:
        raise ValueError(f"engine: '{engine}' is not one of {ENGINES}")
    vllm_ids = {IDS_KEY: [t + 1 for t in taps]} if engine in (VLLM, BOTH_ENGINES) else {}
    sglang_ids = {IDS_KEY: taps} if engine in (SGLANG, BOTH_ENGINES) else {}
    return {**vllm_ids, "eagle_config": {"use_aux_hidden_state": True, **sglang_ids}}


def taps_in_config(config: dict, n_layers: int) -> tuple[list[int], str]:
    """The layers whose outputs a draft with this config.json is fed (see the module docstring), and
    where they come from, for messages. Ids at the top level and in eagle_config must agree."""
    top = config.get(IDS_KEY)
    nested = (config.get("eagle_config") or {}).get(IDS_KEY)
    if not top and not nested:
        return engine_default_taps(n_layers), f"no {IDS_KEY} (the engines' default for {n_layers} layers)"
    read = []
    if top:
        read.append(([j - 1 for j in top], f"{IDS_KEY} {list(top)} (vLLM numbering)"))
    if nested:
        read.append((list(nested), f"eagle_config.{IDS_KEY} {list(nested)} (SGLang numbering)"))
    if len(read) == 2 and read[0][0] != read[1][0]:
        raise ConfigError(f"{read[0][1]} and {read[1][1]} name different layers ({read[0][0]} vs {read[1][0]}); "
                          f"keep the one of the engine the draft was trained for")
    return read[0]


# --- tensors ----------------------------------------------------------------------------------------
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
        out[EMBED_KEY] = embed_tokens
    return {k: v.contiguous() for k, v in out.items()}


def from_engine_layout(draft, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of to_engine_layout (the policy's embed_tokens is dropped)."""
    adapter, a = _rope_adapter(draft), draft.args
    out = {k: v for k, v in state.items() if k != EMBED_KEY}
    out["midlayer.self_attn.q_proj.weight"] = adapter._reverse_permute(state["midlayer.self_attn.q_proj.weight"],
                                                                       a.n_heads)
    out["midlayer.self_attn.k_proj.weight"] = adapter._reverse_permute(state["midlayer.self_attn.k_proj.weight"],
                                                                       a.n_kv_heads)
    return out


# --- export -----------------------------------------------------------------------------------------
def engine_config(draft, ids: dict, dtype: torch.dtype) -> dict:
    """config.json of the draft; `ids` from tap_layer_ids."""
    a = draft.args
    return {
        "architectures": [ARCHITECTURE], "model_type": "llama", "num_hidden_layers": 1,
        "hidden_size": a.dim, "num_attention_heads": a.n_heads, "num_key_value_heads": a.n_kv_heads,
        "head_dim": a.head_dim, "intermediate_size": a.ffn_dim, "rms_norm_eps": a.norm_eps,
        "rope_theta": a.rope_theta, "max_position_embeddings": a.max_seq_len, "hidden_act": "silu",
        "vocab_size": a.target_vocab_size, "draft_vocab_size": a.draft_vocab_size, "target_hidden_size": a.dim,
        "tie_word_embeddings": False, "torch_dtype": str(dtype).removeprefix("torch."), **ids,
    }


def export_draft(draft, tap_layers: list[int], output: str, *, n_layers: int, engine: str = BOTH_ENGINES,
                 embed_tokens: torch.Tensor | None = None) -> None:
    """Write `output` (config.json + model.safetensors) atomically for `engine` ("vllm", "sglang" or
    "both"); n_layers: the policy's. A collective on sharded drafts."""
    from safetensors.torch import save_file

    ids = tap_layer_ids(tap_layers, n_layers, engine)  # checks first, before any collective
    state = full_state_dict(draft)
    if not is_rank0():
        return
    tensors = to_engine_layout(draft, state, embed_tokens)
    with atomic_directory(output) as tmp:
        save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(engine_config(draft, ids, state["fc.weight"].dtype), f, indent=2)


# --- import -----------------------------------------------------------------------------------------
def _rope(config: dict) -> tuple[float, str]:
    """(rope_theta, rope type) of a config.json in the older flat keys or transformers 5's rope_parameters."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    theta = config.get("rope_theta", rope.get("rope_theta", 10000.0))
    return float(theta), rope.get("rope_type", rope.get("type", "default"))


def config_mismatches(draft, config: dict, tap_layers: list[int], n_layers: int) -> list[str]:
    """One line per config.json entry that this draft (its shape, this job's taps) cannot take: key,
    the file's value, ours, and the fix."""
    a, hidden = draft.args, config.get("hidden_size")
    heads = config.get("num_attention_heads")
    vocab = config.get("vocab_size")
    theta, rope_type = _rope(config)
    fixed = "this project's draft cannot take another value"
    for_policy = "use a draft made for this policy"
    expected = [  # key, the file's value (Llama config defaults where absent), ours, fix
        ("num_hidden_layers", config.get("num_hidden_layers"), 1, "this project's draft has one decoder layer"),
        ("hidden_size", hidden, a.dim, f"the draft reads the policy's hidden states; {for_policy}"),
        ("target_hidden_size", config.get("target_hidden_size", hidden), a.dim, for_policy),
        ("num_attention_heads", heads, a.n_heads, f"set --draft.n_heads {heads}"),
        ("num_key_value_heads", config.get("num_key_value_heads", heads), a.n_kv_heads,
         f"set --draft.n_kv_heads {config.get('num_key_value_heads', heads)}"),
        ("intermediate_size", config.get("intermediate_size"), a.ffn_dim,
         f"this project's draft has intermediate_size = 4 * hidden_size; {fixed}"),
        ("vocab_size", vocab, a.target_vocab_size, f"the draft was made for another vocabulary; {for_policy}"),
        ("draft_vocab_size", config.get("draft_vocab_size") or vocab, a.draft_vocab_size,
         f"set --draft.vocab_size {config.get('draft_vocab_size') or vocab}"),
        ("rope_theta", theta, a.rope_theta, f"the draft takes the policy's rope_theta; {for_policy}"),
        ("rope_scaling.rope_type", rope_type, "default", f"the draft rotates with plain RoPE; {fixed}"),
        ("rms_norm_eps", config.get("rms_norm_eps", 1e-6), a.norm_eps, f"the draft takes the policy's; {for_policy}"),
        ("tie_word_embeddings", config.get("tie_word_embeddings", False), False,
         f"the draft has its own lm_head; {fixed}"),
    ]
    lines = [f"{key} is {theirs!r}, this job's draft has {ours!r}; {fix}"
             for key, theirs, ours, fix in expected if theirs != ours]
    if hidden and heads and config.get("head_dim", hidden // heads) * heads != hidden:
        lines.append(f"head_dim is {config['head_dim']}, not hidden_size / num_attention_heads = {hidden // heads} "
                     f"as in this project's draft; {fixed}")
    architectures = config.get("architectures") or []
    if not set(architectures) & set(ARCHITECTURES):
        lines.insert(0, f"architectures is {architectures}, not an EAGLE-3 Llama draft ({ARCHITECTURE}); "
                        f"use a draft in the SGLang/vLLM EAGLE-3 layout")
    if lines:  # the taps only mean something for a draft of this shape
        return lines
    try:
        taps, source = taps_in_config(config, n_layers)
    except ConfigError as e:
        return [str(e)]
    if taps != list(tap_layers):
        lines.append(f"{source}: the draft was trained on the outputs of layers {taps}, this job taps "
                     f"{list(tap_layers)}; set --draft.tap_layers {' '.join(map(str, taps))}")
    return lines


def _complete_vocab_maps(draft, state: dict[str, torch.Tensor]) -> None:
    """Both engines ignore t2d and some drafts omit it (and d2t when the vocabularies are equal)."""
    a = draft.args
    if "d2t" not in state and a.draft_vocab_size == a.target_vocab_size:
        state["d2t"] = torch.zeros(a.draft_vocab_size, dtype=torch.long)
    if "t2d" not in state and "d2t" in state:
        state["t2d"] = torch.zeros(a.target_vocab_size, dtype=torch.bool)
        state["t2d"][state["d2t"] + torch.arange(len(state["d2t"]))] = True


def tensor_mismatches(draft, state: dict[str, torch.Tensor]) -> list[str]:
    """One line per tensor the draft lacks, does not have, or has in another shape."""
    ours = draft.state_dict()
    lines = [f"tensor {k} is missing; this job's draft needs it with shape {list(ours[k].shape)}"
             for k in ours if k not in state]
    lines += [f"tensor {k} is not part of this project's draft; use a draft without it" for k in state if k not in ours]
    lines += [f"tensor {k} has shape {list(state[k].shape)}, this job's draft has {list(ours[k].shape)}; "
              f"use a draft made for this policy and these draft settings"
              for k in ours if k in state and state[k].shape != ours[k].shape]
    return lines


def load_draft(draft, folder: str, tap_layers: list[int], *, n_layers: int) -> None:
    """Load an EAGLE-3 draft folder (SGLang/vLLM layout, what export_draft writes) into `draft` (plain
    or sharded; every rank reads the files). Checks its config.json against the draft's shape and this
    job's tap layers (n_layers: the policy's) first; a ConfigError lists every mismatch, one per line."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise ConfigError(f"{path}: not found; point --draft.init_path at an EAGLE-3 draft folder "
                          f"(config.json + *.safetensors)")
    with open(path) as f:
        config = json.load(f)
    lines = config_mismatches(draft, config, tap_layers, n_layers)
    if not lines:
        state = {k: v for k, v in read_safetensors(folder, "draft.init_path").items() if k != EMBED_KEY}
        _complete_vocab_maps(draft, state)
        lines = tensor_mismatches(draft, state)
    if lines:
        raise ConfigError("\n".join(f"{folder}: {line}" for line in lines))
    set_model_state_dict(draft, from_engine_layout(draft, state),
                         options=StateDictOptions(full_state_dict=True, strict=True))
