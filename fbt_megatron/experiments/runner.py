"""Runs a grid's training runs through the entry point, a few at a time, resumably.

Each run is ``python -m fbt_megatron.train --recipe R FLAGS --save F --load F`` in a process of its
own (niced), its output in ``F/train.log``; a task run is then evaluated by
``python -m fbt_megatron.evaluation.tasks.evaluate`` into ``F/eval.json``. A run whose ``F/done.json`` exists
is reused as it is; an interrupted one resumes from its newest checkpoint (or starts again when it
has none). ``F/run.json`` holds the command: a folder made by another command is an error, never
overwritten. Runs start in the grid's order while their threads fit in ``cpus``, at most ``jobs``
at a time; a failed run is reported and the others go on.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import List, Optional

from tqdm import tqdm

from fbt_megatron.common.io import atomic_write
from fbt_megatron.experiments.grid import REPO, RunSpec
from fbt_megatron.trainer.callbacks.metrics_writer import read_metrics

STEP_LINE = re.compile(r"^\S+Z step\s+(\d+)\b")  # a step's log line: its UTC time, the step (trainer.callbacks.metrics_writer.format_record)
DONE, IDENTITY, EVAL = "done.json", "run.json", "eval.json"


def train_command(run: RunSpec) -> List[str]:
    return ["-m", "fbt_megatron.train", "--recipe", str(run.recipe), *run.flags, "--save", str(run.folder),
            "--load", str(run.folder)]


def eval_command(run: RunSpec, output: Path) -> List[str]:
    e = run.evaluate
    return ["-m", "fbt_megatron.evaluation.tasks.evaluate", "--recipe", str(run.recipe), *run.flags, "--load", str(run.folder),
            "--sequences", str(e.get("sequences", 256)), "--lengths", *map(str, e.get("lengths", [1, 2, 4])),
            "--json", str(output)]


def trained(run: RunSpec) -> bool:
    """Whether the run's training has logged and checkpointed its last step."""
    from fbt_megatron.trainer.checkpointing import latest_iteration

    records = read_metrics(run.folder)
    return bool(records) and records[-1]["step"] == run.steps and latest_iteration(run.folder) == run.steps


def is_done(run: RunSpec) -> bool:
    return (run.folder / DONE).is_file()


def _write_json(path: Path, value) -> None:
    atomic_write(path, json.dumps(value, indent=2) + "\n")


def identity(run: RunSpec) -> dict:
    """What ``run.json`` holds: the run's command."""
    return {"recipe": str(run.recipe), "flags": list(run.flags)}


def claim(run: RunSpec) -> None:
    """Make ``run.folder`` this run's (``run.json``), or fail when another command made it."""
    path = run.folder / IDENTITY
    if path.is_file():
        before = json.loads(path.read_text())
        if before != identity(run):
            raise ValueError(f"{run.folder} holds a run of another command ({before['recipe']} {' '.join(before['flags'])}); "
                             "remove it or choose another --root")
        return
    run.folder.mkdir(parents=True, exist_ok=True)
    _write_json(path, identity(run))


