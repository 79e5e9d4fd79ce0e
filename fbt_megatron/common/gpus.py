"""Accelerators the planner knows: memory and dense peak throughput (vendor datasheets, SXM parts).

MFU's denominator is the dense (no sparsity) BF16 tensor-core peak; FP8 is listed for FP8 GEMM runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class GPU:
    name: str
    memory_gb: float  # GiB the allocator can use is a little less (CUDA context, fragmentation)
    bf16_tflops: float  # dense peak
    fp8_tflops: Optional[float]  # dense peak; None: no FP8 tensor cores

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gb * 2**30)


GPUS = {
    "h100": GPU("H100 SXM 80GB", 80, 989.0, 1979.0),
    "h100-pcie": GPU("H100 PCIe 80GB", 80, 756.0, 1513.0),
    "h200": GPU("H200 SXM 141GB", 141, 989.0, 1979.0),
    "a100": GPU("A100 SXM 80GB", 80, 312.0, None),
    "b200": GPU("B200 180GB", 180, 2250.0, 4500.0),
}


def from_device_name(name: str) -> Optional[GPU]:
    """The table's entry for a CUDA device name (``torch.cuda.get_device_name()``, e.g. "NVIDIA
    H100 PCIe"): the longest key the name contains; None if none does."""
    normalised = "-".join(name.lower().split())
    matches = [key for key in GPUS if key in normalised]
    return GPUS[max(matches, key=len)] if matches else None


def current() -> Optional[GPU]:
    """This process's GPU from the table; None on CPU or for a GPU the table does not have."""
    import torch

    return from_device_name(torch.cuda.get_device_name()) if torch.cuda.is_available() else None


def peak_tflops(override=None):
    """MFU's denominator: ``logging.peak_tflops`` when given, else this GPU's dense BF16 peak; None on CPU."""
    gpu = current()
    return override or (gpu.bf16_tflops if gpu else None)
