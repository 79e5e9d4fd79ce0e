"""A trained run as one CPU process: what generation, conversion and evaluation start from.

Every checkpoint records the recipe it was trained with and the embedding's vocabulary size
(``checkpointing.TrainState``), so a run folder alone rebuilds its model: fp32, megatron-core's local
spec, no tensor or pipeline parallelism, whatever layout it was saved from (``dist_checkpointing``
reshards on load). Like Megatron-LM, the tokenizer is not copied into the run folder: it is the
recipe's (the corpus's tokenizer file, or a state-tracking task's vocabulary), found where the run
was trained, or given with ``tokenizer_model``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from fbt_megatron.common.errors import RecipeError
from fbt_megatron.recipe import Recipe, recipe_from_dict


@dataclass
class Run:
    folder: str
    iteration: int
    recipe: Recipe  # as trained (its last stretch)
    model: torch.nn.Module  # FBTModel, eval mode, fp32, one process
    tokenizer: object  # tokenize(text) -> ids, detokenize(ids) -> text, eod, vocab_size
    tokenizer_path: Optional[str]  # the tokenizer file (None for a state-tracking vocabulary)


def run_recipe(folder: str, iteration: Optional[int] = None) -> tuple:
    """(recipe, train_state) recorded with a checkpoint of ``folder`` (the latest, or ``iteration``'s)."""
    from fbt_megatron.trainer import checkpointing

    if not Path(folder).is_dir():
        raise RecipeError(f"--load {folder}: no such run folder")
    if iteration is None and checkpointing.latest_iteration(folder) is None:
        raise RecipeError(f"--load {folder}: the folder holds no checkpoint (iter_*)")
    state = checkpointing.read_train_state(folder, iteration=iteration)
    if not state.get("recipe"):
        raise RecipeError(f"the checkpoint in {folder} does not record its recipe (written by an older fbt-megatron): "
                          "resume it for one step with the current version to record it")
    return recipe_from_dict(state["recipe"]), state


def build_inference_model(config):
    """An FBTModel on megatron-core's local spec (no Transformer Engine), eval mode."""
    from fbt_megatron.model.fbt_model import FBTModel, fbt_model_spec

    return FBTModel(config, spec=fbt_model_spec(config, use_transformer_engine=False)).eval()


def load_tokenizer_of(recipe: Recipe, tokenizer_model: Optional[str] = None) -> tuple:
    """(tokenizer, file) of the run: ``tokenizer_model`` if given, else the recipe's."""
    from fbt_megatron.data import state_tracking
    from fbt_megatron.data.corpus import load_corpus
    from fbt_megatron.data.tokenizer import load_tokenizer

    d = recipe.data
    path = tokenizer_model or d.tokenizer_model
    if path is None:
        if state_tracking.task_name(d.corpus) or state_tracking.is_task_folder(d.data_path):
            if not state_tracking.is_task_folder(d.data_path):
                raise RecipeError(f"the run's task folder {d.data_path} is missing: run from where it was trained")
            return state_tracking.load_task(d.data_path).vocabulary, None
        try:
            path = load_corpus(d.data_path).tokenizer_path
        except (OSError, ValueError):
            raise RecipeError(f"the run's corpus {d.data_path} is missing: run from where it was trained, "
                              "or give its tokenizer file with --tokenizer-model") from None
    if not Path(path).is_file():
        raise RecipeError(f"tokenizer file {path} not found: give it with --tokenizer-model")
    return load_tokenizer(path), str(Path(path).resolve())


def load_run(folder: str, iteration: Optional[int] = None, tokenizer_model: Optional[str] = None) -> Run:
    """The run's model with the weights of its latest (or ``iteration``'s) checkpoint, and its
    tokenizer. Initialises a one-process megatron parallel state if none is up."""
    from fbt_megatron.common import platform
    from fbt_megatron.model.config import recipe_config
    from fbt_megatron.trainer import checkpointing

    recipe, state = run_recipe(folder, iteration)
    tokenizer, tokenizer_path = load_tokenizer_of(recipe, tokenizer_model)
    platform.init_distributed(1, 1, recipe.training.seed)
    model = build_inference_model(recipe_config(recipe, state["vocab_size"]))  # fp32: make_config's default
    checkpointing.load(folder, model, None, None, iteration=iteration)
    return Run(folder, state["iteration"], recipe, model.eval(), tokenizer, tokenizer_path)


def describe(run: Run) -> str:
    c = run.model.config
    return (f"{run.folder} (iteration {run.iteration}): {run.recipe.model.preset}, {c.num_layers} layers, "
            f"hidden {c.hidden_size}, vocabulary {c.vocab_size}, latent feedback {'on' if c.latent_feedback else 'off'}")
