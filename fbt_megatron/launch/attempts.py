"""The attempts of a Slurm training job, and its retry budget (slurm/train.sbatch runs this file).

Every start of the job (an attempt) is one line of ``<run folder>/jobs.jsonl``, completed when it
ends: ``{"job_id", "restart_count", "nodes", "start_time", "start_step", "end_time", "end_step",
"exit_code", "ended", "next"}``, steps being the newest checkpoint's, and where known
``"job_start"`` (when the job script started, Unix seconds), ``"goodput"`` (the attempt's wall
seconds per cause: ``goodput.py``), ``"in_job_restarts"`` (``[{"time", "step"}, ...]``: torchrun's restarts of the workers inside the
attempt, each resuming from the checkpoint of ``step``: the training's starts in ``timeline.jsonl``
after its first), ``"rank_nodes"`` (the node of each rank, from the training's ``ranks.json``), ``"failed_task"``
(``{"node", "task", "exit_code"}``: the task that failed first, a rank killed by a signal before those that followed it, ``failed_task``), ``"stragglers"`` (the training's
``stragglers.jsonl`` lines of this attempt) and ``"excluded"`` (the nodes excluded from the next
start). ``exit_code`` is the first failed task's (the rank that failed, e.g. 137 for a rank killed
by SIGKILL), not srun's (often the survivors' 143). ``ended``: ``finished``, ``stopped`` (a clean
early stop: the time-limit signal, ``--exit-duration-in-mins``), ``stopped by Slurm`` (``scontrol
requeue``, ``scancel``), ``bad input`` (exit code 2), ``hang`` (exit code 124, the hang watchdog),
``failed`` (any other exit code: a crash, a killed rank), or ``lost`` (the attempt never came back
to say: its node died, and Slurm requeued the job; found at the next start; or, with spares, more
nodes were lost than spares: the job script requeued it). ``next``: what the job
did then: ``done``, ``requeued``, ``Slurm's`` (Slurm requeues or cancels), ``not retried`` or
``gave up``.

The budget: a failed or hung attempt, and an attempt that stopped without checkpointing a step
(a time limit too short for the first checkpoint), is requeued while the job's such attempts since
the newest checkpoint was made number at most ``--max-restarts``: a restart that checkpoints again
starts the count afresh, and so does a new submission. Torchrun's restarts inside an attempt
(``--in-job``: ``start`` prints how many it may make, the budget left at the attempt's checkpoint)
spend the same budget, each at the checkpoint it resumed from; when they are spent, the attempt
fails and is requeued or not by the same rule. A lost attempt was Slurm's requeue, not a
failure of the training, and is not counted. Exit code 2 — bad input, which a restart cannot fix
— is not retried, and says so.

Exclusion: the node of the first failed task (``srun: error: NODE: task N: ...`` in the job's log)
— and with ``--exclude-stragglers`` the nodes the training named as stragglers — are kept out of
the restart when the partition has nodes to spare (not on a one-node cluster). Slurm takes
``ExcNodeList`` only from a pending job, so the job is requeued held (``scontrol requeuehold``),
updated, then released, while this process ignores the SIGTERM the requeue sends the batch step.

Plain Python 3.8 or newer, no imports beyond the standard library: it runs in the batch shell,
outside any container, with the ``python3`` there (the job script checks the version first).
"""

from __future__ import annotations

import argparse
import calendar
import json
import os
import re
import signal
import subprocess
import sys
import time
from typing import Optional
from pathlib import Path

ATTEMPTS = "jobs.jsonl"
TRACKER = "latest_checkpointed_iteration.txt"
RANKS, TIMELINE, STRAGGLERS = "ranks.json", "timeline.jsonl", "stragglers.jsonl"  # the training's (trainer/ranks.py,
# timeline.py, stragglers.py)
STATUS = "exit_status.json"  # how the training ended (stopping.py): a hang's stuck ranks
BAD_INPUT, HANG = 2, 124  # cli.py's exit code for bad input; trainer/callbacks/watchdog.py's for a hang
FAILED = ("failed", "hang")


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


