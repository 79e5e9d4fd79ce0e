"""The Full-Bandwidth Transformer (FBT) in plain torch for Hugging Face transformers.

This file is copied verbatim into exported model folders and loaded with ``trust_remote_code=True``:
it imports only ``torch`` and ``transformers`` (never the training code).

Notation (the paper's): e_t is the token embedding at position t (0-based here), h_L the residual
stream after the last layer, s_t the *top state* of position t — h_L ("residual") or
RMSNorm_final(h_L) ("final_norm") as ``config.feedback_source`` says. The latent feedback fusion
(the FBT part) builds a position's input from the previous position's top state:

    u_t = RMSNorm_fb( W_U s_{t−1} ⊙ sigmoid(W_G e_t) )                                   (eq. F4)

Passes. Pass 1 is the plain model (inputs e_t). A fused pass j ≥ 2 runs the whole stack again on
all positions with inputs u_t = fuse(s^{(j−1)}_{t−1}, e_t) where fusion applies (else e_t), s^{(j−1)}
being pass j−1's top states. ``forward(num_passes=k, prefix_len=p)`` is training's teacher-forced
k-pass forward in eval mode: fusion at positions t ≥ max(1, p); the last pass's logits are output.

Decoding modes (``generate(decode_mode=...)``, ``decode_logits``):
  * standard: the plain model, one pass, no fusion at all.
  * soft: the prompt runs as a plain pass; every generated position t takes u_t = fuse(s_{t−1}, e_t),
    s_{t−1} the top state the model produced at position t−1 (the prompt's last one for the first
    generated token). Equal to the k-pass forward with prefix p (the prompt length), k = T − p + 1.
  * fused(n): n extra fused passes over the prompt (pass j = 2 … n+1 fuses at every position t ≥ 1
    of the prompt); the KV cache is the last pass's, and soft decoding continues from s^{(n+1)}_{p−1}.
    fused(0) = soft.
With left-padded batches, positions are counted from each row's first real token (position ids from
the attention mask); the first real token is never fused and padding never is.

The state fed back while decoding with a cache travels between ``forward`` calls as
``feedback_state`` ([batch, hidden], the last position's top state): the model returns it in its
output and ``generate`` hands it back through its model kwargs (``_update_model_kwargs_for_generation``).
Without a cache (``use_cache=False``) every call recomputes the whole recurrence in passes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation import GenerationMixin
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel

from .configuration_fbt import DECODE_MODES, FBTConfig

# transformers renamed the cache field of model outputs and of the mask functions from
# ``past_key_values`` to ``cache`` (5.20); this file supports both (the mask functions are called
# positionally, the outputs are built with the field this version has).
CACHE_FIELD = "cache" if "cache" in {f.name for f in fields(CausalLMOutputWithPast)} else "past_key_values"


# ---------------------------------------------------------------- building blocks
class FBTRMSNorm(nn.Module):
    """y = x / sqrt(mean(x²) + ε) · g (over the last dimension)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.variance_epsilon)

    def extra_repr(self):
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


class FBTRotaryEmbedding(nn.Module):
    """RoPE (rotate-half convention) with base θ = config.rope_theta over head_dim."""

    def __init__(self, config: FBTConfig):
        super().__init__()
        self.config = config
        self.rope_type = "default"
        inv_freq, self.attention_scaling = self.compute_default_rope_parameters(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("original_inv_freq", inv_freq.clone(), persistent=False)

    @staticmethod
    def compute_default_rope_parameters(config: FBTConfig, device=None, **kwargs) -> tuple[torch.Tensor, float]:
        dim = config.head_dim
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float, device=device) / dim))
        return inv_freq, 1.0

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)  # [b, s, head_dim]
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    """q, k: [b, heads, s, head_dim]; cos, sin: [b, s, head_dim]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def repeat_kv(hidden_states: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[b, kv_heads, s, d] → [b, kv_heads·n_rep, s, d] (each key/value head serves n_rep query heads)."""
    if n_rep == 1:
        return hidden_states
    b, kv_heads, s, d = hidden_states.shape
    return hidden_states[:, :, None].expand(b, kv_heads, n_rep, s, d).reshape(b, kv_heads * n_rep, s, d)


def eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Reference attention (``attn_implementation="eager"``); the default is torch's SDPA."""
    key, value = repeat_kv(key, module.num_key_value_groups), repeat_kv(value, module.num_key_value_groups)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        scores = scores + attention_mask
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    probs = F.dropout(probs, p=dropout, training=module.training)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), probs


class FBTAttention(nn.Module):
    """Grouped-query self-attention with q/k RMSNorm, RoPE, an optional sliding window and the
    headwise output gate: o_h ← o_h · sigmoid(w_hᵀ x) before the output projection, x being the
    attention's (normed) input."""

    def __init__(self, config: FBTConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.is_causal = True
        self.attention_dropout = config.attention_dropout
        self.layer_type = config.layer_types[layer_idx]
        self.sliding_window = config.sliding_window if self.layer_type == "sliding_attention" else None
        d = config.hidden_size
        self.q_proj = nn.Linear(d, config.num_attention_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d, config.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, config.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, d, bias=False)
        self.q_norm = FBTRMSNorm(self.head_dim, eps=config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = FBTRMSNorm(self.head_dim, eps=config.rms_norm_eps) if config.qk_norm else None
        # the headwise gate w_h, one row per query head
        self.gate_proj = nn.Linear(d, config.num_attention_heads, bias=False) if config.attention_gate else None

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
        cache: Cache | None = None,
    ) -> torch.Tensor:
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query = self.q_proj(hidden_states).view(hidden_shape)
        key = self.k_proj(hidden_states).view(hidden_shape)
        if self.q_norm is not None:  # RMSNorm over head_dim, before RoPE
            query, key = self.q_norm(query), self.k_norm(key)
        query, key = query.transpose(1, 2), key.transpose(1, 2)
        value = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        query, key = apply_rotary_pos_emb(query, key, *position_embeddings)
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx)

        attention: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        out, _ = attention(
            self,
            query,
            key,
            value,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            sliding_window=self.sliding_window,
        )  # [b, s, heads, head_dim]
        if self.gate_proj is not None:
            out = out * torch.sigmoid(self.gate_proj(hidden_states)).unsqueeze(-1)
        return self.o_proj(out.reshape(*input_shape, -1))


