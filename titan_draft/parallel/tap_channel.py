"""TapChannel: tap features from the pipeline's producer stages to the draft stage, off the schedule.

With pipeline parallelism the draft lives whole on the last stage, but its inputs (the token
embeddings and the tap layers' hidden states) come from earlier stages. Sending them with blocking
send/recv on the schedule's own communicator interleaves with the schedule's P2P and can deadlock.
The channel is a separate path instead (DESIGN.md sections 1 and 1b):

- one communicator per (pipeline, producer stage), so messages of one stage arrive in order even
  where the backend ignores tags (NCCL) and several stages share a rank (virtual stages);
- the draft stage posts its receives ahead into landing slots, a ring of 2 * (pp_size - r) per
  producer stage on pp rank r, sized for the largest microbatch;
- producers isend and go on: they wait for their sends only at the end of the step;
- microbatches match by order (the n-th put of a stage is its n-th get) and every message carries
  a stamp (step, microbatch, stage) that is checked on arrival;
- a stage on the draft's own rank hands its features over through a local queue;
- every wait has a timeout whose message names the stage, the microbatch and the ranks.

Features are detached: the channel is forward-only and never carries gradients.
"""
import collections
import logging
from dataclasses import dataclass
from datetime import timedelta
from time import perf_counter

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

ORDER_ERROR = "source and draft stages disagree on the microbatch order"


@dataclass
class _Route:
    """Where one producer stage's features go: a remote group, or (group None) the draft's own rank."""

    stage: int
    width: int
    src: int  # global rank of the producer stage
    dst: int  # global rank of the draft stage
    group: dist.ProcessGroup | None
    ring: int  # landing slots on the draft stage


