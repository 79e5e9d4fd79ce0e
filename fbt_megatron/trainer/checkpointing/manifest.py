"""Each checkpoint folder's manifest, ``files.json``: every file's size and sha256, itself covered
by a sha256. Every rank hashes the ``__{rank}_*.distcp`` files it wrote, rank 0 the common ones
(``common.pt``, ``metadata.json``, ``.metadata``), and rank 0 writes the manifest before the folder
is renamed into place (``save``); ``verify`` checks it before anything is loaded.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Optional

import torch.distributed as dist

from fbt_megatron.common.io import atomic_open


MANIFEST = "files.json"


_MANIFEST_FORMAT = "fbt-megatron checkpoint files"


_MANIFEST_KEY = "files_manifest"  # in common.pt: this checkpoint was written with a manifest


_COMMON_FILES = ("common.pt", "metadata.json", ".metadata")  # small: hashed before torch.distributed is up


_RANK_FILE = re.compile(r"^__(\d+)_")  # torch_dist's per-rank data files: __{rank}_{n}.distcp


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
