"""Where a run starts: from scratch, resuming its own checkpoint, or from another run's weights.

Megatron-LM's semantics (``megatron/training/checkpointing.py``, ``load_checkpoint``):

* ``--load RUN`` with a checkpoint in RUN resumes it: weights, optimizer, learning-rate scheduler,
  RNG streams, data position, iteration. The recipe's model must be the checkpoint's, field for
  field (a resumed run continues exactly). ``--no-load-optim`` starts the optimizer afresh (its
  moments; the iteration and the learning-rate curve continue: Megatron-LM also skips its scheduler
  there, which restarts the warmup), ``--no-load-rng`` keeps this run's RNG streams.
* ``--finetune`` takes only the weights of ``--load``'s checkpoint and starts a new run: iteration
  0, consumed samples 0, a fresh optimizer, this run's learning-rate curve and pass schedule, this
  run's RNG streams. Like Megatron-LM's it applies at every start: drop it to resume the run.
* ``--pretrained-checkpoint P`` (a stage: long context, SFT) does the same with P's latest
  checkpoint when ``--load`` holds no checkpoint yet (or is unset). Once the stage has saved its own
  checkpoint, ``--load`` resumes the stage as usual: a requeued job continues the stage.

Weights start another run when the models have the same parameters: the fields of
``config.ARCHITECTURE`` and the padded vocabulary size must be equal (else one line naming the
differing fields); every other model field and the sequence length may change, and one line says
what changed (``rotary_base 10000.0 → 500000.0, seq_length 128 → 512``). Weights are resharded
from whatever parallel layout saved them.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from fbt_megatron.common.errors import RecipeError
from fbt_megatron.model.config import ARCHITECTURE, FBTConfig, field_default, preset_fields
from fbt_megatron.recipe import Recipe
from fbt_megatron.trainer import checkpointing

log = logging.getLogger(__name__)


@dataclass
class Start:
    """A checkpoint a run starts from: resumed (``weights_only`` False), or whose weights start a
    new run; ``saved`` is its training state, ``note`` the line that says what was loaded."""

    folder: str
    iteration: Optional[int]  # None: the folder's latest checkpoint
    saved: dict
    weights_only: bool
    flag: str = "--load"  # the flag that named the checkpoint, for messages
    note: Optional[str] = None
    load_seconds: float = 0.0  # what ``load`` took


def checkpoint_state(recipe: Recipe, folder: str, iteration: Optional[int] = None) -> dict:
    """The training state of a checkpoint of run ``folder`` (the latest, or ``iteration``'s),
    refused when its model is not the recipe's (a resumed run continues exactly)."""
    saved = checkpointing.read_train_state(folder, iteration=iteration)
    _check_same_model(recipe, folder, saved)
    return saved


def _check_same_model(recipe: Recipe, folder: str, saved: dict) -> None:
    """RecipeError when the saved model is not the recipe's, naming the fields that differ."""
    model = recipe.to_dict()["model"]
    if saved["model"] != model:
        architecture, other = model_changes(saved, recipe)
        changes = [c for c in architecture + other if c[0] != "seq_length"] or [
            (f"model.{k}", saved["model"].get(k), model.get(k)) for k in sorted(set(saved["model"]) | set(model))
            if saved["model"].get(k) != model.get(k)]  # the same fields, written otherwise (a preset's value given)
        fix = ("restore them to resume it; weights of another shape cannot be loaded, so to train this model start from "
               "scratch with another --save and --load" if architecture else
               f"restore them to resume it, or add --finetune to start a new run from its weights (or give "
               f"--pretrained-checkpoint {folder} with another --save and --load)")
        raise RecipeError(f"the checkpoint in {folder} is of another model: {_show(changes)} (checkpoint → this run); "
                          f"a resumed run continues the same model: {fix}")


def _fields(model: dict) -> dict:
    """A recipe's model section ({preset, **overrides}) as the FBTConfig fields it sets."""
    model = dict(model)
    return preset_fields(model.pop("preset"), **model)


def model_changes(saved: dict, recipe: Recipe) -> tuple:
    """(architecture changes, other changes) from a checkpoint's training state to the recipe: lists
    of (name, checkpoint's value, recipe's value), the sequence length among the other changes."""
    theirs, ours = _fields(saved["model"]), _fields(recipe.to_dict()["model"])

    def value(fields, name):  # tuples and lists (pass_weights) compare as lists
        found = fields.get(name, field_default(name))
        return list(found) if isinstance(found, tuple) else found

    names = [f.name for f in dataclasses.fields(FBTConfig) if f.name in theirs or f.name in ours]
    changes = [(n, value(theirs, n), value(ours, n)) for n in names if value(theirs, n) != value(ours, n)]
    length = saved.get("recipe", {}).get("data", {}).get("seq_length")
    if length is not None and length != recipe.data.seq_length:
        changes.append(("seq_length", length, recipe.data.seq_length))
    return [c for c in changes if c[0] in ARCHITECTURE], [c for c in changes if c[0] not in ARCHITECTURE]


def _show(changes) -> str:
    return ", ".join(f"{name} {old} → {new}" for name, old, new in changes)


def _refusal(flag: str, folder: str, changes) -> RecipeError:
    return RecipeError(
        f"{flag} {folder} holds a model of another shape: {_show(changes)} (checkpoint → this run); its weights load "
        f"only into a model with the same parameters (a stage may change the RoPE base, the sequence length and training-behaviour fields)"
    )


def _which(recipe: Recipe) -> Optional[tuple]:
    """(flag, folder, iteration, weights only) of the checkpoint this run starts from; None: from
    scratch. Reads only the folders' listings."""
    c = recipe.checkpoint
    if c.finetune and c.load is None and c.pretrained_checkpoint is None:
        raise RecipeError("--finetune starts from the weights of --load's checkpoint: give --load RUN")
    found = c.load is not None and (c.ckpt_step is not None or checkpointing.latest_iteration(c.load) is not None)
    if not found and c.pretrained_checkpoint is not None:
        return "--pretrained-checkpoint", c.pretrained_checkpoint, None, True
    if c.load is None:
        return None
    if not Path(c.load).is_dir():
        raise RecipeError(f"--load {c.load}: no such run folder")
    if not found:
        log.info(f"--load {c.load}: no checkpoint yet, starting from scratch")
        return None
    return ("--finetune --load" if c.finetune else "--load"), c.load, c.ckpt_step, c.finetune


def start_of(recipe: Recipe) -> Optional[Start]:
    """The checkpoint this run starts from (None: from scratch), its saved state read once here and
    checked against the recipe before any work is done."""
    which = _which(recipe)
    if which is None:
        return None
    flag, folder, iteration, weights_only = which
    if not weights_only:  # resumed: the same model, before its last step
        saved = checkpoint_state(recipe, folder, iteration)
        if saved["iteration"] >= recipe.training.train_iters:
            raise RecipeError(f"the checkpoint in {folder} is at iteration {saved['iteration']}, not before "
                              f"--train-iters {recipe.training.train_iters}")
        what = "weights" + ("" if recipe.checkpoint.no_load_optim else ", optimizer") + ("" if recipe.checkpoint.no_load_rng else ", RNG")
        note = (f"--load {folder}: resumed {checkpointing.checkpoint_dir(folder, saved['iteration']).name} "
                f"(step {saved['iteration']}: {what}, data position)")
        return Start(folder, iteration, saved, weights_only=False, note=note)
    if not Path(folder).is_dir():
        raise RecipeError(f"{flag} {folder}: no such run folder")
    try:
        saved = checkpointing.read_train_state(folder, iteration=iteration)
    except checkpointing.CheckpointError as e:
        raise RecipeError(f"{flag} {folder}: {e}") from None
    architecture, other = model_changes(saved, recipe)
    if architecture:
        raise _refusal(flag, folder, architecture)
    note = (f"{flag} {folder}: the weights of {checkpointing.checkpoint_dir(folder, saved['iteration']).name} "
            f"(step {saved['iteration']}), resharded to this layout; iteration 0, fresh optimizer, this run's "
            f"learning-rate and pass schedules" + (f"; since that checkpoint: {_show(other)}" if other else ""))
    return Start(folder, iteration, saved, weights_only=True, flag=flag, note=note)


def check_vocabulary(start: Optional[Start], vocab_size: int) -> None:
    """Refuse a checkpoint whose embedding has another (padded) vocabulary size than this run's."""
    saved = start.saved.get("vocab_size") if start else None
    if saved and saved != vocab_size:
        raise _refusal(start.flag, start.folder, [("vocabulary (padded)", saved, vocab_size)])


def load(start: Start, recipe: Recipe, model, optimizer, scheduler) -> None:
    """Load ``start`` into the model (and, resuming, the optimizer, scheduler and RNG streams
    unless --no-load-optim / --no-load-rng)."""
    c = recipe.checkpoint
    began = time.monotonic()
    checkpointing.load(start.folder, model, optimizer, scheduler, iteration=start.iteration, weights_only=start.weights_only,
                       load_optimizer=not c.no_load_optim, load_rng=not c.no_load_rng)
    start.load_seconds = time.monotonic() - began
    start.note += f", loaded in {start.load_seconds:.1f} s"
