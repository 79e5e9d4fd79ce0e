"""A CPU test double of Transformer Engine 2.16 (the TE of NGC PyTorch 26.06, the project's image).

FBT calls every layer k times per microbatch, and TE keeps state per call that megatron-core drives
for a model that calls each layer once. The simulated device (``fbt_megatron.testing.simulated_device``)
models CUDA and NCCL, not TE, so everything in that state was invisible to the suite. This package
is importable as ``transformer_engine`` (``PYTHONPATH=tests/doubles``) and runs megatron-core's own
TE wrappers (``megatron.core.extensions.transformer_engine``) on the CPU or the simulated device.

What it models, each rule written from TE v2.16's source (``TE:`` paths below; read with
``git show v2.16:<path>`` in NVIDIA/TransformerEngine) and cited where it is implemented:

* the weight-gradient GEMM into ``main_grad`` under ``fuse_wgrad_accumulation``: it *overwrites*
  ``main_grad`` when the forward saw ``is_first_microbatch=True`` and accumulates otherwise, also
  when the flag is None (TE: pytorch/module/linear.py:1105-1110, 1130-1136), then marks
  ``grad_added_to_main_grad`` and returns a dummy gradient (:1220-1234; base.py ``get_dummy_wgrad``);
* the FP8 weight cache: ``is_first_microbatch`` True or None quantizes the weight again, False
  reuses the copy cached by the last True (linear.py:421-431, 1805);
* FP8 scaling: delayed scaling's amax history and scale per module, the amax recorded at each
  quantization, reduced over the autocast's group and turned into new scales at the exit of the
  outermost autocast only if grad is enabled (pytorch/quantization.py:477-541, 632-688, 748-756,
  1043-1143); backward's at the end of the first module's backward; current scaling (tensorwise)
  from each tensor's own amax, no state; MXFP8 refused as on an H100 (autocast_enter's assert);
* the FP8 recompute stash of TE's ``checkpoint``: the forward runs under no_grad and records whether
  FP8 was on at its end; delayed-scaling modules stash scales in the first forward only when FP8 was
  on at the checkpoint's entry, and pop them FIFO in the recompute (quantization.py:761-821,
  pytorch/distributed.py:241-283, 327-470, 649-760; module/base.py:1386-1451);
* e4m3/e5m2 quantization itself, emulated with torch's float8 dtypes (saturating casts), so FP8
  numerics can be compared at CPU scale (``quantization.fake_quantize``).

The GEMMs' tensor-parallel communication (sequence-parallel all-gather and reduce-scatter, the
all-reduce of row-parallel outputs) uses megatron-core's own mappings: the same collectives TE
issues. Not modelled, and refused where megatron could ask for them: userbuffer overlap, delayed
weight gradients, FP8 parameters, context-parallel attention, THD (packed) attention, other FP8
recipes than delayed and tensorwise. TE's fused optimizers are absent (megatron-core then uses its
own), as on an image without them.
"""

__version__ = "2.16.0"

from transformer_engine import common  # noqa: E402,F401  (TE's __init__ loads the recipes too)
