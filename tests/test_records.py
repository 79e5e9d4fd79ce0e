"""Records a cluster can line up (issue 54): every logged step's record and log line carry its wall
time (UTC, ISO 8601) and the memory of the largest rank (RSS on a CPU, the CUDA allocator's counters
on a GPU, under Megatron-LM's tag names), the planner's estimate is put beside the first step's peak,
and a run this node cannot hold is warned of before it starts, in runs of one process or several."""

import json
import re
from pathlib import Path

import pytest
from helpers import launch

from fbt_megatron.common.clock import utc
from fbt_megatron.launch.plan import this_machine
from fbt_megatron.launch.plan.planner import gib, make_plan
from fbt_megatron.trainer.callbacks.metrics_writer import read_metrics
from test_train import TINY, train

DISTRIBUTED = Path(__file__).parent / "distributed"
LINE = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ) step +(\d+) \| .* \| rss (\S+) GiB \(peak (\S+)\)", re.M)
GiB = 2**30


def test_a_step_line_and_its_record_carry_the_utc_time_and_the_memory(tmp_path, small_corpus):
    flags = ["--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "4",
             "--log-interval", "2", "--eval-iters", "0", "--save", tmp_path / "run"]
    _, text = train(tmp_path / "run.log", *flags, corpus=small_corpus)
    records, lines = read_metrics(tmp_path / "run"), LINE.findall(text)
    assert [int(step) for _, step, _, _ in lines] == [r["step"] for r in records] == [2, 4], text[-3000:]
    for (when, _, rss, peak), r in zip(lines, records):
        assert when == r["time_utc"] == utc(r["time"])  # the line's time is the record's, to the second
        assert 100 * 2**20 < r["rss_bytes"] <= r["max_rss_bytes"] < 8 * GiB  # torch alone is over 100 MiB resident
        assert (float(rss), float(peak)) == (round(r["rss_bytes"] / GiB, 2), round(r["max_rss_bytes"] / GiB, 2))
    from fbt_megatron.commands import train as entry

    planned = make_plan(entry.parse_args(["--recipe", TINY, *map(str, flags)]), 1)
    planned = planned.memory[planned.chosen].total
    [said] = re.findall(r"^memory at step 2: peak resident set (\S+) GiB on the largest rank; the planner estimated (\S+) GiB",
                        text, re.M)
    assert said == (f"{records[0]['max_rss_bytes'] / GiB:.2f}", f"{planned / GiB:.2f}"), said

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "run" / "tensorboard")).Reload()
    assert [e.value for e in events.Scalars("mem-max-rss-bytes")] == [r["max_rss_bytes"] for r in records]


