"""Backbone pieces megatron-core does not ship in the paper's form.

* ``RMSNorm`` — a norm that also works under sequence parallelism (the local spec's torch norm
  refuses SP without Apex/TE); its weight is replicated across TP and, under SP, marked so that
  megatron-core all-reduces its gradient.
* ``HeadwiseGatedSelfAttention`` — megatron-core SelfAttention whose per-head outputs are scaled
  by sigmoid(w_hᵀ x) (one scalar per head and token) before the output projection.
* ``FBTTransformerLayer`` — megatron-core TransformerLayer with sandwich norms and depth-scaled
  residual branches: h ← h + α·RMSNorm_post(Sublayer(RMSNorm_pre(h))).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import torch
import torch.nn.functional as F
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
)


class RMSNorm(torch.nn.Module):
    """y = x / sqrt(mean(x²) + eps) · g."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        # megatron-core's finalize_model_grads all-reduces grads of params carrying this flag
        setattr(self.weight, "sequence_parallel", config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


@dataclass
class HeadwiseGatedSelfAttentionSubmodules(SelfAttentionSubmodules):
    linear_gate: Union[ModuleSpec, type] = None


class HeadwiseGatedSelfAttention(SelfAttention):
    """o_h ← o_h · sigmoid(w_hᵀ x) for every head h, x = the attention's (normed) input."""

    def __init__(self, config, submodules: HeadwiseGatedSelfAttentionSubmodules, *args, **kwargs):
        super().__init__(config, submodules, *args, **kwargs)
        # column-parallel: each TP rank computes the gates of the heads it owns
        self.linear_gate = build_module(
            submodules.linear_gate,
            config.hidden_size,
            config.num_attention_heads,
            config=config,
            init_method=config.init_method,
            gather_output=False,
            bias=False,
            skip_bias_add=False,
            is_expert=False,
            tp_group=self.pg_collection.tp,
        )
        self._head_gate_logits = None
        self.linear_proj.register_forward_pre_hook(self._gate_heads)

    def forward(self, hidden_states, *args, **kwargs):
        self._head_gate_logits, _ = self.linear_gate(hidden_states)  # [s, b, heads/tp]
        return super().forward(hidden_states, *args, **kwargs)

    def _gate_heads(self, _module, args):
        core_attn_out, rest = args[0], args[1:]
        gate, self._head_gate_logits = self._head_gate_logits, None
        s, b, _ = core_attn_out.shape
        heads = core_attn_out.view(s, b, gate.shape[-1], -1)
        gated = heads * torch.sigmoid(gate.float()).to(heads.dtype).unsqueeze(-1)
        return (gated.view(s, b, -1), *rest)


@dataclass
class FBTTransformerLayerSubmodules(TransformerLayerSubmodules):
    post_self_attn_layernorm: Union[ModuleSpec, type] = IdentityOp
    post_mlp_layernorm: Union[ModuleSpec, type] = IdentityOp


def _depth_scaled_residual(post_norm: torch.nn.Module, alpha: float):
    """Replaces megatron's bias-dropout-add: out ↦ residual + α·dropout(post_norm(out))."""

    def bda(training: bool, _fused: bool):
        def add(out_with_bias, residual, dropout_prob):
            out, bias = out_with_bias
            assert bias is None, "the FBT backbone has no biases"
            out = F.dropout(post_norm(out), p=dropout_prob, training=training)
            return residual + alpha * out

        return add

    return bda


class FBTTransformerLayer(TransformerLayer):
    """h ← h + α·RMSNorm_post_attn(Attn(RMSNorm_in(h)));
    h ← h + α·RMSNorm_post_ff(MLP(RMSNorm_pre_ff(h)))."""

    def __init__(self, config, submodules: FBTTransformerLayerSubmodules, *args, **kwargs):
        super().__init__(config, submodules, *args, **kwargs)
        norm_kwargs = dict(config=config, hidden_size=config.hidden_size, eps=config.layernorm_epsilon)
        self.post_self_attn_layernorm = build_module(submodules.post_self_attn_layernorm, **norm_kwargs)
        self.post_mlp_layernorm = build_module(submodules.post_mlp_layernorm, **norm_kwargs)
        del self.self_attn_bda, self.mlp_bda  # megatron's bias-dropout-add modules, replaced:
        self.self_attn_bda = _depth_scaled_residual(self.post_self_attn_layernorm, config.depth_scale)
        self.mlp_bda = _depth_scaled_residual(self.post_mlp_layernorm, config.depth_scale)
