"""Watching a run (fbt_megatron.trainer.callbacks): Weights & Biases offline, each layer's norms, the
heartbeat, the rank → node record, stragglers.

* One real run (one process, k = 2 every step) with ``--wandb-project`` under ``WANDB_MODE=offline``
  (no network), stopped after step 2 (``--exit-interval``) and resumed: the resume continues the
  same W&B run (the id kept in ``<save>/wandb_run_id``), and the W&B run's own files
  (``run-ID.wandb``, read back record by record) hold, at every logged step, exactly the
  TensorBoard scalars of that step's ``metrics.jsonl`` record — the per-pass losses, validation and
  each layer's norms among them. Online without an API key: one line at start-up, exit 2.
* Each layer's norms: the gradient norms put back together (√Σ‖g_layer‖²) are the global
  gradient norm megatron-core's optimizer computed; the parameter norms are those of the weights
  the run saved at that step, summed here from the checkpoint's full tensors; the same run at TP 2
  (two processes) logs the same norms: sharded weights counted once, duplicated ones (norms) once.
* The heartbeat: ``<save>/heartbeat.json`` names the last step, its tokens and checkpoint; a run
  killed (``crash@4``) after the checkpoint of step 3 leaves a heartbeat naming step 3 and that
  checkpoint, not the one before.
* Stragglers on 2 ranks: ``slow@3:1`` makes rank 1 spend 1 s of CPU in each step from 3; the logged steps
  4 and 6 name it and its node (``SLURMD_NODENAME``) in the log, ``metrics.jsonl`` and
  ``<save>/stragglers.jsonl``, step 2 does not; the same run without the fault names nobody and
  logs the same losses bit for bit. Both write ``<save>/ranks.json`` (every rank's node, local rank, pid).
  On a GPU a rank's own time is its wall time less the time its GPU ran communication kernels and
  none of its own (the wait for a slow tensor-, context- or pipeline-parallel peer): what a profile
  of kernels gives, checked on events as torch's profiler reports them.
"""

import calendar
import json
import math
import os
import re
import socket
import struct
import time
from pathlib import Path

import pytest
import torch
from forked import run_commands, run_ranks
from helpers import launch

from fbt_megatron.common.errors import RecipeError
from fbt_megatron.trainer.callbacks.heartbeat import read_heartbeat
from fbt_megatron.trainer.ranks import read_ranks
from fbt_megatron.trainer.callbacks.stragglers import read_stragglers
from fbt_megatron.trainer.callbacks.metrics_writer import read_metrics
from fbt_megatron.trainer.scalars import tensorboard_scalars

ROOT = Path(__file__).parent.parent
TINY = str(ROOT / "recipes" / "tiny_cpu.yaml")
ITERS = 4


def _flags(corpus, save):
    return ["--recipe", TINY, "--data-path", str(Path(corpus.train_prefix).parent), "--corpus", "null", "--seq-length", "64",
            "--micro-batch-size", "2", "--global-batch-size", "4", "--lr-warmup-iters", "1", "--threads", "1",
            "--pass-phases", "[{start: 0.0, passes: 2}]", "--fused-prefill-passes", "1", "--train-iters", ITERS,
            "--log-interval", "2", "--log-layer-norms-interval", "2", "--eval-interval", "2", "--eval-iters", "1",
            "--save-interval", "2", "--save", save]


NO_KEY = ("error: --wandb-project fbt-tests: W&B's online mode needs an API key and none is set (no WANDB_API_KEY, no "
          "netrc entry from wandb login): set WANDB_API_KEY, or use --wandb-mode offline (wandb sync uploads the run later)")


GOODPUT = [{"productive": 10.0, "start-up": 5.5}, {"productive": 2.5, "in-job restarts": 4.0}]


@pytest.fixture(scope="module")
def runs(small_corpus, tmp_path_factory, monkeypatch_module):
    """The one-process runs of this module (tests/forked.py), W&B offline and without an API key:
    the W&B run in two parts, online without a key, and a run killed at the start of step 4."""
    base = tmp_path_factory.mktemp("monitoring")
    monkeypatch_module.setenv("WANDB_MODE", "offline")
    monkeypatch_module.setenv("WANDB_SILENT", "true")
    monkeypatch_module.delenv("WANDB_API_KEY", raising=False)
    monkeypatch_module.setenv("NETRC", str(base / "no-netrc"))
    folder, wandb = base / "run", ["--wandb-project", "fbt-tests", "--wandb-exp-name", "offline-check"]
    commands = {
        "first": [*_flags(small_corpus, folder), *wandb, "--exit-interval", "2"],
        "resumed": [*_flags(small_corpus, folder), *wandb, "--load", folder],
        "online": [*_flags(small_corpus, base / "online"), *wandb, "--wandb-mode", "online"],
        "crash": [*_flags(small_corpus, base / "crash"), "--train-iters", "6", "--save-interval", "3", "--heartbeat-interval", "0",
                  "--inject-fault", "crash@4"],
    }
    folder.mkdir()  # a Slurm job's record of its attempts' goodput (launch/attempts.py): the resumed W&B run's summary
    (folder / "jobs.jsonl").write_text("".join(json.dumps({"job_id": 3, "goodput": g}) + "\n" for g in GOODPUT))
    codes = run_commands("fbt_megatron.train", [(list(map(str, argv)), base / f"{name}.log", None) for name, argv in commands.items()])
    return base, {name: (code, (base / f"{name}.log").read_text()) for name, code in zip(commands, codes)}


