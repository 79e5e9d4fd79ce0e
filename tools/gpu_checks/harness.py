"""What the rows share: the context they run in, the models they build (``FBTModel`` as the trainer
builds it, on the platform's device), batches, one k-pass step's losses and gradients, copying the
local spec's weights into the TE spec, and the two measures of a gradient difference.

Two measures, each where it is sound: ``max_norm_error`` (the worst tensor's max |g − g_ref| / max
|g_ref|) for comparisons that should agree to summation order (FP32 against FP32, recompute on
against off), where one wrong tensor must show; ``l2_error`` (‖g − g_ref‖ / ‖g_ref‖ over every
gradient together) for comparisons held to a ratio against another path's error, where a worst-of-60
maximum would be too noisy to divide by."""

from __future__ import annotations

import argparse
import gc
import math
import traceback
from dataclasses import dataclass
from typing import Callable, Dict, List, Tuple

import torch

from fbt_megatron.launch.rehearsal.report import CheckReport, one_line
from gpu_checks.machine import Machine

KS = (1, 2, 3)
# the equivalence model: small, FP8-friendly (every TE GEMM dimension a multiple of 16), sliding window used
SMALL = dict(num_layers=4, hidden_size=256, ffn_hidden_size=768, num_attention_heads=4, num_query_groups=2,
             kv_channels=64, vocab_size=4096, seq_length=256, sliding_window=64, full_attention_every=2)
BF16 = dict(bf16=True, params_dtype=torch.bfloat16)
Grads = Dict[str, torch.Tensor]


@dataclass
class Context:
    report: CheckReport
    machine: Machine
    args: argparse.Namespace


def guarded(report: CheckReport, name: str, fn: Callable, *args) -> None:
    """Run a group of rows; an exception (out of memory included) is a FAIL row with its traceback
    printed, and the next group still runs."""
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 - every failure is a row
        traceback.print_exc()
        free()
        report.fail(name, one_line(e)[:300], "runs")


def device() -> torch.device:
    from fbt_megatron.common import platform

    return platform.device()


def build(te: bool, preset: str = "tiny", **fields):
    """FBTModel on the platform's device as the trainer builds it (config dtype, model .to(dtype)), in train mode."""
    from fbt_megatron.model.config import make_config
    from fbt_megatron.model.fbt_model import FBTModel, fbt_model_spec

    config = make_config(preset, **fields)
    model = FBTModel(config, spec=fbt_model_spec(config, use_transformer_engine=te))
    return model.to(config.params_dtype).to(device()).train()  # plain torch modules (fusion, norms) start on CPU


def make_batch(vocab: int, seq: int, batch: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (batch, seq + 1), generator=g).to(device())
    mask = torch.ones(batch, seq, device=device())
    mask[0, : seq // 8] = 0
    return dict(tokens=x[:, :-1].contiguous(), labels=x[:, 1:].contiguous(), loss_mask=mask,
                seeds=list(range(100 + 10 * seed, 100 + 10 * seed + batch)))


def train_step(model, batch: dict, k: int):
    """Forward + backward of the k-pass step (``fbt.multi_pass_loss``), gradients left in ``.grad``."""
    from fbt_megatron.model.fbt import multi_pass_loss

    model.zero_grad(set_to_none=True)
    model.set_is_first_microbatch()  # FP8: re-quantize weights once per step, as megatron's schedules do
    out = multi_pass_loss(model, batch["tokens"], batch["labels"], batch["loss_mask"], k, batch["seeds"])
    out.loss.backward()
    return out


def losses_and_grads(model, batch: dict, k: int) -> Tuple[List[float], Grads]:
    out = train_step(model, batch, k)
    grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None and p.numel()}
    return [x.item() for x in out.pass_losses], grads


