"""The rollout engine's per-slot row state: what each row of a call holds between decode steps.

A row lives in a slot (dim 0 of every buffer here and of the KV caches); `row_of_slot` maps slots
to the call's rows, so that compaction can gather the running rows to the front (`RowState.compact`)
and later steps run on fewer slots. Beside the slot buffers: the status vector the decode loop reads
once per step (`StepStatus`, the steps write its fields in place) and the call's eos id.

Separate from engine.py because it is one idea, the state's layout and lifetime (allocate, release,
bytes held, compaction), while the engine decides when buffers grow and what the steps compute on
them. Captured CUDA graphs read these tensors by address: allocate() makes new ones (the engine drops
its graphs with the old ones), and everything else (compaction, prefill, steps) writes in place.
"""
from dataclasses import dataclass
from functools import partial

import torch

from titan_draft.models.draft import DraftArgs

# Counters at the head of the status vector: StepStatus's scalar fields.
STATUS_COUNTS = 5


@dataclass
class StepStatus:
    """The counters the decode loop reads once per step, by name: the fields of one device vector
    (its layout is the fields' order), as views of it (`split` of the tensor: prefill and the steps
    write them in place) or as its host copy (`read`: the loop's one host sync per step)."""
    running: int | torch.Tensor
    """Rows not finished."""
    verify_rows: int | torch.Tensor
    """Row verify steps of the call (a step counts once for every row running at its start)."""
    emitted: int | torch.Tensor
    """Tokens emitted by the call's verify steps."""
    longest: int | torch.Tensor
    """The longest row's length."""
    staged: int | torch.Tensor
    """K = 0 steps whose taps wait in the staged buffer for the draft's trunk (adaptive K)."""
    accepted_per_position: list[int] | torch.Tensor
    """[max_k]: row verify steps that accepted draft k."""
    drafted_per_position: list[int] | torch.Tensor
    """[max_k]: row verify steps that proposed draft k."""

    @classmethod
    def split(cls, status, max_k: int) -> "StepStatus":
        """The fields of status (a tensor of STATUS_COUNTS + 2 max_k entries, or a list of them)."""
        head, mid = STATUS_COUNTS, STATUS_COUNTS + max_k
        return cls(*status[:head], status[head:mid], status[mid:])

    @classmethod
    def read(cls, status: torch.Tensor, max_k: int) -> "StepStatus":
        return cls.split(status.tolist(), max_k)


class RowState:
    """The per-slot buffers of up to `rows` rows of `slots` cache slots (none until `allocate`), the
    status vector with its named views (`counts`) and the eos id; the last two live as long as the
    engine (captured steps read them), so allocate and release leave them."""

    def __init__(self, max_k: int, device: torch.device, dtype: torch.dtype, draft_args: DraftArgs | None):
        self.max_k, self.device, self.dtype, self.draft_args = max_k, device, dtype, draft_args
        self.status = torch.zeros(STATUS_COUNTS + 2 * max_k, dtype=torch.long, device=device)
        self.counts = StepStatus.split(self.status, max_k)
        self.eos = torch.zeros((), dtype=torch.long, device=device)
        self.release()

    def allocate(self, rows: int, slots: int) -> None:
        """New buffers of `rows` rows of `slots` slots, zeroed (masked slots must hold finite numbers)."""
        zeros = partial(torch.zeros, device=self.device)
        self.tokens = zeros(rows, slots, dtype=torch.long)  # a verify window writes K + 1 columns
        self.lengths = zeros(rows, dtype=torch.long)
        self.limit = zeros(rows, dtype=torch.long)  # prompt + max_new_tokens
        self.done = zeros(rows, dtype=torch.bool)
        self.row_of_slot = zeros(rows, dtype=torch.long)
        if self.draft_args is not None:
            args = self.draft_args
            self.hidden = zeros(rows, args.dim, dtype=self.dtype)
            # Taps of up to max_k + 1 K = 0 steps, put into the draft's trunk before the next draft.
            self.staged_taps = zeros(rows, self.max_k + 1, args.n_taps * args.dim, dtype=self.dtype)
        self.rows, self.slots = rows, slots

    def release(self) -> None:
        """Drop the slot buffers (the status vector and eos id stay)."""
        self.tokens = self.lengths = self.limit = self.done = self.row_of_slot = None
        self.hidden = self.staged_taps = None
        self.rows = self.slots = 0

    def read_status(self) -> StepStatus:
        """The status vector's host copy: the decode loop's one host sync per step."""
        return StepStatus.read(self.status, self.max_k)

    def slot_buffers(self, caches: list[torch.Tensor]) -> list[torch.Tensor]:
        """The KV caches and every buffer here indexed by slot (dim 0); none when released."""
        if not self.rows:
            return []
        buffers = [*caches, self.tokens, self.lengths, self.limit, self.done, self.row_of_slot]
        if self.draft_args is not None:
            buffers += [self.hidden, self.staged_taps]
        return buffers

    def cache_bytes(self, caches: list[torch.Tensor]) -> int:
        """Bytes held by the KV caches and the slot buffers (0 when released)."""
        return sum(buffer.nbytes for buffer in self.slot_buffers(caches))

    def compact(self, B: int, bucket: int, caches: list[torch.Tensor]) -> None:
        """Move the running rows of slots 0..B-1 (in order, then finished ones to fill the bucket) to
        slots 0..bucket-1 of every slot buffer and KV cache: one gather per buffer, in place, no host
        sync."""
        keep = torch.argsort(self.done[:B].to(torch.uint8), stable=True)[:bucket]
        for buffer in self.slot_buffers(caches):
            buffer[:bucket] = buffer[:B].index_select(0, keep)
