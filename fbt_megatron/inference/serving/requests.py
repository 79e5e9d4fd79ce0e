"""A request's decode mode: ``SamplingParams(extra_args={...})`` offline, ``vllm_xargs`` over the
OpenAI API.

    decode_mode            "standard" | "soft" | "fused" | "fused(n)"   (default: the export's config)
    fused_prefill_passes   n of fused(n)                                   (default: the export's config)
    prompt_length          scoring: positions from here on are scored as decoded positions (fed
                           back one at a time), as ``decode_logits(ids, prompt_length)`` does;
                           default: the whole prompt is the prompt

``FBTRequests`` is a no-op logits processor whose ``validate_params`` runs in the frontend for every
request (vLLM's per-request admission hook): a bad mode, or soft/fused on an export without latent
feedback, or a key that is none of the above (nor vLLM's own), is that request's error (HTTP 400
from the server), never the engine's. It writes the resolved mode back into ``extra_args`` (so the
engine core and the workers need no defaults) and keeps soft/fused requests from reading the prefix
cache (``prefix_cache``). Beam search, which vLLM runs without the request's extra_args, is served
in standard mode only (``install``: refused otherwise, HTTP 400).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor

from fbt_megatron.inference.serving import engine
from fbt_megatron.model.decode_modes import mode_label, parse_mode

KEYS = ("decode_mode", "fused_prefill_passes", "prompt_length")
VLLM_KEYS = ("kv_transfer_params", "ec_transfer_params", "kv_cache_report_mode")  # vLLM's own extra_args


@dataclass(frozen=True)
class RequestMode:
    mode: str  # standard | soft | fused
    passes: int  # n of fused(n); 0 otherwise
    prompt_length: Optional[int] = None  # scoring's context length (None: the whole prompt)

    @property
    def feedback(self) -> bool:
        return self.mode != "standard"

    @property
    def label(self) -> str:
        return mode_label(self.mode, self.passes)


def request_mode(extra_args: Optional[dict], defaults: "engine.ExportDefaults") -> RequestMode:
    """The request's mode from its extra_args and the export's defaults; ValueError (one line), also
    for a key that is neither FBT's nor vLLM's (a misspelt ``decode_mod`` would else be served in the
    default mode)."""
    args = extra_args or {}
    unknown = [k for k in args if k not in KEYS and k not in VLLM_KEYS]
    if unknown:
        raise ValueError(f"unknown vllm_xargs key{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}: "
                         f"an FBT request takes {', '.join(KEYS)}")
    mode = args.get("decode_mode")
    passes = args.get("fused_prefill_passes")
    if mode is None:
        mode = defaults.decode_mode
        if passes is None and mode == "fused":
            passes = defaults.fused_prefill_passes
    elif passes is None and str(mode).strip() == "fused":
        passes = defaults.fused_prefill_passes
    mode, passes = parse_mode(mode, passes)
    if mode != "standard" and not defaults.latent_feedback:
        raise ValueError(f"decode_mode {mode_label(mode, passes)} needs latent feedback; this export has none "
                         f"(a baseline): use decode_mode standard")
    length = args.get("prompt_length")
    if length is not None:
        if isinstance(length, bool) or not isinstance(length, int) or length < 1:
            raise ValueError(f"prompt_length must be a positive integer (the scored context's tokens), got {length!r}")
    return RequestMode(mode, passes, length)


def normalized(mode: RequestMode) -> dict:
    """The extra_args the engine core and the workers read."""
    out = {"decode_mode": mode.mode, "fused_prefill_passes": mode.passes}
    if mode.prompt_length is not None:
        out["prompt_length"] = mode.prompt_length
    return out


def beam_search_refusal(extra_args: Optional[dict], offline: bool = False) -> Optional[str]:
    """Why a beam-search request (its ``vllm_xargs``; ``offline``: ``LLM.beam_search``, which takes
    none) cannot be served, or None.
    vLLM's beam search runs every step as a new one-token request over prompt + beam, without the
    request's extra_args: a plain prefill, which is standard decoding exactly; soft/fused beams would
    need each beam's fed-back state. So a beam search must resolve to standard."""
    defaults = engine.current()
    if defaults is None:
        return None
    mode = request_mode(extra_args, defaults)  # a bad mode or key: that error
    if not mode.feedback:
        return None
    fix = ('start the engine with hf_overrides={"decode_mode": "standard"}' if offline else
           'send vllm_xargs {"decode_mode": "standard"} with use_beam_search')
    return (f"beam search decodes in standard mode only (vLLM's beam search runs each step as a new prompt, without "
            f"the fed-back state), and this request's mode is {mode.label}: {fix}, or decode greedily or by "
            f"sampling in {mode.label}")


def install() -> None:
    """Beam search refused unless standard: the OpenAI requests' ``to_beam_search_params`` (completions
    and chat; a ValueError there is the server's HTTP 400) and the offline ``LLM.beam_search``."""
    import functools

    from vllm import LLM
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    for cls in (CompletionRequest, ChatCompletionRequest):
        original = cls.to_beam_search_params
        if getattr(original, "_fbt", False):
            continue

        @functools.wraps(original)
        def to_beam_search_params(self, *args, _original=original, **kwargs):
            reason = beam_search_refusal(self.vllm_xargs)
            if reason:
                raise ValueError(reason)
            return _original(self, *args, **kwargs)

        to_beam_search_params._fbt = True
        cls.to_beam_search_params = to_beam_search_params

    if not getattr(LLM.beam_search, "_fbt", False):
        original_llm = LLM.beam_search

        @functools.wraps(original_llm)
        def beam_search(self, *args, **kwargs):
            reason = beam_search_refusal(None, offline=True)
            if reason:
                raise ValueError(reason)
            return original_llm(self, *args, **kwargs)

        beam_search._fbt = True
        LLM.beam_search = beam_search


class FBTRequests(LogitsProcessor):
    """Admission of FBT requests (``validate_params``); changes no logits."""

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        defaults = engine.current()
        if defaults is None:  # not an FBT engine in this process: nothing to check
            return
        mode = request_mode(sampling_params.extra_args, defaults)
        if mode.mode == "fused" and defaults.chunked_prefill:
            raise ValueError(
                f"decode_mode {mode.label} needs the whole prompt in one step, and this engine chunks prefills: "
                "start it with --no-enable-chunked-prefill (LLM(..., enable_chunked_prefill=False))")
        sampling_params.extra_args = {**(sampling_params.extra_args or {}), **normalized(mode)}
        if mode.feedback:
            sampling_params.skip_reading_prefix_cache = True

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        pass

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update: Optional[BatchUpdate]) -> None:
        pass

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits
