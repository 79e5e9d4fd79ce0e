"""Validation loss against fused prefill passes (the paper's Fig. 4): for each run the loss after
n = 0 … N fused passes (pass n + 1 of the eval-mode forward), on the validation batches training
evaluates (so the numbers are the ones its ``valid_loss_fused{n}`` records); a run without latent
feedback (a baseline) has only n = 0 and is drawn as a horizontal line."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from fbt_megatron.evaluation.diagnostics import common


def prefill_losses(run, fused_passes: int, eval_iters: Optional[int] = None, sequences: Optional[int] = None) -> dict:
    """One run's validation loss after n = 0 … ``fused_passes`` fused passes (0 only for a baseline)."""
    n = fused_passes if run.model.config.latent_feedback else 0
    selection = common.validation(run, eval_iters, sequences)
    per_group = []
    bar = common.progress(total=selection.microbatches * (n + 1), desc=f"prefill {common.run_name(run)}", unit="pass")
    for batch in selection.batches:
        group = []
        for microbatch in batch:
            losses = []
            for _, loss, _, _ in common.passes(run.model, microbatch, n + 1):
                losses.append(loss)
                bar.update()
            group.append(torch.stack(losses))
        per_group.append(group)
    bar.close()
    return {
        "run": run.folder, "iteration": run.iteration, "baseline": not run.model.config.latent_feedback,
        "sequences": selection.sequences, "data": selection.description,
        "losses": common.training_mean(per_group),  # index n: after n fused passes
    }


def prefill(runs: Sequence, fused_passes: Optional[int] = None, eval_iters: Optional[int] = None,
            sequences: Optional[int] = None) -> dict:
    """``prefill_losses`` of each run; N defaults to the largest ``--fused-prefill-passes`` the runs were trained with."""
    if fused_passes is not None and fused_passes < 0:
        raise ValueError(f"--fused-passes must be >= 0, got {fused_passes}")
    if fused_passes is None:
        fused_passes = max(r.recipe.training.fused_prefill_passes for r in runs)
    return {"fused_passes": fused_passes,
            "runs": [prefill_losses(run, fused_passes, eval_iters, sequences) for run in runs]}


def summary(result: dict) -> str:
    n = result["fused_passes"]
    head = ["run", *[f"{j} fused" for j in range(n + 1)]]
    lines = [f"prefill: validation loss after n fused prefill passes ({result['runs'][0]['data']})",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in result["runs"]:
        cells = [f"{v:.4f}" for v in r["losses"]] + ["–"] * (n + 1 - len(r["losses"]))
        lines.append("| " + " | ".join([common.Path(r["run"]).name + (" (baseline)" if r["baseline"] else ""), *cells]) + " |")
    return "\n".join(lines)


def plot(result: dict, path) -> None:
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    n = result["fused_passes"]
    for i, r in enumerate(result["runs"]):
        name = common.Path(r["run"]).name
        if r["baseline"]:
            ax.axhline(r["losses"][0], linestyle="--", color=f"C{i}", label=f"{name} (baseline)")
        else:
            ax.plot(range(len(r["losses"])), r["losses"], marker="o", color=f"C{i}", label=name)
    ax.set(xlabel="fused prefill passes n", ylabel="validation loss", title="validation loss after n fused prefill passes")
    ax.set_xticks(range(n + 1))
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

