"""``python -m fbt_megatron.convert``: a shim; the command is ``fbt_megatron.commands.convert``."""

from fbt_megatron.commands.convert import cli, main  # noqa: F401 (cli: the fbt-convert console script)

if __name__ == "__main__":
    cli()
