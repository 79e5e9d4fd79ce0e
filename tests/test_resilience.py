"""A run that looks after itself (fbt_megatron/trainer/callbacks/): injected faults, loss spikes, hangs.

* ``--inject-fault`` specs and the spike flags are checked up front, one line each; the flag repeats.
  A fault that could never fire is refused too: a rank outside the world, a step past the run, a
  spike before the spike window is full.
* The spike check on a sequence of gradient norms: warn, skip, the running median's window.
* Through the entry point (real processes): ``spike@6`` with ``--spike-policy rewind`` — reloaded
  from the checkpoint of step 4, the batches of steps 5-6 skipped — gives the same losses bit for
  bit on a rerun, and the same decision at another layout (2 data-parallel ranks, losses equal to
  float rounding). ``hang@3:1`` on 2 ranks (``python -m fbt_megatron.torchrun``): both ranks write
  their stacks, the stuck one is named, the run exits 124 within the timeout plus a grace;
  ``--load`` resumes (the hang does not fire again, the spike does and is rewound again) and logs
  the losses of the uninterrupted 2-rank run bit for bit.
* Which rank is stuck, from the collectives each rank issued per group (``watchdog.diagnose``): the
  rank behind, not the ranks ahead, whatever their Python is doing (a pipeline's chain, a desync).
  Real processes: rank 0 stuck on the simulated device (its groups are ``fakenccl``): named from
  the device group's counts, both ranks exit 124, ``exit_status.json`` names it; a hang as NCCL
  leaves it (the waiting rank issued its collective asynchronously and waits outside any
  ``torch.distributed`` call): only the stuck rank is named, as the flight recorder's own record
  agrees; ``freeze@3:0`` (rank 0 holds the interpreter: no stacks) is named by its missing file,
  and rank 1 writes ``exit_status.json``. Point-to-point operations are counted per pair of ranks
  and left out of the groups' collectives (gloo counts them there, NCCL does not), so ``hang@3:1``
  at PP 2 names the last stage from the pair's counts.
* A Slurm job's attempts and retry budget (``launch/attempts.py``) against stand-ins for
  scontrol and sinfo; the real Slurm: tests/test_slurm.py.
"""

import json
import os
import pickle
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from forked import run_commands, run_ranks

from fbt_megatron.commands import train
from fbt_megatron.common import platform
from fbt_megatron.common.errors import RecipeError
from fbt_megatron.recipe.faults import Fault, parse_faults
from fbt_megatron.trainer.callbacks.spikes import Spikes
from fbt_megatron.trainer.callbacks.watchdog import HANG_EXIT, diagnose
from fbt_megatron.trainer.callbacks.metrics_writer import read_metrics
from fbt_megatron.common.processes import outside_group

ROOT = Path(__file__).parent.parent
TINY = str(ROOT / "recipes" / "tiny_cpu.yaml")
RUN = ["--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "4", "--lr-warmup-iters", "2",
       "--log-interval", "1", "--eval-iters", "0", "--threads", "1", "--train-iters", "10", "--save-interval", "2"]
SPIKE = [*RUN, "--spike-window", "4", "--spike-policy", "rewind", "--inject-fault", "spike@6"]
HANG_MINUTES = 0.3  # 18 s without a step: far more than a step and a checkpoint of the tiny model take here
REWIND_LINE = re.compile(r"^step 6: gradient norm \S+ is \d+× the median \S+ of the last 4 steps \(--spike-factor 10\): spike 1, "
                         r"rewound to checkpoint iter_0000004, the batches of steps 5-6 skipped \(rewind 1 of --max-rewinds 3; "
                         r"--spike-policy rewind\)$", re.M)


