"""One table of lm-eval results, rows model × decode mode (``python -m fbt_megatron.evaluation table``).

Every model (``models``: a run folder exported first, or an export) is evaluated in this process
(``harness.ExportEvaluator``) on the local tasks built from held-out standard-library text and on
its own held-out split (``own_split``), in each decode mode it has (a baseline: standard only). The
table goes to a markdown file, the same numbers with the details to the ``.json`` beside it.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

from fbt_megatron.common.cli import plural
from fbt_megatron.evaluation.harness import METRICS
from fbt_megatron.evaluation.local_tasks import DEFAULT_TASKS_FOLDER, LocalTasks
from fbt_megatron.evaluation.models import Model, exported_models, resolve
from fbt_megatron.evaluation.own_split import corpus_checks, given_corpus, split_tasks

DEFAULT_MODES = ("standard", "soft", "fused(1)", "fused(2)", "fused(3)")
COLUMNS = tuple(column for _, _, column in METRICS)
HEADERS = {"word_perplexity": "word perplexity ↓", "bits_per_byte": "bits per byte ↓",
           "acc": "next line acc ↑", "acc_norm": "next line acc_norm ↑",
           "split_word_perplexity": "own split word perplexity ↓", "split_bits_per_byte": "own split bits per byte ↓"}


@dataclass
class Settings:
    """What ``write_table`` evaluates, and how (the ``table`` command's flags)."""

    models: List[str]
    output: str = "results.md"  # the markdown table; the .json beside it
    modes: List[str] = field(default_factory=lambda: list(DEFAULT_MODES))
    limit: Optional[int] = None  # items per task
    tasks_dir: str = str(DEFAULT_TASKS_FOLDER)
    documents: int = 40  # perplexity documents when building the tasks
    questions: int = 100  # next-line items when building the tasks
    corpus: Optional[str] = None  # every model's held-out split (default: a run's own corpus)
    cache: Optional[str] = None  # run folders' exports (default <output's folder>/exports)
    batch_size: int = 8
    device: Optional[str] = None
    backend: str = "hf"
    threads: Optional[int] = None


def fmt(column: str, value: Optional[float]) -> str:
    if value is None:
        return "–"
    if column.endswith("word_perplexity"):
        return f"{value:,.2f}" if value < 1e4 else f"{value:.3e}"
    return f"{value:.4f}" if column.endswith("bits_per_byte") else f"{value:.3f}"


def markdown(rows: List[dict], info: dict) -> str:
    """The table with a heading saying what its tasks and modes are."""
    head = ["model", "mode", *(HEADERS[c] for c in COLUMNS)]
    splits = "".join(f"; `fbt_split_perplexity` of {label}: {plural(n, 'piece')} of {corpus}/docs.valid.jsonl"
                     for label, (corpus, n) in info["splits"].items())
    lines = ["# lm-eval on held-out text", "",
             f"Tasks: `fbt_stdlib_perplexity` ({plural(info['documents'], 'document')}) and `fbt_stdlib_next_line` "
             f"({plural(info['questions'], 'item')}, 4 choices, chance 0.25), from {info['source']}{splits}"
             + (f"; `--limit {info['limit']}` items per task" if info["limit"] else "") + ".",
             "Modes: standard = the plain model; soft = generated positions fed the previous position's state; "
             "fused(n) = n fused passes over the prompt, then soft. A baseline (no latent feedback) has standard only.",
             "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join([r["model"], r["mode"], *(fmt(c, r[c]) for c in COLUMNS)]) + " |")
    return "\n".join(lines) + "\n"


def check(settings: Settings) -> tuple:
    """(decode modes, ``resolve``'s models, the corpus every model is evaluated on or None); an
    unknown mode, a bad number, a missing model or corpus raises before any work."""
    from fbt_megatron.model.decode_modes import mode_label, parse_mode

    modes = [mode_label(*parse_mode(m)) for m in settings.modes]  # an unknown mode stops here
    if settings.backend == "vllm":
        from fbt_megatron.inference.serving import require_vllm

        require_vllm("--backend vllm")  # before any export is written
    if settings.limit is not None and settings.limit < 1:
        raise ValueError(f"--limit must be positive (got {settings.limit})")
    if settings.batch_size < 1:
        raise ValueError(f"--batch-size must be positive (got {settings.batch_size})")
    models = resolve(settings.models)
    return list(dict.fromkeys(modes)), models, given_corpus(settings.corpus)


def evaluate_all(models: List[Model], modes: List[str], tasks: LocalTasks, own: Dict[str, LocalTasks],
                 settings: Settings) -> tuple:
    """(table rows, details): every model in every decode mode it has (a baseline: standard only),
    on the local tasks and its own corpus split, one evaluator per model."""
    from tqdm import tqdm

    from fbt_megatron.evaluation.harness import ExportEvaluator, table_row

    plan = {m.label: modes if m.latent_feedback else ["standard"] for m in models}
    rows, details = [], []
    bar = tqdm(total=sum(map(len, plan.values())), desc="evaluations", unit="eval")
    for m in models:
        evaluator = ExportEvaluator(m.export, batch_size=settings.batch_size, device=settings.device,
                                    backend=settings.backend)
        for mode in plan[m.label]:
            bar.set_description_str(f"{m.label} {mode}")
            start = time.perf_counter()
            results = evaluator.evaluate(mode, tasks, limit=settings.limit)
            if m.label in own:
                results.update(evaluator.evaluate(mode, own[m.label], limit=settings.limit))
            row = {"model": m.label, "mode": mode, **table_row(results)}
            rows.append(row)
            details.append({**row, "source": m.source, "export": m.export, "iteration": m.run_iteration,
                            "backend": settings.backend, "seconds": round(time.perf_counter() - start, 2),
                            "results": results})
            bar.update(1)
        del evaluator
    bar.close()
    return rows, details


def _threads(threads: Optional[int]) -> None:
    """torch's threads: as given, else on CPU 1 (fastest for the tiny models' many small decoding steps)."""
    import torch

    if threads or not torch.cuda.is_available():
        torch.set_num_threads(threads or 1)


def write_table(settings: Settings) -> Path:
    """Evaluate ``settings.models`` and write the table (markdown, and json beside it); prints the
    table and returns the markdown file."""
    from tqdm import tqdm

    from fbt_megatron.common.cli import quiet_library_warnings
    from fbt_megatron.evaluation.local_tasks import ensure_tasks

    modes, models, corpus = check(settings)
    output = Path(settings.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    cache = (Path(settings.cache) if settings.cache else output.parent / "exports").resolve()
    quiet_library_warnings()
    _threads(settings.threads)
    tasks = ensure_tasks(settings.tasks_dir, settings.documents, settings.questions)
    source = json.loads((Path(tasks.folder) / "tasks.json").read_text())["source"]
    resolved = exported_models(models, cache, output.parent / f"{output.stem}.export.log", say=tqdm.write)
    for model in resolved:
        model.corpus, warnings = corpus_checks(model, corpus, given=corpus is not None)
        for line in warnings:
            tqdm.write(line)
    own = {m.label: split_tasks(Path(m.corpus), output.parent / "split-tasks", settings.documents)
           for m in resolved if m.corpus is not None}
    rows, details = evaluate_all(resolved, modes, tasks, own, settings)
    info = {"documents": tasks.documents, "questions": tasks.questions, "source": source, "limit": settings.limit,
            "splits": {m.label: (m.corpus, own[m.label].documents) for m in resolved if m.label in own}}
    output.write_text(markdown(rows, info))
    json_path = output.with_suffix(".json")
    json_path.write_text(json.dumps({"columns": list(COLUMNS), "rows": rows, "tasks": {**info, "folder": tasks.folder},
                                     "details": details}, indent=2, default=str) + "\n")
    print(markdown(rows, info))
    print(f"wrote {output} and {json_path}")
    return output
