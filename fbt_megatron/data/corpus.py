"""A corpus folder with everything a training run reads, prepared offline by one call.

    corpus.json                       manifest: source, settings, tokenizer, documents/tokens per split
    tokenizer.model                   trained on the train documents (or a copy of a given tokenizer)
    docs.train.jsonl, docs.valid.jsonl              the documents of each split ({"name", "text"})
    train_text_document.bin/.idx, valid_text_document.bin/.idx    the tokenized splits

The source is ``"stdlib"`` (this Python's standard library ``.py`` files without tests and
site-packages: code, available everywhere) or a folder of text files or a JSONL file. The split
is by document and deterministic: a document goes to valid when the SHA-256 of its name (its
relative path, or "file.jsonl:LINE") falls below `valid_fraction`; each split gets at least one.
The folder is written whole (``folders.atomic_folder``); a folder that is there and not empty is never
modified.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import sysconfig
from dataclasses import dataclass
from typing import Iterator

from fbt_megatron.data.documents import Document, iter_documents, list_files, progress, read_file
from fbt_megatron.data.preprocess import preprocess
from fbt_megatron.data.tokenizer import load_tokenizer
from fbt_megatron.data.tokenizer_training import train_tokenizer
from fbt_megatron.folders import atomic_folder

STDLIB = "stdlib"
STDLIB_SKIP = ("test", "tests", "idle_test", "site-packages", "dist-packages")
SPLITS = ("train", "valid")
MANIFEST = "corpus.json"


@dataclass(frozen=True)
class Corpus:
    source: str  # "stdlib" or the absolute source path
    tokenizer_path: str  # absolute paths from here on
    train_prefix: str
    valid_prefix: str
    documents: dict[str, int]  # per split
    tokens: dict[str, int]  # per split, EOD included


def source_documents(source: str, json_key: str = "text") -> Iterator[Document]:
    """The documents of a corpus source, in a fixed order."""
    if source != STDLIB:
        yield from iter_documents([source], json_key)
        return
    root = sysconfig.get_paths()["stdlib"]
    for path in list_files(root, (".py",), STDLIB_SKIP):
        yield from read_file(path, os.path.relpath(path, root))


def split_documents(names: list[str], valid_fraction: float) -> list[bool]:
    """Whether each document goes to the valid split (see the module docstring)."""
    if len(names) < 2:
        raise ValueError(f"a train/valid split needs at least 2 documents, the source has {len(names)}")
    position = [int.from_bytes(hashlib.sha256(n.encode()).digest()[:8], "big") / 2**64 for n in names]
    valid = [p < valid_fraction for p in position]
    if not any(valid):
        valid[position.index(min(position))] = True
    if all(valid):
        valid[position.index(max(position))] = False
    return valid


def _manifest(folder: str) -> dict:
    try:
        with open(os.path.join(folder, MANIFEST)) as f:
            return json.load(f)
    except (OSError, ValueError):
        raise ValueError(f"{folder} is not a prepared corpus (no readable {MANIFEST})") from None


def load_corpus(folder: str) -> Corpus:
    """The complete corpus in `folder` (ValueError if it is not one)."""
    folder = os.path.abspath(folder)
    manifest = _manifest(folder)
    splits = manifest["splits"]
    files = [manifest["tokenizer"]] + [splits[s]["prefix"] + ext for s in SPLITS for ext in (".bin", ".idx")]
    missing = [f for f in files if not os.path.isfile(os.path.join(folder, f))]
    if missing:
        raise ValueError(f"{folder} is an incomplete corpus (missing {', '.join(missing)})")
    return Corpus(
        source=manifest["source"],
        tokenizer_path=os.path.join(folder, manifest["tokenizer"]),
        train_prefix=os.path.join(folder, splits["train"]["prefix"]),
        valid_prefix=os.path.join(folder, splits["valid"]["prefix"]),
        documents={s: splits[s]["documents"] for s in SPLITS},
        tokens={s: splits[s]["tokens"] for s in SPLITS},
    )


def _settings(source: str, vocab_size: int, valid_fraction: float, tokenizer: str | None, json_key: str) -> dict:
    if source != STDLIB and not os.path.exists(source):
        raise FileNotFoundError(f"source {source} does not exist (a folder, a JSONL file or 'stdlib')")
    if tokenizer is None and vocab_size <= 0:
        raise ValueError(f"vocab size must be positive (got {vocab_size})")
    if not 0 < valid_fraction < 1:
        raise ValueError(f"valid fraction must be between 0 and 1 (got {valid_fraction})")
    return {
        "source": source if source == STDLIB else os.path.abspath(source),
        "json_key": json_key,
        "valid_fraction": valid_fraction,
        "vocab_size": vocab_size if tokenizer is None else None,
        "tokenizer_sha256": None if tokenizer is None else load_tokenizer(tokenizer).sha256,
    }


def _existing(output: str, settings: dict, flag: str, hint: str) -> Corpus | None:
    """The corpus already at `output`, None when there is nothing there; an error naming `output`
    as the caller's `flag` and ending in `hint` (what to do) for anything else."""
    if not os.path.exists(output) or (os.path.isdir(output) and not os.listdir(output)):
        return None
    try:
        corpus, prepared = load_corpus(output), _manifest(output)["settings"]
    except ValueError as e:
        raise ValueError(f"{flag} {e}; {hint}") from None
    changed = [f"{k} {prepared.get(k)!r} → {v!r}" for k, v in settings.items() if prepared.get(k) != v]
    if changed:
        raise ValueError(f"{flag} {output} holds a corpus prepared with other settings ({', '.join(changed)}); {hint}")
    return corpus


