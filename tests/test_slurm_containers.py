"""Training jobs in the project's image as clusters run them (issue 52): ``srun --container-image``
through pyxis and enroot on the multi-node Slurm of this machine (tests/slurm_cluster.py with
``pyxis=True``; ../shared/notes/pyxis-enroot.md), the image the squashfs file that ``make image-cpu``
builds and enroot imports (the CPU stand-in for NGC's PyTorch image plus the wheelhouse:
tests/test_container_image.py). Each drill is held bit for bit to the same training run on the host
with the image's stack (Python 3.12, torch 2.13.0, megatron-core 0.19.2: CI's .venv-mcore-latest), the
run folder and the data mounted (``--container-mounts``), and the image file unchanged afterwards:

- a 2-node job (torchrun launch) that crashes (its node excluded from the restart), then hangs (the
  stuck rank named), then gets the time-limit signal (saves, exit 0, requeued) and finishes: each
  node imports the image once per attempt (pyxis's log), the training step reuses the check's container;
- a 2-node job whose batch host is lost: Slurm requeues it onto the nodes left.

pyxis and enroot are built from their sources (NVIDIA/pyxis, NVIDIA/enroot), which nothing here may
carry, and the image takes minutes to build: CI has neither, so these tests skip there, and fail
where ``FBT_REQUIRE_PYXIS`` is set.
"""

import hashlib
import os
import re
import subprocess
import time
from pathlib import Path

import pytest
from slurm_cluster import SlurmCluster, find_pyxis, missing_binaries
from test_slurm import DRILL_STEPS, TINY, drill_flags, job_ids, last_step, same_losses, starts, submit_many, wait_until  # noqa: F401 (drill_flags: a fixture)

from fbt_megatron.trainer.callbacks.metrics_writer import read_metrics
from fbt_megatron.common.processes import outside_group

ROOT = Path(__file__).parent.parent
SQSH = Path(os.environ.get("FBT_IMAGE_SQSH", ROOT / ".image-build" / "fbt-megatron+26.06-cpu.sqsh"))
HOST_PYTHON = ROOT / ".venv-mcore-latest" / "bin" / "python"  # the image's stack on the host (make .venv-mcore-latest/.installed)


def digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


@pytest.fixture(scope="module")
def pyxis_slurm(tmp_path_factory):
    missing = [*missing_binaries(), *([] if find_pyxis() else ["pyxis (spank_pyxis.so) and enroot"]),
               *([] if SQSH.is_file() else [f"the image {SQSH} (make image-cpu)"]),
               *([] if HOST_PYTHON.is_file() else [f"{HOST_PYTHON} (make .venv-mcore-latest/.installed)"])]
    if missing or os.geteuid() != 0:
        problem = f"missing: {', '.join(missing)}" if missing else "not root"
        if os.environ.get("FBT_REQUIRE_PYXIS"):
            pytest.fail(f"{problem} (FBT_REQUIRE_PYXIS is set)")
        pytest.skip(f"{problem}: containers on Slurm need pyxis + enroot (../shared/notes/pyxis-enroot.md) and the image")
    before = digest(SQSH)
    cluster = SlurmCluster(pyxis=True)
    try:
        cluster.start()
    except BaseException:
        cluster.stop(keep_logs=tmp_path_factory.mktemp("slurm-logs"))
        raise
    saved = {k: os.environ.get(k) for k in ("SLURM_CONF", "XDG_DATA_HOME", "XDG_RUNTIME_DIR")}
    os.environ.update({k: cluster.env[k] for k in saved})  # the jobs' environment (sbatch exports the submitter's)
    yield cluster
    cluster.stop(keep_logs=tmp_path_factory.mktemp("slurm-logs"))
    for k, v in saved.items():
        os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    assert digest(SQSH) == before, f"{SQSH} changed: something was written into the image"


@pytest.fixture(scope="module")
def host_run(drill_flags, tmp_path_factory) -> list:
    """The drills' flags as 2 processes on one node (torchrun), on the host, with the image's stack."""
    folder = tmp_path_factory.mktemp("host-run")
    env = outside_group()
    with open(folder / "log", "w") as out:
        code = subprocess.run([HOST_PYTHON, "-m", "fbt_megatron.torchrun", "--nproc-per-node=2", "--standalone", "-m",
                               "fbt_megatron.train", "--recipe", TINY, *map(str, drill_flags), "--save", folder / "run"],
                              cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=900).returncode
    assert code == 0, (folder / "log").read_text()[-3000:]
    return read_metrics(folder / "run")


