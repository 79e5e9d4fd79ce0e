"""How this project's command-line tools end: bad input is one ``error:`` line and exit code 2,
and the process group a command started is torn down; counts they print agree in number (``plural``)."""

from __future__ import annotations

import logging
import os
import signal
import sys
import warnings
from typing import Callable, NoReturn

from fbt_megatron.common import logs
from fbt_megatron.common.errors import PeerLostError, lost_a_peer, peer_lost
from fbt_megatron.common.folders import STORAGE_ERRNOS, unwritable

log = logging.getLogger(__name__)

# The process id of the torchrun agent (``trainer.stopping.torchrun``) that a worker finding bad input
# signals (BAD_INPUT_SIGNAL), so that the agent stops every worker instead of restarting them (in-job).
AGENT = "FBT_TORCHRUN_AGENT"
BAD_INPUT_SIGNAL = signal.SIGUSR2


def plural(count: int, noun: str, nouns: str | None = None) -> str:
    """"1 document", "2,048 documents" (``nouns``: an irregular plural)."""
    return f"{count:,} " + (noun if count == 1 else nouns or noun + "s")


def quiet_library_warnings() -> None:
    """Hide megatron-core's and torch's API notices (deprecations, CPU fallbacks) from a run's output."""
    for category in (UserWarning, FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category, module=r"(megatron|torch|fbt_megatron)\..*")
    warnings.filterwarnings("ignore", message=".*(ShardedTensor|grad attribute of a Tensor that is not a leaf).*")


def run_cli(main: Callable[[], int | None]) -> NoReturn:
    """Run `main` and exit with its return code, once the torch.distributed process group it
    started (training, conversion, loading a run) is destroyed. A ValueError or FileNotFoundError
    (bad input: a missing file, a malformed line, a bad flag value) becomes ``error: <message>`` on
    stderr and exit code 2, without a traceback; so does an OSError of the environment that no
    caller said better (``STORAGE_ERRNOS``: a full disk, a read-only file system). Under
    torchrun/srun every rank finds the same bad input; only rank 0 says so. A rank that lost
    another says so in one line, exit code 1: a ``PeerLostError`` (the ranks' stop check), or a
    torch.distributed collective's error that found another rank gone (``errors.lost_a_peer``:
    gloo's "Connection closed by peer", NCCL's aborted communicator; in the gradient all-reduce,
    a pipeline send) while a process group exists; any other error keeps its traceback. A process
    group that was there before (a caller's) is left as it is."""
    started_here = not _process_group()
    try:
        code = main()
    except PeerLostError as e:  # another rank ended first: its line says why; this one's group is broken
        _peer_lost(e)
    except (ValueError, FileNotFoundError) as e:
        _bad_input(str(e))
    except OSError as e:
        if e.errno not in STORAGE_ERRNOS:
            raise
        _bad_input(_storage_message(e))
    except RuntimeError as e:  # a collective's (gloo's RuntimeError, torch's DistBackendError)
        if not (_process_group() and lost_a_peer(e)):
            raise
        _peer_lost(peer_lost(sys.modules["torch.distributed"].get_rank(), "a collective", e))
    if started_here and _process_group():
        sys.modules["torch.distributed"].destroy_process_group()
    sys.exit(code)


def _peer_lost(e: PeerLostError) -> NoReturn:
    """End with ``error: <message>`` on one line (every rank that lost another says it) and exit code 1."""
    log.error(f"error: {' '.join(str(e).split())}", extra=logs.EVERY_RANK)
    sys.exit(1)


def _bad_input(message: str) -> NoReturn:
    """End with ``error: <message>`` on one line (rank 0 says it) and exit code 2."""
    line = "error: " + " ".join(message.split())
    if os.environ.get("RANK", "0") == "0":  # rank 0, whatever the logging rank: ``stopping.failed_worker`` counts on it
        log.error(line, extra=logs.EVERY_RANK)
    _tell_torchrun(line)
    agent = os.environ.get(AGENT, "")
    if agent.isdigit() and int(agent) == os.getppid():  # a restart cannot fix it: no restart
        os.kill(int(agent), BAD_INPUT_SIGNAL)
    sys.exit(2)


def _storage_message(e: OSError) -> str:
    """A write the file system refused, said with its folder and the fix (``folders.unwritable``)."""
    if e.filename:
        return unwritable(e, os.path.dirname(os.path.abspath(e.filename)), "write elsewhere") + f" (writing {e.filename})"
    return unwritable(e, "a folder this command writes in", "write elsewhere")


def _tell_torchrun(line: str) -> None:
    """Under torchrun, the ``error:`` line also goes to this worker's error file (torch elastic's
    ``TORCHELASTIC_ERROR_FILE``, its format, with the time to the microsecond): torchrun stops the
    other workers as soon as one fails, often before rank 0 has said anything, and
    ``stopping.torchrun`` prints the line of the rank that failed first from there."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        import json
        import time

        now = time.time()
        with open(path, "w") as f:
            json.dump({"message": {"message": line, "extraInfo": {"timestamp": int(now), "time": now,
                                                                  "rank": int(os.environ.get("RANK", 0))}}}, f)


def _process_group() -> bool:
    """Whether a torch.distributed process group exists (only a command that imported torch can have one)."""
    distributed = sys.modules.get("torch.distributed")
    return distributed is not None and distributed.is_available() and distributed.is_initialized()
