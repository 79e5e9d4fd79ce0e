"""Which callbacks a run has, from its recipe, and their order: ``callbacks_for``."""

from __future__ import annotations

from typing import List, Sequence

from fbt_megatron.trainer.callbacks.base import Callback, Callbacks
from fbt_megatron.trainer.callbacks.checkpointer import Checkpointer
from fbt_megatron.trainer.callbacks.faults import Faults, NaNInjection
from fbt_megatron.trainer.callbacks.heartbeat import Heartbeat
from fbt_megatron.trainer.callbacks.memory import Memory
from fbt_megatron.trainer.callbacks.metrics_writer import MetricsWriter
from fbt_megatron.trainer.callbacks.spikes import Spikes
from fbt_megatron.trainer.callbacks.stragglers import Stragglers
from fbt_megatron.trainer.callbacks.timeline import Timeline
from fbt_megatron.trainer.callbacks.wandb_writer import WandbWriter
from fbt_megatron.trainer.callbacks.watchdog import Watchdog


def callbacks_for(recipe, state, step, stop, rank: int, active: bool, ranks: List[dict], load_seconds: float,
                  extra: Sequence[Callback] = ()) -> Callbacks:
    """The run's callbacks (``state``: where it starts; ``step``: its ``step.TrainStep``; ``stop``:
    its ``stopping.StopCheck``; ``rank``: this process's; ``active``: this rank logs; ``ranks``:
    every rank's node; ``load_seconds``: what loading its checkpoint took), in the order every hook
    calls them:

    1. the training log's writer (``metrics_writer``: stdout, ``metrics.jsonl``, TensorBoard, the
       logging rank): each record before any other callback sees it; the summary line first at the end;
    2. injected faults (``--inject-fault``, ``--inject-nan``: ``faults``): at the step's start,
       inside its clock; a spiking or poisoned gradient before the update;
    3. the largest rank's memory and the stragglers (``memory``, ``stragglers``: every rank, for a
       logged step's record; the stragglers' line after the record's);
    4. Weights & Biases (``--wandb-project``, the logging rank): each record after stdout,
       ``metrics.jsonl`` and TensorBoard have it; its run finishes after the log's summary line;
    5. the spike check (``--spike-policy`` other than off: ``spikes``, every rank, its state saved
       in each checkpoint): it vetoes a spiking step's update; a rewind after that step's record,
       before the save point, so the checkpoint saved next is of the rewound run;
    6. the checkpointer (every rank: ``checkpointer``): the save point; at the end its background
       writes complete and the exit status written before the callbacks after it look, its lines
       after the summary and W&B's;
    7. the heartbeat and the timeline (``--save``, the logging rank): after the save point, so they
       name the checkpoint just written; at the end, the step reached;
    8. the hang watchdog (``--hang-timeout-minutes``): kicked last, so a step, its validation, its
       checkpoint and the heartbeat all count in its timeout;
    9. ``extra`` (``train``'s own argument), after the recipe's: they see what those did.
    """
    t, c, g = recipe.training, recipe.checkpoint, recipe.logging
    checkpointer = Checkpointer(recipe, step, state, stop)
    out = [MetricsWriter(c.save, active=active, tensorboard=g.tensorboard, tensorboard_dir=g.tensorboard_dir,
                         resume_from=state.iteration)]
    if t.inject_fault:
        out.append(Faults(t.inject_fault, c.save, rank, step.model))
    if t.inject_nan:
        out.append(NaNInjection(t.inject_nan, step.model))
    out += [Memory(), Stragglers(g.straggler_threshold, c.save, ranks, active)]
    if g.wandb_project and active:
        out.append(WandbWriter(recipe))
    if t.spike_policy != "off":
        out.append(Spikes(t, c.save, rewind_with=(step, checkpointer)))
    out.append(checkpointer)
    if c.save and active:
        out += [Heartbeat(c.save, g.heartbeat_interval, t.train_iters), Timeline(c.save, checkpointer, ranks, load_seconds)]
    if t.hang_timeout_minutes:
        out.append(Watchdog(t.hang_timeout_minutes, c.save, state.iteration, t.train_iters))
    return Callbacks([*out, *extra])
