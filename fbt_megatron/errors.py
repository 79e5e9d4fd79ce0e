"""The project's error types: input that cannot be used, said in one line.

Each is a ValueError, so a command-line tool ends on it with one ``error: <message>`` line and exit
code 2, without a traceback (``cli.run_cli``). The message names the offending thing and the fix.
This module imports nothing: every layer may raise them.
"""


class RecipeError(ValueError):
    """A recipe or command line that cannot be run; the message names the offending key."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names it."""


class ConversionError(ValueError):
    """A checkpoint or folder that cannot be converted; the message says why in one line."""


class BadStepsError(ValueError):
    """Too many consecutive bad steps: the run stops (one ``error:`` line, exit code 2)."""
