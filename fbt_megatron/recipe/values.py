"""Typed values: a YAML or command-line value checked against a field's type hint (``check``), and
the hints of the sections' and the model's settable fields."""

from __future__ import annotations

import functools
import typing
from typing import Any, Dict, List, Literal

from fbt_megatron.common.errors import RecipeError
from fbt_megatron.recipe.sections import SECTIONS


def check(value, hint, key: str):
    """``value`` converted to the type ``hint``, or RecipeError naming ``key``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union:  # Optional[X]
        if value is None:
            return None
        return check(value, [a for a in args if a is not type(None)][0], key)
    if origin is Literal:
        if value not in args:
            raise RecipeError(f"{key} must be one of {list(args)}, got {value!r}")
        return value
    if origin in (list, List):
        if not isinstance(value, (list, tuple)):
            raise RecipeError(f"{key} must be a list, got {value!r}")
        return [check(v, args[0], key) for v in value] if args else list(value)
    if origin in (dict, Dict):
        if not isinstance(value, dict):
            raise RecipeError(f"{key} must be a mapping, got {value!r}")
        return {check(k, args[0], key): check(v, args[1], key) for k, v in value.items()}
    if hint is Any:
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise RecipeError(f"{key} must be true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise RecipeError(f"{key} must be an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise RecipeError(f"{key} must be a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise RecipeError(f"{key} must be a string, got {value!r}")
        return value
    if hint is tuple:
        if not isinstance(value, (list, tuple)):
            raise RecipeError(f"{key} must be a list, got {value!r}")
        return tuple(value)
    raise RecipeError(f"{key}: cannot be set from a recipe")


def hints(cls) -> dict:
    return typing.get_type_hints(cls)


_SIMPLE = (bool, int, float, str, tuple)


def _settable(hint) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union:
        return all(a is type(None) or _settable(a) for a in args)
    return origin is Literal or hint in _SIMPLE


@functools.cache
def model_hints() -> dict:
    """Type hints of the FBTConfig (and TransformerConfig) fields a recipe may set: simple-typed ones."""
    from fbt_megatron.model.config import FBTConfig

    owned = {name for cls in SECTIONS.values() for name in hints(cls)} | {"vocab_size"}  # set elsewhere
    return {n: h for n, h in typing.get_type_hints(FBTConfig).items() if _settable(h) and n not in owned}
