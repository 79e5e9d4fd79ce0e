r"""Evaluation entry points.

    python -m fbt_megatron.evaluation table MODEL... [--modes standard soft 'fused(2)'] [--output eval.md]
        every MODEL (a run folder, exported first into --cache, or a Hugging Face export) in every
        decode mode on the local tasks and its own held-out split: one markdown table + its .json
        (fbt_megatron.evaluation.table)
    python -m fbt_megatron.evaluation tasks --output DIR [--documents 40] [--questions 100]
        build the local lm-eval tasks (held-out standard-library text) into DIR
    python -m fbt_megatron.evaluation lm-eval <lm-eval arguments>
        lm-eval's own CLI, offline, with the ``fbt`` model registered:
        python -m fbt_megatron.evaluation lm-eval run --model fbt \
            --model_args pretrained=EXPORT,decode_mode=fused,fused_prefill_passes=2 --tasks fbt_stdlib_perplexity
        The local tasks (fbt_stdlib_*) are built on first use into data/lm-eval-tasks and added to
        --include_path when none is given. ``--backend vllm`` scores with a vLLM engine instead of
        transformers (``--model fbt`` becomes ``fbt-vllm``; docs/serving.md).
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from fbt_megatron.common.cli import plural, run_cli
from fbt_megatron.common.logs import setup_logging
from fbt_megatron.evaluation import table
from fbt_megatron.evaluation.local_tasks import DEFAULT_TASKS_FOLDER, TASKS, build_tasks, ensure_tasks

TABLE_EPILOG = """\
    python -m fbt_megatron.evaluation table runs/demo/lm/baseline-800 runs/demo/lm/FBT-800 \\
        --output runs/demo/eval.md
    python -m fbt_megatron.evaluation table EXPORT_DIR --modes standard soft 'fused(2)' --limit 20
    python -m fbt_megatron.evaluation table runs/mine --corpus data/mine --modes standard

