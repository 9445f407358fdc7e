"""Meshes, FSDP2 and tensor parallelism for the policy and the draft, from torchtitan's [parallelism] keys.

- Meshes: torchtitan's ParallelDims (dp_replicate, dp_shard, cp, tp, pp), built from the run's plan
  (titan_draft/plan.py resolves the degrees: `build_parallel_dims`), also for one process. Its meshes
  are built on first use by collectives; a one-process run never builds them (`optional_mesh`).
- Tensor parallel (both models): attention heads and MLP columns split over `tp` (torch's
  Colwise/RowwiseParallel on the same projections as torchtitan's llama3 plan), norms replicated.
  Unlike torchtitan's plan there is no sequence parallelism: every decoder layer's output stays
  whole on every tp rank, because the draft reads the outputs of the tap layers (TapRecorder) and
  the full logits (GRPO and the TTT teacher). The embeddings are row-parallel, the policy's LM head
  replicates its output. The draft's lm_head is vocab-parallel: its soft cross-entropy
  (models/draft.py soft_cross_entropy) reduces over tp instead of gathering the logits (torch's
  loss_parallel implements only class-index targets).
- Context parallel (cp): the RL step shards each packed batch with titan_draft.parallel's
  apply_context_parallel (train.py); warm starts run whole batches on every rank.
- torch.compile ([compile] enable): "model" in components compiles each policy block whole (torchtitan's
  apply_compile, after TP and before FSDP); "loss" the LM head's chunked log-probs, entropy and teacher
  (PolicyHead.compiled). The draft runs eagerly; config.validate refuses compile with CP or TP.
- FSDP2: torchtitan's apply_fsdp for the policy, fully_shard for the draft, over dp_shard x cp
  (torchtitan's "fsdp" mesh), or in one process training in bf16 over a mesh of its one rank, so
  that FSDP's MixedPrecisionPolicy casts the parameters there too (`fsdp_wraps`). Gradients are
  AVERAGED over the loss mesh (dp x cp: FSDP's divide factor; torchtitan turns division off), so a
  warm start that gives every rank the same batch is exact; RL losses normalised by counts over the
  loss mesh are multiplied by `loss_scale` to make the average the sum they need (context-parallel
  ranks hold disjoint rows of the same documents).
"""
import contextlib
import datetime
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import titan_draft.ops.branch_attention  # noqa: F401  (registers titan_draft::packed_attention, kept by selective AC)
from titan_draft.infra import _compat
from titan_draft.models.policy import PolicyHead
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.utils import maybe_enable_amp


def optional_mesh(dims: ParallelDims, name: str):
    """dims' mesh `name`, or None where that dimension has one rank (torchtitan's get_optional_mesh); a
    one-process run has none and never builds any (that would take a process group)."""
    return dims.get_optional_mesh(name) if dims.world_size > 1 else None


def init_process_group(cfg) -> None:
    """The default group, with [comm] init_timeout_seconds. torchrun's environment gives rank and size;
    a process started without it gets a group of one (torchtitan's checkpointing needs a group)."""
    timeout = datetime.timedelta(seconds=cfg.comm.init_timeout_seconds)
    if "MASTER_ADDR" in os.environ:
        dist.init_process_group(_compat.backend(), timeout=timeout)
    else:
        dist.init_process_group(_compat.backend(), store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)


def compute_dtype(param_dtype: str, device: torch.device) -> torch.dtype:
    """What training forwards and rollouts compute in: [training] mixed_precision_param on GPUs, float32
    on CPU (the CPU runs the math attention path, which has no flash kernel to feed with bf16, and the
    CPU tests compare against float32/float64 references)."""
    return torch.float32 if device.type == "cpu" else TORCH_DTYPE_MAP[param_dtype]


def fsdp_wraps(dims: ParallelDims, param_dtype: str, device: torch.device) -> bool:
    """Whether FSDP2 wraps the models: under data-parallel sharding or replication, and in one process
    that trains in a lower precision. There FSDP's MixedPrecisionPolicy casts the parameters for
    compute over a mesh of one rank, as it does over many; autocast would leave float32 RMSNorm
    weights beside bf16 activations, a mix torch's fused rms_norm refuses (it warns and falls back)."""
    if dims.fsdp_enabled or dims.dp_replicate_enabled:
        return True
    return dims.world_size == 1 and compute_dtype(param_dtype, device) != torch.float32


def training_autocast(param_dtype: str, device: torch.device, dims: ParallelDims):
    """The training forwards' mixed precision, by torchtitan's rule: FSDP casts the parameters itself,
    otherwise autocast to compute_dtype; nothing to do when that is float32. The object is reusable:
    enter it around every training forward."""
    if compute_dtype(param_dtype, device) == torch.float32 or fsdp_wraps(dims, param_dtype, device):
        return contextlib.nullcontext()
    return maybe_enable_amp(dims, param_dtype, device.type)


