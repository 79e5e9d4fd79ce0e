"""The project's error types: input that cannot be used, said in one line.

Each is a ValueError, so a command-line tool ends on it with one ``error: <message>`` line and exit
code 2, without a traceback (``cli.run_cli``). The message names the offending thing and the fix.
``PeerLostError`` is the one that is not bad input: one line too, exit code 1 (``peer_lost``
makes it from a collective's error, ``lost_a_peer`` recognises one).
This module imports nothing of the project (only ``re``): every layer may raise them.
"""

import re


class RecipeError(ValueError):
    """A recipe or command line that cannot be run; the message names the offending key."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names it."""


class ConversionError(ValueError):
    """A checkpoint or folder that cannot be converted; the message says why in one line."""


class StorageError(ValueError):
    """A folder the run must write in cannot take it (a full disk, a read-only file system, no
    permission, a path through a file): the environment, not the code, so one line naming the folder
    and the fix, exit code 2 (a Slurm job does not retry it)."""


class BadStepsError(ValueError):
    """Too many consecutive bad steps: the run stops (one ``error:`` line, exit code 2)."""


class ArgumentError(ValueError):
    """A function argument's bad value, worded for both kinds of caller: the message names
    arguments as ``{name}`` placeholders, said as Python arguments (``str``) or as a command's
    ``--flags`` (``flags()``)."""

    def __init__(self, template: str, *names: str):
        self.template, self.names = template, names
        super().__init__(self.say(lambda name: name))

    def say(self, word) -> str:
        return self.template.format(**{name: word(name) for name in self.names})

    def flags(self) -> str:
        """The message with every argument named as its flag (``max_new_tokens`` → ``--max-new-tokens``)."""
        return self.say(lambda name: "--" + name.replace("_", "-"))


class PeerLostError(RuntimeError):
    """Another rank of the run ended while this one waited for it (its connection closed): the cause
    is that rank's, and its own line says what it was. This rank ends with one line, exit code 1 (a
    crash: a job may retry it), not the library's traceback (``cli.run_cli``)."""


# A collective's error when another rank's process ended (killed, OOM, crashed): gloo's "Connection closed by
# peer" / "Connection reset by peer" / "Broken pipe" (a read or write on the dead rank's socket); NCCL's
# "NCCL communicator was aborted on rank R" (also after a collective's timeout: a rank that never came) and
# ncclRemoteError ("remote process exited or there was a network error"; its socket's "Connection closed by
# remote peer"). Not an error of this rank's own (NCCL's "unhandled cuda error"): that stays the library's.
_LOST_PEER = re.compile(r"connection (closed|reset) by (remote )?peer|broken pipe|communicator was aborted|"
                        r"ncclRemoteError|remote process exited", re.IGNORECASE)


def lost_a_peer(error: BaseException) -> bool:
    """Whether ``error`` is a collective's (torch.distributed: gloo's ``RuntimeError``, a
    ``DistBackendError``) that found another rank gone (``_LOST_PEER``)."""
    return isinstance(error, RuntimeError) and bool(_LOST_PEER.search(str(error)))


def peer_lost(rank: int, what: str, error: BaseException) -> PeerLostError:
    """The ``PeerLostError`` of rank ``rank`` whose ``what`` ("a collective", "the ranks' stop check")
    lost another rank with ``error``: its message quotes the library's first line, less gloo's source
    location ("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] ") and what follows its first
    sentence (gloo's "This is typically caused by a remote worker crashing. ...")."""
    first = (str(error).splitlines() or [""])[0]
    said = re.sub(r"^\[[^\]]*\]\s*", "", first).split(". ")[0] or type(error).__name__
    return PeerLostError(f"rank {rank}: {what} lost another rank ({said}): that rank's own line says why it ended")
