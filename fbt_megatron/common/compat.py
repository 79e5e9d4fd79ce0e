"""Every difference between the megatron-core releases this project runs on, in one place.

Tested: megatron-core 0.16.1 (Python 3.11, ``requirements.txt``, the CPU default) and 0.19.2
(Python 3.12, ``requirements-mcore-latest.txt``, what GPU clusters' containers have), both in CI.
The rest of the project imports these names from here and never asks for a version; each name is
found by what the installed megatron-core has, not by its version number. What differs only on
the CPU (0.19's gradient sync asks for the current CUDA stream) is the platform layer's
(``fbt_megatron.common.platform``).

* ``LegacyTokenizer``: the tokenizer interface megatron-core's datasets read (``unique_identifiers``
  for their cache names, ``eod``, ``pad``, ``vocab_size``). 0.16 has it as
  ``megatron.core.datasets.megatron_tokenizer.MegatronLegacyTokenizer`` and warns on every
  instance (silenced: the datasets read exactly this interface); 0.19 removed that module, its
  datasets read the same attributes, and the class here gives the same identifiers.
* ``write_results_queue_getter()``: the name of the function with which megatron-core's
  checkpoint writers get their results queue (``megatron_fixes`` replaces it):
  ``_get_write_results_queue`` in 0.16, ``get_write_results_queue(mp_mode)`` in 0.19.
* ``apply()`` (from ``platform.install()``): 0.19's ``TransformerBlock.forward`` asks for its
  layer offset (for feature extraction) with its ``vp_stage``, and refuses a block without one
  while a virtual pipeline size is set. Here the k passes are the virtual chunks of one stage —
  the same layers k times, built once without a ``vp_stage`` (``fbt_megatron.distributed.pipeline``)
  — so such a block's offset is the stage's plain one; 0.16 asks only while building (no virtual
  size then), where this changes nothing.
* ``layer_wise_attributes()``: what megatron-core's ``LayerWiseDistributedOptimizer.__init__`` sets
  for its other methods, for the subclass that shards before it wraps and so skips that
  ``__init__`` (``fbt_megatron.optimizers.layer_wise``). 0.16's methods read the process groups
  from ``pg_collection``; 0.19's read them cached (``dp_cp``, ``expt_dp``) and choose how to
  all-gather after the step (here always ``allgather_params``: no parameter layout, no overlap).
* Notices that 0.16 (the legacy tokenizer) and 0.19 log on every run about their own future API,
  silenced (``NOTICES``): GPTModel
  is deprecated in favour of HybridModel; an MLP ``ModuleSpec`` is rewrapped as
  ``MLP.as_mlp_submodule`` (0.19 does it itself; 0.16 has no such method); the distributed
  optimizer's parameter layout is computed inside DDP (as in 0.16) rather than passed in; the
  synchronous checkpoint save goes through megatron-core's own async machinery, which it calls
  deprecated in favour of NVIDIA Resiliency Extension; a checkpoint saved by 0.16 is read through
  ``load_common``, which 0.19 calls deprecated. None changes what is computed. (Python warnings
  of megatron-core and torch, 0.19's included, are ``cli.quiet_library_warnings()``'s.)
* Checkpoints: 0.19 keeps a checkpoint's common state inside its ``torch_dist`` files (0.16: a
  ``common.pt`` beside them, and ``metadata.json`` names its ``common_backend``). 0.19 reads both;
  0.16 cannot read 0.19's, which ``newer_checkpoint()`` says in one line.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from pathlib import Path
from typing import Optional

NOTICES = {  # logger: the start of the message
    "megatron.core.datasets.megatron_tokenizer": "You're using the legacy tokenizer system",  # 0.16
    "megatron.core.models.gpt.gpt_model": "GPTModel IS DEPRECATED",
    "megatron.core.transformer.transformer_layer": "Rewrapping ModuleSpec with module",
    "megatron.core.distributed.distributed_data_parallel": "DistributedDataParallel: full_param_layout not provided",
    "megatron.core.dist_checkpointing.strategies.torch": "MCore's async save is deprecated",
    "megatron.core.dist_checkpointing.strategies.common": "load_common is deprecated",
}
for _logger, _start in NOTICES.items():
    logging.getLogger(_logger).addFilter(lambda record, start=_start: not record.getMessage().startswith(start))

try:
    from megatron.core.datasets.megatron_tokenizer import MegatronLegacyTokenizer as LegacyTokenizer
except ImportError:  # megatron-core >= 0.17

    class LegacyTokenizer:
        """megatron-core 0.16's ``MegatronLegacyTokenizer``: identifiers from the class, the paths
        and the options, as megatron's dataset caches name them."""

        def __init__(self, *tokenizer_paths: str, **tokenizer_options):
            self.unique_identifiers = OrderedDict()
            self.unique_identifiers["class"] = type(self).__name__
            self.unique_identifiers["tokenizer_path"] = list(tokenizer_paths)
            for option, value in tokenizer_options.items():
                self.unique_identifiers[option] = str(value)
            self.unique_description = json.dumps(self.unique_identifiers, indent=4)


def write_results_queue_getter() -> str:
    """The name of ``filesystem_async``'s results-queue function (module docstring)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    return next(name for name in ("get_write_results_queue", "_get_write_results_queue") if hasattr(filesystem_async, name))


def apply() -> None:
    """The patch of the module docstring (once per process: ``platform.install()``)."""
    from megatron.core.transformer import transformer_block

    offset = transformer_block.get_transformer_layer_offset

    def layer_offset(config, vp_stage=None, pp_rank=None):
        if vp_stage is not None or config.virtual_pipeline_model_parallel_size is None:
            return offset(config, vp_stage, pp_rank)
        virtual, config.virtual_pipeline_model_parallel_size = config.virtual_pipeline_model_parallel_size, None
        try:  # a block shared by every virtual chunk (module docstring)
            return offset(config, None, pp_rank)
        finally:
            config.virtual_pipeline_model_parallel_size = virtual

    transformer_block.get_transformer_layer_offset = layer_offset


def layer_wise_attributes(pg_collection) -> dict:
    """The attributes of the module docstring, for ``setattr`` on the optimizer."""
    return {"dp_cp": pg_collection.dp_cp, "expt_dp": getattr(pg_collection, "expt_dp", None),
            "overlap_param_gather": False, "use_buffer_param_sync": False}


def newer_checkpoint(folder: Path) -> Optional[str]:
    """The problem, in words, when checkpoint ``folder`` was saved by a megatron-core whose format
    this one cannot read (module docstring); None when it can (or the folder is damaged: named
    where it is read)."""
    import megatron.core
    from megatron.core.dist_checkpointing import serialization

    if hasattr(serialization, "_legacy_common_state_exists"):  # reads both formats
        return None
    try:
        metadata = json.loads((Path(folder) / "metadata.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(metadata, dict) or "common_backend" in metadata:
        return None
    return (f"{folder} was saved by megatron-core 0.17 or newer (its common state inside the torch_dist files), which "
            f"megatron-core {megatron.core.__version__} cannot read: load it with megatron-core 0.19 "
            "(Python 3.12, requirements-mcore-latest.txt)")
