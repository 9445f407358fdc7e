"""Run a function on N CPU processes joined in a gloo process group, and collect what each returns.

    from distributed import run_distributed
    results = run_distributed(worker, 4, arg1, arg2, timeout=120)   # [result of rank 0, ...]

`worker(rank, world_size, *args)` must be a module-level function (the processes are spawned, so
they import it by name). The default process group is initialised before it runs and destroyed
after it; each process uses one thread. Results travel back through torch.save, so tensors,
numbers and containers of them are all fine. If a rank raises, or the whole run exceeds
`timeout` seconds, every child is killed and RuntimeError carries the failing rank's traceback.
"""
import datetime
import io
import os
import queue
import socket
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn, rank, world_size, port, timeout, results, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout))
        value = fn(rank, world_size, *args)
        buffer = io.BytesIO()
        torch.save(value, buffer)
        results.put((rank, True, buffer.getvalue()))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn, world_size: int, *args, timeout: float = 120.0) -> list:
    """fn(rank, world_size, *args) on world_size gloo ranks; returns the results in rank order."""
    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = [context.Process(target=_worker, args=(fn, rank, world_size, port, timeout, results, args),
                                 daemon=True) for rank in range(world_size)]
    for process in processes:
        process.start()
    deadline = time.monotonic() + timeout
    collected = {}
    try:
        while len(collected) < world_size:
            try:
                rank, ok, payload = results.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                missing = sorted(set(range(world_size)) - set(collected))
                raise RuntimeError(f"run_distributed: ranks {missing} gave no result within {timeout} s")
            if not ok:
                raise RuntimeError(f"run_distributed: rank {rank} failed:\n{payload}")
            collected[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    finally:
        for process in processes:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join()
    return [collected[rank] for rank in range(world_size)]
