"""The pass-aware forward-backward step: k passes of every microbatch on megatron-core schedules.

PP = 1 — megatron-core's no-pipelining schedule; a microbatch's forward step runs its k passes
(``fbt.multi_pass_loss``) and returns their weighted loss.

PP > 1 — the k passes are k *virtual pipeline chunks* of one stage (the same module object k
times) in megatron-core's interleaved 1F1B schedule. Its ring wraps from the last rank's chunk j
to the first rank's chunk j+1, which is the route of the carried state: pass j's top states
s^{(j)} leave the last stage and enter pass j+1's fusion on the first stage, and in backward
their gradient travels the same way back. Pass j < k's loss is computed on the last stage and
rides on the state it sends (``_AttachLoss``: identity forward, and its backward also starts that
loss's gradient); pass k's loss goes through the schedule's loss function. Microbatches stay
pipelined across stages and passes; k may change every step (the chunk count is set per call).
For k = 1 this is megatron-core's plain 1F1B schedule.

A stage runs pass j as ``stage_pass``: the first stage embeds and fuses (``fbt.run_pass``), a later
one continues from the previous stage's hidden states. With ``recompute_passes`` a chunk is not
checkpointed when the schedule runs its backward right after its forward (``backward_next``): in
1F1B that is pass k on the last stage.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import List, Optional, Set, Tuple

import torch
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import schedules

from fbt_megatron.model.fbt import default_feedback, masked_mean, multi_pass_loss, pass_weights, run_pass, state_delta_square
from fbt_megatron.model.offload import recomputed_pass


def stage() -> dict:
    """This rank's pipeline stage as FBTModel arguments: does it embed, does it compute losses."""
    return dict(
        pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=True),
        post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=True),
    )


class _AttachLoss(torch.autograd.Function):
    """state ↦ a copy of state; backward: the state's gradient, and ``scale`` as the gradient of
    ``loss`` (a non-final pass's loss joins the backward of the state it was computed beside)."""

    @staticmethod
    def forward(ctx, state, loss, scale):
        ctx.save_for_backward(scale)
        ctx.loss_shape = loss.shape
        return state.clone()  # a new tensor: the schedule may scale its outputs in place

    @staticmethod
    def backward(ctx, grad):
        (scale,) = ctx.saved_tensors
        return grad, scale.reshape(ctx.loss_shape), None


def _unwrap(model):
    return model.module if hasattr(model, "module") else model


def _loss_tokens(config, loss_mask: torch.Tensor) -> Optional[torch.Tensor]:
    """Under CP each rank holds part of every sequence: the microbatch's loss tokens over all of
    them, so that a rank's loss is its share of the microbatch mean (None without CP)."""
    if config.context_parallel_size == 1:
        return None
    count = loss_mask.sum().float()
    torch.distributed.all_reduce(count, group=parallel_state.get_context_parallel_group())
    return count


def _microbatch_report(config, losses: List[torch.Tensor], deltas: List[torch.Tensor]) -> dict:
    """Per-pass losses (a CP rank's share × cp, so that the mean over CP ranks is the microbatch's
    loss) and mean squared state deltas, for logging."""
    report = {"pass_losses": torch.stack(losses).float() * config.context_parallel_size}
    if deltas:
        report["state_delta_squares"] = torch.stack(deltas).float()
    return report


def stage_pass(module, batch: dict, labels, pass_index: int, feedback_fn, backward_next: bool):
    """Pass j of one microbatch on this stage → (output, top state): the first stage embeds and
    fuses the previous pass's top states that it received (``fbt.run_pass``); a later stage
    continues from the previous stage's hidden states (its output; top state None before the last)."""
    packed = batch.get("packed")  # packed conversations (SFT): every stage masks their attention
    if module.pre_process:
        return run_pass(module, batch["tokens"], labels, pass_index, module.received, feedback_fn, backward_next, packed)
    attention_mask = None if packed is None else packed.attention_mask

    def forward(_, labels, hidden_states):
        return module(batch["tokens"], labels=labels, hidden_states=hidden_states, attention_mask=attention_mask)

    return recomputed_pass(module.config, forward, None, labels, module.received, backward_next)


def _whole_model_step(num_passes: int, measure_deltas: bool, data_iterator, model):
    """PP = 1: all k passes of one microbatch."""
    _, _, batch = next(data_iterator)
    module = _unwrap(model)
    out = multi_pass_loss(
        module, batch["tokens"], batch["labels"], batch["loss_mask"], num_passes, batch["seeds"],
        num_tokens=_loss_tokens(module.config, batch["loss_mask"]), packed=batch.get("packed"),
    )
    report = _microbatch_report(module.config, out.pass_losses, out.state_delta_squares if measure_deltas else [])
    return out.loss, lambda loss: (loss, report)


