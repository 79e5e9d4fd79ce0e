"""A run folder's checkpoints, in Megatron-LM's layout::

    <save>/iter_0000100/                           one complete checkpoint
    <save>/latest_checkpointed_iteration.txt       the newest one's number (for Megatron tools)

A checkpoint is written to ``iter_XXXXXXX.tmp`` and renamed once every rank has finished
(``save``), so a crash at any moment leaves the previous checkpoints intact; the ``.tmp`` folders an
aborted save left are removed at the run's next save (``remove_stale``). The one resumed from is
the one the tracker names (the last one saved: after ``--ckpt-step N`` the later folders of the
abandoned continuation are not it), else the newest ``iter_*`` folder; ``iteration=N``
(``--ckpt-step N``) picks another. ``retain`` keeps the newest N.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path
from typing import Optional

from fbt_megatron.common import logs

log = logging.getLogger(__name__)


TRACKER = "latest_checkpointed_iteration.txt"


_ITER = re.compile(r"^iter_(\d{7})$")


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
