"""GPT train/valid/test datasets through megatron-core's BlendedMegatronDatasetBuilder.

Every rank builds; under torch.distributed megatron builds on rank 0 first (writing the index
cache to `cache_dir`), then the other ranks load it, so all ranks must call `build_datasets`.
It also works without any process group (one process).
"""

from __future__ import annotations

import contextlib
from unittest import mock

import torch.distributed as dist
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

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
