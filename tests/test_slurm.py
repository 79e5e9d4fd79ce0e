"""Slurm jobs (``python -m fbt_megatron.slurm``) on a real Slurm of three nodes on this machine
(tests/slurm_cluster.py): the rendered scripts; the drills of issue 44, each held to an
uninterrupted run bit for bit — a 2-node job requeued by ``scontrol requeue`` and stopped by the
time-limit signal (its save outlasting torchrun's own kill timeout) with a straggler kept out of its
restart, a crash and a hang whose nodes are excluded where a node is spare, a lost node that Slurm
requeues around; bad input and an unusable Python not retried; a chained pretrain → long-context →
SFT → export + evaluation on 2 nodes; a corpus prepared as a job array over nodes.

Without the Slurm binaries (``apt-get install slurmctld slurmd slurm-client munge iproute2``) or
root these tests skip on a developer machine; in CI (``FBT_REQUIRE_SLURM=1``, set by .ci/run) they
fail instead.
"""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from forked import run_commands
from slurm_cluster import SlurmCluster, missing_binaries
from test_train import SMALL

from fbt_megatron.launch.plan.planner import batch_fit
from fbt_megatron.recipe import load_recipe
from fbt_megatron.trainer import checkpointing
from fbt_megatron.trainer.callbacks.timeline import read_timeline
from fbt_megatron.trainer.callbacks.metrics_writer import read_metrics
from fbt_megatron.common.processes import outside_group

ROOT = Path(__file__).parent.parent
TINY = ROOT / "recipes" / "tiny_cpu.yaml"
SUBMIT = "slurm_submit"  # python -m fbt_megatron.slurm, its imports loaded once (tests/slurm_submit.py)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    missing = missing_binaries()
    problem = f"Slurm binaries not found: {', '.join(missing)}" if missing else None if os.geteuid() == 0 else "not root"
    if problem:
        if os.environ.get("FBT_REQUIRE_SLURM"):
            pytest.fail(f"{problem} (FBT_REQUIRE_SLURM is set: .ci/run installs slurmctld slurmd slurm-client munge iproute2)")
        pytest.skip(f"{problem}: the three-node Slurm needs root and apt-get install slurmctld slurmd slurm-client munge iproute2")
    cluster = SlurmCluster()
    try:
        cluster.start()
    except BaseException:
        cluster.stop(keep_logs=tmp_path_factory.mktemp("slurm-logs"))  # what it started, and its network
        raise
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


PAPER_CHAIN = ["fbt_1b_100b", "longctx_32k", "sft"]  # the README's chain
EVERY_NODE = '--nodes="$SLURM_JOB_NUM_NODES" --ntasks="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1'  # srun: one task per node
IMAGE = "/shared/images/fbt-megatron+26.06.sqsh"  # the project's image (docs/gpu.md#the-container)
STOCK = "nvcr.io/nvidia/pytorch:26.06-py3"  # NVIDIA's, as it ships
SIF = "/shared/images/fbt-megatron+26.06.sif"  # the project's image for Apptainer (apptainer build ... docker-daemon://…)


def images(tmp: Path):
    """The image files of the dry runs (``dry_runs``): pyxis's squashfs file and Apptainer's .sif."""
    return tmp / "images" / "fbt-megatron+26.06.sqsh", tmp / "images" / "fbt-megatron+26.06.sif"


BAD = {  # the one line a mistake gets: (the line contains, the command after "submit")
    "--recipe missing.yaml": ["--recipe", "missing.yaml", "--nodes", "1", "--gpus-per-node", "0", "--time", "01:00:00"],
    "--nodes 0": ["--recipe", str(TINY), "--nodes", "0", "--gpus-per-node", "0", "--time", "01:00:00"],
    "--signal-margin 20: must be more than 20 s": ["--recipe", str(TINY), "--nodes", "1", "--gpus-per-node", "0", "--time",
                                                  "01:00:00", "--signal-margin", "20"],
    "--time 90": ["--recipe", str(TINY), "--nodes", "1", "--gpus-per-node", "0", "--time", "90"],
    "unknown flag --bogus": ["--recipe", str(TINY), "--nodes", "1", "--gpus-per-node", "0", "--time", "01:00:00", "--", "--bogus", "1"],
    "--chain sets each stage's": ["--chain", str(TINY), "--nodes", "1", "--gpus-per-node", "0", "--time", "01:00:00", "--", "--save", "x"],
    "--env NCCL_DEBUG: expected NAME=VALUE": ["--recipe", str(TINY), "--nodes", "1", "--gpus-per-node", "0", "--time", "01:00:00",
                                              "--env", "NCCL_DEBUG"],
    "--socket-ifname 'ib0 eth0': network interface names, comma-separated": [
        "--recipe", str(TINY), "--nodes", "1", "--gpus-per-node", "0", "--time", "01:00:00", "--socket-ifname", "ib0 eth0"],
    "--no-exclusive: give --cpus-per-task": ["--recipe", str(TINY), "--nodes", "1", "--gpus-per-node", "0", "--time", "01:00:00",
                                            "--no-exclusive"],
    "--container-mounts: mounts are for --container-image": ["--recipe", str(TINY), "--nodes", "1", "--gpus-per-node", "0",
                                                             "--time", "01:00:00", "--container-mounts", "/data:/data"],
    "--stage-args sft: no such stage": ["--chain", str(TINY), "--nodes", "1", "--gpus-per-node", "0", "--time", "01:00:00",
                                        "--stage-args", "sft=--train-iters 3"],
    "--container-runtime apptainer: the runtime of --container-image; give the image": [
        "--recipe", str(TINY), "--nodes", "1", "--gpus-per-node", "0", "--time", "01:00:00", "--container-runtime", "apptainer"],
    "--finetune: a Slurm job resumes its own --save on every requeue": ["--recipe", str(TINY), "--nodes", "1", "--gpus-per-node",
                                                                       "0", "--time", "01:00:00", "--", "--finetune"],
    "--spare-nodes -1: give 0 or more": ["--recipe", str(TINY), "--nodes", "1", "--gpus-per-node", "0", "--time", "01:00:00",
                                         "--spare-nodes", "-1"],
    "--spare-nodes 1: spares take a lost node's place in torchrun's rendezvous: use them with --launch torchrun and "
    "--restart in-job": ["--recipe", str(TINY), "--nodes", "1", "--gpus-per-node", "0", "--time", "01:00:00", "--spare-nodes",
                         "1", "--restart", "requeue"],
    "--rdzv-join-timeout 0: give 1 or more seconds": ["--recipe", str(TINY), "--nodes", "1", "--gpus-per-node", "0", "--time",
                                                      "01:00:00", "--rdzv-join-timeout", "0"],
    "--rdzv-join-timeout: the rendezvous of --launch torchrun; --launch tasks has none": [
        "--recipe", str(TINY), "--nodes", "1", "--gpus-per-node", "0", "--time", "01:00:00", "--launch", "tasks",
        "--rdzv-join-timeout", "900"],
}


def planner_refusal(name: str, world_size: int) -> str:
    """The planner's own line for a recipe's global batch on a world (python -m fbt_megatron.plan's)."""
    return batch_fit(load_recipe(str(ROOT / "recipes" / f"{name}.yaml")), world_size).problem()


@pytest.fixture(scope="module")
def dry_runs(tmp_path_factory):
    """Every ``--dry-run`` of this module in one interpreter (``submit_many``): {case: (exit code,
    output)}, with the folder, the data files given to the paper chain and the planner's lines."""
    tmp = tmp_path_factory.mktemp("dry-runs")
    data = {"web": tmp / "data" / "web_text_document", "long": tmp / "data" / "long_text_document",
            "tokenizer": tmp / "data" / "tokenizer.model", "chat": tmp / "data" / "chat_train.jsonl",
            "chat_valid": tmp / "data" / "chat_valid.jsonl", "export": tmp / "export"}
    (tmp / "data").mkdir()
    for path in [data["web"].with_suffix(".bin"), data["web"].with_suffix(".idx"), data["long"].with_suffix(".bin"),
                 data["long"].with_suffix(".idx"), data["tokenizer"], data["chat"], data["chat_valid"]]:
        path.write_text("")  # only their presence is checked before submitting
    data["export"].mkdir()
    (data["export"] / "config.json").write_text("{}")
    image, sif = images(tmp)
    image.parent.mkdir()
    for path in (image, sif):
        path.write_text("")  # preflight checks that an image file exists; what is in it, the job's first step
    mount = f"{tmp}:{tmp}"  # the runs and data of these jobs (outside the checkout, the container's own mount)
    refusals = {name: planner_refusal(name, 64) for name in PAPER_CHAIN[:2]}  # sft's batch of 64 divides over DP 32
    suggested = {name: re.search(r"--global-batch-size \d+ --train-iters \d+", line)[0] for name, line in refusals.items()}

    tiny = ["submit", "--recipe", str(TINY), "--nodes", "2", "--gpus-per-node", "4", "--time", "04:00:00", "--partition", "gpu",
            "--account", "proj", "--container-image", image, "--container-mounts", "/data:/data", "--container-mounts", mount,
            "--sbatch-option=--qos=high",
            "--env", "NCCL_SOCKET_IFNAME=ib0", "--runs-root", str(tmp / "runs"), "--log-dir", str(tmp / "logs"), "--dry-run"]
    chain = ["submit", "--chain", *(str(ROOT / "recipes" / f"{n}.yaml") for n in PAPER_CHAIN), "--nodes", "8",
             "--gpus-per-node", "8", "--gpu", "h100", "--time", "04:00:00", "--runs-root", str(tmp / "runs" / "1b"), "--dry-run"]
    data_args = ["--stage-args", f"fbt_1b_100b=--train-data-path [{data['web']}]",
                 "--stage-args", f"longctx_32k=--train-data-path [{data['long']}]",
                 "--stage-args", f"sft=--train-data-path [{data['chat']}] --valid-data-path [{data['chat_valid']}]",
                 "--container-image", image, "--container-mounts", mount, "--", "--tokenizer-model", str(data["tokenizer"])]
    cases = {
        "torchrun": [*tiny, "--", "--train-iters", "7", "--micro-batch-size", "2"],
        "tasks": [*tiny, "--launch", "tasks", "--exit-margin", "10", "--no-exclusive", "--cpus-per-task", "12",
                  "--socket-ifname", "ib0,ib1", "--", "--micro-batch-size", "2"],
        "sockets": ["submit", "--recipe", str(TINY), "--nodes", "2", "--gpus-per-node", "0", "--time", "01:00:00",
                    "--socket-ifname", "ib0,ib1", "--runs-root", str(tmp / "runs" / "sockets"), "--log-dir", str(tmp / "logs"),
                    "--dry-run"],
        "join timeout": ["submit", "--recipe", str(TINY), "--nodes", "2", "--gpus-per-node", "0", "--time", "01:00:00",
                         "--rdzv-join-timeout", "2400", "--runs-root", str(tmp / "runs" / "join"), "--log-dir", str(tmp / "logs"),
                         "--dry-run"],
        "spares": ["submit", "--recipe", str(TINY), "--nodes", "2", "--spare-nodes", "1", "--gpus-per-node", "0", "--time",
                   "01:00:00", "--runs-root", str(tmp / "runs" / "spares"), "--log-dir", str(tmp / "logs"), "--dry-run"],
        "cpu image": ["submit", "--recipe", str(TINY), "--nodes", "2", "--gpus-per-node", "0", "--time", "01:00:00",
                      "--container-image", image, "--container-mounts", mount, "--runs-root", str(tmp / "runs" / "cpu-image"), "--log-dir", str(tmp / "logs"),
                      "--dry-run"],
        "apptainer": ["submit", "--recipe", str(TINY), "--nodes", "2", "--gpus-per-node", "4", "--time", "01:00:00",
                      "--container-image", sif, "--container-runtime", "apptainer", "--container-mounts", "/data:/data",
                      "--container-mounts", mount,
                      "--runs-root", str(tmp / "runs" / "apptainer"), "--log-dir", str(tmp / "logs"), "--dry-run", "--",
                      "--micro-batch-size", "2"],
        "missing data": ["submit", "--recipe", str(TINY), "--nodes", "1", "--gpus-per-node", "0", "--time", "01:00:00", "--dry-run",
                         "--", "--train-data-path", f"[{tmp / 'missing'}]", "--tokenizer-model", str(data["tokenizer"])],
        "paper chain": chain,
        "memory": ["submit", "--recipe", str(ROOT / "recipes" / "fbt_1b_100b.yaml"), "--nodes", "1", "--gpus-per-node", "4",
                   "--gpu-memory-gb", "24", "--time", "04:00:00", "--container-image", image, "--container-mounts", mount,
                   "--dry-run", "--",
                   "--tensor-model-parallel-size", "1", "--sequence-parallel", "false", "--train-data-path", f"[{data['web']}]",
                   "--tokenizer-model", str(data["tokenizer"])],
        "tp across nodes": ["submit", "--recipe", str(ROOT / "recipes" / "fbt_1b_100b.yaml"), "--nodes", "4", "--gpus-per-node", "4",
                            "--gpu", "h100", "--time", "04:00:00", "--fit-global-batch", "--container-image", image,
                            "--container-mounts", mount, "--dry-run", "--", "--tensor-model-parallel-size", "8",
                            "--train-data-path", f"[{data['web']}]", "--tokenizer-model", str(data["tokenizer"])],
        "suggested": [*chain, *(a for name, flags in suggested.items() for a in ("--stage-args", f"{name}={flags}")), *data_args],
        "fitted": [*chain, "--fit-global-batch", *data_args],
        "serve": ["serve", str(data["export"]), "--time", "08:00:00", "--partition", "gpu", "--container-image", image,
                  "--container-mounts", mount,
                  "--port", "8100", "--log-dir", str(tmp / "logs"), "--dry-run", "--", "--max-model-len", "512"],
        "serve placeholder": ["serve", "/path/to/export", "--time", "08:00:00", "--dry-run"],
        "stock image": ["submit", "--recipe", str(TINY), "--nodes", "1", "--gpus-per-node", "0", "--time", "01:00:00",
                        "--container-image", STOCK, "--dry-run"],
        "serve stock image": ["serve", str(data["export"]), "--time", "01:00:00", "--container-image", "nvcr.io#nvidia/pytorch:26.06-py3",
                              "--dry-run"],
        "serve cpu": ["serve", str(data["export"]), "--time", "01:00:00", "--gpus", "0", "--container-image", image,
                      "--container-mounts", mount,
                      "--log-dir", str(tmp / "logs"), "--dry-run"],
        "evaluate": ["evaluate", str(data["export"]), "--output", str(tmp / "eval" / "x.md"), "--time", "01:00:00",
                     "--container-image", image, "--container-mounts", mount, "--log-dir", str(tmp / "logs"), "--dry-run", "--",
                     "--modes", "standard"],
        "missing image": ["submit", "--recipe", str(TINY), "--nodes", "1", "--gpus-per-node", "0", "--time", "01:00:00",
                          "--container-image", str(image.with_name("nope.sqsh")), "--dry-run"],
        "placeholder sif": ["submit", "--recipe", str(TINY), "--nodes", "1", "--gpus-per-node", "0", "--time", "01:00:00",
                            "--container-image", "/path/to/fbt.sif", "--container-runtime", "apptainer", "--dry-run"],
        "registry": ["submit", "--recipe", str(TINY), "--nodes", "1", "--gpus-per-node", "0", "--time", "01:00:00",
                     "--container-image", "registry.example.org#fbt/fbt-megatron:26.06", "--dry-run"],
        "unmounted": ["submit", "--recipe", str(TINY), "--nodes", "1", "--gpus-per-node", "0", "--time", "01:00:00",
                      "--container-image", image, "--runs-root", str(tmp / "scratch" / "runs"), "--dry-run", "--",
                      "--tokenizer-model", str(data["tokenizer"])],
        "unmounted evaluate": ["evaluate", str(data["export"]), "--output", str(tmp / "eval" / "x.md"), "--time", "01:00:00",
                               "--container-image", image, "--dry-run"],
        **{bad: ["submit", *argv] for bad, argv in BAD.items()},
    }
    results = submit_many(tmp, list(cases.values()))
    return dict(zip(cases, results)), tmp, data, refusals