def imports(cluster: SlurmCluster, job: int) -> dict:
    """{node: [("created" or "reused", setup seconds) for each container step of ``job``, in order]}: what
    pyxis did on each node, from the slurmd logs ("creating container filesystem", then "completed
    container setup in N ms"; "reusing existing container filesystem"). A requeued job numbers its
    steps afresh, so steps are taken in the order they came."""
    found = {}
    for node in cluster.nodes:
        log = (cluster.base / f"slurmd-{node}.log").read_text(errors="replace")
        steps = []
        for what in re.findall(rf"\[{job}\.\d+\] pyxis: (creating container filesystem|reusing existing container filesystem|"
                               r"completed container setup in \d+ ms)", log):
            if what.startswith("completed"):
                steps[-1][1] = int(re.search(r"\d+", what)[0]) / 1000
            else:
                steps.append(["created" if what.startswith("creating") else "reused", 0.0])
        found[node] = [tuple(step) for step in steps]
    return found


def containers_left(cluster: SlurmCluster) -> list:
    """The enroot containers on the nodes' own disks (pyxis_*: named or not)."""
    return sorted(str(p.relative_to(cluster.base)) for p in (cluster.base / "nodes").glob("*/enroot-data/enroot/pyxis_*"))


def per_attempt(found: dict, attempts: list, cluster: SlurmCluster) -> dict:
    """{node: [what each attempt on it did: (the check's step, the training's step)]}: every attempt's nodes
    import the image once, in its first step (the check), and its training reuses that container."""
    on = {node: [a for a in attempts if node in cluster._run("scontrol", "show", "hostnames", a["nodes"]).split()]
          for node in cluster.nodes}
    return {node: [tuple(kind for kind, _ in found[node][2 * i:2 * i + 2]) for i in range(len(on[node]))]
            for node in cluster.nodes}


@pytest.mark.slow
def test_a_job_in_the_image_crashes_hangs_and_stops_at_its_time_limit_and_trains_as_the_host_does(
        pyxis_slurm, drill_flags, host_run, tmp_path, tmp_path_factory):
    """One 2-node job (torchrun launch, --max-restarts 3) in the image on three nodes: rank 1 dies as
    kill -9 kills it at step 3 (exit 137, its node excluded: the restart runs on the spare), then hangs at
    step 6 (the watchdog names it and its node, exit 124; no node left to spare), then the batch shell
    gets the time-limit signal (USR1): the training in the container saves at its next step and
    exits 0, the job requeues itself and finishes. Every attempt imports the image once on each of its
    nodes (the check's step; the training's step reuses that named container), and no container is
    left on any node when the job ends. All 16 steps' losses equal the host's run bit for bit."""
    began = time.time()
    mounts = str(tmp_path_factory.getbasetemp())  # the data (small_corpus), the run folder and the logs
    [(code, output)] = submit_many(tmp_path, [[
        "submit", "--recipe", str(TINY), "--nodes", "2", "--gpus-per-node", "0", "--time", "00:30:00",
        "--container-image", str(SQSH), "--container-mounts", f"{mounts}:{mounts}", "--runs-root", str(tmp_path / "runs"),
        "--log-dir", str(tmp_path / "logs"), "--max-restarts", "3", "--restart", "requeue", "--",
        *map(str, drill_flags), "--inject-fault", "crash@3:1", "--inject-fault", "hang@6:1", "--hang-timeout-minutes", "0.5"]])
    assert code == 0, output
    [job] = job_ids(output)
    run, log = tmp_path / "runs" / "tiny_cpu", tmp_path / "logs" / f"tiny_cpu-{job}.out"
    pyxis_slurm.wait_for(job, {"RUNNING"}, restarts=2, timeout=900)
    wait_until(lambda: len(starts(run)) == 3 and last_step(run) >= starts(run)[2]["start_step"] + 2,
               f"job {job} did not resume twice: {log.read_text() if log.exists() else ''}", timeout=900)
    signalled_at = last_step(run)
    pyxis_slurm.signal_batch(job, "USR1")  # the time-limit signal (--signal=B:USR1@S)
    pyxis_slurm.wait_for(job, {"COMPLETED"}, restarts=3, timeout=900)
    text = log.read_text()
    attempts = starts(run)
    assert [(a["restart_count"], a["start_step"], a["exit_code"], a["ended"], a["next"]) for a in attempts] == [
        (0, 0, 137, "failed", "requeued"), (1, 2, 124, "hang", "requeued"), (2, 4, 0, "stopped", "requeued"),
        (3, attempts[3]["start_step"], 0, "finished", "done")], attempts
    crashed, hung = attempts[0]["rank_nodes"][1], attempts[1]["rank_nodes"][1]
    assert attempts[0]["excluded"] == [crashed] and all(crashed not in a["rank_nodes"] for a in attempts[1:]), attempts
    assert attempts[1]["stuck_nodes"] == [hung], attempts
    assert signalled_at <= attempts[3]["start_step"] == attempts[2]["end_step"] < DRILL_STEPS, (attempts, signalled_at)
    [hang_line] = [line for line in text.splitlines() if re.match(r"\S+Z hang: ", line)]  # timestamped (a job)
    assert f"rank 1 on {hung} stuck outside a collective" in hang_line, hang_line
    for line in [f"=== the training failed (exit code 137) at step 2 of 16: requeueing job {job}", "USR1: time limit in 180 s",
                 f"stopped at step {attempts[3]['start_step']} of 16: requeueing job {job}", "=== finished: step 16 of 16"]:
        assert line in text, line + "\n" + text[-3000:]
    assert text.count(f"=== environment: --container-image {SQSH}: python 3.12.") == 4, text[-3000:]  # each attempt's check
    found = imports(pyxis_slurm, job)
    done = per_attempt(found, attempts, pyxis_slurm)
    assert all(kinds == [("created", "reused")] * len(kinds) for kinds in done.values()), found
    assert sum(map(len, found.values())) == 2 * 2 * len(attempts), found  # once per node per attempt, no more
    assert containers_left(pyxis_slurm) == [], containers_left(pyxis_slurm)
    got = same_losses(run, host_run)
    setups = [s for steps in found.values() for kind, s in steps if kind == "created"]
    print(f"\nslurm job {job} in {SQSH.name} ({SQSH.stat().st_size / 2**30:.1f} GiB; 2 nodes of 3, torchrun launch): attempts "
          f"{[(a['nodes'], a['start_step'], a['end_step'], a['exit_code'], a['ended'], a.get('excluded')) for a in attempts]}; "
          f"image imports per node and attempt {done}, each {min(setups):.0f}-{max(setups):.0f} s; {hang_line[:120]}...; "
          f"losses of all 16 steps equal the host's run with the image's stack bit for bit (last {got[-1]['loss']!r}); "
          f"{time.time() - began:.0f} s")


