"""A corpus folder with everything a training run reads, prepared offline by one call.

    corpus.json                       manifest: source, settings, tokenizer, documents/tokens per split
    tokenizer.model                   trained on a sample of the train documents (or a copy of a given tokenizer)
    docs.valid.jsonl                  the documents of the valid split ({"name", "text"})
    docs.train.jsonl                  those of the train split, for a small corpus (one the tokenizer trained on whole)
    train_text_document.bin/.idx, valid_text_document.bin/.idx    the tokenized splits

The source is ``"stdlib"`` (this Python's standard library ``.py`` files without tests and
site-packages: code, available everywhere) or any input ``documents`` reads (text, JSONL, possibly
compressed, parquet, a saved dataset; a folder or a glob pattern of them). Text files are split
into documents by `split_documents` (``documents.SPLITS``; default: a text file given alone by
blank lines, the files of a folder or the standard library one document each).

Memory is bounded whatever the corpus: the source is streamed twice, never copied whole. The first
pass splits, counts and samples the tokenizer's training text (``tokenizer_training.Sample``); the
second tokenizes both splits. The split is by document and deterministic: a document goes to valid
when the SHA-256 of its name (its relative path, or "file:N") falls below `valid_fraction`; each
split gets at least one (the document nearest the threshold moves, named in the manifest).
Degenerate splits are warned about, one line each (``split_warnings``). Bad records are errors
unless `skip_bad_records` allows some (``documents.BadRecords``). The folder is written whole
(``io.atomic_folder``); a folder that is there and not empty is never modified.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import logging
import os
import platform
import shutil
import sysconfig
from dataclasses import dataclass, field
from typing import Iterator

from fbt_megatron.common.cli import plural
from fbt_megatron.common.io import FolderExists, atomic_folder
from fbt_megatron.data.documents import SPLITS as DOCUMENT_SPLITS
from fbt_megatron.data.documents import BadRecords, Document, Source, iter_documents, progress, sources, walk
from fbt_megatron.data.preprocess import tokenize_into
from fbt_megatron.data.tokenizer import load_tokenizer
from fbt_megatron.data.tokenizer_training import SAMPLE_BYTES, Sample, train_sentencepiece

log = logging.getLogger(__name__)

STDLIB = "stdlib"
STDLIB_SKIP = ("test", "tests", "idle_test", "site-packages", "dist-packages")
SPLITS = ("train", "valid")
MANIFEST = "corpus.json"
DEFAULTS = {"tokenizer_sample_bytes": SAMPLE_BYTES, "tokenizer_threads": 1, "seed": 0, "skip_bad_records": None}


@dataclass(frozen=True)
class Corpus:
    source: str  # "stdlib" or the absolute source path
    tokenizer_path: str  # absolute paths from here on
    train_prefix: str
    valid_prefix: str
    documents: dict[str, int]  # per split
    tokens: dict[str, int]  # per split, EOD included


def default_split(source: str) -> str:
    """How a source's text files become documents unless chosen: a text file alone by blank lines,
    the files of a folder (and the standard library's) one document each."""
    return "blank-line" if os.path.isfile(source) and ".jsonl" not in source and not source.endswith(".parquet") else "file"


def source_units(source: str) -> list[Source]:
    """The files (and saved datasets) of a corpus source, in a fixed order."""
    if source != STDLIB:
        return sources([source])
    return walk(sysconfig.get_paths()["stdlib"], (".py",), STDLIB_SKIP)


def source_documents(source: str, json_key: str = "text", split: str = "file",
                     bad: BadRecords | None = None) -> Iterator[Document]:
    """The documents of a corpus source, in a fixed order (the standard library's files whole)."""
    if source == STDLIB:
        return iter_documents(source_units(source))
    return iter_documents(source_units(source), json_key, split, bad)


def _position(name: str) -> float:
    """Where a document's name falls in [0, 1): below the valid fraction, it is held out."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big") / 2**64


def split_documents(names: list[str], valid_fraction: float) -> list[bool]:
    """Whether each document goes to the valid split (see the module docstring)."""
    split = SplitScan(valid_fraction)
    for index, name in enumerate(names):
        split.add(index, name, "")
    split.close()
    return [split.is_valid(index, name) for index, name in enumerate(names)]


@dataclass
class SplitScan:
    """The split of a stream of documents, with what its warnings need, in memory that grows with
    the files, not the documents."""

    valid_fraction: float
    documents: dict = field(default_factory=lambda: {"train": 0, "valid": 0})
    files: dict = field(default_factory=dict)  # file -> [train characters, valid characters]
    first_train: list = field(default_factory=list)  # (index, file) of the first two train documents
    lowest: tuple = (2.0,)  # (position, index, name, file, characters): valid if nothing else is
    highest: tuple = (-1.0,)  # (position, index, name, file, characters, text): train if nothing else is
    moved: dict = field(default_factory=dict)  # index -> (name, split) of a document moved to fill a split

    def add(self, index: int, name: str, text: str, file: str = "") -> bool:
        """Count a document; whether its name puts it in valid (before ``close``)."""
        position = _position(name)
        valid = position < self.valid_fraction
        self.documents["valid" if valid else "train"] += 1
        self.files.setdefault(file, [0, 0])[valid] += len(text)
        if not valid and len(self.first_train) < 2:
            self.first_train.append((index, file))
        if position < self.lowest[0]:
            self.lowest = (position, index, name, file, len(text))
        if position > self.highest[0]:
            self.highest = (position, index, name, file, len(text), text)
        return valid

    def close(self) -> None:
        """Give each split a document (see the module docstring)."""
        total = sum(self.documents.values())
        if total < 2:
            raise ValueError(f"a train/valid split needs at least 2 documents, the source has {plural(total, 'document')}: "
                             f"split a text file into documents with --split-documents blank-line (paragraphs) or line")
        for empty, (_, index, name, file, size, *_) in (("valid", self.lowest), ("train", self.highest)):
            if not self.documents[empty]:
                self.moved[index] = (name, empty)
                self.documents[empty] += 1
                self.documents["train" if empty == "valid" else "valid"] -= 1
                self.files[file][empty == "valid"] += size
                self.files[file][empty != "valid"] -= size
                self.first_train = [(i, f) for i, f in self.first_train if i != index] or [(index, file)]

    def is_valid(self, index: int, name: str) -> bool:
        """The document's split, once closed."""
        if index in self.moved:
            return self.moved[index][1] == "valid"
        return _position(name) < self.valid_fraction


def split_warnings(scan: SplitScan) -> list[str]:
    """One line for each way the split is degenerate: a single training document, a validation
    split larger than training, validation text mostly from one file that training has none of and
    that holds a tenth of the corpus or more (another source, not one file among many)."""
    size = {"train": sum(n[0] for n in scan.files.values()), "valid": sum(n[1] for n in scan.files.values())}
    fix = "split the files into more documents (--split-documents blank-line or line) or add text"
    out = []
    if scan.documents["train"] == 1:
        out.append(f"warning: the train split is 1 document ({scan.first_train[0][1]}): {fix}")
    if size["valid"] > size["train"]:
        out.append(f"warning: the valid split ({size['valid']:,} characters) is larger than the train split "
                   f"({size['train']:,}): {fix}, or lower --valid-fraction")
    unseen = {f: n[1] for f, n in scan.files.items() if n[1] and not n[0]}
    total = size["train"] + size["valid"]
    if unseen and max(unseen.values()) > max(size["valid"] / 2, total / 10):  # a file of many held out whole
        f = max(unseen, key=unseen.get)
        out.append(f"warning: {100 * unseen[f] / size['valid']:.0f}% of the valid split comes from {f}, which has no "
                   f"training document: validation measures another source than training; {fix}")
    return out


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


def _settings(source: str, vocab_size: int, valid_fraction: float, tokenizer: str | None, json_key: str,
              split: str | None, tokenizer_sample_bytes: int, tokenizer_threads: int, seed: int,
              skip_bad_records: str | None) -> dict:
    if source != STDLIB and not os.path.exists(source) and not _matches(source):
        raise FileNotFoundError(f"source {source} does not exist (a file, a folder or a glob pattern of text, JSONL, "
                                f"parquet or saved datasets, or 'stdlib')")
    if split is not None and split not in DOCUMENT_SPLITS:
        raise ValueError(f"--split-documents {split!r}: choose one of {', '.join(DOCUMENT_SPLITS)}")
    if tokenizer is None and vocab_size <= 0:
        raise ValueError(f"vocab size must be positive (got {vocab_size})")
    if not 0 < valid_fraction < 1:
        raise ValueError(f"valid fraction must be between 0 and 1 (got {valid_fraction})")
    if tokenizer_sample_bytes <= 0 or tokenizer_threads < 1:
        raise ValueError(f"the tokenizer's sample ({tokenizer_sample_bytes} bytes) and threads ({tokenizer_threads}) "
                         f"must be positive")
    BadRecords(skip_bad_records)  # a bad limit is an error before any work
    return {
        "source": source if source == STDLIB else os.path.abspath(source),
        "json_key": json_key,
        "valid_fraction": valid_fraction,
        "vocab_size": vocab_size if tokenizer is None else None,
        "tokenizer_sha256": None if tokenizer is None else load_tokenizer(tokenizer).sha256,
        "split_documents": split or default_split(source),
        "tokenizer_sample_bytes": tokenizer_sample_bytes,
        "tokenizer_threads": tokenizer_threads,
        "seed": seed,
        "skip_bad_records": skip_bad_records,
    }


def _matches(pattern: str) -> bool:
    """Whether `pattern` is a glob pattern that matches something."""
    return glob.has_magic(pattern) and bool(glob.glob(pattern))


def _existing(output: str, settings: dict, flag: str, hint: str) -> Corpus | None:
    """The corpus already at `output`, None when there is nothing there; an error naming `output`
    as the caller's `flag` and ending in `hint` (what to do) for anything else."""
    if not os.path.exists(output) or (os.path.isdir(output) and not os.listdir(output)):
        return None
    try:
        corpus, prepared = load_corpus(output), _manifest(output)["settings"]
    except ValueError as e:
        raise ValueError(f"{flag} {e}; {hint}") from None
    prepared.setdefault("split_documents", "file")  # prepared before text files could be split
    for key, value in DEFAULTS.items():  # prepared before these were settings: as their defaults do now
        prepared.setdefault(key, value)
    changed = [f"{k} {prepared.get(k)!r} → {v!r}" for k, v in settings.items() if prepared.get(k) != v]
    if changed:
        raise ValueError(f"{flag} {output} holds a corpus prepared with other settings ({', '.join(changed)}); {hint}")
    return corpus


def _scan(settings: dict, bad: BadRecords, show_progress: bool) -> tuple[SplitScan, Sample]:
    """The first pass: the split, its warnings' numbers and the tokenizer's sample of train text."""
    scan = SplitScan(settings["valid_fraction"])
    sample = Sample(settings["tokenizer_sample_bytes"], settings["seed"])
    documents = source_documents(settings["source"], settings["json_key"], settings["split_documents"], bad)
    for index, doc in enumerate(progress(documents, "scan", show_progress)):
        if not scan.add(index, doc.name, doc.text, doc.file):
            sample.add(index, doc.name, doc.text)
    scan.close()
    for index, (name, split) in scan.moved.items():
        if split == "valid":
            sample.discard(index)
        else:
            sample.add(index, name, scan.highest[5])
    return scan, sample


def _build(folder: str, settings: dict, tokenizer: str | None, workers: int, show_progress: bool) -> None:
    source = settings["source"]
    bad = BadRecords(settings["skip_bad_records"])
    scan, sample = _scan(settings, bad, show_progress)
    if bad.skipped:
        log.info(bad.summary())
    for line in split_warnings(scan):
        log.info(line)
    if tokenizer is None:
        tokenizer_file = "tokenizer.model"
        train_sentencepiece(sample.texts(), os.path.join(folder, tokenizer_file), settings["vocab_size"],
                            settings["tokenizer_threads"], show_progress)
    else:
        tokenizer_file = os.path.basename(tokenizer)  # the name tells its kind
        shutil.copyfile(tokenizer, os.path.join(folder, tokenizer_file))
    copied = [s for s in SPLITS if s == "valid" or sample.whole]  # train's too when the tokenizer read it whole
    del sample  # its text is not kept while tokenizing (nor in the workers)
    docs = {s: f"docs.{s}.jsonl" for s in copied}
    with contextlib.ExitStack() as stack:
        copies = {s: stack.enter_context(open(os.path.join(folder, docs[s]), "w", encoding="utf-8")) for s in copied}

        def items():
            documents = source_documents(source, settings["json_key"], settings["split_documents"], BadRecords(
                settings["skip_bad_records"], quiet=True))  # the bad records found by the scan, again
            for index, doc in enumerate(documents):
                split = "valid" if scan.is_valid(index, doc.name) else "train"
                if split in copies:
                    copies[split].write(json.dumps({"name": doc.name, "text": doc.text}, ensure_ascii=False) + "\n")
                yield SPLITS.index(split), doc.text

        prefixes = [os.path.join(folder, f"{s}_text_document") for s in SPLITS]
        counts = tokenize_into(items(), os.path.join(folder, tokenizer_file), prefixes, workers, show_progress,
                               desc="tokenize", total=sum(scan.documents.values()))
    tok = load_tokenizer(os.path.join(folder, tokenizer_file))
    splits = {s: {"prefix": f"{s}_text_document", "docs": docs.get(s), **n} for s, n in zip(SPLITS, counts)}
    if [splits[s]["documents"] for s in SPLITS] != [scan.documents[s] for s in SPLITS]:
        raise RuntimeError(f"the source changed while it was read ({splits} after a scan of {scan.documents})")
    manifest = {
        "source": source,
        **({"python": platform.python_version()} if source == STDLIB else {}),
        "settings": settings,
        "tokenizer": tokenizer_file,
        "tokenizer_kind": tok.kind,
        "vocab_size": tok.vocab_size,
        "splits": splits,
        **({"moved": {name: split for name, split in scan.moved.values()}} if scan.moved else {}),
        **({"skipped": dict(bad.counts)} if bad.skipped else {}),
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
    split_documents: str | None = None,
    tokenizer_sample_bytes: int = SAMPLE_BYTES,
    tokenizer_threads: int = 1,
    seed: int = 0,
    skip_bad_records: str | None = None,
) -> Corpus:
    """Prepare the corpus folder `output` from `source`, with a sentencepiece tokenizer of
    `vocab_size` trained on a sample of at most `tokenizer_sample_bytes` of the train documents
    (drawn by `seed`, learned on `tokenizer_threads` threads), or a copy of the `tokenizer` file;
    text files split into documents by `split_documents` (None: ``default_split``); bad records
    skipped as `skip_bad_records` allows (``documents.BadRecords``). Does nothing
    (and says so) when `output` already holds the corpus prepared with the same settings; anything
    else is an error naming `output` as `flag` and ending in `hint`."""
    output = os.path.abspath(output)
    settings = _settings(source, vocab_size, valid_fraction, tokenizer, json_key, split_documents,
                         tokenizer_sample_bytes, tokenizer_threads, seed, skip_bad_records)
    corpus = _existing(output, settings, flag, hint)
    if corpus is not None:
        if show_progress:
            log.info(f"{output}: corpus already prepared, nothing to do")
        return corpus
    try:
        with atomic_folder(output) as tmp:
            _build(str(tmp), settings, tokenizer, workers, show_progress)
    except FolderExists:  # another process (a run started beside this one) finished it first: theirs, if the same
        return _existing(output, settings, flag, hint)
    return load_corpus(output)


def ensure_corpus(source: str, output: str, vocab_size: int = 2048, **kwargs) -> Corpus:
    """The corpus at `output`, prepared from `source` first if it is not there yet (the training
    loop's call; this is `prepare_corpus`, which leaves a complete corpus as it is, with advice in
    the training entry point's flags)."""
    hint = (f"to train on the corpus there as it is, add --corpus null; to prepare --corpus {source} "
            f"with --vocab-size {vocab_size}, choose another --data-path")
    return prepare_corpus(source, output, vocab_size, flag="--data-path", hint=hint, **kwargs)
