"""Pretraining entry point: ``python -m fbt_megatron.train --recipe recipes/NAME.yaml [overrides]``.

Runs alone (one process) or under ``torchrun``/``srun``. Overrides use Megatron-LM's argument
names (``--train-iters 200 --micro-batch-size 4 --tensor-model-parallel-size 2 --save runs/x``).
Set up: where the run starts (``stages``), its learning-rate curve (``optimizers.schedule``), the
process groups, the data (``data.build``), the model and optimizer (``build``). Then every step,
top to bottom: pick k for this step (the pass schedule, ``passes``) → one step (``step.TrainStep``:
megatron-core's forward-backward schedule over the microbatches, each doing k passes; gradients
reduced by DDP; the optimizer step; the learning-rate step) → advance the state → validate when
due (``step.validation_due``, at its own interval) → record and log (``metrics.TrainingLog``: the
validation, stragglers) → after a loss spike, rewind (``resilience.spikes``) → the stop check
(``stopping``) → save, and decide whether to exit (``saver.Saver``) → the heartbeat, naming that
save. At start-up every rank's node is recorded (``monitoring.ranks``: ``<save>/ranks.json``). A
watchdog ends a run whose steps stop coming, with every rank's stacks (``resilience.watchdog``).
"""

from __future__ import annotations

import os
import time
from typing import List

import torch
import torch.distributed as dist

from fbt_megatron import checkpointing, flags, megatron_fixes, platform, stages
from fbt_megatron.build import build_model, build_optimizer
from fbt_megatron.checkpointing import TrainState
from fbt_megatron.cli import quiet_library_warnings, run_cli
from fbt_megatron.data.build import build_data
from fbt_megatron.metrics import TrainingLog, epochs_note, header, validation_note
from fbt_megatron.monitoring.ranks import record_ranks
from fbt_megatron.monitoring.wandb_writer import check_wandb
from fbt_megatron.optimizers.schedule import choose_schedule
from fbt_megatron.passes import pass_schedule
from fbt_megatron.plan.planner import print_plan
from fbt_megatron.recipe import Recipe
from fbt_megatron.resilience.watchdog import Watchdog, arm_flight_recorder
from fbt_megatron.saver import Saver, check_save
from fbt_megatron.step import TrainStep, evaluate, validation_due
from fbt_megatron.stopping import StopCheck

DESCRIPTION = ("Train an FBT model (or its baseline) from a recipe, alone or under torchrun/srun. "
               "Every recipe field is a flag; the defaults shown are the recipe's.")


def train(recipe: Recipe) -> List[dict]:
    """Train per the recipe; returns the logged records (also on stdout / metrics.jsonl / TensorBoard)."""
    began = time.monotonic()  # --exit-duration-in-mins counts from here
    t, c, p = recipe.training, recipe.checkpoint, recipe.parallel
    if t.threads:
        torch.set_num_threads(t.threads)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if t.dry_run:  # the plan for this world (fbt_megatron.plan), before any process group or data
        print_plan(recipe, world)
        return []
    recipe.validate(world)
    if recipe.logging.wandb_project is not None:
        check_wandb(recipe.logging)  # the package, and an API key for an online run
    warmup_note = recipe.clamp_warmup()
    check_save(recipe)  # a --save folder holding another run is refused (unless resumed or --overwrite-save)
    origin = stages.start_of(recipe)  # resume, weights of another run (a stage), or None: from scratch
    saved = origin.saved if origin is not None and not origin.weights_only else None
    schedule, schedule_note = choose_schedule(recipe, saved)
    platform.install()
    if c.save:  # its checkpoint writers' manager, forked while small, before CUDA and NCCL (megatron_fixes)
        megatron_fixes.start_write_results_queue()
    arm_flight_recorder(c.save)  # before the process groups: NCCL's timeout dumps its flight recorder to <save>/hang/
    platform.init_distributed(p.tensor_model_parallel_size, p.pipeline_model_parallel_size, t.seed,
                              context_parallel_size=p.context_parallel_size, timeout_s=60 * t.distributed_timeout_minutes)
    data = build_data(recipe, dist.get_rank())
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
        state = TrainState(**{**saved, **{k: getattr(state, k) for k in ("pass_schedule", "lr_schedule", "recipe", "vocab_size")}})
    if c.create_seed_checkpoint:
        print(f"seed checkpoint: {checkpointing.save(c.save, state.iteration, model, None, None, vars(state))}", flush=True)
        return []

    ranks = record_ranks(c.save)  # every rank's node, in <save>/ranks.json (once the inputs are known good)
    is_logger = dist.get_rank() == dist.get_world_size() - 1  # last pipeline stage: it has the losses
    log = TrainingLog(recipe, config, passes, state, ranks, active=is_logger)
    if is_logger:
        notes = [origin and origin.note, warmup_note, schedule_note, validation_note(data.valid, recipe),
                 epochs_note(data.train, recipe)]
        print("\n".join([header(recipe, model, vocab, data, schedule, state.iteration), *filter(None, notes)]), flush=True)
    step = TrainStep(recipe, model, ddp, optimizer, scheduler, data.train, schedule, state.skipped_steps, verbose=is_logger)
    stop = StopCheck(t.exit_duration_in_mins, t.exit_signal_handler, began)  # signals and the time budget
    saver = Saver(recipe, model, optimizer, scheduler, state, verbose=is_logger)
    watchdog = Watchdog(t.hang_timeout_minutes, c.save, state.iteration, t.train_iters)  # a hang: stacks, exit 124
    try:
        while state.iteration < t.train_iters:
            k = passes(state.iteration)
            stop.start_step()  # the ranks agree on stopping while the step computes
            result = step(state, k, measure_deltas=log.due(state.iteration + 1))
            state.advance(k, t.global_batch_size, t.global_batch_size * recipe.data.seq_length, step.bad.skipped)
            valid = evaluate(recipe, config, ddp, data.valid) if validation_due(recipe, state.iteration) else {}
            log.end_step(state, k, result, valid)
            if step.spikes.rewind_due:  # --spike-policy rewind: the last checkpoint back, the spike's batches skipped
                step.spikes.rewind(state, model, optimizer, scheduler, saver, step.bad)
            if saver.save_and_decide_exit(state, stop.stop_reason(), step.bad):
                break
            log.beat(state)  # after the save: the heartbeat names the checkpoint just written
            watchdog.kick(state.iteration)
        saver.wait()
    finally:
        watchdog.close()
        stop.close()
        log.close(state)
    saver.finish(state, stop)
    return log.records


def parse_args(argv=None) -> Recipe:
    return flags.parse(argv, prog="python -m fbt_megatron.train", description=DESCRIPTION)


def main(argv=None) -> int:
    quiet_library_warnings()
    train(parse_args(argv))
    return 0


def cli() -> None:
    """The ``fbt-train`` console script."""
    run_cli(main)


if __name__ == "__main__":
    cli()
