"""fbt-megatron: Megatron-style distributed pretraining of Full-Bandwidth Transformers."""

import warnings as _warnings

import torch as _torch

__version__ = "0.1.0"

if not _torch.cuda.is_available():  # on CPU the absence of Transformer Engine/Apex is expected
    _warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex) (and Apex )?(is|are) not installed.*")
