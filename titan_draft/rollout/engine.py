"""Speculative rollout engine: EAGLE-3 drafting and lossless verification with KV caches.

gpt-fast style, plain PyTorch. This file is the decode loop: `RolloutEngine.generate`, prefill,
the decode step. Its parts, one idea per file of titan_draft/rollout/:
- cached_model.py: the inference copies of the policy (a torchtitan llama3 / qwen3 model) and of
  the draft with their KV caches; cached forwards and decode attention (`CachedModels`);
- row_state.py: the rows' per-slot buffers (tokens, lengths, the draft's hidden state and staged
  taps, ...), the status vector the loop reads (`StepStatus`) and compaction (`RowState`);
- graphs.py: CUDA-graph capture and replay of the engine's calls, per key (`StepGraphs`), and the
  decode step's key (`StepShape`);
- goodput.py: adaptive K (`GoodputController`) and step timing;
- measure.py: adaptive K's up-front measurement of a new batch size (`measure_steps`);
- weights.py: refreshing the inference copies from the trained modules (`load_weights`);
- sampling.py: sampling and the acceptance rule from logits (what the steps run), beside their
  dense reference on probabilities over the vocabulary.

Bookkeeping, per row b of the batch (prompt length p_b; cache slot = RoPE position = token column):
- `lengths[b]` tokens are known; the last one, at position n = lengths[b] - 1, is not yet in the
  policy's cache. A decode step verifies [x_n, t_1..t_K] at positions n..n+K in one forward and
  emits 1..K+1 tokens. Rolling back rejected drafts is only a matter of `lengths`: a query at
  position q attends slots <= q, so slots past a row's length are never attended before the next
  step overwrites them. Prompts of different lengths use the same rule: they are right-padded to
  the longest, prefill runs all columns, row b samples its first token from column p_b - 1, and
  its padding slots lie past its length. Rows stop at their own eos or at p_b + max_new_tokens.
- The draft's cache holds its pass-1 ("trunk") keys of anchors i whose next token x_{i+1} is known:
  input concat(e(x_{i+1}), fc(taps_i)), RoPE position i (titan_draft/models/draft.py conventions).
  Proposing after position n uses anchor a = n - 1: pass 1 is the trunk entry of a itself; pass k
  feeds e(t_{k-1}) and pass k-1's hidden at RoPE position a + k - 1, puts its branch key in slot
  a + k - 1, and attends slots <= a + k - 1: the trunk (anchors <= a) plus passes 2..k's branch keys.
  Trunk slots past anchor lengths[b] - 2 (padding, rejected drafts, branch keys) are garbage under
  the same rule: the trunk extension after each verify step overwrites them.
- Prefill runs the whole prompt and samples the first response token; it is not a verify step.

Memory: the KV caches (policy and draft) and every other state buffer indexed by row (tokens,
lengths, the draft's hidden state and staged taps, ...) hold what calls need, not the engine's
bounds (max_batch_size rows of max_seq_len + max_k + 1 slots). `generate` makes them hold its rows
and longest prompt + max_new_tokens + max_k + 1 slots (rounded up to SLOT_ROUNDING): a call that
fits in the current buffers reuses them and their captured steps; one that does not gets new
ones, of the larger of each dimension seen, and captures its steps again. `release_caches()`
gives the buffers and the captured steps back (the weights stay), e.g. while the policy trains;
`cache_bytes` is what they hold.

Finished rows stop costing compute: row state lives in slots. When the running rows fit a smaller
bucket (power of two), they are gathered to the front of every slot buffer (caches, tokens,
lengths, ...: `RowState.compact`), the finished rows' outputs having been saved first, and later
steps run on the bucket; `RowState.row_of_slot` maps slots to rows. Random numbers are drawn at the
call's full batch shape and indexed by that map (`RowNoise`), so a row samples the same tokens with
or without compaction (the draws keep their full-batch cost; the model work shrinks).

Adaptive K (`generate(adaptive=True)`): before each step `GoodputController` picks the number of
drafts 0..K with the most expected tokens per second at the current bucket, from online acceptance
rates per draft position and measured step times per (bucket, K). A K = 0 step runs no draft: it
stages its taps, and the draft's trunk takes the staged anchors in one pass-1 call before the next
drafting step (or when max_k + 1 are staged). Any K, at any step, is lossless. A call whose
expected saving does not beat what drafting adds outside the steps, the draft's prefill over its
prompts and its pending weight copy (`GoodputController.would_draft`), runs as plain decoding: no
draft prefill, no staged taps, no draft weight copy (load_weights leaves it for the next call that
drafts), so speculation that does not pay costs a call nothing. Calls are also judged by their own
times (seconds over their work at the plain step costs, drafting calls and plain ones apart): once
both kinds are timed, the cheaper decides and the other is retried every few calls.

Speed: one decode step (draft K tokens, verify, accept, roll back, extend the draft's trunk) is a
single function of static-shape tensors that live in engine buffers, with no host
synchronisation inside. On CUDA it is captured once per `StepShape` (bucket, K, temperature,
top-p, ...; the cache width is all slots there: `step_width`) into a CUDA graph and replayed
(graphs.py); elsewhere it runs eagerly.
Both run the same code. The loop reads one small status vector per step (`StepStatus`: running
rows, the longest row, staged steps, counters). Attention reads only the live part of the caches:
each row's slots on CUDA (ops/decode_attention.py), the first `cache_width` slots elsewhere and in
prefill (cached_model.py); on CUDA the policy's blocks are compiled (`EngineOptions.compile`).
Sampling and acceptance start from the logits: float32 work over the target vocabulary is one
position per row (sampling.py). Adaptive K captures and times every step shape of a new batch
size once, before that call's prefill (`measure.measure_steps`), so rollouts neither explore nor
capture (docs/DESIGN.md 4.4).
"""
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial
from operator import attrgetter

