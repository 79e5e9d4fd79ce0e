"""Watching a run (fbt_megatron.monitoring): Weights & Biases offline, each layer's norms, the heartbeat.

* One real run (one process, k = 2 every step) with ``--wandb-project`` under ``WANDB_MODE=offline``
  (no network): the W&B run's own file (``run-ID.wandb``, read back record by record) holds, at
  every logged step, exactly the TensorBoard scalars of that step's ``metrics.jsonl`` record —
  the per-pass losses, validation and each layer's norms among them.
* Each layer's norms: the gradient norms put back together (√Σ‖g_layer‖²) are the global
  gradient norm megatron-core's optimizer computed; the parameter norms are those of the weights
  the run saved at that step, summed here from the checkpoint's full tensors; the same run at TP 2
  (two processes) logs the same norms: sharded weights counted once, duplicated ones (norms) once.
* The heartbeat: ``<save>/heartbeat.json`` names the last step, its tokens and checkpoint.
"""

import json
import math
import struct
from pathlib import Path

import pytest

from fbt_megatron.errors import RecipeError
from fbt_megatron.metrics import read_metrics, tensorboard_scalars
from fbt_megatron.monitoring.heartbeat import read_heartbeat
from helpers import launch

ROOT = Path(__file__).parent.parent
TINY = str(ROOT / "recipes" / "tiny_cpu.yaml")
ITERS = 4


def _flags(corpus, save):
    return ["--recipe", TINY, "--data-path", str(Path(corpus.train_prefix).parent), "--corpus", "null", "--seq-length", "64",
            "--micro-batch-size", "2", "--global-batch-size", "4", "--lr-warmup-iters", "1", "--threads", "1",
            "--pass-phases", "[{start: 0.0, passes: 2}]", "--fused-prefill-passes", "1", "--train-iters", ITERS,
            "--log-interval", "2", "--log-layer-norms-interval", "2", "--eval-interval", "2", "--eval-iters", "1",
            "--save-interval", "2", "--save", save]


@pytest.fixture(scope="module")
def wandb_run(small_corpus, tmp_path_factory, monkeypatch_module):
    monkeypatch_module.setenv("WANDB_MODE", "offline")
    monkeypatch_module.setenv("WANDB_SILENT", "true")
    folder = tmp_path_factory.mktemp("monitoring") / "run"
    code, out = launch(folder.parent / "run.log", "fbt_megatron.train", *_flags(small_corpus, folder),
                       "--wandb-project", "fbt-tests", "--wandb-exp-name", "offline-check")
    assert code == 0, out[-3000:]
    return folder


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


def test_wandb_offline_run_holds_the_tensorboard_scalars(wandb_run):
    runs = list((wandb_run / "wandb" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs
    files = list(runs[0].glob("run-*.wandb"))
    assert len(files) == 1
    history, config, names = {}, None, []
    for record in wandb_records(files[0]):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history[row.pop("_step")] = {k: v for k, v in row.items() if not k.startswith("_")}
        elif kind == "run":
            names.append((record.run.project, record.run.display_name))
            config = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.run.config.update}
    assert names == [("fbt-tests", "offline-check")]
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
    from fbt_megatron.monitoring.norms import layer_names
    from fbt_megatron.runs import load_run

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


def test_the_heartbeat_names_the_last_step_and_checkpoint(wandb_run):
    beat = read_heartbeat(wandb_run)
    assert {k: beat[k] for k in ("step", "train_iters", "last_checkpoint")} == {
        "step": ITERS, "train_iters": ITERS, "last_checkpoint": f"iter_{ITERS:07d}"}
    assert beat["tokens"] == read_metrics(wandb_run)[-1]["tokens"] and beat["time"] > 0 and beat["pid"] > 0
    assert not list(wandb_run.glob("heartbeat.json.tmp"))


def test_a_missing_wandb_package_is_one_line(monkeypatch):
    import sys

    from fbt_megatron.monitoring.wandb_writer import require_wandb

    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    with pytest.raises(RecipeError, match=r"^--wandb-project needs the wandb package, which is not installed: pip install wandb"):
        require_wandb()
