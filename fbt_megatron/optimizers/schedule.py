"""The learning-rate and weight-decay schedule: megatron-core's OptimizerParamScheduler, with AdamC.

A run's curve is ``lr_schedule`` (the flags that define it, saved in every checkpoint);
``choose_schedule`` decides which curve a resumed run follows, ``build_scheduler`` builds it,
``describe_schedule`` says it in words, ``cooldown_start`` is where AdamC and the z-loss switch on.

Each param group follows the scheduler's curve up to its own peak (``max_lr`` of the group:
NorMuon's ``--lr``, Adam's ``--adam-lr``; megatron-core honours the override). With
``--weight-decay-schedule adamc`` (Defazio et al., "Why gradients rapidly increase near the end of
training"), from the first cooldown step on a group's weight decay is multiplied by
lr_t / lr_max of that group, so the decoupled decay lr_t · wd_t of the normalised layers' matrices
shrinks with lr_t² instead of lr_t; before the cooldown it is unchanged.
"""

from __future__ import annotations

from typing import Optional, Tuple

from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from fbt_megatron.common.cli import plural
from fbt_megatron.common.errors import RecipeError
from fbt_megatron.recipe import Recipe, flags


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


def lr_schedule(recipe: Recipe) -> dict:
    """The flags that define the learning-rate and weight-decay curve (saved in every checkpoint,
    so that a resumed run knows whether its curve is the one the checkpoint was trained on)."""
    o = recipe.optimizer
    schedule = {"lr": o.lr, "min_lr": o.min_lr, "lr_warmup_iters": o.lr_warmup_iters,
                "train_iters": recipe.training.train_iters, "lr_decay_style": o.lr_decay_style, "weight_decay": o.weight_decay}
    if o.weight_decay_schedule != "constant":  # recorded when not the default: older checkpoints stay resumable
        schedule["weight_decay_schedule"] = o.weight_decay_schedule
    if o.optimizer == "normuon":
        schedule["adam_lr"] = o.lr if o.adam_lr is None else o.adam_lr
    if o.lr_decay_style == "WSD":
        schedule.update(lr_wsd_decay_style=o.lr_wsd_decay_style, lr_wsd_decay_fraction=o.lr_wsd_decay_fraction)
    return schedule


def _wsd_decay_iters(schedule: dict) -> int:
    return round(schedule["lr_wsd_decay_fraction"] * schedule["train_iters"])


def cooldown_start(schedule: dict) -> Optional[int]:
    """The first step of the cooldown: the first 0-based iteration whose learning rate is below its
    peak (WSD: the last ``lr_wsd_decay_fraction`` of the run; cosine and linear: after warmup;
    constant: none). megatron-core's scheduler keeps the peak at the decay's start step
    (lr(i) = peak for i <= start), so the cooldown begins one later. AdamC's weight decay and the
    z-loss switch on there."""
    style = schedule["lr_decay_style"]
    if style == "WSD":
        return schedule["train_iters"] - _wsd_decay_iters(schedule) + 1
    return None if style == "constant" else schedule["lr_warmup_iters"] + 1


def build_scheduler(optimizer, schedule: dict):
    """megatron-core's OptimizerParamScheduler for ``schedule`` (with AdamC weight decay in the
    cooldown when asked: ``WeightDecayScheduler``). It is the curve this run chose
    (``choose_schedule``), so loading a checkpoint restores only its step count. Every param group
    peaks at its own ``max_lr`` (Adam's at ``adam_lr`` under normuon)."""
    wsd = schedule["lr_decay_style"] == "WSD"
    adamc = schedule.get("weight_decay_schedule") == "adamc"
    return WeightDecayScheduler(
        optimizer,
        adamc_from=cooldown_start(schedule) if adamc else None,
        init_lr=0.0,
        max_lr=schedule["lr"],
        min_lr=schedule["min_lr"],
        lr_warmup_steps=schedule["lr_warmup_iters"],
        lr_decay_steps=schedule["train_iters"],
        lr_decay_style=schedule["lr_decay_style"],
        start_wd=schedule["weight_decay"],
        end_wd=schedule["weight_decay"],
        wd_incr_steps=schedule["train_iters"],
        wd_incr_style="constant",
        wsd_decay_steps=_wsd_decay_iters(schedule) if wsd else None,
        lr_wsd_decay_style=schedule["lr_wsd_decay_style"] if wsd else None,
        override_opt_param_scheduler=True,
        use_checkpoint_opt_param_scheduler=False,
    )


