"""Checkpoints through megatron-core ``dist_checkpointing`` (torch_dist): written atomically,
loaded safely, resharded to whatever parallel layout loads them.

A run folder holds Megatron-LM's layout::

    <save>/iter_0000100/                           one complete checkpoint
    <save>/latest_checkpointed_iteration.txt       the newest one's number (for Megatron tools)

A checkpoint is written to ``iter_XXXXXXX.tmp`` and renamed once every rank has finished, so a
crash at any moment leaves the previous checkpoints intact; the ``.tmp`` folders an aborted save
left are removed at the run's next save (``remove_stale``). The one resumed from is the one the
tracker names (the last one saved: after ``--ckpt-step N`` the later folders of the abandoned
continuation are not it), else the newest ``iter_*`` folder; ``iteration=N`` (``--ckpt-step N``)
picks another.

Damage is found before anything is loaded. Each checkpoint folder holds a manifest,
``files.json``: every file's size and sha256, itself covered by a sha256. Every rank hashes the
``__{rank}_*.distcp`` files it wrote, rank 0 the common ones (``common.pt``, ``metadata.json``,
``.metadata``), and rank 0 writes the manifest before the folder is renamed into place. Before
loading, ``read_train_state`` (one process, before torch.distributed is up) checks the manifest,
every file's size and the common files' hashes; ``load`` (every rank) also checks the hashes of
the large files, file i on rank i % world. A damaged checkpoint is one line naming the files and
the newest older complete checkpoint of the run folder (``--ckpt-step N``). A checkpoint
without a manifest (written before there was one) gets structural checks: the files and sizes
the torch_dist metadata lists, and readable common files.

With ``--async-save`` the files are written by a background process while training goes on
(megatron-core's async save, ``BackgroundSaves``); the manifest, the rename and the tracker follow
at a later step boundary, once every rank's files are written, so the atomicity is the same.

A save the run folder cannot take ends the run with one ``StorageError`` (exit code 2, not retried
by a Slurm job) naming the checkpoint, the fix and the checkpoint to resume from, and leaves the
complete checkpoints as they were: before writing, a folder with less room than its newest
checkpoint takes is refused; a write that fails where the folder then cannot take a small file
(full, read-only: ``folders.write_problem``) has its unfinished ``.tmp`` folder removed.

Loading never unpickles arbitrary objects: the torch_dist metadata file is checked by a
restricted unpickler first, and every other item is read by ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import pickle
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from torch.distributed.checkpoint.api import CheckpointException

from fbt_megatron.common import compat, logs
from fbt_megatron.common.errors import CheckpointError, StorageError
from fbt_megatron.common.folders import unwritable, write_problem
from fbt_megatron.common.io import atomic_open, atomic_write, sync_folder

log = logging.getLogger(__name__)

TRACKER = "latest_checkpointed_iteration.txt"
MANIFEST = "files.json"
_MANIFEST_FORMAT = "fbt-megatron checkpoint files"
_MANIFEST_KEY = "files_manifest"  # in common.pt: this checkpoint was written with a manifest
_COMMON_FILES = ("common.pt", "metadata.json", ".metadata")  # small: hashed before torch.distributed is up
_ITER = re.compile(r"^iter_(\d{7})$")
_RANK_FILE = re.compile(r"^__(\d+)_")  # torch_dist's per-rank data files: __{rank}_{n}.distcp
# The distributed optimizer's torch-Adam path (no Apex/TE) only supports this format.
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}
OTHER_SAVE = "choose another --save"  # the alternative to freeing the run folder's file system
# megatron-core logs a checkpoint writer's failure that the save then raises: said once, by the raise
logging.getLogger("megatron.core.dist_checkpointing.strategies.filesystem_async").addFilter(
    lambda record: not record.getMessage().startswith("Local process "))


def checkpoint_dir(folder, iteration: int) -> Path:
    return Path(folder) / f"iter_{iteration:07d}"


def iterations(folder) -> list:
    """The iterations of the checkpoints (``iter_XXXXXXX`` folders) in a run folder, ascending;
    ``.tmp`` (being written or left by a crash) and ``.old`` (being replaced) folders are not."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return sorted(int(m.group(1)) for p in folder.iterdir() if p.is_dir() and (m := _ITER.match(p.name)))


