"""Operations (fbt_megatron.trainer.stopping, fbt_megatron.trainer.bad_steps, checkpoint retention): runs that
stop early, steps that go bad, processes that die.

* A skipped step is a step that never happened, for the optimizer: with Adam and NorMuon, fp32
  and bf16, the weights and optimizer state after a skipped step are bitwise those before it, and
  the next step equals megatron-core's own step on an optimizer that never saw the bad one.
* Through the entry point (real processes, tests/forked.py, one interpreter start-up for all):
  NaN/Inf injection, too many bad steps, SIGTERM, a second Ctrl-C (each signal to the process
  group, as Slurm and a terminal send it), --exit-duration-in-mins, keep-last-N retention,
  --async-save and kill -9 at 10 points (mid-step and mid-save; of the process group or of the
  training process alone) with resumes; no process of any of these runs is left 5 s after it.
* Under torchrun (2 processes, ``python -m fbt_megatron.torchrun``): a signal only one rank got,
  a double Ctrl-C, kill -9 of one rank; no process of the run is left, and the last checkpoint
  resumes exactly.
* The launcher's wait (``stopping.torchrun``, a Slurm job's torchrun; one bash worker): a stop
  longer than torchrun's own kill timeout completes, one that never ends is killed after the
  launcher's timeout, a torchrun without ``--signals-to-handle`` keeps its own handling, and a SIGTERM
  that finds the worker killed (SIGKILL) ends the launcher at once with the worker's exit code, 137.
"""

import json
import math
import random
import re
import signal
import time
from pathlib import Path

import pytest
import torch
from forked import Signal, descendants, run_commands, survivors

from fbt_megatron.commands import train
from fbt_megatron.trainer import build, checkpointing
from fbt_megatron.trainer.callbacks import checkpointer
from fbt_megatron.trainer.bad_steps import optimizer_step
from fbt_megatron.trainer.callbacks.metrics_writer import read_metrics
from fbt_megatron.common.processes import outside_group
from fbt_megatron.trainer.stopping import StopCheck

ROOT = Path(__file__).parent.parent
TINY = str(ROOT / "recipes" / "tiny_cpu.yaml")
SMALL = ["--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "4", "--lr-warmup-iters", "2",
         "--log-interval", "1", "--fused-prefill-passes", "1", "--threads", "1",
         "--pass-phases", "[{start: 0.0, mixture: {1: 0.5, 2: 0.5}}]"]
EVERY_STEP = ["--eval-interval", "1", "--eval-iters", "1"]  # the validation loss after every step: the weights seen
KILL_ITERS = 13


# ---------------------------------------------------------------- the skipped step, one process
def _snapshot(model, optimizer):
    return ([p.detach().clone() for p in model.parameters()],
            [v.clone() if torch.is_tensor(v) else v for opt in getattr(optimizer, "chained_optimizers", [optimizer])
             for state in opt.optimizer.state.values() for _, v in sorted(state.items())])


def _same(a, b) -> bool:
    return all(torch.equal(x, y) if torch.is_tensor(x) else x == y for x, y in zip(a, b)) and len(a) == len(b)


@pytest.mark.parametrize("name,precision", [("adam", []), ("adam", ["--bf16"]), ("normuon", []), ("normuon", ["--bf16"])])
def test_a_skipped_step_is_a_step_that_never_happened(name, precision):
    """Two copies of one model: copy A steps with megatron-core's ``optimizer.step()`` on gradients
    g1, g3; copy B with ``optimizer_step`` on g1, a poisoned g2 (skipped), g3. After g1 they are
    equal (``optimizer_step`` is megatron-core's step); the skipped step leaves B's weights and
    optimizer state (moments, step counts) bitwise unchanged; after g3 B equals A: the skipped step
    left no trace."""
    recipe = train.parse_args(["--recipe", TINY, "--optimizer", name, *precision, "--seq-length", "32", "--num-layers", "2"])
    copies = []
    for _ in range(2):
        config, model, ddp = build.build_model(recipe, 256)
        optimizer, _ = build.build_optimizer(recipe, config, ddp)
        copies.append((model, optimizer))
    (model_a, opt_a), (model_b, opt_b) = copies
    model_b.load_state_dict(model_a.state_dict())
    for opt in (opt_a, opt_b):
        opt.reload_model_params()
        for group in opt.param_groups:
            group["lr"] = 1e-2

    def gradients(model, seed, poison=None):
        g = torch.Generator().manual_seed(seed)
        for p in model.parameters():
            p.main_grad.copy_(torch.randn(p.shape, generator=g))
        if poison is not None:
            next(model.parameters()).main_grad.view(-1)[0] = poison

    gradients(model_a, 1), gradients(model_b, 1)
    assert opt_a.step()[0] and optimizer_step(opt_b)[0]
    assert _same(_snapshot(model_a, opt_a)[0], _snapshot(model_b, opt_b)[0])
    for poison in (math.nan, math.inf):
        before = _snapshot(model_b, opt_b)
        gradients(model_b, 2, poison)
        updated, norm = optimizer_step(opt_b)
        assert not updated and not math.isfinite(norm)
        after = _snapshot(model_b, opt_b)
        assert _same(before[0], after[0]) and _same(before[1], after[1])
    gradients(model_a, 3), gradients(model_b, 3)
    opt_a.step()
    assert optimizer_step(opt_b)[0]
    a, b = _snapshot(model_a, opt_a), _snapshot(model_b, opt_b)
    assert not _same(before[0], b[0])  # the step did something
    assert _same(a[0], b[0]) and _same(a[1], b[1])


