"""The one report of every benchmark: what was measured and on what, a table of the variants, the
ratios with their goals (PASS / MISS / info), notes, and a warning when other processes competed."""

from __future__ import annotations

from typing import List, Sequence, Tuple


def format_report(results: dict, title: str, columns: Sequence[Tuple[str, int]], rows: Sequence[Sequence[str]],
                  notes: Sequence[str] = ()) -> str:
    """``title`` (what was measured, one line), the model (when the settings name one), how (threads,
    repeats, load), a table of ``columns`` ((heading, width): the first left-aligned, the others
    right-aligned) and ``rows``, the ratio table of ``results["ratios"]``, ``notes``, the load warning."""
    s = results["settings"]
    lines = [
        title,
        *_model(s),
        f"{s['threads']} threads; medians of {s['repeats']} interleaved repeats after {s['warmup']} warm-up rounds; "
        f"system load average {s['load_average'][0]:.1f} before, {s['load_average'][1]:.1f} after, on {s['cpus']} CPUs",
        "",
        _row([heading for heading, _ in columns], columns),
        *(_row(row, columns) for row in rows),
        "",
        *ratio_lines(results),
    ]
    if notes:
        lines += ["", *notes]
    return "\n".join(lines + load_warning(results))


def _model(s: dict) -> List[str]:
    if "preset" not in s:
        return []
    return [f"model {s['preset']}: {s['num_layers']} layers, hidden {s['hidden_size']}, FFN {s['ffn_hidden_size']}, "
            f"{s['num_attention_heads']} heads ({s['num_query_groups']} KV groups) × {s['kv_channels']}, "
            f"vocab {s['vocab_size']}, seq {s['seq_length']}"]


def _row(cells: Sequence[str], columns: Sequence[Tuple[str, int]]) -> str:
    (_, first), *rest = columns
    return " ".join([f"{cells[0]:<{first}}", *(f"{cell:>{width}}" for cell, (_, width) in zip(cells[1:], rest))])


def ratio_lines(results: dict) -> List[str]:
    """The ratio table: label, measured value, goal, PASS/MISS/info."""
    width = max(len(r["label"]) for r in results["ratios"].values())
    return [f"{'ratio':<{width}} {'measured':>8}  {'goal':<8} result"] + [
        f"{r['label']:<{width}} {r['value']:>8.3f}  {r['goal'] or '–':<8} {r['status']}" for r in results["ratios"].values()
    ]


def load_warning(results: dict) -> List[str]:
    """A warning line when the last minute's load exceeds this run's own threads (noisy timings)."""
    s = results["settings"]
    if s["load_average"][1] > s["threads"] + 1:
        return ["warning: the load average shows other processes competing for the CPUs: timings are noisy"]
    return []
