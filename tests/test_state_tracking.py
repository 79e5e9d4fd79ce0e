"""State tracking (``fbt_megatron.evaluation.tasks``): labels checked against independent computations, the
prepared folder read back as Megatron data, the full recurrence against decoding position by
position, and a short run through the entry points as users run them (real processes)."""

import itertools
import json
from pathlib import Path

import numpy
import pytest
import torch
from forked import run_commands
from helpers import build
from megatron.core.datasets.indexed_dataset import IndexedDataset

from fbt_megatron.data.state_tracking import GROUPS, load_task, prepare_task, task_name
from fbt_megatron.evaluation.tasks.evaluate import FULL, bucket_accuracy, bucket_labels, pass_logits
from fbt_megatron.model.fbt import Feedback

ROOT = Path(__file__).parent.parent


# ---------------------------------------------------------------- the generator
def test_cyclic_labels_are_running_sums():
    for name, n in (("parity", 2), ("sum_mod5", 5)):
        tokens, labels = GROUPS[name].sample(50, 40, seed=3)
        assert tokens.min() == 0 and tokens.max() == n - 1
        numpy.testing.assert_array_equal(labels, numpy.cumsum(tokens, axis=1) % n)
    tokens, labels = GROUPS["parity"].sample(20, 16, seed=4)
    numpy.testing.assert_array_equal(labels, numpy.bitwise_xor.accumulate(tokens, axis=1))


def test_s3_labels_are_running_compositions_of_permutation_matrices():
    """Element i is the i-th permutation of (0, 1, 2) in lexicographic order; the state after
    inputs x_1 … x_t is the permutation of the matrix product P(x_t) ⋯ P(x_1)."""
    perms = list(itertools.permutations(range(3)))
    matrices = [numpy.eye(3, dtype=int)[:, p] for p in perms]  # column i is e_{p(i)}: P(p) e_i = e_{p(i)}
    index = {m.tobytes(): i for i, m in enumerate(matrices)}
    tokens, labels = GROUPS["s3"].sample(30, 20, seed=5)
    for row, expected in zip(tokens, labels):
        state, got = numpy.eye(3, dtype=int), []
        for x in row:
            state = matrices[x] @ state
            got.append(index[state.tobytes()])
        assert got == expected.tolist()
    ab, ba = GROUPS["s3"].table[1, 2], GROUPS["s3"].table[2, 1]
    assert ab != ba  # not commutative: the order of composition matters


def test_task_names():
    assert task_name("state_tracking:s3") == "s3" and task_name("stdlib") is None and task_name(None) is None
    with pytest.raises(ValueError, match="unknown state-tracking task 'nope'"):
        task_name("state_tracking:nope")


# ---------------------------------------------------------------- the prepared folder
def test_prepared_task_is_megatron_data(tmp_path):
    folder = tmp_path / "parity"
    task = prepare_task("sum_mod5", str(folder), seq_length=12, sequences={"train": 40, "valid": 8})
    for split, count in (("train", 40), ("valid", 8)):
        tokens, labels = IndexedDataset(str(folder / f"{split}_tokens")), IndexedDataset(str(folder / f"{split}_labels"))
        assert len(tokens) == len(labels) == count
        rows = numpy.stack([tokens[i] for i in range(count)]).astype(int)
        assert rows.shape == (count, 12)
        numpy.testing.assert_array_equal(numpy.stack([labels[i] for i in range(count)]), numpy.cumsum(rows, axis=1) % 5)
    assert json.loads((folder / "task.json").read_text())["task"] == "sum_mod5"

    dataset = task.dataset("train", 12, num_samples=100, seed=7)
    samples = [dataset[i] for i in range(len(dataset))]
    assert len(samples) == 100
    first = samples[0]
    assert set(first) == {"tokens", "labels", "loss_mask"}
    assert first["tokens"].dtype == first["labels"].dtype == numpy.int64 and first["loss_mask"].tolist() == [1.0] * 12
    epoch = {tuple(s["tokens"]) for s in samples[:40]}
    assert len(epoch) == 40 and [tuple(s["tokens"]) for s in samples[40:80]] == [tuple(s["tokens"]) for s in samples[:40]]
    other_seed = task.dataset("train", 12, num_samples=40, seed=8)
    assert [tuple(other_seed[i]["tokens"]) for i in range(40)] != [tuple(s["tokens"]) for s in samples[:40]]

    before = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    assert prepare_task("sum_mod5", str(folder), seq_length=12) == task  # prepared: left as it is
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == before
    with pytest.raises(ValueError, match="holds the task sum_mod5 at length 12, not parity at 12"):
        prepare_task("parity", str(folder), seq_length=12)
    with pytest.raises(ValueError, match="sequences of length 12, not data.seq_length 16"):
        task.dataset("train", 16, num_samples=4, seed=0)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left
    assert load_task(str(folder)).vocabulary.padded_vocab_size(1, 8) == 8


