"""Pretraining entry point: ``python -m fbt_megatron.train --recipe recipes/NAME.yaml [overrides]``.

Runs alone (one process) or under ``torchrun``/``srun``. Overrides use Megatron-LM's argument
names (``--train-iters 200 --micro-batch-size 4 --tensor-model-parallel-size 2 --save runs/x``).
``--dry-run`` prints the plan for this world (``fbt_megatron.launch.plan``) before any process
group or data. Otherwise the recipe is checked, the planner's memory estimate is weighed against
this node (``launch.plan.this_machine``: a warning before the start, once per node; the estimate
beside the first step's peak: ``trainer.callbacks.planned_memory``), rank 0 prepares the data it names (the embedded
corpus, a state-tracking task, the tiny SFT set: ``trainer.data.prepare_data``) and every rank
runs the loop (``fbt_megatron.trainer.loop``) on prepared data.
"""

import logging
import os

from fbt_megatron.common.cli import quiet_library_warnings, run_cli
from fbt_megatron.common import logs
from fbt_megatron.recipe import Recipe, flags

log = logging.getLogger(__name__)

DESCRIPTION = ("Train an FBT model (or its baseline) from a recipe, alone or under torchrun/srun. "
               "Every recipe field is a flag; the defaults shown are the recipe's.")


def parse_args(argv=None) -> Recipe:
    return flags.parse(argv, prog="python -m fbt_megatron.train", description=DESCRIPTION)


def main(argv=None) -> int:
    logs.setup_logging()
    quiet_library_warnings()
    recipe, world = parse_args(argv), int(os.environ.get("WORLD_SIZE", "1"))
    logs.stamp_lines(recipe.logging.log_timestamps)
    # torch and megatron-core load once the flags are parsed: --help and a bad flag answer at once
    from fbt_megatron.launch.plan.planner import print_plan
    from fbt_megatron.launch.plan.this_machine import estimate_here
    from fbt_megatron.trainer.callbacks.planned_memory import PlannedMemory
    from fbt_megatron.trainer.data import prepare_data
    from fbt_megatron.trainer.loop import train

    if recipe.training.dry_run:
        print_plan(recipe, world)
        return 0
    recipe.validate(world)  # bad input is one line before any work
    planned, warning = estimate_here(recipe, world)  # the planner's memory per process; can this node hold it?
    if warning and int(os.environ.get("LOCAL_RANK", "0")) == 0:  # once per node
        log.warning(warning, extra=logs.EVERY_RANK)
    if int(os.environ.get("RANK", "0")) == 0:
        with logs.on_this_rank():  # rank 0 says what it prepares
            prepare_data(recipe)
    train(recipe, callbacks=[PlannedMemory(planned)] if planned else [])
    return 0


def cli() -> None:
    """The ``fbt-train`` console script."""
    run_cli(main)


if __name__ == "__main__":
    cli()
