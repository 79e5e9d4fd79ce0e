"""Command lines run as a person runs them, without paying the interpreter's start-up for each.

``run_commands(module, commands)`` starts one Python process that imports ``module`` (what
``python -m`` runs, e.g. ``fbt_megatron.train`` or ``fbt_megatron.generate.__main__``: torch and
megatron-core, seconds of start-up), then forks one child per command line, in order, each a real
process of its own: its own ``sys.argv``, the module's ``main`` run as ``python -m`` runs it
(``fbt_megatron.cli.run_cli``) to its exit code, stdout and stderr in files. A later command sees what earlier ones wrote (a
resumed run after the run it resumes). Nothing but the imports is shared: the parent runs no
torch work before forking.
"""

import importlib
import json
import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from fbt_megatron.cli import run_cli

ROOT = Path(__file__).parent.parent
Command = Tuple[Sequence[str], Path, Optional[Path]]  # argv, stdout file, stderr file (None: with stdout)


def run_commands(module: str, commands: List[Command], timeout: int = 900) -> List[int]:
    """The exit codes of ``python -m module *argv`` for each command, run one after another."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    with tempfile.TemporaryDirectory() as tmp:
        spec, codes = Path(tmp) / "commands.json", Path(tmp) / "codes.json"
        spec.write_text(json.dumps([[list(map(str, argv)), str(out), str(err) if err else None] for argv, out, err in commands]))
        run = subprocess.run([sys.executable, __file__, module, str(spec), str(codes)], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=timeout)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
        return json.loads(codes.read_text())


def _child(module, argv: List[str], out: str, err: Optional[str]) -> int:
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    out_fd = os.open(out, flags, 0o644)
    os.dup2(out_fd, 1)
    os.dup2(os.open(err, flags, 0o644) if err else out_fd, 2)
    sys.argv = [module.__name__, *argv]
    try:
        run_cli(module.main)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def main() -> None:
    name, spec, results = sys.argv[1:]
    module = importlib.import_module(name)  # under its own name: a ``__main__`` module's guard stays shut
    codes = []
    for argv, out, err in json.loads(Path(spec).read_text()):
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os._exit(_child(module, argv, out, err))
        codes.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
    Path(results).write_text(json.dumps(codes))


if __name__ == "__main__":
    main()
