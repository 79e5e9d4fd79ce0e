"""The training loop, ``train(recipe)``, read top to bottom (its command: ``fbt_megatron.train``).

Set up: where the run starts (``stages``), its learning-rate curve (``optimizers.schedule``), the
process groups, the data (prepared by the entry point, loaded here: ``data``), the model and
optimizer (``build``), the step (``step.TrainStep``); every rank's node is recorded (``ranks``:
``<save>/ranks.json``). The recipe then says which callbacks the run has, in their order
(``callbacks.registry.callbacks_for``; the protocol: ``callbacks.base``). Then every step, top to
bottom: pick k for this step (the pass schedule, ``passes``) → the step (``step.TrainStep``:
forward-backward over the microbatches, each doing k passes, and the optimizer step; the callbacks
come in at its start, before the update and with a veto on it) → advance the state → validate when
due (``intervals``, ``TrainStep.evaluate``) → the callbacks' ``post_step`` on every rank (at a logged
step the largest rank's memory and the stragglers, for the record) → record (``metrics.TrainingLog``:
time, losses, throughput, the validation and those fields) → ``on_step_end`` with that record (its
writer first: stdout, ``metrics.jsonl``, TensorBoard; the stragglers' line; W&B; after a loss spike,
the rewind) → the stop check (``stopping``: a signal, the time budget, ``--exit-interval``) → the
save point (``Callbacks.save_point``: the callbacks' states with the checkpoint the checkpointer
writes when due or stopping, ``callbacks.checkpointer``; then ``on_save``: the heartbeat naming it,
the hang watchdog's kick). A resumed run's callbacks get their saved states back before
``on_start``. After the last step ``on_stop`` (the exit status); an exception reaches
``on_failure`` first, then goes on; always every callback's ``close`` (the log's summary line, W&B's
last lines, then the checkpointer's: what saving cost, a stopped run's line).
"""

from __future__ import annotations

import logging
import os
import time
from typing import List, Sequence

import torch
import torch.distributed as dist

from fbt_megatron.common import logs, megatron_fixes, platform
from fbt_megatron.optimizers.schedule import choose_schedule
from fbt_megatron.recipe import Recipe
from fbt_megatron.trainer import checkpointing, stages
from fbt_megatron.trainer.build import build_model, build_optimizer
from fbt_megatron.trainer.callbacks.base import Callback
from fbt_megatron.trainer.callbacks.checkpointer import check_save
from fbt_megatron.trainer.ranks import record_ranks
from fbt_megatron.trainer.callbacks.registry import callbacks_for
from fbt_megatron.trainer.callbacks.watchdog import arm_flight_recorder, collective_timeout_s
from fbt_megatron.trainer.checkpointing import TrainState
from fbt_megatron.trainer.data import build_data
from fbt_megatron.trainer.intervals import validation_due
from fbt_megatron.trainer.metrics import TrainingLog, epochs_note, header, validation_note
from fbt_megatron.trainer.passes import pass_schedule
from fbt_megatron.trainer.step import TrainStep
from fbt_megatron.trainer.stopping import StopCheck

log = logging.getLogger(__name__)


