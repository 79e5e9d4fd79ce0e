"""What a checkpoint holds: the model's and optimizer's sharded state, the scheduler, this rank's
RNG streams (per pipeline and tensor rank, replicated over data-parallel ranks) and the training
state besides (``TrainState``: plain data, in the common state).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional, Tuple

import torch
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedTensor

log = logging.getLogger(__name__)


# The distributed optimizer's torch-Adam path (no Apex/TE) only supports this format.
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


@dataclass
class TrainState:
    """What besides weights and optimizer a resumed run needs (saved in every checkpoint as a dict:
    ``read_train_state``)."""

    iteration: int = 0
    consumed_samples: int = 0
    tokens: int = 0
    compute_tokens: int = 0  # tokens × passes: the cost in equivalent single-pass tokens
    pass_schedule: dict = field(default_factory=dict)
    model: dict = field(default_factory=dict)
    lr_schedule: dict = field(default_factory=dict)  # the curve the optimizer followed (``optimizers.schedule.lr_schedule``)
    recipe: dict = field(default_factory=dict)  # the whole recipe of the run's latest stretch (``runs.load_run``)
    vocab_size: int = 0  # the embedding's (padded) vocabulary size
    skipped_steps: int = 0  # steps whose update was skipped (NaN/Inf gradient norm: ``bad_steps``; spikes)
    callbacks: dict = field(default_factory=dict)  # the loop's callbacks' states by name (``callbacks.base``)

    @classmethod
    def from_saved(cls, saved: dict) -> "TrainState":
        """A checkpoint's train state (``read_train_state``). One written before the callbacks kept
        their own state has the spike detector's at the top (``spike_window``, ``spikes``, ``rewinds``)."""
        saved = dict(saved)
        old = {key: saved.pop(key) for key in ("spike_window", "spikes", "rewinds") if key in saved}
        if old:
            spikes = {"window": old.get("spike_window", []), "spikes": old.get("spikes", 0), "rewinds": old.get("rewinds", 0)}
            saved["callbacks"] = {"spikes": spikes, **saved.get("callbacks", {})}
        return cls(**saved)

    def advance(self, passes: int, samples: int, tokens: int, skipped_steps: int) -> None:
        """After a step of ``passes`` passes over ``samples`` sequences of ``tokens`` tokens in all."""
        self.iteration += 1
        self.consumed_samples += samples
        self.tokens += tokens
        self.compute_tokens += tokens * passes
        self.skipped_steps = skipped_steps


def _rng_streams() -> List[Tuple[str, torch.Tensor]]:
    """This rank's RNG streams by name, in a fixed order: the default generator, the device one (GPU)
    and megatron's tracker streams (dropout in TP regions). Their states' sizes depend on the device:
    a CUDA generator's is 16 bytes (Philox seed and offset), a CPU one's 5056 (Mersenne twister; the
    tracker's streams on a CPU: ``platform``), so a CPU and a GPU write RNG vectors of other lengths."""
    streams = [("cpu", torch.get_rng_state())]
    if torch.cuda.is_available():
        streams.append(("cuda", torch.cuda.get_rng_state()))
    tracker = tensor_parallel.get_cuda_rng_tracker().get_states()
    return streams + [(f"tracker:{name}", tracker[name]) for name in sorted(tracker)]


def _rng_state() -> torch.Tensor:
    """This rank's RNG streams (``_rng_streams``) as one uint8 vector."""
    return torch.cat([state.cpu() for _, state in _rng_streams()])


def _rng_parts() -> list:
    """``[[name, bytes], ...]``: the streams of ``_rng_state``'s vector, in its order (saved with it)."""
    return [[name, state.numel()] for name, state in _rng_streams()]


def _saved_rng_parts(path: Path, common: dict) -> list:
    """The streams of a checkpoint's RNG vector: saved with it, or for a checkpoint written before
    they were, read from the vector's length: this process's when as long, else the default
    generator (first, the same size everywhere) and the other device's streams."""
    if "rng_parts" in common:
        return common["rng_parts"]
    length = dist_checkpointing.load_tensors_metadata(str(path))["rng_state"].global_shape[-1]
    ours = _rng_parts()
    if length == sum(size for _, size in ours):
        return ours
    return [ours[0], ["another device's streams", length - ours[0][1]]]


def _set_rng_state(path: Path, flat: torch.Tensor, parts: list) -> None:
    """Restore this rank's streams from a checkpoint's RNG vector ``flat`` of streams ``parts``:
    each stream saved with the size this process's has. A CPU-saved run resumed on a GPU (or the
    other way) gets its default generator back and keeps the device's streams as this run seeded
    them (--seed): their states do not map; one line says which."""
    saved, offset = {}, 0
    for name, size in parts:
        saved[name], offset = flat[offset:offset + size], offset + size
    ours = _rng_streams()
    restored = {name: saved[name].clone() for name, state in ours if name in saved and saved[name].numel() == state.numel()}
    if "cpu" in restored:
        torch.set_rng_state(restored["cpu"])
    if "cuda" in restored:
        torch.cuda.set_rng_state(restored["cuda"])
    tracker = tensor_parallel.get_cuda_rng_tracker()
    states = tracker.get_states()
    tracker.set_states({name: restored.get(f"tracker:{name}", state).to(state.device) for name, state in states.items()})
    fresh = [name for name, _ in ours if name not in restored]
    if fresh:
        there = ", ".join(f"{name} {size} B" for name, size in parts)
        log.warning(f"{path}: RNG streams restored: {', '.join(restored) or 'none'}; started from --seed: {', '.join(fresh)} "
                    f"(the checkpoint's are another device's, which do not map to this one's: {there})")


def _sharded_rng(rng: torch.Tensor) -> ShardedTensor:
    """Per (pipeline, tensor) rank RNG state, replicated over data-parallel ranks."""
    pp, tp = parallel_state.get_pipeline_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_world_size()
    return ShardedTensor.from_rank_offsets(
        "rng_state",
        rng.view(1, 1, -1),
        (0, parallel_state.get_pipeline_model_parallel_rank(), pp),
        (1, parallel_state.get_tensor_model_parallel_rank(), tp),
        replica_id=parallel_state.get_data_parallel_rank(with_context_parallel=True),
    )


def _rng_layout() -> list:
    return [parallel_state.get_pipeline_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_world_size()]


def _state(model, optimizer, scheduler, extra: dict, loading: bool, optimizer_state: bool = True,
           rng: Optional[torch.Tensor] = None) -> dict:
    """Everything a checkpoint holds; without an optimizer, the weights (a seed checkpoint). ``rng``:
    the RNG vector (``_rng_state``) to save, or for loading one as long as the saved one; None leaves
    the RNG streams out. For loading, ``optimizer_state=False`` leaves out the optimizer's state."""
    model_state = model.sharded_state_dict()
    if optimizer is None:
        return {"model": model_state, "train_state": extra}
    state = {"model": model_state, "scheduler": scheduler.state_dict(), "train_state": extra}
    if optimizer_state:
        state["optimizer"] = optimizer.sharded_state_dict(model_state, is_loading=loading, metadata=OPTIMIZER_METADATA)
    if rng is not None:
        state.update(rng_state=_sharded_rng(rng), rng_layout=_rng_layout(), rng_parts=_rng_parts())
    return state