class Runner:
    """Runs ``runs`` (``RunSpec``) ``jobs`` at a time within ``cpus`` threads, at ``nice``."""

    def __init__(self, runs: List[RunSpec], jobs: int = 2, cpus: int = 2, nice: int = 19, show: bool = True):
        if jobs < 1 or cpus < 1:
            raise ValueError(f"--jobs and --cpus must be >= 1, got {jobs} and {cpus}")
        too_wide = [r.label for r in runs if r.threads > cpus]
        if too_wide:
            raise ValueError(f"runs with more threads than --cpus {cpus}: {', '.join(too_wide[:3])}; raise --cpus")
        self.runs, self.jobs, self.cpus, self.nice = runs, jobs, cpus, nice
        self.free = cpus
        self.stopping = False
        self.live: set = set()  # the processes running now
        self.turn = 0  # runs start in order: the index of the next one to start
        self.cond = threading.Condition()
        self.failed: List[tuple] = []
        self.reused = 0
        work = sum(self.work(r) for r in runs)
        self.bar = tqdm(total=round(work), desc=f"{len(runs)} runs", unit="step", disable=not show,
                        bar_format="{desc} |{bar}| {percentage:3.0f}% [{elapsed} elapsed, about {remaining} left]")
        self.done = 0

    @staticmethod
    def work(run: RunSpec) -> float:
        """A run's cost in plain steps (steps × mean passes)."""
        return run.steps * run.mean_passes

    def _preexec(self):
        if self.nice:
            os.nice(self.nice)

    def run_all(self) -> List[tuple]:
        """Run every run not done yet; returns [(run, error)] of those that failed. On SIGTERM (or
        Ctrl-C) the running runs checkpoint and stop, and no other starts: run again to resume."""
        main = threading.current_thread() is threading.main_thread()
        before = signal.signal(signal.SIGTERM, self.stop) if main else None
        pool = ThreadPoolExecutor(self.jobs)
        try:
            for future in [pool.submit(self._one, i) for i in range(len(self.runs))]:
                future.result()
        except KeyboardInterrupt:  # the runs got the Ctrl-C from the terminal too
            self.stop()
            pool.shutdown(wait=True, cancel_futures=True)
            raise
        finally:
            if main:
                signal.signal(signal.SIGTERM, before)
        pool.shutdown()
        self.bar.close()
        return self.failed

    def stop(self, *_) -> None:
        """Start no other run; the running ones get SIGTERM (the entry point saves a checkpoint and exits)."""
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
            for proc in self.live:
                proc.send_signal(signal.SIGTERM)

    def _one(self, index: int) -> None:
        run = self.runs[index]
        with self.cond:  # start in the grid's order, when the run's threads are free
            self.cond.wait_for(lambda: self.stopping or (self.turn == index and self.free >= run.threads))
            if self.stopping:
                return
            self.turn += 1
            self.free -= run.threads
            self.cond.notify_all()
        try:
            reused = self.execute(run)
            with self.cond:
                self.done += 1
                self.reused += reused
                self.bar.set_description_str(f"{self.done}/{len(self.runs)} runs done")
        except Exception as e:  # noqa: BLE001  (one failed run does not stop the grid)
            self.failed.append((run, str(e)))
            tqdm.write(f"[{run.label}] FAILED: {e}")
        finally:
            with self.cond:
                self.free += run.threads
                self.cond.notify_all()

    def _process(self, args: List[str], log: Path, on_line=None) -> int:
        with open(log, "a", buffering=1) as out, subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                     text=True, cwd=REPO, preexec_fn=self._preexec,
                                                     env={**os.environ, "PYTHONUNBUFFERED": "1"}) as proc:
            with self.cond:
                self.live.add(proc)
                if self.stopping:
                    proc.send_signal(signal.SIGTERM)
            out.write("$ python " + " ".join(args) + "\n")
            for line in proc.stdout:
                out.write(line)
                if on_line:
                    on_line(line)
        with self.cond:
            self.live.discard(proc)
        return proc.returncode

    def execute(self, run: RunSpec) -> bool:
        """Train (or resume) and evaluate ``run``; True when it was done before (reused)."""
        if is_done(run):
            claim(run)  # still the same command
            self.bar.update(round(self.work(run)))
            return True
        claim(run)
        start = time.time()
        per_step = self.work(run) / run.steps
        progress = {"step": 0}

        def on_line(line):
            m = STEP_LINE.match(line)
            if m:
                step = int(m.group(1))
                self.bar.update(round(per_step * step) - round(per_step * progress["step"]))
                progress["step"] = step

        log = run.folder / "train.log"
        if not trained(run):  # else it stopped after its last checkpoint, before done.json: nothing to train
            code = self._process(train_command(run), log, on_line)
            if code != 0:
                raise RuntimeError(f"training exited with {code}; see {log}")
        records = read_metrics(run.folder)
        last = records[-1]["step"] if records else 0
        if last != run.steps:
            raise RuntimeError(f"training stopped at step {last} of {run.steps} (interrupted: run the study again to resume)")
        if run.evaluate is not None:
            code = self._process(eval_command(run, run.folder / EVAL), run.folder / "eval.log")  # written whole (io.atomic_write)
            if code != 0:
                raise RuntimeError(f"evaluation exited with {code}; see {run.folder / 'eval.log'}")
        wall = time.time() - start
        _write_json(run.folder / DONE, {"steps": run.steps, "wall_s": round(wall, 1), "finished": time.strftime("%Y-%m-%d %H:%M:%S")})
        tqdm.write(f"[{run.label}] done in {wall / 60:.1f} min")
        return False


def wall_time(run: RunSpec) -> Optional[float]:
    path = run.folder / DONE
    return json.loads(path.read_text())["wall_s"] if path.is_file() else None
