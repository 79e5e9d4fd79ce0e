"""``python -m fbt_megatron.plan``: a shim; the command is ``fbt_megatron.commands.plan``."""

from fbt_megatron.commands.plan import main
from fbt_megatron.common.cli import run_cli

if __name__ == "__main__":
    run_cli(main)
