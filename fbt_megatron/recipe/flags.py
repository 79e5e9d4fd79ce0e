"""The training command line: every recipe field is a Megatron-style flag (``train_iters`` ↔
``--train-iters``), grouped, described, typed, with the recipe's value as its default.

Descriptions are the field docstrings of the recipe sections (``fbt_megatron.recipe``) and of
``FBTConfig`` / megatron-core's ``TransformerConfig``: one source of truth (the model's read from
``model_fields``, a table generated from them and checked against them, for the megatron-core it
was written from; another release's fields are read from the dataclass, torch loading). Parsing
then imports neither torch nor megatron-core, and neither does ``--help`` (with or without a recipe):
a model field's default shown is the value the recipe gives it (its override, else its preset's,
from that table), not what the config derives from it (``depth_scale``: null, meaning 1/√(2L)).
``--help`` shows the groups a run is made of; megatron-core's other ``TransformerConfig`` fields are
accepted as flags too and listed by ``--help-all``. Mistakes are one line: an unknown flag names
the closest valid one, abbreviations are refused, and a value may be a negative number (``--lr
-1e-3`` reaches the recipe's own check).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import functools
import inspect
import re
import sys
import textwrap
import typing
from typing import Any, Literal, Optional, Sequence

import yaml

from fbt_megatron.common.errors import RecipeError
from fbt_megatron.recipe import SECTIONS, ModelSection, Recipe, check, hints, load_recipe, model_hints
from fbt_megatron.recipe.model_fields import FIELDS, PRESET_VALUES
from fbt_megatron.recipe.values import table_is_current

# Model fields (FBTConfig / TransformerConfig) shown in --help, by group; every other settable
# field is a pass-through flag listed by --help-all.
ARCHITECTURE = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
    "sliding_window", "full_attention_every", "rotary_base", "depth_scale", "sandwich_norm",
    "headwise_attention_gate", "layernorm_epsilon", "init_method_std",
)
FEEDBACK = (
    "latent_feedback", "feedback_state", "feedback_jitter", "prefix_mixin_prob", "prefix_mixin_max_fraction",
    "pass_weights", "detach_feedback",
)
MEMORY = (
    "recompute_passes", "offload_recompute_inputs", "min_offloaded_tensor_size", "recompute_granularity",
    "recompute_method", "recompute_num_layers",
)
MODEL_SHOWN = (*ARCHITECTURE, *FEEDBACK, *MEMORY)
# (title, [(recipe section, field names)]) in the order --help prints them
GROUPS = [
    ("training", [("training", None)]),
    ("data", [("data", None)]),
    ("model", [("model", ("preset", *ARCHITECTURE))]),
    ("FBT passes and feedback", [("passes", None), ("model", FEEDBACK)]),
    ("optimizer and learning-rate schedule", [("optimizer", None)]),
    ("parallelism and memory", [("parallel", None), ("model", MEMORY)]),
    ("checkpoint", [("checkpoint", None)]),
    ("logging", [("logging", None)]),
]


REPEATABLE = ("inject_fault",)  # list fields whose flag may be given again: the values add up, in order

EPILOG = ("Values are YAML: --pass-phases '[{start: 0.75, passes: 2}]', --train-data-path '[0.7, a, 0.3, b]', "
          "null for none. A BOOL flag alone means true.")


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


# ---------------------------------------------------------------- descriptions and types
@functools.cache
def field_docs(cls) -> dict:
    """Field name → the first sentence of its attribute docstring, over the dataclass and its bases."""
    docs = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        except (OSError, TypeError, IndexError):
            continue
        for node, following in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                    and isinstance(following.value.value, str)):
                docs[node.target.id] = _first_sentence(following.value.value)
    return docs


def _first_sentence(text: str) -> str:
    text = " ".join(text.split())
    return re.split(r"(?<!e\.g)(?<!i\.e)\.\s+", text, maxsplit=1)[0].rstrip(".")


def metavar(hint) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union:
        return metavar(next(a for a in args if a is not type(None)))
    if origin is Literal:
        return "{" + ",".join(map(str, args)) + "}"
    if origin in (list, typing.List) or hint is tuple:
        return "LIST"
    if origin in (dict, typing.Dict):
        return "MAP"
    return {bool: "BOOL", int: "INT", float: "FLOAT", str: "STR"}.get(hint, "VALUE")


def show(value) -> str:
    """A default as the user would write it in YAML."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (dict, list, tuple)):
        return yaml.safe_dump(value if not isinstance(value, tuple) else list(value), default_flow_style=True).strip()
    return str(value)


