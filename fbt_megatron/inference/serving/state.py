"""The fed-back state of every request, and the plan of one forward step.

The model keeps ``buffer`` [slots, hidden]: row ``s`` holds the top state of the latest computed
position of the request that owns slot ``s`` (the EAGLE/MTP pattern of the paper's appendix D), and
``values`` [slots + tokens, hidden]: the fusion's value W_U s_{t-1} of every token that reads one,
projected where it is taken, outside the compiled pass. Its first ``slots`` rows are W_U of the
buffer's rows (``gather``, before pass 1: one product over the slots in use, none in a step of
standard requests), row ``slots + t`` is W_U s^{(j-1)}_{t-1} of token t's predecessor in the previous
pass (``carry``, before pass j > 1). The buffer, ``values`` and the per-token index tensors are
allocated once (their addresses never change). Slot 0 is scratch: every token that is not the last
of a soft/fused request writes there. Per token of a step, ``token_reads`` says whether its input is
fused, ``token_source`` which row of ``values`` it takes, ``token_write`` which slot its top state
goes to. A pass is then the same tensor program for every step whatever its requests are (the
compiled step, ``model``); a forward outside the plan (vLLM's profile and dummy runs, CUDA-graph
capture) finds them neutral (no reads, every write to scratch): ``finish`` restores that after each
step, except a decode step's entries, which the next decode step of the same requests reuses as they
are (any other step, and a forward without a plan, clears them first: ``neutral``).

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
A decode step's requests (one position each, fed from the buffer) are planned as arrays at once;
the others one by one. The slots of a step's requests are looked up once per batch layout (the
runner passes the same ``req_ids`` list while the batch's requests stay the same) and again after
any slot is freed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional

import numpy as np
import torch

from fbt_megatron.inference.serving.requests import RequestMode

UNBOUNDED = 1 << 30  # fuse_until of chained positions: every pass
Project = Callable[[torch.Tensor, Optional[torch.Tensor]], torch.Tensor]  # (states, out or None) -> W_U states


@dataclass
class Rows:
    """The soft/fused requests of a step in the packed batch's order, one entry each."""

    req_ids: List[str]  # the same list object while the batch's requests do not change
    modes: List[RequestMode]
    start: np.ndarray  # first token index in the packed batch
    end: np.ndarray  # one past the last
    first_position: np.ndarray  # t0
    prompt_length: np.ndarray  # p >= 1 (the scored context's length when given)
    decode: bool  # every request of the step (standard ones too) has one token


@dataclass
class StepPlan:
    num_tokens: int
    passes: int
    fuse_until: Optional[torch.Tensor]  # [chained/fused-prompt tokens] pass limits (None: single pass)
    fuse_index: Optional[torch.Tensor]  # [the same tokens] their indices
    gathered: int  # the buffer's rows [0, gathered) to project before pass 1 (0: no token reads the buffer)
    feedback: bool  # some row is soft/fused (the index tensors were filled)