def scripts(output: str) -> dict:
    """The job scripts of a --dry-run by job name, each checked by ``bash -n``."""
    parts = re.split(r"^# ---- (\S+): sbatch --parsable.*$", output, flags=re.M)
    jobs = dict(zip(parts[1::2], parts[2::2]))
    for name, script in jobs.items():
        syntax = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True)
        assert syntax.returncode == 0 and script.lstrip().startswith("#!/bin/bash"), (name, syntax.stderr)
    return jobs


def test_dry_run_renders_both_launch_modes_and_bad_input_is_one_line(dry_runs):
    cases, tmp, _, _ = dry_runs
    (code_torchrun, torchrun), (code_tasks, tasks) = cases["torchrun"], cases["tasks"]
    assert code_torchrun == 0 and code_tasks == 0, torchrun + tasks
    save, (image, _) = tmp / "runs" / "tiny_cpu", images(tmp)
    [torchrun], [tasks] = scripts(torchrun).values(), scripts(tasks).values()
    for script in (torchrun, tasks):
        for line in ["#SBATCH --nodes=2", "#SBATCH --time=04:00:00", "#SBATCH --requeue", "#SBATCH --open-mode=append",
                     f"#SBATCH --output={tmp}/logs/tiny_cpu-%j.out", "#SBATCH --signal=B:USR1@180",
                     "#SBATCH --partition=gpu", "#SBATCH --account=proj", "#SBATCH --gpus-per-node=4", "#SBATCH --qos=high",
                     f"CONTAINER=(--container-image={image} --container-mounts={ROOT}:{ROOT},/data:/data,{tmp}:{tmp}",
                     f"SAVE={save}",
                     f"ATTEMPTS=(python3 {ROOT}/fbt_megatron/launch/attempts.py)", '"${ATTEMPTS[@]}" end',
                     "--kill-on-bad-exit=1", "# (TP 1, CP 1: CUDA_DEVICE_MAX_CONNECTIONS not set)",
                     "export NCCL_IB_TIMEOUT=${NCCL_IB_TIMEOUT:-22}", "export NCCL_IB_RETRY_CNT=${NCCL_IB_RETRY_CNT:-7}",
                     "export NCCL_SOCKET_IFNAME=ib0", f"export PYTHONPATH={ROOT}$" "{PYTHONPATH:+:$PYTHONPATH}",
                     'srun --cpus-per-task="$CPUS_PER_TASK"', 'srun --ntasks-per-node=1 --cpus-per-task="$CPUS_PER_TASK"',
                     f'CHECK=$(srun {EVERY_NODE} "${{CONTAINER[@]}}" python {ROOT}/fbt_megatron/launch/slurm/image_check.py '
                     f"--image {image} --gpus 4 2>&1)\nCHECKED=$?", "[[ $CHECKED != 2 ]] || { remove_containers; exit 2; }"]:
            assert line in script, line
        assert script.index("image_check.py") < script.index('"${ATTEMPTS[@]}" start')  # the first step, before any attempt
        assert script.index("#SBATCH --qos=high") < script.index("set -uo pipefail")  # extra lines among the directives
        assert script.index("NCCL_IB_TIMEOUT") < script.index("NCCL_SOCKET_IFNAME=ib0")  # --env after the defaults: it wins
    # in-job restarts: torchrun may restart the workers as often as the budget left says (attempts.py start); the tasks
    # launch has no agent to restart them: every restart is a requeue
    assert "POLICY=(--max-restarts 3 --in-job)" in torchrun and "POLICY=(--max-restarts 3)" in tasks
    assert 'IN_JOB=$("${ATTEMPTS[@]}" start "$SAVE" "${POLICY[@]}" --job-start "$JOB_START") || exit 1' in torchrun
    assert '--nnodes=2 --nproc-per-node="$PROCS_PER_NODE" --max-restarts="$IN_JOB" ' in torchrun
    assert "--kill-on-bad-exit=1 " in torchrun and "#SBATCH --no-kill" not in torchrun and "#SBATCH --nodes=2\n" in torchrun
    [spares] = scripts(cases["spares"][1]).values()  # 2 training nodes and a spare: the job and its step outlive a lost node
    assert "#SBATCH --nodes=3\n" in spares and "#SBATCH --no-kill\n" in spares and spares.count("--kill-on-bad-exit") == 1  # tasks
    assert 'srun --ntasks-per-node=1 --cpus-per-task="$CPUS_PER_TASK" --no-kill ' in spares and " --nnodes=2 " in spares
    assert "if (( 1 > 0 )); then\n    trap 'STOP=lost;" in spares and "if (( 0 > 0 )); then\n" in torchrun  # the lost-node watch
    assert "#SBATCH --exclusive" in torchrun and "--cpus-per-task=" not in torchrun.split("set -uo")[0]
    assert "CPUS_PER_TASK=${SLURM_CPUS_PER_TASK:-$((SLURM_CPUS_ON_NODE / 1))}" in torchrun  # the node's CPUs to torchrun
    assert "#SBATCH --cpus-per-task=12" in tasks and "#SBATCH --exclusive" not in tasks
    # --socket-ifname: gloo's and NCCL's interfaces (NCCL's exactly these: "="), after the NCCL defaults; --env wins
    [sockets] = scripts(cases["sockets"][1]).values()
    assert sockets.index("NCCL_DEBUG") < sockets.index("export GLOO_SOCKET_IFNAME=ib0,ib1\nexport NCCL_SOCKET_IFNAME==ib0,ib1\n")
    assert "export GLOO_SOCKET_IFNAME=ib0,ib1\nexport NCCL_SOCKET_IFNAME=ib0\n" in tasks and "GLOO_SOCKET_IFNAME" not in torchrun
    assert "#SBATCH --ntasks-per-node=1" in torchrun and "LAUNCH=torchrun" in torchrun and "PROCS_PER_NODE=4" in torchrun
    assert "STOP_TIMEOUT=160" in torchrun and '-m fbt_megatron.slurm torchrun \\\n        --stop-timeout "$STOP_TIMEOUT" ' in torchrun
    assert "export CUDA_DEVICE_MAX_CONNECTIONS" not in torchrun + tasks  # TP 1, CP 1
    assert f"TRAIN_ARGS=(--recipe {TINY} --log-timestamps --train-iters 7 --micro-batch-size 2 --save {save} --load {save})" in torchrun
    assert "TRAIN_ITERS=7" in torchrun and "TRAIN_ITERS=800" in tasks  # the recipe's, or the flag's
    assert "#SBATCH --ntasks-per-node=4" in tasks and "LAUNCH=tasks" in tasks
    assert f"--exit-duration-in-mins 230 --save {save}" in tasks  # 4 h minus the 10-minute --exit-margin
    for expected in BAD:
        code, output = cases[expected]
        assert code == 2 and output.count("\n") == 1 and output.startswith("error: ") and expected in output, output
    code, output = cases["stock image"]  # NVIDIA's image as it ships: no megatron-core; refused before it queues
    assert code == 2 and output.splitlines() == [
        f"error: --container-image {STOCK} is NVIDIA's PyTorch image as it ships, without megatron-core, transformers or "
        "this project: give the project's image (packaging/container/Dockerfile: NGC PyTorch and the wheelhouse, "
        "docs/gpu.md#the-container), built from it", "error: nothing submitted: 1 problem (the lines above)"], output
    code, output = cases["serve stock image"]  # enroot's spelling of the registry; the fix for serving is another image
    assert code == 2 and "is NVIDIA's PyTorch image as it ships" in output and "give an image with vLLM and this package" in output
    code, output = cases["missing data"]
    missing = tmp / "missing"
    assert code == 2 and output.splitlines() == [
        f"error: tiny_cpu: data.train_data_path {missing}: {missing}.bin and {missing}.idx not found (expected: a Megatron "
        f"blend; relative paths start at {ROOT})", "error: nothing submitted: 1 problem (the lines above)"], output


