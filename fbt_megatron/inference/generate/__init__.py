"""Text generation with FBT models: standard, soft, fused(n) and adaptive decoding with a KV cache
(``decoding``), and its command line (``python -m fbt_megatron.generate``)."""

from fbt_megatron.inference.generate.decoding import MODES, Generation, forced_logits, generate

__all__ = ["MODES", "Generation", "forced_logits", "generate"]
