"""Fixes for bugs of megatron-core (0.16 and 0.19 alike) that this project hits, on CPU and GPU
alike. Each is applied once per process by ``apply()`` (called from ``platform.install()``), names
the bug, and is checked by a test that fails without it (resume and cross-layout checkpoint
tests)."""

from __future__ import annotations

import torch

from fbt_megatron.common import compat

_applied = False


def apply() -> None:
    global _applied
    if not _applied:
        _torch_adam_steps()
        _fully_reshardable_bucket_padding()
        _write_results_queue()
        _accurate_gradient_norm()
        _applied = True


def _torch_adam_steps() -> None:
    """megatron-core's DistributedOptimizer (0.16 and 0.19) on torch's Adam (used when neither Apex
    nor TE is installed) mishandles Adam's per-parameter ``step`` in checkpoints:
      * ``state_dict()`` asserts when nothing has been stepped yet (it is called while loading);
      * loading gives every parameter the *same* step tensor, which Adam then increments once per
        parameter per step: silently wrong bias correction after a resume;
      * ``fully_reshardable`` loading copies a ``step`` the checkpoint's tensors do not hold.
    The wrappers below fix each; with Apex/TE this code path is not taken."""
    from megatron.core.optimizer import distrib_optimizer as do

    if do.HAVE_APEX_OR_TE:
        return
    cls = do.DistributedOptimizer
    state_dict, load_state_dict, set_states = cls.state_dict, cls.load_state_dict, cls._set_main_param_and_optimizer_states

    def state_dict_before_first_step(self):
        if len(self.optimizer.state):
            return state_dict(self)
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        for p in params:  # step 0, for the duration of the call
            self.optimizer.state[p] = {"step": torch.tensor(0.0)}
        try:
            return state_dict(self)
        finally:
            self.optimizer.state.clear()

    def load_state_dict_own_steps(self, sd):
        load_state_dict(self, sd)
        for state in self.optimizer.state.values():
            if "step" in state:
                state["step"] = state["step"].clone()

    def set_states_keep_step(self, model_param, tensors):
        if not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            group, order = self.model_param_group_index_map[model_param]
            current = self.optimizer.state[self.optimizer.param_groups[group]["params"][order]]
            tensors = {**{k: v for k, v in current.items() if k not in tensors and k != "param"}, **tensors}
        return set_states(self, model_param, tensors)

    cls.state_dict = state_dict_before_first_step
    cls.load_state_dict = load_state_dict_own_steps
    cls._set_main_param_and_optimizer_states = set_states_keep_step


def _fully_reshardable_bucket_padding() -> None:
    """``fully_reshardable`` distributed-optimizer checkpoints gather each buffer's optimizer state
    into a "world" tensor from which the padding at the end of every bucket is removed, then cut
    it with parameter offsets that still count that padding. With more than one bucket in a buffer
    (the tied output layer's own bucket on the last pipeline stage; many buckets at scale) the
    parameters after the first bucket are saved with other parameters' state — silently. The
    wrapper hands that method offsets without the padding."""
    from megatron.core.optimizer import distrib_optimizer as do

    cls = do.DistributedOptimizer
    sharded_param_state = cls.sharded_param_state_fully_reshardable

    def unpadded_offsets(buffer) -> dict:
        bucket_start, total = [], 0
        for bucket in buffer.buckets:  # where each bucket begins in the world tensor
            bucket_start.append(total)
            total += bucket.numel_unpadded
        return {
            param: (start - buffer.buckets[b].offset + bucket_start[b], end - buffer.buckets[b].offset + bucket_start[b], b)
            for param, (start, end, b) in buffer.param_index_map.items()
        }

    def with_unpadded_offsets(self, *args, **kwargs):
        padded = [buffer.param_index_map for buffer in self.buffers]
        try:
            for buffer in self.buffers:
                buffer.param_index_map = unpadded_offsets(buffer)
            return sharded_param_state(self, *args, **kwargs)
        finally:
            for buffer, index_map in zip(self.buffers, padded):
                buffer.param_index_map = index_map

    cls.sharded_param_state_fully_reshardable = with_unpadded_offsets


