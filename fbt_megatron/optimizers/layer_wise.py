"""megatron-core's LayerWiseDistributedOptimizer with an all-gather that gloo can run.

Each data-parallel rank owns whole parameters (their optimizer state and update); after the step
the owners' weights are all-gathered. megatron-core 0.16.1 all-gathers tensors of different
lengths (NCCL accepts that; gloo refuses: "invalid tensor size"), so here every rank's part is
padded to the longest. And the optimizers are wrapped (fp32 or bf16 main weights) by wrappers the
caller gives, after the parameters are shared out: megatron-core's own wrapping would replace
NorMuon's checkpointing wrapper (``checkpoint``) with its generic one.
"""

from __future__ import annotations

from typing import Callable, List

import torch
import torch.distributed as dist
from megatron.core.optimizer import ChainedOptimizer
from megatron.core.optimizer.layer_wise_optimizer import LayerWiseDistributedOptimizer
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from fbt_megatron.common import compat


class LayerWiseOptimizer(LayerWiseDistributedOptimizer):
    """Per-rank ownership of whole parameters (see the module docstring); no expert parallelism.
    ``optimizers`` are torch optimizers over the model's parameters; ``wrappers[i]`` makes the
    megatron-core optimizer of the i-th once its parameter groups hold only this rank's share."""

    def __init__(self, optimizers: List[torch.optim.Optimizer], wrappers: List[Callable], pg_collection):
        self.pg_collection = pg_collection
        for name, value in compat.layer_wise_attributes(pg_collection).items():
            setattr(self, name, value)
        self.shard_params(optimizers)
        ChainedOptimizer.__init__(self, [wrap(optimizer) for wrap, optimizer in zip(wrappers, optimizers)])

    @torch.no_grad()
    def allgather_params(self) -> None:
        assert self.expt_dp_params_list is None, "expert-parallel parameters are not supported"
        if self.pg_collection is None or not self.dp_cp_params_list:
            return
        group, owned = self.pg_collection.dp_cp, self.dp_cp_params_list
        rank, sizes = dist.get_rank(group), [sum(p.numel() for p in params) for params in owned]
        like = next(p for params in owned for p in params)
        mine = torch.zeros(max(sizes), dtype=like.dtype, device=like.device)
        if owned[rank]:
            mine[: sizes[rank]] = _flatten_dense_tensors(owned[rank])
        parts = [torch.empty_like(mine) for _ in owned]
        dist.all_gather(parts, mine, group=group)
        for i, (part, params) in enumerate(zip(parts, owned)):
            if i != rank and params:
                for updated, p in zip(_unflatten_dense_tensors(part[: sizes[i]], params), params):
                    p.data.copy_(updated)
