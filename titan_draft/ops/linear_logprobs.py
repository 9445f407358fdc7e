"""Per-token log-probabilities, entropy and the draft's teacher straight from hidden states and the LM
head, chunked over rows so that the full logits never exist.

Why: at the Qwen3-1.7B shape (hidden H = 2048, vocabulary V = 151,936) an RL step scores ~80K
response rows R. Their logits [R, V] are 24.3 GB in bf16 and 48.6 GB as the float32 copy the
log-softmax needs; autograd keeps the float32 log-softmax for the backward, which then makes a
float32 gradient of the same size. Chunked over N rows, a chunk's bf16 logits and its float32
temporaries take about N * V * 14 bytes in the forward (8.7 GB at N = 4096; 1.1 GB at N = 512),
the backward adds one float32 [V, H] buffer for the LM head's gradient (1.2 GB), and what the
forward keeps for the backward is hidden, weight, targets and the float32 logsumexp [R] (0.3 MB).

Math. logits = hidden @ weight.T; lse = logsumexp(logits); log p_t = logits[t] - lse;
entropy = lse - sum(softmax * logits). For an upstream gradient g on log p_t:
d log p_t / d logits = onehot(t) - softmax(logits), so grad_logits = g * (onehot(t) - exp(logits - lse)),
grad_hidden = grad_logits @ weight and grad_weight = grad_logits.T @ hidden. The backward recomputes
each chunk's logits from the saved inputs and lse (one more matmul per chunk, no R x V memory).

The entropy (a metric) and the teacher (the draft's target: the logits on the draft vocabulary and
the argmax over the full vocabulary) are detached: no gradient flows back through them.

linear_token_outputs(chunk_size=0) is the dense reference (full logits, plain autograd), the
behaviour the callers had before; chunk_size > 0 is the fast path, equal to it in float64.
"""
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F


@dataclass
class TokenOutputs:
    logprobs: torch.Tensor  # [R] log p(targets[r]); differentiable w.r.t. hidden and weight
    entropy: torch.Tensor  # [R] entropy of the row's distribution, detached
    teacher_logits: torch.Tensor | None  # [len(teacher_rows), len(teacher_ids)] logits[teacher_rows][:, teacher_ids]
    teacher_argmax: torch.Tensor | None  # [len(teacher_rows)] int64 argmax over the FULL vocabulary

    def fields(self) -> tuple[torch.Tensor, ...]:
        """The tensors, the teacher's only when there is one (a pipeline stage's output is tensors only)."""
        return tuple(t for t in (self.logprobs, self.entropy, self.teacher_logits, self.teacher_argmax)
                     if t is not None)

    @classmethod
    def from_fields(cls, fields: tuple[torch.Tensor, ...]) -> "TokenOutputs":
        """The inverse of fields()."""
        return cls(*fields, *[None] * (4 - len(fields)))


def linear_token_outputs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                         chunk_size: int = 0, teacher_ids: torch.Tensor | None = None,
                         teacher_rows: torch.Tensor | None = None, compiled: bool = False) -> TokenOutputs:
    """Log p(targets), entropy and (with teacher_ids) the teacher of logits = hidden @ weight.T.

    hidden [R, H], weight [V, H], targets [R] int64. teacher_ids [K] int64: vocabulary ids whose
    logits make the teacher (None: no teacher outputs); teacher_rows int64 indices into R whose
    teacher is wanted (None: every row). chunk_size 0: dense reference; N > 0: N rows at a time.
    Logits are computed in the inputs' dtype (under autocast: the autocast dtype, both inputs cast
    to it), statistics in float32 (float64 for float64 inputs). compiled (chunked path only): each
    chunk's statistics and its logits' gradient through torch.compile, one fused pass each over the
    chunk's logits instead of an eager kernel per step ([compile] components "loss").
    """
    hidden, weight = _autocast_inputs(hidden, weight)
    _validate(hidden, weight, targets, chunk_size, teacher_ids, teacher_rows)
    # Inputs are cast above; autocast must not re-cast the float32 statistics inside.
    with torch.autocast(hidden.device.type, enabled=False):
        if chunk_size == 0:
            return _dense_token_outputs(hidden, weight, targets, teacher_ids, teacher_rows)
        if teacher_ids is not None and teacher_rows is None:
            teacher_rows = torch.arange(hidden.shape[0], device=hidden.device)
        return TokenOutputs(*_ChunkedTokenOutputs.apply(hidden, weight, targets, chunk_size, teacher_ids,
                                                        teacher_rows, _CHUNK_MATH[compiled]))


