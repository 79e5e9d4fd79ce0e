"""The two ways a job script starts the training processes on its nodes (``--launch``).

``torchrun``: one Slurm task per node runs torchrun (``python -m fbt_megatron.slurm torchrun
--stop-timeout S ARGS``: ARGS is torchrun's own command line) through ``stopping.torchrun``. On
SIGTERM — the job script's forwarded time-limit signal, or Slurm's requeue or cancel — the workers
get it, checkpoint at the next step boundary and exit 0, and so does the launcher, the workers' line
last; it waits for them up to S seconds (the job script's ``--signal-margin`` less what the script
needs after the training: the requeue must happen before the time limit), then kills them (exit
128 + 9, one line). Plain torchrun would kill them 30 s after the signal (its ``close`` timeout,
torch ``elastic/multiprocessing/api.py``), cutting a full-size save. A worker that fails ends the
launcher with that worker's exit code (128 + the signal that killed it), not torchrun's 1: the job
script tells bad input (2) and a hang (124) from a crash by it (``launch.attempts``). So does
the SIGTERM that finds the worker dead: srun's ``--kill-on-bad-exit`` ending the step because
another node's rank exited 1 when this node's was killed (kill -9, the OOM killer), before torchrun
noticed. The launcher then ends at once, with the worker's signal as its exit code (137), not 143
and not killed: once srun has ended the step it prints a line only for a task that exited, not for
one a signal ended, and the attempt's record names the failed node from those lines. A
torchrun too old for ``--signals-to-handle`` keeps its own 30 s and ends with 128 + the signal.

torchrun's agent itself logs C++ warnings with every frame of their stack: at the end of each
multi-node job, when the node that hosted the rendezvous store has left before another node's agent
closed its rendezvous (torch's ``dynamic_rendezvous`` then says so in one line of its own). The
job script starts the launcher with ``TORCH_CPP_LOG_LEVEL=ERROR`` (read once, when torch loads) and
the level its workers should have in ``FBT_WORKER_CPP_LOG_LEVEL`` (the submitting shell's, else
torch's default WARNING), which the launcher gives back to the workers' environment.

``tasks``: one Slurm task per GPU, no torchrun (``python -m fbt_megatron.slurm task ARGS``: the
training's command line). megatron-core 0.16 and torch.distributed read only torch's names, so
each task exports RANK, WORLD_SIZE and LOCAL_RANK from Slurm's, then becomes the training process
(``python -m fbt_megatron.train ARGS``, exec'd: the same process, which Slurm signals);
MASTER_ADDR and MASTER_PORT come from the job script (the job's first node, a port derived from
the job id).

Neither srun nor slurmd cuts the time-limit stop short: ``scancel --signal=TERM`` only signals the
steps' processes (slurmstepd ``_handle_signal_container``), with no SIGKILL after it; srun kills a
step on its own only when a task exits non-zero (``--kill-on-bad-exit``), when srun itself gets
SIGTERM (not the case: the batch shell is not signalled) or ``--wait``/``WaitTime`` seconds after the
first task ends (default 0: never). A requeue, a cancel or the time limit itself are Slurm's own
terminations: SIGTERM, then SIGKILL ``KillWait`` seconds later (``scontrol show config``; default
30), for every launch (docs/operations.md).
"""

from __future__ import annotations

import os
import sys
from typing import List, NoReturn

WORKER_CPP_LOG_LEVEL = "FBT_WORKER_CPP_LOG_LEVEL"  # the workers' TORCH_CPP_LOG_LEVEL (the agent's is ERROR)
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


def torchrun(argv: List[str]) -> int:
    """``--stop-timeout SECONDS`` then torchrun's own command line (``stopping.torchrun``)."""
    from fbt_megatron.trainer.stopping import torchrun as run_torchrun

    if argv[:1] != ["--stop-timeout"] or len(argv) < 2 or not argv[1].isdigit() or int(argv[1]) < 1:
        raise ValueError(f"python -m fbt_megatron.slurm torchrun: expected --stop-timeout SECONDS (1 or more) before "
                         f"torchrun's arguments, got {' '.join(argv[:2]) or 'nothing'}")
    if WORKER_CPP_LOG_LEVEL in os.environ:  # the agent's own level is set; the workers get theirs
        os.environ["TORCH_CPP_LOG_LEVEL"] = os.environ.pop(WORKER_CPP_LOG_LEVEL)
    return run_torchrun(argv[2:], stop_timeout=int(argv[1]))
