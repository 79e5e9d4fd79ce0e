"""One training step, and validation: the microbatches of a global batch through the pass-aware
schedule.

``TrainStep`` keeps the forward-backward and the optimizer step; the loop's callbacks
(``callbacks.base``) come in at three hooks. Top to bottom: zero the gradients → the callbacks'
``on_step_start`` (``--inject-fault``: a crash, hang or slow step of this rank; ``--inject-nan``: a
poisoned batch; ``callbacks.faults``) → megatron-core's forward-backward schedule over this rank's
microbatches, each doing k passes (``distributed.pipeline``: all passes in one forward step at
PP = 1, passes as virtual pipeline chunks at PP > 1), gradients reduced by DDP → the callbacks'
``pre_optim_step`` (a drill's poisoned or spiking gradient) → the optimizer step, skipped for a
NaN/Inf gradient norm (``bad_steps.optimizer_step``) or when a callback vetoes the update
(``vetoes_update``: a spike to skip or rewind, ``callbacks.spikes``) → the learning-rate step → the
bad-step record. The step times itself: its whole time and this rank's
own part, up to the gradient reduction (``callbacks.stragglers.StepClock``). A logged step
(``intervals.logged``) measures the state deltas too and averages its report over the
data-parallel ranks (``data_parallel_mean``: floats, for the log). ``TrainStep.evaluate`` runs the
validation batches forward only, after 0, 1, …, n fused passes, when due (``intervals``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import logging
import torch
import torch.distributed as dist
from megatron.core import parallel_state

from fbt_megatron.common import platform
from fbt_megatron.common.seeds import sequence_seed
from fbt_megatron.data.packed_rows import PackedRows
from fbt_megatron.distributed import pipeline
from fbt_megatron.model.losses import z_loss_coefficient
from fbt_megatron.model.sequence import shard_positions
from fbt_megatron.optimizers.schedule import cooldown_start
from fbt_megatron.recipe import Recipe
from fbt_megatron.trainer import intervals
from fbt_megatron.trainer.bad_steps import BadSteps, optimizer_step
from fbt_megatron.trainer.norms import gradient_squares, layer_norms
from fbt_megatron.trainer.callbacks.stragglers import StepClock

log = logging.getLogger(__name__)


# ---------------------------------------------------------------- batches
def microbatches(dataset, first_sample: int, recipe: Recipe, dp_rank: int, dp_size: int):
    """This data-parallel rank's microbatches of the global batch starting at ``first_sample``.
    Global batch g holds samples [g·G, (g+1)·G); rank r takes its contiguous G/dp of them. Under
    context parallelism each CP rank keeps its load-balanced chunks of every sequence. Rows of
    packed conversations (SFT: items with ``segments`` and ``plain``) come with ``packed``
    (``data.packed_rows.PackedRows``)."""
    t = recipe.training
    cp = parallel_state.get_context_parallel_world_size()
    columns = shard_positions(recipe.data.seq_length, parallel_state.get_context_parallel_rank(), cp, 0, 1)
    per_rank = t.global_batch_size // dp_size
    start = first_sample + dp_rank * per_rank
    for m in range(per_rank // t.micro_batch_size):
        ids = range(start + m * t.micro_batch_size, start + (m + 1) * t.micro_batch_size)
        items = [dataset[i] for i in ids]
        batch = {
            key: torch.stack([torch.as_tensor(item[key]) for item in items])[:, columns].to(platform.device())
            for key in ("tokens", "labels", "loss_mask", "segments", "plain") if key in items[0]
        }
        batch["seeds"] = [sequence_seed(t.seed, i) for i in ids]
        if "segments" in batch:  # packed conversations (SFT): attention and feedback stay inside each
            batch["packed"] = PackedRows(batch.pop("segments"), batch.pop("plain"),
                                         prompt_prefix=recipe.data.sft_prefix_mixin == "prompt")
        yield batch


def run_schedule(recipe: Recipe, ddp, dataset, first_sample: int, num_passes: int, forward_only: bool, measure_deltas: bool = True):
    """One global batch through the pass-aware schedule (``distributed.pipeline``); returns this
    rank's per-pass losses and state deltas (tensors) averaged over its microbatches."""
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    t = recipe.training
    reports = pipeline.forward_backward(
        ddp,
        list(microbatches(dataset, first_sample, recipe, dp_rank, dp_size)),
        num_passes,
        seq_length=recipe.data.seq_length,
        micro_batch_size=t.micro_batch_size,
        forward_only=forward_only,
        measure_deltas=measure_deltas,
    )
    out = {}
    for key in ("pass_losses", "state_delta_squares"):
        if reports and key in reports[0]:
            out[key] = torch.stack([r[key] for r in reports]).mean(0)
    return out


