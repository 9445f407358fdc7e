"""Sampling distributions and the lossless speculative acceptance rule (DESIGN.md section 4).

Two implementations of the same draws, side by side:
- the dense reference, on probabilities over the whole vocabulary: `probs_from_logits`, `sample`,
  `speculative_accept`;
- what the engine runs, from logits: `sample_from_logits`, `speculative_accept_from_logits`. The
  acceptance rule needs the target's and the draft's probabilities only at the drafted tokens
  (one log-normaliser per position, `log_normalisers`) and in full at one position per row, where the
  chain stops; only there is the draft's distribution scattered into the target vocabulary.
Both draw the same random numbers in the same order from the same generator (or RowNoise), so they
emit the same tokens up to rounding (tests/test_sampling_from_logits.py compares them in float64).

Probabilities are float32 (float64 for float64 logits); the random draws are float32 whatever the
logits' dtype. The target's and the draft's distributions use the same temperature and top-p, so
the acceptance rule compares like with like; at temperature 0 both are one-hot and the rule
reduces to exact greedy decoding.
"""
from typing import Callable

import torch


class RowNoise:
    """Random numbers for the rows of a batch that may be a subset of the rows a call started with.

    With `rows` (slot -> original row, [B]) every draw is made at the shape of all `full` original
    rows and the rows' part is taken: a row gets the same numbers whichever slot it sits in and
    whichever other rows still run, so compacting a batch changes no sample. Without `rows` the
    draws have the batch's own shape (the numbers a plain generator call gives).
    """

    def __init__(self, generator: torch.Generator | None, full: int = 0, rows: torch.Tensor | None = None):
        self.generator, self.full, self.rows = generator, full, rows

    def _shape(self, shape: tuple) -> tuple:
        return shape if self.rows is None else (self.full, *shape[1:])

    def _of_rows(self, draw: torch.Tensor) -> torch.Tensor:
        return draw if self.rows is None else draw[self.rows]

    def exponential(self, shape: tuple, dtype: torch.dtype, device) -> torch.Tensor:
        draw = torch.empty(self._shape(shape), dtype=dtype, device=device).exponential_(generator=self.generator)
        return self._of_rows(draw)

    def uniform(self, shape: tuple, device) -> torch.Tensor:
        return self._of_rows(torch.rand(self._shape(shape), device=device, generator=self.generator))


def _noise(rng: torch.Generator | RowNoise | None) -> RowNoise:
    return rng if isinstance(rng, RowNoise) else RowNoise(rng)


def check_sampling_args(temperature: float, top_p: float) -> None:
    if temperature < 0:
        raise ValueError(f"temperature: {temperature} must be >= 0 (0 = greedy)")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p: {top_p} must be in (0, 1]")


def _prob_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype sampling computes in for logits of `dtype`: float32, float64 for float64."""
    return torch.promote_types(dtype, torch.float32)


def _race(shape: tuple, dtype: torch.dtype, device, rng) -> torch.Tensor:
    """E ~ Exp(1) i.i.d. of `shape`, drawn in float32 (the same generator stream whatever dtype the
    caller computes in), as `dtype`, clamped away from 0 (exponential_ may round to 0: 0 / 0, or
    log 0 against a -inf logit, would yield a NaN that argmax picks)."""
    race = _noise(rng).exponential(shape, torch.float32, device).to(dtype)
    return race.clamp_min_(torch.finfo(dtype).tiny)


# --- the dense reference: probabilities over the whole vocabulary ------------------------------------

def probs_from_logits(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """Probabilities over the last dim (float32, float64 for float64 logits); temperature 0 = one-hot
    at the argmax.

    top_p keeps the smallest set of most likely tokens whose mass reaches top_p (always at least
    the most likely one) and renormalises.
    """
    check_sampling_args(temperature, top_p)
    dtype = _prob_dtype(logits.dtype)
    if temperature == 0:
        probs = torch.zeros_like(logits, dtype=dtype)
        return probs.scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    probs = torch.softmax(logits.to(dtype) / temperature, dim=-1)
    if top_p < 1:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, rng: torch.Generator | RowNoise | None = None) -> torch.Tensor:
    """One token id per row of probs [B, ..., V] (unnormalised weights are fine); random numbers
    from rng (a generator, or the RowNoise of a compacted batch).

    Exponential race: argmax_v p_v / E_v with E_v ~ Exp(1) i.i.d. is v with probability
    p_v / sum(p) (E_v / p_v ~ Exp(p_v); the smallest wins). Unlike torch.multinomial it never
    synchronises with the host, so a CUDA graph can capture it.
    """
    dtype = _prob_dtype(probs.dtype)
    return _race_winner(probs.to(dtype), _race(tuple(probs.shape), dtype, probs.device, rng))


def _race_winner(weights: torch.Tensor, race: torch.Tensor) -> torch.Tensor:
    """The exponential race's winner, argmax_v weights_v / race_v, from drawn race times."""
    return (weights / race).argmax(-1)


