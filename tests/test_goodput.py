"""The goodput account (``fbt_megatron/launch/goodput.py``) of a run folder written by hand: a job
whose first attempt restarts in the job once and then fails, requeued onto three nodes (one a spare)
where it finishes. Every category's node-seconds are computed here from the times below, not by the
module; the CLI prints them as a table and draws them."""

import json
import subprocess
import sys
import time
from pathlib import Path

from fbt_megatron.launch import goodput

ROOT = Path(__file__).resolve().parents[1]


def iso(seconds: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


def write_run(run: Path) -> None:
    run.mkdir()
    attempts = [
        {"job_id": 5, "restart_count": 0, "nodes": "n[1-2]", "job_start": 1000.0, "start_time": iso(1000), "start_step": 0,
         "rank_nodes": ["n1", "n2"], "end_time": iso(1100), "end_step": 6, "ended": "failed", "next": "requeued"},
        {"job_id": 5, "restart_count": 1, "nodes": "n[1-3]", "job_start": 1130.0, "start_time": iso(1130), "start_step": 6,
         "rank_nodes": ["n1", "n3"], "end_time": iso(1200), "end_step": 8, "ended": "finished", "next": "done"},
    ]
    events = [
        ("start", 1010, dict(began=1002, load_seconds=0, step=0)), ("step", 1012, dict(step=1)), ("step", 1014, dict(step=2)),
        ("save", 1015, dict(step=2, seconds=1)), ("step", 1017, dict(step=3, straggler=2.0)), ("step", 1019, dict(step=4)),
        ("save", 1020, dict(step=4, seconds=1)), ("step", 1022, dict(step=5)),  # then a crash: step 5 is redone
        ("start", 1040, dict(began=1030, load_seconds=2, step=4)), ("step", 1042, dict(step=5)), ("step", 1044, dict(step=6)),
        ("save", 1045, dict(step=6, seconds=1)), ("step", 1047, dict(step=7)),  # then the attempt fails: step 7 is redone
        ("start", 1140, dict(began=1132, load_seconds=3, step=6)), ("step", 1143, dict(step=7)), ("step", 1146, dict(step=8)),
        ("save", 1149, dict(step=8, seconds=2)), ("end", 1150, dict(step=8, reason="finished")),
    ]
    (run / "jobs.jsonl").write_text("".join(json.dumps(a) + "\n" for a in attempts))
    (run / "timeline.jsonl").write_text("".join(json.dumps({"event": e, "time": t, **f}) + "\n" for e, t, f in events))


def test_a_jobs_node_seconds_split_by_cause(tmp_path):
    run = tmp_path / "run"
    write_run(run)
    [(job, account)] = goodput.job_accounts(run).items()
    # attempt 0, 2 nodes, 1000-1100: start-up 1000→1010; steps 1-4 productive (step 3's 2 s half a straggler's), two
    # saves; step 5 redone; the restart 1022→1040 less the 2 s load; steps 5-6, a save, step 7 redone; 1047→1100 failing.
    # attempt 1, 3 nodes (one waiting), 1130-1200: start-up 1130→1137, load 3, steps 7-8, a save of 2 s ending 3 s after
    # step 8 (1 s unexplained), then the finished job's end 1149→1200.
    first = {"start-up": 10, "checkpoint load": 2, "productive": 2 + 2 + 1 + 2 + 2 + 2, "stragglers": 1, "checkpoint save": 3,
             "steps lost and redone": 2 + 2, "in-job restarts": 8 + 8, "failed attempts": 53}
    second = {"start-up": 7, "checkpoint load": 3, "productive": 6, "checkpoint save": 2, "other": 1 + 51}
    expected = {c: 2 * first.get(c, 0) + 2 * second.get(c, 0) for c in goodput.CATEGORIES}
    expected["spares waiting"] = 70
    assert job == 5 and account.node_seconds == expected, account.node_seconds
    assert account.allocated == 2 * 100 + 3 * 70 and account.requeue_gaps == 30 and account.attempts == 2
    assert abs(account.goodput - 2 * 17 / 410) < 1e-12
    assert goodput.node_count("n[1-3,5],gpu07,a[08-09]") == 7


def test_the_goodput_command_prints_the_table_and_draws_it(tmp_path):
    run = tmp_path / "run"
    write_run(run)
    done = subprocess.run([sys.executable, "-m", "fbt_megatron.slurm", "goodput", str(run), "--plot", str(tmp_path / "g.png")],
                          cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "| | run job 5 |" and "| productive | 0.009 (8.3%) |" in lines, done.stdout
    assert "| **goodput** | **8.3%** |" in lines and "| requeue gaps, wall hours (queued, not allocated) | 0.008 |" in lines
    assert (tmp_path / "g.png").stat().st_size > 1000 and lines[-1] == f"plot: {tmp_path / 'g.png'}"
    bad = subprocess.run([sys.executable, "-m", "fbt_megatron.slurm", "goodput", str(tmp_path)], cwd=ROOT, capture_output=True,
                         text=True)
    assert bad.returncode == 2 and bad.stdout == "" and bad.stderr.strip() == (
        f"error: {tmp_path}: no jobs.jsonl: not the run folder of a Slurm training job (python -m fbt_megatron.slurm submit)")
