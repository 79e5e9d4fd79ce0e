"""``<save>/heartbeat.json``: where a run is, for a cluster monitor that cannot read its log.

``{"step", "train_iters", "tokens", "time" (Unix seconds), "time_utc", "last_checkpoint"
("iter_000000N" or null), "pid", "host"}``, written by one rank (the logging one) after a step and
its checkpoint, if one was due (``last_checkpoint`` is the newest complete one, that step's own when
it saved), at most every ``--heartbeat-interval`` seconds (0: every step) and at the end, atomically
(``io.atomic_write``): a reader sees the previous heartbeat or the new one, whole. A monitor that
finds ``time`` older than a few intervals (and no ``exit_status.json`` newer than it) has found a
stalled run.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Optional

from fbt_megatron.common.clock import utc
from fbt_megatron.common.io import atomic_write
from fbt_megatron.trainer.callbacks.base import Callback

HEARTBEAT = "heartbeat.json"


def read_heartbeat(folder) -> Optional[dict]:
    path = Path(folder) / HEARTBEAT
    return json.loads(path.read_text()) if path.is_file() else None


class Heartbeat(Callback):
    """``beat(state)`` after each step and its checkpoint (``on_save``): rewrites the file when
    ``interval`` seconds have passed since the last write (or ``force``: at the end of the loop,
    ``on_stop`` / ``on_failure``, the step it reached)."""

    def __init__(self, folder: Optional[str], interval: float, train_iters: int, active: bool = True):
        self.path = Path(folder) / HEARTBEAT if folder is not None and active else None
        self.interval, self.train_iters, self.last = interval, train_iters, None

    def beat(self, state, force: bool = False) -> None:
        now = time.time()
        if self.path is None or not (force or self.last is None or now - self.last >= self.interval):
            return
        from fbt_megatron.trainer import checkpointing

        self.last = now
        saved = checkpointing.latest_iteration(self.path.parent)
        record = {"step": state.iteration, "train_iters": self.train_iters, "tokens": state.tokens, "time": now,
                  "time_utc": utc(now),
                  "last_checkpoint": checkpointing.checkpoint_dir(self.path.parent, saved).name if saved is not None else None,
                  "pid": os.getpid(), "host": socket.gethostname()}
        atomic_write(self.path, json.dumps(record) + "\n")

    def on_save(self, state, checkpoint) -> None:
        self.beat(state)  # after the save: it names the checkpoint just written

    def on_stop(self, state, reason: str) -> None:
        self.beat(state, force=True)

    def on_failure(self, state, error: BaseException) -> None:
        self.beat(state, force=True)
