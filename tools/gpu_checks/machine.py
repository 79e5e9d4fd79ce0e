"""What this machine has: the device, torch, megatron-core and Transformer Engine (``probe``), read
once per process and handed to every group of rows (``Machine``); a CPU test double of TE
(``tests/doubles``, on ``PYTHONPATH``) is recognised and every row it produces says so."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Tuple

import torch

DOUBLE_LABEL = " [TE test double on CPU, not Transformer Engine]"
NO_GPU = "no CUDA GPU on this machine"
NO_TE = "needs Transformer Engine (not importable here)"


@dataclass(frozen=True)
class Machine:
    device: str  # the platform's device type: cuda, cpu, or the simulated device's
    gpus: int
    gpu_name: Optional[str]
    capability: Optional[Tuple[int, int]]
    memory_gib: Optional[float]
    te_version: Optional[str]  # None: transformer_engine.pytorch does not import
    te_error: Optional[str]
    te_double: bool  # the tests' CPU double of TE

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    @property
    def te(self) -> bool:
        """TE's modules run here: the real one on a GPU, or the double."""
        return self.te_version is not None and (self.cuda or self.te_double and self.device != "cpu")

    @property
    def real_te(self) -> bool:
        return self.te and not self.te_double

    @property
    def label(self) -> str:
        return DOUBLE_LABEL if self.te_double else ""

    def why_no_te(self) -> str:
        """Why the TE rows cannot run (for a SKIP)."""
        if not self.cuda and not self.te_double:
            return NO_GPU
        if self.te_double and not self.cuda and self.device == "cpu":
            return "the TE double runs on the simulated device: FBT_SIMULATED_DEVICE=1"
        return f"{NO_TE}: {self.te_error}" if self.te_error else NO_TE

    def fp8_missing(self) -> Optional[str]:
        """Why FP8 rows cannot run here, or None."""
        if not self.real_te:
            return self.why_no_te() if not self.te_double else "the TE double's FP8 is an emulation, not Transformer Engine"
        if self.cuda and self.capability < (8, 9):
            return f"FP8 needs sm89+ (Ada, Hopper, Blackwell); this GPU is sm{self.capability[0]}{self.capability[1]}"
        return None


def transformer_engine() -> Tuple[Optional[str], Optional[str], bool]:
    """(version, error, is the test double) of ``transformer_engine.pytorch``."""
    try:
        te = importlib.import_module("transformer_engine")
        importlib.import_module("transformer_engine.pytorch")  # a build for another torch or CUDA fails here
    except Exception as e:  # noqa: BLE001 - ImportError, OSError of a mismatched library, ...
        return None, f"{type(e).__name__}: {' '.join(str(e).split())}"[:200], False
    return getattr(te, "__version__", "unknown"), None, "doubles" in Path(te.__file__).resolve().parts


def probe() -> Machine:
    from fbt_megatron.common import platform
    from fbt_megatron.testing import simulated_device  # the tests' GPU stand-in (FBT_SIMULATED_DEVICE=1)

    version, error, double = transformer_engine()
    cuda = torch.cuda.is_available()
    props = torch.cuda.get_device_properties(0) if cuda else None
    device = "cuda" if cuda else simulated_device.DEVICE_TYPE if platform.simulated() else "cpu"
    return Machine(device=device, gpus=torch.cuda.device_count() if cuda else 0,
                   gpu_name=props.name if props else None, capability=(props.major, props.minor) if props else None,
                   memory_gib=props.total_memory / 2**30 if props else None, te_version=version, te_error=error,
                   te_double=double)
