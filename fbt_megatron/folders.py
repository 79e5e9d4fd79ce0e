"""Folders written whole: a folder this project creates (a corpus, a task, an SFT set, an export, an
imported run) appears complete under its name, or not at all.

``atomic_folder(path)`` yields an empty temporary folder beside ``path`` (``.NAME.tmp-XXXXXXXX``, same
file system) and renames it to ``path`` when the block ends; on any error, interrupts included, the
temporary folder is removed and ``path`` is left as it was. ``path`` may be missing (its missing
parents are created, and removed again on failure) or an empty folder (replaced by the rename); a
non-empty folder or a file there is never touched: the rename refuses it (``FolderExists``), also
when another process finished the same folder first.

``check_new_folder(path, flag)`` is the same rule as a command's early check of its output flag: one
line and nothing written when ``path`` cannot become the new folder.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator


class FolderExists(ValueError):
    """The folder to create exists and is not empty (or is a file): bad input, one line."""


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
    above = next(p for p in out.absolute().parents if p.exists())
    if not above.is_dir():
        raise FolderExists(f"{flag} {out} cannot be created: {above} is a file, not a folder")
    return out


@contextlib.contextmanager
def atomic_folder(path) -> Iterator[Path]:
    """Build the folder ``path`` whole (module docstring): yields the temporary folder to fill."""
    final = Path(path).absolute()
    created = [p for p in [final.parent, *final.parent.parents] if not p.exists()]
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        tmp.chmod(0o777 & ~current_umask())  # mkdtemp's folder is private; this one is an ordinary folder
        yield tmp
        try:
            os.rename(tmp, final)
        except OSError:
            if _vacant(final):
                raise
            raise FolderExists(f"{final} exists and is not empty (written meanwhile by another process?); "
                               f"remove it or write elsewhere") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for parent in created:  # innermost first; only while still empty
            with contextlib.suppress(OSError):
                parent.rmdir()
        raise
