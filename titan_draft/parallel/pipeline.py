"""Pipeline-parallel co-training: the policy split into torchtitan pipeline stages, the draft on the last.

Microbatch layout: the schedule moves [B, S] token rows (and [B, S, dim] activations), one
document per row, padded at its end; labels are -100 on untrained rows (prompt, padding, last
token). Every stage runs its microbatch as B packed documents (cu_seqlens = multiples of S,
positions 0..S-1 per row), derived from the shape it receives, so nothing else has to travel
with the schedule.

Each stage module (TapStage) returns only its usual activation to the schedule and hands its tap
features (stage 0: the token embeddings first, then its tap layers in ascending order) to the
TapChannel. The last stage's loss (CoTrainLoss) computes the policy's loss and the draft's TTT
loss on the microbatch's taps, so the draft's backward rides the schedule's backward; the draft
is a submodule of the last stage, so zero-bubble schedules' split weight pass reaches it too.
torchtitan's PP path sums microbatch losses unscaled: both losses are divided by their global
counts over the whole step (all microbatches, all data-parallel replicas), computed before it.
"""
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, ScheduleZBVZeroBubble, get_schedule_class

from titan_draft import _compat  # noqa: F401  (before torchtitan)
from torchtitan.config import JobConfig
from torchtitan.distributed.pipeline_parallel import (
    build_pipeline_schedule,
    generate_llm_fqn_per_model_part,
    pipeline_module_split,
)
from torchtitan.models.attention import VarlenMetadata

from titan_draft.models.draft import DocumentShift, EagleDraft, ttt_loss
from titan_draft.models.policy import TapRecorder
from titan_draft.ops import branch_attention
from titan_draft.packing import positions_from_cu_seqlens
from titan_draft.parallel.tap_channel import TapChannel

IGNORE = -100


@dataclass
class CoTrainSpec:
    tap_layers: list[int]
    ttt_steps: int = 3
    pass_decay: float = 0.8
    loss_weight: float = 1.0


def stage_pp_ranks(num_stages: int, pp: int, schedule: str) -> list[int]:
    """pp rank of every stage, as torchtitan's pipeline_module_split places them (loop or V style)."""
    if get_schedule_class(schedule) is ScheduleZBVZeroBubble:
        return [s if s < pp else 2 * pp - 1 - s for s in range(num_stages)]
    return [s % pp for s in range(num_stages)]


def row_documents(rows: int, seq_len: int, device) -> VarlenMetadata:
    cu = torch.arange(0, (rows + 1) * seq_len, seq_len, dtype=torch.int32, device=device)
    return VarlenMetadata(cu, cu, seq_len, seq_len)


def target_counts(labels: torch.Tensor, ttt_steps: int, group: dist.ProcessGroup | None = None):
    """(trained tokens, valid draft (anchor, pass) pairs) of a [B, S] label batch, summed over `group`.

    Pass d at anchor i is trained on row i + d of the same document when that row is trained.
    """
    trained = labels != IGNORE
    pairs = sum(trained[:, d:].sum() for d in range(1, ttt_steps + 1))
    counts = torch.stack([trained.sum(), pairs]).float()
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(counts, group=group)
    return counts[0], counts[1]


class TapStage(nn.Module):
    """One pipeline stage of the policy: its usual activation to the schedule, its taps to the channel."""

    def __init__(self, part: nn.Module, stage_index: int, tap_layers: list[int], channel: TapChannel | None,
                 draft: EagleDraft | None = None):
        super().__init__()
        self.part, self.stage_index, self.channel = part, stage_index, channel
        self.local_taps = [i for i in tap_layers if str(i) in part.layers]
        self.sends_embeddings = part.tok_embeddings is not None
        self.draft = draft  # the last stage only: a submodule so that the schedule's weight pass sees it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        documents = row_documents(x.shape[0], x.shape[1], x.device)  # positions default to 0..S-1 per row
        if self.channel is None or not self.channel.in_step or not (self.local_taps or self.sends_embeddings):
            return self.part(x, attention_masks=documents)
        with TapRecorder(self.part, self.local_taps) as recorder:
            out = self.part(x, attention_masks=documents)
        features = ([recorder.embeddings()] if self.sends_embeddings else []) + \
                   [recorder.outputs[f"layer{i}"] for i in self.local_taps]
        self.channel.put(self.stage_index, torch.cat(features, dim=-1))
        return out


