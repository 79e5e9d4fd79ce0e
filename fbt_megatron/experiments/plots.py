"""Plots of a grid's results (``results.write``'s dict), from the logged numbers only.

Language-model grids: one column per data set and width; validation loss (0 fused) against training tokens
(top) and against compute tokens, i.e. tokens × passes (bottom): each cell's curve is the mean over
seeds with its min–max band, and the baseline's frontier (the best final validation loss of any of
its runs, mean over seeds) is a dotted line. Task grids: the full recurrence's accuracy on the
longest positions, one dot per seed, per cell.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Dict, List

from fbt_megatron.experiments.compare import family


def _colour(model: str, index: int, count: int):
    import matplotlib

    family = "Blues" if model.startswith("baseline") or "baseline" in model else "Oranges"
    return matplotlib.colormaps[family](0.4 + 0.55 * (index + 1) / max(count, 1))


def _curves(rows: List[dict]) -> Dict[tuple, List[dict]]:
    cells: Dict[tuple, List[dict]] = {}
    for r in rows:
        cells.setdefault((r["data"], r["model"], r["length"], r["threads"]), []).append(r)
    return cells


def frontier(cells: List[dict], data: str, width: str = "") -> float:
    """The baseline's best mean final validation loss (0 fused) over its runs on ``data`` at one
    width (``compare.family``: "" or "_w128")."""
    return min(c["valid"][0]["mean"] for c in cells if c["data"] == data and c["model"] == "baseline" + width)


def plot_lm(results: dict, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, cells = results["runs"], results["cells"]
    panels = list(dict.fromkeys((r["data"], family(r["model"])) for r in rows))  # a column per data set and width
    fig, axes = plt.subplots(2, len(panels), figsize=(6 * len(panels), 9), squeeze=False)
    groups = _curves(rows)
    models = list(dict.fromkeys(k[1] for k in groups))
    for col, (data, width) in enumerate(panels):
        mine = [k for k in groups if k[0] == data and family(k[1]) == width]
        for row, axis in enumerate(("tokens", "compute_tokens")):
            ax = axes[row][col]
            for model in models:
                keys = [k for k in mine if k[1] == model]
                for i, key in enumerate(keys):
                    runs = groups[key]
                    points = list(zip(*[r["curve"] for r in runs]))  # validations, each over seeds
                    x = [statistics.mean(p[axis] for p in pts) for pts in points]
                    y = [[p["valid"][0] for p in pts] for pts in points]
                    colour = _colour(model, i, len(keys))
                    ax.plot(x, [statistics.mean(v) for v in y], "-", color=colour, lw=1.4, label=f"{model} {key[2]}")
                    if len(runs) > 1:
                        ax.fill_between(x, [min(v) for v in y], [max(v) for v in y], color=colour, alpha=0.15, lw=0)
                    ax.plot(x[-1:], [statistics.mean(y[-1])], "o", color=colour)
            if any(k[1].startswith("baseline") for k in mine):
                ax.axhline(frontier(cells, data, width), color="tab:blue", ls=":", lw=1, label="baseline's best final (mean)")
            ax.set_xscale("log")
            ax.set(xlabel="training tokens" if axis == "tokens" else "compute tokens (tokens × passes)",
                   ylabel="validation loss, 0 fused (lower is better)", title=f"{data}{' ' + width[1:] if width else ''}: against {axis.replace('_', ' ')}")
            top = max(statistics.mean(r["curve"][len(r["curve"]) // 2]["valid"][0] for r in groups[k]) for k in mine)
            low = min(min(p["valid"][0] for p in r["curve"]) for k in mine for r in groups[k])
            ax.set_ylim(low - 0.05, top + 0.1)  # the end of training, where the comparison is
            ax.legend(fontsize=7)
    fig.suptitle(results["title"] + "\nmean over seeds, band: min–max", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return fig


def plot_task(results: dict, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = [c for c in results["cells"] if "full recurrence" in c.get("accuracy", {})]
    groups = _curves(results["runs"])
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(cells) + 2), 4.8))
    labels = []
    for i, c in enumerate(cells):
        runs = groups[(c["data"], c["model"], c["length"], c["threads"])]
        last = list(runs[0]["task"]["accuracy"]["full recurrence"])[-1]
        values = [r["task"]["accuracy"]["full recurrence"][last] for r in runs]
        ax.plot([i] * len(values), values, "o", color="tab:red", alpha=0.6)
        ax.plot([i - 0.25, i + 0.25], [statistics.mean(values)] * 2, color="black", lw=1)
        labels.append(f"{c['data']}\n{c['model']}\n{c['length']} t{c['threads']}\nheld {c['held']}/{len(runs)}")
    ax.axhline(0.95, color="gray", ls=":", lw=1)
    ax.set_xticks(range(len(cells)), labels, fontsize=7)
    ax.set_ylim(0, 1.03)
    ax.set(ylabel="accuracy on the longest positions (higher is better)",
           title="full recurrence, one dot per seed (line: mean; dotted: 0.95)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return fig


def plot(results: dict, path: Path):
    import matplotlib.pyplot as plt

    fig = plot_task(results, path) if any("task" in r for r in results["runs"]) else plot_lm(results, path)
    plt.close(fig)
