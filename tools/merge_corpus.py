"""Merge .bin/.idx prefixes (the shards of tools/preprocess_data.py --shard) into one, in order.

    python tools/merge_corpus.py --output-prefix data/train --shards 16
    python tools/merge_corpus.py --output-prefix data/all --input data/a_text_document data/b_text_document
"""

from __future__ import annotations

import argparse

from fbt_megatron.common.cli import plural, run_cli
from fbt_megatron.common.logs import setup_logging


def main(argv=None) -> int:
    setup_logging()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--shards", type=int, metavar="N", help="merge PREFIX_shard-00000-of-N ... of --output-prefix")
    what.add_argument("--input", nargs="+", metavar="PREFIX", help="merge these prefixes, in this order")
    args = parser.parse_args(argv)
    from fbt_megatron.data.shards import merge, shard_prefix

    if args.shards is not None and args.shards < 1:
        raise ValueError(f"--shards {args.shards}: give 1 or more")
    prefixes = args.input or [shard_prefix(args.output_prefix, i, args.shards) for i in range(args.shards)]
    counts = merge(prefixes, args.output_prefix)
    print(f"{args.output_prefix}.bin/.idx: {plural(len(prefixes), 'prefix', 'prefixes')} merged, "
          f"{plural(counts['documents'], 'document')}, {plural(counts['tokens'], 'token')}")
    return 0


if __name__ == "__main__":
    run_cli(main)
