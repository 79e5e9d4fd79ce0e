"""TE's quantization recipes (TE: common/recipe/__init__.py): the fields megatron-core sets.

TE's recipes are pydantic dataclasses, which ignore keyword arguments they do not have (pydantic's
``extra='ignore'``): megatron-core 0.16 passes ``params_dtype``, ``device`` and
``override_linear_precision`` (gone from TE 2.16's DelayedScaling, so ``fp8_wgrad false`` is
dropped there), and TE takes the rest."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple, Optional


def ignore_extra(cls):
    """pydantic's ``extra='ignore'`` on a plain dataclass: unknown keyword arguments are dropped."""
    init, names = cls.__init__, {f.name for f in dataclasses.fields(cls)}

    def __init__(self, *args, **kwargs):
        init(self, *args, **{k: v for k, v in kwargs.items() if k in names})

    cls.__init__ = __init__
    return cls


class _FormatHelper(NamedTuple):
    max_fwd: float
    max_bwd: float


class Format(Enum):
    """FP8 formats: E4M3 everywhere, E5M2 everywhere, or HYBRID (E4M3 forward, E5M2 for gradients)."""

    E4M3 = _FormatHelper(max_fwd=448, max_bwd=448)
    E5M2 = _FormatHelper(max_fwd=57344, max_bwd=57344)
    HYBRID = _FormatHelper(max_fwd=448, max_bwd=57344)


class Recipe:
    """Base of the recipes (TE: ``Recipe``); ``delayed()`` as TE's predicates."""

    def delayed(self) -> bool:
        return isinstance(self, DelayedScaling)

    def float8_current_scaling(self) -> bool:
        return isinstance(self, Float8CurrentScaling)

    def mxfp8(self) -> bool:
        return isinstance(self, MXFP8BlockScaling)

    def custom(self) -> bool:
        return False


@ignore_extra
@dataclass
class DelayedScaling(Recipe):
    """Scales from an amax history, updated at the exit of the outermost autocast."""

    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    scaling_factor_compute_algo: Optional[object] = None
    reduce_amax: bool = True
    fp8_dpa: bool = False
    fp8_mha: bool = False

    def __post_init__(self):
        assert self.fp8_format != Format.E5M2, "Pure E5M2 training is not supported."
        if self.fp8_dpa or self.fp8_mha:
            raise NotImplementedError("the TE double does not model FP8 attention (fp8_dpa / fp8_mha)")


@ignore_extra
@dataclass
class Float8CurrentScaling(Recipe):
    """Per-tensor scales from each tensor's own amax at the moment it is quantized (no state)."""

    fp8_format: Format = Format.HYBRID
    fp8_dpa: bool = False
    fp8_mha: bool = False

    def __post_init__(self):
        if self.fp8_dpa or self.fp8_mha:
            raise NotImplementedError("the TE double does not model FP8 attention (fp8_dpa / fp8_mha)")


@ignore_extra
@dataclass
class MXFP8BlockScaling(Recipe):
    """Block scales of 32 values (Blackwell only)."""

    margin: int = 0
    fp8_format: Format = Format.E4M3
    fp8_dpa: bool = False
    fp8_mha: bool = False


@ignore_extra
@dataclass
class Float8BlockScaling(Recipe):
    """1×128 / 128×128 block scales (not modelled by the double)."""

    fp8_format: Format = Format.E4M3
