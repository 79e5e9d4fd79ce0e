"""The seeds of a run's random draws: each draw has a generator of its own, fixed by its place.

A sequence's prefix-mixin and jitter draws (``fbt``) are fixed by (the sequence's seed, pass,
stream), and a sequence's seed by (run seed, its sample index): they depend on which sequence is
drawn for, never on how the batch is split across ranks or microbatches, and a recomputed pass
sees the same numbers. The pass schedule's k (``passes``) is fixed by (run seed, step): every
rank, and a resumed run, draws the same k without communicating.
"""

from __future__ import annotations

import torch

from fbt_megatron.common import platform

PREFIX, JITTER, SCHEDULE = 1, 2, 3  # the streams


def sequence_seed(seed: int, sample: int) -> int:
    """The seed of a sample's prefix-mixin and jitter draws: fixed by (run seed, sample index)."""
    return seed * 1_000_003 + sample


def generator(seed: int, index: int, stream: int, device) -> torch.Generator:
    """A generator fixed by (seed, index, stream): (sequence seed, pass) or (run seed, step)."""
    mixed = (seed * 1_000_003 + index * 7_919 + stream) % (2**63 - 1)
    return platform.generator(device).manual_seed(mixed)