class TapChannel:
    """Per-microbatch, one-way transport of detached tap features to the draft stage.

    pipelines: the global ranks of every pipeline replica, in pp-rank order (all ranks pass the
        same list: the channel's groups are created collectively);
    stage_ranks: the pp rank hosting each stage; the last stage is the draft stage;
    widths: feature width of every stage that sends (embeddings and tap layers it holds);
    max_rows: rows of the largest microbatch (batch * seq_len); the slots are sized for it.
    Per step, every rank calls begin_step(n_microbatches, rows) and end_step(); producer stages
    call put(stage, features) once per microbatch forward, the draft stage get(stage) once per
    microbatch loss.
    """

    def __init__(self, pipelines: list[list[int]], stage_ranks: list[int], widths: dict[int, int],
                 max_rows: int, dtype: torch.dtype, device: torch.device,
                 put_timeout: float = 120.0, get_timeout: float = 240.0):
        self.rank = dist.get_rank()
        mine = [p for p in pipelines if self.rank in p]
        if len(mine) != 1:
            raise ValueError(f"pipelines: rank {self.rank} must be in exactly one pipeline, got {pipelines}")
        pipeline = mine[0]
        pp = len(pipeline)
        if sorted(set(stage_ranks)) != list(range(pp)):
            raise ValueError(f"stage_ranks: {stage_ranks} must place stages on every pp rank 0..{pp - 1}")
        self.consumer_stage = len(stage_ranks) - 1
        self.pp_rank = pipeline.index(self.rank)
        self.is_consumer = stage_ranks[self.consumer_stage] == self.pp_rank
        self.max_rows, self.device = max_rows, device
        self.put_timeout, self.get_timeout = put_timeout, get_timeout
        self.trace: list[tuple] | None = None  # (kind, stage, microbatch, t_start, t_end) when a list

        self.routes: dict[int, _Route] = {}  # producer stages of this rank's pipeline
        for ranks in pipelines:  # new_group is collective: every rank creates every group, in one order
            dst = ranks[stage_ranks[self.consumer_stage]]
            for stage in sorted(widths):
                src = ranks[stage_ranks[stage]]
                group = dist.new_group(sorted({src, dst})) if src != dst else None
                if ranks is pipeline:
                    ring = 2 * (pp - stage_ranks[stage])
                    self.routes[stage] = _Route(stage, widths[stage], src, dst, group, ring)

        self.slots: dict[int, torch.Tensor] = {}
        self.stamps: dict[int, torch.Tensor] = {}
        self.local: dict[int, collections.deque] = {}
        if self.is_consumer:
            reserved = 0
            for r in self.routes.values():
                if r.group is None:
                    self.local[r.stage] = collections.deque()
                    continue
                self.slots[r.stage] = torch.empty(r.ring, max_rows, r.width, dtype=dtype, device=device)
                self.stamps[r.stage] = torch.empty(r.ring, 3, dtype=torch.int64, device=device)
                reserved += self.slots[r.stage].nbytes
            logger.info("TapChannel: %d landing slots reserve %.2f MiB on rank %d",
                        sum(r.ring for r in self.routes.values() if r.group is not None), reserved / 2**20,
                        self.rank)
            self.reserved_bytes = reserved
        self.producing = [s for s, r in self.routes.items() if r.src == self.rank]
        self._warm_up()

        self.step = 0
        self.n_microbatches = 0
        self.rows = 0
        self.put_count: dict[int, int] = {}
        self.get_count: dict[int, int] = {}
        self.sends: list[tuple[int, int, list[dist.Work], tuple]] = []  # (stage, microbatch, works, tensors)
        self.recvs: dict[tuple[int, int], list[dist.Work]] = {}  # (stage, slot) -> works
        self.in_step = False

    def _warm_up(self) -> None:
        """One tiny message per remote route, so the first in-schedule send does not set up a communicator."""
        ops = []
        for r in self.routes.values():
            if r.group is None or self.rank not in (r.src, r.dst):
                continue
            buf = torch.zeros(1, device=self.device)
            op = dist.isend if self.rank == r.src else dist.irecv
            ops.append(dist.P2POp(op, buf, r.dst if self.rank == r.src else r.src, r.group))
        for op in ops:  # one batch per group: batch_isend_irecv wants a single group per call
            for work in dist.batch_isend_irecv([op]):
                work.wait()

    # --- the step ---------------------------------------------------------------------------------
    def begin_step(self, n_microbatches: int, rows: int) -> None:
        if rows > self.max_rows:
            raise ValueError(f"TapChannel: a microbatch of {rows} rows exceeds max_rows={self.max_rows}; "
                             f"build the channel with max_rows >= the largest microbatch (batch * seq_len)")
        self.step += 1
        self.n_microbatches, self.rows = n_microbatches, rows
        self.put_count = {s: 0 for s in self.producing}
        self.get_count = {s: 0 for s in self.routes} if self.is_consumer else {}
        if self.is_consumer:
            for s in self.slots:
                for m in range(min(self.routes[s].ring, n_microbatches)):
                    self._post_recv(s, m)
        self.in_step = True

    def _post_recv(self, stage: int, microbatch: int) -> None:
        r = self.routes[stage]
        slot = microbatch % r.ring
        ops = [dist.P2POp(dist.irecv, self.stamps[stage][slot], r.src, r.group),
               dist.P2POp(dist.irecv, self.slots[stage][slot, : self.rows], r.src, r.group)]
        self.recvs[(stage, slot)] = dist.batch_isend_irecv(ops)

    def put(self, stage: int, features: torch.Tensor) -> None:
        """Send microbatch features [rows, width] of a producer stage; returns without waiting."""
        t0 = perf_counter()
        r = self.routes.get(stage)
        if r is None or stage not in self.put_count:
            raise ValueError(f"TapChannel.put: stage {stage} is not a producer stage of rank {self.rank}; "
                             f"producers here: {self.producing}")
        if tuple(features.shape) != (self.rows, r.width):
            raise ValueError(f"TapChannel.put: stage {stage} features have shape {tuple(features.shape)}, "
                             f"expected [{self.rows}, {r.width}] (rows of the microbatch, width)")
        m = self.put_count[stage]
        self.put_count[stage] = m + 1
        stamp = torch.tensor([self.step, m, stage], dtype=torch.int64, device=self.device)
        features = features.detach().contiguous()
        if r.group is None:
            self.local[stage].append((stamp, features))
        else:
            ops = [dist.P2POp(dist.isend, stamp, r.dst, r.group), dist.P2POp(dist.isend, features, r.dst, r.group)]
            self.sends.append((stage, m, dist.batch_isend_irecv(ops), (stamp, features)))
        self._record("put", stage, m, t0)

    def get(self, stage: int) -> torch.Tensor:
        """The next microbatch's features [rows, width] from a producer stage (a fresh tensor)."""
        t0 = perf_counter()
        r = self.routes[stage]
        m = self.get_count[stage]
        self.get_count[stage] = m + 1
        if r.group is None:
            if not self.local[stage]:
                raise RuntimeError(f"TapChannel: {ORDER_ERROR}: stage {stage} (rank {r.src}) has not produced "
                                   f"microbatch {m} of step {self.step} when the draft stage needs it")
            stamp, features = self.local[stage].popleft()
        else:
            slot = m % r.ring
            self._wait(self.recvs.pop((stage, slot)), self.get_timeout,
                       f"received no tap features from stage {stage} (rank {r.src}) for microbatch {m} of "
                       f"step {self.step} on draft rank {self.rank}")
            stamp = self.stamps[stage][slot].clone()
            features = self.slots[stage][slot, : self.rows].clone()
            if m + r.ring < self.n_microbatches:  # the slot is free again: it may land at once
                self._post_recv(stage, m + r.ring)
        got = [int(x) for x in stamp.tolist()]
        if got != [self.step, m, stage]:
            raise RuntimeError(f"TapChannel: {ORDER_ERROR}: stage {got[2]} sent microbatch {got[1]} of step "
                               f"{got[0]}, the draft stage (rank {self.rank}) expected microbatch {m} of step "
                               f"{self.step} from stage {stage}")
        self._record("get", stage, m, t0)
        return features

    def end_step(self) -> None:
        """Wait for this rank's sends; check that every stage put and got one tensor per microbatch."""
        self.in_step = False
        for stage, m, works, _ in self.sends:
            r = self.routes[stage]
            self._wait(works, self.put_timeout,
                       f"stage {stage} on rank {self.rank} could not deliver microbatch {m} of step "
                       f"{self.step} to the draft stage (rank {r.dst})")
        self.sends.clear()
        for counts, what in ((self.put_count, "produced"), (self.get_count, "consumed")):
            for stage, n in counts.items():
                if n != self.n_microbatches:
                    raise RuntimeError(f"TapChannel: {ORDER_ERROR}: stage {stage} {what} {n} tap tensors in "
                                       f"step {self.step} of {self.n_microbatches} microbatches (rank {self.rank})")

    def _wait(self, works: list[dist.Work], timeout: float, what: str) -> None:
        start = perf_counter()
        try:
            for work in works:
                work.wait(timedelta(seconds=timeout))
        except RuntimeError as e:
            if perf_counter() - start < 0.9 * timeout:  # a failure, not the timeout: keep the backend's error
                raise
            raise TimeoutError(f"TapChannel timeout after {timeout:g} s: {what}") from e

    def _record(self, kind: str, stage: int, microbatch: int, t0: float) -> None:
        if self.trace is not None:
            self.trace.append((kind, stage, microbatch, t0, perf_counter()))
