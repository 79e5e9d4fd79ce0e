"""The engine-level side of serving an FBT export: what vLLM's configuration must satisfy, and the
export's defaults that requests fall back to.

``FBTEngineConfig.verify_and_update_config`` is vLLM's per-architecture configuration hook
(``MODELS_CONFIG_MAP``), run once when an engine's ``VllmConfig`` is built in the frontend process:

* refuses, in one line, what the fed-back state does not support: speculative decoding, pipeline
  parallelism, the GPU "model runner V2" (``VLLM_USE_V2_MODEL_RUNNER=0`` selects the V1 runner the
  hooks are written for), CUDA graphs unless ``FBT_VLLM_CUDA_GRAPHS=1`` (the one-pass step is written
  to be captured, but has never run on a GPU) and, on CPU, a head dimension vLLM's CPU attention does
  not take (the engine would die on the first request);
* adds ``requests.FBTRequests`` to the engine's logits processors (the per-request admission);
* records the export's defaults (``decode_mode``, ``fused_prefill_passes`` of config.json or
  ``--hf-overrides``) for that admission, which runs in the same process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from fbt_megatron.model.decode_modes import config_mode

REQUESTS = "fbt_megatron.inference.serving.requests:FBTRequests"
# The one setting that lets vLLM capture CUDA graphs of an FBT model (docs/serving.md, "The GPU path"):
# off until a GPU test exists.
CUDA_GRAPHS = "FBT_VLLM_CUDA_GRAPHS"


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
    """The export's default mode (``decode_modes.config_mode``: its config.json's, or soft with latent
    feedback and standard without where it names none) and the engine's prefill chunking."""
    mode, passes = config_mode(hf_config)
    return ExportDefaults(
        latent_feedback=bool(getattr(hf_config, "latent_feedback", False)),
        decode_mode=mode,
        fused_prefill_passes=passes,
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
    import os

    from vllm.config import CUDAGraphMode
    from vllm.platforms import current_platform

    graphs = (not vllm_config.model_config.enforce_eager
              and vllm_config.compilation_config.cudagraph_mode != CUDAGraphMode.NONE)
    if current_platform.is_cuda_alike() and graphs and os.environ.get(CUDA_GRAPHS) != "1":
        return (f"CUDA graphs of an FBT model have not run on a GPU yet: start the engine with --enforce-eager, "
                f"or set {CUDA_GRAPHS}=1 to capture its one-pass step (docs/serving.md, 'The GPU path')")
    if current_platform.is_cpu():
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        sizes = CPUAttentionBackend.get_supported_head_sizes()
        head_dim = vllm_config.model_config.hf_config.head_dim
        if head_dim not in sizes:
            return (f"this export's head_dim {head_dim} is not one vLLM's CPU attention takes "
                    f"({', '.join(map(str, sizes))}): export a model trained with one of these (--kv-channels)")
    return None


class EngineRefusal(ValueError):
    """An engine configuration that cannot serve an FBT export (``refusal``)."""


def _refusal_in(exc: BaseException) -> Optional[EngineRefusal]:
    """The EngineRefusal ``exc`` is or wraps (pydantic wraps it in VllmConfig's ValidationError)."""
    if isinstance(exc, EngineRefusal):
        return exc
    try:
        for error in exc.errors():  # pydantic's ValidationError
            if isinstance((error.get("ctx") or {}).get("error"), EngineRefusal):
                return error["ctx"]["error"]
    except Exception:
        pass
    return None


def one_line_refusals() -> None:
    """A refusal nobody catches (``vllm serve``, a script's ``LLM(...)``) ends the process with one
    ``error:`` line and exit code 2 instead of vLLM's traceback; every other error is left as it is."""
    import os
    import sys

    if getattr(sys.excepthook, "_fbt", False):
        return
    previous = sys.excepthook

    def hook(kind, exc, traceback):
        refusal = _refusal_in(exc)
        if refusal is None:
            return previous(kind, exc, traceback)
        print(f"error: {refusal}", file=sys.stderr, flush=True)
        os._exit(2)  # at the top level, before any engine process started

    hook._fbt = True
    sys.excepthook = hook


class FBTEngineConfig:
    """vLLM's ``VerifyAndUpdateConfig`` for the architecture FBTForCausalLM."""

    @staticmethod
    def verify_and_update_config(vllm_config) -> None:
        global _CURRENT
        reason = refusal(vllm_config)
        if reason:
            raise EngineRefusal(reason)
        model_config = vllm_config.model_config
        processors = list(model_config.logits_processors or [])
        if REQUESTS not in processors:
            model_config.logits_processors = [*processors, REQUESTS]
        _CURRENT = export_defaults(model_config.hf_config, vllm_config.scheduler_config)

    @staticmethod
    def verify_and_update_model_config(model_config) -> None:
        return None
