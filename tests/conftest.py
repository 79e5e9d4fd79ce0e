import os
import warnings

import pytest
import torch

warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")
torch.set_num_threads(min(2, os.cpu_count() or 1))

from fbt_megatron.common.logs import setup_logging  # noqa: E402

setup_logging()  # as every command's main does: the package's lines in the tests' captured stdout and stderr


@pytest.fixture(scope="session", autouse=True)
def megatron_single_process():
    """One-process torch.distributed + megatron parallel state for in-process tests."""
    from fbt_megatron.common import platform

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


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module of tiny models decoding one position at a time: on the shared
    2-core machine a second thread only adds synchronisation (soft decoding ~10× slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _train_tiny(folder, recipe: str):
    from helpers import launch

    code, out = launch(folder.parent / f"{folder.name}.log", "fbt_megatron.train", "--recipe", recipe, "--train-iters", 4,
                       "--eval-interval", 4, "--eval-iters", 1, "--threads", 1, "--save", folder)
    assert code == 0, out[-3000:]
    return folder


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """A real run folder to load (read only): 4 steps of recipes/tiny_cpu.yaml on the embedded
    corpus, validated at its end after 0–3 fused passes."""
    return _train_tiny(tmp_path_factory.mktemp("tiny_run") / "fbt", "recipes/tiny_cpu.yaml")


@pytest.fixture(scope="session")
def tiny_baseline_run(tmp_path_factory):
    """The same with recipes/tiny_cpu_baseline.yaml (no latent feedback)."""
    return _train_tiny(tmp_path_factory.mktemp("tiny_run") / "baseline", "recipes/tiny_cpu_baseline.yaml")


@pytest.fixture(scope="session")
def tiny_export(tiny_run, tmp_path_factory):
    """tiny_run's Hugging Face export (``python -m fbt_megatron.convert to-hf``; read only)."""
    from helpers import launch

    base = tmp_path_factory.mktemp("tiny_export")
    code, out = launch(base / "export.log", "fbt_megatron.convert", "to-hf", "--load", tiny_run, "--output", base / "export")
    assert code == 0, out[-3000:]
    return base / "export"
