"""Why and when a run stops before ``--train-iters``: a signal, a time budget, ``--exit-interval``.

With ``--exit-signal-handler`` (the default) SIGTERM and SIGINT only set a flag: Slurm's signal
before the time limit, ``scontrol requeue``, ``kill`` and Ctrl-C (torchrun forwards TERM, INT, HUP
and QUIT to its workers). ``--exit-duration-in-mins M`` raises the same flag once M minutes have
passed since ``train()`` started. At the next step boundary every rank stops together: the run
saves a checkpoint (with ``--save``) and exits 0 with one line naming the checkpoint; ``--load``
resumes it exactly. A second Ctrl-C aborts at once (exit 130, nothing saved); so does a SIGTERM
after a Ctrl-C, which is how torchrun passes a second Ctrl-C on (a second SIGTERM does not abort:
Slurm and a forwarding torchrun may both send one).

Ranks agree without a stall: each step starts an asynchronous MAX all-reduce of this rank's flags
(the signal's number, overtime or not: two numbers over a gloo group, CPU tensors, no device
sync) that runs while the step computes, and reads it after the optimizer step. So with several ranks a signal that arrives during step i
stops the run after step i + 1, on every rank at the same step, whichever ranks received it (one
process: after step i).

Every stop (and the end of a run) is recorded in ``<save>/exit_status.json`` (``write_status``):
``{"reason": "finished" | "exit_interval" | "signal" | "duration" | "bad_steps" | "hang", "step": N,
"train_iters": T, "checkpoint": "iter_000000N" or null, "signal": "SIGTERM" (signal stops),
"spikes": S, "rewinds": R (when there were: ``resilience.spikes``)}``,
for job scripts (Slurm) deciding whether to resubmit.

Every delivery counts, whatever the main thread is doing (a long kernel, a collective waiting for
a peer): Python's C-level handler writes each signal's number to its wakeup pipe, and a thread of
``StopCheck`` reads it. Processes forked while it handles the signals (megatron-core's checkpoint
writers) ignore SIGTERM and SIGINT: the run decides when to stop, and they die with it
(``fbt_megatron.processes``).

Under torchrun the training processes are in sessions of their own: a terminal's Ctrl-C reaches
only torchrun, which forwards it, gives the workers 30 s (then kills them) and, after their clean
stop, ends with its own ``SignalException`` traceback and exit 1; on a second Ctrl-C it sends them
SIGTERM (they abort) and ends the same way. ``torchrun()`` (``python -m fbt_megatron.torchrun``,
torchrun's own command line) forwards TERM and INT to the workers instead and lets torchrun wait for
them, however long the save takes: a clean stop exits 0 with the workers' line last, a second
Ctrl-C aborts them at once (exit 130), and a failed worker ends in one line naming it.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import List, Optional

import torch
import torch.distributed as dist

SIGNALS = (signal.SIGTERM, signal.SIGINT)
STATUS = "exit_status.json"
_pipe = None  # (read, write) of the StopCheck that handles SIGNALS in this process


def _counted(signum, frame) -> None:
    """The Python-level handler: nothing; StopCheck's receiver thread reads the delivery."""


def _forked() -> None:
    global _pipe
    if _pipe is not None:  # a helper (checkpoint writer): the run stops it, not the signal
        signal.set_wakeup_fd(-1)
        for s in SIGNALS:
            signal.signal(s, signal.SIG_IGN)
        for fd in _pipe:
            os.close(fd)
        _pipe = None  # (the numbers are free for this process's own files)


os.register_at_fork(after_in_child=_forked)


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
        self.previous, self.receiver = {}, None
        if handle_signals:  # every delivery counts, also while the main thread is in a long C call
            global _pipe
            _pipe = os.pipe()
            os.set_blocking(_pipe[1], False)
            self.previous = {s: signal.signal(s, _counted) for s in SIGNALS}
            self.previous_wakeup = signal.set_wakeup_fd(_pipe[1], warn_on_full_buffer=False)
            self.receiver = threading.Thread(target=self._receive, args=(_pipe[0],), name="stop-signals", daemon=True)
            self.receiver.start()

    def _receive(self, read: int) -> None:
        """Python's C-level handler writes each signal's number to the wakeup pipe as it arrives;
        ``close()`` writes 0."""
        while numbers := os.read(read, 64):
            for signum in numbers:
                if signum == 0:
                    os.close(read)
                    return
                if signum in SIGNALS:
                    self._on_signal(signum)

    def _on_signal(self, signum: int) -> None:
        name = signal.Signals(signum).name
        if self.signal is None:
            self.signal = name
            if os.environ.get("RANK", "0") == "0":
                again = " (Ctrl-C again to abort now)" if signum == signal.SIGINT else ""
                # one write (end=""): the other ranks write to the same stream, unbuffered under python -u
                print(f"{name} received: saving a checkpoint and stopping at the next step boundary{again}\n", end="", flush=True)
        elif signal.SIGINT in (signum, signal.Signals[self.signal]):  # a second Ctrl-C: abort at once, as users expect
            what = f"a second {name}" if name == self.signal else f"{name} after {self.signal}"
            print(f"aborted by {what}: no checkpoint written\n", end="", file=sys.stderr, flush=True)
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
        global _pipe
        if self.receiver is not None:
            signal.set_wakeup_fd(self.previous_wakeup)
            for s, handler in self.previous.items():
                signal.signal(s, handler)
            os.write(_pipe[1], b"\0")  # the receiver reads the signals before it and stops
            self.receiver.join()
            os.close(_pipe[1])
            self.previous, self.receiver, _pipe = {}, None, None


