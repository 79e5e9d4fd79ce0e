"""A 2-node job (``--rows slurm --slurm-nodes 2 --gpus-per-node 8``), run from a login node of the
cluster (no GPU needed there, ``sbatch`` and ``scancel`` on PATH): ``recipes/tiny_cpu.yaml`` at TP 2 + SP
through ``python -m fbt_megatron.slurm submit`` and slurm/train.sbatch, with the global batch one
microbatch per data-parallel rank (micro × DP: ``job_command``, which the preflight's ``batch_fit``
accepts); mid-run the time-limit signal (USR1 to the batch shell): the training must checkpoint and
exit 0, the job requeue itself, the next attempt resume there and finish; every rank in the banner's
world; NCCL's transport between nodes from ``NCCL_DEBUG=INFO``."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, List, Optional

from gpu_checks.harness import Context

TITLE = "multi-node job through slurm/train.sbatch"
EXACT = False  # attention as training runs it (TE's non-deterministic backward allowed)
REPO = Path(__file__).resolve().parents[2]
RECIPE, STEPS, TP = "recipes/tiny_cpu.yaml", 60, 2
ROWS = ("time-limit stop", "requeued attempt", "every rank in the run", "NCCL transport between nodes")


def job_command(nodes: int, gpus_per_node: int, runs: Path, logs: Path, submit_args: List[str]) -> List[str]:
    """The submit command: TP 2 + SP, the global batch = the recipe's micro batch × DP; in a container
    image, the folder of ``runs`` and ``logs`` mounted (the recipe's data are in the checkout, mounted)."""
    from fbt_megatron.recipe import flags

    world = nodes * gpus_per_node
    if world % TP:
        raise ValueError(f"{nodes} node(s) x {gpus_per_node} GPU(s) do not divide by TP {TP}")
    image = any(arg == "--container-image" or arg.startswith("--container-image=") for arg in submit_args)
    mounts = ["--container-mounts", f"{runs.parent}:{runs.parent}"] if image else []
    micro = flags.parse(["--recipe", RECIPE], prog="gpu_check", description="").training.micro_batch_size
    train = ["--train-iters", STEPS, "--save-interval", 20, "--log-interval", 1, "--eval-iters", 0, "--tensorboard", "false",
             "--tensor-model-parallel-size", TP, "--sequence-parallel", "true", "--global-batch-size", micro * world // TP]
    return [str(x) for x in [sys.executable, "-m", "fbt_megatron.slurm", "submit", "--recipe", RECIPE, "--nodes", nodes,
                             "--gpus-per-node", gpus_per_node, "--time", "00:30:00", "--runs-root", runs, "--log-dir", logs,
                             "--env", "NCCL_DEBUG=INFO", *submit_args, *mounts, "--", *train]]


def wait_for(condition: Callable[[], bool], what: str, timeout: float) -> None:
    deadline = time.time() + timeout
    while not condition():
        if time.time() > deadline:
            raise RuntimeError(f"{what} within {timeout:.0f} s")
        time.sleep(2)


def attempts(run: Path) -> list:
    path = run / "jobs.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def last_step(run: Path) -> int:
    from fbt_megatron.trainer.callbacks.metrics_writer import read_metrics

    return max([r["step"] for r in read_metrics(run)], default=0)


def submit(command: List[str]) -> str:
    print("$ " + " ".join(shlex.quote(x) for x in command), flush=True)
    submitted = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    print(submitted.stdout + submitted.stderr)
    jobs = re.findall(r": job (\d+)", submitted.stdout)
    if submitted.returncode or not jobs:
        raise RuntimeError(f"submit failed (exit {submitted.returncode})")
    return jobs[-1]


def stop_and_resume(job: str, run: Path) -> tuple:
    """Signal the job at step 10; (first attempt, second attempt, the step signalled at, seconds to stop)."""
    wait_for(lambda: last_step(run) >= 10, f"job {job} logged no 10 steps", 1800)  # the queue, the image, the rendezvous
    signalled_at, sent = last_step(run), time.time()
    subprocess.run(["scancel", "--batch", "--signal=USR1", job], check=True)
    wait_for(lambda: attempts(run) and "ended" in attempts(run)[0], f"job {job}'s first attempt did not end", 900)
    stop_seconds = time.time() - sent
    wait_for(lambda: len(attempts(run)) == 2 and "ended" in attempts(run)[1], f"job {job} was not requeued and finished", 1800)
    first, second = attempts(run)
    return first, second, signalled_at, stop_seconds


def why_not(ctx: Context) -> Optional[str]:
    if not ctx.args.slurm_nodes or not ctx.args.gpus_per_node:
        return "give --slurm-nodes 2 --gpus-per-node N (the nodes' GPUs) and --slurm-args, from a login node"
    if not shutil.which("sbatch"):
        return "no sbatch on PATH: run it from a login node of the cluster"
    return None


def run(ctx: Context) -> None:
    args, report = ctx.args, ctx.report
    names = [f"{args.slurm_nodes or 2}-node job: {row}" for row in ROWS]
    why = why_not(ctx)
    if why:
        for name in names:
            report.skip(name, why)
        return
    args.workdir.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="gpu_check-slurm-", dir=args.workdir))
    print(f"\n== a {args.slurm_nodes}-node job through slurm/train.sbatch, the time-limit signal mid-run; in {workdir}")
    job = submit(job_command(args.slurm_nodes, args.gpus_per_node, workdir / "runs", workdir / "logs", shlex.split(args.slurm_args)))
    run_folder = workdir / "runs" / "tiny_cpu"
    first, second, signalled_at, stop_seconds = stop_and_resume(job, run_folder)
    log = (workdir / "logs" / f"tiny_cpu-{job}.out").read_text()
    manifest = (run_folder / f"iter_{first['end_step']:07d}" / "files.json").is_file()
    resumed = second["start_step"] == first["end_step"] >= signalled_at and second["end_step"] == STEPS
    report.check(names[0], f"exit {first['exit_code']}, {first['ended']}/{first['next']}, checkpoint at step {first['end_step']} "
                 f"complete: {manifest}, {stop_seconds:.0f} s after the signal"[:100], first["exit_code"] == 0
                 and first["next"] == "requeued" and manifest, "exit 0, requeued, manifest")
    report.check(names[1], f"resumed at step {second['start_step']}, ended {second['ended']} at {second['end_step']}",
                 resumed and second["ended"] == "finished", f"resumes there, finishes {STEPS}")
    world = args.slurm_nodes * args.gpus_per_node
    report.check(names[2], f"'world {world} ' in the banner: {f'world {world} ' in log}", f"world {world} " in log, f"{world} ranks")
    transport = "NET/IB" if "NET/IB" in log else "NET/Socket" if "NET/Socket" in log else "not in the log"
    report.info(names[3], transport, "NET/IB on an InfiniBand cluster")
