"""A user's own text, end to end, through the real entry points (issue 20, items 4 and 5):
``tools/prepare_corpus.py`` on a text file (split into documents at blank lines) and on a folder of
two files (degenerate splits, one warning line each) → a few-step ``fbt_megatron.train`` run on the
text file's corpus → ``python -m fbt_megatron.evaluation table`` on the run's own held-out split
besides the stdlib tasks; the generated task YAMLs load in lm-eval without a warning, and
``lm-eval --model hf`` through ``python -m fbt_megatron.evaluation lm-eval`` says one line about
contexts longer than the model.
The same run checks the stop summary (the step reached, not the last logged one), the removal of
an aborted save's ``.tmp`` folder, the one-line refusal of a resume with another model, and a
recipe's YAML syntax error with its line and column."""

import ast
import contextlib
import io
import json
import logging
import math
import sysconfig
from pathlib import Path

import pytest
from forked import run_commands

from fbt_megatron.common.cli import run_cli
from fbt_megatron.evaluation.local_tasks import NEXT_LINE, PERPLEXITY, SPLIT_PERPLEXITY
from fbt_megatron.trainer import checkpointing
from fbt_megatron.trainer.callbacks.metrics_writer import read_metrics

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "recipes" / "tiny_cpu.yaml")
# 5 steps (stopped by --exit-interval) of 6, logged at step 4 (validated at 6 only): the summary must say 5
TRAIN = ["--recipe", TINY, "--seq-length", "64", "--micro-batch-size", "4", "--global-batch-size", "4",
         "--lr-warmup-iters", "1", "--threads", "1", "--tensorboard", "false", "--eval-iters", "1", "--eval-interval", "6",
         "--train-iters", "6", "--log-interval", "4", "--corpus", "null"]

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


def paragraphs(count: int) -> list:
    """Prose: paragraphs of the standard library's module docstrings (the same wherever this Python is)."""
    out = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        try:
            doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        out += [p.strip() for p in (doc or "").split("\n\n") if len(p.strip()) > 60]
        if len(out) >= count:
            break
    return out[:count]


def in_process(module, *args) -> tuple:
    """(exit code, stdout, stderr) of a tools/ script's ``main`` as its ``__main__`` runs it (``cli.run_cli``)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exit_:
        run_cli(lambda: module.main(list(map(str, args))))
    return exit_.value.code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def own(tmp_path_factory):
    """The corpora, the run and the refused commands, and the run's evaluation."""
    import prepare_corpus

    from fbt_megatron.evaluation import __main__ as evaluation

    tmp = tmp_path_factory.mktemp("own")
    text = paragraphs(160)
    (tmp / "notes.txt").write_text("\n\n".join(text) + "\n", encoding="utf-8")
    two = tmp / "two"
    two.mkdir()
    (two / "a.txt").write_text("\n\n".join(text[:60]) + "\n", encoding="utf-8")  # to valid (its name's hash), 3× b.txt
    (two / "b.txt").write_text("\n\n".join(text[60:80]) + "\n", encoding="utf-8")
    prepared = {name: in_process(prepare_corpus, "--source", source, "--output", tmp / f"{name}-corpus", "--vocab-size", 384,
                                 "--valid-fraction", 0.1, "--workers", 1)
                for name, source in (("notes", tmp / "notes.txt"), ("two", two))}

    run = tmp / "run"
    (run / "iter_0000002.tmp").mkdir(parents=True)  # an aborted save's folder
    (run / "iter_0000002.tmp" / "__0_0.distcp").write_bytes(b"half")
    (tmp / "bad.yaml").write_text("model:\n  preset: tiny\n  num_layers: [2, 3\ndata:\n  seq_length: 64\n")
    resume = [*TRAIN, "--data-path", tmp / "notes-corpus", "--load", run, "--save", tmp / "resumed"]
    commands = {
        "train": [*TRAIN, "--data-path", tmp / "notes-corpus", "--save", run, "--exit-interval", "5"],
        "shape": [*resume, "--num-layers", "2"],
        "behaviour": [*resume, "--feedback-jitter", "0.05"],
        "yaml": ["--recipe", tmp / "bad.yaml"],
    }
    codes = run_commands("fbt_megatron.train", [(args, tmp / f"{name}.log", None) for name, args in commands.items()])
    logs = {name: (tmp / f"{name}.log").read_text() for name in commands}
    assert codes[0] == 0, logs["train"][-3000:]

    evaluated = in_process(evaluation, "table", run, "--output", tmp / "eval" / "table.md", "--modes", "standard", "--limit", 3,
                           "--tasks-dir", tmp / "tasks", "--documents", 4, "--questions", 6)
    return {"tmp": tmp, "prepared": prepared, "codes": dict(zip(commands, codes)), "logs": logs, "run": run,
            "eval": evaluated}


