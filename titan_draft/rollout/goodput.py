"""Adaptive K: the number of drafts per decode step with the most expected tokens per second.

`GoodputController` weighs online acceptance rates per draft position against measured seconds
per step at each (active-row bucket, K), which the engine's loop times with timing.DeviceTimer (no
host synchronisation of its own; docs/DESIGN.md 4.4).
"""

class GoodputController:
    """The draft length K (0..max_k) of the next decode step: the one with the most expected
    emitted tokens per second for the current active-row bucket.

    Expected tokens per row-step with K drafts: 1 + sum_{k<K} a_k, where a_k is the measured
    fraction of row-steps that drafted more than k tokens and accepted more than k; the counts are
    exponentially decayed once per call (`new_call`) and start from a prior of `prior_steps`
    row-steps that accepted everything, so that positions left unused long enough get tried again.
    a_k is made non-increasing in k, as the true rates are. Seconds per step: per (bucket, K) a
    running mean of measured step times; in a bucket every K gets a measurement (largest K first)
    before any K is judged. A bucket keeps its last K unless another promises `switch_gain` more
    tokens per second: measurement noise does not flip K (each new step shape costs a capture).

    Per call, speculation also costs the draft's prefill over the prompts and its weight copy:
    `would_draft` weighs them against the decode seconds a drafting call saves (`call_saving`), from
    the plain-decoding steps that calls need per bucket (`observe_call`, a running mean over calls).
    That model leaves out what no step time shows (host gaps between steps, flushes charged to
    other steps), so calls are judged by their own times too: a call's seconds over the seconds
    its work would take at the measured plain step costs (`call_ratio`, per kind: drafting or
    not). Once both kinds have a ratio, the lower decides, and the other kind runs again every
    `explore_every` calls, as the draft and the answers change; the first call that drafts is
    followed by plain ones until one of them is timed (or `explore_every` calls pass), so that a
    drafting call is never judged by the model alone. Only calls whose every step replayed a
    CUDA graph are timed (the engine captures a plain call's steps with the drafting ones).
    """

    def __init__(self, max_k: int, *, decay: float = 0.5, prior_steps: float = 1.0, cost_weight: float = 0.25,
                 switch_gain: float = 0.05, explore_every: int = 8):
        self.max_k, self.decay, self.prior_steps, self.cost_weight = max_k, decay, prior_steps, cost_weight
        self.switch_gain, self.explore_every = switch_gain, explore_every
        self.last: dict[int, int] = {}
        """bucket -> the K chosen last."""
        self.accepted = [0.0] * max_k
        self.drafted = [0.0] * max_k
        self.cost: dict[tuple[int, int], float] = {}
        """(bucket, K) -> seconds per step."""
        self.plain_steps: dict[int, float] = {}
        """bucket -> the steps plain decoding needs there in a call (running mean over calls)."""
        self.call_ratio: dict[bool, float] = {}
        """drafted -> a call's seconds over its work's seconds at the plain step costs (running mean)."""
        self.calls_since: dict[bool, int] = {True: 0, False: 0}
        """drafted -> calls since the last call of that kind."""

    def _running_mean(self, old: float | None, new: float) -> float:
        """The running mean after `new` (its weight cost_weight); the first value stands alone."""
        return new if old is None else old + self.cost_weight * (new - old)

    def new_call(self) -> None:
        self.accepted = [self.decay * a for a in self.accepted]
        self.drafted = [self.decay * d for d in self.drafted]

    def observe_acceptance(self, accepted, drafted) -> None:
        """Per-position counts of one or more steps (as RolloutResult's *_per_position)."""
        for k, (a, d) in enumerate(zip(accepted, drafted)):
            self.accepted[k] += a
            self.drafted[k] += d

    def observe_cost(self, bucket: int, K: int, seconds: float) -> None:
        self.cost[bucket, K] = self._running_mean(self.cost.get((bucket, K)), seconds)

    def observe_call(self, plain_steps: dict[int, float], *, drafted: bool | None = None,
                     seconds: float = 0.0) -> None:
        """A call's decode work per bucket: the steps plain decoding needs there (each step's emitted
        tokens over its running rows: one per step without drafts, its tokens per row with them);
        with `drafted`, also the call's `seconds` (decode, plus the draft's prefill and weight copy
        where it drafted) for `call_ratio`; the engine leaves it None where a step of the call was
        not a CUDA graph replay (an eager run or a capture is not the kind's time)."""
        for bucket in plain_steps.keys() | self.plain_steps.keys():
            self.plain_steps[bucket] = self._running_mean(self.plain_steps.get(bucket), plain_steps.get(bucket, 0.0))
        plain_s = sum(steps * self.cost.get((bucket, 0), 0.0) for bucket, steps in plain_steps.items())
        if drafted is None or plain_s <= 0:
            return
        self.call_ratio[drafted] = self._running_mean(self.call_ratio.get(drafted), seconds / plain_s)

    def acceptance_rates(self) -> list[float]:
        """a_k for k = 0..max_k-1."""
        rates, bound = [], 1.0
        for a, d in zip(self.accepted, self.drafted):
            bound = min(bound, (a + self.prior_steps) / (d + self.prior_steps))
            rates.append(bound)
        return rates

    def expected_tokens(self, K: int) -> float:
        """Expected emitted tokens per row-step with K drafts."""
        return 1.0 + sum(self.acceptance_rates()[:K])

    def goodput(self, bucket: int, max_k: int) -> dict[int, float] | None:
        """Expected tokens per second of a `bucket`-row step per K in 0..max_k; None until every K
        of the bucket has a measured cost."""
        if any((bucket, K) not in self.cost for K in range(max_k + 1)):
            return None
        return {K: self.expected_tokens(K) / self.cost[bucket, K] for K in range(max_k + 1)}

    def call_saving(self, buckets, max_k: int) -> float | None:
        """Decode seconds a call that drafts saves over plain decoding: per bucket, its plain steps
        times (a plain step's cost - the best K's cost per plain step it replaces); None while a
        bucket has an unmeasured K."""
        saving = 0.0
        for bucket in buckets:
            goodput = self.goodput(bucket, max_k)
            if goodput is None:
                return None
            best = max(goodput, key=goodput.get)
            plain_step_s = self.cost[bucket, 0]
            saving += self.plain_steps.get(bucket, 0.0) * (plain_step_s - 1 / goodput[best])
        return saving

    def would_draft(self, buckets, max_k: int, overhead_s: float = 0.0) -> bool:
        """Whether a call over these buckets should draft (counted as a call of that kind).

        Where calls of both kinds have a `call_ratio`: the kind with the lower one, except that the
        other kind runs once `explore_every` calls have passed without it; after the first timed drafting
        call, plain ones until one is timed (or `explore_every` calls pass). Otherwise the model: draft while a K is unmeasured; before any call was
        observed, where some bucket's best K > 0; after, where the call's expected saving exceeds
        `overhead_s`, what drafting adds outside the steps (the draft's prefill and weight copy).
        A call that does not draft runs as plain decoding, without the draft's prefill, staged taps
        and weight copy. Acceptance counts decay towards the prior's full acceptance (`new_call`),
        so the model drafts again after a while and measures acceptance afresh."""
        if len(self.call_ratio) == 2:
            drafts = self.call_ratio[True] < self.call_ratio[False]
            if self.calls_since[not drafts] >= self.explore_every:
                drafts = not drafts
        elif self.call_ratio.keys() == {True}:  # plain until a plain call is timed (or explore_every calls)
            drafts = self.calls_since[True] >= self.explore_every
        else:
            drafts = self._model_would_draft(buckets, max_k, overhead_s)
        self.calls_since[drafts] = 0
        self.calls_since[not drafts] += 1
        return drafts

    def _model_would_draft(self, buckets, max_k: int, overhead_s: float) -> bool:
        saving = self.call_saving(buckets, max_k)
        if saving is None:
            return True
        if not self.plain_steps:
            goodputs = [self.goodput(bucket, max_k) for bucket in buckets]
            return any(max(goodput, key=goodput.get) > 0 for goodput in goodputs)
        return saving > overhead_s

    def choose(self, bucket: int, max_k: int) -> int:
        """K in 0..max_k for a step of `bucket` rows."""
        goodput = self.goodput(bucket, max_k)
        if goodput is None:  # largest unmeasured K first
            return next(K for K in range(max_k, -1, -1) if (bucket, K) not in self.cost)
        best = max(goodput, key=goodput.get)
        last = self.last.get(bucket)
        if last in goodput and goodput[best] <= (1 + self.switch_gain) * goodput[last]:
            best = last
        self.last[bucket] = best
        return best
