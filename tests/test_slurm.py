"""Slurm jobs (``python -m fbt_megatron.slurm``) on a real single-node Slurm on loopback
(tests/slurm_cluster.py): the rendered scripts, a job interrupted twice — ``scontrol requeue`` and
the time-limit signal — that resumes and logs the losses of an uninterrupted run bit for bit, and
a chained pretrain → long-context → SFT → export + evaluation.

Without the Slurm binaries (``apt-get install slurmctld slurmd slurm-client munge``) these tests
skip on a developer machine; in CI (``FBT_REQUIRE_SLURM=1``, set by .ci/run) they fail instead.
"""

import json
import os
import re
import subprocess
import threading
import time
from pathlib import Path

import pytest

from fbt_megatron.metrics import read_metrics
from forked import run_commands
from slurm_cluster import LocalSlurm, missing_binaries
from test_train import SMALL, train_many

ROOT = Path(__file__).parent.parent
TINY = ROOT / "recipes" / "tiny_cpu.yaml"
SUBMIT = "fbt_megatron.slurm.__main__"


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    missing = missing_binaries()
    problem = f"Slurm binaries not found: {', '.join(missing)}" if missing else None if os.geteuid() == 0 else "not root"
    if problem:
        if os.environ.get("FBT_REQUIRE_SLURM"):
            pytest.fail(f"{problem} (FBT_REQUIRE_SLURM is set: .ci/run installs slurmctld slurmd slurm-client munge)")
        pytest.skip(f"{problem}: the loopback Slurm needs root and apt-get install slurmctld slurmd slurm-client munge")
    cluster = LocalSlurm().start()
    before = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(cluster.conf)  # for sbatch in the submit tool's processes
    yield cluster
    cluster.stop(keep_logs=tmp_path_factory.mktemp("slurm-logs"))
    os.environ.pop("SLURM_CONF")
    if before is not None:
        os.environ["SLURM_CONF"] = before


def submit_many(folder: Path, command_lines) -> list:
    """(exit code, output) of ``python -m fbt_megatron.slurm`` for each argument list, one
    interpreter start-up for all (tests/forked.py)."""
    logs = [folder / f"submit{i}.log" for i in range(len(command_lines))]
    codes = run_commands(SUBMIT, [(args, log, None) for args, log in zip(command_lines, logs)])
    return [(code, log.read_text()) for code, log in zip(codes, logs)]


def job_ids(output: str) -> list:
    return [int(i) for i in re.findall(r": job (\d+)", output)]


def last_step(run: Path) -> int:
    """The newest step in the run's metrics.jsonl (0 while there is none)."""
    path = run / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    steps = [json.loads(line)["step"] for line in lines if line.endswith("}")]
    return max(steps, default=0)


def starts(run: Path) -> list:
    """The job starts recorded in the run folder (jobs.jsonl)."""
    path = run / "jobs.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_until(condition, what: str, timeout: float = 300):
    deadline = time.time() + timeout
    while not condition():
        if time.time() > deadline:
            raise TimeoutError(what)
        time.sleep(0.2)