def describe_schedule(schedule: dict, train_iters: int) -> str:
    """The learning-rate curve in words, e.g. "warmup to 3.0e-03 over 20 steps, constant to step
    600, linear decay to 0.0e+00 at step 800"."""
    s, end = schedule, schedule["train_iters"]
    parts = [f"warmup to {s['lr']:.1e} over {plural(s['lr_warmup_iters'], 'step')}" if s["lr_warmup_iters"] else f"{s['lr']:.1e} from step 1"]
    if s["lr_decay_style"] == "WSD":
        parts += [f"constant to step {end - _wsd_decay_iters(s)}", f"{s['lr_wsd_decay_style']} decay to {s['min_lr']:.1e} at step {end}"]
    elif s["lr_decay_style"] == "constant":
        parts.append("constant")
    else:
        parts.append(f"{s['lr_decay_style']} decay to {s['min_lr']:.1e} at step {end}")
    if train_iters > end and s["lr_decay_style"] != "constant":
        parts.append(f"then {s['min_lr']:.1e} to step {train_iters}")
    if "adam_lr" in s:
        parts.append(f"Adam's peak {s['adam_lr']:.1e}")
    if s.get("weight_decay_schedule") == "adamc":
        parts.append("AdamC weight decay in the cooldown")
    return ", ".join(parts)


def _curve(schedule: dict) -> dict:
    """What shapes the curve: a constant learning rate does not depend on the run's length."""
    return {k: v for k, v in schedule.items() if not (k == "train_iters" and schedule["lr_decay_style"] == "constant")}


def choose_schedule(recipe: Recipe, saved: Optional[dict]) -> Tuple[dict, Optional[str]]:
    """The learning-rate schedule of this run, and a note when resuming changes it. As in
    Megatron-LM, a checkpoint trained on another curve (a longer --train-iters, a new --lr, warmup
    or decay) is refused unless the run says which curve applies:
    ``--override-opt-param-scheduler`` (this run's, recomputed for its length) or
    ``--use-checkpoint-opt-param-scheduler`` (the checkpoint's, whatever the flags say)."""
    ours = lr_schedule(recipe)
    theirs = saved.get("lr_schedule") if saved else None
    if theirs is None or _curve(theirs) == _curve(ours):
        return ours, None
    changed = ", ".join(
        f"{flags.flag(key)} {flags.show(theirs.get(key))} → {flags.show(ours.get(key))}"
        for key in [*ours, *(k for k in theirs if k not in ours)] if theirs.get(key) != ours.get(key)
    )
    c = recipe.checkpoint
    if c.override_opt_param_scheduler:
        return ours, f"learning-rate schedule changed since the checkpoint ({changed}): this run's applies (--override-opt-param-scheduler)"
    if c.use_checkpoint_opt_param_scheduler:
        return theirs, f"learning-rate schedule changed since the checkpoint ({changed}): the checkpoint's applies (--use-checkpoint-opt-param-scheduler)"
    raise RecipeError(
        f"the checkpoint in {c.load} (step {saved['iteration']}) was trained with another learning-rate schedule ({changed}): "
        f"add --override-opt-param-scheduler to apply this run's from step {saved['iteration'] + 1}, "
        f"or --use-checkpoint-opt-param-scheduler to keep the checkpoint's"
    )
