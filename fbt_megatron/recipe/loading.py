"""A recipe from YAML (``load_recipe``) or from its sections as a dict (``recipe_from_dict``: a
checkpoint's record), every key and value checked: an unknown key or a wrong type is one
``RecipeError`` line naming it."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import yaml

from fbt_megatron.common.errors import RecipeError
from fbt_megatron.recipe.recipe import Recipe
from fbt_megatron.recipe.sections import SECTIONS, ModelSection
from fbt_megatron.recipe.values import check, hints, model_hints


def _section(cls, values, where: str):
    if values is None:
        return cls()
    if not isinstance(values, dict):
        raise RecipeError(f"{where} must be a mapping")
    types = hints(cls)
    unknown = sorted(set(values) - set(types))
    if unknown:
        raise RecipeError(f"unknown key {where}.{unknown[0]} (known: {', '.join(sorted(types))})")
    return cls(**{k: check(v, types[k], f"{where}.{k}") for k, v in values.items()})


def _model(values) -> tuple:
    values = dict(values or {})
    if not isinstance(values, dict):
        raise RecipeError("model must be a mapping")
    preset = check(values.pop("preset", ModelSection.preset), str, "model.preset")
    types = model_hints()
    overrides = {}
    for key, value in values.items():
        if key not in types:
            raise RecipeError(f"unknown key model.{key} (not an FBTConfig field a recipe can set)")
        overrides[key] = check(value, types[key], f"model.{key}")
    return ModelSection(preset=preset), overrides


def yaml_error(path, e: yaml.YAMLError) -> str:
    """PyYAML's error as one line with its place: ``path:LINE:COLUMN: problem (context at LINE:COLUMN)``."""
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
    context, start = getattr(e, "context", None), getattr(e, "context_mark", None)
    if context and start is not None:
        problem += f" ({context} from line {start.line + 1}, column {start.column + 1})"
    return f"{where}: not valid YAML: {problem}; fix the recipe file there"


def load_recipe(path: Optional[str]) -> Recipe:
    """Read and type-check a recipe file (None: all defaults)."""
    if path is None:
        raw = {}
    else:
        if not Path(path).is_file():
            raise RecipeError(f"recipe file not found: {path}")
        try:
            raw = yaml.safe_load(Path(path).read_text())
        except yaml.YAMLError as e:
            raise RecipeError(yaml_error(path, e)) from None
        if raw is None:  # empty, or only comments: not a run's recipe (every field would be a default)
            raise RecipeError(f"{path}: the recipe file is empty; give its sections (recipes/README.md), or drop --recipe "
                              f"to train on the defaults")
        if not isinstance(raw, dict):
            raise RecipeError(f"{path}: a recipe is a mapping of sections")
    return recipe_from_dict(raw)


def recipe_from_dict(raw: dict) -> Recipe:
    """A type-checked Recipe from its sections (a parsed recipe file, or ``Recipe.to_dict()`` as a
    checkpoint records it)."""
    unknown = sorted(set(raw) - set(SECTIONS) - {"model"})
    if unknown:
        raise RecipeError(f"unknown recipe section {unknown[0]!r} (known: model, {', '.join(SECTIONS)})")
    model, overrides = _model(raw.get("model"))
    sections = {name: _section(cls, raw.get(name), name) for name, cls in SECTIONS.items()}
    return Recipe(model=model, model_overrides=overrides, **sections)
