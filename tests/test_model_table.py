"""The command line without torch: the table of model fields it reads instead of ``FBTConfig``
(``fbt_megatron/recipe/model_fields.py``) is what the live dataclass gives, under the megatron-core
release it was written from (another's: the dataclass is read), and ``--help``, a bad flag and a
parse import neither torch nor megatron-core (real subprocesses, ``-X importtime``)."""

import difflib
import subprocess
import sys
from pathlib import Path

import pytest

from fbt_megatron.recipe import model_fields, model_hints, model_table
from fbt_megatron.recipe.values import live_model_hints, table_is_current

ROOT = Path(__file__).parent.parent
TINY = str(ROOT / "recipes" / "tiny_cpu.yaml")


def test_another_megatron_core_reads_the_dataclass(monkeypatch):
    """The table is of one megatron-core release (its fields differ between releases: 0.19's from
    0.16's): under another the command line reads the live dataclass, and parses what it accepts."""
    from fbt_megatron.recipe import flags, values

    monkeypatch.setattr(values, "MEGATRON_CORE", "0.0.0")
    model_hints.cache_clear()
    try:
        assert not table_is_current() and model_hints() == live_model_hints()
        recipe = flags.parse(["--recipe", TINY, "--num-layers", "3"], "t", "")
        assert recipe.model_overrides["num_layers"] == 3
    finally:
        model_hints.cache_clear()


@pytest.mark.skipif(not table_is_current(), reason="the table is of another megatron-core release (the test above)")
def test_the_model_table_is_what_fbtconfig_gives():
    written, live = model_table.PATH.read_text(), model_table.render()
    diff = "".join(difflib.unified_diff(written.splitlines(True), live.splitlines(True), "model_fields.py", "FBTConfig", n=0))
    assert written == live, f"{model_table.PATH} differs from FBTConfig: regenerate it with {model_table.COMMAND}\n{diff[:4000]}"
    assert model_hints() == live_model_hints()  # the types as written read back as the live ones
    # the values --help shows for a preset do not depend on the recipe's sequence length (the table has one)
    assert model_table.live_preset_values(seq_length=64) == model_fields.PRESET_VALUES


def imported(*args: str) -> tuple:
    """(exit code, the top-level packages imported) of ``python -X importtime *args`` in the repository."""
    run = subprocess.run([sys.executable, "-X", "importtime", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    names = {line.rsplit("|", 1)[1].strip().split(".")[0] for line in run.stderr.splitlines() if line.startswith("import time:")}
    return run.returncode, names


PARSE = f"from fbt_megatron.recipe.flags import parse; parse(['--recipe', {TINY!r}, '--num-layers', '2', '--lr', '1e-3'], 't', '')"


@pytest.mark.parametrize("args, code", [
    (["-m", "fbt_megatron.train", "--help"], 0),
    (["-m", "fbt_megatron.train", "--recipe", TINY, "--train-iter", "3"], 2),  # a bad flag: one line, at once
    (["-c", PARSE], 0),  # a recipe with model fields, and flags: torch loads only once the command needs it
], ids=["help", "bad flag", "parse"])
def test_the_command_line_imports_neither_torch_nor_megatron_core(args, code):
    exit_code, names = imported(*args)
    assert exit_code == code and "fbt_megatron" in names
    assert not names & {"torch", "megatron", "transformer_engine"}, sorted(names & {"torch", "megatron", "transformer_engine"})
