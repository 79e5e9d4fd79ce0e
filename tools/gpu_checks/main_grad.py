"""N1: the weight gradients k passes leave in DDP's ``main_grad``, with gradient-accumulation fusion on
against off. Built from the project's own pieces, as a training step runs: ``trainer.build.build_model``
(the recipe's config, the TE spec, megatron-core DDP with fp32 ``main_grad`` buffers),
``PassAwareDDP.start_step`` and ``distributed.pipeline.forward_backward`` (megatron-core's schedule:
``set_is_first_microbatch`` on the first microbatch, ``no_sync`` and the DDP hooks, then
``fbt.multi_pass_loss`` per microbatch); ``tiny_cpu``'s model, FBT k = 3, 2 microbatches per step,
2 steps, the same weights in every run.

With the fusion TE's weight-gradient GEMM writes ``main_grad`` itself: it overwrites it when its
forward saw ``is_first_microbatch=True`` (TE module/linear.py ``accumulate = fuse and not
is_first_microbatch``). Only pass 1 sees True and its backward runs last, so without a fix it wipes
passes 2..k of microbatch 0 (BF16: the first step after a start; FP8: every step) — about a third of
those gradients. Without the fusion ``.grad`` is added into ``main_grad`` by DDP's hook, which never
overwrites. A correct fusion differs from it only in the rounding of each weight gradient (fp32
accumulation against a BF16 ``.grad`` added in fp32): far below BF16's own error. So each precision's
row passes when ‖main_grad(on) − main_grad(off)‖ / ‖main_grad(off)‖ is at most the BF16 noise, the
same measure between BF16 and FP32 runs without the fusion (both over every parameter together)."""

from __future__ import annotations

from typing import List, Optional

from gpu_checks.harness import Context, Grads, free, l2_error, make_batch, ratio

TITLE = "main_grad through DDP, fusion on vs off (N1)"
EXACT = True  # deterministic attention (TE): the rows compare closely
MICRO, MICROBATCHES, K, STEPS, VOCAB = 2, 2, 3, 2, 2048
RATIO = 1.0  # on-vs-off error / the BF16 noise
PRECISIONS = {"FP32": ["--bf16", "false"], "BF16": ["--bf16", "true"],
              "FP8 tensorwise": ["--bf16", "true", "--fp8", "hybrid", "--fp8-recipe", "tensorwise"]}


def recipe(precision: str, fusion: bool):
    from fbt_megatron.recipe import flags

    argv = ["--recipe", "recipes/tiny_cpu.yaml", "--micro-batch-size", MICRO, "--global-batch-size", MICRO * MICROBATCHES,
            "--use-distributed-optimizer", "false", "--overlap-grad-reduce", "false",
            "--gradient-accumulation-fusion", str(fusion).lower(), *PRECISIONS[precision]]
    return flags.parse([str(a) for a in argv], prog="gpu_check main_grad", description="")


def main_grads(precision: str, fusion: bool, weights: Optional[dict], batches: List[dict]):
    """The ``main_grad`` of every parameter after each of ``STEPS`` steps, and the weights used."""
    from fbt_megatron.distributed import pipeline
    from fbt_megatron.trainer.build import build_model

    r = recipe(precision, fusion)
    _, model, ddp = build_model(r, VOCAB)
    if weights is None:
        weights = {k: v.detach().float().clone() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    else:
        missing, unexpected = model.load_state_dict(weights, strict=False)
        if unexpected or [k for k in missing if not k.endswith("_extra_state")]:
            raise AssertionError(f"the runs' parameters differ: {(unexpected + missing)[:4]}")
    steps = []
    for _ in range(STEPS):
        ddp.start_step(K)
        pipeline.forward_backward(ddp, batches, K, seq_length=r.data.seq_length, micro_batch_size=MICRO)
        steps.append({n: p.main_grad.detach().float().clone() for n, p in model.named_parameters() if p.requires_grad})
    del ddp, model
    free()
    return steps, weights


def worst(steps: List[Grads], references: List[Grads]) -> float:
    return max(l2_error(g, ref) for g, ref in zip(steps, references))


def missing(ctx: Context) -> Optional[str]:
    """Why the row cannot run here, or None."""
    if not ctx.machine.te:
        return ctx.machine.why_no_te()
    from megatron.core.tensor_parallel import layers

    if not layers._grad_accum_fusion_available:
        return ("Apex's fused_weight_gradient_mlp_cuda is absent: megatron-core's own linears (the headwise gate, the "
                "output layer) cannot fuse, so training runs without the fusion and N1 cannot occur")
    return None


def run(ctx: Context) -> None:
    report, label = ctx.report, ctx.machine.label
    names = {p: f"main_grad {p}, k={K}, {MICROBATCHES} microbatches: fusion on vs off{label}" for p in PRECISIONS if p != "FP32"}
    criterion = f"<= {RATIO} x the BF16 noise (L2, all parameters)"
    why = missing(ctx)
    if why:
        for name in names.values():
            report.skip(name, why, criterion)
        return
    print(f"\n== main_grad through megatron-core DDP: tiny_cpu, k={K}, {MICROBATCHES} microbatches x {MICRO}, {STEPS} steps")
    batches = [make_batch(VOCAB, recipe("FP32", False).data.seq_length, MICRO, seed=m) for m in range(MICROBATCHES)]
    fp32, weights = main_grads("FP32", False, None, batches)
    off = {"BF16": main_grads("BF16", False, weights, batches)[0]}
    noise = worst(off["BF16"], fp32)
    report.info(f"main_grad BF16 vs FP32, fusion off (the BF16 noise){label}", f"{noise:.1e}")
    fp8_why = None if ctx.machine.te_double else ctx.machine.fp8_missing()
    for precision, name in names.items():
        if precision.startswith("FP8") and fp8_why:
            report.skip(name, fp8_why, criterion)
            continue
        reference = off.get(precision) or main_grads(precision, False, weights, batches)[0]
        error = worst(main_grads(precision, True, weights, batches)[0], reference)
        print(f"{precision}: main_grad fusion on vs off {error:.1e}, BF16 noise {noise:.1e}")
        report.check(name, f"{error:.1e} / {noise:.1e} = {ratio(error, noise):.2f}", ratio(error, noise) <= RATIO, criterion)
