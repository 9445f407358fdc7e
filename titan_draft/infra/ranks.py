"""Which process of the job this is, asked one way everywhere."""
import os

import torch.distributed as dist


def is_rank0() -> bool:
    """Whether this is the job's global rank 0, the one that writes files and prints: by the process group,
    or before one exists by torchrun's RANK (a process started without torchrun is rank 0)."""
    if dist.is_initialized():
        return dist.get_rank() == 0
    return int(os.environ.get("RANK", "0")) == 0
