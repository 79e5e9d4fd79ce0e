"""The hang watchdog: a run whose steps stop coming is ended, naming the rank the others wait for.

A thread per rank watches the training loop's progress (``kick`` at every step boundary). After
``--hang-timeout-minutes`` without one (a step, its validation and its checkpoint must fit), each
rank writes to ``<save>/hang/``: ``rank<R>.txt`` (one line: where its main thread is and the
collectives it has issued; then every thread's stack, ``faulthandler``), ``fr_trace_rank_<R>``
(torch's flight recorder, where torch has one: the collectives' sequence numbers, states, sizes
and call stacks, a pickle that ``torchfrtrace <save>/hang`` or ``python -m
torch.distributed.flight_recorder.fr_trace <save>/hang`` reads), and ``rank<R>.json`` last.

Which rank is stuck is read from the communicators, not from where Python waits. On NCCL a
collective call returns at once and the host waits later (a ``.item()``, a synchronize, a gradient
bucket's ``wait()``), so a waiting rank's main thread is rarely inside ``torch.distributed``. Each
rank's ``rank<R>.json`` holds, per process group it belongs to, the number of collectives it has
issued there as the group's backend counts them (``Backend._get_sequence_number_for_group``:
gloo's, NCCL's ``seqCollective_``, bumped on the host when the call is made), and per peer the
point-to-point operations (a pipeline's sends and receives) it has issued with that peer, a group
of two. torch exposes no count of those (NCCL's ``seqP2P_`` is not readable from Python), so the
watchdog counts them itself (``count_point_to_point``: torch.distributed's send/recv calls wrapped,
counted when the call is made); whatever they move of a backend's own count (gloo's counts each
among its collectives; NCCL's ``seqCollective_`` is moved by a batch of them, where it starts
coalescing) is measured around the call and taken out of the group's collectives, which are then
collectives alone on any backend: a pipeline's middle stage, which talks to two peers, is not
"ahead" of the others on the pipeline group. A rank that issued more collectives on a group (or
operations with a peer) than a peer is waiting for that peer; a rank behind on a group and ahead
on none is stuck outside a collective: the cause. Where the counts cannot tell (equal on every
group), a rank inside a ``torch.distributed`` call, or waiting beside a rank found stuck or silent,
is waiting; else it is stuck (every rank stuck outside collectives, e.g. in I/O). A rank stuck
holding the interpreter (a C call that never returns) writes nothing: it is named by its missing
file, and the launcher (torchrun, srun) ends it once the others have exited.

Each rank waits up to ``GRACE_S`` for the others' reports. Every rank that has them writes
``exit_status.json`` (``hang``, ``stuck_ranks``: the same content, atomically), so the file is there
whichever rank is stuck; the lowest rank with a report says it in one line (also in
``<save>/hang/diagnosis.txt``), and the others exit only once it has (at most ``GRACE_S`` later): a
launcher stops the other ranks when one exits. Every rank exits with ``HANG_EXIT`` (124, as
``timeout`` does), which a Slurm job restarts from the last checkpoint (``attempts``).

The process groups have a timeout of their own (``--distributed-timeout-minutes``, Megatron-LM's
flag, default 10): a collective that waits longer fails; on NCCL its watchdog then dumps the flight
recorder into ``<save>/hang/`` (``arm_flight_recorder``) and aborts the process (exit 134 under
Slurm, no stacks, no diagnosis). So that this watchdog names a hang first, the run gives its groups
the larger of that flag and this watchdog's timeout plus ``FIRES_WITHIN_S`` (``collective_timeout_s``):
a collective is issued after the watchdog's last kick, so it cannot time out before the watchdog has
fired, gathered the reports and ended the run. With the watchdog off (0) the flag alone holds.
"""

from __future__ import annotations

import faulthandler
import functools
import inspect
import json
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List, NamedTuple, Optional, Tuple

from fbt_megatron.common import logs
from fbt_megatron.common.io import atomic_open
from fbt_megatron.common.platform import node_name
from fbt_megatron.trainer.callbacks.base import Callback

log = logging.getLogger(__name__)

