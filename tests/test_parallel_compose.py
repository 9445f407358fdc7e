"""Composed parallelism on gloo: one co-training step (GRPO loss + draft TTT loss, their backward and
clipping) on 4 ranks equals the same step in one process — losses and every parameter's gradient
(also with micro-batches and a chunked LM head against the single process's one batch).
Pipeline layouts (PP x FSDP2 with 1F1B and Interleaved1F1B, CP x PP, TP x PP) run the
step through the pipeline schedule: each rank holds some stages' gradients (the draft's on the last
stage), together they are every gradient. The memory levers under PP (a chunked LM head, groups of
rows as schedule steps, the draft on drawn documents) equal the one-process step: each alone on
2 stages in float64 (row groups also on Interleaved1F1B), all together on PP x FSDP2."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from distributed import run_distributed  # noqa: E402

from titan_draft.config import parse_config  # noqa: E402
from titan_draft.parallel.pipeline import last_stage_pp_rank  # noqa: E402
from titan_draft.rollout.weights import unwrapped_name  # noqa: E402

CONFIG = os.path.join(os.path.dirname(__file__), "..", "train_configs", "sort_tiny_cpu.toml")
TINY = ["--job.config_file", CONFIG, "--model.flavor", "tiny_gqa", "--training.seq_len", "32",
        "--training.mixed_precision_param", "float32", "--task.num_items", "4", "--draft.tap_layers", "0", "1", "3",
        "--draft.vocab_size", "16", "--rl.prompts_per_step", "4", "--rl.group_size", "2", "--debug.seed", "3",
        "--rl.kl_to_start_metric"]


def fixed_rollouts(cfg, task):
    """Rollouts of the whole step, independent of the rank: random responses of random lengths."""
    from titan_draft.train import Rollouts

    g = torch.Generator().manual_seed(11)
    n = cfg.rl.prompts_per_step * cfg.rl.group_size
    prompts = task.sample_prompts(cfg.rl.prompts_per_step, g).repeat_interleave(cfg.rl.group_size)
    rows = torch.stack(prompts.ids)
    answers = task.answers(rows)
    # Half of the samples are right (reward 1), the rest random letters, so advantages are nonzero.
    noise = torch.randint(4, 4 + cfg.task.alphabet_size, answers.shape, generator=g)
    right = torch.arange(n) % 2 == 0
    responses = torch.where(right[:, None], answers, noise)
    lengths = torch.where(right, task.answer_len, torch.randint(2, task.answer_len + 1, (n,), generator=g))
    return Rollouts(prompts, torch.cat([rows, responses], 1), prompts.lengths(), lengths, {}, torch.zeros(0))


def share_of(rollouts, rank: int, degree: int):
    """This data-parallel rank's share of the step's rollouts (as collect_rollouts gives it)."""
    from titan_draft.train import Rollouts

    r = rollouts
    return Rollouts(r.prompts.shard(rank, degree), *(x.chunk(degree)[rank] for x in
                                                    (r.tokens, r.prompt_lengths, r.response_lengths)), {}, r.counts)


def cotrain_step(argv, dims_from_world: bool, poison: str = "", return_state: bool = False):
    """One train_step(); returns (metrics, {param: grad}) with full (gathered) gradients (and the
    RLState with return_state). poison = "draft" puts a NaN into the draft's lm_head (its loss is not
    finite), "policy" one into the policy's output layer (its loss and gradients are not)."""
    from torch.distributed.tensor import DTensor

    from titan_draft.infra.metrics import MetricsLogger
    from titan_draft.job import build_job
    from titan_draft.models.cotrain import DraftOptimizer
    from titan_draft.parallel.parallelize import dp_rank_and_degree
    from titan_draft.plan import build_parallel_dims, build_plan
    from titan_draft.rl.warmstart import draft_vocab_from_data
    from titan_draft.train import RLState, train_step

    cfg = parse_config(argv)
    plan = build_plan(cfg, torch.distributed.get_world_size() if dims_from_world else 1)
    dims = build_parallel_dims(plan)
    job = build_job(cfg, MetricsLogger(cfg.job.dump_folder, enabled=False), plan=plan, dims=dims)  # writes nothing
    draft_vocab_from_data(job.task, job.draft, torch.Generator().manual_seed(5))
    if poison:
        module = job.draft.lm_head if poison == "draft" else job.policy.output
        with torch.no_grad():
            weight = module.weight
            (weight.to_local() if isinstance(weight, DTensor) else weight)[0, 0] = float("nan")
    state = RLState.create(job, DraftOptimizer(job.draft, cfg.draft))
    grads = {}

    def capture(prefix, *modules):
        def hook(_opt, _args, _kwargs):
            for module in modules:
                for name, p in module.named_parameters():
                    g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                    grads[prefix + unwrapped_name(name)] = g.detach().clone()  # compiled blocks: _orig_mod
        return hook

    state.policy.optimizer.register_step_pre_hook(capture("policy.", *state.policy.parts))
    state.draft_opt.optimizer.register_step_pre_hook(capture("draft.", job.draft))
    metrics = train_step(state, share_of(fixed_rollouts(cfg, job.task), *dp_rank_and_degree(dims)))
    return (metrics, grads, state) if return_state else (metrics, grads)