def set_collective_timeout(dims: ParallelDims, seconds: int) -> None:
    """Switch every mesh group (and the default group) to `seconds`, after a barrier so that no rank
    runs under the shorter timeout while another is still initialising (as torchtitan's
    set_pg_timeouts, whose barrier asks for an accelerator)."""
    dist.barrier()
    timeout = datetime.timedelta(seconds=seconds)
    groups = [mesh.get_group() for mesh in dims.get_all_one_dimensional_meshes().values()] + [None]
    for group in groups:
        if dist.get_backend(group) in ("gloo", "nccl"):  # torchtitan gives unused dimensions a fake backend
            dist.distributed_c10d._set_pg_timeout(timeout, group)


def describe_rank(dims: ParallelDims) -> str:
    """'rank 3 (fsdp 1/2, tp 1/2)': this rank's coordinate in every active mesh, for error messages."""
    parts = [f"{name} {mesh.get_local_rank()}/{mesh.size()}"
             for name, mesh in dims.get_all_one_dimensional_meshes().items() if name in ("dp_replicate", "fsdp",
                                                                                          "cp", "tp", "pp")]
    return f"rank {dist.get_rank()} ({', '.join(parts) or 'single'})"


def dp_rank_and_degree(dims: ParallelDims) -> tuple[int, int]:
    """This rank's index among the data-parallel ranks (dp_replicate x dp_shard) that split the rollouts."""
    mesh = optional_mesh(dims, "batch")
    return (0, 1) if mesh is None else (mesh.get_local_rank(), mesh.size())


def batch_group(dims: ParallelDims):
    """The process group of the data-parallel ranks (dp_replicate x dp_shard: different rollouts), or None."""
    mesh = optional_mesh(dims, "batch")
    return None if mesh is None else mesh.get_group()


def loss_group(dims: ParallelDims):
    """The process group of all ranks holding different rows (dp x cp), or None."""
    mesh = optional_mesh(dims, "loss")
    return None if mesh is None else mesh.get_group()


def cp_mesh(dims: ParallelDims):
    return optional_mesh(dims, "cp")


def sum_over_dp(values: torch.Tensor, dims: ParallelDims, mesh_name: str = "batch") -> torch.Tensor:
    """Sum of a (detached) tensor over the data-parallel ranks ("batch": per-sample totals) or over
    dp x cp ("loss": per-row totals and counts)."""
    mesh = optional_mesh(dims, mesh_name)
    if mesh is None:
        return values
    total = values.detach().clone()
    dist.all_reduce(total, group=mesh.get_group())
    return total


def mean_over_dp(metrics: dict[str, float], dims: ParallelDims) -> dict[str, float]:
    """Per-rank float metrics averaged over the data-parallel ranks."""
    degree = dp_rank_and_degree(dims)[1]
    if degree == 1:
        return metrics
    totals = sum_over_dp(torch.tensor(list(metrics.values()), dtype=torch.float64, device=_compat.device()), dims)
    return dict(zip(metrics, (totals / degree).tolist()))


def loss_scale(dims: ParallelDims) -> float:
    """Factor that turns FSDP's average over the loss mesh (dp x cp) into the sum that losses
    normalised by global counts need."""
    return float(dims.dp_replicate * dims.dp_shard * dims.cp)


def _fsdp_mesh(dims: ParallelDims):
    """FSDP's mesh: torchtitan's (dp_replicate x) fsdp, or in one process a mesh of its one rank, which
    torchtitan's ParallelDims does not build (fsdp_wraps)."""
    if dims.world_size == 1:
        return init_device_mesh(_compat.device().type, (1,), mesh_dim_names=("fsdp",))
    return dims.get_mesh(["dp_replicate", "fsdp"] if dims.dp_replicate_enabled else "fsdp")


def _average_over_dp(model: nn.Module, dims: ParallelDims) -> None:
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(loss_scale(dims))


def apply_activation_checkpointing(policy: nn.Module, cfg) -> nn.Module:
    """torchtitan's [activation_checkpoint] mode (none | selective | full) on the policy's layers, in
    place, as torchtitan's llama3 / qwen3 parallelize applies it: before FSDP, with its list of ops
    that selective op-level checkpointing keeps, and the policy's attention op among them (as torchtitan
    keeps its own varlen attention op's output)."""
    from torchtitan.distributed.activation_checkpoint import apply_ac
    from torchtitan.models.llama3.infra.parallelize import _op_sac_save_list

    if cfg.activation_checkpoint.mode != "none":
        apply_ac(policy, cfg.activation_checkpoint, base_folder=cfg.job.dump_folder,
                 model_compile_enabled=compiles(cfg, "model"),  # memory_budget: the compiler's partitioner
                 op_sac_save_list=_op_sac_save_list | {torch.ops.titan_draft.packed_attention.default})
    return policy


def compiles(cfg, component: str) -> bool:
    """Whether torchtitan's [compile] asks for `component` ("model": the policy's blocks; "loss": its
    LM head's chunked reduction) compiled."""
    return cfg.compile.enable and component in cfg.compile.components