def test_paper_chain_on_8x8_is_refused_with_the_planners_lines_and_plans_with_the_suggested_flags(dry_runs):
    """The README's chain on 8 nodes x 8 GPUs: every problem of every stage is one line, the
    planner's own where the global batch does not divide (with the flags that fit), placeholders
    by name, this machine's CPU-only torch for GPU nodes; nothing is rendered. With the suggested
    flags (per stage) and data, or with --fit-global-batch, every stage plans and renders."""
    cases, tmp, data, refusals = dry_runs
    code, output = cases["paper chain"]
    assert "--global-batch-size 32 --train-iters 381471 or --global-batch-size 64 --train-iters 190736" in refusals["fbt_1b_100b"]
    assert "--global-batch-size 16 --train-iters 22889 (" in refusals["longctx_32k"]  # 8 sequences over DP 16: only up
    placeholder = "error: {}: data.{} /path/to/{} is a placeholder: give {} (--{})"
    expected = [
        f"error: fbt_1b_100b: {refusals['fbt_1b_100b']}",
        placeholder.format("fbt_1b_100b", "train_data_path", "your_text_document", "a Megatron blend", "train-data-path"),
        placeholder.format("fbt_1b_100b", "tokenizer_model", "tokenizer.model", "the tokenizer file", "tokenizer-model"),
        f"error: longctx_32k: {refusals['longctx_32k']}",
        placeholder.format("longctx_32k", "train_data_path", "your_long_text_document", "a Megatron blend", "train-data-path"),
        placeholder.format("longctx_32k", "tokenizer_model", "tokenizer.model", "the tokenizer file", "tokenizer-model"),
        placeholder.format("sft", "train_data_path", "chat_train.jsonl", "chat .jsonl files", "train-data-path"),
        placeholder.format("sft", "valid_data_path", "chat_valid.jsonl", "chat .jsonl files", "valid-data-path"),
        placeholder.format("sft", "tokenizer_model", "tokenizer.model", "the tokenizer file", "tokenizer-model"),
    ]
    if torch.version.cuda is None:  # this machine's torch, which GPU nodes would run without a container
        expected.append(f"error: GPU jobs without --container-image run {sys.executable}, whose torch {torch.__version__} is a "
                        "CPU-only build: give --container-image with the project's image (packaging/container/Dockerfile: "
                        "NGC PyTorch and the wheelhouse, docs/gpu.md#the-container), or submit from a Python with a CUDA "
                        "torch and requirements-gpu.txt's packages")
    expected.append(f"error: nothing submitted: {len(expected)} problems (the lines above); the flags of one stage of a chain: "
                    "--stage-args STAGE='FLAGS'")
    assert code == 2 and output.splitlines() == expected, output

    code, output = cases["tp across nodes"]  # allowed (an NVLink domain may span nodes), said: the plan assumes NVLink
    assert code == 0 and ("fbt_1b_100b: note: --tensor-model-parallel-size 8 spans nodes of 4 GPUs: every layer's all-reduces "
                          "would cross the network") in output, output[:3000]
    code, output = cases["memory"]  # a layout that does not fit 24 GiB GPUs: the planner's line
    assert code == 2 and output.startswith("error: fbt_1b_100b: does not fit: ") and "activations alone" in output, output
    assert output.splitlines()[1:] == ["error: nothing submitted: 1 problem (the lines above)"], output

    plans = {}
    for case in ("suggested", "fitted"):
        code, output = cases[case]
        assert code == 0, output
        jobs = scripts(output)
        assert list(jobs) == [*PAPER_CHAIN, "sft-eval"]
        plans[case] = [line for line in output.splitlines() if ": plan: " in line]
        assert [line.split(":")[0] for line in plans[case]] == PAPER_CHAIN
        checks = {name: re.search(r"image_check.py (.*) 2>&1", jobs[name])[1] for name in PAPER_CHAIN}
        image, _ = images(tmp)
        assert checks == {"fbt_1b_100b": f"--image {image} --gpus 8", "longctx_32k": f"--image {image} --gpus 8 --context-parallel",
                          "sft": f"--image {image} --gpus 8"}, checks  # context parallelism: Transformer Engine attention
        connections = {name: re.search(r"^export CUDA_DEVICE_MAX_CONNECTIONS=(.*)$", jobs[name], flags=re.M)[1] for name in PAPER_CHAIN}
        assert connections == {name: f"${{CUDA_DEVICE_MAX_CONNECTIONS:-1}}  # TP 2, CP {cp}" for name, cp in
                               zip(PAPER_CHAIN, (1, 2, 1))}, connections  # tensor (and context) parallelism: one queue
        iters = [re.search(r"^TRAIN_ITERS=(\d+)$", jobs[name], flags=re.M)[1] for name in PAPER_CHAIN]
        assert iters == ["381471", "22889", "22889"], iters
        train_args = {name: re.search(r"^TRAIN_ARGS=\((.*)\)$", jobs[name], flags=re.M)[1] for name in PAPER_CHAIN}
        assert "--global-batch-size 32 --train-iters 381471" in train_args["fbt_1b_100b"]
        assert "--global-batch-size 16 --train-iters 22889" in train_args["longctx_32k"]
        assert "--global-batch-size" not in train_args["sft"]  # its 64 sequences split over DP 32 as they are
        assert train_args["longctx_32k"].endswith(f"--pretrained-checkpoint {tmp}/runs/1b/fbt_1b_100b")
        assert f"--train-data-path '[{data['long']}]'" in train_args["longctx_32k"]  # --stage-args: this stage's only
    assert plans["suggested"] == plans["fitted"]
    assert plans["fitted"][0].startswith("fbt_1b_100b: plan: 64 GPUs as TP 2 × PP 1 × CP 1 × DP 32; 381,471 steps × 32 × "
                                         "8,192 tokens (100.00B); ") and " GiB per GPU estimated of 77.6 usable; " in plans["fitted"][0]
    assert plans["fitted"][1].startswith("longctx_32k: plan: 64 GPUs as TP 2 × PP 1 × CP 2 × DP 16; 22,889 steps × 16 × 32,768")
    fitted = cases["fitted"][1]
    assert ("fbt_1b_100b: --fit-global-batch: global batch 36 → 32 sequences (DP 32 on 64 GPUs), --train-iters 339085 → "
            "381471 (the same 100.00B tokens, rounded up)") in fitted
    assert "longctx_32k: --fit-global-batch: global batch 8 → 16 sequences (DP 16 on 64 GPUs), --train-iters 45777 → 22889" in fitted
    print("\n" + "\n".join(cases["paper chain"][1].splitlines() + plans["fitted"]))


def test_serving_and_evaluating_an_export_on_a_gpu_node_with_vllm(dry_runs):
    """``serve EXPORT``: ``vllm serve`` on one GPU with 8 CPUs; ``evaluate``: the evaluation table with the
    vLLM backend; a placeholder export and a GPU job on this CPU-only environment are refused."""
    cases, tmp, data, _ = dry_runs
    code, output = cases["serve"]
    assert code == 0, output
    [(name, serve)] = scripts(output).items()
    assert name == "serve-export"
    for line in ["#SBATCH --nodes=1", "#SBATCH --ntasks=1", "#SBATCH --time=08:00:00", "#SBATCH --partition=gpu",
                 "#SBATCH --gpus-per-node=1", "#SBATCH --cpus-per-task=8", f"#SBATCH --output={tmp}/logs/serve-export-%j.out",
                 f'"${{CONTAINER[@]}}" vllm serve {data["export"]} \\\n    --host 0.0.0.0 --port 8100 --enforce-eager --max-model-len 512',
                 "export VLLM_USE_V2_MODEL_RUNNER=${VLLM_USE_V2_MODEL_RUNNER:-0}",
                 f"serves {data['export']} at http://$(hostname):8100/v1", "export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}"]:
        assert line in serve, line
    assert "--kv-cache-memory-bytes" not in serve  # a GPU node sizes its KV cache from the GPU's memory
    code, output = cases["serve cpu"]  # a CPU node: compiled, and a KV cache of docs/serving.md's size
    assert code == 0, output
    [serve_cpu] = scripts(output).values()
    assert f'vllm serve {data["export"]} \\\n' in serve_cpu and "--gpus-per-node" not in serve_cpu, serve_cpu
    [command] = [line.strip() for line in serve_cpu.splitlines() if "--host 0.0.0.0" in line]
    assert command == "--host 0.0.0.0 --port 8000 --kv-cache-memory-bytes 1G", serve_cpu  # no --enforce-eager
    code, output = cases["evaluate"]
    assert code == 0, output
    [evaluate] = scripts(output).values()
    assert (f"-m fbt_megatron.evaluation table {data['export']} \\\n    --cache {tmp}/eval/exports --output {tmp}/eval/x.md --backend vllm "
            "--modes standard") in evaluate and "#SBATCH --gpus-per-node=1" in evaluate
    assert "export VLLM_USE_V2_MODEL_RUNNER=${VLLM_USE_V2_MODEL_RUNNER:-0}" in evaluate
    code, output = cases["serve placeholder"]
    lines = output.splitlines()
    assert code == 2 and lines[0] == "error: export /path/to/export is a placeholder: give an export folder", output
    if torch.version.cuda is None:
        assert "whose torch" in output and "is a CPU-only build" in output
    assert lines[-1].startswith(f"error: nothing submitted: {len(lines) - 1} problem")


def test_a_container_job_whose_image_file_or_paths_it_would_not_find_is_refused_before_it_queues(dry_runs):
    """An image given as a file that does not exist (or a placeholder) is refused before it queues,
    not after the queue wait; a registry reference is the runtime's to import. Every path a container
    job reads or writes (its run folder, data, tokenizer; an export, an evaluation's output) must be
    inside a folder mounted at its own path: each one outside gets the mount to add."""
    cases, tmp, data, _ = dry_runs
    image, _ = images(tmp)
    refusals = {case: (cases[case][0], cases[case][1].splitlines()) for case in
                ("missing image", "placeholder sif", "unmounted", "unmounted evaluate")}
    missing = image.with_name("nope.sqsh")
    assert refusals["missing image"] == (2, [
        f"error: --container-image {missing}: no such file (expected: a squashfs file made by enroot import, at a path every "
        f"node reads (docs/gpu.md#the-container); relative paths start at {ROOT})",
        "error: nothing submitted: 1 problem (the lines above)"]), refusals
    assert refusals["placeholder sif"] == (2, [
        "error: --container-image /path/to/fbt.sif is a placeholder: give a .sif file made by apptainer build, at a path every "
        "node reads (docs/gpu.md#the-container)", "error: nothing submitted: 1 problem (the lines above)"]), refusals
    code, output = cases["registry"]
    assert code == 0 and "'--container-image=registry.example.org#fbt/fbt-megatron:26.06' " in output, output
    outside = "is not mounted in the container (it mounts {}): add --container-mounts {}:{}"
    assert refusals["unmounted"] == (2, [
        f"error: --save {tmp}/scratch/runs/tiny_cpu " + outside.format(ROOT, tmp, tmp),  # the nearest folder that exists
        f"error: data.tokenizer_model {data['tokenizer']} " + outside.format(ROOT, *[data["tokenizer"].parent] * 2),
        "error: nothing submitted: 2 problems (the lines above)"]), refusals
    assert refusals["unmounted evaluate"] == (2, [
        f"error: model {data['export']} " + outside.format(ROOT, *[data["export"]] * 2),
        f"error: --output {tmp}/eval " + outside.format(ROOT, tmp, tmp),
        "error: nothing submitted: 2 problems (the lines above)"]), refusals


