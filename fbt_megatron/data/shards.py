"""Preparation over many machines: the inputs cut into shards, one ``.bin/.idx`` each, then merged.

``--shard I/N`` gives shard I (0-based) of N a contiguous run of the inputs' files (saved datasets
count as one), balanced by bytes on disk, so the shards in order hold the documents in the order
one process reads them. Shard I of prefix P is written as ``P_shard-IIIII-of-NNNNN.bin/.idx``
(atomically, ``preprocess``), then what made it is recorded beside them in ``P_shard-IIIII-of-NNNNN.json``
(atomically, last; ``made_by``): its input files (paths, sizes, modification times), the tokenizer's
sha256, the text key and the document split. A shard is complete when its two files are there and
its record matches what would make it now; a rerun (a requeued array task) skips complete shards
and redoes the others, saying why in one line (``shard 3: redone, its tokenizer changed``).
``merge`` concatenates prefixes in order through megatron-core's
``IndexedDatasetBuilder.add_index``: the merged files are byte for byte those one process writes
from all the inputs.
"""

from __future__ import annotations

import json
import logging
import os
import re

from megatron.core.datasets.indexed_dataset import IndexedDataset, get_bin_path, get_idx_path

from fbt_megatron.common.io import atomic_write
from fbt_megatron.data.documents import Source, sources
from fbt_megatron.data.preprocess import indexed_outputs, preprocess
from fbt_megatron.data.tokenizer import load_tokenizer

log = logging.getLogger(__name__)

RECORD_FORMAT = "fbt-megatron shard"


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
                     json_key: str = "text", split: str = "file", **kwargs) -> tuple[str, dict, bool]:
    """Shard `index` of `count` of the inputs tokenized (``preprocess`` with `json_key`, `split` and
    `kwargs`), unless it is complete already (``stale`` finds nothing); returns (its prefix, its
    counts, whether it was written now)."""
    prefix = shard_prefix(output_prefix, index, count)
    units = shard_units(inputs, index, count)
    record = made_by(units, tokenizer_path, json_key, split)
    why = stale(prefix, record)
    if why is None:
        return prefix, counts(prefix), False
    if any(os.path.exists(p) for p in (get_bin_path(prefix), get_idx_path(prefix), record_path(prefix))):
        log.info(f"shard {index}: redone, {why}")
        if os.path.exists(record_path(prefix)):
            os.remove(record_path(prefix))  # not complete from here on, whatever stops the redo
    written = preprocess(units, tokenizer_path, prefix, json_key=json_key, split=split, **kwargs)
    _write_record(prefix, record)
    return prefix, written, True


def record_path(prefix: str) -> str:
    """Where what made the shard `prefix` is recorded."""
    return prefix + ".json"


def made_by(units: list[Source], tokenizer_path: str, json_key: str, split: str) -> dict:
    """What makes a shard: its input files (each file of a saved dataset) with their sizes and
    modification times, the tokenizer's sha256, the text key and the document split."""
    stats = [(os.path.abspath(path), os.stat(path)) for unit in units for path in unit.files]
    return {
        "format": RECORD_FORMAT,
        "inputs": [[path, stat.st_size, stat.st_mtime_ns] for path, stat in stats],
        "tokenizer_sha256": load_tokenizer(tokenizer_path).sha256,
        "json_key": json_key,
        "split_documents": split,
    }


def stale(prefix: str, record: dict) -> str | None:
    """Why shard `prefix` is not complete for `record` (``made_by``), in words; None when it is."""
    if not complete(prefix):
        return "its .bin/.idx are not both there"
    try:
        with open(record_path(prefix)) as f:
            recorded = json.load(f)
    except FileNotFoundError:
        return f"it has no record of what made it ({os.path.basename(record_path(prefix))})"
    except (OSError, ValueError):
        recorded = None
    if not isinstance(recorded, dict) or recorded.get("format") != RECORD_FORMAT or recorded.keys() != record.keys():
        return f"its record {os.path.basename(record_path(prefix))} is unreadable"
    if recorded["tokenizer_sha256"] != record["tokenizer_sha256"]:
        return "its tokenizer changed"
    if recorded["inputs"] != record["inputs"]:
        return _inputs_change(recorded["inputs"], record["inputs"])
    changed = [key for key in ("json_key", "split_documents") if recorded[key] != record[key]]
    if changed:
        return f"its --{changed[0].replace('_', '-')} changed"
    return None


def _inputs_change(before: list, now: list) -> str:
    """Which of a shard's input files changed, in words."""
    old, new = ({path: rest for path, *rest in files} for files in (before, now))
    for path, rest in new.items():
        if path not in old:
            return f"its inputs changed ({path} is new to it)"
        if old[path] != rest:
            return f"its input {path} changed (size or modification time)"
    gone = [path for path in old if path not in new]
    return f"its inputs changed ({gone[0]} is no longer one)" if gone else "its inputs changed (their order)"


def _write_record(prefix: str, record: dict) -> None:
    """The record of a shard just written, atomically and synced: the last thing that makes it complete."""
    atomic_write(record_path(prefix), json.dumps(record, indent=1))


def complete(prefix: str) -> bool:
    """Whether `prefix` was written whole (``io.publish_indexed``: its old .idx is removed first, the
    new one renamed into place last)."""
    return os.path.isfile(get_bin_path(prefix)) and os.path.isfile(get_idx_path(prefix))


def counts(prefix: str) -> dict:
    """``{"documents": n, "tokens": n}`` of a written prefix."""
    data = IndexedDataset(prefix, mmap=True)
    return {"documents": len(data), "tokens": int(data.sequence_lengths.sum())}


def merge(prefixes: list[str], output_prefix: str) -> dict:
    """Concatenate `prefixes` in order into `output_prefix`.bin/.idx (atomically); returns its counts.
    Prefixes recorded (shards) as made by different tokenizers are refused."""
    missing = [p for p in prefixes if not complete(p)]
    if missing:
        raise FileNotFoundError(f"{missing[0]}.bin/.idx not there (of {len(missing)} missing): prepare every shard first")
    tokenizers = {}  # the tokenizer of each prefix that has a shard's record: one tokenizer for all
    for prefix in prefixes:
        try:
            with open(record_path(prefix)) as f:
                tokenizers.setdefault(json.load(f)["tokenizer_sha256"], []).append(prefix)
        except (OSError, ValueError, KeyError, TypeError):
            continue
    if len(tokenizers) > 1:
        groups = "; ".join(f"{os.path.basename(ps[0])}{f' and {len(ps) - 1} more' if len(ps) > 1 else ''}: tokenizer "
                           f"sha256 {sha[:12]}…" for sha, ps in tokenizers.items())
        raise ValueError(f"the prefixes were tokenized with different tokenizers ({groups}): tokenize them again with one "
                         "(tools/preprocess_data.py --tokenizer), the ids of one tokenizer mean other pieces in another")
    dtypes = {p: IndexedDataset(p, mmap=True).index.dtype for p in prefixes}
    if len(set(dtypes.values())) > 1:
        raise ValueError(f"the prefixes have different token types ({', '.join(f'{p}: {d.__name__}' for p, d in dtypes.items())}): "
                         f"tokenized with different tokenizers")
    with indexed_outputs([output_prefix], dtypes[prefixes[0]]) as [builder]:
        for prefix in prefixes:
            builder.add_index(prefix)
    return counts(output_prefix)
