"""State tracking: the label at each position is the state so far, a running product in a small group.

A sequence x_1 … x_T of group elements is drawn uniformly; the label at position t is the state
s_t = s_{t−1} · x_t, with s_0 the identity. Three groups, from easy to hard:

    parity     Z_2: the running xor of a bit stream
    sum_mod5   Z_5: the running sum mod 5
    s3         S_3: the running composition of permutations of 3 elements (not commutative)

The state at position t depends on every earlier input, one step at a time: a transformer of fixed
depth has to learn a shortcut, which in practice holds only for the lengths it was trained on, while
FBT's fused passes are steps of a recurrence over positions (pass j is exact up to position j, so
k = T passes are the sequential recurrence). This is where latent feedback should show even at CPU
scale.

A prepared task folder is read like a corpus (``data.corpus: "state_tracking:parity"`` prepares
``data.data_path`` on first use)::

    task.json                                          manifest: task, sequence length, sequences per split
    train_tokens.bin/.idx, train_labels.bin/.idx       Megatron IndexedDatasets, one sequence per example
    valid_tokens.bin/.idx, valid_labels.bin/.idx

Tokens and labels share one vocabulary, the group's elements (element 0 is the identity). The
folder is written whole (``io.atomic_folder``); an existing folder is never modified.
"""

from __future__ import annotations

import itertools
import json
import os
from dataclasses import dataclass
from typing import Optional

import numpy
import torch
from megatron.core.datasets.indexed_dataset import DType, IndexedDataset, IndexedDatasetBuilder, get_bin_path, get_idx_path

from fbt_megatron.common.io import FolderExists, atomic_folder
from fbt_megatron.data.tokenizer import padded_vocab_size

SOURCE_PREFIX = "state_tracking:"  # data.corpus value naming a task: "state_tracking:parity"
MANIFEST = "task.json"
SPLITS = ("train", "valid")
SEQUENCES = {"train": 65536, "valid": 1024}  # per split; a longer run cycles through train in epochs
SPLIT_SEEDS = {"train": 0, "valid": 1, "test": 2}  # sequences of the same task never share a generator


# ---------------------------------------------------------------- the groups
@dataclass(frozen=True)
class Group:
    """A finite group by its multiplication table: ``table[s, x]`` is the state after input x in
    state s. Element 0 is the identity."""

    name: str
    table: numpy.ndarray  # [n, n] int

    @property
    def size(self) -> int:
        return len(self.table)

    def running_products(self, tokens: numpy.ndarray) -> numpy.ndarray:
        """Labels [n, T]: the state after each position of the sequences ``tokens`` [n, T]."""
        labels = numpy.empty_like(tokens)
        state = numpy.zeros(len(tokens), dtype=tokens.dtype)
        for t in range(tokens.shape[1]):
            state = self.table[state, tokens[:, t]]
            labels[:, t] = state
        return labels

    def sample(self, count: int, length: int, seed: int) -> tuple[numpy.ndarray, numpy.ndarray]:
        """``count`` uniform sequences of ``length`` inputs and their labels, both [count, length] int64."""
        tokens = numpy.random.default_rng(seed).integers(0, self.size, (count, length), dtype=numpy.int64)
        return tokens, self.running_products(tokens)


def cyclic(name: str, n: int) -> Group:
    """Z_n: the running sum mod n."""
    elements = numpy.arange(n)
    return Group(name, (elements[:, None] + elements[None, :]) % n)


def symmetric3(name: str) -> Group:
    """S_3: permutations of (0, 1, 2) in lexicographic order (the identity first); the state after
    input x in state s is x ∘ s, i.e. i ↦ x[s[i]]."""
    perms = list(itertools.permutations(range(3)))
    index = {p: i for i, p in enumerate(perms)}
    return Group(name, numpy.array([[index[tuple(x[i] for i in s)] for x in perms] for s in perms]))


GROUPS = {g.name: g for g in (cyclic("parity", 2), cyclic("sum_mod5", 5), symmetric3("s3"))}


def task_name(source: Optional[str]) -> Optional[str]:
    """The task a ``data.corpus`` value names ("state_tracking:NAME"), None for other sources."""
    if source is None or not source.startswith(SOURCE_PREFIX):
        return None
    name = source[len(SOURCE_PREFIX):]
    if name not in GROUPS:
        raise ValueError(f"unknown state-tracking task {name!r} in {source!r}; choose one of {', '.join(GROUPS)}")
    return name


@dataclass(frozen=True)
class TaskVocabulary:
    """What the training loop asks of a tokenizer: the size of the (padded) embedding."""

    vocab_size: int

    def padded_vocab_size(self, tensor_model_parallel_size: int = 1, divisible_by: int = 128) -> int:
        return padded_vocab_size(self.vocab_size, tensor_model_parallel_size, divisible_by)


