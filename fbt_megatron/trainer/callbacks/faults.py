"""Faults injected for drills, as callbacks of the loop: ``Faults`` (``--inject-fault``: crash,
hang, freeze, slow step, loss spike; the spec and what each kind does: ``fbt_megatron.recipe.faults``)
and ``NaNInjection`` (``--inject-nan``: a poisoned batch or gradient; the spec: ``recipe.nan_injections``).
Crashes and hangs fire once per run folder: the rank that fires one first appends it to
``<save>/injected_faults.jsonl``, and a restart skips those found there."""

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
from fbt_megatron.recipe import nan_injections
from fbt_megatron.recipe.faults import ONCE, SLOW_SECONDS, SLOW_STEPS, SPIKE_FACTOR, Fault, parse_faults
from fbt_megatron.trainer.callbacks.base import Callback

log = logging.getLogger(__name__)

FIRED = "injected_faults.jsonl"


class Faults(Callback):
    """The faults of one run on this rank (``rank``) of ``model`` (a spike's; None: no spikes); ``save``: the run folder that
    records the crashes and hangs already fired (None: this process alone). Its crash, hang, freeze
    or slow step at the step's start (``on_step_start``, inside the step's clock); a spike's
    gradients and loss scaled before the update (``pre_optim_step``)."""

    def __init__(self, specs: Optional[List[str]], save: Optional[str], rank: int, model=None):
        self.rank, self.record, self.model = rank, Path(save) / FIRED if save else None, model
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

    def pre_optim_step(self, state, report: dict) -> None:
        """After the step's backward: its loss (``report``) and gradients × SPIKE_FACTOR if a spike is due."""
        if any(f.kind == "spike" and f.step == state.iteration + 1 for f in self.faults):
            for param in self.model.parameters():
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


class NaNInjection(Callback):
    """``--inject-nan`` (``spec``; steps counted from 1, as in the logs) on ``model``: a poisoned
    batch (the token embeddings × NaN in the step's forward: its loss is NaN) or gradient (every
    rank's first parameter's × NaN or Inf after the backward), answered by ``bad_steps``."""

    def __init__(self, spec: Optional[str], model):
        self.steps, self.model, self.handle = nan_injections(spec), model, None  # step → (what, factor)

    def on_step_start(self, state, k: int) -> None:
        what, factor = self.steps.get(state.iteration + 1, (None, 1.0))
        embedding = getattr(self.model, "embedding", None)  # the first pipeline stage's
        if what == "loss" and embedding is not None:
            self.handle = embedding.register_forward_hook(lambda module, args, out: out * factor)

    def pre_optim_step(self, state, report: dict) -> None:
        self._remove()
        what, factor = self.steps.get(state.iteration + 1, (None, 1.0))
        if what == "grad":
            param = next(p for p in self.model.parameters() if p.requires_grad)
            param.main_grad.mul_(factor)

    def on_failure(self, state, error: BaseException) -> None:
        self._remove()

    def _remove(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None


def _hold_the_interpreter() -> None:
    """Never returns, holding the GIL: Python's own lock acquired twice through its C API
    (``ctypes.pythonapi`` calls keep the GIL; a signal does not end the wait)."""
    api = ctypes.pythonapi
    api.PyThread_allocate_lock.restype = ctypes.c_void_p
    api.PyThread_acquire_lock.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lock = api.PyThread_allocate_lock()
    api.PyThread_acquire_lock(lock, 1)
    api.PyThread_acquire_lock(lock, 1)  # taken already, by this thread: waits for ever
