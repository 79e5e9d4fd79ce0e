"""Command lines run as a person runs them, without paying the interpreter's start-up for each.

``run_commands(module, commands)`` starts one Python process that imports ``module`` (what
``python -m`` runs, e.g. ``fbt_megatron.train`` or ``fbt_megatron.generate``: torch and
megatron-core, seconds of start-up), then forks one child per command line, in order, each a real
process of its own: its own ``sys.argv``, the module's ``main`` run as ``python -m`` runs it
(``fbt_megatron.common.cli.run_cli``) to its exit code, stdout and stderr in files. A later command sees what earlier ones wrote (a
resumed run after the run it resumes). Nothing but the imports is shared: the parent runs no
torch work before forking.

A command may also carry signals to send to its process (``Signal``: Ctrl-C, SIGTERM, kill -9 at
a chosen moment): each once the command's output contains ``output`` and a file matching the glob
``path`` exists, ``delay`` seconds later, one after another. Each child leads a process group of
its own and a signal goes to the whole group, as a terminal's Ctrl-C or Slurm's signal to a job
step does (the helper processes it started too), or with ``group=False`` to the process alone
(``kill -9 PID``). With ``listing`` (a folder) the parent records the names of its entries after
each command, before the next one starts: e.g. what a killed run left behind
(``run_commands(..., listing=folder, listings=[])``). ``survivors=[]`` gets, per command, the
processes of its run still alive 5 s after it ended (``survivors()``: its process group, and every
process descended from it when a signal was sent): none, when nothing outlives its run.

``run_ranks(target, nproc, log)`` is torchrun's ``--standalone`` launch the same way: one Python
process imports the target (``["-m", module, *argv]`` or ``[script, *argv]``) and megatron-core,
then forks ``nproc`` ranks at once with torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR/PORT, OMP_NUM_THREADS=1), each a real process joining one gloo process group; their
output goes to ``log``. When a rank fails the others are killed (they would wait for it in a
collective), as torchrun stops them; with ``each=[]`` none is: every rank ends by itself, and
``each`` gets every rank's exit code (a run whose ranks all end on their own, e.g. a hang's 124).
"""

import atexit
import glob
import importlib
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Iterable, List, NamedTuple, Optional, Sequence, Tuple

import psutil

from fbt_megatron.common.cli import run_cli
from fbt_megatron.common.processes import outside_group

ROOT = Path(__file__).parent.parent


class Signal(NamedTuple):
    """A signal for a command's process, sent ``delay`` s after its output contains ``output`` and
    a file matching the glob ``path`` exists (None: no such condition)."""

    signal: int
    output: Optional[str] = None
    path: Optional[str] = None
    delay: float = 0.0
    group: bool = True  # to the command's process group (False: to its process alone)


def descendants(pid: int) -> List[psutil.Process]:
    """``pid`` and every process descended from it, now."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def survivors(groups: Iterable[int], processes: Iterable[psutil.Process], within: float = 5.0) -> List[str]:
    """The processes of a run still alive ``within`` seconds from now (polled): members of the
    process ``groups`` and those of ``processes`` (``descendants()`` taken earlier), as ps lines."""
    groups, processes = set(groups), list(processes)
    deadline = time.monotonic() + within
    while True:
        alive = {p.pid: p for p in psutil.process_iter() if _group(p) in groups}
        alive.update({p.pid: p for p in processes if _alive(p)})
        alive.pop(os.getpid(), None)
        if not alive or time.monotonic() > deadline:
            return [_ps_line(p) for p in alive.values()]
        time.sleep(0.1)


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _group(process: psutil.Process) -> Optional[int]:
    try:
        return os.getpgid(process.pid) if _alive(process) else None
    except ProcessLookupError:
        return None


def _ps_line(process: psutil.Process) -> str:
    try:
        return f"{process.pid} ppid {process.ppid()} pgid {_group(process)}: {' '.join(process.cmdline())[:200]}"
    except psutil.NoSuchProcess:
        return f"{process.pid} (gone meanwhile)"


# argv, stdout file, stderr file (None: with stdout)[, signals to send]
Command = Tuple[Sequence[str], Path, Optional[Path]] | Tuple[Sequence[str], Path, Optional[Path], Sequence[Signal]]


def run_commands(module: str, commands: List[Command], timeout: int = 900, listing: Optional[Path] = None,
                 listings: Optional[list] = None, survivors: Optional[list] = None) -> List[int]:
    """The exit codes of ``python -m module *argv`` for each command, run one after another;
    ``listings`` (with ``listing``) gets, per command, the sorted entry names of ``listing`` after it;
    ``survivors`` the processes of each command's run alive 5 s after it ended."""
    env = outside_group()
    with tempfile.TemporaryDirectory() as tmp:
        spec, codes = Path(tmp) / "commands.json", Path(tmp) / "codes.json"
        spec.write_text(json.dumps({
            "listing": str(listing) if listing else None,
            "commands": [[list(map(str, c[0])), str(c[1]), str(c[2]) if c[2] else None, [list(s) for s in (c[3] if len(c) > 3 else [])]]
                         for c in commands],
        }))
        run = subprocess.run([sys.executable, __file__, module, str(spec), str(codes)], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=timeout)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
        results = json.loads(codes.read_text())
        if listings is not None:
            listings.extend(results["listings"])
        if survivors is not None:
            survivors.extend(results["survivors"])
        return results["codes"]