HANG_EXIT = 124
GRACE_S = 20.0  # how long the first rank waits for the others' files
CHECK_S = 10.0  # the longest time between two looks at the progress
# after its timeout the watchdog has ended the run within: a look (CHECK_S), the reports (GRACE_S),
# the stacks and flight-recorder dumps; with room
FIRES_WITHIN_S = 120.0
FLIGHT_RECORDER = "fr_trace_rank_"  # <save>/hang/fr_trace_rank_<R>: torch's flight recorder, per rank
DIAGNOSIS = "diagnosis.txt"  # <save>/hang/diagnosis.txt: the one line


def arm_flight_recorder(save: Optional[str]) -> None:
    """Before the process groups exist: NCCL's own collective timeout dumps torch's flight recorder
    (``TORCH_NCCL_DUMP_ON_TIMEOUT``) into ``<save>/hang/`` beside the watchdog's dumps
    (``TORCH_FR_DUMP_TEMP_FILE`` and ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``, its older name: a prefix,
    torch adds the rank), as torchtitan and Megatron-LM set them; what the environment sets already
    is kept. The recorder itself is on by default (2000 entries: ``TORCH_FR_BUFFER_SIZE``, older
    ``TORCH_NCCL_TRACE_BUFFER_SIZE``; 0 turns it off)."""
    defaults = [(("TORCH_NCCL_DUMP_ON_TIMEOUT",), "1")]
    if save:
        folder = Path(save) / "hang"
        defaults.append((("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"), str(folder / FLIGHT_RECORDER)))
        import torch

        if torch.cuda.is_available():  # NCCL's writer does not make the folder
            folder.mkdir(parents=True, exist_ok=True)
    for names, value in defaults:
        if not any(name in os.environ for name in names):
            os.environ.update(dict.fromkeys(names, value))


def collective_timeout_s(distributed_timeout_minutes: float, hang_timeout_minutes: float) -> int:
    """The process groups' timeout, seconds (module docstring): ``--distributed-timeout-minutes``,
    raised to the watchdog's ``--hang-timeout-minutes`` plus ``FIRES_WITHIN_S`` when that is later."""
    own = 60 * distributed_timeout_minutes
    if not hang_timeout_minutes:
        return int(own)
    return int(max(own, 60 * hang_timeout_minutes + FIRES_WITHIN_S))


# ---------------------------------------------------------------- point-to-point counts
_pairs: Dict[Tuple[int, int], int] = {}  # (lower, higher global rank) → point-to-point operations this rank issued between them
_moved: Dict[Tuple[str, str], int] = {}  # (group name, backend name) → what those moved of the backend's own count


class _Calls(threading.local):
    """This thread's wrapped calls under way: an operation inside another is the same one (torch's
    ``send`` calls ``isend``, and a torch-function mode such as ``platform``'s on a CPU calls the
    function again); inside ``batch_isend_irecv`` its operations' moves are the batch's."""

    op = 0
    batch = 0


_calls = _Calls()


def count_point_to_point() -> None:
    """Wrap torch.distributed's point-to-point calls (idempotent) so that ``issued_collectives``
    reports them per pair of ranks and leaves them out of the groups' collectives (module
    docstring). The wrappers replace the functions in ``torch.distributed`` and its
    ``distributed_c10d``, where megatron-core's pipeline looks them up at each call (``P2POp``
    accepts only those functions, and ``batch_isend_irecv`` calls what its ops hold)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if getattr(c10d.isend, "counted", False):
        return
    for name, peer in (("isend", "dst"), ("send", "dst"), ("irecv", "src"), ("recv", "src")):
        wrapped = _counted(getattr(c10d, name), peer)
        setattr(c10d, name, wrapped)
        setattr(dist, name, wrapped)
    batch = c10d.batch_isend_irecv

    @functools.wraps(batch)
    def batch_isend_irecv(p2p_op_list):
        def issue():
            _calls.batch += 1
            try:
                return batch(p2p_op_list)
            finally:
                _calls.batch -= 1

        return _moving(p2p_op_list[0].group, p2p_op_list[0].tensor.device, issue) if p2p_op_list else issue()

    c10d.batch_isend_irecv = dist.batch_isend_irecv = batch_isend_irecv


def _counted(op, peer: str):
    """``op`` (isend, send: ``peer`` "dst"; irecv, recv: "src"), counting each operation with its peer."""
    signature = inspect.signature(op)

    def call(*args, **kwargs):
        _calls.op += 1
        try:
            return op(*args, **kwargs)
        finally:
            _calls.op -= 1

    @functools.wraps(op)
    def counted(*args, **kwargs):
        import torch.distributed as dist

        if _calls.op:  # the operation under way, called again
            return op(*args, **kwargs)
        given = signature.bind(*args, **kwargs).arguments
        group, other = given.get("group"), given.get(peer)
        if other is None and given.get(f"group_{peer}") is not None:  # batch_isend_irecv names the peer in its group
            other = dist.get_global_rank(group or dist.group.WORLD, given[f"group_{peer}"])
        out = _moving(group, given["tensor"].device, lambda: call(*args, **kwargs))
        if other is not None:  # (a receive from any source has no peer to compare with)
            pair = tuple(sorted((dist.get_rank(), other)))
            _pairs[pair] = _pairs.get(pair, 0) + 1
        return out

    counted.counted = True
    return counted


def _moving(group, device, issue):
    """``issue()``, adding what it moves of ``group``'s backend count to ``_moved`` (outside a batch)."""
    import torch.distributed as dist

    if _calls.batch:
        return issue()
    group = group or dist.group.WORLD
    try:
        backend = group._get_backend(device)
        before = backend._get_sequence_number_for_group()
    except RuntimeError:  # no backend for the device, or one that does not count: the call says what is wrong
        return issue()
    out = issue()
    key = (dist.distributed_c10d._world.pg_names[group], backend.name())
    _moved[key] = _moved.get(key, 0) + backend._get_sequence_number_for_group() - before
    return out