def _write_results_queue() -> None:
    """At its first checkpoint save megatron-core starts a multiprocessing manager, only to pass
    its (forked) writer processes' results back, with the "spawn" start method:
      * the signals of a job reach it: Slurm signals every process of a job step and Ctrl-C the
        terminal's process group, so the manager dies and the checkpoint the run saves on that
        signal fails (BrokenPipeError);
      * spawning re-imports the entry point (torch, megatron-core): about 8 s per process, paid by
        every run that saves.
    The replacement forks the manager, as megatron-core forks its writers, with SIGTERM and SIGINT
    ignored in it (the dispositions a forked process inherits); like every process forked after
    ``platform.install()`` it dies with its parent (``fbt_megatron.common.processes``), so no kill of the
    run leaves it behind. A fork made at the first save would be a copy-on-write snapshot of the
    whole training state that lives as long as the run: every page training rewrites afterwards
    becomes the manager's own, up to a second copy of the state (measured at fbt-1b's width: 3.7 GiB
    of a 4 GiB process with 2 layers after one more step; the OOM kill of the 24 layers). A run that
    saves therefore starts it before building its model (``start_write_results_queue``), and before
    its process group: upstream spawns the manager because a fork after CUDA and NCCL have started
    copies a process with their threads (a child that touches them can deadlock)."""
    import multiprocessing
    import signal

    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa

    def forked_results_queue(*args, **kwargs):  # (0.19: the start method to use, which it replaces)
        if fa._results_queue is None:
            previous = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGTERM, signal.SIGINT)}
            try:
                fa._results_queue = multiprocessing.get_context("fork").Manager().Queue()
            finally:
                for s, handler in previous.items():
                    signal.signal(s, handler)
        return fa._results_queue

    setattr(fa, compat.write_results_queue_getter(), forked_results_queue)


def start_write_results_queue() -> None:
    """Start the checkpoint writers' results-queue manager now, while this process holds no model
    and has not started CUDA or NCCL (``_write_results_queue``): before ``init_distributed`` in a
    run that saves, after ``apply()`` (``platform.install()``)."""
    assert _applied, "megatron_fixes.apply() (platform.install()) first: else megatron-core's own manager is started"
    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa

    getattr(fa, compat.write_results_queue_getter())()


def _accurate_gradient_norm() -> None:
    """Without Apex/TE megatron-core's global gradient norm (clipping, the logged ``grad_norm``) is
    ``local_multi_tensor_l2_norm``: ``torch.norm`` of each gradient, whose CPU kernel sums the
    squares in one float32 accumulator (PyTorch issue #169237) and comes out low by a relative
    4e-5 for a 1536 × 1536 matrix and 1.6e-3 for fbt-1b's 13312 × 1536 SwiGLU weight, less for
    TP shards (shorter): fbt-1b's norm moved by 1.9e-4 from one process to TP 2 while the
    gradients agreed to float32 rounding. The replacement sums each gradient's squares with torch's
    cascade summation in chunks of 4M elements (no copy of a whole gradient) and adds the chunks in
    float64: within ~1e-7 of the float64 norm at any size and layout. Apex's and TE's kernels are
    left alone."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    if clip_grads.l2_norm_impl is not utils.local_multi_tensor_l2_norm:
        return

    def l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
        squares = [part.float().square().sum().double() for tensors in tensor_lists for t in tensors
                   for part in t.detach().reshape(-1).split(1 << 22)]
        total = torch.stack(squares).sum() if squares else torch.zeros((), dtype=torch.float64, device="cuda")
        return total.sqrt().float().reshape(1), None

    clip_grads.l2_norm_impl = l2_norm