# ---------------------------------------------------------------- real runs
def _kill_plan(folder: Path, seed: int = 13):
    """10 kill -9 points, seeded: at step n = 2 … 11, alternately while checkpoint n is being
    written (its .tmp folder exists) and during step n + 1 (checkpoint n complete); in pairs, to
    the process group (Slurm) and to the training process alone (its helpers live on unless they
    die with it)."""
    rng = random.Random(seed)
    plan = []
    for i, n in enumerate(range(2, 12)):
        group = i // 2 % 2 == 0
        if i % 2 == 0:
            plan.append(Signal(signal.SIGKILL, path=str(folder / f"iter_{n:07d}.tmp"), delay=rng.uniform(0.0, 0.02), group=group))
        else:
            plan.append(Signal(signal.SIGKILL, path=str(folder / f"iter_{n:07d}"), delay=rng.uniform(0.01, 0.05), group=group))
    return plan


@pytest.fixture(scope="module")
def runs(tmp_path_factory, small_corpus):
    """Every command line of this module, one after another in forked processes of one interpreter."""
    tmp = tmp_path_factory.mktemp("operations")
    data = ["--data-path", str(Path(small_corpus.train_prefix).parent), "--corpus", "null"]
    kill = tmp / "kill"
    kill.mkdir()  # --load of a run folder with no checkpoint yet: starts from scratch
    commands = {
        "clean": [*SMALL, *EVERY_STEP, "--train-iters", "7", "--save", tmp / "clean"],
        "poisoned": [*SMALL, *EVERY_STEP, "--train-iters", "7", "--save", tmp / "poisoned", "--save-interval", "1",
                     "--keep-last-n-checkpoints", "2", "--inject-nan", "loss@3,grad@5:inf"],
        "normuon": [*SMALL, *EVERY_STEP, "--train-iters", "5", "--optimizer", "normuon", "--bf16", "--inject-nan", "grad@3"],
        "streak": [*SMALL, "--eval-iters", "0", "--train-iters", "9", "--save", tmp / "streak", "--save-interval", "1",
                   "--keep-last-n-checkpoints", "2", "--inject-nan", "grad@4-6", "--max-bad-steps", "2"],
        "sigterm": [*SMALL, "--eval-iters", "0", "--train-iters", "7", "--save", tmp / "sigterm"],
        "sigterm_resumed": [*SMALL, "--eval-iters", "0", "--train-iters", "7", "--save", tmp / "sigterm", "--load", tmp / "sigterm"],
        "duration": [*SMALL, "--eval-iters", "0", "--train-iters", "7", "--save", tmp / "duration",
                     "--exit-duration-in-mins", "0.00001"],
        "ctrl_c_twice": [*SMALL, "--eval-iters", "0", "--train-iters", KILL_ITERS, "--save-interval", "1", "--save", tmp / "ctrl_c"],
        "ctrl_c_resumed": [*SMALL, "--eval-iters", "0", "--train-iters", KILL_ITERS, "--save", tmp / "ctrl_c", "--load", tmp / "ctrl_c"],
        "ctrl_c_then_term": [*SMALL, "--eval-iters", "0", "--train-iters", "30"],
        "async": [*SMALL, "--eval-iters", "0", "--train-iters", "7", "--save", tmp / "async", "--save-interval", "2",
                  "--keep-last-n-checkpoints", "2", "--async-save"],
        "async_resumed": [*SMALL, "--eval-iters", "0", "--train-iters", "7", "--save", tmp / "async_resumed", "--load", tmp / "async",
                          "--ckpt-step", "6"],
        "bad_spec": ["--inject-nan", "loss3", "--save", tmp / "bad"],
        "bad_keep": ["--keep-last-n-checkpoints", "-1", "--save", tmp / "bad"],
        "uninterrupted": [*SMALL, "--eval-iters", "0", "--train-iters", KILL_ITERS, "--save", tmp / "uninterrupted"],
    }
    signals = {
        "sigterm": [Signal(signal.SIGTERM, output="step      3 ")],
        "ctrl_c_twice": [Signal(signal.SIGINT, output="step      3 ", path=str(tmp / "ctrl_c" / "iter_0000003")),
                         Signal(signal.SIGINT, output="SIGINT received")],
        "ctrl_c_then_term": [Signal(signal.SIGINT, output="step      2 "), Signal(signal.SIGTERM, output="SIGINT received")],
    }
    lines = [(name, [*data, *args], signals.get(name, [])) for name, args in commands.items()]
    resume = [*data, *SMALL, "--eval-iters", "0", "--train-iters", KILL_ITERS, "--save-interval", "1", "--save", kill, "--load", kill]
    lines += [(f"kill{i}", resume, [s]) for i, s in enumerate(_kill_plan(kill))]
    lines.append(("kill_final", resume, []))
    listings, left = [], []
    codes = run_commands("fbt_megatron.train", [(["--recipe", TINY, *map(str, args)], tmp / f"{name}.log", None, sig)
                                                for name, args, sig in lines], listing=kill, listings=listings, survivors=left)
    return {name: {"code": code, "log": (tmp / f"{name}.log").read_text(), "listing": listing, "survivors": survivors}
            for (name, _, _), code, listing, survivors in zip(lines, codes, listings, left)}, tmp


def _ok(run):
    assert run["code"] == 0, run["log"][-3000:]
    assert "Traceback" not in run["log"], run["log"][-3000:]


