"""Offline Hugging Face settings for evaluation: set before transformers, datasets or lm_eval are imported."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

OFFLINE = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")


def _writable(path: Path) -> bool:
    """Whether ``path`` is, or could be created as, a folder this process can write to."""
    for p in (path, *path.parents):
        if p.exists():
            return p.is_dir() and os.access(p, os.W_OK | os.X_OK)
    return False


def offline_environment() -> dict:
    """Nothing is downloaded (the hub, transformers and datasets offline), and HF_HOME is a folder
    that can be written (datasets caches the local tasks' tables there): the user's when it is set
    and writable, else ~/.cache/huggingface, else one in the temporary folder. A user's explicit
    ``*_OFFLINE=0`` is left alone. Returns what was set."""
    changed = {}
    for name in OFFLINE:
        if name not in os.environ:
            os.environ[name] = changed[name] = "1"
    home = os.environ.get("HF_HOME")
    if not home or not _writable(Path(home)):
        default = Path.home() / ".cache" / "huggingface"
        home = str(default if _writable(default) else Path(tempfile.gettempdir()) / f"fbt-hf-home-{os.getuid()}")
        os.environ["HF_HOME"] = changed["HF_HOME"] = home
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return changed
