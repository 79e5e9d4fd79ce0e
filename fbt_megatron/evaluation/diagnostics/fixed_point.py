"""Fixed point of the passes (the paper's Fig. 3): for passes j = 1 … K over validation sequences,
‖Δs‖_j = RMS(s^{(j)} − s^{(j−1)}) (the square's mean over tokens and hidden units, then the root,
as training logs it) and the validation loss L_j. Passes of a sequence converge when ‖Δs‖ → 0;
the ratio of successive ‖Δs‖ estimates the contraction of the pass map."""

from __future__ import annotations

import math
from typing import List, Optional

import torch

from fbt_megatron.evaluation.diagnostics import common


def fixed_point(run, max_passes: int = 64, eval_iters: Optional[int] = None, sequences: Optional[int] = None) -> dict:
    """{"rows": [{"pass": j, "loss": L_j, "state_delta": ‖Δs‖_j (None at j = 1)}, …], …} for j = 1 … max_passes."""
    if max_passes < 1:
        raise ValueError(f"--max-passes must be >= 1, got {max_passes}")
    common.require_feedback(run, "fixed-point")
    selection = common.validation(run, eval_iters, sequences)
    losses, squares = [], []  # per group: per microbatch [K] and [K − 1]
    bar = common.progress(total=selection.microbatches * max_passes, desc="fixed-point passes", unit="pass")
    for batch in selection.batches:
        group_losses, group_squares = [], []
        for microbatch in batch:
            pass_losses, pass_squares = [], []
            for _, loss, _, delta in common.passes(run.model, microbatch, max_passes):
                pass_losses.append(loss)
                if delta is not None:
                    pass_squares.append(delta)
                bar.update()
            group_losses.append(torch.stack(pass_losses))
            if pass_squares:
                group_squares.append(torch.stack(pass_squares))
        losses.append(group_losses)
        squares.append(group_squares)
    bar.close()
    mean_loss = common.training_mean(losses)
    deltas = [math.sqrt(v) for v in common.training_mean(squares)] if max_passes > 1 else []
    rows = [{"pass": j, "loss": mean_loss[j - 1], "state_delta": None if j == 1 else deltas[j - 2]}
            for j in range(1, max_passes + 1)]
    return {
        "run": run.folder, "iteration": run.iteration, "feedback_state": run.model.config.feedback_state,
        "max_passes": max_passes, "sequences": selection.sequences, "data": selection.description,
        "contraction": contraction(deltas),
        # pass j is exact up to position j, so by pass T (the sequence length) the passes reach the fixed point
        "exact_from": next((r["pass"] for r in rows if r["state_delta"] == 0.0), None),
        "rows": rows,
    }


def contraction(deltas: List[float], last: int = 8) -> Optional[float]:
    """Geometric mean of ‖Δs‖_{j+1} / ‖Δs‖_j over the last ``last`` ratios before ‖Δs‖ reaches 0
    (None with fewer than two positive deltas)."""
    positive = deltas[: next((i for i, d in enumerate(deltas) if d <= 0), len(deltas))]
    tail = positive[-(last + 1):]
    if len(tail) < 2:
        return None
    return (tail[-1] / tail[0]) ** (1 / (len(tail) - 1))


def summary(result: dict) -> str:
    rows = result["rows"]
    first, last = rows[0], rows[-1]
    best = min(rows, key=lambda r: r["loss"])
    lines = [f"fixed-point: {result['run']} (iteration {result['iteration']}), {result['max_passes']} passes over {result['data']}",
             f"  validation loss {first['loss']:.4f} at pass 1, {last['loss']:.4f} at pass {last['pass']} "
             f"(lowest {best['loss']:.4f} at pass {best['pass']})"]
    if len(rows) > 1:
        lines.append(f"  ‖Δs‖ {rows[1]['state_delta']:.3e} at pass 2, {last['state_delta']:.3e} at pass {last['pass']}"
                     + (f"; contraction per pass {result['contraction']:.3f} (last passes)" if result["contraction"] else "")
                     + (f"; exactly 0 from pass {result['exact_from']} (the fixed point)" if result["exact_from"] else ""))
    return "\n".join(lines)


def plot(result: dict, path) -> None:
    plt = common.pyplot()
    rows = result["rows"]
    fig, (ax_delta, ax_loss) = plt.subplots(1, 2, figsize=(10, 4))
    with_delta = [r for r in rows if r["state_delta"]]  # a log scale has no 0: exact passes are marked instead
    if with_delta:
        ax_delta.semilogy([r["pass"] for r in with_delta], [r["state_delta"] for r in with_delta], marker=".")
    if result.get("exact_from"):
        ax_delta.axvline(result["exact_from"], color="gray", linestyle=":", label=f"‖Δs‖ = 0 from pass {result['exact_from']}")
        ax_delta.legend()
    ax_delta.set(xlabel="pass j", ylabel="‖Δs‖ = RMS(s⁽ʲ⁾ − s⁽ʲ⁻¹⁾)", title="distance between successive passes")
    ax_delta.grid(True, which="both", alpha=0.3)
    ax_loss.plot([r["pass"] for r in rows], [r["loss"] for r in rows], marker=".", color="C1")
    ax_loss.set(xlabel="pass j", ylabel="validation loss", title="validation loss after pass j")
    ax_loss.grid(True, alpha=0.3)
    fig.suptitle(f"{common.Path(result['run']).name}: passes towards the fixed point ({result['sequences']} sequences)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
