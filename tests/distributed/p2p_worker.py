"""Worker of the point-to-point counts (2 ranks, tests/test_resilience.py): with the hang
watchdog's counting on (``watchdog.count_point_to_point``), each rank issues point-to-point
operations as megatron-core's pipeline does (a blocking pair, a batch of two, a single isend/irecv
pair) and one all-reduce, and writes what ``issued_collectives`` reports before and after to
``OUT/rank<R>.json``.

    python tests/distributed/p2p_worker.py OUT   (as 2 ranks: tests/forked.py)
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def main():
    from fbt_megatron.common import platform
    from fbt_megatron.trainer.callbacks import watchdog

    platform.init_distributed()
    watchdog.count_point_to_point()
    rank, device = dist.get_rank(), platform.device()
    peer = 1 - rank
    before = watchdog.issued_collectives()
    t, got = torch.ones(4, device=device), torch.zeros(4, device=device)
    dist.send(t, peer) if rank == 0 else dist.recv(got, peer)  # 1 operation each
    for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, t, peer), dist.P2POp(dist.irecv, got, peer)]):  # 2
        work.wait()
    (dist.isend(t, dst=peer) if rank == 0 else dist.irecv(got, src=peer)).wait()  # 1
    dist.all_reduce(t)
    after = watchdog.issued_collectives()
    Path(sys.argv[1], f"rank{rank}.json").write_text(json.dumps({"before": before, "after": after}))
    dist.barrier()


if __name__ == "__main__":
    main()
