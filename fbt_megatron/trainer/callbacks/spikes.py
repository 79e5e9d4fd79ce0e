"""Loss spikes: a step whose gradient norm is many times its recent level, finite.

The signal is the global gradient norm megatron-core computes for clipping: the same on every rank
(all-reduced already), known before the update, and no extra communication or host sync — so
every rank takes the same decision at the same step, whatever the layout. A step is a spike when
its norm exceeds ``--spike-factor`` × the median of the last ``--spike-window`` finite norms (once
that many are known; they are kept in the train state, so a resumed run decides as an
uninterrupted one). A spiking step enters the window too: a lasting change of level stops counting
as spikes after half a window. ``--spike-policy``:

* ``warn``: the step is applied; one line says so.
* ``skip``: the update is not applied (as a NaN/Inf step: the learning rate does not advance
  either); the data and the iteration move on.
* ``rewind`` (PaLM's practice): the update is not applied, the last checkpoint before the spike is
  reloaded in the process (weights, optimizer, scheduler, RNG streams, the spike window), and
  training goes on from the step after the spike: the batches from the checkpoint to the spike are
  skipped (counted as skipped steps). At most ``--max-rewinds`` in a run; without a checkpoint to go
  back to, or once they are used up, a spike is skipped instead.

Every spike is one line (on the logger rank) and counted (``spikes``, ``rewinds`` in the train
state, the log records and ``exit_status.json``). The spike drill: ``--inject-fault spike@6 --spike-window 4``.
"""

from __future__ import annotations

import logging
import statistics
from typing import Optional

from fbt_megatron.trainer import checkpointing
from fbt_megatron.trainer.callbacks.base import Callback

log = logging.getLogger(__name__)


class Spikes:
    """The spike check of a run's steps (``training``: the recipe's training section)."""

    def __init__(self, training, save: Optional[str]):
        self.policy, self.factor, self.window = training.spike_policy, training.spike_factor, training.spike_window
        self.max_rewinds, self.save = training.max_rewinds, save
        self.rewind_due = False  # the step just vetoed is to be rewound (``rewind``)
        self.line = ""

    def vetoes(self, state, step: int, grad_norm: float) -> bool:
        """Step ``step``'s finite gradient norm seen: True when its update must not be applied."""
        if self.policy == "off":
            return False
        window = state.spike_window
        median = statistics.median(window) if len(window) >= self.window else None
        state.spike_window = (window + [grad_norm])[-self.window:]
        if median is None or grad_norm <= self.factor * median:
            return False
        state.spikes += 1
        self.line = (f"step {step}: gradient norm {grad_norm:.4g} is {grad_norm / median:.0f}× the median {median:.4g} "
                     f"of the last {self.window} steps (--spike-factor {self.factor:g}): spike {state.spikes}")
        if self.policy == "warn":
            self._say("trained on (--spike-policy warn)")
            return False
        if self.policy == "skip":
            self._say("update skipped (--spike-policy skip)")
        self.rewind_due = self.policy == "rewind"
        return True

    def rewind(self, state, model, optimizer, scheduler, saver, bad) -> None:
        """After the vetoed step (``state`` at its iteration): back to the last checkpoint before it,
        in place, the batches since skipped; else (no checkpoint, no rewinds left) the step stays skipped."""
        self.rewind_due = False
        saver.wait()  # a checkpoint written in the background is complete (or not there)
        before = [i for i in checkpointing.iterations(self.save) if i < state.iteration] if self.save else []
        newest = before[-1] if before else None  # (a run resumed from an earlier checkpoint may have later ones)
        if newest is None or state.rewinds >= self.max_rewinds:
            why = "no checkpoint to go back to (--save, --save-interval)" if newest is None else f"--max-rewinds {self.max_rewinds} used up"
            self._say(f"update skipped: {why}")
            return
        saved = checkpointing.read_train_state(self.save, newest)
        scheduler.num_steps = 0  # megatron-core's load_state_dict steps the scheduler on by the saved count
        checkpointing.load(self.save, model, optimizer, scheduler, iteration=newest)
        skipped = state.iteration - saved["iteration"]
        state.spike_window, state.rewinds = saved.get("spike_window", []), state.rewinds + 1
        state.skipped_steps = bad.skipped = saved["skipped_steps"] + skipped
        first = saved["iteration"] + 1
        steps = f"step {first}" if skipped == 1 else f"steps {first}-{state.iteration}"
        self._say(f"rewound to checkpoint {checkpointing.checkpoint_dir(self.save, newest).name}, the batches of {steps} "
                  f"skipped (rewind {state.rewinds} of --max-rewinds {self.max_rewinds}; --spike-policy rewind)")

    def _say(self, what: str) -> None:
        log.info(f"{self.line}, {what}")


class Rewind(Callback):
    """``--spike-policy rewind`` as a callback of the loop: after a vetoed step and its record
    (``on_step_end``), before its save point, the step's ``Spikes`` rewinds the run (``rewind``)."""

    def __init__(self, spikes: Spikes, model, optimizer, scheduler, saver, bad):
        self.spikes, self.parts = spikes, (model, optimizer, scheduler, saver, bad)

    def on_step_end(self, state, record) -> None:
        if self.spikes.rewind_due:  # the last checkpoint back, the spike's batches skipped
            self.spikes.rewind(state, *self.parts)
