"""The paper's diagnostics (``fbt_megatron.diagnostics``) on tiny runs trained here: prefill
reproduces the validation losses training logged, fixed-point's ‖Δs‖ and losses agree with plain
``run_pass`` calls, probes read a state that is linearly there and are deterministic, decoding's
accuracies agree with ``tasks.evaluate`` where the modes coincide, and bad input is one line."""

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import launch

from fbt_megatron.evaluation.diagnostics import common, fixed_point, generation, prefill, probes
from fbt_megatron.trainer.callbacks.metrics_writer import read_metrics

ROOT = Path(__file__).parent.parent
TRAIN = ["fbt_megatron.train", "--threads", "1", "--train-iters", "4", "--eval-interval", "4", "--eval-iters", "1"]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def lm_run(tiny_run):
    return tiny_run


@pytest.fixture(scope="module")
def st_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("diagnostics") / "parity"
    code, text = launch(folder.parent / "st.log", *TRAIN, "--recipe", ROOT / "recipes/state_tracking_fbt.yaml", "--save", folder)
    assert code == 0, text[-3000:]
    return folder


@pytest.fixture(scope="module")
def lm(lm_run):
    return common.load(lm_run)


@pytest.fixture(scope="module")
def st(st_run):
    return common.load(st_run)


def logged_validation(folder) -> list:
    last = [r for r in read_metrics(folder) if "valid_loss_fused0" in r][-1]
    return [last[f"valid_loss_fused{n}"] for n in range(4) if f"valid_loss_fused{n}" in last]


# ---------------------------------------------------------------- prefill and fixed point
def test_prefill_reproduces_the_logged_validation_losses(lm_run, st_run, lm, st):
    result = prefill.prefill([lm, st])
    assert result["fused_passes"] == 3
    for folder, got in zip((lm_run, st_run), result["runs"]):
        assert len(got["losses"]) == 4 and not got["baseline"]
        assert got["losses"] == logged_validation(folder)  # bitwise: the same sequences, the same float32 ops


def test_fixed_point_agrees_with_plain_passes_and_with_prefill(lm_run, lm, tmp_path):
    from fbt_megatron.commands.diagnostics import main
    from fbt_megatron.model.fbt import Feedback, fuse_mask, run_pass

    assert main(["fixed-point", "--load", str(lm_run), "--output", str(tmp_path), "--max-passes", "5"]) == 0
    result = json.loads((tmp_path / "fixed-point.json").read_text())
    assert (tmp_path / "fixed-point.png").stat().st_size > 1000
    rows = result["rows"]
    assert [r["pass"] for r in rows] == [1, 2, 3, 4, 5] and rows[0]["state_delta"] is None
    assert rows[0]["loss"] == logged_validation(lm_run)[0]  # pass 1 = prefill's n = 0
    assert [r["loss"] for r in rows[:4]] == logged_validation(lm_run)  # pass n + 1 = n fused prefill passes

    # ‖Δs‖ of pass 2 from two run_pass calls on the same 16 validation sequences, all at once
    run = lm
    batches = common.validation(run).batches
    tokens = torch.cat([mb["tokens"] for batch in batches for mb in batch])
    feedback = lambda state, j: Feedback(state, fuse_mask(torch.zeros(len(tokens), dtype=torch.long), tokens.shape[1], "cpu"))  # noqa: E731
    with torch.no_grad():
        _, s1 = run_pass(run.model, tokens, None, 1, None, feedback)
        _, s2 = run_pass(run.model, tokens, None, 2, s1, feedback)
    assert rows[1]["state_delta"] == pytest.approx((s2 - s1).pow(2).mean().sqrt().item(), rel=1e-5)
    assert all(r["state_delta"] > 0 for r in rows[1:])


# ---------------------------------------------------------------- probes
def test_a_probe_reads_a_linearly_decodable_state():
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 3, (3000,), generator=g)
    direction = torch.randn(3, 16, generator=g)
    features = direction[labels] + 0.5 * torch.randn(3000, 16, generator=g)
    probe = probes.Probe(features[:2000], labels[:2000], 3)
    assert probe.accuracy(features[2000:], labels[2000:]) > 0.95
    noise = probes.Probe(torch.randn(2000, 16, generator=g), labels[:2000], 3)
    assert noise.accuracy(torch.randn(1000, 16, generator=g), labels[2000:]) < 0.45


def test_layer_outputs_are_the_stack_input_and_the_residual_stream(st):
    from fbt_megatron.model.fbt import default_feedback, run_pass

    run = st
    tokens = torch.randint(0, 2, (3, 32), generator=torch.Generator().manual_seed(1))
    outputs = probes.layer_outputs(run.model, tokens, [1, 3])
    assert outputs[1].shape == (3, 3 * 32, 64)  # input + 2 layers, b·s rows, hidden 64
    feedback = default_feedback(run.model, tokens, [0] * 3)
    with torch.no_grad():
        state = None
        for j in (1, 2, 3):
            _, state = run_pass(run.model, tokens, None, j, state, feedback)
            if j == 1:
                assert torch.equal(outputs[1][0], run.model.embed(tokens).transpose(0, 1).reshape(-1, 64))
                assert torch.equal(outputs[1][-1], state.transpose(0, 1).reshape(-1, 64))
    assert torch.equal(outputs[3][-1], state.transpose(0, 1).reshape(-1, 64))  # the last pass's top state


