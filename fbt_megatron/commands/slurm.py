"""``python -m fbt_megatron.slurm submit ...``: render a training job (or a chain of them) from
slurm/ and submit it with sbatch, after planning every stage for the requested nodes × GPUs
(``--dry-run``: print the plans and scripts). ``serve EXPORT`` and ``evaluate MODEL ...``: a vLLM
server, or an lm-eval table, on one GPU node. ``prepare``: a corpus tokenized over many nodes (a
job array of shards, then their merge). ``goodput RUN ...``: where runs' jobs' node-hours went.
Inside a job: ``python -m fbt_megatron.slurm torchrun ...`` and ``python -m fbt_megatron.slurm task ...`` start the training processes (``launch``)."""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from pathlib import Path

from fbt_megatron.common.cli import quiet_library_warnings, run_cli
from fbt_megatron.common.logs import setup_logging
from fbt_megatron.common.gpus import GPUS
from fbt_megatron.launch.slurm import launch, script
from fbt_megatron.recipe import RecipeError

EXAMPLES = """examples:
  python -m fbt_megatron.slurm submit --recipe recipes/fbt_1b_100b.yaml --nodes 8 --gpus-per-node 8 --gpu h100 \\
      --time 04:00:00 --partition gpu --container-image /shared/images/fbt-megatron+26.06.sqsh --fit-global-batch \\
      -- --train-data-path "[/data/web_text_document]" --tokenizer-model /data/tokenizer.model
  python -m fbt_megatron.slurm submit --chain recipes/fbt_1b_100b.yaml recipes/longctx_32k.yaml recipes/sft.yaml \\
      --nodes 8 --gpus-per-node 8 --gpu h100 --time 04:00:00 --runs-root runs/1b --container-image IMAGE \\
      --stage-args sft="--train-data-path [/data/chat_train.jsonl] --valid-data-path [/data/chat_valid.jsonl]" ...
Training flags after -- go to every stage (python -m fbt_megatron.train --help); --stage-args NAME=FLAGS to one."""
SERVE_EXAMPLES = """example:
  python -m fbt_megatron.slurm serve runs/1b/exports/sft-iter22889 --time 08:00:00 --partition gpu \\
      --container-image IMAGE -- --max-model-len 4096
Flags after -- go to vllm serve."""
EVALUATE_EXAMPLES = """example:
  python -m fbt_megatron.slurm evaluate runs/1b/exports/sft-iter22889 --output runs/1b/eval/sft-vllm.md \\
      --time 02:00:00 --partition gpu -- --modes standard 'fused(2)'
Flags after -- go to python -m fbt_megatron.evaluation table."""
PREPARE_EXAMPLES = """example:
  python -m fbt_megatron.slurm prepare --input '/data/web/*.jsonl.zst' --tokenizer /data/tokenizer.model \\
      --output-prefix /data/web_text_document --shards 64 --time 04:00:00 --partition cpu -- --skip-bad-records 0.01%
Flags after -- go to tools/preprocess_data.py."""


class _Parser(argparse.ArgumentParser):
    """Mistakes on the command line are one line (``cli.run_cli``), not a usage block."""

    def error(self, message):
        raise RecipeError(f"{message} (python -m fbt_megatron.slurm {self.prog.split()[-1]} --help)")


