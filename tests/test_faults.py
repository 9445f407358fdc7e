"""A policy or draft update that goes non-finite: skipped and counted, never applied; a policy that stays
non-finite stops the job (exit 3, one line, its checkpoints hold the last finite weights); a draft that
stays non-finite is restored to its state before the update that broke it."""
import copy
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from test_parallel_compose import TINY, cotrain_step, fixed_rollouts, share_of  # noqa: E402

from titan_draft.config import parse_config  # noqa: E402
from titan_draft.models.cotrain import DraftOptimizer  # noqa: E402
from titan_draft.models.draft import EagleDraft, draft_args_for  # noqa: E402
from titan_draft.models.policy import model_args  # noqa: E402
from titan_draft.train import PolicyDiverged, main, train_step  # noqa: E402


@pytest.fixture(scope="module")
def clean_step():
    torch.manual_seed(0)
    return cotrain_step(TINY, dims_from_world=False)


def test_non_finite_draft_loss_skips_only_the_draft_update(clean_step):
    metrics, grads = cotrain_step(TINY, dims_from_world=False, poison="draft")
    assert metrics["draft_updates_skipped"] == 1 and metrics["policy_updates_skipped"] == 0
    assert not any(k.startswith("draft.") for k in grads)  # the draft's optimizer never stepped
    clean_metrics, clean_grads = clean_step
    assert metrics["policy_loss"] == clean_metrics["policy_loss"]
    for name, grad in clean_grads.items():  # the policy's update is the clean step's, bit for bit
        if name.startswith("policy."):
            assert torch.equal(grads[name], grad), name


def test_non_finite_policy_skips_its_update_and_stops_after_repeats():
    metrics, grads, state = cotrain_step(TINY, dims_from_world=False, poison="policy", return_state=True)
    assert metrics["policy_updates_skipped"] == 1
    assert not any(k.startswith("policy.") for k in grads)  # the policy's optimizer never stepped
    cfg = state.cfg
    rollouts = share_of(fixed_rollouts(cfg, state.job.task), 0, 1)
    assert train_step(state, rollouts)["policy_updates_skipped"] == 2
    with pytest.raises(PolicyDiverged, match=r"^rl: the policy's loss or gradient norm was not finite in 3 RL steps "
                                             r"in a row .*; lower rl.lr or raise rl.stop_after_skips$"):
        train_step(state, rollouts)


def test_diverging_job_exits_3_with_one_line_and_keeps_finite_checkpoints(tmp_path, capsys):
    tiny = ["--job.config_file", TINY[1], "--model.flavor", "tiny_gqa", "--training.seq_len", "16",
            "--task.num_items", "2", "--task.alphabet_size", "4", "--rl.sft_steps", "20", "--rl.sft_batch_size", "16",
            "--draft.warmup_steps", "2", "--rl.prompts_per_step", "4", "--rl.group_size", "4"]
    argv = [*tiny, "--training.steps", "8", "--rl.lr", "1e20", "--rl.stop_after_skips", "2", "--checkpoint.enable",
            "--checkpoint.interval", "1",
            "--job.dump_folder", str(tmp_path)]
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 3
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("stopped:")]
    assert len(lines) == 1 and "2 RL steps in a row" in lines[0], lines
    from titan_draft.checkpoint import complete_steps

    saved = complete_steps(str(tmp_path / "checkpoint"))
    assert saved and max(saved) < 2 + 8  # the job never reached its last step
    from torch.distributed.checkpoint import load
    from titan_draft.models import build_models

    _, policy, _ = build_models(parse_config(argv), torch.device("cpu"))
    state = policy.state_dict()  # torchtitan keeps the model's entries at the top level
    load(state, checkpoint_id=str(tmp_path / "checkpoint" / f"step-{max(saved)}"))
    assert all(torch.isfinite(t).all() for t in state.values())


def test_draft_restored_after_repeated_non_finite_losses():
    args = model_args("llama3", "tiny", 16)
    torch.manual_seed(0)
    draft = EagleDraft(draft_args_for(args, 3))
    draft.init_weights()
    cfg = parse_config(["--job.config_file", TINY[1], "--draft.lr", "1e12", "--draft.restore_after_skips", "2"])
    optimizer = DraftOptimizer(draft, cfg.draft)
    before = {k: v.clone() for k, v in draft.state_dict().items()}

    def step(loss_value):
        for p in optimizer.params:
            p.grad = torch.ones_like(p)
        return optimizer.step(torch.tensor(loss_value))

    assert step(1.0)  # the destructive update (lr 1e12) is applied: its loss was finite
    broken = {k: v.clone() for k, v in draft.state_dict().items()}
    assert any(not torch.equal(broken[k], before[k]) for k in before)
    with pytest.warns(UserWarning, match="back to their state before the last update"):
        assert not step(float("nan")) and not step(float("inf"))  # the second skip in a row restores
    assert optimizer.skipped == 2 and optimizer.restores == 1
    assert all(torch.equal(draft.state_dict()[k], before[k]) for k in before)
    assert optimizer.optimizer.state_dict()["state"] == {}  # AdamW's moments are back to before the update too

    # A later update breaks it again: back to the weights and the moments of the update before it.
    optimizer.set_lr(1e-3)
    assert step(1.0)
    good = copy.deepcopy((draft.state_dict(), optimizer.optimizer.state_dict()["state"]))
    optimizer.set_lr(1e12)
    assert step(1.0)
    with pytest.warns(UserWarning, match="back to their state before the last update"):
        assert not step(float("nan")) and not step(float("nan"))
    assert optimizer.restores == 2
    assert all(torch.equal(draft.state_dict()[k], good[0][k]) for k in good[0])
    moments = optimizer.optimizer.state_dict()["state"]
    assert moments.keys() == good[1].keys() and all(
        torch.equal(moments[i][key], good[1][i][key]) for i in moments for key in moments[i])
