"""FBT's decode modes by name, as generation, evaluation and serving take them: standard, soft,
fused(n); and the one default: a model with latent feedback decodes soft (the method's mode) unless
told otherwise, a baseline standard (docs/generation.md, "Decode modes")."""

from __future__ import annotations

import re
from typing import Optional, Tuple

MODES = ("standard", "soft", "fused")
MODE_PATTERN = re.compile(r"^(standard|soft|fused)(?:\((\d+)\)|(\d+))?$")


def default_mode(latent_feedback: bool) -> str:
    """The mode of a model when none is named: soft with latent feedback, standard without (a
    baseline). The HF export writes it into config.json (``decode_mode``), which its ``generate``,
    vLLM and lm-eval read; ``configuration_fbt.py`` (remote code, no imports from here) repeats it
    for configs that name none."""
    return "soft" if latent_feedback else "standard"


def config_mode(config) -> Tuple[str, int]:
    """(mode, n) an HF export's config names (``decode_mode``, ``fused_prefill_passes``), or
    ``default_mode`` of its ``latent_feedback`` where it names none."""
    mode = getattr(config, "decode_mode", None) or default_mode(bool(getattr(config, "latent_feedback", False)))
    passes = getattr(config, "fused_prefill_passes", 0) or 0
    return parse_mode(mode, passes if mode == "fused" else None)


def named_mode(decode_mode=None, fused_prefill_passes=None) -> Optional[Tuple[str, int]]:
    """``parse_mode`` of what a caller named (fused passes alone name fused), or None: the model's
    default (``config_mode``) applies."""
    if decode_mode is None and fused_prefill_passes is None:
        return None
    return parse_mode("fused" if decode_mode is None else decode_mode, fused_prefill_passes)


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
