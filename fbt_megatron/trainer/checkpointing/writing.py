"""Writing a checkpoint atomically, with its manifest.

With ``--async-save`` the files are written by a background process while training goes on
(megatron-core's async save, ``BackgroundSaves``); the manifest, the rename and the tracker follow
at a later step boundary, once every rank's files are written, so the atomicity is the same.

A save the run folder cannot take ends the run with one ``StorageError`` (exit code 2, not retried
by a Slurm job) naming the checkpoint, the fix and the checkpoint to resume from, and leaves the
complete checkpoints as they were: before writing, a folder with less room than its newest
checkpoint takes is refused; a write that fails where the folder then cannot take a small file
(full, read-only: ``folders.write_problem``) has its unfinished ``.tmp`` folder removed.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import shutil
from pathlib import Path
from typing import Iterator, Optional

import torch.distributed as dist
from megatron.core import dist_checkpointing
from torch.distributed.checkpoint.api import CheckpointException

from fbt_megatron.common.errors import StorageError
from fbt_megatron.common.folders import unwritable, write_problem
from fbt_megatron.common.io import atomic_write, sync_folder
from fbt_megatron.trainer.checkpointing.layout import TRACKER, checkpoint_dir, latest_iteration, remove_stale, retain
from fbt_megatron.trainer.checkpointing.manifest import MANIFEST, _MANIFEST_KEY, _hashed_files, _read_manifest, _write_manifest
from fbt_megatron.trainer.checkpointing.state import _rng_state, _state


OTHER_SAVE = "choose another --save"  # the alternative to freeing the run folder's file system


# megatron-core logs a checkpoint writer's failure that the save then raises: said once, by the raise
logging.getLogger("megatron.core.dist_checkpointing.strategies.filesystem_async").addFilter(
    lambda record: not record.getMessage().startswith("Local process "))


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
