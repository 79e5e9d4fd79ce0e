"""The attempts of a Slurm training job, and its retry budget (slurm/train.sbatch runs this file).

Every start of the job (an attempt) is one line of ``<run folder>/jobs.jsonl``, completed when it
ends: ``{"job_id", "restart_count", "nodes", "start_time", "start_step", "end_time", "end_step",
"exit_code", "ended", "next"}``, steps being the newest checkpoint's. ``ended``: ``finished``,
``stopped`` (a clean early stop: the time-limit signal, ``--exit-duration-in-mins``), ``stopped by
Slurm`` (``scontrol requeue``, ``scancel``), ``bad input`` (exit code 2), ``hang`` (exit code 124,
the hang watchdog), ``failed`` (any other exit code: a crash, a killed rank), or ``lost`` (the
attempt never came back to say: its node died; found at the next start). ``next``: what the job
did then: ``done``, ``requeued``, ``Slurm's`` (Slurm requeues or cancels), ``not retried`` or
``gave up``.

A failed, hung or lost attempt is requeued (``scontrol requeue``) while the job's attempts that
failed since the newest checkpoint was made number at most ``--max-restarts``: a restart that
checkpoints again starts the count afresh, and so does a new submission. The node that srun
names for the first failed task (``srun: error: NODE: task N: ...`` in the job's log) is excluded
from the restart (``scontrol update ExcNodeList``) when the partition has a node to spare (not on
a one-node cluster). Exit code 2 — bad input, which a restart cannot fix — is not retried, and
says so.

Plain Python, no imports beyond the standard library: it runs in the batch shell, outside any
container, with the ``python3`` there.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ATTEMPTS = "jobs.jsonl"
TRACKER = "latest_checkpointed_iteration.txt"
BAD_INPUT, HANG = 2, 124  # cli.py's exit code for bad input; resilience/watchdog.py's for a hang
FAILED = ("failed", "hang", "lost")


def checkpointed(save: Path) -> int:
    """The newest checkpoint's step (0: none)."""
    try:
        return int((save / TRACKER).read_text().strip())
    except (OSError, ValueError):
        return 0


def read(save: Path) -> list:
    path = save / ATTEMPTS
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def write(save: Path, attempts: list) -> None:
    tmp = save / (ATTEMPTS + ".tmp")
    tmp.write_text("".join(json.dumps(a) + "\n" for a in attempts))
    os.replace(tmp, save / ATTEMPTS)


def failures(attempts: list, step: int) -> int:
    """Attempts of this job (a new submission has a budget of its own) that failed since the
    checkpoint of ``step`` was made (ended there)."""
    job = attempts[-1]["job_id"]
    return sum(a["job_id"] == job and a.get("ended") in FAILED and a.get("end_step") == step for a in attempts)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def start(save: Path, max_restarts: int) -> int:
    """Record this attempt; an earlier one that never said how it ended was lost. 1 (start
    nothing) when the lost ones used up the budget."""
    save.mkdir(parents=True, exist_ok=True)
    attempts, step = read(save), checkpointed(save)
    for a in attempts:
        if "ended" not in a:
            a.update(end_time=None, end_step=step, exit_code=None, ended="lost", next="Slurm's")
            print(f"=== job {a['job_id']} restart {a['restart_count']} was lost (it never ended: its node failed?) ===")
    env = os.environ
    attempts.append({"job_id": int(env["SLURM_JOB_ID"]), "restart_count": int(env.get("SLURM_RESTART_COUNT", 0)),
                     "nodes": env.get("SLURM_JOB_NODELIST", ""), "start_time": _now(), "start_step": step})
    failed = failures(attempts, step)
    if failed > max_restarts:
        attempts[-1].update(end_time=_now(), end_step=step, exit_code=None, ended="not started", next="gave up")
        write(save, attempts)
        print(f"=== gave up: {failed} attempts failed since step {step} was checkpointed (--max-restarts {max_restarts}); "
              "submit again for a new budget ===")
        return 1
    write(save, attempts)
    return 0


