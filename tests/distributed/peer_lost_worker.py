"""Worker of tests/test_operations.py (2 ranks, tests/forked.py): rank 1 is killed (SIGKILL) once the
process group is up; rank 0 then runs a step boundary's stop check (``stopping.StopCheck``), whose
all-reduce finds rank 1 gone, through the command line's ``run_cli`` as the training command does.

    python tests/distributed/peer_lost_worker.py
"""

import os
import signal


def main():
    from fbt_megatron.common.cli import run_cli

    run_cli(stop_check)


def stop_check():
    import torch.distributed as dist

    from fbt_megatron.common import platform
    from fbt_megatron.trainer.stopping import StopCheck

    platform.init_distributed()
    stop = StopCheck(None, handle_signals=False, started=0.0)
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        stop.start_step()
        return stop.stop_reason(1)
    finally:
        stop.close()


if __name__ == "__main__":
    main()