@pytest.fixture(scope="module")
def wandb_run(runs):
    base, results = runs
    for name in ("first", "resumed"):
        code, out = results[name]
        assert code == 0 and "Traceback" not in out, out[-3000:]
    return base / "run"


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def wandb_records(path: Path):
    """The protobuf records of a W&B run file (``run-ID.wandb``): W&B's LevelDB-style log of 32 KiB
    blocks, each record a 7-byte header (CRC32, length, type: full, first, middle, last) and its data."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    ident, _, _ = struct.unpack("<4sHB", data[:7])
    assert ident == b":W&B"
    pos, block, parts = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            break
        parts += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # full, last
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            parts = b""
            yield record


def test_wandb_offline_run_is_resumed_and_holds_the_tensorboard_scalars(wandb_run):
    run_id = (wandb_run / "wandb_run_id").read_text().strip()
    runs = sorted((wandb_run / "wandb" / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(r.name.endswith(f"-{run_id}") for r in runs), (run_id, runs)  # the resume: the same run
    history, config, names, summary = {}, None, [], {}
    for run in runs:
        [file] = run.glob(f"run-{run_id}.wandb")
        for record in wandb_records(file):
            kind = record.WhichOneof("record_type")
            if kind == "history":
                row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
                history[row.pop("_step")] = {k: v for k, v in row.items() if not k.startswith("_")}
            elif kind == "summary":
                summary.update({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.summary.update})
            elif kind == "run":
                names.append((record.run.project, record.run.display_name, record.run.run_id))
                config = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.run.config.update}
    assert names == [("fbt-tests", "offline-check", run_id)] * 2
    assert {k: v for k, v in summary.items() if k.startswith("goodput/")} == {  # the Slurm job's attempts so far
        "goodput/productive seconds": 12.5, "goodput/start-up seconds": 5.5, "goodput/in-job restarts seconds": 4.0}
    assert config["training"]["train_iters"] == ITERS and config["passes"]["pass_phases"] == [{"start": 0.0, "passes": 2}]
    records = read_metrics(wandb_run)
    assert [r["step"] for r in records] == sorted(history) == [2, 4]
    for r in records:
        expected = tensorboard_scalars(r)
        assert {"fbt/lm loss pass1", "fbt/lm loss pass2", "lm loss validation", "params-norm/decoder.layers.0",
                "grad-norm/decoder.layers.1"} <= set(expected)
        assert history[r["step"]] == pytest.approx(expected, rel=1e-12), r["step"]


def _reference_param_norms(folder, iteration):
    """Each layer's parameter norm from the checkpoint's full tensors (one process, no sharding)."""
    from fbt_megatron.inference.runs import load_run
    from fbt_megatron.trainer.norms import layer_names

    model = load_run(str(folder), iteration).model
    sums = {}
    for param, name in layer_names(model).items():
        sums[name] = sums.get(name, 0.0) + float(param.detach().double().square().sum())
    return {name: math.sqrt(v) for name, v in sums.items()}


def test_layer_norms_add_up_and_are_the_saved_weights_and_the_same_at_tp2(wandb_run, small_corpus, tmp_path):
    records = read_metrics(wandb_run)
    for r in records:
        layers = r["grad_norms"]
        assert len(layers) >= 4 and any(name.startswith("decoder.layers.") for name in layers)
        assert math.sqrt(sum(v * v for v in layers.values())) == pytest.approx(r["grad_norm"], rel=1e-5)
    assert records[-1]["param_norms"] == pytest.approx(_reference_param_norms(wandb_run, ITERS), rel=1e-6)

    tp2 = tmp_path / "tp2"
    code, out = launch(tmp_path / "tp2.log", "-m", "fbt_megatron.train", *_flags(small_corpus, tp2),
                       "--tensor-model-parallel-size", "2", nproc=2)
    assert code == 0, out[-3000:]
    for one, two in zip(records, read_metrics(tp2), strict=True):
        for kind in ("param_norms", "grad_norms"):
            assert two[kind] == pytest.approx(one[kind], rel=1e-4), (kind, one["step"])


def test_online_wandb_without_an_api_key_is_one_line_at_start_up(runs):
    base, results = runs
    code, out = results["online"]
    assert code == 2 and [line for line in out.splitlines() if line.startswith("error:")] == [NO_KEY], out[-3000:]
    assert "Traceback" not in out and not (base / "online").exists()  # refused before anything is written


def test_an_api_key_is_found_in_the_environment_or_netrc(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from fbt_megatron.recipe.wandb_check import check_wandb

    logging = SimpleNamespace(wandb_project="p", wandb_mode=None)
    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL", "WANDB_MODE"):
        monkeypatch.delenv(name, raising=False)
    netrc = tmp_path / "netrc"
    netrc.write_text("machine example.org login user password x\n")
    monkeypatch.setenv("NETRC", str(netrc))
    with pytest.raises(RecipeError, match="^--wandb-project p: W&B's online mode needs an API key"):
        check_wandb(logging)
    check_wandb(SimpleNamespace(wandb_project="p", wandb_mode="offline"))  # no key needed
    netrc.write_text("machine api.wandb.ai login user password 0123456789abcdef0123456789abcdef01234567\n")
    check_wandb(logging)
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.org")  # a W&B server of one's own: its entry
    with pytest.raises(RecipeError):
        check_wandb(logging)
    monkeypatch.setenv("WANDB_API_KEY", "0123456789abcdef0123456789abcdef01234567")
    check_wandb(logging)


def test_the_heartbeat_names_the_last_step_and_checkpoint(wandb_run):
    beat = read_heartbeat(wandb_run)
    assert {k: beat[k] for k in ("step", "train_iters", "last_checkpoint")} == {
        "step": ITERS, "train_iters": ITERS, "last_checkpoint": f"iter_{ITERS:07d}"}
    assert beat["tokens"] == read_metrics(wandb_run)[-1]["tokens"] and beat["time"] > 0 and beat["pid"] > 0
    assert not list(wandb_run.glob("*.tmp"))


def test_the_heartbeat_of_a_killed_run_names_the_checkpoint_of_its_last_step(runs):
    """Killed (kill -9) at the start of step 4, after step 3 and its checkpoint: the heartbeat,
    written after every step (--heartbeat-interval 0) once its checkpoint is complete, names both."""
    base, results = runs
    code, out = results["crash"]
    assert code == -9 and "--inject-fault crash@4:0: rank 0 dies (SIGKILL) at the start of step 4" in out, out[-3000:]
    beat = read_heartbeat(base / "crash")
    assert {k: beat[k] for k in ("step", "train_iters", "last_checkpoint")} == {
        "step": 3, "train_iters": 6, "last_checkpoint": "iter_0000003"}


def test_a_missing_wandb_package_is_one_line(monkeypatch):
    import sys

    from fbt_megatron.recipe.wandb_check import require_wandb

    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    with pytest.raises(RecipeError, match=r"^--wandb-project needs the wandb package, which is not installed: pip install wandb"):
        require_wandb()


class _Event:
    """A profiler event as torch's kineto results give them (``_KinetoEvent``)."""

    def __init__(self, name, start, end, device="cuda", activity="kernel"):
        from torch.autograd import DeviceType

        self._name, self._start, self._end, self._activity = name, start, end, activity
        self._device = DeviceType.CUDA if device == "cuda" else DeviceType.CPU

    def name(self):
        return self._name

    def start_ns(self):
        return self._start

    def end_ns(self):
        return self._end

    def device_type(self):
        return self._device

    def activity_type(self):
        return self._activity


