"""Make the inputs of train_configs/hf_tiny_cpu.toml: a tiny random Hugging Face checkpoint (with its
trained tokenizer) and a JSONL file of GSM8K-style word problems. Nothing is downloaded.

    python scripts/make_tiny_hf.py --out outputs/tiny_hf [--family llama3|qwen3]

writes <out>/model (config.json, model.safetensors, tokenizer.json, tokenizer_config.json),
<out>/train.jsonl and <out>/test.jsonl ({"prompt": ..., "answer": "... #### <number>"} per line).
"""
import argparse

from titan_draft.tiny_hf import write_demo_inputs


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
