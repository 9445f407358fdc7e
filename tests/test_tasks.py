"""The task registry, Prompts, the jsonl task (parsing, tokenizer, chat template, reward rule, checks)
and the arith task (scratchpad, heavy-tailed lengths, SFT corruption). Tokenizers are built here."""
import json
import typing

import pytest
import torch

from titan_draft.config import ConfigError, Task as TaskSection, parse_config
from titan_draft.data.tasks import TASKS, Prompts, build_task, check_task
from titan_draft.data.tasks.arith import CHARS, ArithTask, pareto_exponent
from titan_draft.data.tasks.jsonl import answers_match, final_answer, reference_answer
from titan_draft.plan import build_plan

WORDS = ["<pad>", "<s>", "</s>", "<unk>", "what", "is", "plus", "the", "answer", "so", "####", "?", ".", "1", "2",
         "3", "4", "5", "7", "5.0", "$5", "\\boxed{4}", "\\boxed{6}"]
CHAT = "{{ bos_token }}{% for m in messages %}<|{{ m.role }}|> {{ m.content }} {% endfor %}" \
       "{% if add_generation_prompt %}<|assistant|>{% endif %}"


def make_tokenizer(folder, chat_template: str | None = CHAT, add_bos: bool = True):
    """A word-level Hugging Face tokenizer (tokenizer.json + tokenizer_config.json) in `folder`."""
    from tokenizers import Tokenizer, models, pre_tokenizers  # no decoder: words joined by spaces

    hf = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf.add_special_tokens(["<s>", "</s>", "<pad>", "<|user|>", "<|assistant|>"])
    hf.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": {"content": "</s>"}, "pad_token": "<pad>", "add_bos_token": add_bos}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


ROWS = [{"prompt": "what is 2 plus 3 ?", "answer": "2 plus 3 is 5 . #### 5"},
        {"prompt": "what is 1 plus 1 plus 1 plus 1 ?", "answer": "so \\boxed{4}"},
        {"prompt": "what is 7 ?", "answer": "7"}]


def jsonl_config(tmp_path, *extra, rows=ROWS, chat_template=CHAT):
    make_tokenizer(tmp_path, chat_template)
    data = write_jsonl(tmp_path / "data.jsonl", rows)
    return parse_config(["--task.name", "jsonl", "--training.dataset_path", str(data), "--model.hf_assets_path",
                         str(tmp_path), "--training.seq_len", "64", *extra])


# --- the registry and Prompts ---------------------------------------------------------------------------

def test_registry_matches_the_config_literal_and_builds_every_task(tmp_path):
    assert set(TASKS) == set(typing.get_args(typing.get_type_hints(TaskSection)["name"]))
    cfgs = {"sort": parse_config(["--task.name", "sort"]), "jsonl": jsonl_config(tmp_path),
            "arith": parse_config(["--task.name", "arith", "--training.seq_len", "1024"])}
    for name, cfg in cfgs.items():
        check_task(cfg, 32, build_plan(cfg, 1))
        task = build_task(cfg, 32)
        assert task.name == name
        prompts = task.sample_prompts(4, torch.Generator().manual_seed(0))
        documents, prompt_lengths = task.sft_documents(3, torch.Generator().manual_seed(0))
        assert len(prompts) == 4 and len(documents) == 3 and prompt_lengths.dtype == torch.int64
        for doc, p in zip(documents, prompt_lengths.tolist()):
            assert doc.dtype == torch.int64 and doc[-1] == task.tokenizer.eos_id and 0 < p < len(doc)
        # an SFT document's response, given as a rollout response, earns the reward (sort/arith: no swaps)
        if name != "jsonl":
            task.swap_prob = 0.0
        docs, p_lens = task.sft_documents(1, torch.Generator().manual_seed(5))
        same = task.sample_prompts(1, torch.Generator().manual_seed(5))
        assert torch.equal(same.ids[0], docs[0][: p_lens[0]])
        assert task.rewards(same, [docs[0][p_lens[0]:]]).tolist() == [1.0]
        assert task.rewards(same, [docs[0][p_lens[0]:-1]]).tolist() == [0.0 if name != "jsonl" else 1.0]


def test_unknown_task_name():
    cfg = parse_config([])
    cfg.task.name = "chess"
    with pytest.raises(ConfigError, match=r"^task.name: 'chess' is unknown; use one of \['arith', 'jsonl', 'sort'\]$"):
        check_task(cfg, 32, build_plan(cfg, 1))


