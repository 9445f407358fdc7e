"""The sorting task, its tokenizer, a real Hugging Face tokenizer through torchtitan, and packing."""
import json

import torch

from titan_draft.packing import cu_seqlens_from_lengths, pack, pack_rows, positions_from_cu_seqlens
from titan_draft.task import BOS, EOS, FIRST_LETTER, SEP, CharTokenizer, SortTask, load_hf_tokenizer


def test_rewards_exact_match_only():
    task = SortTask(num_items=4, alphabet_size=6)
    tok = task.tokenizer
    prompts = torch.tensor([[BOS, *tok.encode("dbca"), SEP]] * 5)
    good = [*tok.encode("abcd"), EOS]
    responses = torch.tensor([
        good + [0, 7],                             # right, junk after EOS is ignored
        [*tok.encode("abdc"), EOS, 0, 0],          # one swap
        [*tok.encode("abcd"), 0, 0, 0],            # no EOS
        [*tok.encode("abc"), EOS, 0, 0, 0],        # too short
        [*tok.encode("abcdd"), EOS, 0],            # extra letter
    ])
    assert task.rewards(prompts, responses).tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert task.rewards(prompts[:1], torch.tensor([good[:-1]])).tolist() == [0.0]  # cut before EOS


def test_answers_sorted_with_duplicates():
    task = SortTask(num_items=5, alphabet_size=4)
    prompts = torch.tensor([[BOS, *task.tokenizer.encode("cabac"), SEP]])
    assert task.tokenizer.decode(task.answers(prompts)[0]) == "aabcc$"


def test_sft_batch_swap_prob_zero_and_one():
    torch.manual_seed(0)
    task = SortTask(num_items=7, alphabet_size=16)  # odd: the last letter has no partner
    P, A = task.prompt_len, task.answer_len
    rows = task.sft_batch(64, torch.Generator().manual_seed(1), swap_prob=0.0)
    assert rows.shape == (64, P + A)
    prompts, answers = rows[:, :P], rows[:, P:]
    assert (prompts[:, 0] == BOS).all() and (prompts[:, -1] == SEP).all()
    assert ((prompts[:, 1:-1] >= FIRST_LETTER) & (prompts[:, 1:-1] < FIRST_LETTER + 16)).all()
    assert torch.equal(answers, task.answers(prompts))
    assert task.rewards(prompts, answers).sum() == 64

    rows = task.sft_batch(64, torch.Generator().manual_seed(1), swap_prob=1.0)
    prompts, answers = rows[:, :P], rows[:, P:]
    right = task.answers(prompts)
    for got, want in zip(answers.tolist(), right.tolist()):
        swapped = [want[1], want[0], want[3], want[2], want[5], want[4], want[6], EOS]
        assert got == swapped


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


def test_pack_rows_loss_mask():
    rows = torch.arange(12).view(2, 6)
    b = pack_rows(rows, first_trained_row=2)
    # rows 2..4 of each document predict a trained token; row 5 (the last) has no next token
    assert b.loss_mask.tolist() == [False, False, True, True, True, False] * 2
    assert b.tokens.tolist() == list(range(12))

    b = pack_rows(rows, first_trained_row=2, lengths=torch.tensor([4, 6]))
    assert b.tokens.tolist() == [0, 1, 2, 3, 6, 7, 8, 9, 10, 11]
    assert b.cu_seqlens.tolist() == [0, 4, 10]
    assert b.positions.tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4, 5]
    assert b.loss_mask.tolist() == [False, False, True, False] + [False, False, True, True, True, False]
    # the trained rows predict exactly the response tokens (positions >= first_trained_row + 1)
    next_tokens = b.tokens.roll(-1)[b.loss_mask]
    assert next_tokens.tolist() == [3, 9, 10, 11]
