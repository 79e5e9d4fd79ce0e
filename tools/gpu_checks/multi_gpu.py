"""With 2+ GPUs, through the training entry point (NCCL) against 1 GPU, ``recipes/tiny_cpu.yaml``, 12
steps from one seed checkpoint, k = 1..3: TP 2 + SP in FP32 with Adam and with NorMuon (its owner
gather and scatter), every per-pass loss within 1e-4 (gloo's TP on a CPU: 1e-7); CP 2 in BF16 (TE has
no FP32 attention under CP) against 1 GPU in BF16 within 1e-2, with a flash/fused backend and the CP
communication type in the log. A run that fails is a FAIL; on 1 GPU each row is a SKIP."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

from gpu_checks.harness import Context, fmt, rel
from gpu_checks.machine import NO_GPU
from fbt_megatron.common.processes import outside_group

TITLE = "multi-GPU vs 1 GPU (entry point, NCCL)"
EXACT = False  # attention as training runs it (TE's non-deterministic backward allowed)
REPO = Path(__file__).resolve().parents[2]
STEPS = 12
SP = ("--tensor-model-parallel-size", 2, "--sequence-parallel", "true")
# name: (flags, the 1-GPU reference's flags, tolerance)
LAYOUTS = {
    "TP=2+SP": (SP, [], 1e-4),
    "TP=2+SP NorMuon": ([*SP, "--optimizer", "normuon"], ["--optimizer", "normuon"], 1e-4),
    "CP=2 BF16": (["--context-parallel-size", 2, "--bf16", "true"], ["--bf16", "true"], 1e-2),
}


def launch(cmd: list, log: Path, timeout: int, **extra_env) -> None:
    print("$ " + " ".join(shlex.quote(str(x)) for x in cmd), flush=True)
    env = outside_group()
    env.update(CUDA_DEVICE_MAX_CONNECTIONS="1", PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
               **extra_env)
    with open(log, "w") as f:
        code = subprocess.run([str(x) for x in cmd], cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
    if code:
        raise RuntimeError(f"exit code {code}; see {log}")


def losses(folder: Path) -> dict:
    from fbt_megatron.trainer.callbacks.metrics_writer import read_metrics

    return {r["step"]: r for r in read_metrics(folder)}


def compare(ctx: Context, name: str, reference: dict, folder: Path, tolerance: float) -> None:
    check, criterion = f"{name} vs 1 GPU: per-pass losses, {STEPS} steps", f"< {tolerance:.0e} relative"
    got = losses(folder)
    if sorted(reference) != sorted(got) or any(reference[s]["k"] != got[s]["k"] for s in reference):
        ctx.report.fail(check, "logged steps or k differ", criterion)
        return
    worst = 0.0
    for step in sorted(reference):
        diffs = [rel(x, y) for x, y in zip(got[step]["pass_losses"], reference[step]["pass_losses"])]
        worst = max([worst, *diffs])
        print(f"step {step:>3} k={reference[step]['k']}: 1 GPU {fmt(reference[step]['pass_losses'])} | {name} "
              f"{fmt(got[step]['pass_losses'])} | rel {max(diffs):.1e}")
    ctx.report.check(check, f"{worst:.1e}", worst < tolerance, criterion)
    if name.startswith("CP"):  # the type chosen for windowed layers (banner) and a flash/fused backend (TE's log)
        log = folder.with_suffix(".log").read_text()
        comm = "over a2a" in log or "over all_gather" in log
        fused = "Running with FusedAttention" in log or "Running with FlashAttention" in log
        ctx.report.check(f"{name}: TE attention backend and CP communication type", f"fused/flash {fused}, a2a/all_gather {comm}",
                         fused and comm, "both in the log")


def why_not(ctx: Context, name: str) -> Optional[str]:
    """Why layout ``name`` cannot run here, or None."""
    if not ctx.machine.cuda:
        return NO_GPU
    if ctx.machine.gpus < 2:
        return f"needs 2 GPUs (this machine has {ctx.machine.gpus})"
    if name.startswith("CP") and not ctx.machine.real_te:
        return "context parallelism " + ctx.machine.why_no_te()
    return None


def run(ctx: Context) -> None:
    runnable = {}
    for name, layout in LAYOUTS.items():
        why = why_not(ctx, name)
        if why:
            ctx.report.skip(f"{name} vs 1 GPU (entry point, NCCL)", why)
        else:
            runnable[name] = layout
    if not runnable:
        return
    ctx.args.workdir.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="gpu_check-", dir=ctx.args.workdir))
    print(f"\n== {', '.join(runnable)} vs 1 GPU through fbt_megatron.train ({STEPS} steps, one seed checkpoint); in {workdir}")
    seed, recipe = workdir / "seed", ["--recipe", "recipes/tiny_cpu.yaml", "--tensorboard", "false"]
    train = [*recipe, "--load", seed, "--train-iters", STEPS, "--lr-warmup-iters", 2, "--log-interval", 1, "--eval-iters", 0,
             "--pass-phases", "[{start: 0.0, mixture: {1: 0.4, 2: 0.3, 3: 0.3}}]", "--override-opt-param-scheduler"]
    entry = [sys.executable, "-m", "fbt_megatron.train"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", 2, "-m", "fbt_megatron.train"]
    launch([*entry, *recipe, "--save", seed, "--create-seed-checkpoint", "true"], workdir / "seed.log", 900)
    references = {}
    for name, (flags, reference_flags, tolerance) in runnable.items():
        folder, key = workdir / name.replace("=", "").replace("+", "_").replace(" ", "_"), " ".join(map(str, reference_flags))
        try:
            if key not in references:
                one = workdir / f"gpu1_{len(references)}"
                launch([*entry, *train, *reference_flags, "--save", one], one.with_suffix(".log"), 600)
                references[key] = losses(one)
            launch([*torchrun, *train, *flags, "--save", folder], folder.with_suffix(".log"), 600,
                   NVTE_DEBUG="1", NVTE_DEBUG_LEVEL="2")  # TE names the attention backend it runs
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            ctx.report.fail(f"{name} vs 1 GPU: per-pass losses, {STEPS} steps", f"run failed: {e}"[:200], f"< {tolerance:.0e} relative")
            continue
        compare(ctx, name, references[key], folder, tolerance)
