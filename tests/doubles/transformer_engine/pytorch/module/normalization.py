"""TE's RMSNorm and LayerNorm (TE: pytorch/module/rmsnorm.py, layernorm.py): statistics in FP32,
the output in the input's dtype; the weight carries ``sequence_parallel`` so that megatron-core
all-reduces its gradient over the TP group."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from transformer_engine.pytorch.module.base import device_of


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered_gamma: bool) -> torch.Tensor:
    gamma = weight.float() + 1 if zero_centered_gamma else weight.float()
    return F.rms_norm(x.float(), (x.shape[-1],), gamma, eps).to(x.dtype)


def make_norm_weight(module: torch.nn.Module, name: str, hidden_size: int, zero_centered_gamma: bool,
                     sequence_parallel: bool, params_dtype, device) -> None:
    init = torch.zeros if zero_centered_gamma else torch.ones
    weight = torch.nn.Parameter(init(hidden_size, dtype=params_dtype or torch.float32, device=device_of(device)))
    weight.sequence_parallel = sequence_parallel
    module.register_parameter(name, weight)


class RMSNorm(torch.nn.Module):
    """TE 2.16 takes ``normalized_shape`` (megatron-core 0.19) or the deprecated ``hidden_size`` (0.16)."""

    def __init__(self, normalized_shape=None, eps: float = 1e-5, sequence_parallel: bool = False,
                 params_dtype=None, zero_centered_gamma: bool = False, hidden_size=None, device="cuda", **kwargs):
        super().__init__()
        if kwargs:
            raise NotImplementedError(f"the TE double does not model RMSNorm({', '.join(kwargs)})")
        if (normalized_shape is None) == (hidden_size is None):
            raise RuntimeError("give one of normalized_shape and hidden_size (deprecated)")
        hidden_size = normalized_shape if hidden_size is None else hidden_size
        self.eps, self.zero_centered_gamma, self.sequence_parallel = eps, zero_centered_gamma, sequence_parallel
        make_norm_weight(self, "weight", hidden_size, zero_centered_gamma, sequence_parallel, params_dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu":
            raise RuntimeError(f"TransformerEngine needs CUDA. Got input on device: {x.device}")
        return rms_norm(x, self.weight, self.eps, self.zero_centered_gamma)


class LayerNorm(torch.nn.Module):
    def __init__(self, *args, **kwargs):
        raise NotImplementedError("the TE double models RMSNorm only (the FBT model's norm)")
