"""TE ≥ 2.x keeps this module for the old import path (``transformer_engine.pytorch.fp8``)."""

from transformer_engine.pytorch.quantization import FP8GlobalStateManager, fp8_autocast, fp8_model_init  # noqa: F401
