"""The fed-back state of every request, and the plan of one forward step.

The model keeps ``buffer`` [slots, hidden]: row ``s`` holds the top state of the latest computed
position of the request that owns slot ``s`` (the EAGLE/MTP pattern of the paper's appendix D). The
buffer and the per-token index tensors are allocated once (their addresses never change). Slot 0 is
scratch: rows of standard requests write there. A request takes a slot at its first step in a
soft/fused mode and gives it back when it finishes, is aborted or is preempted (a preempted request
comes back as one prefill from position 0, so its state is recomputed).

A step's packed tokens are grouped by request (``query_start_loc``). Per token (position t of a
request with prompt length p, first position of the step t0):

* standard request, or t = 0: the plain embedding e_t, one pass;
* fused(n), 1 <= t < p: the prompt's fused passes 2 … n+1 take fuse(s^{(j-1)}_{t-1}, e_t) from the
  previous pass of the same step (the whole prompt must be in the step);
* t >= p, t = t0 (a decoded position whose predecessor was computed before): fuse(buffer, e_t);
* t >= p, t > t0 (scoring's continuation, a preempted request's recomputed tokens, the first
  decoded position after a prefill chunk in the same step): fuse(s_{t-1}, e_t) with s_{t-1} from
  the previous pass: each pass makes one more such position exact.

The step runs max over its requests of (n+1 or 1) + (those chained positions) passes; requests
that need fewer keep their inputs, so their extra passes recompute the same keys and values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional

import numpy as np
import torch

from fbt_megatron.serving.requests import RequestMode

UNBOUNDED = 1 << 30  # fuse_until of chained positions: every pass


@dataclass
class Row:
    """One request of a step."""

    req_id: str
    start: int  # first token index in the packed batch
    end: int  # one past the last
    first_position: int  # t0
    prompt_length: int  # p (the scored context's length when given)
    mode: RequestMode


@dataclass
class StepPlan:
    num_tokens: int
    passes: int
    any_buffer: bool  # some token reads the buffer in pass 1
    fuse_until: Optional[torch.Tensor]  # [chained/fused-prompt tokens] pass limits (None: single pass)
    fuse_index: Optional[torch.Tensor]  # [the same tokens] their indices
    write_rows: int  # rows whose states are written back


class FeedbackState:
    """The buffer, the slots and the plan of each step (see the module docstring)."""

    def __init__(self, max_num_seqs: int, max_num_tokens: int, hidden_size: int, dtype, device):
        self.slots = max_num_seqs + 1  # + the scratch slot 0
        self.buffer = torch.zeros(self.slots, hidden_size, dtype=dtype, device=device)
        # per token of a step: the slot it reads in pass 1, and whether it does
        self.token_slot = torch.zeros(max_num_tokens, dtype=torch.long, device=device)
        self.token_reads = torch.zeros(max_num_tokens, 1, dtype=torch.bool, device=device)
        # per row: the slot written after the step, from which token
        self.row_slot = torch.zeros(max_num_seqs, dtype=torch.long, device=device)
        self.row_last = torch.zeros(max_num_seqs, dtype=torch.long, device=device)
        self._owner: Dict[str, int] = {}  # request id -> slot
        self._free: List[int] = list(range(self.slots - 1, 0, -1))
        self._position = np.full(self.slots, -1, dtype=np.int64)  # the position each slot's state is of
        self.plan: Optional[StepPlan] = None
        self.stats = {"steps": 0, "max_passes": 0, "preempted": 0}

    # ------------------------------------------------------------ slots
    @property
    def in_use(self) -> int:
        return len(self._owner)

    def release(self, req_ids: Iterable[str], preempted: bool = False) -> None:
        """Finished, aborted or preempted requests give their slots back."""
        for req_id in req_ids:
            self.stats["preempted"] += int(preempted)
            slot = self._owner.pop(req_id, None)
            if slot is not None:
                self._position[slot] = -1
                self._free.append(slot)

    def _slot(self, req_id: str) -> int:
        slot = self._owner.get(req_id)
        if slot is None:
            if not self._free:
                raise RuntimeError(f"FBT state buffer full ({self.slots - 1} slots): more running requests than "
                                   "max_num_seqs, or slots were not freed")
            slot = self._owner[req_id] = self._free.pop()
        return slot

    # ------------------------------------------------------------ a step
    def prepare(self, rows: List[Row]) -> StepPlan:
        """Fill the step's index tensors and return its plan."""
        num_tokens = rows[-1].end if rows else 0
        token_slot = np.zeros(num_tokens, dtype=np.int64)
        token_reads = np.zeros(num_tokens, dtype=bool)
        row_slot = np.zeros(len(rows), dtype=np.int64)
        row_last = np.zeros(len(rows), dtype=np.int64)
        fuse_index: List[np.ndarray] = []
        fuse_until: List[np.ndarray] = []
        passes = 1
        for i, row in enumerate(rows):
            row_last[i] = row.end - 1
            if not row.mode.feedback:
                continue
            slot = row_slot[i] = self._slot(row.req_id)
            p, t0, count = row.prompt_length, row.first_position, row.end - row.start
            positions = np.arange(t0, t0 + count)
            base = 1
            if row.mode.mode == "fused" and t0 < p:
                if t0 != 0 or t0 + count < p:
                    raise RuntimeError(
                        f"request {row.req_id}: fused({row.mode.passes}) got positions {t0}…{t0 + count - 1} of a "
                        f"{p}-token prompt in one step; it needs the whole prompt at once (no chunked prefill)")
                prompt = np.nonzero((positions >= 1) & (positions < p))[0]
                if row.mode.passes and len(prompt):
                    fuse_index.append(row.start + prompt)
                    fuse_until.append(np.full(len(prompt), row.mode.passes + 1))
                    base = row.mode.passes + 1
            decoded = (positions >= p) & (positions >= 1)
            if decoded[0]:  # its predecessor was computed in an earlier step
                if self._position[slot] != t0 - 1:
                    raise RuntimeError(f"request {row.req_id}: the fed-back state is of position "
                                       f"{self._position[slot]}, position {t0} needs {t0 - 1}'s")
                token_slot[row.start] = slot
                token_reads[row.start] = True
            chained = np.nonzero(decoded[1:])[0] + 1
            if len(chained):
                fuse_index.append(row.start + chained)
                fuse_until.append(np.full(len(chained), UNBOUNDED))
            passes = max(passes, base + len(chained))
            self._position[slot] = t0 + count - 1
        device = self.buffer.device
        self.token_slot[:num_tokens].copy_(torch.from_numpy(token_slot), non_blocking=True)
        self.token_reads[:num_tokens, 0].copy_(torch.from_numpy(token_reads), non_blocking=True)
        self.row_slot[: len(rows)].copy_(torch.from_numpy(row_slot), non_blocking=True)
        self.row_last[: len(rows)].copy_(torch.from_numpy(row_last), non_blocking=True)
        index = until = None
        if fuse_index:
            index = torch.from_numpy(np.concatenate(fuse_index)).to(device)
            until = torch.from_numpy(np.concatenate(fuse_until)).to(device)
        self.plan = StepPlan(num_tokens, passes, bool(token_reads.any()), until, index, len(rows))
        self.stats["steps"] += 1
        self.stats["max_passes"] = max(self.stats["max_passes"], passes)
        return self.plan

    def write_back(self, top: torch.Tensor) -> None:
        """After the step: every soft/fused row's last top state into its slot (others: scratch)."""
        rows = self.plan.write_rows
        self.buffer.index_copy_(0, self.row_slot[:rows], top[self.row_last[:rows]].to(self.buffer.dtype))


def summary(model) -> dict:
    """The state buffer of a served model at a glance, for ``LLM.apply_model(summary)``: slots in
    use, the buffer's shape and address, and the step counters."""
    s = model.feedback_state
    return {"in_use": s.in_use, "shape": tuple(s.buffer.shape), "address": s.buffer.data_ptr(), **s.stats}
