"""The planner's memory estimate (``fbt_megatron.launch.plan``) beside what the run measures: one line
at the first logged step (``trainer.memory``: the largest rank's peak). The training command adds it
(``fbt_megatron.train``), since the planner sits above the trainer."""

from __future__ import annotations

import logging

from fbt_megatron.trainer.callbacks.base import Callback
from fbt_megatron.trainer.memory import GiB, peak

log = logging.getLogger(__name__)


class PlannedMemory(Callback):
    """At the first logged step: its peak memory (the largest rank's) beside the planner's estimate
    for the busiest rank (``planned``, bytes: ``fbt_megatron.launch.plan``), in one line."""

    def __init__(self, planned: float):
        self.planned, self.said = planned, False

    def on_step_end(self, state, record) -> None:
        if record is None or self.said or peak(record) is None:
            return
        self.said, measured = True, peak(record)
        what = "peak allocated" if "mem_max_allocated_bytes" in record else "peak resident set"
        log.info(f"memory at step {record['step']}: {what} {measured / GiB:.2f} GiB on the largest rank; the planner "
                 f"estimated {self.planned / GiB:.2f} GiB ({100 * (measured / self.planned - 1):+.0f}%; python -m fbt_megatron.plan)")