def backward_next(config, num_passes: int, num_microbatches: int) -> Set[Tuple[int, int]]:
    """The (pass j, microbatch) chunks whose backward megatron-core's (interleaved) 1F1B schedule runs
    on this rank right after their forward: checkpointing those would only add a forward.

    It replays the schedule's order from megatron-core's own warm-up count and schedule table:
    warm-up forwards, then per step one forward and one backward, then the remaining backwards; a
    backward of chunk c takes c's oldest pending forward. This finds pass k on the last stage —
    for every microbatch unless the last microbatch group is smaller than the others, whose pass-k
    forwards then run ahead of their backwards. On earlier stages a backward waits for the later
    stages, so other chunks' forwards always run in between (a chunk left unrecomputed there would
    hold its activations across them: more memory, not a skipped cost)."""
    group = config.microbatch_group_size_per_vp_stage
    communicator = SimpleNamespace(  # what get_pp_rank_microbatches reads of the schedule's communicator
        pp_group=parallel_state.get_pipeline_model_parallel_group(),
        virtual_pipeline_model_parallel_size=num_passes if num_passes > 1 else None,
    )
    total, _, warmup, _ = schedules.get_pp_rank_microbatches(
        num_microbatches, num_passes, group, overlap_moe_expert_parallel_comm=config.overlap_moe_expert_parallel_comm,
        p2p_communicator=communicator,
    )
    table = schedules.get_schedule_table(num_microbatches, num_passes, group)  # virtual id → (microbatch, chunk)
    order = [("F", v) for v in range(warmup)]
    for i in range(total - warmup):
        order += [("F", warmup + i), ("B", i)]
    order += [("B", i) for i in range(total - warmup, total)]
    pending = {c: [] for c in range(num_passes)}  # chunk → microbatches forwarded, backward not yet run
    found, last_forward = set(), None
    for kind, v in order:
        if kind == "F":
            m, c = table[v]
            pending[c].append(m)
            last_forward = (c, m)
            continue
        c = num_passes - 1 - table[v][1]  # backward runs the chunks in reverse
        chunk = (c, pending[c].pop(0))
        if chunk == last_forward:
            found.add((c + 1, chunk[1]))
        last_forward = None
    return found


class _PassChunkStep:
    """PP > 1: the forward step of virtual chunk j − 1 = pass j on this stage."""

    def __init__(self, config, num_passes: int, num_microbatches: int, measure_deltas: bool, forward_only: bool):
        self.config, self.k, self.m, self.measure_deltas = config, num_passes, num_microbatches, measure_deltas
        self.backward_next = set() if forward_only else backward_next(config, num_passes, num_microbatches)
        self.weights = pass_weights(config, num_passes)
        self.passes = {}  # microbatch → (losses, deltas, last top state) on the last stage
        self.loss_tokens = {}  # microbatch → its loss tokens over whole sequences (CP), counted once

    def loss_gradient_scale(self, j: int, device) -> torch.Tensor:
        """∂(step loss)/∂L_j as the schedule would apply it: w_j · cp / M, times the loss scale."""
        one = torch.ones(1, device=device)
        scale = self.config.grad_scale_func(one) if self.config.grad_scale_func is not None else one
        return scale * (self.weights[j - 1] * self.config.context_parallel_size / self.m)

    def __call__(self, data_iterator, model):
        j, m, batch = next(data_iterator)
        module = _unwrap(model)
        labels = batch["labels"] if module.post_process else None
        feedback_fn = default_feedback(module, batch["tokens"], batch["seeds"], batch.get("packed"))
        out, top = stage_pass(module, batch, labels, j, feedback_fn, backward_next=(j, m) in self.backward_next)
        if not module.post_process:
            return out, None  # hidden states, sent to the next stage
        if m not in self.loss_tokens:
            self.loss_tokens[m] = _loss_tokens(self.config, batch["loss_mask"])
        loss = masked_mean(out, batch["loss_mask"], self.loss_tokens[m])
        losses, deltas, previous = self.passes.get(m, ([], [], None))
        losses.append(loss.detach())
        if self.measure_deltas and previous is not None:
            deltas.append(state_delta_square(top, previous))
        self.passes[m] = (losses, deltas, top.detach() if self.measure_deltas else None)
        if j < self.k:  # s^{(j)} travels on to pass j + 1, carrying L_j's gradient
            return _AttachLoss.apply(top, loss, self.loss_gradient_scale(j, loss.device)), None
        report = _microbatch_report(self.config, *self.passes.pop(m)[:2])
        return loss, lambda loss: (self.weights[-1] * loss, report)


def forward_backward(
    ddp, batches: List[dict], num_passes: int, seq_length: int, micro_batch_size: int,
    forward_only: bool = False, measure_deltas: bool = False,
) -> List[dict]:
    """One global batch (this rank's microbatches) with k passes each; gradients are left in the
    DDP buffers. Returns per-microbatch reports (pass losses, state deltas) on the last stage."""
    config = ddp.config
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    tagged = lambda j: iter([(j, m, batch) for m, batch in enumerate(batches)])  # noqa: E731
    common = dict(
        num_microbatches=len(batches), seq_length=seq_length, micro_batch_size=micro_batch_size, forward_only=forward_only
    )
    if pp == 1:
        step = lambda it, model: _whole_model_step(num_passes, measure_deltas, it, model)  # noqa: E731
        return schedules.forward_backward_no_pipelining(forward_step_func=step, data_iterator=tagged(1), model=[ddp], **common)
    assert not config.detach_feedback, "detach_feedback (an ablation) is not supported with pipeline parallelism"
    step = _PassChunkStep(config, num_passes, len(batches), measure_deltas, forward_only)
    config.batch_p2p_comm = pp > 2  # batched p2p pairs wrongly on the PP=2 ring (prev = next rank)
    if num_passes == 1:
        return schedules.forward_backward_pipelining_without_interleaving(
            forward_step_func=step, data_iterator=tagged(1), model=[ddp], **common
        )
    config.virtual_pipeline_model_parallel_size = num_passes  # the schedule's chunk count: k, this call only
    try:
        return schedules.forward_backward_pipelining_with_interleaving(
            forward_step_func=step,
            data_iterator=[tagged(j) for j in range(1, num_passes + 1)],
            model=[ddp] * num_passes,  # one stage, k passes: the same module (and DDP buffers) k times
            **common,
        )
    finally:
        config.virtual_pipeline_model_parallel_size = None