import torch
from torch import nn

from titan_draft.infra.timing import DeviceTimer, timed
from titan_draft.models.draft import DraftArgs
from titan_draft.rollout.cached_model import (DECODE_KERNEL_MAX_QUERIES, CachedModels, cache_width,
                                              compile_for_decoding)
from titan_draft.rollout.goodput import GoodputController
from titan_draft.rollout.graphs import StepGraphs, StepShape
from titan_draft.rollout.measure import measure_call
from titan_draft.rollout.row_state import RowState
from titan_draft.rollout.sampling import (AcceptRule, RowNoise, accept_drawn, check_sampling_args, log_normalisers,
                                          sample_from_logits, speculative_accept_from_logits)
from titan_draft.rollout.weights import copy_weights, weights_need_collective

# The state buffers' cache slots are a multiple of this (RolloutEngine.reserve): calls of similar
# budgets share buffers and captured steps.
SLOT_ROUNDING = 128


@dataclass
class RolloutResult:
    tokens: torch.Tensor
    """[B, max(prompt_lengths) + max_new_tokens] int64: row b holds its prompt in columns
    0..p_b-1, its response right after, then eos_id."""
    prompt_lengths: torch.Tensor
    """[B] int64: p_b."""
    response_lengths: torch.Tensor
    """[B] int64: generated tokens per row (an emitted eos included)."""
    num_verify_forwards: int
    """Verify forwards counted per row (a batched step counts once for every row still running)."""
    emitted_tokens: int
    """Tokens emitted by verify steps (the first token, sampled at prefill, is not counted)."""
    acceptance_length: float
    """emitted_tokens / num_verify_forwards (1.0 without speculation)."""
    num_drafts: int
    """Row verify steps that proposed at least one draft token."""
    num_draft_tokens: int
    """Draft tokens proposed, summed over row verify steps."""
    num_accepted_tokens: int
    """Draft tokens accepted, summed over row verify steps."""
    accepted_per_position: torch.Tensor
    """[K] int64: row verify steps that accepted draft k (and so every draft before it)."""
    drafted_per_position: torch.Tensor
    """[K] int64: row verify steps that proposed draft k."""
    per_position_acceptance: torch.Tensor
    """[K] float: accepted_per_position / drafted_per_position (0 where nothing was drafted)."""
    steps_per_k: torch.Tensor
    """[K + 1] int64: decode steps that ran with k drafts (K = the call's maximum)."""
    num_decode_steps: int
    """Batched decode forwards (one per loop iteration)."""
    unreplayed_calls: int = 0
    """Prefill, flush and decode calls of this generate that did not replay a CUDA graph (ran
    eagerly before their shape's capture, or were captured): each costs more than a replay.
    0 without CUDA graphs."""
    timing: dict = field(default_factory=dict)
    """Seconds in measure_s (adaptive K's first call at a batch size: every step shape captured and
    timed), draft_weights_s (the draft's weight copy load_weights left for a drafting call; 0 where
    none ran), prefill_s (prompt forward, first token, draft trunk) and decode_s (the steps);
    capture_s: the part of the last two in calls that captured a CUDA graph (StepGraphs.capture_s)."""
    tokens_per_s: float = 0.0
    """Generated tokens (all rows) per second of wall time of generate()."""
    call_ratios: dict = field(default_factory=dict)
    """Adaptive K's call ratios after this call (GoodputController.call_ratio), by kind: "drafting",
    "plain"; a kind's entry only once a call of it was timed; empty without adaptive K."""


