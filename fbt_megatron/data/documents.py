"""Documents from text files, folders and JSONL files: the one reader of raw text.

A ``.jsonl`` file holds one document per line (a JSON object, the text under `json_key`); any
other file is read as UTF-8 with its line endings kept exactly and split into documents by
`split` (``SPLITS``): ``file`` one document, ``blank-line`` one per paragraph (lines between
blank lines), ``line`` one per line; a piece of a file is named "file.txt:LINE" (its first line).
A folder is read recursively in sorted order, skipping hidden entries and ``__pycache__``. Empty
documents are skipped; inputs without any document are an error.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Iterable, Iterator

from tqdm import tqdm


SPLITS = ("file", "blank-line", "line")  # how a text file is split into documents


@dataclass(frozen=True)
class Document:
    name: str  # the file's path relative to the input folder, or "file:LINE" (a JSONL line, a piece of a text file)
    text: str

    @property
    def file(self) -> str:
        """The name of the file the document comes from."""
        return self.name.rsplit(":", 1)[0] if self.name.rsplit(":", 1)[-1].isdigit() else self.name


def list_files(folder: str, suffixes: tuple[str, ...] | None = None, skip_dirs: Iterable[str] = ()) -> list[str]:
    """The files under `folder` (with one of `suffixes`, if given), sorted, skipping hidden entries,
    ``__pycache__`` and folders named in `skip_dirs`."""
    skip = {"__pycache__", *skip_dirs}
    files = []
    for root, dirs, names in os.walk(folder):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in skip]
        files += [
            os.path.join(root, n)
            for n in names
            if not n.startswith(".") and (suffixes is None or n.endswith(suffixes))
        ]
    return sorted(files)


def split_text(text: str, name: str, split: str) -> Iterator[Document]:
    """The documents of a text file's content (see the module docstring)."""
    if split == "file":
        if text:
            yield Document(name, text)
        return
    if split not in SPLITS:
        raise ValueError(f"--split-documents {split!r}: choose one of {', '.join(SPLITS)}")
    lines, start, piece = text.splitlines(keepends=True), 0, []
    for number, line in enumerate([*lines, ""], 1):
        blank = not line.strip()
        if piece and (blank or split == "line"):
            yield Document(f"{name}:{start}", "".join(piece).rstrip("\r\n"))
            piece = []
        if not blank:
            start = number if not piece else start
            piece.append(line)


def read_file(path: str, name: str, json_key: str = "text", split: str = "file") -> Iterator[Document]:
    """The documents of one file: one per JSONL line, or the file's text split by ``split``."""
    try:
        if not path.endswith(".jsonl"):
            with open(path, encoding="utf-8", newline="") as f:
                yield from split_text(f.read(), name, split)
            return
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    text = _json_text(line, json_key, f"{path}:{number}")
                    if text:
                        yield Document(f"{name}:{number}", text)
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start})") from None


def _json_text(line: str, key: str, where: str) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: malformed JSON line ({e.msg})") from None
    if not isinstance(record, dict) or key not in record:
        raise ValueError(f"{where}: no key {key!r} (choose the text field with --json-key)")
    if not isinstance(record[key], str):
        raise ValueError(f"{where}: the value of {key!r} is not a string")
    return record[key]


def iter_documents(inputs: list[str], json_key: str = "text", split: str = "file") -> Iterator[Document]:
    """The documents of `inputs` (files or folders) in order, text files split by ``split``; a
    missing input or no document at all is an error."""
    found = False
    for path in inputs:
        if os.path.isdir(path):
            files = [(f, os.path.relpath(f, path)) for f in list_files(path)]
        elif os.path.isfile(path):
            files = [(path, os.path.basename(path))]
        else:
            raise FileNotFoundError(f"input {path} does not exist")
        for file, name in files:
            for doc in read_file(file, name, json_key, split):
                found = True
                yield doc
    if not found:
        raise ValueError(f"no documents in {', '.join(inputs) or 'the inputs'} (empty corpus)")


def progress(documents: Iterable, desc: str, show: bool, **kwargs) -> tqdm:
    """A tqdm bar counting `documents`, shown when `show` and stderr is a terminal."""
    return tqdm(documents, desc=desc, unit=" docs", disable=None if show else True, **kwargs)
