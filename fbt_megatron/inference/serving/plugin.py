"""vLLM's general plugin for FBT exports (entry point ``vllm.general_plugins``: ``fbt``).

vLLM calls ``register`` in every process it starts (frontend, engine core, workers); it is
idempotent. It registers the export's config class (``AutoConfig``) and tokenizer
(``AutoTokenizer``) with transformers, so an export loads without ``trust_remote_code``; the model
``FBTForCausalLM`` and its engine-configuration hook with vLLM; and the runner, prefix-cache and
beam-search hooks (``runner``, ``prefix_cache``, ``requests``).
"""

from __future__ import annotations

ARCHITECTURE = "FBTForCausalLM"


def register() -> None:
    from transformers import AutoConfig, AutoTokenizer
    from vllm import ModelRegistry
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    from fbt_megatron.inference.convert.hf.configuration_fbt import FBTConfig
    from fbt_megatron.inference.convert.hf.tokenization_fbt import FBTTokenizer
    from fbt_megatron.inference.serving import prefix_cache, requests, runner
    from fbt_megatron.inference.serving.engine import FBTEngineConfig, one_line_refusals

    AutoConfig.register(FBTConfig.model_type, FBTConfig, exist_ok=True)
    AutoTokenizer.register(FBTConfig, slow_tokenizer_class=FBTTokenizer, exist_ok=True)
    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, "fbt_megatron.inference.serving.model:FBTForCausalLM")
    MODELS_CONFIG_MAP[ARCHITECTURE] = FBTEngineConfig
    runner.install()
    prefix_cache.install()
    requests.install()
    one_line_refusals()
