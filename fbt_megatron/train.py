"""``python -m fbt_megatron.train``: a shim; the command is ``fbt_megatron.commands.train``."""

from fbt_megatron.commands.train import cli, main  # noqa: F401 (cli: the fbt-train console script)

if __name__ == "__main__":
    cli()
