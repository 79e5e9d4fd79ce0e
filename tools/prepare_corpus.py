"""Prepare a training corpus folder offline: split documents, train a tokenizer, tokenize.

    python tools/prepare_corpus.py --source stdlib --output data/stdlib-sp2048 --vocab-size 2048
    python tools/prepare_corpus.py --source notes.txt --output data/notes --vocab-size 1024
"""

from __future__ import annotations

import argparse
import os

from fbt_megatron.cli import plural, run_cli
from fbt_megatron.data.documents import SPLITS


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", default="stdlib",
                        help="'stdlib' (this Python's standard library), a text file, a folder of text files or a JSONL file")
    parser.add_argument("--split-documents", choices=SPLITS, default=None,
                        help="how text files become documents: file (one each), blank-line (paragraphs), line "
                             "(default: blank-line for a text file given alone, file for a folder's files)")
    parser.add_argument("--output", required=True, help="the corpus folder to create")
    parser.add_argument("--vocab-size", type=int, default=2048, help="of the sentencepiece tokenizer trained on train")
    parser.add_argument("--tokenizer", help="use this tokenizer file (copied in) instead of training one")
    parser.add_argument("--valid-fraction", type=float, default=0.02, help="of the documents (default: 0.02)")
    parser.add_argument("--json-key", default="text", help="the text field of JSONL lines (default: text)")
    parser.add_argument("--workers", type=int, default=os.cpu_count(), help="tokenizer processes (default: all cores)")
    args = parser.parse_args(argv)
    from fbt_megatron.data.corpus import prepare_corpus

    corpus = prepare_corpus(args.source, args.output, args.vocab_size, args.valid_fraction, args.tokenizer,
                            args.workers, json_key=args.json_key, split_documents=args.split_documents)
    for split in corpus.documents:
        print(f"{split}: {plural(corpus.documents[split], 'document')}, {plural(corpus.tokens[split], 'token')}")
    print(f"tokenizer: {corpus.tokenizer_path}")
    return 0


if __name__ == "__main__":
    run_cli(main)
