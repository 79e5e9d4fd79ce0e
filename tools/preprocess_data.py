"""Tokenize text into megatron-core .bin/.idx files, each document followed by EOD.

    python tools/preprocess_data.py --input docs.jsonl --tokenizer tokenizer.model --output-prefix data/train
"""

from __future__ import annotations

import argparse
import os

from fbt_megatron.cli import plural, run_cli


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", nargs="+", required=True,
                        help="JSONL files (a document a line), text files or folders")
    parser.add_argument("--json-key", default="text", help="the text field of JSONL lines (default: text)")
    parser.add_argument("--tokenizer", required=True, help="a sentencepiece .model, tokenizer.json or .tiktoken file")
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    parser.add_argument("--workers", type=int, default=os.cpu_count(), help="tokenizer processes (default: all cores)")
    args = parser.parse_args(argv)
    from fbt_megatron.data.preprocess import preprocess

    counts = preprocess(args.input, args.tokenizer, args.output_prefix, args.json_key, args.workers)
    print(f"{args.output_prefix}.bin/.idx: {plural(counts['documents'], 'document')}, {plural(counts['tokens'], 'token')}")
    return 0


if __name__ == "__main__":
    run_cli(main)
