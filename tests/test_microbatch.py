"""The memory levers of the real-size presets change no number: micro-batches (rl.max_tokens_per_microbatch),
the chunked LM head (rl.logprob_chunk_size) and activation checkpointing give the one-batch step's
gradients and metrics in float64; the GRPO loss is normalised by the step's response tokens (a hand
value); the real-size presets pass the config checks and build (on the meta device)."""
import copy
import os
import sys

import pytest
import torch

from titan_draft.config import parse_config, validate
from titan_draft.data.packing import microbatch_ranges
from titan_draft.infra.metrics import TIMING_KEYS, MetricsLogger
from titan_draft.job import build_job
from titan_draft.models.cotrain import DraftOptimizer
from titan_draft.models.policy import job_model_args, policy_from_args
from titan_draft.plan import build_parallel_dims, build_plan
from titan_draft.rl.warmstart import WarmStartRun, draft_vocab_from_data, next_token_loss_backward, sft_batch
from titan_draft.rollout.weights import unwrapped_name
from titan_draft.train import RLState, train_step

sys.path.insert(0, os.path.dirname(__file__))
from test_parallel_compose import fixed_rollouts  # noqa: E402  (the same fixed rollouts as the layouts' test)

ROOT = os.path.join(os.path.dirname(__file__), "..")
CONFIG = os.path.join(ROOT, "train_configs", "sort_tiny_cpu.toml")
TINY = ["--job.config_file", CONFIG, "--model.flavor", "tiny_gqa", "--training.seq_len", "32",
        "--task.num_items", "4", "--draft.vocab_size", "16", "--rl.prompts_per_step", "4", "--rl.group_size", "4",
        "--debug.seed", "3", "--rl.kl_coef", "0.05"]
# At most one rollout's length per micro-batch (several micro-batches) and a head chunk that divides nothing.
LEVERS = ["--rl.max_tokens_per_microbatch", "32", "--rl.logprob_chunk_size", "7"]


@pytest.fixture(autouse=True)
def float64():
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(torch.float32)


def step(*overrides, mode="cotrain"):
    """One train_step on fixed rollouts: (metrics without timings, {param: grad} before the updates)."""
    cfg = parse_config([*TINY, "--draft.mode", mode, *overrides])
    torch.manual_seed(0)
    plan = build_plan(cfg, 1)
    job = build_job(cfg, MetricsLogger(cfg.job.dump_folder, enabled=False), plan=plan, dims=build_parallel_dims(plan))
    draft_vocab_from_data(job.task, job.draft, torch.Generator().manual_seed(5))
    state = RLState.create(job, DraftOptimizer(job.draft, cfg.draft))
    grads = {}

    def capture(prefix, module):
        def hook(*_):
            grads.update({prefix + unwrapped_name(name): p.grad.clone()  # AC's and compile's wrappers
                          for name, p in module.named_parameters() if p.grad is not None})
        return hook

    state.policy.optimizer.register_step_pre_hook(capture("policy.", state.policy.parts[0]))
    state.draft_opt.optimizer.register_step_pre_hook(capture("draft.", job.draft))
    r = fixed_rollouts(cfg, job.task)
    metrics = train_step(state, r)
    return {k: v for k, v in metrics.items() if k not in TIMING_KEYS}, grads, r, state


def assert_same(a, b):
    (m1, g1), (m2, g2) = a[:2], b[:2]
    assert m1.keys() == m2.keys() and g1.keys() == g2.keys()
    for key in m1:
        assert m2[key] == pytest.approx(m1[key], rel=1e-10, abs=1e-12), key
    for name in g1:  # relative to the gradient's norm: float64 sums in another order
        assert (g2[name] - g1[name]).norm() <= 1e-10 * g1[name].norm(), name


def test_microbatches_and_chunked_head_equal_the_one_batch_step():
    one = step()
    r = one[2]
    assert len(microbatch_ranges((r.prompt_lengths + r.response_lengths).tolist(), 32)) > 2  # really split
    assert any(g.abs().sum() > 0 for name, g in one[1].items() if name.startswith("draft.midlayer"))
    assert "kl_to_start" in one[0]  # the reference runs too (kl_coef > 0)
    assert_same(one, step(*LEVERS))


def test_drawn_documents_microbatched_equal_one_batch():
    """draft.train_fraction < 1: the same drawn documents give the same update in micro-batches."""
    assert_same(step("--draft.train_fraction", "0.5"), step("--draft.train_fraction", "0.5", *LEVERS))


