"""Stragglers: ranks slower than the others (``--straggler-threshold``, default 1.5; 0: off).

What is measured (``StepClock``): each rank's own time of a step, from the step's start to the
moment it enters the gradient reduction (megatron-core's ``finalize_model_grads``, where the
data-parallel ranks meet): its batches, forward and backward, none of the time it then waits there
for a slower rank. A slow rank's own time is longer, although every rank's whole step lasts as long
as the slowest one's.

On a GPU the host runs ahead of the kernels it launches, and a clock on the compute stream (CUDA
events) would count the waits inside the step too: that stream waits for NCCL's, and under tensor,
context or pipeline parallelism NCCL waits for the slowest peer, so every rank of the group would
show the slow rank's time. Its own time there is the step's wall time up to the gradient reduction
less its exposed communication: the time its GPU ran communication kernels and none of its own
(``exposed_communication_seconds``), which holds every wait for a peer. What is left is its own
kernels and the gaps between them, so a slow GPU and a slow host (a data loader, a busy CPU, the
``slow`` drill) both count, and a slow GPU is named alone, also among tensor-parallel peers; a
plain sum of its compute kernels (what NVIDIA's resiliency extension scores a GPU by) would miss a
slow host. The kernels come from torch's profiler (kineto: CUPTI's kernel records) over the logged
steps only: the profiler starts with such a step and stops at its gradient reduction, after a
synchronize (the host waits for the GPU there a little earlier than it would anyway), and its
bookkeeping is left out of the step's time. (Not run on a GPU yet.)

On a CPU, the device is the host's cores: the own time is the process's CPU time
(``time.process_time``) over every step, the work the rank did. The wall clock there counted the
time the host's scheduler gave other processes: on a busy 2-core machine it named whichever rank
was kept waiting (1.505× at threshold 1.5 in a world of two, where that is 3 times the other's
time), while the same work costs each rank about the same CPU time.

When (``Stragglers``, a callback of every rank: ``post_step``): every rank adds up its own times
between logged steps (on a GPU: the logged step's), without any communication; at a logged step
(``--log-interval``, a validation, the last step) the means meet in one all-gather of one number
per rank (the nodes are known from start-up: ``ranks``). A rank whose
mean exceeds the threshold × the median of all ranks' means is a straggler. (In a world of two the
median is the pair's mean: at 1.5 a rank is named when it takes 3 times as long as the other.)

Where (``on_step_end``, after the record's line): the logging rank says it in one line (each straggler's rank, node, time and ratio, the
median), adds ``stragglers`` ``[{"rank", "node", "step_time", "median", "ratio"}]`` to the step's
record (``metrics.jsonl``; TensorBoard and W&B: ``stragglers/rank<R>``, the ratio) and appends one
line per straggler to ``<save>/stragglers.jsonl`` for the Slurm attempt record: ``{"time": ISO-UTC,
"step", "rank", "node", "step_time" (s), "median" (s), "ratio"}``. The drill: ``--inject-fault
slow@STEP[:RANK]`` (``trainer.callbacks.faults``).
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import time
from pathlib import Path
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.autograd import DeviceType

from fbt_megatron.common import logs, platform
from fbt_megatron.common.clock import utc
from fbt_megatron.common.io import append_line
from fbt_megatron.trainer.callbacks.base import Callback

log = logging.getLogger(__name__)

STRAGGLERS = "stragglers.jsonl"


def read_stragglers(folder) -> List[dict]:
    path = Path(folder) / STRAGGLERS
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def exposed_communication_seconds(events) -> Optional[float]:
    """The time a profile's GPU ran communication kernels and none of its own (torch.profiler's
    kineto events: their ``name()``, ``device_type()``, ``activity_type()``, ``start_ns()``,
    ``end_ns()``): the union of all kernels' intervals less the union of those that are not
    communication. A communication kernel (NCCL's ``ncclDevKernel_*``, ``ncclKernel_*`` before NCCL
    2.19) runs until every peer has arrived, so it holds the wait for a slow peer; the rest runs on
    this GPU alone. (NVIDIA's resiliency extension leaves NCCL's kernels out of a GPU's score too:
    ``straggler/reporting.py``, ``_filter_out_nccl_kernels``.) None: no kernel recorded."""
    kernels = [(e.start_ns(), e.end_ns(), "nccl" in e.name().lower()) for e in events
               if e.device_type() == DeviceType.CUDA and e.activity_type() == "kernel"]
    if not kernels:
        return None
    return (_covered([(a, b) for a, b, _ in kernels]) - _covered([(a, b) for a, b, comm in kernels if not comm])) / 1e9


def _covered(intervals) -> int:
    """The length of the union of the intervals (start, end)."""
    total, reach = 0, None
    for start, end in sorted(intervals):
        if reach is None or start > reach:
            total, reach = total + end - start, end
        elif end > reach:
            total, reach = total + end - reach, end
    return total


class StepClock:
    """A training step's wall time and this rank's own part of it (module docstring): ``start()``
    at the step's start, ``stop()`` at its end. The gradient reduction's entry is marked by
    wrapping the schedule's ``config.finalize_model_grads_func``. ``profile``: the straggler check
    is on (on a GPU its logged steps' kernels are profiled)."""

    def __init__(self, config, profile: bool):
        reduce, self.gpu, self.profile = config.finalize_model_grads_func, platform.on_gpu(), profile
        self.started, self.began, self.own, self.profiler, self.overhead = 0.0, 0.0, None, None, 0.0
        if self.gpu and profile:
            os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # kineto's lines at every profile's start and stop: none

        def marked(*args, **kwargs):
            self._reduced()
            return reduce(*args, **kwargs)

        config.finalize_model_grads_func = marked

    def start(self, logged: bool) -> None:
        """At the step's start; ``logged``: a logged step (on a GPU it is profiled)."""
        self.started, self.own, self.profiler, self.overhead = time.perf_counter(), None, None, 0.0
        if not self.gpu:
            self.began = time.process_time()
        elif self.profile and logged:
            from torch.profiler import ProfilerActivity, profile

            self.profiler = profile(activities=[ProfilerActivity.CUDA])
            self.profiler.start()
            self.began = time.perf_counter()
            self.overhead = self.began - self.started

    def _reduced(self) -> None:
        """The gradient reduction's entry: this rank's own part of the step ends (its first entry)."""
        if self.own is not None:
            return
        if not self.gpu:
            self.own = time.process_time() - self.began
        elif self.profiler is not None:
            torch.cuda.synchronize()  # what was launched has run: the window's end
            window, stopping = time.perf_counter() - self.began, time.perf_counter()
            self.profiler.stop()
            exposed = exposed_communication_seconds(self.profiler.profiler.kineto_results.events())
            self.profiler, self.overhead = None, self.overhead + time.perf_counter() - stopping
            if exposed is None:
                log.warning("stragglers: the profiler recorded no kernels on this rank (CUPTI taken by another "
                            "profiler, e.g. nsys, or not permitted): its own time is not measured", extra=logs.EVERY_RANK)
            else:
                self.own = window - exposed

    def stop(self) -> Tuple[float, Optional[float]]:
        """(the step's wall seconds, the profiler's bookkeeping left out; this rank's own seconds up to
        the gradient reduction: its CPU time on a CPU; on a GPU at a logged step the wall time less
        the exposed communication, else None)."""
        self._reduced()
        return time.perf_counter() - self.started - self.overhead, self.own


class Stragglers(Callback):
    """The straggler check of one run on this rank (module docstring): each step's own time kept,
    the ranks' means gathered at each logged step (every rank) into the record, and what that found
    said (the logging rank)."""

    def __init__(self, threshold: float, save: Optional[str], ranks: List[dict], active: bool):
        """``threshold``: ``--straggler-threshold`` (0: off); ``ranks``: every rank's node
        (``ranks.record_ranks``); ``active``: this rank reports."""
        self.threshold, self.ranks, self.on = threshold, ranks, bool(threshold) and len(ranks) > 1
        self.path = Path(save) / STRAGGLERS if save is not None and active else None
        self.active, self.spans, self.window, self.named = active, [], 0, []

    def post_step(self, state, result) -> dict:
        """The step's own seconds (``StepClock``; None: not measured) kept until the next logged
        step (when the check is on); at a logged step, ``stragglers`` for its record (when any)."""
        if self.on and result.own is not None:
            self.spans.append(result.own)
        if not result.logged:
            return {}
        self.named = self.gather()
        return {"stragglers": self.named} if self.named else {}

    def on_step_end(self, state, record: Optional[dict]) -> None:
        if record is not None:
            self.report(record["step"], self.named)

    def gather(self) -> List[dict]:
        """At a logged step, on every rank (one all-gather when on and the world has more than one
        rank): the stragglers of the steps measured since the last one, ``{"rank", "node",
        "step_time", "median", "ratio"}`` in rank order; the window (``window`` steps) starts
        afresh. A rank that measured nothing (a GPU whose profiler recorded no kernels) is compared
        with no one."""
        spans, self.spans, self.window = self.spans, [], len(self.spans)
        if not self.on:
            return []
        mine = torch.tensor([sum(spans) / len(spans) if spans else 0.0], dtype=torch.float64, device=platform.device())
        every = [torch.empty_like(mine) for _ in self.ranks]
        dist.all_gather(every, mine)
        times = torch.cat(every).tolist()
        measured = [t for t in times if t > 0]
        if not measured:
            return []
        median = statistics.median(measured)
        return [{"rank": r, "node": self.ranks[r]["node"], "step_time": t, "median": median, "ratio": t / median}
                for r, t in enumerate(times) if t > self.threshold * median]

    def report(self, step: int, named: List[dict]) -> None:
        """The logging rank's line and ``stragglers.jsonl`` lines for the stragglers ``named`` by
        the gather at step ``step``."""
        if not self.active or not named:
            return
        who = ", ".join(f"rank {s['rank']} on node {s['node']} ({s['step_time']:.3f} s, {s['ratio']:.2f}×)" for s in named)
        steps = f"step {step}" if self.window == 1 else f"steps {step - self.window + 1}-{step}"
        log.info(f"step {step}: straggler{'s' if len(named) > 1 else ''} {who}: own time per step over {steps} against the "
                 f"median {named[0]['median']:.3f} s of {len(self.ranks)} ranks (--straggler-threshold {self.threshold:g})")
        if self.path is not None:
            now = utc()
            append_line(self.path, "".join(json.dumps({"time": now, "step": step, **s}) + "\n" for s in named))
