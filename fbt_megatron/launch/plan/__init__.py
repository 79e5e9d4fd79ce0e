"""Planning a run before submitting it: ``python -m fbt_megatron.plan --recipe R --nodes N --gpus-per-node G``.

* ``planner``: builds the recipe's model on the meta device and prints parameters, steps, the
  parallel layout (with context parallelism's communication type), peak memory per GPU, FLOPs per
  token and the wall time at a stated MFU; it refuses a layout that does not fit (one line naming
  the term and its fix);
* ``memory``: the per-rank memory estimate (weights, gradients, optimizer states, activations,
  transients);
* ``timing``: the wall time's terms (model FLOPs, NorMuon's Newton–Schulz in FP32, the local
  attention core's memory-bound work) and Megatron-LM's FLOPs formula beside ours;
* ``device``: what a plan knows of a GPU beyond ``common/gpus.py``: the memory CUDA reports and the
  share a process can use, the FP32 peak, the memory bandwidth.

The model FLOPs per token are ``model/flops.py``'s (the formula the training log's MFU uses).
``python -m fbt_megatron.train --dry-run`` prints the same plan for the current world.
"""

from fbt_megatron.launch.plan.planner import Plan, format_plan, make_plan

__all__ = ["Plan", "format_plan", "make_plan"]