@pytest.mark.slow
def test_nan_and_inf_steps_are_skipped_and_counted(runs):
    """A poisoned batch at step 3 (NaN loss) and a poisoned gradient at step 5 (Inf): both skipped
    and counted, the weights unchanged by them (the validation loss after step 3 is bitwise the
    one after step 2; after 5 the one after 4), the learning-rate schedule not advanced (step 4
    has the clean run's lr of step 3), steps 1-2 bitwise the clean run's, every later step
    finite; NorMuon in bf16 likewise."""
    results, tmp = runs
    for name in ("clean", "poisoned", "normuon"):
        _ok(results[name])
    clean, poisoned = read_metrics(tmp / "clean"), read_metrics(tmp / "poisoned")
    assert [r["step"] for r in poisoned] == list(range(1, 8))
    keys = ["k", "loss", "pass_losses", "grad_norm", "lr", "valid_loss_fused0"]
    assert [{k: r[k] for k in keys} for r in poisoned[:2]] == [{k: r[k] for k in keys} for r in clean[:2]]
    assert math.isnan(poisoned[2]["loss"]) and math.isnan(poisoned[2]["grad_norm"])  # the poisoned batch
    assert math.isfinite(poisoned[4]["loss"]) and poisoned[4]["grad_norm"] == math.inf  # the poisoned gradient
    assert [r["skipped_steps"] for r in poisoned] == [0, 0, 1, 1, 2, 2, 2]
    for skipped in (3, 5):
        assert poisoned[skipped - 1]["valid_loss_fused1"] == poisoned[skipped - 2]["valid_loss_fused1"]
    assert poisoned[3]["lr"] == clean[2]["lr"] and poisoned[5]["lr"] == clean[3]["lr"]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in poisoned[5:])
    log = results["poisoned"]["log"]
    assert "step 3 skipped: gradient norm nan (1 in a row, 1 in all)" in log
    assert "step 5 skipped: gradient norm inf (1 in a row, 2 in all)" in log
    normuon = [line for line in results["normuon"]["log"].splitlines() if re.match(r"\S+Z step ", line)]
    assert "step 3 skipped" in results["normuon"]["log"]
    valid = [float(line.rsplit("valid ", 1)[1].split("/")[0]) for line in normuon if "valid " in line]
    assert valid[2] == valid[1] and valid[3] != valid[2] and all(math.isfinite(v) for v in valid)


@pytest.mark.slow
def test_too_many_bad_steps_stop_with_the_last_good_checkpoint(runs):
    """--max-bad-steps 2 and bad steps 4-6: the third stops the run (one error line, exit 2); no
    checkpoint was written after a bad step, so retention (keep 2) kept the last good ones, 2 and 3,
    both complete."""
    results, tmp = runs
    run = results["streak"]
    assert run["code"] == 2 and "Traceback" not in run["log"], run["log"][-3000:]
    errors = [line for line in run["log"].splitlines() if line.startswith("error:")]
    assert errors == [f"error: 3 consecutive steps with a NaN/Inf loss or gradient norm (steps 4-6; --max-bad-steps 2): "
                      f"the last good checkpoint is {tmp / 'streak' / 'iter_0000003'}; lower --lr or check the data of these steps"]
    assert checkpointing.iterations(tmp / "streak") == [2, 3]
    assert [checkpointing.read_train_state(tmp / "streak", i)["iteration"] for i in (2, 3)] == [2, 3]
    assert json.loads((tmp / "streak" / "exit_status.json").read_text())["reason"] == "bad_steps"


@pytest.mark.slow
def test_retention_keeps_the_newest_checkpoints(runs):
    results, tmp = runs
    folder = tmp / "poisoned"
    assert checkpointing.iterations(folder) == [6, 7] and checkpointing.latest_iteration(folder) == 7
    assert not [p for p in folder.iterdir() if p.name.endswith((".old", ".tmp"))]
    assert checkpointing.read_train_state(folder, 6)["skipped_steps"] == 2


@pytest.mark.slow
def test_sigterm_saves_stops_and_resumes_exactly(runs):
    """SIGTERM after step 3 is logged: the run stops at the next step boundary with a checkpoint
    and one line, exit 0; --load resumes it and the losses equal the uninterrupted run's bit for bit."""
    results, tmp = runs
    _ok(results["sigterm"]), _ok(results["sigterm_resumed"])
    log = results["sigterm"]["log"]
    stopped = [line for line in log.splitlines() if line.startswith("stopped by")]
    assert len(stopped) == 1 and stopped[0].startswith("stopped by SIGTERM at step "), log[-2000:]
    step = int(stopped[0].split("at step ")[1].split(":")[0])
    assert 3 <= step < 7 and stopped[0].endswith(f"checkpoint {tmp / 'sigterm' / f'iter_{step:07d}'}; "
                                                 f"--load {tmp / 'sigterm'} resumes from it")
    assert json.loads((tmp / "sigterm" / "exit_status.json").read_text()) == {
        "reason": "finished", "step": 7, "train_iters": 7, "checkpoint": "iter_0000007"}
    keys = ["k", "loss", "pass_losses", "state_deltas", "grad_norm", "lr"]  # training: validation does not change it
    expected, got = read_metrics(tmp / "clean"), read_metrics(tmp / "sigterm")
    assert [{k: r.get(k) for k in keys} for r in got] == [{k: r.get(k) for k in keys} for r in expected]