# ---------------------------------------------------------------- the evaluation
def test_full_recurrence_equals_decoding_position_by_position():
    """k = T parallel passes against the sequential recurrence, computed here one position at a
    time: position t's input fuses the final state of position t − 1 (itself decoded that way)."""
    model = build(num_layers=2, sliding_window=None)
    model.eval()
    tokens = torch.randint(0, 5, (3, 10), generator=torch.Generator().manual_seed(0))
    batch, seq = tokens.shape
    with torch.no_grad():
        passes = list(pass_logits(model, tokens, seq))
        states, sequential = [], []
        for t in range(1, seq + 1):
            carried = torch.stack(states + [torch.zeros_like(states[0])]) if states else None  # row τ: state of τ
            feedback = None if carried is None else Feedback(carried, torch.arange(t).unsqueeze(1).expand(t, batch) >= 1)
            logits, top = model(tokens[:, :t], feedback=feedback)
            sequential.append(logits[:, -1])
            states.append(top[-1])
        sequential = torch.stack(sequential, dim=1)
    torch.testing.assert_close(passes[-1], sequential, rtol=1e-4, atol=1e-5)
    for j, logits in enumerate(passes, start=1):  # pass j is exact up to position j, not beyond
        torch.testing.assert_close(logits[:, :j], sequential[:, :j], rtol=1e-4, atol=1e-5)
    assert (passes[2][:, 4:] - sequential[:, 4:]).abs().max() > 1e-3  # three passes are not the recurrence


def test_bucket_accuracy_and_labels():
    per_position = [1.0] * 4 + [0.5] * 4 + [0.0] * 8
    assert bucket_accuracy(per_position, 4, [1, 2, 4]) == {"1x": 1.0, "2x": 0.5, "4x": 0.0}
    assert bucket_labels(["1x", "2x", "4x"], 32) == ["positions 1–32 (1x)", "33–64 (2x)", "65–128 (4x)"]


# ---------------------------------------------------------------- the entry points
def run_many(module: str, *runs) -> list:
    """(exit code, output) of ``python -m module *args`` for each (log, args), in order (each a
    process of its own: tests/forked.py)."""
    codes = run_commands(module, [(list(map(str, args)), log, None) for log, args in runs])
    return [(code, log.read_text()) for code, (log, _) in zip(codes, runs)]


@pytest.mark.slow
def test_state_tracking_trains_and_evaluates_through_the_entry_points(tmp_path):
    recipe = str(ROOT / "recipes" / "state_tracking_fbt.yaml")
    data = ["--corpus", "state_tracking:parity", "--data-path", str(tmp_path / "parity")]
    flags = ["--recipe", recipe, *data, "--threads", "1"]
    baseline = str(ROOT / "recipes" / "state_tracking_baseline.yaml")
    (code, text), (unknown_code, unknown_text) = run_many(
        "fbt_megatron.train",
        (tmp_path / "train.log", [*flags, "--train-iters", "12", "--log-interval", "4", "--eval-interval", "12",
                                  "--eval-iters", "1", "--save", tmp_path / "run"]),
        (tmp_path / "unknown.log", [*flags, "--corpus", "state_tracking:nope"]))
    assert code == 0, text[-3000:]
    assert "parity state tracking" in text and "valid " in text
    assert (tmp_path / "parity" / "train_tokens.bin").is_file()

    out = tmp_path / "eval.json"
    (code, text), *refused = run_many(
        "fbt_megatron.evaluation.tasks.evaluate",
        (tmp_path / "eval.log", [*flags, "--load", tmp_path / "run", "--sequences", "4", "--lengths", "1", "2", "--json", out]),
        (tmp_path / "other.log", ["--recipe", baseline, *data, "--load", tmp_path / "run"]),
        (tmp_path / "none.log", flags))
    assert code == 0, text[-3000:]
    result = json.loads(out.read_text())
    assert result["test_length"] == 64 and result["chance"] == 0.5
    assert list(result["accuracy"]) == ["0 fused", "1 fused", "2 fused", "3 fused", FULL]
    assert all(list(row) == ["1x", "2x"] for row in result["accuracy"].values())
    assert all(len(v) == 64 for v in result["by_position"].values())
    assert "| full recurrence |" in text

    bad = {
        "unknown task": ((unknown_code, unknown_text), "unknown state-tracking task 'nope'"),
        "another recipe's run": (refused[0], "is of another model"),
        "no run": (refused[1], "--load RUN"),
    }
    for name, ((code, text), message) in bad.items():
        errors = [line for line in text.splitlines() if line.startswith("error:")]
        assert code == 2 and len(errors) == 1 and message in errors[0], (name, text[-2000:])


def test_task_recipes_differ_only_in_the_feedback():
    from fbt_megatron.recipe import load_recipe

    fbt, base = (load_recipe(str(ROOT / "recipes" / f"state_tracking_{m}.yaml")).to_dict() for m in ("fbt", "baseline"))
    for section in ("data", "optimizer", "parallel", "checkpoint"):
        assert fbt[section] == base[section], section
    assert {**fbt["training"], "fused_prefill_passes": 0} == base["training"]
    feedback = {"latent_feedback", "feedback_jitter", "prefix_mixin_prob"}
    assert {k: v for k, v in fbt["model"].items() if k not in feedback} == {k: v for k, v in base["model"].items() if k not in feedback}
    assert fbt["model"]["sliding_window"] is None and fbt["data"]["corpus"] == "state_tracking:parity"
    assert fbt["passes"]["pass_phases"] == [{"start": 0.0, "mixture": {1: 0.5, 2: 0.3, 3: 0.2}}] and base["passes"]["pass_phases"] is None
