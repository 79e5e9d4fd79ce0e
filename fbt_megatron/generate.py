"""``python -m fbt_megatron.generate``: a shim; the command is ``fbt_megatron.commands.generate``."""

from fbt_megatron.commands.generate import main
from fbt_megatron.common.cli import run_cli

if __name__ == "__main__":
    run_cli(main)
