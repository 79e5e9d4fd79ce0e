"""Training logs: one record per logged step, made here (``TrainingLog``) and handed to the loop's
callbacks, the first of which writes it to stdout, TensorBoard and ``<save>/metrics.jsonl``
(``callbacks.metrics_writer``); then Weights & Biases (``--wandb-project``: ``callbacks.wandb_writer``).

``TrainingLog`` makes the records: the window of steps since the last one (its time, throughput and
MFU), the losses, the pass schedule's phase and shares, the z-loss, validation, and what the
callbacks add (``post_step``: the stragglers, the largest rank's memory); ``header`` and
``validation_note`` open the log.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Optional

from fbt_megatron.common.cli import plural
from fbt_megatron.common.clock import utc

log = logging.getLogger(__name__)



class PassShares:
    """The pass-schedule phase of a run's latest step and the share of its steps so far that ran
    each k, counted from the pure schedule (``passes.PassSchedule``): a resumed run logs what an
    uninterrupted one does. Counting continues from the previous call (a resumed run's first
    call counts the steps before the resume once)."""

    def __init__(self, schedule):
        self.schedule, self.counts, self.steps = schedule, Counter(), 0

    def __call__(self, steps: int) -> dict:
        """``phase`` of step ``steps`` (1-based: the one just run) and ``k_share`` {"k": fraction} over steps 1..steps."""
        self.counts.update(self.schedule(i) for i in range(self.steps, steps))
        self.steps = steps
        return {"phase": self.schedule.phase(steps - 1),
                "k_share": {str(k): n / steps for k, n in sorted(self.counts.items())}}


class TrainingLog:
    """The log of a training run on this rank. Every step's time (``step.StepResult``: the step's
    own clock) joins the current window; a logged step (every ``--log-interval``, every validation
    and the last) makes a record: the objective and the per-pass losses (averaged over the
    data-parallel ranks), its time (Unix and UTC), ‖Δs‖, learning rate, gradient norm, skipped steps,
    the window's time per step and throughput, tokens, MFU (``plan.flops.Throughput``), the pass
    phase and shares (``PassShares``), the z-loss, every ``--log-layer-norms-interval`` steps each
    layer's norms (``norms``), then the validation losses the loop measured after the step and what
    the callbacks add (``callbacks.base``'s ``post_step``: memory, stragglers). Only the last
    pipeline stage has the losses and makes records."""

    def __init__(self, recipe, config, passes, state):
        import torch.distributed as dist

        from fbt_megatron.common.gpus import peak_tflops
        from fbt_megatron.model.flops import Throughput

        g = recipe.logging
        self.recipe, self.config = recipe, config
        self.throughput = Throughput(config, dist.get_world_size(), peak_tflops(g.peak_tflops), state.tokens, state.compute_tokens)
        self.pass_shares = PassShares(passes)
        self.records, self.window_time, self.window_steps = [], 0.0, 0

    def end_step(self, state, k: int, step, fields: dict) -> Optional[dict]:
        """After the step (``step.StepResult``, k passes) that brought ``state`` to its iteration:
        at a logged step of the logging rank its record, with ``fields`` (the validation's losses,
        what the callbacks add), for the callbacks (``metrics_writer`` writes it first); else None."""
        self.window_time += step.seconds
        self.window_steps += 1
        if not step.logged or not step.report:  # not logged, or not the last pipeline stage: no losses here
            return None
        record = {**self._record(state, k, step), **fields}
        self.window_time, self.window_steps = 0.0, 0
        self.records.append(record)
        return record

    def _record(self, state, k: int, step) -> dict:
        from fbt_megatron.model.fbt import pass_weights

        report = step.report  # averaged over the data-parallel ranks at a logged step
        losses, now = report["pass_losses"], time.time()
        tokens_per_step = self.recipe.training.global_batch_size * self.recipe.data.seq_length
        record = {
            "step": state.iteration,
            "time": round(now, 3),  # when the step ended: Unix seconds, to line a run up with a cluster's events
            "time_utc": utc(now),  # the same, ISO 8601 (the log line's)
            "k": k,
            "loss": sum(w * l for w, l in zip(pass_weights(self.config, k), losses)),
            "pass_losses": losses,
            "state_deltas": report.get("state_deltas", []),
            "lr": step.lr,
            "grad_norm": step.grad_norm,
            "skipped_steps": state.skipped_steps,
            "iteration_time": self.window_time / self.window_steps,
            "tokens_per_s": self.window_steps * tokens_per_step / self.window_time,
            "tokens": state.tokens,
            "compute_tokens": state.compute_tokens,
        }
        record.update(self.throughput.fields(record))  # tokens/s and model TFLOP/s per GPU, MFU (fbt_megatron.model.flops)
        record.update(self.pass_shares(state.iteration))  # the step's pass-schedule phase, the share of each k so far
        record.update(step.layer_norms or {})  # param_norms, grad_norms: {layer: norm}
        if "z_loss" in report:  # `loss` is the objective, cross-entropy + z; `pass_losses` stay cross-entropy
            record.update(z_loss=report["z_loss"], loss=record["loss"] + report["z_loss"])
        return record



def header(recipe, model, vocab: int, data, schedule: dict, start: int) -> str:
    """The lines a run's log opens with: model, data, layout, steps, learning rate, passes, FLOPs."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from fbt_megatron.model.flops import flops_per_token
    from fbt_megatron.optimizers.schedule import describe_schedule
    from fbt_megatron.trainer.passes import pass_schedule

    t, p = recipe.training, recipe.parallel
    tokenizer_vocab = data.tokenizer.vocab_size
    return (
        f"fbt-megatron: {recipe.model.preset}, {sum(q.numel() for q in model.parameters()):,} parameters on this rank, "
        f"vocabulary {tokenizer_vocab:,}" + (f" (padded to {vocab:,})" if vocab != tokenizer_vocab else "") + "\n"
        f"  data {data.source}; world {dist.get_world_size()} (tp {p.tensor_model_parallel_size}, "
        f"pp {p.pipeline_model_parallel_size}, cp {p.context_parallel_size}"
        + (f" over {model.config.cp_comm_type}" if model.config.cp_comm_type else "")
        + f", dp {parallel_state.get_data_parallel_world_size()}); "
        f"steps {start}→{t.train_iters} of {t.global_batch_size} × {recipe.data.seq_length} tokens\n"
        f"  learning rate: {describe_schedule(schedule, t.train_iters)}\n"
        f"  passes: {pass_schedule(recipe).describe()}\n"
        f"  model FLOPs per token (fwd+bwd, fbt_megatron.model.flops): "
        + ", ".join(f"{flops_per_token(model.config, k):.3g} at k = {k}" for k in sorted(pass_schedule(recipe).expected_passes(t.train_iters)))
    )


def validation_note(valid, recipe) -> Optional[str]:
    """A note when validation reads the training blend (``--train-data-path`` without
    ``--valid-data-path``), a warning when it asks for more sequences than the validation split
    holds (they repeat, so the loss is measured on less text than it seems)."""
    t, length, d = recipe.training, recipe.data.seq_length, recipe.data
    if t.eval_iters and d.train_data_path is not None and d.valid_data_path is None:
        return ("note: validation reads the training data (--train-data-path, no --valid-data-path): its loss is "
                "measured on sequences trained on; give --valid-data-path a held-out blend to measure generalization")
    documents = getattr(valid, "dataset", None)
    if documents is None or not hasattr(valid, "indices"):  # a blend or another dataset class
        return None
    tokens = int(documents.sequence_lengths[valid.indices].sum())
    distinct, asked = max(1, (tokens - 1) // length), t.eval_iters * t.global_batch_size
    if not t.eval_iters or asked <= distinct:
        return None
    return (f"warning: validation reads {asked} sequences of {length} tokens but its split holds {tokens:,} tokens "
            f"({distinct} distinct sequences): they repeat; use a larger validation split or fewer --eval-iters")


def epochs_note(train, recipe) -> Optional[str]:
    """A warning when fine-tuning (``--sft``) reads its set of packed rows more than once: the
    conversations repeat, as ``validation_note`` says of validation."""
    t = recipe.training
    if not recipe.data.sft or not len(train):
        return None
    asked = t.train_iters * t.global_batch_size
    epochs = asked / len(train)
    if epochs <= 1:
        return None
    return (f"warning: SFT reads {asked:,} rows ({plural(t.train_iters, 'step')} × {t.global_batch_size}) of a set of "
            f"{plural(len(train), 'row')}: {epochs:.1f} epochs, every conversation about {epochs:.0f} times; add conversations "
            f"or lower --train-iters to repeat them less")
