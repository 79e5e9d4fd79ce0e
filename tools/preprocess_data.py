"""Tokenize text into megatron-core .bin/.idx files, each document followed by EOD.

    python tools/preprocess_data.py --input docs.jsonl --tokenizer tokenizer.model --output-prefix data/train
    python tools/preprocess_data.py --input 'shards/*.jsonl.zst' --tokenizer tokenizer.model \\
        --output-prefix data/train --shard 3/16      # writes data/train_shard-00003-of-00016.bin/.idx
"""

from __future__ import annotations

import argparse
import os

from fbt_megatron.common.cli import plural, run_cli
from fbt_megatron.common.logs import setup_logging
from fbt_megatron.data.documents import INPUTS_HELP, SPLITS


def main(argv=None) -> int:
    setup_logging()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", nargs="+", required=True, help=INPUTS_HELP)
    parser.add_argument("--json-key", default="text",
                        help="the text field of JSONL records, parquet and dataset columns (default: text)")
    parser.add_argument("--split-documents", choices=SPLITS, default="file",
                        help="how text files become documents: file (one each, the default), blank-line, line")
    parser.add_argument("--tokenizer", required=True, help="a sentencepiece .model, tokenizer.json or .tiktoken file")
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    parser.add_argument("--workers", type=int, default=os.cpu_count(), help="tokenizer processes (default: all cores)")
    parser.add_argument("--skip-bad-records", metavar="N|P%",
                        help="skip up to N bad records (or P%% of the records), counted by kind (default: stop at the first)")
    parser.add_argument("--shard", metavar="I/N",
                        help="tokenize only shard I of N of the inputs, into PREFIX_shard-IIIII-of-NNNNN "
                             "(skipped when complete); merge them with tools/merge_corpus.py")
    args = parser.parse_args(argv)
    from fbt_megatron.data.preprocess import preprocess
    from fbt_megatron.data.shards import parse_shard, preprocess_shard

    options = dict(json_key=args.json_key, workers=args.workers, split=args.split_documents,
                   skip_bad_records=args.skip_bad_records)
    if args.shard is None:
        prefix, counts, written = args.output_prefix, preprocess(args.input, args.tokenizer, args.output_prefix, **options), True
    else:
        prefix, counts, written = preprocess_shard(args.input, args.tokenizer, args.output_prefix, *parse_shard(args.shard),
                                                   **options)
    skipped = counts.get("skipped", {})
    kinds = ", ".join(f"{n:,} {kind}" for kind, n in sorted(skipped.items(), key=lambda item: -item[1]))
    print(f"{prefix}.bin/.idx: {plural(counts['documents'], 'document')}, {plural(counts['tokens'], 'token')}"
          + (f", skipped {plural(sum(skipped.values()), 'bad record')}: {kinds}" if skipped else "")
          + ("" if written else " (complete already, nothing to do)"))
    return 0


if __name__ == "__main__":
    run_cli(main)
