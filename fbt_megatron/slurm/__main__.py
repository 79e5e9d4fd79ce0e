"""``python -m fbt_megatron.slurm submit ...``: render a job script from slurm/ and submit it with
sbatch (``--dry-run``: print it). Inside a job: ``python -m fbt_megatron.slurm torchrun ...`` and
``python -m fbt_megatron.slurm task ...`` start the training processes (``launch``)."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from fbt_megatron.cli import quiet_library_warnings, run_cli
from fbt_megatron.recipe import RecipeError
from fbt_megatron.slurm import launch, script

EXAMPLES = """examples:
  python -m fbt_megatron.slurm submit --recipe recipes/fbt_1b_100b.yaml --nodes 8 --gpus-per-node 8 --time 04:00:00 \\
      --partition gpu --container-image nvcr.io/nvidia/pytorch:25.01-py3 -- --micro-batch-size 4
  python -m fbt_megatron.slurm submit --chain recipes/fbt_1b_100b.yaml recipes/longctx_32k.yaml recipes/sft.yaml \\
      --nodes 8 --gpus-per-node 8 --time 04:00:00 --runs-root runs/1b
Training flags after -- go to every stage (python -m fbt_megatron.train --help)."""


class _Parser(argparse.ArgumentParser):
    """Mistakes on the command line are one line (``cli.run_cli``), not a usage block."""

    def error(self, message):
        raise RecipeError(f"{message} (python -m fbt_megatron.slurm {self.prog.split()[-1]} --help)")


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m fbt_megatron.slurm", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = p.add_subparsers(dest="command", required=True)
    s = commands.add_parser("submit", help="render a job script from slurm/ and submit it", epilog=EXAMPLES,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    what = s.add_mutually_exclusive_group(required=True)
    what.add_argument("--recipe", help="the recipe of one training stage")
    what.add_argument("--chain", nargs="+", metavar="RECIPE",
                      help="stages run one after another, each from the previous one's weights, then export + evaluation")
    s.add_argument("--nodes", type=int, required=True, help="nodes of each job")
    s.add_argument("--gpus-per-node", type=int, required=True, help="0: CPU, one process per node, no GRES")
    s.add_argument("--time", required=True, help="time limit of each job, HH:MM:SS or D-HH:MM:SS")
    s.add_argument("--partition")
    s.add_argument("--account")
    s.add_argument("--container-image", help="run the tasks in this image (pyxis: srun --container-image)")
    s.add_argument("--launch", choices=script.LAUNCHES, default="torchrun",
                   help="torchrun: one task per node running torchrun; tasks: one task per GPU (default torchrun)")
    s.add_argument("--signal-margin", type=int, default=180, metavar="SECONDS",
                   help="the batch shell gets USR1 this long before the time limit; the training checkpoints and the job requeues")
    s.add_argument("--exit-margin", type=float, metavar="MINUTES",
                   help="also pass --exit-duration-in-mins (the time limit minus this): stop without a signal")
    s.add_argument("--runs-root", default="runs", help="run folders are <runs-root>/<recipe name> (default runs)")
    s.add_argument("--name", help="job and run-folder name of a single stage (default: the recipe's file name)")
    s.add_argument("--log-dir", default="logs", help="job logs: <log-dir>/<name>-<job id>.out (default logs)")
    s.add_argument("--eval-args", help="tools/eval.py flags of the chain's final export + evaluation job, e.g. "
                                        "--eval-args='--modes standard fused(2) --limit 100' (default: its defaults)")
    s.add_argument("--dry-run", action="store_true", help="print the job scripts, submit nothing")
    commands.add_parser("torchrun", help="inside a job: torchrun, ending with one line on SIGTERM (--launch torchrun)")
    commands.add_parser("task", help="inside a job: one training process per task (--launch tasks)")
    return p


def run_submit(args, train_flags) -> int:
    from fbt_megatron.slurm import submit  # the recipe's flags: megatron-core's config

    if args.nodes < 1:
        raise RecipeError(f"--nodes {args.nodes}: a job needs at least one node")
    if args.gpus_per_node < 0:
        raise RecipeError(f"--gpus-per-node {args.gpus_per_node}: give 0 (CPU) or more")
    limit = script.parse_time(args.time)
    if not 0 < args.signal_margin < limit:
        raise RecipeError(f"--signal-margin {args.signal_margin}: must be between 0 and the time limit ({limit} s)")
    if args.exit_margin is not None:
        if not 0 < args.exit_margin < limit / 60:
            raise RecipeError(f"--exit-margin {args.exit_margin}: must be between 0 and the time limit ({limit / 60:g} minutes)")
        train_flags = [*train_flags, "--exit-duration-in-mins", f"{limit / 60 - args.exit_margin:g}"]
    if args.eval_args is not None and not args.chain:
        raise RecipeError("--eval-args: the export + evaluation job follows a --chain")
    if args.name and args.chain:
        raise RecipeError("--name: the stages of a --chain are named after their recipes")
    runs_root = Path(args.runs_root).resolve()
    if args.chain:
        stages = submit.chain(args.chain, train_flags, runs_root)
    else:
        stages = [submit.stage(args.recipe, train_flags, runs_root, name=args.name)]
    res = script.Resources(nodes=args.nodes, gpus_per_node=args.gpus_per_node, time=args.time, partition=args.partition,
                           account=args.account, container_image=args.container_image, log_dir=Path(args.log_dir).resolve())
    eval_args = shlex.split(args.eval_args or "") if args.chain else None
    submit.submit(stages, res, args.launch, args.signal_margin, eval_args, runs_root, args.dry_run)
    return 0


def main(argv=None) -> int:
    quiet_library_warnings()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["torchrun"]:
        return launch.torchrun(argv[1:])
    if argv[:1] == ["task"]:
        return launch.task(argv[1:])
    ours, train_flags = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    return run_submit(parser().parse_args(ours), train_flags)


if __name__ == "__main__":
    run_cli(main)