def _job_options() -> argparse.ArgumentParser:
    """The options every job has: where, how long, in which container and environment."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--time", required=True, help="time limit of each job, HH:MM:SS or D-HH:MM:SS")
    p.add_argument("--partition")
    p.add_argument("--account")
    p.add_argument("--container-image", help="run the tasks in this image (pyxis: srun --container-image): the project's "
                   "image, docs/gpu.md#the-container")
    p.add_argument("--container-mounts", action="append", default=[], metavar="SRC:DST[:FLAGS]",
                   help="also mount this in the container (repeatable; the work folder is always mounted)")
    p.add_argument("--container-runtime", choices=script.CONTAINER_RUNTIMES, default="pyxis",
                   help="what runs --container-image: pyxis (srun's --container-* options, default), or apptainer "
                   "(srun ... apptainer exec IMAGE: a .sif file, Apptainer or Singularity on the nodes; docs/slurm.md)")
    p.add_argument("--sbatch-option", action="append", default=[], metavar="OPTION",
                   help="an extra #SBATCH line, e.g. --sbatch-option=--qos=high (repeatable; written after ours)")
    p.add_argument("--socket-ifname", metavar="IFACE[,IFACE]",
                   help="the network interfaces of the job's gloo groups and of NCCL's bootstrap and socket transport "
                   "(GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME: exactly these), e.g. ib0: on nodes with several networks "
                   "the one the host name resolves to may not reach the others")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="export this in the job, after the NCCL defaults and --socket-ifname (repeatable), "
                   "e.g. --env NCCL_IB_HCA=mlx5")
    p.add_argument("--cpus-per-task", type=int, metavar="N",
                   help="CPUs of each task (default: training jobs take whole nodes, one-GPU jobs 8 CPUs per GPU)")
    p.add_argument("--log-dir", default="logs", help="job logs: <log-dir>/<name>-<job id>.out (default logs)")
    p.add_argument("--dry-run", action="store_true", help="check and print the job scripts, submit nothing")
    return p


def _restart_options(s: argparse.ArgumentParser) -> None:
    """``submit``'s options of what a failed job does: restart in the job, on a spare, or requeued."""
    s.add_argument("--max-restarts", type=int, default=3, metavar="N",
                   help="restart a failed job (a crash, a killed rank, a hang) up to N times from one checkpoint: "
                        "inside the allocation (torchrun launch; see --restart), else requeued away from the failed "
                        "node where the partition has one to spare; exit code 2 (bad input) is never retried; a node "
                        "lost is Slurm's requeue, not counted (default 3)")
    s.add_argument("--restart", choices=("in-job", "requeue"), default="in-job",
                   help="in-job: torchrun restarts the workers inside the allocation first (--launch torchrun), "
                        "requeueing once those restarts are spent; requeue: every restart is a requeue (default in-job)")
    s.add_argument("--spare-nodes", type=int, default=0, metavar="N",
                   help="allocate N nodes more than the training's, waiting in torchrun's rendezvous: a node lost "
                        "is replaced by one inside the allocation and the training continues on the same layout "
                        "(--restart in-job, --launch torchrun; with none left, or the first node lost: requeued)")
    s.add_argument("--exclude-stragglers", action="store_true",
                   help="also keep the nodes the training named as stragglers (--straggler-threshold) out of the "
                        "job's next start")


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m fbt_megatron.slurm", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = p.add_subparsers(dest="command", required=True)
    common = _job_options()
    s = commands.add_parser("submit", help="plan, render and submit training jobs", epilog=EXAMPLES, parents=[common],
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    what = s.add_mutually_exclusive_group(required=True)
    what.add_argument("--recipe", help="the recipe of one training stage")
    what.add_argument("--chain", nargs="+", metavar="RECIPE",
                      help="stages run one after another, each from the previous one's weights, then export + evaluation")
    s.add_argument("--nodes", type=int, required=True, help="nodes of each job")
    s.add_argument("--gpus-per-node", type=int, required=True, help="0: CPU, one process per node, no GRES")
    s.add_argument("--gpu", choices=sorted(GPUS), help="the nodes' GPU: check the memory plan against it, estimate the time")
    s.add_argument("--gpu-memory-gb", type=float, help="or only its memory, GiB")
    s.add_argument("--fit-global-batch", action="store_true",
                   help="a stage whose global batch does not divide over its data-parallel ranks gets the nearest that "
                        "does, with the --train-iters that keep its tokens (default: refuse, naming them)")
    s.add_argument("--stage-args", action="append", default=[], metavar="STAGE=FLAGS",
                   help="training flags of one stage of a --chain (by recipe name), e.g. "
                        "--stage-args sft='--train-data-path [/data/chat.jsonl]' (repeatable)")
    s.add_argument("--exclusive", action=argparse.BooleanOptionalAction, default=True,
                   help="training jobs take whole nodes (default; --no-exclusive needs --cpus-per-task)")
    s.add_argument("--procs-per-node", type=int, default=1, metavar="N",
                   help="training processes per node with --gpus-per-node 0 (CPU; default 1)")
    _restart_options(s)
    s.add_argument("--launch", choices=script.LAUNCHES, default="torchrun",
                   help="torchrun: one task per node running torchrun; tasks: one task per GPU (default torchrun)")
    s.add_argument("--rdzv-join-timeout", type=int, metavar="SECONDS",
                   help="--launch torchrun: how long every node's torchrun has to join the rendezvous (torch's join_timeout, "
                        "its default 600 s), above the time a node takes to import the --container-image should the training "
                        f"step have to (default {script.JOIN_TIMEOUT}: {script.IMAGE_IMPORT_ALLOWANCE} s for that, 10 minutes more)")
    s.add_argument("--signal-margin", type=int, default=180, metavar="SECONDS",
                   help="the batch shell gets USR1 this long before the time limit; the training checkpoints and the job "
                        f"requeues (torchrun waits up to this less {script.STOP_RESERVE} s for the save; default 180)")
    s.add_argument("--exit-margin", type=float, metavar="MINUTES",
                   help="also pass --exit-duration-in-mins (the time limit minus this): stop without a signal")
    s.add_argument("--runs-root", default="runs", help="run folders are <runs-root>/<recipe name> (default runs)")
    s.add_argument("--name", help="job and run-folder name of a single stage (default: the recipe's file name)")
    s.add_argument("--eval-args", help="python -m fbt_megatron.evaluation table flags of the chain's final export + evaluation job, e.g. "
                                        "--eval-args='--modes standard fused(2) --limit 100' (default: its defaults)")
    v = commands.add_parser("serve", help="serve an export with vLLM (vllm serve) on one GPU node", parents=[common],
                            epilog=SERVE_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    v.add_argument("export", help="a Hugging Face export folder (python -m fbt_megatron.convert to-hf)")
    v.add_argument("--gpus", type=int, default=1, help="GPUs of the job (default 1; more: pass --tensor-parallel-size after --)")
    v.add_argument("--port", type=int, default=8000, help="the server's port on its node (default 8000)")
    v.add_argument("--name", help="job name (default serve-<export folder name>)")
    e = commands.add_parser("evaluate", help="evaluate exports or runs with lm-eval (python -m fbt_megatron.evaluation table) on one GPU node",
                            parents=[common], epilog=EVALUATE_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    e.add_argument("models", nargs="+", metavar="MODEL", help="Hugging Face export folders or run folders")
    e.add_argument("--output", required=True, help="the table (markdown; details in the .json beside it)")
    e.add_argument("--backend", choices=("vllm", "hf"), default="vllm", help="vLLM's engine (default) or transformers")
    e.add_argument("--gpus", type=int, default=1, help="GPUs of the job (default 1)")
    e.add_argument("--name", help="job name (default eval-<output file name>)")
    r = commands.add_parser("prepare", help="tokenize a corpus over many nodes: a job array of shards, then their merge",
                            parents=[common], epilog=PREPARE_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    r.add_argument("--input", nargs="+", required=True, help="files, folders or glob patterns (tools/preprocess_data.py)")
    r.add_argument("--tokenizer", required=True, help="a sentencepiece .model, tokenizer.json or .tiktoken file")
    r.add_argument("--output-prefix", required=True, help="the merged PREFIX.bin/.idx (shards: PREFIX_shard-IIIII-of-NNNNN)")
    r.add_argument("--shards", type=int, required=True, help="array tasks, one shard of the inputs' files each")
    r.add_argument("--name", help="job name (default prepare-<output prefix name>)")
    g = commands.add_parser("goodput", help="where the allocated node-hours of runs' Slurm jobs went: productive steps "
                                            "and badput by cause (jobs.jsonl, timeline.jsonl)")
    g.add_argument("runs", nargs="+", metavar="RUN", help="run folders (a chain's stages: its account is their sum)")
    g.add_argument("--plot", metavar="PNG", help="also draw the accounts as stacked bars into this file")
    commands.add_parser("torchrun", help="inside a job: --stop-timeout SECONDS, then torchrun's command line: torchrun "
                                         "that waits that long for the workers' save on SIGTERM (--launch torchrun)")
    commands.add_parser("task", help="inside a job: one training process per task (--launch tasks)")
    return p


def resources(args, nodes: int, gpus_per_node: int) -> script.Resources:
    """The jobs' Resources from the common options, each checked (one line on a bad one)."""
    if nodes < 1:
        raise RecipeError(f"--nodes {nodes}: a job needs at least one node")
    if gpus_per_node < 0:
        raise RecipeError(f"--gpus-per-node {gpus_per_node}: give 0 (CPU) or more")
    script.parse_time(args.time)
    if args.cpus_per_task is not None and args.cpus_per_task < 1:
        raise RecipeError(f"--cpus-per-task {args.cpus_per_task}: give 1 or more")
    if args.container_mounts and not args.container_image:
        raise RecipeError("--container-mounts: mounts are for --container-image")
    if args.container_runtime != "pyxis" and not args.container_image:
        raise RecipeError(f"--container-runtime {args.container_runtime}: the runtime of --container-image; give the image")
    for line in args.sbatch_option:
        if not line.startswith("-") or "\n" in line:
            raise RecipeError(f"--sbatch-option {line!r}: one sbatch option, e.g. --sbatch-option=--qos=high")
    environment = _environment(args)
    exclusive = getattr(args, "exclusive", False)
    if not exclusive and args.command == "submit" and args.cpus_per_task is None:
        raise RecipeError("--no-exclusive: give --cpus-per-task (the CPUs of each task; Slurm's default is often 1)")
    return script.Resources(nodes=nodes, gpus_per_node=gpus_per_node, time=args.time, partition=args.partition,
                            account=args.account, container_image=args.container_image, container_runtime=args.container_runtime,
                            log_dir=Path(args.log_dir).resolve(),
                            container_mounts=args.container_mounts, sbatch_lines=args.sbatch_option, environment=environment,
                            cpus_per_task=args.cpus_per_task, exclusive=exclusive)


def _environment(args) -> dict:
    """What the jobs export after the NCCL defaults: ``--socket-ifname``'s interfaces for gloo and for
    NCCL (exact names: a bare NCCL_SOCKET_IFNAME is a prefix, ib0 would also take ib01), then each
    ``--env`` (which wins over both)."""
    environment = {}
    if args.socket_ifname is not None:
        names = args.socket_ifname.split(",")
        if not all(re.fullmatch(r"[A-Za-z0-9_.:-]{1,15}", name) for name in names):
            raise RecipeError(f"--socket-ifname {args.socket_ifname!r}: network interface names, comma-separated, e.g. "
                              "--socket-ifname ib0 (ip -brief link lists a node's)")
        environment.update(GLOO_SOCKET_IFNAME=",".join(names), NCCL_SOCKET_IFNAME="=" + ",".join(names))
    for item in args.env:
        name, sep, value = item.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise RecipeError(f"--env {item}: expected NAME=VALUE, e.g. --env NCCL_IB_HCA=mlx5")
        environment[name] = value
    return environment


def run_submit(args, train_flags) -> int:
    from fbt_megatron.launch.slurm import preflight, submit  # the recipe's flags: megatron-core's config

    res = resources(args, args.nodes, args.gpus_per_node)
    if args.procs_per_node < 1 or (args.procs_per_node > 1 and args.gpus_per_node):
        raise RecipeError(f"--procs-per-node {args.procs_per_node}: give 1 or more, with --gpus-per-node 0 (GPU nodes run one per GPU)")
    if args.max_restarts < 0:
        raise RecipeError(f"--max-restarts {args.max_restarts}: give 0 (no retries) or more")
    if args.spare_nodes < 0:
        raise RecipeError(f"--spare-nodes {args.spare_nodes}: give 0 or more")
    if args.spare_nodes and (args.launch != "torchrun" or args.restart != "in-job"):
        raise RecipeError(f"--spare-nodes {args.spare_nodes}: spares take a lost node's place in torchrun's rendezvous: "
                          "use them with --launch torchrun and --restart in-job (the defaults)")
    if args.rdzv_join_timeout is not None and args.launch != "torchrun":
        raise RecipeError("--rdzv-join-timeout: the rendezvous of --launch torchrun; --launch tasks has none")
    if args.rdzv_join_timeout is not None and args.rdzv_join_timeout < 1:
        raise RecipeError(f"--rdzv-join-timeout {args.rdzv_join_timeout}: give 1 or more seconds")
    res.cpu_procs_per_node = args.procs_per_node
    limit = script.parse_time(args.time)
    if not script.STOP_RESERVE < args.signal_margin < limit:
        raise RecipeError(f"--signal-margin {args.signal_margin}: must be more than {script.STOP_RESERVE} s (what the job "
                          f"script needs after the training stops) and less than the time limit ({limit} s)")
    if args.exit_margin is not None:
        if not 0 < args.exit_margin < limit / 60:
            raise RecipeError(f"--exit-margin {args.exit_margin}: must be between 0 and the time limit ({limit / 60:g} minutes)")
        train_flags = [*train_flags, "--exit-duration-in-mins", f"{limit / 60 - args.exit_margin:g}"]
    if args.eval_args is not None and not args.chain:
        raise RecipeError("--eval-args: the export + evaluation job follows a --chain")
    if args.name and args.chain:
        raise RecipeError("--name: the stages of a --chain are named after their recipes")
    if args.stage_args and not args.chain:
        raise RecipeError("--stage-args: for the stages of a --chain (one stage's flags go after --)")
    if args.gpu and args.gpu_memory_gb:
        raise RecipeError("--gpu and --gpu-memory-gb are exclusive: pick one")
    stage_flags = {}
    for item in args.stage_args:
        name, sep, flags = item.partition("=")
        if not sep:
            raise RecipeError(f"--stage-args {item}: expected STAGE=FLAGS, e.g. --stage-args sft='--train-iters 100'")
        stage_flags.setdefault(name, []).extend(shlex.split(flags))
    runs_root = Path(args.runs_root).resolve()
    if args.chain:
        stages = submit.chain(args.chain, train_flags, runs_root, stage_flags)
    else:
        stages = [submit.stage(args.recipe, train_flags, runs_root, name=args.name)]
    check = preflight.plan_stages(stages, res, GPUS.get(args.gpu), args.gpu_memory_gb, args.fit_global_batch,
                                  args.signal_margin)
    check.problems += preflight.environment_problems(res, sys.executable)
    paths = [path for s in stages for path in preflight.stage_paths(s)]
    paths += [("--runs-root", str(runs_root))] if args.eval_args is not None else []  # the export + evaluation job's
    check.problems += dict.fromkeys(preflight.mount_problems(res, paths, Path.cwd()))  # a path the stages share: once
    preflight.refuse_on(check, "; the flags of one stage of a chain: --stage-args STAGE='FLAGS'" if args.chain else "")
    eval_args = shlex.split(args.eval_args or "") if args.chain else None
    submit.submit(stages, res, args.launch, args.signal_margin, eval_args, runs_root, args.dry_run,
                  script.Retries(args.max_restarts, args.exclude_stragglers, in_job=args.restart == "in-job" and args.launch == "torchrun",
                                 spare_nodes=args.spare_nodes),
                  args.rdzv_join_timeout or script.JOIN_TIMEOUT)
    return 0


def run_serve(args, serve_args) -> int:
    from fbt_megatron.launch.slurm import preflight, submit

    res = resources(args, 1, args.gpus)
    if not 0 < args.port < 65536:
        raise RecipeError(f"--port {args.port}: give a port number (1-65535)")
    export = Path(args.export)
    problems = preflight.model_problems([args.export], exports_only=True)
    problems += preflight.environment_problems(res, sys.executable, vllm=True)
    problems += preflight.mount_problems(res, [("export", args.export)], Path.cwd())
    preflight.refuse_on(preflight.Check(problems=problems))
    name = args.name or f"serve-{export.resolve().name}"
    job = script.serve_script(name, export.resolve(), args.port, serve_args, res, Path.cwd(), sys.executable)
    submit.submit_jobs([(name, job)], res.log_dir, args.dry_run)
    return 0


def run_evaluate(args, eval_args) -> int:
    from fbt_megatron.launch.slurm import preflight, submit

    res = resources(args, 1, args.gpus)
    output = Path(args.output).resolve()
    problems = preflight.model_problems(args.models)
    problems += preflight.environment_problems(res, sys.executable, vllm=args.backend == "vllm")
    problems += preflight.mount_problems(res, [*(("model", m) for m in args.models), ("--output", str(output.parent))], Path.cwd())
    preflight.refuse_on(preflight.Check(problems=problems))
    name = args.name or f"eval-{output.stem}"
    job = script.export_eval_script(name, [Path(m).resolve() for m in args.models], output.parent / "exports", output,
                                    ["--backend", args.backend, *eval_args], res, Path.cwd(), sys.executable)
    submit.submit_jobs([(name, job)], res.log_dir, args.dry_run)
    return 0


def run_prepare(args, tool_args) -> int:
    from fbt_megatron.launch.slurm import preflight, prepare, submit

    res = resources(args, 1, 0)
    prepare.check(args.input, args.tokenizer, args.output_prefix, args.shards)
    paths = [*(("--input", i) for i in args.input), ("--tokenizer", args.tokenizer), ("--output-prefix", args.output_prefix)]
    preflight.refuse_on(preflight.Check(problems=preflight.environment_problems(res, sys.executable)
                                        + preflight.mount_problems(res, paths, Path.cwd())))
    name = args.name or f"prepare-{Path(args.output_prefix).name}"
    jobs = prepare.jobs(name, args.input, args.tokenizer, args.output_prefix, args.shards, tool_args, res, Path.cwd(),
                        sys.executable)
    submit.submit_jobs(jobs, res.log_dir, args.dry_run)
    return 0


def run_goodput(args, rest) -> int:
    from fbt_megatron.launch import goodput

    if rest:
        raise RecipeError(f"goodput takes no flags after --: {' '.join(rest)}")
    columns, total = {}, goodput.Account()
    for run in map(Path, args.runs):
        if not (run / "jobs.jsonl").is_file():
            raise RecipeError(f"{run}: no jobs.jsonl: not the run folder of a Slurm training job (python -m fbt_megatron.slurm submit)")
        for job, account in goodput.job_accounts(run).items():
            columns[f"{run.name} job {job}"] = account
            total.add(account)
    if len(columns) > 1:
        columns["all" if len(args.runs) == 1 else "chain"] = total
    print(goodput.table(columns))
    if args.plot:
        goodput.plot(columns, Path(args.plot))
        print(f"plot: {args.plot}")
    return 0


def main(argv=None) -> int:
    setup_logging()
    quiet_library_warnings()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["torchrun"]:
        return launch.torchrun(argv[1:])
    if argv[:1] == ["task"]:
        return launch.task(argv[1:])
    ours, passed = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    args = parser().parse_args(ours)
    commands = {"submit": run_submit, "serve": run_serve, "evaluate": run_evaluate, "prepare": run_prepare, "goodput": run_goodput}
    return commands[args.command](args, passed)


if __name__ == "__main__":
    run_cli(main)
