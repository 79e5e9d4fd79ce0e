"""Submitting: one training stage, or a chain of stages (each starting from the previous stage's
weights, ``--dependency=afterok``) followed by an export + evaluation job; or one job that
evaluates models or serves an export with vLLM. Every job script is rendered from slurm/
(``script``) and given to ``sbatch --parsable`` on its standard input, once ``preflight`` found
nothing that would make it fail after queueing."""

from __future__ import annotations

import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import yaml

from fbt_megatron.launch.slurm.script import JOIN_TIMEOUT, Resources, Retries, Stage, export_eval_script, training_script
from fbt_megatron.recipe import RecipeError, flags

OWN_FOLDERS = ("--save", "--load", "--pretrained-checkpoint")  # set per stage by a chain


def stage(recipe_path: str, train_flags: List[str], runs_root: Path, name: Optional[str] = None,
          pretrained: Optional[Path] = None) -> Stage:
    """A stage from a recipe and flags, checked as the training entry point checks them. Its run
    folder (its --save and --load: a requeued job resumes from it) is --save among the flags, else
    <runs_root>/<name> (the recipe's own --save/--load are relative to where it was written)."""
    path = Path(recipe_path)
    if not path.is_file():
        raise RecipeError(f"--recipe {recipe_path}: no such file")
    recipe = flags.parse(["--recipe", str(path.resolve()), *train_flags], prog="python -m fbt_megatron.train", description="")
    name = name or path.stem
    c = recipe.checkpoint
    if c.finetune:  # it would load its own newest checkpoint at iteration 0 on every requeue: a job that never ends
        raise RecipeError("--finetune: a Slurm job resumes its own --save on every requeue, and --finetune would restart it "
                          "at step 0 each time; start from another run's weights with --pretrained-checkpoint RUN (its "
                          "weights, iteration 0, fresh optimizer, as --finetune)")
    save = Path(c.save if _given("--save", train_flags) else runs_root / name).resolve()
    if _given("--load", train_flags) and Path(c.load).resolve() != save:
        raise RecipeError(f"--load {c.load}: a Slurm job resumes from its own --save ({save}); "
                          "start from another run's weights with --pretrained-checkpoint")
    if pretrained is None and c.pretrained_checkpoint:
        pretrained = Path(c.pretrained_checkpoint).resolve()
    return Stage(name=name, recipe=str(path.resolve()), save=save, train_iters=recipe.training.train_iters,
                 flags=_timestamped(path, train_flags), pretrained=pretrained, config=recipe)


def _given(flag: str, train_flags: List[str]) -> bool:
    return any(f == flag or f.startswith(flag + "=") for f in train_flags)


def _timestamped(path: Path, train_flags: List[str]) -> List[str]:
    """The flags with ``--log-timestamps`` ahead of them: every line of a job's log opens with its UTC
    time, to be lined up with the cluster's events (the scheduler's, a node's, the file system's);
    unless the flags or the recipe's own ``logging`` section set it."""
    recipe = yaml.safe_load(path.read_text()) or {}
    if _given("--log-timestamps", train_flags) or "log_timestamps" in (recipe.get("logging") or {}):
        return list(train_flags)
    return ["--log-timestamps", *train_flags]


def chain(recipes: List[str], train_flags: List[str], runs_root: Path, stage_flags: Dict[str, List[str]]) -> List[Stage]:
    """Stages run one after another, each from the previous one's final weights; ``stage_flags``:
    training flags of one stage (by name), after (and winning over) those of every stage."""
    names = [Path(r).stem for r in recipes]
    if len(set(names)) != len(names):
        raise RecipeError(f"--chain {' '.join(recipes)}: the stages' recipe names must differ (they name the run folders)")
    unknown = sorted(set(stage_flags) - set(names))
    if unknown:
        raise RecipeError(f"--stage-args {unknown[0]}: no such stage (the stages are {', '.join(names)})")
    for where, flags_given in [("", train_flags), *((f"--stage-args {n}: ", f) for n, f in stage_flags.items())]:
        given = [f for f in OWN_FOLDERS if _given(f, flags_given)]
        if given:
            raise RecipeError(f"{where}--chain sets each stage's {', '.join(OWN_FOLDERS)}: drop {given[0]} (use --runs-root)")
    stages: List[Stage] = []
    for recipe, name in zip(recipes, names):
        stages.append(stage(recipe, [*train_flags, *stage_flags.get(name, [])], runs_root,
                            pretrained=stages[-1].save if stages else None))
    return stages


def sbatch(script: str, dependency: Optional[int] = None) -> int:
    """Submit a job script; its job id."""
    cmd = ["sbatch", "--parsable", *([f"--dependency=afterok:{dependency}"] if dependency else [])]
    run = subprocess.run(cmd, input=script, capture_output=True, text=True)
    if run.returncode:
        raise RecipeError(f"sbatch failed: {' '.join((run.stderr or run.stdout).split())}")
    return int(run.stdout.strip().split(";")[0])


def submit(stages: List[Stage], res: Resources, launch: str, signal_seconds: int, eval_args: Optional[List[str]],
           runs_root: Path, dry_run: bool, retries: Retries = Retries(), join_timeout: int = JOIN_TIMEOUT) -> List[int]:
    """Submit (``dry_run``: print) each stage's job, each depending on the previous one, then the
    export + evaluation job when ``eval_args`` is given (on one GPU of one node); returns the job ids.
    A stage's failed attempts are requeued as ``retries`` says; torchrun's rendezvous waits
    ``join_timeout`` seconds for every node."""
    workdir, python = Path.cwd(), sys.executable
    jobs = [(s.name, training_script(s, res, launch, signal_seconds, workdir, python, retries, join_timeout)) for s in stages]
    if eval_args is not None:
        name, run = f"{stages[-1].name}-eval", stages[-1].save
        one_gpu = replace(res, nodes=1, gpus_per_node=min(res.gpus_per_node, 1), cpus_per_task=None)
        jobs.append((name, export_eval_script(name, [run], runs_root / "exports", runs_root / "eval" / f"{run.name}.md",
                                              eval_args, one_gpu, workdir, python)))
    return submit_jobs(jobs, res.log_dir, dry_run)


def submit_jobs(jobs: List[Tuple[str, str]], log_dir: Path, dry_run: bool) -> List[int]:
    """Submit (name, script) jobs, each after the previous one (``dry_run``: print the scripts);
    one line per job submitted; the job ids."""
    if dry_run:
        for i, (name, script) in enumerate(jobs):
            print(f"# ---- {name}: sbatch --parsable" + (f" --dependency=afterok:<job of {jobs[i - 1][0]}>" if i else ""))
            print(script)
        return []
    if shutil.which("sbatch") is None:
        raise RecipeError("sbatch is not on PATH: submit from a Slurm login node (or see the script with --dry-run)")
    log_dir.mkdir(parents=True, exist_ok=True)
    ids: List[int] = []
    for name, script in jobs:
        try:
            ids.append(sbatch(script, ids[-1] if ids else None))
        except RecipeError as e:
            raise RecipeError(f"{name}: {e}" + (f" (already submitted: jobs {', '.join(map(str, ids))})" if ids else "")) from None
        print(f"submitted {name}: job {ids[-1]}" + (f" after job {ids[-2]}" if len(ids) > 1 else "")
              + f", log {log_dir / name}-{ids[-1]}.out", flush=True)
    return ids