def end(save: Path, code: int, stop: str, train_iters: int, max_restarts: int, log: Path) -> int:
    """Complete this attempt's line and requeue the job when it should go on; the exit code of the job script."""
    attempts, done, job = read(save), checkpointed(save), os.environ["SLURM_JOB_ID"]
    this = attempts[-1]
    where = f"at step {done} of {train_iters}"
    if done >= train_iters:
        ended, then, rc, line = "finished", "done", 0, f"finished: step {done} of {train_iters} checkpointed in {save}"
    elif stop == "slurm":
        ended, then, rc, line = "stopped by Slurm", "Slurm's", 0, f"stopped by Slurm at step {done}"
    elif stop == "limit" or code == 0:
        ended, then, rc, line = "stopped", "requeued", 0, f"stopped {where}: requeueing job {job}"
    elif code == BAD_INPUT:
        ended, then, rc = "bad input", "not retried", code
        line = (f"the training failed with exit code 2 {where}: bad input (the error: line above), which a restart "
                "cannot fix: not retried")
    else:
        ended = "hang" if code == HANG else "failed"
        hang = f": a hang, stacks in {save}/hang" if code == HANG else ""
        what = f"the training failed (exit code {code}{hang}) {where}"
        this.update(ended=ended, end_step=done)
        failed = failures(attempts, done)
        if failed > max_restarts:
            then, rc = "gave up", code
            line = (f"{what}: not requeued, {failed} failed attempts since step {done} was checkpointed "
                    f"(--max-restarts {max_restarts})")
        else:
            then, rc = "requeued", 0
            line = (f"{what}: requeueing job {job} (restart {failed} of --max-restarts {max_restarts} from this "
                    f"checkpoint){exclude(job, log, this)}")
    this.update(end_time=_now(), end_step=done, exit_code=code, ended=ended, next=then)
    write(save, attempts)
    print(f"=== {line} ===", flush=True)
    if then == "requeued":
        subprocess.run(["scontrol", "requeue", job], check=False)
    return rc


def exclude(job: str, log: Path, this: dict) -> str:
    """Exclude the node srun named for this attempt's first failed task from the restart, where the
    partition has one to spare; what was done, as words for the job's line."""
    text = log.read_text(errors="replace") if log.is_file() else ""
    marker = f"restart {this['restart_count']} on"
    text = text[text.rfind(marker):] if marker in text else ""
    named = re.findall(r"^srun: error: (\S+): tasks? [\d,-]+: ", text, flags=re.M)
    if not named:
        return ""
    node = named[0]
    show = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True).stdout
    excluded = re.search(r"\bExcNodeList=(\S+)", show)
    excluded = [n for n in (excluded[1] if excluded else "").split(",") if n and n != "(null)"]
    partition = os.environ.get("SLURM_JOB_PARTITION", "")
    nodes = set(subprocess.run(["sinfo", "-h", "-N", "-o", "%N", *(["-p", partition] if partition else [])],
                               capture_output=True, text=True).stdout.split())
    if len(nodes - {node, *excluded}) < int(os.environ.get("SLURM_JOB_NUM_NODES", 1)):
        return f"; srun named node {node}, not excluded: the partition has no node to spare"
    run = subprocess.run(["scontrol", "update", f"JobId={job}", f"ExcNodeList={','.join([*excluded, node])}"],
                         capture_output=True, text=True)
    if run.returncode:
        return f"; srun named node {node}, not excluded: {' '.join((run.stderr or run.stdout).split())}"
    this["excluded"] = node
    return f", excluding node {node}, which srun named"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="attempts.py", description="The attempts of a Slurm training job (slurm/train.sbatch).")
    p.add_argument("when", choices=("start", "end"))
    p.add_argument("save", type=Path)
    p.add_argument("--max-restarts", type=int, required=True)
    p.add_argument("--exit-code", type=int, default=0)
    p.add_argument("--stop", default="", help="how the batch shell was stopped: limit (USR1), slurm (SIGTERM) or empty")
    p.add_argument("--train-iters", type=int, default=0)
    p.add_argument("--log", type=Path, help="the job's log, where srun names the nodes of failed tasks")
    args = p.parse_args(argv)
    if args.when == "start":
        return start(args.save, args.max_restarts)
    return end(args.save, args.exit_code, args.stop, args.train_iters, args.max_restarts, args.log or Path("/nonexistent"))


if __name__ == "__main__":
    sys.exit(main())