@pytest.mark.slow
def test_exit_duration_and_a_second_ctrl_c(runs):
    """A second Ctrl-C (after checkpoint 3) aborts at once, exit 130, and so does a SIGTERM after a
    Ctrl-C (torchrun's way of passing a second Ctrl-C on); --load then resumes from the last
    complete checkpoint and the losses equal the uninterrupted run's bit for bit."""
    results, tmp = runs
    _ok(results["duration"])
    assert "stopped by --exit-duration-in-mins 1e-05 at step 1: checkpoint" in results["duration"]["log"]
    assert json.loads((tmp / "duration" / "exit_status.json").read_text())["reason"] == "duration"
    twice = results["ctrl_c_twice"]
    assert twice["code"] == 130 and "aborted by a second SIGINT: no checkpoint written" in twice["log"], twice["log"][-2000:]
    assert "Traceback" not in twice["log"]
    then_term = results["ctrl_c_then_term"]
    assert then_term["code"] == 130 and "aborted by SIGTERM after SIGINT: no checkpoint written" in then_term["log"], then_term["log"][-2000:]
    _ok(results["ctrl_c_resumed"])
    resumed_from = int(re.search(r"steps (\d+)→", results["ctrl_c_resumed"]["log"]).group(1))
    assert resumed_from >= 3, results["ctrl_c_resumed"]["log"][:800]
    keys = ["k", "loss", "pass_losses", "grad_norm", "lr"]
    expected, got = read_metrics(tmp / "uninterrupted"), read_metrics(tmp / "ctrl_c")
    assert len(got) == KILL_ITERS and [{k: r[k] for k in keys} for r in got] == [{k: r[k] for k in keys} for r in expected]


def test_a_signal_or_the_time_budget_stops_a_run_before_its_exit_interval_does():
    """The stop check's reason after a step (one process): --exit-interval every N-th step, unless a
    signal or the time budget stops the run there, whose stop line and exit status name them."""
    with StopCheck(None, handle_signals=False, started=time.monotonic(), exit_interval=3) as stop:
        assert [stop.stop_reason(i) for i in (1, 2, 3, 6)] == [None, None, "exit_interval", "exit_interval"]
        stop.signal = "SIGTERM"
        assert [stop.stop_reason(i) for i in (2, 3)] == ["signal", "signal"]
    with StopCheck(0.0, handle_signals=False, started=time.monotonic(), exit_interval=3) as stop:
        assert [stop.stop_reason(i) for i in (1, 3)] == ["duration", "duration"]
    with StopCheck(None, handle_signals=False, started=time.monotonic()) as stop:
        assert stop.stop_reason(3) is None


@pytest.mark.slow
def test_no_process_outlives_its_run(runs):
    """5 s after each run ended — finished, stopped, aborted by a second Ctrl-C, kill -9 of its
    process group or of the training process alone, mid-step or mid-save — no process of it is
    left (its process group, and everything descended from it when it was signalled): not the
    checkpoint results-queue manager (which ignores SIGINT and SIGTERM), not a checkpoint writer."""
    results, _ = runs
    assert sum(not s.group for s in _kill_plan(Path("k"))) == 4
    left = {name: run["survivors"] for name, run in results.items() if run["survivors"]}
    assert not left, left


@pytest.mark.slow
def test_kill_9_at_10_points_then_resume_exactly(runs):
    """kill -9 at 10 points (alternately mid-save and mid-step, tests/forked.py), each followed by
    --load: (a) every resume starts from the newest checkpoint the killed run left, (b) every
    checkpoint folder left is complete (manifest, sizes and hashes), (c) the losses logged after
    the last resume equal the uninterrupted run's bit for bit."""
    results, tmp = runs
    kills = [results[f"kill{i}"] for i in range(10)]
    assert all(run["code"] == -signal.SIGKILL for run in kills), [run["code"] for run in kills]
    _ok(results["uninterrupted"]), _ok(results["kill_final"])
    previous = [results[f"kill{i}"] for i in range(10)]
    mid_save = 0
    for before, after in zip(previous, [*kills[1:], results["kill_final"]]):
        newest = max(int(name[len("iter_"):]) for name in before["listing"] if name.startswith("iter_") and name[5:].isdigit())
        mid_save += any(name.endswith(".tmp") for name in before["listing"])
        assert f"steps {newest}→{KILL_ITERS} " in after["log"], (before["listing"], after["log"][:800])
    assert mid_save >= 3  # some kills left a half-written checkpoint (and it was never loaded)
    folder = tmp / "kill"
    for i in checkpointing.iterations(folder):
        assert not checkpointing.damage(checkpointing.checkpoint_dir(folder, i), collective=True), i
    keys = ["k", "loss", "pass_losses", "grad_norm", "lr"]
    expected, got = read_metrics(tmp / "uninterrupted"), read_metrics(folder)
    assert len(got) == KILL_ITERS and [{k: r[k] for k in keys} for r in got] == [{k: r[k] for k in keys} for r in expected]


@pytest.mark.slow
def test_async_save_writes_the_same_checkpoints_in_the_background(runs):
    """--async-save (saves at 2, 4, 6, 7, keep 2): the losses are the synchronous run's; the
    checkpoints, finished at later step boundaries (manifest, rename, tracker, retention), are
    complete; a run resumed from step 6 logs the uninterrupted run's step 7 bit for bit."""
    results, tmp = runs
    _ok(results["async"]), _ok(results["async_resumed"])
    assert "(written in the background: --async-save)" in results["async"]["log"]
    folder = tmp / "async"
    assert checkpointing.iterations(folder) == [6, 7] and checkpointing.latest_iteration(folder) == 7
    for i in (6, 7):
        assert not checkpointing.damage(checkpointing.checkpoint_dir(folder, i), collective=True), i
    keys = ["k", "loss", "pass_losses", "state_deltas", "grad_norm", "lr"]
    clean = [{k: r[k] for k in keys} for r in read_metrics(tmp / "clean")]
    assert [{k: r[k] for k in keys} for r in read_metrics(folder)] == clean
    assert [{k: r[k] for k in keys} for r in read_metrics(tmp / "async_resumed")] == clean[6:]


