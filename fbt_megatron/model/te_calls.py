"""The k passes on Transformer Engine: TE's per-call state, decided in one place.

FBT calls every layer k times per microbatch; Transformer Engine keeps state per call, and
megatron-core drives it for a model that calls each layer once (TE v2.16, megatron-core 0.16/0.19;
the rules are modelled, with their sources, by the CPU double in ``tests/doubles``):

* **``is_first_microbatch``.** megatron passes it to TE's linears: True on a module's first call
  (again at every step's first microbatch under FP8), then False. With gradient-accumulation fusion
  TE's weight-gradient GEMM *overwrites* ``main_grad`` after a True forward and adds otherwise.
  Pass 1's backward runs last (passes 2..k need its top state), so it would wipe what passes 2..k
  of the same microbatch had added. A model with latent feedback therefore sets
  ``disable_parameter_transpose_cache``: megatron then passes None, and TE always adds and
  quantizes the weight again at every call (under FP8: k casts of each weight per microbatch
  instead of one per step).
* **FP8 scaling.** Delayed scaling keeps an amax history and scales per module, updated when the
  outermost autocast exits with grad enabled. A pass recomputed by TE's checkpoint runs its
  forward under no_grad (no update: at PP > 1 a non-last stage's scales stay at 1.0) and pops a
  stash that it fills only when FP8 was on at the checkpoint's entry; and with megatron's default
  history of 1, pass j quantizes with pass j−1's amax, though the passes' inputs differ (e_t
  against u_t). The default here is current scaling (``tensorwise``: each tensor's own scale,
  no state, on Hopper) or MXFP8 on Blackwell; delayed scaling is refused with
  ``recompute_passes``, and with k > 1 unless its scale is the maximum over a history of at
  least ``DELAYED_HISTORY_PER_PASS`` · k calls.
* **Recompute.** Under FP8 a recomputed pass goes through TE's checkpoint without an outer
  autocast, as megatron-core's block enters it for every recipe but delayed scaling.
"""

from __future__ import annotations

from typing import Callable

import torch
from megatron.core import tensor_parallel

DELAYED_HISTORY_PER_PASS = 16  # amax history calls per pass that delayed scaling needs with k > 1


def fp8_recipe_default() -> str:
    """Current scaling on Hopper and older, MXFP8 on Blackwell (sm100+: TE asserts MXFP8 elsewhere)."""
    blackwell = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 10
    return "mxfp8" if blackwell else "tensorwise"


def settle(config) -> None:
    """Fill in and check the TE fields of an ``FBTConfig`` before megatron-core reads them
    (``disable_parameter_transpose_cache`` and ``fp8_recipe`` left as None take the defaults above)."""
    if config.disable_parameter_transpose_cache is None:
        config.disable_parameter_transpose_cache = config.latent_feedback
    elif config.latent_feedback and not config.disable_parameter_transpose_cache:
        raise ValueError("disable_parameter_transpose_cache false with latent_feedback: TE would overwrite the fused "
                         "passes' weight gradients under gradient-accumulation fusion; leave it unset")
    if config.fp8_recipe is None:
        config.fp8_recipe = fp8_recipe_default()
    if config.fp8 and config.fp8_recipe == "delayed" and config.recompute_passes:
        raise ValueError("fp8_recipe delayed with recompute_passes: a recomputed pass updates no FP8 scale and "
                         "TE's recompute stash does not follow the passes; use fp8_recipe tensorwise (or mxfp8 on "
                         "Blackwell), or recompute_passes false")


def check_pass_count(config, max_passes: int) -> None:
    """ValueError when delayed scaling would quantize one pass with another's amax: with k > 1 its
    scale must be the maximum over at least ``DELAYED_HISTORY_PER_PASS`` · k calls."""
    if not (config.fp8 and config.fp8_recipe == "delayed" and max_passes > 1):
        return
    need = DELAYED_HISTORY_PER_PASS * max_passes
    if config.fp8_amax_compute_algo != "max" or config.fp8_amax_history_len < need:
        raise ValueError(f"fp8_recipe delayed with up to {max_passes} passes needs fp8_amax_compute_algo max and "
                         f"fp8_amax_history_len >= {need} (got {config.fp8_amax_compute_algo}, "
                         f"{config.fp8_amax_history_len}): else a pass quantizes with the previous pass's amax; "
                         "or use fp8_recipe tensorwise")


def checkpoint(config, forward: Callable, *args):
    """Activation checkpointing as megatron-core's TransformerBlock chooses it: Transformer Engine's
    under FP8 (it marks the recompute for TE's modules), megatron's otherwise."""
    if config.fp8 or config.fp4:
        from megatron.core import parallel_state
        from megatron.core.extensions.transformer_engine import te_checkpoint

        return te_checkpoint(forward, False, tensor_parallel.get_cuda_rng_tracker,
                             parallel_state.get_tensor_model_parallel_group(check_initialized=False), *args)
    return tensor_parallel.checkpoint(forward, False, *args)
