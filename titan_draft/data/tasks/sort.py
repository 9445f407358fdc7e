"""A synthetic verifiable task that a tiny policy learns on a laptop: sort letters.

Sequence layout (one document): BOS  c_1 .. c_n  SEP  sorted(c)  EOS. The prompt ends at SEP,
the response is the answer and EOS; the reward is 1 for an exact match, else 0.
SFT data can carry a systematic error (adjacent answer pairs swapped with probability
`swap_prob`) that RL then corrects: that moves the policy, which is what makes a frozen draft decay.
"""
import torch

from titan_draft.data.tasks.base import Prompts, response_budget, token_ids
from titan_draft.infra.errors import ConfigError

PAD, BOS, EOS, SEP = 0, 1, 2, 3
FIRST_LETTER = 4


class CharTokenizer:
    """Letters 'a'.. plus four specials; ids are fixed, so nothing needs to be downloaded."""

    def __init__(self, alphabet_size: int, vocab_size: int | None = None):
        self.alphabet_size = alphabet_size
        self.vocab_size = vocab_size or FIRST_LETTER + alphabet_size
        if self.vocab_size < FIRST_LETTER + alphabet_size:
            raise ValueError(f"vocab_size {self.vocab_size} < {FIRST_LETTER + alphabet_size} needed by the task")
        self.pad_id, self.bos_id, self.eos_id, self.sep_id = PAD, BOS, EOS, SEP

    def encode(self, text: str) -> list[int]:
        return [FIRST_LETTER + ord(c) - ord("a") for c in text]

    def decode(self, ids) -> str:
        specials = {PAD: "_", BOS: "^", EOS: "$", SEP: "|"}
        return "".join(specials.get(i, chr(ord("a") + i - FIRST_LETTER)) for i in token_ids(ids))


class SortTask:
    name = "sort"

    def __init__(self, num_items: int, alphabet_size: int, vocab_size: int | None = None, swap_prob: float = 0.0):
        self.num_items = num_items
        self.swap_prob = swap_prob
        self.tokenizer = CharTokenizer(alphabet_size, vocab_size)

    @property
    def prompt_len(self) -> int:
        return self.num_items + 2

    @property
    def answer_len(self) -> int:
        return self.num_items + 1  # letters + EOS

    @property
    def max_new_tokens(self) -> int:
        return self.answer_len + 2

    def _prompt_rows(self, n: int, generator: torch.Generator) -> torch.Tensor:
        """[n, prompt_len] int64: BOS, n distinct-or-not random letters, SEP."""
        letters = torch.randint(0, self.tokenizer.alphabet_size, (n, self.num_items), generator=generator)
        bos = torch.full((n, 1), BOS)
        sep = torch.full((n, 1), SEP)
        return torch.cat([bos, letters + FIRST_LETTER, sep], dim=1)

    def answers(self, prompts: torch.Tensor) -> torch.Tensor:
        """[n, answer_len]: the sorted letters of prompts [n, prompt_len], then EOS."""
        letters = prompts[:, 1:-1].sort(dim=1).values
        return torch.cat([letters, torch.full((len(prompts), 1), EOS)], dim=1)

    def sample_prompts(self, n: int, generator: torch.Generator) -> Prompts:
        rows = self._prompt_rows(n, generator)
        return Prompts(list(rows), list(self.answers(rows)))

    def sft_documents(self, n: int, generator: torch.Generator) -> tuple[list[torch.Tensor], torch.Tensor]:
        """n documents of prompt_len + answer_len tokens, answers corrupted by adjacent swaps."""
        prompts = self._prompt_rows(n, generator)
        answers = self.answers(prompts)
        swap = torch.rand(n, self.num_items // 2, generator=generator) < self.swap_prob
        pairs = answers[:, : 2 * (self.num_items // 2)].view(n, -1, 2)
        pairs = torch.where(swap[..., None], pairs.flip(-1), pairs)
        answers[:, : pairs.shape[1] * 2] = pairs.reshape(n, -1)
        return list(torch.cat([prompts, answers], dim=1)), torch.full((n,), self.prompt_len)

    def rewards(self, prompts: Prompts, responses: list[torch.Tensor]) -> torch.Tensor:
        """1.0 where a response starts with exactly the sorted letters and EOS (anything after is ignored)."""
        A = self.answer_len
        return torch.tensor([float(len(got) >= A and torch.equal(got[:A].cpu(), want))
                             for got, want in zip(responses, prompts.references)])


def build(cfg, vocab_size: int) -> SortTask:
    t = cfg.task
    return SortTask(t.num_items, t.alphabet_size, vocab_size, swap_prob=t.sft_swap_prob)


def check(cfg, vocab_size: int, plan) -> None:
    t, seq, cp = cfg.task, cfg.training.seq_len, plan.cp
    if t.num_items < 1:
        raise ConfigError(f"task.num_items: {t.num_items} must be >= 1")
    if not 1 <= t.alphabet_size <= vocab_size - FIRST_LETTER:
        raise ConfigError(f"task.alphabet_size: {t.alphabet_size} letters and {FIRST_LETTER} special tokens do not "
                          f"fit the policy's vocabulary of {vocab_size}; use 1..{vocab_size - FIRST_LETTER}")
    task = build(cfg, vocab_size)
    budget = response_budget(cfg, task.max_new_tokens)
    longest = task.prompt_len + max(task.answer_len, budget)
    if seq < longest:
        raise ConfigError(f"training.seq_len: {seq} cannot hold a sort prompt of {task.prompt_len} tokens with its "
                          f"answer ({task.answer_len}) or a rollout of {budget} new tokens (rollout.max_new_tokens, "
                          f"0 = answer + 2); use >= {-(-longest // (2 * cp)) * 2 * cp}")
