"""GPT train/valid/test datasets through megatron-core's BlendedMegatronDatasetBuilder.

Every rank builds; under torch.distributed megatron builds on rank 0 first (writing the index
cache to `cache_dir`), then the other ranks load it, so all ranks must call `build_datasets`.
It also works without any process group (one process). ``token_id_problem`` checks, cheaply, that a
``.bin/.idx`` prefix was tokenized with the run's vocabulary.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Optional
from unittest import mock

import numpy
import torch.distributed as dist
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import _INDEX_HEADER, DType

from fbt_megatron.common.errors import RecipeError
from fbt_megatron.data.tokenizer import Tokenizer

Blend = tuple[list[str], list[float] | None]  # megatron's (prefixes, weights or None)


def build_datasets(
    tokenizer: Tokenizer,
    seq_length: int,
    seed: int,
    num_samples: tuple[int | None, int | None, int | None],
    cache_dir: str,
    blend: Blend | None = None,
    split: str | None = None,
    blend_per_split: list[Blend | None] | None = None,
) -> tuple:
    """(train, valid, test) datasets (None where a split is empty) of `num_samples` samples each
    (None: one epoch; required with weights). Either `blend` with `split` ("98,2,0") or
    `blend_per_split` (one blend or None per split). Samples are dicts of tokens, labels,
    loss_mask and position_ids of length `seq_length` (and dataset_id from a blend)."""
    if (blend is None) == (blend_per_split is None):
        raise ValueError("give exactly one of blend and blend_per_split")
    if blend is not None and split is None:
        raise ValueError('a blend needs a split, e.g. "98,2,0"')
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=split,
        path_to_cache=cache_dir,
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
    )
    builder = BlendedMegatronDatasetBuilder(GPTDataset, list(num_samples), lambda: True, config)
    with _rank_zero_without_process_group():
        return tuple(builder.build())


@contextlib.contextmanager
def _rank_zero_without_process_group():
    """megatron-core 0.16's BlendedDataset asks torch.distributed for the rank when it writes its
    index cache, even without a process group (GPTDataset checks first): a process alone is rank 0."""
    if dist.is_initialized():
        yield
    else:
        with mock.patch.object(dist, "get_rank", lambda group=None: 0):
            yield


SAMPLE_WINDOWS, SAMPLE_WINDOW = 16, 1 << 16  # ids read per prefix: 16 evenly spaced windows of 65,536 (≤ 4 MiB)


def token_id_problem(prefix: str, vocab_size: int, tokenizer: str, key: str) -> Optional[str]:
    """One line when ``prefix``.bin holds a token id outside a vocabulary of ``vocab_size`` ids (the
    tokenizer ``tokenizer``'s), found in a sample (``SAMPLE_WINDOWS`` windows spread over the file:
    a blend made with another tokenizer has such ids everywhere); None when the sample fits (or the
    index is not megatron-core's, which its reader reports)."""
    with open(prefix + ".idx", "rb") as f:
        header = f.read(18)  # megatron's magic (9 bytes), version (8), the dtype's code (1)
    if len(header) < 18 or not header.startswith(_INDEX_HEADER) or not os.path.getsize(prefix + ".bin"):
        return None
    tokens = numpy.memmap(prefix + ".bin", dtype=DType.dtype_from_code(header[17]), mode="r")
    starts = sorted({int(s) for s in numpy.linspace(0, max(0, len(tokens) - SAMPLE_WINDOW), SAMPLE_WINDOWS)})
    top = max(int(tokens[s:s + SAMPLE_WINDOW].max()) for s in starts)
    if top < vocab_size:
        return None
    return (f"{key}: {prefix} holds token id {top:,} but the tokenizer {tokenizer} has {vocab_size:,} ids: the blend was "
            f"tokenized with another vocabulary; give the tokenizer it was made with (--tokenizer-model) or tokenize it "
            f"again with this one (tools/preprocess_data.py --tokenizer {tokenizer})")


def blend(spec: list, key: str) -> Blend:
    """Megatron's blend list ([w, prefix, w, prefix, ...] or [prefix, ...]) → (prefixes, weights)."""
    if all(isinstance(x, str) for x in spec):
        prefixes, weights = list(spec), None
    elif len(spec) % 2 == 0 and all(isinstance(w, (int, float)) for w in spec[0::2]):
        prefixes, weights = [str(p) for p in spec[1::2]], [float(w) for w in spec[0::2]]
    else:
        raise RecipeError(f"{key} must be [prefix, ...] or [weight, prefix, weight, prefix, ...]")
    for prefix in prefixes:
        for ext in (".bin", ".idx"):
            if not Path(prefix + ext).is_file():
                raise RecipeError(f"{key}: data file not found: {prefix + ext}")
    return prefixes, weights
