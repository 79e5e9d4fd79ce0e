"""Data parallelism for multi-pass steps: megatron-core DDP (gradient buffers, optionally the
distributed optimizer's reduce-scatter, overlapped with backward), wired for pass chunks.

Two things differ from a one-pass model:
* Under PP the schedule sees the stage k times (one chunk per pass) but there is one set of
  parameters: one DDP object, whose gradients are finalized (reduced) once per step.
* Overlapped reduction launches a bucket's collective once each of its parameters has reported a
  gradient as many times as in the first step (megatron-core learns these counts once). With
  activation recompute or pass chunks a parameter reports once per pass, so the counts depend on
  k: ``PassAwareDDP.start_step(k)`` keeps one set per k.
"""

from __future__ import annotations

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads


class PassAwareDDP(DistributedDataParallel):
    """megatron-core DDP for steps whose pass count varies."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._ready_counts = {}  # k → per bucket group: (golden counts, still learning)
        self._step_passes = None

    def start_step(self, num_passes: int) -> None:
        """Zero the gradient buffers before a step of ``num_passes`` passes."""
        self.zero_grad_buffer()  # also records the counts learned in the previous step
        if not self.ddp_config.overlap_grad_reduce:
            return
        groups = self.bucket_groups + self.expert_parallel_bucket_groups
        if self._step_passes is not None:
            self._ready_counts[self._step_passes] = [(g.golden_per_param_grad_ready_counts, g.is_first_batch) for g in groups]
        for group, (golden, learning) in zip(groups, self._ready_counts.get(num_passes, [({}, True)] * len(groups))):
            group.golden_per_param_grad_ready_counts, group.is_first_batch = golden, learning
        self._step_passes = num_passes


def finalize_once(model_chunks, *args, **kwargs):
    """megatron-core's finalize_model_grads (DP reduction, SP norm and tied-embedding all-reduces)
    for the stage once, although the schedule passes it the stage once per pass chunk."""
    return finalize_model_grads(model_chunks[:1], *args, **kwargs)


def wrap(config, module, overlap_grad_reduce: bool, use_distributed_optimizer: bool) -> PassAwareDDP:
    """The stage's module in PassAwareDDP, with the schedule hooks set on ``config``."""
    ddp = PassAwareDDP(
        config,
        DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=overlap_grad_reduce,
            use_distributed_optimizer=use_distributed_optimizer,
        ),
        module=module,
    )
    ddp.broadcast_params()
    config.finalize_model_grads_func = finalize_once
    config.no_sync_func = ddp.no_sync  # one function: every pass chunk is the same DDP
    return ddp
