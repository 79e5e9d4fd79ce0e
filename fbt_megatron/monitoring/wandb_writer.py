"""Weights & Biases with Megatron-LM's flags: ``--wandb-project P [--wandb-exp-name NAME]
[--wandb-save-dir DIR]`` logs every record's scalars, under the same tags as TensorBoard
(``metrics.tensorboard_scalars``: per-pass losses, validation, throughput, layer norms), with the
recipe as the run's config. ``wandb`` is optional: imported only when asked for, and its absence is
one line. ``WANDB_MODE=offline`` writes the run under ``--wandb-save-dir`` (default ``<save>/wandb``)
without a network; ``wandb sync`` uploads it later."""

from __future__ import annotations

from pathlib import Path

from fbt_megatron.errors import RecipeError


def require_wandb():
    """The ``wandb`` module, or the one line that says how to install it."""
    try:
        import wandb
    except ImportError:
        raise RecipeError("--wandb-project needs the wandb package, which is not installed: pip install wandb "
                          "(or drop --wandb-project)") from None
    return wandb


class WandbWriter:
    """One W&B run of this process's log (the logging rank's): ``log(scalars, step)``, ``close()``."""

    def __init__(self, recipe):
        wandb = require_wandb()
        g, save = recipe.logging, recipe.checkpoint.save
        folder = Path(g.wandb_save_dir or Path(save or ".") / "wandb")
        folder.mkdir(parents=True, exist_ok=True)
        name = g.wandb_exp_name or (Path(save).name if save else None)
        self.run = wandb.init(project=g.wandb_project, name=name, dir=str(folder), config=recipe.to_dict())

    def log(self, scalars: dict, step: int) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()