def per_k(model, batch: dict, reference: dict, label: str) -> dict:
    """Losses and gradients for k = 1..3 against ``reference`` (k → (losses, grads)), each k printed:
    the worst loss difference and both gradient measures, over k."""
    loss, worst, l2 = 0.0, (0.0, "-"), 0.0
    for k in KS:
        losses, grads = losses_and_grads(model, batch, k)
        k_loss = max(rel(a, b) for a, b in zip(losses, reference[k][0]))
        k_worst, k_l2 = max_norm_error(grads, reference[k][1]), l2_error(grads, reference[k][1])
        print(f"{label} k={k}: losses {fmt(losses)} (reference {fmt(reference[k][0])}, {k_loss:.1e}); gradients: "
              f"worst tensor {k_worst[0]:.1e} ({k_worst[1]}), all {k_l2:.1e}")
        loss, worst, l2 = max(loss, k_loss), max(worst, k_worst), max(l2, k_l2)
    return dict(loss=loss, worst=worst, l2=l2)


def local_weights(fields: dict, seed: int = 0) -> dict:
    """The weights of a local-spec FP32 model of ``fields`` (norm weights drawn in [0.5, 1.5], so a norm
    that is not copied or not applied shows), TE's extra state left out: every row's common start."""
    from fbt_megatron.common import platform

    platform.seed(1234 + seed)
    model = build(False, **fields)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    del model
    free()
    return weights


def copy_weights(weights: dict, model) -> int:
    """Load the local spec's weights into ``model``; names must match except TE's _extra_state (FP8
    metadata) and the MLP's input norm, a parameter of TE's fused norm + linear (``FUSED_NORM_KEYS``).
    Returns the number of parameter tensors, every one checked to equal its source."""
    from fbt_megatron.model.fbt_model import FUSED_NORM_KEYS

    if any(n.endswith("mlp.linear_fc1.layer_norm_weight") for n, _ in model.named_parameters()):
        for te_name, local_name in FUSED_NORM_KEYS.items():
            weights = {k.replace(local_name, te_name): v for k, v in weights.items()}
    empty = {n for n, p in model.named_parameters() if not p.numel()}  # bias=False in some TE versions
    missing, unexpected = model.load_state_dict(weights, strict=False)
    bad = sorted(unexpected) + [k for k in missing if not k.endswith("_extra_state") and k not in empty]
    if bad:
        raise AssertionError(f"parameter names differ between the local and TE specs: {bad[:6]}")
    params = {n: p for n, p in model.named_parameters() if n not in empty}
    not_copied = [n for n, p in params.items() if n not in weights or not torch.equal(p.detach(), weights[n].to(p.device, p.dtype))]
    if not_copied:
        raise AssertionError(f"parameters not copied: {not_copied[:6]}")
    return len(params)


def max_norm_error(grads: Grads, ref: Grads) -> Tuple[float, str]:
    """The worst parameter tensor: max |g − g_ref| / max |g_ref| (inf where one side has no gradient)."""
    worst, name = 0.0, "-"
    for n in sorted(set(ref) | set(grads)):
        if n not in ref or n not in grads:
            return math.inf, f"{n} (gradient on one side only)"
        scale, d = ref[n].abs().max().item(), (grads[n] - ref[n]).abs().max().item()
        r = d / scale if scale > 0 else (0.0 if d == 0 else math.inf)
        if r > worst:
            worst, name = r, n
    return worst, name


def l2_error(grads: Grads, ref: Grads) -> float:
    """‖g − g_ref‖ / ‖g_ref‖ over every gradient together (inf where one side has no gradient)."""
    if set(grads) != set(ref):
        return math.inf
    diff = sum(float((grads[n] - ref[n]).double().pow(2).sum()) for n in ref)
    norm = sum(float(ref[n].double().pow(2).sum()) for n in ref)
    return math.sqrt(diff / norm) if norm > 0 else (0.0 if diff == 0 else math.inf)


def ratio(error: float, reference: float) -> float:
    return error / reference if reference > 0 else (0.0 if error == 0 else math.inf)


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def fmt(losses: List[float]) -> str:
    return "/".join(f"{x:.6f}" for x in losses)


def free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