def run_bash(script: str, env: dict, path=None) -> subprocess.CompletedProcess:
    """``script`` in ``bash -u`` with only ``env`` (and PATH: ``path`` first)."""
    paths = [str(path)] if path else []
    return subprocess.run(["bash", "-uc", script], env={**env, "PATH": os.pathsep.join([*paths, os.environ["PATH"]])},
                          capture_output=True, text=True)


def test_a_container_job_imports_the_image_once_per_node_and_attempt_and_removes_what_pyxis_keeps(dry_runs, tmp_path):
    """gpu-review-2 N10 (issue 52 item 3): both steps of an attempt run in one named container per node
    (pyxis reuses a named container and skips the import; an unnamed one is removed after its step), so
    each node imports the image once per attempt; the name carries the restart count, so a requeued
    attempt never reuses a container an earlier one left. The check runs on every node of an image or
    GPU job (there each node imports the image, before the rendezvous; a GPU job's check gets the GPUs
    per node), on the first node of a CPU job on the host Python, as before. The rendezvous waits 1800 s
    (--rdzv-join-timeout) for every node's torchrun. Named containers outlive the job where pyxis's
    container_scope is global (its default): the job removes its own on its nodes (``enroot`` and
    ``srun`` stand-ins here)."""
    cases, tmp, _, _ = dry_runs
    image, sif = images(tmp)
    [torchrun], [tasks], [cpu_image], [apptainer] = (scripts(cases[name][1]).values()
                                                     for name in ("torchrun", "tasks", "cpu image", "apptainer"))
    [(join_code, join_output), (cpu_code, cpu_output)] = cases["join timeout"], cases["sockets"]
    assert join_code == 0 and cpu_code == 0, join_output + cpu_output
    [join], [cpu] = scripts(join_output).values(), scripts(cpu_output).values()
    name = 'CONTAINER_NAME="fbt-$SLURM_JOB_ID-${SLURM_RESTART_COUNT:-0}"\n'
    for script in (torchrun, tasks, cpu_image):
        assert name in script and f'--container-workdir={ROOT} --container-name="$CONTAINER_NAME")' in script, script
        steps = [line for line in script.splitlines() if re.match(r"\s*(CHECK=\$\(|TORCH_CPP_LOG_LEVEL=ERROR |timeout \d+ )?srun ", line)]
        # the removal (on the host), the check, the training (torchrun's or the tasks'): each in the attempt's container
        assert ['"${CONTAINER[@]}"' in line for line in steps] == [False, True, True, True], steps
        assert steps[1].startswith(f'CHECK=$(srun {EVERY_NODE} "${{CONTAINER[@]}}" python '), steps
    assert f"image_check.py --image {image} --gpus 4 2>&1" in torchrun + tasks
    assert f"image_check.py --image {image} 2>&1" in cpu_image  # CPU nodes: imports only
    assert '--rdzv-id="$SLURM_JOB_ID" --rdzv-conf=join_timeout=1800 \\\n' in torchrun
    assert "--rdzv-conf=join_timeout=2400 \\\n" in join
    # Apptainer (--container-runtime apptainer): every step runs `apptainer exec` of the .sif file (GPUs with --nv), the
    # same mounts and work folder; nothing kept per node, so no name and nothing to remove
    exec_ = (f"CONTAINER=(apptainer exec --nv --bind {ROOT}:{ROOT},/data:/data,{tmp}:{tmp} --pwd {ROOT} {sif})\n")
    assert "CONTAINER_NAME=''\n" + exec_ in apptainer and "--container-image=" not in apptainer, apptainer
    steps = [line for line in apptainer.splitlines() if re.match(r"\s*(CHECK=\$\(|TORCH_CPP_LOG_LEVEL=ERROR |timeout \d+ )?srun ", line)]
    assert ['"${CONTAINER[@]}" python ' in line for line in steps] == [False, True, True, True], steps
    assert f"image_check.py --image {sif} --gpus 4 2>&1" in apptainer
    for script in (cpu, join):  # the host's Python on CPU nodes: no container, the check on the first node
        assert "CONTAINER_NAME=''\nCONTAINER=()\n" in script and "--container-name" not in script
        assert f'CHECK=$(srun --nodes=1 --ntasks=1 "${{CONTAINER[@]}}" {sys.executable} {ROOT}/fbt_megatron/launch/slurm/image_check.py 2>&1)' in script
    assert torchrun.index("remove_containers\nCHECK=$(srun") < torchrun.index("image_check.py --image") < torchrun.index('"${ATTEMPTS[@]}" start')
    assert re.search(r'^CODE=\$\?\n.*WATCH.*\n+(#.*\n)+remove_containers\n(#.*\n)+"\$\{ATTEMPTS\[@\]\}" end ', torchrun, flags=re.M), torchrun
    assert torchrun.rstrip().endswith('"${POLICY[@]}" --log "$LOG"')  # its exit code the job's

    # the name each attempt gets, and what the removal takes: this job's, either container_scope's, nothing else
    header = re.search(r"^CONTAINER_NAME=.*\nCONTAINER=\(.*\)$", torchrun, flags=re.M)[0]
    remove = re.search(r"^remove_containers\(\) \{\n.*?^\}$", torchrun, flags=re.M | re.S)[0]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text('#!/bin/bash\necho "srun $*" >> "$CALLS"\nwhile [[ $1 == --* ]]; do shift; done\nexec "$@"\n')
    (bin_dir / "enroot").write_text('#!/bin/bash\ncase $1 in list) cat "$LISTED" ;; remove) echo "$*" >> "$CALLS" ;; esac\n')
    for tool in ("srun", "enroot"):
        (bin_dir / tool).chmod(0o755)
    listed = ["pyxis_fbt-4242-0", "pyxis_fbt-4242-1", "pyxis_4242_fbt-4242-1", "pyxis_fbt-42420-0", "pyxis_fbt-424-1",
              "pyxis_4242.0", "pyxis_other", "fbt-4242-0"]
    (tmp_path / "listed").write_text("\n".join(listed) + "\n")
    env = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": "2", "CALLS": str(tmp_path / "calls"), "LISTED": str(tmp_path / "listed")}
    shown = run_bash(f'{header}\nprintf "%s\\n" "${{CONTAINER[@]}}"', env)
    assert shown.returncode == 0 and shown.stdout.splitlines()[-1] == "--container-name=fbt-4242-0", shown
    shown = run_bash(f'{header}\nprintf "%s\\n" "${{CONTAINER[@]}}"', {**env, "SLURM_RESTART_COUNT": "2"})
    assert shown.stdout.splitlines()[-1] == "--container-name=fbt-4242-2", shown  # a requeued attempt: a container of its own
    removed = run_bash(f"{header}\n{remove}\nremove_containers", {**env, "SLURM_RESTART_COUNT": "2"}, bin_dir)
    assert removed.returncode == 0 and removed.stdout + removed.stderr == "", removed
    calls = (tmp_path / "calls").read_text().splitlines()  # srun: one task on each of the job's nodes
    assert calls[0].startswith("srun --nodes=2 --ntasks=2 --ntasks-per-node=1 bash -c enroot list") and calls[0].endswith(" _ fbt-4242-2")
    assert calls[1:] == ["remove -f pyxis_fbt-4242-0", "remove -f pyxis_fbt-4242-1", "remove -f pyxis_4242_fbt-4242-1"], calls
    (tmp_path / "calls").unlink()
    # an image file enroot cannot start (pyxis's lines as pyxis 0.24 / enroot 4.1.2 print them on the test Slurm: a
    # missing file, or not a squashfs file): one error: line, exit 2 (not retried); a registry out of reach: retried
    check = re.search(r"^remove_containers\nCHECK=.*?^# ----$", torchrun, flags=re.M | re.S)[0]
    pyxis = {"missing": ["slurmstepd-n2: error: pyxis: child 227 failed with error code: 1",
                         "slurmstepd-n2: error: pyxis: failed to create container filesystem for image: " + str(image),
                         "slurmstepd-n2: error: pyxis: printing enroot log file:",
                         f"slurmstepd-n2: error: pyxis:     [ERROR] No such file or directory: {image}",
                         "slurmstepd-n2: error: spank: required plugin spank_pyxis.so: task_init() failed with rc=-1",
                         "srun: error: n2: task 1: Exited with exit code 1"],
             "registry": ["slurmstepd-n1: error: pyxis: failed to import docker image: nvcr.io#nvidia/x:1",
                          "slurmstepd-n1: error: pyxis:     curl: (6) Could not resolve host: nvcr.io",
                          "srun: error: n1: task 0: Exited with exit code 1"]}
    (bin_dir / "srun").write_text('#!/bin/bash\n[[ $* == *image_check.py* ]] || exit 0\ncat "$PYXIS" >&2\nexit 1\n')
    for case, lines in pyxis.items():
        (tmp_path / case).write_text("\n".join(lines) + "\n")
        ran = run_bash(f"{header}\n{remove}\n{check}\necho continued", {**env, "PYXIS": str(tmp_path / case)}, bin_dir)
        if case == "missing":
            assert ran.returncode == 2 and ran.stdout.splitlines() == [
                f"error: --container-image {image} cannot start on node n2: No such file or directory: {image} (enroot): give "
                "the path of a squashfs file made by enroot import, readable on every node (docs/gpu.md#the-container)"], ran
        else:  # left to the training step and its retry budget, pyxis's lines shown
            assert ran.returncode == 0 and ran.stdout.splitlines()[-1] == "continued" and "curl: (6)" in ran.stdout, ran
    cpu_header = re.search(r"^CONTAINER_NAME=.*\nCONTAINER=\(.*\)$", cpu, flags=re.M)[0]
    removed = run_bash(f"{cpu_header}\n{remove}\nremove_containers", env, bin_dir)
    assert removed.returncode == 0 and not (tmp_path / "calls").exists(), removed  # no image: no srun at all


NO_KERNEL = "CUDA error: no kernel image is available for execution on the device"
OLD_DRIVER = ("The NVIDIA driver on your system is too old (found version 12020). Please update your GPU driver by downloading "
              "and installing a new version from the URL: http://www.nvidia.com/Download/index.aspx")
KEEP_OUT = "or keep the node out of the job (--sbatch-option=--exclude=gpu017)"
GPU_NODES = {  # (what the node's CUDA does, argv) → the check's exit code and its line (after "error: IMAGE on node gpu017 ")
    "healthy": ({}, ["--gpus", "8"], 0, "=== environment: --container-image {image}: {versions}; 8 × NVIDIA H100 80GB HBM3 per node ==="),
    "driver too old": ({"init": RuntimeError(OLD_DRIVER)}, ["--gpus", "8"], 2,
                       f"cannot run this job: CUDA did not initialise (RuntimeError: {OLD_DRIVER}): the image's CUDA 13.3 needs a "
                       f"driver that supports it (its release notes): update the node's driver, give an image built for it, {KEEP_OUT}"),
    "a GPU missing": ({"count": 7}, ["--gpus", "8"], 2, "cannot run this job: it shows 7 GPUs where the job asked for 8 per node "
                      f"(--gpus-per-node 8): check its GPUs (nvidia-smi), {KEEP_OUT}"),
    "no kernel for it": ({"kernel": {3: RuntimeError(NO_KERNEL)}}, ["--gpus", "8"], 2,
                         f"cannot run this job: a kernel on its GPU 3 failed (RuntimeError: {NO_KERNEL}): an image without this "
                         f"GPU's architecture, or a faulty GPU: check it (nvidia-smi), {KEEP_OUT}"),
    "a wrong sum": ({"kernel": {0: 0.0}}, ["--gpus", "8"], 2, "cannot run this job: a kernel on its GPU 0 failed (RuntimeError: "
                    f"1 + 1 was not 2): an image without this GPU's architecture, or a faulty GPU: check it (nvidia-smi), {KEEP_OUT}"),
    "the image's build": ({"init": RuntimeError("no GPU in docker build")}, ["--gpu"], 0, "=== environment: --container-image "
                          "{image}: {versions} ==="),  # --gpu alone: imports only, CUDA untouched
}