def latest_iteration(folder) -> Optional[int]:
    """The checkpoint a run folder resumes from, or None: the one the tracker names (the last one
    saved), else the newest."""
    found = iterations(folder)
    if not found:
        return None
    try:
        tracked = int((Path(folder) / TRACKER).read_text().strip())
    except (OSError, ValueError):
        tracked = None
    return tracked if tracked in found else found[-1]


# ---------------------------------------------------------------- what a checkpoint holds
@dataclass
class TrainState:
    """What besides weights and optimizer a resumed run needs (saved in every checkpoint as a dict:
    ``read_train_state``)."""

    iteration: int = 0
    consumed_samples: int = 0
    tokens: int = 0
    compute_tokens: int = 0  # tokens × passes: the cost in equivalent single-pass tokens
    pass_schedule: dict = field(default_factory=dict)
    model: dict = field(default_factory=dict)
    lr_schedule: dict = field(default_factory=dict)  # the curve the optimizer followed (``optimizers.schedule.lr_schedule``)
    recipe: dict = field(default_factory=dict)  # the whole recipe of the run's latest stretch (``runs.load_run``)
    vocab_size: int = 0  # the embedding's (padded) vocabulary size
    skipped_steps: int = 0  # steps whose update was skipped (NaN/Inf gradient norm: ``bad_steps``; spikes)
    spike_window: list = field(default_factory=list)  # the latest finite gradient norms (``callbacks.spikes``)
    spikes: int = 0  # steps whose gradient norm spiked
    rewinds: int = 0  # returns to an earlier checkpoint after a spike

    def advance(self, passes: int, samples: int, tokens: int, skipped_steps: int) -> None:
        """After a step of ``passes`` passes over ``samples`` sequences of ``tokens`` tokens in all."""
        self.iteration += 1
        self.consumed_samples += samples
        self.tokens += tokens
        self.compute_tokens += tokens * passes
        self.skipped_steps = skipped_steps


def _rng_streams() -> List[Tuple[str, torch.Tensor]]:
    """This rank's RNG streams by name, in a fixed order: the default generator, the device one (GPU)
    and megatron's tracker streams (dropout in TP regions). Their states' sizes depend on the device:
    a CUDA generator's is 16 bytes (Philox seed and offset), a CPU one's 5056 (Mersenne twister; the
    tracker's streams on a CPU: ``platform``), so a CPU and a GPU write RNG vectors of other lengths."""
    streams = [("cpu", torch.get_rng_state())]
    if torch.cuda.is_available():
        streams.append(("cuda", torch.cuda.get_rng_state()))
    tracker = tensor_parallel.get_cuda_rng_tracker().get_states()
    return streams + [(f"tracker:{name}", tracker[name]) for name in sorted(tracker)]


def _rng_state() -> torch.Tensor:
    """This rank's RNG streams (``_rng_streams``) as one uint8 vector."""
    return torch.cat([state.cpu() for _, state in _rng_streams()])


def _rng_parts() -> list:
    """``[[name, bytes], ...]``: the streams of ``_rng_state``'s vector, in its order (saved with it)."""
    return [[name, state.numel()] for name, state in _rng_streams()]


def _saved_rng_parts(path: Path, common: dict) -> list:
    """The streams of a checkpoint's RNG vector: saved with it, or for a checkpoint written before
    they were, read from the vector's length: this process's when as long, else the default
    generator (first, the same size everywhere) and the other device's streams."""
    if "rng_parts" in common:
        return common["rng_parts"]
    length = dist_checkpointing.load_tensors_metadata(str(path))["rng_state"].global_shape[-1]
    ours = _rng_parts()
    if length == sum(size for _, size in ours):
        return ours
    return [ours[0], ["another device's streams", length - ours[0][1]]]


