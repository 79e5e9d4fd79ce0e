"""The tiny SFT set (``data.corpus: sft:stdlib`` or ``sft:FOLDER`` of ``.py`` files), prepared on first use:
questions about the public functions and classes of Python's standard library answered with the
first paragraph of their docstrings (and, for some, a follow-up about their parameters), split by
module like the corpus, written whole (``io.atomic_folder``) to ``data.data_path``::

    sft.json                    manifest: settings (source, tokenizer, sequence length), files, conversations
    train.jsonl, valid.jsonl    the chat records that fit the sequence
    TOKENIZER FILE              a copy of the run's, with a tokenizer_config.json holding the chat template
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

from fbt_megatron.common.io import FolderExists, atomic_folder
from fbt_megatron.data.sft.chat import DEFAULT_CHAT_TEMPLATE, ChatEncoder, write_tokenizer_config
from fbt_megatron.data.tokenizer import load_tokenizer

MANIFEST = "sft.json"
SOURCE_PREFIX = "sft:"
SPLITS = ("train", "valid")


def set_source(corpus: Optional[str]) -> Optional[str]:
    """The source a ``data.corpus`` value names for an SFT set ("sft:stdlib", "sft:FOLDER"), else None."""
    return corpus[len(SOURCE_PREFIX):] if corpus and corpus.startswith(SOURCE_PREFIX) else None


SYSTEM = "You answer questions about Python's standard library from its source."


def _summary(docstring: Optional[str]) -> Optional[str]:
    """The first paragraph of a docstring on one line, if it is a sentence of reasonable length."""
    if not docstring:
        return None
    text = " ".join(docstring.strip().split("\n\n")[0].split())
    return text if 16 <= len(text) <= 160 and text[0].isalpha() else None


def _parameters(node: ast.FunctionDef) -> str:
    a = node.args
    names = [x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs] if x.arg not in ("self", "cls")]
    names += [f"*{a.vararg.arg}"] if a.vararg else []
    names += [f"**{a.kwarg.arg}"] if a.kwarg else []
    return ", ".join(names)


def module_conversations(module: str, text: str) -> Iterator[dict]:
    """Chat records about one module's public functions and classes (deterministic)."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.ClassDef)) or node.name.startswith("_"):
            continue
        answer = _summary(ast.get_docstring(node))
        if answer is None:
            continue
        name = f"{module}.{node.name}"
        h = int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "big")
        question = f"What does {name} do?" if isinstance(node, ast.FunctionDef) else f"What is {name}?"
        messages = ([{"role": "system", "content": SYSTEM}] if h % 3 == 0 else []) + [
            {"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        if isinstance(node, ast.FunctionDef) and h % 4 == 1:  # a second turn
            params = _parameters(node)
            messages += [{"role": "user", "content": "What are its parameters?"},
                         {"role": "assistant", "content": f"{node.name}({params})" if params else "It takes none."}]
        yield {"messages": messages}


def _manifest(folder) -> Optional[dict]:
    try:
        return json.loads(Path(folder, MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def set_files(folder) -> Tuple[List[str], List[str], str]:
    """(train files, valid files, tokenizer file) of the prepared set in ``folder`` (the run's ``data.data_path``)."""
    manifest = _manifest(folder)
    if manifest is None:
        raise ValueError(f"data.data_path {folder} is not a prepared SFT set (no {MANIFEST}): set --corpus "
                         f"sft:stdlib to prepare one there, or --train-data-path to chat .jsonl files")
    train, valid = ([str(Path(folder, manifest["splits"][s]))] for s in SPLITS)
    return train, valid, str(Path(folder, manifest["tokenizer"]))


def ensure_sft_set(corpus: str, output: str, tokenizer_model: Optional[str], seq_length: int) -> None:
    """Prepare the tiny SFT set ``output`` from ``corpus`` ("sft:stdlib" or "sft:FOLDER") unless it
    is there already, made with the same settings: train.jsonl, valid.jsonl (conversations that fit
    ``seq_length`` positions), a copy of the tokenizer with a tokenizer_config.json (the chat
    template) and sft.json, written whole (``io.atomic_folder``)."""
    source = set_source(corpus)
    if tokenizer_model is None:
        raise ValueError(f"--corpus {corpus} needs --tokenizer-model (the tokenizer of the run to fine-tune)")
    tokenizer = load_tokenizer(tokenizer_model)
    settings = {"source": source if source == "stdlib" else os.path.abspath(source), "tokenizer_sha256": tokenizer.sha256,
                "seq_length": seq_length}
    if _prepared(output, settings):
        return
    if source != "stdlib" and not os.path.isdir(source):
        raise FileNotFoundError(f"--corpus {corpus}: {source} is not a folder of .py files (or use sft:stdlib)")
    try:
        _write_set(output, source, tokenizer_model, tokenizer, settings)
    except FolderExists:  # another process (a run started beside this one) finished it first: theirs, if the same
        _prepared(output, settings)


def _prepared(output: str, settings: dict) -> bool:
    """True when ``output`` holds the SFT set of ``settings``, False when there is nothing there; else
    a ValueError naming the fix."""
    existing = _manifest(output)
    if existing is not None:
        if existing.get("settings") != settings:
            raise ValueError(f"--data-path {output} holds an SFT set prepared from other settings ({existing.get('settings')}); "
                             f"choose another --data-path or remove it")
        return True
    if os.path.exists(output) and os.listdir(output):
        raise ValueError(f"--data-path {output} exists and is not an SFT set; choose another --data-path")
    return False


def _write_set(output: str, source: str, tokenizer_model: str, tokenizer, settings: dict) -> None:
    from fbt_megatron.data.corpus import source_documents, split_documents

    documents = [d for d in source_documents(source) if d.name.endswith(".py")]
    in_valid = split_documents([d.name for d in documents], 0.1)
    encoder = ChatEncoder(tokenizer, DEFAULT_CHAT_TEMPLATE, "the default chat template")
    seq_length = settings["seq_length"]
    with atomic_folder(output) as tmp:
        counts = {}
        for split, wanted in zip(SPLITS, (False, True)):
            with open(tmp / f"{split}.jsonl", "w", encoding="utf-8") as f:
                counts[split] = 0
                for doc, valid in zip(documents, in_valid):
                    if valid == wanted:
                        module = doc.name[:-3].replace(os.sep, ".").removesuffix(".__init__")
                        for record in module_conversations(module, doc.text):
                            if len(encoder.encode(record["messages"])[0]) - 1 > seq_length:
                                continue
                            f.write(json.dumps(record, ensure_ascii=False) + "\n")
                            counts[split] += 1
        tokenizer_file = os.path.basename(tokenizer_model)
        shutil.copyfile(tokenizer_model, tmp / tokenizer_file)
        write_tokenizer_config(tmp, tokenizer)
        manifest = {"settings": settings, "tokenizer": tokenizer_file, "conversations": counts,
                    "splits": {s: f"{s}.jsonl" for s in SPLITS}}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