@pytest.mark.parametrize("case", GPU_NODES)
def test_the_image_check_on_a_gpu_node_initialises_cuda_and_counts_and_runs_the_jobs_gpus(case, monkeypatch, capsys):
    """gpu-review-2 N10 (issue 52 item 3), as a contract on this CPU machine: on a GPU node
    (``--gpus N``, rendered from --gpus-per-node) the check also initialises CUDA, finds the N GPUs the
    job asked per node and runs a kernel on each — torch.cuda stood in for here. A node that cannot
    run the training gets one ``error:`` line naming it, what was found and the fix, and exit code 2
    (the job script ends the job there: not retried). The imports are the CPU drills' (stood in too)."""
    from fbt_megatron.launch.slurm import image_check

    node, argv, code, line = GPU_NODES[case]
    imports = []
    monkeypatch.setattr(image_check, "problems", lambda gpu, context_parallel: imports.append(gpu) or [])
    monkeypatch.setattr(torch.version, "cuda", "13.3")
    monkeypatch.setenv("SLURMD_NODENAME", "gpu017")
    real_ones, touched = torch.ones, []

    def init():
        if "init" in node:
            raise node["init"]

    def ones(*size, device=None, **kwargs):  # the device's tensor, on the CPU: what a kernel there computes
        index = int(device.split(":")[1])
        touched.append(index)
        result = node.get("kernel", {}).get(index)
        if isinstance(result, Exception):
            raise result
        return real_ones(*size, **kwargs) * (1.0 if result is None else result)

    monkeypatch.setattr(torch.cuda, "init", init)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: node.get("count", 8))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch, "ones", ones)
    assert image_check.main(["--image", IMAGE, *argv]) == code
    out, err = capsys.readouterr()
    expected = line.format(image=IMAGE, versions=image_check.versions()) if code == 0 else \
        f"error: --container-image {IMAGE} on node gpu017 {line}"
    assert (out if code == 0 else err).splitlines() == [expected] and (err if code == 0 else out) == "", (out, err)
    assert imports == [True]  # --gpus N: what GPU nodes import (Transformer Engine, a CUDA torch) too
    assert touched == {"healthy": list(range(8)), "no kernel for it": [0, 1, 2, 3], "a wrong sum": [0]}.get(case, []), touched


def test_the_failed_task_is_the_rank_a_signal_killed_whichever_line_srun_printed_first():
    """Rank 1 killed (SIGKILL) takes rank 0 down with it (its connection closed: exit 1): srun prints the two
    lines in the order it hears of them (CI once had rank 0's first, and the attempt blamed node n1 with exit 1).
    The killed rank is the failed task either way; without a killed one, the first line; a SIGTERM'd rank
    only followed."""
    from fbt_megatron.launch import attempts

    killed, follower = "srun: error: n2: task 1: Exited with exit code 137", "srun: error: n1: task 0: Exited with exit code 1"
    for lines in ([killed, follower], [follower, killed], [follower, "srun: error: n3: task 2: Terminated", killed]):
        assert attempts.failed_task("\n".join(["=== x: job 1 restart 0 on n[1-2]", *lines])) == {
            "node": "n2", "task": "1", "exit_code": 137}, lines
    assert attempts.failed_task(f"{follower}\nsrun: error: n2: task 1: Exited with exit code 1") == {
        "node": "n1", "task": "0", "exit_code": 1}
    assert attempts.failed_task("srun: error: n2: task 1: Killed") == {"node": "n2", "task": "1", "exit_code": 137}
    assert attempts.failed_task("no task failed") is None


def test_a_jobs_training_logs_timestamps_unless_its_flags_or_recipe_say_otherwise(tmp_path):
    """A job's log lines open with their UTC time (``--log-timestamps`` ahead of the flags), to be lined
    up with the cluster's events; flags or a recipe that set it keep theirs."""
    from fbt_megatron.launch.slurm import submit

    def flags(recipe, *given):
        return submit.stage(recipe, list(given), tmp_path / "runs").flags

    assert flags("recipes/tiny_cpu.yaml", "--train-iters", "2") == ["--log-timestamps", "--train-iters", "2"]
    assert flags("recipes/tiny_cpu.yaml", "--log-timestamps", "false") == ["--log-timestamps", "false"]
    own = tmp_path / "own.yaml"
    recipe = yaml.safe_load(Path("recipes/tiny_cpu.yaml").read_text())
    own.write_text(yaml.safe_dump({**recipe, "logging": {**recipe["logging"], "log_timestamps": False}}))
    stage = submit.stage(str(own), [], tmp_path / "runs")
    assert stage.flags == [] and not stage.config.logging.log_timestamps
    assert "--log-timestamps" in submit.stage("recipes/tiny_cpu.yaml", [], tmp_path / "runs").train_args()


def test_the_retry_budget_counts_failures_and_stalled_stops_but_not_slurms_requeues(tmp_path, monkeypatch, capsys):
    """``launch/attempts.py`` on a run folder, outside Slurm (no scontrol is called on these
    paths; requeues and exclusions are drilled on the real Slurm below): an attempt that never ended
    is found lost at the next start and does not spend the budget; an attempt stopped by the time
    limit before checkpointing a step spends it, so a job whose limit is too short for its first
    checkpoint gives up instead of requeueing itself forever; a new submission has a budget of its
    own; exit code 2 is never retried."""
    from fbt_megatron.launch import attempts

    run = tmp_path / "run"
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "n[1-2]")
    for restart in range(2):  # two starts that never said how they ended: their node failed
        monkeypatch.setenv("SLURM_RESTART_COUNT", str(restart))
        attempts.start(run, 3, False)
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    attempts.start(run, 3, False)
    assert [a.get("ended") for a in attempts.read(run)] == ["lost", "lost", None]
    assert attempts.failures(attempts.read(run), 0) == 0  # Slurm's requeues: not failures
    log = tmp_path / "job.out"
    log.write_text("=== tiny: job 7 restart 2 on n[1-2] at ... ===\n")
    code = attempts.end(run, 0, "limit", train_iters=8, max_restarts=0, log=log)  # stopped at step 0 again
    last = attempts.read(run)[-1]
    assert (code, last["ended"], last["next"], last["end_step"]) == (1, "stopped", "gave up", 0), last
    assert ("=== stopped at step 0 of 8: not requeued, 1 of this job's starts failed or stopped without a checkpoint "
            "since step 0 was checkpointed (--max-restarts 0) ===") in capsys.readouterr().out
    monkeypatch.setenv("SLURM_JOB_ID", "8")  # submitted again: a budget of its own
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    attempts.start(run, 3, False)
    assert attempts.failures(attempts.read(run), 0) == 0
    assert attempts.end(run, 2, "", train_iters=8, max_restarts=3, log=log) == 2  # bad input: never retried
    assert (attempts.read(run)[-1]["ended"], attempts.read(run)[-1]["next"]) == ("bad input", "not retried")
    (run / attempts.TRACKER).write_text("8")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    attempts.start(run, 3, False)
    assert attempts.end(run, 0, "", train_iters=8, max_restarts=0, log=log) == 0
    assert (attempts.read(run)[-1]["ended"], attempts.read(run)[-1]["start_step"]) == ("finished", 8)

    # In-job: torchrun's restarts of the workers inside an attempt (the training's starts in timeline.jsonl after its first)
    # spend the same budget, each at the checkpoint it resumed from; start says how many torchrun may make
    monkeypatch.setenv("SLURM_JOB_ID", "9")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    (run / attempts.TRACKER).write_text("2")
    assert attempts.start(run, 3, True) == 3
    lines = [{"event": "start", "job_id": 8, "restart_count": 1, "step": 8, "time": 1.0}]  # another job's: not this attempt's
    lines += [{"event": event, "job_id": 9, "restart_count": 0, "step": step, "time": t}
              for event, step, t in (("start", 2, 60.0), ("save", 4, 90.0), ("start", 2, 120.0), ("start", 4, 180.0))]
    (run / attempts.TIMELINE).write_text("".join(json.dumps(line) + "\n" for line in lines))
    (run / attempts.TRACKER).write_text("4")
    log.write_text("=== tiny: job 9 restart 0 on n[1-2] at ... ===\nsrun: error: n2: task 1: Exited with exit code 137\n")
    assert attempts.end(run, 1, "", train_iters=8, max_restarts=1, log=log) == 137  # restarts at 2, 4; failed at 4
    last = attempts.read(run)[-1]
    assert last["in_job_restarts"] == [{"time": "1970-01-01T00:02:00Z", "step": 2}, {"time": "1970-01-01T00:03:00Z", "step": 4}], last
    assert (last["ended"], last["next"]) == ("failed", "gave up") and attempts.failures(attempts.read(run), 4) == 2
    assert ("=== the training failed (exit code 137) at step 4 of 8 after 2 in-job restarts: not requeued, 2 of this job's "
            "starts failed or stopped without a checkpoint since step 4 was checkpointed (--max-restarts 1) ===") in \
        capsys.readouterr().out
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # had it been requeued: torchrun's restarts left at step 4
    assert attempts.start(run, 3, True) == 1 and attempts.start(run, 3, False) == 0


def training_worker(job: int, rank: int = 0):
    """The training process of ``rank`` in a torchrun job (its forked helpers share its environment)."""
    import psutil

    mine = {}
    for p in psutil.process_iter():
        try:
            env = p.environ()
        except psutil.Error:
            continue
        if env.get("TORCHELASTIC_RUN_ID") == str(job) and env.get("RANK") == str(rank):
            mine[p.pid] = p
    [worker] = [p for p in mine.values() if p.ppid() not in mine]
    return worker


def torchrun_two(log: Path, flags: list) -> int:
    """``python -m fbt_megatron.torchrun`` with 2 processes (--standalone) of the training, here."""
    env = outside_group()
    with open(log, "w") as out:
        return subprocess.run([sys.executable, "-m", "fbt_megatron.torchrun", "--nproc-per-node=2", "--standalone", "-m",
                               "fbt_megatron.train", "--recipe", str(TINY), *map(str, flags)], cwd=ROOT, env=env,
                              stdout=out, stderr=subprocess.STDOUT, timeout=600).returncode


DRILL_STEPS = 16
KEYS = ["k", "loss", "pass_losses", "state_deltas", "lr", "grad_norm", "valid_loss_fused0", "valid_loss_fused2"]


@pytest.fixture(scope="module")
def drill_flags(small_corpus) -> list:
    """The training flags of the drills on Slurm (each adds its faults)."""
    return [*SMALL, "--train-iters", DRILL_STEPS, "--save-interval", 2, "--threads", 1, "--data-path",
            Path(small_corpus.train_prefix).parent, "--corpus", "null"]


@pytest.fixture(scope="module")
def uninterrupted(drill_flags, tmp_path_factory) -> list:
    """What every drill is held to: its flags as 2 processes on one node (torchrun), no fault, no stop
    (the faults drilled change no loss: a crash or hang fires once, a slow rank only loops)."""
    folder = tmp_path_factory.mktemp("uninterrupted")
    assert torchrun_two(folder / "log", [*drill_flags, "--save", folder / "run"]) == 0, (folder / "log").read_text()[-3000:]
    return read_metrics(folder / "run")


def same_losses(run: Path, expected: list) -> list:
    """The run's records, each step's losses, learning rate and gradient norm equal ``expected``'s bit for bit."""
    got = read_metrics(run)
    assert [r["step"] for r in got] == list(range(1, DRILL_STEPS + 1))
    assert [{k: r.get(k) for k in KEYS} for r in got] == [{k: r.get(k) for k in KEYS} for r in expected]  # == on floats
    return got


