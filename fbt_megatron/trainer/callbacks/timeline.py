"""``<save>/timeline.jsonl``: when a run's processes started, saved and ended, one line per event,
appended by the logging rank and never rewritten (``metrics.jsonl`` drops the steps a restart redoes;
this keeps every start): what ``launch/attempts.py`` counts torchrun's in-job restarts from and
``launch/goodput.py`` accounts a job's time with. Times are Unix seconds (UTC).

* ``{"event": "start", "time", "began", "load_seconds", "step", "job_id", "restart_count",
  "elastic_restart", "world_size", "nodes"}``: the training ready to take its first step (``time``),
  its process started at ``began``, ``load_seconds`` of it loading the checkpoint of ``step`` (0: from
  scratch); Slurm's job and restart count, and this node's torchrun restarts
  (``TORCHELASTIC_RESTART_COUNT``: a restart another node's failure caused is not counted there).
* ``{"event": "step", "time", "step"}``: a logged step done (every ``--log-interval``; not synced to
  disk, the others are), ``"straggler"``: the slowest rank's time over the median's, when one was named.
* ``{"event": "save", "time", "step", "seconds"}``: a checkpoint written, ``seconds`` what it held
  training up (with ``--async-save``, the part in the step).
* ``{"event": "end", "time", "step", "reason"}``: the loop ended without an error (``reason``:
  finished, exit_interval, signal, duration); a failure writes none.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import List, Optional

import psutil

from fbt_megatron.common.io import append_line, append_synced
from fbt_megatron.trainer.callbacks.base import Callback

TIMELINE = "timeline.jsonl"


class Timeline(Callback):
    """The run's events in ``<save>/timeline.jsonl`` (module docstring): its start (``ranks``: every
    rank's node, ``load_seconds``: what loading its checkpoint took), each checkpoint ``checkpointer`` writes,
    its end."""

    def __init__(self, save: str, checkpointer, ranks: List[dict], load_seconds: float):
        self.path, self.checkpointer, self.ranks, self.load_seconds = Path(save) / TIMELINE, checkpointer, ranks, load_seconds
        self.saves, self.save_time = checkpointer.saves, checkpointer.save_time

    def record(self, event: str, **fields) -> None:
        append_synced(self.path, json.dumps({"event": event, "time": round(time.time(), 3), **fields}) + "\n")

    def on_start(self, state) -> None:
        env = os.environ
        self.record("start", began=round(psutil.Process().create_time(), 3), load_seconds=round(self.load_seconds, 3),
                    step=state.iteration, job_id=int(env["SLURM_JOB_ID"]) if "SLURM_JOB_ID" in env else None,
                    restart_count=int(env.get("SLURM_RESTART_COUNT", 0)),
                    elastic_restart=int(env.get("TORCHELASTIC_RESTART_COUNT", 0)), world_size=len(self.ranks),
                    nodes=sorted({r["node"] for r in self.ranks}))

    def on_step_end(self, state, record: Optional[dict]) -> None:
        if record is not None:
            slowest = max((s["ratio"] for s in record.get("stragglers", [])), default=None)
            event = {"event": "step", "time": round(time.time(), 3), "step": state.iteration}
            append_line(self.path, json.dumps({**event, **({"straggler": round(slowest, 3)} if slowest else {})}) + "\n")

    def on_save(self, state, checkpoint: Optional[Path]) -> None:
        written = self.checkpointer
        if written.saves > self.saves:
            self.record("save", step=state.iteration, seconds=round(written.save_time - self.save_time, 3))
            self.saves, self.save_time = written.saves, written.save_time

    def on_stop(self, state, reason: str) -> None:
        self.record("end", step=state.iteration, reason=reason)


def read_timeline(folder) -> List[dict]:
    path = Path(folder) / TIMELINE
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
