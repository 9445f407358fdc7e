"""The main job: SFT warm start -> draft warm start -> RL (GRPO) with speculative rollouts and
online draft co-training. Run it with ./run_train.sh (torchrun); read it top to bottom.

One RL step:
  1. rollouts: the speculative engine samples group_size answers per prompt (draft proposes,
     policy verifies; lossless, so the samples follow the policy exactly);
  2. rewards -> group-relative advantages;
  3. ONE policy forward over the packed rollouts records the taps; from it come the policy's GRPO
     loss and the draft's TTT loss (teacher = the policy's detached logits, inputs = detached taps);
  4. separate optimizers and clips for policy and draft; the draft loss never reaches the policy;
  5. the engine's copies are refreshed from the updated weights.
[draft] mode = "cotrain" | "frozen" | "none" switches step 3's draft update / speculation off.
"""
import copy
import os
import sys
import time

import torch

from titan_draft import _compat
from titan_draft.config import parse_config, tap_layers, validate
from titan_draft.cotrain import DraftOptimizer, draft_loss
from titan_draft.grpo import group_advantages, grpo_loss, rollout_batch, token_entropy, token_logprobs
from titan_draft.metrics import MetricsLogger
from titan_draft.models.draft import EagleDraft, draft_args_for
from titan_draft.models.policy import TapRecorder, build_policy, forward_packed, model_args
from titan_draft.rollout import RolloutEngine
from titan_draft.task import SortTask
from titan_draft.warmstart import draft_vocab_from_data, sft_policy, warmup_draft


def build_models(cfg, device):
    """Policy and draft, initialised from the config's seed."""
    max_len = cfg.training.seq_len
    args = model_args(cfg.model.name, cfg.model.flavor, max_len)
    policy = build_policy(cfg.model.name, cfg.model.flavor, max_len, seed=cfg.debug.seed)
    layers = tap_layers(cfg, args.n_layers)
    d = cfg.draft
    draft = EagleDraft(draft_args_for(args, len(layers), d.vocab_size, d.n_heads, d.n_kv_heads)).to(device)
    draft.init_weights()
    return args, policy, draft, layers


def main(argv: list[str]) -> None:
    cfg = parse_config(argv)
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    args = model_args(cfg.model.name, cfg.model.flavor, cfg.training.seq_len)
    validate(cfg, world_size, args.n_layers, args.vocab_size)
    if world_size > 1:
        raise SystemExit("titan_draft.train: multi-process runs need the parallel layouts (not wired in yet); "
                         "use NGPU=1")
    device = _compat.device()
    seed = cfg.debug.seed if cfg.debug.seed is not None else 0
    torch.manual_seed(seed)
    data_gen = torch.Generator().manual_seed(seed + 1)
    rollout_gen = torch.Generator(device=device).manual_seed(seed + 2)
    metrics = MetricsLogger(cfg.job.dump_folder)
    task = SortTask(cfg.task.num_items, cfg.task.alphabet_size, args.vocab_size)
    _, policy, draft, layers = build_models(cfg, device)
    d, rl, ro = cfg.draft, cfg.rl, cfg.rollout

    # --- warm starts ----------------------------------------------------------------------------
    sft_policy(policy, task, rl.sft_steps, rl.sft_lr, rl.sft_batch_size, cfg.task.sft_swap_prob, data_gen,
               device, metrics)
    draft_vocab_from_data(task, draft, data_gen, cfg.task.sft_swap_prob)
    draft_opt = DraftOptimizer(draft, d.lr, d.max_norm)
    if d.mode != "none":
        draft_opt = warmup_draft(policy, draft, task, layers, d.warmup_steps, d.lr, d.max_norm, rl.sft_batch_size,
                                 d.ttt_steps, d.pass_decay, cfg.task.sft_swap_prob, data_gen, device, metrics)

    # --- RL ---------------------------------------------------------------------------------------
    start_policy = copy.deepcopy(policy).requires_grad_(False)  # reference for the KL metric / penalty
    policy_opt = torch.optim.AdamW(policy.parameters(), lr=rl.lr, weight_decay=0.0)
    speculate = d.mode != "none"
    engine = RolloutEngine(args, draft.args if speculate else None, layers,
                           max_batch_size=rl.prompts_per_step * rl.group_size,
                           max_seq_len=cfg.training.seq_len, device=device, dtype=torch.float32)
    max_new = ro.max_new_tokens or task.answer_len + 2
    for step in range(1, cfg.training.steps + 1):
        # 1. rollouts with the current policy (and draft)
        t0 = time.perf_counter()
        engine.load_weights(policy, draft if speculate else None)
        prompts = task.sample_prompts(rl.prompts_per_step, data_gen).repeat_interleave(rl.group_size, 0)
        result = engine.generate(prompts.to(device), max_new, num_speculative_tokens=ro.num_speculative_tokens
                                 if speculate else 0, temperature=ro.temperature, top_p=ro.top_p,
                                 eos_id=task.tokenizer.eos_id, generator=rollout_gen)
        rollout_time = time.perf_counter() - t0

        # 2. rewards and group-relative advantages
        t1 = time.perf_counter()
        P = prompts.shape[1]
        rewards = task.rewards(prompts, result.tokens[:, P:].cpu())
        advantages = group_advantages(rewards, rl.group_size)
        batch = rollout_batch(prompts, result.tokens.cpu(), result.response_lengths.cpu()).to(device)
        doc_lengths = batch.cu_seqlens.diff().long()
        row_advantages = advantages.to(device).repeat_interleave(doc_lengths)

        # 3. one policy forward: GRPO loss for the policy, TTT loss for the draft
        with TapRecorder(policy, layers) as rec:
            logits = forward_packed(policy, batch)
        logprobs = token_logprobs(logits, batch)
        with torch.no_grad():
            ref_logprobs = token_logprobs(forward_packed(start_policy, batch), batch)
        policy_loss, pg_stats = grpo_loss(logprobs, logprobs.detach(), row_advantages, batch.loss_mask,
                                          rl.clip_eps, ref_logprobs, rl.kl_coef)

        # 4. separate updates
        policy_loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.training.max_norm)
        policy_opt.step()
        policy_opt.zero_grad(set_to_none=True)
        draft_stats = {}
        if speculate:
            with torch.set_grad_enabled(d.mode == "cotrain"):
                loss, draft_stats = draft_loss(draft, rec.embeddings(), rec.taps(), logits, batch, d.ttt_steps,
                                               d.pass_decay)
            if d.mode == "cotrain":
                (d.loss_weight * loss).backward()
                draft_stats["draft_update_skipped"] = int(not draft_opt.step(loss))

        mask = batch.loss_mask
        with torch.no_grad():
            entropy = token_entropy(logits[mask]).mean().item()
            kl = (logprobs.detach() - ref_logprobs)[mask].mean().item()
        metrics.log("rl", step, {
            "reward_mean": rewards.mean().item(),
            "acceptance_length": result.acceptance_length,
            **draft_stats,
            "policy_loss": policy_loss.item(),
            "entropy": entropy,
            "kl_to_start": kl,
            **pg_stats,
            "rollout_tokens_per_s": result.tokens_per_s,
            "rollout_time_s": rollout_time,
            "train_time_s": time.perf_counter() - t1,
        })
    metrics.close()


if __name__ == "__main__":
    main(sys.argv[1:])
