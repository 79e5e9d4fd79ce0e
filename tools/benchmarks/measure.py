"""What every benchmark measures with: steps timed in interleaved rounds, the activations autograd
keeps, ratios with their goals, a random batch, and the settings of the run (shape, threads, load)."""

from __future__ import annotations

import contextlib
import gc
import os
import statistics
import sys
import time
import weakref
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import torch

# the model shape flags (make_config fields) every benchmark takes
SHAPE_FLAGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
               "kv_channels", "vocab_size", "seq_length")


@dataclass(frozen=True)
class Ratio:
    """numerator / denominator of a measurement (``kind``: what the benchmark compares, e.g. "time",
    "throughput", "memory") with its goal: ``goal`` is (op, value), op one of <=, >=, ≈ (within 10 %),
    or None for information only."""

    key: str
    label: str
    kind: str
    numerator: str
    denominator: str
    goal: Optional[tuple] = None

    def status(self, value: float) -> str:
        if self.goal is None:
            return "info"
        op, target = self.goal
        ok = {"<=": value <= target, ">=": value >= target, "≈": abs(value / target - 1) <= 0.1}[op]
        return "PASS" if ok else "MISS"

    def result(self, value: float) -> dict:
        """The ratio as a report (and JSON) entry."""
        return dict(label=self.label, value=value, goal=None if self.goal is None else f"{self.goal[0]} {self.goal[1]}",
                    status=self.status(value))


def median_ratio(numerator: List[float], denominator: List[float]) -> float:
    """The median over rounds of the ratio within a round (both steps ran side by side)."""
    return statistics.median(a / b for a, b in zip(numerator, denominator))


# ---------------------------------------------------------------- time
def progress(total: int, desc: str, unit: str):
    """A progress bar on stderr, gone when done (the report is stdout)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, leave=False, file=sys.stderr)


class Seconds(float):
    """What a step of ``time_rounds`` returns when it timed itself (a child process's own clock)."""


def time_rounds(steps: Dict[str, Callable[[], None]], rounds: int, progress) -> Dict[str, List[float]]:
    """Seconds of each step in each of `rounds` rounds. Every round runs every step once, in an
    order rotated by one each round (ABC, BCA, CAB, …), so slow drift and position effects fall
    on all of them alike. Garbage collection runs before, never during, a timed step. A step that
    returns ``Seconds`` returns the time it measured itself (another process's own timing)."""
    names = list(steps)
    times = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            progress.set_postfix_str(name)
            gc.collect()
            gc.disable()
            try:
                start = time.perf_counter()
                measured = steps[name]()
                times[name].append(measured if isinstance(measured, Seconds) else time.perf_counter() - start)
            finally:
                gc.enable()
            progress.update()
    return times


# ---------------------------------------------------------------- memory
class SavedActivations(contextlib.AbstractContextManager):
    """Peak bytes of the tensors autograd keeps for backward while the context is active.

    CPU tensors have no allocator statistics, so this watches what autograd saves: a
    ``saved_tensors_hooks`` pack hook sees every tensor saved for backward (also those saved by
    the forward that megatron's activation recompute re-runs inside backward, since the hooks
    are thread-local state that the autograd engine carries into backward). Memory is counted
    per storage, not per tensor: views and repeated saves of one storage count once (keyed by
    ``storage.data_ptr()``, sized ``storage.nbytes()``). A storage stays counted until it is
    actually freed: ``weakref.finalize`` on the storage's Python object fires when the
    underlying storage is released (PyTorch keeps that object alive as long as any tensor, the
    graph included, still uses the storage), i.e. when backward frees the saved tensors or the
    last tensor viewing it goes away. Live bytes only grow when a new storage is saved, so the
    peak is taken there. Storages in ``exclude`` (the parameters, the batch) are not activations.
    """

    def __init__(self, exclude: set):
        self.exclude = exclude
        self.live: Dict[int, int] = {}
        self.bytes = self.peak = 0
        self._finalizers: List[weakref.finalize] = []
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self.exclude or ptr in self.live or storage.nbytes() == 0:
            return tensor
        self.live[ptr] = storage.nbytes()
        self.bytes += storage.nbytes()
        self.peak = max(self.peak, self.bytes)
        self._finalizers.append(weakref.finalize(storage, self._free, ptr))
        return tensor

    def _free(self, ptr: int) -> None:
        self.bytes -= self.live.pop(ptr)

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        for f in self._finalizers:  # storages still alive (e.g. caches) no longer report here
            f.detach()


def storage_ptrs(tensors) -> set:
    return {t.untyped_storage().data_ptr() for t in tensors}


def peak_activations(step: Callable[[], None], exclude: set) -> int:
    with SavedActivations(exclude) as saved:
        step()
    return saved.peak


@dataclass
class Batch:
    tokens: torch.Tensor  # [b, s]
    labels: torch.Tensor  # [b, s]
    loss_mask: torch.Tensor  # [b, s]
    seeds: List[int]

    @classmethod
    def random(cls, batch: int, seq: int, vocab: int, seed: int) -> "Batch":
        x = torch.randint(0, vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(seed))
        return cls(x[:, :-1], x[:, 1:], torch.ones(batch, seq), list(range(batch)))


# ---------------------------------------------------------------- the run
def start(args) -> float:
    """Torch's threads, the one-process group and the seeds; returns the load average before."""
    from fbt_megatron.common import platform

    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    platform.init_distributed(seed_value=args.seed)
    return load_before


def settings(args, load_before: float, config=None, **extra) -> dict:
    """What a result was measured with: the model ``config``'s shape (when one model is measured),
    ``extra``, the timing settings and the machine's CPUs and load average before and after."""
    shape = {} if config is None else dict(
        preset=args.preset, **{n: getattr(config, n) for n in SHAPE_FLAGS},
        sliding_window=config.sliding_window, full_attention_every=config.full_attention_every)
    return dict(**shape, **extra, threads=args.threads, repeats=args.repeats, warmup=args.warmup, seed=args.seed,
                cpus=os.cpu_count(), load_average=[load_before, os.getloadavg()[0]])


def shape_overrides(args, tiny_shape: dict) -> dict:
    """make_config overrides for the benchmarked shape: the shape flags given, on top of the
    benchmark's own ``tiny_shape`` for ``--preset tiny`` (not with --quick) and of the preset's
    shape otherwise."""
    from fbt_megatron.model.config import PRESETS

    if args.preset not in PRESETS:
        raise ValueError(f"unknown model preset {args.preset!r}; choose one of {sorted(PRESETS)}")
    shape = dict(tiny_shape) if args.preset == "tiny" and not args.quick else {}
    shape.update({name: getattr(args, name) for name in SHAPE_FLAGS if getattr(args, name) is not None})
    full = {**PRESETS[args.preset], **shape}
    if args.hidden_size is not None and args.kv_channels is None:  # keep heads × head size = hidden
        shape["kv_channels"] = full["hidden_size"] // full["num_attention_heads"]
    if full["num_attention_heads"] % full["num_query_groups"]:
        raise ValueError(f"--num-attention-heads ({full['num_attention_heads']}) must be a multiple of "
                         f"--num-query-groups ({full['num_query_groups']})")
    if args.sliding_window is not None:
        shape["sliding_window"] = args.sliding_window or None
    return shape