def test_memory_is_the_largest_ranks(tmp_path):
    code, text = launch(tmp_path / "worker.log", DISTRIBUTED / "memory_worker.py", tmp_path, nproc=2)
    assert code == 0, text[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["largest"] == ranks[1]["largest"]  # one figure for the run, whichever rank logs
    big, small = ranks[0], ranks[1]
    assert big["own"]["rss_bytes"] > small["own"]["rss_bytes"] + 0.9 * big["held"]  # rank 0 holds its tensor
    for key in ("rss_bytes", "max_rss_bytes"):  # rank 0's own, read just before and after
        assert big["own"][key] <= big["largest"][key] <= big["own_after"][key] + 2**20, (key, big)


@pytest.mark.parametrize("where", ["cpu", "gpu"])
def test_a_run_this_node_cannot_hold_is_warned_of_before_it_starts(where, monkeypatch):
    from fbt_megatron.commands import train as entry

    recipe = entry.parse_args(["--recipe", TINY])
    plan = make_plan(recipe, 1)
    cpu_estimate = plan.memory[plan.chosen].total
    if where == "gpu":  # a GPU of 80 GiB holds it; one whose usable memory (less 1.5 GiB) is half the estimate does not
        monkeypatch.setattr(this_machine, "gpu_memory_gib", lambda: 80.0)
        estimate, warning = this_machine.estimate_here(recipe, 1)
        gpu_plan = make_plan(recipe, 1, gpu_memory_gb=float("inf"))
        assert warning is None and estimate == gpu_plan.memory[gpu_plan.chosen].total != cpu_estimate  # a GPU's terms
        monkeypatch.setattr(this_machine, "gpu_memory_gib", lambda: 1.5 + estimate / 2 / GiB)
        assert this_machine.estimate_here(recipe, 1) == (
            estimate, f"warning: the planner estimates {gib(estimate)} GiB per GPU, more than the {gib(estimate / 2)} GiB "
                      f"usable of this GPU: the run may stop with CUDA out of memory (python -m fbt_megatron.plan)")
        return
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.setattr(this_machine, "host_available_bytes", lambda: 4 * cpu_estimate)
    estimate, warning = this_machine.estimate_here(recipe, 1)
    assert estimate == cpu_estimate and "per process × 8 here" in warning and "out-of-memory killer" in warning, warning
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert this_machine.estimate_here(recipe, 1) == (estimate, None)


def test_log_timestamps_open_every_line_with_the_utc_time(tmp_path, small_corpus):
    """``--log-timestamps``: every line the run logs opens with its UTC time (each line of a message of
    several too), a step's line with its record's time once; without it only the steps' lines do."""
    flags = ["--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "2",
             "--log-interval", "1", "--eval-iters", "0", "--save", tmp_path / "run"]
    _, text = train(tmp_path / "run.log", *flags, "--log-timestamps", corpus=small_corpus)
    lines = [line for line in text.splitlines() if line.strip()]
    stamp = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ ")
    assert len(lines) > 8 and all(stamp.match(line) for line in lines), text[-3000:]
    steps = [line for line in lines if " step " in line and " | k " in line]
    records = read_metrics(tmp_path / "run")
    assert [line.split(" ", 1)[0] for line in steps] == [r["time_utc"] for r in records]
    assert not any(stamp.match(line.split(" ", 1)[1]) for line in steps)  # the step's own time, not twice


def _sockets() -> set:
    """This process's open sockets (their ``/proc/self/fd`` links)."""
    links = set()
    for fd in Path("/proc/self/fd").iterdir():
        try:
            links.add(str(fd.readlink()))
        except OSError:  # (the listing's own descriptor, closed by now)
            pass
    return {link for link in links if link.startswith("socket:")}


def test_the_planners_model_is_built_without_opening_a_socket():
    """The planner's private group (its meta model needs megatron's parallel state) is torch's fake
    backend: a gloo group's listening socket took a port of the moment, once the rendezvous port a
    4-process run's rank 0 was about to bind (EADDRINUSE); so runs of one process only were weighed."""
    from fbt_megatron.launch.plan import planner

    before = _sockets()
    with planner._single_process_group():
        during = _sockets()
    assert during == before, during - before


def test_a_run_of_two_processes_puts_the_planners_estimate_beside_its_first_peak(tmp_path, small_corpus):
    """DP 2: the 2-process plan's estimate (its busiest rank) beside the largest rank's peak, in one line."""
    flags = ["--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "2",
             "--log-interval", "2", "--eval-iters", "0"]
    data = ["--data-path", str(Path(small_corpus.train_prefix).parent), "--corpus", "null"]
    code, text = launch(tmp_path / "run.log", "-m", "fbt_megatron.train", "--recipe", TINY, "--threads", "1", *data, *flags,
                        "--save", tmp_path / "run", nproc=2)
    assert code == 0, text[-3000:]
    from fbt_megatron.commands import train as entry

    plan = make_plan(entry.parse_args(["--recipe", TINY, *flags]), 2)
    [(peak, planned)] = re.findall(r"^memory at step 2: peak resident set (\S+) GiB on the largest rank; the planner "
                                   r"estimated (\S+) GiB", text, re.M)
    assert (peak, planned) == (f"{read_metrics(tmp_path / 'run')[0]['max_rss_bytes'] / GiB:.2f}",
                               f"{plan.memory[plan.chosen].total / GiB:.2f}"), text[-3000:]
