"""The hang watchdog: a run whose steps stop coming is ended, with every rank's Python stacks.

A thread per rank watches the training loop's progress (``kick`` at every step boundary). After
``--hang-timeout-minutes`` without one (a step, its validation and its checkpoint must fit), each
rank writes ``<save>/hang/rank<R>.txt``: one line saying where its main thread is and whether that
is inside a collective (``torch.distributed``), then every thread's stack (``faulthandler``). A
rank stuck outside a collective is the cause; the ranks waiting for it inside one are not — so
the first rank with a file waits up to ``GRACE_S`` for the others' and names the stuck ranks in one
line. Then every rank exits with ``HANG_EXIT`` (124, as ``timeout`` does), which a Slurm job
restarts from the last checkpoint (``attempts``); ``exit_status.json`` says ``hang``. A rank stuck
holding the interpreter (a C call that never returns) writes nothing: it is named by its missing
file, and the launcher (torchrun, srun) ends it once the others have exited.

``--distributed-timeout-minutes`` (Megatron-LM's flag, default 10) is the process groups' own
timeout: a collective that waits longer fails with an error. A watchdog timeout below it ends
hangs in collectives sooner and with stacks; above it, it catches what the groups cannot (a rank
stuck in I/O, a data loader, a deadlock in Python).
"""

from __future__ import annotations

import faulthandler
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Optional

HANG_EXIT = 124
GRACE_S = 20.0  # how long the first rank waits for the others' stacks


def _main_thread_at() -> tuple:
    """(where the main thread is: its innermost frame in this package as fbt_megatron/FILE:LINE in
    FUNCTION, whether it is inside torch.distributed)."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    frames = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    ours = [f for f in frames if f"{os.sep}fbt_megatron{os.sep}" in f.f_code.co_filename]
    if not ours:
        return "(unknown)", False
    path = ours[0].f_code.co_filename
    where = f"{path[path.rindex(f'{os.sep}fbt_megatron{os.sep}') + 1:]}:{ours[0].f_lineno} in {ours[0].f_code.co_name}"
    return where, any(f"torch{os.sep}distributed{os.sep}" in f.f_code.co_filename for f in frames[:3])


class Watchdog:
    """Ends the run when ``kick`` has not been called for ``minutes`` (0: no watchdog); ``save``:
    the run folder (None: the stacks go to stderr); ``step``: the iteration the loop starts at."""

    def __init__(self, minutes: float, save: Optional[str], step: int, train_iters: int):
        import torch.distributed as dist

        self.timeout_s, self.step, self.train_iters, self.save = 60.0 * minutes, step, train_iters, save
        self.rank, self.world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        self.folder = Path(save) / "hang" if save else None  # a previous hang's files stay until the next one
        self.last, self.started, self.done, self.thread = time.monotonic(), time.time(), threading.Event(), None
        if self.timeout_s > 0:
            self.thread = threading.Thread(target=self._watch, name="hang-watchdog", daemon=True)
            self.thread.start()

    def kick(self, step: int) -> None:
        """Progress: the loop is at step boundary ``step``."""
        self.last, self.step = time.monotonic(), step

    def close(self) -> None:
        self.done.set()
        if self.thread is not None:
            self.thread.join()

    def _watch(self) -> None:
        while not self.done.wait(min(self.timeout_s / 10, 10.0)):
            if time.monotonic() - self.last > self.timeout_s:
                self._fire()

    def _fire(self) -> None:
        idle = time.monotonic() - self.last
        where, inside = _main_thread_at()
        head = (f"rank {self.rank} (host {socket.gethostname()}, pid {os.getpid()}): no step progress for {idle:.0f} s "
                f"after step {self.step}; main thread at {where}; {'in a collective' if inside else 'not in a collective'}\n")
        if self.folder is None:
            sys.stderr.write("hang watchdog: " + head)
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            sys.stderr.flush()
            os._exit(HANG_EXIT)
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"rank{self.rank}.txt"
        tmp = path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            f.write(head)
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        os.replace(tmp, path)
        heads = self._gather()
        if min(heads) == self.rank:  # the first rank with stacks says it, once
            print(self._line(idle, heads), flush=True)
            self._status()
        os._exit(HANG_EXIT)

    def _gather(self) -> dict:
        """Rank → the first line of its stacks file, for every rank that wrote one within GRACE_S."""
        deadline = time.monotonic() + GRACE_S
        while True:
            heads = {}
            for r in range(self.world):
                path = self.folder / f"rank{r}.txt"
                if path.is_file() and path.stat().st_mtime >= self.started - 1:  # this run's, not an earlier hang's
                    heads[r] = path.read_text().split("\n", 1)[0]
            if len(heads) == self.world or time.monotonic() > deadline:
                return heads
            time.sleep(0.2)

    def _line(self, idle: float, heads: dict) -> str:
        stuck = [r for r, head in heads.items() if head.endswith("; not in a collective")]
        silent = [r for r in range(self.world) if r not in heads]
        waiting = [r for r in heads if r not in stuck]
        parts = [f"{_ranks(stuck)} stuck outside a collective ({heads[stuck[0]].split('main thread at ')[1].split(';')[0]})"
                 if stuck else "", f"{_ranks(silent)} wrote no stacks (stuck holding the interpreter, or gone)" if silent else "",
                 f"{_ranks(waiting)} waiting in a collective" if waiting else ""]
        return (f"hang: no step progress for {idle:.0f} s after step {self.step} (--hang-timeout-minutes "
                f"{self.timeout_s / 60:g}): {'; '.join(filter(None, parts))}; stacks in {self.folder}/rank*.txt; "
                f"exit {HANG_EXIT}: a restart (--load) resumes from the last checkpoint")

    def _status(self) -> None:
        from fbt_megatron import checkpointing
        from fbt_megatron.stopping import write_status

        newest = checkpointing.latest_iteration(self.save)
        write_status(self.save, "hang", self.step, self.train_iters,
                     None if newest is None else checkpointing.checkpoint_dir(self.save, newest))


def _ranks(ranks: list) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))