def issued_collectives() -> dict:
    """Per process group of this rank: ``{key: {"group": its description, "ranks": [global ranks],
    "issued": collectives issued}}``, keyed by the group's name (the same on every rank), with the
    backend's name after a slash where a group has several (``cpu:gloo,cuda:nccl``); and per peer
    this rank exchanged point-to-point operations with (``count_point_to_point``), keyed ``p2p
    LOW-HIGH``: the operations issued."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return {}
    world = dist.distributed_c10d._world
    groups = {}
    for pg in list(world.pg_map):
        name, desc = world.pg_names[pg], getattr(pg, "group_desc", "")
        ranks = sorted(world.pg_group_ranks[pg], key=world.pg_group_ranks[pg].get)
        try:
            backends = []
            for device in pg._device_types:
                backend = pg._get_backend(device)
                if all(backend is not b for b in backends):  # one backend may serve several devices (gloo: cpu, cuda)
                    backends.append(backend)
            issued = [(backend.name(), backend._get_sequence_number_for_group() - _moved.get((name, backend.name()), 0))
                      for backend in backends]
        except RuntimeError:  # a backend that does not count (MPI, UCC, some third-party ones)
            continue
        for backend, n in issued:
            groups[name + (f"/{backend}" if len(issued) > 1 else "")] = {
                "group": desc if desc not in ("", "undefined") else f"group {name}", "ranks": ranks, "issued": n}
    for (low, high), n in sorted(_pairs.items()):
        groups[f"p2p {low}-{high}"] = {"group": f"point-to-point {low}-{high}", "ranks": [low, high], "issued": n}
    return groups


def _main_thread_at() -> tuple:
    """(where the main thread is: its innermost frame in this package as fbt_megatron/FILE:LINE in
    FUNCTION, else its innermost frame as FILE:LINE in FUNCTION; whether it is inside a
    torch.distributed call)."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    frames = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    if not frames:
        return "(unknown)", False
    package = f"{os.sep}fbt_megatron{os.sep}"
    at = next((f for f in frames if package in f.f_code.co_filename), frames[0])
    path = at.f_code.co_filename
    shown = path[path.rindex(package) + 1:] if package in path else os.path.basename(path)
    return f"{shown}:{at.f_lineno} in {at.f_code.co_name}", any(f"torch{os.sep}distributed{os.sep}" in f.f_code.co_filename
                                                               for f in frames[:3])


def _flight_recorder() -> Optional[bytes]:
    """This process's flight recorder as torch dumps it on a timeout; None where torch has none:
    NCCL's where torch is built with it (``_dump_nccl_trace``), else the backend-neutral one that
    gloo records into (``_dump_fr_trace``, recent torch)."""
    import torch

    c10d = torch._C._distributed_c10d
    dump = getattr(c10d, "_dump_nccl_trace", None) or getattr(c10d, "_dump_fr_trace", None)
    return None if dump is None else dump()


