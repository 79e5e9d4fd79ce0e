"""fbt-1b in BF16 on this GPU: tokens/s, MFU and peak memory for k = 1, 2, 3 and k = 3 with
``recompute_passes`` (figures: INFO), and one criterion — the planner's peak-memory estimate
(``fbt_megatron/launch/plan/memory.py``) within 20% of the allocator's peak at k = 3. Out of memory is
a FAIL: the planner says fbt-1b at micro batch 1 fits one GPU."""

from __future__ import annotations

import os
import statistics
import time

import torch

from gpu_checks.harness import BF16, Context, build, free, make_batch, train_step
from gpu_checks.machine import NO_GPU

TITLE = "fbt-1b performance"
EXACT = False  # attention as training runs it (TE's non-deterministic backward allowed)
SETUPS = (("k=1", 1, False), ("k=2", 2, False), ("k=3", 3, False), ("k=3 recompute_passes", 3, True))
PLANNER_TOLERANCE = 0.2


def peak_flops():
    """Dense BF16 peak FLOP/s of this GPU (the planner's table, fbt_megatron/common/gpus.py); FBT_PEAK_FLOPS overrides."""
    from fbt_megatron.common.gpus import from_device_name

    if os.environ.get("FBT_PEAK_FLOPS"):
        return float(os.environ["FBT_PEAK_FLOPS"]), "FBT_PEAK_FLOPS"
    name = torch.cuda.get_device_name()
    gpu = from_device_name(name)
    return (gpu.bf16_tflops * 1e12, gpu.name) if gpu else (None, name)


def planned_memory(model, micro_batch: int, seq: int, k: int, te: bool) -> float:
    """The planner's peak for this bare-model step, GiB: BF16 weights and their BF16 .grad (no DDP
    buffer, no optimizer here) plus the activations."""
    from fbt_megatron.launch.plan import memory

    params = sum(p.numel() for p in model.parameters())
    layout = memory.Layout(micro_batch_size=micro_batch, seq_length=seq, half=True, transformer_engine=te)
    stage = memory.Stage(rank=0, layers=model.config.num_layers, params=params, matrix_params=0, matrix_rows=0, first=True, last=True)
    return (4 * params + memory.activations(model.config, layout, stage, k).total) / 2**30


def timed(model, batch: dict, k: int, steps: int) -> float:
    """The median step time after 2 warm-up steps."""
    for _ in range(2):
        train_step(model, batch, k)
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        train_step(model, batch, k)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def one_setup(ctx: Context, model, batch: dict, label: str, k: int) -> None:
    """One setup's figures (and at k = 3 the planner's row); out of memory or any failure is its FAIL row."""
    from fbt_megatron.launch.rehearsal.report import one_line
    from fbt_megatron.model.flops import flops_per_token

    report, args, c = ctx.report, ctx.args, model.config
    seq, micro = args.perf_seq_length, args.perf_micro_batch_size
    planner = "planner memory estimate, fbt-1b BF16 k=3"
    model.zero_grad(set_to_none=True)
    free()
    torch.cuda.reset_peak_memory_stats()
    try:
        t = timed(model, batch, k, args.perf_steps)
    except Exception as e:  # noqa: BLE001 - out of memory included: the planner says it fits
        report.fail(f"fbt-1b BF16 {label}", one_line(e)[:200], "runs (the planner says it fits)")
        model.zero_grad(set_to_none=True)
        if label == "k=3":
            report.skip(planner, f"k=3 did not run ({one_line(e)[:80]})")
        return
    mem = torch.cuda.max_memory_allocated() / 2**30
    peak, _ = peak_flops()
    mfu = f"MFU {micro * seq * flops_per_token(c, k) / t / peak:.1%}" if peak else "MFU n/a (set FBT_PEAK_FLOPS)"
    report.info(f"fbt-1b BF16 {label}", f"{micro * seq / t:,.0f} tok/s, {mfu}, {t * 1e3:.0f} ms/step, {mem:.1f} GiB")
    if label == "k=3":
        planned = planned_memory(model, micro, seq, k, ctx.machine.real_te)
        report.check(planner, f"{planned:.1f} vs {mem:.1f} GiB measured ({planned / mem:.2f}x)",
                     abs(planned / mem - 1) <= PLANNER_TOLERANCE, f"within {PLANNER_TOLERANCE:.0%}")


def run(ctx: Context) -> None:
    if not ctx.machine.cuda:
        ctx.report.skip("fbt-1b BF16: tokens/s, MFU, peak memory; the planner memory", NO_GPU)
        return
    seq, micro = ctx.args.perf_seq_length, ctx.args.perf_micro_batch_size
    print(f"\n== fbt-1b, BF16, {'TE' if ctx.machine.real_te else 'local spec'}, micro batch {micro} x seq {seq}; "
          f"peak FLOP/s from {peak_flops()[1]}")
    model = build(ctx.machine.real_te, "fbt-1b", seq_length=seq, **BF16)
    batch = make_batch(model.config.vocab_size, seq, micro)
    for label, k, recompute in SETUPS:
        model.config.recompute_passes = recompute
        one_setup(ctx, model, batch, label, k)
    del model, batch
    free()