def _worker(rank, world_size, argv):
    return cotrain_step(argv, dims_from_world=True)


def assert_same_step(single, distributed):
    (_, g1), (_, g2) = single, distributed
    assert g1.keys() == g2.keys()
    assert_same_values(single, distributed)
    assert any(g.abs().sum() > 0 for name, g in g1.items() if name.startswith("draft.midlayer"))
    assert any(g.abs().sum() > 0 for name, g in g1.items() if name.startswith("policy.layers"))


def assert_same_values(single, distributed):
    """The metrics, and every gradient the distributed rank holds, equal the single process's."""
    (m1, g1), (m2, g2) = single, distributed
    for key in ("policy_loss", "draft_loss", "draft_acc_pass1", "draft_acc_pass3", "entropy", "kl_to_start",
                "clip_frac", "reward_mean"):
        assert m2[key] == pytest.approx(m1[key], rel=1e-5, abs=1e-6), key
    for name in g2:
        torch.testing.assert_close(g2[name], g1[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.fixture(scope="module")
def single_process_step():
    torch.manual_seed(0)
    return cotrain_step(TINY, dims_from_world=False)


LAYOUTS = {  # 4 ranks each
    "fsdp2_x_tp": ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.tensor_parallel_degree", "2"],
    "cp_x_fsdp2": ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.context_parallel_degree", "2"],
    "cp_x_tp": ["--parallelism.tensor_parallel_degree", "2", "--parallelism.context_parallel_degree", "2",
                "--draft.cp_mode", "allgather"],
    "hsdp": ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "2"],
    # micro-batches of at most one rollout's length and a head chunk that divides nothing, against the
    # single process's one batch and full logits
    "cp_x_fsdp2_microbatched": ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.context_parallel_degree",
                                "2", "--rl.max_tokens_per_microbatch", "32", "--rl.logprob_chunk_size", "5"],
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_composed_layout_equals_single_process(single_process_step, layout):
    results = run_distributed(_worker, 4, TINY + LAYOUTS[layout], timeout=150)
    for result in results:
        assert_same_step(single_process_step, result)


def _timeout_worker(rank, world_size, argv):
    import time

    import torch.distributed as dist

    from titan_draft.parallel.parallelize import describe_rank, loss_group, set_collective_timeout
    from titan_draft.plan import build_parallel_dims, build_plan

    cfg = parse_config(argv)
    dims = build_parallel_dims(build_plan(cfg, world_size))
    set_collective_timeout(dims, cfg.comm.train_timeout_seconds)
    if rank == 1:  # a stuck rank: never joins the collective
        time.sleep(12)
        return None
    start = time.monotonic()
    with pytest.raises(RuntimeError) as err:
        dist.all_reduce(torch.ones(1), group=loss_group(dims))
    return describe_rank(dims), time.monotonic() - start, str(err.value)


def test_train_timeout_from_config_fires_and_names_the_rank():
    argv = TINY + ["--parallelism.data_parallel_shard_degree", "2", "--comm.train_timeout_seconds", "3"]
    where, waited, _ = run_distributed(_timeout_worker, 2, argv, timeout=100)[0]
    assert where == "rank 0 (fsdp 0/2)"
    assert 2.5 < waited < 11  # the configured 3 s, not the 300 s init timeout


PIPELINE_LAYOUTS = {  # 4 ranks each; one row per microbatch; 1F1B unless named
    "pp_x_fsdp2": ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "2"],
    "cp_x_pp": ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.context_parallel_degree", "2"],
    "tp_x_pp": ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.tensor_parallel_degree", "2"],
    # two stages per rank, loop-placed
    "interleaved_pp_x_fsdp2": ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree",
                               "2", "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"],
    # the stages' blocks and LM head compiled ([compile]) against the eager single process
    "pp_x_fsdp2_compiled": ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree",
                            "2", "--compile.enable"],
}


