"""Mixed precision in one process, the torchtitan way: FSDP2's MixedPrecisionPolicy over a mesh of one
rank casts the parameters (parallelize.fsdp_wraps), where autocast would feed float32 RMSNorm weights
bf16 activations (torch then warns "Mismatch dtype between input and weight" and leaves its fused
kernel). The CPU computes in float32 (parallelize.compute_dtype); the workers give it a GPU's bf16.
Such a job also checkpoints, resumes and exports its draft."""
import json
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(__file__))
from distributed import run_distributed  # noqa: E402
from test_parallel_compose import fixed_rollouts  # noqa: E402

ROOT = os.path.join(os.path.dirname(__file__), "..")
JOB = ["--job.config_file", os.path.join(ROOT, "train_configs", "sort_tiny_cpu.toml"), "--model.name", "qwen3",
       "--model.flavor", "debugmodel", "--training.seq_len", "32", "--task.num_items", "4", "--draft.vocab_size", "16",
       "--rl.prompts_per_step", "2", "--rl.group_size", "4", "--rl.kl_coef", "0.05",
       "--training.mixed_precision_param", "bfloat16", "--debug.seed", "3"]


def mismatch_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if "Mismatch dtype" in str(w.message)]


def one_process_bf16_step(rank, world_size):
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from titan_draft.config import parse_config
    from titan_draft.infra.metrics import MetricsLogger
    from titan_draft.job import build_job
    from titan_draft.models.cotrain import DraftOptimizer
    from titan_draft.data.packing import pack_documents
    from titan_draft.models.policy import cast_parameters, forward_packed, job_model_args, policy_from_args
    from titan_draft.parallel import parallelize
    from titan_draft.plan import build_parallel_dims, build_plan
    from titan_draft.rl.warmstart import draft_vocab_from_data
    from titan_draft.train import RLState, train_step
    from torchtitan.config import TORCH_DTYPE_MAP

    parallelize.compute_dtype = lambda param_dtype, device: TORCH_DTYPE_MAP[param_dtype]  # as on a GPU
    cfg = parse_config(JOB)
    plan = build_plan(cfg, world_size)
    dims = build_parallel_dims(plan)
    plain = policy_from_args(job_model_args(cfg), seed=cfg.debug.seed)  # the job's initial weights, unwrapped
    job = build_job(cfg, MetricsLogger(cfg.job.dump_folder, enabled=False), plan=plan, dims=dims)
    wrapped = {name: isinstance(m, FSDPModule) for name, m in (("policy", job.policy), ("draft", job.draft))}
    sharded = all(isinstance(p, DTensor) for p in job.policy.parameters())
    draft_vocab_from_data(job.task, job.draft, torch.Generator().manual_seed(5))
    batch = pack_documents([torch.randint(0, 32, (n,)) for n in (12, 20)], [4, 6])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with job.amp:
            logits = forward_packed(job.policy, batch).detach()
        state = RLState.create(job, DraftOptimizer(job.draft, cfg.draft))
        metrics = train_step(state, fixed_rollouts(cfg, job.task))
    with warnings.catch_warnings(record=True) as caught_autocast:
        warnings.simplefilter("always")
        with torch.autocast("cpu", dtype=torch.bfloat16):  # float32 weights under autocast
            forward_packed(plain, batch)
    bf16_logits = forward_packed(cast_parameters(plain, torch.bfloat16), batch).detach()
    return dict(wrapped=wrapped, sharded=sharded, amp=type(job.amp).__name__, warnings=mismatch_warnings(caught),
                autocast_warnings=mismatch_warnings(caught_autocast), logits=logits, bf16_logits=bf16_logits,
                metrics=metrics)


def test_one_process_mixed_precision_is_fsdp_without_dtype_mismatch():
    (result,) = run_distributed(one_process_bf16_step, 1, timeout=300)
    assert result["wrapped"] == {"policy": True, "draft": True} and result["sharded"]
    assert result["amp"] == "nullcontext"  # FSDP casts: no autocast around the forwards
    assert result["autocast_warnings"], "autocast with float32 norms no longer warns: the check below proves nothing"
    assert result["warnings"] == []
    # The same math as a bf16 copy of the initial weights.
    assert result["logits"].dtype == torch.bfloat16
    torch.testing.assert_close(result["logits"], result["bf16_logits"], rtol=0, atol=0)
    metrics = result["metrics"]
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values() if isinstance(v, float))
    assert metrics["kl_to_start"] == 0.0  # the reference (FSDP-wrapped like the policy) equals it at the start


def bf16_job_runs(rank, world_size, dump_folder: str, steps: list[int]):
    """train.run of a short bf16 job (checkpoint every step) once per entry of `steps` (training.steps; a
    later run resumes the earlier's checkpoint); the draft's full weights at the end."""
    from titan_draft import train
    from titan_draft.config import parse_config
    from titan_draft.infra.io import full_state_dict
    from titan_draft.parallel import parallelize
    from titan_draft.plan import build_parallel_dims, build_plan
    from torchtitan.config import TORCH_DTYPE_MAP

    parallelize.compute_dtype = lambda param_dtype, device: TORCH_DTYPE_MAP[param_dtype]  # as on a GPU
    jobs, build_job = [], train.build_job
    train.build_job = lambda *args, **kwargs: jobs.append(build_job(*args, **kwargs)) or jobs[-1]  # keep the draft
    for total in steps:
        cfg = parse_config([*SHORT_JOB, "--job.dump_folder", dump_folder, "--training.steps", str(total)])
        plan = build_plan(cfg, world_size)
        train.run(cfg, plan=plan, dims=build_parallel_dims(plan))
    return {name: value.float() for name, value in full_state_dict(jobs[-1].draft).items()}