# ---------------------------------------------------------------- under torchrun
TORCHRUN_ITERS = 14


def _torchrun(log: Path, args: list, when=None, act=None) -> dict:
    """``python -m fbt_megatron.torchrun`` with 2 processes, in a session of its own as a terminal
    starts it; once ``when(output)`` holds, ``act(launcher pid, output file)`` signals it. Returns
    the exit code, the output, the seconds from ``act`` to the launcher's end and the processes
    of the run alive 5 s after it (every process of the run when ``act`` began, and their groups)."""
    import os
    import subprocess
    import sys
    import time

    env = outside_group()
    command = [sys.executable, "-m", "fbt_megatron.torchrun", "--nproc-per-node=2", "--standalone", "-m", "fbt_megatron.train",
               "--recipe", TINY, *map(str, args)]
    processes, acted = [], None
    with open(log, "w") as out:
        launcher = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            if act is not None:
                while not when(log.read_text()) and launcher.poll() is None:
                    time.sleep(0.02)
                processes = descendants(launcher.pid)
                acted = time.monotonic()
                act(launcher.pid, log)
            code = launcher.wait(timeout=600)
            seconds = None if acted is None else time.monotonic() - acted
        finally:
            if launcher.poll() is None:
                launcher.kill()
    left = survivors([launcher.pid, *(p.pid for p in processes)], processes)
    return {"code": code, "log": log.read_text(), "seconds": seconds, "survivors": left}


def _rank(launcher: int, rank: int) -> int:
    """The worker process of ``rank`` (not the processes it forked, which inherit its RANK)."""
    of_rank = {p.pid: p for p in descendants(launcher) if p.environ().get("RANK") == str(rank)}
    workers = [pid for pid, p in of_rank.items() if p.ppid() not in of_rank]
    assert len(workers) == 1, workers
    return workers[0]


def _ctrl_c_twice(launcher: int, log: Path) -> None:
    import os
    import time

    os.killpg(launcher, signal.SIGINT)  # a terminal's Ctrl-C: to the launcher's process group
    while "SIGINT received" not in log.read_text():
        time.sleep(0.01)
    os.killpg(launcher, signal.SIGINT)


@pytest.fixture(scope="module")
def torchrun_runs(tmp_path_factory, small_corpus):
    """One folder, one after another: SIGTERM to rank 1 alone after step 3 (the run stops
    cleanly); --load, a double Ctrl-C once a new checkpoint is complete; --load, kill -9 of rank 1
    once a new checkpoint is complete; --load to the end. And the run uninterrupted."""
    import os

    tmp = tmp_path_factory.mktemp("torchrun")
    base = ["--data-path", str(Path(small_corpus.train_prefix).parent), "--corpus", "null", *SMALL, "--eval-iters", "0",
            "--train-iters", TORCHRUN_ITERS]
    run = tmp / "run"
    resume = [*base, "--save", run, "--load", run, "--save-interval", "1"]

    results = {"uninterrupted": _torchrun(tmp / "uninterrupted.log", [*base, "--save", tmp / "uninterrupted"])}
    results["one_rank"] = _torchrun(tmp / "one_rank.log", [*base, "--save", run], lambda text: "step      3 " in text,
                                    lambda launcher, log: os.kill(_rank(launcher, 1), signal.SIGTERM))
    results["one_rank"].update(iterations=checkpointing.iterations(run), status=json.loads((run / "exit_status.json").read_text()))
    for name, act in (("ctrl_c_twice", _ctrl_c_twice), ("kill", lambda launcher, log: os.kill(_rank(launcher, 1), signal.SIGKILL))):
        after = run / f"iter_{checkpointing.latest_iteration(run) + 1:07d}"  # once a new checkpoint is complete
        results[name] = _torchrun(tmp / f"{name}.log", resume, lambda text, after=after: after.exists(), act)
        results[name]["latest"] = checkpointing.latest_iteration(run)
    results["resumed"] = _torchrun(tmp / "resumed.log", resume)
    return results, tmp


@pytest.mark.slow
def test_ranks_agree_on_a_signal_only_one_of_them_received(torchrun_runs):
    """torchrun, 2 data-parallel ranks: SIGTERM to rank 1 alone. Both ranks stop at the same step
    boundary (the flag is all-reduced), save one complete checkpoint of that step together and
    exit 0 (torchrun too, no traceback); rank 0, which got no signal, reports it."""
    results, tmp = torchrun_runs
    save, text, code = tmp / "run", results["one_rank"]["log"], results["one_rank"]["code"]
    assert code == 0 and "Traceback" not in text, text[-3000:]
    stopped = [line for line in text.splitlines() if line.startswith("stopped by")]
    assert len(stopped) == 1 and stopped[0].startswith("stopped by SIGTERM at step "), text[-3000:]
    step = int(stopped[0].split("at step ")[1].split(":")[0])
    assert 3 <= step < TORCHRUN_ITERS and results["one_rank"]["iterations"] == [step]
    assert not checkpointing.damage(checkpointing.checkpoint_dir(save, step), collective=True)
    assert results["one_rank"]["status"]["signal"] == "SIGTERM"


