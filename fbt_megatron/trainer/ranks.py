"""``<save>/ranks.json``: which node each rank of a run runs on, for the Slurm attempt record (which
copies it into ``jobs.jsonl``) and for naming stragglers (``stragglers``).

``{"started": ISO-UTC, "world_size": N, "ranks": [{"rank": 0, "node": "n1", "local_rank": 0, "pid":
123}, ...]}``, the ranks in order: gathered from every rank once (one ``all_gather_object``) when the
run's inputs (data, model, checkpoint) have been checked, so that bad input leaves no folder behind,
and written by rank 0 atomically (``io.atomic_write``): a reader sees the previous attempt's
file or this one's, whole. A rank's node is Slurm's name for it (``SLURMD_NODENAME``), else its host
name; ``local_rank`` is its place on the node (``LOCAL_RANK``, set by torchrun and by the Slurm
tasks launch), ``pid`` its process id.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import List, Optional

import torch.distributed as dist

from fbt_megatron.common.clock import utc
from fbt_megatron.common.io import atomic_write
from fbt_megatron.common.platform import node_name

RANKS = "ranks.json"


def read_ranks(folder) -> Optional[dict]:
    path = Path(folder) / RANKS
    return json.loads(path.read_text()) if path.is_file() else None


def record_ranks(save: Optional[str]) -> List[dict]:
    """Every rank's ``{"rank", "node", "local_rank", "pid"}``, in rank order (a collective: every rank
    calls it); rank 0 also writes them to ``<save>/ranks.json`` (module docstring)."""
    mine = {"rank": dist.get_rank(), "node": node_name(), "local_rank": int(os.environ.get("LOCAL_RANK", 0)), "pid": os.getpid()}
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    if save is not None and dist.get_rank() == 0:
        Path(save).mkdir(parents=True, exist_ok=True)
        record = {"started": utc(), "world_size": len(ranks), "ranks": ranks}
        atomic_write(Path(save) / RANKS, json.dumps(record) + "\n")
    return ranks
