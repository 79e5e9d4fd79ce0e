import os
import warnings

import pytest
import torch

warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(scope="session", autouse=True)
def megatron_single_process():
    """One-process torch.distributed + megatron parallel state for in-process tests."""
    from fbt_megatron import platform

    platform.init_distributed(seed_value=1234)
    yield
