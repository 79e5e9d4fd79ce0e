"""The environment gate (``--rows gate``, about 10-20 s): what every later row needs, and nothing
slow — torch with CUDA and a kernel that runs, the GPU's name and memory, megatron-core and
Transformer Engine's PyTorch modules importing, this project, the environment of exact comparisons,
and whether the gradient-accumulation fusion (``main_grad`` row) can be on. With ``--require-gpu``
(``tools/gpu_loan.sh``) a missing GPU or TE is a FAIL and the loan stops there; without it, a SKIP."""

from __future__ import annotations

import importlib.util
import os
import time

import torch

from fbt_megatron.launch.rehearsal.measure import EXACT_ENV
from fbt_megatron.launch.rehearsal.report import CheckReport, one_line
from gpu_checks.machine import NO_GPU, Machine, probe

TITLE = "the environment gate"


def absent(report: CheckReport, name: str, why: str, require_gpu: bool) -> None:
    """A GPU-only requirement missing: FAIL where the run requires a GPU (the loan), else SKIP."""
    if require_gpu:
        report.fail(name, why, "present (--require-gpu)")
    else:
        report.skip(name, why)


def device_rows(report: CheckReport, machine: Machine, require_gpu: bool) -> None:
    name = "gate: CUDA GPU"
    if not machine.cuda:
        absent(report, name, f"{NO_GPU} (torch {torch.__version__}, CUDA {torch.version.cuda})", require_gpu)
        return
    report.check(name, f"{machine.gpus} x {machine.gpu_name}, sm{machine.capability[0]}{machine.capability[1]}, "
                 f"{machine.memory_gib:.0f} GiB; torch {torch.__version__}, CUDA {torch.version.cuda}", True, "visible")
    try:
        start = time.perf_counter()
        x = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
        finite = bool(torch.isfinite(x @ x).all())  # a host sync: the kernel ran (an old driver fails here)
        report.check("gate: a BF16 GEMM runs on the GPU", f"finite {finite}, {time.perf_counter() - start:.2f} s", finite,
                     "runs, finite")
    except Exception as e:  # noqa: BLE001 - the driver, the CUDA runtime
        report.fail("gate: a BF16 GEMM runs on the GPU", one_line(e)[:200], "runs, finite")


def import_rows(report: CheckReport, machine: Machine, require_gpu: bool) -> None:
    import fbt_megatron

    try:
        megatron = importlib.import_module("megatron.core")
        report.check("gate: megatron-core, fbt_megatron import", f"megatron-core {megatron.__version__}, "
                     f"fbt_megatron {fbt_megatron.__version__}", True, "import")
    except Exception as e:  # noqa: BLE001 - not installed, or built for another torch
        report.fail("gate: megatron-core, fbt_megatron import", one_line(e)[:200], "import")
    name = "gate: transformer_engine.pytorch imports"
    if machine.te_version is None:
        absent(report, name, machine.te_error or "not installed", require_gpu)
    elif machine.te_double:
        report.info(name + machine.label, f"the double of {machine.te_version}")
    else:
        report.check(name, f"transformer-engine {machine.te_version}", True, "imports")
    fusion = importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None
    report.info("gate: Apex fused_weight_gradient_mlp_cuda (gradient-accumulation fusion)" + machine.label,
                "present: training fuses, the main_grad row runs" if fusion else
                "absent: training runs without the fusion (N1 cannot occur), the main_grad row is skipped")


def environment_row(report: CheckReport) -> None:
    """TF32 off for every row; TE's attention determinism is set per group (tools/gpu_check.py)."""
    names = [name for name in EXACT_ENV if name != "NVTE_ALLOW_NONDETERMINISTIC_ALGO"]
    values = {name: os.environ.get(name) for name in [*names, "CUDA_DEVICE_MAX_CONNECTIONS"]}
    exact = all(values[name] == EXACT_ENV[name] for name in names)
    report.check("gate: environment of exact comparisons", ", ".join(f"{k}={v}" for k, v in values.items()), exact,
                 "TF32 off, cuBLAS reproducible")


def run(report: CheckReport, require_gpu: bool) -> None:
    machine = probe()
    device_rows(report, machine, require_gpu)
    import_rows(report, machine, require_gpu)
    environment_row(report)