def test_prompts_repeat_shard_pad():
    p = Prompts([torch.tensor([5, 6]), torch.tensor([7]), torch.tensor([8, 9, 10])], ["a", "b", "c"])
    assert p.lengths().tolist() == [2, 1, 3] and p.lengths().dtype == torch.int64
    assert p.padded(0).tolist() == [[5, 6, 0], [7, 0, 0], [8, 9, 10]]
    r = p.repeat_interleave(2)
    assert len(r) == 6 and r.references == ["a", "a", "b", "b", "c", "c"]
    assert [x.tolist() for x in r.ids] == [[5, 6], [5, 6], [7], [7], [8, 9, 10], [8, 9, 10]]
    for n in range(0, 8):
        q = Prompts([torch.tensor([i]) for i in range(n)], list(range(n)))
        for degree in (1, 2, 3, 4):
            chunks = torch.arange(n).chunk(degree)
            for rank in range(degree):
                want = chunks[rank].tolist() if rank < len(chunks) else []
                assert q.shard(rank, degree).references == want, (n, degree, rank)
    assert Prompts([], []).padded(3).shape == (0, 0)


# --- jsonl -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, want", [
    ("so the answer is 5 . #### 5", "5"),
    ("#### 3 \n and then 4", "3"),                              # the first line after the last ####
    ("#### 1 #### 12", "12"),                                   # the last ####
    ("so \\boxed{12} is it", "12"),
    ("\\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),   # the last box, nested braces balanced
    ("\\boxed{5 and never closed", "5"),                        # unclosed box: the last number
    ("#### 7 and \\boxed{8}", "7 and \\boxed{8}"),              # #### wins over \boxed
    ("it is 3, then 1,234,567.", "1,234,567"),
    ("we owe -12.5 now", "-12.5"),
    ("no answer here", None),
])
def test_final_answer_extraction(text, want):
    assert final_answer(text) == want


@pytest.mark.parametrize("got, reference, match", [
    ("5", "2 plus 3 is 5 #### 5", True),
    ("1,234", "#### 1234", True),                               # commas
    ("$18", "#### 18", True),                                   # dollar sign
    ("18.0", "18", True),                                       # trailing .0
    ("18.00", "$18.", True),
    ("0.5", "\\boxed{0.50}", True),
    ("-3", "#### -3", True),                                    # negative
    ("3", "#### -3", False),
    ("18.5", "18", False),
    ("\\frac{1}{2}", "\\boxed{\\frac{1}{2}}", True),            # not a number: the text
    ("\\frac{1}{3}", "\\frac{1}{2}", False),
    (" x+1 ", "x+1", True),
    (None, "5", False),                                         # no answer in the response
])
def test_answers_match(got, reference, match):
    assert answers_match(got, reference_answer(reference)) is match


def test_jsonl_prompts_documents_rewards(tmp_path):
    cfg = jsonl_config(tmp_path, "--task.answer_field", "solution",
                       rows=[{"prompt": r["prompt"], "solution": r["answer"]} for r in ROWS])
    task = build_task(cfg, 32)
    tok = task.tokenizer
    assert (tok.eos_id, tok.pad_id, tok.vocab_size) == (2, 0, len(WORDS) + 2)
    assert [p.tolist() for p in task.prompt_ids] == [[1, *tok.encode(r["prompt"], False)] for r in ROWS]
    assert task.references == ["5", "4", "7"]
    assert task.max_new_tokens == 64 - 11  # the rest of training.seq_len after the longest prompt (bos + 10 words)
    g = torch.Generator().manual_seed(3)
    picks = torch.randint(3, (5,), generator=torch.Generator().manual_seed(3)).tolist()
    prompts = task.sample_prompts(5, g)  # drawn with replacement through the generator
    assert prompts.references == [task.references[i] for i in picks]
    assert [len(p) for p in prompts.ids] == [len(task.prompt_ids[i]) for i in picks]  # lengths differ freely
    documents, prompt_lengths = task.sft_documents(2, torch.Generator().manual_seed(4))
    for doc, p in zip(documents, prompt_lengths.tolist()):
        assert tok.decode(doc[p:]) in [r["answer"] for r in ROWS] and doc[-1] == tok.eos_id

    five = Prompts([task.prompt_ids[0]] * 6, ["5"] * 6)
    responses = ["so the answer is 5 </s> 4 4", "#### 5", "the answer is \\boxed{6}", "the answer is 5.0",
                 "so $5", "the answer is 4 </s> 5"]  # the text after eos does not count
    rewards = task.rewards(five, [torch.tensor(tok.encode(r, False)) for r in responses])
    assert rewards.tolist() == [1.0, 1.0, 0.0, 1.0, 1.0, 0.0] and rewards.dtype == torch.float32