def stop_line(cause: str, step: int, save: Optional[str], checkpoint: Optional[Path]) -> str:
    """The one line a stopped run ends with (``checkpoint``: the newest one, normally step's)."""
    if save is None:
        return f"stopped by {cause} at step {step}: no --save, nothing saved"
    if checkpoint is None:
        return f"stopped by {cause} at step {step}: no checkpoint (the step was skipped); --load {save} starts afresh"
    return f"stopped by {cause} at step {step}: checkpoint {checkpoint}; --load {save} resumes from it"


def write_status(save: Optional[str], reason: str, step: int, train_iters: int, checkpoint: Optional[Path],
                 signal_name: Optional[str] = None, counts: Optional[dict] = None) -> None:
    """Record why the run ended in ``<save>/exit_status.json`` (atomically; rank 0 only), with the
    non-zero ``counts`` (the loss spikes and rewinds: ``resilience.spikes``)."""
    if save is None or (dist.is_initialized() and dist.get_rank() != 0):
        return
    status = {"reason": reason, "step": step, "train_iters": train_iters,
              "checkpoint": checkpoint.name if checkpoint is not None else None}
    if signal_name:
        status["signal"] = signal_name
    status.update({name: n for name, n in (counts or {}).items() if n})
    path = Path(save) / STATUS
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(STATUS + ".tmp")
    tmp.write_text(json.dumps(status) + "\n")
    os.replace(tmp, path)


def failed_worker(e) -> int:
    """The end of a torchrun whose worker failed (``e``: torch elastic's ``ChildFailedError``): one
    line naming the rank that failed first, after that rank's ``error:`` line when it found bad input
    (``cli.run_cli`` writes it to the worker's error file: torchrun stops the other workers as soon as
    one fails, often before rank 0 has said anything); returns that worker's exit code (128 + the
    signal that killed it), not torchrun's 1, so a job script tells bad input (2) and a hang (124)
    from a crash (``resilience.attempts``)."""
    rank, failure = e.get_first_failure()
    said = {r: f.message for r, f in e.failures.items() if isinstance(f.message, dict) and "time" in f.message.get("extraInfo", {})}
    code = 128 - failure.exitcode if failure.exitcode < 0 else failure.exitcode
    how = f"signal {failure.signal_name()}" if failure.exitcode < 0 else f"exit code {failure.exitcode}"
    if said:  # ranks that found bad input wrote their error line before exiting with 2 (or being stopped)
        rank = min(said, key=lambda r: said[r]["extraInfo"]["time"])
        code, how = 2, "exit code 2"
        if said.get(0, {}).get("message") != said[rank]["message"]:  # else rank 0 printed it itself
            print(said[rank]["message"], file=sys.stderr, flush=True)
    print(f"torchrun: rank {rank} ended with {how}; torchrun stopped the other workers", file=sys.stderr, flush=True)
    return code


def torchrun(argv: List[str]) -> int:
    """torchrun (``argv``: its command line) with the stop of one process (module docstring):
    SIGTERM and SIGINT go to every worker's process group, and torchrun waits for the workers."""
    import psutil
    from torch.distributed import run
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    def forward(signum, frame):
        workers = psutil.Process().children()
        if not workers:  # not started yet: nothing to stop cleanly
            raise SystemExit(128 + signum)
        for worker in workers:
            try:
                os.killpg(worker.pid, signum)  # torchrun starts each in a session of its own
            except ProcessLookupError:
                pass

    previous = {s: signal.signal(s, forward) for s in SIGNALS}
    try:
        run.main(["--signals-to-handle", "SIGHUP,SIGQUIT", *argv])  # torchrun's own handling: the others
    except ChildFailedError as e:
        return failed_worker(e)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return 0