def since_start(text: str, job: int, restart: int) -> str:
    """The job's log from its ``restart``-th start on."""
    return text[text.index(f"job {job} restart {restart} on"):]


@pytest.mark.slow
def test_requeued_and_signalled_job_resumes_and_logs_the_uninterrupted_losses(slurm, drill_flags, uninterrupted, tmp_path):
    """Submitted through the submit tool (torchrun launch, 2 nodes × 1 CPU process): ``scontrol requeue``
    mid-run (SIGTERM from Slurm), then USR1 to the batch shell as ``--signal=B:USR1@S`` sends it S
    seconds before the time limit (sent with scancel: Slurm's own timer checks every 30 s, its
    minimum --time is a minute). Each time the training checkpoints at the next step boundary, the
    job comes back (Slurm requeues it; the script requeues itself after the signal) and resumes.
    The time-limit stop outlasts torchrun's own kill timeout (1 s here: TORCH_ELASTIC_SHUTDOWN_TIMEOUT,
    which this torch reads; 30 s by default, a full-size save takes longer): the worker is held
    stopped (SIGSTOP) for 3 s after it got SIGTERM, is alive then, and saves a complete checkpoint;
    the attempt ends with exit code 0. Drill e of issue 44: rank 1 is a straggler (``--inject-fault
    slow@1:1``: 1 s more in each of steps 1-10); the log, metrics.jsonl and jobs.jsonl name it with
    its node, and with ``--exclude-stragglers`` the restart after the time-limit stop runs without
    that node."""
    from torch.distributed.launcher.api import LaunchConfig

    os.environ["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] = "1"
    try:
        assert LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=1).shutdown_timeout == 1  # plain torchrun's kill: 1 s
    finally:
        del os.environ["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"]
    began = time.time()
    steps = DRILL_STEPS  # the signals reach the job within its first dozen steps (rank 1 is slow in steps 1-10)
    flags = [*drill_flags, "--inject-fault", "slow@1:1"]

    [(code, output)] = submit_many(tmp_path, [["submit", "--recipe", str(TINY), "--nodes", "2", "--gpus-per-node", "0",
                                               "--time", "00:10:00", "--runs-root", str(tmp_path / "runs"), "--exclude-stragglers",
                                               "--env", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT=1",
                                               "--log-dir", str(tmp_path / "logs"), "--", *map(str, flags)]])
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
    wait_until(lambda: log.read_text().count("SIGTERM received") == 2, f"job {job} got no SIGTERM: {log.read_text()}")
    worker = training_worker(job)
    worker.suspend()  # a save that takes 3 s, 3 times torchrun's kill timeout
    time.sleep(3)
    held = worker.status()
    worker.resume()
    assert held == "stopped", held  # not killed
    slurm.wait_for(job, {"COMPLETED"}, restarts=2)
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
    assert {resumes[1], resumes[2], steps} <= set(iterations), iterations
    assert (run / f"iter_{resumes[2]:07d}" / checkpointing.MANIFEST).is_file()  # the held save completed
    assert [(s["ended"], s["next"]) for s in records] == [("stopped by Slurm", "Slurm's"), ("stopped", "requeued"),
                                                         ("finished", "done")], records
    assert records[1]["exit_code"] == 0, records  # the launcher's clean stop (plain torchrun: 143 after killing it)
    slow = records[1]["rank_nodes"][1]  # the straggler's node
    assert {(s["rank"], s["node"]) for s in records[1]["stragglers"]} == {(1, slow)}, records[1]
    assert records[1]["excluded"] == [slow] and slow not in records[2]["rank_nodes"], records
    assert f"requeueing job {job}, excluding node {slow} (a straggler) ===" in text, text[-3000:]
    assert re.search(rf"^\S+Z step \d+: straggler rank 1 on node {slow} \(", text, flags=re.M), text[-3000:]  # timestamped (a job)
    named = [r["step"] for r in read_metrics(run) if any(s["rank"] == 1 for s in r.get("stragglers", []))]
    assert named and set(named) <= set(range(1, 11)), named  # the slow steps, and no others
    assert "frame #" not in since_start(text, job, 2), text[-3000:]  # no C++ frames in a success

    got = same_losses(run, uninterrupted)
    assert sum("valid_loss_fused2" in r for r in got) == steps // 4
    from fbt_megatron.launch import goodput

    [account] = goodput.job_accounts(run).values()  # the stops: Slurm's requeue and the time-limit signal's
    assert account.attempts == 3 and account.node_seconds["time-limit stops"] > 0 and account.node_seconds["stragglers"] > 0
    assert account.node_seconds["checkpoint load"] > 0 and account.requeue_gaps > 0, account
    print(f"\nslurm job {job} ({steps} steps of tiny_cpu, 2 nodes, torchrun launch): scontrol requeue at step {requeued_at} → "
          f"restart 1 resumed from step {resumes[1]}; USR1 (the time-limit signal) at step {signalled_at}, its save held "
          f"3 s against torchrun's 1 s kill timeout → restart 2 resumed from step {resumes[2]} without the straggler's node {slow}; finished; losses of all {steps} steps equal the uninterrupted run's bit for bit "
          f"(last {got[-1]['loss']!r}); {time.time() - began:.0f} s")


def recoveries(run: Path) -> list:
    """Each injected crash or hang of a run (``injected_faults.jsonl``): its step, the step the training
    resumed from (the newest checkpoint then), the steps lost (computed, then redone) and the seconds from
    the fault to the next step completed (``metrics.jsonl``'s times; the fault's to the second)."""
    import calendar

    faults = [json.loads(line) for line in (run / "injected_faults.jsonl").read_text().splitlines()]
    records, out = read_metrics(run), []
    for fault in faults:
        at = calendar.timegm(time.strptime(fault["time"], "%Y-%m-%dT%H:%M:%SZ"))
        step = int(re.search(r"@(\d+)", fault["fault"])[1])
        after = min((r for r in records if r["time"] >= at + 1), key=lambda r: r["time"])  # completed after the fault
        resumed = after["step"] - 1
        out.append({"fault": fault["fault"], "resumed": resumed, "lost": step - 1 - resumed, "seconds": after["time"] - at})
    return out


def crash_and_hang(slurm, flags: list, folder: Path, restart: str) -> tuple:
    """A 2-node job (torchrun launch, --max-restarts 2, ``--restart restart``) whose rank 1 is killed
    (kill -9) at step 3 and hangs at step 6, run to its end: (job id, run folder, log text, attempts)."""
    folder.mkdir()
    [(code, output)] = submit_many(folder, [[
        "submit", "--recipe", str(TINY), "--nodes", "2", "--gpus-per-node", "0", "--time", "00:10:00", "--runs-root",
        str(folder / "runs"), "--log-dir", str(folder / "logs"), "--max-restarts", "2", "--restart", restart, "--",
        *map(str, flags), "--inject-fault", "crash@3:1", "--inject-fault", "hang@6:1", "--hang-timeout-minutes", "0.3"]])
    assert code == 0, output
    [job] = job_ids(output)
    run = folder / "runs" / "tiny_cpu"
    slurm.wait_for(job, {"COMPLETED"}, restarts=2 if restart == "requeue" else 0, timeout=600)
    return job, run, (folder / "logs" / f"tiny_cpu-{job}.out").read_text(), starts(run)


@pytest.mark.slow
def test_a_crash_and_a_hang_restart_in_the_job_or_requeue_away_from_their_node_bit_for_bit(slurm, drill_flags, uninterrupted,
                                                                                          tmp_path):
    """Drills a, b and d of issue 44 and issue 53's in-job restart on three nodes: two jobs of 2 nodes ×
    1 process (torchrun launch) with ``--inject-fault crash@3:1 --inject-fault hang@6:1``, each held
    to an uninterrupted run of 2 processes on one node, all 16 steps' losses bit for bit.

    ``--restart requeue``: rank 1 dies as kill -9 kills it at step 3: the attempt's exit code is that
    rank's (137, not the survivors' 143), its node is excluded (the job requeued held, updated,
    released: Slurm takes ``ExcNodeList`` from a pending job only) and the restart runs on the third
    node. There rank 1 hangs at step 6: the watchdog on both nodes writes their stacks, names the
    stuck rank and its node, exit 124; that node is not excluded (no node left to spare) and the job
    resumes and finishes; jobs.jsonl has each attempt's nodes per rank.

    In-job (the default): torchrun restarts the workers inside the allocation both times, from the
    newest checkpoint: Slurm's restart count stays 0 and the one attempt finishes with its two in-job
    restarts (from steps 2 and 4). Both jobs' recovery (fault → next completed step), steps lost and
    goodput are printed side by side."""
    from fbt_megatron.launch import goodput

    began = time.time()
    job, run, text, attempts = crash_and_hang(slurm, drill_flags, tmp_path / "requeue", "requeue")
    assert [(a["restart_count"], a["start_step"], a["end_step"], a["exit_code"], a["ended"], a["next"]) for a in attempts] == [
        (0, 0, 2, 137, "failed", "requeued"), (1, 2, 4, 124, "hang", "requeued"), (2, 4, 16, 0, "finished", "done")], attempts
    crashed, hung = attempts[0]["rank_nodes"][1], attempts[1]["rank_nodes"][1]
    assert sorted(attempts[0]["rank_nodes"]) == ["n1", "n2"] and attempts[0]["failed_task"]["node"] == crashed, attempts
    assert attempts[0]["excluded"] == [crashed] and crashed not in attempts[1]["rank_nodes"] + attempts[2]["rank_nodes"]
    assert attempts[1]["stuck_nodes"] == [hung] and "excluded" not in attempts[1], attempts
    assert (f"=== the training failed (exit code 137) at step 2 of 16: requeueing job {job} (restart 1 of --max-restarts 2 "
            f"from this checkpoint), excluding node {crashed} (srun named) ===") in text, text[-3000:]
    assert (f"=== the training failed (exit code 124: a hang, stacks in {run}/hang) at step 4 of 16: requeueing job {job} "
            f"(restart 1 of --max-restarts 2 from this checkpoint); node {hung} (stuck) not excluded: the partition has no "
            "node to spare ===") in text, text[-3000:]
    [hang_line] = [line for line in text.splitlines() if re.match(r"\S+Z hang: ", line)]  # timestamped (a job)
    assert f"rank 1 on {hung} stuck outside a collective" in hang_line and "rank 0 on " in hang_line, hang_line
    stacks = {r: (run / "hang" / f"rank{r}.txt").read_text().splitlines()[0] for r in (0, 1)}
    assert [stacks[r].startswith(f"rank {r} (node {attempts[1]['rank_nodes'][r]}, pid ") for r in (0, 1)] == [True, True], stacks
    assert text.count("--inject-fault crash@3:1: rank 1 dies") == 1 and "=== finished: step 16 of 16" in text, text[-3000:]
    assert "frame #" not in since_start(text, job, 2), text[-3000:]  # no C++ frames in a success
    same_losses(run, uninterrupted)

    in_job, in_job_run, in_job_text, [attempt] = crash_and_hang(slurm, drill_flags, tmp_path / "in-job", "in-job")
    assert (attempt["start_step"], attempt["end_step"], attempt["exit_code"], attempt["ended"], attempt["next"]) == (
        0, 16, 0, "finished", "done"), attempt
    assert [r["step"] for r in attempt["in_job_restarts"]] == [2, 4], attempt
    assert f"=== finished: step 16 of 16 after 2 in-job restarts checkpointed in {in_job_run} ===" in in_job_text
    assert slurm.job(in_job)["Restarts"] == "0" and in_job_text.count("--inject-fault crash@3:1: rank 1 dies") == 1
    same_losses(in_job_run, uninterrupted)
    recovered = {name: recoveries(folder) for name, folder in (("requeue", run), ("in-job", in_job_run))}
    for name, faults in recovered.items():
        assert [(r["resumed"], r["lost"]) for r in faults] == [(2, 0), (4, 1)], (name, faults)
    [requeued], [restarted] = goodput.job_accounts(run).values(), goodput.job_accounts(in_job_run).values()
    # which job's goodput is higher depends on the machine's load (a verdict may not depend on timing): printed below
    assert 0 < requeued.goodput < 1 and 0 < restarted.goodput < 1 and restarted.node_seconds["in-job restarts"] > 0
    assert requeued.node_seconds["failed attempts"] > 0 and requeued.requeue_gaps > 0 and restarted.requeue_gaps == 0
    print(f"\nslurm jobs {job} (--restart requeue) and {in_job} (in-job), 2 nodes each, crash@3:1, hang@6:1: requeue attempts "
          f"{[(a['rank_nodes'], a['start_step'], a['end_step'], a['exit_code'], a['ended'], a.get('excluded')) for a in attempts]}; "
          f"in-job: Restarts 0, restarts {attempt['in_job_restarts']}; {hang_line}; recovery (fault, steps lost, s to the next "
          f"step): " + "; ".join(f"{name} {[(r['fault'], r['lost'], round(r['seconds'], 1)) for r in faults]}"
                                  for name, faults in recovered.items())
          + f"; losses of all 16 steps equal the uninterrupted run's bit for bit, both; {time.time() - began:.0f} s\n"
          + goodput.table({f"requeue (job {job})": requeued, f"in-job (job {in_job})": restarted}))