def test_probes_on_a_state_tracking_run_are_deterministic(st, tmp_path):
    run = st
    first = probes.probes(run, [1], train_sequences=128, test_sequences=128)
    again = probes.probes(run, [1], train_sequences=128, test_sequences=128)
    assert first == again
    assert list(first["accuracy"]) == ["standard", "1 fused"] and all(len(v) == 3 for v in first["accuracy"].values())
    # 4 training steps: no parity yet, but the probes are not below chance (position 0's state is its input)
    assert all(a > first["chance"] - 0.03 for v in first["accuracy"].values() for a in v)
    assert max(a for v in first["accuracy"].values() for a in v) >= first["chance"]
    probes.plot(first, tmp_path / "probes.png")
    assert (tmp_path / "probes.png").stat().st_size > 1000


# ---------------------------------------------------------------- generation
def test_decoding_accuracy_agrees_with_tasks_evaluate(st, tmp_path):
    from fbt_megatron.data.state_tracking import SPLIT_SEEDS
    from fbt_megatron.evaluation.tasks.evaluate import FULL, accuracy_by_position

    run = st
    one_token = generation.generation(run, [1], lengths=[1, 2], prompt_length=1, sequences=16)
    half = generation.generation(run, [1], lengths=[1, 2], prompt_length=16, sequences=16)
    task = common.state_tracking_task(run, "test")
    tokens, labels = (torch.from_numpy(a) for a in task.group.sample(16, 64, SPLIT_SEEDS["test"]))
    expected = accuracy_by_position(run.model, tokens, labels, 0)
    assert one_token["by_position"]["standard"] == expected["0 fused"]
    assert half["by_position"]["standard"] == expected["0 fused"]
    assert one_token["by_position"]["soft"] == expected[FULL]  # soft from one token = the full recurrence
    assert list(half["accuracy"]) == ["standard", "soft", "fused(1)"] and list(half["accuracy"]["soft"]) == ["1x", "2x"]
    generation.plot(half, tmp_path / "generation.png")
    assert (tmp_path / "generation.png").stat().st_size > 1000


# ---------------------------------------------------------------- bad input
def cli(*args):
    run = subprocess.run([sys.executable, "-m", "fbt_megatron.diagnostics", *map(str, args)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    return run.returncode, run.stderr.strip().splitlines()


def test_bad_input_is_one_error_line(lm_run, lm, st, tmp_path):
    code, err = cli("fixed-point", "--load", tmp_path / "missing", "--output", tmp_path / "out")
    assert code == 2 and len(err) == 1 and err[0].startswith("error:") and "no such run folder" in err[0]
    code, err = cli("probes", "--load", lm_run, "--output", tmp_path / "out")
    assert code == 2 and len(err) == 1 and err[0].startswith("error:") and "needs a state-tracking run" in err[0]

    from fbt_megatron.commands.diagnostics import main

    with pytest.raises(ValueError, match="--max-passes must be >= 1, got 0"):
        main(["fixed-point", "--load", str(lm_run), "--output", str(tmp_path / "out"), "--max-passes", "0"])
    with pytest.raises(ValueError, match="needs a state-tracking run"):
        generation.generation(lm)
    with pytest.raises(ValueError, match="--max-passes must be >= 1"):
        fixed_point.fixed_point(lm, 0)
    from helpers import build

    baseline = dataclasses.replace(st, model=build(0, num_layers=2, vocab_size=8, seq_length=32, latent_feedback=False).eval())
    with pytest.raises(ValueError, match="is a baseline"):
        probes.probes(baseline, [1])
    with pytest.raises(ValueError, match="is a baseline"):
        fixed_point.fixed_point(baseline, 4)
    with pytest.raises(ValueError, match="is a baseline"):
        generation.generation(baseline, [1])
    assert probes.probes(baseline, None, 32, 32)["accuracy"].keys() == {"standard"}  # the baseline's default: standard only
    assert prefill.prefill([baseline], 2, sequences=32)["runs"][0]["losses"].__len__() == 1  # a baseline has n = 0 only
    with pytest.raises(ValueError, match="--lengths"):
        generation.generation(st, [1], lengths=[2, 1])
    with pytest.raises(ValueError, match="--prompt-length"):
        generation.generation(st, [1], lengths=[1], prompt_length=32)
    with pytest.raises(ValueError, match="not both"):
        common.validation(st, eval_iters=1, sequences=4)
    with pytest.raises(ValueError, match="--sequences must be >= 1"):
        common.validation(st, sequences=0)
    assert math.isfinite(prefill.prefill([lm], 0, sequences=8)["runs"][0]["losses"][0])
