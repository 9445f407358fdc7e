"""Before RL: supervised fine-tuning of the policy on the task's reference documents, then offline
draft training on its taps. Both are optional (rl.sft_steps = 0 for a pretrained policy,
draft.warmup_steps = 0 for a draft that starts from draft.init_path).

Both run as the RL step does at scale: micro-batches of whole documents (rl.max_tokens_per_microbatch)
with gradients accumulated under the whole batch's normaliser, and the LM head reduced to the rows'
log-probs and teacher (rl.logprob_chunk_size). `amp` is the training forwards' precision context
(parallelize.training_autocast), entered around every forward; the default is plain float32."""
import contextlib
from dataclasses import dataclass

import torch

from titan_draft.data.packing import PackedBatch, microbatch_ranges, pack_documents
from titan_draft.infra.metrics import MetricsLogger, progress
from titan_draft.models.cotrain import (CoTrainSpec, DraftFeatures, DraftOptimizer, draft_backward, draft_metrics,
                                        valid_pairs)
from titan_draft.models.draft import EagleDraft, Teacher, build_draft_vocab
from titan_draft.models.policy import HeadRequest, TapRecorder, token_outputs
from torchtitan.components.lr_scheduler import build_lr_schedulers


@dataclass
class WarmStartRun:
    """What both warm starts share: the data stream, where they compute, where they log, and the RL
    step's memory settings ([rl] logprob_chunk_size, max_tokens_per_microbatch)."""

    generator: torch.Generator
    device: torch.device
    metrics: MetricsLogger
    amp: contextlib.AbstractContextManager = contextlib.nullcontext()
    log_every: int = 50
    chunk_size: int = 0
    max_tokens: int = 0


def response_request(batch: PackedBatch, chunk_size: int, teacher_ids: torch.Tensor | None = None) -> HeadRequest:
    """The head's work on a packed batch: the next token of every trained row (and the teacher there)."""
    rows = batch.loss_mask.nonzero().flatten()
    targets = batch.tokens.roll(-1)[rows]  # loss_mask never marks a document's last row
    return HeadRequest(rows, targets, chunk_size, teacher_ids=teacher_ids)


def next_token_loss_backward(policy, batch: PackedBatch, run: WarmStartRun) -> torch.Tensor:
    """Mean cross-entropy of the next token over the rows the batch trains (loss_mask), backpropagated
    micro-batch by micro-batch; returns it detached. Every rank holds the same batch (FSDP averages)."""
    count = batch.loss_mask.sum().clamp(min=1)
    total = torch.zeros((), device=batch.tokens.device)
    for index in microbatch_ranges(batch.document_lengths(), run.max_tokens):
        micro, _ = batch.documents(torch.arange(index.start, index.stop))
        with run.amp:
            loss = -token_outputs(policy, micro, response_request(micro, run.chunk_size)).logprobs.sum() / count
        loss.backward()
        total += loss.detach()
    return total


def sft_batch(task, n: int, run: WarmStartRun) -> PackedBatch:
    """n of the task's reference documents, packed, trained on their responses."""
    documents, prompt_lengths = task.sft_documents(n, run.generator)
    return pack_documents(documents, prompt_lengths).to(run.device)


def sft_policy(policy, task, rl_cfg, schedule_cfg, run: WarmStartRun) -> None:
    """[rl] sft_steps of AdamW (sft_lr) on batches of sft_batch_size documents, the learning rate following
    torchtitan's [lr_scheduler] (linear warm-up, then stable / decaying) over the SFT steps."""
    optimizer = torch.optim.AdamW(policy.parameters(), lr=rl_cfg.sft_lr, weight_decay=0.0)
    schedule = build_lr_schedulers([optimizer], schedule_cfg, training_steps=rl_cfg.sft_steps)
    steps = rl_cfg.sft_steps
    bar = progress(range(1, steps + 1), "sft", run.metrics.enabled)
    for step in bar:
        loss = next_token_loss_backward(policy, sft_batch(task, rl_cfg.sft_batch_size, run), run)
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
        run.metrics.log("sft", step, {"loss": loss.item(), "lr": optimizer.param_groups[0]["lr"]},
                        echo=step % run.log_every == 0 or step == steps)


def draft_vocab_from_data(task, draft: EagleDraft, generator: torch.Generator, num_docs: int = 1024) -> None:
    """The draft vocabulary: the most frequent target tokens of the task's reference responses."""
    if draft.args.draft_vocab_size == draft.args.target_vocab_size:
        return
    documents, prompt_lengths = task.sft_documents(num_docs, generator)
    responses = torch.cat([doc[p:] for doc, p in zip(documents, prompt_lengths.tolist())])
    counts = torch.bincount(responses, minlength=draft.args.target_vocab_size)
    draft.set_vocab(build_draft_vocab(counts, draft.args.draft_vocab_size))


def warmup_draft(policy, draft: EagleDraft, task, spec: CoTrainSpec, *, optimizer: DraftOptimizer, steps: int,
                 batch_size: int, run: WarmStartRun) -> None:
    """Train the draft alone on the (frozen) policy's taps and teacher, through the optimizer RL goes on with."""
    bar = progress(range(1, steps + 1), "draft warm-up", run.metrics.enabled)
    for step in bar:
        batch = sft_batch(task, batch_size, run)
        request = response_request(batch, run.chunk_size, teacher_ids=draft.target_ids())
        with run.amp, torch.no_grad(), TapRecorder(policy, spec.tap_layers) as rec:
            out = token_outputs(policy, batch, request)
        features = DraftFeatures(batch, rec.embeddings(), rec.taps(),
                                 Teacher.at(batch.loss_mask, out.teacher_logits, out.teacher_argmax))
        count = valid_pairs(batch.loss_mask, batch.shift(spec.ttt_steps), spec.ttt_steps)
        with run.amp:
            loss, per_pass = draft_backward(draft, features, spec, count=count, max_tokens=run.max_tokens)
        optimizer.step(loss)
        stats = draft_metrics(per_pass)
        bar.set_postfix(loss=f"{stats['draft_loss']:.3f}", acc1=f"{stats['draft_acc_pass1']:.3f}", refresh=False)
        run.metrics.log("draft_warmup", step, stats, echo=step % run.log_every == 0 or step == steps)
