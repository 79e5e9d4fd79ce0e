"""Train a sentencepiece BPE tokenizer (byte fallback, whitespace kept exactly) for source code.

    python tools/train_tokenizer.py --input data/code/ --vocab-size 2048 --output tokenizer.model
"""

from __future__ import annotations

import argparse

from fbt_megatron.cli import run_cli


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", nargs="+", required=True,
                        help="JSONL files (a document a line), text files or folders")
    parser.add_argument("--json-key", default="text", help="the text field of JSONL lines (default: text)")
    parser.add_argument("--vocab-size", type=int, required=True)
    parser.add_argument("--output", required=True, help="the sentencepiece .model file to write")
    args = parser.parse_args(argv)
    from fbt_megatron.data.tokenizer import load_tokenizer
    from fbt_megatron.data.tokenizer_training import train_tokenizer

    tokenizer = load_tokenizer(train_tokenizer(args.input, args.output, args.vocab_size, args.json_key))
    print(f"{args.output}: sentencepiece BPE, {tokenizer.vocab_size:,} pieces")
    return 0


if __name__ == "__main__":
    run_cli(main)
