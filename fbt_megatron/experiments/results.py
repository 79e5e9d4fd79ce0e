"""A grid's results, read from its runs' ``metrics.jsonl`` (and a task run's ``eval.json``) only.

Per run: its final validation losses (0, 1, … fused prefill passes), its best validation loss
(0 fused, over all its validations) and where, tokens and compute tokens (tokens × passes), and its
validation curve. Per cell (a run's settings without the seed): the mean, min and max over seeds.
Written as ``results.json`` (everything, curves included), ``runs.csv`` and ``table.md``.
"""

from __future__ import annotations

import csv
import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Dict, List

from fbt_megatron.experiments.grid import RunSpec
from fbt_megatron.experiments.runner import DONE, EVAL
from fbt_megatron.trainer.callbacks.metrics_writer import read_metrics

HELD = 0.95  # a task run holds when its full recurrence is at least this accurate in every position bucket


def run_result(run: RunSpec) -> dict:
    """What ``run`` logged (its folder must hold a finished run)."""
    records = read_metrics(run.folder)
    evals = [r for r in records if "valid_loss_fused0" in r]
    if not evals or records[-1]["step"] != run.steps:
        raise ValueError(f"{run.folder} holds no finished run (train it first: the study's run command)")
    modes = sorted((k for k in evals[-1] if k.startswith("valid_loss_fused")), key=lambda k: int(k.removeprefix("valid_loss_fused")))
    best = min(evals, key=lambda r: r["valid_loss_fused0"])
    last = records[-1]
    out = {
        "data": run.data, "model": run.model, "length": run.length, "seed": run.seed, "threads": run.threads,
        "steps": run.steps, "epochs": run.epochs, "compute_of": run.compute_of, "tokens": last["tokens"], "compute_tokens": last["compute_tokens"],
        "valid": [evals[-1][k] for k in modes],
        "best_valid": best["valid_loss_fused0"], "best_step": best["step"],
        "best_tokens": best["tokens"], "best_compute_tokens": best["compute_tokens"],
        "curve": [{"step": r["step"], "tokens": r["tokens"], "compute_tokens": r["compute_tokens"],
                   "valid": [r[k] for k in modes]} for r in evals],
    }
    done = json.loads((run.folder / DONE).read_text()) if (run.folder / DONE).is_file() else {}
    out["wall_s"], out["finished"] = done.get("wall_s"), done.get("finished")
    if run.evaluate is not None:
        result = json.loads((run.folder / EVAL).read_text())
        out["task"] = {k: result[k] for k in ("task", "chance", "train_length", "test_length", "sequences", "accuracy")}
        full = result["accuracy"].get("full recurrence")
        out["held"] = None if full is None else min(full.values()) >= HELD
    return out


def summary(values: List[float]) -> dict:
    return {"mean": statistics.mean(values), "min": min(values), "max": max(values), "n": len(values)}


def cell_results(rows: List[dict]) -> List[dict]:
    """Rows grouped by cell (data, model, length, threads), in first-seen order: mean/min/max over seeds."""
    groups: Dict[tuple, List[dict]] = defaultdict(list)
    for r in rows:
        groups[(r["data"], r["model"], r["length"], r["threads"])].append(r)
    cells = []
    for (data, model, length, threads), runs in groups.items():
        cell = {"data": data, "model": model, "length": length, "threads": threads, "seeds": [r["seed"] for r in runs],
                "steps": runs[0]["steps"], "epochs": runs[0]["epochs"], "compute_of": runs[0]["compute_of"]}
        for key in ("tokens", "compute_tokens", "best_valid", "best_tokens", "best_compute_tokens"):
            cell[key] = summary([r[key] for r in runs])
        cell["valid"] = [summary([r["valid"][j] for r in runs]) for j in range(min(len(r["valid"]) for r in runs))]
        if "task" in runs[0]:
            modes = runs[0]["task"]["accuracy"]
            cell["accuracy"] = {m: {b: summary([r["task"]["accuracy"][m][b] for r in runs]) for b in modes[m]} for m in modes}
            cell["held"] = sum(bool(r["held"]) for r in runs)
        cells.append(cell)
    return cells


def spread(s: dict, digits: int = 4) -> str:
    """"mean (min–max)" of a summary; just the value for one seed."""
    if s["n"] == 1:
        return f"{s['mean']:.{digits}f}"
    return f"{s['mean']:.{digits}f} ({s['min']:.{digits}f}–{s['max']:.{digits}f})"


def _epochs(cell: dict) -> str:
    return "–" if cell["epochs"] is None else f"{cell['epochs']:.2f}"


