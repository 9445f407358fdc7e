"""Your prompts and reference answers: one JSON object per line of `training.dataset_path`.

Prompts are tokenised with the policy's Hugging Face tokenizer (`model.hf_assets_path`), optionally
through its chat template as one user message (`task.chat_template`). An SFT document is the prompt,
the reference answer text and eos. The reward is a rule-based final-answer match, 1.0 or 0.0:
a response's final answer is the text after its last `####`, else its last `\\boxed{...}`, else its
last number; a reference's is the same, except that without `####` or `\\boxed` the whole answer is it
(answer fields are often just "72" or "\\frac{1}{2}"). Two numbers are compared as numbers (commas,
$ signs and a trailing .0 do not matter), anything else as stripped text.
"""
import json
import os
import re
from dataclasses import dataclass
from fractions import Fraction

import torch

from titan_draft.data.tasks.base import Prompts, check_prompts_fit, response_budget
from titan_draft.data.tasks.hf_tokenizer import HFTokenizer
from titan_draft.infra.errors import ConfigError

NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?")


def _boxed(text: str) -> str | None:
    """The contents of the last \\boxed{...}, braces balanced; None without a closed one."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for i in range(begin, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth < 0:
            return text[begin:i]
    return None


def _after_hashes(text: str) -> str | None:
    """The first non-empty line after the last ####; None without ####."""
    if "####" not in text:
        return None
    lines = [line.strip() for line in text.rsplit("####", 1)[1].splitlines()]
    return next((line for line in lines if line), "")


def final_answer(text: str) -> str | None:
    """A response's final answer: after the last ####, else the last \\boxed{}, else the last number."""
    for found in (_after_hashes(text), _boxed(text)):
        if found is not None:
            return found.strip()
    numbers = NUMBER.findall(text)
    return numbers[-1] if numbers else None


def reference_answer(text: str) -> str:
    """A reference's final answer: after the last ####, else the last \\boxed{}, else all of it."""
    for found in (_after_hashes(text), _boxed(text)):
        if found is not None:
            return found.strip()
    return text.strip()


def as_number(text: str) -> Fraction | None:
    """"$1,234.50" -> 1234.5; None unless the whole text (less $, commas, a final period) is one number."""
    cleaned = text.strip().replace("$", "").replace(",", "").rstrip(".").strip()
    return Fraction(cleaned) if re.fullmatch(r"-?\d+(?:\.\d+)?", cleaned) else None


def answers_match(got: str | None, want: str) -> bool:
    if got is None:
        return False
    got_number, want_number = as_number(got), as_number(want)
    if got_number is not None and want_number is not None:
        return got_number == want_number
    return got.strip() == want.strip()


@dataclass
class Example:
    prompt: str
    answer: str


def read_examples(path: str, prompt_field: str, answer_field: str) -> list[Example]:
    """The dataset's lines, or a ConfigError naming the file, the line and the fix."""
    if not path or not os.path.isfile(path):
        raise ConfigError(f"training.dataset_path: '{path}' is not a file; point it at a JSONL file with one "
                          f"{{\"{prompt_field}\": ..., \"{answer_field}\": ...}} object per line")
    examples = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ConfigError(f"training.dataset_path: {path} line {number} is not JSON ({err.msg}); "
                                  "write one JSON object per line") from None
            for field, key in ((prompt_field, "task.prompt_field"), (answer_field, "task.answer_field")):
                if not isinstance(row, dict) or not isinstance(row.get(field), str):
                    raise ConfigError(f"training.dataset_path: {path} line {number} has no text field "
                                      f"'{field}'; set {key} to the name its objects use")
            examples.append(Example(row[prompt_field], row[answer_field]))
    if not examples:
        raise ConfigError(f"training.dataset_path: {path} holds no examples; write one JSON object per line")
    return examples


