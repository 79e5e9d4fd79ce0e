"""Encoded conversations → packed training rows.

**Rows**: a conversation of n tokens gives n − 1 positions (input token, label). Conversations are
packed whole (never split) into rows of ``seq_length`` positions, best fit in a seeded random order,
padding at the end; rows are read in a seeded permutation per epoch. Per position: ``tokens``,
``labels``, ``loss_mask`` (1 where the label is an assistant token, its end of turn included; 0 on
system and user turns, role headers and padding), ``segments`` (which conversation; the padding is
one of its own) and ``plain`` (the input token is not the assistant's). No label crosses a boundary:
a conversation's last token is only a label.

**Attention and positions** (``data/packed_rows.PackedRows``): each conversation attends only to itself through an
explicit mask (later position or other conversation → masked) with megatron-core's local attention;
sliding-window layers keep their window (``layers.FBTDotProductAttention``). On GPUs the same mask
works with the local spec; Transformer Engine's route would be megatron-core's packed-sequence path
(``PackedSeqParams`` / ``cu_seqlens``, THD), not wired here (TE attention with packed rows is refused).
RoPE positions are not reset per conversation (Megatron's ``reset_position_ids`` off): RoPE scores
depend only on the distance between positions, so a conversation's attention does not depend on its
offset; tests/test_sft.py checks that a packed row's per-token losses equal each conversation's alone
(to float rounding).

**Prefix mixin** (``data.sft_prefix_mixin``). ``prompt`` (default): in fused passes every position whose
input is not an assistant token keeps its plain embedding — the prompt (system, first user turn and
the assistant header) and also later user turns; assistant tokens are fused. ``fbt_megatron.generate``
runs any prompt with plain embeddings and fuses only the tokens it generates, and continuing a
conversation means giving it the follow-up user turn as (part of) a prompt: so user turns are plain
and replies fused at every turn. (A follow-up re-prompted from scratch would run the earlier replies
plain too; in training they stay fused, as they were when generated.) A conversation's first position
is never fused either way. ``random``: the pretraining random prefix per row. Validation uses the
prompt in both cases (prompt-then-generate), so the two are measured alike.
"""

from __future__ import annotations

import bisect
from typing import Dict, List, Sequence

import numpy as np

from fbt_megatron.data.sft.chat import Conversation


def pack(lengths: Sequence[int], capacity: int, seed: int) -> List[List[int]]:
    """Rows of conversation indices whose lengths sum to at most ``capacity``: each conversation, in
    a seeded random order, goes to the row it fills best (the least free space that holds it; ties:
    the oldest row), else starts a new row. Deterministic for (lengths, capacity, seed)."""
    rows: List[List[int]] = []
    by_free: List[List[int]] = [[] for _ in range(capacity + 1)]  # free positions → rows, oldest first
    for i in np.random.default_rng(seed).permutation(len(lengths)).tolist():
        need = lengths[i]
        free = next((f for f in range(need, capacity + 1) if by_free[f]), None)
        if free is None:
            rows.append([])
            row, free = len(rows) - 1, capacity
        else:
            row = by_free[free].pop(0)
        rows[row].append(i)
        bisect.insort(by_free[free - need], row)
    return rows


class SFTDataset:
    """Packed rows of conversations (module docstring), indexed like a GPTDataset: item i is a dict
    of numpy arrays of ``seq_length`` positions; beyond one epoch the rows repeat in another
    seeded order."""

    def __init__(self, conversations: List[Conversation], seq_length: int, seed: int, pad: int):
        self.conversations, self.seq_length, self.seed, self.pad = conversations, seq_length, seed, pad
        self.rows = pack([len(c.ids) - 1 for c in conversations], seq_length, seed)
        self._orders: Dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def tokens(self) -> int:
        """Positions holding a conversation (not padding) over one epoch."""
        return sum(len(c.ids) - 1 for c in self.conversations)

    def __getitem__(self, index: int) -> dict:
        epoch, i = divmod(int(index), len(self.rows))
        if epoch not in self._orders:
            self._orders[epoch] = np.random.default_rng([self.seed, epoch]).permutation(len(self.rows))
        return self.row(self.rows[self._orders[epoch][i]])

    def row(self, members: Sequence[int]) -> dict:
        s = self.seq_length
        out = dict(tokens=np.full(s, self.pad, dtype=np.int64), labels=np.full(s, self.pad, dtype=np.int64),
                   loss_mask=np.zeros(s, dtype=np.float32), segments=np.full(s, len(members), dtype=np.int64),
                   plain=np.ones(s, dtype=bool))
        start = 0
        for segment, c in enumerate(self.conversations[m] for m in members):
            end = start + len(c.ids) - 1
            out["tokens"][start:end], out["labels"][start:end] = c.ids[:-1], c.ids[1:]
            out["loss_mask"][start:end] = c.assistant[1:]
            out["segments"][start:end] = segment
            out["plain"][start:end] = ~c.assistant[:-1]
            start = end
        return out