def test_chat_template_on_and_off(tmp_path):
    plain = build_task(jsonl_config(tmp_path), 32)
    chat = build_task(jsonl_config(tmp_path, "--task.chat_template"), 32)
    tok = chat.tokenizer
    user, assistant = tok.backend.token_to_id("<|user|>"), tok.backend.token_to_id("<|assistant|>")
    words = tok.encode(ROWS[2]["prompt"], False)
    assert plain.prompt_ids[2].tolist() == [1, *words]
    assert chat.prompt_ids[2].tolist() == [1, user, *words, assistant]  # one bos: the template's own
    assert tok.decode(chat.prompt_ids[2]) == "what is 7 ?"
    cfg = jsonl_config(tmp_path, "--task.chat_template", chat_template=None)
    with pytest.raises(ConfigError, match=rf"^task.chat_template: the tokenizer in {tmp_path} has no chat_template "
                       r"\(tokenizer_config.json or chat_template.jinja\); set task.chat_template = false$"):
        check_task(cfg, 32, build_plan(cfg, 1))


def expect_error(cfg, message: str, vocab_size: int = 32):
    with pytest.raises(ConfigError) as err:
        check_task(cfg, vocab_size, build_plan(cfg, 1))
    assert str(err.value) == message


def test_jsonl_checks(tmp_path):
    data = tmp_path / "data.jsonl"
    cfg = jsonl_config(tmp_path)
    cfg.training.dataset_path = str(tmp_path / "missing.jsonl")
    expect_error(cfg, f"training.dataset_path: '{tmp_path}/missing.jsonl' is not a file; point it at a JSONL file "
                 "with one {\"prompt\": ..., \"answer\": ...} object per line")

    cfg = jsonl_config(tmp_path, rows=[ROWS[0], "", "{\"prompt\": 1,"])
    expect_error(cfg, f"training.dataset_path: {data} line 3 is not JSON (Expecting property name enclosed in "
                 "double quotes); write one JSON object per line")
    cfg = jsonl_config(tmp_path, rows=[ROWS[0], {"question": "what is 7 ?", "answer": "7"}])
    expect_error(cfg, f"training.dataset_path: {data} line 2 has no text field 'prompt'; set task.prompt_field "
                 "to the name its objects use")
    cfg = jsonl_config(tmp_path, "--task.answer_field", "solution")
    expect_error(cfg, f"training.dataset_path: {data} line 1 has no text field 'solution'; set task.answer_field "
                 "to the name its objects use")

    cfg = jsonl_config(tmp_path, "--rollout.max_new_tokens", "58")  # prompts of 7, 11 and 5 tokens: room for 6
    expect_error(cfg, f"training.dataset_path {data}: 2 of 3 prompts are longer than training.seq_len 64 minus the "
                 "response budget 58 (the longest has 11 tokens); set training.seq_len >= 69 or lower "
                 "rollout.max_new_tokens")
    cfg = jsonl_config(tmp_path, "--training.seq_len", "12")  # documents of 7 + 9, 11 + 3, 5 + 2 tokens
    expect_error(cfg, f"training.dataset_path {data}: 2 of 3 SFT documents (prompt + answer + eos) are longer "
                 "than training.seq_len 12 (the longest has 16 tokens); set training.seq_len >= 16, or "
                 "rl.sft_steps = 0 and draft.warmup_steps = 0")
    cfg = jsonl_config(tmp_path, "--training.seq_len", "12", "--rl.sft_steps", "0", "--draft.mode", "none")
    check_task(cfg, 32, build_plan(cfg, 1))

    expect_error(jsonl_config(tmp_path), f"model.hf_assets_path: the tokenizer's {len(WORDS) + 2} tokens do not fit "
                 "the policy's embedding of 16; use the policy's own tokenizer", vocab_size=16)
    cfg = jsonl_config(tmp_path)
    (tmp_path / "tokenizer.json").unlink()
    expect_error(cfg, f"model.hf_assets_path: {tmp_path} has no tokenizer.json; point it at the policy's Hugging "
                 "Face folder (the one with tokenizer.json and tokenizer_config.json)")


# --- arith -------------------------------------------------------------------------------------------------

def test_arith_scratchpad_is_right_and_local():
    task = ArithTask(30, 60, 600, vocab_size=32)
    assert (task.width, task.line_len, task.min_lines, task.max_lines) == (5, 21, 1, 28)
    tok = task.tokenizer
    prompt = task._prompt(3, 90, 7269)
    assert tok.decode(prompt) == "^309.096.002.007.000.|"
    answer = task._answer(3, 90, 7269, [[False] * 5] * 3)
    # 7269 + 90 = 7359 (carry out of the tens), 7449, 7539; counter 2, 1, 0 (digits least significant first)
    assert tok.decode(answer) == ("209.095c003.007.000.;" "109.094c004.007.000.;" "009.093c005.007.000.;"
                                  "=07539$")
    assert task.reference(3, 90, 7269) == "07539" and len(answer) == task.answer_len(3)
    # a counter decrement that borrows: 10 -> 9, flag b in digit 0
    assert tok.decode(task._answer(10, 1, 0, [[False] * 5] * 10)).startswith("911b000.")
    assert tok.encode(tok.decode(answer)) == answer and len(CHARS) == 20
    assert tok.decode(torch.tensor(answer)) == tok.decode(answer)  # rewards decode tensors, converted once


