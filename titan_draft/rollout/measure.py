"""Adaptive K's measurement of a new batch size, made once before that call's prefill: every decode
step shape the call can run, captured (on CUDA) and timed, and the draft's prefill per prompt token.

The controller then starts from measured costs, so rollouts neither explore nor capture (docs/DESIGN.md
4.4). Separate from engine.py because the decode loop is read without it: it drives the engine's own
steps (`decode_step`, `flush_staged`, the draft's trunk extension) on a dummy row state, and hands
the costs to the engine's controller.
"""
from functools import partial
from typing import TYPE_CHECKING

import torch

from titan_draft.infra.timing import DeviceTimer, timed
from titan_draft.rollout.cached_model import cache_width
from titan_draft.rollout.graphs import StepShape

if TYPE_CHECKING:
    from titan_draft.rollout.engine import RolloutEngine

# Timed replays per decode-step shape when adaptive K measures a new batch size (median kept).
MEASURED_STEPS = 3


def measure_steps(engine: "RolloutEngine", B0: int, K: int, temperature: float, top_p: float, length: int,
                  repeats: int = MEASURED_STEPS) -> dict[tuple[int, int], float]:
    """Capture (on CUDA) and time every decode step a call of B0 rows can run with rows of
    `length` tokens, each active-row bucket with k = 0..K drafts: {(bucket, k): median seconds
    of `repeats` replays}, also given to the controller, so that adaptive K starts from
    measured costs (exploring inside rollouts instead ran each new shape eagerly, then captured
    it, at tens of ms apiece on the H200, against ~1 ms per replayed step). On CUDA these are
    all the step shapes and flushes of the call (their width is all slots: step_width); elsewhere
    they are timed at the prompts' width.
    Runs on a dummy state (every row finishes at its first step, so no slot past length + K is
    written), before a call's prefill and before the call seeds its generator: the call's
    tokens do not depend on it. The state buffers must hold B0 rows of length + max_k + 1 slots."""
    width = engine.step_width(length)
    costs = {}
    state = engine.row_state
    state.tokens[:B0].zero_()
    state.lengths[:B0] = length
    state.limit[:B0] = length + 1
    state.done[:B0] = False
    state.row_of_slot[:B0] = torch.arange(B0, device=engine.device)
    state.hidden[:B0].zero_()
    timer = DeviceTimer(engine.device)
    for bucket in engine.buckets(B0):
        state.counts.staged.fill_(1)
        engine.graphs.capture_at_next_use(("flush", bucket, width))
        engine.graphs.run(("flush", bucket, width), partial(engine.flush_staged, bucket, width))
        for k in range(K + 1):
            shape = StepShape(B0, bucket, k, temperature, top_p, stage=not k, width=width)
            engine.graphs.capture_at_next_use(shape)
            seconds = []
            while len(seconds) < repeats:
                state.counts.staged.zero_()  # a K = 0 step stages into slot 0
                with timer():
                    first = engine.graphs.run(shape, partial(engine.decode_step, shape))
                state.status.tolist()  # the loop's host sync, as in a call
                step_seconds = timer.pop_seconds()
                if not first:
                    seconds.append(step_seconds)
            costs[bucket, k] = sorted(seconds)[len(seconds) // 2]
            engine.controller.observe_cost(bucket, k, costs[bucket, k])
        # The step of a call that adaptive K runs as plain decoding (no taps staged): captured
        # too, so that the first such calls do not run eagerly and look slower than they are.
        plain = StepShape(B0, bucket, 0, temperature, top_p, stage=False, width=width)
        engine.graphs.capture_at_next_use(plain)
        engine.graphs.run(plain, partial(engine.decode_step, plain))
    state.counts.staged.zero_()
    return costs


def measure_draft_prefill(engine: "RolloutEngine", B: int, P: int) -> float:
    """Median seconds per prompt token of the draft's trunk over B dummy prompts of P tokens, as
    prefill runs it (what a drafting call adds to plain decoding's prefill; the first run compiles
    or warms up). Its inputs are the size of the prefill's own taps."""
    width = cache_width(engine.row_state.slots, P)
    next_emb = engine.policy.tok_embeddings(engine.row_state.tokens[:B, 1:P + 1])
    taps = torch.zeros(B, P, engine.row_state.staged_taps.shape[-1], dtype=engine.dtype, device=engine.device)
    start, count = (torch.full((B,), n, dtype=torch.long, device=engine.device) for n in (0, P))
    seconds = [timed(lambda: engine._draft_extend(next_emb, taps, start, count, width), engine.device)[0]
               for _ in range(MEASURED_STEPS + 1)]
    return sorted(seconds[1:])[MEASURED_STEPS // 2] / (B * P)


def measure_call(engine: "RolloutEngine", B: int, K: int, temperature: float, top_p: float, P: int) -> float:
    """What adaptive K reads, measured once per batch size before a call's prefill: every step shape
    (measure_steps, at the prompts' length; their costs go to the controller) and the draft's
    prefill over the prompts, returned in seconds per prompt token (`draft_prefill_s_per_token`)."""
    measure_steps(engine, B, K, temperature, top_p, P)
    return measure_draft_prefill(engine, B, P)