# ---------------------------------------------------------------- the prepared folder
class StateTrackingDataset(torch.utils.data.Dataset):
    """``num_samples`` examples of one split, in an order shuffled by ``seed`` (cycled in epochs),
    as dicts of ``tokens``, ``labels`` (both int64 [T]) and ``loss_mask`` (ones: every position is scored),
    like megatron-core's GPTDataset samples."""

    def __init__(self, prefix: str, num_samples: int, seed: int):
        self.tokens, self.labels = IndexedDataset(prefix + "_tokens"), IndexedDataset(prefix + "_labels")
        self.order = numpy.random.default_rng(seed).permutation(len(self.tokens))
        self.num_samples = num_samples

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> dict:
        sequence = self.order[i % len(self.order)]
        tokens = self.tokens[sequence].astype(numpy.int64)
        return {
            "tokens": tokens,
            "labels": self.labels[sequence].astype(numpy.int64),
            "loss_mask": numpy.ones(len(tokens), dtype=numpy.float32),
        }


@dataclass(frozen=True)
class Task:
    """A prepared task folder."""

    folder: str
    group: Group
    seq_length: int
    sequences: dict[str, int]  # per split

    @property
    def vocabulary(self) -> TaskVocabulary:
        return TaskVocabulary(self.group.size)

    def dataset(self, split: str, seq_length: int, num_samples: int, seed: int) -> StateTrackingDataset:
        """``num_samples`` examples of ``split``; ``seq_length`` must be the length it was prepared at."""
        if seq_length != self.seq_length:
            raise ValueError(
                f"{self.folder} holds {self.group.name} sequences of length {self.seq_length}, not "
                f"data.seq_length {seq_length}; prepare another data.data_path"
            )
        return StateTrackingDataset(os.path.join(self.folder, split), num_samples, seed)


def is_task_folder(folder: Optional[str]) -> bool:
    return folder is not None and os.path.isfile(os.path.join(folder, MANIFEST))


def load_task(folder: str) -> Task:
    """The prepared task in ``folder`` (ValueError if it is not one)."""
    folder = os.path.abspath(folder)
    try:
        with open(os.path.join(folder, MANIFEST)) as f:
            manifest = json.load(f)
    except (OSError, ValueError):
        raise ValueError(f"{folder} is not a prepared state-tracking task (no readable {MANIFEST})") from None
    files = [f"{s}_{part}{ext}" for s in SPLITS for part in ("tokens", "labels") for ext in (".bin", ".idx")]
    missing = [f for f in files if not os.path.isfile(os.path.join(folder, f))]
    if missing:
        raise ValueError(f"{folder} is an incomplete state-tracking task (missing {', '.join(missing)})")
    return Task(folder, GROUPS[manifest["task"]], manifest["seq_length"], manifest["sequences"])


def _write(prefix: str, rows: numpy.ndarray, dtype) -> None:
    """Each row of ``rows`` as one sequence of the IndexedDataset ``prefix``.bin/.idx."""
    builder = IndexedDatasetBuilder(get_bin_path(prefix), dtype=dtype)
    for row in rows:
        builder.add_document(row, [len(row)])
    builder.finalize(get_idx_path(prefix))


def prepare_task(name: str, output: str, seq_length: int, sequences: Optional[dict[str, int]] = None) -> Task:
    """Prepare the task folder ``output``: ``sequences`` (default ``SEQUENCES``) examples per split of
    ``seq_length`` inputs. Does nothing when ``output`` already holds this task at this length."""
    if name not in GROUPS:
        raise ValueError(f"unknown state-tracking task {name!r}; choose one of {', '.join(GROUPS)}")
    if seq_length < 1:
        raise ValueError(f"seq_length must be >= 1, got {seq_length}")
    sequences = dict(sequences or SEQUENCES)
    output = os.path.abspath(output)
    if not os.path.exists(output):
        _build(name, output, seq_length, sequences)
    task = load_task(output)
    if (task.group.name, task.seq_length) != (name, seq_length):
        raise ValueError(
            f"{output} holds the task {task.group.name} at length {task.seq_length}, not {name} at "
            f"{seq_length}; choose another data.data_path or remove it"
        )
    return task


def _build(name: str, output: str, seq_length: int, sequences: dict[str, int]) -> None:
    """Write the task folder ``output`` whole; when another process got there first (runs started
    together), its folder is kept and checked by the caller."""
    group, dtype = GROUPS[name], DType.optimal_dtype(GROUPS[name].size)
    try:
        with atomic_folder(output) as tmp:
            for split in SPLITS:
                tokens, labels = group.sample(sequences[split], seq_length, SPLIT_SEEDS[split])
                _write(str(tmp / f"{split}_tokens"), tokens, dtype)
                _write(str(tmp / f"{split}_labels"), labels, dtype)
            manifest = {"task": name, "group_size": group.size, "seq_length": seq_length, "sequences": sequences,
                        "split_seeds": {s: SPLIT_SEEDS[s] for s in SPLITS}}
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
    except FolderExists:
        pass  # lost the race: keep theirs
