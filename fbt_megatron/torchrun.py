"""``python -m fbt_megatron.torchrun``: a shim; the command is ``fbt_megatron.commands.torchrun``."""

from fbt_megatron.commands.torchrun import main

if __name__ == "__main__":
    main()
