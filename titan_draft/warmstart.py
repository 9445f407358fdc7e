"""Before RL: supervised fine-tuning of the policy on the task, then offline draft training on its taps.

`amp` is the training forwards' precision context (parallelize.training_autocast), entered around every
forward; the default is plain float32."""
import contextlib

import torch
import torch.nn.functional as F

from titan_draft.cotrain import DraftOptimizer, draft_loss
from titan_draft.metrics import MetricsLogger, progress
from titan_draft.models.draft import EagleDraft, build_draft_vocab
from titan_draft.models.policy import TapRecorder, forward_packed
from titan_draft.packing import PackedBatch, pack
from titan_draft.tasks import Task


def next_token_loss(logits: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
    """Mean cross-entropy of the next token over the rows the batch trains (loss_mask)."""
    targets = batch.tokens.roll(-1)  # loss_mask never marks a document's last row
    return F.cross_entropy(logits[batch.loss_mask].float(), targets[batch.loss_mask])


def sft_batch(task: Task, n: int, generator: torch.Generator, device) -> PackedBatch:
    """n of the task's SFT documents, packed; the rows that predict response tokens are trained."""
    documents, prompt_lengths = task.sft_documents(n, generator)
    masks = [(torch.arange(len(d)) >= p - 1) & (torch.arange(len(d)) < len(d) - 1)
             for d, p in zip(documents, prompt_lengths.tolist())]
    return pack(documents, masks).to(device)


def sft_policy(policy, task: Task, steps: int, lr: float, batch_size: int,
               generator: torch.Generator, device, metrics: MetricsLogger, log_every: int = 50,
               amp=contextlib.nullcontext()) -> None:
    optimizer = torch.optim.AdamW(policy.parameters(), lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 20))
    bar = progress(range(1, steps + 1), "sft", metrics.enabled)
    for step in bar:
        batch = sft_batch(task, batch_size, generator, device)
        with amp:
            logits = forward_packed(policy, batch)
        loss = next_token_loss(logits, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
        metrics.log("sft", step, {"loss": loss.item()}, echo=step % log_every == 0 or step == steps)


def draft_vocab_from_data(task: Task, draft: EagleDraft, generator: torch.Generator, num_docs: int = 1024) -> None:
    """The draft vocabulary: the most frequent target tokens of the task's answers."""
    if draft.args.draft_vocab_size == draft.args.target_vocab_size:
        return
    documents, prompt_lengths = task.sft_documents(num_docs, generator)
    answers = torch.cat([d[p:] for d, p in zip(documents, prompt_lengths.tolist())])
    counts = torch.bincount(answers, minlength=draft.args.target_vocab_size)
    draft.set_vocab(build_draft_vocab(counts, draft.args.draft_vocab_size))


def warmup_draft(policy, draft: EagleDraft, task: Task, tap_layers: list[int], steps: int, lr: float,
                 max_norm: float, batch_size: int, ttt_steps: int, pass_decay: float,
                 generator: torch.Generator, device, metrics: MetricsLogger, log_every: int = 50,
                 amp=contextlib.nullcontext()) -> DraftOptimizer:
    """Train the draft alone on the (frozen) policy's taps and logits; returns its optimizer for RL."""
    optimizer = DraftOptimizer(draft, lr, max_norm)
    bar = progress(range(1, steps + 1), "draft warm-up", metrics.enabled)
    for step in bar:
        batch = sft_batch(task, batch_size, generator, device)
        with amp:
            with torch.no_grad(), TapRecorder(policy, tap_layers) as rec:
                logits = forward_packed(policy, batch)
            loss, stats = draft_loss(draft, rec.embeddings(), rec.taps(), logits, batch, ttt_steps, pass_decay)
        loss.backward()
        optimizer.step(loss)
        bar.set_postfix(loss=f"{stats['draft_loss']:.3f}", acc1=f"{stats['draft_acc_pass1']:.3f}", refresh=False)
        metrics.log("draft_warmup", step, stats, echo=step % log_every == 0 or step == steps)
    return optimizer
