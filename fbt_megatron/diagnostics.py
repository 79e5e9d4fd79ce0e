"""``python -m fbt_megatron.diagnostics``: a shim; the command is ``fbt_megatron.commands.diagnostics``."""

from fbt_megatron.commands.diagnostics import main
from fbt_megatron.common.cli import run_cli

if __name__ == "__main__":
    run_cli(main)
