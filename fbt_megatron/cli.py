"""How this project's command-line tools end: bad input is one ``error:`` line and exit code 2."""

from __future__ import annotations

import sys
from typing import Callable, NoReturn


def run_cli(main: Callable[[], int | None]) -> NoReturn:
    """Run `main` and exit with its return code. A ValueError or FileNotFoundError (bad input: a
    missing file, a malformed line, a bad flag value) becomes ``error: <message>`` on stderr and
    exit code 2, without a traceback."""
    try:
        code = main()
    except (ValueError, FileNotFoundError) as e:
        print("error: " + " ".join(str(e).split()), file=sys.stderr)
        sys.exit(2)
    sys.exit(code)
