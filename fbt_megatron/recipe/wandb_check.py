"""What a recipe with ``--wandb-project`` needs of this machine, checked with the recipe before any
work: the ``wandb`` package, and an API key for an online run (``check_wandb``). The writer itself
is ``fbt_megatron.trainer.callbacks.wandb_writer``."""

from __future__ import annotations

import netrc
import os
from pathlib import Path
from urllib.parse import urlsplit

from fbt_megatron.common.errors import RecipeError

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
