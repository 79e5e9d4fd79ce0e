"""NorMuon (Li et al., 2025): Muon's orthogonalised momentum, normalised per output row.

One step for a weight matrix W (m × n) with gradient G, following the paper's reference
``normuon.py``:

    M ← μ M + (1 − μ) G                          momentum (μ = 0.95), Nesterov: U = (1 − μ) G + μ M
    O ← NewtonSchulz5(U)                         Frobenius-normalised, coefficients (3.4445, −4.7750, 2.0315)
    v ← β2 v + (1 − β2) mean_columns(O²)         one second moment per output row (β2 = 0.95)
    O ← O / (√v + ε) · ‖O_before‖_F / ‖O / (√v + ε)‖_F · √max(1, m / n)
    W ← W (1 − lr · wd) − lr · O                 decoupled weight decay

Newton–Schulz is pytorch-optimizer's ``zero_power_via_newton_schulz_5``, run in fp32.

Tensor parallelism follows megatron-core's ``muon.py``: in ``duplicated`` mode the momentum's
shards are all-gathered along the weight's ``partition_dim``, the whole matrix is orthogonalised
and row-normalised (so the update equals the one-process update) and each rank keeps its chunk.
``v`` holds one value per row of the local weight: sharded like the rows of a column-parallel
weight (gathered for the step), whole on every TP rank for a row-parallel one (each rank computes
the same). In ``blockwise`` mode each shard is orthogonalised and normalised alone. A fused QKV weight (``is_qkv`` set, as in
``muon.py``) is orthogonalised per Q, K and V over all query groups.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from pytorch_optimizer.optimizer.utils.matrix import zero_power_via_newton_schulz_5

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def tp_partition_dim(p: torch.Tensor, tp_group, mode: str) -> Optional[int]:
    """The axis along which ``p``'s TP shards are gathered before orthogonalising (None: the
    local matrix is the whole one, or blockwise mode)."""
    if mode != "duplicated" or tp_group is None or dist.get_world_size(tp_group) == 1:
        return None
    if not getattr(p, "tensor_model_parallel", False) or getattr(p, "partition_dim", -1) < 0:
        return None
    return p.partition_dim


def _gather(x: torch.Tensor, dim: Optional[int], group) -> torch.Tensor:
    if dim is None:
        return x
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _split(x: torch.Tensor, shapes: Optional[Sequence[int]]) -> list:
    """The matrices orthogonalised separately: x itself, or its Q, K, V rows over all query groups."""
    if not shapes:
        return [x]
    groups = x.shape[0] // sum(shapes)
    return [part.reshape(-1, x.shape[1]) for part in torch.split(x.view(groups, sum(shapes), -1), list(shapes), dim=1)]


def _join(parts: list, shapes: Optional[Sequence[int]], like: torch.Tensor) -> torch.Tensor:
    if not shapes:
        return parts[0]
    groups = like.shape[0] // sum(shapes)
    return torch.cat([part.view(groups, -1, like.shape[1]) for part in parts], dim=1).view_as(like)


def normuon_direction(update: torch.Tensor, v: torch.Tensor, beta2: float, eps: float, num_ns_steps: int,
                      qkv_split_shapes: Optional[Sequence[int]] = None) -> torch.Tensor:
    """The NorMuon direction of one (whole) matrix ``update``; updates ``v`` (rows × 1) in place."""
    parts = [zero_power_via_newton_schulz_5(u.float(), num_steps=num_ns_steps, weights=NS_COEFFICIENTS, dtype=torch.float32)
             for u in _split(update, qkv_split_shapes)]
    norms = [o.norm() for o in parts]
    o = _join(parts, qkv_split_shapes, update.float())
    v.lerp_(o.square().mean(dim=-1, keepdim=True), 1.0 - beta2)
    o = o / (v.sqrt() + eps)
    scaled = [q * (norm / (q.norm() + eps)) * math.sqrt(max(1.0, q.shape[0] / q.shape[1]))
              for q, norm in zip(_split(o, qkv_split_shapes), norms)]
    return _join(scaled, qkv_split_shapes, o)


class NorMuon(torch.optim.Optimizer):
    """NorMuon for 2-D weights (a torch optimizer; megatron-core's FP32/Float16 wrappers and
    chained optimizer hold it). Per-parameter state: ``momentum_buffer`` (shaped like the weight)
    and ``second_moment`` (the weight's rows × 1). ``qkv_split_shapes``: rows of Q, K, V per query
    group, for the parameters marked ``is_qkv``."""

    def __init__(self, params, lr: float, momentum: float = 0.95, beta2: float = 0.95, weight_decay: float = 0.0,
                 num_ns_steps: int = 5, eps: float = 1e-10, qkv_split_shapes: Optional[Sequence[int]] = None,
                 tp_group=None, tp_mode: str = "duplicated"):
        super().__init__(params, dict(lr=lr, momentum=momentum, beta2=beta2, weight_decay=weight_decay, eps=eps))
        self.num_ns_steps, self.qkv_split_shapes, self.tp_group, self.tp_mode = num_ns_steps, qkv_split_shapes, tp_group, tp_mode

    def init_state(self, p: torch.Tensor) -> None:
        state = self.state[p]
        if not state:
            state["momentum_buffer"] = torch.zeros_like(p)
            state["second_moment"] = torch.zeros(p.shape[0], 1, dtype=torch.float32, device=p.device)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                self.init_state(p)
                state, mu = self.state[p], group["momentum"]
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1.0 - mu)
                update = p.grad.lerp(buf, mu)  # Nesterov
                dim = tp_partition_dim(p, self.tp_group, self.tp_mode)
                v = _gather(state["second_moment"], 0 if dim == 0 else None, self.tp_group)
                o = normuon_direction(_gather(update, dim, self.tp_group), v, group["beta2"], group["eps"],
                                      self.num_ns_steps, self.qkv_split_shapes if getattr(p, "is_qkv", False) else None)
                if dim is not None:
                    rank, size = dist.get_rank(self.tp_group), dist.get_world_size(self.tp_group)
                    o = o.chunk(size, dim=dim)[rank]
                    if dim == 0:
                        state["second_moment"].copy_(v.chunk(size)[rank])
                p.mul_(1.0 - group["lr"] * group["weight_decay"])
                p.add_(o.to(p.dtype), alpha=-group["lr"])
        return loss
