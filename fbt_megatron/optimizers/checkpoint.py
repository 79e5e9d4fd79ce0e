"""dist_checkpointing of NorMuon's per-row second moment.

megatron-core's optimizer wrappers describe every state tensor with its parameter's sharding,
which needs the parameter's shape; ``second_moment`` is one value per row (rows × 1). The
wrappers here describe it as the parameter's sharding with the column axis collapsed: sharded
like the rows, a TP replica where the rows are whole on every TP rank (row-parallel weights under
``duplicated``), one column block per TP rank under ``blockwise``. So it reshards across layouts
like the weights (save at TP 2, load at TP 1).
"""

from __future__ import annotations

import dataclasses
from itertools import chain

import torch
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.dist_checkpointing.optimizer import get_param_id_to_sharded_param_map
from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params, FP32Optimizer

from fbt_megatron.optimizers.normuon import tp_partition_dim

KEY = "second_moment"


def row_moment_sharded_tensor(param_sharding, moment: torch.Tensor, param: torch.Tensor, normuon):
    """``moment`` (rows × 1) of ``param`` described like ``param_sharding`` (its ShardedTensor or
    factory), under key ``optimizer.state.second_moment.<param key>``."""
    key = f"optimizer.state.{KEY}.{param_sharding.key}"
    if isinstance(param_sharding, ShardedTensorFactory):  # e.g. the SwiGLU fc1 (column-parallel: rows sharded)
        assert getattr(param, "partition_dim", 0) == 0, "a factory-sharded row-parallel weight is not supported"
        return dataclasses.replace(param_sharding, key=key, data=moment)
    sh: ShardedTensor = param_sharding
    replica_id, columns, offset = sh.replica_id, sh.axis_fragmentations[-1], sh.global_offset[-1] // sh.local_shape[-1]
    if tp_partition_dim(param, normuon.tp_group, normuon.tp_mode) == 1:  # whole rows, the same on every TP rank
        columns, offset = 1, 0
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        replica_id = (replica_id[0], tp_rank, *replica_id[2:]) if isinstance(replica_id, tuple) else (replica_id, tp_rank, 0)
    return dataclasses.replace(
        sh, key=key, data=moment, dtype=moment.dtype, local_shape=(*sh.local_shape[:-1], 1),
        global_shape=(*sh.global_shape[:-1], columns), global_offset=(*sh.global_offset[:-1], offset),
        axis_fragmentations=(*sh.axis_fragmentations[:-1], columns), replica_id=replica_id,
    )


class _RowMomentCheckpointing:
    """Mixin for megatron-core's optimizer wrappers holding a ``NorMuon``."""

    def _model_params(self) -> list:
        raise NotImplementedError

    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, metadata=None):
        if is_loading:
            self.init_state_fn(self.optimizer, self.config)
        main = [p for group in self.optimizer.param_groups for p in group["params"]]
        moments = [self.optimizer.state[p].pop(KEY, None) for p in main]
        try:  # megatron's description of the other state (shaped like the parameters)
            state_dict = super().sharded_state_dict(model_sharded_state_dict, is_loading, metadata)
        finally:
            for p, moment in zip(main, moments):
                if moment is not None:
                    self.optimizer.state[p][KEY] = moment
        params = self._model_params()
        sharding = get_param_id_to_sharded_param_map(model_sharded_state_dict, params)
        state = state_dict["optimizer"]["state"]
        for i, (param, moment) in enumerate(zip(params, moments)):
            if moment is not None:
                state[i][KEY] = row_moment_sharded_tensor(sharding[i], moment, param, self.optimizer)
        return state_dict


class NestedFP32Optimizer(FP32Optimizer):
    """megatron-core's FP32Optimizer with its checkpoint state under ``optimizer``, as the Float16
    wrapper's is (megatron-core's LayerWiseDistributedOptimizer reads it there; in 0.16.1 it
    fails on the FP32 layout)."""

    def sharded_state_dict(self, *args, **kwargs):
        return {"optimizer": super().sharded_state_dict(*args, **kwargs)}

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict["optimizer"])


class NorMuonFP32Optimizer(_RowMomentCheckpointing, NestedFP32Optimizer):
    """megatron-core's FP32Optimizer around a NorMuon."""

    def _model_params(self) -> list:
        return self.get_parameters()


class NorMuonFloat16Optimizer(_RowMomentCheckpointing, Float16OptimizerWithFloat16Params):
    """megatron-core's bf16/fp16 wrapper (fp32 main weights) around a NorMuon."""

    def _model_params(self) -> list:
        return list(chain.from_iterable(self.float16_groups))