def _chain_shape(drafts: torch.Tensor, name: str) -> tuple[int, int]:
    """(B, K) of a chain of draft tokens [B, K] (the argument `name`), K >= 1."""
    if drafts.dim() != 2:
        raise ValueError(f"{name} must be [B, K], got shape {tuple(drafts.shape)}")
    B, K = drafts.shape
    if K < 1:
        raise ValueError(f"{name}: K = 0 draft tokens; speculative acceptance needs K >= 1 "
                         "(sample the target directly when there is no draft)")
    return B, K


def _count_accepted(p: torch.Tensor, q: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Leading accepted drafts [B] in 0..K, from p and q [B, K] at the drafted tokens and uniform
    draws [B, K]: draft k is accepted with probability min(1, p/q)."""
    accepted = uniform * q < p  # u < p / q without dividing; q > 0 for any token the draft sampled
    return accepted.long().cumprod(-1).sum(-1)


def _emit(tokens: torch.Tensor, num_accepted: torch.Tensor, p_stop: torch.Tensor, q_stop: torch.Tensor,
          race: torch.Tensor) -> torch.Tensor:
    """The emitted window [B, K+1]: the accepted drafts of tokens [B, K], then a sample of
    norm(max(0, p_stop - q_stop)) ([B, V]: target and draft at the stop position; q_stop is 0
    past the last draft, which makes it the bonus distribution p_K) by the race times [B, V],
    then -1."""
    B, K = tokens.shape
    residual = (p_stop - q_stop).clamp(min=0)
    mass = residual.sum(-1, keepdim=True)
    # p == q everywhere makes a rejection impossible in exact arithmetic; keep rounding harmless.
    residual = torch.where(mass > 0, residual, p_stop)
    last = _race_winner(residual, race)
    position = torch.arange(K + 1, device=tokens.device)
    out = torch.cat([tokens, tokens.new_full((B, 1), -1)], dim=1)
    out = torch.where(position < num_accepted[:, None], out, torch.full_like(out, -1))
    out[torch.arange(B, device=tokens.device), num_accepted] = last
    return out


def speculative_accept(draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                       rng: torch.Generator | RowNoise | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling of a chain of K draft tokens against the target, for a batch of rows.

    draft_tokens int64 [B, K]; draft_probs [B, K, V] (the draft's distribution at each proposal,
    in the target vocabulary); target_probs [B, K+1, V].
    Returns num_accepted int64 [B] in 0..K and tokens int64 [B, K+1]: tokens[b, :num_accepted[b]+1]
    are the emitted tokens (the accepted drafts, then the corrected or bonus token), the rest -1.
    Draft k is accepted with probability min(1, p/q); the first rejection emits a sample of
    norm(max(0, p - q)); when all K are accepted the bonus comes from target_probs[:, K].
    """
    B, K = _chain_shape(draft_tokens, "draft_tokens")
    if draft_probs.dim() != 3 or draft_probs.shape[:2] != (B, K):
        raise ValueError(f"draft_probs must be [B, K, V] = [{B}, {K}, V], got {tuple(draft_probs.shape)}")
    V = draft_probs.shape[2]
    if tuple(target_probs.shape) != (B, K + 1, V):
        raise ValueError(f"target_probs must be [B, K+1, V] = [{B}, {K + 1}, {V}], got {tuple(target_probs.shape)}")

    dtype = _prob_dtype(torch.promote_types(draft_probs.dtype, target_probs.dtype))
    tokens = draft_tokens.long()
    p = target_probs[:, :K].gather(-1, tokens[..., None])[..., 0].to(dtype)
    q = draft_probs.gather(-1, tokens[..., None])[..., 0].to(dtype)
    num_accepted = _count_accepted(p, q, _noise(rng).uniform((B, K), tokens.device))
    rows = torch.arange(B, device=tokens.device)
    p_stop = target_probs[rows, num_accepted].to(dtype)
    q_stop = torch.where((num_accepted < K)[:, None], draft_probs[rows, num_accepted.clamp(max=K - 1)], 0).to(dtype)
    return num_accepted, _emit(tokens, num_accepted, p_stop, q_stop, _race((B, V), dtype, tokens.device, rng))


# --- from logits: what the engine runs -------------------------------------------------------------

def log_normalisers(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logsumexp(logits / T) over the last dim: [..., V] -> [...] (float32, float64 for float64
    logits); temperature > 0. All positions at once: compiled, the upcast, scaling and reduction fuse
    into one read of the logits (eager PyTorch would copy them all to float32 first)."""
    return torch.logsumexp(logits.to(_prob_dtype(logits.dtype)) / temperature, dim=-1)


def log_normalisers_by_position(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """`log_normalisers` of logits [B, S, V] -> [B, S], one position at a time, so that the float32
    copy eager PyTorch makes is [B, V], never [B, S, V]."""
    return torch.stack([log_normalisers(logits[:, s], temperature) for s in range(logits.shape[1])], dim=1)


LogNormalisersFn = Callable[[torch.Tensor, float], torch.Tensor]


def _probs_at(logits: torch.Tensor, ids: torch.Tensor, temperature: float, top_p: float,
              norm: torch.Tensor | None) -> torch.Tensor:
    """The sampling distribution (T > 0, top-p) of logits [B, S, V] at ids [B, S] -> [B, S]; norm
    [B, >= S]: the log-normalisers of the positions (top-p 1; None otherwise)."""
    if top_p < 1:  # the nucleus is a cut of the sorted, normalised distribution: the exact path
        return probs_from_logits(logits, temperature, top_p).gather(-1, ids[..., None])[..., 0]
    picked = logits.gather(-1, ids[..., None])[..., 0].to(norm.dtype)
    return (picked / temperature - norm[:, :ids.shape[1]]).exp()


def _probs(logits: torch.Tensor, position: torch.Tensor, temperature: float, top_p: float,
           norm: torch.Tensor | None) -> torch.Tensor:
    """The sampling distribution (T > 0, top-p) [B, V] of logits [B, S, V] at one position [B] per
    row; norm [B, S]: the log-normalisers (top-p 1), which make it one pass over the logits."""
    rows = torch.arange(len(position), device=position.device)
    if top_p < 1:
        return probs_from_logits(logits[rows, position], temperature, top_p)
    return (logits[rows, position].to(norm.dtype) / temperature - norm[rows, position, None]).exp()


def sample_from_logits(logits: torch.Tensor, temperature: float, top_p: float = 1.0,
                       rng: torch.Generator | RowNoise | None = None) -> torch.Tensor:
    """`sample(probs_from_logits(logits, temperature, top_p), rng)` without the probabilities:
    one token id per row of logits [B, ..., V], from the same random numbers.

    The exponential race in log space: argmax_v p_v / E_v = argmax_v (logit_v / T - log E_v), the
    log-normaliser being the same for every v of a row. Temperature 0 is the argmax and draws
    nothing (the reference's draws cannot change a one-hot's winner).
    """
    check_sampling_args(temperature, top_p)
    if temperature == 0:
        return logits.argmax(-1)
    if top_p < 1:  # the nucleus is a cut of the sorted, normalised distribution: the exact path
        return sample(probs_from_logits(logits, temperature, top_p), rng)
    dtype = _prob_dtype(logits.dtype)
    race = _race(tuple(logits.shape), dtype, logits.device, rng)
    return (logits.to(dtype) / temperature).sub_(race.log_()).argmax(-1)


def accept_drawn(draft_ids: torch.Tensor, draft_logits: torch.Tensor, target_logits: torch.Tensor,
                 target_ids: torch.Tensor, uniform: torch.Tensor, race: torch.Tensor, temperature: float,
                 top_p: float, log_normalisers_fn: LogNormalisersFn = log_normalisers_by_position,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The acceptance rule of `speculative_accept_from_logits` (temperature > 0) on its drawn random
    numbers: uniform [B, K] for the accept tests, race [B, V] (Exp(1), clamped) for the residual.

    p and q are needed at the K drafted tokens only, and in full at the one position per row where
    the chain stops: there the residual norm(max(0, p - q)) is formed, with q scattered into the
    target vocabulary. At top-p 1 all of them are exp(logit / T - log-normaliser), with one
    log-normaliser per position (log_normalisers_fn: `log_normalisers_by_position`, or
    `log_normalisers` where the whole rule is compiled and the positions fuse).
    """
    K = draft_ids.shape[1]
    tokens = target_ids[draft_ids]
    target_norm = draft_norm = None
    if top_p == 1:
        target_norm = log_normalisers_fn(target_logits, temperature)
        draft_norm = log_normalisers_fn(draft_logits, temperature)
    p = _probs_at(target_logits[:, :K], tokens, temperature, top_p, target_norm)
    q = _probs_at(draft_logits, draft_ids, temperature, top_p, draft_norm)
    num_accepted = _count_accepted(p, q.to(p.dtype), uniform)
    p_stop = _probs(target_logits, num_accepted, temperature, top_p, target_norm)
    q_draft = _probs(draft_logits, num_accepted.clamp(max=K - 1), temperature, top_p, draft_norm)
    q_draft = q_draft.to(p_stop.dtype).masked_fill((num_accepted == K)[:, None], 0)  # no draft past the last
    q_stop = torch.zeros_like(p_stop).index_copy_(-1, target_ids, q_draft)
    return num_accepted, _emit(tokens, num_accepted, p_stop, q_stop, race)


AcceptRule = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def speculative_accept_from_logits(draft_ids: torch.Tensor, draft_logits: torch.Tensor,
                                   target_logits: torch.Tensor, *, target_ids: torch.Tensor, temperature: float,
                                   top_p: float = 1.0, rng: torch.Generator | RowNoise | None = None,
                                   rule: AcceptRule = accept_drawn) -> tuple[torch.Tensor, torch.Tensor]:
    """`speculative_accept` from logits, with the draft in its own vocabulary: the same rule, the
    same random numbers (the uniforms of the accept tests, then the residual's race), the same
    outputs.

    draft_ids int64 [B, K] in the draft's vocabulary (V_d ids), sampled from draft_logits
    [B, K, V_d]; target_ids int64 [V_d]: the target id of each draft id (distinct);
    target_logits [B, K+1, V]. Returns num_accepted int64 [B] and tokens int64 [B, K+1] in target
    ids, as speculative_accept does.
    The random numbers are drawn here, the rest is `accept_drawn` (rule: it or a compiled copy of
    it, as the engine runs it), a function of tensors only.
    Temperature 0: a draft is accepted iff it is the target's argmax, and the argmax is emitted at
    the stop position (what the reference's one-hot distributions give); nothing is drawn.
    """
    B, K = _chain_shape(draft_ids, "draft_ids")
    if draft_logits.dim() != 3 or draft_logits.shape[:2] != (B, K):
        raise ValueError(f"draft_logits must be [B, K, V_draft] = [{B}, {K}, V_draft], "
                         f"got {tuple(draft_logits.shape)}")
    if tuple(target_ids.shape) != draft_logits.shape[2:]:
        raise ValueError(f"target_ids must be [V_draft] = [{draft_logits.shape[2]}], got {tuple(target_ids.shape)}")
    if target_logits.dim() != 3 or target_logits.shape[:2] != (B, K + 1):
        raise ValueError(f"target_logits must be [B, K+1, V] = [{B}, {K + 1}, V], got {tuple(target_logits.shape)}")
    check_sampling_args(temperature, top_p)

    if temperature == 0:
        greedy = target_logits.argmax(-1)
        num_accepted = (target_ids[draft_ids] == greedy[:, :K]).long().cumprod(-1).sum(-1)
        position = torch.arange(K + 1, device=draft_ids.device)
        return num_accepted, greedy.masked_fill(position > num_accepted[:, None], -1)
    device = draft_ids.device
    uniform = _noise(rng).uniform((B, K), device)
    race = _race((B, target_logits.shape[2]), _prob_dtype(target_logits.dtype), device, rng)
    return rule(draft_ids, draft_logits, target_logits, target_ids, uniform, race, temperature, top_p)