@dataclass(frozen=True)
class EngineOptions:
    """A RolloutEngine's draft capacity and speed switches (the defaults suit training rollouts).

    max_speculative_tokens: the most drafts a step may propose (sizes caches and buffers).
    compile: torch.compile the policy's block forward, the draft's forwards and the acceptance rule
    (`sampling.accept_drawn`) (on CUDA devices; ignored elsewhere). The first calls of each
    new step shape then take seconds to compile.
    few_row_linear: the policy's block projections of calls of at most 16 rows x positions (decode
    and verify steps at small batch) run a Triton kernel that streams each weight once
    (ops/skinny_linear.py) instead of cuBLAS (on CUDA devices; ignored elsewhere).
    cuda_graphs: replay prefill and decode steps as CUDA graphs (on CUDA devices; ignored elsewhere).
    compact: move the running rows to the front of the state when they fit a smaller bucket.
    min_bucket: the fewest slots a compacted batch runs in. Below ~16 rows a step costs about the
    same at any batch on the H200 (launch-bound), while every bucket adds step shapes to capture.
    """

    max_speculative_tokens: int = 8
    compile: bool = False
    few_row_linear: bool = True
    cuda_graphs: bool = True
    compact: bool = True
    min_bucket: int = 16


def compiled_accept_rule() -> AcceptRule:
    """The acceptance rule (`sampling.accept_drawn`) as a compiled engine runs it: its dozens of small
    ops fuse into a few kernels and its log-normalisers into one read of the logits per call. One graph
    per step shape (row bucket x K): with dynamic sizes inductor does not split a reduction over rows
    too few to fill the GPU, and a 16-row softmax over the target vocabulary then took 0.16 ms on the
    H200, 3x the eager kernel."""
    return compile_for_decoding(partial(accept_drawn, log_normalisers_fn=log_normalisers), dynamic=False)


