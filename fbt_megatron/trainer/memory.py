"""Memory per logged step, the largest over the ranks: on a GPU the CUDA caching allocator's
counters under Megatron-LM's names (``mem_allocated_bytes``, ``mem_reserved_bytes``,
``mem_max_allocated_bytes``: its ``--log-memory-to-tensorboard`` tags ``mem-allocated-bytes``, …),
on a CPU the process's resident set (``rss_bytes`` now, ``max_rss_bytes`` its peak since the process
started: what the kernel's out-of-memory killer counts). Into each logged step's record:
``callbacks.memory``; the planner's estimate beside the first logged step's peak:
``callbacks.planned_memory``."""

from __future__ import annotations

import os
import resource
from typing import Dict, Optional

import torch
import torch.distributed as dist

from fbt_megatron.common import platform

GiB = 2**30


def usage() -> Dict[str, int]:
    """This process's memory now (the module docstring), bytes."""
    if platform.on_gpu():
        return {"mem_allocated_bytes": torch.cuda.memory_allocated(), "mem_reserved_bytes": torch.cuda.memory_reserved(),
                "mem_max_allocated_bytes": torch.cuda.max_memory_allocated()}
    with open("/proc/self/statm") as statm:
        rss = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return {"rss_bytes": rss, "max_rss_bytes": max(rss, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)}  # (ru_maxrss lags)


def largest_over_ranks() -> Dict[str, int]:
    """``usage()``, each figure the largest over the ranks (one all-reduce: every rank calls it)."""
    mine = usage()
    values = torch.tensor(list(mine.values()), dtype=torch.int64, device=platform.device())
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return dict(zip(mine, values.tolist()))


def peak(record: dict) -> Optional[int]:
    """A record's peak: the most the allocator held for tensors (GPU) or the peak resident set (CPU)."""
    return record.get("mem_max_allocated_bytes", record.get("max_rss_bytes"))


def describe(record: dict) -> str:
    """The log line's memory: peak allocated / reserved (GPU) or the resident set and its peak (CPU), GiB."""
    if "mem_max_allocated_bytes" in record:
        return f"mem {record['mem_max_allocated_bytes'] / GiB:.2f}/{record['mem_reserved_bytes'] / GiB:.2f} GiB"
    return f"rss {record['rss_bytes'] / GiB:.2f} GiB (peak {record['max_rss_bytes'] / GiB:.2f})"
