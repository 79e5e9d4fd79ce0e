"""A finished run's record: the small files a report reads, kept beside the report and reused.

A report's ``records/`` folder holds, for each run it reports, ``run.json`` (the command),
``done.json``, ``metrics.jsonl`` and, for task runs, ``eval.json``, at the run's place under the
root (``STUDY/DATA/MODEL/LENGTH/seedS-tT``). The command is stored with the repository and the root
written as ``{repo}`` and ``{root}``, so a record is the same wherever it was made. ``--reuse
RECORDS`` puts the records of runs not done under ``--root`` there before a plan, a run or a
report: a grid can be finished on another machine (or another day) than the one that began it, and
a report rebuilt from the shipped records alone. Checkpoints are not records: a run that was not
finished is trained again.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import List

from fbt_megatron.common.io import atomic_folder
from fbt_megatron.experiments.grid import REPO, RunSpec
from fbt_megatron.experiments.runner import DONE, EVAL, IDENTITY, identity, is_done

FILES = (IDENTITY, DONE, "metrics.jsonl", EVAL)


def _portable(text: str, root: Path) -> str:
    places = sorted([(str(REPO), "{repo}"), (str(root), "{root}")], key=lambda p: -len(p[0]))  # the inner one first
    for path, name in places:
        text = text.replace(path, name)
    return text


def _local(text: str, root: Path) -> str:
    return text.replace("{repo}", str(REPO)).replace("{root}", str(root))


def save(runs: List[RunSpec], root: Path, folder: Path) -> None:
    """The records of ``runs`` (all done) into ``folder``, replacing what it held."""
    with atomic_folder(folder.resolve(), replace=True) as tmp:
        for run in runs:
            place = tmp / run.folder.relative_to(root)
            place.mkdir(parents=True)
            for name in FILES:
                if (run.folder / name).is_file():
                    text = (run.folder / name).read_text()
                    (place / name).write_text(_portable(text, root) if name == IDENTITY else text)


def restore(runs: List[RunSpec], root: Path, folder: Path) -> int:
    """Put the records in ``folder`` of those ``runs`` not done under ``root`` in their places;
    returns how many. A record of another command, or a place holding an unfinished run, is an
    error (ValueError) and nothing is written there."""
    folder = folder.resolve()
    if not folder.is_dir():
        raise ValueError(f"--reuse {folder}: no such folder (a report's records/)")
    restored = 0
    for run in runs:
        record = folder / run.folder.relative_to(root)
        if is_done(run) or not (record / DONE).is_file():
            continue
        recorded = json.loads(_local((record / IDENTITY).read_text(), root))
        if recorded != identity(run):
            raise ValueError(f"the record {record} is of another command than the study's {run.label}; "
                             "the study file changed since it was made: run it again instead of reusing it")
        if run.folder.exists() and any(run.folder.iterdir()):
            raise ValueError(f"{run.folder} holds an unfinished run and {folder} a finished one: "
                             "remove the folder to reuse the record, or drop --reuse to finish it")
        with atomic_folder(run.folder) as tmp:  # replaces an empty folder
            for name in FILES:
                if (record / name).is_file():
                    text = (record / name).read_text()
                    (tmp / name).write_text(_local(text, root) if name == IDENTITY else text)
        restored += 1
    return restored