def test_dry_run_renders_both_launch_modes_and_bad_input_is_one_line(tmp_path):
    common = ["submit", "--recipe", str(TINY), "--nodes", "2", "--gpus-per-node", "4", "--time", "04:00:00",
              "--partition", "gpu", "--account", "proj", "--container-image", "nvcr.io/nvidia/pytorch:25.01-py3",
              "--runs-root", str(tmp_path / "runs"), "--log-dir", str(tmp_path / "logs"), "--dry-run"]
    bad = {
        "--recipe missing.yaml": ["submit", "--recipe", "missing.yaml", "--nodes", "1", "--gpus-per-node", "0", "--time", "01:00:00"],
        "--nodes 0": ["submit", "--recipe", str(TINY), "--nodes", "0", "--gpus-per-node", "0", "--time", "01:00:00"],
        "--time 90": ["submit", "--recipe", str(TINY), "--nodes", "1", "--gpus-per-node", "0", "--time", "90"],
        "unknown flag --bogus": ["submit", "--recipe", str(TINY), "--nodes", "1", "--gpus-per-node", "0", "--time", "01:00:00",
                                 "--", "--bogus", "1"],
        "--chain sets each stage's": ["submit", "--chain", str(TINY), "--nodes", "1", "--gpus-per-node", "0", "--time", "01:00:00",
                                      "--", "--save", "x"],
    }
    results = submit_many(tmp_path, [[*common, "--", "--train-iters", "7"], [*common, "--launch", "tasks", "--exit-margin", "10"],
                                     *bad.values()])
    (code_torchrun, torchrun), (code_tasks, tasks) = results[:2]
    assert code_torchrun == 0 and code_tasks == 0, torchrun + tasks
    save = tmp_path / "runs" / "tiny_cpu"
    for script in (torchrun, tasks):
        for line in ["#SBATCH --nodes=2", "#SBATCH --time=04:00:00", "#SBATCH --requeue", "#SBATCH --open-mode=append",
                     f"#SBATCH --output={tmp_path}/logs/tiny_cpu-%j.out", "#SBATCH --signal=B:USR1@180",
                     "#SBATCH --partition=gpu", "#SBATCH --account=proj", "#SBATCH --gpus-per-node=4",
                     "CONTAINER=(--container-image=nvcr.io/nvidia/pytorch:25.01-py3", f"SAVE={save}", "scontrol requeue"]:
            assert line in script, line
        body = script[script.index("#!/bin/bash"):]
        syntax = subprocess.run(["bash", "-n"], input=body, capture_output=True, text=True)
        assert syntax.returncode == 0, syntax.stderr
    assert "#SBATCH --ntasks-per-node=1" in torchrun and "LAUNCH=torchrun" in torchrun and "PROCS_PER_NODE=4" in torchrun
    assert f"TRAIN_ARGS=(--recipe {TINY} --train-iters 7 --save {save} --load {save})" in torchrun
    assert "TRAIN_ITERS=7" in torchrun and "TRAIN_ITERS=800" in tasks  # the recipe's, or the flag's
    assert "#SBATCH --ntasks-per-node=4" in tasks and "LAUNCH=tasks" in tasks
    assert f"--exit-duration-in-mins 230 --save {save}" in tasks  # 4 h minus the 10-minute --exit-margin
    for (code, output), (expected, _) in zip(results[2:], bad.items()):
        assert code == 2 and output.count("\n") == 1 and output.startswith("error: ") and expected in output, output


@pytest.mark.slow
def test_requeued_and_signalled_job_resumes_and_logs_the_uninterrupted_losses(slurm, small_corpus, tmp_path):
    """Submitted through the submit tool (torchrun launch, one CPU process): ``scontrol requeue``
    mid-run (SIGTERM from Slurm), then USR1 to the batch shell as ``--signal=B:USR1@S`` sends it S
    seconds before the time limit (sent with scancel: Slurm's own timer checks every 30 s, its
    minimum --time is a minute). Each time the training checkpoints at the next step boundary, the
    job comes back (Slurm requeues it; the script requeues itself after the signal) and resumes."""
    began = time.time()
    steps = 48  # the signals reach the job within its first dozen steps, whatever the machine's load
    flags = [*SMALL, "--train-iters", steps, "--eval-interval", 12]
    reference, ref_run = [], tmp_path / "uninterrupted"
    uninterrupted = threading.Thread(target=lambda: reference.extend(
        train_many([(tmp_path / "uninterrupted.log", [*flags, "--save", ref_run])], corpus=small_corpus)))
    uninterrupted.start()  # the other CPU core

    data = ["--data-path", str(Path(small_corpus.train_prefix).parent), "--corpus", "null", "--threads", "1"]
    [(code, output)] = submit_many(tmp_path, [["submit", "--recipe", str(TINY), "--nodes", "1", "--gpus-per-node", "0",
                                               "--time", "00:10:00", "--runs-root", str(tmp_path / "runs"),
                                               "--log-dir", str(tmp_path / "logs"), "--", *map(str, flags), *data]])
    assert code == 0, output
    [job] = job_ids(output)
    run, log = tmp_path / "runs" / "tiny_cpu", tmp_path / "logs" / f"tiny_cpu-{job}.out"
    slurm.wait_for(job, {"RUNNING"})
    wait_until(lambda: last_step(run) >= 3, f"job {job} logged no steps: {log.read_text() if log.exists() else ''}")
    requeued_at = last_step(run)
    slurm.requeue(job)
    slurm.wait_for(job, {"RUNNING"}, restarts=1)
    wait_until(lambda: len(starts(run)) == 2, f"job {job} did not come back: {log.read_text()}")
    first_resume = starts(run)[1]["start_step"]
    wait_until(lambda: last_step(run) >= first_resume + 3, f"job {job} did not resume: {log.read_text()}")
    signalled_at = last_step(run)
    slurm.signal_batch(job, "USR1")
    slurm.wait_for(job, {"COMPLETED"}, restarts=2)
    uninterrupted.join()
    text = log.read_text()

    records = starts(run)
    assert [(s["job_id"], s["restart_count"]) for s in records] == [(job, i) for i in range(3)], records
    resumes = [s["start_step"] for s in records]
    assert 0 == resumes[0] < requeued_at <= resumes[1] < signalled_at <= resumes[2] < steps, (resumes, requeued_at, signalled_at)
    for line in ["SIGTERM from Slurm (requeue or cancel)", "USR1: time limit in 180 s",
                 f"stopped at step {resumes[2]} of {steps}: requeueing job {job}", f"finished: step {steps} of {steps}",
                 f"stopped by SIGTERM at step {resumes[1]}", f"stopped by SIGTERM at step {resumes[2]}"]:
        assert line in text, line + "\n" + text[-3000:]
    assert [f"restart {i}" in text for i in range(3)] == [True] * 3
    iterations = sorted(int(p.name[5:]) for p in run.glob("iter_*"))
    assert iterations == [resumes[1], resumes[2], steps], iterations

    [(ref_code, ref_text)] = reference
    assert ref_code == 0, ref_text[-3000:]
    expected, got = read_metrics(ref_run), read_metrics(run)
    assert [r["step"] for r in got] == list(range(1, steps + 1))
    keys = ["k", "loss", "pass_losses", "state_deltas", "lr", "grad_norm", "valid_loss_fused0", "valid_loss_fused2"]
    assert sum("valid_loss_fused2" in r for r in got) == steps // 12
    for e, g in zip(expected, got):
        assert {k: e.get(k) for k in keys} == {k: g.get(k) for k in keys}, (e, g)  # bitwise: == on floats
    print(f"\nslurm job {job} ({steps} steps of tiny_cpu, torchrun launch): scontrol requeue at step {requeued_at} → "
          f"restart 1 resumed from step {resumes[1]}; USR1 (the time-limit signal) at step {signalled_at} → restart 2 "
          f"resumed from step {resumes[2]}; finished; losses of all {steps} steps equal the uninterrupted run's bit for bit "
          f"(last {got[-1]['loss']!r}); {time.time() - began:.0f} s")


