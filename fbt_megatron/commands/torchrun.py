"""torchrun for training runs, ending as one process does: ``python -m fbt_megatron.torchrun
--nproc-per-node 2 -m fbt_megatron.train ...`` (torchrun's own command line). Ctrl-C or SIGTERM:
the workers save and stop, exit 0, no traceback; a second Ctrl-C aborts at once (exit 130). Bad
input: the ``error:`` line of the rank that failed first, once, exit 2 (even when torchrun stopped
rank 0 before it could print). See ``fbt_megatron.trainer.stopping``."""

import sys

from fbt_megatron.common.logs import setup_logging
from fbt_megatron.trainer.stopping import torchrun


def main() -> None:
    setup_logging()
    sys.exit(torchrun(sys.argv[1:]))


if __name__ == "__main__":
    main()
