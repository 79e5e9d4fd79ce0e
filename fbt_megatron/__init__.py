"""fbt-megatron: Megatron-style distributed pretraining of Full-Bandwidth Transformers."""

import os as _os
import warnings as _warnings

# oneMKL may use fewer threads than torch asks, deciding at run time (MKL_DYNAMIC, on by default): a
# matrix product then sums in another order, and a resumed step is no longer bit for bit the
# uninterrupted one (seen on a loaded 2-core CPU: 5 of 39 resumed steps; 0 of 25 with it off). MKL
# reads it as torch loads, so it holds where this package is imported first: every
# ``python -m fbt_megatron.…`` command, and the processes they start.
_os.environ.setdefault("MKL_DYNAMIC", "FALSE")

import torch as _torch  # noqa: E402

__version__ = "0.1.0"

if not _torch.cuda.is_available():  # on CPU the absence of Transformer Engine/Apex is expected
    _warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex) (and Apex )?(is|are) not installed.*")