def test_a_gpu_ranks_own_time_leaves_out_the_communication_that_waits_for_peers():
    """A step on a GPU whose tensor-parallel all-reduce waits 20 µs for a slow peer: the NCCL kernel
    spans the wait, during which the GPU runs nothing of its own; an all-reduce overlapped by the
    rank's own kernels (gradient buckets during the backward) hides nothing; copies, host events and
    host gaps (a slow host is the rank's own time) are not communication. Then the same on the
    events torch's profiler records here (host ones only: none of them communication)."""
    from torch.profiler import ProfilerActivity, profile

    from fbt_megatron.trainer.callbacks.stragglers import exposed_communication_seconds

    us = 1000
    events = [_Event("ampere_bf16_s16816gemm_bf16_128x128", 0, 10 * us),
              _Event("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 5 * us, 30 * us),
              _Event("void at::native::vectorized_elementwise_kernel<4>", 30 * us, 40 * us),
              _Event("ncclKernel_ReduceScatter_RING_LL_Sum_float", 32 * us, 38 * us),  # NCCL before 2.19, overlapped
              _Event("Memcpy DtoH (Device -> Pinned)", 40 * us, 60 * us, activity="gpu_memcpy"),
              _Event("aten::mm", 0, 100 * us, device="cpu", activity="cpu_op"),
              _Event("void flash_fwd_kernel<Flash_fwd_kernel_traits>", 70 * us, 80 * us)]  # after a host gap
    assert exposed_communication_seconds(events) == 20e-6
    assert exposed_communication_seconds([e for e in events if "nccl" not in e.name()]) == 0.0
    assert exposed_communication_seconds(events[4:6]) is None  # no kernel: not measured
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.ones(8).sum()
    assert exposed_communication_seconds(prof.profiler.kineto_results.events()) is None


STRAGGLER = ["--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "4", "--lr-warmup-iters", "2",
             "--log-interval", "2", "--eval-iters", "0", "--threads", "1", "--train-iters", "6"]
STRAGGLER_LINE = re.compile(r"^step (\d+): straggler rank 1 on node n7 \(\S+ s, \S+×\): own time per step over steps "
                            r"(\d+)-(\d+) against the median \S+ s of 2 ranks \(--straggler-threshold 1.5\)$", re.M)


@pytest.mark.slow
def test_a_slow_rank_is_named_with_its_node_and_changes_no_loss(small_corpus, tmp_path, monkeypatch):
    data = ["--data-path", str(Path(small_corpus.train_prefix).parent), "--corpus", "null"]
    started = time.time()
    monkeypatch.setenv("SLURMD_NODENAME", "n7")  # the slow run's ranks, as on a Slurm node
    slow = run_ranks(["-m", "fbt_megatron.train", "--recipe", TINY, *data, *STRAGGLER, "--save", str(tmp_path / "slow"),
                      "--inject-fault", "slow@3:1"], 2, tmp_path / "slow.log")
    monkeypatch.delenv("SLURMD_NODENAME")
    plain = run_ranks(["-m", "fbt_megatron.train", "--recipe", TINY, *data, *STRAGGLER, "--save", str(tmp_path / "plain")],
                      2, tmp_path / "plain.log")
    logs = {name: (tmp_path / f"{name}.log").read_text() for name in ("slow", "plain")}
    assert slow == 0 and plain == 0, logs["slow"][-3000:] + logs["plain"][-3000:]

    named = read_stragglers(tmp_path / "slow")
    assert [(s["step"], s["rank"], s["node"]) for s in named] == [(4, 1, "n7"), (6, 1, "n7")]  # steps 3-4, 5-6; not 1-2
    for s in named:
        assert s["step_time"] > 1.0 and s["ratio"] == s["step_time"] / s["median"] > 1.5, s  # the busy loop is its own time
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", s["time"]), s
    records = read_metrics(tmp_path / "slow")
    assert [r["step"] for r in records] == [2, 4, 6] and "stragglers" not in records[0]
    assert [r["stragglers"] for r in records[1:]] == [[{k: v for k, v in s.items() if k not in ("time", "step")}] for s in named]
    assert tensorboard_scalars(records[1])["stragglers/rank1"] == named[0]["ratio"]  # TensorBoard's and W&B's tag
    assert [m.groups() for m in STRAGGLER_LINE.finditer(logs["slow"])] == [("4", "3", "4"), ("6", "5", "6")], logs["slow"][-3000:]

    assert not (tmp_path / "plain" / "stragglers.jsonl").exists() and "straggler" not in logs["plain"]
    assert not any("stragglers" in r for r in read_metrics(tmp_path / "plain"))
    keys = ["k", "loss", "pass_losses", "state_deltas", "lr", "grad_norm", "skipped_steps"]
    assert [{k: r[k] for k in keys} for r in records] == [{k: r[k] for k in keys} for r in read_metrics(tmp_path / "plain")]

    for name, node in (("slow", "n7"), ("plain", socket.gethostname())):
        ranks = read_ranks(tmp_path / name)
        assert ranks["world_size"] == 2 and calendar.timegm(time.strptime(ranks["started"], "%Y-%m-%dT%H:%M:%SZ")) >= int(started)
        assert [(r["rank"], r["node"], r["local_rank"]) for r in ranks["ranks"]] == [(0, node, 0), (1, node, 1)]
        pids = [r["pid"] for r in ranks["ranks"]]
        assert len(set(pids)) == 2 and os.getpid() not in pids, pids
    print(f"\nslow@3:1 on 2 ranks: {STRAGGLER_LINE.search(logs['slow'])[0]}; without it nobody is named and the losses "
          f"are equal bit for bit")
