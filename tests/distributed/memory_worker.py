"""Worker of tests/test_records.py (2 ranks, tests/forked.py): rank 0 holds 256 MiB more than rank 1
(a tensor written through, so its pages are resident); ``trainer.memory.largest_over_ranks`` must
give both ranks rank 0's figures. Each rank writes its own ``usage()`` and the largest to
``OUT/rank<r>.json``.

    python tests/distributed/memory_worker.py OUT
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def main():
    from fbt_megatron.common import platform
    from fbt_megatron.trainer import memory

    platform.init_distributed()
    rank = dist.get_rank()
    held = torch.ones(64 * 2**20 if rank == 0 else 1, dtype=torch.float32)  # 256 MiB on rank 0, every page written
    dist.barrier()
    own, largest = memory.usage(), memory.largest_over_ranks()
    own_after = memory.usage()
    Path(sys.argv[1], f"rank{rank}.json").write_text(json.dumps({"own": own, "own_after": own_after, "largest": largest,
                                                                 "held": held.numel() * 4}))
    dist.barrier()


if __name__ == "__main__":
    main()
