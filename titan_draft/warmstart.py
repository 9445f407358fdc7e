"""Before RL: supervised fine-tuning of the policy on the task's reference documents, then offline
draft training on its taps. Both are optional (rl.sft_steps = 0 for a pretrained policy,
draft.warmup_steps = 0 for a draft that starts from draft.init_path).

`amp` is the training forwards' precision context (parallelize.training_autocast), entered around
every forward; the default is plain float32."""
import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from titan_draft.cotrain import CoTrainSpec, DraftOptimizer, draft_loss, draft_metrics
from titan_draft.metrics import MetricsLogger, progress
from titan_draft.models.draft import EagleDraft, build_draft_vocab
from titan_draft.models.policy import TapRecorder, forward_packed
from titan_draft.packing import PackedBatch, pack_documents


@dataclass
class WarmStartRun:
    """What both warm starts share: the data stream, where they compute, where they log."""

    generator: torch.Generator
    device: torch.device
    metrics: MetricsLogger
    amp: contextlib.AbstractContextManager = contextlib.nullcontext()
    log_every: int = 50


def next_token_loss(logits: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
    """Mean cross-entropy of the next token over the rows the batch trains (loss_mask)."""
    targets = batch.tokens.roll(-1)  # loss_mask never marks a document's last row
    return F.cross_entropy(logits[batch.loss_mask].float(), targets[batch.loss_mask])


def sft_batch(task, n: int, run: WarmStartRun) -> PackedBatch:
    """n of the task's reference documents, packed, trained on their responses."""
    documents, prompt_lengths = task.sft_documents(n, run.generator)
    return pack_documents(documents, prompt_lengths).to(run.device)


def sft_policy(policy, task, rl_cfg, run: WarmStartRun) -> None:
    """[rl] sft_steps of AdamW (sft_lr, 20 warm-up steps) on batches of sft_batch_size documents."""
    optimizer = torch.optim.AdamW(policy.parameters(), lr=rl_cfg.sft_lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 20))
    steps = rl_cfg.sft_steps
    bar = progress(range(1, steps + 1), "sft", run.metrics.enabled)
    for step in bar:
        batch = sft_batch(task, rl_cfg.sft_batch_size, run)
        with run.amp:
            logits = forward_packed(policy, batch)
        loss = next_token_loss(logits, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
        run.metrics.log("sft", step, {"loss": loss.item()}, echo=step % run.log_every == 0 or step == steps)


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
    """Train the draft alone on the (frozen) policy's taps and logits, through the optimizer RL goes on with."""
    bar = progress(range(1, steps + 1), "draft warm-up", run.metrics.enabled)
    for step in bar:
        batch = sft_batch(task, batch_size, run)
        with run.amp:
            with torch.no_grad(), TapRecorder(policy, spec.tap_layers) as rec:
                logits = forward_packed(policy, batch)
            loss, per_pass = draft_loss(draft, rec.embeddings(), rec.taps(), logits, batch, spec)
        loss.backward()
        optimizer.step(loss)
        stats = draft_metrics(per_pass)
        bar.set_postfix(loss=f"{stats['draft_loss']:.3f}", acc1=f"{stats['draft_acc_pass1']:.3f}", refresh=False)
        run.metrics.log("draft_warmup", step, stats, echo=step % run.log_every == 0 or step == steps)