def run_ranks(target: Sequence, nproc: int, log: Path, timeout: int = 900, each: Optional[list] = None) -> int:
    """The exit code of ``target`` (``["-m", module, *argv]`` or ``[script, *argv]``) run as ``nproc``
    ranks (0: every rank succeeded; else the first failure's); all output in ``log``. ``each``: gets
    every rank's exit code, in rank order, and no rank is stopped when another fails."""
    env = outside_group()
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests"), env.get("PYTHONPATH", "")])
    with tempfile.TemporaryDirectory() as tmp, open(log, "w") as out:
        codes = Path(tmp) / "codes.json" if each is not None else None
        # a session of its own: on a timeout every rank goes with the launcher
        launcher = subprocess.Popen([sys.executable, __file__, "--ranks", str(nproc), str(codes or ""), *map(str, target)],
                                    cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = launcher.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
            raise
        if codes is not None:
            each.extend(json.loads(codes.read_text()))
        return code


def _load(target: List[str]):
    """(module, argv, is the module a script) of a command line's target."""
    if target[0] == "-m":
        return importlib.import_module(target[1]), target[2:], False
    spec = importlib.util.spec_from_file_location(f"_forked_{Path(target[0]).stem}", target[0])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # under its own name: the ``__main__`` guard stays shut
    sys.path.insert(0, str(Path(target[0]).resolve().parent))  # as ``python script.py`` puts it first
    return module, target[1:], True


def _rank(module, script: bool, argv: List[str], rank: int, nproc: int, port: int) -> int:
    import torch

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                      GROUP_RANK="0", ROLE_RANK=str(rank), ROLE_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0")
    if "OMP_NUM_THREADS" not in os.environ and nproc > 1:  # torchrun's default for several ranks per node
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)
    sys.argv = [getattr(module, "__file__", module.__name__), *argv]
    try:
        if script:
            code = module.main()
        else:
            run_cli(module.main)
    except SystemExit as e:
        code = e.code
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    return code if isinstance(code, int) else (0 if code is None else 1)


def ranks(nproc: int, codes: str, target: List[str]) -> int:
    """Fork the ranks and wait for them; ``codes``: a file for every rank's exit code (then no rank is
    stopped when another fails), or ""."""
    importlib.import_module("fbt_megatron.commands.train")  # torch and megatron-core, once for every rank
    module, argv, script = _load(target)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sys.stdout.flush()
    sys.stderr.flush()
    pids = []
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            os._exit(_rank(module, script, argv, rank, nproc, port))
        pids.append(pid)
    failed, each = 0, {}
    while len(each) < nproc:
        pid, status = os.wait()
        if pid not in pids:
            continue
        each[pid] = code = os.waitstatus_to_exitcode(status)
        if code and not failed:
            failed = code
            if not codes:
                print(f"forked.run_ranks: a rank exited with {code}: stopping the others", file=sys.stderr, flush=True)
                for other in set(pids) - set(each):  # they would wait for it in a collective
                    os.kill(other, signal.SIGKILL)
    if codes:
        Path(codes).write_text(json.dumps([each[pid] for pid in pids]))
    return failed


def _child(module, argv: List[str], out: str, err: Optional[str]) -> int:
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    out_fd = os.open(out, flags, 0o644)
    os.dup2(out_fd, 1)
    os.dup2(os.open(err, flags, 0o644) if err else out_fd, 2)
    sys.argv = [module.__name__, *argv]
    os.setpgid(0, 0)
    try:
        run_cli(module.main)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
        return 1
    finally:
        atexit._run_exitfuncs()  # what the interpreter's exit runs: e.g. stop multiprocessing managers
        sys.stdout.flush()
        sys.stderr.flush()


def _wait(pid: int, out: str, signals: list, processes: list) -> int:
    """Wait for the child, sending it ``signals`` (``Signal`` fields) as their conditions come true;
    ``processes`` gets the child's descendants at each signal."""
    def printed(text):
        return os.path.exists(out) and text in Path(out).read_text(errors="replace")

    for number, output, path, delay, group in signals:
        while not ((output is None or printed(output)) and (path is None or glob.glob(path))):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return os.waitstatus_to_exitcode(status)
            time.sleep(0.005)
        time.sleep(delay)
        processes.extend(descendants(pid))
        try:
            (os.killpg if group else os.kill)(pid, number)
        except ProcessLookupError:
            break
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def main() -> None:
    if sys.argv[1] == "--ranks":
        sys.exit(ranks(int(sys.argv[2]), sys.argv[3], sys.argv[4:]))
    name, spec, results = sys.argv[1:]
    module = importlib.import_module(name)  # under its own name: a ``__main__`` module's guard stays shut
    spec = json.loads(Path(spec).read_text())
    codes, listings, left = [], [], []
    for argv, out, err, signals in spec["commands"]:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os._exit(_child(module, argv, out, err))
        try:
            os.setpgid(pid, pid)  # also here: before the child may have run its own setpgid
        except (PermissionError, ProcessLookupError):
            pass
        processes = []
        codes.append(_wait(pid, out, signals, processes))
        left.append(survivors([pid], processes))
        if spec["listing"]:
            listings.append(sorted(os.listdir(spec["listing"])) if os.path.isdir(spec["listing"]) else [])
    Path(results).write_text(json.dumps({"codes": codes, "listings": listings, "survivors": left}))


if __name__ == "__main__":
    main()