class FeedbackState:
    """The buffer, the slots and the plan of each step (see the module docstring)."""

    def __init__(self, max_num_seqs: int, max_num_tokens: int, hidden_size: int, dtype, device):
        self.slots = max_num_seqs + 1  # + the scratch slot 0
        device = torch.device(device)
        self.buffer = torch.zeros(self.slots, hidden_size, dtype=dtype, device=device)
        self.values = torch.zeros(self.slots + max_num_tokens, hidden_size, dtype=dtype, device=device)
        # per token of a step: whether its input is fused, the row of ``values`` it takes, the slot its
        # top state is written to (0: scratch). Filled on the host each step; on CPU the tensors share
        # the host arrays' memory (no copy), elsewhere they are copied over.
        self._host = dict(token_reads=np.zeros((max_num_tokens, 1), dtype=bool),
                          token_source=np.zeros(max_num_tokens, dtype=np.int64),
                          token_write=np.zeros(max_num_tokens, dtype=np.int64))
        self._shared = device.type == "cpu"
        for name, array in self._host.items():
            setattr(self, name, torch.from_numpy(array) if self._shared else torch.empty_like(torch.from_numpy(array), device=device))
        self._owner: Dict[str, int] = {}  # request id -> slot
        self._free: List[int] = list(range(self.slots - 1, 0, -1))
        self._position = np.full(self.slots, -1, dtype=np.int64)  # the position each slot's state is of
        self._freed = 0  # slots freed so far: a layout's slots looked up before are stale once it moves
        self._layout_slots = (None, -1, None, 0)  # (req_ids, _freed, their slots, the highest) of the last layout
        self._set_tokens = 0  # the index tensors may hold entries for tokens [0, _set_tokens)
        self._kept = None  # (req_ids, _freed, tokens) of the decode step whose entries are kept for the next
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
                self._freed += 1

    def _slot(self, req_id: str) -> int:
        slot = self._owner.get(req_id)
        if slot is None:
            if not self._free:
                raise RuntimeError(f"FBT state buffer full ({self.slots - 1} slots): more running requests than "
                                   "max_num_seqs, or slots were not freed")
            slot = self._owner[req_id] = self._free.pop()
        return slot

    def _slots(self, req_ids: List[str]) -> tuple[np.ndarray, int]:
        """The slots of a layout's requests (taking free ones for new requests) and the highest,
        looked up again only for another layout or after a slot was freed."""
        cached, freed, slots, highest = self._layout_slots
        if cached is not req_ids or freed != self._freed:
            slots = np.array([self._slot(r) for r in req_ids], dtype=np.int64)
            highest = int(slots.max())
            self._layout_slots = (req_ids, self._freed, slots, highest)
        return slots, highest

    # ------------------------------------------------------------ a step
    def prepare(self, num_tokens: int, rows: Optional[Rows]) -> StepPlan:
        """Fill the step's index tensors for its soft/fused ``rows`` (None: there are none) and return
        its plan; its other tokens keep the tensors' neutral state (no reads, writes to scratch). A
        decode step's entries stay set after it (``finish``): the next decode step of the same
        requests needs the same ones, and only checks and moves the positions; any other step clears
        them first. A step whose plan cannot be made leaves the tensors neutral."""
        same = (rows is not None and rows.decode and self._kept is not None and self._kept[0] is rows.req_ids
                and self._kept[1:] == (self._freed, num_tokens))
        if not same:
            self.neutral()
        if rows is None:
            self.plan = StepPlan(num_tokens, 1, None, None, 0, False)
            return self.plan
        try:
            return self._prepare(num_tokens, rows, same)
        except BaseException:
            self.plan = None
            self.neutral()
            raise

    def _prepare(self, num_tokens: int, rows: Rows, same: bool) -> StepPlan:
        start, end, t0, p = rows.start, rows.end, rows.first_position, rows.prompt_length
        slots, highest = self._slots(rows.req_ids)
        host, passes, fused = self._host, 1, (None, None)
        # a decode step: each row's one position reads the buffer (``same``: the previous step's rows)
        decode = same or (rows.decode and (t0 >= p).all())
        if decode:
            reading, read_slots, read_tokens, last, gathered = t0, slots, start, t0, highest + 1
        else:
            count = end - start
            single = (count == 1) & (t0 >= p)  # rows whose one position reads the buffer (p >= 1: so is t0)
            reads, fuse_index, fuse_until = [np.flatnonzero(single)], [], []
            for i in np.flatnonzero(~single):
                passes = max(passes, self._plan_row(rows, i, reads, fuse_index, fuse_until))
            read_rows = np.concatenate(reads)
            reading, read_slots, read_tokens, last = t0[read_rows], slots[read_rows], start[read_rows], t0 + count - 1
            gathered = int(read_slots.max()) + 1 if len(read_slots) else 0
            if fuse_index:  # chained/fused-prompt tokens take their row of ``values`` (filled by ``carry``)
                index = np.concatenate(fuse_index)
                host["token_source"][index] = self.slots + index
                fused = self._tensor(np.concatenate(fuse_until)), self._tensor(index)
        stale = self._position[read_slots] + 1 != reading
        if stale.any():  # the slot must hold the state of the position just before the row's first
            i = int(np.flatnonzero(np.isin(slots, read_slots[stale]))[0])
            raise RuntimeError(f"request {rows.req_ids[i]}: the fed-back state is of position "
                               f"{self._position[slots[i]]}, position {t0[i]} needs {t0[i] - 1}'s")
        self._position[slots] = last
        if not same:  # (else the entries are set: the same tokens read and write the same slots)
            self._set_tokens = num_tokens
            host["token_reads"][read_tokens] = True
            host["token_source"][read_tokens] = read_slots
            host["token_write"][end - 1] = slots
            if not self._shared:
                for name in host:
                    getattr(self, name)[:num_tokens].copy_(torch.from_numpy(host[name][:num_tokens]), non_blocking=True)
            self._kept = (rows.req_ids, self._freed, num_tokens) if decode else None
        self.plan = StepPlan(num_tokens, passes, *fused, gathered, True)
        self.stats["steps"] += 1
        self.stats["max_passes"] = max(self.stats["max_passes"], passes)
        return self.plan

    def _plan_row(self, rows: Rows, i: int, reads: list, fuse_index: list, fuse_until: list) -> int:
        """A row other than a decode step's one position: its prompt's fused passes, whether its first
        token reads the buffer, its chained positions; returns the passes it needs."""
        mode, start, t0, p = rows.modes[i], rows.start[i], rows.first_position[i], rows.prompt_length[i]
        count = rows.end[i] - start
        positions = np.arange(t0, t0 + count)
        base = 1
        if mode.mode == "fused" and t0 < p:
            if t0 != 0 or t0 + count < p:
                raise RuntimeError(
                    f"request {rows.req_ids[i]}: fused({mode.passes}) got positions {t0}…{t0 + count - 1} of a "
                    f"{p}-token prompt in one step; it needs the whole prompt at once (no chunked prefill)")
            prompt = np.nonzero((positions >= 1) & (positions < p))[0]
            if mode.passes and len(prompt):
                fuse_index.append(start + prompt)
                fuse_until.append(np.full(len(prompt), mode.passes + 1))
                base = mode.passes + 1
        decoded = (positions >= p) & (positions >= 1)
        if decoded[0]:  # its predecessor was computed in an earlier step
            reads.append(np.array([i]))
        chained = np.nonzero(decoded[1:])[0] + 1
        if len(chained):
            fuse_index.append(start + chained)
            fuse_until.append(np.full(len(chained), UNBOUNDED))
        return base + len(chained)

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        """Indices as a tensor on the buffer's device (on CPU, the array's memory)."""
        tensor = torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64))
        return tensor if self._shared else tensor.to(self.buffer.device)

    def finish(self) -> None:
        """After the step: no plan, and the index tensors neutral again unless they hold a decode
        step's entries (kept for the next one: ``prepare``)."""
        self.plan = None
        if self._kept is None:
            self.neutral()

    def neutral(self) -> None:
        """The index tensors neutral: no reads, every write to scratch (before any step that does not
        keep the previous one's entries, and before a forward without a plan: vLLM's dummy runs)."""
        n, self._set_tokens, self._kept = self._set_tokens, 0, None
        if n:
            for name in ("token_reads", "token_write"):  # token_source is read only where token_reads is set
                self._host[name][:n] = 0
                if not self._shared:
                    getattr(self, name)[:n].zero_()

    def gather(self, project: Project) -> None:
        """Before pass 1: W_U of the buffer's rows the step's reading tokens take, one product over
        the slots up to the highest they read (slots are handed out lowest first, so those in use
        stay packed), written into ``values``."""
        plan = self.plan
        if plan is not None and plan.gathered:
            project(self.buffer[: plan.gathered], self.values[: plan.gathered])

    def carry(self, top: torch.Tensor, plan: StepPlan, j: int, project: Project) -> None:
        """Before pass j > 1: the tokens the plan still fuses at pass j take W_U s^{(j-1)}_{t-1}, of the
        previous position's top state in pass j - 1; the others keep their input."""
        index = plan.fuse_index[plan.fuse_until >= j]
        self.values.index_copy_(0, index + self.slots, project(top.index_select(0, index - 1), None))
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
