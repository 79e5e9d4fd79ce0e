"""One check of a GPU machine, in rows that decide (their modules: tools/gpu_checks/).

    python tools/gpu_check.py                                   # every row this machine can run
    python tools/gpu_check.py --rows gate --require-gpu         # the environment gate alone (10-20 s)
    python tools/gpu_check.py --rows main_grad --json OUT/main_grad.json
    python tools/gpu_check.py --rows slurm --slurm-nodes 2 --gpus-per-node 8 --slurm-args "--partition gpu"
    python tools/gpu_check.py --loan-summary runs/gpu-loan-DATE  # tools/gpu_loan.sh's report of its parts

Rows: gate, equivalence, fp8, main_grad, kernels, performance, offload, multi_gpu (default: all of
them) and slurm (with --slurm-nodes; from a login node). Each row is PASS, FAIL, SKIP (the reason it
could not run) or INFO, with its criterion (docs/gpu.md#the-rows-and-their-criteria). Runs with TF32
off (``measure.EXACT_ENV``); Transformer Engine's attention is deterministic in the groups that compare
closely (equivalence, fp8, main_grad) and as training runs it in the others. Prints one table and its
verdict, writes --json; exit code 0 every row ran and passed, 1 a row failed (out of memory included),
3 none failed but some were not checked, 2 bad flags. Without a GPU the rows that need one are SKIPs
and the rest run on the CPU; with ``PYTHONPATH=tests/doubles FBT_SIMULATED_DEVICE=1`` the main_grad row
runs against the tests' TE double, and says so in its name.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "tools"), str(REPO)]

from fbt_megatron.common.cli import quiet_library_warnings, run_cli  # noqa: E402
from fbt_megatron.launch.rehearsal.measure import EXACT_ENV  # noqa: E402
from fbt_megatron.launch.rehearsal.report import CheckReport, one_line  # noqa: E402
from gpu_checks import GROUPS, gate, loan  # noqa: E402
from gpu_checks.harness import Context, guarded  # noqa: E402
from gpu_checks.machine import probe  # noqa: E402

LOCAL_ROWS = ("gate", *[name for name in GROUPS if name != "slurm"])
ATTENTION = "NVTE_ALLOW_NONDETERMINISTIC_ALGO"  # TE reads it when a model's attention is built


def exact_environment() -> str:
    """TF32 off and cuBLAS reproducible before any CUDA library starts (NVIDIA_TF32_OVERRIDE is read when cuBLAS
    starts, TORCH_ALLOW_TF32_CUBLAS_OVERRIDE at torch's first FP32 GEMM); one hardware queue, as jobs run with TP > 1
    or CP > 1 (the timed rows). Returns the attention setting training runs with (TE's default: non-deterministic
    allowed), for the groups that measure what trains."""
    training = os.environ.get(ATTENTION, "1")
    os.environ.update(EXACT_ENV)
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    return training


class _Parser(argparse.ArgumentParser):
    """Bad flags raise ValueError: one ``error:`` line and exit code 2 (``run_cli``)."""

    def error(self, message):
        raise ValueError(message)


def parse_args(argv=None) -> argparse.Namespace:
    parser = _Parser(prog="python tools/gpu_check.py", description=__doc__.splitlines()[0])
    parser.add_argument("--rows", help=f"comma-separated groups (default: {','.join(LOCAL_ROWS)}; slurm with --slurm-nodes)")
    parser.add_argument("--require-gpu", action="store_true", help="a missing GPU or Transformer Engine is a FAIL (the loan's gate)")
    parser.add_argument("--json", type=Path, help="write the report here")
    parser.add_argument("--perf-seq-length", type=int, default=4096)
    parser.add_argument("--perf-micro-batch-size", type=int, default=1)
    parser.add_argument("--perf-steps", type=int, default=5, help="timed steps (after 2 warm-up steps)")
    parser.add_argument("--offload-seq-length", type=int, default=32768, help="sequence of the offloading comparison")
    parser.add_argument("--offload-steps", type=int, default=3, help="timed steps of each offloading candidate")
    parser.add_argument("--kernel-seq-length", type=int, default=4096, help="sequence of the attention kernels' comparison")
    parser.add_argument("--slurm-nodes", type=int, default=0, help="nodes of the Slurm job row (run from a login node)")
    parser.add_argument("--gpus-per-node", type=int, default=0, help="the GPUs of each of those nodes (the job's layout)")
    parser.add_argument("--slurm-args", default="", help="more flags of `python -m fbt_megatron.slurm submit` for that job "
                        "(quoted: --partition, --account, --container-image IMAGE, ...)")
    parser.add_argument("--workdir", type=Path, default=REPO / "runs", help="a new gpu_check-* folder here holds the runs")
    parser.add_argument("--loan-summary", type=Path, metavar="DIR", help="only summarise tools/gpu_loan.sh's parts in DIR")
    args = parser.parse_args(argv)
    default = LOCAL_ROWS + (("slurm",) if args.slurm_nodes else ())
    args.rows = args.rows.split(",") if args.rows else list(default)
    unknown = [name for name in args.rows if name not in ["gate", *GROUPS]]
    if unknown:
        raise ValueError(f"--rows: unknown {', '.join(unknown)} (known: gate, {', '.join(GROUPS)})")
    args.workdir = args.workdir.resolve()
    return args


def run_rows(args: argparse.Namespace, report: CheckReport, training_attention: str) -> None:
    """The gate (it needs nothing started), then the platform (one process group), then each group."""
    if "gate" in args.rows:
        guarded(report, gate.TITLE, gate.run, report, args.require_gpu)
    groups = [name for name in args.rows if name != "gate"]
    if not groups:
        return
    try:
        from fbt_megatron.common import platform

        platform.init_distributed()  # a one-process NCCL (CPU: gloo) group, megatron's parallel state, seeds
        machine = probe()
    except Exception as e:  # noqa: BLE001 - megatron-core missing or broken: every group says so
        report.fail("start: the megatron-core parallel state", one_line(e)[:200], "starts")
        for name in groups:
            report.skip(GROUPS[name].TITLE, "the platform did not start")
        return
    print(f"machine: {machine}")
    for name in groups:
        # TE reads it when a model's attention is built: deterministic where rows compare closely, as training runs elsewhere
        os.environ[ATTENTION] = "0" if GROUPS[name].EXACT else training_attention
        guarded(report, GROUPS[name].TITLE, GROUPS[name].run, Context(report, machine, args))


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.loan_summary:
        return loan.summarize(args.loan_summary)
    training_attention = exact_environment()
    quiet_library_warnings()
    report = CheckReport()
    run_rows(args, report, training_attention)
    print("\n" + report.checks_table(width=110) + "\n\n" + report.verdict())
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report.as_dict(), indent=1) + "\n")
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return report.exit_code()


if __name__ == "__main__":
    run_cli(main)
