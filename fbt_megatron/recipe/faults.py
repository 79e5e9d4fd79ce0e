"""``--inject-fault KIND@STEP[:RANK]``: faults on purpose, for tests and drills (docs/operations.md):
the spec, checked with the recipe; ``trainer.callbacks.faults`` fires them.

* ``crash@5:1`` — rank 1 dies at the start of step 5 as ``kill -9`` kills it (SIGKILL to itself).
* ``hang@3:1`` — rank 1 stops at the start of step 3 and never returns; the other ranks block in
  the step's first collective. The hang watchdog (``trainer.callbacks.watchdog``) ends the run.
* ``freeze@3:1`` — the same, but rank 1 holds the interpreter while it waits (a C call that never
  returns: Python's own lock taken twice through its C API), so none of its threads runs, its
  watchdog included: it writes no stacks, the others name it by its missing file, and the launcher
  ends it once they have exited.
* ``slow@3:1`` — rank 1 is a straggler: it spends ``SLOW_SECONDS`` (1 s) of CPU time in a busy loop
  (as a throttled device would: more work for the same step; a sleep would be no work on a CPU,
  where the check counts CPU time) at the start of each of
  the ``SLOW_STEPS`` (10) steps from step 3 (3-12), inside its own part of the step, while the
  others wait for it in the gradient reduction; the straggler check (``trainer.callbacks.stragglers``)
  names it. Only time changes: the losses are those of the run without it, bit for bit.
* ``spike@6`` — step 6's loss and gradients are scaled by ``SPIKE_FACTOR`` (every rank: the whole
  step's), as a loss spike; the spike policy (``trainer.callbacks.spikes``) answers it.

The rank is 0 when not given; steps count from 1, as in the logs. The flag repeats (``--inject-fault
crash@5:1 --inject-fault spike@25``; a recipe: ``inject_fault: [crash@5:1, spike@25]``). A fault
that could not fire is refused up front with one line (``check_faults``): a rank outside the
world, a step past ``--train-iters``, a spike before the spike detector's window is full (its
first ``--spike-window`` steps: the spike would pass unseen).

A crash, hang or freeze is the machine's fault, which a restart fixes: it fires once per run
folder. The rank that fires it first appends it to ``<save>/injected_faults.jsonl``, and a run (a
restart, a ``--load``) skips the faults found there; so ``crash@5`` with a checkpoint at step 4
crashes once, and the restart runs step 5 to the end. A spike belongs to the step's data, as a
real one would: it fires whenever step 6 is trained, also after a resume from an earlier
checkpoint, so the spike policy's answer repeats exactly. A slow rank is not recorded either: its
steps are slow whenever they are trained.
"""

from __future__ import annotations

import re
from typing import List, NamedTuple, Optional

from fbt_megatron.common.cli import plural
from fbt_megatron.common.errors import RecipeError

KINDS = ("crash", "hang", "freeze", "slow", "spike")
ONCE = ("crash", "hang", "freeze")  # the machine's faults: fired once per run folder
SPIKE_FACTOR = 1000.0  # a spike's loss and gradients: this many times the step's own
SLOW_SECONDS = 1.0  # a slow rank's busy loop (CPU seconds) at the start of each of its slow steps
SLOW_STEPS = 10  # slow@STEP slows steps STEP .. STEP + SLOW_STEPS - 1
_SPEC = re.compile(rf"^({'|'.join(KINDS)})@(\d+)(?::(\d+))?$")


class Fault(NamedTuple):
    kind: str
    step: int
    rank: int

    @classmethod
    def parse(cls, spec) -> "Fault":
        """``KIND@STEP[:RANK]``; RecipeError (one line) for a malformed one."""
        m = _SPEC.match(str(spec).strip())
        if not m or int(m[2]) < 1:
            raise RecipeError(f"training.inject_fault: {spec!r} is not KIND@STEP[:RANK] (KIND: {', '.join(KINDS)}; "
                              "STEP from 1), e.g. --inject-fault crash@5:1")
        if m[1] == "spike" and m[3] is not None:
            raise RecipeError(f"training.inject_fault: {spec!r}: a spike is the whole step's, on every rank: give spike@{m[2]}")
        return cls(m[1], int(m[2]), int(m[3] or 0))

    def __str__(self) -> str:
        return f"{self.kind}@{self.step}" + ("" if self.kind == "spike" else f":{self.rank}")


def parse_faults(specs: Optional[List[str]]) -> List[Fault]:
    """The faults of ``--inject-fault``; RecipeError (one line) for a malformed one."""
    return [Fault.parse(spec) for spec in specs or []]


def check_faults(training, world_size: int) -> List[Fault]:
    """The faults of ``training.inject_fault`` (the recipe's training section), each one that can
    fire in a run of ``training.train_iters`` steps on ``world_size`` processes; RecipeError (one
    line) for the first that never would: its rank outside the world, its step past the run, a
    spike at a step whose spike window cannot be full (at step S the window holds at most the S - 1
    norms before it: the spike would pass unseen)."""
    faults = parse_faults(training.inject_fault)
    for spec, fault in zip(training.inject_fault or [], faults):
        where = f"training.inject_fault: {str(spec).strip()!r}"
        if fault.rank >= world_size:
            ranks = "rank 0" if world_size == 1 else f"ranks 0-{world_size - 1}"
            raise RecipeError(f"{where}: rank {fault.rank} is not in this run's world of {plural(world_size, 'process', 'processes')} "
                              f"({ranks}): it would never fire")
        if fault.step > training.train_iters:
            raise RecipeError(f"{where}: step {fault.step} is past --train-iters {training.train_iters}: it would never fire")
        if fault.kind == "spike" and fault.step <= training.spike_window:
            raise RecipeError(f"{where}: the spike detector compares a step with the median of the {training.spike_window} "
                              f"before it (--spike-window {training.spike_window}), so it sees no spike before step "
                              f"{training.spike_window + 1}: give a later step or a smaller --spike-window")
    return faults
