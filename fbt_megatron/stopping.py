"""Why and when a run stops before ``--train-iters``: a signal, a time budget, ``--exit-interval``.

With ``--exit-signal-handler`` (the default) SIGTERM and SIGINT only set a flag: Slurm's signal
before the time limit, ``scontrol requeue``, ``kill`` and Ctrl-C (torchrun forwards TERM, INT, HUP
and QUIT to its workers). ``--exit-duration-in-mins M`` raises the same flag once M minutes have
passed since ``train()`` started. At the next step boundary every rank stops together: the run
saves a checkpoint (with ``--save``) and exits 0 with one line naming the checkpoint; ``--load``
resumes it exactly. A second Ctrl-C aborts at once (exit 130, nothing saved).

Ranks agree without a stall: each step starts an asynchronous MAX all-reduce of this rank's flags
(the signal's number, overtime or not: two numbers over a gloo group, CPU tensors, no device
sync) that runs while the step computes, and reads it after the optimizer step. So with several ranks a signal that arrives during step i
stops the run after step i + 1, on every rank at the same step, whichever ranks received it (one
process: after step i).

Every stop (and the end of a run) is recorded in ``<save>/exit_status.json`` (``write_status``):
``{"reason": "finished" | "exit_interval" | "signal" | "duration" | "bad_steps", "step": N,
"train_iters": T, "checkpoint": "iter_000000N" or null, "signal": "SIGTERM" (signal stops)}``,
for job scripts (Slurm) deciding whether to resubmit.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

SIGNALS = (signal.SIGTERM, signal.SIGINT)
STATUS = "exit_status.json"


class StopCheck:
    """The stop decision of every step boundary, the same on every rank (see the module docstring).
    ``start_step()`` before a step's work, ``stop_reason()`` after it: None, "signal" or "duration"."""

    def __init__(self, exit_duration_in_mins: Optional[float], handle_signals: bool, started: float):
        self.started = started  # time.monotonic() when train() started
        self.budget_s = None if exit_duration_in_mins is None else 60.0 * exit_duration_in_mins
        self.signal: Optional[str] = None  # the first signal received (on this rank; after a stop: on any rank)
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.group = None
        if self.world > 1 and dist.get_backend() != "gloo":  # a CPU group: the flags never touch the device
            self.group = dist.new_group(backend="gloo")
        self.flags, self.pending = torch.zeros(2), None
        self.previous = {}
        if handle_signals:
            self.previous = {s: signal.signal(s, self._on_signal) for s in SIGNALS}

    def _on_signal(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.signal is None:
            self.signal = name
            if os.environ.get("RANK", "0") == "0":
                again = " (Ctrl-C again to abort now)" if signum == signal.SIGINT else ""
                print(f"{name} received: saving a checkpoint and stopping at the next step boundary{again}", flush=True)
        elif signum == signal.SIGINT:  # a second Ctrl-C: abort at once, as users expect
            print(f"aborted by a second {name}: no checkpoint written", file=sys.stderr, flush=True)
            os._exit(130)

    def start_step(self) -> None:
        self.flags = torch.tensor([float(signal.Signals[self.signal] if self.signal else 0), float(self._overtime())])
        if self.world > 1:
            self.pending = dist.all_reduce(self.flags, op=dist.ReduceOp.MAX, group=self.group, async_op=True)

    def stop_reason(self) -> Optional[str]:
        if self.world == 1:  # nothing to agree on: the flags as they are now
            self.start_step()
        if self.pending is not None:
            self.pending.wait()
            self.pending = None
        signalled, overtime = (int(x) for x in self.flags.tolist())
        if signalled:
            self.signal = signal.Signals(signalled).name
        return "signal" if signalled else "duration" if overtime else None

    def _overtime(self) -> bool:
        return self.budget_s is not None and time.monotonic() - self.started >= self.budget_s

    def describe(self, reason: str) -> str:
        """The cause of a stop in words: "SIGTERM", "--exit-duration-in-mins 30"."""
        if reason == "signal":
            return self.signal
        return f"--exit-duration-in-mins {self.budget_s / 60:g}"

    def close(self) -> None:
        """Restore the signal handlers there were before (a process may train again)."""
        if self.pending is not None:
            self.pending.wait()
        for s, handler in self.previous.items():
            signal.signal(s, handler)
        self.previous = {}


def stop_line(cause: str, step: int, save: Optional[str], checkpoint: Optional[Path]) -> str:
    """The one line a stopped run ends with (``checkpoint``: the newest one, normally step's)."""
    if save is None:
        return f"stopped by {cause} at step {step}: no --save, nothing saved"
    if checkpoint is None:
        return f"stopped by {cause} at step {step}: no checkpoint (the step was skipped); --load {save} starts afresh"
    return f"stopped by {cause} at step {step}: checkpoint {checkpoint}; --load {save} resumes from it"


def write_status(save: Optional[str], reason: str, step: int, train_iters: int, checkpoint: Optional[Path],
                 signal_name: Optional[str] = None) -> None:
    """Record why the run ended in ``<save>/exit_status.json`` (atomically; rank 0 only)."""
    if save is None or (dist.is_initialized() and dist.get_rank() != 0):
        return
    status = {"reason": reason, "step": step, "train_iters": train_iters,
              "checkpoint": checkpoint.name if checkpoint is not None else None}
    if signal_name:
        status["signal"] = signal_name
    path = Path(save) / STATUS
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(STATUS + ".tmp")
    tmp.write_text(json.dumps(status) + "\n")
    os.replace(tmp, path)
