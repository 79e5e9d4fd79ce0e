"""Evaluate trained models with lm-eval on the local tasks, in every decode mode, into one table.

    python tools/eval.py runs/demo/lm/baseline-800 runs/demo/lm/FBT-800 --output runs/demo/eval.md
    python tools/eval.py EXPORT_DIR --modes standard soft 'fused(2)' --limit 20

A MODEL is a run folder (exported first with ``python -m fbt_megatron.convert to-hf`` into
``--cache``, default ``<output's folder>/exports/<name>-iter<N>``, reused while the run's latest
checkpoint is the same) or a Hugging Face export folder. Every model is evaluated by lm-eval
(``fbt_megatron.evaluation``: the ``fbt`` model, offline) on the local tasks built from held-out
standard-library text (``--tasks-dir``, built on first use):

  fbt_stdlib_perplexity   word_perplexity and bits_per_byte (lower is better)
  fbt_stdlib_next_line    acc and acc_norm over 4 candidate next lines (higher is better; chance 0.25)

in the modes ``--modes`` (default: standard, soft, fused(1), fused(2), fused(3)); a model without
latent feedback (a baseline) only in standard. One table, rows model × mode, goes to ``--output``
(markdown) and the same numbers with the details to the ``.json`` beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from fbt_megatron.cli import quiet_library_warnings, run_cli  # noqa: E402
from fbt_megatron.evaluation.local_tasks import DEFAULT_TASKS_FOLDER  # noqa: E402

DEFAULT_MODES = ("standard", "soft", "fused(1)", "fused(2)", "fused(3)")
COLUMNS = ("word_perplexity", "bits_per_byte", "acc", "acc_norm")
HEADERS = {"word_perplexity": "word perplexity ↓", "bits_per_byte": "bits per byte ↓",
           "acc": "next line acc ↑", "acc_norm": "next line acc_norm ↑"}


@dataclass
class Model:
    label: str  # the row's name
    source: str  # what was given: a run folder or an export
    export: str  # the Hugging Face export evaluated
    run_iteration: Optional[int] = None  # the run's checkpoint, when exported from a run
    latent_feedback: bool = True


def is_run_folder(path: Path) -> bool:
    from fbt_megatron.checkpointing import latest_iteration

    return path.is_dir() and latest_iteration(str(path)) is not None


def resolve(models: List[str]) -> List[tuple]:
    """[(label, path, kind)] with kind "export" or "run"; an error line for anything else."""
    from fbt_megatron.evaluation.harness import read_export_config

    out = []
    for m in models:
        path = Path(m)
        if not path.exists():
            raise FileNotFoundError(f"{m}: no such run folder or export")
        if (path / "config.json").is_file():
            read_export_config(str(path))  # an FBT export, or a clear error
            out.append((path.name, path, "export"))
        elif is_run_folder(path):
            out.append((path.name, path, "run"))
        else:
            raise ValueError(f"{m}: neither a run folder (no checkpoint iter_*) nor a Hugging Face export (no config.json)")
    labels = [label for label, _, _ in out]
    return [(label if labels.count(label) == 1 else f"{p.parent.name}/{p.name}", p, kind) for label, p, kind in out]


def export_run(run: Path, cache: Path, label: str, log: Path) -> tuple:
    """(export folder, iteration): the run's latest checkpoint exported into ``cache`` with the
    project's converter (reused when it was exported after the checkpoint was written)."""
    from fbt_megatron.checkpointing import checkpoint_dir, latest_iteration

    iteration = latest_iteration(str(run))
    checkpoint = checkpoint_dir(str(run), iteration)
    target = cache / f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', label)}-iter{iteration}"
    if (target / "config.json").is_file() and (target / "config.json").stat().st_mtime >= checkpoint.stat().st_mtime:
        tqdm.write(f"[{label}] iteration {iteration}: exported before, {target}")
        return target, iteration  # exported after the checkpoint was written
    tqdm.write(f"[{label}] iteration {iteration}: exporting {run} → {target}")
    shutil.rmtree(target, ignore_errors=True)
    tmp = cache / f".{target.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    cache.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "fbt_megatron.convert", "to-hf", "--load", str(run), "--output", str(tmp),
           "--ckpt-step", str(iteration)]
    with open(log, "a") as out:
        out.write("$ " + " ".join(cmd[1:]) + "\n")
        out.flush()
        code = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT).returncode
    if code or not (tmp / "config.json").is_file():
        shutil.rmtree(tmp, ignore_errors=True)
        lines = log.read_text().splitlines()
        if code == 2 and lines and lines[-1].startswith("error: "):  # the converter's one line: bad input
            raise ValueError(f"exporting {run}: {lines[-1][len('error: '):]}")
        tail = "\n".join(lines[-10:])
        raise RuntimeError(f"exporting {run} failed (exit {code}); the end of {log}:\n{tail}")
    os.replace(tmp, target)
    return target, iteration