def test_arith_lengths_are_heavy_tailed():
    task = ArithTask(30, 100, 3000, vocab_size=32)
    assert task.max_new_tokens == task.answer_len(task.max_lines) <= 3000 + task.line_len
    documents, _ = task.sft_documents(512, torch.Generator().manual_seed(0))
    answer = torch.tensor([len(d) - task.prompt_len for d in documents]).float()
    median, longest = answer.median().item(), answer.max().item()
    assert 60 <= median <= 140  # about the asked 100 tokens
    assert longest / median > 10 and longest <= task.max_new_tokens  # thousands next to tens in one batch
    assert answer.min() >= task.answer_len(task.min_lines)
    assert (answer > 1000).float().mean() > 0.02  # a real tail, not a few outliers
    for low, median, high in ((1, 3, 28), (2, 40, 50), (3, 10, 2000)):  # the law's median is the asked one
        a = pareto_exponent(low, median, high)
        assert abs(low * (1 - 0.5 * (1 - (low / high) ** a)) ** (-1 / a) - median) < 1e-6


def test_arith_sft_corruption_drops_carries_and_costs_reward():
    task = ArithTask(30, 80, 400, vocab_size=32, swap_prob=0.0)
    clean, p_lens = task.sft_documents(200, torch.Generator().manual_seed(1))
    prompts = task.sample_prompts(200, torch.Generator().manual_seed(1))
    assert task.rewards(prompts, [d[p:] for d, p in zip(clean, p_lens)]).tolist() == [1.0] * 200
    task.swap_prob = 0.3
    dirty, _ = task.sft_documents(200, torch.Generator().manual_seed(1))
    assert [d[: task.prompt_len].tolist() for d in dirty] == [d[: task.prompt_len].tolist() for d in clean]
    rewards = task.rewards(prompts, [d[p:] for d, p in zip(dirty, p_lens)])
    carries = lambda docs: sum(int(((d == 15) | (d == 17)).sum()) for d in docs)  # noqa: E731  (flags c, x)
    assert carries(dirty) < 0.8 * carries(clean)  # about 30% of the carries dropped
    assert 0.1 < rewards.mean() < 0.9  # a dropped carry makes the final answer wrong
    lengths_clean = [len(d) for d in clean]
    assert [len(d) for d in dirty] == lengths_clean  # same problems, same lengths


def test_arith_rewards_need_the_final_answer_and_eos():
    task = ArithTask(30, 60, 600, vocab_size=32)
    prompts = Prompts([task._prompt(3, 90, 7269)] * 5, ["07539"] * 5)
    enc = task.tokenizer.encode
    responses = [enc("=07539$"), enc(";=07539$$$"), enc("=07539"), enc("=07538$"), enc("=01=07539$")]
    assert task.rewards(prompts, [torch.tensor(r) for r in responses]).tolist() == [1.0, 1.0, 0.0, 0.0, 1.0]


def test_arith_checks():
    cfg = parse_config(["--task.name", "arith", "--task.answer_len_median", "20"])
    expect_error(cfg, "task.answer_len_min / _median / _max: 30 / 20 / 600 must rise strictly from a positive "
                 "minimum, e.g. 40 / 150 / 3000")
    cfg = parse_config(["--task.name", "arith", "--training.seq_len", "500"])
    expect_error(cfg, "training.seq_len: 500 is shorter than the longest arith document: prompt 22 + answer 595 "
                 "tokens (task.answer_len_max 600, rollout.max_new_tokens); set training.seq_len >= 617 or lower "
                 "task.answer_len_max")
    expect_error(parse_config(["--task.name", "arith", "--training.seq_len", "1024"]),
                 "task.name: 'arith' needs 20 token ids, the policy's vocabulary has 16; use a model flavor with "
                 "a larger vocabulary", vocab_size=16)


def test_sort_checks():
    expect_error(parse_config(["--task.alphabet_size", "30"]), "task.alphabet_size: 30 letters and 4 special tokens "
                 "do not fit the policy's vocabulary of 32; use 1..28")
    expect_error(parse_config(["--training.seq_len", "20"]), "training.seq_len: 20 cannot hold a sort prompt of 12 "
                 "tokens with its answer (11) or a rollout of 13 new tokens (rollout.max_new_tokens, 0 = answer + 2); "
                 "use >= 26")
