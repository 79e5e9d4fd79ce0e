"""The PyTorch modules of the TE double: those megatron-core's TE spec builds, its autocast, its
checkpoint (``transformer_engine`` explains what is modelled)."""

from transformer_engine.pytorch import distributed, ops  # noqa: F401
from transformer_engine.pytorch.attention import DotProductAttention  # noqa: F401
from transformer_engine.pytorch.distributed import CudaRNGStatesTracker, checkpoint  # noqa: F401
from transformer_engine.pytorch.module import LayerNorm, LayerNormLinear, Linear, RMSNorm  # noqa: F401
from transformer_engine.pytorch.quantization import autocast, fp8_autocast, fp8_model_init, is_fp8_available  # noqa: F401


class GroupedLinear(Linear):
    """megatron-core subclasses it at import (``TEGroupedLinear``, mixture of experts): not modelled."""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError("the TE double does not model GroupedLinear (mixture of experts)")