@pytest.mark.slow
def test_a_crash_and_a_hang_in_the_image_restart_inside_the_job_and_train_as_the_host_does(
        pyxis_slurm, drill_flags, host_run, tmp_path, tmp_path_factory):
    """Issue 53's in-job restart with the image's stack (Python 3.12, the image's torch and megatron-core
    0.19): a 2-node job (--restart in-job, the default) whose rank 1 is killed at step 3 and hangs at
    step 6. Torchrun restarts the workers twice inside the allocation and inside the attempt's
    containers: Slurm's restart count 0, each node imports the image once (the check's step; the
    training's step reuses it, and so do the restarts, in the same step), no container left, and all
    16 steps' losses equal the host's run with the image's stack bit for bit."""
    began = time.time()
    mounts = str(tmp_path_factory.getbasetemp())
    [(code, output)] = submit_many(tmp_path, [[
        "submit", "--recipe", str(TINY), "--nodes", "2", "--gpus-per-node", "0", "--time", "00:30:00",
        "--container-image", str(SQSH), "--container-mounts", f"{mounts}:{mounts}", "--runs-root", str(tmp_path / "runs"),
        "--log-dir", str(tmp_path / "logs"), "--max-restarts", "2", "--",
        *map(str, drill_flags), "--inject-fault", "crash@3:1", "--inject-fault", "hang@6:1", "--hang-timeout-minutes", "0.5"]])
    assert code == 0, output
    [job] = job_ids(output)
    run, log = tmp_path / "runs" / "tiny_cpu", tmp_path / "logs" / f"tiny_cpu-{job}.out"
    pyxis_slurm.wait_for(job, {"COMPLETED"}, restarts=0, timeout=900)
    text = log.read_text()
    [attempt] = starts(run)
    assert (attempt["ended"], attempt["next"], [r["step"] for r in attempt["in_job_restarts"]]) == ("finished", "done", [2, 4])
    assert "=== finished: step 16 of 16 after 2 in-job restarts" in text, text[-3000:]
    found = imports(pyxis_slurm, job)
    assert sorted(kinds for kinds in (tuple(k for k, _ in steps) for steps in found.values()) if kinds) == [
        ("created", "reused")] * 2, found  # two nodes, one import each
    assert containers_left(pyxis_slurm) == [], containers_left(pyxis_slurm)
    got = same_losses(run, host_run)
    print(f"\nslurm job {job} in {SQSH.name} (2 nodes of 3, in-job): Restarts 0, in-job restarts {attempt['in_job_restarts']}; "
          f"image imports {found}; losses of all 16 steps equal the host's run with the image's stack bit for bit "
          f"(last {got[-1]['loss']!r}); {time.time() - began:.0f} s")