def prompt_batch(prompts, eos_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompts right-padded with eos_id [B, max p_b] on `device`, p_b [B] on the host)."""
    if isinstance(prompts, torch.Tensor):
        if prompts.dim() != 2 or prompts.dtype != torch.int64:
            raise ValueError(f"prompts must be an int64 [B, P] tensor or a list of 1-D int64 tensors, "
                             f"got {prompts.dtype} {tuple(prompts.shape)}")
        return prompts.to(device), torch.full((len(prompts),), prompts.shape[1], dtype=torch.long)
    if not prompts:
        raise ValueError("prompts: an empty list; pass at least one prompt")
    bad = [i for i, p in enumerate(prompts) if p.dim() != 1 or p.dtype != torch.int64 or len(p) == 0]
    if bad:
        raise ValueError(f"prompts: row {bad[0]} is not a non-empty 1-D int64 tensor of token ids")
    padded = torch.nn.utils.rnn.pad_sequence(list(prompts), batch_first=True, padding_value=eos_id)
    return padded.to(device), torch.tensor([len(p) for p in prompts], dtype=torch.long)


class RolloutEngine:
    def __init__(self, policy_args, draft_args: DraftArgs | None, tap_layers, max_batch_size: int,
                 max_seq_len: int, device, dtype=torch.bfloat16, *, options: EngineOptions = EngineOptions()):
        """Inference copies of the policy (and draft) for calls of up to max_batch_size rows of up
        to max_seq_len tokens (prompt + response), with up to options.max_speculative_tokens
        drafts. The KV caches and other state buffers come with the first `generate`."""
        self.device, self.dtype = torch.device(device), dtype
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len
        self.max_k = options.max_speculative_tokens
        self.compact, self.min_bucket = options.compact, options.min_bucket
        # Verify windows of finished rows and the last step may run K + 1 slots past a row's budget.
        self.max_slots = max_seq_len + self.max_k + 1

        compile = self.compiled = options.compile and self.device.type == "cuda"
        self.model = CachedModels(policy_args, draft_args, tap_layers, self.max_slots, self.device, dtype,
                                  compile=compile, few_row_linear=options.few_row_linear)
        self._target_ids = None  # the draft's vocabulary as target ids (load_weights)
        self._draft_source = None  # the draft module load_weights was given, while not yet copied
        self.draft_refresh_s = 0.0  # seconds of the last draft weight copy (_refresh_draft)

        # The rows' per-slot buffers (none until reserve), the status vector the loop reads and eos.
        self.row_state = RowState(self.max_k, self.device, dtype,
                                  self.model.draft.args if self.model.draft is not None else None)
        # Every random draw of generate() comes from this generator, seeded from the caller's.
        self._rng = torch.Generator(self.device)
        self.graphs = StepGraphs(options.cuda_graphs and self.device.type == "cuda", self._rng)
        self.controller = GoodputController(self.max_k)
        self._measured: set[tuple] = set()  # (rows, K, temperature, top_p) of adaptive calls measured
        self.draft_prefill_s_per_token = 0.0  # the draft's trunk over prompts (measure.measure_call)
        # Decode steps and flushes (at most max_k + 1 queries per row) attend through the decode
        # kernel, which reads each row's live slots only (cached_model._attend): see step_width.
        self.steps_read_live_slots = (self.device.type == "cuda"
                                      and self.max_k + 1 <= DECODE_KERNEL_MAX_QUERIES)

        self._draft_extend, self._draft_pass = self.model.draft_extend, self.model.draft_pass
        self._accept_rule = accept_drawn
        if compile:
            self._draft_extend, self._draft_pass = map(compile_for_decoding, (self._draft_extend, self._draft_pass))
            self._accept_rule = compiled_accept_rule()

    # The cached models' modules and KV caches, by the names callers read.
    policy = property(attrgetter("model.policy"))
    k_cache, v_cache = property(attrgetter("model.k_cache")), property(attrgetter("model.v_cache"))
    draft_k, draft_v = property(attrgetter("model.draft_k")), property(attrgetter("model.draft_v"))

    @property
    def draft(self) -> nn.Module | None:
        """The engine's draft (None without draft_args), holding the weights of the last `load_weights`
        (reading it brings in a refresh that load_weights left for the next drafting call)."""
        self._refresh_draft()
        return self.model.draft

    @property
    def holds_draft_weights(self) -> bool:
        """Whether a load_weights has given the engine a draft (the first one is copied at once)."""
        return self._target_ids is not None

    @property
    def cuda_graphs(self) -> bool:
        """Whether prefill and decode steps replay as CUDA graphs (options.cuda_graphs, on CUDA)."""
        return self.graphs.enabled

    # --- state buffers -------------------------------------------------------------------------------
    def reserve(self, rows: int, slots: int) -> None:
        """State buffers that hold `rows` rows of `slots` cache slots: the current ones when they do.
        Else new ones, zeroed (masked slots must hold finite numbers: 0 x inf is nan), of the larger
        of each, the slots rounded up to SLOT_ROUNDING (within max_slots), so that calls of similar
        sizes, or alternating ones, settle on one set; the captured steps, which read the old
        buffers' addresses, go with them (release_caches).
        Kept across new buffers: the graphs' use counts (StepGraphs), `_measured` and the
        controller's costs. The costs, seconds per (bucket, K) step, stay valid: a step's work
        depends on its rows, K and the slots its attention reads, not on where the buffers live
        (on CUDA each row's live slots; elsewhere the smallest halving of the slots that holds the
        longest row: under twice its length for any slot count, but at the narrowest level); the
        running mean follows what differs."""
        if rows <= self.row_state.rows and slots <= self.row_state.slots:
            return
        rows = max(rows, self.row_state.rows)
        slots = min(max(-(-slots // SLOT_ROUNDING) * SLOT_ROUNDING, self.row_state.slots), self.max_slots)
        self.release_caches()
        self.model.allocate(rows, slots)
        self.row_state.allocate(rows, slots)

    def release_caches(self) -> None:
        """Give back the KV caches, every other state buffer and the captured steps with their
        private memory pool (to PyTorch's caching allocator: torch.cuda.empty_cache() hands it on
        to the driver), e.g. while the policy trains. The weights stay; the next `generate`
        allocates again and captures its steps again."""
        self.model.release()
        self.row_state.release()
        self.graphs.clear()

    @property
    def cache_bytes(self) -> int:
        """Bytes held by the state buffers now (KV caches, tokens, row state; 0 when released)."""
        return self.row_state.cache_bytes(self.model.caches())

    # --- weights -----------------------------------------------------------------------------------
    @torch.no_grad()
    def load_weights(self, policy: nn.Module, draft: nn.Module | None = None) -> None:
        """Refresh the inference copies from trained modules (plain, FSDP2/DTensor-sharded,
        activation-checkpointed or compiled).

        The draft's copy waits for the next call that drafts (or a read of `draft`): a call that
        adaptive K runs as plain decoding (GoodputController.would_draft) does not pay for it. It is
        made at once where it is a collective (a draft sharded over several ranks, whose calls
        need not all draft) and at the first load (the captured steps read its target ids). So
        `draft` must keep these weights until the next generate: the job trains it after."""
        copy_weights(policy, self.policy, "policy")
        if draft is None:
            return
        if self.model.draft is None:
            raise ValueError("load_weights: a draft was given but the engine was built without "
                             "draft_args; build it with the draft's args")
        self._draft_source = draft
        if self._target_ids is None or weights_need_collective(draft):
            self._refresh_draft()

    def _refresh_draft(self) -> None:
        """The pending draft weights of load_weights into the engine's draft; `draft_refresh_s` is the
        seconds the last one took (between device syncs), what would_draft weighs it at."""
        if self._draft_source is None:
            return
        source, self._draft_source = self._draft_source, None
        self.draft_refresh_s, _ = timed(lambda: copy_weights(source, self.model.draft, "draft"), self.device)
        if self._target_ids is None:
            self._target_ids = self.model.draft.target_ids()
        else:  # in place: captured steps read it
            self._target_ids.copy_(self.model.draft.target_ids())

    # --- the cached forwards, on buffers that hold their rows ----------------------------------------
    def policy_forward(self, tokens: torch.Tensor, positions: torch.Tensor, width: int | None = None):
        """CachedModels.policy_forward, the state buffers made to hold B rows and width slots first
        (reserve: new ones start from zero). width: the cache slots attention reads (default
        max_slots)."""
        width = width or self.max_slots
        self.reserve(tokens.shape[0], width)
        return self.model.policy_forward(tokens, positions, width)

    def draft_extend(self, next_emb: torch.Tensor, taps: torch.Tensor, start: torch.Tensor, count: torch.Tensor,
                     width: int | None = None):
        """CachedModels.draft_extend, the state buffers made to hold B rows and width slots first."""
        width = width or self.max_slots
        self.reserve(next_emb.shape[0], width)
        return self.model.draft_extend(next_emb, taps, start, count, width)

    def draft_pass(self, k: int, emb: torch.Tensor, hidden: torch.Tensor, anchor: torch.Tensor,
                   width: int | None = None):
        """CachedModels.draft_pass, the state buffers made to hold B rows and width slots first."""
        width = width or self.max_slots
        self.reserve(emb.shape[0], width)
        return self.model.draft_pass(k, emb, hidden, anchor, width)

    # --- generation ----------------------------------------------------------------------------------
    def _propose(self, hidden, anchor, K, temperature, top_p, noise, width):
        """K chained draft tokens [B, K] in the draft's vocabulary and the draft's logits for each
        [B, K, V_draft], from pass 1's hidden; random numbers from noise (a RowNoise)."""
        ids, logits = [], []
        for k in range(1, K + 1):
            if k > 1:
                emb = self.policy.tok_embeddings(self._target_ids[ids[-1]])
                hidden = self._draft_pass(k, emb, hidden, anchor, width)
            logits.append(self.model.draft.logits(hidden))
            ids.append(sample_from_logits(logits[-1], temperature, top_p, noise))
        return torch.stack(ids, 1), torch.stack(logits, 1)

    def _accept(self, draft_ids, draft_logits, logits, temperature, top_p, noise):
        """speculative_accept_from_logits with the engine's draft-to-target id map and acceptance rule."""
        return speculative_accept_from_logits(draft_ids, draft_logits, logits, target_ids=self._target_ids,
                                              temperature=temperature, top_p=top_p, rng=noise, rule=self._accept_rule)

    def _check(self, prompt_lengths, max_new_tokens, K, temperature, top_p):
        B = len(prompt_lengths)
        if not 1 <= B <= self.max_batch_size:
            raise ValueError(f"prompts: batch of {B} rows, but the engine holds 1..{self.max_batch_size} "
                             "(max_batch_size); split the batch or build a larger engine")
        P = int(prompt_lengths.max())
        if P < 1 or max_new_tokens < 1 or P + max_new_tokens > self.max_seq_len:
            raise ValueError(f"prompts: longest P = {P} + max_new_tokens = {max_new_tokens} must be within "
                             f"1..max_seq_len = {self.max_seq_len}; shorten them or build a larger engine")
        if K < 0 or K > self.max_k:
            raise ValueError(f"num_speculative_tokens: {K} must be in 0..{self.max_k} "
                             "(max_speculative_tokens; 0 = no speculation)")
        if K > 0 and self.model.draft is None:
            raise ValueError("num_speculative_tokens: speculation needs a draft, but the engine has none; "
                             "pass draft_args when building it, or use 0")
        if K > 0 and self._target_ids is None:
            raise ValueError("load_weights(policy, draft) must run before speculative generation")
        check_sampling_args(temperature, top_p)

    def _in_vocab(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens with ids outside the vocabulary (the -1 of unused window slots, an eos_id no model
        emits in padding) clamped into it: only garbage slots, overwritten before use, see them."""
        return tokens.clamp(0, self.policy.tok_embeddings.num_embeddings - 1)

    def _prefill(self, B: int, P: int, draft: bool, temperature: float, top_p: float, width: int) -> None:
        """The prompts (in the token buffer, lengths = their lengths) through the policy, the first
        response token, the row state, and the draft's trunk over the prompts; in place, no host sync.
        Columns past a row's prompt are padding: their cache slots lie past the row's length, so
        no query attends them before a verify step overwrites them (as after a rollback)."""
        state = self.row_state
        tokens, lengths, done = state.tokens[:B], state.lengths[:B], state.done[:B]
        rows = torch.arange(B, device=tokens.device)
        prompts = self._in_vocab(tokens[:, :P])
        logits, taps, _ = self.model.policy_forward(prompts, torch.arange(P, device=tokens.device).expand(B, P), width)
        first = sample_from_logits(logits[rows, lengths - 1], temperature, top_p, self._rng)
        tokens[rows, lengths] = first
        lengths += 1
        done.copy_((first == state.eos) | (lengths >= state.limit[:B]))
        state.status.zero_()  # nothing staged, nothing counted yet
        state.counts.running.copy_((~done).sum())
        state.counts.longest.copy_(lengths.max())
        if draft:  # anchors 0..p_b - 1 (x_{p_b} is the first token); later ones are padding
            next_emb = self.policy.tok_embeddings(self._in_vocab(tokens[:, 1:P + 1]))
            state.hidden[:B] = self._draft_extend(next_emb, taps, torch.zeros_like(lengths), lengths - 1, width)

    def decode_step(self, shape: StepShape) -> None:
        """One decode step of slots 0..shape.rows-1, in place on the engine's state buffers; no host sync.

        Draft K tokens (K = 0: none), verify [x_n, t_1..t_K] at positions n..n+K, accept, emit up
        to the first eos and within the row's budget (finished rows emit nothing), then put the
        trunk keys of the anchors whose next token became known into the draft's cache (K = 0 with
        stage: keep the taps for a later `flush_staged` instead).
        """
        B, K, temperature, top_p = shape.rows, shape.k, shape.temperature, shape.top_p
        state = self.row_state
        tokens, lengths, done, limit = state.tokens[:B], state.lengths[:B], state.done[:B], state.limit[:B]
        noise = RowNoise(self._rng, shape.full, state.row_of_slot[:B] if B < shape.full else None)
        dev = tokens.device
        rows = torch.arange(B, device=dev)
        window = torch.arange(K + 1, device=dev)
        n = lengths - 1  # position of the last known token, the first one verified
        verify_in = tokens[rows, n][:, None]
        if K:
            draft_ids, draft_logits = self._propose(state.hidden[:B], n - 1, K, temperature, top_p, noise, shape.width)
            verify_in = torch.cat([verify_in, self._target_ids[draft_ids]], dim=1)
        logits, taps, _ = self.model.policy_forward(verify_in, n[:, None] + window, shape.width)
        if K:
            num_accepted, out = self._accept(draft_ids, draft_logits, logits, temperature, top_p, noise)
        else:
            num_accepted, out = torch.zeros_like(lengths), sample_from_logits(logits, temperature, top_p, noise)
        emit = num_accepted + 1
        is_eos = (out == state.eos) & (window < emit[:, None])
        emit = torch.where(is_eos.any(1), is_eos.long().argmax(1) + 1, emit)
        emit = torch.minimum(emit, limit - lengths).masked_fill(done, 0)
        # Write the emitted tokens; the other window slots get their old values back.
        columns = lengths[:, None] + window
        tokens.scatter_(1, columns, torch.where(window < emit[:, None], out, tokens.gather(1, columns)))
        running = ~done
        counts = state.counts
        counts.verify_rows += running.sum()
        counts.emitted += emit.sum()
        if K:
            counts.accepted_per_position[:K] += ((num_accepted[:, None] > window[:K]) & running[:, None]).sum(0)
            counts.drafted_per_position[:K] += running.sum()
        done |= is_eos.any(1) | (lengths + emit >= limit)
        lengths += emit
        counts.running.copy_((~done).sum())
        counts.longest.copy_(lengths.max())
        if K:  # finished rows extend too (harmlessly, past their end): no data-dependent branch
            next_emb = self.policy.tok_embeddings(self._in_vocab(out))
            state.hidden[:B] = self._draft_extend(next_emb, taps, n, emit.clamp(min=1), shape.width)
        elif shape.stage:  # running rows emitted exactly one token: anchor n's taps
            state.staged_taps[:B].index_copy_(1, counts.staged[None], taps)
            counts.staged += 1

    def flush_staged(self, B: int, width: int) -> None:
        """Pass 1 of the draft at the anchors of the K = 0 steps since its last use (their taps were
        staged; each running row emitted one token per step), so that its trunk and hidden state
        are current again; in place, no host sync. Windows are max_k + 1 wide, the staged part real."""
        state = self.row_state
        tokens, lengths, staged = state.tokens[:B], state.lengths[:B], state.counts.staged
        start = (lengths - 1 - staged).clamp(min=0)  # first staged anchor of a running row
        columns = start[:, None] + 1 + torch.arange(state.staged_taps.shape[1], device=tokens.device)
        next_emb = self.policy.tok_embeddings(self._in_vocab(tokens.gather(1, columns)))
        state.hidden[:B] = self._draft_extend(next_emb, state.staged_taps[:B], start, staged.expand(B), width)
        staged.zero_()

    def step_width(self, longest: int) -> int:
        """The cache width of a decode step or flush while the longest row holds `longest` tokens.
        Every slot such a call writes or reads lies below longest + max_k (the verify window, the
        draft's branch and trunk slots). Where attention reads each row's live slots only (the
        decode kernel: `steps_read_live_slots`), the width only sets the kernel's chunk count, and
        every step takes all slots: one step shape per (bucket, K), all captured by measure_steps
        (a width per halving multiplied them by up to CACHE_WIDTH_LEVELS, and the widths a call
        grew into were captured in the middle of its rollouts). Elsewhere attention reads the first
        `width` slots: the narrowest level that holds the longest row's window."""
        if self.steps_read_live_slots:
            return self.row_state.slots
        return cache_width(self.row_state.slots, longest + self.max_k)

    def _bucket(self, running: int, B: int) -> int:
        """Slots to run `running` rows in: the smallest power of two that holds them (at least
        min_bucket, at most B), so that at most half the slots idle, and a call compacts (and
        captures graph sets) at most log2(B / min_bucket) times."""
        return min(B, max(self.min_bucket, 1 << (running - 1).bit_length())) if self.compact else B

    def buckets(self, B0: int) -> list[int]:
        """Every bucket a call of B0 rows may run in, ascending. `_bucket` rounds the running rows up
        to a power of two, so the powers of two up to B0, and B0, reach every bucket (in log2(B0)
        calls, not B0: this runs before every adaptive call)."""
        return sorted({self._bucket(running, B0) for running in (*(1 << i for i in range(B0.bit_length())), B0)})

    @torch.no_grad()
    def generate(self, prompts: torch.Tensor | list[torch.Tensor], max_new_tokens: int, *,
                 num_speculative_tokens: int, adaptive: bool = False, temperature: float = 1.0,
                 top_p: float = 1.0, eos_id: int, generator: torch.Generator | None = None) -> RolloutResult:
        """Sample up to max_new_tokens per row after each prompt; rows stop at eos_id.

        prompts: [B, P] int64, or a list of B 1-D int64 tensors of any lengths p_b >= 1.
        num_speculative_tokens K = 0 runs the same loop without a draft: the baseline. adaptive:
        K is the maximum, and `controller` picks 0..K before every step (goodput).
        generator (any device, or None for torch's default) seeds the engine's own generator.
        """
        K = num_speculative_tokens
        padded, prompt_lengths = prompt_batch(prompts, eos_id, self.device)
        self._check(prompt_lengths, max_new_tokens, K, temperature, top_p)
        adaptive = adaptive and K > 0
        timing = dict(measure_s=0.0, prefill_s=0.0, decode_s=0.0)
        wall = time.perf_counter()
        B, P = padded.shape
        total = P + max_new_tokens
        self.reserve(B, total + self.max_k + 1)
        seed_device = generator.device if generator is not None else "cpu"
        if adaptive and (B, K, temperature, top_p) not in self._measured:
            timing["measure_s"], self.draft_prefill_s_per_token = timed(
                lambda: measure_call(self, B, K, temperature, top_p, P), self.device)
            self._measured.add((B, K, temperature, top_p))
        drafts = K  # the call's most drafts per step: 0 runs plain decoding (no draft prefill, no taps kept)
        if adaptive:
            self.controller.new_call()
            # What drafting adds outside the steps: the draft's prefill and, if pending, its weight copy.
            draft_prefill_s = self.draft_prefill_s_per_token * B * P
            overhead_s = draft_prefill_s + (self.draft_refresh_s if self._draft_source is not None else 0.0)
            if not self.controller.would_draft(self.buckets(B), K, overhead_s=overhead_s):
                drafts = 0
        timing["draft_weights_s"] = 0.0
        if drafts and self._draft_source is not None:
            self._refresh_draft()
            timing["draft_weights_s"] = self.draft_refresh_s
        self.graphs.unreplayed, self.graphs.capture_s = 0, 0.0
        self._rng.manual_seed(int(torch.randint(2**62, (), generator=generator, device=seed_device)))

        timing["prefill_s"], _ = timed(lambda: self._start(padded, prompt_lengths, max_new_tokens, eos_id, drafts > 0,
                                                        temperature, top_p), self.device)
        unreplayed = self.graphs.unreplayed
        timing["decode_s"], (steps_per_k, out_tokens, out_lengths, status, plain_steps) = timed(
            lambda: self._decode(B, K, drafts, adaptive and drafts > 0, temperature, top_p, total), self.device)
        if adaptive:  # the call's seconds beyond the policy's prefill, which both kinds of call pay
            extra_s = draft_prefill_s + timing["draft_weights_s"] if drafts else 0.0
            # A decode loop with a step that was not a graph replay is no call's representative time.
            replayed = self.graphs.unreplayed == unreplayed
            self.controller.observe_call(plain_steps, drafted=drafts > 0 if replayed else None,
                                         seconds=timing["decode_s"] + extra_s)
        timing["capture_s"] = self.graphs.capture_s

        verify_rows, emitted = status.verify_rows, status.emitted
        accepted = torch.tensor(status.accepted_per_position[:K], dtype=torch.long)
        drafted = torch.tensor(status.drafted_per_position[:K], dtype=torch.long)
        response_lengths = out_lengths.cpu() - prompt_lengths
        result = RolloutResult(
            tokens=out_tokens.cpu(), prompt_lengths=prompt_lengths, response_lengths=response_lengths,
            num_verify_forwards=verify_rows, emitted_tokens=emitted, acceptance_length=emitted / max(verify_rows, 1),
            num_drafts=int(drafted[0]) if K else 0, num_draft_tokens=int(drafted.sum()),
            num_accepted_tokens=int(accepted.sum()), accepted_per_position=accepted,
            drafted_per_position=drafted,
            per_position_acceptance=(accepted.double() / drafted.clamp(min=1).double()).float(),
            steps_per_k=steps_per_k, num_decode_steps=int(steps_per_k.sum()),
            unreplayed_calls=self.graphs.unreplayed, timing=timing,
            call_ratios={"drafting" if drafting else "plain": ratio
                         for drafting, ratio in self.controller.call_ratio.items()} if adaptive else {},
        )
        result.tokens_per_s = float(response_lengths.sum()) / (time.perf_counter() - wall)
        return result

    def _start(self, padded, prompt_lengths, max_new_tokens: int, eos_id: int, draft: bool, temperature: float,
               top_p: float) -> None:
        """The call's rows into the state buffers (prompts right-padded with eos_id, their lengths
        and budgets), then prefill."""
        B, P = padded.shape
        state = self.row_state
        state.tokens[:B].fill_(eos_id)
        state.tokens[:B, :P] = padded
        state.lengths[:B] = prompt_lengths.to(self.device)
        state.limit[:B] = state.lengths[:B] + max_new_tokens
        state.row_of_slot[:B] = torch.arange(B, device=self.device)
        state.eos.fill_(eos_id)
        width = cache_width(state.slots, P)
        self.graphs.run(("prefill", B, P, draft, temperature, top_p, width),
                        partial(self._prefill, B, P, draft, temperature, top_p, width))

    def _decode(self, B0: int, K: int, drafts: int, adaptive: bool, temperature: float, top_p: float, total: int):
        """Decode steps with `drafts` drafts each (adaptive: 0..drafts, chosen per step) until every
        row has finished: (steps per draft length [K + 1], tokens [B0, total] and lengths [B0] of
        the rows, on the device, the last StepStatus, and per bucket the steps plain decoding needs
        there: GoodputController.observe_call)."""
        out_tokens = torch.empty(B0, total, dtype=torch.long, device=self.device)
        out_lengths = torch.empty(B0, dtype=torch.long, device=self.device)

        state = self.row_state

        def save(B):  # the rows of slots 0..B-1 into the result
            rows = state.row_of_slot[:B]
            out_tokens[rows] = state.tokens[:B, :total]
            out_lengths[rows] = state.lengths[:B]

        steps_per_k = torch.zeros(K + 1, dtype=torch.long)
        plain_steps: dict[int, float] = {}
        timer = DeviceTimer(self.device)
        B, status = B0, state.read_status()
        while status.running:
            bucket = self._bucket(status.running, B)
            if bucket < B:
                save(B)  # finished rows keep their output; their slots get reused
                state.compact(B, bucket, self.model.caches())
                B = bucket
            k = self.controller.choose(B, drafts) if adaptive else drafts
            width = self.step_width(status.longest)
            shape = StepShape(B0, B, k, temperature, top_p, stage=adaptive and not k, width=width)
            # Only adaptive K reads step times; a flush is timed with the step it precedes: part of
            # the cost of drafting again.
            with timer() if adaptive else nullcontext():
                first = False
                if status.staged and (k or status.staged == self.max_k + 1):
                    first = self.graphs.run(("flush", B, width), partial(self.flush_staged, B, width))
                first |= self.graphs.run(shape, partial(self.decode_step, shape))
            steps_per_k[k] += 1
            previous, status = status, state.read_status()  # the loop's one host sync
            plain_steps[B] = plain_steps.get(B, 0.0) + (status.emitted - previous.emitted) / previous.running
            if not adaptive:
                continue
            seconds = timer.pop_seconds()
            if not first:
                self.controller.observe_cost(B, k, seconds)
            if k:  # this step's counts per draft position
                self.controller.observe_acceptance(
                    [a - b for a, b in zip(status.accepted_per_position, previous.accepted_per_position)],
                    [a - b for a, b in zip(status.drafted_per_position, previous.drafted_per_position)])
        save(B)
        return steps_per_k, out_tokens, out_lengths, status, plain_steps
