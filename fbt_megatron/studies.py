"""``python -m fbt_megatron.studies``: a shim; the command is ``fbt_megatron.commands.studies``."""

from fbt_megatron.commands.studies import main
from fbt_megatron.common.cli import run_cli

if __name__ == "__main__":
    run_cli(main)