def _set_rng_state(path: Path, flat: torch.Tensor, parts: list) -> None:
    """Restore this rank's streams from a checkpoint's RNG vector ``flat`` of streams ``parts``:
    each stream saved with the size this process's has. A CPU-saved run resumed on a GPU (or the
    other way) gets its default generator back and keeps the device's streams as this run seeded
    them (--seed): their states do not map; one line says which."""
    saved, offset = {}, 0
    for name, size in parts:
        saved[name], offset = flat[offset:offset + size], offset + size
    ours = _rng_streams()
    restored = {name: saved[name].clone() for name, state in ours if name in saved and saved[name].numel() == state.numel()}
    if "cpu" in restored:
        torch.set_rng_state(restored["cpu"])
    if "cuda" in restored:
        torch.cuda.set_rng_state(restored["cuda"])
    tracker = tensor_parallel.get_cuda_rng_tracker()
    states = tracker.get_states()
    tracker.set_states({name: restored.get(f"tracker:{name}", state).to(state.device) for name, state in states.items()})
    fresh = [name for name, _ in ours if name not in restored]
    if fresh:
        there = ", ".join(f"{name} {size} B" for name, size in parts)
        log.warning(f"{path}: RNG streams restored: {', '.join(restored) or 'none'}; started from --seed: {', '.join(fresh)} "
                    f"(the checkpoint's are another device's, which do not map to this one's: {there})")


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


def _state(model, optimizer, scheduler, extra: dict, loading: bool, optimizer_state: bool = True,
           rng: Optional[torch.Tensor] = None) -> dict:
    """Everything a checkpoint holds; without an optimizer, the weights (a seed checkpoint). ``rng``:
    the RNG vector (``_rng_state``) to save, or for loading one as long as the saved one; None leaves
    the RNG streams out. For loading, ``optimizer_state=False`` leaves out the optimizer's state."""
    model_state = model.sharded_state_dict()
    if optimizer is None:
        return {"model": model_state, "train_state": extra}
    state = {"model": model_state, "scheduler": scheduler.state_dict(), "train_state": extra}
    if optimizer_state:
        state["optimizer"] = optimizer.sharded_state_dict(model_state, is_loading=loading, metadata=OPTIMIZER_METADATA)
    if rng is not None:
        state.update(rng_state=_sharded_rng(rng), rng_layout=_rng_layout(), rng_parts=_rng_parts())
    return state


