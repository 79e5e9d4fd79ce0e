"""Evaluate trained models with lm-eval on the local tasks, in every decode mode, into one table.

    python tools/eval.py runs/demo/lm/baseline-800 runs/demo/lm/FBT-800 --output runs/demo/eval.md
    python tools/eval.py EXPORT_DIR --modes standard soft 'fused(2)' --limit 20
    python tools/eval.py runs/mine --corpus data/mine --modes standard

A MODEL is a run folder (exported first with ``python -m fbt_megatron.convert to-hf`` into
``--cache``, default ``<output's folder>/exports/<name>-iter<N>``, reused while the run's latest
checkpoint is the same) or a Hugging Face export folder. Every model is evaluated by lm-eval
(``fbt_megatron.evaluation``: the ``fbt`` model, offline) on the local tasks built from held-out
standard-library text (``--tasks-dir``, built on first use) and on its own held-out split:

  fbt_stdlib_perplexity   word_perplexity and bits_per_byte (lower is better)
  fbt_stdlib_next_line    acc and acc_norm over 4 candidate next lines (higher is better; chance 0.25)
  fbt_split_perplexity    word_perplexity and bits_per_byte over the docs.valid.jsonl of the corpus a
                          run was trained on (its recipe's data path) or of --corpus (a prepared
                          corpus folder: for an export, or to choose another), with the model's tokenizer

in the modes ``--modes`` (default: standard, soft, fused(1), fused(2), fused(3)); a model without
latent feedback (a baseline) only in standard. One table, rows model × mode, goes to ``--output``
(markdown) and the same numbers with the details to the ``.json`` beside it. A model trained on
another corpus than the standard library gets one warning line that the stdlib tasks measure other
text; a --corpus prepared with another tokenizer than the model's, one that the model was not
trained on it.
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

from fbt_megatron.common.cli import quiet_library_warnings, run_cli  # noqa: E402
from fbt_megatron.common.logs import setup_logging  # noqa: E402
from fbt_megatron.evaluation.local_tasks import DEFAULT_TASKS_FOLDER  # noqa: E402

DEFAULT_MODES = ("standard", "soft", "fused(1)", "fused(2)", "fused(3)")
COLUMNS = ("word_perplexity", "bits_per_byte", "acc", "acc_norm", "split_word_perplexity", "split_bits_per_byte")
HEADERS = {"word_perplexity": "word perplexity ↓", "bits_per_byte": "bits per byte ↓",
           "acc": "next line acc ↑", "acc_norm": "next line acc_norm ↑",
           "split_word_perplexity": "own split word perplexity ↓", "split_bits_per_byte": "own split bits per byte ↓"}


@dataclass
class Model:
    label: str  # the row's name
    source: str  # what was given: a run folder or an export
    export: str  # the Hugging Face export evaluated
    run_iteration: Optional[int] = None  # the run's checkpoint, when exported from a run
    latent_feedback: bool = True
    corpus: Optional[str] = None  # the prepared corpus whose held-out split is evaluated


def sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


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
    if exported.is_file() and tokenizer.is_file() and sha256(exported) != sha256(tokenizer):
        warnings.append(f"warning: --corpus {chosen} was prepared with another tokenizer than {model.label}'s: the model "
                        f"was not trained on it (its 'own split' columns measure other text)")
    elif given and own is not None and own != chosen:
        warnings.append(f"warning: --corpus {chosen} is not the corpus {model.label} was trained on ({own})")
    return chosen, warnings


def split_tasks(corpus: Path, folder: Path, documents: int):
    """The ``fbt_split_perplexity`` task of ``corpus`` in a folder of its own under ``folder``."""
    import hashlib

    from fbt_megatron.evaluation.local_tasks import ensure_split_task

    name = f"{corpus.name}-{hashlib.sha256(str(corpus).encode()).hexdigest()[:8]}"
    return ensure_split_task(str(folder / name), str(corpus), documents)


def is_run_folder(path: Path) -> bool:
    from fbt_megatron.trainer.checkpointing import latest_iteration

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
    from fbt_megatron.trainer.checkpointing import checkpoint_dir, latest_iteration

    iteration = latest_iteration(str(run))
    checkpoint = checkpoint_dir(str(run), iteration)
    target = cache / f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', label)}-iter{iteration}"
    if (target / "config.json").is_file() and (target / "config.json").stat().st_mtime >= checkpoint.stat().st_mtime:
        tqdm.write(f"[{label}] iteration {iteration}: exported before, {target}")
        return target, iteration  # exported after the checkpoint was written
    tqdm.write(f"[{label}] iteration {iteration}: exporting {run} → {target}")
    shutil.rmtree(target, ignore_errors=True)
    cache.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "fbt_megatron.convert", "to-hf", "--load", str(run.resolve()), "--output", str(target.resolve()),
           "--ckpt-step", str(iteration)]  # the converter writes the folder whole (io.atomic_folder)
    with open(log, "a") as out:
        out.write("$ " + " ".join(cmd[1:]) + "\n")
        out.flush()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        # from here: a run's recipe names its data as given where it was trained
        code = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env).returncode
    if code or not (target / "config.json").is_file():
        shutil.rmtree(target, ignore_errors=True)
        lines = log.read_text().splitlines()
        if code == 2 and lines and lines[-1].startswith("error: "):  # the converter's one line: bad input
            raise ValueError(f"exporting {run}: {lines[-1][len('error: '):]}")
        tail = "\n".join(lines[-10:])
        raise RuntimeError(f"exporting {run} failed (exit {code}); the end of {log}:\n{tail}")
    return target, iteration


def fmt(column: str, value: Optional[float]) -> str:
    if value is None:
        return "–"
    if column.endswith("word_perplexity"):
        return f"{value:,.2f}" if value < 1e4 else f"{value:.3e}"
    return f"{value:.4f}" if column.endswith("bits_per_byte") else f"{value:.3f}"


def markdown(rows: List[dict], info: dict) -> str:
    head = ["model", "mode", *(HEADERS[c] for c in COLUMNS)]
    from fbt_megatron.common.cli import plural

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


def parser() -> argparse.ArgumentParser:
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
    parser.add_argument("--corpus", default=None,
                        help="a prepared corpus folder whose held-out split every model is evaluated on (default: a "
                             "run's own training corpus; an export has none)")
    parser.add_argument("--questions", type=int, default=100, help="next-line items when building the tasks")
    parser.add_argument("--cache", default=None, help="where run folders are exported (default <output folder>/exports)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    parser.add_argument("--backend", choices=("hf", "vllm"), default="hf",
                        help="hf: transformers (lm-eval's fbt model); vllm: a vLLM engine (fbt-vllm; pip install -r "
                             "requirements-serve.txt, docs/serving.md)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default on CPU: 1, fastest for the tiny models' many small decoding steps)")
    return parser


def checked(args) -> tuple:
    """(decode modes, models, the corpus every model is evaluated on or None) from the arguments;
    an unknown mode, a bad number or a missing corpus raises before any work."""
    from fbt_megatron.model.decode_modes import mode_label, parse_mode

    modes = [mode_label(*parse_mode(m)) for m in args.modes]  # an unknown mode stops here
    if args.backend == "vllm":
        from fbt_megatron.inference.serving import require_vllm

        require_vllm("--backend vllm")  # before any export is written
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit must be positive (got {args.limit})")
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be positive (got {args.batch_size})")
    models = resolve(args.models)
    corpus = Path(args.corpus).resolve() if args.corpus else None
    if corpus is not None and not (corpus / "docs.valid.jsonl").is_file():
        raise FileNotFoundError(f"--corpus {args.corpus}: not a prepared corpus folder (no docs.valid.jsonl; "
                                f"tools/prepare_corpus.py makes one)")
    return list(dict.fromkeys(modes)), models, corpus


def exported(models: List[tuple], corpus: Optional[Path], cache: Path, output: Path) -> List[Model]:
    """Each model with its export (a run folder exported into ``cache`` first) and the corpus whose
    held-out split it is also evaluated on; the corpus checks' warnings said."""
    from fbt_megatron.evaluation.harness import read_export_config

    resolved: List[Model] = []
    for label, path, kind in models:
        if kind == "run":
            export, iteration = export_run(path, cache, label, output.parent / f"{output.stem}.export.log")
        else:
            export, iteration = path, None
        latent = bool(read_export_config(str(export)).get("latent_feedback", False))
        model = Model(label, str(path), str(export), iteration, latent)
        model.corpus, warnings = corpus_checks(model, corpus, given=corpus is not None)
        for line in warnings:
            tqdm.write(line)
        resolved.append(model)
    return resolved


