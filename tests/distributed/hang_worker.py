"""Worker of the hang watchdog's asynchronous case (2 ranks, tests/test_resilience.py): a hang as
NCCL leaves it. The stuck rank stops outside any collective (``--inject-fault``'s hang, at step 1);
the other issues an all-reduce on the default group asynchronously, as every NCCL collective is
issued, and waits for its result from its own code, outside any ``torch.distributed`` call, as an
NCCL host waits in a ``.item()`` or a synchronize. The real watchdog (``--hang-timeout-minutes``
MINUTES) then ends both ranks.

    python tests/distributed/hang_worker.py SAVE STUCK_RANK MINUTES   (as 2 ranks: tests/forked.py)
"""

import sys

import torch.distributed as dist


def result(work) -> None:
    """The host waits for the collective here: not inside torch.distributed (a C++ wait)."""
    work.wait()


def main():
    import torch

    from fbt_megatron.common import platform
    from fbt_megatron.common.logs import setup_logging
    from fbt_megatron.trainer.callbacks.faults import Faults
    from fbt_megatron.trainer.callbacks.watchdog import Watchdog, arm_flight_recorder

    setup_logging()
    save, stuck, minutes = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    arm_flight_recorder(save)
    platform.init_distributed()
    Watchdog(minutes, save, step=0, train_iters=1).start()  # never kicked: it fires after MINUTES
    Faults([f"hang@1:{stuck}"], save, dist.get_rank()).start_step(1)  # the stuck rank stops here
    result(dist.all_reduce(torch.ones(4, device=platform.device()), async_op=True))


if __name__ == "__main__":
    main()
