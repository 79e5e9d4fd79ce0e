"""The learning-rate and weight-decay schedule: megatron-core's OptimizerParamScheduler, with AdamC.

Each param group follows the scheduler's curve up to its own peak (``max_lr`` of the group:
NorMuon's ``--lr``, Adam's ``--adam-lr``; megatron-core honours the override). With
``--weight-decay-schedule adamc`` (Defazio et al., "Why gradients rapidly increase near the end of
training"), from the first cooldown step on a group's weight decay is multiplied by
lr_t / lr_max of that group, so the decoupled decay lr_t · wd_t of the normalised layers' matrices
shrinks with lr_t² instead of lr_t; before the cooldown it is unchanged.
"""

from __future__ import annotations

from typing import Optional

from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler


class WeightDecayScheduler(OptimizerParamScheduler):
    """OptimizerParamScheduler whose weight decay follows AdamC from ``adamc_from`` (an iteration:
    the scheduler's step count when that iteration runs; None: constant weight decay)."""

    def __init__(self, *args, adamc_from: Optional[int] = None, **kwargs):
        self.adamc_from = adamc_from  # before super(): its __init__ sets the first step's values
        super().__init__(*args, **kwargs)

    def get_wd(self, param_group: Optional[dict] = None) -> float:
        wd = super().get_wd(param_group)
        if self.adamc_from is None or param_group is None or self.num_steps < self.adamc_from:
            return wd
        return wd * self.get_lr(param_group) / param_group.get("max_lr", self.max_lr)
