"""The TapChannel alone: ordered delivery across virtual stages and ring wrap-around, and clear errors.

Pipelines here are built by hand (no model): every producer stage puts a known tensor per
microbatch and the draft stage checks it gets exactly those, bit for bit.
"""
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from distributed import run_distributed  # noqa: E402

from titan_draft.parallel.tap_channel import ORDER_ERROR, TapChannel  # noqa: E402

ROWS, MAX_ROWS = 6, 8


def features(step: int, stage: int, microbatch: int, width: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + 10 * stage + microbatch)
    return torch.randn(ROWS, width, generator=g)


def delivery_worker(rank, world_size, n_microbatches, steps):
    """pp=3, six stages in loop order (two per rank): stages 0..4 produce, stage 5 is the draft stage."""
    stage_ranks = [0, 1, 2, 0, 1, 2]
    widths = {0: 8, 1: 4, 3: 12, 4: 4, 5: 8}  # stage 2 has no taps and sends nothing
    channel = TapChannel([[0, 1, 2]], stage_ranks, widths, MAX_ROWS, torch.float32, torch.device("cpu"),
                         put_timeout=30, get_timeout=30)
    mismatches = []
    for step in range(1, steps + 1):
        channel.begin_step(n_microbatches, ROWS)
        mine = [s for s in widths if stage_ranks[s] == rank]
        for m in range(n_microbatches):  # producers interleave their stages, as virtual stages do
            for s in mine:
                channel.put(s, features(step, s, m, widths[s]))
        if channel.is_consumer:
            time.sleep(0.2)  # let the producers run ahead of the draft stage
            for s in sorted(widths, reverse=True):  # another order than the puts': matching is per stage
                for m in range(n_microbatches):
                    if not torch.equal(channel.get(s), features(step, s, m, widths[s])):
                        mismatches.append((step, s, m))
        channel.end_step()
    return dict(mismatches=mismatches, reserved=getattr(channel, "reserved_bytes", None),
                rings={s: r.ring for s, r in channel.routes.items()})


def test_delivery_in_order_across_virtual_stages_and_ring_wraps():
    # 7 microbatches > every ring (stage 0: 6 slots, stages 1 and 4: 4 slots), two steps.
    results = run_distributed(delivery_worker, 3, 7, 2, timeout=90)
    consumer = results[2]
    assert consumer["mismatches"] == []
    assert consumer["rings"] == {0: 6, 1: 4, 3: 6, 4: 4, 5: 2}
    # Slots only for remote producers (stage 5 is the draft stage's own): rings x max_rows x width x 4 bytes.
    assert consumer["reserved"] == 4 * MAX_ROWS * (6 * 8 + 4 * 4 + 6 * 12 + 4 * 4)


def error_worker(rank, world_size):
    """Two ranks, one producer stage (0) on rank 0 and the draft stage (1) on rank 1."""
    def channel(**timeouts):
        return TapChannel([[0, 1]], [0, 1], {0: 4}, MAX_ROWS, torch.float32, torch.device("cpu"), **timeouts)

    def error_of(fn):
        try:
            fn()
        except (RuntimeError, ValueError, TimeoutError) as e:
            return f"{type(e).__name__}: {e}"
        return None

    out = {}
    c = channel()
    out["rows"] = error_of(lambda: c.begin_step(2, MAX_ROWS + 1))
    c.begin_step(1, ROWS)
    if rank == 0:
        out["shape"] = error_of(lambda: c.put(0, torch.zeros(ROWS, 5)))
        out["stage"] = error_of(lambda: c.put(1, torch.zeros(ROWS, 4)))
        c.put(0, torch.zeros(ROWS, 4))
    else:
        c.get(0)
    c.end_step()
    dist.barrier()

    # A producer that never sends: the draft stage fails with the timeout, it does not hang.
    c = channel(get_timeout=0.5)
    c.begin_step(2, ROWS)
    if rank == 1:
        start = time.perf_counter()
        out["get_timeout"] = error_of(lambda: c.get(0))
        out["get_waited"] = time.perf_counter() - start
    dist.barrier()

    # The producer counts one step more than the draft stage (it began a step the draft stage skipped).
    c = channel()
    if rank == 0:
        c.begin_step(1, ROWS)
    c.begin_step(1, ROWS)
    if rank == 0:
        c.put(0, torch.zeros(ROWS, 4))
    else:
        out["order"] = error_of(lambda: c.get(0))
    dist.barrier()

    # A draft stage that never takes its taps: the producer's sends beyond the 4 landing slots time out.
    c = channel(put_timeout=0.5)
    c.begin_step(5, ROWS)
    if rank == 0:
        for _ in range(5):
            c.put(0, torch.zeros(ROWS, 4))
        out["put_timeout"] = error_of(c.end_step)
    dist.barrier()
    return out


def test_errors_name_the_stage_microbatch_and_rank():
    producer, consumer = run_distributed(error_worker, 2, timeout=90)
    assert "max_rows=8" in producer["rows"] and producer["rows"].startswith("ValueError")
    assert "stage 0 features have shape (6, 5), expected [6, 4]" in producer["shape"]
    assert "stage 1 is not a producer stage of rank 0" in producer["stage"]
    assert consumer["get_timeout"].startswith("TimeoutError: TapChannel timeout after 0.5 s")
    assert "from stage 0 (rank 0) for microbatch 0 of step 1 on draft rank 1" in consumer["get_timeout"]
    assert consumer["get_waited"] < 5
    assert ORDER_ERROR in consumer["order"] and "stage 0 sent microbatch 0 of step 2, the draft stage (rank 1) expected microbatch 0 of step 1" \
        in consumer["order"]
    assert producer["put_timeout"].startswith("TimeoutError: TapChannel timeout after 0.5 s")
    assert "stage 0 on rank 0 could not deliver microbatch 4 of step 1 to the draft stage (rank 1)" \
        in producer["put_timeout"]