# ---------------------------------------------------------------- the manifest
def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _body_hash(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _hashed_files(path: Path) -> Optional[dict]:
    """Collective: every rank hashes the data files it wrote (rank 0 the rest); rank 0 gets them all
    ({name: {"size", "sha256"}}), the others None."""
    rank, world = dist.get_rank(), dist.get_world_size()

    def writer(name):
        m = _RANK_FILE.match(name)
        return int(m.group(1)) if m and int(m.group(1)) < world else 0

    names = sorted(p.name for p in path.iterdir() if p.is_file() and p.name != MANIFEST)
    mine = {n: {"size": (path / n).stat().st_size, "sha256": _sha256(path / n)} for n in names if writer(n) == rank}
    parts = [None] * world if rank == 0 else None
    dist.gather_object(mine, parts, dst=0)
    return {n: d for part in parts for n, d in part.items()} if rank == 0 else None


def _write_manifest(path: Path, files: dict) -> None:
    """The manifest of checkpoint folder ``path`` (``files``: ``_hashed_files``), written atomically."""
    body = {"format": _MANIFEST_FORMAT, "version": 1, "files": dict(sorted(files.items()))}
    with atomic_open(path / MANIFEST) as f:
        json.dump({**body, "sha256": _body_hash(body)}, f, indent=1)


def _read_manifest(path: Path):
    """(files: {name: (size, sha256)} or None when there is no manifest, problem or None)."""
    file = path / MANIFEST
    if not file.is_file():
        return None, None
    try:
        data = json.loads(file.read_text())
        body = {k: data[k] for k in ("format", "version", "files")}
        intact = data["format"] == _MANIFEST_FORMAT and data["sha256"] == _body_hash(body)
        files = {str(n): (int(d["size"]), str(d["sha256"])) for n, d in data["files"].items()}
        if any(Path(n).name != n or n in ("", ".", "..") for n in files):
            raise ValueError("not a file name")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None, f"{MANIFEST} is unreadable"
    if not intact:
        return None, f"{MANIFEST} content differs from what was saved"
    return files, None


# ---------------------------------------------------------------- save
class BackgroundSaves:
    """Checkpoints being written by background processes (megatron-core's async ``dist_checkpointing``
    save: a forked process per checkpoint writes the files, from a copy-on-write snapshot of the
    state at the save). Collective: every rank calls ``poll`` at every step boundary (finishes the
    checkpoints whose files are written: the manifest, the rename into place, the tracker,
    retention) and ``wait`` before exiting (finishes them all)."""

    def __init__(self):
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        self.queue = AsyncCallsQueue()
        self.writing: Optional[tuple] = None  # (run folder, .tmp folder) of the checkpoint being written

    def poll(self) -> None:
        self._finalize(blocking=False)

    def wait(self) -> None:
        self._finalize(blocking=True)

    def _finalize(self, blocking: bool) -> None:
        with _written(*self.writing) if self.writing else contextlib.nullcontext():
            if self.queue.maybe_finalize_async_calls(blocking=blocking):
                self.writing = None


def save(folder, iteration: int, model, optimizer, scheduler, extra: dict, keep_last: int = 0,
         background: Optional[BackgroundSaves] = None) -> Path:
    """Write checkpoint ``iteration`` of ``model`` (the unwrapped module) and the training state
    ``extra`` (plain data) atomically, with its manifest; returns its folder. ``optimizer=None``
    writes the weights only (a seed checkpoint). A checkpoint of the same iteration already there
    (a run resumed from an older one with ``--ckpt-step``) is replaced once the new one is complete.
    ``keep_last`` N > 0: then delete the checkpoints older than the newest N (``retain``).
    ``background``: the files are written in the background and the checkpoint is finished (made
    complete under its name) by a later ``background.poll()`` or ``wait()``; one at a time (a save
    first waits for the previous one)."""
    folder = Path(folder)
    final = checkpoint_dir(folder, iteration)
    tmp = final.with_name(final.name + ".tmp")
    if background is not None:
        background.wait()
    _start(folder, tmp)
    state = {**_state(model, optimizer, scheduler, extra, loading=False, rng=_rng_state()), _MANIFEST_KEY: MANIFEST}
    finish = functools.partial(_finish, folder, iteration, tmp, keep_last)
    with _written(folder, tmp):
        if background is None:
            dist_checkpointing.save(state, str(tmp))
            finish()
        else:
            request = dist_checkpointing.save(state, str(tmp), async_sharded_save=True)
            request.add_finalize_fn(finish)  # after megatron-core's own (the torch_dist metadata)
            background.queue.schedule_async_request(request)
            background.writing = (folder, tmp)
    return final


def _agreed(problem: Optional[str]) -> Optional[str]:
    """Rank 0's ``problem`` on every rank (collective)."""
    box = [problem]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _start(folder: Path, tmp: Path) -> None:
    """Collective, before a save writes: rank 0 removes the stale ``.tmp`` folders, checks the room
    (``_room_problem``) and creates ``tmp``; a problem there is one StorageError on every rank."""
    problem = None
    if dist.get_rank() == 0:
        try:
            remove_stale(folder)
            problem = _room_problem(folder)
            if problem is None:
                tmp.mkdir(parents=True)
        except OSError as e:
            problem = unwritable(e, folder, OTHER_SAVE)
    problem = _agreed(problem)
    if problem:
        raise StorageError(_not_saved(folder, tmp, problem))


def _room_problem(folder: Path) -> Optional[str]:
    """Why the run folder's file system has no room for another checkpoint as large as its newest
    one, in words; None when it has (or there is none yet to measure)."""
    newest = latest_iteration(folder)
    if newest is None:
        return None
    path = checkpoint_dir(folder, newest)
    files, _ = _read_manifest(path)
    size = sum(s for s, _ in files.values()) if files else sum(p.stat().st_size for p in path.iterdir() if p.is_file())
    free = shutil.disk_usage(folder).free
    if free >= size:
        return None
    return (f"the file system of {folder} has {free / 2**20:,.1f} MiB free, less than its newest checkpoint takes "
            f"({size / 2**20:,.1f} MiB): free space on it or {OTHER_SAVE}")


def _not_saved(folder: Path, tmp: Path, problem: str) -> str:
    """The line of a save that failed with ``problem``: the checkpoint, the fix, where to resume from."""
    newest = latest_iteration(folder)
    resume = (f"--load {folder} resumes from its newest complete checkpoint, {checkpoint_dir(folder, newest).name}"
              if newest is not None else "no checkpoint of this run folder is complete yet")
    return f"checkpoint {tmp.with_suffix('')} not saved: {problem}; {resume}"


@contextlib.contextmanager
def _written(folder: Path, tmp: Path) -> Iterator[None]:
    """The writing of checkpoint ``tmp`` into run folder ``folder``. A StorageError (every rank
    has it) stands; another failure where the folder then cannot take a small file
    (``folders.write_problem``: full, read-only) becomes one, once every rank has looked; rank 0
    then removes ``tmp``. Any other failure passes as it is."""
    try:
        yield
    except StorageError:
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    except (Exception, CheckpointException):  # torch's CheckpointException is a BaseException
        problem = write_problem(folder, OTHER_SAVE)
        if problem is None:
            raise
        dist.barrier()  # every rank looked before rank 0 frees the space
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise StorageError(_not_saved(folder, tmp, problem)) from None


def remove_stale(folder: Path) -> list:
    """Delete the ``iter_XXXXXXX.tmp`` folders of a run folder: checkpoints an aborted save left
    unfinished (a complete one is never named so: it is renamed once written). Called before a
    save, when no save of this run is under way; says so in one line. Returns the names removed."""
    stale = sorted(p.name for p in folder.glob("iter_*.tmp") if p.is_dir() and _ITER.match(p.name[:-len(".tmp")]))
    for name in stale:
        shutil.rmtree(folder / name)
    if stale:
        log.info(f"removed {', '.join(stale)} from {folder}: unfinished checkpoint{'s' if len(stale) > 1 else ''} "
                 f"of an aborted save", extra=logs.EVERY_RANK)  # rank 0 removes them (``_start``)
    return stale


def _finish(folder: Path, iteration: int, tmp: Path, keep_last: int) -> None:
    """Collective, once every rank's files are in ``tmp``: their hashes, then (rank 0) the manifest,
    the rename into place, the tracker and retention; a file rank 0 cannot write there is one
    StorageError on every rank."""
    dist.barrier()
    files = _hashed_files(tmp)
    problem = None
    if dist.get_rank() == 0:
        try:
            _write_manifest(tmp, files)
            _put_in_place(folder, iteration, tmp)
            if keep_last:
                retain(folder, iteration, keep_last)
        except OSError as e:
            problem = unwritable(e, folder, OTHER_SAVE)
    problem = _agreed(problem)
    if problem:
        raise StorageError(_not_saved(folder, tmp, problem))


def _put_in_place(folder: Path, iteration: int, tmp: Path) -> None:
    """The complete checkpoint ``tmp`` renamed to its name (replacing one of the same iteration once
    it is there), then tracked."""
    final = checkpoint_dir(folder, iteration)
    if final.exists():  # the same iteration saved again: keep the old one until replaced
        old = final.with_name(final.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old)
    else:
        os.replace(tmp, final)
    sync_folder(folder)  # the checkpoint under its name on disk before the tracker names it
    atomic_write(folder / TRACKER, f"{iteration}\n")


def retain(folder, newest: int, keep: int) -> list:
    """Delete the checkpoints of a run folder older than the newest ``keep`` up to ``newest`` (the
    one just saved, complete and tracked); later ones (a continuation abandoned with --ckpt-step)
    stay. Each is renamed out of the checkpoint names first, so a crash mid-delete leaves no
    half-deleted checkpoint. Returns the iterations deleted."""
    older = [i for i in iterations(folder) if i <= newest][:-keep]
    for i in older:
        doomed = checkpoint_dir(folder, i).with_name(checkpoint_dir(folder, i).name + ".old")
        shutil.rmtree(doomed, ignore_errors=True)
        os.replace(checkpoint_dir(folder, i), doomed)
        shutil.rmtree(doomed)
    return older


# ---------------------------------------------------------------- checks before loading
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


def _problems(path: Path, collective: bool) -> list:
    """What is wrong with checkpoint folder ``path`` ([]: complete). ``collective`` (every rank
    calls it): the large files' hashes too, file i checked by rank i % world."""
    problems, unhashed = _cheap_problems(path)
    if collective:
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        mine = [(n, f"{n} content differs from what was saved") for n, d in unhashed[rank::world] if _sha256(path / n) != d]
        if world > 1:
            everyone = [None] * world
            dist.all_gather_object(everyone, mine)
            mine = [p for part in everyone for p in part]
        problems += mine
    return [text for _, text in sorted(problems)]


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


def _verified(folder, iteration: Optional[int], collective: bool) -> Path:
    """The checkpoint folder to load, checked; a damaged one is one CheckpointError naming the
    damaged files and the newest older complete checkpoint (the same error on every rank)."""
    path = _chosen(folder, iteration)
    problems = _problems(path, collective)
    if not problems:
        return path
    older = None
    for candidate in reversed([i for i in iterations(folder) if i < int(path.name[len("iter_"):])]):
        try:
            if not _problems(checkpoint_dir(folder, candidate), collective):
                older = candidate
                break
        except CheckpointError:  # unsafe metadata: not a candidate
            pass
    shown = problems[:3] + ([f"and {len(problems) - 3} more"] if len(problems) > 3 else [])
    advice = (
        f"{checkpoint_dir(folder, older).name} is complete: resume from it with --ckpt-step {older}"
        if older is not None
        else f"no older complete checkpoint in {folder}"
    )
    raise CheckpointError(f"checkpoint {path} is damaged: {', '.join(shown)}; {advice}")


# ---------------------------------------------------------------- load
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
    return _common(_verified(folder, iteration, collective=False))["train_state"]


def load(folder, model, optimizer, scheduler, iteration: Optional[int] = None, weights_only: bool = False,
         load_optimizer: bool = True, load_rng: bool = True) -> None:
    """Load a checkpoint of a run folder (the latest, or ``iteration``'s) into model, optimizer and
    scheduler and restore this rank's RNG streams (those that map from another device's: ``_set_rng_state``). ``weights_only`` (a stage starting from another
    run's weights; always for a seed checkpoint): the model alone. ``load_optimizer=False`` keeps
    the optimizer fresh (the scheduler's step is loaded), ``load_rng=False`` the RNG streams as they
    are. An optimizer whose state is not loaded copies its main (fp32) weights from the loaded
    model. Collective: every rank checks its share of the files' hashes first."""
    path = _verified(folder, iteration, collective=True)
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
        verified = "" if (path / MANIFEST).is_file() else " (or it is damaged: it has no manifest to check)"
        raise CheckpointError(f"{path} does not fit this model/optimizer{verified}: {_reason(e)}") from None
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
