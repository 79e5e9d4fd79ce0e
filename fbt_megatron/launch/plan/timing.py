"""The wall time of a plan on GPUs, and the MFU the training log would show for it.

Three terms, in seconds over the run:

* **model FLOPs** (``model/flops.py``, the formula the training log's MFU uses) at the stated MFU of
  the GPUs' dense BF16 peak;
* **Newton–Schulz**: NorMuon orthogonalises its matrices in FP32 (``optimizers/normuon.py``:
  ``dtype=float32``), on the GPUs' FP32 peak (CUDA cores; ``device.py``), not their BF16 tensor cores,
  at the same share of that peak as the MFU. Each matrix has one owner: under the distributed
  optimizer the DP×CP rank megatron-core's layer-wise optimizer deals it to
  (``memory.layer_wise_parts``), within the TP group the rank its round gives it (``duplicated``
  mode: the i-th of each round of TP matrices; ``blockwise``: every TP rank its own shards). The
  step waits for the busiest GPU, so that GPU's FLOPs count, not the mean. (NVIDIA's PyTorch images
  set ``TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1``: there these GEMMs run on TF32 tensor cores, several
  times faster; the plan prices the FP32 the code asks for.)
* **local attention core** (packed SFT rows, ``memory.Layout.packed_rows``): megatron's unfused core
  computes every s × s score, and its cast-mask-softmax-cast chain is bound by memory, not FLOPs.
  Counted per score element from ``dot_product_attention.py`` and ``fused_softmax.py``
  (``forward_torch_softmax``): forward 33 bytes (the scores written in bf16 2, ``.float()`` 2 + 4,
  the mask 4 + 1 + 4, softmax 4 + 4, the cast back 4 + 2, read by the second GEMM 2), backward 41
  (the probabilities' gradient written and the probabilities read 2 + 2, the cast's 2 + 4, softmax's
  4 + 4 + 4, the mask's 4 + 1 + 4, the cast's 4 + 2, read by the first GEMM's two gradients 2 + 2),
  and 33 again for every forward a recompute runs: at the GPU's memory bandwidth (``device.py``, the
  datasheet's: a lower bound of this time). The dense GEMMs' FLOPs beyond the model's (which count
  the keys a query attends to, not the s × s computed) are added at the MFU.

The training log's MFU is the model FLOPs over the whole wall time. Megatron-LM's formula
(``megatron_flops_per_token``) counts every layer as full causal attention (s/2 keys per query, no
windows), so the same run reads higher by it: the plan prints both.
"""

from __future__ import annotations

from typing import Dict, List

from fbt_megatron.launch.plan import memory
from fbt_megatron.launch.plan.device import DEVICES
from fbt_megatron.model import flops as flops_lib

FORWARD_BYTES, BACKWARD_BYTES = 33, 41  # per score element of the local core's chain (module docstring)


def newton_schulz_flops(rows: int, cols: int, steps: int) -> float:
    """One matrix's Newton–Schulz FLOPs: ``steps`` quintic iterations, 4m²n + 2m³ each (m ≤ n), the
    per-matrix count of ``flops.normuon_flops_per_step``."""
    m, n = min(rows, cols), max(rows, cols)
    return steps * (4 * m * m * n + 2 * m**3)


def busiest_newton_schulz(stages: List[memory.Stage], layout: memory.Layout, blockwise: bool) -> float:
    """NorMuon's Newton–Schulz FLOPs per step on the GPU that runs the most (module docstring)."""
    busiest = 0.0
    for stage in stages:
        parts = memory.layer_wise_parts(stage, layout) if layout.layer_wise else [stage.parameters]
        for part in parts:
            owned = [q.newton_schulz for q in part if q.matrix]
            busiest = max(busiest, *([sum(owned)] if blockwise else [sum(owned[i::layout.tp]) for i in range(layout.tp)]))
    return busiest


def recomputed_forwards(config, passes: int) -> int:
    """Forwards a step of ``passes`` passes runs again in backward: the first k − 1 passes with
    ``recompute_passes``, every pass under full recompute."""
    if config.recompute_granularity == "full":
        return passes
    return passes - 1 if config.recompute_passes and passes > 1 else 0


def dense_score_flops(config, seq_length: int) -> float:
    """FLOPs per token and pass (forward and backward) the local core's dense QKᵀ and AV compute
    beyond the model FLOPs' attended keys."""
    missed = sum(seq_length - flops_lib.mean_context(seq_length, w) for w in flops_lib.layer_windows(config))
    return 3 * 4 * config.num_attention_heads * config.kv_channels * missed


def megatron_flops_per_token(config, seq_length: int) -> float:
    """Megatron-LM's ``num_floating_point_operations`` per token of one forward and backward
    (megatron/training/training.py, ``transformer_flops``, at d98e8a6): dense layers of QKV (GQA)
    and output projections, an MLP of 3 (gated) or 2 GEMMs, the core's 6·h·d·s per layer (causal:
    s/2 keys for QKᵀ and for AV, in every layer), the logits 6·D·V; no MTP, no MoE."""
    c = config
    d, h, g, hidden = c.kv_channels, c.num_attention_heads, c.num_query_groups or c.num_attention_heads, c.hidden_size
    attention = 6 * (hidden * (h * d + 2 * g * d) + h * d * hidden) + 6 * h * d * seq_length
    mlp = 6 * hidden * c.ffn_hidden_size * (3 if c.gated_linear_unit else 2)
    return c.num_layers * (attention + mlp) + 6 * hidden * c.vocab_size


def wall_time(plan) -> Dict[str, float]:
    """Seconds of the run per term (module docstring) of a ``planner.Plan``; {} without a peak."""
    if plan.peak_tflops is None:
        return {}
    lay, iters = plan.layout, plan.recipe.training.train_iters
    rate = plan.world_size * plan.peak_tflops * 1e12 * plan.mfu
    terms = {"model FLOPs": plan.flops_expected * plan.tokens / rate}
    device = DEVICES.get(plan.gpu)
    if plan.newton_schulz:
        fp32 = device.fp32_tflops if device else plan.peak_tflops  # unknown GPU: at the model's peak
        terms["Newton–Schulz"] = iters * plan.newton_schulz / (fp32 * 1e12 * plan.mfu)
    if lay.local_core and device is not None:
        elements = plan.stages[0].layers * lay.microbatches * memory.score_elements(plan.config, lay)
        traffic = sum(n * elements * (FORWARD_BYTES * (k + recomputed_forwards(plan.config, k)) + BACKWARD_BYTES * k)
                      for k, n in plan.steps_per_k.items())
        passes = sum(k * n for k, n in plan.steps_per_k.items()) / sum(plan.steps_per_k.values())
        dense = passes * plan.tokens * dense_score_flops(plan.config, lay.seq_length // lay.cp) / rate
        terms["local attention core"] = traffic / (device.bandwidth_tbs * 1e12) + dense
    return terms
