"""Checks of the folders a command writes: before any work, one line when it cannot.

``check_new_folder(path, flag)`` is the same rule as ``io.atomic_folder``, which writes the folders
this project creates (a corpus, a task, an SFT set, an export, an imported run) whole, applied as a
command's early check of its output flag: one line and nothing written when ``path`` cannot become
the new folder.

``check_writable(path, flag)`` is the early check of a folder a run writes in as it goes (``--save``):
a folder, or a path where one can be created, on a file system that takes a file now;
``write_problem(folder, ...)`` says why one cannot (a full disk, a read-only file system, no
permission), in words ending in the fix.
"""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from pathlib import Path
from typing import Optional

from fbt_megatron.common.errors import StorageError
from fbt_megatron.common.io import FolderExists

PROBE_BYTES = 4096  # what write_problem writes: a block, so that a full file system refuses it
STORAGE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)  # a full disk, over quota, a read-only file system


def current_umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def _vacant(path: Path) -> bool:
    """Missing, or an empty folder."""
    return not path.exists() or (path.is_dir() and not any(path.iterdir()))


def check_new_folder(path, flag: str) -> Path:
    """``path`` (given as ``flag``) as the folder a command is about to create: missing or an empty
    folder, below parents that exist or can be created; else one line naming the fix."""
    out = Path(path)
    if not _vacant(out):
        raise FolderExists(f"{out} exists and is not empty: choose another {flag} or remove it")
    above = _nearest(out.absolute().parent)
    if not above.is_dir():
        raise FolderExists(f"{flag} {out} cannot be created: {above} is a file, not a folder")
    return out


def _nearest(path: Path) -> Path:
    """``path`` or its nearest parent that exists."""
    return next(p for p in [path, *path.parents] if p.exists())


def check_writable(path, flag: str) -> None:
    """``path`` (given as ``flag``) as a folder this process writes in as it goes: a folder, or a path
    where one can be created, on a file system that takes a file now (``write_problem``, in the
    folder or its nearest existing parent); else one line naming it and the fix (``StorageError``).
    Creates nothing."""
    out = Path(path)
    alternative = f"choose another {flag}"
    if out.exists() and not out.is_dir():
        raise StorageError(f"{flag} {out} is a file, not a folder: {alternative}")
    above = _nearest(out.absolute())
    if not above.is_dir():
        raise StorageError(f"{flag} {out} cannot be created: {above} is a file, not a folder; {alternative}")
    problem = write_problem(above, alternative)
    if problem:
        raise StorageError(f"{flag} {out}: {problem}")


def write_problem(folder: Path, alternative: str) -> Optional[str]:
    """Why this process cannot write a file in the existing folder ``folder`` now, in words ending in
    the fix or ``alternative`` (what else to do); None when it can. A probe file of PROBE_BYTES is
    written, synced and removed."""
    try:
        fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=folder)
    except OSError as e:
        return unwritable(e, folder, alternative)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(bytes(PROBE_BYTES))
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        return unwritable(e, folder, alternative)
    finally:
        with contextlib.suppress(OSError):
            os.remove(probe)
    return None


def unwritable(e: OSError, folder, alternative: str) -> str:
    """What ``e``, an error writing in ``folder``, means, ending in the fix or ``alternative``."""
    code = errno.errorcode.get(e.errno, str(e.errno))
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        full = "is full" if e.errno == errno.ENOSPC else "is over its disk quota"
        return f"the file system of {folder} {full} ({code}): free space on it or {alternative}"
    if e.errno == errno.EROFS:
        return f"{folder} is on a read-only file system ({code}): {alternative}"
    if e.errno in (errno.EACCES, errno.EPERM):
        return f"this process may not write in {folder} ({code}): {alternative}"
    return f"cannot write in {folder} ({e.strerror}, {code}): {alternative}"

