"""Tasks: prompts, reference documents for SFT, rewards and a tokenizer behind one small protocol.

`[task] name` picks one: "sort" (letters, the laptop default), "jsonl" (your prompts and reference
answers, your Hugging Face tokenizer) or "arith" (step-by-step addition with heavy-tailed answer
lengths). The job, the warm starts and the benches see only `Task` and `Prompts`.
"""
from titan_draft.data.tasks import arith, jsonl, sort
from titan_draft.data.tasks.base import Prompts, Task, Tokenizer
from titan_draft.infra.errors import ConfigError

__all__ = ["Prompts", "Task", "Tokenizer", "TASKS", "build_task", "check_task"]

# name -> module with build(cfg, vocab_size) -> Task and check(cfg, vocab_size, plan) (ConfigError one-liners)
TASKS = {"sort": sort, "jsonl": jsonl, "arith": arith}


def _module(cfg):
    if cfg.task.name not in TASKS:
        raise ConfigError(f"task.name: '{cfg.task.name}' is unknown; use one of {sorted(TASKS)}")
    return TASKS[cfg.task.name]


def build_task(cfg, vocab_size: int) -> Task:
    """The task `[task] name` names, for a policy with vocab_size token ids (cfg: the whole JobConfig)."""
    return _module(cfg).build(cfg, vocab_size)


def check_task(cfg, vocab_size: int, plan) -> None:
    """Raise ConfigError (one line naming the key or file and the fix) for a task that cannot run the job
    of `plan` (titan_draft.plan.RunPlan); call it before any process group exists."""
    _module(cfg).check(cfg, vocab_size, plan)
