"""The policy: a torchtitan llama3 / qwen3 model that runs packed documents and exposes its taps.

Three small changes to a plain torchtitan model, all invisible to FSDP/TP/PP:
- every attention's inner op becomes `PackedAttention` (causal within each document, through
  titan_draft.ops.branch_attention with no branch; context parallelism swaps in its ring op);
- the LM head (`output`) becomes a `PolicyHead`: plain logits, or, when a `HeadRequest` is set, the
  log-probs / entropy / draft teacher of chosen rows computed chunk by chunk (ops/linear_logprobs.py),
  inside the head's own forward so that FSDP gathers its weight as for any forward;
- `TapRecorder` hooks record the token embeddings and the outputs of the tap layers, detached.
"""
import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from titan_draft.infra import _compat
from torchtitan.models.attention import VarlenMetadata

from titan_draft.data.packing import PackedBatch
from titan_draft.infra.errors import ConfigError
from titan_draft.models.families import family, family_of_args, hf_model_args
from titan_draft.ops.linear_logprobs import TokenOutputs, linear_token_outputs, logits_token_outputs

# Small flavors for laptops and CI; torchtitan's own flavors ("debugmodel", "8B", ...) work too.
TINY_FLAVORS = {
    "tiny": dict(dim=128, n_layers=4, n_heads=4, n_kv_heads=4, vocab_size=32, multiple_of=32),
    "tiny_gqa": dict(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=32, multiple_of=16),
    "small": dict(dim=512, n_layers=8, n_heads=8, n_kv_heads=4, vocab_size=32, multiple_of=64),
    # The GPU rollout bench's policy: 16 layers (~180M parameters), deep enough that one
    # draft layer per proposed token costs a small fraction of a verify forward.
    "medium": dict(dim=1024, n_layers=16, n_heads=16, n_kv_heads=4, vocab_size=32, multiple_of=256),
}


