"""Files and folders written whole: a reader, or the next start after a crash, finds the old content
or the new, never a half-written file. The project's writers publish their files and folders
through here (a checkpoint folder is renamed into place by ``checkpointing``, which then syncs its
run folder).

``atomic_write(path, data)`` (``str``, as UTF-8, or ``bytes``) and ``atomic_open(path, mode)`` (a
file object, for writers that stream) write a temporary file beside ``path``
(``.NAME.tmp-XXXXXXXXXXXXXXXX``, the same file system), flush and sync it, rename it onto ``path``
and sync the folder, so the new content is on disk under its name once they return. On any error,
interrupts included, the temporary file is removed and ``path`` is left as it was. The file is an
ordinary one: 0o666 less the umask (not ``mkstemp``'s owner-only 0o600).

``atomic_folder(path)`` yields an empty temporary folder beside ``path`` and renames it to ``path``
when the block ends, its files synced before and the parent folder after; on any error the
temporary folder is removed and ``path`` is left as it was. ``path`` may be missing (its missing
parents are created, and removed again on failure) or an empty folder (replaced by the rename); a
non-empty folder or a file there is never touched: the rename refuses it (``FolderExists``), also
when another process finished the same folder first. With ``replace`` an existing folder is replaced
instead, kept aside under a hidden name until the new one is in place.

``publish_indexed(written, prefix)`` puts a megatron-core ``.bin``/``.idx`` pair in place so that no
crash leaves a pair a loader takes (a new ``.bin`` beside an old ``.idx``). ``append_synced(path,
text)`` appends to a record that must outlive a crash right after it. ``sync_folder(path)`` puts a
folder's entries (a rename in it) on disk.

One writer stands outside: ``launch/attempts.py`` runs under the batch shell's ``python3``,
outside any container, without this package; it writes its ``jobs.jsonl`` with a rename of its own.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
from pathlib import Path
from typing import IO, Iterator


class FolderExists(ValueError):
    """The folder to create exists and is not empty (or is a file): bad input, one line."""


def atomic_write(path, data: str | bytes) -> None:
    """``path`` holds ``data``, replaced whole (module docstring)."""
    with atomic_open(path, "wb" if isinstance(data, bytes) else "w") as f:
        f.write(data)


@contextlib.contextmanager
def atomic_open(path, mode: str = "w") -> Iterator[IO]:
    """A new file to write (``mode`` "w": text, UTF-8; "wb": bytes) that replaces ``path`` whole when
    the block ends, and only then (module docstring)."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open writes a whole file: mode 'w' or 'wb', not {mode!r}")
    path = Path(path)
    tmp = _temporary(path)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)  # the umask applies
        with open(fd, mode, encoding=None if mode == "wb" else "utf-8") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    sync_folder(path.parent)


@contextlib.contextmanager
def atomic_folder(path, replace: bool = False) -> Iterator[Path]:
    """Build the folder ``path`` whole (module docstring): yields the temporary folder to fill."""
    final = Path(path).absolute()
    created = [p for p in [final.parent, *final.parent.parents] if not p.exists()]
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temporary(final)
    try:
        tmp.mkdir()  # 0o777 less the umask: an ordinary folder
        yield tmp
        _sync_tree(tmp)
        _put_folder(tmp, final, replace)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for parent in created:  # innermost first; only while still empty
            with contextlib.suppress(OSError):
                parent.rmdir()
        raise
    for folder in dict.fromkeys([final.parent, *(p.parent for p in created)]):  # the new names, innermost first
        sync_folder(folder)


def publish_indexed(written, prefix) -> None:
    """The ``.bin``/``.idx`` pair written as ``written`` renamed to ``prefix``. A loader takes a
    prefix whose two files are there, so the old ``.idx`` is removed first and the new one comes
    last, each step on disk before the next: a crash in between leaves a ``.bin`` alone, which no
    loader takes, and publishing again completes it."""
    written, prefix = os.fspath(written), os.fspath(prefix)
    folder = os.path.dirname(os.path.abspath(prefix))
    with contextlib.suppress(FileNotFoundError):
        os.remove(prefix + ".idx")
    sync_folder(folder)
    for ext in (".bin", ".idx"):
        _fsync(written + ext)
        os.replace(written + ext, prefix + ext)
        sync_folder(folder)


def append_line(path, text: str) -> None:
    """``text`` appended to ``path`` (created if missing) and flushed, not synced: a frequent record
    whose last lines a crash of the machine may lose."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(text)


def append_synced(path, text: str) -> None:
    """``text`` appended to ``path`` (created if missing) and on disk, with the file's name."""
    path = Path(path)
    with open(path, "a", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    sync_folder(path.parent)


def sync_folder(path) -> None:
    """The entries of the folder ``path`` (the files created, renamed or removed in it) on disk. A
    file system that cannot sync a folder (EINVAL) is left to keep them in its own time."""
    try:
        _fsync(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise


def _fsync(path, flags: int = os.O_RDONLY) -> None:
    fd = os.open(path, flags | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _temporary(path: Path) -> Path:
    """A new hidden name beside ``path``, unique to this call."""
    return path.with_name(f".{path.name}.tmp-{secrets.token_hex(8)}")


def _sync_tree(folder: Path) -> None:
    """The files and folders below ``folder``, and itself, on disk (symbolic links are not followed)."""
    for root, _, files in os.walk(folder):
        for name in files:
            if not os.path.islink(os.path.join(root, name)):
                _fsync(os.path.join(root, name))
        sync_folder(root)


def _put_folder(tmp: Path, final: Path, replace: bool) -> None:
    """The finished folder ``tmp`` renamed to ``final``; with ``replace`` a folder there is renamed
    aside first (and back if the rename fails), then removed."""
    aside = final.with_name(f".{final.name}.old-{secrets.token_hex(8)}") if replace and final.is_dir() else None
    if aside is not None:
        os.rename(final, aside)
    try:
        os.rename(tmp, final)
    except OSError as e:
        if aside is not None:
            os.rename(aside, final)
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
            raise
        raise FolderExists(f"{final} exists and is not empty (written meanwhile by another process?); "
                           f"remove it or write elsewhere") from None
    if aside is not None:
        shutil.rmtree(aside)
