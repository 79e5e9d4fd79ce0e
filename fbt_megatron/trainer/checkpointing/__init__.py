"""Checkpoints through megatron-core ``dist_checkpointing`` (torch_dist): written atomically
(``writing``), checked before loading (``manifest``, ``verify``), loaded safely and resharded to
whatever parallel layout loads them (``reading``), in Megatron-LM's run-folder layout (``layout``),
holding the weights, optimizer, scheduler, RNG streams and the training state (``state``). The
policy of where a run starts is ``trainer.stages``; when it saves, ``trainer.callbacks.checkpointer``."""

from fbt_megatron.common.errors import CheckpointError
from fbt_megatron.trainer.checkpointing.layout import TRACKER, checkpoint_dir, iterations, latest_iteration, remove_stale, retain
from fbt_megatron.trainer.checkpointing.manifest import MANIFEST
from fbt_megatron.trainer.checkpointing.reading import load, read_train_state
from fbt_megatron.trainer.checkpointing.state import OPTIMIZER_METADATA, TrainState
from fbt_megatron.trainer.checkpointing.verify import damage
from fbt_megatron.trainer.checkpointing.writing import BackgroundSaves, save

__all__ = ["BackgroundSaves", "CheckpointError", "MANIFEST", "OPTIMIZER_METADATA", "TRACKER", "TrainState", "checkpoint_dir",
           "damage", "iterations", "latest_iteration", "load", "read_train_state", "remove_stale", "retain", "save"]