class FBTMLP(nn.Module):
    """SwiGLU: down(silu(gate x) ⊙ up x)."""

    def __init__(self, config: FBTConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class FBTDecoderLayer(nn.Module):
    """h ← h + α·post_attention_layernorm(Attn(input_layernorm(h)));
    h ← h + α·post_feedforward_layernorm(MLP(pre_feedforward_layernorm(h))).
    Without sandwich norms the post-sublayer norms are absent (the identity)."""

    def __init__(self, config: FBTConfig, layer_idx: int):
        super().__init__()
        eps = config.rms_norm_eps
        self.attention_type = config.layer_types[layer_idx]
        self.residual_scale = config.residual_scale  # α
        self.input_layernorm = FBTRMSNorm(config.hidden_size, eps)
        self.self_attn = FBTAttention(config, layer_idx)
        self.pre_feedforward_layernorm = FBTRMSNorm(config.hidden_size, eps)
        self.mlp = FBTMLP(config)
        self.post_attention_layernorm = FBTRMSNorm(config.hidden_size, eps) if config.sandwich_norm else None
        self.post_feedforward_layernorm = FBTRMSNorm(config.hidden_size, eps) if config.sandwich_norm else None

    def forward(self, hidden_states, attention_mask, position_embeddings, cache=None) -> torch.Tensor:
        out = self.self_attn(self.input_layernorm(hidden_states), position_embeddings, attention_mask, cache)
        if self.post_attention_layernorm is not None:
            out = self.post_attention_layernorm(out)
        hidden_states = torch.add(hidden_states, out, alpha=self.residual_scale)
        out = self.mlp(self.pre_feedforward_layernorm(hidden_states))
        if self.post_feedforward_layernorm is not None:
            out = self.post_feedforward_layernorm(out)
        return torch.add(hidden_states, out, alpha=self.residual_scale)


class FBTFeedbackFusion(nn.Module):
    """The latent feedback fusion (eq. F4): the carried state is the value, the token only gates.
    u_t = norm(up_proj(s_{t−1}) ⊙ sigmoid(gate_proj(e_t))), up_proj = W_U, gate_proj = W_G."""

    def __init__(self, config: FBTConfig):
        super().__init__()
        d = config.hidden_size
        self.up_proj = nn.Linear(d, d, bias=False)  # W_U
        self.gate_proj = nn.Linear(d, d, bias=False)  # W_G
        self.norm = FBTRMSNorm(d, config.rms_norm_eps)

    def forward(self, carried: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
        """carried: s_{t−1} aligned with position t; embeddings: e_t (same shape)."""
        return self.norm(self.up_proj(carried) * torch.sigmoid(self.gate_proj(embeddings)))


def shift_right(states: torch.Tensor) -> torch.Tensor:
    """[b, s, d] → the previous position's row at every position (zeros at position 0)."""
    return F.pad(states[:, :-1], (0, 0, 1, 0))


@dataclass
class PassContext:
    """What every pass over the same positions shares: attention masks per layer type and RoPE."""

    masks: dict
    position_embeddings: tuple[torch.Tensor, torch.Tensor]


# ---------------------------------------------------------------- models
class FBTPreTrainedModel(PreTrainedModel):
    config_class = FBTConfig
    config: FBTConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = False
    _no_split_modules = ["FBTDecoderLayer"]
    _supports_sdpa = True
    _supports_flash_attn = False
    _supports_flex_attn = False
    _supports_attention_backend = True
    _can_compile_fullgraph = False


class FBTModel(FBTPreTrainedModel):
    """The backbone: embeddings, decoder layers, final norm and the feedback fusion."""

    def __init__(self, config: FBTConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(FBTDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = FBTRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = FBTRotaryEmbedding(config)
        self.feedback = FBTFeedbackFusion(config) if config.latent_feedback else None
        self.has_full_layers = "full_attention" in config.layer_types
        self.has_sliding_layers = "sliding_attention" in config.layer_types
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def context(self, inputs_embeds, attention_mask, position_ids, cache) -> PassContext:
        """Masks (causal, windowed on sliding layers, padded keys hidden) and RoPE for the positions
        of ``inputs_embeds`` [b, q, d], given the cache they are appended to (or None)."""
        mask_args = (self.config, inputs_embeds, attention_mask, cache, position_ids)  # positional: see CACHE_FIELD
        masks = {}
        if self.has_full_layers:
            masks["full_attention"] = create_causal_mask(*mask_args)
        if self.has_sliding_layers:
            masks["sliding_attention"] = create_sliding_window_causal_mask(*mask_args)
        return PassContext(masks, self.rotary_emb(inputs_embeds, position_ids))

    def stack(self, inputs_embeds: torch.Tensor, ctx: PassContext, cache: Cache | None = None) -> torch.Tensor:
        """One pass of the decoder layers: inputs [b, q, d] → h_L (before the final norm)."""
        hidden = inputs_embeds
        for layer in self.layers:
            hidden = layer(hidden, ctx.masks[layer.attention_type], ctx.position_embeddings, cache)
        return hidden

    def top_state(self, hidden: torch.Tensor, normed: torch.Tensor) -> torch.Tensor:
        """s: the state fed back, h_L or RMSNorm_final(h_L)."""
        return normed if self.config.feedback_source == "final_norm" else hidden

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        past_key_values: Cache | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        """One plain pass (transformers' base-model convention: ``last_hidden_state`` is after the
        final norm). The multi-pass and decoding logic lives in ``FBTForCausalLM``."""
        cache = cache if cache is not None else past_key_values
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        past = cache.get_seq_length() if cache is not None else 0
        position_ids = _position_ids(attention_mask, position_ids, past, inputs_embeds)
        hidden = self.stack(inputs_embeds, self.context(inputs_embeds, attention_mask, position_ids, cache), cache)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden), **{CACHE_FIELD: cache if use_cache else None})


def _position_ids(attention_mask, position_ids, past, inputs_embeds) -> torch.Tensor:
    """Position ids of the q new tokens: given, else counted from each row's first real token (the
    2D attention mask covers past + q tokens), else past … past+q−1."""
    if position_ids is not None:
        return position_ids
    q = inputs_embeds.shape[1]
    if attention_mask is not None and attention_mask.dim() == 2:
        return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -q:]
    return torch.arange(past, past + q, device=inputs_embeds.device).unsqueeze(0)


@dataclass
class FBTCausalLMOutputWithPast(CausalLMOutputWithPast):
    """CausalLMOutputWithPast plus ``feedback_state`` [b, d]: while decoding in soft/fused mode, the
    top state of the last position, fed back into the next generated token."""

    feedback_state: torch.FloatTensor | None = None


class FBTForCausalLM(FBTPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: FBTConfig):
        super().__init__(config)
        self.model = FBTModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)  # tied: logits = norm(h_L)·Eᵀ
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, new_embeddings):
        self.lm_head = new_embeddings

    # ------------------------------------------------------------ forward
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        num_passes: int = 1,
        prefix_len: int | torch.Tensor = 0,
        decode_mode: str | None = None,
        fused_prefill_passes: int | None = None,
        prompt_length: int | None = None,
        feedback_state: torch.Tensor | None = None,
        logits_to_keep: int = 0,
        past_key_values: Cache | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> FBTCausalLMOutputWithPast:
        r"""
        num_passes, prefix_len: the teacher-forced k-pass forward (eval semantics, no jitter): pass j ≥ 2
            fuses at positions t ≥ max(1, prefix_len) (an int or a [b] tensor, counted in real tokens);
            the logits are the last pass's. A cache, if any, holds the last pass's keys/values.
        decode_mode, fused_prefill_passes, prompt_length, feedback_state: decoding semantics (set by
            ``generate``; see the module docstring). ``prompt_length`` is the (padded) prompt length:
            positions before it are the prompt, the rest are generated tokens. It defaults to "this
            call is the prompt" on an empty cache and "these are generated tokens" otherwise.
            ``feedback_state`` is the fed-back state from the previous call (``output.feedback_state``).
        """
        cache = cache if cache is not None else past_key_values
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        if inputs_embeds is None:
            inputs_embeds = self.model.embed_tokens(input_ids)  # e_t
        past = cache.get_seq_length() if cache is not None else 0
        position_ids = _position_ids(attention_mask, position_ids, past, inputs_embeds)

        state = None
        if decode_mode is not None and decode_mode != "standard":
            n = _resolve_mode(self.config, decode_mode, fused_prefill_passes)
            if cache is None:
                normed, _ = self._decode_recompute(inputs_embeds, attention_mask, position_ids, n, prompt_length)
            else:
                normed, state = self._decode_cached(
                    inputs_embeds, attention_mask, position_ids, cache, past, n, prompt_length, feedback_state
                )
        else:
            if num_passes < 1 or (decode_mode == "standard" and num_passes != 1):
                raise ValueError(f"num_passes must be >= 1 (and 1 in standard decoding), got {num_passes}")
            if num_passes > 1:
                self._require_feedback("num_passes > 1")
                if past > 0:
                    raise ValueError("num_passes > 1 needs the whole sequence in one call (an empty cache)")
            ctx = self.model.context(inputs_embeds, attention_mask, position_ids, cache)
            fuse_at = None
            if num_passes > 1:  # fusion at real positions t ≥ max(1, p)
                prefix = torch.as_tensor(prefix_len, device=position_ids.device).clamp(min=1)
                prefix = prefix.unsqueeze(-1) if prefix.dim() == 1 else prefix
                fuse_at = _real_tokens(attention_mask, inputs_embeds) & (position_ids >= prefix)
            normed, _ = self._passes(inputs_embeds, ctx, num_passes, lambda j: fuse_at, cache)

        keep = slice(-logits_to_keep, None) if logits_to_keep else slice(None)
        logits = self.lm_head(normed[:, keep])
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        output = FBTCausalLMOutputWithPast(
            loss=loss, logits=logits, feedback_state=state, **{CACHE_FIELD: cache if use_cache else None}
        )
        return output if return_dict is not False else output.to_tuple()

    def _require_feedback(self, what: str):
        if self.model.feedback is None:
            raise ValueError(f"{what} needs latent feedback; this model has none (latent_feedback=False)")

    def _passes(self, embeds, ctx, num_passes, fuse_at, cache):
        """Passes 1 … num_passes over the same positions → the last one's (RMSNorm_final(h_L), s).
        Pass 1 takes e_t; pass j ≥ 2 takes fuse(s^{(j−1)}_{t−1}, e_t) where ``fuse_at(j)`` [b, q] is
        True and keeps its previous input elsewhere. Only the last pass writes into ``cache`` (the
        masks in ``ctx`` are the same with and without it: every multi-pass call starts from an
        empty cache)."""
        inputs = embeds
        for j in range(1, num_passes + 1):
            if j > 1:  # u_t = fuse(s^{(j−1)}_{t−1}, e_t)
                fused = self.model.feedback(shift_right(top), embeds)
                inputs = torch.where(fuse_at(j).unsqueeze(-1), fused, inputs)
            hidden = self.model.stack(inputs, ctx, cache if j == num_passes else None)
            normed = self.model.norm(hidden)
            top = self.model.top_state(hidden, normed)
        return normed, top

    def _decode_recompute(self, embeds, attention_mask, position_ids, n, prompt_length):
        """Decoding semantics without a cache, over a whole sequence [b, T] whose first
        ``prompt_length`` positions are the prompt: passes 1 … n+1 fuse at every real position ≥ 1
        (the prompt's fused passes), after which the prompt's inputs are frozen and every further
        pass fuses at the generated positions only. Each pass makes one more generated position
        exact: n + 1 + (T − p) passes in all. → (RMSNorm_final(h_L), s) of the last pass."""
        self._require_feedback("soft/fused decoding")
        seq = embeds.shape[1]
        prompt_length = seq if prompt_length is None else prompt_length
        fusable = _real_tokens(attention_mask, embeds) & (position_ids >= 1)
        generated = (torch.arange(seq, device=embeds.device) >= prompt_length).unsqueeze(0)
        later_passes = fusable & generated  # passes n+2 …: the generated positions only
        ctx = self.model.context(embeds, attention_mask, position_ids, None)
        num_passes = n + 1 + max(0, seq - prompt_length)
        return self._passes(embeds, ctx, num_passes, lambda j: fusable if j <= n + 1 else later_passes, None)

    def _decode_cached(self, embeds, attention_mask, position_ids, cache, past, n, prompt_length, state):
        """Decoding semantics with a KV cache: the new positions past … past+q−1 that belong to the
        prompt run in n+1 passes (the cache keeps the last pass's keys/values); the generated ones
        run one at a time, each fed the top state of the position before it (``state`` for the
        first one when the prompt was an earlier call). → (RMSNorm_final(h_L), the last top state)."""
        self._require_feedback("soft/fused decoding")
        q = embeds.shape[1]
        if prompt_length is None:
            prompt_length = past + q if past == 0 else past
        in_prompt = max(0, min(prompt_length - past, q))
        normed_parts = []
        if in_prompt > 0:
            if n > 0 and (past > 0 or in_prompt < prompt_length):
                raise ValueError("fused decoding needs the whole prompt in one forward call (no chunked prefill)")
            mask = None if attention_mask is None else attention_mask[:, : past + in_prompt]
            part = embeds[:, :in_prompt]
            ctx = self.model.context(part, mask, position_ids[:, :in_prompt], cache)
            fuse_at = _real_tokens(mask, part) & (position_ids[:, :in_prompt] >= 1)
            normed, top = self._passes(part, ctx, n + 1, lambda j: fuse_at, cache)
            state = top[:, -1]
            normed_parts.append(normed)
        for i in range(in_prompt, q):  # generated positions: u_t = fuse(s_{t−1}, e_t)
            if state is None:
                raise ValueError("a generated position needs feedback_state (the previous position's top state)")
            e = embeds[:, i : i + 1]
            u = self.model.feedback(state.unsqueeze(1), e)
            mask = None if attention_mask is None else attention_mask[:, : past + i + 1]
            ctx = self.model.context(u, mask, position_ids[:, i : i + 1], cache)
            hidden = self.model.stack(u, ctx, cache)
            normed = self.model.norm(hidden)
            state = self.model.top_state(hidden, normed)[:, -1]
            normed_parts.append(normed)
        normed = normed_parts[0] if len(normed_parts) == 1 else torch.cat(normed_parts, 1)
        return normed, state

    # ------------------------------------------------------------ generation
    def _update_model_kwargs_for_generation(self, outputs, model_kwargs, is_encoder_decoder=False, num_new_tokens=1):
        """Besides transformers' bookkeeping, carry the fed-back top state to the next step."""
        model_kwargs = super()._update_model_kwargs_for_generation(
            outputs, model_kwargs, is_encoder_decoder=is_encoder_decoder, num_new_tokens=num_new_tokens
        )
        state = getattr(outputs, "feedback_state", None)
        if state is not None:
            model_kwargs["feedback_state"] = state
        return model_kwargs

    def generate(self, inputs=None, generation_config=None, decode_mode=None, fused_prefill_passes=None, **kwargs):
        """transformers' ``generate`` with ``decode_mode`` "standard" | "soft" | "fused" and
        ``fused_prefill_passes`` n (defaults: ``config.decode_mode``, ``config.fused_prefill_passes``).
        Soft and fused decoding support greedy search and sampling (no beams, no assistants); every
        mode decodes with the dynamic cache (the default)."""
        mode = decode_mode or self.config.decode_mode
        n = _resolve_mode(self.config, mode, fused_prefill_passes)
        config = generation_config or self.generation_config
        setting = lambda name: kwargs.get(name, getattr(config, name, None))  # noqa: E731
        if setting("cache_implementation") not in (None, "dynamic"):
            raise ValueError(f"cache_implementation={setting('cache_implementation')!r} is not supported: this model "
                             "decodes with the dynamic cache (its sliding windows and fed-back state); drop the argument")
        if mode == "standard":
            return super().generate(inputs, generation_config, **kwargs)
        self._require_feedback(f"decode_mode={mode!r}")
        if (setting("num_beams") or 1) > 1 or setting("prompt_lookup_num_tokens") or setting("penalty_alpha"):
            raise ValueError(f"decode_mode={mode!r} supports greedy search and sampling only (no beams, no lookup)")
        if kwargs.get("assistant_model") is not None or kwargs.get("inputs_embeds") is not None:
            raise ValueError(f"decode_mode={mode!r} supports token prompts without an assistant model only")
        prompt = inputs if inputs is not None else kwargs.get("input_ids")
        if prompt is None:
            raise ValueError(f"decode_mode={mode!r} needs a prompt (input_ids)")
        kwargs.update(decode_mode=mode, fused_prefill_passes=n, prompt_length=prompt.shape[1])
        return super().generate(inputs, generation_config, **kwargs)

    @torch.no_grad()
    def decode_logits(self, input_ids, prompt_length: int, decode_mode=None, fused_prefill_passes=None):
        """Teacher-forced scoring as decoding would produce it: logits [b, T, V] for ``input_ids``
        [b, T] (no padding). Positions < prompt_length are the mode's prefill (standard and soft: the
        plain pass; fused(n): the (n+1)-th pass); positions ≥ prompt_length are the plain pass in
        standard mode, else fed back one step at a time through the KV cache (soft decoding)."""
        mode = decode_mode or self.config.decode_mode
        n = _resolve_mode(self.config, mode, fused_prefill_passes)
        if not 1 <= prompt_length <= input_ids.shape[1]:
            raise ValueError(f"prompt_length must be in [1, {input_ids.shape[1]}], got {prompt_length}")
        if mode == "standard":
            return self(input_ids=input_ids, use_cache=False).logits
        cache = DynamicCache(config=self.config)
        out = self(
            input_ids=input_ids,
            cache=cache,
            use_cache=True,
            decode_mode=mode,
            fused_prefill_passes=n,
            prompt_length=prompt_length,
        )
        return out.logits


def _real_tokens(attention_mask, inputs_embeds) -> torch.Tensor:
    """[b, q] bool: which of the q new positions are real tokens (not padding)."""
    q = inputs_embeds.shape[1]
    if attention_mask is None or attention_mask.dim() != 2:
        return torch.ones(1, q, dtype=torch.bool, device=inputs_embeds.device)
    return attention_mask[:, -q:].bool()


def _resolve_mode(config, decode_mode, fused_prefill_passes) -> int:
    """Checks a decoding mode; returns its number of extra fused prompt passes n (0 unless fused)."""
    if decode_mode not in DECODE_MODES:
        raise ValueError(f"decode_mode must be one of {DECODE_MODES}, got {decode_mode!r}")
    if decode_mode != "fused":
        return 0
    n = config.fused_prefill_passes if fused_prefill_passes is None else int(fused_prefill_passes)
    if n < 0:
        raise ValueError(f"fused_prefill_passes must be >= 0, got {n}")
    return n


__all__ = ["FBTForCausalLM", "FBTModel", "FBTPreTrainedModel"]
