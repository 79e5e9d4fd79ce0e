"""Stragglers: ranks slower than the others (``--straggler-threshold``, default 1.5; 0: off).

What is measured (``StepClock``): each rank's own time of a step, from the step's start to the
moment it enters the gradient reduction (megatron-core's ``finalize_model_grads``, where the
data-parallel ranks meet): its batches, forward and backward, none of the time it then waits there
for a slower rank. A slow rank's own time is longer, although every rank's whole step lasts as long
as the slowest one's. Ranks that exchange activations inside the forward and backward (tensor-,
context- and pipeline-parallel peers) wait for each other there, so a slow rank's peers in those
groups share its time and are named with it: the check finds the slow data-parallel replica. On a
GPU the marks are CUDA events on the compute stream (the host runs ahead of the kernels it
launches), read at the next logged step, when the host waits for the GPU anyway: no step gets a
synchronisation of its own (not run on a GPU yet). On a CPU, the device is the host's cores: the
marks are the process's CPU time (``time.process_time``), the work the rank did. The wall clock
there counted the time the host's scheduler gave other processes: on a busy 2-core machine it named
whichever rank was kept waiting (1.505× at threshold 1.5 in a world of two, where that is 3 times
the other's time), while the same work costs each rank about the same CPU time.

When (``Stragglers``): every rank adds up its own times between logged steps, without any
communication; at a logged step (``--log-interval``, a validation, the last step) the means meet in
one all-gather of one number per rank (the nodes are known from start-up: ``ranks``). A rank whose
mean exceeds the threshold × the median of all ranks' means is a straggler. (In a world of two the
median is the pair's mean: at 1.5 a rank is named when it takes 3 times as long as the other.)

Where: the logging rank says it in one line (each straggler's rank, node, time and ratio, the
median), adds ``stragglers`` ``[{"rank", "node", "step_time", "median", "ratio"}]`` to the step's
record (``metrics.jsonl``; TensorBoard and W&B: ``stragglers/rank<R>``, the ratio) and appends one
line per straggler to ``<save>/stragglers.jsonl`` for the Slurm attempt record: ``{"time": ISO-UTC,
"step", "rank", "node", "step_time" (s), "median" (s), "ratio"}``. The drill: ``--inject-fault
slow@STEP[:RANK]`` (``resilience.faults``).
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from pathlib import Path
from typing import Any, List, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist

from fbt_megatron.common import platform

log = logging.getLogger(__name__)

STRAGGLERS = "stragglers.jsonl"


def read_stragglers(folder) -> List[dict]:
    path = Path(folder) / STRAGGLERS
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


class Span(NamedTuple):
    """This rank's own part of a step, between two marks: the process's CPU time (CPU), or CUDA
    events recorded on the compute stream (GPU)."""

    start: Any
    end: Any

    def seconds(self) -> float:
        """Its length; on a GPU once the end event has happened (a wait for the GPU, if not yet)."""
        if isinstance(self.start, float):
            return self.end - self.start
        self.end.synchronize()
        return self.start.elapsed_time(self.end) / 1000


class StepClock:
    """A training step's wall time and this rank's own part of it (module docstring): ``start()``
    at the step's start, ``stop()`` at its end. The gradient reduction's entry is marked by
    wrapping the schedule's ``config.finalize_model_grads_func``."""

    def __init__(self, config):
        reduce, self.gpu = config.finalize_model_grads_func, platform.on_gpu()
        self.started, self.began, self.reduced = 0.0, None, None

        def marked(*args, **kwargs):
            self.reduced = self._mark()
            return reduce(*args, **kwargs)

        config.finalize_model_grads_func = marked

    def _mark(self):
        """Now: this process's CPU time, or on a GPU an event the compute stream records when it gets there."""
        if not self.gpu:
            return time.process_time()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self) -> None:
        self.started, self.began, self.reduced = time.perf_counter(), self._mark(), None

    def stop(self) -> Tuple[float, Span]:
        """(the step's wall seconds, this rank's own part: the ``Span`` up to the gradient reduction)."""
        return time.perf_counter() - self.started, Span(self.began, self._mark() if self.reduced is None else self.reduced)


class Stragglers:
    """The straggler check of one run on this rank (module docstring): ``add`` each step's own
    time, ``gather`` at each logged step (every rank), ``report`` what it found (the logging rank)."""

    def __init__(self, threshold: float, save: Optional[str], ranks: List[dict], active: bool):
        """``threshold``: ``--straggler-threshold`` (0: off); ``ranks``: every rank's node
        (``ranks.record_ranks``); ``active``: this rank reports."""
        self.threshold, self.ranks, self.on = threshold, ranks, bool(threshold) and len(ranks) > 1
        self.path = Path(save) / STRAGGLERS if save is not None and active else None
        self.active, self.spans, self.window = active, [], 0

    def add(self, own: Span) -> None:
        """A step's own part (``StepClock``), kept until the next logged step (when the check is on)."""
        if self.on:
            self.spans.append(own)

    def gather(self) -> List[dict]:
        """At a logged step, on every rank (one all-gather when on and the world has more than one
        rank): the stragglers of the steps since the last one, ``{"rank", "node", "step_time",
        "median", "ratio"}`` in rank order; the window (``window`` steps) starts afresh."""
        spans, self.spans, self.window = self.spans, [], len(self.spans)
        if not self.on:
            return []
        mine = torch.tensor([sum(s.seconds() for s in spans) / len(spans)], dtype=torch.float64, device=platform.device())
        every = [torch.empty_like(mine) for _ in self.ranks]
        dist.all_gather(every, mine)
        times = torch.cat(every).tolist()
        median = statistics.median(times)
        return [{"rank": r, "node": self.ranks[r]["node"], "step_time": t, "median": median, "ratio": t / median}
                for r, t in enumerate(times) if t > self.threshold * median]

    def report(self, step: int, named: List[dict]) -> None:
        """The logging rank's line and ``stragglers.jsonl`` lines for the stragglers ``named`` by
        the gather at step ``step``."""
        if not self.active or not named:
            return
        who = ", ".join(f"rank {s['rank']} on node {s['node']} ({s['step_time']:.3f} s, {s['ratio']:.2f}×)" for s in named)
        log.info(f"step {step}: straggler{'s' if len(named) > 1 else ''} {who}: own time per step over steps "
                 f"{step - self.window + 1}-{step} against the median {named[0]['median']:.3f} s of {len(self.ranks)} ranks "
                 f"(--straggler-threshold {self.threshold:g})")
        if self.path is not None:
            now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            with open(self.path, "a") as f:
                f.write("".join(json.dumps({"time": now, "step": step, **s}) + "\n" for s in named))
