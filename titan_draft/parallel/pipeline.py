"""Pipeline-parallel co-training: the policy split into torchtitan pipeline stages, the draft on the last.

Microbatch layout: the schedule moves [B, S] token rows (and [B, S, dim] activations), one
document per row, padded at its end. Every stage runs its microbatch as B packed documents
(cu_seqlens = multiples of S, positions 0..S-1 per row), derived from the shape it receives, so
nothing else has to travel with the schedule. Under context parallelism (a RowLayout with a cp
mesh) every row is zigzag-sharded over the cp ranks: the schedule moves [B, S/cp] rows, stage
attention is the packed causal ring (cp_branch_attention), the draft shifts with HaloShift.

Each stage module (TapStage) returns only its usual activation to the schedule and hands its tap
features (stage 0: the token embeddings first, then its tap layers in ascending order) to the
TapChannel. The last stage's LM head computes what its loss reads, as the whole policy's does
(models/policy.head_outputs: log-probs and entropy of the trained rows and the draft's teacher, in
chunks of PipelineSetup.logprob_chunk_size rows), asked through the schedule's per-microbatch kwargs
(`head_target`: the loss's target). The last stage's loss (CoTrainLoss) computes the policy's loss
(pluggable: next-token cross-entropy on labels here, or a caller's loss on per-row side data such
as the RL job's GRPO loss in rl/pipelined_policy.py; either travels as the schedule's `target`,
split into microbatches like labels) and runs the draft's forward and backward on the
microbatch's taps right there (the draft's inputs are detached, so its backward needs nothing of
the schedule's); only the policy's loss goes back to the schedule.
torchtitan's PP path sums microbatch losses unscaled: both losses are divided by their global
counts over the whole step (all microbatches, all schedule steps, all data-parallel replicas),
computed before it (begin_step). A step may run as several schedule steps over groups of rows
(gradient accumulation: `run` once per group), all of the schedule's one microbatch count.
"""
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, ScheduleZBVZeroBubble, get_schedule_class

from titan_draft.infra import _compat
from titan_draft.infra.timing import DeviceTimer
from torchtitan.config import JobConfig
from torchtitan.distributed.pipeline_parallel import (
    build_pipeline_schedule,
    generate_llm_fqn_per_model_part,
    pipeline_module_split,
)
from torchtitan.models.attention import VarlenMetadata

from titan_draft.data.packing import DocumentShift
from titan_draft.models.cotrain import CoTrainSpec, DraftFeatures, draft_step, valid_pairs
from titan_draft.models.draft import EagleDraft, Teacher
from titan_draft.models.policy import HeadRequest, TapRecorder, head_outputs
from titan_draft.ops import branch_attention
from titan_draft.ops.linear_logprobs import TokenOutputs
from titan_draft.parallel.cp_attention import CpGroup, cp_branch_attention
from titan_draft.parallel.halo import HaloShift
from titan_draft.parallel.tap_channel import TapChannel
from titan_draft.parallel.zigzag import zigzag_rows

IGNORE = -100


@dataclass
class PipelineSetup:
    """Where a pipeline runs and the shape of its microbatches.

    pipelines: global ranks of every pipeline replica in pp order (the TapChannel's argument);
    dp_group: the data-parallel replicas' group (loss normalisers); cp_mesh: run every row
    zigzag-sharded over it (RowLayout; the parts must have CP attention: apply_context_parallel);
    dtype: of the activations between stages (default the parts' parameters'; FSDP's
    mixed-precision param dtype when it casts); logprob_chunk_size: rows per chunk of the last
    stage's LM head (0: full logits, the only way for a head split by tensor parallelism);
    channel_timeouts: TapChannel (put, get) seconds.
    """

    pp_mesh: object
    pipelines: list[list[int]]
    schedule: str
    n_microbatches: int  # per schedule step
    microbatch_size: int
    seq_len: int
    dp_group: dist.ProcessGroup | None = None
    cp_mesh: object = None
    cp_mode: str = "ring"
    dtype: torch.dtype | None = None
    logprob_chunk_size: int = 0
    channel_timeouts: tuple[float, float] = (120.0, 240.0)


