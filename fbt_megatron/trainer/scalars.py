"""A logged record's scalars under their TensorBoard tags, the same for TensorBoard (``metrics``) and
Weights & Biases (``callbacks.wandb_writer``): Megatron-LM's names where it has the quantity (its
dashboards and scripts work unchanged), ``fbt/...`` for what only FBT has. ``metrics.jsonl`` keeps
the record's keys."""

from __future__ import annotations

import math

TAGS = {
    "loss": "lm loss",
    "lr": "learning-rate",
    "grad_norm": "grad-norm",
    "iteration_time": "iteration-time",
    "tokens_per_s": "tokens-per-sec",
    "tokens": "consumed-tokens",
    "k": "fbt/passes",
    "compute_tokens": "fbt/compute-tokens",
    "model_tflops_per_gpu": "throughput",  # Megatron-LM's name for model TFLOP/s per GPU
    "tokens_per_s_per_gpu": "tokens-per-sec-per-gpu",
    "mfu": "mfu",
    "phase": "fbt/pass-phase",
    "z_loss": "z-loss",
    "skipped_steps": "skipped-steps",
    "mem_allocated_bytes": "mem-allocated-bytes",  # GPU (Megatron-LM's --log-memory-to-tensorboard)
    "mem_reserved_bytes": "mem-reserved-bytes",
    "mem_max_allocated_bytes": "mem-max-allocated-bytes",
    "rss_bytes": "mem-rss-bytes",  # CPU: the resident set, and its peak
    "max_rss_bytes": "mem-max-rss-bytes",  # steps whose update was skipped (NaN/Inf gradient norm)
}


def tensorboard_scalars(record: dict) -> dict:
    """A logged record as TensorBoard tag → value."""
    out = {}
    for key, value in record.items():
        if key in ("step", "time", "time_utc") or value is None:
            continue
        if key == "pass_losses":  # passes 1..k
            out.update({f"fbt/lm loss pass{j}": v for j, v in enumerate(value, start=1)})
        elif key == "state_deltas":  # ‖s^{(j)} − s^{(j−1)}‖ for passes 2..k
            out.update({f"fbt/state delta pass{j}": v for j, v in enumerate(value, start=2)})
        elif key in ("param_norms", "grad_norms"):  # per layer (norms)
            out.update({f"{'params-norm' if key == 'param_norms' else 'grad-norm'}/{name}": v for name, v in value.items()})
        elif key == "stragglers":  # the ranks named slow at this step (callbacks.stragglers): their ratio to the median
            out.update({f"stragglers/rank{s['rank']}": s["ratio"] for s in value})
        elif key == "k_share":  # the share of steps so far that ran k passes
            out.update({f"fbt/pass-share k{k}": v for k, v in value.items()})
        elif key.startswith("valid_loss_fused"):
            out[f"fbt/lm loss validation fused{key.removeprefix('valid_loss_fused')}"] = value
            if key == "valid_loss_fused0":  # no fused pass: the plain model's validation loss
                out["lm loss validation"], out["lm loss validation ppl"] = value, math.exp(min(value, 20.0))
        else:
            out[TAGS.get(key, key)] = value
    return out
