"""The pass schedule: how many passes k each training step runs.

In phases: e.g. k = 1 for the first 75% of training, then k drawn per step from {1: 0.75, 2: 0.22,
3: 0.03}. A pure function of (seed, step): every rank, and a resumed run, computes the same k
without communicating (``seeds``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Tuple

import torch

from fbt_megatron.common import seeds


@dataclass(frozen=True)
class PassPhase:
    """From step ``start`` on, k is drawn from ``mixture`` ({k: weight}; a fixed k is {k: 1})."""

    start: int
    mixture: Dict[int, float]

    def describe(self) -> str:
        if len(self.mixture) == 1:
            return f"k = {next(iter(self.mixture))}"
        total = sum(self.mixture.values())
        return "k ~ {" + ", ".join(f"{k}: {w / total:.2f}" for k, w in sorted(self.mixture.items())) + "}"


@dataclass(frozen=True)
class PassSchedule:
    """k for each training step, in phases (e.g. k = 1 for the first 75% of training, then
    {1: 0.75, 2: 0.22, 3: 0.03}). A pure function of (seed, step): every rank, and a resumed run,
    computes the same k without communicating."""

    seed: int
    phases: Tuple[PassPhase, ...]

    def __post_init__(self):
        starts = [p.start for p in self.phases]
        if not starts or starts[0] != 0 or starts != sorted(set(starts)):
            raise ValueError(f"pass phases must start at step 0 and increase, got starts {starts}")

    @classmethod
    def fixed(cls, seed: int, passes: int) -> "PassSchedule":
        return cls(seed, (PassPhase(0, {passes: 1.0}),))

    def phase(self, step: int) -> int:
        """The index of the phase ``step`` belongs to."""
        return max(i for i, p in enumerate(self.phases) if p.start <= step)

    def __call__(self, step: int) -> int:
        mixture = self.phases[self.phase(step)].mixture
        counts = sorted(mixture)
        if len(counts) == 1:
            return counts[0]
        weights = torch.tensor([float(mixture[k]) for k in counts], dtype=torch.float64)
        u = torch.rand((), generator=seeds.generator(self.seed, step, seeds.SCHEDULE, "cpu"), dtype=torch.float64)
        index = int(torch.searchsorted(weights.cumsum(0) / weights.sum(), u, right=True).clamp(max=len(counts) - 1))
        return counts[index]

    def expected_passes(self, steps: int) -> Dict[int, float]:
        """The expected number of steps with each k over steps [0, steps) (planning, reports)."""
        out: Dict[int, float] = {}
        for i, p in enumerate(self.phases):
            end = min(steps, self.phases[i + 1].start if i + 1 < len(self.phases) else steps)
            total = sum(p.mixture.values())
            for k, w in p.mixture.items():
                out[k] = out.get(k, 0.0) + max(0, end - p.start) * w / total
        return out

    def describe(self) -> str:
        """The schedule in words, e.g. "k = 1 from step 0, k ~ {1: 0.75, 2: 0.22, 3: 0.03} from step 600"."""
        return ", ".join(f"{p.describe()} from step {p.start}" for p in self.phases)

    def state_dict(self) -> dict:
        return {"seed": self.seed, "phases": [{"start": p.start, "mixture": dict(p.mixture)} for p in self.phases]}


def pass_schedule(recipe) -> PassSchedule:
    """The run's pass schedule: its phases (``Recipe.pass_phases``) drawn with the run's seed."""
    return PassSchedule(recipe.training.seed, tuple(PassPhase(start, mixture) for start, mixture in recipe.pass_phases()))
