"""Checkpoints through megatron-core ``dist_checkpointing`` (torch_dist): written atomically,
loaded safely, resharded to whatever parallel layout loads them.

A run folder holds Megatron-LM's layout::

    <save>/iter_0000100/                           one complete checkpoint
    <save>/latest_checkpointed_iteration.txt       the newest one's number (for Megatron tools)

A checkpoint is written to ``iter_XXXXXXX.tmp`` and renamed once every rank has finished, so a
crash at any moment leaves the previous checkpoints intact; the newest complete ``iter_*``
folder is the one resumed from. Loading never unpickles arbitrary objects: the torch_dist
metadata file is checked by a restricted unpickler first, and every other item is read by
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import shutil
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedTensor

TRACKER = "latest_checkpointed_iteration.txt"
_ITER = re.compile(r"^iter_(\d{7})$")
# The distributed optimizer's torch-Adam path (no Apex/TE) only supports this format.
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names it."""


def checkpoint_dir(folder, iteration: int) -> Path:
    return Path(folder) / f"iter_{iteration:07d}"


def latest_iteration(folder) -> Optional[int]:
    """The newest complete checkpoint in a run folder, or None."""
    folder = Path(folder)
    if not folder.is_dir():
        return None
    found = [int(m.group(1)) for p in folder.iterdir() if p.is_dir() and (m := _ITER.match(p.name))]
    return max(found) if found else None


# ---------------------------------------------------------------- what a checkpoint holds
def _rng_state() -> torch.Tensor:
    """This rank's RNG streams as one uint8 vector: the default generator, the device one (GPU)
    and megatron's tracker streams (dropout in TP regions), in a fixed order."""
    parts = [torch.get_rng_state()]
    if torch.cuda.is_available():
        parts.append(torch.cuda.get_rng_state())
    tracker = tensor_parallel.get_cuda_rng_tracker().get_states()
    parts += [tracker[name] for name in sorted(tracker)]
    return torch.cat([p.cpu() for p in parts])


def _set_rng_state(flat: torch.Tensor) -> None:
    offset = 0

    def take(like):
        nonlocal offset
        part = flat[offset : offset + like.numel()].clone()
        offset += like.numel()
        return part

    torch.set_rng_state(take(torch.get_rng_state()))
    if torch.cuda.is_available():
        torch.cuda.set_rng_state(take(torch.cuda.get_rng_state()))
    tracker = tensor_parallel.get_cuda_rng_tracker()
    states = tracker.get_states()
    tracker.set_states({name: take(states[name]).to(states[name].device) for name in sorted(states)})


def _sharded_rng(rng: torch.Tensor) -> ShardedTensor:
    """Per (pipeline, tensor) rank RNG state, replicated over data-parallel ranks."""
    pp, tp = parallel_state.get_pipeline_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_world_size()
    return ShardedTensor.from_rank_offsets(
        "rng_state",
        rng.view(1, 1, -1),
        (0, parallel_state.get_pipeline_model_parallel_rank(), pp),
        (1, parallel_state.get_tensor_model_parallel_rank(), tp),
        replica_id=parallel_state.get_data_parallel_rank(with_context_parallel=True),
    )


def _rng_layout() -> list:
    return [parallel_state.get_pipeline_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_world_size()]


def _state(model, optimizer, scheduler, extra: dict, loading: bool) -> dict:
    """Everything a checkpoint holds; without an optimizer, the weights (a seed checkpoint)."""
    model_state = model.sharded_state_dict()
    if optimizer is None:
        return {"model": model_state, "train_state": extra}
    return {
        "model": model_state,
        "optimizer": optimizer.sharded_state_dict(model_state, is_loading=loading, metadata=OPTIMIZER_METADATA),
        "scheduler": scheduler.state_dict(),
        "rng_state": _sharded_rng(_rng_state()),
        "rng_layout": _rng_layout(),
        "train_state": extra,
    }