def counted(attempt: dict) -> bool:
    """Whether the attempt spends the budget: it failed or hung, or stopped without a new checkpoint."""
    stalled = attempt.get("ended") == "stopped" and attempt.get("end_step") == attempt.get("start_step")
    return attempt.get("ended") in FAILED or stalled


def failures(attempts: list, step: int) -> int:
    """Attempts of this job (a new submission has a budget of its own) that spent the budget since
    the checkpoint of ``step`` was made (ended there), and torchrun's restarts inside them from it."""
    job = [a for a in attempts if a["job_id"] == attempts[-1]["job_id"]]
    return (sum(counted(a) and a.get("end_step") == step for a in job)
            + sum(r["step"] == step for a in job for r in a.get("in_job_restarts", [])))


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def start(save: Path, max_restarts: int, in_job: bool, job_start: Optional[float] = None) -> int:
    """Record this attempt (an earlier one that never said how it ended was lost); how many times
    torchrun may restart the workers inside it: with ``in_job``, the budget left at its checkpoint."""
    save.mkdir(parents=True, exist_ok=True)
    attempts, step = read(save), checkpointed(save)
    for a in attempts:
        if "ended" not in a:
            a.update(end_time=None, end_step=step, exit_code=None, ended="lost", next="Slurm's")
            print(f"=== job {a['job_id']} restart {a['restart_count']} was lost (it never ended: its node failed?) ===",
                  file=sys.stderr)
    env = os.environ
    attempts.append({"job_id": int(env["SLURM_JOB_ID"]), "restart_count": int(env.get("SLURM_RESTART_COUNT", 0)),
                     "nodes": env.get("SLURM_JOB_NODELIST", ""), "start_time": _now(), "start_step": step,
                     **({"job_start": job_start} if job_start else {})})
    write(save, attempts)
    return max(0, max_restarts - failures(attempts, step)) if in_job else 0


