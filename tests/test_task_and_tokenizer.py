"""The sorting task, its tokenizer, a real Hugging Face tokenizer through torchtitan, and packing."""
import hashlib
import json

import torch

from titan_draft.data.packing import (cu_seqlens_from_lengths, pack, pack_documents, positions_from_cu_seqlens,
                                      trained_rows)
from titan_draft.data.tasks import Prompts
from titan_draft.data.tasks.hf_tokenizer import load_hf_tokenizer
from titan_draft.data.tasks.sort import BOS, EOS, FIRST_LETTER, SEP, CharTokenizer, SortTask


def test_rewards_exact_match_only():
    task = SortTask(num_items=4, alphabet_size=6)
    tok = task.tokenizer
    rows = torch.tensor([[BOS, *tok.encode("dbca"), SEP]] * 6)
    prompts = Prompts(list(rows), list(task.answers(rows)))
    good = [*tok.encode("abcd"), EOS]
    responses = [torch.tensor(r) for r in (
        good + [0, 7],                             # right, junk after EOS is ignored
        good,                                      # right, stopped at EOS
        [*tok.encode("abdc"), EOS, 0, 0],          # one swap
        [*tok.encode("abcd"), 0, 0, 0],            # no EOS
        [*tok.encode("abc"), EOS],                 # too short
        [*tok.encode("abcdd"), EOS, 0],            # extra letter
    )]
    rewards = task.rewards(prompts, responses)
    assert rewards.tolist() == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0] and rewards.dtype == torch.float32
    assert task.rewards(prompts, [torch.tensor(good[:-1])] * 6).sum() == 0  # cut before EOS


def test_answers_sorted_with_duplicates():
    task = SortTask(num_items=5, alphabet_size=4)
    prompts = torch.tensor([[BOS, *task.tokenizer.encode("cabac"), SEP]])
    assert task.tokenizer.decode(task.answers(prompts)[0]) == "aabcc$"


def sft_rows(task: SortTask, n: int, generator: torch.Generator) -> torch.Tensor:
    documents, prompt_lengths = task.sft_documents(n, generator)
    assert prompt_lengths.tolist() == [task.prompt_len] * n
    return torch.stack(documents)


def test_sft_documents_swap_prob_zero_and_one():
    torch.manual_seed(0)
    task = SortTask(num_items=7, alphabet_size=16)  # odd: the last letter has no partner
    P, A = task.prompt_len, task.answer_len
    rows = sft_rows(task, 64, torch.Generator().manual_seed(1))
    assert rows.shape == (64, P + A)
    prompts, answers = rows[:, :P], rows[:, P:]
    assert (prompts[:, 0] == BOS).all() and (prompts[:, -1] == SEP).all()
    assert ((prompts[:, 1:-1] >= FIRST_LETTER) & (prompts[:, 1:-1] < FIRST_LETTER + 16)).all()
    assert torch.equal(answers, task.answers(prompts))
    assert task.rewards(Prompts(list(prompts), list(task.answers(prompts))), list(answers)).sum() == 64

    task.swap_prob = 1.0
    rows = sft_rows(task, 64, torch.Generator().manual_seed(1))
    prompts, answers = rows[:, :P], rows[:, P:]
    right = task.answers(prompts)
    for got, want in zip(answers.tolist(), right.tolist()):
        swapped = [want[1], want[0], want[3], want[2], want[5], want[4], want[6], EOS]
        assert got == swapped


def digest(x: torch.Tensor) -> str:
    return hashlib.sha256(x.numpy().tobytes()).hexdigest()[:16]


def test_sort_draws_exactly_what_the_old_task_drew():
    """Frozen outputs of titan_draft/task.py's SortTask before the Task protocol (sample_prompts, then
    sft_batch(n, g, swap_prob) rows): the default job must stay bit-identical."""
    task = SortTask(num_items=5, alphabet_size=6, swap_prob=0.5)
    g = torch.Generator().manual_seed(7)
    prompts = task.sample_prompts(3, g)
    assert [p.tolist() for p in prompts.ids] == [[1, 7, 8, 5, 6, 5, 3], [1, 7, 9, 9, 8, 9, 3], [1, 8, 5, 6, 7, 6, 3]]
    assert [r.tolist() for r in prompts.references] == [[5, 5, 6, 7, 8, 2], [7, 8, 9, 9, 9, 2], [5, 6, 6, 7, 8, 2]]
    assert sft_rows(task, 4, g).tolist() == [
        [1, 8, 4, 8, 7, 4, 3, 4, 4, 8, 7, 8, 2], [1, 4, 8, 9, 7, 8, 3, 7, 4, 8, 8, 9, 2],  # a swapped pair in each
        [1, 6, 9, 5, 4, 6, 3, 5, 4, 6, 6, 9, 2], [1, 7, 8, 4, 5, 5, 3, 5, 4, 7, 5, 8, 2]]
    assert [p.tolist() for p in task.sample_prompts(2, g).ids] == [[1, 6, 6, 5, 8, 6, 3], [1, 6, 8, 7, 9, 9, 3]]

    task = SortTask(num_items=10, alphabet_size=16, vocab_size=32, swap_prob=0.25)  # the default job's task
    g = torch.Generator().manual_seed(1)
    assert digest(sft_rows(task, 64, g)) == "e2be4a34ef0fd3c4"
    assert digest(task.sample_prompts(32, g).padded(0)) == "f3558493f63756e3"
    assert task.max_new_tokens == 13  # the old default response budget: answer_len + 2


