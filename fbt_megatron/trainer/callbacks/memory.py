"""Memory in every logged step's record: the largest rank's (``trainer.memory``: on a GPU the CUDA
caching allocator's counters, on a CPU the resident set). Every rank takes part (one all-reduce)."""

from __future__ import annotations

from fbt_megatron.trainer.callbacks.base import Callback
from fbt_megatron.trainer.memory import largest_over_ranks


class Memory(Callback):
    """At a logged step, on every rank: the largest rank's memory figures for its record."""

    def post_step(self, state, result) -> dict:
        return largest_over_ranks() if result.logged else {}
