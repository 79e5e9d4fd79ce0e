"""The Full-Bandwidth Transformer on megatron-core's GPTModel, composed from ModuleSpecs.

One spec-building function serves both back ends: Transformer Engine (FP8-capable GEMMs, fused
norms, TE attention) when it is usable, megatron-core's local modules otherwise. The FBT pieces
(headwise gate, sandwich norms, fusion) are the same modules in both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

from fbt_megatron.common import platform
from fbt_megatron.model.config import FBTConfig
from fbt_megatron.model.fbt import Feedback, LatentFeedbackFusion, LatentFeedbackFusionSubmodules
from fbt_megatron.model.layers import (FBTDotProductAttention, FBTSelfAttention, FBTSelfAttentionSubmodules, FBTTransformerLayer,
                                       FBTTransformerLayerSubmodules, HeadwiseGate, RMSNorm)
from fbt_megatron.model.losses import ZLoss, vocab_parallel_cross_entropy_z
from fbt_megatron.model.offload import offloading

# Under the TE spec the MLP's input norm is a parameter of its first linear: its checkpoint name is
# the local spec's (a layer's sharded-state-dict prefix map), so checkpoints move between the specs.
FUSED_NORM_KEYS = {"mlp.linear_fc1.layer_norm_": "pre_mlp_layernorm."}


@dataclass
class FBTModelSubmodules:
    decoder_layer: ModuleSpec
    final_layernorm: Union[ModuleSpec, type]
    feedback_fusion: Optional[ModuleSpec]


def fbt_model_spec(
    config: FBTConfig, use_transformer_engine: Optional[bool] = None, local_attention: bool = False,
) -> FBTModelSubmodules:
    """ModuleSpecs of the whole model; TE is used when available unless told otherwise.
    ``local_attention``: megatron-core's local attention core even beside TE's layers (it has no
    parameters, so checkpoints do not change): packed SFT rows need its explicit mask."""
    te = platform.have_transformer_engine() if use_transformer_engine is None else use_transformer_engine
    if te:
        platform.require_transformer_engine("the Transformer Engine spec")
        from megatron.core.extensions.transformer_engine import (TEColumnParallelLinear, TEDotProductAttention,
                                                                 TELayerNormColumnParallelLinear, TENorm, TERowParallelLinear)

        norm, col, row, core_attention = TENorm, TEColumnParallelLinear, TERowParallelLinear, TEDotProductAttention
        # the MLP's input norm inside its first GEMM (TE's LayerNormLinear: one kernel, its output FP8
        # under FP8); checkpoints keep the local spec's name for the norm's weight (the layer's key map).
        # The attention's input norm stays apart: the headwise gate reads the normed input.
        pre_mlp_norm, fc1, keys = IdentityOp, TELayerNormColumnParallelLinear, FUSED_NORM_KEYS
    else:
        norm, col, row, core_attention = RMSNorm, ColumnParallelLinear, RowParallelLinear, FBTDotProductAttention
        pre_mlp_norm, fc1, keys = norm, col, {}
    if local_attention:
        core_attention = FBTDotProductAttention

    qk_norm = norm if config.qk_layernorm else None
    attn_submodules = dict(
        linear_qkv=col, core_attention=core_attention, linear_proj=row, q_layernorm=qk_norm, k_layernorm=qk_norm
    )
    # the headwise gate has `heads` outputs: too narrow for FP8 GEMMs, so it is a plain GEMM in both specs
    gate = HeadwiseGate if config.headwise_attention_gate else None
    attention = ModuleSpec(
        module=FBTSelfAttention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=FBTSelfAttentionSubmodules(**attn_submodules, linear_gate=gate),
    )
    post_norm = norm if config.sandwich_norm else IdentityOp
    layer = ModuleSpec(
        module=FBTTransformerLayer,
        submodules=FBTTransformerLayerSubmodules(
            input_layernorm=norm,
            self_attention=attention,
            post_self_attn_layernorm=post_norm,
            pre_mlp_layernorm=pre_mlp_norm,
            mlp=ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=fc1, linear_fc2=row)),
            post_mlp_layernorm=post_norm,
            sharded_state_dict_keys_map=keys,
        ),
    )
    fusion = None
    if config.latent_feedback:
        fusion = ModuleSpec(module=LatentFeedbackFusion, submodules=LatentFeedbackFusionSubmodules(norm=norm))
    return FBTModelSubmodules(decoder_layer=layer, final_layernorm=norm, feedback_fusion=fusion)


class FBTModel(GPTModel):
    """GPTModel whose final norm sits outside the decoder so that the top state s (the residual
    stream after the last layer) is available to feed back, and whose first stage can build
    its input from the previous pass's top states (``feedback``)."""

    def __init__(
        self,
        config: FBTConfig,
        spec: Optional[FBTModelSubmodules] = None,
        pre_process: bool = True,
        post_process: bool = True,
        vp_stage: Optional[int] = None,
        pg_collection=None,
    ):
        spec = spec or fbt_model_spec(config)
        block = TransformerBlockSubmodules(
            layer_specs=[spec.decoder_layer] * get_num_layers_to_build(config, vp_stage),
            layer_norm=None,  # the final norm is applied by this model, after the top state
        )
        super().__init__(
            config=config,
            transformer_layer_spec=block,
            vocab_size=config.vocab_size,
            max_sequence_length=config.seq_length,
            pre_process=pre_process,
            post_process=post_process,
            share_embeddings_and_output_weights=True,  # logits = RMSNorm_final(h_L) · Eᵀ
            position_embedding_type="rope",
            rotary_base=config.rotary_base,
            vp_stage=vp_stage,
            pg_collection=pg_collection,
        )
        if post_process:
            self.final_layernorm = build_module(
                spec.final_layernorm, config=config, hidden_size=config.hidden_size, eps=config.layernorm_epsilon
            )
        self.received = None  # see set_input_tensor
        self.z_loss = ZLoss()  # this step's z-loss coefficient, set by the training loop (0: off)
        self.feedback_fusion = None
        if pre_process and spec.feedback_fusion is not None:
            self.feedback_fusion = build_module(spec.feedback_fusion, config=config)

    def compute_language_model_loss(self, labels, logits):
        """Per-token cross-entropy [b, s] (megatron-core's); while this step's z-loss coefficient
        is set, its gradient also carries the z-loss (``fbt_megatron.model.losses``)."""
        if not self.z_loss.coeff:
            return super().compute_language_model_loss(labels, logits)
        loss = vocab_parallel_cross_entropy_z(logits, labels.transpose(0, 1).contiguous(), self.z_loss)
        return loss.transpose(0, 1).contiguous()

    def set_input_tensor(self, input_tensor):
        """What the pipeline schedule received for this stage: kept for ``distributed.pipeline.stage_pass``,
        which hands it to ``forward`` (as feedback on the first stage, hidden states elsewhere)."""
        self.received = input_tensor[0] if isinstance(input_tensor, list) else input_tensor

    def embed(self, input_ids, position_ids=None):
        """e_t = E[x_t] as [s, b, h] (scattered along the sequence under SP)."""
        return self.embedding(input_ids=input_ids, position_ids=position_ids)

    def forward(
        self,
        input_ids,
        position_ids=None,
        attention_mask=None,
        labels=None,
        feedback: Optional[Feedback] = None,
        hidden_states=None,
        embeddings=None,
        inference_context=None,
    ):
        """One pass. Returns ``(output, top_state)``: output is the per-token loss [b, s] when
        labels are given, else logits [b, s, V/tp]; top_state is s [s, b, h], the state fed back
        to the next pass. On a non-final pipeline stage: (hidden states, None).
        A first stage embeds ``input_ids`` (or takes ``embeddings`` from ``embed``) and fuses
        ``feedback`` in; a later stage starts from ``hidden_states``, the previous stage's output.
        ``inference_context`` (megatron's StaticInferenceContext, eval mode): the KV cache of
        ``fbt_megatron.generate``; the inputs are the positions after its ``sequence_len_offset``,
        and the logits only the last position's (megatron's static-batching default).
        ``attention_mask`` [b, 1, s, s] (True = masked; packed SFT rows, ``data.packed_rows.PackedRows``) replaces
        the causal mask; sliding-window layers keep their window. Local attention core only: TE's
        would take its own causal mask and ignore it."""
        if attention_mask is not None and not isinstance(self.decoder.layers[0].self_attention.core_attention,
                                                         FBTDotProductAttention):
            raise ValueError("packed rows (SFT) need the local attention core (fbt_model_spec(local_attention=True)); "
                             "Transformer Engine's would ignore the conversation boundaries")
        decoder_input = None
        if self.pre_process:
            decoder_input = self.embed(input_ids, position_ids) if embeddings is None else embeddings
            if feedback is not None:
                if self.feedback_fusion is None:
                    raise ValueError("this model was built without latent feedback (latent_feedback=False)")
                decoder_input = self.feedback_fusion(decoder_input, feedback)  # u_t where fused
            elif self.feedback_fusion is not None and torch.is_grad_enabled():
                decoder_input = self.feedback_fusion.keep_in_graph(decoder_input)
        else:
            self.decoder.set_input_tensor(hidden_states)
        decoder_input, rotary_pos_emb, *_ = self._preprocess(
            input_ids=input_ids, position_ids=position_ids, decoder_input=decoder_input,
            inference_context=inference_context,
        )
        # under full recompute the decoder keeps only each layer's input: in host memory if offloaded
        # (but for what a pipeline stage received, which the schedule holds until backward anyway)
        held = () if self.pre_process else (hidden_states,)
        with offloading(self.config, recomputed=self.config.recompute_granularity == "full", keep=held):
            hidden = self.decoder(hidden_states=decoder_input, attention_mask=attention_mask,
                                  rotary_pos_emb=rotary_pos_emb, inference_context=inference_context)
        if not self.post_process:
            return hidden, None
        normed = self.final_layernorm(hidden)
        top_state = normed if self.config.feedback_state == "final_norm" else hidden
        output = self._postprocess(
            hidden_states=normed,
            input_ids=input_ids,
            position_ids=position_ids,
            labels=labels,
            rotary_pos_emb=rotary_pos_emb,
            rotary_pos_cos=None,
            rotary_pos_sin=None,
            inference_context=inference_context,
            runtime_gather_output=True if inference_context is not None else None,
        )
        return output, top_state