# ---------------------------------------------------------------- the parser
class FlagParser(argparse.ArgumentParser):
    """argparse with every error as one ``RecipeError`` line (no usage block) and no abbreviations."""

    def __init__(self, **kwargs):
        super().__init__(allow_abbrev=False, **kwargs)

    def error(self, message):
        raise RecipeError(f"{message} (see --help)")


def given_model_values(preset: str, overrides: dict, names) -> dict:
    """The value a recipe of ``preset`` and model ``overrides`` gives each field in ``names``: its
    override, else the preset's, else this machine's choice (``given_fields``: CPU initialisation on
    a CPU), else FBTConfig's default; not what the config's ``__post_init__`` derives from it
    (``depth_scale`` None stays None). Imports megatron-core."""
    from fbt_megatron.model.config import field_default, given_fields

    try:
        given = given_fields(preset, **overrides)
    except ValueError as e:
        raise RecipeError(f"model: {e}") from None
    return {name: given[name] if name in given else field_default(name) for name in names}


def _model_values(recipe: Recipe, names) -> dict:
    """The value ``recipe`` gives each model field in ``names`` (``given_model_values``), the
    defaults --help shows: from the table (``model_fields``, no torch) where it is current and has
    the preset and ``names``, else from the model's config module (megatron-core; --help-all)."""
    table = PRESET_VALUES.get(recipe.model.preset, {}) if table_is_current() else {}
    if set(names) <= table.keys():
        return {name: recipe.model_overrides.get(name, table[name]) for name in names}
    return given_model_values(recipe.model.preset, recipe.model_overrides, names)


def _model_docs() -> dict:
    """The model fields' descriptions: the table's where it is current (``values.table_is_current``),
    else FBTConfig's docstrings (megatron-core)."""
    if table_is_current():
        return {name: doc for name, (_, doc) in FIELDS.items()}
    from fbt_megatron.model.config import FBTConfig

    return field_docs(FBTConfig)


def _describer(recipe: Recipe, types: dict, show_all: bool):
    """``describe(section, name)``: a flag's --help text, its field's description and ``recipe``'s value."""
    model = _model_values(recipe, model_hints() if show_all else MODEL_SHOWN)
    docs = {name: field_docs(cls) for name, cls in SECTIONS.items()}
    docs["model"] = {**_model_docs(), **field_docs(ModelSection)}
    fields = {name for section in types.values() for name in section}

    def describe(section: str, name: str) -> str:
        if section == "model":
            value = recipe.model.preset if name == "preset" else model[name]
        else:
            value = getattr(getattr(recipe, section), name)
        text = re.sub(r"``([^`]+)``", lambda m: flag(m[1]) if m[1] in fields else m[1], docs[section].get(name, ""))
        if not (value is None and "default" in text):  # the description says what null means
            text = f"{text} (default: {show(value)})".lstrip()
        return text

    return describe