def test_activation_checkpointing_leaves_the_step_unchanged():
    one = step(mode="frozen")
    for mode in ("full", "selective"):
        assert_same(one, step("--activation_checkpoint.mode", mode, mode="frozen"))


def test_policy_loss_is_normalised_by_the_step_response_tokens():
    """On-policy the ratio is 1 and the KL to an equal reference 0: the GRPO loss is exactly
    -(sum of every response token's advantage) / (response tokens of the step), the same in micro-batches.
    A loss divided by the number of rollouts (or per micro-batch) differs."""
    from titan_draft.rl.grpo import group_advantages

    for overrides in ([], LEVERS):
        metrics, _, r, state = step(*overrides, mode="none")
        advantages = group_advantages(state.job.task.rewards(r.prompts, r.responses()), 4)
        tokens = r.response_lengths  # trained rows per rollout: one per response token
        want = -(advantages.double() * tokens).sum() / tokens.sum()
        assert metrics["policy_loss"] == pytest.approx(want.item(), rel=1e-9, abs=1e-12)
        assert abs(want.item()) > 1e-3  # a loss divided otherwise would be told apart
        assert metrics["kl_to_start"] == 0.0


def test_no_reference_without_kl():
    _, _, _, state = step("--rl.kl_coef", "0")
    assert state.policy.reference_parts == [] and "start_policy" not in state.policy.checkpoint_states()
    metrics, *_ = step("--rl.kl_coef", "0")
    assert "kl_to_start" not in metrics
    metrics, _, _, state = step("--rl.kl_coef", "0", "--rl.kl_to_start_metric")
    assert len(state.policy.reference_parts) == 1 and metrics["kl_to_start"] == 0.0


def test_sft_loss_in_microbatches_equals_one_batch():
    cfg = parse_config(TINY)
    torch.manual_seed(0)
    plan = build_plan(cfg, 1)
    job = build_job(cfg, MetricsLogger(cfg.job.dump_folder, enabled=False), plan=plan, dims=build_parallel_dims(plan))
    batch = sft_batch(job.task, 16, WarmStartRun(torch.Generator().manual_seed(1), job.device, job.metrics))
    results = []
    for max_tokens, chunk in ((0, 0), (32, 5), (64, 1000)):
        policy = copy.deepcopy(job.policy)
        run = WarmStartRun(None, job.device, job.metrics, chunk_size=chunk, max_tokens=max_tokens)
        loss = next_token_loss_backward(policy, batch, run)
        results.append((loss, [p.grad.clone() for p in policy.parameters()]))
    (want, want_grads), *others = results
    for loss, grads in others:
        assert loss.item() == pytest.approx(want.item(), rel=1e-12)
        for g, w in zip(grads, want_grads):
            assert (g - w).norm() <= 1e-10 * w.norm()


def test_microbatch_ranges_split_whole_documents():
    assert microbatch_ranges([5, 5, 5, 5], 0) == [range(0, 4)]
    assert microbatch_ranges([5, 5, 5, 5], 10) == [range(0, 2), range(2, 4)]
    assert microbatch_ranges([5, 12, 3, 3], 10) == [range(0, 1), range(1, 2), range(2, 4)]  # 12 alone


@pytest.mark.parametrize("preset, params", [("qwen3_1.7b_arith_tail.toml", 2.03e9), ("qwen3_4b_arith_tail.toml", 4.41e9)])
def test_real_size_presets_validate_and_build(preset, params):
    """The presets at tiny row counts pass every check; the policy they name builds (meta device: no memory)
    at its real size."""
    cfg = parse_config(["--job.config_file", os.path.join(ROOT, "train_configs", preset),
                        "--rl.prompts_per_step", "2", "--rl.group_size", "2", "--rl.sft_batch_size", "2"])
    validate(cfg, 1)
    assert cfg.rl.max_tokens_per_microbatch >= cfg.training.seq_len and cfg.rl.logprob_chunk_size > 0
    assert cfg.rl.kl_coef == 0
    # The train phase's fastest setting that fits (bench.train_phase): compiled; 4B needs full checkpointing.
    assert cfg.compile.enable and set(cfg.compile.components) == {"model", "loss"}
    assert cfg.activation_checkpoint.mode == ("none" if "1.7b" in preset else "full")
    policy = policy_from_args(job_model_args(cfg), device="meta")
    assert sum(p.numel() for p in policy.parameters()) == pytest.approx(params, rel=0.01)
    assert policy.output.weight.shape[0] == 151936
