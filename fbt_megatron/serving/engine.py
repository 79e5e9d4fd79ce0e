"""The engine-level side of serving an FBT export: what vLLM's configuration must satisfy, and the
export's defaults that requests fall back to.

``FBTEngineConfig.verify_and_update_config`` is vLLM's per-architecture configuration hook
(``MODELS_CONFIG_MAP``), run once when an engine's ``VllmConfig`` is built in the frontend process:

* refuses, in one line, what the fed-back state does not support: speculative decoding, pipeline
  parallelism, the GPU "model runner V2" (``VLLM_USE_V2_MODEL_RUNNER=0`` selects the V1 runner the
  hooks are written for) and CUDA graphs (``--enforce-eager``: a step's number of passes is data);
* adds ``requests.FBTRequests`` to the engine's logits processors (the per-request admission);
* records the export's defaults (``decode_mode``, ``fused_prefill_passes`` of config.json or
  ``--hf-overrides``) for that admission, which runs in the same process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

REQUESTS = "fbt_megatron.serving.requests:FBTRequests"


@dataclass(frozen=True)
class ExportDefaults:
    latent_feedback: bool
    decode_mode: str
    fused_prefill_passes: int
    chunked_prefill: bool  # the engine may cut a prompt into chunks (fused(n) needs it whole)


_CURRENT: Optional[ExportDefaults] = None  # the FBT engine last configured in this process


def current() -> Optional[ExportDefaults]:
    return _CURRENT


def export_defaults(hf_config, scheduler_config) -> ExportDefaults:
    return ExportDefaults(
        latent_feedback=bool(getattr(hf_config, "latent_feedback", False)),
        decode_mode=getattr(hf_config, "decode_mode", "standard") or "standard",
        fused_prefill_passes=int(getattr(hf_config, "fused_prefill_passes", 0) or 0),
        chunked_prefill=bool(scheduler_config.enable_chunked_prefill)
        or int(getattr(scheduler_config, "long_prefill_token_threshold", 0) or 0) > 0,
    )


def refusal(vllm_config) -> Optional[str]:
    """Why this engine configuration cannot serve an FBT export (None: it can)."""
    if vllm_config.speculative_config is not None:
        return "speculative decoding is not supported with FBT's fed-back state: drop --speculative-config"
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        return "pipeline parallelism is not supported for FBT exports (the fusion needs the top state on the first stage)"
    if vllm_config.use_v2_model_runner:
        return ("FBT's fed-back state hooks vLLM's V1 model runner: set VLLM_USE_V2_MODEL_RUNNER=0 "
                "(docs/serving.md says what model runner V2 needs)")
    from vllm.platforms import current_platform

    if current_platform.is_cuda_alike() and not vllm_config.model_config.enforce_eager:
        return "FBT steps run a data-dependent number of passes: start the engine with --enforce-eager on GPUs"
    return None


class FBTEngineConfig:
    """vLLM's ``VerifyAndUpdateConfig`` for the architecture FBTForCausalLM."""

    @staticmethod
    def verify_and_update_config(vllm_config) -> None:
        global _CURRENT
        reason = refusal(vllm_config)
        if reason:
            raise ValueError(reason)
        model_config = vllm_config.model_config
        processors = list(model_config.logits_processors or [])
        if REQUESTS not in processors:
            model_config.logits_processors = [*processors, REQUESTS]
        _CURRENT = export_defaults(model_config.hf_config, vllm_config.scheduler_config)

    @staticmethod
    def verify_and_update_model_config(model_config) -> None:
        return None
