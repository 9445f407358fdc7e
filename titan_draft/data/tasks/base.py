"""What the job, the warm starts and the benches see of a task: a batch of prompts and two protocols."""
from dataclasses import dataclass
from typing import Protocol

import torch

from titan_draft.infra.errors import ConfigError


@dataclass
class Prompts:
    """A batch of prompts of any lengths, each with what its rewards are computed against."""
    ids: list[torch.Tensor]
    """1-D int64 token ids of each prompt."""
    references: list
    """Per prompt: what the task's rewards() compares a response with (task-defined)."""

    def __len__(self) -> int:
        return len(self.ids)

    def repeat_interleave(self, k: int) -> "Prompts":
        """Each prompt k times in a row (a GRPO group)."""
        return Prompts([x for x in self.ids for _ in range(k)], [r for r in self.references for _ in range(k)])

    def shard(self, rank: int, degree: int) -> "Prompts":
        """Chunk `rank` of `degree`, as Tensor.chunk cuts (ceil-sized chunks; empty past the last)."""
        size = -(-len(self) // degree)
        part = slice(rank * size, (rank + 1) * size)
        return Prompts(self.ids[part], self.references[part])

    def lengths(self) -> torch.Tensor:
        return torch.tensor([len(x) for x in self.ids], dtype=torch.int64)

    def padded(self, pad_id: int) -> torch.Tensor:
        """[n, longest] int64, each prompt followed by pad_id."""
        out = torch.full((len(self), max((len(x) for x in self.ids), default=0)), pad_id, dtype=torch.int64)
        for row, x in zip(out, self.ids):
            row[: len(x)] = x
        return out


def token_ids(ids) -> list[int]:
    """ids (a tensor or any sequence of ints) as a list of Python ints: one conversion, where iterating
    a tensor would cost a select and an item() per token (0.26 s for 512 arith responses on a CPU)."""
    return ids.tolist() if isinstance(ids, torch.Tensor) else [int(i) for i in ids]


class Tokenizer(Protocol):
    vocab_size: int
    eos_id: int
    pad_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids) -> str: ...


class Task(Protocol):
    name: str
    tokenizer: Tokenizer
    max_new_tokens: int
    """The response budget when rollout.max_new_tokens = 0."""

    def sample_prompts(self, n: int, generator: torch.Generator) -> Prompts: ...

    def sft_documents(self, n: int, generator: torch.Generator) -> tuple[list[torch.Tensor], torch.Tensor]:
        """n documents (prompt + reference response + eos) and their prompt lengths [n]; the SFT
        corruption (task.sft_swap_prob) is applied here."""

    def rewards(self, prompts: Prompts, responses: list[torch.Tensor]) -> torch.Tensor:
        """[n] float32; responses[i] = the generated ids of row i (eos included if emitted)."""


def response_budget(cfg, task_max_new_tokens: int) -> int:
    """Tokens a response may take: rollout.max_new_tokens, or the task's own budget when that is 0."""
    return cfg.rollout.max_new_tokens or task_max_new_tokens


def check_prompts_fit(cfg, prompt_lengths: torch.Tensor, budget: int, source: str) -> None:
    """Every prompt plus `budget` response tokens must fit training.seq_len (the models' positions)."""
    seq_len = cfg.training.seq_len
    over = prompt_lengths > seq_len - budget
    if over.any():
        longest = int(prompt_lengths.max())
        raise ConfigError(f"{source}: {int(over.sum())} of {len(prompt_lengths)} prompts are longer than "
                          f"training.seq_len {seq_len} minus the response budget {budget} (the longest has "
                          f"{longest} tokens); set training.seq_len >= {longest + budget} or lower "
                          "rollout.max_new_tokens")
