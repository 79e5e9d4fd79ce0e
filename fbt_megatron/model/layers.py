"""Backbone pieces megatron-core does not ship in the paper's form.

* ``RMSNorm`` — a norm that also works under sequence parallelism (the local spec's torch norm
  refuses SP without Apex/TE); its weight is replicated across TP and, under SP, marked so that
  megatron-core all-reduces its gradient.
* ``FBTSelfAttention`` — megatron-core SelfAttention whose per-head outputs are scaled by
  sigmoid(w_hᵀ x) (one scalar per head and token) before the output projection (the headwise
  gate, optional: ``HeadwiseGate``), with a KV cache for generation that keeps only each layer's window.
* ``FBTDotProductAttention`` — megatron-core's local attention whose sliding window also holds when
  an attention mask is given (packed SFT rows).
* ``FBTTransformerLayer`` — megatron-core TransformerLayer with sandwich norms and depth-scaled
  residual branches: h ← h + α·RMSNorm_post(Sublayer(RMSNorm_pre(h))).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import torch
import torch.nn.functional as F
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.tensor_parallel import mappings
from megatron.core.transformer.module import MegatronModule
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import _yarn_get_concentration_factor_from_config
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules
from megatron.core.transformer.utils import get_sliding_window_causal_mask, is_layer_window_attention


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


class FBTDotProductAttention(DotProductAttention):
    """megatron-core's local (unfused) attention with the layer's sliding window applied on top of
    a given ``attention_mask`` (True = masked). megatron's local softmax replaces any given mask by
    the window mask, so packed rows would attend across conversations in window layers; here this
    module builds that same window mask and ORs in the given one (causal ∧ same conversation):
    window ∧ causal ∧ same conversation. Without a mask it computes exactly what megatron does.
    (It relies on ``masked_softmax_fusion`` being off, as in ``config.py``: megatron's fused causal
    kernel would ignore a given mask.)"""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # (W − 1, 0) in window layers, None elsewhere; the softmax no longer builds its own mask
        self.window_size, self.scale_mask_softmax.window_size = self.scale_mask_softmax.window_size, None

    def forward(self, query, key, value, attention_mask, *args, **kwargs):
        if self.window_size is not None:
            window = get_sliding_window_causal_mask(query.shape[0], key.shape[0], self.window_size).to(query.device)
            attention_mask = window if attention_mask is None else attention_mask | window
        return super().forward(query, key, value, attention_mask, *args, **kwargs)


class HeadwiseGate(MegatronModule):
    """The headwise gate's logits w_hᵀ x [s, b, heads/tp] for this TP rank's heads.

    Its weight [heads, D] is replicated over TP (heads · D values), and every rank computes all
    heads on the tokens it holds: under sequence parallelism only the logits are gathered along the
    sequence (heads values per token, not the normed input's D, which the QKV linear gathers
    already), and a rank keeps its heads' slice. The weight's gradient: under SP each rank holds
    its tokens' part, summed over TP by megatron-core (the ``sequence_parallel`` mark); without SP
    each rank receives every head's (``scatter``'s backward all-gathers), so the replicas stay equal.
    Its checkpoint tensor is the global [heads, D] of a column-parallel linear's, so checkpoints of
    either load. Initialised as megatron's CPU initialisation does a column-parallel weight: the
    whole matrix, on the default generator (the same on every TP rank)."""

    def __init__(self, config, tp_group):
        super().__init__(config)
        self.tp_group = tp_group
        weight = torch.empty(config.num_attention_heads, config.hidden_size, dtype=torch.float32)
        if config.perform_initialization:
            config.init_method(weight)
        self.weight = torch.nn.Parameter(weight.to(config.params_dtype))
        setattr(self.weight, "sequence_parallel", config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, self.weight)  # every head, on the tokens this rank holds
        tp = self.tp_group.size() if self.tp_group is not None else 1
        if tp == 1:
            return logits
        if not self.config.sequence_parallel:
            return mappings.scatter_to_tensor_model_parallel_region(logits, group=self.tp_group)
        logits = mappings.gather_from_sequence_parallel_region(logits, group=self.tp_group)
        heads = logits.shape[-1] // tp
        rank = self.tp_group.rank()
        return logits[..., rank * heads:(rank + 1) * heads]


@dataclass
class FBTSelfAttentionSubmodules(SelfAttentionSubmodules):
    linear_gate: Union[ModuleSpec, type, None] = None  # None: no headwise gate


class FBTSelfAttention(SelfAttention):
    """megatron-core SelfAttention with the headwise gate o_h ← o_h · sigmoid(w_hᵀ x) (x = the
    attention's normed input) when ``submodules.linear_gate`` is given, and a KV cache that keeps
    only what each layer can attend to (``_adjust_key_value_for_inference``)."""

    def __init__(self, config, submodules: FBTSelfAttentionSubmodules, *args, **kwargs):
        super().__init__(config, submodules, *args, **kwargs)
        self.window = self.config.window_size[0] if is_layer_window_attention(
            self.config.window_size, self.config.window_attn_skip_freq, self.layer_number) else None  # W − 1
        self.linear_gate = None
        if submodules.linear_gate is not None:
            self.linear_gate = build_module(submodules.linear_gate, config=config, tp_group=self.pg_collection.tp)
            self._head_gate_logits = None
            self.linear_proj.register_forward_pre_hook(self._gate_heads)

    def forward(self, hidden_states, *args, **kwargs):
        if self.linear_gate is not None:
            self._head_gate_logits = self.linear_gate(hidden_states)  # [s, b, heads/tp]
        return super().forward(hidden_states, *args, **kwargs)

    def _gate_heads(self, _module, args):
        core_attn_out, rest = args[0], args[1:]
        gate, self._head_gate_logits = self._head_gate_logits, None
        s, b, _ = core_attn_out.shape
        heads = core_attn_out.view(s, b, gate.shape[-1], -1)
        gated = heads * torch.sigmoid(gate.float()).to(heads.dtype).unsqueeze(-1)
        return (gated.view(s, b, -1), *rest)

    def _adjust_key_value_for_inference(self, inference_context, query, key, value, rotary_pos_emb, *args, **kwargs):
        """The KV cache of static batching (``fbt_megatron.generate``): keys are cached with RoPE
        applied; a sliding-window layer keeps only the last W − 1 past positions, a global layer a
        buffer of the context's maximum length. Returns exactly the keys the new queries may see
        (megatron's local attention aligns its sliding-window mask bottom-right), with the key's
        rotary emptied so that it is not applied twice."""
        if inference_context is None or not inference_context.is_static_batching():
            return super()._adjust_key_value_for_inference(inference_context, query, key, value, rotary_pos_emb,
                                                           *args, **kwargs)
        assert not self.config.flash_decode, "flash decoding is not supported by FBTSelfAttention's cache"
        start = inference_context.sequence_len_offset
        end = start + key.shape[0]
        if end > inference_context.max_sequence_length:
            raise ValueError(f"position {end - 1} is beyond the inference context's length "
                             f"{inference_context.max_sequence_length}")
        if rotary_pos_emb is not None:
            q_pos_emb, k_pos_emb = rotary_pos_emb
            if k_pos_emb is not None:
                key = apply_rotary_pos_emb(key, k_pos_emb[start:end], config=self.config,
                                           mscale=_yarn_get_concentration_factor_from_config(self.config),
                                           cp_group=self.pg_collection.cp)
            rotary_pos_emb = (None if q_pos_emb is None else q_pos_emb[start:end], None)
        memory = inference_context.key_value_memory_dict
        if self.window is not None:  # the last W − 1 past positions, then the new ones
            if start > 0:
                past_key, past_value = memory[self.layer_number]
                key, value = torch.cat([past_key, key]), torch.cat([past_value, value])
            keep = max(key.shape[0] - self.window, 0)
            memory[self.layer_number] = (key[keep:], value[keep:])
        else:  # every position so far, in a preallocated buffer
            if self.layer_number not in memory:
                length = inference_context.max_sequence_length
                memory[self.layer_number] = (key.new_empty(length, *key.shape[1:]),
                                             value.new_empty(length, *value.shape[1:]))
            key_memory, value_memory = memory[self.layer_number]
            key_memory[start:end], value_memory[start:end] = key, value
            key, value = key_memory[:end], value_memory[:end]
        # as megatron: no mask once decoding (the new queries see every returned key but the
        # window's, which megatron's local attention masks bottom-right aligned)
        mask_type = self.attn_mask_type if start == 0 else AttnMaskType.no_mask
        return query, key, value, rotary_pos_emb, mask_type, None


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
