"""A synthetic verifiable task that a tiny policy learns on a laptop: sort letters.

Sequence layout (one document): BOS  c_1 .. c_n  SEP  sorted(c)  EOS. The prompt ends at SEP,
the response is the answer and EOS; the reward is 1 for an exact match, else 0.
SFT data can carry a systematic error (adjacent answer pairs swapped with probability
`swap_prob`) that RL then corrects: that moves the policy, which is what makes a frozen draft decay.
"""
import torch

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
        return "".join(specials.get(int(i), chr(ord("a") + int(i) - FIRST_LETTER)) for i in ids)


class SortTask:
    def __init__(self, num_items: int, alphabet_size: int, vocab_size: int | None = None):
        self.num_items = num_items
        self.tokenizer = CharTokenizer(alphabet_size, vocab_size)

    @property
    def prompt_len(self) -> int:
        return self.num_items + 2

    @property
    def answer_len(self) -> int:
        return self.num_items + 1  # letters + EOS

    def sample_prompts(self, n: int, generator: torch.Generator) -> torch.Tensor:
        """[n, prompt_len] int64: BOS, n distinct-or-not random letters, SEP."""
        letters = torch.randint(0, self.tokenizer.alphabet_size, (n, self.num_items), generator=generator)
        bos = torch.full((n, 1), BOS)
        sep = torch.full((n, 1), SEP)
        return torch.cat([bos, letters + FIRST_LETTER, sep], dim=1)

    def answers(self, prompts: torch.Tensor) -> torch.Tensor:
        """[n, answer_len]: the sorted letters, then EOS."""
        letters = prompts[:, 1:-1].sort(dim=1).values
        return torch.cat([letters, torch.full((len(prompts), 1), EOS)], dim=1)

    def sft_batch(self, n: int, generator: torch.Generator, swap_prob: float) -> torch.Tensor:
        """[n, prompt_len + answer_len] full documents, answers corrupted by adjacent swaps."""
        prompts = self.sample_prompts(n, generator)
        answers = self.answers(prompts)
        swap = torch.rand(n, self.num_items // 2, generator=generator) < swap_prob
        pairs = answers[:, : 2 * (self.num_items // 2)].view(n, -1, 2)
        pairs = torch.where(swap[..., None], pairs.flip(-1), pairs)
        answers[:, : pairs.shape[1] * 2] = pairs.reshape(n, -1)
        return torch.cat([prompts, answers], dim=1)

    def rewards(self, prompts: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
        """[n] float: 1.0 where the response (padded with anything after EOS) is exactly right."""
        want = self.answers(prompts)
        got = responses[:, : self.answer_len]
        if got.shape[1] < self.answer_len:
            return torch.zeros(len(prompts))
        return (got == want).all(dim=1).float()


def load_hf_tokenizer(path: str):
    """A real tokenizer from a local Hugging Face folder (tokenizer.json), through torchtitan."""
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    return HuggingFaceTokenizer(path)
