"""The model families titan_draft runs (torchtitan's llama3 and qwen3), in one table.

Everything that differs between the two families and that more than one module needs lives here:
torchtitan's model and args classes, its flavor registry, its RoPE function and the name of the
model's RoPE table buffer, its Hugging Face state-dict adapter, and the Hugging Face names of the
family (config.json `architectures` / `model_type`) with the reader of its config.json. Callers
look a family up by `model.name` (`family`), by a torchtitan args object (`family_of_args`) or by a
Hugging Face config.json (`family_of_hf_config`) and never branch on the family themselves;
`hf_model_args` is model.flavor "hf": the torchtitan args of a Hugging Face model folder.
"""
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from torchtitan.models.llama3 import Transformer, TransformerModelArgs, llama3_args
from torchtitan.models.llama3.model.args import RoPEScalingArgs
from torchtitan.models.llama3.model.model import FeedForward as Llama3FeedForward
from torchtitan.models.llama3.model.state_dict_adapter import Llama3StateDictAdapter
from torchtitan.models.qwen3 import Qwen3Model, Qwen3ModelArgs, qwen3_args
from torchtitan.models.qwen3.model.model import apply_rotary_emb as qwen3_rotary_emb
from torchtitan.models.qwen3.model.state_dict_adapter import Qwen3StateDictAdapter

from titan_draft.infra.errors import ConfigError
from titan_draft.infra.io import read_json
from titan_draft.models.rope import rotate_pairs


@dataclass(frozen=True)
class ModelFamily:
    name: str
    """model.name: "llama3" or "qwen3"."""
    model_cls: type
    args_cls: type
    flavors: dict
    """torchtitan's registry of named flavors ("debugmodel", "8B", ...); never mutate its entries."""
    apply_rotary_emb: Callable
    """apply_rotary_emb(xq, xk, rope_table, positions) of this family as torchtitan computes it (llama3:
    models/rope.rotate_pairs, torchtitan's complex products on real numbers, which torch.compile fuses)."""
    rope_buffer: str
    """Name of the model's precomputed RoPE table buffer."""
    adapter_cls: type
    """torchtitan's Hugging Face state-dict adapter: adapter_cls(args, hf_assets_path)."""
    hf_architectures: tuple[str, ...]
    """config.json `architectures` this family reads; the first is the one it writes."""
    hf_model_type: str
    args_from_hf: Callable
    """args_from_hf(config: dict, source: str) -> torchtitan args of a Hugging Face config.json."""


class HFConfig:
    """A parsed config.json, read key by key; a missing or unsupported value is one ConfigError line
    naming the file and the key."""

    def __init__(self, config: dict, source: str):
        self.config, self.source = config, source

    def get(self, key: str, default=None):
        return self.config.get(key, default)

    def need(self, key: str):
        if key not in self.config:
            raise ConfigError(f"{self.source}: key '{key}' is missing; use the config.json saved with the weights")
        return self.config[key]

    def expect(self, key: str, allowed, why: str) -> None:
        """`key` is `allowed` or absent (transformers' default is the allowed value)."""
        value = self.config.get(key, allowed)
        if value != allowed:
            raise ConfigError(f"{self.source}: {key} = {value!r} is not supported ({why}); only {allowed!r} is")

    def common(self) -> dict:
        """The torchtitan args fields both families share."""
        for key, why in (("attention_bias", "torchtitan's attention has no biases"),
                         ("mlp_bias", "torchtitan's feed-forward has no biases")):
            self.expect(key, False, why)
        self.expect("hidden_act", "silu", "torchtitan's feed-forward is SwiGLU")
        n_heads = self.need("num_attention_heads")
        return dict(dim=self.need("hidden_size"), n_layers=self.need("num_hidden_layers"), n_heads=n_heads,
                    n_kv_heads=self.get("num_key_value_heads") or n_heads, vocab_size=self.need("vocab_size"),
                    norm_eps=self.get("rms_norm_eps", 1e-6))

    def rope(self) -> tuple[dict, float]:
        """(rope parameters, rope_theta): transformers >= 5 writes `rope_parameters` (theta inside),
        older files and the hub's Llama-3.x / Qwen3 files `rope_scaling` plus a top-level `rope_theta`."""
        rope = dict(self.get("rope_parameters") or self.get("rope_scaling") or {})
        rope.setdefault("rope_type", rope.get("type", "default"))
        return rope, float(rope.get("rope_theta", self.get("rope_theta", 10000.0)))


def _llama3_args_from_hf(config: dict, source: str) -> TransformerModelArgs:
    hf = HFConfig(config, source)
    common = hf.common()
    head_dim = hf.get("head_dim") or common["dim"] // common["n_heads"]
    if head_dim * common["n_heads"] != common["dim"]:
        raise ConfigError(f"{source}: head_dim = {head_dim} x num_attention_heads = {common['n_heads']} != "
                          f"hidden_size = {common['dim']}; torchtitan's llama3 needs head_dim = hidden_size / heads")
    rope, theta = hf.rope()
    if rope["rope_type"] == "llama3":
        scaling = RoPEScalingArgs(scaling_factor=float(rope["factor"]), low_freq_factor=float(rope["low_freq_factor"]),
                                  high_freq_factor=float(rope["high_freq_factor"]),
                                  original_max_position_embeddings=int(rope.get(
                                      "original_max_position_embeddings", hf.need("max_position_embeddings"))))
    elif rope["rope_type"] == "default":
        scaling = RoPEScalingArgs(scaling_factor=1.0)  # factor 1 leaves every frequency as it is
    else:
        raise ConfigError(f"{source}: rope_type '{rope['rope_type']}' is not supported for LlamaForCausalLM; "
                          "only 'llama3' scaling (Llama-3.1+) or none is")
    multiple_of, multiplier = _llama3_ffn_args(common["dim"], hf.need("intermediate_size"), source)
    return TransformerModelArgs(**common, rope_theta=theta, rope_scaling_args=scaling, multiple_of=multiple_of,
                                ffn_dim_multiplier=multiplier)


