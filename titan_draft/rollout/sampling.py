"""Sampling distributions and the lossless speculative acceptance rule (DESIGN.md section 4).

Both the target's and the draft's distributions go through `probs_from_logits` with the same
temperature and top-p, so the acceptance rule compares like with like; at temperature 0 both are
one-hot and the rule reduces to exact greedy decoding.
"""
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


def probs_from_logits(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """float32 probabilities over the last dim; temperature 0 = one-hot at the argmax.

    top_p keeps the smallest set of most likely tokens whose mass reaches top_p (always at least
    the most likely one) and renormalises.
    """
    check_sampling_args(temperature, top_p)
    if temperature == 0:
        probs = torch.zeros_like(logits, dtype=torch.float32)
        return probs.scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
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
    dtype = torch.promote_types(probs.dtype, torch.float32)
    race = _noise(rng).exponential(tuple(probs.shape), dtype, probs.device)
    # exponential_ may round to 0: clamp so that 0 / 0 never yields a NaN that argmax would pick.
    return (probs.to(dtype) / race.clamp_min(torch.finfo(dtype).tiny)).argmax(-1)


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
    if draft_tokens.dim() != 2:
        raise ValueError(f"draft_tokens must be [B, K], got shape {tuple(draft_tokens.shape)}")
    B, K = draft_tokens.shape
    if K < 1:
        raise ValueError("draft_tokens: K = 0 draft tokens; speculative_accept needs K >= 1 "
                         "(sample target_probs directly when there is no draft)")
    if draft_probs.dim() != 3 or draft_probs.shape[:2] != (B, K):
        raise ValueError(f"draft_probs must be [B, K, V] = [{B}, {K}, V], got {tuple(draft_probs.shape)}")
    V = draft_probs.shape[2]
    if tuple(target_probs.shape) != (B, K + 1, V):
        raise ValueError(f"target_probs must be [B, K+1, V] = [{B}, {K + 1}, {V}], got {tuple(target_probs.shape)}")

    tokens = draft_tokens.long()
    p = target_probs[:, :K].gather(-1, tokens[..., None])[..., 0].float()
    q = draft_probs.gather(-1, tokens[..., None])[..., 0].float()
    u = _noise(rng).uniform((B, K), p.device)
    accepted = u * q < p  # u < p / q without dividing; q > 0 for any token the draft sampled
    num_accepted = accepted.long().cumprod(-1).sum(-1)

    # Where the chain stops, emit from norm(max(0, p - q)); past the last draft q is 0, so the
    # same formula gives the bonus distribution p_K.
    rows = torch.arange(B, device=tokens.device)
    p_stop = target_probs[rows, num_accepted].float()
    q_stop = torch.where((num_accepted < K)[:, None], draft_probs[rows, num_accepted.clamp(max=K - 1)], 0).float()
    residual = (p_stop - q_stop).clamp(min=0)
    mass = residual.sum(-1, keepdim=True)
    # p == q everywhere makes a rejection impossible in exact arithmetic; keep rounding harmless.
    residual = torch.where(mass > 0, residual, p_stop)
    last = sample(residual, rng)

    position = torch.arange(K + 1, device=tokens.device)
    out = torch.cat([tokens, tokens.new_full((B, 1), -1)], dim=1)
    out = torch.where(position < num_accepted[:, None], out, torch.full_like(out, -1))
    out[rows, num_accepted] = last
    return num_accepted, out
