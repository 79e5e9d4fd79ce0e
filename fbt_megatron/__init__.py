"""fbt-megatron: Megatron-style distributed pretraining of Full-Bandwidth Transformers."""

import os as _os
import warnings as _warnings

__version__ = "0.1.0"

# Without an NVIDIA driver the absence of Transformer Engine/Apex is expected (megatron-core warns on
# import). Asked of the driver, not of torch: a command's --help loads no torch.
if not _os.path.exists("/proc/driver/nvidia/version"):
    _warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex) (and Apex )?(is|are) not installed.*")
