"""Attention over packed documents with cuDNN's fused attention, documents batched by length.

cuDNN's causal attention is the fastest causal attention PyTorch runs on Hopper (1.65-1.7x its
FlashAttention-2 kernels on an H200, bench/branch_attention.py), but PyTorch reaches it only for
dense [B, H, L, D] batches (its packed-sequence entry point rebuilds a plan per call). So the
documents of a packed block are grouped by length and each group runs as one batch:

- causal: a document of n rows joins the batch of length bucket(n) >= n (at most 1/8 more rows),
  its rows padded at the END. Causality makes that exact: a real query never sees a padded key.
  In backward a padded query row gets lse = +inf, so its probabilities are 0 and it adds nothing
  to any real key's gradient.
- full (non-causal) blocks of the CP ring: batched by exact (query length, key length), no
  padding (a padded key would be seen).
Buckets keep the number of distinct batch shapes, and so of cuDNN plans (~40 ms to build one),
small across steps whose documents differ. A batch holds at most max_batch_rows query rows (one
document at least): cuDNN's backward keeps a float32 dQ accumulator of all the batch's rows, twice
the bytes of their q, so a batch of every document would hold it for the whole block where one
call per document holds one document's.

The backward is cuDNN's own, called with the FINAL out and lse of a larger attention (blocks and
branch merged), which is what makes per-block gradients exact (DESIGN.md section 3).
Layouts: q/out/dq [T, Hq, D]; k/v [T, Hkv, D] (GQA native); lse [Hq, T] float32.
"""
from dataclasses import dataclass
from typing import NamedTuple

import torch

_INF = float("inf")


