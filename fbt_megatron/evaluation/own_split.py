"""A model's own held-out split: the ``docs.valid.jsonl`` of the prepared corpus a run was trained on
(its recipe's data path) or of a corpus given (``--corpus``), evaluated as ``fbt_split_perplexity``;
with a warning line where the standard-library tasks or the corpus are not the model's own text."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Optional

from fbt_megatron.evaluation.local_tasks import ROOT, LocalTasks, ensure_split_task
from fbt_megatron.evaluation.models import Model


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def given_corpus(corpus: Optional[str]) -> Optional[Path]:
    """The ``--corpus`` folder resolved (None when none is given); an error line when it is not prepared."""
    if not corpus:
        return None
    folder = Path(corpus).resolve()
    if not (folder / "docs.valid.jsonl").is_file():
        raise FileNotFoundError(f"--corpus {corpus}: not a prepared corpus folder (no docs.valid.jsonl; "
                                f"tools/prepare_corpus.py makes one)")
    return folder


def training_corpus(run: Path) -> Optional[Path]:
    """The prepared corpus folder a run was trained on (its recipe's data path, as given then: from
    the working directory or the repository), None when it is not one (a task's data, a blend)."""
    from fbt_megatron.trainer.checkpointing import read_train_state

    data_path = read_train_state(str(run)).get("recipe", {}).get("data", {}).get("data_path")
    if not isinstance(data_path, str):
        return None
    for folder in (Path(data_path), ROOT / data_path):
        if (folder / "corpus.json").is_file():
            return folder.resolve()
    return None


def corpus_checks(model: Model, corpus: Optional[Path], given: bool) -> tuple:
    """(the corpus whose held-out split ``model`` is evaluated on or None, warning lines): that
    the stdlib tasks are not its training text; that a given --corpus is not its own."""
    own = training_corpus(Path(model.source)) if model.run_iteration is not None else None
    warnings = []
    if own is not None and json.loads((own / "corpus.json").read_text())["source"] != "stdlib":
        warnings.append(f"warning: {model.label} was trained on {own}, not the standard library: the fbt_stdlib_* "
                        f"columns measure other text; its own held-out split is the 'own split' columns")
    chosen = corpus if given else own
    if chosen is None:
        if model.run_iteration is not None:
            warnings.append(f"warning: {model.label}: its data path is not a prepared corpus (tools/prepare_corpus.py): "
                            f"no own-split evaluation; give --corpus DIR")
        return None, warnings
    manifest = json.loads((chosen / "corpus.json").read_text())
    tokenizer, exported = chosen / manifest["tokenizer"], Path(model.export) / "tokenizer.model"
    if exported.is_file() and tokenizer.is_file() and _sha256(exported) != _sha256(tokenizer):
        warnings.append(f"warning: --corpus {chosen} was prepared with another tokenizer than {model.label}'s: the model "
                        f"was not trained on it (its 'own split' columns measure other text)")
    elif given and own is not None and own != chosen:
        warnings.append(f"warning: --corpus {chosen} is not the corpus {model.label} was trained on ({own})")
    return chosen, warnings


def split_tasks(corpus: Path, folder: Path, documents: int) -> LocalTasks:
    """The ``fbt_split_perplexity`` task of ``corpus`` in a folder of its own under ``folder``."""
    name = f"{corpus.name}-{hashlib.sha256(str(corpus).encode()).hexdigest()[:8]}"
    return ensure_split_task(str(folder / name), str(corpus), documents)