@pytest.mark.slow
def test_under_torchrun_a_double_ctrl_c_and_kill_9_leave_nothing_and_resume_exactly(torchrun_runs):
    """A double Ctrl-C to the launcher's process group aborts both ranks at once (exit 130, one
    line from the launcher last); kill -9 of rank 1 ends the run (exit 128 + 9, one line naming
    it). 5 s after each, no process of the run is left (launcher, workers in their own sessions,
    their checkpoint helpers). Resumed from the newest complete checkpoint, the losses equal the
    uninterrupted run's bit for bit."""
    results, tmp = torchrun_runs
    twice, kill = results["ctrl_c_twice"], results["kill"]
    assert twice["code"] == 130 and "aborted by a second SIGINT: no checkpoint written" in twice["log"], twice["log"][-3000:]
    last = twice["log"].strip().splitlines()[-1]
    assert re.fullmatch(r"torchrun: rank [01] ended with exit code 130; torchrun stopped the other workers", last), twice["log"][-3000:]
    assert kill["code"] == 128 + signal.SIGKILL, kill["log"][-3000:]
    assert kill["log"].strip().splitlines()[-1] == "torchrun: rank 1 ended with signal SIGKILL; torchrun stopped the other workers"
    print(f"torchrun: a double Ctrl-C ended the run in {twice['seconds']:.1f} s, kill -9 of rank 1 in {kill['seconds']:.1f} s")
    left = {name: run["survivors"] for name, run in results.items() if run["survivors"]}
    assert not left, left
    resumed = results["resumed"]
    assert resumed["code"] == 0 and "Traceback" not in resumed["log"], resumed["log"][-3000:]
    assert f"steps {kill['latest']}→{TORCHRUN_ITERS} " in resumed["log"] and twice["latest"] < kill["latest"] < TORCHRUN_ITERS
    keys = ["k", "loss", "pass_losses", "grad_norm", "lr"]
    expected, got = read_metrics(tmp / "uninterrupted"), read_metrics(tmp / "run")
    assert len(got) == TORCHRUN_ITERS and [{k: r[k] for k in keys} for r in got] == [{k: r[k] for k in keys} for r in expected]


