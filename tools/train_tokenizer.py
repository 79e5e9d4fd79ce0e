"""Train a sentencepiece BPE tokenizer (byte fallback, whitespace kept exactly) for source code.

    python tools/train_tokenizer.py --input data/code/ --vocab-size 2048 --output tokenizer.model
    python tools/train_tokenizer.py --input 'web/*.parquet' --vocab-size 32000 --sample-bytes 1G --threads 64 \\
        --output tokenizer.model
"""

from __future__ import annotations

import argparse

from fbt_megatron.common.cli import run_cli
from fbt_megatron.common.logs import setup_logging
from fbt_megatron.data.documents import INPUTS_HELP, SPLITS


def main(argv=None) -> int:
    setup_logging()
    from fbt_megatron.data.tokenizer_training import SAMPLE_BYTES, parse_size

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", nargs="+", required=True, help=INPUTS_HELP)
    parser.add_argument("--json-key", default="text",
                        help="the text field of JSONL records, parquet and dataset columns (default: text)")
    parser.add_argument("--split-documents", choices=SPLITS, default="file",
                        help="how text files become documents: file (one each, the default), blank-line, line")
    parser.add_argument("--vocab-size", type=int, required=True)
    parser.add_argument("--output", required=True, help="the sentencepiece .model file to write")
    parser.add_argument("--sample-bytes", type=parse_size, default=SAMPLE_BYTES, metavar="SIZE",
                        help=f"train on a seeded sample of at most this much text, e.g. 500M (default {SAMPLE_BYTES:,})")
    parser.add_argument("--seed", type=int, default=0, help="of the sample (default 0)")
    parser.add_argument("--threads", type=int, default=1,
                        help="sentencepiece threads (default 1: the model then is the same on any machine)")
    parser.add_argument("--skip-bad-records", metavar="N|P%",
                        help="skip up to N bad records (or P%% of the records), counted by kind (default: stop at the first)")
    args = parser.parse_args(argv)
    from fbt_megatron.data.tokenizer import load_tokenizer
    from fbt_megatron.data.tokenizer_training import train_tokenizer

    path = train_tokenizer(args.input, args.output, args.vocab_size, args.json_key, sample_bytes=args.sample_bytes,
                           seed=args.seed, threads=args.threads, skip_bad_records=args.skip_bad_records,
                           split=args.split_documents)
    print(f"{args.output}: sentencepiece BPE, {load_tokenizer(path).vocab_size:,} pieces")
    return 0


if __name__ == "__main__":
    run_cli(main)
