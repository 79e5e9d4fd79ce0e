"""A study from its file to its results: prepare the data, run the grid, write the tables and plots."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Dict, List, Sequence

from fbt_megatron.experiments.grid import SUBSET_RULES, RunSpec, Study, expand, subset_tokens_needed
from fbt_megatron.experiments.runner import Runner, is_done
from fbt_megatron.trainer.callbacks.metrics_writer import read_metrics

log = logging.getLogger(__name__)


def prepare_data(study: Study, grid: str, root: Path, show: bool = True) -> Dict[str, int]:
    """The corpus and the subsets ``grid`` trains on, prepared if missing; {subset: train tokens}."""
    from fbt_megatron.data.corpus import ensure_corpus
    from fbt_megatron.experiments.subsets import prepare_subset

    names = subset_tokens_needed(study, grid)
    if not names:
        return {}
    c = study.corpus
    corpus = study.corpus_folder(root)
    if show and not (corpus / "corpus.json").is_file():
        log.info(f"preparing the corpus {corpus} (once)")
    ensure_corpus(c["source"], str(corpus), vocab_size=c.get("vocab_size", 2048), valid_fraction=c.get("valid_fraction", 0.02),
                  show_progress=show)
    tokens = {}
    for name in names:
        rules = {rule: study.data[name][rule] for rule in SUBSET_RULES if rule in study.data[name]}
        subset = prepare_subset(str(corpus), str(study.subset_folder(root, name)), study.data[name]["subset_tokens"], **rules)
        tokens[name] = subset.tokens["train"]
        if show:
            log.info(f"subset {name}: {subset.documents['train']} documents, {tokens[name]:,} tokens "
                     f"({study.subset_folder(root, name)})")
    return tokens


def runs_of(study: Study, grid: str, root: Path, show: bool = False) -> List[RunSpec]:
    return expand(study, grid, root, prepare_data(study, grid, root, show))


def plan(runs: List[RunSpec]) -> str:
    """One line per run: done or to run, and its steps and compute."""
    lines = [f"{'run':<44} {'steps':>7} {'k̄':>5} {'epochs':>7}  state"]
    for r in runs:
        epochs = "–" if r.epochs is None else f"{r.epochs:.2f}"
        logged = read_metrics(r.folder)
        state = "done" if is_done(r) else f"at step {logged[-1]['step']}" if logged else "to run"
        lines.append(f"{r.label:<44} {r.steps:>7,} {r.mean_passes:>5.2f} {epochs:>7}  {state}")
    todo = [r for r in runs if not is_done(r)]
    work = sum(Runner.work(r) for r in todo)
    lines.append(f"{len(todo)} of {len(runs)} runs to run: {work:,.0f} plain-step equivalents (steps × k̄)")
    return "\n".join(lines)


def run(runs: List[RunSpec], jobs: int, cpus: int, nice: int, show: bool = True) -> Runner:
    """Run those of ``runs`` not done yet; returns the runner (``failed``: [(run, message)], ``reused``)."""
    start = time.time()
    runner = Runner(runs, jobs, cpus, nice, show)
    failed = runner.run_all()
    if show:
        log.info(f"{runner.done} of {len(runs)} runs done ({runner.reused} reused), {len(failed)} failed or stopped, "
                 f"in {(time.time() - start) / 60:.1f} min")
    return runner


def runs_of_grids(pairs: List[tuple], root: Path, show: bool = False, reuse: Sequence[Path] = ()) -> List[RunSpec]:
    """The runs of several (study, grid) pairs in order, each run once; the records in ``reuse``
    (report folders' records/) of those not done yet are put in their places first."""
    from fbt_megatron.experiments import records

    runs, seen = [], set()
    for study, grid in pairs:
        runs += [r for r in runs_of(study, grid, root, show) if not (r.folder in seen or seen.add(r.folder))]
    for folder in reuse:
        restored = records.restore(runs, root, Path(folder))
        if show:
            log.info(f"{restored} finished runs reused from {folder}")
    return runs


def _reported(out: Path) -> Dict[tuple, dict]:
    """The rows ``out/results.json`` holds, by run (data, model, length, seed, threads)."""
    path = out / "results.json"
    rows = json.loads(path.read_text())["runs"] if path.is_file() else []
    return {(r["data"], r["model"], r["length"], r["seed"], r["threads"]): r for r in rows}


def report(study: Study, grids: List[str], root: Path, out: Path, partial: bool = False, reuse: Sequence[Path] = (),
           keep_reported: bool = False) -> dict:
    """Tables and plots of the finished runs of ``grids`` into ``out``, and their records
    (``out/records``, studies.records); every run must be done unless ``partial``. With
    ``keep_reported``, a run not under ``root`` keeps its record from ``out/records`` or, reported
    before records were kept, its row in ``out/results.json``: a report can grow by new grids."""
    from fbt_megatron.experiments import compare, plots, records, results

    if keep_reported and (out / "records").is_dir():
        reuse = [*reuse, out / "records"]
    runs = runs_of_grids([(study, g) for g in grids], root, reuse=reuse)
    finished = [r for r in runs if is_done(r)]
    before = _reported(out) if keep_reported else {}
    rows = {r.folder: results.run_result(r) if is_done(r) else before.get((r.data, r.model, r.length, r.seed, r.threads))
            for r in runs}
    rows = {folder: row for folder, row in rows.items() if row is not None}
    missing = len(runs) - len(rows)
    name = f"{study.name}/{'+'.join(grids)}"
    if missing and not partial:
        raise ValueError(f"{missing} of {len(runs)} runs of {name} are not done; run them first, "
                         "or --partial for a report of those that are")
    if not rows:
        raise ValueError(f"no run of {name} is done yet")
    title = f"{study.name}, grid {'+'.join(grids)}: {len(rows)} of {len(runs)} runs"
    by_grid = {g: [rows[r.folder] for r in runs_of(study, g, root) if r.folder in rows] for g in grids}
    written = results.write(list(rows.values()), out, title, by_grid)
    records.save(finished, root, out / "records")
    plots.plot(written, out / "results.png")
    if not any("task" in r for r in written["runs"]):
        rows = compare.comparisons(written["runs"])
        (out / "summary.md").write_text(compare.summary_markdown(written))
        (out / "summary.json").write_text(json.dumps({"per_seed": rows, "per_cell": compare.verdicts(rows)}, indent=1) + "\n")
    return written