class Hang(NamedTuple):
    """Who the ranks wait for. ``evidence``: for the first stuck rank, the group it is behind on
    (its description, its count, {rank: count} of the ranks ahead); None when the counts do not tell."""

    stuck: List[int]
    silent: List[int]
    waiting: List[int]
    evidence: Optional[tuple]


def diagnose(reports: dict, world: int) -> Hang:
    """The ranks' reports (rank → its ``rank<R>.json``) read as the module docstring says."""
    keys = list(dict.fromkeys(k for r in sorted(reports) for k in reports[r]["groups"]))
    ahead, behind = set(), {}
    for key in keys:
        counts = {r: report["groups"][key]["issued"] for r, report in reports.items() if key in report["groups"]}
        for r, n in counts.items():
            if n > min(counts.values()):
                ahead.add(r)
            more = {q: m for q, m in counts.items() if m > n}
            if more and r not in behind:
                behind[r] = (reports[r]["groups"][key]["group"], n, more)
    silent = [r for r in range(world) if r not in reports]
    stuck = [r for r in sorted(reports) if r in behind and r not in ahead]
    explained = bool(silent or stuck)  # the others wait for these, maybe outside a Python-visible call
    stuck += [r for r in sorted(reports) if r not in ahead and r not in behind and not reports[r]["in_call"] and not explained]
    stuck.sort()
    return Hang(stuck, silent, [r for r in sorted(reports) if r not in stuck], behind.get(stuck[0]) if stuck else None)


