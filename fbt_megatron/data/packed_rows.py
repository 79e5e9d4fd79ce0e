"""Conversations packed into the rows of a microbatch (SFT): what attention and the fusion see.

Several conversations share a row (``fbt_megatron.data.sft`` packs them); each attends only to
itself, and its first position takes e_t like position 1 of a sequence, so no carried state crosses
a boundary (``fbt.make_feedback`` asks ``fusable``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass
class PackedRows:
    """Conversations packed into the rows of a microbatch (``fbt_megatron.data.sft``).

    Attention stays inside a conversation (``attention_mask``) and the carried state does not
    cross into the next one: a conversation's first position is never fused. In the fused passes
    the prompt positions keep e_t (the prompt-aware prefix mixin) when ``prompt_prefix`` is set,
    and always in evaluation (prompt-then-generate); otherwise training draws the pretraining
    random prefix per row."""

    segments: torch.Tensor  # [b, s] which conversation each position belongs to (padding: one of its own)
    plain: torch.Tensor  # [b, s] bool: prompt positions (every token that is not the assistant's)
    prompt_prefix: bool = True  # training: the prompt is the prefix (else a random prefix per row)

    @cached_property
    def starts(self) -> torch.Tensor:
        """[b, s] bool: the first position of each conversation (and of the padding)."""
        first = torch.ones_like(self.segments[:, :1], dtype=torch.bool)
        return torch.cat([first, self.segments[:, 1:] != self.segments[:, :-1]], dim=1)

    @cached_property
    def attention_mask(self) -> torch.Tensor:
        """[b, 1, s, s] bool, True = masked (megatron's convention): a later position or another
        conversation. A sliding-window layer adds its window (``layers.FBTDotProductAttention``)."""
        s = self.segments.shape[1]
        later = torch.ones(s, s, dtype=torch.bool, device=self.segments.device).triu(1)
        other = self.segments.unsqueeze(2) != self.segments.unsqueeze(1)
        return (other | later).unsqueeze(1)

    def uses_prompt(self, training: bool) -> bool:
        return self.prompt_prefix or not training

    def fusable(self, training: bool) -> torch.Tensor:
        """[s, b] bool: where a fused pass may use u_t — not at a conversation's first position,
        nor on its prompt when the prompt is the prefix."""
        allowed = ~self.starts
        if self.uses_prompt(training):
            allowed = allowed & ~self.plain
        return allowed.transpose(0, 1)
