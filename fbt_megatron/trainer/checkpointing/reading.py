"""Loading a checkpoint, checked first (``verify``), resharded to whatever parallel layout loads
it. Loading never unpickles arbitrary objects: the torch_dist metadata file is checked by a
restricted unpickler first, and every other item is read by ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Optional

import torch
from megatron.core import dist_checkpointing
from torch.distributed.checkpoint.api import CheckpointException

from fbt_megatron.common import compat
from fbt_megatron.common.errors import CheckpointError
from fbt_megatron.trainer.checkpointing.manifest import MANIFEST
from fbt_megatron.trainer.checkpointing.state import _rng_layout, _saved_rng_parts, _set_rng_state, _state
from fbt_megatron.trainer.checkpointing.verify import verified


@contextlib.contextmanager
def _weights_only_loading():
    """torch_dist reads non-tensor items (layers' ``_extra_state``) with ``torch.load(...,
    weights_only=False)``; within this block every torch.load is a weights-only (safe) one."""
    original = torch.load

    def safe_load(*args, **kwargs):
        kwargs["weights_only"] = True
        return original(*args, **kwargs)

    torch.load = safe_load
    try:
        yield
    finally:
        torch.load = original


def _reason(e: BaseException) -> str:
    """The first line of what went wrong (for torch's CheckpointException: of the first rank's failure)."""
    if isinstance(e, CheckpointException) and e.failures:
        e = next(iter(e.failures.values()))[0]
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def _common(path: Path) -> dict:
    newer = compat.newer_checkpoint(path)
    if newer:
        raise CheckpointError(newer)
    try:
        with _weights_only_loading():
            return dist_checkpointing.load_common_state_dict(str(path))
    except Exception as e:
        raise CheckpointError(f"{path}/common.pt is unreadable: {_reason(e)}") from None


def read_train_state(folder, iteration: Optional[int] = None) -> dict:
    """The training state saved with a checkpoint of a run folder (the latest, or ``iteration``'s),
    weights not read. Needs no torch.distributed; checks every file's size and the common files'
    hashes."""
    return _common(verified(folder, iteration, collective=False))["train_state"]


def load(folder, model, optimizer, scheduler, iteration: Optional[int] = None, weights_only: bool = False,
         load_optimizer: bool = True, load_rng: bool = True) -> None:
    """Load a checkpoint of a run folder (the latest, or ``iteration``'s) into model, optimizer and
    scheduler and restore this rank's RNG streams (those that map from another device's: ``_set_rng_state``). ``weights_only`` (a stage starting from another
    run's weights; always for a seed checkpoint): the model alone. ``load_optimizer=False`` keeps
    the optimizer fresh (the scheduler's step is loaded), ``load_rng=False`` the RNG streams as they
    are. An optimizer whose state is not loaded copies its main (fp32) weights from the loaded
    model. Collective: every rank checks its share of the files' hashes first."""
    path = verified(folder, iteration, collective=True)
    common = _common(path)
    fresh_optimizer = optimizer
    if weights_only or "scheduler" not in common:  # a seed checkpoint holds the weights only
        optimizer = scheduler = None
    # RNG streams are per (PP, TP) rank: resharded runs start them afresh
    rng = load_rng and optimizer is not None and common.get("rng_layout") == _rng_layout()
    parts = _saved_rng_parts(path, common) if rng else []
    template = torch.empty(sum(size for _, size in parts), dtype=torch.uint8) if rng else None  # as long as the saved vector
    state = _state(model, optimizer, scheduler, {}, loading=True, optimizer_state=load_optimizer, rng=template)
    del state["train_state"]  # read from the common state, whatever its keys
    try:
        with torch.no_grad(), _weights_only_loading():  # no grad: the optimizer copies into views of parameters
            loaded = dist_checkpointing.load(state, str(path))
    except (Exception, CheckpointException) as e:  # shapes or keys that do not fit this model
        unchecked = "" if (path / MANIFEST).is_file() else " (or it is damaged: it has no manifest to check)"
        raise CheckpointError(f"{path} does not fit this model/optimizer{unchecked}: {_reason(e)}") from None
    model.load_state_dict(loaded["model"])  # (``loaded`` also holds the common state of whatever was not asked for)
    if optimizer is not None and load_optimizer:
        with torch.no_grad():
            optimizer.load_state_dict(loaded["optimizer"])
    elif fresh_optimizer is not None:
        fresh_optimizer.reload_model_params()
    if scheduler is not None:
        scheduler.load_state_dict(loaded["scheduler"])
    if rng:
        _set_rng_state(path, loaded["rng_state"].flatten(), parts)
