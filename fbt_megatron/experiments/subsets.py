"""A fixed unique corpus for data-constrained studies: whole documents of a prepared corpus's train
split, about N tokens of them, tokenized with the corpus's own tokenizer.

The subset is itself a prepared corpus folder (``fbt_megatron.data.corpus``), so a run reads it
with ``--data-path SUBSET --corpus null``::

    corpus.json                      the corpus's manifest, its train split replaced; "subset" says how
    tokenizer.model                  a copy of the corpus's tokenizer
    docs.train.jsonl                 the chosen documents, whole, in the corpus's order
    train_text_document.bin/.idx     them, tokenized again with that tokenizer (EOD after each)
    docs.valid.jsonl, valid_text_document.bin/.idx     the corpus's validation split, copied

Documents are taken in an order shuffled by ``order_seed``; a document joins when it keeps the
subset at most ``tokens`` long (EOD included), so the subset ends a little under ``tokens``. With
``max_shared_lines``, a document that shares more long lines (over 40 characters, stripped) with the
validation split is left out: near-copies of validation documents (the stdlib's generated codec
tables, ``encodings/cp1253.py`` beside the validation split's ``encodings/iso8859_6.py``) would
otherwise be memorised and read as generalisation. With ``max_document_share``, a document longer
than that share of ``tokens`` is left out, so that no one document makes most of the subset (the
stdlib's generated ``pydoc_data/topics.py``, English prose, would be 78% of a 300K subset). Leaving
documents out keeps the others' order, so a subset that holds none of them is the same with or
without a rule; the manifest lists what each rule left out. The folder is written whole
(``io.atomic_folder``); an existing subset is reused when it was made the same way, and is an
error otherwise.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from typing import Optional

import numpy
from megatron.core.datasets.indexed_dataset import IndexedDataset

from fbt_megatron.common.io import FolderExists, atomic_folder
from fbt_megatron.data.corpus import MANIFEST, Corpus, load_corpus
from fbt_megatron.data.preprocess import preprocess

LONG_LINE = 40  # characters: shorter lines (``else:``, ``return None``) are shared by any two programs


def long_lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if len(line.strip()) > LONG_LINE]


def choose_documents(lengths: list[int], tokens: int, order_seed: int = 0, excluded: frozenset = frozenset()) -> list[int]:
    """Indices (increasing) of the documents, of these token ``lengths``, that make the subset;
    ``excluded`` documents are passed over."""
    chosen, total = [], 0
    for i in numpy.random.default_rng(order_seed).permutation(len(lengths)).tolist():
        if i not in excluded and total + lengths[i] <= tokens:
            chosen.append(i)
            total += lengths[i]
    return sorted(chosen)


def _manifest(folder: str) -> dict:
    with open(os.path.join(folder, MANIFEST)) as f:
        return json.load(f)


def shared_with_validation(corpus_folder: str, manifest: dict) -> list[tuple[str, int]]:
    """For each document of the train split: its name, and how many of its long lines the
    validation split holds."""
    def documents(split):
        with open(os.path.join(corpus_folder, manifest["splits"][split]["docs"]), encoding="utf-8") as f:
            return [json.loads(line) for line in f]

    valid = {line for d in documents("valid") for line in long_lines(d["text"])}
    return [(d["name"], sum(line in valid for line in long_lines(d["text"]))) for d in documents("train")]


def prepare_subset(corpus_folder: str, output: str, tokens: int, order_seed: int = 0,
                   max_shared_lines: Optional[int] = None, max_document_share: Optional[float] = None) -> Corpus:
    """The subset of about ``tokens`` tokens of ``corpus_folder``'s train split in ``output`` (see
    the module docstring); its validation split is the corpus's."""
    if tokens < 1:
        raise ValueError(f"a subset needs a positive number of tokens, got {tokens}")
    if max_document_share is not None and not 0 < max_document_share <= 1:
        raise ValueError(f"max_document_share is a share of the subset's tokens, in (0, 1]; got {max_document_share}")
    corpus = load_corpus(corpus_folder)
    recipe = {"of": os.path.abspath(corpus_folder), "target_tokens": tokens, "order_seed": order_seed,
              "max_shared_lines": max_shared_lines, "max_document_share": max_document_share}
    output = os.path.abspath(output)
    if os.path.exists(output):
        made = _manifest(output).get("subset", {}) if os.path.isfile(os.path.join(output, MANIFEST)) else {}
        if {k: made.get(k) for k in recipe} != recipe:
            raise ValueError(f"{output} holds something else than the subset {recipe}; choose another folder or remove it")
        return load_corpus(output)
    documents = IndexedDataset(corpus.train_prefix)  # kept while its memory map is read
    lengths = documents.sequence_lengths.tolist()  # per document, EOD included
    del documents
    manifest = _manifest(corpus_folder)
    if manifest["splits"]["train"].get("docs") is None:  # a large corpus keeps no copy of its train split
        raise ValueError(f"{corpus_folder} keeps no copy of its train split's documents (it was larger than the "
                         "tokenizer's sample when prepared), and a subset is made of whole documents: prepare it again "
                         "with --tokenizer-sample-bytes above its size")
    shared = shared_with_validation(corpus_folder, manifest) if max_shared_lines is not None else []
    excluded = {i: name for i, (name, n) in enumerate(shared) if n > max_shared_lines}
    cap = tokens * max_document_share if max_document_share is not None else tokens
    too_long = [i for i, n in enumerate(lengths) if n > cap]
    chosen = choose_documents(lengths, tokens, order_seed, frozenset(excluded) | frozenset(too_long))
    if not chosen:
        raise ValueError(f"no document of {corpus_folder}'s train split fits in {tokens} tokens; ask for more")
    with contextlib.suppress(FolderExists), atomic_folder(output) as tmp:  # FolderExists: another process made it first
        source_docs = os.path.join(corpus_folder, manifest["splits"]["train"]["docs"])
        keep, long_ones = set(chosen), set(too_long) if max_document_share is not None else set()
        lines, too_long_names = [], []
        with open(source_docs, encoding="utf-8") as f:
            for i, line in enumerate(f):
                if i in keep:
                    lines.append(line)
                if i in long_ones:
                    too_long_names.append(json.loads(line)["name"])
        with open(os.path.join(tmp, "docs.train.jsonl"), "w", encoding="utf-8") as out:
            out.writelines(lines)
        shutil.copyfile(corpus.tokenizer_path, os.path.join(tmp, manifest["tokenizer"]))
        counts = preprocess([os.path.join(tmp, "docs.train.jsonl")], os.path.join(tmp, manifest["tokenizer"]),
                            os.path.join(tmp, "train_text_document"), show_progress=False)
        expected = sum(lengths[i] for i in chosen)
        if counts != {"documents": len(chosen), "tokens": expected}:  # the corpus's tokenizer, the same documents
            raise RuntimeError(f"the subset tokenized to {counts}, not the corpus's {len(chosen)} documents of {expected} tokens")
        valid = manifest["splits"]["valid"]
        for file in (valid["docs"], valid["prefix"] + ".bin", valid["prefix"] + ".idx"):
            shutil.copyfile(os.path.join(corpus_folder, file), os.path.join(tmp, file))
        manifest["splits"]["train"] = {"prefix": "train_text_document", "docs": "docs.train.jsonl", **counts}
        manifest["subset"] = {**recipe, "documents": [json.loads(line)["name"] for line in lines],
                              "excluded": [excluded[i] for i in sorted(excluded)],
                              "too_long": too_long_names}
        with open(os.path.join(tmp, MANIFEST), "w") as f:
            json.dump(manifest, f, indent=2)
    return load_corpus(output)
