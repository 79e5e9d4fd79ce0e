"""The project's error types: input that cannot be used, said in one line.

Each is a ValueError, so a command-line tool ends on it with one ``error: <message>`` line and exit
code 2, without a traceback (``cli.run_cli``). The message names the offending thing and the fix.
``PeerLostError`` is the one that is not bad input: one line too, exit code 1.
This module imports nothing: every layer may raise them.
"""


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