def _build(folder: str, settings: dict, tokenizer: str | None, workers: int, show_progress: bool) -> None:
    source, json_key = settings["source"], settings["json_key"]
    names = [d.name for d in progress(source_documents(source, json_key), "scan", show_progress)]
    in_valid = split_documents(names, settings["valid_fraction"])
    docs = {s: os.path.join(folder, f"docs.{s}.jsonl") for s in SPLITS}
    with open(docs["train"], "w", encoding="utf-8") as train, open(docs["valid"], "w", encoding="utf-8") as valid:
        documents = progress(source_documents(source, json_key), "split", show_progress, total=len(names))
        for doc, is_valid in zip(documents, in_valid):
            record = json.dumps({"name": doc.name, "text": doc.text}, ensure_ascii=False)
            (valid if is_valid else train).write(record + "\n")
    if tokenizer is None:
        tokenizer_file = "tokenizer.model"
        model = os.path.join(folder, tokenizer_file)
        train_tokenizer([docs["train"]], model, settings["vocab_size"], show_progress=show_progress)
    else:
        tokenizer_file = os.path.basename(tokenizer)  # the name tells its kind
        shutil.copyfile(tokenizer, os.path.join(folder, tokenizer_file))
    tok = load_tokenizer(os.path.join(folder, tokenizer_file))
    splits = {}
    for s in SPLITS:
        prefix = f"{s}_text_document"
        counts = preprocess([docs[s]], tok.path, os.path.join(folder, prefix), workers=workers,
                            show_progress=show_progress)
        splits[s] = {"prefix": prefix, "docs": os.path.basename(docs[s]), **counts}
    manifest = {
        "source": source,
        **({"python": platform.python_version()} if source == STDLIB else {}),
        "settings": settings,
        "tokenizer": tokenizer_file,
        "tokenizer_kind": tok.kind,
        "vocab_size": tok.vocab_size,
        "splits": splits,
    }
    with open(os.path.join(folder, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=2)


def prepare_corpus(
    source: str,
    output: str,
    vocab_size: int = 2048,
    valid_fraction: float = 0.02,
    tokenizer: str | None = None,
    workers: int = 1,
    show_progress: bool = True,
    json_key: str = "text",
    flag: str = "--output",
    hint: str = "choose another --output or remove it",
) -> Corpus:
    """Prepare the corpus folder `output` from `source`, with a sentencepiece tokenizer of
    `vocab_size` trained on the train documents, or a copy of the `tokenizer` file. Does nothing
    (and says so) when `output` already holds the corpus prepared with the same settings; anything
    else is an error naming `output` as `flag` and ending in `hint`."""
    output = os.path.abspath(output)
    settings = _settings(source, vocab_size, valid_fraction, tokenizer, json_key)
    corpus = _existing(output, settings, flag, hint)
    if corpus is not None:
        if show_progress:
            print(f"{output}: corpus already prepared, nothing to do")
        return corpus
    with atomic_folder(output) as tmp:
        _build(str(tmp), settings, tokenizer, workers, show_progress)
    return load_corpus(output)


def ensure_corpus(source: str, output: str, vocab_size: int = 2048, **kwargs) -> Corpus:
    """The corpus at `output`, prepared from `source` first if it is not there yet (the training
    loop's call; this is `prepare_corpus`, which leaves a complete corpus as it is, with advice in
    the training entry point's flags)."""
    hint = (f"to train on the corpus there as it is, add --corpus null; to prepare --corpus {source} "
            f"with --vocab-size {vocab_size}, choose another --data-path")
    return prepare_corpus(source, output, vocab_size, flag="--data-path", hint=hint, **kwargs)
