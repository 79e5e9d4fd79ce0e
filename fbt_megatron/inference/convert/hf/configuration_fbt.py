"""Configuration of the Full-Bandwidth Transformer (FBT) for Hugging Face transformers.

This file is copied verbatim into exported model folders and loaded with ``trust_remote_code=True``:
it imports only ``transformers`` (never the training code).

The backbone is a decoder-only transformer with
  * grouped-query attention with RMS-normalised queries and keys (``qk_norm``) and RoPE,
  * a headwise output gate: head h's output is scaled by sigmoid(w_hᵀ x) (``attention_gate``),
  * sandwich norms and depth-scaled residual branches (``sandwich_norm``, ``residual_scale`` = α):
        h ← h + α·RMSNorm_post(Sublayer(RMSNorm_pre(h))),
  * sliding-window attention on all layers but every ``full_attention_every``-th (1-based),
  * a SwiGLU MLP, a final RMSNorm and tied input/output embeddings.
With ``latent_feedback`` it also has the FBT fusion that feeds the previous position's top state
back into the input of the next one (see ``modeling_fbt.py``):
        u_t = RMSNorm(W_U s_{t−1} ⊙ sigmoid(W_G e_t)).
"""

from __future__ import annotations

import math

from huggingface_hub.dataclasses import strict
from transformers.configuration_utils import PreTrainedConfig

DECODE_MODES = ("standard", "soft", "fused")


@strict  # type-checks the fields and runs the validate_* methods on construction
class FBTConfig(PreTrainedConfig):
    r"""
    Args:
        vocab_size: rows of the embedding (the tokenizer's vocabulary, padded).
        hidden_size: D, the width of the residual stream.
        intermediate_size: width of the SwiGLU MLP.
        num_hidden_layers: L.
        num_attention_heads / num_key_value_heads / head_dim: grouped-query attention shape.
        rms_norm_eps: ε of every RMSNorm (layers, q/k norms, final norm, fusion norm).
        rope_theta: RoPE base θ.
        max_position_embeddings: the longest context the model is meant for (informational).
        sliding_window: W, or None: a windowed layer lets position t attend to t−W+1 … t.
        full_attention_every: None or k: layer l (1-based) is global iff l % k == 0 (with a window,
            None means every layer is windowed).
        layer_types: derived from the two above ("sliding_attention" / "full_attention" per layer).
        residual_scale: α of the depth-scaled residual; None means 1/√(2L).
        sandwich_norm: RMSNorm on every sublayer's output before the residual add.
        attention_gate: the headwise sigmoid gate on the attention output.
        qk_norm: RMSNorm (over head_dim) on queries and keys.
        latent_feedback: the model has the FBT fusion (False: the plain baseline, standard decoding only).
        feedback_source: the top state fed back, "residual" (h_L) or "final_norm" (RMSNorm_final(h_L)).
        decode_mode: default mode of ``generate``/``decode_logits`` (and of vLLM requests naming none):
            "standard", "soft" or "fused"; None: "soft" with latent feedback (the method's mode),
            "standard" for a baseline (the project's one default, ``fbt_megatron.model.decode_modes``).
        fused_prefill_passes: default n of fused(n) decoding (extra fused passes over the prompt).
    """

    model_type = "fbt"
    keys_to_ignore_at_inference = ["cache", "past_key_values"]

    vocab_size: int = 100352
    hidden_size: int = 1536
    intermediate_size: int = 6656
    num_hidden_layers: int = 24
    num_attention_heads: int = 16
    num_key_value_heads: int = 8
    head_dim: int = 96
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    sliding_window: int | None = 2048
    full_attention_every: int | None = 6
    layer_types: list[str] | None = None
    residual_scale: float | None = None
    sandwich_norm: bool = True
    attention_gate: bool = True
    qk_norm: bool = True
    latent_feedback: bool = True
    feedback_source: str = "residual"
    decode_mode: str | None = None
    fused_prefill_passes: int = 0
    initializer_range: float = 0.02
    attention_dropout: float = 0.0
    use_cache: bool = True
    tie_word_embeddings: bool = True
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    pad_token_id: int | None = 3

    def __post_init__(self, **kwargs):
        if self.layer_types is None:
            self.layer_types = [
                "sliding_attention" if self.layer_is_windowed(layer) else "full_attention"
                for layer in range(1, self.num_hidden_layers + 1)
            ]
        if self.residual_scale is None:
            self.residual_scale = 1.0 / math.sqrt(2 * self.num_hidden_layers)
        if self.decode_mode is None:
            self.decode_mode = "soft" if self.latent_feedback else "standard"
        super().__post_init__(**kwargs)

    def layer_is_windowed(self, layer: int) -> bool:
        """Whether layer ``layer`` (1-based) uses the sliding window."""
        if self.sliding_window is None:
            return False
        return not (self.full_attention_every and layer % self.full_attention_every == 0)

    def validate_architecture(self):
        """Run by @strict after construction (and by transformers before saving)."""
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {self.sliding_window}")
        if self.feedback_source not in ("residual", "final_norm"):
            raise ValueError(f"feedback_source must be 'residual' or 'final_norm', got {self.feedback_source!r}")
        if self.decode_mode not in DECODE_MODES:
            raise ValueError(f"decode_mode must be one of {DECODE_MODES}, got {self.decode_mode!r}")
        if self.decode_mode != "standard" and not self.latent_feedback:
            raise ValueError(f"decode_mode {self.decode_mode!r} needs latent feedback; this model has none (a baseline): "
                             "use decode_mode 'standard'")
        if self.fused_prefill_passes < 0:
            raise ValueError(f"fused_prefill_passes must be >= 0, got {self.fused_prefill_passes}")


__all__ = ["FBTConfig"]
