"""TE's activation checkpointing (TE: pytorch/distributed.py) with its FP8 bookkeeping.

``checkpoint`` runs the function under no_grad, keeping its inputs; in backward it recomputes it
and backpropagates. Around the first forward ``activation_recompute_forward`` tells FP8 modules
that a recompute will follow (only when FP8 is on at that moment: delayed-scaling modules then
stash their scales); around the recompute it marks the recompute phase (they pop the stash) and
re-enters an autocast that is enabled only if FP8 was on when the first forward ended.
"""

from __future__ import annotations

from typing import Callable

import torch

from transformer_engine.pytorch.quantization import FP8GlobalStateManager, autocast

_RECOMPUTE_ENABLED = False  # TE: _FP8_ACTIVATION_RECOMPUTE_ENABLED
_RECOMPUTE_PHASE = False  # TE: _FP8_ACTIVATION_RECOMPUTE_PHASE


def is_fp8_activation_recompute_enabled() -> bool:
    return _RECOMPUTE_ENABLED


def in_fp8_activation_recompute_phase() -> bool:
    return _RECOMPUTE_PHASE


class activation_recompute_forward:
    """TE: distributed.py:241-273. The first-module flag is carried from the first forward to the
    recompute in a FIFO of the class."""

    _is_first_fp8_module: list = []

    def __init__(self, activation_recompute: bool = False, recompute_phase: bool = False):
        self.activation_recompute, self.recompute_phase = activation_recompute, recompute_phase

    def __enter__(self):
        global _RECOMPUTE_ENABLED, _RECOMPUTE_PHASE
        _RECOMPUTE_ENABLED = self.activation_recompute and FP8GlobalStateManager.is_fp8_enabled()
        _RECOMPUTE_PHASE = self.recompute_phase
        state = FP8GlobalStateManager.quantization_state
        if self.activation_recompute and not self.recompute_phase:
            activation_recompute_forward._is_first_fp8_module.append(state.is_first_fp8_module)
        if self.activation_recompute and self.recompute_phase:
            state.is_first_fp8_module = activation_recompute_forward._is_first_fp8_module.pop(0)

    def __exit__(self, *exc):
        global _RECOMPUTE_ENABLED, _RECOMPUTE_PHASE
        _RECOMPUTE_ENABLED = _RECOMPUTE_PHASE = False


class _Checkpoint(torch.autograd.Function):
    """TE: distributed.py:327-470 (the RNG states of the CPU and of megatron's tracker kept and
    replayed; distributing saved activations is not modelled)."""

    @staticmethod
    def forward(ctx, function: Callable, get_rng_state_tracker, *args):
        ctx.function, ctx.tracker = function, get_rng_state_tracker
        ctx.cpu_rng = torch.get_rng_state()
        ctx.tracker_states = get_rng_state_tracker().get_states() if get_rng_state_tracker else None
        with torch.no_grad(), activation_recompute_forward(activation_recompute=True, recompute_phase=False):
            outputs = function(*args)
        ctx.inputs = [None if torch.is_tensor(a) else a for a in args]
        ctx.save_for_backward(*[a if torch.is_tensor(a) else None for a in args])
        ctx.fp8 = FP8GlobalStateManager.is_fp8_enabled()  # at the end of the first forward (:390)
        ctx.fp8_recipe = FP8GlobalStateManager.get_fp8_recipe() if ctx.fp8 else None
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        inputs = [t if t is not None else a for t, a in zip(ctx.saved_tensors, ctx.inputs)]
        cpu_rng = torch.get_rng_state()
        tracker_states = ctx.tracker().get_states() if ctx.tracker else None
        torch.set_rng_state(ctx.cpu_rng)
        if ctx.tracker:
            ctx.tracker().set_states(ctx.tracker_states)
        detached = [a.detach().requires_grad_(a.requires_grad) if torch.is_tensor(a) else a for a in inputs]
        with torch.enable_grad(), activation_recompute_forward(activation_recompute=True, recompute_phase=True), \
                autocast(enabled=ctx.fp8, recipe=ctx.fp8_recipe):
            outputs = ctx.function(*detached)
        torch.set_rng_state(cpu_rng)
        if ctx.tracker:
            ctx.tracker().set_states(tracker_states)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads) if torch.is_tensor(o) and o.requires_grad]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None, *[a.grad if torch.is_tensor(a) else None for a in detached])


def checkpoint(function: Callable, *args, distribute_saved_activations: bool = False, get_rng_state_tracker=None,
               tp_group=None, use_reentrant: bool = True, **kwargs):
    """TE: distributed.py:649-760 (reentrant; keyword arguments only, as TE ≥ 1.5 takes them)."""
    if distribute_saved_activations or not use_reentrant or kwargs:
        raise NotImplementedError("the TE double models the reentrant checkpoint without distributed activations")
    return _Checkpoint.apply(function, get_rng_state_tracker, *args)


class CudaRNGStatesTracker:
    """megatron-core subclasses it at import (``TECudaRNGStatesTracker``); only its use is refused."""

    def reset(self):
        raise NotImplementedError("the TE double does not model TE's RNG tracker (use_te_rng_tracker)")
