"""The command line without torch: the table of model fields it reads instead of ``FBTConfig``
(``fbt_megatron/recipe/model_fields.py``) is what the live dataclass gives, under the megatron-core
release it was written from (another's: the dataclass is read); the model values ``--help`` shows
for every shipped recipe are its model's config's (a field the config derives from None: None, said
so); and ``--help`` (with a recipe too), a bad flag and a parse import neither torch nor
megatron-core (real subprocesses, ``-X importtime``)."""

import difflib
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fbt_megatron.recipe import model_hints, model_table
from fbt_megatron.recipe.values import live_model_hints, table_is_current

ROOT = Path(__file__).parent.parent
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))
TINY = str(ROOT / "recipes" / "tiny_cpu.yaml")
SMALL = str(ROOT / "recipes" / "small_gpu.yaml")  # a preset's sizes overridden


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


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_help_shows_the_model_values_a_recipe_gives(path):
    """``--help`` shows, for each model field, the value the recipe gives it (no torch: the table and
    its overrides): its config's value, but where the config derives one from None (``depth_scale``:
    1/√(2L)), None, whose description says what None means; the live path (another megatron-core
    release, --help-all) gives the same values."""
    from fbt_megatron.model.config import recipe_config
    from fbt_megatron.recipe import load_recipe
    from fbt_megatron.recipe.flags import MODEL_SHOWN, _model_docs, _model_values, given_model_values

    recipe = load_recipe(str(path))
    shown = _model_values(recipe, MODEL_SHOWN)
    assert shown == given_model_values(recipe.model.preset, recipe.model_overrides, MODEL_SHOWN)
    config, docs, derived = recipe_config(recipe), _model_docs(), set()
    for name in MODEL_SHOWN:
        live = getattr(config, name)
        if shown[name] is None and live is not None:  # given None, derived by the config
            derived.add(name)
            assert re.search(r"\b(None|null)\b", docs[name]), f"{name}: shown null, its description does not say what null means"
        else:
            assert shown[name] == live, f"{path.name}: --help shows {name} {shown[name]!r}, its config has {live!r}"
    if "depth_scale" not in recipe.model_overrides:
        assert "depth_scale" in derived  # None: 1/√(2L) of the recipe's layers


def imported(*args: str) -> tuple:
    """(exit code, the top-level packages imported) of ``python -X importtime *args`` in the repository."""
    run = subprocess.run([sys.executable, "-X", "importtime", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    names = {line.rsplit("|", 1)[1].strip().split(".")[0] for line in run.stderr.splitlines() if line.startswith("import time:")}
    return run.returncode, names


PARSE = f"from fbt_megatron.recipe.flags import parse; parse(['--recipe', {TINY!r}, '--num-layers', '2', '--lr', '1e-3'], 't', '')"


@pytest.mark.parametrize("args, code", [
    (["-m", "fbt_megatron.train", "--help"], 0),
    (["-m", "fbt_megatron.train", "--recipe", TINY, "--help"], 0),  # recipes with model fields: the table and them
    (["-m", "fbt_megatron.train", "--recipe", SMALL, "--help"], 0),
    (["-m", "fbt_megatron.train", "--recipe", TINY, "--train-iter", "3"], 2),  # a bad flag: one line, at once
    (["-c", PARSE], 0),  # a recipe with model fields, and flags: torch loads only once the command needs it
], ids=["help", "help tiny_cpu", "help small_gpu", "bad flag", "parse"])
def test_the_command_line_imports_neither_torch_nor_megatron_core(args, code):
    exit_code, names = imported(*args)
    assert exit_code == code and "fbt_megatron" in names
    assert not names & {"torch", "megatron", "transformer_engine"}, sorted(names & {"torch", "megatron", "transformer_engine"})
