"""TE's RoPE (TE: pytorch/attention/rope.py:346): the first d2 channels of each head rotated by
``freqs`` [s2, 1, 1, d2] (s2 ≥ s), the rest passed through; fused or not, computed in FP32."""

from __future__ import annotations

import torch


def apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor, tensor_format: str = "sbhd", start_positions=None,
                         interleaved: bool = False, fused: bool = False, cu_seqlens=None, cp_size: int = 1,
                         cp_rank: int = 0) -> torch.Tensor:
    if tensor_format != "sbhd" or interleaved or start_positions is not None or cp_size != 1:
        raise NotImplementedError("the TE double models RoPE in sbhd, not interleaved, without offsets or CP")
    rotary = freqs.shape[-1]
    angles = freqs[: t.shape[0]].float()
    x, rest = t[..., :rotary].float(), t[..., rotary:]
    first, second = x.chunk(2, dim=-1)
    rotated = torch.cat((-second, first), dim=-1)
    out = x * torch.cos(angles) + rotated * torch.sin(angles)
    return torch.cat((out.to(t.dtype), rest), dim=-1)
