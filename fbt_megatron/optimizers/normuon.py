"""NorMuon (Li et al., 2025): Muon's orthogonalised momentum, normalised per output row.

One step for a weight matrix W (m × n) with gradient G, following the paper's reference
``normuon.py``:

    M ← μ M + (1 − μ) G                          momentum (μ = 0.95), Nesterov: U = (1 − μ) G + μ M
    O ← NewtonSchulz5(U)                         Frobenius-normalised, coefficients (3.4445, −4.7750, 2.0315)
    v ← β2 v + (1 − β2) mean_columns(O²)         one second moment per output row (β2 = 0.95)
    O ← O / (√v + ε) · ‖O_before‖_F / ‖O / (√v + ε)‖_F · √max(1, m / n)
    W ← W (1 − lr · wd) − lr · O                 decoupled weight decay

Newton–Schulz is pytorch-optimizer's ``zero_power_via_newton_schulz_5``, run in fp32.

Tensor parallelism follows megatron-core's ``muon.py``: in ``duplicated`` mode the whole matrix
is orthogonalised and row-normalised (so the update equals the one-process update) and each rank
keeps its chunk. Where megatron-core's every TP rank orthogonalises every matrix, here each matrix
has one owner: the parameters are taken in rounds of TP size, the i-th of a round owned by TP rank
i, which gathers the momentum's shards along the weight's ``partition_dim``, computes the direction
while the other ranks compute theirs, and scatters the chunks (broadcasts a matrix not split by
TP). The same arithmetic on the same matrix: the update is bit for bit the one every rank would
compute, for 1/TP of Newton–Schulz's work per rank. ``v`` holds one value per row of the local
weight: sharded like the rows of a column-parallel weight (gathered to the owner and scattered
back), whole on every TP rank for a row-parallel one (broadcast by the owner). In ``blockwise``
mode each shard is orthogonalised and normalised alone. A fused QKV weight (``is_qkv`` set, as in
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


def _gather_to(x: torch.Tensor, dim: Optional[int], owner: int, group) -> Optional[torch.Tensor]:
    """The whole of ``x`` on TP rank ``owner`` (its shards concatenated along ``dim``; ``x`` itself,
    the same on every rank, where ``dim`` is None), None elsewhere."""
    mine = dist.get_rank(group) == owner
    if dim is None:
        return x if mine else None
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))] if mine else None
    dist.gather(x.contiguous(), parts, dst=dist.get_global_rank(group, owner), group=group)
    return torch.cat(parts, dim=dim) if mine else None


def _share_from(whole: Optional[torch.Tensor], out: torch.Tensor, dim: Optional[int], owner: int, group) -> None:
    """Fills every rank's ``out`` with its chunk (along ``dim``; all of it where None) of the owner's ``whole``."""
    src = dist.get_global_rank(group, owner)
    if dim is None:
        if whole is not None and whole is not out:
            out.copy_(whole)
        dist.broadcast(out, src=src, group=group)
        return
    chunks = [c.contiguous() for c in whole.chunk(dist.get_world_size(group), dim=dim)] if whole is not None else None
    dist.scatter(out, chunks, src=src, group=group)


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

    def _update(self, p: torch.Tensor, mu: float) -> torch.Tensor:
        """Momentum, then its Nesterov mix with the gradient."""
        self.init_state(p)
        buf = self.state[p]["momentum_buffer"]
        buf.lerp_(p.grad, 1.0 - mu)
        return p.grad.lerp(buf, mu)

    def _direction(self, p: torch.Tensor, update: torch.Tensor, v: torch.Tensor, group: dict) -> torch.Tensor:
        return normuon_direction(update, v, group["beta2"], group["eps"], self.num_ns_steps,
                                 self.qkv_split_shapes if getattr(p, "is_qkv", False) else None)

    @staticmethod
    def _apply(p: torch.Tensor, o: torch.Tensor, group: dict) -> None:
        p.mul_(1.0 - group["lr"] * group["weight_decay"])
        p.add_(o.to(p.dtype), alpha=-group["lr"])

    def _owned_round(self, params: list, group: dict) -> None:
        """One round of ``duplicated`` TP (module docstring): ``params[i]`` orthogonalised by TP rank i."""
        tp, rank = self.tp_group, dist.get_rank(self.tp_group)
        dims = [tp_partition_dim(p, tp, self.tp_mode) for p in params]
        mine = None
        for i, (p, dim) in enumerate(zip(params, dims)):
            whole = _gather_to(self._update(p, group["momentum"]), dim, i, tp)
            v = _gather_to(self.state[p]["second_moment"], 0 if dim == 0 else None, i, tp)
            if i == rank:
                mine = (p, whole, v)
        if mine is not None:
            p, whole, v = mine
            mine = (self._direction(p, whole, v, group), v)
        for i, (p, dim) in enumerate(zip(params, dims)):
            o, v = mine if i == rank else (None, None)
            local = torch.empty(p.shape, dtype=torch.float32, device=p.device)
            _share_from(o, local, dim, i, tp)
            _share_from(v, self.state[p]["second_moment"], 0 if dim == 0 else None, i, tp)
            self._apply(p, local, group)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        tp_size = dist.get_world_size(self.tp_group) if self.tp_group is not None else 1
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if self.tp_mode == "duplicated" and tp_size > 1:
                for start in range(0, len(params), tp_size):
                    self._owned_round(params[start:start + tp_size], group)
                continue
            for p in params:
                self._apply(p, self._direction(p, self._update(p, group["momentum"]), self.state[p]["second_moment"], group), group)
        return loss