def lm_table(cells: List[dict]) -> str:
    """Validation losses per cell: final after 0 … n fused passes and the best over the run (0 fused)."""
    passes = max(len(c["valid"]) for c in cells)
    head = ["data", "model", "run", "epochs", "steps", "seeds", "compute tokens", "best valid (0 fused)",
            *[f"final valid, {j} fused" for j in range(passes)]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in cells:
        valid = [spread(c["valid"][j]) if j < len(c["valid"]) else "–" for j in range(passes)]
        row = [c["data"], c["model"], c["length"], _epochs(c), f"{c['steps']:,}", str(len(c["seeds"])),
               f"{c['compute_tokens']['mean']:,.0f}", spread(c["best_valid"]), *valid]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def task_table(cells: List[dict]) -> str:
    """Accuracy of the full recurrence (FBT) or the plain model (baseline) per position bucket, and
    the seeds where the full recurrence held (≥ HELD in every bucket)."""
    first = next(c for c in cells if "accuracy" in c)
    buckets = list(next(iter(first["accuracy"].values())))
    head = ["data", "model", "run", "threads", "seeds", "mode", *buckets, f"seeds held (full ≥ {HELD})"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in cells:
        mode = "full recurrence" if "full recurrence" in c["accuracy"] else "0 fused"
        held = f"{c['held']}/{len(c['seeds'])}" if mode == "full recurrence" else "–"
        row = [c["data"], c["model"], c["length"], str(c["threads"]), str(len(c["seeds"])), mode,
               *[spread(c["accuracy"][mode][b], 3) for b in buckets], held]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def task_seed_table(rows: List[dict]) -> str:
    """Every seed of every task cell: the lowest bucket accuracy of the full recurrence (FBT; the
    plain model for a baseline), the number that decides whether a run held."""
    groups: Dict[tuple, Dict[int, float]] = defaultdict(dict)
    for r in rows:
        accuracy = r["task"]["accuracy"]
        mode = "full recurrence" if "full recurrence" in accuracy else "0 fused"
        groups[(r["data"], r["model"], r["length"], r["threads"], mode)][r["seed"]] = min(accuracy[mode].values())
    seeds = sorted({seed for values in groups.values() for seed in values})
    head = ["data", "model", "run", "threads", "mode", *[f"seed {s}" for s in seeds]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key, values in groups.items():
        cells = [f"{values[s]:.4f}" + (" ✓" if values[s] >= HELD else "") if s in values else "–" for s in seeds]
        lines.append("| " + " | ".join([*map(str, key), *cells]) + " |")
    return (f"Lowest accuracy over the position buckets, per seed (✓: ≥ {HELD}, the run held):\n\n" + "\n".join(lines))


def wall_time(rows: List[dict]) -> dict:
    """Seconds of all runs together, and from the first start to the last end (from done.json)."""
    import datetime

    timed = [r for r in rows if r.get("finished") and r.get("wall_s") is not None]
    if not timed:
        return {}
    end = [datetime.datetime.strptime(r["finished"], "%Y-%m-%d %H:%M:%S").timestamp() for r in timed]
    start = [e - r["wall_s"] for e, r in zip(end, timed)]
    return {"runs_s": round(sum(r["wall_s"] for r in timed), 1), "span_s": round(max(end) - min(start), 1)}


CSV_FIELDS = ["data", "model", "length", "seed", "threads", "steps", "epochs", "tokens", "compute_tokens",
              "best_valid", "best_step", "wall_s"]


def write(rows: List[dict], out: Path, title: str, grids: Dict[str, List[dict]]) -> dict:
    """results.json, runs.csv and table.md in ``out``; returns the results. ``grids``: {grid: its
    rows}, for each grid's wall time (a grid is run at one time; the union of grids may span days)."""
    out.mkdir(parents=True, exist_ok=True)
    cells = cell_results(rows)
    by_grid = {g: wall_time(r) for g, r in grids.items()}
    results = {"title": title, "runs": rows, "cells": cells, "wall_by_grid": {g: w for g, w in by_grid.items() if w}}
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    passes = max(len(r["valid"]) for r in rows)
    with open(out / "runs.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(CSV_FIELDS + [f"valid_fused{j}" for j in range(passes)] + (["held"] if "held" in rows[0] else []))
        for r in rows:
            writer.writerow([r[k] for k in CSV_FIELDS] + r["valid"] + [None] * (passes - len(r["valid"]))
                            + ([r["held"]] if "held" in r else []))
    tasks = any("accuracy" in c for c in cells)
    tables = [lm_table(cells)] + ([task_table(cells), task_seed_table(rows)] if tasks else [])
    note = ("Wall time per grid, from its first run's start to its last run's end (runs added up; a resumed run counts "
            "from its last start): " + "; ".join(f"{g} {w['span_s'] / 60:.0f} min ({w['runs_s'] / 60:.0f} min)"
                                                 for g, w in results["wall_by_grid"].items()) + ".")
    (out / "table.md").write_text(f"# {title}\n\n" + "\n\n".join(tables + [note]) + "\n")
    return results
