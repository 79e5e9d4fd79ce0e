"""Loss spikes: a step whose gradient norm is many times its recent level, finite.

The signal is the global gradient norm megatron-core computes for clipping: the same on every rank
(all-reduced already), known before the update, and no extra communication or host sync — so
every rank takes the same decision at the same step, whatever the layout. A step is a spike when
its norm exceeds ``--spike-factor`` × the median of the last ``--spike-window`` finite norms (once
that many are known; they are saved with every checkpoint, the callback's state, so a resumed run
decides as an uninterrupted one). A spiking step enters the window too: a lasting change of level stops counting
as spikes after half a window. ``--spike-policy``:

* ``warn``: the step is applied; one line says so.
* ``skip``: the update is not applied (as a NaN/Inf step: the learning rate does not advance
  either); the data and the iteration move on.
* ``rewind`` (PaLM's practice): the update is not applied, the last checkpoint before the spike is
  reloaded in the process (weights, optimizer, scheduler, RNG streams, the spike window), and
  training goes on from the step after the spike: the batches from the checkpoint to the spike are
  skipped (counted as skipped steps). At most ``--max-rewinds`` in a run; without a checkpoint to go
  back to, or once they are used up, a spike is skipped instead.

Every spike is one line (on the logger rank) and counted (``spikes``, ``rewinds`` in the
callback's state and ``exit_status.json``). The spike drill: ``--inject-fault spike@6 --spike-window 4``.
"""

from __future__ import annotations

import logging
import statistics
from typing import Optional

from fbt_megatron.trainer import checkpointing
from fbt_megatron.trainer.callbacks.base import Callback

log = logging.getLogger(__name__)


class Spikes(Callback):
    """The spike check of a run's steps, a callback of the loop (``training``: the recipe's training
    section; ``save``: the run's checkpoint folder). Its state (the window of norms, the spikes and
    rewinds counted) is saved in every checkpoint under ``spikes``: a resumed run decides as an
    uninterrupted one. ``rewind_with``: what ``--spike-policy rewind`` reloads (the step,
    ``step.TrainStep``: model, optimizer, scheduler, bad steps; the run's ``checkpointer.Checkpointer``)."""

    name = "spikes"

    def __init__(self, training, save: Optional[str], rewind_with: Optional[tuple] = None):
        self.policy, self.factor, self.window = training.spike_policy, training.spike_factor, training.spike_window
        self.max_rewinds, self.save, self.rewind_with = training.max_rewinds, save, rewind_with
        self.norms, self.spikes, self.rewinds = [], 0, 0  # the latest finite gradient norms; the counts
        self.rewind_due = False  # the step just vetoed is to be rewound (``rewind``)
        self.line = ""

    def state_dict(self) -> dict:
        return {"window": list(self.norms), "spikes": self.spikes, "rewinds": self.rewinds}

    def load_state_dict(self, state_dict: dict) -> None:
        self.norms, self.spikes, self.rewinds = list(state_dict["window"]), state_dict["spikes"], state_dict["rewinds"]

    def vetoes_update(self, state, grad_norm: float) -> bool:
        """Step ``state.iteration + 1``'s finite gradient norm seen: True when its update must not be applied."""
        if self.policy == "off":
            return False
        median = statistics.median(self.norms) if len(self.norms) >= self.window else None
        self.norms = (self.norms + [grad_norm])[-self.window:]
        if median is None or grad_norm <= self.factor * median:
            return False
        self.spikes += 1
        self.line = (f"step {state.iteration + 1}: gradient norm {grad_norm:.4g} is {grad_norm / median:.0f}× the median "
                     f"{median:.4g} of the last {self.window} steps (--spike-factor {self.factor:g}): spike {self.spikes}")
        if self.policy == "warn":
            self._say("trained on (--spike-policy warn)")
            return False
        if self.policy == "skip":
            self._say("update skipped (--spike-policy skip)")
        self.rewind_due = self.policy == "rewind"
        return True

    def on_step_end(self, state, record) -> None:
        """After a vetoed step and its record, before its save point: the rewind, when due."""
        if self.rewind_due:
            self.rewind(state)

    def rewind(self, state) -> None:
        """After the vetoed step (``state`` at its iteration): back to the last checkpoint before it,
        in place, the batches since skipped; else (no checkpoint, no rewinds left) the step stays skipped."""
        step, checkpointer = self.rewind_with
        self.rewind_due = False
        checkpointer.wait()  # a checkpoint written in the background is complete (or not there)
        before = [i for i in checkpointing.iterations(self.save) if i < state.iteration] if self.save else []
        newest = before[-1] if before else None  # (a run resumed from an earlier checkpoint may have later ones)
        if newest is None or self.rewinds >= self.max_rewinds:
            why = "no checkpoint to go back to (--save, --save-interval)" if newest is None else f"--max-rewinds {self.max_rewinds} used up"
            self._say(f"update skipped: {why}")
            return
        saved = checkpointing.TrainState.from_saved(checkpointing.read_train_state(self.save, newest))
        step.scheduler.num_steps = 0  # megatron-core's load_state_dict steps the scheduler on by the saved count
        checkpointing.load(self.save, step.model, step.optimizer, step.scheduler, iteration=newest)
        skipped = state.iteration - saved.iteration
        self.norms, self.rewinds = list(saved.callbacks.get(self.name, {}).get("window", [])), self.rewinds + 1
        state.skipped_steps = step.bad.skipped = saved.skipped_steps + skipped
        first = saved.iteration + 1
        steps = f"step {first}" if skipped == 1 else f"steps {first}-{state.iteration}"
        self._say(f"rewound to checkpoint {checkpointing.checkpoint_dir(self.save, newest).name}, the batches of {steps} "
                  f"skipped (rewind {self.rewinds} of --max-rewinds {self.max_rewinds}; --spike-policy rewind)")

    def _say(self, what: str) -> None:
        log.info(f"{self.line}, {what}")