def train(recipe: Recipe, callbacks: Sequence[Callback] = ()) -> List[dict]:
    """Train per the recipe; returns the logged records (also on stdout / metrics.jsonl / TensorBoard).
    ``callbacks``: more of them (``callbacks.base.Callback``), called after the recipe's."""
    began = time.monotonic()  # --exit-duration-in-mins counts from here
    t, c, p = recipe.training, recipe.checkpoint, recipe.parallel
    timeout_s = collective_timeout_s(t.distributed_timeout_minutes, t.hang_timeout_minutes)  # the process groups'
    origin, saved, schedule, notes = _check(recipe)
    platform.install()
    if c.save:  # its checkpoint writers' manager, forked while small, before CUDA and NCCL (megatron_fixes)
        megatron_fixes.start_write_results_queue()
    arm_flight_recorder(c.save)  # before the process groups: NCCL's timeout dumps its flight recorder to <save>/hang/
    platform.init_distributed(p.tensor_model_parallel_size, p.pipeline_model_parallel_size, t.seed,
                              context_parallel_size=p.context_parallel_size, timeout_s=timeout_s)
    dist.barrier()  # the entry point's rank 0 prepared the data (trainer.data.prepare_data) before it came here
    data = build_data(recipe, dist.get_rank())
    vocab, config, model, ddp, optimizer, scheduler, passes, state = _build(recipe, origin, saved, data, schedule)
    if c.create_seed_checkpoint:
        log.info(f"seed checkpoint: {checkpointing.save(c.save, state.iteration, model, None, None, vars(state))}")
        return []

    ranks = record_ranks(c.save)  # every rank's node, in <save>/ranks.json (once the inputs are known good)
    is_logger = logs.is_logging_rank()  # the last rank (its pipeline stage has the losses): its lines, metrics, TensorBoard
    training_log = TrainingLog(recipe, config, passes, state)
    step = TrainStep(recipe, model, ddp, optimizer, scheduler, data.train, schedule, state.skipped_steps)
    notes = [origin and origin.note, *notes, validation_note(data.valid, recipe), epochs_note(data.train, recipe)]
    log.info("\n".join([header(recipe, model, vocab, data, schedule, state.iteration), *filter(None, notes)]))
    with StopCheck(t.exit_duration_in_mins, t.exit_signal_handler, began, t.exit_interval) as stop:
        callbacks = callbacks_for(recipe, state, step, stop, dist.get_rank(), active=is_logger, ranks=ranks,
                                  load_seconds=origin.load_seconds if origin else 0.0, extra=callbacks)
        try:
            callbacks.start(state)
            stopping = None
            while state.iteration < t.train_iters and not stopping:
                k, validate = passes(state.iteration), validation_due(recipe, state.iteration + 1)
                stop.start_step()  # the ranks agree on stopping while the step computes
                result = step(state, k, callbacks)
                state.advance(k, t.global_batch_size, t.global_batch_size * recipe.data.seq_length, step.bad.skipped)
                valid = step.evaluate(data.valid) if validate else {}
                fields = {**valid, **callbacks.post_step(state, result)}  # every rank: at a logged step, collectives
                callbacks.step_end(state, training_log.end_step(state, k, result, fields))
                stopping = stop.stop_reason(state.iteration)  # a signal, the time budget, --exit-interval; None: go on
                callbacks.save_point(state, stopping)  # the checkpointer saves when due (always when stopping)
            callbacks.stop(state, stopping or "finished")
        except BaseException as error:
            callbacks.failure(state, error)
            raise
        finally:
            callbacks.close()  # the log's summary line first (its writer's), W&B's last lines, the checkpointer's
    return training_log.records


def _check(recipe: Recipe) -> tuple:
    """Before anything starts: the recipe checked, where the run starts (``stages``: resume, weights
    of another run, or None: from scratch) and its saved train state, the learning-rate curve, notes."""
    if recipe.training.threads:
        torch.set_num_threads(recipe.training.threads)
    warmup_note = recipe.clamp_warmup()
    recipe.validate(int(os.environ.get("WORLD_SIZE", "1")))
    check_save(recipe)  # a --save folder holding another run is refused (unless resumed or --overwrite-save)
    origin = stages.start_of(recipe)
    saved = origin.saved if origin is not None and not origin.weights_only else None
    schedule, schedule_note = choose_schedule(recipe, saved)
    return origin, saved, schedule, [warmup_note, schedule_note]


def _build(recipe: Recipe, origin, saved, data, schedule: dict) -> tuple:
    """(vocabulary, model config, model, DDP, optimizer, scheduler, pass schedule, train state),
    loaded from ``origin`` when the run does not start from scratch."""
    p = recipe.parallel
    vocab = data.tokenizer.padded_vocab_size(p.tensor_model_parallel_size, recipe.data.make_vocab_size_divisible_by)
    stages.check_vocabulary(origin, vocab)
    config, model, ddp = build_model(recipe, vocab)
    optimizer, scheduler = build_optimizer(recipe, config, ddp, schedule)
    passes = pass_schedule(recipe)
    state = TrainState(pass_schedule=passes.state_dict(), model=recipe.to_dict()["model"], lr_schedule=schedule,
                       recipe=recipe.to_dict(), vocab_size=vocab)
    if origin is not None:
        stages.load(origin, recipe, model, optimizer, scheduler)
    if saved is not None:
        state = TrainState.from_saved({**saved, **{k: getattr(state, k) for k in ("pass_schedule", "lr_schedule", "recipe", "vocab_size")}})
    return vocab, config, model, ddp, optimizer, scheduler, passes, state
