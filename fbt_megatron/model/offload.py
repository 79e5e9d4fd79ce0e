"""Offloading of recompute inputs to host memory (``offload_recompute_inputs``).

Activation recompute keeps only the inputs of each recomputed region on the device: the pass
inputs (e_t and the carried state s^{(j−1)}) with ``recompute_passes``, every layer's input with
megatron-core's full recompute. With k = 3 passes at long context those inputs are what is left
(k · L · s · b · h values per microbatch under full recompute), and they wait on the device from
a pass's forward until its backward. ``HostOffload`` moves them to pinned host memory as they
are saved and brings them back when backward unpacks them.

It is a ``torch.autograd.graph.saved_tensors_hooks`` context around the checkpointed call, so it
works for any recompute function (megatron-core's, pass-level, under every parallel layout) and
never changes a number: the unpacked tensor is a copy of the saved one. On CUDA the device→host
copy runs on a side stream, and unpacking a region's tensor prefetches the one saved before it
(backward unpacks in reverse order) on another stream. On a CPU-only machine the "host" copy is a
second CPU tensor: the mechanism and its byte count are exercised, nothing is saved.
(torch's ``save_on_cpu`` is the synchronous form of this, for every saved tensor: here the copies
overlap compute, and parameters, small tensors and ``keep`` stay.)

Under pipeline parallelism megatron-core's schedule keeps every received tensor until its backward
anyway, so ``recomputed_pass`` and ``FBTModel.forward`` leave those on the device (``keep``): there
e_t (first stage) and, under full recompute, the other layers' inputs are what moves.

Why not the other candidates (measured in the session that chose this, see the README):
DeepSpeed's ``cpu_checkpointing`` empties every floating-point checkpoint input in place
(``arg.data = torch.empty([])``), which breaks tensors shared between checkpoints (megatron-core
passes one RoPE table to every layer's checkpoint; the carried state is read after its pass);
megatron-core's ``cpu_offloading`` (Transformer Engine's) refuses activation recompute.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch

from fbt_megatron.model.te_calls import checkpoint


@dataclass
class OffloadStats:
    """Bytes (and tensors) moved to host memory since the last ``reset``."""

    bytes: int = 0
    tensors: int = 0

    def reset(self) -> None:
        self.bytes, self.tensors = 0, 0


STATS = OffloadStats()


class _Streams:
    """The two side streams, created on first use on a CUDA device."""

    d2h: Optional["torch.cuda.Stream"] = None
    h2d: Optional["torch.cuda.Stream"] = None

    @classmethod
    def get(cls):
        if cls.d2h is None:
            cls.d2h, cls.h2d = torch.cuda.Stream(), torch.cuda.Stream()
        return cls.d2h, cls.h2d


class _Saved:
    """One offloaded tensor: its host copy, and (CUDA) the events of the copies in flight."""

    __slots__ = ("device", "host", "stored", "device_copy", "loaded")

    def __init__(self, device, host, stored):
        self.device, self.host, self.stored = device, host, stored
        self.device_copy, self.loaded = None, None

    def prefetch(self) -> None:
        """Start the host→device copy on the h2d stream (CUDA), once."""
        if self.device_copy is not None or self.device.type != "cuda":
            return
        _, h2d = _Streams.get()
        h2d.wait_event(self.stored)
        with torch.cuda.stream(h2d):
            self.device_copy = self.host.to(self.device, non_blocking=True)
        self.loaded = h2d.record_event()

    def load(self) -> torch.Tensor:
        if self.device.type != "cuda":
            return self.host.clone()  # a CPU "device": a fresh tensor, as a real copy back would be
        self.prefetch()
        current = torch.cuda.current_stream()
        current.wait_event(self.loaded)
        tensor, self.device_copy = self.device_copy, None
        tensor.record_stream(current)  # allocated on h2d, used on the compute stream
        return tensor


def _offloadable(tensor: torch.Tensor, min_numel: int) -> bool:
    """Activations only: floating, needed for a gradient, not a parameter, at least
    megatron-core's ``min_offloaded_tensor_size`` elements."""
    return (
        tensor.is_floating_point()
        and tensor.requires_grad
        and not isinstance(tensor, torch.nn.Parameter)
        and tensor.numel() >= min_numel
    )


class HostOffload(torch.autograd.graph.saved_tensors_hooks):
    """Within this context, activations saved for backward live in host memory.

    Use it around a checkpointed call only (where the saved tensors are the recompute inputs); one
    instance per call, so its saved list is one region's, unpacked in reverse order."""

    def __init__(self, min_numel: int, keep: Tuple[torch.Tensor, ...] = ()):
        self.saved: List[_Saved] = []
        self.min_numel, self.keep = min_numel, keep
        super().__init__(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor):
        if not _offloadable(tensor, self.min_numel) or any(tensor is k for k in self.keep):
            return tensor
        if tensor.device.type == "cuda":
            d2h, _ = _Streams.get()
            d2h.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(d2h):
                host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
                host.copy_(tensor, non_blocking=True)
            tensor.record_stream(d2h)  # its memory is reused only after the copy
            saved = _Saved(tensor.device, host, d2h.record_event())
        else:
            saved = _Saved(tensor.device, tensor.detach().clone(), None)
        STATS.bytes += tensor.numel() * tensor.element_size()
        STATS.tensors += 1
        saved_index = len(self.saved)
        self.saved.append(saved)
        return saved_index

    def _unpack(self, packed):
        if not isinstance(packed, int):
            return packed
        if packed > 0 and self.saved[packed - 1] is not None:
            self.saved[packed - 1].prefetch()  # most likely the next one backward asks for
        saved, self.saved[packed] = self.saved[packed], None
        return saved.load()


def offloading(config, recomputed: bool, keep: Tuple[torch.Tensor, ...] = ()):
    """A ``HostOffload`` around a ``recomputed`` region when the config asks for it, in a forward
    that will be backpropagated (not the recompute inside backward: its inputs are needed now).
    ``keep``: tensors that stay on the device anyway (held elsewhere until backward)."""
    if not (recomputed and config.offload_recompute_inputs and torch.is_grad_enabled()) or _in_backward():
        return nullcontext()
    return HostOffload(config.min_offloaded_tensor_size, keep)


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def recomputed_pass(config, forward: Callable, embeddings, labels, received, backward_next: bool = False):
    """``forward(embeddings, labels, received)``: one pass on this pipeline stage, under pass-level
    activation checkpointing when ``recompute_passes`` asks for it — only its inputs (e_t and what
    the stage received: the previous pass's top states or the previous stage's hidden states) wait
    for backward, in host memory with ``offload_recompute_inputs`` (but for what a pipeline schedule
    received: it holds that until backward anyway), and the pass is recomputed in backward. Not when
    ``backward_next``: the caller runs this pass's backward right after its forward (the last pass
    on the last stage), so its activations are freed as soon as a recompute's would be, and
    checkpointing would only add a forward."""
    if not config.recompute_passes or backward_next:
        return forward(embeddings, labels, received)
    held = (received,) if config.pipeline_model_parallel_size > 1 else ()
    with offloading(config, recomputed=True, keep=held):
        return checkpoint(config, forward, embeddings, labels, received)

