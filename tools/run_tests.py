"""The test suite (``make test``) in two streams on one machine.

tests/test_slurm.py and tests/test_slurm_containers.py (a real Slurm of three nodes, one at a time:
two would clash on this machine) and tests/test_resilience.py spend much of their time waiting: on Slurm's scheduling, requeues and node timeouts, on the hang watchdog. They run as
one stream beside the rest of tests/ instead of after it (measured on 2 cores: 11 minutes of the
suite's 44 at 0.4–0.6 of the CPU). That stream's output is kept in ``.test-logs/waiting.log`` and
shown after the rest's; the exit status is the first failing stream's. The streams share nothing
on disk but the default data prepared under ``data/`` on first use, which either may prepare first
(a preparer takes the folder another process finished meanwhile when its settings are the same).

    python tools/run_tests.py            # the whole suite, two streams
    python tools/run_tests.py ARGS...    # pytest ARGS, one stream (e.g. tests/test_data.py -x)
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BESIDE = ["tests/test_slurm.py", "tests/test_slurm_containers.py", "tests/test_resilience.py"]
LOG = ROOT / ".test-logs" / "waiting.log"


def main(argv: list[str]) -> int:
    pytest = [sys.executable, "-m", "pytest", "-q"]
    if argv:
        return ended(subprocess.Popen([*pytest, *argv], cwd=ROOT))
    LOG.parent.mkdir(exist_ok=True)
    with open(LOG, "wb") as log:
        beside = subprocess.Popen([*pytest, *BESIDE], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        rest = ended(subprocess.Popen([*pytest, *(f"--ignore={path}" for path in BESIDE)], cwd=ROOT))
        waiting = ended(beside)
    print(f"\n---- {' and '.join(BESIDE)}, run beside the rest (its output: {LOG.relative_to(ROOT)}) ----", flush=True)
    sys.stdout.write(LOG.read_text(errors="replace"))
    return rest or waiting


def ended(stream: subprocess.Popen) -> int:
    """The stream's exit status once it has ended. Ctrl-C reaches every stream (one process group):
    each ends its own tests and cleans up (the Slurm cluster's daemons), so this waits on."""
    while True:
        try:
            return stream.wait()
        except KeyboardInterrupt:
            continue


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
