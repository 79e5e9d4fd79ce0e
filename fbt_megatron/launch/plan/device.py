"""What a plan needs to know of a GPU beyond ``common/gpus.py``'s table: the memory CUDA reports,
the share of it a training process can use, the FP32 peak and the memory bandwidth.

* **memory CUDA reports** (``torch.cuda.get_device_properties(i).total_memory``, the "total
  capacity" of PyTorch's out-of-memory message) is less than the nominal size: 79.11 GiB on an
  H100 80GB (nvidia-smi: 81,559 MiB, SXM and PCIe alike), 79.21 GiB on an A100-SXM4-80GB
  (85,056,798,720 bytes), 139.72–139.81 GiB on an H200 (the lowest taken), 178.35 GiB on a B200 —
  figures quoted in public out-of-memory reports and device dumps, not measured here;
* **reserved** before the first tensor: the CUDA context with torch's kernels and cuBLAS's workspace
  (≈ 0.5 GiB with CUDA 12's lazy module loading) and NCCL's buffers for the run's communicators
  (``NCCL_BUFFSIZE``, 4 MiB by default, per channel and peer of each: ≈ 1 GiB together): 1.5 GiB,
  the allowance of the planner cross-check (../shared/notes/planner-xcheck.md §6), not measured here
  — ``tools/gpu_check.sh`` on a loan is where it would be;
* **FP32 peak** (CUDA cores, no tensor cores) and **memory bandwidth**: the vendors' datasheets
  (SXM parts; the H100 PCIe's own).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from fbt_megatron.common.gpus import GPU, GPUS

RESERVED_GIB = 1.5  # the CUDA context and NCCL's buffers (module docstring)


@dataclass(frozen=True)
class Device:
    cuda_gib: float  # what CUDA reports
    fp32_tflops: float  # dense, CUDA cores
    bandwidth_tbs: float  # memory bandwidth, TB/s


DEVICES = {
    GPUS["h100"]: Device(79.11, 67.0, 3.35),
    GPUS["h100-pcie"]: Device(79.11, 51.0, 2.0),
    GPUS["h200"]: Device(139.72, 67.0, 4.8),
    GPUS["a100"]: Device(79.21, 19.5, 2.039),
    GPUS["b200"]: Device(178.35, 80.0, 8.0),
}


def usable_bytes(gpu: Optional[GPU], cuda_gib: Optional[float] = None) -> Optional[float]:
    """Bytes a training process can use: what CUDA reports (``cuda_gib``, else the table's for ``gpu``,
    else its nominal size) less the reserve; None without either."""
    if cuda_gib is None and gpu is None:
        return None
    total = cuda_gib if cuda_gib is not None else DEVICES[gpu].cuda_gib if gpu in DEVICES else gpu.memory_gb
    return (total - RESERVED_GIB) * 2**30

