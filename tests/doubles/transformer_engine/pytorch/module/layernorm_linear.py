"""TE's LayerNormLinear (TE: pytorch/module/layernorm_linear.py): the norm, then the column-parallel
GEMM of ``linear.Linear`` with the same per-call state (its ``accumulate`` rule at
layernorm_linear.py:934). Its norm weight is ``layer_norm_weight``, its gradient not fused."""

from __future__ import annotations

from typing import Optional

import torch

from transformer_engine.pytorch.module.linear import Linear
from transformer_engine.pytorch.module.normalization import make_norm_weight, rms_norm


class LayerNormLinear(Linear):
    def __init__(self, in_features: int, out_features: int, eps: float = 1e-5, normalization: str = "LayerNorm",
                 zero_centered_gamma: bool = False, return_layernorm_output: bool = False, **kwargs):
        if normalization != "RMSNorm" or return_layernorm_output:
            raise NotImplementedError("the TE double models LayerNormLinear with RMSNorm, without returning the norm")
        if kwargs.get("parallel_mode") not in (None, "column"):
            raise ValueError("LayerNormLinear is column-parallel or not parallel")
        super().__init__(in_features, out_features, **kwargs)
        self.eps, self.zero_centered_gamma = eps, zero_centered_gamma
        make_norm_weight(self, "layer_norm_weight", in_features, zero_centered_gamma, self.sequence_parallel,
                         kwargs.get("params_dtype"), kwargs.get("device", "cuda"))
        self._parameters["weight"] = self._parameters.pop("weight")  # TE registers the norm's weight first

    def forward(self, inp: torch.Tensor, is_first_microbatch: Optional[bool] = None, **kwargs):
        if kwargs:
            raise NotImplementedError(f"the TE double does not model LayerNormLinear.forward({', '.join(kwargs)})")
        inp = self.prepare_forward(inp)
        normed = rms_norm(inp, self.layer_norm_weight, self.eps, self.zero_centered_gamma)
        out = self.gemm(normed, is_first_microbatch)
        self.end_forward()
        return (out, torch.empty(0, dtype=out.dtype, device=out.device)) if self.return_bias else out
