"""Make the inputs of train_configs/hf_tiny_cpu.toml: a tiny random Hugging Face checkpoint (with its
trained tokenizer) and a JSONL file of GSM8K-style word problems. Nothing is downloaded.

    python scripts/make_tiny_hf.py --out outputs/tiny_hf [--family llama3|qwen3]

writes <out>/model (config.json, model.safetensors, tokenizer.json, tokenizer_config.json),
<out>/train.jsonl and <out>/test.jsonl ({"prompt": ..., "answer": "... #### <number>"} per line).

The tests make their checkpoints and problem sets with the functions here too. Needs the dev extra
(transformers, tokenizers): transformers initialises the model at random and the tokenizer is trained
here, on the texts it will tokenize. A checkpoint folder holds what a hub checkpoint holds: config.json,
model.safetensors (or shards and model.safetensors.index.json), tokenizer.json and tokenizer_config.json.
"""
import argparse
import json
import os
import random
import string
from dataclasses import dataclass

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from titan_draft.infra.io import atomic_directory, atomic_file

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")  # ids 0, 1, 2, 3
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
# Every printable ASCII character is a token of its own, so no text of the demo data is <unk>.
ALPHABET = sorted(set(string.printable) - set("\r\x0b\x0c"))
CHAT_TEMPLATE = ("{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant: {% endif %}")
# Small enough for CPU tests; head_dim differs from hidden / heads in qwen3, as in the real Qwen3 models.
SIZES = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             initializer_range=0.2)


def _llama_config(vocab_size: int) -> LlamaConfig:
    # Llama-3.1 RoPE scaling with a short original context, so that the scaled, the smoothed and
    # the unscaled frequency bands all occur at head_dim 16.
    rope = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                original_max_position_embeddings=64)
    return LlamaConfig(vocab_size=vocab_size, **SIZES, rms_norm_eps=1e-5, max_position_embeddings=1024,
                       rope_parameters=rope, tie_word_embeddings=False, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
                       pad_token_id=PAD_ID)


def _qwen3_config(vocab_size: int) -> Qwen3Config:
    # Tied embeddings, as the small Qwen3 checkpoints have them.
    return Qwen3Config(vocab_size=vocab_size, **SIZES, head_dim=32, rms_norm_eps=1e-6, max_position_embeddings=1024,
                       rope_parameters=dict(rope_type="default", rope_theta=1000000.0), tie_word_embeddings=True,
                       bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)