SHORT_JOB = [*JOB, "--rl.sft_steps", "4", "--draft.warmup_steps", "2", "--rl.sft_batch_size", "8",
             "--checkpoint.enable", "--checkpoint.interval", "1", "--metrics.no-enable-tensorboard"]


def test_one_process_bf16_job_checkpoints_resumes_and_exports(tmp_path):
    """The FSDP-wrapped one-process job saves its checkpoints (sharded tensors of one rank), resumes from
    them, and export_draft reads the draft back into a plain module: the exported weights are the job's."""
    from safetensors.torch import load_file

    from titan_draft.cli.export_draft import main as export_draft_main

    (draft,) = run_distributed(bf16_job_runs, 1, str(tmp_path), [1, 2], timeout=600)
    checkpoints = sorted(os.listdir(tmp_path / "checkpoint"))
    assert checkpoints[-1] == "step-4"  # SFT 1, warm-up 2, RL steps 3 (first run) and 4 (resumed)
    phases = [json.loads(line)["phase"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert phases == ["sft"] * 4 + ["draft_warmup"] * 2 + ["rl"] * 2  # the second run resumed, no SFT again
    export_draft_main(["--checkpoint", str(tmp_path / "checkpoint"), "--output", str(tmp_path / "draft"),
                       "--engine", "vllm", *SHORT_JOB])
    exported = load_file(tmp_path / "draft" / "model.safetensors")
    torch.testing.assert_close(exported["lm_head.weight"].float(), draft["lm_head.weight"], rtol=0, atol=0)
    torch.testing.assert_close(exported["fc.weight"].float(), draft["fc.weight"], rtol=0, atol=0)


def bench_modes_from_a_bf16_warm_state(rank, world_size, dump_folder: str):
    """bench.rl_step's start of a mode on the FSDP-wrapped one-process job a GPU builds: the warm-started
    job's state in host memory (bench._job.warm_state), then a [draft] mode's own job holding it
    (bench.rl_step.mode_state; such modules refuse deepcopy). Full tensors of both, and the mode's wrapping."""
    sys.path.insert(0, ROOT)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    from torch.distributed.fsdp import FSDPModule

    from bench._job import new_job, warm_state
    from bench.rl_step import mode_state
    from titan_draft.config import parse_config
    from titan_draft.infra.io import full_state_dict
    from titan_draft.parallel import parallelize
    from titan_draft.rl.warmstart import draft_vocab_from_data
    from torchtitan.config import TORCH_DTYPE_MAP

    parallelize.compute_dtype = lambda param_dtype, device: TORCH_DTYPE_MAP[param_dtype]  # as on a GPU
    cfg = parse_config([*JOB, "--draft.mode", "cotrain"])
    job, draft_opt = new_job(cfg, dump_folder)
    # A state the mode's fresh job cannot have by itself: a draft vocabulary, one optimizer step, drawn streams.
    draft_vocab_from_data(job.task, job.draft, job.generators["data"])
    sum(p.float().square().sum() for p in job.draft.parameters() if p.requires_grad).backward()
    draft_opt.optimizer.step()
    torch.rand(3, generator=job.generators["rollout"])
    warm = warm_state(job, draft_opt)
    cfg.debug.seed = 11  # the mode's job starts from other weights and streams
    state = mode_state(cfg, warm, "frozen")
    full = StateDictOptions(full_state_dict=True)
    optimizer_states = [get_optimizer_state_dict(j.draft, o.optimizer, options=full)["state"]
                        for j, o in ((job, draft_opt), (state.job, state.draft_opt))]
    return dict(wrapped=isinstance(state.job.policy, FSDPModule), mode=state.cfg.draft.mode,
                policy=[full_state_dict(j.policy, every_rank=True) for j in (job, state.job)],
                draft=[full_state_dict(j.draft, every_rank=True) for j in (job, state.job)],
                optimizer=optimizer_states,
                generators=[{k: g.get_state() for k, g in j.generators.items()} for j in (job, state.job)])


def test_bench_modes_start_from_the_warm_state_of_a_bf16_job(tmp_path):
    (result,) = run_distributed(bench_modes_from_a_bf16_warm_state, 1, str(tmp_path), timeout=300)
    assert result["wrapped"] and result["mode"] == "frozen"
    for name in ("policy", "draft", "generators"):
        warm, mode = result[name]
        assert warm.keys() == mode.keys(), name
        for key in warm:
            torch.testing.assert_close(mode[key], warm[key], rtol=0, atol=0, msg=f"{name} {key}")
    warm, mode = result["optimizer"]
    assert warm.keys() == mode.keys() and warm
    for key in warm:
        for moment in warm[key]:
            torch.testing.assert_close(mode[key][moment], warm[key][moment], rtol=0, atol=0)
