"""The whole "your own model and data" path, end to end on CPU: a tiny random Hugging Face checkpoint
(made here with transformers, tokenizer trained here) and a JSONL file of problems; the job loads the
policy through --model.flavor hf / --checkpoint.initial_load_path, skips SFT, warms the draft up,
runs RL steps with co-training on prompts of different lengths, dumps samples and writes metrics;
its exported draft then starts a second job through --draft.init_path unchanged."""
import json
import os

import torch
import torch.distributed.checkpoint as dcp

from scripts.make_tiny_hf import write_demo_inputs
from titan_draft.cli.export_draft import main as export_main
from titan_draft.config import parse_config
from titan_draft.infra.metrics import MetricsLogger, read_metrics
from titan_draft.job import build_job
from titan_draft.plan import build_parallel_dims, build_plan
from titan_draft.train import main

ROOT = os.path.join(os.path.dirname(__file__), "..")
CONFIG = os.path.join(ROOT, "train_configs", "hf_tiny_cpu.toml")


def test_hf_checkpoint_and_jsonl_job_end_to_end(tmp_path):
    inputs = write_demo_inputs(str(tmp_path / "inputs"), "llama3", vocab_size=384, train_problems=64,
                               test_problems=4, seed=0)
    argv = ["--job.config_file", CONFIG, "--model.hf_assets_path", inputs.model,
            "--checkpoint.initial_load_path", inputs.model, "--training.dataset_path", inputs.train,
            "--draft.warmup_steps", "3", "--training.steps", "2", "--rl.prompts_per_step", "4",
            "--rl.group_size", "2", "--rollout.max_new_tokens", "12", "--rollout.dump_samples", "3",
            "--rollout.no-adaptive", "--checkpoint.enable"]  # fixed K: every step drafts (adaptive K follows CPU timings)
    run = tmp_path / "run"
    main([*argv, "--job.dump_folder", str(run)])

    records = read_metrics(str(run / "metrics.jsonl"))
    assert not any(r["phase"] == "sft" for r in records)  # rl.sft_steps = 0: the HF weights are the start
    assert [r["step"] for r in records if r["phase"] == "draft_warmup"] == [1, 2, 3]
    rl = [r for r in records if r["phase"] == "rl"]
    assert [r["step"] for r in rl] == [1, 2] and all(r["spec_num_drafts"] > 0 for r in rl)
    for step in (1, 2):
        samples = [json.loads(line) for line in open(run / "rollouts" / f"step_{step}.jsonl")]
        assert len(samples) == 3
        for sample in samples:
            assert {"step", "prompt", "response", "response_ids", "reward"} <= set(sample) and sample["step"] == step
            assert sample["prompt"].strip() and 1 <= len(sample["response_ids"]) <= 12
    prompts = {sample["prompt"] for step in (1, 2) for sample in
               map(json.loads, open(run / "rollouts" / f"step_{step}.jsonl"))}
    assert len(prompts) >= 2

    # The co-trained draft, exported, starts the next job unchanged (vocabulary maps included).
    exported = tmp_path / "draft"
    export_main(["--checkpoint", str(run / "checkpoint"), "--output", str(exported), "--engine", "sglang", *argv])
    cfg = parse_config([*argv, "--draft.init_path", str(exported), "--job.dump_folder", str(tmp_path / "next")])
    plan = build_plan(cfg, 1)
    job = build_job(cfg, MetricsLogger(str(tmp_path / "next"), enabled=False), plan=plan, dims=build_parallel_dims(plan))
    trained = {k: torch.empty_like(v) for k, v in job.draft.state_dict().items()}
    dcp.load({"draft": trained}, checkpoint_id=str(latest_step(run / "checkpoint")))
    for name, value in job.draft.state_dict().items():
        assert torch.equal(value, trained[name]), name


def latest_step(folder):
    return max((p for p in folder.iterdir() if p.name.startswith("step-")), key=lambda p: int(p.name[5:]))