class CoTrainLoss:
    """The last stage's loss of one microbatch: policy cross-entropy + weighted draft TTT loss.

    Called by the schedule as loss_fn(logits [B, S, V], labels [B, S]) once per microbatch, in
    microbatch order; takes that microbatch's features from every producer stage (ascending).
    Without a draft (the plain-policy twin) it is the policy's loss alone.
    """

    def __init__(self, draft: EagleDraft | None, channel: TapChannel | None, producer_stages: list[int],
                 spec: CoTrainSpec):
        self.draft, self.channel, self.producers, self.spec = draft, channel, sorted(producer_stages), spec
        self.policy_count = self.draft_count = None
        self.policy_sum = self.draft_sum = 0.0

    def begin_step(self, policy_count: torch.Tensor, draft_count: torch.Tensor) -> None:
        self.policy_count, self.draft_count = policy_count.clamp(min=1), draft_count.clamp(min=1)
        self.policy_sum = self.draft_sum = 0.0

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        rows, seq_len = labels.shape
        policy = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE,
                                 reduction="sum") / self.policy_count
        self.policy_sum += policy.detach()
        if self.draft is None:
            return policy
        features = torch.cat([self.channel.get(s) for s in self.producers], dim=-1)
        dim = self.draft.args.dim
        emb, taps = features[:, :dim], features[:, dim:]
        cu = row_documents(rows, seq_len, labels.device).cu_seq_q
        shift = DocumentShift(cu)
        states = self.draft.ttt_forward(emb, taps, positions_from_cu_seqlens(cu), self.spec.ttt_steps, shift,
                                        partial(branch_attention, cu_seqlens=cu))
        total, _, _ = ttt_loss(self.draft, states, logits.detach().flatten(0, 1), (labels != IGNORE).flatten(),
                               shift, self.spec.pass_decay)
        draft = total / self.draft_count
        self.draft_sum += draft.detach()
        return policy + self.spec.loss_weight * draft


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
    n_microbatches: int
    microbatch_size: int
    dp_group: dist.ProcessGroup | None

    @property
    def has_first(self) -> bool:
        return any(s.is_first for s in self.stages)

    @property
    def has_last(self) -> bool:
        return any(s.is_last for s in self.stages)

    def step(self, tokens: torch.Tensor, labels: torch.Tensor):
        """tokens, labels [B, S] of this data-parallel replica (every rank passes them). Returns, on the
        last stage (else None), this replica's (policy loss, unweighted draft loss): sums over its
        microbatches divided by the counts of all replicas, so replicas' values add up to the step's."""
        rows, seq_len = tokens.shape
        if rows != self.n_microbatches * self.microbatch_size:
            raise ValueError(f"tokens: {rows} rows, expected n_microbatches x microbatch_size = "
                             f"{self.n_microbatches} x {self.microbatch_size}")
        policy_count, draft_count = target_counts(labels, self.spec.ttt_steps, self.dp_group)
        self.loss.begin_step(policy_count, draft_count)
        if self.channel is not None:
            self.channel.begin_step(self.n_microbatches, self.microbatch_size * seq_len)
        args = (tokens,) if self.has_first else ()
        target, losses = (labels, []) if self.has_last else (None, None)
        self.schedule.step(*args, target=target, losses=losses, return_outputs=False)
        if self.channel is not None:
            self.channel.end_step()
        return (float(self.loss.policy_sum), float(self.loss.draft_sum)) if self.has_last else None


