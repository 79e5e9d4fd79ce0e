"""Goodput: where a training job's allocated node-seconds went. Each attempt of the job (its line in
``<run>/jobs.jsonl``: from the job script's start to its end, on its nodes) is split, from the
training's own ``<run>/timeline.jsonl`` (starts, logged steps, saves, ends), into productive step
time and badput by cause:

* ``start-up``: from the job's start (the environment check, srun, torchrun's rendezvous, imports,
  building the model) to the training's first step, less the checkpoint's load;
* ``checkpoint load`` and ``checkpoint save`` (what saving held training up);
* ``steps lost and redone``: steps computed after the checkpoint the next start resumed from;
* ``in-job restarts``: from the last step before a failure to torchrun's next start of the workers
  (the failure's detection: a crash at once, a hang after ``--hang-timeout-minutes``; the restart);
* ``failed attempts``: the same at the end of an attempt that failed, hung or was lost (requeued);
* ``time-limit stops``: from the last step of a stopped attempt to its end (the stop, its save's
  wait, the requeue);
* ``stragglers``: the part of each logged step the slowest rank added over the median rank's (the
  step's ``straggler`` ratio);
* ``spares waiting``: the spare nodes' whole allocation (``--spare-nodes``);
* ``other``: the rest (the end of a finished job, gaps the records do not explain).

``requeue gaps`` — between a job's attempts, queued: no node allocated — are wall time, beside the
allocated account. A chain's account is its stages' summed. Plain Python (no torch): the job script
records an attempt's account in ``jobs.jsonl`` (``"goodput"``) with the batch shell's ``python3``.
"""

from __future__ import annotations

import calendar
import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

CATEGORIES = ("productive", "start-up", "checkpoint load", "checkpoint save", "steps lost and redone", "in-job restarts",
              "failed attempts", "time-limit stops", "stragglers", "spares waiting", "other")
ENDED = {"finished": "other", "bad input": "other", "stopped": "time-limit stops", "stopped by Slurm": "time-limit stops",
         "failed": "failed attempts", "hang": "failed attempts", "lost": "failed attempts"}


def unix(iso: Optional[str]) -> Optional[float]:
    return None if iso is None else float(calendar.timegm(time.strptime(iso, "%Y-%m-%dT%H:%M:%SZ")))


def node_count(nodelist: str) -> int:
    """The nodes of a Slurm node list (``n[1-3,5],gpu07``: 5)."""
    count = 0
    for prefix, ranges in re.findall(r"([^,\[]*)(?:\[([^\]]*)\])?(?:,|$)", nodelist):
        if ranges:
            for item in ranges.split(","):
                low, _, high = item.partition("-")
                count += int(high or low) - int(low) + 1
        elif prefix:
            count += 1
    return count


@dataclass
class Account:
    """Seconds × nodes per category (``CATEGORIES``), the wall seconds queued between attempts, and
    the attempts accounted."""
    node_seconds: Dict[str, float] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0.0))
    requeue_gaps: float = 0.0
    attempts: int = 0

    def add(self, other: "Account") -> None:
        for name, value in other.node_seconds.items():
            self.node_seconds[name] += value
        self.requeue_gaps += other.requeue_gaps
        self.attempts += other.attempts

    @property
    def allocated(self) -> float:
        return sum(self.node_seconds.values())

    @property
    def goodput(self) -> float:
        return self.node_seconds["productive"] / self.allocated if self.allocated else 0.0