# ---------------------------------------------------------------- save
def save(folder, iteration: int, model, optimizer, scheduler, extra: dict) -> Path:
    """Write checkpoint ``iteration`` of ``model`` (the unwrapped module) and the training state
    ``extra`` (plain data) atomically; returns its folder. ``optimizer=None`` writes the weights
    only (a seed checkpoint)."""
    folder = Path(folder)
    final = checkpoint_dir(folder, iteration)
    tmp = final.with_name(final.name + ".tmp")
    rank0 = dist.get_rank() == 0
    if rank0:
        shutil.rmtree(tmp, ignore_errors=True)  # left over by a crash
        tmp.mkdir(parents=True)
    dist.barrier()
    dist_checkpointing.save(_state(model, optimizer, scheduler, extra, loading=False), str(tmp))
    dist.barrier()
    if rank0:
        if final.exists():  # the same iteration saved again: keep the old one until replaced
            old = final.with_name(final.name + ".old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old)
        else:
            os.replace(tmp, final)
        tracker_tmp = folder / (TRACKER + ".tmp")
        tracker_tmp.write_text(f"{iteration}\n")
        os.replace(tracker_tmp, folder / TRACKER)
    dist.barrier()
    return final


# ---------------------------------------------------------------- load
class _MetadataUnpickler(pickle.Unpickler):
    """Admits only what torch_dist metadata is made of: checkpoint metadata classes and torch types."""

    _ALLOWED = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict")}

    def find_class(self, module, name):
        allowed = (
            module.startswith("torch.distributed.checkpoint.")
            or (module, name) in self._ALLOWED
            or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))
        )
        if not allowed:
            raise CheckpointError(f"refusing to load {module}.{name} from checkpoint metadata")
        return super().find_class(module, name)


def _check_safe(path: Path) -> None:
    """Refuse checkpoint metadata holding anything but checkpoint metadata classes."""
    meta = path / ".metadata"
    if not meta.is_file() or not (path / "common.pt").is_file():
        raise CheckpointError(f"{path} is not a complete torch_dist checkpoint")
    try:
        with open(meta, "rb") as f:
            _MetadataUnpickler(f).load()
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"{meta} is unreadable: {e}") from None


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


def _latest(folder) -> Path:
    iteration = latest_iteration(folder)
    if iteration is None:
        raise CheckpointError(f"no checkpoint (iter_XXXXXXX folder) in {folder}")
    path = checkpoint_dir(folder, iteration)
    _check_safe(path)
    return path


def _common(path: Path) -> dict:
    try:
        with _weights_only_loading():
            return dist_checkpointing.load_common_state_dict(str(path))
    except Exception as e:
        raise CheckpointError(f"{path}/common.pt is unreadable: {str(e).splitlines()[0]}") from None


def read_train_state(folder) -> dict:
    """The training state saved with the newest checkpoint of a run folder (weights not read)."""
    return _common(_latest(folder))["train_state"]


def load(folder, model, optimizer, scheduler) -> None:
    """Load the newest checkpoint of a run folder into model, optimizer and scheduler and
    restore this rank's RNG streams; from a seed checkpoint, the weights only."""
    path = _latest(folder)
    common = _common(path)
    if "scheduler" not in common:  # a seed checkpoint: weights only
        optimizer = scheduler = None
    state = _state(model, optimizer, scheduler, {}, loading=True)
    del state["train_state"]  # read from the common state, whatever its keys
    same_layout = common.get("rng_layout") == _rng_layout()
    if optimizer is not None and not same_layout:  # RNG streams are per (PP, TP) rank: resharded runs start them afresh
        del state["rng_state"], state["rng_layout"]
    try:
        with torch.no_grad(), _weights_only_loading():  # no grad: the optimizer copies into views of parameters
            loaded = dist_checkpointing.load(state, str(path))
    except Exception as e:  # shapes or keys that do not fit this model
        raise CheckpointError(f"{path} does not fit this model/optimizer: {str(e).splitlines()[0]}") from None
    model.load_state_dict(loaded["model"])
    if optimizer is None:
        return
    with torch.no_grad():
        optimizer.load_state_dict(loaded["optimizer"])
    scheduler.load_state_dict(loaded["scheduler"])
    if same_layout:
        _set_rng_state(loaded["rng_state"].flatten())
