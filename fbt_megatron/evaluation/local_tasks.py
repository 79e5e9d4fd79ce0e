"""lm-eval tasks built from held-out text on this machine: no downloads, the same files every time.

The text is the validation split of the embedded corpus (Python standard-library modules no
training run saw): the ``docs.valid.jsonl`` of a prepared corpus folder (``data/stdlib-sp2048``),
or, where none is prepared, the same split computed from this Python's standard library
(``fbt_megatron.data.corpus``: a module goes to valid when the hash of its name falls below 2%).

Two tasks, written with their data to one folder that lm-eval reads with ``--include_path``:

  fbt_stdlib_perplexity   ``loglikelihood_rolling`` over pieces of the held-out modules (cut at line
                          ends, at most ``max_chars`` characters, taken round-robin over the modules):
                          word_perplexity, byte_perplexity, bits_per_byte, as lm-eval's wikitext
  fbt_stdlib_next_line    ``multiple_choice``: a context of a few lines of a held-out module and four
                          candidate next lines (the true one and three lines of other held-out modules
                          with the same indentation); acc and acc_norm

    python -m fbt_megatron.evaluation tasks --output DIR [--documents 40] [--questions 100]

A third task, ``fbt_split_perplexity``, is the same perplexity over the held-out split of any
prepared corpus (``ensure_split_task``: the split of the corpus a run was trained on, for
the ``table`` command), in a folder of its own.

The files: ``perplexity.jsonl``, ``next_line.jsonl``, one YAML per task (``dataset_path: json``
with the absolute path of its data file; every metric with its aggregation and direction, so
lm-eval loads them without a warning) and ``tasks.json`` (what was built from what).
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from fbt_megatron.common.io import atomic_write

ROOT = Path(__file__).resolve().parent.parent.parent
DEFAULT_CORPUS = ROOT / "data" / "stdlib-sp2048"
DEFAULT_TASKS_FOLDER = ROOT / "data" / "lm-eval-tasks"  # where the tools build them on first use
PERPLEXITY, NEXT_LINE = "fbt_stdlib_perplexity", "fbt_stdlib_next_line"
TASKS = (PERPLEXITY, NEXT_LINE)
SPLIT_PERPLEXITY = "fbt_split_perplexity"  # a prepared corpus's held-out split (ensure_split_task)
MANIFEST = "tasks.json"
FORMAT = 2  # bump when the built files change for the same settings
SEED = 20261130
CHOICES = 4


@dataclass(frozen=True)
class LocalTasks:
    folder: str  # for --include_path
    names: tuple  # the task names
    documents: int  # perplexity documents
    questions: int  # multiple-choice items


# ---------------------------------------------------------------- the held-out text
def held_out_documents(corpus: Optional[str] = None) -> tuple:
    """([(name, text)], source description): the validation documents of ``corpus`` (a prepared
    corpus folder; by default the repository's data/stdlib-sp2048 when it is prepared), else the
    standard library's valid split computed here."""
    folder = Path(corpus) if corpus is not None else DEFAULT_CORPUS
    docs_file = folder / "docs.valid.jsonl"
    if docs_file.is_file():
        docs = []
        with open(docs_file, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    record = json.loads(line)
                    docs.append((record["name"], record["text"]))
        return docs, f"{folder.resolve()}/docs.valid.jsonl"
    if corpus is not None:
        raise FileNotFoundError(f"--corpus {corpus}: no docs.valid.jsonl there (not a prepared corpus folder)")
    from fbt_megatron.data.corpus import STDLIB, source_documents, split_documents

    documents = list(source_documents(STDLIB))
    valid = split_documents([d.name for d in documents], 0.02)
    return [(d.name, d.text) for d, v in zip(documents, valid) if v], "stdlib valid split (2%)"


def pieces(text: str, max_chars: int) -> List[str]:
    """``text`` cut at line ends into pieces of at most ``max_chars`` characters (a longer line is
    a piece of its own, cut at ``max_chars``); pieces with nothing but whitespace are dropped."""
    out, current = [], ""
    for line in text.splitlines(keepends=True):
        while len(line) > max_chars:
            if current:
                out.append(current)
                current = ""
            out.append(line[:max_chars])
            line = line[max_chars:]
        if len(current) + len(line) > max_chars:
            out.append(current)
            current = ""
        current += line
    if current:
        out.append(current)
    return [p for p in out if p.strip()]


def perplexity_documents(docs: Sequence[tuple], count: int, max_chars: int) -> List[dict]:
    """``count`` pieces taken round-robin over the documents (first pieces first)."""
    cut = [[(name, i, p) for i, p in enumerate(pieces(text, max_chars))] for name, text in docs]
    out, depth = [], 0
    while len(out) < count and any(depth < len(c) for c in cut):
        out += [{"name": f"{c[depth][0]}#{c[depth][1]}", "text": c[depth][2]} for c in cut if depth < len(c)]
        depth += 1
    return out[:count]


# ---------------------------------------------------------------- the next-line questions
MIN_LINE, MAX_LINE = 12, 100  # characters of a candidate line, indentation not counted
CONTEXT_LINES, CONTEXT_CHARS = 8, 400


def _indent(line: str) -> str:
    return line[: len(line) - len(line.lstrip())]


def _candidate(line: str) -> bool:
    """A line worth predicting: some code or prose, not a lone bracket, separator or repeated table entry."""
    body = line.strip()
    return MIN_LINE <= len(body) <= MAX_LINE and len(re.findall(r"\w", body)) >= 5


def next_line_questions(docs: Sequence[tuple], count: int, seed: int = SEED) -> List[dict]:
    """``count`` items {name, context, choices, label}: a line of a held-out document after the
    (up to) ``CONTEXT_LINES`` lines before it, against three lines of other documents with the
    same indentation (any indentation when fewer exist). The items are spread round-robin over the
    documents; the answer's place among the choices is uniform."""
    rng = random.Random(seed)
    lines = [text.splitlines() for _, text in docs]
    by_indent: Dict[str, List[tuple]] = {}  # indentation -> [(document, line)]
    for d, doc_lines in enumerate(lines):
        for line in doc_lines:
            if _candidate(line):
                by_indent.setdefault(_indent(line), []).append((d, line.rstrip()))
    targets = []
    for d, doc_lines in enumerate(lines):
        places = [i for i in range(3, len(doc_lines)) if _candidate(doc_lines[i]) and any(l.strip() for l in doc_lines[i - 3:i])]
        rng.shuffle(places)
        targets.append(places)
    order, depth = [], 0
    while len(order) < count and any(depth < len(t) for t in targets):
        order += [(d, t[depth]) for d, t in enumerate(targets) if depth < len(t)]
        depth += 1
    everything = [x for pool in by_indent.values() for x in pool]
    items = []
    for d, i in order[:count]:
        answer = lines[d][i].rstrip()
        pool = [line for doc, line in by_indent.get(_indent(answer), []) if doc != d and line != answer]
        if len(set(pool)) < CHOICES - 1:
            pool = [line for doc, line in everything if doc != d and line != answer]
        distractors = rng.sample(sorted(set(pool)), CHOICES - 1)
        label = rng.randrange(CHOICES)
        choices = distractors[:label] + [answer] + distractors[label:]
        before = [l.rstrip() + "\n" for l in lines[d][max(0, i - CONTEXT_LINES):i]]
        while len(before) > 1 and sum(map(len, before)) > CONTEXT_CHARS:
            before.pop(0)  # whole lines, at most CONTEXT_CHARS characters (a longer last line is cut)
        context = "".join(before)[-CONTEXT_CHARS:]
        items.append({"name": f"{docs[d][0]}:{i + 1}", "context": context, "choices": choices, "label": label})
    return items


# ---------------------------------------------------------------- the files lm-eval reads
def _yaml(task: str, data_file: Path, body: str) -> str:
    return (f"# built by fbt_megatron.evaluation.local_tasks (held-out text)\n"
            f"task: {task}\n"
            f"dataset_path: json\n"
            f"dataset_kwargs:\n"
            f"  data_files:\n"
            f"    test: {json.dumps(str(data_file))}\n"
            f"test_split: test\n" + body)


PERPLEXITY_YAML = """output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: text
metric_list:
  - metric: word_perplexity
    aggregation: weighted_perplexity
    higher_is_better: false
  - metric: byte_perplexity
    aggregation: weighted_perplexity
    higher_is_better: false
  - metric: bits_per_byte
    aggregation: bits_per_byte
    higher_is_better: false
metadata:
  version: 1.0
"""

NEXT_LINE_YAML = """output_type: multiple_choice
doc_to_text: context
doc_to_choice: choices
doc_to_target: label
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def _write_jsonl(path: Path, records: List[dict]) -> None:
    atomic_write(path, "".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in records))


def build_tasks(output: str, documents: int = 40, questions: int = 100, max_chars: int = 1200,
                corpus: Optional[str] = None) -> LocalTasks:
    """Write the two tasks to ``output`` (created; files there are replaced). Deterministic: the
    same settings and held-out text give the same files."""
    if documents < 1 or questions < 1:
        raise ValueError(f"--documents and --questions must be positive (got {documents}, {questions})")
    if max_chars < 100:
        raise ValueError(f"--max-chars must be at least 100 (got {max_chars})")
    docs, source = held_out_documents(corpus)
    folder = Path(output).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    ppl = perplexity_documents(docs, documents, max_chars)
    mc = next_line_questions(docs, questions)
    _write_jsonl(folder / "perplexity.jsonl", ppl)
    _write_jsonl(folder / "next_line.jsonl", mc)
    atomic_write(folder / f"{PERPLEXITY}.yaml", _yaml(PERPLEXITY, folder / "perplexity.jsonl", PERPLEXITY_YAML))
    atomic_write(folder / f"{NEXT_LINE}.yaml", _yaml(NEXT_LINE, folder / "next_line.jsonl", NEXT_LINE_YAML))
    manifest = {"format": FORMAT, "source": source, "held_out_documents": len(docs),
                "settings": _settings(documents, questions, max_chars, corpus),
                "tasks": {PERPLEXITY: len(ppl), NEXT_LINE: len(mc)}}
    atomic_write(folder / MANIFEST, json.dumps(manifest, indent=2) + "\n")
    return LocalTasks(str(folder), TASKS, len(ppl), len(mc))


def _settings(documents: int, questions: int, max_chars: int, corpus: Optional[str]) -> dict:
    return {"documents": documents, "questions": questions, "max_chars": max_chars,
            "corpus": None if corpus is None else str(Path(corpus).resolve())}


def build_split_task(output: str, corpus: str, documents: int = 40, max_chars: int = 1200) -> LocalTasks:
    """Write ``fbt_split_perplexity`` over the held-out split of the prepared ``corpus`` to ``output``."""
    if documents < 1:
        raise ValueError(f"--documents must be positive (got {documents})")
    docs, source = held_out_documents(corpus)
    folder = Path(output).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    ppl = perplexity_documents(docs, documents, max_chars)
    _write_jsonl(folder / "perplexity.jsonl", ppl)
    atomic_write(folder / f"{SPLIT_PERPLEXITY}.yaml", _yaml(SPLIT_PERPLEXITY, folder / "perplexity.jsonl", PERPLEXITY_YAML))
    manifest = {"format": FORMAT, "source": source, "held_out_documents": len(docs),
                "settings": _settings(documents, 0, max_chars, corpus), "tasks": {SPLIT_PERPLEXITY: len(ppl)}}
    atomic_write(folder / MANIFEST, json.dumps(manifest, indent=2) + "\n")
    return LocalTasks(str(folder), (SPLIT_PERPLEXITY,), len(ppl), 0)


def _built(folder: str, settings: dict, names: tuple, data: str) -> Optional[LocalTasks]:
    """The tasks ``names`` in ``folder`` when they were built there with ``settings`` (their data
    file ``data`` where the YAML says), else None."""
    try:
        manifest = json.loads((Path(folder) / MANIFEST).read_text())
        files = all((Path(folder) / f).is_file() for f in (data, *(f"{t}.yaml" for t in names)))
        where = json.dumps(str(Path(folder).resolve() / data))
        if manifest.get("format") == FORMAT and manifest.get("settings") == settings and files \
                and where in (Path(folder) / f"{names[-1]}.yaml").read_text():
            counts = manifest["tasks"]
            return LocalTasks(str(Path(folder).resolve()), names, counts[names[0]], counts.get(NEXT_LINE, 0))
    except (OSError, ValueError, KeyError):
        pass
    return None


def ensure_tasks(folder: str, documents: int = 40, questions: int = 100, max_chars: int = 1200,
                 corpus: Optional[str] = None) -> LocalTasks:
    """The tasks in ``folder``, built there first if missing or built with other settings."""
    return (_built(folder, _settings(documents, questions, max_chars, corpus), TASKS, "next_line.jsonl")
            or build_tasks(folder, documents, questions, max_chars, corpus))


def ensure_split_task(folder: str, corpus: str, documents: int = 40, max_chars: int = 1200) -> LocalTasks:
    """``fbt_split_perplexity`` of ``corpus`` in ``folder``, built there first if missing or built otherwise."""
    return (_built(folder, _settings(documents, 0, max_chars, corpus), (SPLIT_PERPLEXITY,), "perplexity.jsonl")
            or build_split_task(folder, corpus, documents, max_chars))
