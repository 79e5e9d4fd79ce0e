"""The training command line as a person meets it (real subprocesses): a grouped, described
``--help`` (snapshot), and every mistake answered by one ``error:`` line."""

import re
from pathlib import Path

import pytest
from forked import run_commands

from fbt_megatron.recipe import RecipeError
from fbt_megatron.recipe.flags import parse
from fbt_megatron.common.processes import outside_group

ROOT = Path(__file__).parent.parent
SNAPSHOT = Path(__file__).parent / "snapshots" / "train_help.txt"
TINY = str(ROOT / "recipes" / "tiny_cpu.yaml")


def cli_many(folder: Path, *commands) -> list:
    """(exit code, stdout, stderr) of ``python -m fbt_megatron.train *args`` for each command (each a
    process of its own, tests/forked.py)."""
    files = [(folder / f"{i}.out", folder / f"{i}.err") for i in range(len(commands))]
    codes = run_commands("fbt_megatron.train", [(args, out, err) for args, (out, err) in zip(commands, files)])
    return [(code, out.read_text(), err.read_text()) for code, (out, err) in zip(codes, files)]


def test_help_is_grouped_described_and_typed(tmp_path):
    """Regenerate after an intended change: python -m fbt_megatron.train --help > tests/snapshots/train_help.txt"""
    (code, out, _), (code_recipe, with_recipe, _), (code_all, everything, _) = cli_many(
        tmp_path, ["--help"], ["--recipe", TINY, "--help"], ["--help-all"])
    assert code == 0
    assert out == SNAPSHOT.read_text(), "--help changed; see this test's docstring to update the snapshot"
    groups = [line[:-1] for line in out.splitlines() if line and not line.startswith(" ") and line.endswith(":")]
    assert groups == ["recipe", "training", "data", "model", "FBT passes and feedback",
                      "optimizer and learning-rate schedule", "parallelism and memory", "checkpoint", "logging"]
    assert "--moe-" not in out and len(out.splitlines()) < 300  # megatron-core's pass-through fields: --help-all

    assert code_recipe == 0 and "(default: 800)" in with_recipe  # the recipe's train_iters, not the dataclass's 100
    assert code_all == 0 and "--moe-router-topk INT" in everything and len(everything) > 2 * len(out)


MISTAKES = [
    (["--train-iter", "3"], "unknown flag --train-iter: did you mean --train-iters? (see --help)"),  # also: no abbreviations
    (["--lerning-rate", "1e-3"], "unknown flag --lerning-rate"),
    (["--lr", "-1e-3"], "optimizer.lr must be > 0, got -0.001"),  # scientific notation is a number
    (["--lr", "0"], "optimizer.lr must be > 0, got 0.0"),
    (["--lr"], "argument --lr: expected one argument (see --help)"),
    (["--train-iters", "4", "5"], "unexpected argument '5'"),
    (["--pass-phases", "[{start: 0.5"], "--pass-phases must be a list"),
]


@pytest.fixture(scope="module")
def mistakes(tmp_path_factory) -> list:
    return cli_many(tmp_path_factory.mktemp("mistakes"), *(["--recipe", TINY, *flags] for flags, _ in MISTAKES))


@pytest.mark.parametrize("case", range(len(MISTAKES)), ids=[message for _, message in MISTAKES])
def test_every_cli_mistake_is_one_line(case, mistakes):
    (_, message), (code, out, err) = MISTAKES[case], mistakes[case]
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


def test_torchrun_shows_the_first_failing_ranks_error_line():
    """Two ranks find the same bad flag; torchrun stops the other as soon as one exits (often
    before rank 0 has printed): the error line is shown once, then the rank that failed first."""
    import os
    import subprocess
    import sys

    env = outside_group()
    run = subprocess.run([sys.executable, "-m", "fbt_megatron.torchrun", "--nproc-per-node", "2", "--standalone", "-m",
                          "fbt_megatron.train", "--recipe", TINY, "--tensor-model-parallel-size", "3"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    lines = [line for line in run.stderr.splitlines() if line.startswith(("error:", "torchrun:", "Traceback"))]
    assert run.returncode == 2 and len(lines) == 2, run.stderr[-3000:]
    assert lines[0] == "error: tensor (3) x pipeline (1) x context (1) parallel size does not divide the world size 2"
    assert re.fullmatch(r"torchrun: rank [01] ended with exit code 2; torchrun stopped the other workers", lines[1])


def test_a_blend_of_another_vocabulary_is_one_line_at_start_and_in_the_preflight(tmp_path, small_corpus):
    """A blend whose token ids reach 999, with a 512-piece tokenizer: one line naming the prefix, the
    id, the tokenizer and the fix, from the training (exit 2, before any step) and from the Slurm
    preflight; the corpus's own blend passes, and validation on it says it reads the training data."""
    import numpy
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    from fbt_megatron.launch.slurm.preflight import vocabulary_problems
    from fbt_megatron.trainer.metrics import validation_note

    prefix, tokenizer = str(tmp_path / "other_text_document"), small_corpus.tokenizer_path
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.uint16)
    for start in range(0, 3000, 300):
        ids = (numpy.arange(start, start + 300) % 1000).astype(numpy.uint16)
        builder.add_document(ids, [ids.size])
    builder.finalize(prefix + ".idx")
    line = (f"data.train_data_path: {prefix} holds token id 999 but the tokenizer {tokenizer} has 512 ids: the blend was "
            f"tokenized with another vocabulary; give the tokenizer it was made with (--tokenizer-model) or tokenize it "
            f"again with this one (tools/preprocess_data.py --tokenizer {tokenizer})")
    flags = ["--recipe", TINY, "--data-path", "null", "--tokenizer-model", tokenizer, "--seq-length", "64"]
    [(code, out, err)] = cli_many(tmp_path, [*flags, "--train-data-path", f"[{prefix}]", "--save", str(tmp_path / "run")])
    assert code == 2 and err.splitlines() == ["error: " + line], err[-3000:]
    assert not list((tmp_path / "run").glob("iter_*"))

    assert vocabulary_problems(parse([*flags, "--train-data-path", f"[{prefix}]"], "t", "")) == [line]
    own = parse([*flags, "--train-data-path", f"[{small_corpus.train_prefix}]"], "t", "")
    assert vocabulary_problems(own) == []
    assert validation_note(None, own) == (
        "note: validation reads the training data (--train-data-path, no --valid-data-path): its loss is measured on "
        "sequences trained on; give --valid-data-path a held-out blend to measure generalization")
