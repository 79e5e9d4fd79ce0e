"""One stage of the rehearsal: a command run as a child process, measured.

The child's output goes to ``<stage>.log`` with each line's arrival time (seconds since the start),
so a stage's phases can be timed from its own log lines. Memory is sampled every ``INTERVAL``
seconds over the child's whole process tree (torchrun's workers, megatron's background savers):
the largest single process's peak RSS (the kernel's high-water mark ``VmHWM``, so a peak between two
samples is not missed; what the planner estimates per rank) and the tree's largest footprint, the
sum of its processes' proportional set sizes (``Pss`` of ``smaps_rollup``: a page a forked child
shares with its parent counts once, split between them; what the machine must hold), and when that
process's peak was reached, placed after the log line before it (``Measured.peak``). CPU time is
the children's user + system time (``getrusage``): unlike wall time, it hardly depends on what else
the machine runs. Reading the Pss of a large process costs (``OVERHEAD``): it is read less often,
at most 5% of a core.
"""

from __future__ import annotations

import logging
import os
import resource
import shlex
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

import psutil

from fbt_megatron.common.processes import outside_group

log = logging.getLogger(__name__)

# Where a check compares bits or greedy tokens, on a GPU: cuBLAS in full FP32 (NVIDIA_TF32_OVERRIDE; NGC's
# images set TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1, which makes every FP32 torch matmul TF32), deterministic
# attention backward in Transformer Engine (its default allows FusedAttention/FlashAttention's
# non-deterministic one) and a cuBLAS workspace that reproduces bit for bit. No effect on a CPU.
EXACT_ENV = {"NVIDIA_TF32_OVERRIDE": "0", "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE": "0", "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0",
             "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
INTERVAL = 0.2  # seconds between memory samples
OVERHEAD = 20  # the tree's Pss at most every 20 times what reading it took: a 16 GiB process's walks its page tables
GiB = 2**30


@dataclass
class Measured:
    name: str
    command: List[str]
    seconds: float
    cpu_seconds: float
    code: int
    max_process_rss: int  # bytes
    max_tree_pss: int  # bytes
    lines: List[tuple] = field(default_factory=list)  # (seconds since start, text)
    log: str = ""
    peak_at: Optional[float] = None  # seconds since start when the largest process's peak RSS was last raised

    def ok(self) -> bool:
        return self.code == 0

    def peak(self) -> str:
        """When the largest process's RSS peaked, and the last log line before then."""
        if self.peak_at is None:
            return "peak time unknown"
        before = [text for t, text in self.lines if t <= self.peak_at and text.strip()]
        return f"peak at {self.peak_at:.0f} s" + (f", after {before[-1][:80]!r}" if before else ", before the first log line")

    def tail(self, n: int = 25) -> str:
        return "\n".join(text for _, text in self.lines[-n:])


class _Sampler(threading.Thread):
    def __init__(self, pid: int, start: float):
        super().__init__(daemon=True)
        self.root, self.done, self.origin = psutil.Process(pid), threading.Event(), start
        self.max_process = self.max_tree = 0
        self.peak_at: Optional[float] = None

    def run(self):
        pss_due = 0.0  # when the tree's Pss is read next (at most OVERHEAD times what the last reading took)
        while not self.done.is_set():
            try:
                procs = [self.root, *self.root.children(recursive=True)]
            except psutil.Error:
                break
            for p in procs:
                try:
                    hwm = _kib(f"/proc/{p.pid}/status", "VmHWM:")
                except OSError:  # it ended meanwhile
                    continue
                if hwm > self.max_process:
                    self.max_process, self.peak_at = hwm, time.perf_counter() - self.origin
            began = time.perf_counter()
            if began >= pss_due:
                sizes = []
                for p in procs:
                    try:
                        sizes.append(_kib(f"/proc/{p.pid}/smaps_rollup", "Pss:"))
                    except OSError:
                        pass
                self.max_tree = max(self.max_tree, sum(sizes))
                pss_due = began + OVERHEAD * (time.perf_counter() - began)
            self.done.wait(INTERVAL)


def _kib(path: str, key: str) -> int:
    """The bytes of the ``key`` line (a size in kB) of a /proc file; 0 where there is none."""
    with open(path) as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    return 0


def run_stage(name: str, command: List, log: Path, cwd: Path, env: Optional[dict] = None,
              echo: bool = False) -> Measured:
    """Run ``command`` (its output to ``log``), sampling its memory; returns the measurements."""
    command = [str(c) for c in command]
    env = outside_group({**os.environ, **(env or {})})  # not this process's group
    lines = []
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    with open(log, "w") as out:
        out.write("$ " + " ".join(shlex.quote(c) for c in command) + "\n")
        out.flush()
        child = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                 errors="replace")
        sampler = _Sampler(child.pid, start)
        sampler.start()
        for text in child.stdout:
            text = text.rstrip("\n")
            lines.append((time.perf_counter() - start, text))
            out.write(text + "\n")
            out.flush()
            if echo:
                log.info(f"  [{name}] {text}")
        code = child.wait()
        seconds = time.perf_counter() - start
        sampler.done.set()
        sampler.join()
    now = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = now.ru_utime + now.ru_stime - used.ru_utime - used.ru_stime
    return Measured(name, command, seconds, cpu, code, sampler.max_process, sampler.max_tree, lines, str(log), sampler.peak_at)
