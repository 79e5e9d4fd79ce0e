"""lm-eval's ``fbt-vllm`` model: an FBT export served by vLLM (``fbt_megatron.inference.serving``), scored in a
decode mode.

    --model fbt-vllm --model_args pretrained=DIR,decode_mode=soft
    python -m fbt_megatron.evaluation lm-eval run --backend vllm --model fbt --model_args pretrained=DIR,...

A subclass of lm-eval's ``vllm`` model (same tokenization, truncation, batching, generation) in
which every request carries the mode in ``SamplingParams.extra_args``. A loglikelihood request
(context, continuation) is one prompt over context + continuation with ``prompt_logprobs`` and
``prompt_length`` = the context's tokens: vLLM's FBT model computes the context as the mode's
prefill and feeds the continuation's positions back one at a time, which equals the HF export's
``decode_logits`` and so the ``fbt`` model (``lm.py``). The mode is per request, so one engine
serves every mode (``decode_mode`` can be changed between evaluations, as ``harness`` does).
Chunked prefill is off (fused(n) needs the whole prompt in one step). Without ``decode_mode`` the
export's own default applies (soft for an FBT model, standard for a baseline), as in ``lm.py``.
"""

from __future__ import annotations

import os
from typing import Optional

from fbt_megatron.evaluation.env import offline_environment
from fbt_megatron.model.decode_modes import config_mode, mode_label, named_mode

offline_environment()

from lm_eval.api.registry import register_model  # noqa: E402
from lm_eval.models.vllm_causallms import VLLM  # noqa: E402
from tqdm import tqdm  # noqa: E402


@register_model("fbt-vllm")
class FBTVLLM(VLLM):
    """lm-eval's ``vllm`` model with FBT's decode modes (see the module docstring)."""

    quiet = False  # True: no progress bars (a caller shows its own)

    def __init__(self, pretrained, decode_mode: Optional[str] = None, fused_prefill_passes: Optional[int] = None,
                 **kwargs):
        from fbt_megatron.inference.serving.plugin import register

        register()  # lm-eval loads the config and tokenizer before vLLM loads its plugins
        named = named_mode(decode_mode, fused_prefill_passes)
        kwargs.setdefault("dtype", "float32")
        kwargs.setdefault("enable_chunked_prefill", False)
        kwargs.setdefault("enforce_eager", True)
        os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")  # the plugin hooks the V1 runner (GPU default: V2)
        kwargs.pop("trust_remote_code", None)  # the plugin registers the export's code
        super().__init__(pretrained, **kwargs)
        self.decode_mode, self.fused_prefill_passes = named or config_mode(self._config)
        if self.decode_mode != "standard" and not getattr(self._config, "latent_feedback", False):
            raise ValueError(f"{pretrained}: the model has no latent feedback (a baseline): only decode_mode=standard, "
                             f"not {self.mode}")

    @property
    def mode(self) -> str:
        return mode_label(self.decode_mode, self.fused_prefill_passes)

    def mode_args(self, prompt_length: Optional[int] = None) -> dict:
        args = {"decode_mode": self.decode_mode, "fused_prefill_passes": self.fused_prefill_passes}
        return args if prompt_length is None else {**args, "prompt_length": prompt_length}

    def _model_generate(self, requests, generate: bool = False, sampling_params=None):
        if generate and sampling_params is not None:
            params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(requests)
            for sp in params:
                sp.extra_args = {**self.mode_args(), **(sp.extra_args or {})}
            sampling_params = params
        return super()._model_generate(requests, generate=generate, sampling_params=sampling_params)

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm or self.quiet)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        return super().loglikelihood_rolling(requests, disable_tqdm=disable_tqdm or self.quiet)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False):
        """[(log P(continuation | context), greedy?)] in the requests' order: each request one prompt
        (lm-eval's left truncation) whose scored context ends at ``prompt_length``."""
        from vllm import SamplingParams

        limit = self.max_length - 1  # vLLM generates at least one token
        inputs, context_lengths = [], []
        for _, context, continuation in requests:
            inputs.append((context + continuation)[-limit:])
            context_lengths.append(len(context) - max(0, len(context) + len(continuation) - limit))
        params = [SamplingParams(temperature=0, prompt_logprobs=1, max_tokens=1, detokenize=False,
                                 extra_args=self.mode_args(max(1, n))) for n in context_lengths]
        bar = tqdm(total=len(requests), disable=disable_tqdm or self.quiet,
                   desc=f"Running loglikelihood requests ({self.mode}, vLLM)")
        outputs = self._model_generate(inputs, generate=True, sampling_params=params)
        results = []
        for (key, _, _), tokens, n, output in zip(requests, inputs, context_lengths, outputs):
            answer = self._parse_logprobs(tokens=tokens, outputs=output, ctxlen=n)
            results.append(answer)
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
            bar.update(1)
        bar.close()
        return results