def stage_pp_ranks(num_stages: int, pp: int, schedule: str) -> list[int]:
    """pp rank of every stage, as torchtitan's pipeline_module_split places them (loop or V style)."""
    if get_schedule_class(schedule) is ScheduleZBVZeroBubble:
        return [s if s < pp else 2 * pp - 1 - s for s in range(num_stages)]
    return [s % pp for s in range(num_stages)]


def row_documents(rows: int, seq_len: int, device) -> VarlenMetadata:
    cu = torch.arange(0, (rows + 1) * seq_len, seq_len, dtype=torch.int32, device=device)
    return VarlenMetadata(cu, cu, seq_len, seq_len)


class RowLayout:
    """Where the rows of one microbatch ([rows, seq_len] documents) sit on this rank.

    Without a cp mesh: whole rows. With one: every row zigzag-sharded over the cp ranks (chunks r
    and 2cp-1-r, titan_draft.parallel.zigzag), [rows, seq_len / cp] here; attention (the policy's,
    no branch, and the draft's) is the packed ring over the global documents, shifts a HaloShift.
    """

    def __init__(self, rows: int, seq_len: int, device, cp_mesh=None, cp_mode: str = "ring", max_shift: int = 1):
        self.rows, self.seq_len, self.cp_mesh, self.cp_mode = rows, seq_len, cp_mesh, cp_mode
        self.device, self.max_shift = device, max_shift
        self.cu_seqlens = row_documents(rows, seq_len, device).cu_seq_q  # global documents
        if cp_mesh is None:
            self.columns, self.local_len = None, seq_len
            self.shift = DocumentShift(self.cu_seqlens)
            positions = torch.arange(seq_len, device=device)
        else:
            cp = cp_mesh.size()
            if seq_len % (2 * cp):
                raise ValueError(f"seq_len: {seq_len} is not a multiple of 2 * cp = {2 * cp} (zigzag chunks)")
            bounds = torch.tensor([0, seq_len], dtype=torch.int32, device=device)
            self.columns = zigzag_rows(bounds, cp, cp_mesh.get_local_rank())
            self.local_len = seq_len // cp
            self.shift = HaloShift(self.cu_seqlens, cp_mesh, max_shift)
            positions = self.columns
        self.positions = positions.expand(rows, -1)  # [rows, local_len]: RoPE ids of the local columns
        # The stages' attention metadata: the global rows (CP attention, installed in the parts, reads them).
        self.documents = row_documents(rows, seq_len, device)

    def with_rows(self, rows: int) -> "RowLayout":
        """The same layout for microbatches of `rows` rows."""
        return RowLayout(rows, self.seq_len, self.device, self.cp_mesh, self.cp_mode, self.max_shift)

    def shard(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's columns of a [B, seq_len, ...] tensor."""
        return x if self.columns is None else x.index_select(1, self.columns.to(x.device))

    def attention(self, q, k, v, branch_k=None, branch_v=None, scale=None):
        """The draft's causal attention within the global documents + its branch: local rows in and out."""
        if self.cp_mesh is None:
            return branch_attention(q, k, v, branch_k, branch_v, cu_seqlens=self.cu_seqlens, scale=scale)
        return cp_branch_attention(q, k, v, branch_k, branch_v, cu_seqlens=self.cu_seqlens,
                                   cp=CpGroup(self.cp_mesh, self.cp_mode), scale=scale)

    def batch(self, trained: torch.Tensor) -> "RowBatch":
        """A microbatch's local rows, trained where `trained` [rows, local_len] is set, as the draft's loss
        reads a batch (cotrain.draft_loss: positions, loss_mask, shift, draft_attention)."""
        return RowBatch(self, trained.flatten())


@dataclass
class RowBatch:
    """RowLayout's rows of one microbatch with PackedBatch's surface for the draft's loss."""

    layout: RowLayout
    loss_mask: torch.Tensor

    @property
    def positions(self) -> torch.Tensor:
        return self.layout.positions.flatten()

    def shift(self, max_shift: int):
        return self.layout.shift

    def draft_attention(self, q, k, v, branch_k=None, branch_v=None, scale=None):
        return self.layout.attention(q, k, v, branch_k, branch_v, scale)


def target_counts(trained: torch.Tensor, ttt_steps: int, group: dist.ProcessGroup | None = None):
    """(trained tokens, valid draft (anchor, pass) pairs) of a [B, S] bool mask of whole rows, summed
    over `group`. Pass d at anchor i is trained on row i + d of the same document when that row is trained.
    """
    shift = DocumentShift(row_documents(*trained.shape, trained.device).cu_seq_q)
    counts = torch.stack([trained.sum().float(), valid_pairs(trained.flatten(), shift, ttt_steps)])
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(counts, group=group)
    return counts[0], counts[1]


class CrossEntropyLoss:
    """Policy loss on labels [B, S] (next token, IGNORE on untrained rows): summed cross-entropy / count.

    The surface of a pipeline's policy loss (pipelined_policy.GRPOLoss is another): which rows of the
    target are trained, their next tokens (what the LM head scores), which rows the draft trains on
    (None: every row), and the loss of the trained rows' TokenOutputs."""

    def trained(self, target: torch.Tensor) -> torch.Tensor:
        return target != IGNORE

    def next_tokens(self, target: torch.Tensor) -> torch.Tensor:
        return target

    def drafted(self, target: torch.Tensor) -> None:
        return None

    def __call__(self, outputs: TokenOutputs, target: torch.Tensor, count: torch.Tensor):
        """(loss, detached metric sums [loss])."""
        loss = -outputs.logprobs.sum() / count
        return loss, loss.detach()[None]


class TapStage(nn.Module):
    """One pipeline stage of the policy: its usual activation to the schedule, its taps to the channel.

    The last stage (head_request set) returns instead what its LM head computes for the loss
    (TokenOutputs.fields()): head_request(head_target) says what, head_target being the microbatch of
    the loss's target that the schedule hands every stage of the last stage's rank as a kwarg."""

    def __init__(self, part: nn.Module, stage_index: int, tap_layers: list[int], channel: TapChannel | None,
                 layout: RowLayout | None = None, head_request=None):
        super().__init__()
        self.part, self.stage_index, self.channel = part, stage_index, channel
        self.local_taps = [i for i in tap_layers if str(i) in part.layers]
        self.sends_embeddings = part.tok_embeddings is not None
        self.layout, self.head_request = layout, head_request

    def _run(self, x: torch.Tensor):
        if self.layout is None:  # positions default to 0..S-1 per row
            return self.part(x, attention_masks=row_documents(x.shape[0], x.shape[1], x.device))
        return self.part(x, attention_masks=self.layout.documents, positions=self.layout.positions)

    def _output(self, x: torch.Tensor, head_target: torch.Tensor | None):
        if self.head_request is None:
            return self._run(x)
        return head_outputs(lambda: self._run(x), self.part.output, self.head_request(head_target)).fields()

    def forward(self, x: torch.Tensor, head_target: torch.Tensor | None = None):
        if self.channel is None or not self.channel.in_step or not (self.local_taps or self.sends_embeddings):
            return self._output(x, head_target)
        with TapRecorder(self.part, self.local_taps) as recorder:
            out = self._output(x, head_target)
        features = ([recorder.embeddings()] if self.sends_embeddings else []) + \
                   [recorder.outputs[f"layer{i}"] for i in self.local_taps]
        self.channel.put(self.stage_index, torch.cat(features, dim=-1))
        return out


class CoTrainLoss:
    """The last stage's loss of one microbatch: the policy's loss, with the draft's TTT step beside it.

    Called by the schedule as loss_fn(head fields, target) once per microbatch, in microbatch order;
    takes that microbatch's features from every producer stage (ascending). `policy_loss`
    (CrossEntropyLoss, pipelined_policy.GRPOLoss) reads its target and says which rows are trained (they
    are the draft's trained rows too) and which rows the draft trains on. The draft's forward and
    backward (times grad_scale x spec.loss_weight) run here, inside `timer` (the draft's part of the step);
    only grad_scale x the policy's loss returns to the schedule. Without a draft (the plain-policy twin)
    it is the policy's loss alone. Per step it accumulates the policy loss's metric sums and the draft's
    per-pass statistics; grad_scale: data-parallel gradient averaging, see parallelize.py.
    train_draft=False (a frozen draft) evaluates the draft without its backward.
    """

    def __init__(self, draft: EagleDraft | None, channel: TapChannel | None, producer_stages: list[int],
                 spec: CoTrainSpec, layout: RowLayout, *, policy_loss=None, grad_scale: float = 1.0,
                 train_draft: bool = True, chunk_size: int = 0, timer: DeviceTimer | None = None):
        self.draft, self.channel, self.producers, self.spec = draft, channel, sorted(producer_stages), spec
        self.policy_loss = policy_loss or CrossEntropyLoss()
        self.layout, self.grad_scale, self.train_draft, self.chunk_size = layout, grad_scale, train_draft, chunk_size
        self.timer = timer or DeviceTimer(layout.device)
        self.layouts = {layout.rows: layout}  # by the number of rows the draft runs on
        self.policy_count = self.draft_count = None
        self.draft_scale = 1.0
        self.policy_sum = self.draft_sum = 0.0
        self.policy_stats = self.draft_stats = None

    def begin_step(self, policy_count: torch.Tensor, draft_count: torch.Tensor, draft_scale: float = 1.0) -> None:
        """The step's normalisers; draft_scale: the replica's rows / rows the draft trains on (cotrain.draft_loss)."""
        self.policy_count, self.draft_count = policy_count.clamp(min=1), draft_count.clamp(min=1)
        self.draft_scale = draft_scale
        self.policy_sum = self.draft_sum = 0.0
        self.policy_stats = self.draft_stats = 0.0

    def head_request(self, target: torch.Tensor) -> HeadRequest:
        """What the last stage's head computes for a microbatch: the trained rows' log-probs (their next
        tokens) and, with a draft, the teacher at the trained rows of the rows it trains on."""
        trained = self.policy_loss.trained(target)
        rows = trained.flatten().nonzero().flatten()
        request = HeadRequest(rows, self.policy_loss.next_tokens(target).flatten()[rows].long(), self.chunk_size)
        if self.draft is not None:
            drafted = self.policy_loss.drafted(target)
            in_draft = trained if drafted is None else trained & drafted[:, None]
            request.teacher_ids = self.draft.target_ids()
            request.teacher_rows = in_draft.flatten()[rows].nonzero().flatten()
        return request

    def __call__(self, fields: tuple[torch.Tensor, ...], target: torch.Tensor) -> torch.Tensor:
        outputs = TokenOutputs.from_fields(fields)
        policy, sums = self.policy_loss(outputs, target, self.policy_count)
        self.policy_sum += sums[0]
        self.policy_stats = self.policy_stats + sums
        if self.draft is not None:
            features = torch.cat([self.channel.get(s) for s in self.producers], dim=-1)
            with self.timer():
                self._draft_step(features, outputs, target)
        return self.grad_scale * policy

    def _draft_rows(self, target: torch.Tensor):
        """(the rows of the microbatch the draft runs on, their trained mask). A microbatch without any
        drawn row runs its first row with nothing trained: the draft's forward and backward still run
        (at zero loss), so it joins the collectives of its FSDP units, which every data-parallel rank
        runs once per microbatch."""
        trained = self.policy_loss.trained(target)
        drafted = self.policy_loss.drafted(target)
        if drafted is None:
            return torch.arange(len(trained), device=trained.device), trained
        index = drafted.nonzero().flatten()
        if len(index) == 0:
            return index.new_zeros(1), torch.zeros_like(trained[:1])
        return index, trained[index]

    def _draft_step(self, features: torch.Tensor, outputs: TokenOutputs, target: torch.Tensor) -> None:
        """cotrain.draft_step on this microbatch's drawn rows, normalised by the step's pairs (begin_step)."""
        index, trained = self._draft_rows(target)
        if len(index) not in self.layouts:
            self.layouts[len(index)] = self.layout.with_rows(len(index))
        dim = self.draft.args.dim
        features = features.view(*target.shape[:2], -1)[index].flatten(0, 1)
        rows = DraftFeatures(self.layouts[len(index)].batch(trained), features[:, :dim], features[:, dim:],
                             Teacher.at(trained.flatten(), outputs.teacher_logits, outputs.teacher_argmax))
        loss, per_pass = draft_step(self.draft, rows, self.spec, count=self.draft_count, scale=self.draft_scale,
                                    train=self.train_draft and torch.is_grad_enabled(), grad_scale=self.grad_scale)
        self.draft_sum += loss
        self.draft_stats = self.draft_stats + per_pass


@dataclass
class PipelineCoTrain:
    """What build_pipeline_cotrain returns; `step` runs one co-training step (fwd + bwd, no update)."""

    schedule: object
    stages: list[PipelineStage]
    parts: list[nn.Module]  # this rank's policy parts (torchtitan FQNs), for optimizers and checkpoints
    channel: TapChannel | None
    loss: CoTrainLoss  # used on the rank holding the last stage
    spec: CoTrainSpec
    stage_ranks: list[int]  # pp rank of every stage
    setup: PipelineSetup
    layout: RowLayout

    @property
    def has_first(self) -> bool:
        return any(s.is_first for s in self.stages)

    @property
    def has_last(self) -> bool:
        return any(s.is_last for s in self.stages)

    def _check_rows(self, tokens: torch.Tensor) -> None:
        rows, seq_len = tokens.shape
        n, size = self.setup.n_microbatches, self.setup.microbatch_size
        if rows != n * size or seq_len != self.layout.seq_len:
            raise ValueError(f"tokens: {tuple(tokens.shape)}, expected [n_microbatches x microbatch_size, seq_len] "
                             f"= [{n} x {size}, {self.layout.seq_len}]")

    def step(self, tokens: torch.Tensor, target: torch.Tensor):
        """tokens [B, S] and the policy loss's target ([B, S] labels, or [B, S, C]) of this data-parallel
        replica, whole rows (every rank passes them; under context parallelism each rank runs its
        zigzag columns). Returns, on the last stage (else None), this replica's (policy loss,
        unweighted draft loss): sums over its microbatches divided by the counts of all replicas,
        so replicas' values add up to the step's (context-parallel ranks' values, too)."""
        policy_loss = self.loss.policy_loss
        self.begin_step(policy_loss.trained(target), policy_loss.drafted(target))
        return self.run(tokens, self.layout.shard(target) if self.has_last else None)

    def begin_step(self, trained: torch.Tensor, drafted: torch.Tensor | None = None) -> None:
        """The step's loss normalisers from the trained rows [B, S] of this replica (whole rows, all of
        the step's; every rank) and the rows [B] the draft trains on (None: all)."""
        scale = 1.0 if drafted is None else len(drafted) / int(drafted.sum())
        self.loss.begin_step(*target_counts(trained, self.spec.ttt_steps, self.setup.dp_group), draft_scale=scale)

    def run(self, tokens: torch.Tensor, local_target: torch.Tensor | None):
        """One schedule step on whole-row tokens [B, S] and the last stage's target, already in this rank's
        columns (RowLayout.shard); after begin_step, once per group of the step's rows (gradients
        accumulate). Returns as step(), summed over the step's groups so far."""
        self._check_rows(tokens)
        if self.channel is not None:
            self.channel.begin_step(self.setup.n_microbatches, self.setup.microbatch_size * self.layout.local_len)
        args = (self.layout.shard(tokens),) if self.has_first else ()
        kwargs = dict(target=local_target, head_target=local_target) if self.has_last else {}
        self.schedule.step(*args, return_outputs=False, **kwargs)
        if self.channel is not None:
            self.channel.end_step()
        return (float(self.loss.policy_sum), float(self.loss.draft_sum)) if self.has_last else None

    @torch.no_grad()
    def forward_logprobs(self, tokens: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor | None:
        """Forward only (schedule.eval) of a pipeline built with loss=NextTokenLogprobs(): log p(next
        token) [B, S_local] of this rank's columns on the last stage, None elsewhere."""
        self._check_rows(tokens)
        args = (self.layout.shard(tokens),) if self.has_first else ()
        losses, kwargs = None, {}
        if self.has_last:
            target = self.layout.shard(next_tokens)
            losses, kwargs = [], dict(target=target, head_target=target)
        self.schedule.eval(*args, losses=losses, **kwargs)
        return torch.cat(losses) if self.has_last else None


def build_pipeline_cotrain(parts: list[nn.Module], draft: EagleDraft, spec: CoTrainSpec, setup: PipelineSetup, *,
                           policy_loss=None, grad_scale: float = 1.0, train_draft: bool = True,
                           draft_timer: DeviceTimer | None = None) -> PipelineCoTrain:
    """The co-training pipeline: this rank's stage `parts` (split_policy) with a TapChannel to the draft on
    the last stage. policy_loss: see CoTrainLoss (default: cross-entropy on labels); grad_scale:
    data-parallel gradient averaging (parallelize.loss_scale); train_draft=False evaluates a frozen draft;
    draft_timer: times the draft's forward and backward (CoTrainLoss)."""
    args = parts[0].model_args
    layers = list(spec.tap_layers)
    if layers != sorted(set(layers)) or not all(0 <= i < args.n_layers for i in layers):
        raise ValueError(f"spec.tap_layers: {layers} must be distinct, ascending and in 0..{args.n_layers - 1}")
    if draft.args.n_taps != len(layers) or draft.args.dim != args.dim:
        raise ValueError(f"draft: built for {draft.args.n_taps} taps of width {draft.args.dim}, the policy gives "
                         f"{len(layers)} of width {args.dim}; build it with draft_args_for(policy "
                         f"args, n_taps=len(spec.tap_layers))")
    return _build(parts, setup, spec, draft=draft, loss_options=dict(
        policy_loss=policy_loss, grad_scale=grad_scale, train_draft=train_draft, timer=draft_timer))


def build_policy_pipeline(parts: list[nn.Module], setup: PipelineSetup, *, policy_loss=None, grad_scale: float = 1.0,
                          loss=None) -> PipelineCoTrain:
    """The same pipeline without TapChannel or draft: the plain policy (the schedule's own communication
    is then exactly the co-training one's). policy_loss, grad_scale: as build_pipeline_cotrain; loss: a
    function replacing the policy loss, with CoTrainLoss's head_request (what the head computes), e.g.
    NextTokenLogprobs for a forward-only run (forward_logprobs)."""
    return _build(parts, setup, CoTrainSpec(tap_layers=[]), draft=None,
                  loss_options=dict(policy_loss=policy_loss, grad_scale=grad_scale), loss=loss)


def _build(parts: list[nn.Module], setup: PipelineSetup, spec: CoTrainSpec, *, draft=None, loss_options=None,
           loss=None) -> PipelineCoTrain:
    """Stages, TapChannel (with a draft) and torchtitan's schedule over this rank's parts; the schedule's
    loss is a CoTrainLoss (with loss_options), or `loss` when given."""
    args = parts[0].model_args
    pp_mesh, schedule, microbatch_size = setup.pp_mesh, setup.schedule, setup.microbatch_size
    num_stages = pipeline_num_stages(pp_mesh.size(), schedule)
    names = generate_llm_fqn_per_model_part(num_stages, args.n_layers)
    device = _compat.device()
    stage_ranks = stage_pp_ranks(num_stages, pp_mesh.size(), schedule)
    local_stages = [s for s in range(num_stages) if stage_ranks[s] == pp_mesh.get_local_rank()]
    dtype = setup.dtype or next(parts[0].parameters()).dtype
    layout = RowLayout(microbatch_size, setup.seq_len, device, setup.cp_mesh, setup.cp_mode, max_shift=spec.ttt_steps)
    taps = draft is not None

    widths = {}
    for s, stage_names in enumerate(names):
        count = ("tok_embeddings" in stage_names) + sum(f"layers.{i}" in stage_names for i in spec.tap_layers)
        if count:
            widths[s] = count * args.dim
    channel = TapChannel(setup.pipelines, stage_ranks, widths, microbatch_size * layout.local_len, dtype, device,
                         *setup.channel_timeouts) if taps else None

    # Every rank needs a loss function: torch pipelining runs backward only when it has one.
    cotrain_loss = CoTrainLoss(draft, channel, list(widths), spec, layout, chunk_size=setup.logprob_chunk_size,
                               **(loss_options or {}))
    schedule_loss = loss or cotrain_loss
    shape = (microbatch_size, layout.local_len)
    # The last stage's outputs, the head's TokenOutputs fields, go to the loss, never to another stage: torch
    # pipelining neither sends nor checks them, but wants one entry each (shapes: the most rows, every row).
    rows, stats = shape[0] * shape[1], torch.promote_types(dtype, torch.float32)
    head_fields = (torch.empty(rows, dtype=stats, device="meta", requires_grad=True),
                   torch.empty(rows, dtype=stats, device="meta"))
    if taps:  # the draft's teacher
        head_fields += (torch.empty(rows, len(draft.target_ids()), dtype=dtype, device="meta"),
                        torch.empty(rows, dtype=torch.long, device="meta"))
    stages = []
    for s, part in zip(local_stages, parts):
        last = s == num_stages - 1
        module = TapStage(part, s, spec.tap_layers, channel, layout,
                          head_request=schedule_loss.head_request if last else None)
        inputs = torch.empty(shape, dtype=torch.long, device="meta") if s == 0 else \
            torch.empty(*shape, args.dim, dtype=dtype, device="meta", requires_grad=True)
        outputs = head_fields if last else torch.empty(*shape, args.dim, dtype=dtype, device="meta",
                                                       requires_grad=True)
        # Given shapes, torch pipelining skips its inference forward, which would run the stage (and
        # the loss) once more than the schedule and desynchronise the channel.
        stages.append(PipelineStage(module, s, num_stages, device, input_args=inputs, output_args=outputs,
                                    group=pp_mesh.get_group()))

    job = JobConfig()
    job.parallelism.pipeline_parallel_schedule = schedule
    job.parallelism.pipeline_parallel_degree = pp_mesh.size()
    job.parallelism.pipeline_parallel_microbatch_size = microbatch_size
    job.training.local_batch_size = setup.n_microbatches * microbatch_size
    pp_schedule = build_pipeline_schedule(job, stages, schedule_loss)
    return PipelineCoTrain(pp_schedule, stages, parts, channel, cotrain_loss, spec, stage_ranks, setup, layout)


def pipeline_num_stages(pp: int, schedule: str) -> int:
    """Stages of a schedule on pp ranks: two per rank for the multi-stage (interleaved, V) schedules."""
    return pp * (2 if issubclass(get_schedule_class(schedule), PipelineScheduleMulti) else 1)


def last_stage_pp_rank(pp: int, schedule: str) -> int:
    """The pp rank holding the last stage (the draft's): pp - 1, or 0 for V-style schedules."""
    return stage_pp_ranks(pipeline_num_stages(pp, schedule), pp, schedule)[-1]


def split_policy(policy: nn.Module, pp_mesh, schedule: str) -> list[nn.Module]:
    """This rank's stage parts of an unsharded `policy` (torchtitan's pipeline_module_split: copies
    with the other stages' modules removed, FQNs unchanged), in stage order."""
    num_stages = pipeline_num_stages(pp_mesh.size(), schedule)
    names = generate_llm_fqn_per_model_part(num_stages, policy.model_args.n_layers)
    _, parts = pipeline_module_split(policy, pp_mesh, schedule, _compat.device(), names)
    return parts
