"""Run a study's grid, or write its tables and plots.

    python -m fbt_megatron.studies plan   recipes/studies/compute_for_data.yaml --grid cut
    python -m fbt_megatron.studies run    recipes/studies/compute_for_data.yaml --grid cut [--jobs 2 --cpus 2]
        [--then recipes/studies/state_tracking.yaml:screen]   # one queue over several grids
    python -m fbt_megatron.studies report recipes/studies/compute_for_data.yaml --grid cut --out docs/evidence/compute_for_data

Runs live under --root (default runs/studies): ROOT/STUDY/DATA/MODEL/LENGTH/seedS-tT, each a run
folder of the training entry point with its train.log. A finished run is reused, an interrupted one
resumes; run the same command again to continue a grid. A report also keeps each run's record
(its command, metrics.jsonl, done.json, eval.json) in OUT/records; --reuse OUT/records puts them
under another root, to finish a grid elsewhere or to rebuild a report from them alone.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from fbt_megatron.common.cli import quiet_library_warnings, run_cli
from fbt_megatron.common.logs import setup_logging
from fbt_megatron.experiments import study as studies
from fbt_megatron.experiments.grid import load_study

log = logging.getLogger(__name__)


def main(argv=None) -> int:
    setup_logging()
    parser = argparse.ArgumentParser(prog="python -m fbt_megatron.studies", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=("plan", "run", "report"))
    parser.add_argument("study", help="a study file (recipes/studies/*.yaml)")
    parser.add_argument("--grid", required=True, action="append", help="which of the study's grids (repeat for several)")
    parser.add_argument("--then", action="append", default=[], metavar="STUDY:GRID",
                        help="plan/run: then the runs of this grid of another study file (repeatable), in one queue")
    parser.add_argument("--root", default="runs/studies", help="where runs and prepared data live (default: runs/studies)")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time (default: 2)")
    parser.add_argument("--cpus", type=int, default=2, help="threads all runs together may use (default: 2)")
    parser.add_argument("--nice", type=int, default=19, help="niceness of the runs (default: 19)")
    parser.add_argument("--out", help="report: the folder for results.json, runs.csv, table.md, results.png")
    parser.add_argument("--partial", action="store_true", help="report: the runs done so far")
    parser.add_argument("--keep-reported", action="store_true",
                        help="report: runs not under --root keep what --out already holds of them (its records/, or its results.json's rows)")
    parser.add_argument("--reuse", action="append", default=[], metavar="RECORDS",
                        help="first put the finished runs recorded in RECORDS (a report's records/ folder) in their places under --root")
    args = parser.parse_args(argv)
    quiet_library_warnings()
    study, root = load_study(args.study), Path(args.root).resolve()
    pairs = [(study, g) for g in args.grid]
    for spec in args.then:
        path, sep, grid = spec.rpartition(":")
        if not sep or not path:
            raise ValueError(f"--then takes STUDY:GRID, got {spec!r}")
        pairs.append((load_study(path), grid))
    if args.command == "plan":
        print(studies.plan(studies.runs_of_grids(pairs, root, show=True, reuse=args.reuse)))
        return 0
    if args.command == "run":
        failed = studies.run(studies.runs_of_grids(pairs, root, show=True, reuse=args.reuse), args.jobs, args.cpus, args.nice).failed
        for run, message in failed:
            log.error(f"failed: {run.label}: {message}")
        return 1 if failed else 0
    if not args.out or args.then:
        raise ValueError("report takes one study (no --then) and needs --out FOLDER")
    written = studies.report(study, args.grid, root, Path(args.out), args.partial, args.reuse, args.keep_reported)
    print((Path(args.out) / "table.md").read_text())
    print(f"wrote {args.out}/results.json, runs.csv, table.md, results.png, records/ ({len(written['runs'])} runs)")
    return 0

if __name__ == "__main__":
    run_cli(main)