def test_fault_specs_and_spike_flags_are_checked_in_one_line():
    recipe = train.parse_args(["--recipe", TINY, "--inject-fault", "crash@5:1", "--inject-fault", "[hang@3:1, spike@6]"])
    assert recipe.training.inject_fault == ["crash@5:1", "hang@3:1", "spike@6"]  # repeated: the values add up
    assert parse_faults(recipe.training.inject_fault) == [Fault("crash", 5, 1), Fault("hang", 3, 1), Fault("spike", 6, 0)]
    assert parse_faults(["crash@7", "freeze@2:1", "slow@3:1"]) == [Fault("crash", 7, 0), Fault("freeze", 2, 1),
                                                                    Fault("slow", 3, 1)]  # rank 0 unless given
    train.parse_args(["--recipe", TINY, "--train-iters", "21", "--inject-fault", "slow@21:1", "--inject-fault", "spike@21"]).validate(2)
    bad = {
        ("--inject-fault", "crash5"): "training.inject_fault: 'crash5' is not KIND@STEP[:RANK] (KIND: crash, hang, freeze, "
                                      "slow, spike; STEP from 1), e.g. --inject-fault crash@5:1",
        ("--inject-fault", "spike@6:1"): "training.inject_fault: 'spike@6:1': a spike is the whole step's, on every rank: "
                                         "give spike@6",
        ("--inject-fault", "crash@0"): "training.inject_fault: 'crash@0' is not KIND@STEP[:RANK] (KIND: crash, hang, freeze, "
                                       "slow, spike; STEP from 1), e.g. --inject-fault crash@5:1",
        ("--inject-fault", "crash@2:9"): "training.inject_fault: 'crash@2:9': rank 9 is not in this run's world of 1 process "
                                         "(rank 0): it would never fire",
        ("--inject-fault", "slow@2:1"): "training.inject_fault: 'slow@2:1': rank 1 is not in this run's world of 1 process "
                                        "(rank 0): it would never fire",
        ("--train-iters", "10", "--inject-fault", "hang@99"): "training.inject_fault: 'hang@99': step 99 is past --train-iters "
                                                              "10: it would never fire",
        ("--inject-fault", "spike@6"): "training.inject_fault: 'spike@6': the spike detector compares a step with the median of "
                                       "the 20 before it (--spike-window 20), so it sees no spike before step 21: give a later "
                                       "step or a smaller --spike-window",
        ("--spike-factor", "1"): "training.spike_factor must be > 1, got 1.0",
        ("--spike-window", "0"): "training.spike_window must be >= 1, got 0",
        ("--hang-timeout-minutes", "-1"): "training.hang_timeout_minutes must be >= 0, got -1.0",
        ("--spike-policy", "undo"): "--spike-policy must be one of ['off', 'warn', 'skip', 'rewind'], got 'undo'",
    }
    for argv, line in bad.items():
        with pytest.raises(RecipeError) as e:
            train.parse_args(["--recipe", TINY, *argv]).validate(1)
        assert str(e.value) == line


def test_spike_policies_decide_from_the_running_median(capsys):
    """Gradient norms 4, 3, 2, 2 fill a window of 4 (median 2.5); 30 is a spike (> 10 × 2.5),
    2.4 is not. A lasting level of 30 enters the window and stops being a spike once it is half
    the window: warn trains on every spike, skip vetoes them, rewind vetoes and asks for the rewind."""
    norms = [4.0, 3.0, 2.0, 2.0, 30.0, 2.4, 30.0, 30.0, 30.0]
    decisions, said = {}, {}
    for policy in ("off", "warn", "skip", "rewind"):
        training = SimpleNamespace(spike_policy=policy, spike_factor=10.0, spike_window=4, max_rewinds=1)
        spikes = Spikes(training, None)
        decisions[policy] = [spikes.vetoes_update(SimpleNamespace(iteration=step - 1), norm) for step, norm in enumerate(norms, start=1)]
        said[policy] = capsys.readouterr().out.splitlines()
        assert spikes.spikes == (0 if policy == "off" else 2) and spikes.rewind_due == (policy == "rewind")
        window = [] if policy == "off" else [2.4, 30.0, 30.0, 30.0]
        assert spikes.state_dict() == {"window": window, "spikes": spikes.spikes, "rewinds": 0}
        resumed = Spikes(training, None)  # its state saved and loaded: the next norm decided as by the uninterrupted one
        resumed.load_state_dict(spikes.state_dict())
        assert resumed.vetoes_update(SimpleNamespace(iteration=9), 400.0) == spikes.vetoes_update(SimpleNamespace(iteration=9), 400.0)
        assert resumed.state_dict() == spikes.state_dict()
        capsys.readouterr()
    spiking = [False, False, False, False, True, False, True, False, False]  # the 2nd 30 in a row: median (2.4+30)/2
    assert decisions == {"off": [False] * 9, "warn": [False] * 9, "skip": spiking, "rewind": spiking}
    assert said["warn"][0] == ("step 5: gradient norm 30 is 12× the median 2.5 of the last 4 steps (--spike-factor 10): spike 1, "
                               "trained on (--spike-policy warn)")
    assert said["skip"][0] == ("step 5: gradient norm 30 is 12× the median 2.5 of the last 4 steps (--spike-factor 10): spike 1, "
                               "update skipped (--spike-policy skip)")
    assert said["warn"][1].startswith("step 7: gradient norm 30 is 14× the median 2.2 ")  # warn, skip: a line a spike
    assert [len(said[p]) for p in ("off", "warn", "skip", "rewind")] == [0, 2, 2, 0]
    # (rewind says its line when it rewinds)


