"""Make the inputs of train_configs/hf_tiny_cpu.toml: a tiny random Hugging Face checkpoint (with its
trained tokenizer) and a JSONL file of GSM8K-style word problems. Nothing is downloaded.

    python scripts/make_tiny_hf.py --out outputs/tiny_hf [--family llama3|qwen3]

writes <out>/model (config.json, model.safetensors, tokenizer.json, tokenizer_config.json),
<out>/train.jsonl and <out>/test.jsonl ({"prompt": ..., "answer": "... #### <number>"} per line).
"""
import argparse
import os

from titan_draft.tiny_hf import arithmetic_problems, write_jsonl, write_tiny_checkpoint


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

    train = arithmetic_problems(args.train_problems, seed=args.seed)
    test = arithmetic_problems(args.test_problems, seed=args.seed + 1)
    model = os.path.join(args.out, "model")
    size = write_tiny_checkpoint(model, args.family, [f"{p['prompt']} {p['answer']}" for p in train],
                                 vocab_size=args.vocab_size, seed=args.seed)
    write_jsonl(os.path.join(args.out, "train.jsonl"), train)
    write_jsonl(os.path.join(args.out, "test.jsonl"), test)
    print(f"wrote {model} ({args.family}, tokenizer of {size} ids) and {len(train)} + {len(test)} problems "
          f"in {args.out}/train.jsonl, test.jsonl")


if __name__ == "__main__":
    main()