def parallelize_policy(policy: nn.Module, dims: ParallelDims, cfg) -> nn.Module:
    """TP (POLICY_TP_PLAN), torch.compile of each block ([compile]), then torchtitan's FSDP2/HSDP, in
    place: torchtitan's order (activation checkpointing, applied before, comes under the compile)."""
    from torchtitan.models.llama3.infra.parallelize import apply_compile, apply_fsdp

    if dims.tp_enabled:
        tp_mesh = dims.get_mesh("tp")
        parallelize_module(policy, tp_mesh, POLICY_TP_PLAN)
        for block in policy.layers.values():
            parallelize_module(block, tp_mesh, POLICY_LAYER_TP_PLAN)
        _replicate_norms(policy, tp_mesh)
    if compiles(cfg, "model"):
        # fullgraph per block: its attention is one opaque op (ops/branch_attention.py packed_attention).
        apply_compile(policy, cfg.compile)
    if compiles(cfg, "loss") and isinstance(getattr(policy, "output", None), PolicyHead):
        policy.output.compiled = True  # the LM head's chunked log-probs (ops/linear_logprobs.py)
    if fsdp_wraps(dims, cfg.training.mixed_precision_param, _compat.device()):
        apply_fsdp(policy, _fsdp_mesh(dims), param_dtype=TORCH_DTYPE_MAP[cfg.training.mixed_precision_param],
                   reduce_dtype=TORCH_DTYPE_MAP[cfg.training.mixed_precision_reduce], pp_enabled=dims.pp_enabled,
                   reshard_after_forward_policy=cfg.parallelism.fsdp_reshard_after_forward)
        _average_over_dp(policy, dims)
        _compat.fix_fsdp_reduce_ops(policy)
    return policy


def _replicate_over(module: nn.Module, mesh) -> None:
    """Parameters become Replicate DTensors (every parameter then lives on the tp mesh, which FSDP's
    2-D sharding and gradient clipping need); the module still takes and returns plain tensors."""
    distribute_module(
        module, mesh,
        input_fn=lambda _m, inputs, mesh: tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False)
                                                for x in inputs),
        output_fn=lambda _m, output, _mesh: output.to_local(),
    )


def _replicate_norms(model: nn.Module, mesh) -> None:
    for module in list(model.modules()):
        if isinstance(module, nn.RMSNorm):
            _replicate_over(module, mesh)


POLICY_TP_PLAN = {
    "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
    "output": ColwiseParallel(output_layouts=Replicate()),
}
POLICY_LAYER_TP_PLAN = {
    "attention.wq": ColwiseParallel(),
    "attention.wk": ColwiseParallel(),
    "attention.wv": ColwiseParallel(),
    "attention.wo": RowwiseParallel(),
    "feed_forward.w1": ColwiseParallel(),
    "feed_forward.w3": ColwiseParallel(),
    "feed_forward.w2": RowwiseParallel(),
}
DRAFT_TP_PLAN = {
    "midlayer.self_attn.q_proj": ColwiseParallel(),
    "midlayer.self_attn.k_proj": ColwiseParallel(),
    "midlayer.self_attn.v_proj": ColwiseParallel(),
    "midlayer.self_attn.o_proj": RowwiseParallel(),
    "midlayer.mlp.gate_proj": ColwiseParallel(),
    "midlayer.mlp.up_proj": ColwiseParallel(),
    "midlayer.mlp.down_proj": RowwiseParallel(),
    "lm_head": ColwiseParallel(),  # vocab-parallel: each rank's logits are its slice of the draft vocabulary
}


def parallelize_draft(draft: nn.Module, dims: ParallelDims, cfg) -> nn.Module:
    """TP on the draft's decoder layer (its TTT attention runs on the local heads) and a
    vocab-parallel lm_head, fc / norms replicated over tp; then FSDP2 over the data-parallel mesh,
    in place."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if dims.tp_enabled:
        tp_mesh = dims.get_mesh("tp")
        parallelize_module(draft, tp_mesh, DRAFT_TP_PLAN)
        _replicate_over(draft.fc, tp_mesh)
        _replicate_norms(draft, tp_mesh)
        draft.vocab_parallel_group = tp_mesh.get_group()  # ttt_loss's soft cross-entropy reduces over it
    if fsdp_wraps(dims, cfg.training.mixed_precision_param, _compat.device()):
        mp = MixedPrecisionPolicy(param_dtype=TORCH_DTYPE_MAP[cfg.training.mixed_precision_param],
                                  reduce_dtype=TORCH_DTYPE_MAP[cfg.training.mixed_precision_reduce])
        # One unit: each (micro-)batch calls the draft's forward once (every TTT pass and its logits), so
        # its parameters are gathered once and its gradients reduced once per call; a unit per submodule
        # runs FSDP's hooks for every submodule in every pass.
        fully_shard(draft, mesh=_fsdp_mesh(dims), mp_policy=mp)
        _average_over_dp(draft, dims)
        _compat.fix_fsdp_reduce_ops(draft)
    return draft
