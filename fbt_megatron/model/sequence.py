"""Where a sequence's positions live, and the right shift s_{t−1} → t across shards.

Under sequence parallelism (SP) a TP rank holds a contiguous 1/tp of the positions; under context
parallelism (CP) megatron-core splits the sequence into 2·cp chunks and CP rank r holds chunks r
and 2cp−1−r (load balance for causal attention); with both, SP splits the CP rank's rows again.
The fused pass needs, at every local position t, the carried state of position t−1 — which for
the first row of each contiguous run lives on another rank. ``SequenceLayout.shift`` fetches
those boundary rows with one all-gather of every rank's run-end rows; its backward (megatron's
reduce-scatter) returns each boundary row's gradient to the rank that owns it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Optional, Tuple

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

from fbt_megatron.common import platform


def shard_positions(seq_length: int, cp_rank: int, cp_size: int, sp_rank: int, sp_size: int) -> torch.Tensor:
    """Global positions (0-based) of the rows one rank holds, in its local order."""
    if seq_length % (2 * cp_size * sp_size if cp_size > 1 else sp_size):
        raise ValueError(f"seq_length {seq_length} does not split into the CP={cp_size} × SP={sp_size} layout")
    positions = torch.arange(seq_length)
    if cp_size > 1:  # load-balanced CP: chunks r and 2cp−1−r
        chunks = positions.chunk(2 * cp_size)
        positions = torch.cat([chunks[cp_rank], chunks[2 * cp_size - 1 - cp_rank]])
    return positions.chunk(sp_size)[sp_rank]


def _run_ends(positions: torch.Tensor, width: int) -> torch.Tensor:
    """Local indices of the last row of each contiguous run of positions, padded to `width` with −1."""
    ends = torch.nonzero(positions[1:] != positions[:-1] + 1).flatten().tolist() + [len(positions) - 1]
    return torch.tensor(ends + [-1] * (width - len(ends)))


@dataclass(frozen=True)
class SequenceLayout:
    """The rows of a [s_local, b, h] activation: their global positions and the group sharing the sequence."""

    seq_length: Optional[int] = None  # None: as long as the tensors given
    positions: Optional[torch.Tensor] = None  # [s_local] global positions of the local rows (on the device)
    group: Optional[dist.ProcessGroup] = None  # None: this rank holds the whole sequence
    halo: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None  # see `_halo_plan` (on the device)

    def local(self, full: torch.Tensor) -> torch.Tensor:
        """The local rows of a tensor over the whole sequence ([s, ...] → [s_local, ...])."""
        return full if self.group is None else full[self.positions.to(full.device)]

    def shift(self, state: torch.Tensor) -> torch.Tensor:
        """Row t ← row t−1 of the global sequence (zeros at position 0): s_{t−1} at t."""
        shifted = torch.cat([torch.zeros_like(state[:1]), state[:-1]], dim=0)
        if self.group is None:
            return shifted
        ends, starts, sources = (x.to(state.device) for x in self.halo)
        # every rank's run-end rows (padding rows repeat row 0 and are never read)
        gathered = gather_from_sequence_parallel_region(state[ends.clamp(min=0)], group=self.group)
        incoming = gathered[sources]
        return shifted.index_copy(0, starts, incoming)


WHOLE_SEQUENCE = SequenceLayout()  # one rank holds every position


def _halo_plan(all_positions, rank: int, width: int):
    """Which gathered rows the first row of each local run needs: (ends, starts, sources)."""
    owner = {}  # global position of a run end → its row in the gathered tensor
    for r, positions in enumerate(all_positions):
        for i, end in enumerate(_run_ends(positions, width).tolist()):
            if end >= 0:
                owner[int(positions[end])] = r * width + i
    mine = all_positions[rank]
    starts = [0] + (torch.nonzero(mine[1:] != mine[:-1] + 1).flatten() + 1).tolist()
    starts = [i for i in starts if mine[i] > 0]  # position 0 has no predecessor: stays zero
    sources = [owner[int(mine[i]) - 1] for i in starts]
    return _run_ends(mine, width), torch.tensor(starts, dtype=torch.long), torch.tensor(sources, dtype=torch.long)


@lru_cache(maxsize=None)
def _layout(seq_length: int, sequence_parallel: bool, context_parallel: bool) -> SequenceLayout:
    from megatron.core import parallel_state as ps

    cp_size = ps.get_context_parallel_world_size() if context_parallel else 1
    cp_rank = ps.get_context_parallel_rank() if context_parallel else 0
    sp_size = ps.get_tensor_model_parallel_world_size() if sequence_parallel else 1
    sp_rank = ps.get_tensor_model_parallel_rank() if sequence_parallel else 0
    positions = shard_positions(seq_length, cp_rank, cp_size, sp_rank, sp_size)
    if cp_size * sp_size == 1:
        return WHOLE_SEQUENCE
    if cp_size > 1 and sp_size > 1:
        group = ps.get_tensor_and_context_parallel_group()
    else:
        group = ps.get_context_parallel_group() if cp_size > 1 else ps.get_tensor_model_parallel_group()
    # once per process: the group's rank order. On the device: TP and CP groups are NCCL on GPUs,
    # which takes device tensors only (tests see it on the simulated device: platform)
    on_device = positions.to(platform.device())
    gathered = [torch.empty_like(on_device) for _ in range(group.size())]
    dist.all_gather(gathered, on_device, group=group)
    gathered = [g.cpu() for g in gathered]
    width = 2 if cp_size > 1 else 1
    # the index tensors kept on the device: a copy from pageable host memory at every pass (2 in
    # ``local``, 3 in ``shift``) would be a blocking copy each, the host waiting for the GPU
    halo = tuple(x.to(platform.device()) for x in _halo_plan(gathered, group.rank(), width))
    return SequenceLayout(seq_length, on_device, group, halo)


def sequence_layout(config, seq_length: int) -> SequenceLayout:
    """This rank's layout of a sequence of ``seq_length`` positions under the config's SP/CP."""
    return _layout(seq_length, bool(config.sequence_parallel), config.context_parallel_size > 1)
