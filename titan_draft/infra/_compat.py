"""torchtitan 0.2.2 on a machine without an accelerator: the few workarounds, in one place.

It must run before torchtitan is imported: titan_draft/__init__.py imports it first, so any import of
the package applies it. On a GPU machine it changes nothing.
"""
import torch

ON_CPU = not torch.cuda.is_available()

if ON_CPU:
    # torchtitan picks its device type at import time and falls back to "cuda" on CPU hosts.
    torch._utils._get_available_device_type = lambda: "cpu"


def device() -> torch.device:
    """The device this process computes on: its local GPU, or the CPU."""
    if ON_CPU:
        return torch.device("cpu")
    import os

    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))


def backend() -> str:
    return "gloo" if ON_CPU else "nccl"


def fix_fsdp_reduce_ops(model: torch.nn.Module) -> None:
    """Gloo has no PREMUL_SUM: let FSDP2 reduce with SUM (then divide) on CPU."""
    if not ON_CPU:
        return
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
