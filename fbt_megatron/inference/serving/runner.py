"""Two hooks in vLLM's V1 model runner (``GPUModelRunner``, which the CPU runner inherits) that give
an FBT model its step's requests. Installed once per process by the plugin; models without a
``feedback_state`` are not touched.

* ``execute_model``: first, the slots of the requests the scheduler finished, aborted or preempted
  since the last step go back to the buffer (``SchedulerOutput.finished_req_ids`` /
  ``preempted_req_ids``);
* ``_model_forward`` (real steps only: profile and dummy runs call the model directly): the plan of
  the step from the persistent batch (request ids in row order, ``query_start_loc``, computed
  tokens, prompt lengths, each request's ``SamplingParams.extra_args``), set on the model for the
  forward and cleared after it (``FeedbackState.finish``: the index tensors neutral again). What
  depends only on which requests the batch holds, in which order (their modes, prompt lengths,
  slots), is worked out once per such layout.

On GPUs vLLM 0.32 defaults to "model runner V2", whose per-request hook is the model's
``get_model_state_cls()``; the engine refuses it for FBT (``engine``) until that is written.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import List, Optional

import numpy as np

from fbt_megatron.inference.serving.requests import request_mode
from fbt_megatron.inference.serving.state import Rows


def _feedback(runner):
    return getattr(getattr(runner, "model", None), "feedback_state", None)


def _mode(request, defaults):
    """The request's mode, resolved once (kept on vLLM's per-request state; the mode never changes)."""
    mode = getattr(request, "_fbt_mode", None)
    if mode is None:
        mode = request._fbt_mode = request_mode(request.sampling_params.extra_args if request.sampling_params else None,
                                                defaults)
    return mode


@dataclass
class _Layout:
    """The soft/fused requests of the persistent batch while its requests and their order stay the
    same (in decode, most steps): their rows, ids (one list object: the state's key for their
    slots), modes and prompt lengths."""

    key: tuple  # the batch's request ids
    index: np.ndarray  # their rows in the batch
    next: np.ndarray  # index + 1
    req_ids: List[str]
    modes: list
    prompt_length: np.ndarray


def _layout(runner, ids: List[str], defaults) -> _Layout:
    layout = getattr(runner, "_fbt_layout", None)
    key = tuple(ids)
    if layout is not None and layout.key == key:
        return layout
    requests = runner.requests
    modes = [_mode(requests[req_id], defaults) for req_id in ids]
    picked = [i for i, mode in enumerate(modes) if mode.feedback]
    prompt = np.array([requests[ids[i]].num_prompt_tokens for i in picked], dtype=np.int64)
    scored = np.array([modes[i].prompt_length or prompt[k] for k, i in enumerate(picked)], dtype=np.int64)
    index = np.array(picked, dtype=np.int64)
    layout = runner._fbt_layout = _Layout(key, index, index + 1, [ids[i] for i in picked], [modes[i] for i in picked],
                                          np.minimum(scored, prompt))
    return layout


def step_rows(runner, defaults) -> tuple[int, Optional[Rows]]:
    """The step's token count and its soft/fused requests in the packed batch's order (None when it
    has none: standard requests need nothing of the state)."""
    batch = runner.input_batch
    num_reqs = batch.num_reqs
    starts = runner.query_start_loc.np
    num_tokens = int(starts[num_reqs])
    layout = _layout(runner, batch.req_ids[:num_reqs], defaults)
    if not layout.req_ids:
        return num_tokens, None
    index = layout.index
    return num_tokens, Rows(layout.req_ids, layout.modes, starts[index], starts[layout.next],
                            batch.num_computed_tokens_cpu[index], layout.prompt_length, num_tokens == num_reqs)


def install() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from fbt_megatron.inference.serving.engine import export_defaults

    if getattr(GPUModelRunner, "_fbt_hooks", False):
        return

    execute_model, model_forward = GPUModelRunner.execute_model, GPUModelRunner._model_forward

    @functools.wraps(execute_model)
    def execute_model_hook(self, scheduler_output, *args, **kwargs):
        state = _feedback(self)
        if state is not None:
            state.release(scheduler_output.finished_req_ids)
            state.release(scheduler_output.preempted_req_ids or (), preempted=True)
        return execute_model(self, scheduler_output, *args, **kwargs)

    @functools.wraps(model_forward)
    def model_forward_hook(self, *args, **kwargs):
        state = _feedback(self)
        if state is None:
            return model_forward(self, *args, **kwargs)
        defaults = getattr(self, "_fbt_defaults", None)
        if defaults is None:
            defaults = self._fbt_defaults = export_defaults(self.model_config.hf_config, self.scheduler_config)
        state.prepare(*step_rows(self, defaults))
        try:
            return model_forward(self, *args, **kwargs)
        finally:
            state.finish()

    GPUModelRunner.execute_model = execute_model_hook
    GPUModelRunner._model_forward = model_forward_hook
    GPUModelRunner._fbt_hooks = True