@pytest.mark.slow
def test_in_job_restarts_spent_fall_back_to_a_requeue_within_the_same_budget_bit_for_bit(slurm, drill_flags, uninterrupted,
                                                                                          tmp_path):
    """One budget for both: a 2-node job with ``--max-restarts 1`` whose rank 1 is killed at step 3 and
    again at step 5. The first crash is restarted inside the job (torchrun may restart once: the whole
    budget at step 0); from the checkpoint of step 4 the second finds torchrun's restarts spent, so the
    attempt fails and is requeued (one failure since that checkpoint: within the budget), without the
    failed node, and the next attempt, whose torchrun may restart no more (the budget left at step 4),
    finishes. All 16 steps' losses equal the uninterrupted run's bit for bit."""
    [(code, output)] = submit_many(tmp_path, [[
        "submit", "--recipe", str(TINY), "--nodes", "2", "--gpus-per-node", "0", "--time", "00:10:00", "--runs-root",
        str(tmp_path / "runs"), "--log-dir", str(tmp_path / "logs"), "--max-restarts", "1", "--", *map(str, drill_flags),
        "--inject-fault", "crash@3:1", "--inject-fault", "crash@5:1"]])
    assert code == 0, output
    [job] = job_ids(output)
    run = tmp_path / "runs" / "tiny_cpu"
    slurm.wait_for(job, {"COMPLETED"}, restarts=1, timeout=600)
    text = (tmp_path / "logs" / f"tiny_cpu-{job}.out").read_text()
    attempts = starts(run)
    assert [(a["start_step"], a["end_step"], a["exit_code"], a["ended"], a["next"], [r["step"] for r in a.get("in_job_restarts", [])])
            for a in attempts] == [(0, 4, 137, "failed", "requeued", [2]), (4, 16, 0, "finished", "done", [])], attempts
    assert (f"=== the training failed (exit code 137) at step 4 of 16 after 1 in-job restart: requeueing job {job} (restart 1 "
            "of --max-restarts 1 from this checkpoint), excluding node") in text, text[-3000:]
    assert attempts[0]["excluded"] == [attempts[0]["failed_task"]["node"]], attempts
    same_losses(run, uninterrupted)
    print(f"\nslurm job {job} (2 nodes, --max-restarts 1, crash@3:1, crash@5:1): attempts "
          f"{[(a['nodes'], a['start_step'], a['end_step'], a['ended'], a.get('in_job_restarts'), a.get('excluded')) for a in attempts]}; "
          "losses of all 16 steps equal the uninterrupted run's bit for bit")


@pytest.mark.slow
def test_bad_input_found_after_submitting_is_retried_neither_in_the_job_nor_by_a_requeue(slurm, drill_flags, tmp_path):
    """Two 1-node jobs whose recipe went bad after submitting (held, edited, released), one per launch:
    ``tasks`` (no in-job restarts) and ``torchrun`` (in-job restarts: the worker that finds bad input
    stops its torchrun instead of being restarted). Each fails with exit code 2, is not retried, and
    says so in one line after the error."""
    recipe = tmp_path / "edited.yaml"
    recipe.write_text(TINY.read_text())
    common = ["--recipe", str(recipe), "--nodes", "1", "--gpus-per-node", "0", "--time", "00:10:00", "--runs-root",
              str(tmp_path / "runs"), "--log-dir", str(tmp_path / "logs"), "--max-restarts", "2", "--sbatch-option=--hold"]
    results = submit_many(tmp_path, [["submit", *common, "--launch", launch, "--name", f"edited-{launch}", "--",
                                      *map(str, drill_flags)] for launch in ("tasks", "torchrun")])
    assert [code for code, _ in results] == [0, 0], results
    jobs = [job for _, output in results for job in job_ids(output)]
    recipe.write_text(TINY.read_text() + "\nbogus_section: {}\n")  # edited after submitting: the jobs read it
    for bad, launch in zip(jobs, ("tasks", "torchrun")):
        slurm._run("scontrol", "release", str(bad))
        with pytest.raises(AssertionError, match="ended FAILED"):
            slurm.wait_for(bad, {"COMPLETED"})
        bad_log = (tmp_path / "logs" / f"edited-{launch}-{bad}.out").read_text()
        assert bad_log.count("error: unknown recipe section 'bogus_section'") == 1 and slurm.job(bad)["Restarts"] == "0", bad_log
        verdict = [line for line in bad_log.splitlines() if line.startswith("=== the training failed")]
        assert verdict == ["=== the training failed with exit code 2 at step 0 of 16: bad input (the error: line above), which "
                           "a restart cannot fix: not retried ==="], bad_log[-3000:]
        assert [(a["ended"], a["next"]) for a in starts(tmp_path / "runs" / f"edited-{launch}")] == [("bad input", "not retried")]
        assert "restarting" not in bad_log.lower() and "attempts left" not in bad_log, bad_log[-3000:]


@pytest.mark.slow
def test_a_node_lost_mid_run_is_requeued_by_slurm_onto_the_nodes_left_and_resumes_bit_for_bit(slurm, drill_flags, uninterrupted,
                                                                                              tmp_path):
    """Drill c of issue 44: a 2-node job (torchrun launch) loses its batch host — its slurmd and
    every process on it SIGKILLed, as a power loss would — after its first checkpoints. Nobody is
    left to record the attempt: Slurm marks the node down (``SlurmdTimeout``, 10 s here) and
    requeues the job (``--requeue``) onto the two nodes left, which resume from the last checkpoint.
    The next start records the attempt as lost, Slurm's requeue, not counted against the budget
    (``--max-restarts 0``). All 16 steps' losses equal an uninterrupted run of 2 processes on one
    node bit for bit. (``slow@3:0`` — rank 0 spends 1 s of CPU in each of steps 3-12, as a straggler — keeps
    the job running long enough to be killed mid-run whatever the machine's load; the losses are
    not touched by it.)"""
    began = time.time()
    flags = [*drill_flags, "--inject-fault", "slow@3:0"]
    [(code, output)] = submit_many(tmp_path, [["submit", "--recipe", str(TINY), "--nodes", "2", "--gpus-per-node", "0",
                                               "--time", "00:10:00", "--runs-root", str(tmp_path / "runs"), "--log-dir",
                                               str(tmp_path / "logs"), "--max-restarts", "0", "--", *map(str, flags)]])
    assert code == 0, output
    [job] = job_ids(output)
    run, log = tmp_path / "runs" / "tiny_cpu", tmp_path / "logs" / f"tiny_cpu-{job}.out"
    host = slurm.wait_for(job, {"RUNNING"})["BatchHost"]
    wait_until(lambda: (run / "iter_0000004").is_dir() and last_step(run) >= 5, f"job {job} made no checkpoint: "
               + (log.read_text() if log.exists() else ""))
    killed_at = last_step(run)
    slurm.kill_node(host)
    try:
        slurm.wait_for(job, {"COMPLETED"}, restarts=1, timeout=400)
    finally:
        slurm.start_node(host)  # back for the other tests (ReturnToService=2)
    slurm.wait_for_nodes("idle", [host])
    text = log.read_text()
    attempts = starts(run)
    assert [(a["restart_count"], a["ended"], a["next"]) for a in attempts] == [(0, "lost", "Slurm's"), (1, "finished", "done")]
    assert host in slurm._run("scontrol", "show", "hostnames", attempts[0]["nodes"]).split(), attempts
    assert host not in attempts[1]["rank_nodes"], attempts
    assert 4 <= attempts[1]["start_step"] <= killed_at, (attempts, killed_at)
    assert f"=== job {job} restart 0 was lost (it never ended: its node failed?) ===" in text, text[-3000:]
    same_losses(run, uninterrupted)
    print(f"\nslurm job {job} (2 nodes): batch host {host} killed at step {killed_at} → Slurm requeued the job onto "
          f"{attempts[1]['nodes']}, resumed from step {attempts[1]['start_step']}, finished; jobs.jsonl "
          f"{[(a['nodes'], a['ended'], a['next']) for a in attempts]}; losses of all 16 steps equal the uninterrupted run's "
          f"bit for bit; {time.time() - began:.0f} s")


