"""Long context (``--offload-seq-length``, 32K; the loan's 16K), fbt-1b, BF16 TE, k = 3: what recompute
keeps (pass inputs, and layer inputs under full recompute), kept on the GPU against offloaded to pinned
host memory by ``offload_recompute_inputs`` (the CUDA branch of ``model/offload.py``, which no CPU
test reaches), and by DeepSpeed's ``cpu_checkpointing`` when installed. Criteria: the first step's
gradients within 2e-2 of the kept run's (only the recompute's order differs), and less peak memory;
step time is a figure. A run that fails or runs out of memory is a FAIL."""

from __future__ import annotations

import contextlib
import importlib
import time

import torch

from fbt_megatron.launch.rehearsal.report import one_line
from gpu_checks.harness import BF16, Context, build, free, make_batch, max_norm_error, train_step
from gpu_checks.machine import NO_GPU

TITLE = "offloading recompute inputs"
EXACT = False  # attention as training runs it (TE's non-deterministic backward allowed)
FULL_RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
SETUPS = {"recompute_passes + full": dict(recompute_passes=True, **FULL_RECOMPUTE), "full": FULL_RECOMPUTE}
GRAD_TOLERANCE = 2e-2


@contextlib.contextmanager
def deepspeed_checkpointing():
    """Recompute through DeepSpeed's checkpoint with ``cpu_checkpointing`` instead of megatron-core's.
    DeepSpeed empties every checkpoint input in place once copied to the host, which breaks inputs
    shared between checkpoints (megatron-core hands one RoPE table to every layer): each is cloned."""
    import deepspeed
    from megatron.core import parallel_state, tensor_parallel

    deepspeed.init_distributed(dist_backend="nccl")  # adopts the process group already initialised
    deepspeed.checkpointing.configure(parallel_state, partition_activations=False, checkpoint_in_cpu=True)
    megatron_checkpoint = tensor_parallel.checkpoint

    def checkpoint(function, distribute_saved_activations, *args):
        args = [a.clone() if torch.is_tensor(a) and a.is_floating_point() else a for a in args]
        return deepspeed.checkpointing.checkpoint(function, *args)

    tensor_parallel.checkpoint = checkpoint  # looked up at call time by megatron-core's block and fbt.run_pass
    try:
        yield
    finally:
        tensor_parallel.checkpoint = megatron_checkpoint


def candidates(ctx: Context) -> dict:
    """name → (model fields, context): kept, ours, and DeepSpeed's when it imports (else a SKIP row)."""
    found = {"kept": ({}, contextlib.nullcontext), "offload_recompute_inputs": (dict(offload_recompute_inputs=True), contextlib.nullcontext)}
    try:
        importlib.import_module("deepspeed")  # a broken install fails here
        found["DeepSpeed cpu_checkpointing"] = ({}, deepspeed_checkpointing)
    except Exception as e:  # noqa: BLE001
        ctx.report.skip("offload: DeepSpeed cpu_checkpointing", f"DeepSpeed does not import ({one_line(e)[:80]})")
    return found


def measure(ctx: Context, setup: dict, fields: dict, context) -> tuple:
    """(first step's gradients on the host, seconds per step, peak GiB) of one candidate."""
    from fbt_megatron.common import platform

    seq, steps = ctx.args.offload_seq_length, ctx.args.offload_steps
    platform.seed(1234)  # the same weights for every candidate
    model = build(True, "fbt-1b", seq_length=seq, **fields, **setup, **BF16)
    batch = make_batch(model.config.vocab_size, seq, 1)
    torch.cuda.reset_peak_memory_stats()
    try:
        with context():
            train_step(model, batch, 3)  # also the warm-up
            grads = {n: p.grad.detach().float().cpu() for n, p in model.named_parameters() if p.grad is not None}
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(steps):
                train_step(model, batch, 3)
            torch.cuda.synchronize()
        return grads, (time.perf_counter() - start) / steps, torch.cuda.max_memory_allocated() / 2**30
    finally:
        del model, batch
        free()


def one_setup(ctx: Context, name: str, setup: dict, found: dict) -> None:
    report, kept = ctx.report, None
    for candidate, (fields, context) in found.items():
        label = f"offload, {name}, {candidate}"
        try:
            grads, t, mem = measure(ctx, setup, fields, context)
        except Exception as e:  # noqa: BLE001 - out of memory included
            report.fail(f"{label}: runs", one_line(e)[:200], "runs")
            if kept is None:
                report.skip(f"offload, {name}: the other candidates", "nothing to compare with: the kept run failed")
                return
            continue
        print(f"{label}: {t * 1e3:.0f} ms/step, peak {mem:.1f} GiB")
        if kept is None:
            kept = grads, t, mem
            report.info(f"{label}: step time, peak memory", f"{t * 1e3:.0f} ms, {mem:.1f} GiB")
            continue
        diff, where = max_norm_error(grads, kept[0])
        report.check(f"{label}: gradients vs kept", f"{diff:.1e} ({where})"[:80], diff < GRAD_TOLERANCE,
                     f"< {GRAD_TOLERANCE:.0e} (max-norm)")
        report.check(f"{label}: peak memory / kept", f"{mem:.1f} / {kept[2]:.1f} GiB = {mem / kept[2]:.2f}", mem < kept[2], "< 1")
        report.info(f"{label}: step time / kept", f"{t / kept[1]:.3f}")


def run(ctx: Context) -> None:
    if not ctx.machine.cuda or not ctx.machine.real_te:  # without TE, the local spec's s x s scores: 64 GiB per layer at 32K
        ctx.report.skip("offloading recompute inputs at long context", NO_GPU if not ctx.machine.cuda else ctx.machine.why_no_te())
        return
    print(f"\n== fbt-1b, BF16, TE, k=3, micro batch 1 x seq {ctx.args.offload_seq_length}: recompute inputs kept vs offloaded")
    found = candidates(ctx)
    for name, setup in SETUPS.items():
        one_setup(ctx, name, setup, found)