def attempt_seconds(attempt: dict, events: List[dict], end: float) -> Dict[str, float]:
    """One attempt's wall seconds per category (its training nodes'), from ``events`` (its timeline
    lines, in time order) and ``end`` (when it ended; for a lost one, its last event)."""
    out = dict.fromkeys(CATEGORIES, 0.0)
    began = attempt.get("job_start") or unix(attempt["start_time"])
    starts = [e for e in events if e["event"] == "start"]
    if not starts:  # never trained: the check, bad input, a start-up that failed
        out["start-up"] = max(0.0, end - began)
        return out
    out["start-up"] = max(0.0, starts[0]["time"] - starts[0]["load_seconds"] - began)
    for k, start in enumerate(starts):
        out["checkpoint load"] += start["load_seconds"]
        following = starts[k + 1] if k + 1 < len(starts) else None
        until = following["began"] if following else end
        good = following["step"] if following else attempt.get("end_step", 0)  # steps past it were redone
        mine = [e for e in events if start["time"] < e["time"] <= until and e["event"] in ("step", "save")]
        last = start["time"]
        for event in mine:
            if event["event"] == "save":  # after its step: the time to its end is not the next step's
                out["checkpoint save"] += event["seconds"]
                last = max(last, event["time"])
                continue
            took = max(0.0, event["time"] - last)
            if event["step"] > good:
                out["steps lost and redone"] += took
            else:
                slow = took - took / event.get("straggler", 1.0)
                out["stragglers"] += slow
                out["productive"] += took - slow
            last = max(last, event["time"])
        tail = max(0.0, until - last)
        if following:
            out["in-job restarts"] += tail + max(0.0, following["time"] - following["load_seconds"] - following["began"])
        else:
            out[ENDED.get(attempt.get("ended"), "other")] += tail
    return out


def job_accounts(run: Path) -> Dict[int, Account]:
    """Each job's account in one run folder (a job id: one submission and its requeues)."""
    jobs = [json.loads(line) for line in (run / "jobs.jsonl").read_text().splitlines() if line.strip()]
    path = run / "timeline.jsonl"
    timeline = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    timeline.sort(key=lambda e: e["time"])
    accounts: Dict[int, Account] = {}
    for i, attempt in enumerate(jobs):
        began = attempt.get("job_start") or unix(attempt["start_time"])
        following = jobs[i + 1] if i + 1 < len(jobs) else None
        bound = (following.get("job_start") or unix(following["start_time"])) if following else float("inf")
        end = unix(attempt.get("end_time"))
        mine = [e for e in timeline if began <= e["time"] < (end + 1 if end else bound)]
        end = end or (mine[-1]["time"] if mine else began)  # lost: its last sign of life
        seconds = attempt_seconds(attempt, mine, end)
        allocated, trained = node_count(attempt["nodes"]), len(set(attempt.get("rank_nodes", []))) or node_count(attempt["nodes"])
        account = accounts.setdefault(attempt["job_id"], Account())
        for name, value in seconds.items():
            account.node_seconds[name] += value * trained
        account.node_seconds["spares waiting"] += (end - began) * max(0, allocated - trained)
        account.node_seconds["other"] += max(0.0, (end - began) - sum(seconds.values())) * trained
        account.attempts += 1
        if following and following["job_id"] == attempt["job_id"]:
            account.requeue_gaps += max(0.0, bound - end)
    return accounts


def table(accounts: Dict[str, Account]) -> str:
    """A markdown table: one column per account (a job, a run, a chain), node-hours and shares."""
    names = list(accounts)
    lines = ["| | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for category in CATEGORIES:
        cells = [f"{a.node_seconds[category] / 3600:.3f} ({a.node_seconds[category] / max(a.allocated, 1e-9):.1%})"
                 for a in accounts.values()]
        lines.append(f"| {category} | " + " | ".join(cells) + " |")
    lines.append("| **allocated node-hours** | " + " | ".join(f"{a.allocated / 3600:.3f}" for a in accounts.values()) + " |")
    lines.append("| **goodput** | " + " | ".join(f"**{a.goodput:.1%}**" for a in accounts.values()) + " |")
    lines.append("| requeue gaps, wall hours (queued, not allocated) | "
                 + " | ".join(f"{a.requeue_gaps / 3600:.3f}" for a in accounts.values()) + " |")
    lines.append("| attempts | " + " | ".join(str(a.attempts) for a in accounts.values()) + " |")
    return "\n".join(lines)


def plot(accounts: Dict[str, Account], path: Path) -> None:
    """The accounts as stacked bars, each category's share of the allocated node-seconds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.6 * len(accounts)))
    left = [0.0] * len(accounts)
    for category in CATEGORIES:
        shares = [a.node_seconds[category] / max(a.allocated, 1e-9) for a in accounts.values()]
        ax.barh(list(accounts), shares, left=left, label=category)
        left = [x + y for x, y in zip(left, shares)]
    ax.set_xlim(0, 1)
    ax.set_xlabel("share of the allocated node-seconds")
    ax.legend(ncol=4, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.35 - 0.05 * len(accounts)))
    fig.savefig(path, bbox_inches="tight", dpi=120)
    plt.close(fig)
