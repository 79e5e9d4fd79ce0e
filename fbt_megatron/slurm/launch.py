"""The two ways a job script starts the training processes on its nodes (``--launch``).

``torchrun``: one Slurm task per node runs torchrun (``python -m fbt_megatron.slurm torchrun
ARGS``: torchrun's own command line). On SIGTERM — Slurm's requeue or cancel, or the job script's
forwarded time-limit signal — torchrun forwards TERM to its workers, waits for them (they save a
checkpoint at the next step boundary) and then raises; here that ends with one line instead of a
traceback, exit code 128 + the signal. A worker that fails ends torchrun with that worker's exit code
(128 + the signal that killed it), not torchrun's 1: the job script tells bad input (2) and a hang
(124) from a crash by it (``resilience.attempts``).

``tasks``: one Slurm task per GPU, no torchrun (``python -m fbt_megatron.slurm task ARGS``: the
training's command line). megatron-core 0.16 and torch.distributed read only torch's names, so
each task exports RANK, WORLD_SIZE and LOCAL_RANK from Slurm's, then becomes the training process
(``python -m fbt_megatron.train ARGS``, exec'd: the same process, which Slurm signals);
MASTER_ADDR and MASTER_PORT come from the job script (the job's first node, a port derived from
the job id).
"""

from __future__ import annotations

import os
import sys
from typing import List, NoReturn

TORCH_FROM_SLURM = {"RANK": "SLURM_PROCID", "WORLD_SIZE": "SLURM_NTASKS", "LOCAL_RANK": "SLURM_LOCALID"}


def torch_environment(env) -> dict:
    """RANK, WORLD_SIZE and LOCAL_RANK of this task from a Slurm step's environment."""
    missing = [name for name in [*TORCH_FROM_SLURM.values(), "MASTER_ADDR", "MASTER_PORT"] if name not in env]
    if missing:
        raise ValueError(f"not inside a job step of slurm/train.sbatch: {', '.join(missing)} not set")
    return {torch_name: env[slurm_name] for torch_name, slurm_name in TORCH_FROM_SLURM.items()}


def task(train_args: List[str]) -> NoReturn:
    os.environ.update(torch_environment(os.environ))
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-m", "fbt_megatron.train", *train_args])


def torchrun(torchrun_args: List[str]) -> int:
    from torch.distributed import run
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from fbt_megatron.stopping import failed_worker

    try:
        run.main(torchrun_args)
    except SignalException as e:
        print(f"torchrun: {e.sigval.name}: the workers were sent {e.sigval.name} and have ended", file=sys.stderr, flush=True)
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        return failed_worker(e)
    return 0
