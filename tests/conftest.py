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


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory):
    """A real corpus prepared by the project's own pipeline: 40 standard-library modules,
    a 512-piece sentencepiece tokenizer, Megatron .bin/.idx train and valid splits."""
    import shutil
    import sysconfig
    from pathlib import Path

    from fbt_megatron.data.corpus import prepare_corpus

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    source = tmp_path_factory.mktemp("source")
    for path in sorted(stdlib.glob("*.py"))[:40]:
        shutil.copy(path, source / path.name)
    return prepare_corpus(str(source), str(tmp_path_factory.mktemp("corpus") / "c"), vocab_size=512,
                          valid_fraction=0.1, show_progress=False)
