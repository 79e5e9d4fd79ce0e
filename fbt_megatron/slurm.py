"""``python -m fbt_megatron.slurm``: a shim; the command is ``fbt_megatron.commands.slurm``."""

from fbt_megatron.commands.slurm import main
from fbt_megatron.common.cli import run_cli

if __name__ == "__main__":
    run_cli(main)
