"""``python -m fbt_megatron.plan --recipe R --nodes N --gpus-per-node G [--gpu h100|h200|a100 |
--gpu-memory-gb M] [--mfu 0.4] [--fit-global-batch] [any training flag]``: the plan of a run
(``fbt_megatron.launch.plan``)."""

from __future__ import annotations

from fbt_megatron.common.cli import quiet_library_warnings, run_cli
from fbt_megatron.common.logs import setup_logging
from fbt_megatron.common.gpus import GPUS
from fbt_megatron.launch.plan.planner import batch_fit, format_plan, make_plan
from fbt_megatron.recipe import RecipeError, flags

PROG = "python -m fbt_megatron.plan"


def parse(argv=None):
    """(planner options, the recipe with training flags applied)."""
    parser = flags.FlagParser(prog=PROG, add_help=False)
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--gpus-per-node", type=int, default=1)
    parser.add_argument("--gpu", choices=sorted(GPUS))
    parser.add_argument("--gpu-memory-gb", type=float)
    parser.add_argument("--mfu", type=float, default=0.4)
    parser.add_argument("--fit-global-batch", action="store_true")
    args, rest = parser.parse_known_args(argv)
    if args.nodes < 1 or args.gpus_per_node < 1:
        raise RecipeError("--nodes and --gpus-per-node must be >= 1")
    if args.gpu and args.gpu_memory_gb:
        raise RecipeError("--gpu and --gpu-memory-gb are exclusive: pick one")
    description = ("Plan a run: parameters, steps, layout, memory per GPU, FLOPs and wall time. Planner options: "
                   "--nodes N --gpus-per-node G [--gpu " + "|".join(sorted(GPUS)) + " | --gpu-memory-gb M] [--mfu 0.4] "
                   "[--fit-global-batch: a global batch that does not divide over the data-parallel ranks becomes the "
                   "nearest that does, with the --train-iters that keep its tokens]; the training flags below override the recipe.")
    return args, flags.parse(rest, prog=PROG, description=description)


def main(argv=None) -> int:
    setup_logging()
    quiet_library_warnings()
    args, recipe = parse(argv)
    world_size = args.nodes * args.gpus_per_node
    fit = batch_fit(recipe, world_size)
    if fit is not None and not args.fit_global_batch:
        raise RecipeError(fit.problem())
    if fit is not None:
        print(fit.apply())
    plan = make_plan(recipe, world_size, GPUS.get(args.gpu), args.gpu_memory_gb, args.mfu)
    print(format_plan(plan))
    return 0


if __name__ == "__main__":
    run_cli(main)