def data_parallel_mean(report: dict) -> dict:
    """A step's report averaged over data- and context-parallel ranks (and over the TP ranks, which
    hold shards of the sequence under SP), as floats (one host sync: log steps only); the mean
    squared state deltas become ‖Δs‖, the RMS over all tokens."""
    out = {}
    for key, value in report.items():
        value = value.clone()
        for group in (parallel_state.get_data_parallel_group(with_context_parallel=True), parallel_state.get_tensor_model_parallel_group()):
            dist.all_reduce(value, group=group)
            value /= dist.get_world_size(group)
        if key == "state_delta_squares":
            key, value = "state_deltas", value.sqrt()
        out[key] = value.tolist()
    return out


# ---------------------------------------------------------------- the step
@dataclass
class StepResult:
    report: dict  # per-pass losses, state deltas and z-loss: at a logged step averaged over the data-parallel
    # ranks (floats: data_parallel_mean), else this rank's (tensors); empty before the last pipeline stage
    grad_norm: Optional[float]  # the global gradient norm (None: the fp16 loss scaler found an overflow)
    lr: float  # the learning rate after the step (the first param group's)
    layer_norms: Optional[dict] = None  # every --log-layer-norms-interval steps: norms.layer_norms
    seconds: float = 0.0  # the step's wall time
    own: Optional[float] = None  # this rank's own seconds of it, up to the gradient reduction (callbacks.stragglers)
    logged: bool = False  # the step makes a record (intervals.logged)


class TrainStep:
    """One optimizer step of the run (the module docstring). ``bad`` counts the skipped steps and
    the current run of bad ones (``bad_steps.BadSteps``); each skipped step is logged."""

    def __init__(self, recipe: Recipe, model, ddp, optimizer, scheduler, dataset, lr_schedule: dict, skipped_steps: int):
        t = recipe.training
        self.recipe, self.model, self.ddp, self.optimizer, self.scheduler = recipe, model, ddp, optimizer, scheduler
        self.dataset, self.cooldown = dataset, cooldown_start(lr_schedule)
        self.bad = BadSteps(t.max_bad_steps, skipped_steps)
        self.clock = StepClock(ddp.config, profile=bool(recipe.logging.straggler_threshold) and dist.get_world_size() > 1)

    def __call__(self, state, k: int, callbacks) -> StepResult:
        """The step after ``state`` (``checkpointing.TrainState``) with k passes; ``callbacks``: the
        run's (``callbacks.base.Callbacks``: the module docstring says when each is called)."""
        logged = intervals.logged(self.recipe, state.iteration + 1)  # its state deltas ‖Δs‖ measured, its report averaged
        self.clock.start(logged=logged)
        t, step, model = self.recipe.training, state.iteration + 1, self.model
        self.ddp.start_step(k)
        model.z_loss.start_step(z_loss_coefficient(t, self.cooldown, state.iteration))
        self.optimizer.zero_grad()
        callbacks.step_start(state, k)  # inside the step's clock: an injected slow step counts in this rank's own time
        report = run_schedule(self.recipe, self.ddp, self.dataset, state.consumed_samples, k, forward_only=False,
                              measure_deltas=logged)
        callbacks.pre_optim_step(state, report)  # the gradients reduced, before their norm
        if report and t.z_loss_coeff:  # logged from the first step: 0 before the z-loss switches on
            report["z_loss"] = model.z_loss.value(model.config)
        interval = self.recipe.logging.log_layer_norms_interval
        grads = gradient_squares(model, self.ddp, float(self.optimizer.get_loss_scale())) if interval and step % interval == 0 else None
        # no update when the gradient norm is NaN/Inf, or a callback vetoes it (a spike to skip or rewind)
        updated, grad_norm = optimizer_step(self.optimizer, lambda norm: callbacks.vetoes_update(state, norm))
        norms = layer_norms(model, grads) if grads is not None else None
        if updated:
            self.scheduler.step(increment=1)
        self.bad.record(step, updated, grad_norm)
        if self.bad.consecutive:
            log.info(f"step {step} skipped: gradient norm {grad_norm} ({self.bad.consecutive} in a row, "
                     f"{self.bad.skipped} in all)")
        seconds = self.clock.stop()
        report = data_parallel_mean(report) if report and logged else report  # (after the clock: the log's work)
        return StepResult(report, grad_norm, self.scheduler.get_lr(self.optimizer.param_groups[0]), norms, *seconds, logged)

    def evaluate(self, valid) -> dict:
        """Validation loss on ``valid`` after 0, 1, …, n fused prefill passes (eval mode: no prefix
        mixin, no jitter); {} before the last pipeline stage."""
        t = self.recipe.training
        n = t.fused_prefill_passes if self.model.config.latent_feedback else 0
        self.ddp.eval()
        losses = []
        with torch.no_grad():
            for i in range(t.eval_iters):
                report = run_schedule(self.recipe, self.ddp, valid, i * t.global_batch_size, n + 1, forward_only=True)
                if report:  # the last pipeline stage
                    losses.append(data_parallel_mean(report)["pass_losses"])
        self.ddp.train()
        if not losses:
            return {}
        mean = torch.tensor(losses).mean(0).tolist()
        return {f"valid_loss_fused{j}": v for j, v in enumerate(mean)}
