"""The training command line as a person meets it (real subprocesses): a grouped, described
``--help`` (snapshot), and every mistake answered by one ``error:`` line."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fbt_megatron.flags import parse
from fbt_megatron.recipe import RecipeError

ROOT = Path(__file__).parent.parent
SNAPSHOT = Path(__file__).parent / "snapshots" / "train_help.txt"
TINY = str(ROOT / "recipes" / "tiny_cpu.yaml")


def cli(*args):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    run = subprocess.run([sys.executable, "-m", "fbt_megatron.train", *args], capture_output=True, text=True,
                         cwd=ROOT, env=env, timeout=300)
    return run.returncode, run.stdout, run.stderr


def test_help_is_grouped_described_and_typed():
    """Regenerate after an intended change: python -m fbt_megatron.train --help > tests/snapshots/train_help.txt"""
    code, out, _ = cli("--help")
    assert code == 0
    assert out == SNAPSHOT.read_text(), "--help changed; see this test's docstring to update the snapshot"
    groups = [line[:-1] for line in out.splitlines() if line and not line.startswith(" ") and line.endswith(":")]
    assert groups == ["recipe", "training", "data", "model", "FBT passes and feedback",
                      "optimizer and learning-rate schedule", "parallelism and memory", "checkpoint", "logging"]
    assert "--moe-" not in out and len(out.splitlines()) < 250  # megatron-core's pass-through fields: --help-all

    code, with_recipe, _ = cli("--recipe", TINY, "--help")
    assert code == 0 and "(default: 800)" in with_recipe  # the recipe's train_iters, not the dataclass's 100
    code, everything, _ = cli("--help-all")
    assert code == 0 and "--moe-router-topk INT" in everything and len(everything) > 2 * len(out)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--train-iter", "3"], "unknown flag --train-iter: did you mean --train-iters? (see --help)"),  # also: no abbreviations
        (["--lerning-rate", "1e-3"], "unknown flag --lerning-rate"),
        (["--lr", "-1e-3"], "optimizer.lr must be > 0, got -0.001"),  # scientific notation is a number
        (["--lr", "0"], "optimizer.lr must be > 0, got 0.0"),
        (["--lr"], "argument --lr: expected one argument (see --help)"),
        (["--train-iters", "4", "5"], "unexpected argument '5'"),
        (["--pass-phases", "[{start: 0.5"], "--pass-phases must be a list"),
    ],
)
def test_every_cli_mistake_is_one_line(flags, message):
    code, out, err = cli("--recipe", TINY, *flags)
    assert code == 2 and out == "", (out, err)
    assert err.splitlines() == ["error: " + message] or (len(err.splitlines()) == 1 and message in err), err


def test_flag_values():
    base = ["--recipe", TINY]
    assert parse([*base, "--sequence-parallel"], "t", "").parallel.sequence_parallel is True  # a BOOL flag alone
    assert parse([*base, "--sequence-parallel", "false"], "t", "").parallel.sequence_parallel is False
    assert parse([*base, "--min-lr=-0.0"], "t", "").optimizer.min_lr == 0.0
    assert parse([*base, "--adam-beta1", "-1e-1"], "t", "").optimizer.adam_beta1 == -0.1
    with pytest.raises(RecipeError, match="unknown flag --seq: did you mean --seed"):
        parse([*base, "--seq", "64"], "t", "")


def test_a_short_run_of_a_long_recipe_clamps_its_warmup():
    recipe = parse(["--recipe", TINY, "--train-iters", "4"], "t", "")
    assert recipe.clamp_warmup() == ("note: --lr-warmup-iters 20 does not fit --train-iters 4: warmup clamped to 0 steps "
                                     "(a tenth of the run)")
    assert recipe.optimizer.lr_warmup_iters == 0 and recipe.clamp_warmup() is None
    long = parse(["--recipe", TINY, "--train-iters", "30"], "t", "")
    assert long.clamp_warmup() is None and long.optimizer.lr_warmup_iters == 20
