import torch

from fbt_megatron.config import make_config
from fbt_megatron.model import FBTModel


def build(seed=0, **overrides):
    """A tiny FBT model (fp32, CPU) with fresh random weights from `seed`."""
    torch.manual_seed(seed)
    config = make_config("tiny", **overrides)
    model = FBTModel(config)
    # give the norms non-trivial weights so that a missing/misplaced norm is visible
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def tokens(batch=2, seq=24, vocab=1024, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq + 1), generator=g)
