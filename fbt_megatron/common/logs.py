"""One logger: each module logs to ``logging.getLogger(__name__)`` (all under ``fbt_megatron``), and
each entry point's ``main`` calls ``setup_logging()`` once.

A line is the message as it is (no level or logger name: the output reads as it always did; a
training step's line opens with its UTC time, and ``stamp_lines``, a run's ``--log-timestamps``,
puts the time in front of every line),
INFO on stdout, WARNING and above on stderr (and an INFO record marked ``STDERR``: the status lines
that stand for a progress bar in a batch job's log), each written in one write and flushed at once
(a log read while the process runs, by a person, a launcher or a test, has every line), to the
``sys.stdout``/``sys.stderr`` of the moment (a redirect, a test's capture).

Ranks: in a job of several processes (torchrun, Slurm: a torch.distributed process group, or before
one ``RANK`` and ``WORLD_SIZE``) one process says what the job does: the logging rank, the last, the
pipeline stage that has the losses (``trainer.loop``). A record about this process (its injected
fault, its watchdog, its torchrun), or one where the caller chose the ranks, passes on every rank
that logs it: ``extra=EVERY_RANK``, or every record logged inside ``with on_this_rank():`` (rank 0
prepares the data while the others wait).

What a command is for — tables, generated text, plans, reports, its result lines — is printed, not
logged; ``tests/test_logs.py`` holds the places that print.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import sys
import time
from typing import Callable, Iterator, Tuple

ROOT = "fbt_megatron"
EVERY_RANK = {"every_rank": True}  # extra= of a record said by every rank that logs it
STDERR = {"stderr": True}  # extra= of an INFO record for stderr
STAMPED = {"stamped": True}  # extra= of a record whose message opens with its own UTC time (a step's line)
_this_rank = contextvars.ContextVar("fbt_megatron_logs_this_rank", default=False)


def rank_and_world() -> Tuple[int, int]:
    """This process's rank and the world's size: the process group's when there is one, else
    torchrun's/Slurm's environment (``RANK``, ``WORLD_SIZE``), else (0, 1)."""
    dist = sys.modules.get("torch.distributed")  # a process that never imported torch has no group
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def is_logging_rank() -> bool:
    """Whether this process says what the job does: the last rank (its pipeline stage has the losses)."""
    rank, world = rank_and_world()
    return rank == world - 1


@contextlib.contextmanager
def on_this_rank() -> Iterator[None]:
    """Every record this thread logs inside passes on this rank, whichever it is (the caller chose it)."""
    token = _this_rank.set(True)
    try:
        yield
    finally:
        _this_rank.reset(token)


class RankFilter(logging.Filter):
    """Lets a record through on the logging rank (the last), and one marked ``EVERY_RANK`` or
    logged inside ``on_this_rank()`` on any rank. ``where``: () → (rank, world size)."""

    def __init__(self, where: Callable[[], Tuple[int, int]] = rank_and_world):
        super().__init__()
        self.where = where

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "every_rank", False) or _this_rank.get():
            return True
        rank, world = self.where()
        return rank == world - 1


class _Streams(logging.StreamHandler):
    """stdout for INFO, stderr for WARNING and above and for a record marked ``STDERR``; each
    looked up when the record comes. StreamHandler writes message and newline in one write and flushes."""

    def __init__(self):
        super().__init__(sys.stdout)

    def emit(self, record: logging.LogRecord) -> None:
        to_stderr = record.levelno >= logging.WARNING or getattr(record, "stderr", False)
        self.stream = sys.stderr if to_stderr else sys.stdout  # (Handler.handle holds the handler's lock)
        super().emit(record)


class _Lines(logging.Formatter):
    """The message as it is; with ``stamped`` (``stamp_lines``) its UTC time in front, ISO 8601,
    unless the record carries its own (``STAMPED``)."""

    converter = time.gmtime

    def __init__(self, stamped: bool = False):
        super().__init__("%(message)s")
        self.stamped = stamped

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        if not self.stamped or getattr(record, "stamped", False):
            return line
        when = self.formatTime(record, "%Y-%m-%dT%H:%M:%SZ")
        return "\n".join(f"{when} {part}" for part in line.split("\n"))  # each line of a message of several


def stamp_lines(on: bool = True) -> None:
    """Every line of this process's logger opens with its UTC time (``--log-timestamps``)."""
    for handler in logging.getLogger(ROOT).handlers:
        if isinstance(handler, _Streams):
            handler.setFormatter(_Lines(stamped=on))


def setup_logging(level: int = logging.INFO) -> logging.Logger:
    """The ``fbt_megatron`` logger of this process: one handler (``_Streams``, the plain message,
    ``RankFilter``), ``level``, not passed on to the root logger (a library's configuration of
    it leaves ours alone). Called again (a test, a command run in-process) it sets the level and
    adds nothing. Returns the logger."""
    logger = logging.getLogger(ROOT)
    handler = next((h for h in logger.handlers if isinstance(h, _Streams)), None)
    if handler is None:
        handler = _Streams()
        handler.setFormatter(_Lines())
        handler.addFilter(RankFilter())
        logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False
    return logger
