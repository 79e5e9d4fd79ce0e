"""Typed values: a YAML or command-line value checked against a field's type hint (``check``), and
the hints of the sections' and the model's settable fields."""

from __future__ import annotations

import functools
import importlib.metadata
import typing
from typing import Any, Dict, List, Literal

from fbt_megatron.common.errors import RecipeError
from fbt_megatron.recipe.model_fields import FIELDS, MEGATRON_CORE
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


def table_is_current() -> bool:
    """Whether ``model_fields`` was written from the megatron-core installed here (its fields differ
    between releases): then the command line reads it, else the live ``FBTConfig`` (torch loads)."""
    try:
        return importlib.metadata.version("megatron-core") == MEGATRON_CORE
    except importlib.metadata.PackageNotFoundError:
        return False


SIMPLE_TYPES = (bool, int, float, str, tuple)


def _settable(hint) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union:
        return all(a is type(None) or _settable(a) for a in args)
    return origin is Literal or hint in SIMPLE_TYPES


def live_model_hints() -> dict:
    """Type hints of the FBTConfig (and TransformerConfig) fields a recipe may set, from the dataclass:
    simple-typed ones, less those the recipe's sections own."""
    from fbt_megatron.model.config import FBTConfig

    owned = {name for cls in SECTIONS.values() for name in hints(cls)} | {"vocab_size"}  # set elsewhere
    return {n: h for n, h in typing.get_type_hints(FBTConfig).items() if _settable(h) and n not in owned}


@functools.cache
def model_hints() -> dict:
    """Type hints of the model fields a recipe may set: the table's (``model_fields``, no torch) where
    it is current (``table_is_current``), else the dataclass's (``live_model_hints``)."""
    return {name: hint for name, (hint, _) in FIELDS.items()} if table_is_current() else live_model_hints()
