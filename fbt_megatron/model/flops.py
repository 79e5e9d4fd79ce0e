"""Model FLOPs of training: the one formula the planner, the training logs (MFU) and gpu_check use.

Per token of a k-pass training step (multiply-add = 2 FLOPs; backward = 2 × forward, so a
forward+backward is 3 × forward):

    F(k) = 3 · [ k · (2·N + 2·V·D + 4·h·d_h·Σ_l c_l) + (k − 1) · 4·D² ]

* N: the weight-matrix parameters of the L layers: QKV D·(h + 2g)·d_h, output projection h·d_h·D,
  the headwise gate D·h, the MLP (2 if gated) · D·F + F·D (norms are not matmuls);
* 2·V·D: the logits (tied embedding); the embedding lookup costs nothing;
* 4·h·d_h·c_l: scores QKᵀ and the weighted sum AV of layer l, where c_l is the mean number of keys
  a query attends to: (s + 1)/2 for causal attention, mean_t min(t, W) with a sliding window W
  (layers with 1-based index divisible by ``full_attention_every`` are global), i.e. attention
  counted by what the window lets it see, not by the dense s × s an implementation may compute;
* 4·D²: the latent feedback fusion's two D × D matmuls (W_U, W_G), in every fused pass j ≥ 2.

These are *model* FLOPs: recomputation (``recompute_passes``, full recompute) repeats forward work
that is not counted, so MFU = model FLOPs / time / peak is comparable across recompute settings.
The optimizer step is not counted in MFU; the planner's wall time adds NorMuon's, the one optimizer
with matrix work (``normuon_flops_per_step``): Newton–Schulz's quintic iteration on an m × n matrix
(m ≤ n; pytorch-optimizer's ``zero_power_via_newton_schulz_5`` transposes to that) costs
X·Xᵀ 2m²n + A·A 2m³ + B·X 2m²n = 4m²n + 2m³ per step, 5 steps by default, once per matrix per step
(the owner scheme under TP, layer-wise ownership under the distributed optimizer; every data-parallel
replica repeats it without the latter).
"""

from __future__ import annotations

from typing import Dict


def mean_context(seq_length: int, window) -> float:
    """Keys a causal query attends to, averaged over the positions 1..s: (s+1)/2, or mean_t min(t, W)."""
    w = seq_length if window is None else min(window, seq_length)
    return (w * (w + 1) / 2 + (seq_length - w) * w) / seq_length


def layer_windows(config) -> list:
    """Each layer's attention window (None: global), 1-based rule of ``full_attention_every``."""
    every = config.full_attention_every
    return [None if config.sliding_window is None or (every and layer % every == 0) else config.sliding_window
            for layer in range(1, config.num_layers + 1)]


def layer_matrix_params(config) -> int:
    """N: weight-matrix parameters of all layers (what the token's GEMMs multiply by)."""
    c = config
    d, h, g = c.kv_channels, c.num_attention_heads, c.num_query_groups or c.num_attention_heads
    attention = c.hidden_size * (h + 2 * g) * d + h * d * c.hidden_size
    gate = c.hidden_size * h if c.headwise_attention_gate else 0
    mlp = (2 if c.gated_linear_unit else 1) * c.hidden_size * c.ffn_hidden_size + c.ffn_hidden_size * c.hidden_size
    return c.num_layers * (attention + gate + mlp)


def flops_per_token(config, passes: int, seq_length: int = None) -> float:
    """F(k): model FLOPs per token of a training step with ``passes`` passes (module docstring)."""
    c, s = config, seq_length or config.seq_length
    context = sum(mean_context(s, w) for w in layer_windows(c))
    per_pass = 2 * layer_matrix_params(c) + 2 * c.vocab_size * c.hidden_size + 4 * c.num_attention_heads * c.kv_channels * context
    fusion = 4 * c.hidden_size**2 if c.latent_feedback else 0
    return 3 * (passes * per_pass + (passes - 1) * fusion)


def expected_flops_per_token(config, steps_per_k: Dict[int, float], seq_length: int = None) -> float:
    """F averaged over a run's steps ({k: number of steps}, e.g. ``PassSchedule.expected_passes``)."""
    total = sum(steps_per_k.values())
    return sum(n * flops_per_token(config, k, seq_length) for k, n in steps_per_k.items()) / total


def normuon_matrices(config, split_qkv: bool = True) -> list:
    """(rows, columns) of each matrix NorMuon orthogonalises (``fbt_megatron.optimizers``): per layer
    Q, K and V over all query groups (or QKV whole), the output projection, the MLP's fc1 and fc2;
    the fusion's W_U and W_G. The headwise gate, norms and embeddings are Adam's."""
    c = config
    d, h, g, hidden = c.kv_channels, c.num_attention_heads, c.num_query_groups or c.num_attention_heads, c.hidden_size
    qkv = [(h * d, hidden), (g * d, hidden), (g * d, hidden)] if split_qkv else [((h + 2 * g) * d, hidden)]
    fc1 = ((2 if c.gated_linear_unit else 1) * c.ffn_hidden_size, hidden)
    layer = [*qkv, (hidden, h * d), fc1, (hidden, c.ffn_hidden_size)]
    return layer * c.num_layers + ([(hidden, hidden)] * 2 if c.latent_feedback else [])


def normuon_flops_per_step(config, num_ns_steps: int = 5, split_qkv: bool = True) -> float:
    """FLOPs of one NorMuon step's Newton–Schulz over every matrix once (module docstring)."""
    return sum(num_ns_steps * (4 * min(m, n) ** 2 * max(m, n) + 2 * min(m, n) ** 3)
               for m, n in normuon_matrices(config, split_qkv))


class Throughput:
    """MFU and per-GPU throughput of the training log's windows (the steps since the last record).

    A window's steps may have different k; F is affine in k (F(k) = k·(F(1) + f) − f, f the fusion
    term), so its FLOPs follow from the window's tokens and equivalent-compute tokens (tokens × k)."""

    def __init__(self, config, world_size: int, peak_tflops=None, tokens: int = 0, compute_tokens: int = 0):
        self.config, self.world_size, self.peak_tflops = config, world_size, peak_tflops
        self.tokens, self.compute_tokens = tokens, compute_tokens

    def fields(self, record: dict) -> dict:
        """``tokens_per_s_per_gpu``, ``model_tflops_per_gpu`` and, with a known peak, ``mfu`` for a
        logged record (its cumulative ``tokens``/``compute_tokens`` and the window's ``tokens_per_s``)."""
        tokens, compute = record["tokens"] - self.tokens, record["compute_tokens"] - self.compute_tokens
        self.tokens, self.compute_tokens = record["tokens"], record["compute_tokens"]
        fusion = flops_per_token(self.config, 2) - 2 * flops_per_token(self.config, 1)  # f
        window_flops = compute * (flops_per_token(self.config, 1) + fusion) - tokens * fusion
        seconds = tokens / record["tokens_per_s"]
        tflops = window_flops / seconds / self.world_size / 1e12
        out = {"tokens_per_s_per_gpu": record["tokens_per_s"] / self.world_size, "model_tflops_per_gpu": tflops}
        if self.peak_tflops:
            out["mfu"] = tflops / self.peak_tflops
        return out