def length_bucket(length: int) -> int:
    """The padded length of a causal document: `length` rounded up to a multiple of
    2 ** (bit_length - 4), i.e. at most 1/8 more rows and 8 buckets per doubling."""
    step = 1 << max(length.bit_length() - 4, 0)
    return -(-length // step) * step


class Group(NamedTuple):
    """`docs` documents run as one [docs, H, len_q|len_k, D] batch, causal or full.

    start: the batch is rows start .. start + docs * len of q/k (a view, nothing copied), or
    None: it is gathered through q_rows / k_rows ([docs * len], clamped into range). keep_*: the
    flattened batch positions of real rows, dest_*: their rows in q/k (None: all, in order).
    pad_q: [docs, len_q] True at padded query rows (None: no padding)."""

    docs: int
    causal: bool
    len_q: int
    len_k: int
    start: int | None
    q_rows: torch.Tensor | None
    k_rows: torch.Tensor | None
    keep_q: torch.Tensor | None
    dest_q: torch.Tensor | None
    keep_k: torch.Tensor | None
    dest_k: torch.Tensor | None
    pad_q: torch.Tensor | None


@dataclass(frozen=True)
class Layout:
    """A block's documents on cuDNN: `groups` (split_documents), and whether the caller writes the
    rows in no group itself, (query rows, key rows): then those results start unfilled."""

    groups: list[Group]
    rest_written: tuple[bool, bool] = (False, False)


def to_device(x: torch.Tensor, device) -> torch.Tensor:
    """A host-built index tensor on `device` without stalling the host (pinned, asynchronous)."""
    if torch.device(device).type != "cuda":
        return x
    return x.pin_memory().to(device, non_blocking=True)


def _group(spans, len_q, len_k, causal, tokens, device) -> Group:
    """spans: (q0, q1, k0, k1) of each document of the group; tokens: (rows of q, rows of k)."""
    docs = len(spans)
    exact = all(q1 - q0 == len_q and k1 - k0 == len_k for q0, q1, k0, k1 in spans)
    q_starts = [q0 for q0, _, _, _ in spans]
    consecutive = all(b - a == len_q for a, b in zip(q_starts, q_starts[1:]))
    if exact and consecutive and (causal or all(q0 == k0 for q0, _, k0, _ in spans)) and len_q == len_k:
        return Group(docs, causal, len_q, len_k, q_starts[0], *(None,) * 7)

    def side(starts, lengths, length, available):
        """(gather rows [docs * length], which of them are real [docs, length]) on the host."""
        index = torch.tensor(starts)[:, None] + torch.arange(length)
        is_real = torch.arange(length) < torch.tensor(lengths)[:, None]
        return index.flatten().clamp_(max=available - 1), is_real  # padded rows past the end

    def on_device(rows, is_real):
        """(rows, keep, dest) on the device: keep = real positions in the batch, dest = their rows."""
        keep = is_real.flatten().nonzero().squeeze(1)
        return tuple(to_device(x, device) for x in (rows, keep, rows[keep]))

    q_rows, q_real = side(q_starts, [q1 - q0 for q0, q1, _, _ in spans], len_q, tokens[0])
    q_side = on_device(q_rows, q_real)
    k_side = q_side  # causal: keys are the query rows
    if not causal:
        k_side = on_device(*side([k0 for _, _, k0, _ in spans], [k1 - k0 for _, _, k0, k1 in spans],
                                 len_k, tokens[1]))
    pad_q = None if exact else to_device(~q_real, device)
    (q_rows, keep_q, dest_q), (k_rows, keep_k, dest_k) = q_side, k_side
    return Group(docs, causal, len_q, len_k, None, q_rows, k_rows, keep_q, dest_q, keep_k, dest_k, pad_q)


def split_documents(bounds_q: list[int], bounds_k: list[int], *, causal: bool, min_length: int,
                    max_batch_rows: int, tokens: tuple[int, int], device
                    ) -> tuple[list[Group], list[tuple[int, int, int, int]]]:
    """Group the documents with at least min_length query rows and keys by batch shape, each group
    at most max_batch_rows query rows or one document; return (groups, the other
    documents' (q0, q1, k0, k1) with both rows and keys), the latter for another kernel.
    tokens: (rows of q, rows of k)."""
    by_shape, rest = {}, []
    for q0, q1, k0, k1 in zip(bounds_q, bounds_q[1:], bounds_k, bounds_k[1:]):
        if q1 == q0 or k1 == k0:
            continue
        if q1 - q0 < min_length or k1 - k0 < min_length:
            rest.append((q0, q1, k0, k1))
            continue
        shape = (length_bucket(q1 - q0),) * 2 if causal else (q1 - q0, k1 - k0)
        by_shape.setdefault(shape, []).append((q0, q1, k0, k1))
    groups = []
    for (len_q, len_k), spans in by_shape.items():
        per_batch = max(1, max_batch_rows // len_q)
        groups += [_group(spans[i:i + per_batch], len_q, len_k, causal, tokens, device)
                   for i in range(0, len(spans), per_batch)]
    return groups, rest


def _batch(x, group: Group, rows, length):
    """[T, H, D] rows of a group as a [docs, H, length, D] view (physically [docs, length, H, D],
    the layout cuDNN reads as it is)."""
    if group.start is None:
        flat = x.index_select(0, rows)
    else:
        flat = x[group.start:group.start + group.docs * length]
    return flat.view(group.docs, length, *x.shape[1:]).transpose(1, 2)


def _scatter(target, group: Group, batch, keep, dest, length, dim=0):
    """Write a group's [docs, length, ...]-flattened result rows back into target rows."""
    flat = batch.reshape(group.docs * length, *batch.shape[2:]) if dim == 0 else batch
    if group.start is None:
        target.index_copy_(dim, dest, flat.index_select(dim, keep))
    elif dim == 0:
        target[group.start:group.start + group.docs * length] = flat
    else:
        target[:, group.start:group.start + group.docs * length] = flat


def batch_forward(q, k, v, *, causal: bool, scale: float):
    """cuDNN on one dense batch: q [B, Hq, L, D], k/v [B, Hkv, L, D] -> (out, lse [B, Hq, L, 1])."""
    result = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, causal, False, scale=scale)
    return result[0], result[1]


def batch_backward(dout, q, k, v, out, lse, *, causal: bool, scale: float):
    """cuDNN's backward of one dense batch for the GIVEN out/lse -> (dq, dk, dv). attn_bias,
    dropout state and packed offsets are passed as None (undefined), as autograd does."""
    return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        dout, q, k, v, out, lse, None, None, None, None, None, q.shape[2], k.shape[2], 0.0, causal,
        scale=scale)


def _covers(group: Group, tokens: int) -> bool:
    return group.start == 0 and group.docs * group.len_q == tokens