A MODEL is a run folder (its latest checkpoint exported first with ``python -m fbt_megatron.convert
to-hf`` into --cache, reused while that checkpoint is the same) or a Hugging Face export folder.
The tasks (lm-eval's ``fbt`` model, offline):

  fbt_stdlib_perplexity   word_perplexity and bits_per_byte (lower is better)
  fbt_stdlib_next_line    acc and acc_norm over 4 candidate next lines (higher is better; chance 0.25)
  fbt_split_perplexity    word_perplexity and bits_per_byte over the docs.valid.jsonl of the corpus a
                          run was trained on (its recipe's data path) or of --corpus

A model without latent feedback (a baseline) is evaluated in standard only. A model trained on
another corpus than the standard library gets one warning line that the stdlib tasks measure other
text; a --corpus prepared with another tokenizer than the model's, one that it was not trained on it.
"""


def _tasks_parser(sub) -> None:
    p = sub.add_parser("tasks", help="build the local lm-eval tasks", description=build_tasks.__doc__)
    p.add_argument("--output", required=True, help="folder to write the tasks to (lm-eval's --include_path)")
    p.add_argument("--documents", type=int, default=40, help="perplexity documents (default 40)")
    p.add_argument("--questions", type=int, default=100, help="multiple-choice items (default 100)")
    p.add_argument("--max-chars", type=int, default=1200, help="characters per perplexity document at most (default 1200)")
    p.add_argument("--corpus", default=None,
                   help="a prepared corpus folder whose docs.valid.jsonl to use (default data/stdlib-sp2048 when "
                        "prepared, else the standard library's valid split)")


def _table_parser(sub) -> None:
    p = sub.add_parser("table", help="evaluate models in every decode mode into one table",
                       description=table.__doc__,
                       epilog=TABLE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("models", nargs="+", metavar="MODEL", help="run folders or Hugging Face export folders")
    p.add_argument("--output", default="results.md", help="the markdown table (default results.md); .json beside it")
    p.add_argument("--modes", nargs="+", default=list(table.DEFAULT_MODES),
                   help="decode modes: standard, soft, fused(N) (default: %(default)s)")
    p.add_argument("--limit", type=int, default=None, help="evaluate only the first N items of each task")
    p.add_argument("--tasks-dir", default=str(DEFAULT_TASKS_FOLDER),
                   help="the local tasks' folder, built there on first use (default data/lm-eval-tasks)")
    p.add_argument("--documents", type=int, default=40, help="perplexity documents when building the tasks")
    p.add_argument("--questions", type=int, default=100, help="next-line items when building the tasks")
    p.add_argument("--corpus", default=None,
                   help="a prepared corpus folder whose held-out split every model is evaluated on (default: a "
                        "run's own training corpus; an export has none)")
    p.add_argument("--cache", default=None, help="where run folders are exported (default <output folder>/exports)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    p.add_argument("--backend", choices=("hf", "vllm"), default="hf",
                   help="hf: transformers (lm-eval's fbt model); vllm: a vLLM engine (fbt-vllm; pip install -r "
                        "requirements-serve.txt, docs/serving.md)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default on CPU: 1, fastest for the tiny models' many small decoding steps)")


def _option(args: List[str], name: str) -> Optional[str]:
    """The value of ``--name X`` or ``--name=X`` in ``args``."""
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


def _backend(args: List[str]) -> tuple:
    """(lm-eval's arguments, backend): ``--backend hf|vllm`` taken out; with vllm, ``--model fbt``
    (or none) becomes ``--model fbt-vllm``."""
    backend = _option(args, "--backend") or "hf"
    if backend not in ("hf", "vllm"):
        raise ValueError(f"--backend {backend!r}: choose hf or vllm")
    out, skip = [], False
    for i, a in enumerate(args):
        if skip:
            skip = False
        elif a == "--backend":
            skip = True
        elif not a.startswith("--backend="):
            out.append(a)
    if backend == "vllm":
        model = _option(out, "--model")
        if model is None:
            out += ["--model", "fbt-vllm"]
        elif model == "fbt":
            out = [("fbt-vllm" if a == "fbt" and i and out[i - 1] == "--model" else
                    "--model=fbt-vllm" if a == "--model=fbt" else a) for i, a in enumerate(out)]
    return out, backend


def lm_eval_main(args: List[str]) -> int:
    """lm-eval's CLI on ``args`` with the ``fbt`` model registered and the environment offline."""
    from fbt_megatron.evaluation.env import offline_environment
    from fbt_megatron.evaluation.harness import one_truncation_warning

    offline_environment()
    one_truncation_warning()
    args, backend = _backend(args)
    if backend == "vllm":
        from fbt_megatron.inference.serving import require_vllm

        require_vllm("--backend vllm")
        import fbt_megatron.evaluation.vllm_lm  # noqa: F401  (registers --model fbt-vllm)
    else:
        import fbt_megatron.evaluation.lm  # noqa: F401  (registers --model fbt)

    tasks = _option(args, "--tasks") or ""
    if _option(args, "--include_path") is None and any(t in tasks.split(",") for t in TASKS):
        args = [*args, "--include_path", ensure_tasks(str(DEFAULT_TASKS_FOLDER)).folder]
    from lm_eval.__main__ import cli_evaluate

    argv = sys.argv
    sys.argv = ["lm-eval", *args]
    try:
        cli_evaluate()
    finally:
        sys.argv = argv
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    setup_logging()
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "lm-eval":
        return lm_eval_main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m fbt_megatron.evaluation", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="{table,tasks,lm-eval}")
    _table_parser(sub)
    _tasks_parser(sub)
    sub.add_parser("lm-eval", help="lm-eval's CLI with the fbt model registered (arguments passed through)")
    args = parser.parse_args(argv)
    if args.command == "table":
        table.write_table(table.Settings(**{k: v for k, v in vars(args).items() if k != "command"}))
        return 0
    if args.command != "tasks":
        parser.print_help()
        return 2
    built = build_tasks(args.output, args.documents, args.questions, args.max_chars, args.corpus)
    print(f"{built.folder}: {built.names[0]} ({plural(built.documents, 'document')}), "
          f"{built.names[1]} ({plural(built.questions, 'item')}); "
          f"lm-eval ... --include_path {built.folder} --tasks {','.join(built.names)}")
    return 0


if __name__ == "__main__":
    run_cli(main)
