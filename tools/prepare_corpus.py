"""Prepare a training corpus folder offline: split documents, train a tokenizer, tokenize.

    python tools/prepare_corpus.py --source stdlib --output data/stdlib-sp2048 --vocab-size 2048
    python tools/prepare_corpus.py --source notes.txt --output data/notes --vocab-size 1024
    python tools/prepare_corpus.py --source 'web/*.jsonl.zst' --output data/web --vocab-size 32000 \\
        --tokenizer-sample-bytes 1G --skip-bad-records 0.01%
"""

from __future__ import annotations

import argparse
import os

from fbt_megatron.common.cli import plural, run_cli
from fbt_megatron.common.logs import setup_logging
from fbt_megatron.data.documents import SPLITS
from fbt_megatron.data.tokenizer_training import SAMPLE_BYTES, parse_size


def main(argv=None) -> int:
    setup_logging()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", default="stdlib",
                        help="'stdlib' (this Python's standard library), or a file, folder or glob pattern of "
                             ".jsonl(.gz/.zst), .parquet, datasets.save_to_disk folders or text (.txt, .gz, ...)")
    parser.add_argument("--split-documents", choices=SPLITS, default=None,
                        help="how text files become documents: file (one each), blank-line (paragraphs), line "
                             "(default: blank-line for a text file given alone, file for a folder's files)")
    parser.add_argument("--output", required=True, help="the corpus folder to create")
    parser.add_argument("--vocab-size", type=int, default=2048, help="of the sentencepiece tokenizer trained on train")
    parser.add_argument("--tokenizer", help="use this tokenizer file (copied in) instead of training one")
    parser.add_argument("--tokenizer-sample-bytes", type=parse_size, default=SAMPLE_BYTES, metavar="SIZE",
                        help=f"train the tokenizer on a seeded sample of at most this much of the train text, "
                             f"e.g. 500M (default {SAMPLE_BYTES:,}); memory stays bounded by it")
    parser.add_argument("--tokenizer-threads", type=int, default=1,
                        help="sentencepiece threads (default 1: the model then is the same on any machine)")
    parser.add_argument("--seed", type=int, default=0, help="of the tokenizer's sample (default 0)")
    parser.add_argument("--valid-fraction", type=float, default=0.02, help="of the documents (default: 0.02)")
    parser.add_argument("--json-key", default="text",
                        help="the text field of JSONL records, parquet and dataset columns (default: text)")
    parser.add_argument("--skip-bad-records", metavar="N|P%",
                        help="skip up to N bad records (or P%% of the records), counted by kind (default: stop at the first)")
    parser.add_argument("--workers", type=int, default=os.cpu_count(), help="tokenizer processes (default: all cores)")
    args = parser.parse_args(argv)
    from fbt_megatron.data.corpus import prepare_corpus

    corpus = prepare_corpus(args.source, args.output, args.vocab_size, args.valid_fraction, args.tokenizer,
                            args.workers, json_key=args.json_key, split_documents=args.split_documents,
                            tokenizer_sample_bytes=args.tokenizer_sample_bytes, tokenizer_threads=args.tokenizer_threads,
                            seed=args.seed, skip_bad_records=args.skip_bad_records)
    for split in corpus.documents:
        print(f"{split}: {plural(corpus.documents[split], 'document')}, {plural(corpus.tokens[split], 'token')}")
    print(f"tokenizer: {corpus.tokenizer_path}")
    return 0


if __name__ == "__main__":
    run_cli(main)