def uninitialized(shape, *, dtype, device) -> torch.Tensor:
    """torch.empty, for a result whose every element some kernel writes (the tests make it NaN, so
    that an element left unwritten shows)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _start(shape, *, dtype, device, fill: float, rest_written: bool) -> torch.Tensor:
    """A result to scatter groups into: `fill` in rows no group writes, or nothing filled where
    the caller writes those rows itself."""
    if rest_written:
        return uninitialized(shape, dtype=dtype, device=device)
    return torch.full(shape, fill, dtype=dtype, device=device)


def forward(q, k, v, layout: Layout, *, scale: float, lse_dtype):
    """(out [T, Hq, D], lse [Hq, T]) of the layout's documents; rows in no group get out = 0 and
    lse = -inf, unless the layout says the caller writes them (then nothing is filled)."""
    tokens, heads = q.shape[:2]
    groups, rest_written = layout.groups, layout.rest_written[0]
    out = lse = None
    if not (len(groups) == 1 and _covers(groups[0], tokens)):
        out = _start(q.shape, dtype=q.dtype, device=q.device, fill=0.0, rest_written=rest_written)
        lse = _start((heads, tokens), dtype=lse_dtype, device=q.device, fill=-_INF,
                     rest_written=rest_written)
    for group in groups:
        group_out, group_lse = batch_forward(  # [docs, Hq, Lq, D], [docs, Hq, Lq, 1]
            _batch(q, group, group.q_rows, group.len_q), _batch(k, group, group.k_rows, group.len_k),
            _batch(v, group, group.k_rows, group.len_k), causal=group.causal, scale=scale)
        lse_rows = group_lse.squeeze(-1).transpose(0, 1).reshape(heads, -1).to(lse_dtype)
        if out is None:  # one batch of all rows: its results are the answer, nothing to copy
            return group_out.transpose(1, 2).reshape(q.shape), lse_rows
        _scatter(out, group, group_out.transpose(1, 2), group.keep_q, group.dest_q, group.len_q)
        _scatter(lse, group, lse_rows, group.keep_q, group.dest_q, group.len_q, dim=1)
    return out, lse


def backward(dout, q, k, v, out, lse, layout: Layout, *, scale: float):
    """(dq, dk, dv) of the layout's documents given the FINAL out/lse (zero in rows in no group,
    unless the layout says the caller writes them: dq's rows, dk/dv's rows). lse [Hq, T] must
    already use +inf for rows that saw no key (cuDNN then gives them p = 0)."""
    groups, (q_written, k_written) = layout.groups, layout.rest_written
    whole = len(groups) == 1 and _covers(groups[0], q.shape[0]) and q.shape[0] == k.shape[0]
    if not whole:
        dq, dk, dv = (_start(x.shape, dtype=x.dtype, device=x.device, fill=0.0, rest_written=written)
                      for x, written in ((q, q_written), (k, k_written), (v, k_written)))
    for group in groups:
        if group.start is None:
            group_lse = lse.index_select(1, group.q_rows)
        else:
            group_lse = lse[:, group.start:group.start + group.docs * group.len_q]
        group_lse = group_lse.reshape(lse.shape[0], group.docs, group.len_q).transpose(0, 1)
        if group.pad_q is not None:
            group_lse = group_lse.masked_fill(group.pad_q[:, None, :], _INF)
        grads = batch_backward(
            _batch(dout, group, group.q_rows, group.len_q), _batch(q, group, group.q_rows, group.len_q),
            _batch(k, group, group.k_rows, group.len_k), _batch(v, group, group.k_rows, group.len_k),
            _batch(out, group, group.q_rows, group.len_q), group_lse.unsqueeze(-1).contiguous(),
            causal=group.causal, scale=scale)
        if whole:
            return tuple(grad.transpose(1, 2).reshape(x.shape) for grad, x in zip(grads, (q, k, v)))
        for target, grad, keep, dest, length in (
                (dq, grads[0], group.keep_q, group.dest_q, group.len_q),
                (dk, grads[1], group.keep_k, group.dest_k, group.len_k),
                (dv, grads[2], group.keep_k, group.dest_k, group.len_k)):
            _scatter(target, group, grad.transpose(1, 2), keep, dest, length)
    return dq, dk, dv
