"""The UTC timestamps of the run folder's records (``ranks.json``, ``heartbeat.json``,
``stragglers.jsonl``, ``injected_faults.jsonl``, ``metrics.jsonl``'s ``time_utc`` and each step's log
line; the Slurm job's ``jobs.jsonl`` writes the same form
from the batch shell): ISO 8601 to the second, ``2026-12-07T14:22:46Z``."""

from __future__ import annotations

import time
from typing import Optional

UTC_FORMAT = "%Y-%m-%dT%H:%M:%SZ"


def utc(seconds: Optional[float] = None) -> str:
    """``seconds`` (Unix time; None: now) as ISO 8601 UTC."""
    return time.strftime(UTC_FORMAT, time.gmtime(seconds))
