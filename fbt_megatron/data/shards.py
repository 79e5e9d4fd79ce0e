"""Preparation over many machines: the inputs cut into shards, one ``.bin/.idx`` each, then merged.

``--shard I/N`` gives shard I (0-based) of N a contiguous run of the inputs' files (saved datasets
count as one), balanced by bytes on disk, so the shards in order hold the documents in the order
one process reads them. Shard I of prefix P is written as ``P_shard-IIIII-of-NNNNN.bin/.idx``
(atomically, ``preprocess``); a shard whose two files are there is complete and skipped, so a
rerun (a requeued array task) redoes only what is missing. ``merge`` concatenates prefixes in order
through megatron-core's ``IndexedDatasetBuilder.add_index``: the merged files are byte for byte
those one process writes from all the inputs.
"""

from __future__ import annotations

import os
import re

from megatron.core.datasets.indexed_dataset import IndexedDataset, get_bin_path, get_idx_path

from fbt_megatron.data.documents import Source, sources
from fbt_megatron.data.preprocess import indexed_outputs, preprocess


def parse_shard(text: str) -> tuple[int, int]:
    """(I, N) from "I/N", 0 <= I < N."""
    match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if not match or not int(match[1]) < int(match[2]):
        raise ValueError(f"--shard {text!r}: give I/N with 0 <= I < N, e.g. --shard 0/16")
    return int(match[1]), int(match[2])


def shard_prefix(prefix: str, index: int, count: int) -> str:
    return f"{prefix}_shard-{index:05d}-of-{count:05d}"


def assign(units: list[Source], count: int) -> list[list[Source]]:
    """The units of each of `count` shards: contiguous, balanced by size (a unit goes to the shard
    its middle byte falls in); an error when a shard would get none."""
    if len(units) < count:
        raise ValueError(f"{count} shards of {len(units)} input file{'s' * (len(units) != 1)}: "
                         f"use at most {len(units)} shards (a file is not cut)")
    sizes = [max(unit.size, 1) for unit in units]
    total, before, shards = sum(sizes), 0, [[] for _ in range(count)]
    for unit, size in zip(units, sizes):
        shards[min(count - 1, (2 * before + size) * count // (2 * total))].append(unit)
        before += size
    empty = [i for i, shard in enumerate(shards) if not shard]
    if empty:
        raise ValueError(f"{count} shards of {len(units)} input files: shard {empty[0]} gets none, the files are too "
                         f"unequal in size; use fewer shards")
    return shards


def shard_units(inputs: list[str], index: int, count: int) -> list[Source]:
    """Shard `index` of `count` of the inputs' units."""
    return assign(sources(inputs), count)[index]


def preprocess_shard(inputs: list[str], tokenizer_path: str, output_prefix: str, index: int, count: int,
                     **kwargs) -> tuple[str, dict, bool]:
    """Shard `index` of `count` of the inputs tokenized (``preprocess`` with `kwargs`), unless it
    is complete already; returns (its prefix, its counts, whether it was written now)."""
    prefix = shard_prefix(output_prefix, index, count)
    if complete(prefix):
        return prefix, counts(prefix), False
    return prefix, preprocess(shard_units(inputs, index, count), tokenizer_path, prefix, **kwargs), True


def complete(prefix: str) -> bool:
    """Whether `prefix` was written whole (its .idx is renamed into place last)."""
    return os.path.isfile(get_bin_path(prefix)) and os.path.isfile(get_idx_path(prefix))


def counts(prefix: str) -> dict:
    """``{"documents": n, "tokens": n}`` of a written prefix."""
    data = IndexedDataset(prefix, mmap=True)
    return {"documents": len(data), "tokens": int(data.sequence_lengths.sum())}


def merge(prefixes: list[str], output_prefix: str) -> dict:
    """Concatenate `prefixes` in order into `output_prefix`.bin/.idx (atomically); returns its counts."""
    missing = [p for p in prefixes if not complete(p)]
    if missing:
        raise FileNotFoundError(f"{missing[0]}.bin/.idx not there (of {len(missing)} missing): prepare every shard first")
    dtypes = {p: IndexedDataset(p, mmap=True).index.dtype for p in prefixes}
    if len(set(dtypes.values())) > 1:
        raise ValueError(f"the prefixes have different token types ({', '.join(f'{p}: {d.__name__}' for p, d in dtypes.items())}): "
                         f"tokenized with different tokenizers")
    with indexed_outputs([output_prefix], dtypes[prefixes[0]]) as [builder]:
        for prefix in prefixes:
            builder.add_index(prefix)
    return counts(output_prefix)