HF_MODELS = {"llama3": (_llama_config, LlamaForCausalLM), "qwen3": (_qwen3_config, Qwen3ForCausalLM)}


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """A byte-pair tokenizer of at most vocab_size ids: the specials, the printable ASCII characters,
    then the merges most frequent in `texts`; spaces are kept as a word-start marker (Metaspace), so
    decode(encode(text)) == text."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=ALPHABET, show_progress=False)
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def write_tiny_checkpoint(folder: str, name: str, texts: list[str], *, vocab_size: int = 384, seed: int = 0,
                          max_shard_size: str | None = None) -> int:
    """A random transformers model of family `name` ("llama3": Llama-3.1 style with llama3 RoPE
    scaling; "qwen3": Qwen3 with head_dim 32 and tied embeddings) with vocab_size embedding rows,
    float32, and a tokenizer trained on `texts`, written atomically into `folder`.
    max_shard_size (e.g. "40KB") splits the weights into shards with an index. Returns the
    tokenizer's size (<= vocab_size)."""
    make_config, model_cls = HF_MODELS[name]
    tokenizer = train_tokenizer(texts, vocab_size)
    torch.manual_seed(seed)
    model = model_cls(make_config(vocab_size)).float()
    with atomic_directory(folder) as tmp:
        model.save_pretrained(tmp, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
        tokenizer.save(os.path.join(tmp, "tokenizer.json"))
        tokenizer_config = dict(zip(("pad_token", "bos_token", "eos_token", "unk_token"), SPECIAL_TOKENS),
                                tokenizer_class="PreTrainedTokenizerFast", model_max_length=1024,
                                add_bos_token=False, add_eos_token=False, chat_template=CHAT_TEMPLATE)
        with open(os.path.join(tmp, "tokenizer_config.json"), "w") as f:
            json.dump(tokenizer_config, f, indent=2)
    return tokenizer.get_vocab_size(with_added_tokens=True)


NAMES = ("Ana", "Ben", "Carla", "Dev", "Emma", "Farid", "Grace", "Hugo", "Ines", "Jonas")
ITEMS = ("apples", "pencils", "stickers", "marbles", "books", "cookies", "shells", "coins")


def arithmetic_problems(n: int, seed: int = 0) -> list[dict]:
    """n GSM8K-style word problems (one or two steps of +, -, x), each {"prompt": question,
    "answer": worked solution ending in "#### <number>"}; prompts differ in length."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        who, item = rng.choice(NAMES), rng.choice(ITEMS)
        a, b, kind = rng.randint(2, 60), rng.randint(2, 30), rng.randrange(4)
        if kind == 0:
            question = f"{who} has {a} {item} and gets {b} more. How many {item} does {who} have now?"
            steps, result = f"{a} + {b} = {a + b}.", a + b
        elif kind == 1:
            a += b  # never negative
            question = f"{who} had {a} {item} and gave {b} of them away. How many {item} are left?"
            steps, result = f"{a} - {b} = {a - b}.", a - b
        elif kind == 2:
            a = a % 9 + 2
            question = f"{who} buys {a} bags with {b} {item} in each bag. How many {item} is that in total?"
            steps, result = f"{a} x {b} = {a * b}.", a * b
        else:
            c = rng.randint(1, a + b)
            question = (f"{who} has {a} {item}, finds {b} more and then gives {c} to a friend. "
                        f"How many {item} does {who} have in the end?")
            steps, result = f"{a} + {b} = {a + b}. {a + b} - {c} = {a + b - c}.", a + b - c
        rows.append({"prompt": question, "answer": f"{steps}\n#### {result}"})
    return rows


def problem_texts(problems: list[dict]) -> list[str]:
    """Prompt and answer of each problem as one text: what the tokenizer is trained on."""
    return [f"{p['prompt']} {p['answer']}" for p in problems]


def write_jsonl(path: str, rows: list[dict]) -> None:
    """One JSON object per line, written atomically."""
    with atomic_file(path) as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


@dataclass
class DemoInputs:
    model: str
    """The checkpoint folder: model.hf_assets_path and checkpoint.initial_load_path."""
    train: str
    """training.dataset_path."""
    test: str
    tokenizer_size: int


def write_demo_inputs(out: str, family: str = "llama3", *, vocab_size: int = 384, train_problems: int = 2000,
                      test_problems: int = 200, seed: int = 0) -> DemoInputs:
    """<out>/model (write_tiny_checkpoint, its tokenizer trained on the training problems),
    <out>/train.jsonl and <out>/test.jsonl (arithmetic_problems, {"prompt", "answer"} per line)."""
    problems = arithmetic_problems(train_problems, seed=seed)
    model, train, test = (os.path.join(out, name) for name in ("model", "train.jsonl", "test.jsonl"))
    size = write_tiny_checkpoint(model, family, problem_texts(problems), vocab_size=vocab_size, seed=seed)
    write_jsonl(train, problems)
    write_jsonl(test, arithmetic_problems(test_problems, seed=seed + 1))
    return DemoInputs(model, train, test, size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="outputs/tiny_hf", help="folder for the model and the data")
    parser.add_argument("--family", choices=("llama3", "qwen3"), default="llama3",
                        help="llama3: Llama-3.1 style (llama3 RoPE scaling); qwen3: Qwen3 (tied embeddings)")
    parser.add_argument("--vocab-size", type=int, default=384, help="embedding rows (the tokenizer gets <= this)")
    parser.add_argument("--train-problems", type=int, default=2000)
    parser.add_argument("--test-problems", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    inputs = write_demo_inputs(args.out, args.family, vocab_size=args.vocab_size, train_problems=args.train_problems,
                               test_problems=args.test_problems, seed=args.seed)
    print(f"wrote {inputs.model} ({args.family}, tokenizer of {inputs.tokenizer_size} ids), {inputs.train} "
          f"({args.train_problems} problems) and {inputs.test} ({args.test_problems})")


if __name__ == "__main__":
    main()