class Watchdog(Callback):
    """Ends the run when ``kick`` has not been called for ``minutes`` (0: no watchdog) since
    ``start``; ``save``: the run folder (None: the stacks go to stderr); ``step``: the iteration the
    loop starts at. A callback of the loop: started with it (``on_start``), kicked after each
    step's save and heartbeat (``on_save``)."""

    def __init__(self, minutes: float, save: Optional[str], step: int, train_iters: int):
        import torch.distributed as dist

        self.timeout_s, self.step, self.train_iters, self.save = 60.0 * minutes, step, train_iters, save
        self.rank, self.world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        self.folder = Path(save) / "hang" if save else None  # a previous hang's files stay until the next one
        self.last, self.started, self.done, self.thread = time.monotonic(), time.time(), threading.Event(), None

    def start(self) -> None:
        """The watching thread, from now (none for a timeout of 0), and the point-to-point counts."""
        self.last = time.monotonic()
        if self.timeout_s > 0:
            count_point_to_point()
            self.thread = threading.Thread(target=self._watch, name="hang-watchdog", daemon=True)
            self.thread.start()

    def kick(self, step: int) -> None:
        """Progress: the loop is at step boundary ``step``."""
        self.last, self.step = time.monotonic(), step

    def on_start(self, state) -> None:
        self.start()

    def on_save(self, state, checkpoint) -> None:
        self.kick(state.iteration)

    def close(self) -> None:
        self.done.set()
        if self.thread is not None:
            self.thread.join()

    def _watch(self) -> None:
        while not self.done.wait(min(self.timeout_s / 10, CHECK_S)):
            if time.monotonic() - self.last > self.timeout_s:
                self._fire()

    def _fire(self) -> None:
        idle = time.monotonic() - self.last
        where, in_call = _main_thread_at()  # first: what this rank was doing, before anything below moves
        try:
            groups = issued_collectives()
        except Exception as e:  # torch's internals moved: where Python waits still says something
            log.warning(f"hang watchdog: rank {self.rank}: no collective counts ({type(e).__name__}: {e})", extra=logs.EVERY_RANK)
            groups = {}
        issued = ", ".join(f"{g['group']} {g['issued']}" for g in groups.values() if g["issued"]) or "none"
        head = (f"rank {self.rank} (node {node_name()}, pid {os.getpid()}): no step progress for {idle:.0f} s "
                f"after step {self.step}; main thread at {where}, {'inside' if in_call else 'outside'} a torch.distributed "
                f"call; collectives issued: {issued}\n")
        if self.folder is None:
            sys.stderr.write("hang watchdog: " + head)
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            sys.stderr.flush()
            os._exit(HANG_EXIT)
        self.folder.mkdir(parents=True, exist_ok=True)
        with atomic_open(self.folder / f"rank{self.rank}.txt", "w") as f:
            f.write(head)
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        try:
            trace = _flight_recorder()
        except Exception as e:  # the stacks and the counts still name the stuck rank
            log.warning(f"hang watchdog: rank {self.rank}: no flight recorder dump ({type(e).__name__}: {e})", extra=logs.EVERY_RANK)
            trace = None
        if trace is not None:
            with atomic_open(self.folder / f"{FLIGHT_RECORDER}{self.rank}", "wb") as f:
                f.write(trace)
        report = {"rank": self.rank, "node": node_name(), "step": self.step, "idle_s": round(idle), "where": where,
                  "in_call": in_call, "groups": groups}
        with atomic_open(self.folder / f"rank{self.rank}.json", "w") as f:  # last: this rank has reported
            json.dump(report, f)
        reports = self._gather()
        hang = diagnose(reports, self.world)
        self._status(_step(reports), hang)  # every rank: the stuck one may be rank 0
        said = self.folder / DIAGNOSIS
        if min(reports) == self.rank:  # the lowest rank with a report says it, once
            line = self._line(reports, hang)
            log.info(line, extra=logs.EVERY_RANK)
            with atomic_open(said, "w") as f:
                f.write(line + "\n")
        else:  # it says it before any rank exits: a launcher stops the others when one exits
            self._await(lambda: self._fresh(said))
        os._exit(HANG_EXIT)

    def _gather(self) -> dict:
        """Rank → its report, for every rank that wrote one within GRACE_S."""
        reports = {}

        def complete() -> bool:
            for r in range(self.world):
                path = self.folder / f"rank{r}.json"
                if r not in reports and self._fresh(path):
                    reports[r] = json.loads(path.read_text())
            return len(reports) == self.world

        self._await(complete)
        return reports

    def _fresh(self, path: Path) -> bool:
        """``path`` is there, written by this run's hang (not an earlier one's)."""
        return path.is_file() and path.stat().st_mtime >= self.started - 1

    @staticmethod
    def _await(done) -> None:
        """Until ``done()``, at most GRACE_S."""
        deadline = time.monotonic() + GRACE_S
        while not done() and time.monotonic() < deadline:
            time.sleep(0.2)

    def _line(self, reports: dict, hang: Hang) -> str:
        parts = []
        if hang.stuck:
            where = reports[hang.stuck[0]]["where"]
            if hang.evidence is not None:
                group, n, more = hang.evidence
                where += f"; {n} collectives issued on {group}, {_ranks(sorted(more))} {max(more.values())}"
            parts.append(f"{_ranks(hang.stuck, reports)} stuck outside a collective ({where})")
        if hang.silent:
            parts.append(f"{_ranks(hang.silent)} wrote no stacks (stuck holding the interpreter, or gone)")
        if hang.waiting:
            parts.append(f"{_ranks(hang.waiting, reports)} waiting in a collective")
        return (f"hang: no step progress for {reports[min(reports)]['idle_s']} s after step {_step(reports)} (--hang-timeout-minutes "
                f"{self.timeout_s / 60:g}): {'; '.join(parts)}; stacks in {self.folder}/rank*.txt; exit {HANG_EXIT}: a "
                "restart (--load) resumes from the last checkpoint")

    def _status(self, step: int, hang: Hang) -> None:
        from fbt_megatron.trainer import checkpointing
        from fbt_megatron.trainer.stopping import write_status

        newest = checkpointing.latest_iteration(self.save)
        write_status(self.save, "hang", step, self.train_iters,
                     None if newest is None else checkpointing.checkpoint_dir(self.save, newest),
                     stuck_ranks=sorted(hang.stuck + hang.silent))


def _step(reports: dict) -> int:
    """The step boundary the run stopped after: the earliest any rank reached."""
    return min(r["step"] for r in reports.values())


def _ranks(ranks: list, reports: Optional[dict] = None) -> str:
    """``rank 1`` / ``ranks 0, 2``; with their reports, each rank's node: ``rank 1 on n2``."""
    on = {r: f" on {reports[r]['node']}" for r in ranks if reports and "node" in reports.get(r, {})}
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(f"{r}{on.get(r, '')}" for r in ranks)