def build_parser(recipe: Recipe, prog: str, description: str, show_all: bool, described: bool) -> FlagParser:
    """The parser of every recipe field; defaults shown are ``recipe``'s values. Not ``described``: a
    parser that only parses, its flags without descriptions (no model config: no megatron-core)."""
    parser = FlagParser(
        prog=prog, usage=f"{prog} [--recipe YAML] [--FLAG VALUE ...]", description=description, epilog=EPILOG,
        add_help=False, formatter_class=lambda prog: argparse.HelpFormatter(prog, max_help_position=36, width=100),
    )
    top = parser.add_argument_group("recipe")
    top.add_argument("-h", "--help", action="help", help="show the flags of a run and exit")
    top.add_argument("--help-all", action="help", help="also list megatron-core's TransformerConfig fields (accepted as flags)")
    top.add_argument("--recipe", metavar="YAML", help="recipe file (recipes/*.yaml); the flags below override it, "
                     "and the defaults shown are its values")
    types = {name: hints(cls) for name, cls in SECTIONS.items()}
    types["model"] = {"preset": str, **model_hints()}
    describe = _describer(recipe, types, show_all) if described else None
    shown = set()

    def add(group, section: str, name: str, hidden: bool = False):
        hint = types[section][name]
        extra = dict(nargs="?", const="true") if hint is bool else dict(action="append") if name in REPEATABLE else {}
        group.add_argument(flag(name), dest=f"{section}.{name}", default=None, metavar=metavar(hint),
                           help=describe(section, name) if describe and not hidden else argparse.SUPPRESS, **extra)
        shown.add((section, name))

    for title, members in GROUPS:
        group = parser.add_argument_group(title)
        for section, names in members:
            for name in names or types[section]:
                add(group, section, name)
    rest = parser.add_argument_group("model: megatron-core TransformerConfig fields") if show_all else parser
    for name in sorted(types["model"]):
        if ("model", name) not in shown:
            add(rest, "model", name, hidden=not show_all)
    return parser


def _join_negative_values(argv: Sequence[str]) -> list:
    """``--lr -1e-3`` → ``--lr=-1e-3``: argparse takes ``-1e-3`` for a flag (only plain negative
    numbers count as values there); every flag here takes one value, so a number after a flag is
    that flag's value."""
    out, i = [], 0
    while i < len(argv):
        token = argv[i]
        if (token.startswith("--") and "=" not in token and i + 1 < len(argv)
                and re.fullmatch(r"-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?|-inf|-nan", argv[i + 1])):
            out.append(f"{token}={argv[i + 1]}")
            i += 2
        else:
            out.append(token)
            i += 1
    return out


def _unknown(extra: list, parser: argparse.ArgumentParser) -> str:
    """One line about the first argument the parser did not take."""
    first = extra[0]
    if not first.startswith("-"):
        return f"unexpected argument {first!r}: every flag takes one value (see --help)"
    name = first.split("=", 1)[0]
    known = [s for action in parser._actions for s in action.option_strings if s.startswith("--")]
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    hint = f": did you mean {close[0]}?" if close else ""
    return f"unknown flag {name}{hint} (see --help)"


def apply_overrides(recipe: Recipe, args: argparse.Namespace) -> Recipe:
    """The recipe with every flag given on the command line applied (values are YAML scalars and
    lists, type-checked against the field)."""
    for dest, text in vars(args).items():
        if "." not in dest or text is None:
            continue
        section, name = dest.split(".", 1)
        value: Any = _yaml(text)
        if isinstance(text, list):  # a repeatable flag: every occurrence's values, in order
            value = [v for item in value for v in (item if isinstance(item, list) else [item])]
        where = flag(name)
        if section == "model":
            if name == "preset":
                recipe.model.preset = check(value, str, where)
            else:
                recipe.model_overrides[name] = check(value, model_hints()[name], where)
        else:
            target = getattr(recipe, section)
            setattr(target, name, check(value, hints(type(target))[name], where))
    return recipe


def _yaml(text):
    """A flag's value (or a repeated flag's values) as YAML; text that is not YAML stays text."""
    if isinstance(text, list):
        return [_yaml(t) for t in text]
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def parse(argv: Optional[Sequence[str]], prog: str, description: str) -> Recipe:
    """The recipe a command line asks for: ``--recipe`` loaded, the other flags applied."""
    argv = _join_negative_values(sys.argv[1:] if argv is None else list(argv))
    first = FlagParser(add_help=False)
    first.add_argument("--recipe")
    known, _ = first.parse_known_args(argv)
    recipe = load_recipe(known.recipe)
    # the descriptions (the model's defaults: its config, megatron-core's) only for a help to print;
    # the model's config is checked by Recipe.validate
    parser = build_parser(recipe, prog, description, show_all="--help-all" in argv,
                          described=not {"-h", "--help", "--help-all"}.isdisjoint(argv))
    args, extra = parser.parse_known_args(argv)
    if extra:
        raise RecipeError(_unknown(extra, parser))
    return apply_overrides(recipe, args)
