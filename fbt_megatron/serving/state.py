"""The fed-back state of every request, and the plan of one forward step.

The model keeps ``buffer`` [slots, hidden]: row ``s`` holds the top state of the latest computed
position of the request that owns slot ``s`` (the EAGLE/MTP pattern of the paper's appendix D). The
buffer, ``carried`` [tokens, hidden] (each token's fed-back state in the current pass) and the
per-token index tensors are allocated once (their addresses never change). Slot 0 is scratch:
every token that is not the last of a soft/fused request writes there. Per token of a step,
``token_slot`` says which slot it takes its state from before pass 1, ``token_reads`` whether its
input is fused, ``token_write`` which slot its top state goes to. A pass is then the same tensor
program for every step whatever its requests are (the compiled step, ``model``); a forward outside
the plan (vLLM's profile and dummy runs, CUDA-graph capture) finds them neutral (no reads, every
write to scratch): ``finish`` restores that after each step.

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
    fuse_until: Optional[torch.Tensor]  # [chained/fused-prompt tokens] pass limits (None: single pass)
    fuse_index: Optional[torch.Tensor]  # [the same tokens] their indices
    feedback: bool  # some row is soft/fused (the index tensors were filled)


class FeedbackState:
    """The buffer, the slots and the plan of each step (see the module docstring)."""

    def __init__(self, max_num_seqs: int, max_num_tokens: int, hidden_size: int, dtype, device):
        self.slots = max_num_seqs + 1  # + the scratch slot 0
        device = torch.device(device)
        self.buffer = torch.zeros(self.slots, hidden_size, dtype=dtype, device=device)
        self.carried = torch.zeros(max_num_tokens, hidden_size, dtype=dtype, device=device)
        # per token of a step: the slot it reads in pass 1, whether it does, the slot its top state
        # is written to (0: scratch). Filled on the host each step; on CPU the tensors share the host
        # arrays' memory (no copy), elsewhere they are copied over.
        self._host = dict(token_slot=np.zeros(max_num_tokens, dtype=np.int64),
                          token_reads=np.zeros((max_num_tokens, 1), dtype=bool),
                          token_write=np.zeros(max_num_tokens, dtype=np.int64))
        self._shared = device.type == "cpu"
        for name, array in self._host.items():
            setattr(self, name, torch.from_numpy(array) if self._shared else torch.empty_like(torch.from_numpy(array), device=device))
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
    def prepare(self, num_tokens: int, rows: List[Row]) -> StepPlan:
        """Fill the step's index tensors for its soft/fused ``rows`` and return its plan; its other
        tokens keep the tensors' neutral state (no reads, writes to scratch). A step whose plan
        cannot be made leaves them neutral."""
        try:
            return self._prepare(num_tokens, rows)
        except BaseException:
            self.plan = StepPlan(num_tokens, 1, None, None, True)
            self.finish()
            raise

    def _prepare(self, num_tokens: int, rows: List[Row]) -> StepPlan:
        token_write = self._host["token_write"]
        fuse_index: List[np.ndarray] = []
        fuse_until: List[np.ndarray] = []
        passes = 1
        for row in rows:
            slot = self._slot(row.req_id)
            token_write[row.end - 1] = slot
            p, t0, count = row.prompt_length, row.first_position, row.end - row.start
            if count == 1 and t0 >= p and t0 >= 1:  # a decode step's one position: fuse(buffer[slot], e_t)
                self._read_buffer(row, slot)
                self._position[slot] = t0
                continue
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
                self._read_buffer(row, slot)
            chained = np.nonzero(decoded[1:])[0] + 1
            if len(chained):
                fuse_index.append(row.start + chained)
                fuse_until.append(np.full(len(chained), UNBOUNDED))
            passes = max(passes, base + len(chained))
            self._position[slot] = t0 + count - 1
        feedback = bool(rows)
        if feedback and not self._shared:
            for name in ("token_slot", "token_reads", "token_write"):
                getattr(self, name)[:num_tokens].copy_(torch.from_numpy(self._host[name][:num_tokens]),
                                                       non_blocking=True)
        index = until = None
        if fuse_index:
            device = self.buffer.device
            index = torch.from_numpy(np.concatenate(fuse_index)).to(device)
            until = torch.from_numpy(np.concatenate(fuse_until)).to(device)
        self.plan = StepPlan(num_tokens, passes, until, index, feedback)
        self.stats["steps"] += 1
        self.stats["max_passes"] = max(self.stats["max_passes"], passes)
        return self.plan

    def finish(self) -> None:
        """After the step: the index tensors neutral again (no reads, writes to scratch) and no plan."""
        plan, self.plan = self.plan, None
        if plan is None or not plan.feedback:
            return
        n = plan.num_tokens
        for name in ("token_slot", "token_reads", "token_write"):
            self._host[name][:n] = 0
            if not self._shared:
                getattr(self, name)[:n].zero_()

    def _read_buffer(self, row: Row, slot: int) -> None:
        """The row's first token takes fuse(buffer[slot], e_t): the slot must hold the state of the
        position just before it."""
        t0 = row.first_position
        if self._position[slot] != t0 - 1:
            raise RuntimeError(f"request {row.req_id}: the fed-back state is of position "
                               f"{self._position[slot]}, position {t0} needs {t0 - 1}'s")
        self._host["token_slot"][row.start] = slot
        self._host["token_reads"][row.start] = True

    def gather(self, num_tokens: int) -> None:
        """Before pass 1: every token's fed-back state from its slot (scratch's where it reads none).
        Skipped in a step whose plan reads none (its fusions are discarded); a forward outside the
        plan (``plan`` None: vLLM's dummy runs, CUDA-graph capture) gathers."""
        if self.plan is None or self.plan.feedback:
            torch.index_select(self.buffer, 0, self.token_slot[:num_tokens], out=self.carried[:num_tokens])

    def carry(self, top: torch.Tensor, plan: StepPlan, j: int) -> None:
        """Before pass j > 1: the tokens the plan still fuses at pass j take s^{(j-1)}_{t-1}, the top
        state of the previous position in pass j - 1; the others keep their input."""
        index = plan.fuse_index[plan.fuse_until >= j]
        self.carried.index_copy_(0, index, top.index_select(0, index - 1))
        self.token_reads[index] = True

    def write(self, top: torch.Tensor) -> None:
        """Every token's top state into its ``token_write`` slot: each soft/fused row's last token into
        the row's slot, all others into scratch (the order among those is immaterial)."""
        self.buffer.index_copy_(0, self.token_write[: top.shape[0]], top.to(self.buffer.dtype))


def summary(model) -> dict:
    """The state buffer of a served model at a glance, for ``LLM.apply_model(summary)``: slots in
    use, the buffer's shape and address, the step counters, and whether vLLM compiles the pass."""
    s = model.feedback_state
    return {"in_use": s.in_use, "shape": tuple(s.buffer.shape), "address": s.buffer.data_ptr(), **s.stats,
            "compiled": not getattr(model.model, "do_not_compile", True)}