@pytest.mark.slow
def test_a_node_lost_is_replaced_by_a_spare_and_one_lost_beyond_the_spares_requeues_bit_for_bit(slurm, drill_flags,
                                                                                                uninterrupted, tmp_path):
    """Issue 53's hot spare: a job of 2 training nodes and ``--spare-nodes 1`` (all three nodes; the
    spare's torchrun waits in the rendezvous) loses a training node that is not its batch host — its
    slurmd and every process on it SIGKILLed — after its first checkpoints. The job and its step outlive
    it (``--no-kill``); the other node's workers fail, its torchrun restarts them and the spare joins the
    new round once the lost node's heartbeat has expired: the training goes on from the newest checkpoint
    on the same layout (2 ranks), inside the job. Then the other training node that is not the batch
    host is lost too, with no spare left: once Slurm drops it from the job, the job script stops the
    training and requeues the job (the attempt ``lost``, not counted); with the nodes back it resumes
    and finishes, requeued once (Slurm's restart count 1). All 16 steps' losses equal the uninterrupted
    run's bit for bit. (``slow@3:0`` keeps the job running long enough.)"""
    from fbt_megatron.launch import goodput

    began = time.time()
    flags = [*drill_flags, "--inject-fault", "slow@3:0"]
    [(code, output)] = submit_many(tmp_path, [[
        "submit", "--recipe", str(TINY), "--nodes", "2", "--spare-nodes", "1", "--gpus-per-node", "0", "--time", "00:10:00",
        "--runs-root", str(tmp_path / "runs"), "--log-dir", str(tmp_path / "logs"), "--max-restarts", "2", "--",
        *map(str, flags)]])
    assert code == 0, output
    [job] = job_ids(output)
    run, log = tmp_path / "runs" / "tiny_cpu", tmp_path / "logs" / f"tiny_cpu-{job}.out"
    host = slurm.wait_for(job, {"RUNNING"})["BatchHost"]
    wait_until(lambda: (run / "iter_0000004").is_dir() and last_step(run) >= 5, f"job {job} made no checkpoint: "
               + (log.read_text() if log.exists() else ""))
    first = [r["node"] for r in json.loads((run / "ranks.json").read_text())["ranks"]]
    victim = next(node for node in first if node != host)
    killed_at, killed = last_step(run), time.time()
    slurm.kill_node(victim)
    restarted = lambda: [e for e in read_timeline(run) if e["event"] == "start"][1:]  # noqa: E731
    wait_until(lambda: restarted() and last_step(run) >= restarted()[0]["step"] + 2, f"job {job} did not go on: "
               + log.read_text(), timeout=200)
    spared = [r["node"] for r in json.loads((run / "ranks.json").read_text())["ranks"]]
    second = next(node for node in spared if node != host)
    second_at = last_step(run)
    slurm.kill_node(second)
    try:
        slurm.wait_for(job, {"PENDING"}, restarts=1, timeout=200)  # requeued; its nodes down
    finally:
        for node in (victim, second):
            slurm.start_node(node)  # back for the job and the other tests (ReturnToService=2)
    slurm.wait_for(job, {"COMPLETED"}, restarts=1, timeout=400)
    slurm.wait_for_nodes("idle", [victim, second])
    text = log.read_text()
    attempts = starts(run)
    assert [(a["ended"], a["next"]) for a in attempts] == [("lost", "requeued"), ("finished", "done")], attempts
    [restart] = attempts[0]["in_job_restarts"]
    assert 4 <= restart["step"] <= killed_at and attempts[1]["start_step"] <= second_at, (attempts, killed_at, second_at)
    spare = ({"n1", "n2", "n3"} - set(first)).pop()
    assert victim not in spared and spare in spared and len(spared) == 2, (first, spared)
    assert "=== 2 of the job's 3 nodes lost, 1 spare(s): the training stops ===" in text, text[-3000:]
    assert f"=== nodes lost beyond the spares at step {attempts[0]['end_step']} of 16 after 1 in-job restart: requeueing " \
           f"job {job} ===" in text, text[-3000:]
    same_losses(run, uninterrupted)
    after = min(e["time"] for e in read_timeline(run) if e["event"] == "step" and e["time"] > killed)
    [account] = goodput.job_accounts(run).values()  # the spare waited while the others trained
    assert account.node_seconds["in-job restarts"] > 0 and account.node_seconds["spares waiting"] > 0
    assert account.node_seconds["failed attempts"] > 0 and account.attempts == 2
    print(f"\nslurm job {job} (2 nodes + 1 spare): node {victim} killed at step {killed_at}; ranks {first} → {spared}, "
          f"resumed from step {restart['step']} inside the job, {after - killed:.1f} s from the loss to the next step, "
          f"{killed_at - restart['step']} step(s) redone; node {second} killed at step {second_at}, no spare left: requeued, "
          f"resumed from step {attempts[1]['start_step']}; losses of all 16 steps equal the uninterrupted run's bit for bit; "
          f"{time.time() - began:.0f} s\n" + goodput.table({f"2 nodes + 1 spare (job {job})": account}))


@pytest.mark.slow
def test_a_python_that_cannot_run_the_job_ends_it_at_its_first_step_and_it_is_not_retried(slurm, tmp_path):
    """The environment check (``fbt_megatron/launch/slurm/image_check.py``), a training job's first step, in
    the job's own Python (no pyxis here: with ``--container-image`` the same step runs in the image):
    context parallelism needs Transformer Engine, which this machine's Python lacks. The job ends at
    that step, exit code 2, with the check's one ``error:`` line and nothing else in its log (srun's
    line for the failed task is left out), before its banner and any attempt (no jobs.jsonl), and it
    is not requeued (``--max-restarts 3`` notwithstanding). A Python that passes logs one environment
    line per start and trains (the crash test's job)."""
    began = time.time()
    [(code, output)] = submit_many(tmp_path, [["submit", "--recipe", str(TINY), "--nodes", "1", "--gpus-per-node", "0",
                                               "--procs-per-node", "2", "--time", "00:10:00", "--runs-root", str(tmp_path / "runs"),
                                               "--log-dir", str(tmp_path / "logs"), "--max-restarts", "3", "--",
                                               "--context-parallel-size", "2"]])
    assert code == 0, output  # submitted: this machine's Python is the nodes' only when the job runs
    [job] = job_ids(output)
    with pytest.raises(AssertionError, match="ended FAILED"):
        slurm.wait_for(job, {"COMPLETED"})
    info = slurm.job(job)
    log = (tmp_path / "logs" / f"tiny_cpu-{job}.out").read_text()
    assert log.splitlines() == [
        f"error: the job's Python {sys.executable} cannot run this job: import transformer_engine.pytorch failed "
        "(ModuleNotFoundError: No module named 'transformer_engine'), needed by context parallelism: give --container-image "
        "with the project's image (packaging/container/Dockerfile, docs/gpu.md#the-container), or submit from a Python that "
        "has them"], log
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("FAILED", "2:0", "0"), info
    assert not (tmp_path / "runs" / "tiny_cpu" / "jobs.jsonl").exists()  # no attempt started
    time.sleep(3)
    assert (slurm.job(job)["JobState"], slurm.job(job)["Restarts"]) == ("FAILED", "0")  # and none comes
    print(f"\nslurm job {job} (CPU, context parallelism, this Python without Transformer Engine): ended by its first step, "
          f"exit code 2, not requeued; its log: {log.strip()}; {time.time() - began:.0f} s")


STAGES = ["tiny_cpu", "longctx_tiny_cpu", "sft_tiny_cpu"]  # pretrain (128 tokens) → long context (512) → SFT


@pytest.mark.slow
def test_chained_stages_run_through_slurm_then_export_and_evaluation(slurm, tmp_path):
    """``submit --chain``: three tiny stages on 2 nodes (drill g of issue 44; the one-task-per-GPU
    launch: one CPU task per node, no torchrun), each job after the previous one (afterok) and
    starting from its final weights, then the export + evaluation job (one node)."""
    began = time.time()
    recipes = [str(ROOT / "recipes" / f"{name}.yaml") for name in STAGES]
    runs, logs = tmp_path / "runs", tmp_path / "logs"
    flags = ["--train-iters", "4", "--micro-batch-size", "1", "--global-batch-size", "2", "--log-interval", "1",
             "--eval-interval", "4", "--eval-iters", "1", "--threads", "1"]
    [(code, output)] = submit_many(tmp_path, [["submit", "--chain", *recipes, "--nodes", "2", "--gpus-per-node", "0",
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
        assert "=== finished: step 4 of 4" in text and "world 2 (tp 1, pp 1, cp 1, dp 2)" in text, text[-3000:]
        assert len(set(starts(runs / name)[0]["rank_nodes"])) == 2, starts(runs / name)  # one rank on each of 2 nodes
        losses[name] = [round(r["loss"], 4) for r in read_metrics(runs / name)]
        assert len(losses[name]) == 4
    for name, previous in zip(STAGES[1:], STAGES):
        text = (logs / f"{name}-{jobs[STAGES.index(name)]}.out").read_text()
        assert str(runs / previous) in text, text[-3000:]  # the stage says whose weights it starts from
    eval_log = (logs / f"{STAGES[-1]}-eval-{jobs[-1]}.out").read_text()
    assert list((runs / "exports").glob(f"{STAGES[-1]}-iter4/config.json")), eval_log[-3000:]
    table = (runs / "eval" / f"{STAGES[-1]}.md").read_text()
    assert "standard" in table, table
    shown = subprocess.run([sys.executable, "-m", "fbt_megatron.slurm", "goodput", *(str(runs / name) for name in STAGES)],
                           cwd=ROOT, capture_output=True, text=True)  # the chain's account: its stages' summed
    header, _, *rows = shown.stdout.splitlines()
    assert shown.returncode == 0 and header == "| | " + " | ".join(f"{n} job {j}" for n, j in zip(STAGES, jobs)) + " | chain |"
    allocated = [float(x) for x in next(r for r in rows if r.startswith("| **allocated")).strip("| ").split(" | ")[1:]]
    assert len(allocated) == 4 and abs(sum(allocated[:3]) - allocated[3]) < 0.002 and min(allocated) > 0, shown.stdout
    print(f"\nslurm chain, jobs {jobs} (afterok): " + "; ".join(f"{n} losses {l}" for n, l in losses.items())
          + f"; export + evaluation job {jobs[-1]}:\n{table}\n{shown.stdout}{time.time() - began:.0f} s")


@pytest.mark.slow
def test_a_corpus_prepared_as_a_job_array_merges_into_what_one_process_writes(slurm, small_corpus, tmp_path):
    """``python -m fbt_megatron.slurm prepare`` for real: a job array of 2 shards of 3 JSONL files
    (each task a whole node: drill f of issue 44, the shards on two nodes) and the merge job after it
    (afterok); the merged .bin/.idx are byte for byte what one ``preprocess_data`` process writes from
    all the inputs."""
    import sysconfig

    from fbt_megatron.data.preprocess import preprocess

    began = time.time()
    stdlib = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:30]
    inputs, logs, out = tmp_path / "web", tmp_path / "logs", tmp_path / "out"
    inputs.mkdir()
    out.mkdir()
    for i in range(3):
        (inputs / f"part-{i}.jsonl").write_text("".join(json.dumps({"text": p.read_text()}) + "\n" for p in stdlib[i::3]))
    tokenizer = small_corpus.tokenizer_path
    [(code, output)] = submit_many(tmp_path, [["prepare", "--input", str(inputs / "part-*.jsonl"), "--tokenizer", tokenizer,
                                               "--output-prefix", str(out / "web"), "--shards", "2", "--time", "00:10:00",
                                               "--log-dir", str(logs)]])
    assert code == 0, output
    array, merge = job_ids(output)
    assert slurm.job(merge)["Dependency"] in (f"afterok:{array}_*(unfulfilled)", "(null)")  # (null) once it ran
    slurm.wait_for(merge, {"COMPLETED"}, timeout=300)
    shards = [(logs / f"prepare-web-{array}_{i}.out").read_text() for i in range(2)]
    for i, text in enumerate(shards):
        assert f"{out}/web_shard-{i:05d}-of-00002.bin/.idx: " in text, text[-3000:]
    nodes = [re.search(r" of 2 on (n\d) at ", text)[1] for text in shards]
    assert len(set(nodes)) == 2, nodes
    merged = (logs / f"prepare-web-merge-{merge}.out").read_text()
    assert f"{out}/web.bin/.idx: 2 prefixes merged, 30 documents" in merged, merged[-3000:]

    one = preprocess([str(inputs / "part-*.jsonl")], tokenizer, str(tmp_path / "one"), workers=1, show_progress=False)
    for ext in (".bin", ".idx"):
        assert (out / f"web{ext}").read_bytes() == (tmp_path / f"one{ext}").read_bytes(), ext
    print(f"\nslurm prepare: array job {array} (2 shards, on nodes {nodes}) then merge job {merge} (afterok): {out}/web.bin/.idx "
          f"byte-identical to one process's ({one['documents']} documents, {one['tokens']:,} tokens); "
          f"{time.time() - began:.0f} s")


def test_clusters_side_by_side_keep_to_their_own_names_and_network(slurm):
    """Two more clusters start beside the suite's (two suites on one host, a sandbox beside CI): each
    has its own subnet, slurmctld port and network names, runs its own two-node job, and stopping one
    leaves the others' nodes up."""
    others = [SlurmCluster(nodes=2), SlurmCluster(nodes=2)]
    try:
        for cluster in others:
            cluster.start()
        every = [slurm, *others]
        assert len({c.network for c in every}) == len({c.port for c in every}) == len({c.bridge for c in every}) == 3
        for cluster in others:
            run = subprocess.run(["srun", "--nodes=2", "--ntasks-per-node=1", "hostname"], env=cluster.env, capture_output=True,
                                 text=True, timeout=120)
            assert run.returncode == 0 and sorted(run.stdout.split()) == ["n1", "n2"], run.stderr
        others[0].stop()
        others[1].wait_for_nodes("idle", others[1].nodes, timeout=10)
        assert set(slurm._run("sinfo", "-h", "-N", "-o", "%N").split()) == set(slurm.nodes)  # the suite's controller answers
        assert all(Path("/run/netns", slurm.namespace(n)).exists() for n in slurm.nodes)
    finally:
        for cluster in others:
            cluster.stop()