def in_job_restarts(save: Path, this: dict) -> list:
    """Torchrun's restarts of the workers inside this attempt: the training's starts after its first
    (``timeline.jsonl``), each with its time (Unix seconds) and the step it resumed from."""
    path = save / TIMELINE
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    mine = [e for e in lines if e["event"] == "start" and (e.get("job_id"), e.get("restart_count")) ==
            (this["job_id"], this["restart_count"])]
    return [{"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(e["time"])), "step": e["step"]} for e in mine[1:]]


def end(save: Path, code: int, stop: str, train_iters: int, max_restarts: int, log: Path,
        exclude_stragglers: bool = False) -> int:
    """Complete this attempt's line and requeue the job when it should go on; the exit code of the job script."""
    attempts, done, job = read(save), checkpointed(save), os.environ["SLURM_JOB_ID"]
    this = attempts[-1]
    this.update(observed(save, this, log))
    restarted = in_job_restarts(save, this)
    if restarted:
        this["in_job_restarts"] = restarted
    code = this["failed_task"]["exit_code"] if code and "failed_task" in this else code
    where = f"at step {done} of {train_iters}" + (f" after {len(restarted)} in-job restart{'s' * (len(restarted) > 1)}"
                                                  if restarted else "")
    this.update(end_step=done, exit_code=code)
    if done >= train_iters:
        ended, then, rc, line = "finished", "done", 0, f"finished: {where[3:]} checkpointed in {save}"
    elif stop == "slurm":
        ended, then, rc, line = "stopped by Slurm", "Slurm's", 0, f"stopped by Slurm at step {done}"
    elif stop == "lost":  # more nodes lost than spares (slurm/train.sbatch): Slurm's failure, not the training's
        this["ended"], then, rc = "lost", "requeued", 0
        line = f"nodes lost beyond the spares {where}: requeueing job {job}{requeue(job, this, False)}"
        ended = "lost"
    elif code == BAD_INPUT and stop != "limit":
        ended, then, rc = "bad input", "not retried", code
        line = (f"the training failed with exit code 2 {where}: bad input (the error: line above), which a restart "
                "cannot fix: not retried")
    else:
        if stop == "limit" or code == 0:
            ended, what = "stopped", f"stopped {where}"
        else:
            ended = "hang" if code == HANG else "failed"
            what = f"the training failed (exit code {code}{f': a hang, stacks in {save}/hang' if code == HANG else ''}) {where}"
        this["ended"] = ended
        failed = failures(attempts, done)
        if failed > max_restarts:
            then, rc = "gave up", code or 1
            line = (f"{what}: not requeued, {failed} of this job's starts failed or stopped without a checkpoint since "
                    f"step {done} was checkpointed (--max-restarts {max_restarts})")
        else:
            then, rc = "requeued", 0
            budget = f" (restart {failed} of --max-restarts {max_restarts} from this checkpoint)" if counted(this) else ""
            line = f"{what}: requeueing job {job}{budget}{requeue(job, this, exclude_stragglers)}"
    this.update(end_time=_now(), ended=ended, next=then)
    this["goodput"] = account(save, this)
    write(save, attempts)
    print(f"=== {line} ===", flush=True)
    return rc


def account(save: Path, this: dict) -> dict:
    """This attempt's wall seconds per cause (``goodput.py`` beside this file, plain Python too), from
    the training's ``timeline.jsonl``: the categories it spent time in."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("fbt_goodput", Path(__file__).with_name("goodput.py"))
    goodput = sys.modules.setdefault(spec.name, importlib.util.module_from_spec(spec))
    if not hasattr(goodput, "attempt_seconds"):
        spec.loader.exec_module(goodput)
    path, began = save / TIMELINE, this.get("job_start") or goodput.unix(this["start_time"])
    events = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    events = sorted((e for e in events if e["time"] >= began), key=lambda e: e["time"])
    seconds = goodput.attempt_seconds(this, events, goodput.unix(this["end_time"]))
    return {name: round(value, 1) for name, value in seconds.items() if value >= 0.05}


def observed(save: Path, this: dict, log: Path) -> dict:
    """What the training and srun left about this attempt: the node of each rank (``ranks.json``),
    the nodes of the ranks a hang was stuck on (``exit_status.json``), the first task srun saw fail
    (the job's log since this attempt's first line) and the stragglers named (``stragglers.jsonl``)."""
    found = {}
    try:
        ranks = json.loads((save / RANKS).read_text())
        if ranks.get("started", "") >= this["start_time"]:
            found["rank_nodes"] = [r["node"] for r in sorted(ranks["ranks"], key=lambda r: r["rank"])]
        status = json.loads((save / STATUS).read_text())
        began = calendar.timegm(time.strptime(this["start_time"], "%Y-%m-%dT%H:%M:%SZ"))
        if "rank_nodes" in found and status.get("reason") == "hang" and (save / STATUS).stat().st_mtime >= began:
            found["stuck_nodes"] = sorted({found["rank_nodes"][r] for r in status["stuck_ranks"]})
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        pass
    text = log.read_text(errors="replace") if log.is_file() else ""
    marker = f"restart {this['restart_count']} on"
    text = text[text.rfind(marker):] if marker in text else ""
    task = failed_task(text)
    if task:
        found["failed_task"] = task
    path = save / STRAGGLERS
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    named = [s for s in lines if s.get("time", "") >= this["start_time"]]
    if named:
        found["stragglers"] = named
    return found


# srun's line for a task that failed. When one rank dies the others follow (a connection closed: exit 1; stopped:
# SIGTERM, SIGINT), and srun prints their lines in the order it hears of them: a task killed by another signal
# (SIGKILL from kill -9 or the OOM killer, SIGSEGV, SIGABRT, SIGBUS) is the cause whichever line came first. Once srun
# has ended the step for a bad exit (--kill-on-bad-exit) it prints no line for a task a signal ended, only for one
# that exited: a torchrun launcher reports its worker's signal as its exit code (137), also on srun's SIGTERM
# (trainer/stopping.py, failed_so_far).
FAILED_TASK = re.compile(r"^srun: error: (\S+): tasks? ([\d,-]+): (Exited with exit code (\d+)|Killed|Terminated)", re.M)
FOLLOWED = {128 + 15, 128 + 2}  # SIGTERM, SIGINT: how a stopped rank ends


def failed_task(text: str) -> Optional[dict]:
    """The task that failed first in an attempt's log: its node, task and exit code (None: no task failed)."""
    tasks = [{"node": m[1], "task": m[2], "exit_code": int(m[4]) if m[4] else {"Killed": 128 + 9, "Terminated": 128 + 15}[m[3]]}
             for m in FAILED_TASK.finditer(text)]
    killed = [t for t in tasks if t["exit_code"] > 128 and t["exit_code"] not in FOLLOWED]
    return (killed or tasks or [None])[0]


def requeue(job: str, this: dict, exclude_stragglers: bool) -> str:
    """Requeue the job, keeping the failed node — a hang's stuck ranks' nodes, else the first failed
    task's — (and the stragglers' with ``exclude_stragglers``) out of its restart where the
    partition has nodes to spare; what was done about nodes, as words for the job's line."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the requeue's own SIGTERM; scontrol inherits the SIG_IGN
    stuck = this.get("stuck_nodes", []) if this["ended"] == "hang" else []
    first = [this["failed_task"]["node"]] if this["ended"] in FAILED and "failed_task" in this and not stuck else []
    slow = sorted({s["node"] for s in this.get("stragglers", [])}) if exclude_stragglers else []
    nodes = list(dict.fromkeys(stuck + first + slow))
    why = {n: "stuck" if n in stuck else "srun named" if n in first else "a straggler" for n in nodes}
    named = ", ".join(f"node {n} ({why[n]})" for n in nodes)
    show = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True).stdout
    before = re.search(r"\bExcNodeList=(\S+)", show)
    before = [n for n in (before[1] if before else "").split(",") if n and n != "(null)"]
    spare = len(usable_nodes() - {*nodes, *before}) >= int(os.environ.get("SLURM_JOB_NUM_NODES", 1))
    if not nodes or not spare:
        subprocess.run(["scontrol", "requeue", job], check=False)
        return f"; {named} not excluded: the partition has no node to spare" if nodes else ""
    subprocess.run(["scontrol", "requeuehold", job], check=False)
    run = subprocess.run(["scontrol", "update", f"JobId={job}", f"ExcNodeList={','.join([*before, *nodes])}"],
                         capture_output=True, text=True)
    subprocess.run(["scontrol", "release", job], check=False)
    if run.returncode:
        return f"; {named} not excluded: {' '.join((run.stderr or run.stdout).split())}"
    this["excluded"] = nodes
    return f", excluding {named}"


def usable_nodes() -> set:
    """The nodes of this job's partition that are not down, drained or failing."""
    partition = os.environ.get("SLURM_JOB_PARTITION", "")
    listed = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T", *(["-p", partition] if partition else [])],
                            capture_output=True, text=True).stdout
    return {name for name, state in (line.split() for line in listed.splitlines() if line.strip())
            if not state.startswith(("down", "drain", "fail"))}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="attempts.py", description="The attempts of a Slurm training job (slurm/train.sbatch).")
    p.add_argument("when", choices=("start", "end"))
    p.add_argument("save", type=Path)
    p.add_argument("--max-restarts", type=int, default=3)
    p.add_argument("--exit-code", type=int, default=0)
    p.add_argument("--stop", default="", help="how the batch shell was stopped: limit (USR1), slurm (SIGTERM), lost (nodes "
                                              "lost beyond the spares) or empty")
    p.add_argument("--train-iters", type=int, default=0)
    p.add_argument("--log", type=Path, help="the job's log, where srun names the nodes of failed tasks")
    p.add_argument("--exclude-stragglers", action="store_true", help="exclude the nodes named as stragglers from the restart")
    p.add_argument("--in-job", action="store_true", help="torchrun restarts failed workers inside the attempt first")
    p.add_argument("--job-start", type=float, help="when the job script started (Unix seconds): the attempt's account")
    args = p.parse_args(argv)
    if args.when == "start":
        print(start(args.save, args.max_restarts, args.in_job, args.job_start))  # torchrun's --max-restarts
        return 0
    return end(args.save, args.exit_code, args.stop, args.train_iters, args.max_restarts, args.log or Path("/nonexistent"),
               args.exclude_stragglers)


if __name__ == "__main__":
    sys.exit(main())