def model_args(name: str, flavor: str, max_seq_len: int, hf_assets_path: str = ""):
    """torchtitan model args for (name, flavor), set up for packed varlen attention.

    flavor "hf" reads the shape from <hf_assets_path>/config.json (families.hf_model_args)."""
    fam = family(name)
    if flavor == "hf":
        args = hf_model_args(name, hf_assets_path)
    elif flavor in TINY_FLAVORS:
        extra = dict(TINY_FLAVORS[flavor])
        if fam.name == "qwen3":
            extra.pop("multiple_of")
            extra.update(head_dim=extra["dim"] // extra["n_heads"], hidden_dim=3 * extra["dim"])
        args = fam.args_cls(**extra)
    elif flavor in fam.flavors:
        args = copy.deepcopy(fam.flavors[flavor])  # torchtitan's registry entry stays as it is
    else:
        raise ConfigError(f"model.flavor: '{flavor}' is unknown for model.name '{name}'; use 'hf' or one of "
                          f"{sorted(TINY_FLAVORS) + sorted(fam.flavors)}")
    args.max_seq_len = max_seq_len
    args.attn_type, args.attn_mask_type = "varlen", "block_causal"
    if hasattr(args, "enable_weight_tying"):
        args.enable_weight_tying = False  # tied embeddings break FSDP and pipelining in torchtitan 0.2.2
    return args


def job_model_args(cfg):
    """model_args of a job config: [model] name / flavor / hf_assets_path, training.seq_len."""
    return model_args(cfg.model.name, cfg.model.flavor, cfg.training.seq_len, cfg.model.hf_assets_path)


def build_policy(name: str, flavor: str, max_seq_len: int, seed: int | None = None, device=None, *,
                 hf_assets_path: str = "") -> nn.Module:
    """A freshly initialised policy on `device` (default: the current one), with packed attention installed
    (on "meta": the structure only, for splitting into pipeline stages)."""
    return policy_from_args(model_args(name, flavor, max_seq_len, hf_assets_path), seed, device)


def policy_from_args(args, seed: int | None = None, device=None) -> nn.Module:
    """build_policy for torchtitan args already made (e.g. model_args with some sizes changed)."""
    if seed is not None:
        torch.manual_seed(seed)
    with torch.device(device or _compat.device()):
        model = family_of_args(args).model_cls(args)
    with torch.no_grad():
        model.init_weights()
    install_packed_attention(model)
    if type(model.output) is nn.Linear:
        model.output.__class__ = PolicyHead  # same parameters and FQNs: a view of the same module
    return model


def cast_parameters(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """The model's parameters in `dtype`, in place; buffers untouched (Module.to would also cast the
    complex RoPE table to a real dtype, dropping its imaginary part)."""
    with torch.no_grad():
        for param in model.parameters():
            param.data = param.data.to(dtype)
    return model


AttentionFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


class PackedAttention(nn.Module):
    """torchtitan's varlen inner-attention slot, served by titan_draft's own ops.

    `attn_fn(q, k, v, cu_seqlens=...) -> (out, lse)` with q [T, H, D]; by default the branch
    attention op with no branch (plain causal attention per document, any device);
    context parallelism replaces it with its ring op.
    """

    def __init__(self, attn_fn: AttentionFn | None = None):
        super().__init__()
        self.attn_fn = attn_fn

    def forward(self, xq, xk, xv, attention_masks: VarlenMetadata, scale=None):
        from titan_draft.ops import branch_attention

        fn = self.attn_fn or branch_attention
        # [B, H, S, D] -> [B*S, H, D]: documents are packed along the token dim.
        q, k, v = (x.transpose(1, 2).flatten(0, 1) for x in (xq, xk, xv))
        out, _ = fn(q, k, v, cu_seqlens=attention_masks.cu_seq_q, scale=scale)
        return out


def attention_modules(model: nn.Module):
    return [m for m in model.modules() if hasattr(m, "inner_attention") and hasattr(m, "attn_type")]


def install_packed_attention(model: nn.Module, attn_fn: AttentionFn | None = None) -> None:
    for attention in attention_modules(model):
        attention.inner_attention = PackedAttention(attn_fn)


def varlen_metadata(batch: PackedBatch) -> VarlenMetadata:
    """The attention metadata of a packed batch: its documents (the global ones under context parallelism)."""
    bounds = batch.attention_cu_seqlens
    return VarlenMetadata(bounds, bounds, batch.max_seqlen, batch.max_seqlen)


def forward_packed(model: nn.Module, batch: PackedBatch) -> torch.Tensor:
    """Logits [T, V] (or the last hidden state on a non-final pipeline stage)."""
    out = model(batch.tokens[None], attention_masks=varlen_metadata(batch), positions=batch.positions[None])
    return out[0]


@dataclass
class HeadRequest:
    """What the LM head computes instead of logits: rows (int64 [R] into the packed rows), their targets
    [R], rows per chunk (0: all at once), and the draft teacher (its vocabulary's target ids, and which of
    the R rows want it; None: no teacher)."""

    rows: torch.Tensor
    targets: torch.Tensor
    chunk_size: int = 0
    teacher_ids: torch.Tensor | None = None
    teacher_rows: torch.Tensor | None = None


class PolicyHead(nn.Linear):
    """torchtitan's `output` linear; with `request` set, its forward returns the rows' TokenOutputs fields
    (a tuple, so that FSDP finds the tensors to hook for backward) instead of logits. `compiled`: the
    chunks' statistics through torch.compile (parallelize_policy sets it for [compile] components "loss")."""

    request: HeadRequest | None = None
    compiled: bool = False

    def forward(self, h: torch.Tensor):
        r = self.request
        if r is None:
            return super().forward(h)
        out = linear_token_outputs(h.flatten(0, -2)[r.rows], self.weight, r.targets, chunk_size=r.chunk_size,
                                   teacher_ids=r.teacher_ids, teacher_rows=r.teacher_rows, compiled=self.compiled)
        return out.logprobs, out.entropy, out.teacher_logits, out.teacher_argmax


def token_outputs(model: nn.Module, batch: PackedBatch, request: HeadRequest) -> TokenOutputs:
    """One forward of the policy over a packed batch, reduced by its head to what `request` asks."""
    return head_outputs(lambda: model(batch.tokens[None], attention_masks=varlen_metadata(batch),
                                      positions=batch.positions[None]), model.output, request)


def head_outputs(forward: Callable[[], object], head: nn.Module, request: HeadRequest) -> TokenOutputs:
    """What `request` asks of the LM head `head`, from `forward()`: a forward of the model (or of the
    pipeline stage) that ends in that head.

    chunk_size > 0: inside the head (PolicyHead), never holding [rows, V] logits. 0: the full logits, then
    the same reduction (logits_token_outputs): the path for heads split by tensor parallelism."""
    if request.chunk_size == 0:
        logits = forward().flatten(0, -2)
        return logits_token_outputs(logits[request.rows], request.targets, teacher_ids=request.teacher_ids,
                                    teacher_rows=request.teacher_rows)
    head.request = request
    try:
        fields = forward()
    finally:
        head.request = None
    return TokenOutputs(*fields)


class TapRecorder:
    """Records, detached, the token embeddings and the outputs of the tap layers of a forward.

    Hooks the modules that sit in `model.layers[str(i)]` when it is entered, so activation
    checkpoint wrappers, FSDP and pipeline splits (a stage holds some layers, or none) all work.
    Use: `with TapRecorder(model, layers) as rec: logits = forward_packed(...)`, then
    `rec.embeddings()` [T, H] and `rec.taps()` [T, len(layers) * H].
    """

    def __init__(self, model: nn.Module, layer_ids: list[int]):
        self.model, self.layer_ids = model, list(layer_ids)
        self.outputs: dict[str, torch.Tensor] = {}
        self._handles = []

    def _record(self, key: str):
        def hook(_module, _inputs, output):
            self.outputs[key] = output.detach().flatten(0, 1)  # [B, S, H] -> [B*S, H]: rows in order

        return hook

    def __enter__(self):
        self.outputs.clear()
        layers = self.model.layers
        targets = {f"layer{i}": layers[str(i)] for i in self.layer_ids if str(i) in layers}
        if getattr(self.model, "tok_embeddings", None) is not None:
            targets["embed"] = self.model.tok_embeddings
        self._handles = [m.register_forward_hook(self._record(k)) for k, m in targets.items()]
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles = []

    def embeddings(self) -> torch.Tensor:
        return self.outputs["embed"]

    def taps(self) -> torch.Tensor:
        return torch.cat([self.outputs[f"layer{i}"] for i in self.layer_ids], dim=-1)