def build_pipeline_cotrain(policy: nn.Module, draft: EagleDraft, spec: CoTrainSpec, *, pp_mesh, pipelines,
                           schedule: str, n_microbatches: int, microbatch_size: int, seq_len: int,
                           dp_group: dist.ProcessGroup | None = None, taps: bool = True,
                           put_timeout: float = 120.0, get_timeout: float = 240.0) -> PipelineCoTrain:
    """Split `policy` over the pp mesh with torchtitan's helpers, wire the TapChannel, build the schedule.

    pipelines: global ranks of every pipeline replica in pp order (TapChannel's argument);
    taps=False builds the identical pipeline without channel or draft (the plain policy), for
    checking that the schedule's own communication does not change.
    """
    n_layers = len(policy.layers)
    layers = list(spec.tap_layers)
    if layers != sorted(set(layers)) or not all(0 <= i < n_layers for i in layers):
        raise ValueError(f"spec.tap_layers: {layers} must be distinct, ascending and in 0..{n_layers - 1}")
    if taps and (draft.args.n_taps != len(layers) or draft.args.dim != policy.model_args.dim):
        raise ValueError(f"draft: built for {draft.args.n_taps} taps of width {draft.args.dim}, the policy gives "
                         f"{len(layers)} of width {policy.model_args.dim}; build it with draft_args_for(policy "
                         f"args, n_taps=len(spec.tap_layers))")
    pp = pp_mesh.size()
    multi = issubclass(get_schedule_class(schedule), PipelineScheduleMulti)
    num_stages = pp * (2 if multi else 1)
    names = generate_llm_fqn_per_model_part(num_stages, n_layers)
    device = _compat.device()
    _, parts = pipeline_module_split(policy, pp_mesh, schedule, device, names)
    stage_ranks = stage_pp_ranks(num_stages, pp, schedule)
    local_stages = [s for s in range(num_stages) if stage_ranks[s] == pp_mesh.get_local_rank()]
    dim, vocab = policy.model_args.dim, policy.model_args.vocab_size
    dtype = next(policy.parameters()).dtype

    widths = {}
    for s, stage_names in enumerate(names):
        count = ("tok_embeddings" in stage_names) + sum(f"layers.{i}" in stage_names for i in spec.tap_layers)
        if count:
            widths[s] = count * dim
    channel = TapChannel(pipelines, stage_ranks, widths, microbatch_size * seq_len, dtype, device,
                         put_timeout, get_timeout) if taps else None

    # Every rank needs a loss function: torch pipelining runs backward only when it has one.
    loss = CoTrainLoss(draft if taps else None, channel, list(widths), spec)
    stages = []
    for s, part in zip(local_stages, parts):
        last = s == num_stages - 1
        module = TapStage(part, s, spec.tap_layers if taps else [], channel, draft if taps and last else None)
        shape = (microbatch_size, seq_len)
        inputs = torch.empty(shape, dtype=torch.long, device="meta") if s == 0 else \
            torch.empty(*shape, dim, dtype=dtype, device="meta", requires_grad=True)
        outputs = torch.empty(*shape, vocab if last else dim, dtype=dtype, device="meta", requires_grad=True)
        # Given shapes, torch pipelining skips its inference forward, which would run the stage (and
        # the loss) once more than the schedule and desynchronise the channel.
        stages.append(PipelineStage(module, s, num_stages, device, input_args=inputs, output_args=outputs,
                                    group=pp_mesh.get_group()))

    job = JobConfig()
    job.parallelism.pipeline_parallel_schedule = schedule
    job.parallelism.pipeline_parallel_degree = pp
    job.parallelism.pipeline_parallel_microbatch_size = microbatch_size
    job.training.local_batch_size = n_microbatches * microbatch_size
    pp_schedule = build_pipeline_schedule(job, stages, loss)
    return PipelineCoTrain(pp_schedule, stages, parts, channel, loss, spec, stage_ranks, n_microbatches,
                           microbatch_size, dp_group)