def test_char_tokenizer_round_trip():
    tok = CharTokenizer(alphabet_size=26)
    text = "thequickbrownfoxjumpsoverthelazydog"
    ids = tok.encode(text)
    assert min(ids) == FIRST_LETTER and max(ids) == FIRST_LETTER + 25
    assert tok.decode(ids) == text
    assert tok.decode([BOS, *tok.encode("ab"), SEP, EOS, 0]) == "^ab|$_"
    assert tok.vocab_size == FIRST_LETTER + 26


def test_hf_tokenizer_built_locally_through_torchtitan(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = ["<pad>", "<s>", "</s>", "<unk>", "sort", "the", "letters", "b", "a", "c"]
    vocab = {w: i for i, w in enumerate(words)}
    hf = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    hf.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>",
         "add_bos_token": True, "add_eos_token": False}))

    tok = load_hf_tokenizer(str(tmp_path))
    assert type(tok).__name__ == "HuggingFaceTokenizer"
    assert (tok.bos_id, tok.eos_id) == (1, 2)
    assert tok.get_vocab_size() == len(words)
    ids = tok.encode("sort the letters b a c")
    assert ids == [1, 4, 5, 6, 7, 8, 9]  # BOS added by tokenizer_config
    assert tok.encode("sort the letters", add_bos=False, add_eos=True) == [4, 5, 6, 2]
    assert tok.encode("sort zebra") == [1, 4, 3]  # unknown word
    assert tok.decode(ids, skip_special_tokens=True) == "sort the letters b a c"


def test_cu_seqlens_and_positions():
    cu = cu_seqlens_from_lengths([3, 1, 4, 0, 2])
    assert cu.dtype == torch.int32
    assert cu.tolist() == [0, 3, 4, 8, 8, 10]
    assert positions_from_cu_seqlens(cu).tolist() == [0, 1, 2, 0, 0, 1, 2, 3, 0, 1]


def test_pack_concatenates_documents():
    docs = [torch.tensor([5, 6, 7]), torch.tensor([8]), torch.tensor([9, 10])]
    masks = [torch.tensor([0, 1, 0]), torch.tensor([0]), torch.tensor([1, 0])]
    b = pack(docs, masks)
    assert b.tokens.tolist() == [5, 6, 7, 8, 9, 10] and b.tokens.dtype == torch.int64
    assert b.positions.tolist() == [0, 1, 2, 0, 0, 1]
    assert b.cu_seqlens.tolist() == [0, 3, 4, 6]
    assert b.loss_mask.tolist() == [False, True, False, False, True, False]
    assert b.max_seqlen == 3 and b.num_tokens == 6


def test_pack_documents_loss_mask():
    rows = torch.arange(12).view(2, 6)
    b = pack_documents(list(rows), torch.tensor([3, 3]))
    # rows 2..4 of each document (prompt of 3) predict a trained token; row 5 (the last) has no next token
    assert b.loss_mask.tolist() == [False, False, True, True, True, False] * 2
    assert b.tokens.tolist() == list(range(12))
    # the same rule as whole rows, which the pipeline trains on
    assert trained_rows(torch.tensor([3, 3]), torch.tensor([6, 6]), 6).flatten().tolist() == b.loss_mask.tolist()

    b = pack_documents([rows[0, :4], rows[1]], torch.tensor([3, 3]))
    assert b.tokens.tolist() == [0, 1, 2, 3, 6, 7, 8, 9, 10, 11]
    assert b.cu_seqlens.tolist() == [0, 4, 10]
    assert b.positions.tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4, 5]
    assert b.loss_mask.tolist() == [False, False, True, False] + [False, False, True, True, True, False]
    # the trained rows predict exactly the response tokens (positions >= the prompt length)
    next_tokens = b.tokens.roll(-1)[b.loss_mask]
    assert next_tokens.tolist() == [3, 9, 10, 11]
    # prompts of different lengths: each document's own
    b = pack_documents([rows[0, :4], rows[1]], torch.tensor([2, 4]))
    assert b.loss_mask.tolist() == [False, True, True, False] + [False, False, False, True, True, False]