def _autocast_inputs(hidden, weight):
    """Under autocast the LM head's matmul runs in the autocast dtype: cast both inputs to it here, so
    that the dense and the chunked path see the same low-precision logits."""
    device_type = hidden.device.type
    if not torch.is_autocast_enabled(device_type):
        return hidden, weight
    dtype = torch.get_autocast_dtype(device_type)
    return hidden.to(dtype), weight.to(dtype)


def _validate(hidden, weight, targets, chunk_size, teacher_ids, teacher_rows):
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden must be [R, H] and weight [V, H], got {tuple(hidden.shape)} and "
                         f"{tuple(weight.shape)}")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden and weight must share a dtype, got {hidden.dtype} and {weight.dtype}")
    if targets.shape != hidden.shape[:1] or targets.dtype != torch.int64:
        raise ValueError(f"targets must be int64 [R] = [{hidden.shape[0]}], got {targets.dtype} "
                         f"{tuple(targets.shape)}")
    if chunk_size < 0:
        raise ValueError(f"chunk_size must be >= 0, got {chunk_size}")
    if teacher_rows is not None and teacher_ids is None:
        raise ValueError("teacher_rows needs teacher_ids")
    for name, ids in (("teacher_ids", teacher_ids), ("teacher_rows", teacher_rows)):
        if ids is not None and (ids.dim() != 1 or ids.dtype != torch.int64):
            raise ValueError(f"{name} must be a 1-D int64 tensor, got {ids.dtype} {tuple(ids.shape)}")


def _statistics_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _dense_token_outputs(hidden, weight, targets, teacher_ids, teacher_rows) -> TokenOutputs:
    """The reference: full logits [R, V], float32 log-softmax, plain autograd. O(R * V) memory."""
    return logits_token_outputs(hidden @ weight.T, targets, teacher_ids=teacher_ids, teacher_rows=teacher_rows)


def logits_token_outputs(logits: torch.Tensor, targets: torch.Tensor, *, teacher_ids: torch.Tensor | None = None,
                         teacher_rows: torch.Tensor | None = None) -> TokenOutputs:
    """linear_token_outputs of logits [R, V] already computed (a head split by tensor parallelism, a
    pipeline's last stage): the same reduction, differentiable through the logits."""
    logp = F.log_softmax(logits.to(_statistics_dtype(logits.dtype)), dim=-1)
    logprobs = logp.gather(1, targets[:, None]).squeeze(1)
    with torch.no_grad():  # metrics and targets: no graph kept for them
        entropy = -(logp.exp() * logp).sum(-1)
        if teacher_ids is None:
            return TokenOutputs(logprobs, entropy, None, None)
        teacher = logits if teacher_rows is None else logits[teacher_rows]
        return TokenOutputs(logprobs, entropy, teacher[:, teacher_ids], teacher.argmax(-1))


def _chunk_statistics(logits: torch.Tensor, targets: torch.Tensor, dtype: torch.dtype):
    """(logsumexp, log p(targets), entropy) of one chunk's logits [N, V], in `dtype`."""
    scores = logits.to(dtype)
    lse = torch.logsumexp(scores, dim=-1)
    logprobs = scores.gather(1, targets[:, None]).squeeze(1) - lse
    probs = torch.exp(scores - lse[:, None])
    return lse, logprobs, lse - probs.mul_(scores).sum(-1)


def _chunk_grad_logits(logits: torch.Tensor, lse: torch.Tensor, targets: torch.Tensor, g: torch.Tensor):
    """d(sum g * log p(targets)) / d logits of one chunk = g * (onehot(target) - softmax), in logits' dtype;
    built in place in the float32 scores."""
    grad = logits.to(lse.dtype).sub_(lse[:, None]).exp_().mul_(-g)
    return grad.scatter_add_(1, targets[:, None], g).to(logits.dtype)


