"""The checkpointer: when a training run saves a checkpoint, a callback of the loop (OLMo-core's
``CheckpointerCallback``; Megatron-LM's ``save_checkpoint_and_time``).

At every step's save point (``save_checkpoint``), with ``--save``: a checkpoint every
``--save-interval`` steps, at the last step, and when the run stops there (``stopping``: a signal,
the time budget, ``--exit-interval``), never right after a bad step (``bad_steps``); a run with too
many bad steps in a row ends there with ``BadStepsError`` (its last good checkpoint intact). With
``--async-save`` the checkpoints are written in the background, polled at every save point and
awaited before the run ends (``wait``). The end is recorded in ``<save>/exit_status.json``
(``on_stop``) and said in one line after the log's summary, with what saving cost (``close``).
Before the run starts, ``check_save`` refuses a ``--save`` folder that holds another run; a save
that fails because the folder cannot take it (``checkpointing.save``) ends the run in one line.
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
from fbt_megatron.trainer.callbacks.base import Callback
from fbt_megatron.trainer.callbacks.metrics_writer import METRICS, read_metrics
from fbt_megatron.trainer.stopping import STATUS, stop_line, write_status

log = logging.getLogger(__name__)


class Checkpointer(Callback):
    """The checkpoints of one training run from ``state``'s iteration on (``step``: its
    ``step.TrainStep``, whose model, optimizer, scheduler and bad steps it saves and checks;
    ``stop``: its ``stopping.StopCheck``, whose signal the end names)."""

    def __init__(self, recipe: Recipe, step, state, stop):
        c = recipe.checkpoint
        self.recipe, self.step, self.stop = recipe, step, stop
        newest = checkpointing.latest_iteration(c.save) if c.save else None
        self.last: Optional[Path] = None if newest is None else checkpointing.checkpoint_dir(c.save, newest)  # the newest checkpoint
        self.background = checkpointing.BackgroundSaves() if c.async_save else None  # --async-save
        self.ending: Optional[str] = None  # why the loop ended (``on_stop``)
        self.saves, self.save_time, self.started, self.first_step = 0, 0.0, time.perf_counter(), state.iteration

    def save_checkpoint(self, state, stopping: Optional[str]) -> Optional[Path]:
        t, c, bad = self.recipe.training, self.recipe.checkpoint, self.step.bad
        if self.background is not None:
            self.background.poll()  # finish the checkpoints written in the background by now
        if c.save and not bad.consecutive and (  # never a checkpoint right after a bad step
            stopping or state.iteration == t.train_iters or (c.save_interval and state.iteration % c.save_interval == 0)
        ):
            saving, s = time.perf_counter(), self.step
            self.last = checkpointing.save(c.save, state.iteration, s.model, s.optimizer, s.scheduler, vars(state),
                                           keep_last=c.keep_last_n_checkpoints, background=self.background)
            self.saves, self.save_time = self.saves + 1, self.save_time + time.perf_counter() - saving
        if bad.too_many:
            self.wait()
            write_status(c.save, "bad_steps", state.iteration, t.train_iters, self.last, counts=_counts(state))
            raise bad.error(state.iteration, self.last)
        return self.last

    def wait(self) -> None:
        """Until the checkpoints written in the background are complete."""
        if self.background is not None:
            self.background.wait()

    def on_stop(self, state, reason: str) -> None:
        self.wait()
        self.ending, self.ended_at = reason, state.iteration
        write_status(self.recipe.checkpoint.save, reason, state.iteration, self.recipe.training.train_iters, self.last,
                     self.stop.signal, _counts(state))

    def close(self) -> None:
        """After a run that ended without an error (``on_stop``), below the log's summary line: what
        saving cost; a stopped run's line (the logging rank writes these, in order)."""
        if self.ending is None:
            return
        c, steps, wall = self.recipe.checkpoint, self.ended_at - self.first_step, time.perf_counter() - self.started
        if self.saves:
            log.info(f"{plural(steps, 'step')} in {wall:.1f} s ({wall / max(steps, 1):.3f} s per step), of which saving "
                     f"{plural(self.saves, 'checkpoint')} "
                     f"held up training {self.save_time:.1f} s" + (" (written in the background: --async-save)" if self.background else ""))
        if self.ending in ("signal", "duration"):
            log.info(stop_line(self.stop.describe(self.ending), self.ended_at, c.save, self.last))


def _counts(state) -> dict:
    """What ``exit_status.json`` counts besides the end: the loss spikes and rewinds (the state of
    ``callbacks.spikes`` at the last save point)."""
    spikes = state.callbacks.get("spikes", {})
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
