"""When a training run saves a checkpoint and whether it goes on: Megatron-LM's
``checkpoint_and_decide_exit``, torchtitan's ``CheckpointManager.save(step, last_step)``.

After every step (``save_and_decide_exit``), with ``--save``: a checkpoint every
``--save-interval`` steps, at the last step, at every ``--exit-interval`` step and when the run is
stopped (a signal or the time budget: ``stopping``), never right after a bad step (``bad_steps``);
then the run ends after an exit interval or a stop, or with ``BadStepsError`` once too many steps
in a row were bad (its last good checkpoint intact). With ``--async-save`` the checkpoints are
written in the background, polled every step and awaited before the run ends (``wait``). The end
is recorded in ``<save>/exit_status.json`` and said in one line, with what saving cost (``finish``).
Before the run starts, ``check_save`` refuses a ``--save`` folder that cannot be written or holds
another run; a save that fails because the folder cannot take it (``checkpointing.save``) ends the
run the same way, in one line.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Optional

from fbt_megatron.common.cli import plural
from fbt_megatron.common.errors import RecipeError
from fbt_megatron.recipe import Recipe
from fbt_megatron.trainer import checkpointing
from fbt_megatron.trainer.callbacks.metrics_writer import METRICS, read_metrics
from fbt_megatron.trainer.stopping import STATUS, stop_line, write_status

log = logging.getLogger(__name__)


class Saver:
    """The checkpoints of one training run from ``state``'s iteration on; it logs what
    saving cost and why it stopped."""

    def __init__(self, recipe: Recipe, model, optimizer, scheduler, state):
        c = recipe.checkpoint
        self.recipe, self.model, self.optimizer, self.scheduler = recipe, model, optimizer, scheduler
        newest = checkpointing.latest_iteration(c.save) if c.save else None
        self.last: Optional[Path] = None if newest is None else checkpointing.checkpoint_dir(c.save, newest)  # the newest checkpoint
        self.background = checkpointing.BackgroundSaves() if c.async_save else None  # --async-save
        self.ending = self.reason = None  # why the run ends early ("exit_interval", "signal", "duration"); the stop's reason
        self.saves, self.save_time, self.started, self.first_step = 0, 0.0, time.perf_counter(), state.iteration

    def save_and_decide_exit(self, state, reason: Optional[str], bad, callbacks) -> bool:
        """After a step (``reason``: why ``stopping.StopCheck`` stops the run, or None; ``bad``: the
        ``bad_steps.BadSteps`` record; ``callbacks``: the loop's, their states saved with the
        checkpoint): save when due; True when the run ends here."""
        state.callbacks = callbacks.state_dict()
        t, c = self.recipe.training, self.recipe.checkpoint
        if self.background is not None:
            self.background.poll()  # finish the checkpoints written in the background by now
        exiting = t.exit_interval is not None and state.iteration % t.exit_interval == 0
        if c.save and not bad.consecutive and (  # never a checkpoint right after a bad step
            reason or exiting or state.iteration == t.train_iters or (c.save_interval and state.iteration % c.save_interval == 0)
        ):
            saving = time.perf_counter()
            self.last = checkpointing.save(c.save, state.iteration, self.model, self.optimizer, self.scheduler, vars(state),
                                           keep_last=c.keep_last_n_checkpoints, background=self.background)
            self.saves, self.save_time = self.saves + 1, self.save_time + time.perf_counter() - saving
        if bad.too_many:
            self.wait()
            write_status(c.save, "bad_steps", state.iteration, t.train_iters, self.last, counts=_counts(callbacks))
            raise bad.error(state.iteration, self.last)
        if reason or exiting:
            self.ending, self.reason = reason or "exit_interval", reason
            return True
        return False

    def wait(self) -> None:
        """Until the checkpoints written in the background are complete."""
        if self.background is not None:
            self.background.wait()

    def finish(self, state, stop, callbacks) -> None:
        """After the run (``stop``: its ``stopping.StopCheck``; ``callbacks``: the loop's): what saving
        cost, the exit status, the stop's line."""
        t, c = self.recipe.training, self.recipe.checkpoint
        if self.saves:
            steps, wall = state.iteration - self.first_step, time.perf_counter() - self.started
            log.info(f"{plural(steps, 'step')} in {wall:.1f} s ({wall / max(steps, 1):.3f} s per step), of which saving "
                     f"{plural(self.saves, 'checkpoint')} "
                     f"held up training {self.save_time:.1f} s" + (" (written in the background: --async-save)" if self.background else ""))
        write_status(c.save, self.ending or "finished", state.iteration, t.train_iters, self.last, stop.signal, _counts(callbacks))
        if self.reason:  # said by the logging rank, after its other lines: one process writes them, in order
            log.info(stop_line(stop.describe(self.reason), state.iteration, c.save, self.last))


def _counts(callbacks) -> dict:
    """What ``exit_status.json`` counts besides the end: the loss spikes and rewinds (the state of
    ``trainer.callbacks.spikes``)."""
    spikes = callbacks.state_dict().get("spikes", {})
    return {"spikes": spikes.get("spikes", 0), "rewinds": spikes.get("rewinds", 0)}


def other_run(folder) -> Optional[str]:
    """What makes ``folder`` hold a run (its checkpoints, metrics, exit status), in words; None: nothing."""
    found = []
    steps = checkpointing.iterations(folder)
    if steps:
        found.append(f"checkpoints to step {steps[-1]}")
    if (Path(folder) / METRICS).is_file():
        found.append(f"{METRICS} to step {max((r['step'] for r in read_metrics(folder)), default=0)}")
    if (Path(folder) / STATUS).is_file():
        found.append(STATUS)
    return ", ".join(found) or None


def check_save(recipe: Recipe) -> None:
    """Refuse a ``--save`` folder that holds another run this one would overwrite: a run that does
    not resume it (``--load`` is another folder or unset) starts from scratch there. ``--load X
    --save X`` (a resume, a requeued Slurm job) and ``--overwrite-save`` pass. (Whether this process
    can write there now is the recipe's check: ``Recipe.validate``.)"""
    c = recipe.checkpoint
    if c.save is None:
        return
    if c.overwrite_save or (c.load is not None and Path(c.load).resolve() == Path(c.save).resolve()):
        return
    held = Path(c.save).is_dir() and other_run(c.save)
    if held:
        raise RecipeError(f"--save {c.save} holds another run ({held}) that this run would overwrite: resume it with "
                          f"--load {c.save}, choose another --save, or add --overwrite-save to replace it")