def evaluate_all(resolved: List[Model], modes: List[str], tasks, own: dict, args) -> tuple:
    """(table rows, details): every model in every decode mode it has (a baseline: standard only),
    on the local tasks and its own corpus split, one evaluator per model."""
    from fbt_megatron.evaluation.harness import ExportEvaluator, table_row

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
            if m.label in own:
                results.update(evaluator.evaluate(mode, own[m.label], limit=args.limit))
            row = {"model": m.label, "mode": mode, **table_row(results)}
            rows.append(row)
            details.append({**row, "source": m.source, "export": m.export, "iteration": m.run_iteration, "backend": args.backend,
                            "seconds": round(time.perf_counter() - start, 2), "results": results})
            bar.update(1)
        del evaluator
    bar.close()
    return rows, details


def main(argv=None) -> int:
    setup_logging()
    args = parser().parse_args(argv)
    modes, models, corpus = checked(args)
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    cache = (Path(args.cache) if args.cache else output.parent / "exports").resolve()
    quiet_library_warnings()
    import torch

    if args.threads or not torch.cuda.is_available():
        torch.set_num_threads(args.threads or 1)
    from fbt_megatron.evaluation.local_tasks import ensure_tasks

    tasks = ensure_tasks(args.tasks_dir, args.documents, args.questions)
    source = json.loads((Path(tasks.folder) / "tasks.json").read_text())["source"]
    resolved = exported(models, corpus, cache, output)
    own = {m.label: split_tasks(Path(m.corpus), output.parent / "split-tasks", args.documents)
           for m in resolved if m.corpus is not None}
    rows, details = evaluate_all(resolved, modes, tasks, own, args)
    info = {"documents": tasks.documents, "questions": tasks.questions, "source": source, "limit": args.limit,
            "splits": {m.label: (m.corpus, own[m.label].documents) for m in resolved if m.label in own}}
    output.write_text(markdown(rows, info))
    json_path = output.with_suffix(".json")
    json_path.write_text(json.dumps({"columns": list(COLUMNS), "rows": rows, "tasks": {**info, "folder": tasks.folder},
                                     "details": details}, indent=2, default=str) + "\n")
    print(markdown(rows, info))
    print(f"wrote {output} and {json_path}")
    return 0

if __name__ == "__main__":
    run_cli(main)
