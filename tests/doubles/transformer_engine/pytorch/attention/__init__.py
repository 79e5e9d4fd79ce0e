"""TE's DotProductAttention (TE: pytorch/attention/dot_product_attention/dot_product_attention.py),
as its unfused backend computes it: softmax(q kᵀ · scale + mask) v in FP32, grouped-query heads
shared, the causal mask top-left aligned ("causal") or bottom-right ("causal_bottom_right", a
decode step), a sliding window (left, 0) on top. Inputs [s, b, heads, d] (sbhd), output
[s, b, heads · d]."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from transformer_engine.pytorch.attention.rope import apply_rotary_pos_emb  # noqa: F401

_MASK_TYPES = ("causal", "causal_bottom_right", "no_mask")


def mask(sq: int, sk: int, mask_type: str, window: Optional[Tuple[int, int]], device) -> Optional[torch.Tensor]:
    """[sq, sk] True where masked. Bottom-right alignment shifts query i to key i + sk − sq."""
    if mask_type == "no_mask" and window is None:
        return None
    shift = sk - sq if mask_type == "causal_bottom_right" else 0
    i = torch.arange(sq, device=device).unsqueeze(1) + shift
    j = torch.arange(sk, device=device).unsqueeze(0)
    masked = j > i if mask_type != "no_mask" else torch.zeros(sq, sk, dtype=torch.bool, device=device)
    if window is not None and window[0] >= 0:
        masked = masked | (j < i - window[0])
    return masked


class DotProductAttention(torch.nn.Module):
    def __init__(self, num_attention_heads: int, kv_channels, num_gqa_groups: Optional[int] = None,
                 attention_dropout: float = 0.0, attn_mask_type: str = "causal", window_size=None,
                 sequence_parallel: bool = False, tp_size: int = 1, get_rng_state_tracker=None, tp_group=None,
                 layer_number: Optional[int] = None, attention_type: str = "self", softmax_scale=None,
                 cp_group=None, softmax_type: str = "vanilla", return_max_logit: bool = False, **kwargs):
        super().__init__()
        if cp_group is not None or kwargs or attention_dropout or softmax_type != "vanilla" or return_max_logit:
            raise NotImplementedError("the TE double models self-attention without context parallelism, dropout, "
                                      "softmax variants or max-logit output")
        if attn_mask_type not in _MASK_TYPES:
            raise NotImplementedError(f"the TE double models mask types {_MASK_TYPES}, not {attn_mask_type!r}")
        channels = kv_channels if isinstance(kv_channels, int) else kv_channels[0]
        self.heads = num_attention_heads // tp_size
        self.groups = (num_gqa_groups or num_attention_heads) // tp_size
        self.softmax_scale = softmax_scale if softmax_scale is not None else channels ** -0.5
        self.attn_mask_type, self.window_size = attn_mask_type, window_size

    def forward(self, query, key, value, attention_mask=None, qkv_format: Optional[str] = None,
                attn_mask_type: Optional[str] = None, window_size=None, **kwargs):
        if attention_mask is not None or (qkv_format or "sbhd") != "sbhd" or kwargs:
            raise NotImplementedError("the TE double models sbhd attention without an explicit mask or packed sequences")
        mask_type = attn_mask_type or self.attn_mask_type
        if mask_type not in _MASK_TYPES:
            raise NotImplementedError(f"the TE double models mask types {_MASK_TYPES}, not {mask_type!r}")
        window = window_size if window_size is not None else self.window_size
        sq, b, h, d = query.shape
        repeat = h // key.shape[2]
        k = key.repeat_interleave(repeat, dim=2) if repeat > 1 else key
        v = value.repeat_interleave(repeat, dim=2) if repeat > 1 else value
        q, k, v = (x.float().permute(1, 2, 0, 3) for x in (query, k, v))  # [b, h, s, d]
        scores = (q @ k.transpose(-1, -2)) * self.softmax_scale
        masked = mask(sq, k.shape[2], mask_type, window, query.device)
        if masked is not None:
            scores = scores.masked_fill(masked, float("-inf"))
        out = torch.softmax(scores, dim=-1) @ v  # [b, h, sq, d]
        return out.permute(2, 0, 1, 3).reshape(sq, b, h * d).to(query.dtype)
