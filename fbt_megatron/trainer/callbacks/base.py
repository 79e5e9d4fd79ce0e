"""The callbacks' protocol: what the training loop tells the helpers that watch or steer a run
(OLMo-core's ``train.callbacks``: a base class of no-op hooks, called in registration order).

``Callback``'s hooks, as ``trainer.loop.train`` calls them (``state``: the run's
``checkpointing.TrainState``, at the iteration just reached):

* ``on_start(state)``: before the first step (its saved state already back: ``load_state_dict``).
* ``on_step_start(state, k)``: a step of k passes has begun, its clock running and its gradients
  zeroed, before its batches (called by ``step.TrainStep``: what a callback does here counts in the
  step's time and in this rank's own part of it, ``stragglers``).
* ``pre_optim_step(state, report)``: the step's gradients are reduced, before their norm and the
  update (``report``: this rank's losses of the step, a dict of tensors; empty before the last
  pipeline stage); e.g. a drill's loss spike (``faults``).
* ``vetoes_update(state, grad_norm) -> bool``: the step's global gradient norm, finite, before the
  update; True: the update is not applied (``spikes``). Every callback is asked, whatever the
  others answer (a detector sees every norm).
* ``post_step(state, result) -> dict``: after the step and its validation, on every rank
  (``result``: the step's ``step.StepResult``; ``result.logged``: a step that makes a record): what
  the callback adds to that record ({}: nothing), merged in registration order; at a logged step
  a callback may run a collective here, since every rank calls it (the stragglers' all-gather:
  ``stragglers``; the largest rank's memory: ``memory``).
* ``on_step_end(state, record)``: after the step and its validation; ``record``: the step's log
  record, already on stdout, in ``metrics.jsonl`` and TensorBoard (``metrics.TrainingLog``), or
  None (not a logged step, or not the logging rank).
* ``save_checkpoint(state, stopping) -> Path | None``: the step's save point (``stopping``: why
  the run stops after this step, "signal", "duration" or "exit_interval", or None), every callback's
  state already in ``state.callbacks``: a checkpointer writes one when due and returns the run's
  newest checkpoint folder (``checkpointer``); the others return None.
* ``on_save(state, checkpoint)``: after the save point, whether or not it saved (``checkpoint``:
  the run's newest checkpoint folder, that step's own when it saved; None: none).
* ``on_stop(state, reason)``: the loop ended without an error; ``reason``: "finished",
  "exit_interval", "signal" or "duration" (``stopping``). The checkpointer comes first among
  those that look at the checkpoints: its background writes are complete for them.
* ``on_failure(state, error)``: an exception is leaving the loop (it is raised again afterwards).
* ``close()``: always, last (after the log's summary line), in registration order.

A callback that keeps state across steps says what to save (``state_dict() -> dict``; {}: none)
and takes it back (``load_state_dict``): the loop saves every callback's under its ``name`` in each
checkpoint's train state (``TrainState.callbacks``) and hands it back before ``on_start`` of a
resumed run, so a resumed run's callbacks decide as the uninterrupted run's.

``Callbacks`` calls one hook of every callback in the order they were registered
(``registry.callbacks_for`` states the run's order, and why).
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, Iterable, List, Optional


class Callback:
    """A helper of the training loop: override the hooks it needs (the module docstring); ``name``:
    the key of its state in a checkpoint."""

    name = ""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state_dict: dict) -> None:
        pass

    def on_start(self, state) -> None:
        pass

    def on_step_start(self, state, k: int) -> None:
        pass

    def pre_optim_step(self, state, report: dict) -> None:
        pass

    def vetoes_update(self, state, grad_norm: float) -> bool:
        return False

    def post_step(self, state, result) -> dict:
        return {}

    def on_step_end(self, state, record: Optional[dict]) -> None:
        pass

    def save_checkpoint(self, state, stopping: Optional[str]) -> Optional[Path]:
        return None

    def on_save(self, state, checkpoint) -> None:
        pass

    def on_stop(self, state, reason: str) -> None:
        pass

    def on_failure(self, state, error: BaseException) -> None:
        pass

    def close(self) -> None:
        pass


class Callbacks:
    """A run's callbacks in their order: each method calls that hook of every one, first to last."""

    def __init__(self, callbacks: Iterable[Callback]):
        self.callbacks: List[Callback] = list(callbacks)
        names = [c.name for c in self.callbacks if c.name]
        if len(set(names)) != len(names):
            raise ValueError(f"callbacks share a name (their state's key in a checkpoint): {names}")

    def state_dict(self) -> Dict[str, dict]:
        """{name: state} of the callbacks that have state (saved in each checkpoint: ``TrainState.callbacks``)."""
        return {c.name: s for c in self.callbacks if c.name for s in [c.state_dict()] if s}

    def start(self, state) -> None:
        """Each callback's saved state back (``state.callbacks``: none from scratch), then ``on_start``."""
        for callback in self.callbacks:
            if callback.name in state.callbacks:
                callback.load_state_dict(state.callbacks[callback.name])
        for callback in self.callbacks:
            callback.on_start(state)

    def step_start(self, state, k: int) -> None:
        for callback in self.callbacks:
            callback.on_step_start(state, k)

    def pre_optim_step(self, state, report: dict) -> None:
        for callback in self.callbacks:
            callback.pre_optim_step(state, report)

    def vetoes_update(self, state, grad_norm: float) -> bool:
        """Whether any callback vetoes the update (every one is asked)."""
        return any([callback.vetoes_update(state, grad_norm) for callback in self.callbacks])

    def post_step(self, state, result) -> dict:
        """What the callbacks add to the step's record, merged first to last."""
        fields = {}
        for callback in self.callbacks:
            fields.update(callback.post_step(state, result))
        return fields

    def step_end(self, state, record: Optional[dict]) -> None:
        for callback in self.callbacks:
            callback.on_step_end(state, record)

    def save_point(self, state, stopping: Optional[str]) -> None:
        """The step's save point: every callback's state into ``state.callbacks`` (saved with the
        checkpoint), each callback's ``save_checkpoint``, then ``on_save`` with the newest checkpoint."""
        state.callbacks = self.state_dict()
        newest = None
        for callback in self.callbacks:
            newest = callback.save_checkpoint(state, stopping) or newest
        for callback in self.callbacks:
            callback.on_save(state, newest)

    def stop(self, state, reason: str) -> None:
        for callback in self.callbacks:
            callback.on_stop(state, reason)

    def failure(self, state, error: BaseException) -> None:
        for callback in self.callbacks:
            callback.on_failure(state, error)

    def close(self) -> None:
        """Every callback's ``close``, even after one fails (the first failure is raised afterwards)."""
        failed = None
        for callback in self.callbacks:
            try:
                callback.close()
            except Exception as e:
                failed = failed or e
        if failed is not None:
            raise failed