class _ChunkMath(NamedTuple):
    statistics: Callable
    grad_logits: Callable


# By `compiled`: eager, or through torch.compile (dynamic: the last chunk has fewer rows).
_CHUNK_MATH = {False: _ChunkMath(_chunk_statistics, _chunk_grad_logits),
               True: _ChunkMath(*(torch.compile(fn, dynamic=True) for fn in (_chunk_statistics, _chunk_grad_logits)))}


class _ChunkedTokenOutputs(torch.autograd.Function):
    """linear_token_outputs over chunks of chunk_size rows; see the module docstring for the math."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_size, teacher_ids, teacher_rows, math: _ChunkMath):
        rows = hidden.shape[0]
        dtype = _statistics_dtype(hidden.dtype)
        lse = hidden.new_empty(rows, dtype=dtype)
        logprobs = hidden.new_empty(rows, dtype=dtype)
        entropy = hidden.new_empty(rows, dtype=dtype)
        teacher_logits = teacher_argmax = teacher_slots = None
        if teacher_ids is not None:
            teacher_slots = _teacher_slots(teacher_rows, rows, chunk_size)
            teacher_logits = hidden.new_empty(len(teacher_rows), len(teacher_ids))
            teacher_argmax = torch.empty(len(teacher_rows), dtype=torch.int64, device=hidden.device)
        for index, start in enumerate(range(0, rows, chunk_size)):
            end = min(start + chunk_size, rows)
            logits = hidden[start:end] @ weight.T
            if teacher_ids is not None:
                slots, local_rows = teacher_slots[index]
                teacher_logits[slots] = logits[local_rows[:, None], teacher_ids]
                teacher_argmax[slots] = logits.argmax(-1)[local_rows]
            lse[start:end], logprobs[start:end], entropy[start:end] = math.statistics(logits, targets[start:end], dtype)
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.chunk_size, ctx.math = chunk_size, math
        ctx.mark_non_differentiable(*(t for t in (entropy, teacher_logits, teacher_argmax) if t is not None))
        ctx.set_materialize_grads(False)  # the detached outputs' gradients stay None
        return logprobs, entropy, teacher_logits, teacher_argmax

    @staticmethod
    def backward(ctx, grad_logprobs, *_detached):
        hidden, weight, targets, lse = ctx.saved_tensors
        want_hidden, want_weight = ctx.needs_input_grad[:2]
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        # One [V, H] accumulator in the statistics dtype: chunk sums of bf16 products stay accurate.
        grad_weight = torch.zeros_like(weight, dtype=lse.dtype) if want_weight else None
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            end = min(start + ctx.chunk_size, hidden.shape[0])
            chunk_hidden, g = hidden[start:end], grad_logprobs[start:end, None].to(lse.dtype)
            grad_logits = ctx.math.grad_logits(chunk_hidden @ weight.T, lse[start:end], targets[start:end], g)
            if want_hidden:
                grad_hidden[start:end] = grad_logits @ weight
            if want_weight:
                grad_weight += grad_logits.T @ chunk_hidden
        if want_weight:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


def _teacher_slots(teacher_rows, rows, chunk_size):
    """Per chunk: (slots of teacher outputs, their rows relative to the chunk start). One sort and one
    host sync for all chunks; duplicate and unsorted teacher_rows are fine."""
    order = torch.argsort(teacher_rows, stable=True)
    sorted_rows = teacher_rows[order]
    edges = list(range(0, rows, chunk_size)) + [rows]
    bounds = torch.searchsorted(sorted_rows, torch.tensor(edges, device=teacher_rows.device)).tolist()
    if bounds[0] != 0 or bounds[-1] != len(teacher_rows):
        raise ValueError(f"teacher_rows must lie in [0, R = {rows})")
    return [(order[low:high], sorted_rows[low:high] - start)
            for start, low, high in zip(edges, bounds, bounds[1:])]
