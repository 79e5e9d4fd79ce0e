"""Why and when a run stops before ``--train-iters``: a signal, a time budget, ``--exit-interval``.

With ``--exit-signal-handler`` (the default) SIGTERM and SIGINT only set a flag: Slurm's signal
before the time limit, ``scontrol requeue``, ``kill`` and Ctrl-C (torchrun forwards TERM, INT, HUP
and QUIT to its workers). ``--exit-duration-in-mins M`` raises the same flag once M minutes have
passed since ``train()`` started. At the next step boundary every rank stops together: the run
saves a checkpoint (with ``--save``) and exits 0 with one line naming the checkpoint; ``--load``
resumes it exactly. ``--exit-interval N`` ends the run the same way after every N-th step, with no
line (exit status ``exit_interval``). A second Ctrl-C aborts at once (exit 130, nothing saved); so does a SIGTERM
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
"spikes": S, "rewinds": R (when there were: ``trainer.callbacks.spikes``), "stuck_ranks": [R, ...] (a hang:
the ranks the others wait for, ``trainer.callbacks.watchdog``)}``,
for job scripts (Slurm) deciding whether to resubmit.

Every delivery counts, whatever the main thread is doing (a long kernel, a collective waiting for
a peer): Python's C-level handler writes each signal's number to its wakeup pipe, and a thread of
``StopCheck`` reads it. Processes forked while it handles the signals (megatron-core's checkpoint
writers) ignore SIGTERM and SIGINT: the run decides when to stop, and they die with it
(``fbt_megatron.common.processes``).

Under torchrun the training processes are in sessions of their own: a terminal's Ctrl-C reaches
only torchrun, which forwards it, gives the workers 30 s (then kills them) and, after their clean
stop, ends with its own ``SignalException`` traceback and exit 1; on a second Ctrl-C it sends them
SIGTERM (they abort) and ends the same way. ``torchrun()`` (``python -m fbt_megatron.torchrun``,
torchrun's own command line; on Slurm ``python -m fbt_megatron.slurm torchrun``) forwards TERM and
INT to the workers instead and lets torchrun wait for them, however long the save takes (on Slurm
at most the time left before the job's time limit, ``--stop-timeout``): a clean stop exits 0 with
the workers' line last, a second Ctrl-C aborts them at once (exit 130), and a failed worker ends in
one line naming it, with its exit code (128 + the signal that killed it), also when a signal comes
after the worker died and before torchrun noticed (srun ending a Slurm step for another node's bad
exit: ``failed_so_far``), and at once. That needs torchrun's ``--signals-to-handle`` (pytorch PR #160690, August 2025);
an older torchrun handles TERM and INT itself, as plain torchrun does, and says so when it starts.

With ``--max-restarts N`` torchrun restarts failed workers (a crash, a hang's exit 124) from the
newest checkpoint (a Slurm job's in-job restarts, ``launch/attempts.py``), but not bad input: a worker
that found it signals its agent (``cli.AGENT``, ``BAD_INPUT_SIGNAL``), which stops every worker and
ends with that worker's ``error:`` line, exit code 2. Each rendezvous round's workers get a store of
their own (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE``): in the agent's one store a restart's workers would
find the dead workers' addresses.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import List, NoReturn, Optional

import torch
import torch.distributed as dist

from fbt_megatron.common import logs, platform
from fbt_megatron.common.cli import AGENT, BAD_INPUT_SIGNAL
from fbt_megatron.common.errors import peer_lost
from fbt_megatron.common.io import atomic_write

log = logging.getLogger(__name__)

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
    ``start_step()`` before a step's work, ``stop_reason(iteration)`` after it: None, "signal",
    "duration" or, every ``exit_interval`` steps, "exit_interval". A context manager: ``close`` on exit."""

    def __init__(self, exit_duration_in_mins: Optional[float], handle_signals: bool, started: float,
                 exit_interval: Optional[int] = None):
        self.started, self.exit_interval = started, exit_interval  # time.monotonic() when train() started
        self.budget_s = None if exit_duration_in_mins is None else 60.0 * exit_duration_in_mins
        self.signal: Optional[str] = None  # the first signal received (on this rank; after a stop: on any rank)
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.group = None
        if self.world > 1 and dist.get_backend() != "gloo":  # a CPU group: the flags never touch the device
            # with the run's timeout: gloo's own default (30 min) would end a hang before the watchdog
            self.group = dist.new_group(backend="gloo", timeout=platform.collective_timeout())
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
            again = " (Ctrl-C again to abort now)" if signum == signal.SIGINT else ""
            log.info(f"{name} received: saving a checkpoint and stopping at the next step boundary{again}")  # the logging rank
        elif signal.SIGINT in (signum, signal.Signals[self.signal]):  # a second Ctrl-C: abort at once, as users expect
            what = f"a second {name}" if name == self.signal else f"{name} after {self.signal}"
            log.warning(f"aborted by {what}: no checkpoint written")  # the logging rank: every rank got the signal
            os._exit(130)

    def start_step(self) -> None:
        self.flags = torch.tensor([float(signal.Signals[self.signal] if self.signal else 0), float(self._overtime())])
        if self.world > 1:
            self.pending = dist.all_reduce(self.flags, op=dist.ReduceOp.MAX, group=self.group, async_op=True)

    def __enter__(self) -> "StopCheck":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def stop_reason(self, iteration: int) -> Optional[str]:
        """Why the run stops after step ``iteration``, the same on every rank; None: it goes on."""
        if self.world == 1:  # nothing to agree on: the flags as they are now
            self.start_step()
        pending, self.pending = self.pending, None
        if pending is not None:
            try:
                pending.wait()
            except RuntimeError as e:  # gloo: "Connection closed by peer"; NCCL: the communicator aborted
                raise peer_lost(dist.get_rank(), "the ranks' stop check", e) from None
        signalled, overtime = (int(x) for x in self.flags.tolist())
        if signalled:
            self.signal = signal.Signals(signalled).name
        if signalled or overtime:
            return "signal" if signalled else "duration"
        return "exit_interval" if self.exit_interval and iteration % self.exit_interval == 0 else None

    def _overtime(self) -> bool:
        return self.budget_s is not None and time.monotonic() - self.started >= self.budget_s

    def describe(self, reason: str) -> str:
        """The cause of a stop in words: "SIGTERM", "--exit-duration-in-mins 30"."""
        if reason == "signal":
            return self.signal
        return f"--exit-duration-in-mins {self.budget_s / 60:g}"

    def close(self) -> None:
        """Restore the signal handlers there were before (a process may train again)."""
        if self.pending is not None:  # an exception left the step: its own error is the one to say
            try:
                self.pending.wait()
            except RuntimeError:  # the same lost rank, a second time
                pass
            self.pending = None
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
                 signal_name: Optional[str] = None, counts: Optional[dict] = None,
                 stuck_ranks: Optional[List[int]] = None) -> None:
    """Record why the run ended in ``<save>/exit_status.json`` (atomically), with the non-zero
    ``counts`` (the loss spikes and rewinds: ``trainer.callbacks.spikes``). Rank 0 writes it; a hang's
    (``stuck_ranks``: the ranks the others wait for, ``trainer.callbacks.watchdog``) every rank that
    diagnosed it writes, the same content: rank 0 may be the stuck one, and the first rank to exit
    may have the others killed."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    if save is None or (rank != 0 and stuck_ranks is None):
        return
    status = {"reason": reason, "step": step, "train_iters": train_iters,
              "checkpoint": checkpoint.name if checkpoint is not None else None}
    if signal_name:
        status["signal"] = signal_name
    status.update({name: n for name, n in (counts or {}).items() if n})
    if stuck_ranks is not None:
        status["stuck_ranks"] = stuck_ranks
    Path(save).mkdir(parents=True, exist_ok=True)
    atomic_write(Path(save) / STATUS, json.dumps(status) + "\n")  # ranks may write at once: each its own temporary


def bad_input(log_dir: str) -> int:
    """The end of a torchrun whose worker found bad input and stopped it (``cli.AGENT``): the
    ``error:`` line of the worker that wrote it first (its error file under torchrun's ``log_dir``),
    unless rank 0 said it (``cli._bad_input``); exit code 2."""
    said = []
    for path in Path(log_dir).glob("**/error.json"):
        try:
            message = json.loads(path.read_text())["message"]
            said.append((message["extraInfo"]["time"], message["extraInfo"].get("rank"), message["message"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue  # a worker's own traceback file (torch elastic's @record), or half written
    if said:
        _, rank, line = min(said)
        if rank != 0:
            log.error(line, extra=logs.EVERY_RANK)
        log.error(f"torchrun: rank {rank} ended with exit code 2; torchrun stopped the other workers", extra=logs.EVERY_RANK)
    return 2


FOLLOWED = (signal.SIGTERM, signal.SIGINT)  # how a stopped worker ends: it followed a failure, it did not cause one


def first_failure(failures: dict) -> tuple:
    """The rank that failed first among torch elastic's ``failures`` (global rank: ``ProcessFailure``)
    and its failure: the earliest torchrun saw (its times are whole seconds, a poll's failures share
    one); of those seen together, a worker a signal killed (SIGKILL, SIGSEGV; not ``FOLLOWED``) before
    the workers that exited because it died (a connection closed: exit 1)."""
    def followed(failure) -> bool:
        return not (failure.exitcode < 0 and -failure.exitcode not in FOLLOWED)

    return min(failures.items(), key=lambda item: (item[1].timestamp, followed(item[1])))


def failed_worker(e) -> int:
    """The end of a torchrun whose worker failed (``e``: torch elastic's ``ChildFailedError``): one
    line naming the rank that failed first (``first_failure``), after that rank's ``error:`` line when
    it found bad input (``cli.run_cli`` writes it to the worker's error file: torchrun stops the other
    workers as soon as one fails, often before rank 0 has said anything); returns that worker's exit
    code (128 + the signal that killed it), not torchrun's 1, so a job script tells bad input (2) and
    a hang (124) from a crash (``launch.attempts``)."""
    rank, failure = first_failure(e.failures)
    said = {r: f.message for r, f in e.failures.items() if isinstance(f.message, dict) and "time" in f.message.get("extraInfo", {})}
    code = 128 - failure.exitcode if failure.exitcode < 0 else failure.exitcode
    how = f"signal {failure.signal_name()}" if failure.exitcode < 0 else f"exit code {failure.exitcode}"
    if said:  # ranks that found bad input wrote their error line before exiting with 2 (or being stopped)
        rank = min(said, key=lambda r: said[r]["extraInfo"]["time"])
        code, how = 2, "exit code 2"
        if said.get(0, {}).get("message") != said[rank]["message"]:  # else rank 0 printed it itself
            log.error(said[rank]["message"], extra=logs.EVERY_RANK)
    log.error(f"torchrun: rank {rank} ended with {how}; torchrun stopped the other workers", extra=logs.EVERY_RANK)
    return code


HANDLED_BY_TORCHRUN = "SIGHUP,SIGQUIT"  # torchrun's own handling (a SignalException); TERM and INT: ``torchrun()``'s


def own_signal_options(parser) -> List[str]:
    """torchrun's options that leave SIGTERM and SIGINT to ``torchrun()``: ``--signals-to-handle``
    where torchrun's ``parser`` knows it (pytorch PR #160690, August 2025), else none (an older
    torchrun refuses the option; its ``PContext.start`` installs its handler for TERM, INT, HUP and
    QUIT whatever the environment says, and ``TORCHELASTIC_SIGNALS_TO_HANDLE`` is overwritten by a
    newer torchrun from the option: the option is the one way)."""
    return ["--signals-to-handle", HANDLED_BY_TORCHRUN] if "--signals-to-handle" in parser._option_string_actions else []


def _signal_workers(context, signum: int) -> None:
    """Send ``signum`` to each worker of ``context`` (one start of torchrun's workers): to its process
    group, torchrun starts each in a session of its own."""
    for pid in context.pids().values():
        try:
            os.killpg(pid, signum)
        except ProcessLookupError:
            pass


def failed_so_far(context) -> Optional[Exception]:
    """The workers of ``context`` (torch elastic's ``SubprocessContext``: one start of them) that have
    ended non-zero, as torchrun's ``ChildFailedError`` names them (None: none has): those its poll has
    seen, at its times, and those it has not polled yet, now (reaped here: a dead worker is a zombie
    until then, and its exit status stays with torchrun's ``Popen``, which its own poll reads)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    failures = dict(context._failures)
    for local_rank, handler in context.subprocess_handlers.items():
        if local_rank not in failures and handler.proc.poll():
            failures[local_rank] = ProcessFailure(local_rank=local_rank, pid=handler.proc.pid,
                                                  exitcode=handler.proc.returncode, error_file=context.error_files[local_rank])
    if not failures:
        return None
    return ChildFailedError(name=str(context.entrypoint), failures={int(context.envs[r]["RANK"]): f for r, f in failures.items()})


def _end_failed(context, e, log_dir: str) -> NoReturn:
    """End this launcher now with its workers' failure ``e`` (``failed_worker``: the line, the exit
    code), killing the workers left: they cannot stop cleanly after a failure, and Slurm's SIGKILL
    (``KillWait`` after its SIGTERM) must not find torchrun still closing its workers and rendezvous."""
    code = failed_worker(e)
    _signal_workers(context, signal.SIGKILL)
    shutil.rmtree(log_dir, ignore_errors=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def torchrun(argv: List[str], stop_timeout: Optional[float] = None) -> int:
    """torchrun (``argv``: its command line) with the stop of one process (module docstring):
    SIGTERM and SIGINT go to every worker's process group, and torchrun waits for the workers —
    with ``stop_timeout``, at most that many seconds after the first signal; then they are killed
    (SIGKILL) and this ends in one line, exit code 128 + 9. A signal that finds a worker failed
    (``failed_so_far``: srun ending the step for another node's bad exit) ends this at once with that
    worker's line and exit code, not the signal's; after the end a signal changes nothing. A torchrun
    without ``--signals-to-handle`` (``own_signal_options``) handles TERM and INT itself: it gives the
    workers 30 s and this ends in one line, 128 + the signal."""
    from torch.distributed import run
    from torch.distributed.elastic.agent.server import local_elastic_agent
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    options = own_signal_options(run.get_args_parser())
    if not options:
        log.warning(f"torchrun: torch {torch.__version__}'s torchrun has no --signals-to-handle: on SIGTERM or SIGINT it gives "
                    "the workers 30 s to stop before it kills them (a newer torch waits for them)", extra=logs.EVERY_RANK)
    stopping: dict = {}  # the first signal forwarded, the timer that ends the wait for the workers, "killed" when it did
    launched: dict = {}  # "workers": torchrun's latest start of the workers (its SubprocessContext)
    log_dir = tempfile.mkdtemp(prefix="fbt-torchrun-")  # the workers' error files (torchrun's --log-dir)
    os.environ[AGENT] = str(os.getpid())
    # Each rendezvous round's workers get a store of their own (rank 0's, on a fresh port), not the agent's
    # one store for every round: a restart's workers would read the dead workers' addresses from it (gloo's
    # full mesh: connection refused; NCCL's unique id) under the same keys (torch's dynamic_rendezvous).
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    start_processes = local_elastic_agent.start_processes

    def start(*args, **kwargs):  # torchrun's agent starting its workers (again after an in-job restart)
        launched["workers"] = start_processes(*args, **kwargs)
        return launched["workers"]

    def stop_for_bad_input(signum, frame):  # torchrun's agent then stops the workers, as on its own signals
        if not stopping.get("bad input"):
            stopping["bad input"] = True
            for name in ("agent.server.api", "multiprocessing.api"):  # not its "death signal" lines: bad_input says why
                logging.getLogger(f"torch.distributed.elastic.{name}").setLevel(logging.ERROR)
            raise SignalException("a worker found bad input", sigval=signal.Signals(signum))

    def forward(signum, frame):
        if "workers" not in launched:  # not started yet: nothing to stop cleanly
            raise SystemExit(128 + signum)
        if not (stopping.get("killed") or stopping.get("bad input")) and (failed := failed_so_far(launched["workers"])):
            _end_failed(launched["workers"], failed, log_dir)  # a worker failed before this signal: that is the end
        _signal_workers(launched["workers"], signum)
        if stop_timeout is not None and "timer" not in stopping:  # the first signal: the wait starts
            timer = threading.Timer(stop_timeout, kill)
            timer.daemon = True
            stopping.update(signal=signal.Signals(signum).name, timer=timer)
            timer.start()

    def kill():
        stopping["killed"] = True
        _signal_workers(launched["workers"], signal.SIGKILL)

    local_elastic_agent.start_processes = start
    handled = {s: forward for s in SIGNALS} | {BAD_INPUT_SIGNAL: stop_for_bad_input}
    for s, handler in handled.items():
        signal.signal(s, handler)
    try:
        run.main([*options, "--log-dir", log_dir, *argv])
    except SignalException as e:  # HUP or QUIT; TERM and INT too from an older torchrun
        if stopping.get("bad input"):
            return bad_input(log_dir)
        log.warning(f"torchrun: {e.sigval.name}: the workers were sent {e.sigval.name} and have ended", extra=logs.EVERY_RANK)
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        if stopping.get("killed"):
            log.error(f"torchrun: the workers had not stopped {stop_timeout:g} s after {stopping['signal']}: killed them "
                      "(SIGKILL); the newest complete checkpoint is the one to resume from", extra=logs.EVERY_RANK)
            return 128 + signal.SIGKILL
        return failed_worker(e)
    finally:
        for s in handled:  # the end is decided: a signal now (Slurm's, after srun ended the step) does not change it
            signal.signal(s, signal.SIG_IGN)
        if "timer" in stopping:
            stopping["timer"].cancel()
        local_elastic_agent.start_processes = start_processes
        shutil.rmtree(log_dir, ignore_errors=True)
    return 0
