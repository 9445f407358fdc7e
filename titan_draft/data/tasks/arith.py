"""A long-answer task with a heavy-tailed answer length that a tiny policy learns from scratch:
repeated addition written out as a scratchpad, one line per step.

A problem is (n, y, x): add y to x, n times. Every number is written with D digits, least
significant first, in D cells of four tokens, and a line holds D cells and ';':
    cell j = [counter digit j] [y digit j] [value digit j] [flag]
The flag says whether this line's addition carried out of digit j (c), its counter decrement
borrowed out of digit j (b), both (x) or neither (.). The prompt is line 0 (counter n, y, value x)
between BOS and SEP; answer line k holds counter n - k and value x + k*y; after the line whose
counter is 0 comes '=', the value's D digits most significant first, and EOS.
Lines have one length L = 4D + 1, so every token depends only on tokens at fixed distances: the
same digit one line up (L back) and the carry or borrow flag of the cell before (a few tokens back).
That is what a tiny transformer learns within minutes, at every answer length.

The number of lines n follows a Pareto law truncated to [min, max] lines whose median is the asked
one (task.answer_len_min / _median / _max, in tokens): a batch holds answers of tens and thousands
of tokens. The reward is 1.0 when the digits after the last '=' are x + n*y and EOS follows.
task.sft_swap_prob is the SFT data's systematic error: each carry is dropped with that probability
(the flag says no carry, the next digit does not get it, later lines go on from the wrong value).
"""
import math

import torch

from titan_draft.data.tasks.base import Prompts, response_budget, token_ids
from titan_draft.infra.errors import ConfigError

PAD, BOS, EOS, SEP = 0, 1, 2, 3
DIGIT = 4  # ids 4..13 are the digits 0..9
FLAGS = {(False, False): 14, (True, False): 15, (False, True): 16, (True, True): 17}  # (carry, borrow)
LINE_END, EQUALS = 18, 19
CHARS = "_^$|0123456789.cbx;="  # one character per token id, for reading samples
MAX_ADDEND = 99