@pytest.mark.slow
def test_a_job_in_the_image_that_loses_its_node_is_requeued_by_slurm_and_trains_as_the_host_does(
        pyxis_slurm, drill_flags, host_run, tmp_path, tmp_path_factory):
    """A 2-node job in the image loses its batch host (its slurmd and every process on it SIGKILLed, as a
    power loss would) after its first checkpoints: Slurm marks the node down and requeues the job onto
    the two nodes left, which import the image afresh and resume. All 16 steps' losses equal the host's
    run bit for bit. (``slow@3:0`` keeps the job running long enough to be killed mid-run.)"""
    began = time.time()
    mounts = str(tmp_path_factory.getbasetemp())
    [(code, output)] = submit_many(tmp_path, [[
        "submit", "--recipe", str(TINY), "--nodes", "2", "--gpus-per-node", "0", "--time", "00:30:00",
        "--container-image", str(SQSH), "--container-mounts", f"{mounts}:{mounts}", "--runs-root", str(tmp_path / "runs"),
        "--log-dir", str(tmp_path / "logs"), "--max-restarts", "0", "--", *map(str, drill_flags), "--inject-fault", "slow@3:0"]])
    assert code == 0, output
    [job] = job_ids(output)
    run, log = tmp_path / "runs" / "tiny_cpu", tmp_path / "logs" / f"tiny_cpu-{job}.out"
    host = pyxis_slurm.wait_for(job, {"RUNNING"})["BatchHost"]
    wait_until(lambda: (run / "iter_0000004").is_dir() and last_step(run) >= 5, f"job {job} made no checkpoint: "
               + (log.read_text() if log.exists() else ""), timeout=600)
    killed_at = last_step(run)
    pyxis_slurm.kill_node(host)
    try:
        pyxis_slurm.wait_for(job, {"COMPLETED"}, restarts=1, timeout=600)
    finally:
        pyxis_slurm.start_node(host)
    pyxis_slurm.wait_for_nodes("idle", [host])
    attempts = starts(run)
    assert [(a["restart_count"], a["ended"], a["next"]) for a in attempts] == [(0, "lost", "Slurm's"), (1, "finished", "done")]
    assert host not in attempts[1]["rank_nodes"] and 4 <= attempts[1]["start_step"] <= killed_at, (attempts, killed_at)
    assert f"=== job {job} restart 0 was lost (it never ended: its node failed?) ===" in log.read_text()
    found = imports(pyxis_slurm, job)
    assert all(kinds == [("created", "reused")] * len(kinds) for kinds in per_attempt(found, attempts, pyxis_slurm).values()), found
    same_losses(run, host_run)
    print(f"\nslurm job {job} in the image (2 nodes): batch host {host} killed at step {killed_at} → Slurm requeued the job "
          f"onto {attempts[1]['nodes']}, which imported the image and resumed from step {attempts[1]['start_step']}; losses of "
          f"all 16 steps equal the host's run bit for bit; {time.time() - began:.0f} s")


@pytest.mark.slow
def test_an_image_file_enroot_cannot_start_ends_the_job_in_one_line_and_is_not_retried(pyxis_slurm, drill_flags, tmp_path,
                                                                                       tmp_path_factory):
    """A --container-image that is not a squashfs file (here: a text file with the name of one): pyxis
    fails the job's first step on every node with enroot's [ERROR]; the job ends there with one error:
    line naming the image, the node and enroot's reason, exit code 2, before any attempt, not requeued
    (--max-restarts 3 notwithstanding)."""
    image, mounts = tmp_path / "fbt-megatron+26.06.sqsh", tmp_path_factory.getbasetemp()  # mounts: the data and the run
    image.write_text("not a squashfs file\n")
    [(code, output)] = submit_many(tmp_path, [[
        "submit", "--recipe", str(TINY), "--nodes", "2", "--gpus-per-node", "0", "--time", "00:10:00",
        "--container-image", str(image), "--container-mounts", f"{mounts}:{mounts}", "--runs-root", str(tmp_path / "runs"),
        "--log-dir", str(tmp_path / "logs"), "--max-restarts", "3", "--", *map(str, drill_flags)]])
    assert code == 0, output
    [job] = job_ids(output)
    with pytest.raises(AssertionError, match="ended FAILED"):
        pyxis_slurm.wait_for(job, {"COMPLETED"}, timeout=300)
    text = (tmp_path / "logs" / f"tiny_cpu-{job}.out").read_text()
    lines = text.strip().splitlines()
    assert len(lines) == 1 and re.fullmatch(
        rf"error: --container-image {re.escape(str(image))} cannot start on node n[12]: Invalid image format: "
        rf"{re.escape(str(image))} \(enroot\): give the path of a squashfs file made by enroot import, readable on every node "
        r"\(docs/gpu.md#the-container\)", lines[0]), text
    assert pyxis_slurm.job(job)["Restarts"] == "0" and not (tmp_path / "runs" / "tiny_cpu" / "jobs.jsonl").exists()
    print(f"\n{lines[0]}")
