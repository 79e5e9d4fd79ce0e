"""Training recipes: typed dataclasses loaded from YAML, with Megatron-style command-line overrides.

A recipe has one section per concern. Field names are Megatron-LM's argument names, so every field
is also a command-line flag of the same name (``train_iters`` ↔ ``--train-iters``); model fields
(``FBTConfig``) go under ``model:`` in YAML and are flags too (``--num-layers``, ``--feedback-jitter``).
Anything wrong (an unknown key, a wrong type, a value out of range, parallel sizes that do not fit
the world) raises ``RecipeError`` with one line naming the key, before any work is done. The
sections are ``sections``, the whole recipe ``recipe``, reading one ``loading`` (typed values:
``values``); the command line (grouped ``--help``, parsing, errors) is ``flags``, whose
descriptions are the sections' field docstrings and, for the model, ``model_fields``: FBTConfig's
fields as a table that ``model_table`` generates, read without torch.
"""

from fbt_megatron.common.errors import RecipeError
from fbt_megatron.recipe.loading import load_recipe, recipe_from_dict, yaml_error
from fbt_megatron.recipe.recipe import Recipe
from fbt_megatron.recipe.sections import SECTIONS, ModelSection, TrainingSection, at_least_one, nan_injections
from fbt_megatron.recipe.values import check, hints, model_hints

__all__ = ["SECTIONS", "ModelSection", "Recipe", "RecipeError", "TrainingSection", "at_least_one", "check", "hints", "load_recipe",
           "model_hints", "nan_injections", "recipe_from_dict", "yaml_error"]
