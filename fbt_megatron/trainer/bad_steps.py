"""Steps whose loss or gradient is NaN/Inf: skipped, counted, and too many in a row stop the run.

``optimizer_step`` is megatron-core's ``MegatronOptimizer.step`` (prepare the gradients, the global
gradient norm, clip, update) with one check between the norm and the update: a norm that is not
finite skips the update, as Megatron-LM skips a step whose fp16 gradients overflowed. The learning
rate scheduler is then not advanced either (the caller's part), while the data and the iteration
move on. The norm is the one megatron-core computes for clipping anyway: all-reduced over the
ranks that hold parts of the gradient (every rank then has the same value on the host), so the
check costs no extra communication and no extra host sync (with ``--clip-grad 0`` megatron-core
would not compute the norm: then it is computed for this check), and every rank skips the same steps. A
NaN or Inf loss reaches it too: the backward of a non-finite loss makes the gradient non-finite.

``--inject-nan`` (its callback: ``callbacks.faults.NaNInjection``) is a testing aid in the spirit
of Megatron-LM's ``--error-injection-rate``:
``"loss@3,grad@5-6,grad@9:inf"`` poisons step 3's forward (the token embeddings are multiplied by
NaN, so the step's loss is NaN: a poisoned batch), the gradients of steps 5 and 6 (after the
backward, every rank multiplies its first parameter's gradient by NaN) and step 9's by Inf.
Steps are counted from 1, as in the logs.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Tuple

import torch

from fbt_megatron.common.errors import BadStepsError


@torch.no_grad()
def optimizer_step(optimizer, veto: Optional[Callable[[float], bool]] = None) -> Tuple[bool, Optional[float]]:
    """(updated, global gradient norm) of one step of a megatron-core optimizer (FP32, mixed
    precision, distributed, chained, layer-wise); no update when the norm is not finite, nor when
    the fp16 loss scaler found an overflow (norm None: its scale is lowered, as in megatron-core),
    nor when ``veto(norm)`` (the loop's callbacks: a spike, ``trainer.callbacks.spikes``)."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    if optimizer.prepare_grads():
        return False, None
    grad_norm = optimizer.get_grad_norm()
    if not math.isfinite(grad_norm) or (veto is not None and veto(grad_norm)):
        return False, grad_norm
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        if inner.config.clip_grad > 0.0 and not getattr(inner, "is_stub_optimizer", False) and inner.get_parameters():
            clip_grad_by_total_norm_fp32(inner.get_parameters(), inner.config.clip_grad, grad_norm,
                                         inner.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)
    updated = optimizer.step_with_ready_grads()
    if hasattr(optimizer, "allgather_params"):  # layer-wise ownership: the owners' new weights to every rank
        optimizer.allgather_params()
    return updated, grad_norm


class BadSteps:
    """Counts skipped steps (``skipped``: in all, resumed runs included) and the current run of
    consecutive bad ones; more than ``max_bad_steps`` in a row stop the run."""

    def __init__(self, max_bad_steps: int, skipped: int = 0):
        self.max_bad_steps, self.skipped, self.consecutive, self.first = max_bad_steps, skipped, 0, None

    def record(self, step: int, updated: bool, grad_norm: Optional[float]) -> None:
        """After ``step`` (1-based): whether it updated the weights and its gradient norm."""
        bad = grad_norm is not None and not math.isfinite(grad_norm)
        self.skipped += not updated
        self.consecutive = self.consecutive + 1 if bad else 0
        self.first = step if self.consecutive == 1 else self.first if bad else None

    @property
    def too_many(self) -> bool:
        return self.consecutive > self.max_bad_steps

    def error(self, step: int, last_good: Optional[str]) -> BadStepsError:
        steps = f"step {step}" if self.consecutive == 1 else f"steps {self.first}-{step}"
        where = f"the last good checkpoint is {last_good}" if last_good else "no checkpoint was saved"
        return BadStepsError(
            f"{self.consecutive} consecutive steps with a NaN/Inf loss or gradient norm ({steps}; --max-bad-steps "
            f"{self.max_bad_steps}): {where}; lower --lr or check the data of these steps"
        )
