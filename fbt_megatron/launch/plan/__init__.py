"""Planning a run before submitting it: ``python -m fbt_megatron.plan --recipe R --nodes N --gpus-per-node G``.

* ``planner``: builds the recipe's model on the meta device and prints parameters, steps, the
  parallel layout, peak memory per GPU, FLOPs per token and the wall time at a stated MFU; it
  refuses a layout that does not fit (one line naming the term);
* ``memory``: the per-rank memory estimate (weights, gradients, optimizer states, activations);
* ``flops``: model FLOPs per token of a k-pass step (the formula MFU in the training logs uses);
* ``gpus``: the accelerators it knows (memory, peak TFLOP/s).

``python -m fbt_megatron.train --dry-run`` prints the same plan for the current world.
"""

from fbt_megatron.launch.plan.planner import Plan, format_plan, make_plan

__all__ = ["Plan", "format_plan", "make_plan"]
