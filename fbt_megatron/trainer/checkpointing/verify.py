"""Damage found before anything is loaded. ``read_train_state`` (one process, before
torch.distributed is up) checks the manifest (``manifest``), every file's size and the common
files' hashes; ``load`` (every rank) also checks the hashes of the large files, file i on rank
i % world. A damaged checkpoint is one line naming the files and the newest older complete
checkpoint of the run folder (``--ckpt-step N``). A checkpoint without a manifest (written before
there was one) gets structural checks: the files and sizes the torch_dist metadata lists, and
readable common files. The torch_dist metadata file is read by a restricted unpickler only.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from fbt_megatron.common.errors import CheckpointError
from fbt_megatron.trainer.checkpointing.layout import checkpoint_dir, iterations, latest_iteration
from fbt_megatron.trainer.checkpointing.manifest import (
    MANIFEST, _COMMON_FILES, _MANIFEST_KEY, _read_manifest, _sha256,
)


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


def _torch_dist_metadata(path: Path):
    """The torch_dist metadata, through the restricted unpickler (CheckpointError: refused)."""
    with open(path / ".metadata", "rb") as f:
        return _MetadataUnpickler(f).load()


def _size_problem(path: Path, name: str, expected: int) -> Optional[str]:
    file = path / name
    if not file.is_file():
        return f"{name} is missing"
    size = file.stat().st_size
    if size < expected:
        return f"{name} is truncated ({size:,} of {expected:,} bytes)"
    if size > expected:
        return f"{name} is longer than saved ({size:,} instead of {expected:,} bytes)"
    return None


def _cheap_problems(path: Path):
    """What one process finds wrong cheaply: [(file, problem)], and the large files whose hash is
    still to be checked [(file, sha256)]. Raises CheckpointError for metadata that is unsafe to load."""
    files, problem = _read_manifest(path)
    if problem:
        return [(MANIFEST, problem)], []
    if files is None:
        return _structural_problems(path), []
    problems, unhashed = [], []
    for name, (size, digest) in files.items():
        problem = _size_problem(path, name, size)
        if problem is None and name in _COMMON_FILES:
            if _sha256(path / name) != digest:
                problem = f"{name} content differs from what was saved"
        elif problem is None:
            unhashed.append((name, digest))
        if problem:
            problems.append((name, problem))
    if not problems:
        try:
            _torch_dist_metadata(path)  # intact, and still only checkpoint metadata classes
        except CheckpointError:
            raise
        except Exception:
            problems.append((".metadata", ".metadata is unreadable"))
    return problems, unhashed


def _structural_problems(path: Path) -> list:
    """A checkpoint without a manifest: the files the torch_dist metadata lists, at least as long as
    it says, and readable common files."""
    problems, needed = [], {}
    if not (path / ".metadata").is_file():
        problems.append((".metadata", ".metadata is missing"))
    else:
        try:
            for info in _torch_dist_metadata(path).storage_data.values():
                needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
        except CheckpointError:
            raise
        except Exception:
            problems.append((".metadata", ".metadata is unreadable"))
    try:
        json.loads((path / "metadata.json").read_text())
    except FileNotFoundError:
        problems.append(("metadata.json", "metadata.json is missing"))
    except (OSError, ValueError):
        problems.append(("metadata.json", "metadata.json is unreadable"))
    if not (path / "common.pt").is_file():
        problems.append(("common.pt", "common.pt is missing"))
    else:
        try:
            common = torch.load(path / "common.pt", map_location="cpu", weights_only=True)
        except Exception:
            problems.append(("common.pt", "common.pt is unreadable"))
        else:
            if isinstance(common, dict) and _MANIFEST_KEY in common:  # written with one: it was deleted
                problems.append((MANIFEST, f"{MANIFEST} is missing"))
    for name, size in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            problems.append((name, f"{name} is missing"))
        elif file.stat().st_size < size:
            problems.append((name, f"{name} is truncated ({file.stat().st_size:,} of {size:,} bytes)"))
    return problems


def damage(path: Path, collective: bool) -> list:
    """What is wrong with checkpoint folder ``path`` ([]: complete). ``collective`` (every rank
    calls it): the large files' hashes too, file i checked by rank i % world."""
    found, unhashed = _cheap_problems(path)
    if collective:
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        mine = [(n, f"{n} content differs from what was saved") for n, d in unhashed[rank::world] if _sha256(path / n) != d]
        if world > 1:
            everyone = [None] * world
            dist.all_gather_object(everyone, mine)
            mine = [p for part in everyone for p in part]
        found += mine
    return [text for _, text in sorted(found)]


def _chosen(folder, iteration: Optional[int]) -> Path:
    """The checkpoint folder to load: ``iteration``'s, or the run folder's latest."""
    found = iterations(folder)
    if iteration is None:
        iteration = latest_iteration(folder)
        if iteration is None:
            raise CheckpointError(f"no checkpoint (iter_XXXXXXX folder) in {folder}")
    elif iteration not in found:
        there = ", ".join(map(str, found)) if found else "none"
        name = checkpoint_dir(folder, iteration).name
        raise CheckpointError(f"--ckpt-step {iteration}: no checkpoint {name} in {folder} (checkpoints there: {there})")
    return checkpoint_dir(folder, iteration)


def verified(folder, iteration: Optional[int], collective: bool) -> Path:
    """The checkpoint folder to load, checked; a damaged one is one CheckpointError naming the
    damaged files and the newest older complete checkpoint (the same error on every rank)."""
    path = _chosen(folder, iteration)
    found = damage(path, collective)
    if not found:
        return path
    older = None
    for candidate in reversed([i for i in iterations(folder) if i < int(path.name[len("iter_"):])]):
        try:
            if not damage(checkpoint_dir(folder, candidate), collective):
                older = candidate
                break
        except CheckpointError:  # unsafe metadata: not a candidate
            pass
    shown = found[:3] + ([f"and {len(found) - 3} more"] if len(found) > 3 else [])
    advice = (
        f"{checkpoint_dir(folder, older).name} is complete: resume from it with --ckpt-step {older}"
        if older is not None
        else f"no older complete checkpoint in {folder}"
    )
    raise CheckpointError(f"checkpoint {path} is damaged: {', '.join(shown)}; {advice}")