class JsonlTask:
    name = "jsonl"

    def __init__(self, examples: list[Example], tokenizer: HFTokenizer, *, chat_template: bool, seq_len: int):
        self.tokenizer = tokenizer
        prompts = [e.prompt for e in examples]
        if chat_template:
            template = tokenizer.chat_template()
            if template is None:
                raise ConfigError(f"task.chat_template: the tokenizer in {tokenizer.folder} has no chat_template "
                                  "(tokenizer_config.json or chat_template.jinja); set task.chat_template = false")
            prompts = [tokenizer.render_user_message(template, p) for p in prompts]
        # A rendered template holds its special tokens (bos included) already.
        self.prompt_ids = [torch.tensor(ids, dtype=torch.int64)
                           for ids in tokenizer.encode_batch(prompts, add_special_tokens=not chat_template)]
        self.answer_ids = [torch.tensor([*ids, tokenizer.eos_id], dtype=torch.int64)
                           for ids in tokenizer.encode_batch([e.answer for e in examples], add_special_tokens=False)]
        self.references = [reference_answer(e.answer) for e in examples]
        # Without rollout.max_new_tokens, responses may fill the context after the longest prompt.
        self.max_new_tokens = seq_len - max(len(p) for p in self.prompt_ids)

    def _draw(self, n: int, generator: torch.Generator) -> list[int]:
        return torch.randint(len(self.prompt_ids), (n,), generator=generator).tolist()

    def sample_prompts(self, n: int, generator: torch.Generator) -> Prompts:
        """n examples drawn with replacement."""
        picks = self._draw(n, generator)
        return Prompts([self.prompt_ids[i] for i in picks], [self.references[i] for i in picks])

    def sft_documents(self, n: int, generator: torch.Generator) -> tuple[list[torch.Tensor], torch.Tensor]:
        """n examples drawn with replacement: prompt + reference answer + eos (no corruption: real data)."""
        picks = self._draw(n, generator)
        documents = [torch.cat([self.prompt_ids[i], self.answer_ids[i]]) for i in picks]
        return documents, torch.tensor([len(self.prompt_ids[i]) for i in picks], dtype=torch.int64)

    def response_text(self, response: torch.Tensor) -> str:
        """The decoded response up to (without) its first eos."""
        ids = response.tolist()
        return self.tokenizer.decode(ids[: ids.index(self.tokenizer.eos_id)] if self.tokenizer.eos_id in ids else ids)

    def rewards(self, prompts: Prompts, responses: list[torch.Tensor]) -> torch.Tensor:
        return torch.tensor([float(answers_match(final_answer(self.response_text(r)), want))
                             for r, want in zip(responses, prompts.references)])


def build(cfg, vocab_size: int) -> JsonlTask:
    t = cfg.task
    examples = read_examples(cfg.training.dataset_path, t.prompt_field, t.answer_field)
    tokenizer = HFTokenizer(cfg.model.hf_assets_path)
    if tokenizer.vocab_size > vocab_size:
        raise ConfigError(f"model.hf_assets_path: the tokenizer's {tokenizer.vocab_size} tokens do not fit the "
                          f"policy's embedding of {vocab_size}; use the policy's own tokenizer")
    return JsonlTask(examples, tokenizer, chat_template=t.chat_template, seq_len=cfg.training.seq_len)


def check(cfg, vocab_size: int, plan) -> None:
    task = build(cfg, vocab_size)
    path, seq_len = cfg.training.dataset_path, cfg.training.seq_len
    # rollout.max_new_tokens = 0 lets responses fill the context: then each prompt must leave one token.
    check_prompts_fit(cfg, torch.tensor([len(p) for p in task.prompt_ids]),
                      response_budget(cfg, 1), f"training.dataset_path {path}")
    if cfg.rl.sft_steps > 0 or (plan.speculate and cfg.draft.warmup_steps > 0):  # a warm start trains on them
        documents = torch.tensor([len(p) + len(a) for p, a in zip(task.prompt_ids, task.answer_ids)])
        if (documents > seq_len).any():
            raise ConfigError(f"training.dataset_path {path}: {int((documents > seq_len).sum())} of "
                              f"{len(documents)} SFT documents (prompt + answer + eos) are longer than "
                              f"training.seq_len {seq_len} (the longest has {int(documents.max())} tokens); "
                              f"set training.seq_len >= {int(documents.max())}, or rl.sft_steps = 0 and "
                              "draft.warmup_steps = 0")
