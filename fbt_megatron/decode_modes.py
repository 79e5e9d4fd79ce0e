"""FBT's decode modes by name, as generation, evaluation and serving take them: standard, soft,
fused(n)."""

from __future__ import annotations

import re
from typing import Tuple

MODES = ("standard", "soft", "fused")
MODE_PATTERN = re.compile(r"^(standard|soft|fused)(?:\((\d+)\)|(\d+))?$")


def parse_mode(decode_mode: str, fused_prefill_passes=None) -> Tuple[str, int]:
    """("standard" | "soft" | "fused", n) from ``decode_mode`` ("fused(2)", "fused2", or "fused"
    with ``fused_prefill_passes``); ValueError for anything else."""
    m = MODE_PATTERN.match(str(decode_mode).strip())
    if not m:
        raise ValueError(f"unknown decode mode {decode_mode!r}: choose standard, soft, fused or fused(N)")
    mode, n = m.group(1), m.group(2) or m.group(3)
    if n is not None and fused_prefill_passes is not None and int(fused_prefill_passes) != int(n):
        raise ValueError(f"decode_mode={decode_mode} and fused_prefill_passes={fused_prefill_passes} disagree")
    if n is not None and mode != "fused":
        raise ValueError(f"unknown decode mode {decode_mode!r}: only fused takes a number of passes")
    try:
        passes = int(n if n is not None else (fused_prefill_passes or 0))
    except (TypeError, ValueError):
        raise ValueError(f"fused_prefill_passes must be an integer (got {fused_prefill_passes!r})") from None
    if passes < 0:
        raise ValueError(f"fused_prefill_passes must be >= 0 (got {passes})")
    if mode != "fused" and passes:
        raise ValueError(f"fused_prefill_passes={passes} needs decode_mode=fused (got {mode})")
    return mode, passes


def mode_label(mode: str, passes: int = 0) -> str:
    """The table's name of a mode: standard, soft, fused(n)."""
    return f"fused({passes})" if mode == "fused" else mode
