"""No process outlives its run: the processes a run starts die with it, whatever kills it.

A training process forks helpers — megatron-core's checkpoint writers and the manager that passes
their results back (``megatron_fixes``), data-preparation workers — and under torchrun the
training processes are themselves the launcher's children, each in a session of its own. When
their parent dies of ``kill -9``, an OOM kill or a second Ctrl-C (``os._exit``), nothing would
stop them: the results-queue manager ignores SIGINT and SIGTERM and would live on with parent 1.

``install()`` (from ``platform.install()``) makes the kernel end them: every process this one
forks from now on gets SIGKILL when its parent dies (Linux's ``PR_SET_PDEATHSIG``), and so do its
own forks in turn; a training process started by torchrun gets SIGKILL when torchrun dies. The
kernel ties that signal to the *thread* that forked: a fork from another thread (rare) is watched
by a thread of the child instead, which kills the child once its parent is gone.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from typing import Optional

GROUP_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")  # torch.distributed's rendezvous


def outside_group(environ: Optional[dict] = None) -> dict:
    """``environ`` (default: this process's environment) without torch.distributed's rendezvous
    variables: a command started from inside a job's process (a test, the rehearsal, a GPU check)
    sets up its own world rather than joining this one's."""
    return {k: v for k, v in (os.environ if environ is None else environ).items() if k not in GROUP_VARIABLES}


_PR_SET_PDEATHSIG = 1
_libc = None
_parent = None  # in the parent at fork time: (its pid, whether the main thread forked)


def install() -> None:
    """Helpers forked from now on die with this process; under torchrun this process dies with
    torchrun. Idempotent; does nothing off Linux."""
    global _libc
    if _libc is not None or not sys.platform.startswith("linux"):
        return
    _libc = ctypes.CDLL(None, use_errno=True)
    os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a worker of torchrun (its own session: no terminal signal reaches it)
        die_with_parent()


def die_with_parent(parent: Optional[int] = None) -> None:
    """SIGKILL to this process when the thread that started it ends (with ``parent``, its pid
    when forking: at once if it is gone already)."""
    if _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if parent is not None and os.getppid() != parent:  # it died before the signal was armed
        os.kill(os.getpid(), signal.SIGKILL)


def _before_fork() -> None:
    global _parent
    _parent = (os.getpid(), threading.current_thread() is threading.main_thread())


def _after_fork_in_child() -> None:
    parent, from_main_thread = _parent
    if from_main_thread:
        die_with_parent(parent)
    else:
        threading.Thread(target=_watch, args=(parent,), name="die-with-parent", daemon=True).start()


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGKILL)
