"""The attention kernels that train the model, at fbt-1b's head geometry and window (``GEOMETRY``: 16
query / 8 KV heads of 96, window 2048 in 5 of 6 layers), seq 4096, k = 2, BF16.

Each BF16 path against FP32 local, never against the other BF16 path (N5): local BF16 (megatron-core's
unfused core) gives the noise, TE BF16 (FlashAttention or FusedAttention) passes at most 1.5 times
it. The backend is read on a window layer (layer 1, from TE's record of its selection right after
that layer's call): TE keeps one global record of the last selection, and the last layer called is
the global one. The control, TE without the window against the same windowed FP32 reference, must
be more than 10 times the noise away: the comparison can see a wrong window."""

from __future__ import annotations

import importlib
from typing import Dict

import torch

from gpu_checks.harness import BF16, Context, build, copy_weights, free, l2_error, local_weights, losses_and_grads, \
    make_batch, ratio

TITLE = "attention kernels at fbt-1b's heads and window"
EXACT = False  # attention as training runs it (TE's non-deterministic backward allowed)
GEOMETRY = dict(num_layers=6, hidden_size=1536, ffn_hidden_size=6656, num_attention_heads=16, num_query_groups=8,
                kv_channels=96, vocab_size=4096, seq_length=4096, sliding_window=2048, full_attention_every=6)
TOL = dict(ratio=1.5, control=10.0)
ROWS = ("attention kernels: TE BF16 vs FP32 local, over local BF16 vs FP32", "attention kernels: the TE backend on a window layer",
        "attention kernels control: TE without the window vs FP32 local")
FUSED = ("FlashAttention", "FusedAttention")


def backend_record() -> Dict:
    """TE's module-level record of its last attention backend selection (TE 2.x
    ``dot_product_attention._attention_backends``), or {} where this TE keeps none."""
    try:
        dpa = importlib.import_module("transformer_engine.pytorch.attention.dot_product_attention.dot_product_attention")
    except ImportError:
        return {}
    return getattr(dpa, "_attention_backends", {})


def window_layer_backend(model, seen: list):
    """A hook reading TE's record right after layer 1's attention ran (a window layer)."""
    def read(*_):
        chosen = backend_record()
        names = [n for n, key in (("FlashAttention", "use_flash_attention"), ("FusedAttention", "use_fused_attention"),
                                  ("UnfusedDotProductAttention", "use_unfused_attention")) if chosen.get(key)]
        window = getattr(chosen.get("attention_params"), "window_size", None)
        seen.append((names[0] if names else "unknown (no record in this TE)", window))
    return model.decoder.layers[0].self_attention.core_attention.register_forward_hook(read)


def te_run(fields: dict, weights: dict, batch: dict, reference: dict):
    """(L2 error against ``reference``, the backend on layer 1 and its window) of TE BF16 with ``fields``."""
    model = build(True, **fields, **BF16)
    copy_weights(weights, model)
    seen: list = []
    hook = window_layer_backend(model, seen)
    losses, grads = losses_and_grads(model, batch, 2)
    hook.remove()
    error = l2_error(grads, reference)
    print(f"TE BF16 window {fields['sliding_window']}: losses {losses}; all gradients vs FP32 local {error:.1e}; layer 1: {seen[-1]}")
    del model, grads
    free()
    return error, seen[-1]


def run(ctx: Context) -> None:
    report = ctx.report
    if not ctx.machine.real_te:
        for name in ROWS:
            report.skip(name, ctx.machine.why_no_te())
        return
    torch.backends.cuda.matmul.allow_tf32 = False
    fields = dict(GEOMETRY, seq_length=ctx.args.kernel_seq_length)
    print(f"\n== attention kernels: 16/8 heads of 96, window 2048 (global every 6), seq {fields['seq_length']}, k=2")
    batch = make_batch(fields["vocab_size"], fields["seq_length"], 1)
    weights = local_weights(fields)
    grads = {}
    for name, extra in (("FP32 local", {}), ("BF16 local", BF16)):
        model = build(False, **fields, **extra)
        copy_weights(weights, model)
        grads[name] = losses_and_grads(model, batch, 2)[1]
        del model
        free()
    noise = l2_error(grads["BF16 local"], grads["FP32 local"])
    report.info("attention kernels: local BF16 vs FP32 local (the noise)", f"{noise:.1e}")
    te, (backend, window) = te_run(fields, weights, batch, grads["FP32 local"])
    report.check(ROWS[0], f"{te:.1e} / {noise:.1e} = {ratio(te, noise):.2f}", ratio(te, noise) <= TOL["ratio"],
                 f"<= {TOL['ratio']} (L2, all gradients)")
    report.check(ROWS[1], f"{backend}, window {window}", backend in FUSED and window is not None and window[0] > 0,
                 "FlashAttention or FusedAttention, windowed")
    control, _ = te_run(dict(fields, sliding_window=None), weights, batch, grads["FP32 local"])
    report.check(ROWS[2], f"{control:.1e} = {ratio(control, noise):.1f} x the noise", ratio(control, noise) > TOL["control"],
                 f"> {TOL['control']:.0f} x the noise (sees the window)")