# ---------------------------------------------------------------- the launcher's wait (one bash worker)
def _launch(tmp: Path, name: str, worker: str, stop_timeout=None, older: bool = False, hold: float = 0.0,
            killed: bool = False, **env) -> dict:
    """``stopping.torchrun`` (tests/launch_torchrun.py) with one worker, ``bash -c WORKER`` (torchrun
    ``--no-python``), in the folder ``tmp/name``: SIGTERM to the launcher alone (as Slurm's cgroup
    tracking delivers it) once the worker has written its pid to ``ready`` (with ``killed``: once
    the worker, killed with SIGKILL then, is dead and not reaped, a zombie: torchrun polls its workers
    every hour here, ``--monitor-interval``); ``hold`` seconds later whether the worker is alive, then
    the file ``go`` (the worker may finish its stop). Returns the exit code, the output and that answer."""
    import os
    import subprocess
    import sys
    import time

    import psutil

    folder = tmp / name
    folder.mkdir()
    command = [sys.executable, str(ROOT / "tests" / "launch_torchrun.py"), "none" if stop_timeout is None else str(stop_timeout),
               "older" if older else "current", "--standalone", "--nproc-per-node=1",
               *(["--monitor-interval=3600"] if killed else []), "--no-python", "bash", "-c", worker]
    environment = outside_group()
    with open(folder / "out", "w") as out:
        launcher = subprocess.Popen(command, cwd=folder, env={**environment, **env}, stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 120
            while not (folder / "ready").exists():
                assert launcher.poll() is None and time.monotonic() < deadline, (folder / "out").read_text()
                time.sleep(0.05)
            worker_process = psutil.Process(int((folder / "ready").read_text()))
            if killed:
                worker_process.kill()
                while worker_process.status() != psutil.STATUS_ZOMBIE:
                    assert time.monotonic() < deadline, (folder / "out").read_text()
                    time.sleep(0.05)
            launcher.send_signal(signal.SIGTERM)
            time.sleep(hold)
            try:
                alive = worker_process.status() != psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                alive = False
            (folder / "go").touch()
            code = launcher.wait(timeout=120)
        finally:
            if launcher.poll() is None:
                launcher.kill()
            if (folder / "ready").exists():  # the worker leads a session of its own: it outlives a killed launcher
                try:
                    os.killpg(int((folder / "ready").read_text()), signal.SIGKILL)
                except ProcessLookupError:
                    pass
    return {"code": code, "log": (folder / "out").read_text(), "alive": alive}


READY = "echo $BASHPID > ready.tmp && mv ready.tmp ready"  # the worker's pid, written whole (torchrun reads $$ as a macro's $)
RUN = "while :; do sleep 0.05; done"


@pytest.mark.slow
def test_the_launcher_waits_for_the_workers_stop_as_long_as_it_is_told(tmp_path):
    """``stopping.torchrun`` (what a Slurm job's torchrun launch runs) with one worker whose stop
    lasts until the test says so. Its torchrun's own kill timeout is 1 s (TORCH_ELASTIC_SHUTDOWN_TIMEOUT,
    which this torch reads; 30 s by default): 3 s after SIGTERM the worker is alive, and once it has
    finished the launcher exits 0 with the worker's line last. A worker that ignores SIGTERM is
    killed after the launcher's ``stop_timeout`` (exit 128 + 9, one line). A torchrun without
    ``--signals-to-handle`` is not given the option, handles SIGTERM itself and ends in one line,
    128 + 15, after saying so when it starts."""
    import os

    from launch_torchrun import without_signals_option
    from torch.distributed import run
    from torch.distributed.launcher.api import LaunchConfig

    from fbt_megatron.trainer.stopping import own_signal_options

    os.environ["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] = "1"
    try:
        assert LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=1).shutdown_timeout == 1  # plain torchrun's kill: 1 s
    finally:
        del os.environ["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"]
    assert own_signal_options(run.get_args_parser()) == ["--signals-to-handle", "SIGHUP,SIGQUIT"]
    assert own_signal_options(without_signals_option(run.get_args_parser())) == []

    slow = _launch(tmp_path, "slow", f"trap 'while [ ! -e go ]; do sleep 0.05; done; echo saved; exit 0' TERM; {READY}; {RUN}",
                   stop_timeout=60, hold=3.0, TORCH_ELASTIC_SHUTDOWN_TIMEOUT="1")
    assert slow["alive"] and slow["code"] == 0 and slow["log"].strip().splitlines()[-1] == "saved", slow["log"][-3000:]
    assert "Traceback" not in slow["log"] and "SIGKILL" not in slow["log"]

    stuck = _launch(tmp_path, "stuck", f"trap '' TERM; {READY}; {RUN}", stop_timeout=1)
    assert stuck["code"] == 128 + signal.SIGKILL, stuck["log"][-3000:]
    assert stuck["log"].strip().splitlines()[-1] == ("torchrun: the workers had not stopped 1 s after SIGTERM: killed them "
                                                     "(SIGKILL); the newest complete checkpoint is the one to resume from")

    older = _launch(tmp_path, "older", f"{READY}; {RUN}", older=True)
    lines = older["log"].strip().splitlines()
    assert older["code"] == 128 + signal.SIGTERM and "Traceback" not in older["log"], older["log"][-3000:]
    assert lines[0] == (f"torchrun: torch {torch.__version__}'s torchrun has no --signals-to-handle: on SIGTERM or SIGINT it "
                        "gives the workers 30 s to stop before it kills them (a newer torch waits for them)"), lines
    assert lines[-1] == "torchrun: SIGTERM: the workers were sent SIGTERM and have ended", lines


@pytest.mark.slow
def test_a_launcher_whose_worker_a_signal_killed_ends_with_that_signal_when_slurm_terminates_it(tmp_path):
    """A Slurm step's launcher (``stopping.torchrun``) whose worker was killed (SIGKILL) and that gets
    SIGTERM before torchrun has looked at the worker (srun ending the step because another node's rank
    exited 1 first) ends at once with the worker's line and exit code, 128 + 9: once srun has ended the
    step it prints no line for a task a signal ended, and the attempt's record would name the node of the
    survivor's exit 1. The worker is a zombie when the signal comes and torchrun would not look for an hour."""
    killed = _launch(tmp_path, "killed", f"{READY}; {RUN}", stop_timeout=60, killed=True)
    assert killed["code"] == 128 + signal.SIGKILL and not killed["alive"], killed["log"][-3000:]
    assert killed["log"].strip().splitlines()[-1] == "torchrun: rank 0 ended with signal SIGKILL; torchrun stopped the other workers"


def test_the_rank_that_failed_first_is_the_one_a_signal_killed_of_those_torchrun_saw_together():
    """``stopping.first_failure``: torchrun's times are whole seconds, so a rank killed (SIGKILL) and the
    ranks that exited or stopped because it died are often seen together: the killed rank failed first;
    an earlier failure stays first, whatever ended it."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from fbt_megatron.trainer.stopping import first_failure

    def failure(exitcode: int, timestamp: int) -> ProcessFailure:
        made = ProcessFailure(local_rank=0, pid=1, exitcode=exitcode, error_file="/nonexistent")
        made.timestamp = timestamp
        return made

    together = {0: failure(1, 100), 1: failure(-signal.SIGTERM, 100), 2: failure(-signal.SIGKILL, 100), 3: failure(1, 100)}
    assert first_failure(together)[0] == 2
    assert first_failure({**together, 4: failure(1, 99)})[0] == 4
    assert first_failure({0: failure(1, 100), 1: failure(-signal.SIGTERM, 100)})[0] == 0


@pytest.mark.slow
def test_bad_operation_flags_are_one_line(runs):
    results, tmp = runs
    expected = {"bad_spec": "error: training.inject_nan: 'loss3' is not WHAT@STEP[-LAST][:nan|inf] (WHAT: loss or grad)",
                "bad_keep": "error: checkpoint.keep_last_n_checkpoints must be >= 0, got -1"}
    for name, line in expected.items():
        assert results[name]["code"] == 2 and results[name]["log"].strip().splitlines() == [line], results[name]["log"]
    assert not (tmp / "bad").exists()


# ---------------------------------------------------------------- the run folder is safe
def _other_run(folder: Path) -> dict:
    """A folder as another run leaves it: checkpoints to step 100 (the tracker names it), 20 metrics records."""
    (folder / "iter_0000100").mkdir(parents=True)
    (folder / "latest_checkpointed_iteration.txt").write_text("100")
    (folder / "metrics.jsonl").write_text("".join(json.dumps({"step": 5 * i, "loss": 1.0}) + "\n" for i in range(1, 21)))
    return {p.name: p.read_bytes() if p.is_file() else None for p in folder.iterdir()}


def test_save_into_another_run_without_load_is_one_line_and_leaves_it(tmp_path):
    """``--save`` into a folder that holds another run, without ``--load`` of it: refused in one
    line naming --overwrite-save, exit 2, the folder byte for byte as it was (a real process). A
    resume (``--load X --save X``, what a requeued Slurm job passes), --overwrite-save, and a stage
    from another run's weights into a fresh folder pass the check."""
    folder = tmp_path / "ow"
    before = _other_run(folder)
    out, err = tmp_path / "out", tmp_path / "err"
    [code] = run_commands("fbt_megatron.train", [(["--recipe", TINY, "--save", folder, "--train-iters", "10"], out, err)])
    assert code == 2 and err.read_text().splitlines() == [
        f"error: --save {folder} holds another run (checkpoints to step 100, metrics.jsonl to step 100) that this run would "
        f"overwrite: resume it with --load {folder}, choose another --save, or add --overwrite-save to replace it"], err.read_text()
    assert {p.name: p.read_bytes() if p.is_file() else None for p in folder.iterdir()} == before

    def check(*flags):
        checkpointer.check_save(train.parse_args(["--recipe", TINY, *map(str, flags)]))

    check("--save", folder, "--load", folder)
    check("--save", folder, "--overwrite-save")
    check("--save", tmp_path / "stage", "--pretrained-checkpoint", folder)
    with pytest.raises(ValueError, match="holds another run"):
        check("--save", folder, "--load", tmp_path / "elsewhere")  # resuming another run into this one


def test_a_rank_that_lost_another_says_so_in_one_line(tmp_path):
    """A rank whose peer died (SIGKILL) finds it at the step boundary's stop check: one ``error:`` line
    naming the stop check and the lost connection, exit code 1 (a crash, not bad input), and no
    traceback (was: two chained gloo ``RuntimeError`` tracebacks, the second from the check's close)."""
    from forked import run_ranks

    codes, log = [], tmp_path / "ranks.log"
    run_ranks([ROOT / "tests" / "distributed" / "peer_lost_worker.py"], 2, log, timeout=300, each=codes)
    text = log.read_text()
    assert codes == [1, -signal.SIGKILL] or codes == [1, 128 + signal.SIGKILL], (codes, text[-3000:])
    [line] = [line for line in text.splitlines() if line.startswith("error: ")]
    assert line.startswith("error: rank 0: the ranks' stop check lost another rank (") and "rank's own line" in line, line
    assert "Traceback" not in text, text[-3000:]


@pytest.mark.slow
def test_a_rank_that_lost_another_inside_the_step_says_so_in_one_line(small_corpus, tmp_path):
    """Training, 2 ranks: rank 1 dies (``--inject-fault crash@2:1``: SIGKILL at the start of step 2, after
    the step's stop check started its all-reduce), so rank 0 meets the loss inside the step, in the
    gradient all-reduce (the stop check is read only after the step): one ``error:`` line naming a
    collective and the lost connection (gloo's first line, less its source location), exit code 1, no
    traceback (was: megatron-core's traceback ending in gloo's "Connection closed by peer" RuntimeError)."""
    from forked import run_ranks

    from fbt_megatron.common.errors import lost_a_peer

    codes, log = [], tmp_path / "ranks.log"
    data = ["--data-path", str(Path(small_corpus.train_prefix).parent), "--corpus", "null"]
    run_ranks(["-m", "fbt_megatron.train", "--recipe", TINY, *data, *SMALL, "--eval-iters", "0", "--train-iters", "4",
               "--inject-fault", "crash@2:1"], 2, log, timeout=300, each=codes)
    text = log.read_text()
    assert codes == [1, -signal.SIGKILL] or codes == [1, 128 + signal.SIGKILL], (codes, text[-3000:])
    assert "--inject-fault crash@2:1: rank 1 dies (SIGKILL) at the start of step 2" in text, text[-3000:]
    [line] = [line for line in text.splitlines() if line.startswith("error: ")]
    said = re.fullmatch(r"error: rank 0: a collective lost another rank \((.+)\): that rank's own line says why it ended", line)
    assert said and lost_a_peer(RuntimeError(said[1])) and not said[1].startswith("["), line
    assert "Traceback" not in text, text[-3000:]


def test_only_a_collective_that_lost_a_rank_ends_in_one_line(monkeypatch):
    """``errors.lost_a_peer`` tells gloo's and NCCL's errors of a lost rank from the others, and
    ``errors.peer_lost`` quotes their first line less gloo's source location; ``run_cli`` lets every
    other RuntimeError (this rank's own NCCL error, a plain one) raise with its traceback, also while
    a process group exists."""
    from torch.distributed import DistBackendError

    from fbt_megatron.common import cli
    from fbt_megatron.common.errors import lost_a_peer, peer_lost

    lost = {"[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1234. This is "
            "typically caused by a remote worker crashing. Check the logs of the remote worker": "Connection closed by peer "
            "[127.0.0.1]:1234",
            "[../third_party/gloo/gloo/transport/tcp/pair.cc:598] Read error [127.0.0.1]:48602: Connection reset by peer":
            "Read error [127.0.0.1]:48602: Connection reset by peer",
            "NCCL communicator was aborted on rank 0. Original reason for failure was: ...": "NCCL communicator was aborted "
            "on rank 0"}
    for message, said in lost.items():
        for error in (RuntimeError(message), DistBackendError(message)):
            assert lost_a_peer(error), error
            assert str(peer_lost(3, "a collective", error)) == (f"rank 3: a collective lost another rank ({said}): "
                                                                 "that rank's own line says why it ended")
    assert lost_a_peer(DistBackendError("NCCL error in: ProcessGroupNCCL.cpp:3356, remote process exited or there was a "
                                        "network error, NCCL version 2.21.5\nncclRemoteError: A call failed"))

    monkeypatch.setattr(cli, "_process_group", lambda: True)  # as in a run's rank: a process group exists
    for error in (RuntimeError("boom"), DistBackendError("NCCL error in: ProcessGroupNCCL.cpp:3356, unhandled cuda error "
                                                         "(run with NCCL_DEBUG=INFO for details), NCCL version 2.21.5"),
                  RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 1800000ms "
                               "for recv operation to complete")):
        def fail(error=error):
            raise error

        assert not lost_a_peer(error)
        with pytest.raises(type(error)) as raised:
            cli.run_cli(fail)
        assert raised.value is error
