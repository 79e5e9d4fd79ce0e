"""lm-eval's ``fbt`` model: a Hugging Face FBT export scored as a decode mode would produce it.

    --model fbt --model_args pretrained=DIR,decode_mode=soft
    --model fbt --model_args pretrained=DIR,decode_mode=fused,fused_prefill_passes=2

A subclass of lm-eval's ``hf`` model (``HFLM``: same tokenization, windows, batching of tasks,
caching) in which a loglikelihood request (context, continuation) is scored the way decoding
would produce the continuation after the context as prompt: ``model.decode_logits(input_ids,
prompt_length, decode_mode, fused_prefill_passes)`` over context + continuation (without its last
token), with the prompt length = the context's tokens (after lm-eval's left truncation to the
model's length). Positions before the prompt's end are the mode's prefill (standard, soft: the plain
pass; fused(n): the (n+1)-th pass); the continuation's positions get the fed-back state one step at
a time (standard: none). Rolling loglikelihoods (perplexity) go through the same path with each
window's context as the prompt. ``decode_mode=standard`` scores exactly as ``hf`` does (up to float
rounding of a different batch composition). Generation (``generate_until``) passes the mode to
``model.generate``.

The mode may also be written ``decode_mode=fused(2)`` (= ``fused`` with 2 prefill passes);
``fused`` with 0 passes is ``soft``. A model without latent feedback supports only ``standard``.
Without ``decode_mode`` the export's own default applies (its config.json's ``decode_mode``: soft for
an FBT model, standard for a baseline; ``decode_modes.config_mode``).
"""

from __future__ import annotations

from collections import defaultdict
from typing import List, Optional

from fbt_megatron.evaluation.env import offline_environment
from fbt_megatron.model.decode_modes import config_mode, mode_label, named_mode

offline_environment()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from lm_eval.api.registry import register_model  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402
from tqdm import tqdm  # noqa: E402


@register_model("fbt")
class FBTLM(HFLM):
    """lm-eval's ``hf`` model with FBT's decode modes (see the module docstring)."""

    def __init__(self, pretrained, decode_mode: Optional[str] = None, fused_prefill_passes: Optional[int] = None,
                 **kwargs):
        named = named_mode(decode_mode, fused_prefill_passes)
        kwargs.setdefault("trust_remote_code", True)
        kwargs.setdefault("dtype", "float32")
        kwargs.setdefault("device", "cuda" if torch.cuda.is_available() else "cpu")
        super().__init__(pretrained, **kwargs)
        config = self.model.config
        self.decode_mode, self.fused_prefill_passes = named or config_mode(config)
        if self.decode_mode != "standard":
            if not getattr(config, "latent_feedback", False):
                raise ValueError(f"{pretrained}: the model has no latent feedback (a baseline): "
                                 f"only decode_mode=standard, not {mode_label(self.decode_mode, self.fused_prefill_passes)}")
            if not hasattr(self.model, "decode_logits"):
                raise ValueError(f"{pretrained}: not an FBT export (the model has no decode_logits)")

    quiet = False  # True: no progress bars of lm-eval's requests (a caller shows its own)

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm or self.quiet)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        return super().loglikelihood_rolling(requests, disable_tqdm=disable_tqdm or self.quiet)

    @property
    def mode(self) -> str:
        return mode_label(self.decode_mode, self.fused_prefill_passes)

    # ------------------------------------------------------------ scoring
    def decode_logits(self, input_ids: torch.Tensor, prompt_length: int) -> torch.Tensor:
        """Logits [b, T, V] of ``input_ids`` [b, T] as the mode decodes them after a prompt of
        ``prompt_length`` tokens."""
        with torch.no_grad():
            if not hasattr(self.model, "decode_logits"):  # any causal LM, standard mode
                return self._model_call(input_ids)
            return self.model.decode_logits(input_ids, prompt_length, decode_mode=self.decode_mode,
                                            fused_prefill_passes=self.fused_prefill_passes)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: Optional[int] = None):
        """[(log P(continuation | context), greedy?)] for requests (key, context tokens,
        continuation tokens), in their order. Requests with the same prompt length are batched
        (``decode_logits`` takes one prompt length per call), right-padded to the longest: a
        position never sees later ones, so padding changes no scored logit."""
        groups = defaultdict(list)  # prompt length -> [(index, input, continuation)]
        for index, (_, context, continuation) in enumerate(requests):
            if not context or not continuation:
                raise ValueError("a loglikelihood request needs a non-empty context and continuation")
            if len(continuation) > self.max_length:
                raise ValueError(f"a continuation of {len(continuation)} tokens exceeds the model's length {self.max_length}")
            whole = (list(context) + list(continuation))[-(self.max_length + 1):]  # left truncation, as hf
            inputs = whole[:-1]
            prompt = len(inputs) - len(continuation) + 1  # the context's tokens kept
            groups[prompt].append((index, inputs, continuation))
        size = override_bs or (self.batch_size if isinstance(self.batch_size, int) and self.batch_size > 0 else 8)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        results: List[Optional[tuple]] = [None] * len(requests)
        bar = tqdm(total=len(requests), disable=(disable_tqdm or self.quiet or self.rank != 0),
                   desc=f"Running loglikelihood requests ({self.mode})")
        for prompt, members in sorted(groups.items()):
            members.sort(key=lambda m: (-len(m[1]), m[0]))
            for start in range(0, len(members), size):
                batch = members[start:start + size]
                width = len(batch[0][1])
                ids = torch.tensor([inputs + [pad] * (width - len(inputs)) for _, inputs, _ in batch],
                                   dtype=torch.long, device=self.device)
                logprobs = F.log_softmax(self.decode_logits(ids, prompt), dim=-1, dtype=self.softmax_dtype)
                for (index, inputs, continuation), row in zip(batch, logprobs):
                    scored = row[prompt - 1:len(inputs)]  # the predictions of the continuation's tokens
                    target = torch.tensor(continuation, dtype=torch.long, device=scored.device)
                    answer = (float(scored.gather(-1, target.unsqueeze(-1)).sum()),
                              bool((scored.argmax(-1) == target).all()))
                    results[index] = answer
                    key = requests[index][0]
                    if key is not None:
                        self.cache_hook.add_partial("loglikelihood", key, answer)
                bar.update(len(batch))
        bar.close()
        return results

    # ------------------------------------------------------------ generation
    def _model_generate(self, context, max_length, stop, **generation_kwargs):
        if self.decode_mode != "standard":
            generation_kwargs = {**generation_kwargs, "decode_mode": self.decode_mode,
                                 "fused_prefill_passes": self.fused_prefill_passes}
        return super()._model_generate(context, max_length, stop, **generation_kwargs)

    def get_model_info(self) -> dict:
        return {**super().get_model_info(), "decode_mode": self.mode}
