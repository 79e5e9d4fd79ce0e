"""The planner's memory estimate for a run about to start here (``train``), and a warning before it
starts when this machine cannot hold it: the training processes of this node × the estimate per
process against the memory left to them (a GPU's own; on a CPU the host's available memory, or the
job's cgroup limit when lower). A run past it is ended by the kernel's out-of-memory killer, which
prints nothing in the run's log. The estimate is the planner's (``planner.make_plan``: its worst
pipeline stage; a CPU process's terms without a GPU, within 15% of the measured RSS of one process
on the runs it was fitted on, 20% on others; a data-parallel save is not counted: docs/planning.md), a warning,
not a refusal: the run may know better."""

from __future__ import annotations

import gc
import os
from pathlib import Path
from typing import Optional, Tuple

import torch

from fbt_megatron.common.errors import RecipeError
from fbt_megatron.launch.plan.device import usable_bytes
from fbt_megatron.launch.plan.planner import gib, make_plan
from fbt_megatron.recipe import Recipe


def processes_here() -> int:
    """Training processes on this node: torchrun's ``LOCAL_WORLD_SIZE``, Slurm's tasks per node, else 1."""
    for name in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        value = os.environ.get(name, "").split("(")[0]
        if value.isdigit():
            return int(value)
    return 1


def host_available_bytes() -> Optional[float]:
    """The host memory processes may still take: ``MemAvailable`` (/proc/meminfo), or the cgroup's
    limit less its usage when lower (a Slurm job's, a container's); None where neither is readable."""
    found = []
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        fields = dict(line.split(":", 1) for line in meminfo.read_text().splitlines() if ":" in line)
        if "MemAvailable" in fields:
            found.append(int(fields["MemAvailable"].split()[0]) * 1024)
    limit, usage = Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory.current")
    if limit.is_file() and usage.is_file() and limit.read_text().strip().isdigit():
        found.append(int(limit.read_text()) - int(usage.read_text()))
    return float(min(found)) if found else None


def gpu_memory_gib() -> Optional[float]:
    """The GiB CUDA reports for this process's GPU; None without one."""
    return torch.cuda.get_device_properties(0).total_memory / 2**30 if torch.cuda.is_available() else None


def estimate_here(recipe: Recipe, world_size: int) -> Tuple[Optional[float], Optional[str]]:
    """(the planner's bytes per training process on this machine, a warning line when this node
    cannot hold its processes); (None, None) where the planner has no estimate for the recipe."""
    gpu_gib = gpu_memory_gib()
    try:  # a GPU's terms without its refusal (weighed below), or a CPU process's
        plan = make_plan(recipe, world_size, gpu_memory_gb=float("inf") if gpu_gib is not None else None)
    except RecipeError:
        return None, None  # (what the training refuses, it says itself)
    finally:
        # The plan's meta model is garbage in reference cycles with its private process group, destroyed:
        # collected here, not in the checkpoint writers' results-queue manager the run forks next (its
        # gc freed them there and the manager died: EOFError at the run's second save).
        gc.collect()
    estimate = plan.memory[plan.chosen].total
    if gpu_gib is not None:
        usable = usable_bytes(None, gpu_gib)
        if estimate > usable:
            return estimate, (f"warning: the planner estimates {gib(estimate)} GiB per GPU, more than the {gib(usable)} GiB "
                              f"usable of this GPU: the run may stop with CUDA out of memory (python -m fbt_megatron.plan)")
        return estimate, None
    here, available = processes_here(), host_available_bytes()
    if available is not None and estimate * here > available:
        return estimate, (f"warning: this machine may not hold the run: the planner estimates {gib(estimate)} GiB per process "
                          f"× {here} here = {gib(estimate * here)} GiB, and {gib(available)} GiB is available; the kernel's "
                          f"out-of-memory killer would end it without a message in this log (lower --micro-batch-size, "
                          f"set --recompute-passes true, or run fewer processes per node)")
    return estimate, None
