"""Weights & Biases with Megatron-LM's flags: ``--wandb-project P [--wandb-exp-name NAME]
[--wandb-save-dir DIR]`` logs every record's scalars, under the same tags as TensorBoard
(``metrics.tensorboard_scalars``: per-pass losses, validation, throughput, layer norms), with the
recipe as the run's config. ``wandb`` is optional: imported only when asked for, and its absence is
one line. ``--wandb-mode offline`` (or ``WANDB_MODE=offline``) writes the run under
``--wandb-save-dir`` (default ``<save>/wandb``) without a network; ``wandb sync`` uploads it later.

An online run needs an API key (``WANDB_API_KEY``, or the netrc entry ``wandb login`` writes);
without one the run stops at start-up with one line (``check_wandb``), not at its first log. The
W&B run's id is kept in ``<save>/wandb_run_id``: a run that continues its folder (``--load`` =
``--save``: a resume, a requeued Slurm job) resumes the same W&B run (``resume="allow"``), as
OLMo-core does; any other run starts a new one and keeps its id there. W&B keeps a run's steps
increasing: steps logged again after a resume from an earlier checkpoint are dropped by W&B
(``metrics.jsonl`` has them as the resumed run logged them)."""

from __future__ import annotations

import netrc
import os
from pathlib import Path
from urllib.parse import urlsplit

from fbt_megatron.errors import RecipeError
from fbt_megatron.io import atomic_write

RUN_ID = "wandb_run_id"
NO_KEY_MODES = ("offline", "dryrun", "disabled")  # W&B's modes that send nothing (WANDB_MODE may say dryrun)


def require_wandb():
    """The ``wandb`` module, or the one line that says how to install it."""
    try:
        import wandb
    except ImportError:
        raise RecipeError("--wandb-project needs the wandb package, which is not installed: pip install wandb "
                          "(or drop --wandb-project)") from None
    return wandb


def has_api_key() -> bool:
    """Whether W&B finds credentials without asking: ``WANDB_API_KEY`` (or an identity token file),
    or an entry for the W&B host (``WANDB_BASE_URL``'s, default api.wandb.ai) in the netrc file it
    reads (``NETRC``, else ``~/.netrc``, else ``~/_netrc``)."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urlsplit(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname
    candidates = [os.environ["NETRC"]] if os.environ.get("NETRC") else ["~/.netrc", "~/_netrc"]
    for path in (Path(p).expanduser() for p in candidates):
        if path.is_file():
            try:
                return netrc.netrc(str(path)).authenticators(host) is not None
            except (OSError, netrc.NetrcParseError):
                return False
    return False


def check_wandb(logging) -> None:
    """At start-up, on every rank (``logging``: the recipe's logging section, with a W&B project):
    the package is installed, and an online run has an API key; else one line naming the fix."""
    require_wandb()
    mode = logging.wandb_mode or os.environ.get("WANDB_MODE") or "online"
    if mode not in NO_KEY_MODES and not has_api_key():
        raise RecipeError(f"--wandb-project {logging.wandb_project}: W&B's {mode} mode needs an API key and none is set "
                          f"(no WANDB_API_KEY, no netrc entry from wandb login): set WANDB_API_KEY, or use --wandb-mode "
                          f"offline (wandb sync uploads the run later)")


class WandbWriter:
    """One W&B run of this process's log (the logging rank's): ``log(scalars, step)``, ``close()``."""

    def __init__(self, recipe):
        wandb = require_wandb()
        g, c = recipe.logging, recipe.checkpoint
        folder = Path(g.wandb_save_dir or Path(c.save or ".") / "wandb")
        folder.mkdir(parents=True, exist_ok=True)
        name = g.wandb_exp_name or (Path(c.save).name if c.save else None)
        kept = Path(c.save) / RUN_ID if c.save else None
        continues = kept is not None and kept.is_file() and c.load is not None and Path(c.load).resolve() == Path(c.save).resolve()
        resume = dict(id=kept.read_text().strip(), resume="allow") if continues else {}
        self.run = wandb.init(project=g.wandb_project, name=name, dir=str(folder), config=recipe.to_dict(), mode=g.wandb_mode,
                              **resume)
        if kept is not None and not continues:
            atomic_write(kept, self.run.id + "\n")

    def log(self, scalars: dict, step: int) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()