class ArithTokenizer:
    """One token per character of CHARS; nothing to download."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.pad_id, self.bos_id, self.eos_id, self.sep_id = PAD, BOS, EOS, SEP

    def encode(self, text: str) -> list[int]:
        return [CHARS.index(c) for c in text]

    def decode(self, ids) -> str:
        return "".join(CHARS[i] if i < len(CHARS) else "?" for i in token_ids(ids))


def pareto_exponent(low: float, median: float, high: float) -> float:
    """The exponent a of a Pareto law on [low, high] (density ~ x^(-a-1), any sign) with this median."""
    def median_of(a):
        if abs(a) < 1e-9:  # the log-uniform limit
            return math.sqrt(low * high)
        return low * (1 - 0.5 * (1 - (low / high) ** a)) ** (-1 / a)

    lo, hi = -60.0, 60.0  # the median falls from high to low as a grows
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if median_of(mid) > median else (lo, mid)
    return (lo + hi) / 2


def digits(value: int, width: int) -> list[int]:
    """Least significant first."""
    return [value // 10**j % 10 for j in range(width)]


class ArithTask:
    name = "arith"

    def __init__(self, answer_len_min: int, answer_len_median: int, answer_len_max: int, *,
                 vocab_size: int, swap_prob: float = 0.0):
        # D: the fewest digits that hold x + n*y (x < 10^(D-1)) for the most lines an answer of
        # answer_len_max tokens has at that D.
        self.width = next(w for w in range(2, 20)
                          if len(str(self._lines(answer_len_max, w) * MAX_ADDEND)) + 1 <= w)
        self.line_len = 4 * self.width + 1
        self.min_lines, self.median_lines, self.max_lines = (
            self._lines(tokens, self.width) for tokens in (answer_len_min, answer_len_median, answer_len_max))
        # lines = floor(X) with X on [min, max + 1): the median of X is half a line above.
        self.exponent = pareto_exponent(self.min_lines, self.median_lines + 0.5, self.max_lines + 1)
        self.swap_prob = swap_prob
        self.tokenizer = ArithTokenizer(vocab_size)

    @staticmethod
    def _lines(answer_tokens: int, width: int) -> int:
        """Lines of an answer of about answer_tokens tokens at D = width."""
        return max(1, round((answer_tokens - width - 2) / (4 * width + 1)))

    @property
    def prompt_len(self) -> int:
        return self.width * 4 + 2

    def answer_len(self, lines: int) -> int:
        return lines * self.line_len + self.width + 2  # lines, '=', D digits, EOS

    @property
    def max_new_tokens(self) -> int:
        return self.answer_len(self.max_lines)

    def _draw(self, n: int, generator: torch.Generator) -> tuple[list[int], list[int], list[int]]:
        """(lines, y, x) of n problems; lines from the truncated Pareto law by its inverse CDF."""
        u = torch.rand(n, generator=generator, dtype=torch.float64)
        low, high, a = self.min_lines, self.max_lines + 1, self.exponent
        if abs(a) < 1e-9:
            lines = low * (high / low) ** u
        else:
            lines = low * (1 - u * (1 - (low / high) ** a)) ** (-1 / a)
        lines = lines.floor().long().clamp(self.min_lines, self.max_lines)
        y = torch.randint(1, MAX_ADDEND + 1, (n,), generator=generator)
        x = torch.randint(0, 10 ** (self.width - 1), (n,), generator=generator)
        return lines.tolist(), y.tolist(), x.tolist()

    def _prompt(self, lines: int, y: int, x: int) -> torch.Tensor:
        cells = zip(digits(lines, self.width), digits(y, self.width), digits(x, self.width))
        ids = [t for c, a, v in cells for t in (DIGIT + c, DIGIT + a, DIGIT + v, FLAGS[False, False])]
        return torch.tensor([BOS, *ids, SEP])

    def _answer(self, lines: int, y: int, x: int, drops: list[list[bool]]) -> list[int]:
        """The scratchpad of (lines, y, x); drops[k][j]: line k + 1 drops a carry out of digit j."""
        ids, value, D = [], x, self.width
        for k in range(lines):
            counter = lines - k
            borrow, carry, new_value = 1, False, []
            for j, (c, a, v) in enumerate(zip(digits(counter, D), digits(y, D), digits(value, D))):
                total = v + a + carry
                c, borrow = (c - borrow) % 10, c < borrow
                carry = total >= 10 and not drops[k][j]
                new_value.append(total % 10)
                ids += [DIGIT + c, DIGIT + a, DIGIT + total % 10, FLAGS[carry, borrow]]
            ids.append(LINE_END)
            value = sum(d * 10**j for j, d in enumerate(new_value))
        return [*ids, EQUALS, *(DIGIT + d for d in reversed(digits(value, D))), EOS]

    def reference(self, lines: int, y: int, x: int) -> str:
        return str(x + lines * y).zfill(self.width)

    def sample_prompts(self, n: int, generator: torch.Generator) -> Prompts:
        problems = list(zip(*self._draw(n, generator)))
        return Prompts([self._prompt(*p) for p in problems], [self.reference(*p) for p in problems])

    def sft_documents(self, n: int, generator: torch.Generator) -> tuple[list[torch.Tensor], torch.Tensor]:
        """n scratchpads; each carry is dropped with probability swap_prob."""
        documents = []
        for problem in zip(*self._draw(n, generator)):
            drops = (torch.rand(problem[0], self.width, generator=generator) < self.swap_prob).tolist()
            documents.append(torch.cat([self._prompt(*problem), torch.tensor(self._answer(*problem, drops))]))
        return documents, torch.full((n,), self.prompt_len)

    def final_answer(self, response: torch.Tensor) -> str | None:
        """The digits between the last '=' and EOS; None without both."""
        text = self.tokenizer.decode(response)
        if "$" not in text:
            return None
        body = text[: text.index("$")]
        return body.rsplit("=", 1)[1] if "=" in body else None

    def rewards(self, prompts: Prompts, responses: list[torch.Tensor]) -> torch.Tensor:
        return torch.tensor([float(self.final_answer(r) == want) for r, want in zip(responses, prompts.references)])


def build(cfg, vocab_size: int) -> ArithTask:
    t = cfg.task
    return ArithTask(t.answer_len_min, t.answer_len_median, t.answer_len_max, vocab_size=vocab_size,
                     swap_prob=t.sft_swap_prob)


def check(cfg, vocab_size: int, plan) -> None:
    t = cfg.task
    if not 0 < t.answer_len_min < t.answer_len_median < t.answer_len_max:
        raise ConfigError(f"task.answer_len_min / _median / _max: {t.answer_len_min} / {t.answer_len_median} / "
                          f"{t.answer_len_max} must rise strictly from a positive minimum, e.g. 40 / 150 / 3000")
    if vocab_size < len(CHARS):
        raise ConfigError(f"task.name: 'arith' needs {len(CHARS)} token ids, the policy's vocabulary has "
                          f"{vocab_size}; use a model flavor with a larger vocabulary")
    task = build(cfg, vocab_size)
    need = task.prompt_len + max(response_budget(cfg, task.max_new_tokens), task.max_new_tokens)
    if need > cfg.training.seq_len:
        raise ConfigError(f"training.seq_len: {cfg.training.seq_len} is shorter than the longest arith document: "
                          f"prompt {task.prompt_len} + answer {need - task.prompt_len} tokens (task.answer_len_max "
                          f"{t.answer_len_max}, rollout.max_new_tokens); set training.seq_len >= {need} or lower "
                          "task.answer_len_max")