def _torchrun(log: Path, flags: list, started: str = None) -> dict:
    """``python -m fbt_megatron.torchrun`` with 2 processes; its exit code, output, and the seconds
    from the moment ``started`` appeared in the output to the end."""
    env = outside_group()
    seen = None
    with open(log, "w") as out:
        launcher = subprocess.Popen([sys.executable, "-m", "fbt_megatron.torchrun", "--nproc-per-node=2", "--standalone", "-m",
                                     "fbt_megatron.train", "--recipe", TINY, *map(str, flags)], cwd=ROOT, env=env,
                                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            while launcher.poll() is None:
                if seen is None and started and started in log.read_text():
                    seen = time.monotonic()
                time.sleep(0.1)
            code = launcher.wait(timeout=600)
        finally:
            if launcher.poll() is None:
                os.killpg(launcher.pid, 9)
    return {"code": code, "log": log.read_text(), "seconds": None if seen is None else time.monotonic() - seen}


def _ranks(log: Path, flags: list) -> dict:
    """2 ranks of the training forked from one interpreter (tests/forked.py: torchrun's environment)."""
    code = run_ranks(["-m", "fbt_megatron.train", "--recipe", TINY, *map(str, flags)], 2, log)
    return {"code": code, "log": log.read_text()}


@pytest.fixture(scope="module")
def drills(tmp_path_factory, small_corpus):
    """The spike drill twice in one process, and at 2 data-parallel ranks; the hang drill on 2
    ranks (with the spike too: python -m fbt_megatron.torchrun, as a user runs it), then its resume."""
    tmp = tmp_path_factory.mktemp("resilience")
    flags = [*SPIKE, "--data-path", str(Path(small_corpus.train_prefix).parent), "--corpus", "null"]
    runs = {"spike": flags + ["--save", tmp / "spike"], "rerun": flags + ["--save", tmp / "rerun"]}
    codes = run_commands("fbt_megatron.train", [(["--recipe", TINY, *map(str, argv)], tmp / f"{name}.log", None)
                                                for name, argv in runs.items()])
    results = {name: {"code": code, "log": (tmp / f"{name}.log").read_text()} for name, code in zip(runs, codes)}
    results["dp2"] = _ranks(tmp / "dp2.log", [*flags, "--save", tmp / "dp2"])
    hang = [*flags, "--save", tmp / "hang", "--inject-fault", "hang@3:1"]
    results["hang"] = _torchrun(tmp / "hang.log", [*hang, "--hang-timeout-minutes", HANG_MINUTES],
                                started="--inject-fault hang@3:1: rank 1 hangs")
    results["hang"]["status"] = json.loads((tmp / "hang" / "exit_status.json").read_text())
    results["hang"]["stacks"] = {r: (tmp / "hang" / "hang" / f"rank{r}.txt").read_text() for r in (0, 1)}
    results["resumed"] = _ranks(tmp / "resumed.log", [*hang, "--load", tmp / "hang"])  # the default timeout
    return results, tmp


def _ok(run):
    assert run["code"] == 0 and "Traceback" not in run["log"], run["log"][-3000:]


@pytest.mark.slow
def test_a_spike_is_rewound_the_same_way_on_every_rerun_and_layout(drills):
    results, tmp = drills
    for name in ("spike", "rerun", "dp2"):
        _ok(results[name])
        assert len(REWIND_LINE.findall(results[name]["log"])) == 1, results[name]["log"][-3000:]
        assert json.loads((tmp / name / "exit_status.json").read_text()) == {
            "reason": "finished", "step": 10, "train_iters": 10, "checkpoint": "iter_0000010", "spikes": 1, "rewinds": 1}
    keys = ["k", "loss", "pass_losses", "state_deltas", "lr", "grad_norm", "skipped_steps"]
    one, again, dp2 = (read_metrics(tmp / name) for name in ("spike", "rerun", "dp2"))
    assert [r["step"] for r in one] == list(range(1, 11))  # steps 5-6 as they ran before the rewind, then 7-10
    assert one[5]["loss"] > 1000 * one[4]["loss"] / 2 and [r["skipped_steps"] for r in one][5:] == [1, 2, 2, 2, 2]
    assert [{k: r[k] for k in keys} for r in again] == [{k: r[k] for k in keys} for r in one]  # bitwise
    assert [r["k"] for r in dp2] == [r["k"] for r in one]
    for a, b in zip(one, dp2):
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * abs(a["loss"]), (a, b)  # summed in another order: float rounding
    print(f"\nspike@6, rewind: {REWIND_LINE.search(results['spike']['log'])[0]}; a rerun's losses equal bit for bit, "
          f"2 DP ranks' within {max(abs(a['loss'] - b['loss']) / a['loss'] for a, b in zip(one, dp2)):.1e}")


@pytest.mark.slow
def test_a_hang_ends_with_every_ranks_stacks_and_resumes_exactly(drills):
    results, tmp = drills
    hang, resumed = results["hang"], results["resumed"]
    assert hang["code"] == HANG_EXIT, hang["log"][-3000:]
    assert hang["seconds"] < 60 * HANG_MINUTES + 30, hang["seconds"]  # the timeout, the watchdog's check, the grace, torchrun
    [line] = [line for line in hang["log"].splitlines() if line.startswith("hang: ")]
    node = platform.node_name()  # each rank's node, named
    named = re.fullmatch(rf"hang: no step progress for \d+ s after step 2 \(--hang-timeout-minutes {HANG_MINUTES:g}\): rank 1 on "
                         rf"{node} stuck outside a collective \(fbt_megatron/trainer/callbacks/faults.py:\d+ in start_step; (\d+) collectives "
                         rf"issued on \S+, rank 0 (\d+)\); rank 0 on {node} waiting in a collective; stacks in {tmp}/hang/hang/rank\*.txt; exit 124: "
                         r"a restart \(--load\) resumes from the last checkpoint", line)
    assert named and int(named[2]) > int(named[1]), line  # gloo: rank 0 waits inside the one collective rank 1 never issued
    assert (tmp / "hang" / "hang" / "diagnosis.txt").read_text() == line + "\n"
    stacks = hang["stacks"]
    assert "inside a torch.distributed call; collectives issued: " in stacks[0].splitlines()[0] and "distributed_c10d.py" in stacks[0]
    assert "outside a torch.distributed call; collectives issued: " in stacks[1].splitlines()[0] and 'faults.py", line' in stacks[1]
    assert hang["status"] == {"reason": "hang", "step": 2, "train_iters": 10, "checkpoint": "iter_0000002", "stuck_ranks": [1]}
    _ok(resumed)
    assert "--inject-fault hang" not in resumed["log"] and len(REWIND_LINE.findall(resumed["log"])) == 1
    keys = ["k", "loss", "pass_losses", "state_deltas", "lr", "grad_norm", "skipped_steps"]
    expected, got = read_metrics(tmp / "dp2"), read_metrics(tmp / "hang")
    assert [{k: r[k] for k in keys} for r in got] == [{k: r[k] for k in keys} for r in expected]  # bitwise
    print(f"\nhang@3:1 on 2 ranks: {line}\nended {hang['seconds']:.1f} s after the hang began (timeout "
          f"{60 * HANG_MINUTES:g} s); the resume's losses equal the uninterrupted run's bit for bit")


def test_the_stuck_rank_is_the_one_behind_on_a_group_whatever_python_is_doing():
    """Reports as the ranks write them (``rank<R>.json``: per group, the collectives issued) and who
    is stuck. A pipeline's chain: rank 2 waits for rank 1 on their group, rank 1 for rank 0 on theirs;
    only rank 0, behind there and ahead nowhere, is stuck, although no rank is inside a
    torch.distributed call (on NCCL they wait in a ``.item()``). A rank that wrote nothing is silent
    and the others wait for it, in a collective call or not; two ranks each ahead on a group (a
    desync) both wait; equal counts and no rank in a call: each is stuck (e.g. in I/O)."""
    def report(in_call=False, **issued):
        return {"in_call": in_call, "groups": {key: {"group": key.upper(), "ranks": [], "issued": n} for key, n in issued.items()}}

    assert diagnose({0: report(g01=5), 1: report(g01=6, g12=3), 2: report(g12=4)}, 3) == ([0], [], [1, 2], ("G01", 5, {1: 6}))
    assert diagnose({1: report(True, dp=7)}, 2) == ([], [0], [1], None)
    assert diagnose({1: report(dp=7), 2: report(dp=7)}, 3) == ([], [0], [1, 2], None)
    assert diagnose({0: report(a=6, b=3), 1: report(a=5, b=4)}, 2) == ([], [], [0, 1], None)
    assert diagnose({0: report(dp=7), 1: report(dp=7)}, 2) == ([0, 1], [], [], None)


@pytest.mark.slow
@pytest.mark.parametrize("simulated", ["0", "1"])
def test_point_to_point_is_counted_per_pair_and_left_out_of_the_groups_collectives(tmp_path, monkeypatch, simulated):
    """tests/distributed/p2p_worker.py: 2 ranks issue 4 point-to-point operations (one blocking, a
    batch of two, one asynchronous) and one all-reduce. Each reports 4 operations on its pair, a
    group of two, and one collective more on the default group and none on any other: gloo counts
    each point-to-point operation among its collectives, NCCL does not (its ``seqP2P_`` is apart),
    so the report leaves them out there on every backend and a pipeline's hang is named from the
    pair's counts (on the simulated device too: its groups are gloo underneath)."""
    monkeypatch.setenv("FBT_SIMULATED_DEVICE", simulated)
    code = run_ranks([Path(__file__).parent / "distributed" / "p2p_worker.py", tmp_path], 2, tmp_path / "p2p.log")
    assert code == 0, (tmp_path / "p2p.log").read_text()[-3000:]
    for rank in (0, 1):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        before, after = report["before"], report["after"]
        assert after.pop("p2p 0-1") == {"group": "point-to-point 0-1", "ranks": [0, 1], "issued": 4}, after
        assert set(after) == set(before) and "p2p 0-1" not in before
        moved = {after[key]["group"]: after[key]["issued"] - before[key]["issued"] for key in after}
        assert moved == {**dict.fromkeys(moved, 0), "default_pg": 1}, moved


def _hang(tmp_path, small_corpus, fault: str, each=None, layout=()) -> dict:
    """2 forked ranks of the tiny run with ``fault`` and the watchdog at HANG_MINUTES: the exit code
    (the first failure's; with ``each``: every rank's, none stopped), the output, the one line."""
    flags = [*RUN, "--data-path", Path(small_corpus.train_prefix).parent, "--corpus", "null", "--save", tmp_path / "run",
             "--inject-fault", fault, "--hang-timeout-minutes", HANG_MINUTES, *layout]
    code = run_ranks(["-m", "fbt_megatron.train", "--recipe", TINY, *map(str, flags)], 2, tmp_path / "run.log", each=each)
    log = (tmp_path / "run.log").read_text()
    lines = [line for line in log.splitlines() if line.startswith("hang: ")]
    assert len(lines) == 1, log[-3000:]
    return {"code": code, "log": log, "line": lines[0], "status": json.loads((tmp_path / "run" / "exit_status.json").read_text())}


@pytest.mark.slow
def test_rank_0_stuck_is_named_from_the_device_groups_and_both_ranks_exit_124(tmp_path, small_corpus, monkeypatch):
    """``hang@3:0`` on the simulated device (its groups are ``fakenccl``, as NCCL's would be), the
    ranks left to end by themselves: each exits 124, the one line names rank 0 from the
    data-parallel group's counts, and ``exit_status.json`` names it."""
    monkeypatch.setenv("FBT_SIMULATED_DEVICE", "1")
    each = []
    run = _hang(tmp_path, small_corpus, "hang@3:0", each)
    assert each == [HANG_EXIT, HANG_EXIT], run["log"][-3000:]
    on = f" on {platform.node_name()}"
    assert re.search(rf"\): rank 0{on} stuck outside a collective \(fbt_megatron/trainer/callbacks/faults.py:\d+ in start_step; \d+ "
                     rf"collectives issued on DATA_PARALLEL_GROUP(_WITH_CP)?, rank 1 \d+\); rank 1{on} waiting in a collective; ",
                     run["line"]), run["line"]
    assert run["status"] == {"reason": "hang", "step": 2, "train_iters": 10, "checkpoint": "iter_0000002", "stuck_ranks": [0]}
    print(f"\nhang@3:0 on the simulated device, both ranks exit {each}: {run['line']}")


@pytest.mark.slow
def test_a_pipeline_stage_stuck_is_named_from_its_point_to_point_count(tmp_path, small_corpus, monkeypatch):
    """``hang@3:1`` at PP 2 on the simulated device: rank 1, the last stage, stops before step 3;
    rank 0 sends it the step's activations and waits for their gradients. Nothing but those sends
    and receives tells the two apart (the groups' collectives are equal: counted apart from the
    point-to-point operations, as NCCL counts them), so rank 1 is named from the pair's counts."""
    monkeypatch.setenv("FBT_SIMULATED_DEVICE", "1")
    each = []
    run = _hang(tmp_path, small_corpus, "hang@3:1", each, layout=["--pipeline-model-parallel-size", "2"])
    assert each == [HANG_EXIT, HANG_EXIT], run["log"][-3000:]
    on = f" on {platform.node_name()}"
    assert re.search(rf"\): rank 1{on} stuck outside a collective \(fbt_megatron/trainer/callbacks/faults.py:\d+ in start_step; "
                     rf"(\d+) collectives issued on point-to-point 0-1, rank 0 (\d+)\); rank 0{on} waiting in a collective; ",
                     run["line"]), run["line"]
    assert run["status"]["stuck_ranks"] == [1]
    print(f"\nhang@3:1 at PP 2 on the simulated device: {run['line']}")


@pytest.mark.slow
def test_a_hang_as_nccl_leaves_it_names_the_rank_behind_not_the_rank_waiting_outside_a_collective_call(tmp_path, monkeypatch):
    """tests/distributed/hang_worker.py on the simulated device: rank 1 hangs before its all-reduce;
    rank 0 issued it asynchronously and waits from its own code, outside any torch.distributed call
    (where Python sits, the two ranks look alike). Only rank 1 is named, from the counts; torch's
    flight recorder, dumped beside the stacks, agrees: rank 0 enqueued one collective that never
    completed, rank 1 none."""
    monkeypatch.setenv("FBT_SIMULATED_DEVICE", "1")
    each, folder = [], tmp_path / "hang"
    launch_log = tmp_path / "worker.log"
    run_ranks([Path(__file__).parent / "distributed" / "hang_worker.py", tmp_path, 1, 0.05], 2, launch_log, each=each)
    log = launch_log.read_text()
    assert each == [HANG_EXIT, HANG_EXIT], log[-3000:]
    heads = {r: (folder / f"rank{r}.txt").read_text().splitlines()[0] for r in (0, 1)}
    assert "main thread at hang_worker.py:" in heads[0] and "outside a torch.distributed call" in heads[0], heads[0]
    assert "faults.py" in heads[1] and "outside a torch.distributed call" in heads[1], heads[1]
    [line] = [line for line in log.splitlines() if line.startswith("hang: ")]
    on = f" on {platform.node_name()}"
    assert re.search(rf"\): rank 1{on} stuck outside a collective \(fbt_megatron/trainer/callbacks/faults.py:\d+ in start_step; 0 "
                     rf"collectives issued on default_pg, rank 0 1\); rank 0{on} waiting in a collective; ", line), line
    assert json.loads((tmp_path / "exit_status.json").read_text())["stuck_ranks"] == [1]
    traces = {r: pickle.loads((folder / f"fr_trace_rank_{r}").read_bytes()) for r in (0, 1)}
    assert [(g["last_enqueued_collective"], g["last_completed_collective"]) for g in traces[0]["pg_status"].values()] == [(1, -1)]
    assert traces[1]["pg_status"] == {}


@pytest.mark.slow
def test_a_silent_rank_0_is_named_by_its_missing_stacks_and_rank_1_writes_the_status(tmp_path, small_corpus):
    """``freeze@3:0``: rank 0 holds the interpreter, so its watchdog never runs and it writes nothing;
    rank 1 waits GRACE_S for it, names it by its missing file, writes ``exit_status.json`` (rank 0
    wrote it alone before) and exits 124; the launcher then ends rank 0, as torchrun or srun would."""
    run = _hang(tmp_path, small_corpus, "freeze@3:0")
    assert run["code"] == HANG_EXIT, run["log"][-3000:]
    assert "--inject-fault freeze@3:0: rank 0 hangs holding the interpreter at the start of step 3" in run["log"]
    assert re.search(rf"\): rank 0 wrote no stacks \(stuck holding the interpreter, or gone\); rank 1 on {platform.node_name()} "
                     r"waiting in a collective; ",
                     run["line"]), run["line"]
    assert not list((tmp_path / "run" / "hang").glob("rank0*")) and (tmp_path / "run" / "hang" / "rank1.json").is_file()
    assert run["status"] == {"reason": "hang", "step": 2, "train_iters": 10, "checkpoint": "iter_0000002", "stuck_ranks": [0]}