def _pipeline_worker(rank, world_size, argv):
    """The step, then the rollout engine's weights gathered from the stages (collect_rollouts' path):
    the names that differ from this rank's own updated parts and draft (none, if the gather is exact)."""
    from torch.distributed.tensor import DTensor

    from titan_draft.infra.io import full_state_dict

    metrics, grads, state = cotrain_step(argv, dims_from_world=True, return_state=True)
    state.engine.load_weights(*state.policy.rollout_weights(with_draft=True))
    own = {}
    for part in state.policy.parts:
        own.update({f"policy.{k}": v for k, v in full_state_dict(part, every_rank=True).items()})
    if state.policy.holds_draft:
        own.update({f"draft.{k}": v for k, v in full_state_dict(state.job.draft, every_rank=True).items()})
    engine = {**{f"policy.{k}": v for k, v in state.engine.policy.state_dict().items()},
              **{f"draft.{k}": v for k, v in state.engine.draft.state_dict().items()}}
    differ = [name for name, value in own.items() if not torch.equal(engine[name], value)]
    meshes = {name for part in state.policy.parts for p in part.parameters() if isinstance(p, DTensor)
              for name in p.device_mesh.mesh_dim_names}
    return metrics, grads, differ, len(own), meshes


@pytest.mark.parametrize("layout", PIPELINE_LAYOUTS)
def test_pipeline_layout_equals_single_process(single_process_step, layout):
    results = run_distributed(_pipeline_worker, 4, TINY + PIPELINE_LAYOUTS[layout], timeout=150)
    union = {}
    for metrics, grads, differ, checked, meshes in results:
        if layout == "tp_x_pp":
            assert "tp" in meshes  # the stages really are tensor-parallel
        assert_same_values(single_process_step, (metrics, grads))
        assert not differ and checked > 0, differ  # the engine got exactly the updated stage weights
        union.update(grads)
    assert union.keys() == single_process_step[1].keys()  # every gradient is on some rank
    schedule = parse_config(TINY + PIPELINE_LAYOUTS[layout]).parallelism.pipeline_parallel_schedule
    draft_pp_rank = last_stage_pp_rank(2, schedule)
    for rank, (metrics, grads, *_) in enumerate(results):  # pp is the outermost mesh dim: ranks 2 r, 2 r + 1
        assert any(k.startswith("draft.") for k in grads) == (rank // 2 == draft_pp_rank), rank
        assert metrics["draft_time_s"] > 0  # the last stage's, on every rank


def _step_and_draws(argv, float64: bool = False):
    """cotrain_step, and the documents this rank's draft trained on (cotrain.sample_documents' draw)."""
    import titan_draft.train as train

    if float64:
        torch.set_default_dtype(torch.float64)
    draws, sample = [], train.sample_documents

    def recording(*args):
        draws.append(sample(*args))
        return draws[-1]

    train.sample_documents = recording
    try:
        metrics, grads, state = cotrain_step(argv, dims_from_world=True, return_state=True)
    finally:
        train.sample_documents = sample
    train_pipeline = state.policy.train
    return metrics, grads, draws[0], train_pipeline.channel.step, train_pipeline.setup.n_microbatches


def _levers_worker(rank, world_size, cases):
    """Each case's step in float64 (the processes' group serves them all)."""
    return {name: _step_and_draws(argv, float64=True) for name, argv in cases.items()}


def one_process_step(argv, drawn=None, *, float64: bool = False, monkeypatch=None):
    """The one-process step (whole batch, full logits), its draft on the documents `drawn` (None: all)."""
    import titan_draft.train as train

    if drawn is not None:
        monkeypatch.setattr(train, "sample_documents", lambda *args: drawn)
    torch.set_default_dtype(torch.float64 if float64 else torch.float32)
    try:
        torch.manual_seed(0)
        return cotrain_step(argv, dims_from_world=False)
    finally:
        torch.set_default_dtype(torch.float32)


def assert_same_float64(single, distributed):
    """The metrics (timings aside) and every gradient the distributed rank holds, to 1e-10 relative."""
    from titan_draft.infra.metrics import TIMING_KEYS

    (m1, g1), (m2, g2) = single, distributed
    for key in m1.keys() - TIMING_KEYS:
        assert m2[key] == pytest.approx(m1[key], rel=1e-10, abs=1e-12), key
    for name in g2:  # relative to the gradient's norm: float64 sums in another order
        assert (g2[name] - g1[name]).norm() <= 1e-10 * g1[name].norm(), name


PP2 = ["--parallelism.pipeline_parallel_degree", "2"]
NINE_ROLLOUTS = ["--rl.prompts_per_step", "3", "--rl.group_size", "3"]
HALF_DRAWN = ["--draft.train_fraction", "0.5"]
LEVER_CASES = {  # 2 stages; (the step's own settings, the levers): rollouts of 11 tokens
    "chunked_head": ([], ["--parallelism.pipeline_parallel_microbatch_size", "2", "--rl.logprob_chunk_size", "5"]),
    # one row per microbatch, at most 70 // 11 = 6 per schedule step: 9 rows in 2 steps of 6 microbatches,
    # the second of 3 rows and 3 empty ones
    "row_groups": (NINE_ROLLOUTS, ["--rl.max_tokens_per_microbatch", "70"]),
    # the same on Interleaved1F1B: two stages per rank, loop-placed
    "interleaved_row_groups": (NINE_ROLLOUTS, ["--rl.max_tokens_per_microbatch", "70",
                                               "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"]),
    "drawn_documents": (HALF_DRAWN, ["--parallelism.pipeline_parallel_microbatch_size", "2"]),
}


def test_pipeline_memory_levers_equal_single_process_in_float64(monkeypatch):
    """Each lever alone on 2 stages (the drawn documents: 0, 1 or 2 of a microbatch's 2 rows) equals the one
    process's step without levers (one batch, full logits) in float64."""
    cases = {name: TINY + own + PP2 + levers for name, (own, levers) in LEVER_CASES.items()}
    results = run_distributed(_levers_worker, 2, cases, timeout=200)
    for name, (own, _) in LEVER_CASES.items():
        drawn = results[0][name][2]
        assert (drawn is not None) == (own is HALF_DRAWN)
        if drawn is not None:  # microbatches (2 rows each) with 0, 1 and 2 drawn rows
            assert set(torch.bincount(drawn // 2, minlength=4).tolist()) == {0, 1, 2}
        reference = one_process_step(TINY + own, drawn, float64=True, monkeypatch=monkeypatch)
        union = {}
        for per_rank in results:
            metrics, grads, _, schedule_steps, microbatches = per_rank[name]
            assert_same_float64(reference, (metrics, grads))
            union.update(grads)
            assert (schedule_steps, microbatches) == ((2, 6) if name.endswith("row_groups") else (1, 4)), name
        assert union.keys() == reference[1].keys(), name  # every gradient was compared


def test_pipeline_x_fsdp_with_every_lever_equals_single_process(monkeypatch):
    """PP x FSDP2 (float32), one row per microbatch, 6 rollouts per replica: a head chunk of 5, 2 schedule
    steps of 4 microbatches (64 // 11 = 5 rounded down to a multiple of pp; the second holds 2 empty rows),
    the draft on 2 of each replica's 6 rollouts. The replicas draw different documents, so one runs its
    draft on a microbatch's row where the other has none (and runs it at zero loss, in lockstep)."""
    own = ["--rl.prompts_per_step", "6", "--draft.train_fraction", "0.3"]
    levers = ["--rl.logprob_chunk_size", "5", "--rl.max_tokens_per_microbatch", "64"]
    results = run_distributed(_step_worker, 4, TINY + own + PIPELINE_LAYOUTS["pp_x_fsdp2"] + levers, timeout=200)
    draws = [results[dp][2] for dp in range(2)]  # global rank = 2 pp + dp
    assert not torch.equal(draws[0], draws[1])
    reference = one_process_step(TINY + own, torch.cat([draws[0], draws[1] + 6]), monkeypatch=monkeypatch)
    union = {}
    for rank, (metrics, grads, drawn, schedule_steps, microbatches) in enumerate(results):
        assert torch.equal(drawn, draws[rank % 2])  # both stages of a replica draw alike
        assert (schedule_steps, microbatches) == (2, 4)
        assert_same_values(reference, (metrics, grads))
        union.update(grads)
    assert union.keys() == reference[1].keys()


def _step_worker(rank, world_size, argv):
    return _step_and_draws(argv)
