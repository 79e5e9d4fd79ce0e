"""The compute-for-data comparison of a language-model grid, from its results (``results.write``).

Per data set and seed: the baseline's frontier (its best final validation loss over every number of
epochs it ran, and the best at any validation of any of its runs), the baseline at FBT's epochs
and at FBT's compute (``equal_compute``), and each FBT run's final validation loss after 0 and
1 fused passes. Per data set: whether FBT is below the frontier in every seed, and at what compute.
Written as ``summary.md``; ``docs/evidence.md`` quotes it.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Dict, List

from fbt_megatron.experiments.results import spread, summary


def is_baseline(model: str) -> bool:
    return model.startswith("baseline")


def frontiers(runs: List[dict]) -> Dict[tuple, dict]:
    """{(data, family, seed): the baseline's best final valid loss, its run, and its best at any validation}.
    A family is the model name after "baseline" ("" or "_w128"): baselines of one width."""
    out: Dict[tuple, dict] = {}
    for r in runs:
        if not is_baseline(r["model"]):
            continue
        best = out.setdefault((r["data"], r["model"].removeprefix("baseline"), r["seed"]),
                              {"final": float("inf"), "anywhere": float("inf")})
        if r["valid"][0] < best["final"]:
            best.update(final=r["valid"][0], length=r["length"], epochs=r["epochs"], compute_tokens=r["compute_tokens"])
        best["anywhere"] = min(best["anywhere"], r["best_valid"])
    return out


def family(model: str) -> str:
    """The width suffix of a model name: "fbt_k2_w128" → "_w128", "fbt_mix" → ""."""
    return "_w" + model.rsplit("_w", 1)[1] if "_w" in model else ""


def comparisons(runs: List[dict]) -> List[dict]:
    """One row per FBT run: its final losses, the same seed's baseline at equal epochs, at equal
    compute, and the frontier."""
    front = frontiers(runs)
    by_key = {(r["data"], r["model"], r["epochs"], r["seed"]): r for r in runs}
    by_compute = {(r["data"], r["compute_of"], r["epochs"], r["seed"]): r for r in runs if r["compute_of"]}
    rows = []
    for r in runs:
        if is_baseline(r["model"]):
            continue
        base_model = "baseline" + family(r["model"])
        key = (r["data"], family(r["model"]), r["seed"])
        if key not in front:
            continue
        same_epochs = by_key.get((r["data"], base_model, r["epochs"], r["seed"]))
        equal = next((b for (d, of, _, s), b in by_compute.items()
                      if (d, of, s) == (r["data"], r["model"], r["seed"])
                      and abs(b["epochs"] - r["epochs"] * r["compute_tokens"] / r["tokens"]) < 0.1 * r["epochs"]), None)
        rows.append({
            "data": r["data"], "model": r["model"], "length": r["length"], "epochs": r["epochs"], "seed": r["seed"],
            "compute_tokens": r["compute_tokens"], "fbt": r["valid"],
            "baseline_same_epochs": same_epochs["valid"][0] if same_epochs else None,
            "baseline_equal_compute": equal["valid"][0] if equal else None,
            "frontier": front[key]["final"], "frontier_run": front[key]["length"],
            "frontier_compute_tokens": front[key]["compute_tokens"], "frontier_anywhere": front[key]["anywhere"],
        })
    return rows


def _fmt(value) -> str:
    return "–" if value is None else f"{value:.4f}"


def verdicts(rows: List[dict]) -> List[dict]:
    """Per FBT cell (data, model, length): over its seeds, how its losses stand against the baseline's."""
    cells: Dict[tuple, List[dict]] = defaultdict(list)
    for r in rows:
        cells[(r["data"], r["model"], r["length"])].append(r)
    out = []
    for (data, model, length), seeds in cells.items():
        v = {"data": data, "model": model, "length": length, "seeds": len(seeds),
             "compute_tokens": statistics.mean(r["compute_tokens"] for r in seeds)}
        for mode in range(len(seeds[0]["fbt"])):
            gap = [r["fbt"][mode] - r["frontier"] for r in seeds]
            v[f"fused{mode}_minus_frontier"] = summary(gap)
            v[f"fused{mode}_below_frontier"] = sum(g < 0 for g in gap)
            v[f"fused{mode}_below_anywhere"] = sum(r["fbt"][mode] < r["frontier_anywhere"] for r in seeds)
            for other in ("baseline_same_epochs", "baseline_equal_compute"):
                if all(r[other] is not None for r in seeds):
                    v[f"fused{mode}_minus_{other}"] = summary([r["fbt"][mode] - r[other] for r in seeds])
        out.append(v)
    return out


def summary_markdown(results: dict) -> str:
    """Per-seed comparison table and per-cell verdicts, in words and numbers."""
    rows = comparisons(results["runs"])
    if not rows:
        return ""
    head = ["data", "FBT run", "seed", "compute tokens", "FBT final, 0 fused", "1 fused", "baseline, same epochs",
            "baseline, equal compute", "baseline's best final (run)", "baseline's best at any validation"]
    lines = ["## Per seed", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        fused = [_fmt(r["fbt"][j]) if j < len(r["fbt"]) else "–" for j in range(2)]
        lines.append("| " + " | ".join([
            r["data"], f"{r['model']} {r['length']}", str(r["seed"]), f"{r['compute_tokens']:,}", *fused,
            _fmt(r["baseline_same_epochs"]), _fmt(r["baseline_equal_compute"]),
            f"{_fmt(r['frontier'])} ({r['frontier_run']})", _fmt(r["frontier_anywhere"])]) + " |")
    lines += ["", "## Per cell: FBT minus the baseline (negative: FBT lower), mean (min–max) over seeds", ""]
    head = ["data", "FBT run", "mode", "− same epochs", "− equal compute", "− baseline's best final",
            "seeds below the best final", "seeds below the best at any validation"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for v in verdicts(rows):
        for mode in range(2):
            if f"fused{mode}_minus_frontier" not in v:
                continue
            cell = lambda key: spread(v[key]) if key in v else "–"  # noqa: E731
            lines.append("| " + " | ".join([
                v["data"], f"{v['model']} {v['length']}", f"{mode} fused",
                cell(f"fused{mode}_minus_baseline_same_epochs"), cell(f"fused{mode}_minus_baseline_equal_compute"),
                cell(f"fused{mode}_minus_frontier"), f"{v[f'fused{mode}_below_frontier']}/{v['seeds']}",
                f"{v[f'fused{mode}_below_anywhere']}/{v['seeds']}"]) + " |")
    return "\n".join(lines) + "\n"