def fmt(column: str, value: Optional[float]) -> str:
    if value is None:
        return "–"
    if column == "word_perplexity":
        return f"{value:,.2f}" if value < 1e4 else f"{value:.3e}"
    return f"{value:.4f}" if column == "bits_per_byte" else f"{value:.3f}"


def markdown(rows: List[dict], info: dict) -> str:
    head = ["model", "mode", *(HEADERS[c] for c in COLUMNS)]
    lines = ["# lm-eval on held-out standard-library text", "",
             f"Tasks: `fbt_stdlib_perplexity` ({info['documents']} documents) and `fbt_stdlib_next_line` "
             f"({info['questions']} items, 4 choices, chance 0.25), from {info['source']}"
             + (f"; `--limit {info['limit']}` items per task" if info["limit"] else "") + ".",
             "Modes: standard = the plain model; soft = generated positions fed the previous position's state; "
             "fused(n) = n fused passes over the prompt, then soft. A baseline (no latent feedback) has standard only.",
             "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join([r["model"], r["mode"], *(fmt(c, r[c]) for c in COLUMNS)]) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__.split("\n", 2)[2],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+", metavar="MODEL", help="run folders or Hugging Face export folders")
    parser.add_argument("--output", default="results.md", help="the markdown table (default results.md); .json beside it")
    parser.add_argument("--modes", nargs="+", default=list(DEFAULT_MODES),
                        help="decode modes: standard, soft, fused(N) (default: %(default)s)")
    parser.add_argument("--limit", type=int, default=None, help="evaluate only the first N items of each task")
    parser.add_argument("--tasks-dir", default=str(DEFAULT_TASKS_FOLDER),
                        help="the local tasks' folder, built there on first use (default data/lm-eval-tasks)")
    parser.add_argument("--documents", type=int, default=40, help="perplexity documents when building the tasks")
    parser.add_argument("--questions", type=int, default=100, help="next-line items when building the tasks")
    parser.add_argument("--cache", default=None, help="where run folders are exported (default <output folder>/exports)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    parser.add_argument("--backend", choices=("hf", "vllm"), default="hf",
                        help="hf: transformers (lm-eval's fbt model); vllm: a vLLM engine (fbt-vllm; pip install -r "
                             "requirements-serve.txt, docs/serving.md)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default on CPU: 1, fastest for the tiny models' many small decoding steps)")
    args = parser.parse_args(argv)

    from fbt_megatron.evaluation.modes import mode_label, parse_mode

    modes = [mode_label(*parse_mode(m)) for m in args.modes]  # an unknown mode stops here
    modes = list(dict.fromkeys(modes))
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit must be positive (got {args.limit})")
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be positive (got {args.batch_size})")
    models = resolve(args.models)
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    cache = Path(args.cache) if args.cache else output.parent / "exports"
    quiet_library_warnings()
    import torch

    if args.threads or not torch.cuda.is_available():
        torch.set_num_threads(args.threads or 1)
    from fbt_megatron.evaluation.harness import ExportEvaluator, read_export_config, table_row
    from fbt_megatron.evaluation.local_tasks import ensure_tasks

    tasks = ensure_tasks(args.tasks_dir, args.documents, args.questions)
    source = json.loads((Path(tasks.folder) / "tasks.json").read_text())["source"]

    resolved: List[Model] = []
    for label, path, kind in models:
        if kind == "run":
            export, iteration = export_run(path, cache, label, output.parent / f"{output.stem}.export.log")
        else:
            export, iteration = path, None
        latent = bool(read_export_config(str(export)).get("latent_feedback", False))
        resolved.append(Model(label, str(path), str(export), iteration, latent))

    plan = [(m, mode) for m in resolved for mode in (modes if m.latent_feedback else ["standard"])]
    rows, details = [], []
    bar = tqdm(total=len(plan), desc="evaluations", unit="eval")
    for m in resolved:
        evaluator = None
        for model, mode in plan:
            if model is not m:
                continue
            bar.set_description_str(f"{m.label} {mode}")
            evaluator = evaluator or ExportEvaluator(m.export, batch_size=args.batch_size, device=args.device,
                                                          backend=args.backend)
            start = time.perf_counter()
            results = evaluator.evaluate(mode, tasks, limit=args.limit)
            row = {"model": m.label, "mode": mode, **table_row(results)}
            rows.append(row)
            details.append({**row, "source": m.source, "export": m.export, "iteration": m.run_iteration, "backend": args.backend,
                            "seconds": round(time.perf_counter() - start, 2), "results": results})
            bar.update(1)
        del evaluator
    bar.close()
    info = {"documents": tasks.documents, "questions": tasks.questions, "source": source, "limit": args.limit}
    output.write_text(markdown(rows, info))
    json_path = output.with_suffix(".json")
    json_path.write_text(json.dumps({"columns": list(COLUMNS), "rows": rows, "tasks": {**info, "folder": tasks.folder},
                                     "details": details}, indent=2, default=str) + "\n")
    print(markdown(rows, info))
    print(f"wrote {output} and {json_path}")
    return 0


if __name__ == "__main__":
    run_cli(main)