def _llama3_ffn_args(dim: int, width: int, source: str) -> tuple[int, float]:
    """(multiple_of, ffn_dim_multiplier) for which torchtitan's llama3 FeedForward is `width` wide.

    torchtitan computes round_up(int(multiplier * base), multiple_of) with base = int(2/3 * 4 * dim).
    With multiplier = width / base, int(multiplier * base) is width or (float rounding) width - 1,
    and multiple_of = width rounds both up to exactly width. Checked on torchtitan's own module.
    """
    with torch.device("meta"):
        base = Llama3FeedForward(dim, 4 * dim, multiple_of=1, ffn_dim_multiplier=None).w1.out_features
        multiplier = width / base
        got = Llama3FeedForward(dim, 4 * dim, multiple_of=width, ffn_dim_multiplier=multiplier).w1.out_features
    if got != width:
        raise ConfigError(f"{source}: intermediate_size = {width} cannot be expressed by torchtitan's llama3 "
                          f"feed-forward rule for hidden_size {dim} (it gives {got})")
    return width, multiplier


def _qwen3_args_from_hf(config: dict, source: str) -> Qwen3ModelArgs:
    hf = HFConfig(config, source)
    common = hf.common()
    hf.expect("use_sliding_window", False, "torchtitan's qwen3 attends the whole context")
    rope, theta = hf.rope()
    if rope["rope_type"] != "default":
        raise ConfigError(f"{source}: rope_type '{rope['rope_type']}' is not supported for Qwen3ForCausalLM; "
                          "torchtitan's qwen3 has no RoPE scaling: remove rope_scaling (contexts up to "
                          "max_position_embeddings need none)")
    # Tied checkpoints are built untied (tying breaks FSDP and pipelining in torchtitan 0.2.2);
    # hf.load_policy copies the embedding into the output weight.
    return Qwen3ModelArgs(**common, head_dim=hf.need("head_dim"),
                          hidden_dim=hf.need("intermediate_size"), rope_theta=theta, qk_norm=True,
                          enable_weight_tying=False)


FAMILIES = {
    "llama3": ModelFamily(
        name="llama3", model_cls=Transformer, args_cls=TransformerModelArgs, flavors=llama3_args,
        apply_rotary_emb=rotate_pairs, rope_buffer="freqs_cis", adapter_cls=Llama3StateDictAdapter,
        hf_architectures=("LlamaForCausalLM",), hf_model_type="llama", args_from_hf=_llama3_args_from_hf),
    "qwen3": ModelFamily(
        name="qwen3", model_cls=Qwen3Model, args_cls=Qwen3ModelArgs, flavors=qwen3_args,
        apply_rotary_emb=qwen3_rotary_emb, rope_buffer="rope_cache", adapter_cls=Qwen3StateDictAdapter,
        hf_architectures=("Qwen3ForCausalLM",), hf_model_type="qwen3", args_from_hf=_qwen3_args_from_hf),
}


def family(name: str) -> ModelFamily:
    if name not in FAMILIES:
        raise ConfigError(f"model.name: '{name}' is not supported; use one of {sorted(FAMILIES)}")
    return FAMILIES[name]


def family_of_args(args) -> ModelFamily:
    """The family whose torchtitan args class `args` is an instance of."""
    for fam in FAMILIES.values():
        if isinstance(args, fam.args_cls):
            return fam
    raise ValueError(f"model args: {type(args).__name__} is not supported; pass torchtitan llama3 "
                     "TransformerModelArgs or qwen3 Qwen3ModelArgs")


def family_of_hf_config(config: dict, source: str) -> ModelFamily:
    """The family of a Hugging Face config.json (already parsed; `source` names the file in errors)."""
    architectures = config.get("architectures") or []
    for fam in FAMILIES.values():
        if any(a in fam.hf_architectures for a in architectures):
            return fam
    supported = [a for fam in FAMILIES.values() for a in fam.hf_architectures]
    raise ConfigError(f"{source}: architectures {architectures} (model_type '{config.get('model_type')}') is not "
                      f"supported with model.flavor 'hf'; use a checkpoint of {' or '.join(supported)}")


def hf_model_args(model_name: str, folder: str):
    """torchtitan args (not yet set up for the job: see policy.model_args) of <folder>/config.json."""
    source = os.path.join(folder, "config.json")
    if not folder:
        raise ConfigError("model.hf_assets_path: empty, but model.flavor 'hf' reads its config.json; set it to the "
                          "Hugging Face model folder")
    config = read_json(source, "model.hf_assets_path")
    fam = family_of_hf_config(config, source)
    if fam.name != model_name:
        raise ConfigError(f"model.name: '{model_name}', but {source} is a {fam.hf_architectures[0]}; set "
                          f"model.name = '{fam.name}'")
    return fam.args_from_hf(config, source)
