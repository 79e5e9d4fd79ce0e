"""Injected faults fired on this rank at their steps (the spec and what each kind does:
``fbt_megatron.recipe.faults``). Crashes and hangs fire once per run folder: the rank that fires
one first appends it to ``<save>/injected_faults.jsonl``, and a restart skips those found there."""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import List, Optional

from fbt_megatron.common import logs
from fbt_megatron.common.clock import utc
from fbt_megatron.common.io import append_synced
from fbt_megatron.recipe.faults import ONCE, SLOW_SECONDS, SLOW_STEPS, SPIKE_FACTOR, Fault, parse_faults
from fbt_megatron.trainer.callbacks.base import Callback

log = logging.getLogger(__name__)

FIRED = "injected_faults.jsonl"


class Faults(Callback):
    """The faults of one run on this rank (``rank``); ``save``: the run folder that records the
    crashes and hangs already fired (None: this process alone). A callback of the loop: its crash,
    hang, freeze or slow step at the step's start (``on_step_start``, inside the step's clock); the
    step itself scales a spike's gradients (``spike``)."""

    def __init__(self, specs: Optional[List[str]], save: Optional[str], rank: int):
        self.rank, self.record = rank, Path(save) / FIRED if save else None
        fired = set()
        if self.record is not None and self.record.is_file():
            fired = {json.loads(line)["fault"] for line in self.record.read_text().splitlines() if line.strip()}
        self.faults = [f for f in parse_faults(specs) if str(f) not in fired]

    def start_step(self, step: int) -> None:
        """At the start of step ``step``: this rank's busy loop if one of its slow faults covers the
        step; its crash, hang or freeze, if one is due."""
        mine = [f for f in self.faults if f.rank == self.rank]
        slow = [f for f in mine if f.kind == "slow" and f.step <= step < f.step + SLOW_STEPS]
        for fault in [f for f in slow if f.step == step]:
            log.info(f"--inject-fault {fault}: rank {self.rank} spends {SLOW_SECONDS:g} s of CPU at the start of each of steps "
                     f"{step}-{step + SLOW_STEPS - 1}", extra=logs.EVERY_RANK)
        if slow:
            end = time.thread_time() + SLOW_SECONDS
            while time.thread_time() < end:  # this thread's CPU time: 1 s of work whatever else the host runs
                pass
        for fault in [f for f in mine if f.step == step and f.kind in ONCE]:
            self._fired(fault)
            if fault.kind == "crash":
                os.kill(os.getpid(), signal.SIGKILL)
            if fault.kind == "freeze":
                _hold_the_interpreter()
            threading.Event().wait()  # hang: no return; the watchdog ends the run

    def on_step_start(self, state, k: int) -> None:
        self.start_step(state.iteration + 1)

    def spike(self, step: int, model, report: dict) -> None:
        """After step ``step``'s backward: its loss (``report``) and gradients × SPIKE_FACTOR if a spike is due."""
        if any(f.kind == "spike" and f.step == step for f in self.faults):
            for param in model.parameters():
                if param.requires_grad:
                    param.main_grad.mul_(SPIKE_FACTOR)
            if "pass_losses" in report:
                report["pass_losses"] = report["pass_losses"] * SPIKE_FACTOR

    def _fired(self, fault: Fault) -> None:
        what = {"crash": "dies (SIGKILL)", "hang": "hangs", "freeze": "hangs holding the interpreter"}[fault.kind]
        log.info(f"--inject-fault {fault}: rank {self.rank} {what} at the start of step {fault.step}", extra=logs.EVERY_RANK)
        if self.record is not None:
            line = json.dumps({"fault": str(fault), "rank": self.rank, "time": utc()})
            append_synced(self.record, line + "\n")


def _hold_the_interpreter() -> None:
    """Never returns, holding the GIL: Python's own lock acquired twice through its C API
    (``ctypes.pythonapi`` calls keep the GIL; a signal does not end the wait)."""
    api = ctypes.pythonapi
    api.PyThread_allocate_lock.restype = ctypes.c_void_p
    api.PyThread_acquire_lock.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lock = api.PyThread_allocate_lock()
    api.PyThread_acquire_lock(lock, 1)
    api.PyThread_acquire_lock(lock, 1)  # taken already, by this thread: waits for ever
