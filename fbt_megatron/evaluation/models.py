"""The models an evaluation table names: run folders, exported on demand into a cache, or Hugging Face exports.

A run folder's latest checkpoint is exported with ``python -m fbt_megatron.convert to-hf`` (in a
process of its own, its output appended to a log) into ``<cache>/<name>-iter<N>``, reused while the
run's latest checkpoint is the same; an export folder is evaluated as it is.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

from fbt_megatron.evaluation.harness import read_export_config
from fbt_megatron.evaluation.local_tasks import ROOT

CONVERT = "fbt_megatron.convert"  # the converter's command (python -m CONVERT to-hf ...)


@dataclass
class Model:
    label: str  # the row's name
    source: str  # what was given: a run folder or an export
    export: str  # the Hugging Face export evaluated
    run_iteration: Optional[int] = None  # the run's checkpoint, when exported from a run
    latent_feedback: bool = True
    corpus: Optional[str] = None  # the prepared corpus whose held-out split is evaluated


def is_run_folder(path: Path) -> bool:
    from fbt_megatron.trainer.checkpointing import latest_iteration

    return path.is_dir() and latest_iteration(str(path)) is not None


def resolve(models: List[str]) -> List[tuple]:
    """[(label, path, kind)] with kind "export" or "run", labelled by their folders' names (with the
    parent's where two share one); an error line for anything else."""
    out = []
    for m in models:
        path = Path(m)
        if not path.exists():
            raise FileNotFoundError(f"{m}: no such run folder or export")
        if (path / "config.json").is_file():
            read_export_config(str(path))  # an FBT export, or a clear error
            out.append((path.name, path, "export"))
        elif is_run_folder(path):
            out.append((path.name, path, "run"))
        else:
            raise ValueError(f"{m}: neither a run folder (no checkpoint iter_*) nor a Hugging Face export (no config.json)")
    labels = [label for label, _, _ in out]
    return [(label if labels.count(label) == 1 else f"{p.parent.name}/{p.name}", p, kind) for label, p, kind in out]


def _convert(run: Path, target: Path, iteration: int, log: Path) -> None:
    """The converter on ``run``'s checkpoint ``iteration`` into ``target``, its output appended to ``log``;
    its one ``error:`` line (bad input) raised as ValueError, any other failure with the log's end."""
    cmd = [sys.executable, "-m", CONVERT, "to-hf", "--load", str(run.resolve()), "--output", str(target.resolve()),
           "--ckpt-step", str(iteration)]  # the converter writes the folder whole (io.atomic_folder)
    with open(log, "a") as out:
        out.write("$ " + " ".join(cmd[1:]) + "\n")
        out.flush()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        # from here: a run's recipe names its data as given where it was trained
        code = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env).returncode
    if code or not (target / "config.json").is_file():
        shutil.rmtree(target, ignore_errors=True)
        lines = log.read_text().splitlines()
        if code == 2 and lines and lines[-1].startswith("error: "):  # the converter's one line: bad input
            raise ValueError(f"exporting {run}: {lines[-1][len('error: '):]}")
        tail = "\n".join(lines[-10:])
        raise RuntimeError(f"exporting {run} failed (exit {code}); the end of {log}:\n{tail}")


def export_run(run: Path, cache: Path, label: str, log: Path, say=print) -> tuple:
    """(export folder, iteration): the run's latest checkpoint exported into ``cache`` with the
    project's converter (reused when it was exported after the checkpoint was written)."""
    from fbt_megatron.trainer.checkpointing import checkpoint_dir, latest_iteration

    iteration = latest_iteration(str(run))
    checkpoint = checkpoint_dir(str(run), iteration)
    target = cache / f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', label)}-iter{iteration}"
    if (target / "config.json").is_file() and (target / "config.json").stat().st_mtime >= checkpoint.stat().st_mtime:
        say(f"[{label}] iteration {iteration}: exported before, {target}")
        return target, iteration
    say(f"[{label}] iteration {iteration}: exporting {run} → {target}")
    shutil.rmtree(target, ignore_errors=True)
    cache.mkdir(parents=True, exist_ok=True)
    _convert(run, target, iteration, log)
    return target, iteration


def exported_models(models: List[tuple], cache: Path, log: Path, say=print) -> List[Model]:
    """Each of ``resolve``'s models with the export it is evaluated as (a run folder exported into
    ``cache`` first) and whether it has latent feedback (a baseline has not)."""
    out = []
    for label, path, kind in models:
        export, iteration = export_run(path, cache, label, log, say) if kind == "run" else (path, None)
        latent = bool(read_export_config(str(export)).get("latent_feedback", False))
        out.append(Model(label, str(path), str(export), iteration, latent))
    return out