def test_a_text_file_is_split_into_documents_at_blank_lines(own):
    code, out, err = own["prepared"]["notes"]
    assert code == 0, err[-3000:]
    assert "warning" not in out, out
    corpus = own["tmp"] / "notes-corpus"
    settings = json.loads((corpus / "corpus.json").read_text())["settings"]
    assert settings["split_documents"] == "blank-line"  # the default for a text file
    docs = [json.loads(line) for split in ("train", "valid") for line in (corpus / f"docs.{split}.jsonl").open()]
    text = (own["tmp"] / "notes.txt").read_text()
    assert sorted(d["text"] for d in docs) == sorted(p for p in text.strip().split("\n\n"))  # every paragraph, exactly
    assert all(d["name"].startswith("notes.txt:") for d in docs)
    valid = sum(1 for _ in (corpus / "docs.valid.jsonl").open())
    assert f"valid: {valid} document{'s' * (valid != 1)}," in out and f"train: {len(docs) - valid} documents," in out


def test_degenerate_splits_are_one_warning_line_each(own):
    code, out, err = own["prepared"]["two"]
    assert code == 0, err[-3000:]
    warnings = [line for line in out.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 3, out
    assert warnings[0] == ("warning: the train split is 1 document (b.txt): split the files into more documents "
                           "(--split-documents blank-line or line) or add text")
    assert warnings[1].startswith("warning: the valid split (") and "is larger than the train split" in warnings[1]
    assert warnings[2].startswith("warning: 100% of the valid split comes from a.txt, which has no training document")
    assert "train: 1 document," in out and "valid: 1 document," in out  # not "1 documents"


def test_the_stop_summary_says_the_step_reached_and_a_stale_tmp_is_removed(own):
    log, run = own["logs"]["train"], own["run"]
    assert [r["step"] for r in read_metrics(run)] == [4]  # logged at 4 only; stopped by --exit-interval 5
    assert "trained to step 5: 1,280 tokens" in log and "trained to step 4" not in log, log[-2000:]
    assert f"removed iter_0000002.tmp from {run}: unfinished checkpoint of an aborted save" in log
    assert checkpointing.iterations(run) == [5] and not (run / "iter_0000002.tmp").exists()
    assert not checkpointing.damage(checkpointing.checkpoint_dir(run, 5), collective=False)


@pytest.mark.parametrize("name,message", [
    ("shape", "the checkpoint in {run} is of another model: num_layers 4 → 2 (checkpoint → this run); a resumed run "
              "continues the same model: restore them to resume it; weights of another shape cannot be loaded, so to "
              "train this model start from scratch with another --save and --load"),
    ("behaviour", "the checkpoint in {run} is of another model: feedback_jitter 0.02 → 0.05 (checkpoint → this run); a "
                  "resumed run continues the same model: restore them to resume it, or add --finetune to start a new run "
                  "from its weights (or give --pretrained-checkpoint {run} with another --save and --load)"),
    ("yaml", "{tmp}/bad.yaml:4:5: not valid YAML: expected ',' or ']', but got ':' (while parsing a flow sequence from "
             "line 3, column 15); fix the recipe file there"),
])
def test_a_changed_model_on_resume_and_a_yaml_error_are_one_line(own, name, message):
    log = own["logs"][name]
    assert own["codes"][name] == 2 and "Traceback" not in log, log[-2000:]
    assert log.strip().splitlines() == ["error: " + message.format(run=own["run"], tmp=own["tmp"])]
    assert not (own["tmp"] / "resumed").exists()


def test_eval_measures_the_runs_own_held_out_split(own):
    code, out, err = own["eval"]
    assert code == 0, (out + err)[-3000:]
    run, corpus = own["run"], own["tmp"] / "notes-corpus"
    assert (f"warning: run was trained on {corpus}, not the standard library: the fbt_stdlib_* columns measure other "
            f"text; its own held-out split is the 'own split' columns") in out
    table = own["tmp"] / "eval" / "table.md"
    header = [line for line in table.read_text().splitlines() if line.startswith("| model")]
    assert header == ["| model | mode | word perplexity ↓ | bits per byte ↓ | next line acc ↑ | next line acc_norm ↑ "
                      "| own split word perplexity ↓ | own split bits per byte ↓ |"]
    data = json.loads(table.with_suffix(".json").read_text())
    (row,) = data["rows"]
    assert all(math.isfinite(row[c]) for c in data["columns"]), row
    assert row["split_bits_per_byte"] != row["bits_per_byte"]
    # the split task is the corpus's held-out documents, cut into pieces
    (folder,) = (own["tmp"] / "eval" / "split-tasks").iterdir()
    held_out = {json.loads(line)["name"] for line in (corpus / "docs.valid.jsonl").open()}
    pieces = [json.loads(line) for line in (folder / "perplexity.jsonl").open()]
    assert pieces and {p["name"].split("#")[0] for p in pieces} <= held_out
    assert json.loads((folder / "tasks.json").read_text())["source"] == f"{corpus}/docs.valid.jsonl"
    # another corpus's held-out split: prepared with another tokenizer than the run's
    from fbt_megatron.evaluation.models import Model
    from fbt_megatron.evaluation.own_split import corpus_checks

    model = Model("run", str(run), data["details"][0]["export"], 5)
    chosen, warnings = corpus_checks(model, own["tmp"] / "two-corpus", given=True)
    assert chosen == own["tmp"] / "two-corpus" and warnings[-1] == (
        f"warning: --corpus {own['tmp'] / 'two-corpus'} was prepared with another tokenizer than run's: the model was not "
        f"trained on it (its 'own split' columns measure other text)")


def test_generated_tasks_load_without_warnings_and_truncation_is_one_line(own, tmp_path, monkeypatch):
    """lm-eval's task loading warns of no metric without aggregation / higher_is_better; its ``hf``
    model, through ``python -m fbt_megatron.evaluation lm-eval``, says once that it cuts contexts
    longer than the model (64 tokens: most next-line contexts)."""
    from lm_eval.tasks import TaskManager, get_task_dict

    from fbt_megatron.evaluation.__main__ import main

    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logger = logging.getLogger("lm_eval")
    level = logger.level
    logger.addHandler(handler)
    try:
        logger.setLevel(logging.WARNING)
        (split_folder,) = (own["tmp"] / "eval" / "split-tasks").iterdir()
        for folder, names in ((own["tmp"] / "tasks", [PERPLEXITY, NEXT_LINE]), (split_folder, [SPLIT_PERPLEXITY])):
            tasks = get_task_dict(names, TaskManager(include_path=str(folder), include_defaults=False))
            assert sorted(tasks) == sorted(names)
        assert [r.getMessage() for r in records] == []

        export = json.loads((own["tmp"] / "eval" / "table.json").read_text())["details"][0]["export"]
        monkeypatch.chdir(tmp_path)
        assert main(["lm-eval", "run", "--model", "hf", "--model_args", f"pretrained={export},trust_remote_code=True",
                     "--tasks", NEXT_LINE, "--include_path", str(own["tmp"] / "tasks"), "--batch_size", "4",
                     "--limit", "6", "--device", "cpu", "--output_path", str(tmp_path / "out")]) == 0
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    truncations = [r.getMessage() for r in records if "tokens from the left" in r.getMessage()]
    assert len(truncations) == 1 and truncations[0].endswith("later truncations are not reported)"), truncations