STAGES = ["tiny_cpu", "longctx_tiny_cpu", "sft_tiny_cpu"]  # pretrain (128 tokens) → long context (512) → SFT


@pytest.mark.slow
def test_chained_stages_run_through_slurm_then_export_and_evaluation(slurm, tmp_path):
    """``submit --chain``: three tiny stages (the one-task-per-GPU launch: one CPU task, no
    torchrun), each job after the previous one (afterok) and starting from its final weights, then
    the export + evaluation job."""
    began = time.time()
    recipes = [str(ROOT / "recipes" / f"{name}.yaml") for name in STAGES]
    runs, logs = tmp_path / "runs", tmp_path / "logs"
    flags = ["--train-iters", "4", "--micro-batch-size", "2", "--global-batch-size", "2", "--log-interval", "1",
             "--eval-interval", "4", "--eval-iters", "1", "--threads", "1"]
    [(code, output)] = submit_many(tmp_path, [["submit", "--chain", *recipes, "--nodes", "1", "--gpus-per-node", "0",
                                               "--time", "00:10:00", "--launch", "tasks", "--runs-root", str(runs), "--log-dir", str(logs),
                                               "--eval-args=--modes standard --limit 2 --threads 1", "--", *flags]])
    assert code == 0, output
    jobs = job_ids(output)
    assert len(jobs) == 4, output
    for job, before in zip(jobs[1:], jobs):
        assert slurm.job(job)["Dependency"] in (f"afterok:{before}(unfulfilled)", "(null)")  # (null) once it ran
    slurm.wait_for(jobs[-1], {"COMPLETED"}, timeout=900)

    losses = {}
    for name, job in zip(STAGES, jobs):
        text = (logs / f"{name}-{job}.out").read_text()
        assert f"=== finished: step 4 of 4" in text, text[-3000:]
        losses[name] = [round(r["loss"], 4) for r in read_metrics(runs / name)]
        assert len(losses[name]) == 4
    for name, previous in zip(STAGES[1:], STAGES):
        text = (logs / f"{name}-{jobs[STAGES.index(name)]}.out").read_text()
        assert str(runs / previous) in text, text[-3000:]  # the stage says whose weights it starts from
    eval_log = (logs / f"{STAGES[-1]}-eval-{jobs[-1]}.out").read_text()
    assert list((runs / "exports").glob(f"{STAGES[-1]}-iter4/config.json")), eval_log[-3000:]
    table = (runs / "eval" / f"{STAGES[-1]}.md").read_text()
    assert "standard" in table, table
    print(f"\nslurm chain, jobs {jobs} (afterok): " + "; ".join(f"{n} losses {l}" for n, l in losses.items())
          + f"; export + evaluation job {jobs[-1]}:\n{table}\n{time.time() - began:.0f} s")
