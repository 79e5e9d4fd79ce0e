"""The study tool (fbt_megatron.studies): subsets of a real corpus, a 2-cell grid of real 4-step runs
through the training entry point, reuse of finished runs, and tables equal to what the runs logged."""

import json
import shutil
from pathlib import Path

import numpy
import pytest
import yaml
from megatron.core.datasets.indexed_dataset import IndexedDataset

from fbt_megatron.data.corpus import load_corpus
from fbt_megatron.data.tokenizer import load_tokenizer
from fbt_megatron.studies import study as studies
from fbt_megatron.studies.grid import load_study
from fbt_megatron.studies.subsets import choose_documents, prepare_subset


def docs(path):
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines()]


def test_choose_documents_fills_up_to_the_target_with_whole_documents():
    lengths = [50, 30, 20, 10, 5]
    chosen = choose_documents(lengths, 60, order_seed=0)
    assert chosen == sorted(chosen) and sum(lengths[i] for i in chosen) <= 60
    left = [n for i, n in enumerate(lengths) if i not in chosen]
    assert all(sum(lengths[i] for i in chosen) + n > 60 for n in left)  # nothing else fits
    assert choose_documents(lengths, 4) == []


def test_subset_keeps_documents_whole_and_uses_the_corpus_tokenizer(small_corpus, tmp_path):
    folder = Path(small_corpus.train_prefix).parent
    subset = prepare_subset(str(folder), str(tmp_path / "sub"), 20_000)
    source = {d["name"]: d["text"] for d in docs(folder / "docs.train.jsonl")}
    chosen = docs(tmp_path / "sub" / "docs.train.jsonl")
    assert 1 <= len(chosen) < len(source)
    assert all(source[d["name"]] == d["text"] for d in chosen)  # whole documents of the train split
    manifest = json.loads((tmp_path / "sub" / "corpus.json").read_text())
    assert manifest["subset"]["documents"] == [d["name"] for d in chosen]
    # token counts: each document tokenized by the corpus's tokenizer, EOD after it
    tokenizer = load_tokenizer(small_corpus.tokenizer_path)
    expected = [tokenizer.tokenize(d["text"]) + [tokenizer.eod] for d in chosen]
    written = IndexedDataset(subset.train_prefix)
    assert [written[i].tolist() for i in range(len(written))] == expected
    assert subset.tokens["train"] == sum(map(len, expected)) <= 20_000
    assert subset.documents["train"] == len(chosen)
    # the same tokens as those documents in the corpus's own tokenized train split
    whole = IndexedDataset(small_corpus.train_prefix)
    order = [d["name"] for d in docs(folder / "docs.train.jsonl")]
    assert all(numpy.array_equal(whole[order.index(d["name"])], written[i]) for i, d in enumerate(chosen))
    # nothing else fits: every document left out would pass the target
    left = [len(tokenizer.tokenize(t)) + 1 for n, t in source.items() if n not in {d["name"] for d in chosen}]
    assert all(subset.tokens["train"] + n > 20_000 for n in left)
    # validation is the corpus's own split, byte for byte
    for ext in (".bin", ".idx"):
        assert Path(subset.valid_prefix + ext).read_bytes() == Path(small_corpus.valid_prefix + ext).read_bytes()
    assert prepare_subset(str(folder), str(tmp_path / "sub"), 20_000) == subset  # reused
    with pytest.raises(ValueError, match="holds something else"):
        prepare_subset(str(folder), str(tmp_path / "sub"), 10_000)


def write_study(path: Path, source: str, corpus: Path) -> Path:
    study = {
        "name": "mini",
        "corpus": {"source": source, "path": str(corpus), "vocab_size": 512, "valid_fraction": 0.1},
        "data": {"sub": {"subset_tokens": 20_000}},
        "models": {"baseline": {"recipe": "recipes/tiny_cpu_baseline.yaml"},
                   "fbt_k2": {"recipe": "recipes/tiny_cpu.yaml", "flags": {"passes": 2, "pass-phases": None}}},
        "flags": {"eval-iters": 1, "log-interval": 1, "tensorboard": False, "fused-prefill-passes": 1},
        "validations": 2,
        "grids": {"two": {"seeds": [5], "cells": [{"data": ["sub"], "models": ["baseline", "fbt_k2"], "steps": [4]}]}},
    }
    path.write_text(yaml.safe_dump(study))
    return path


@pytest.fixture(scope="module")
def grid(small_corpus, tmp_path_factory):
    """A 2-cell grid (baseline, FBT k = 2) of 4-step runs on a subset, run through the entry point."""
    tmp = tmp_path_factory.mktemp("study")
    corpus = tmp / "corpus"
    shutil.copytree(Path(small_corpus.train_prefix).parent, corpus)
    study = load_study(write_study(tmp / "mini.yaml", small_corpus.source, corpus))
    runner = studies.run(study, "two", tmp / "root", jobs=2, cpus=2, nice=0, show=False)
    assert runner.failed == [] and runner.reused == 0
    return study, tmp


def test_a_grid_runs_through_the_entry_point_and_is_reused(grid):
    study, tmp = grid
    runs = studies.runs_of(study, "two", tmp / "root")
    assert [(r.model, r.steps, r.seed) for r in runs] == [("baseline", 4, 5), ("fbt_k2", 4, 5)]
    for r in runs:
        log = (r.folder / "train.log").read_text()
        assert "-m fbt_megatron.train" in log and f"--data-path {tmp / 'root' / 'data' / 'mini-sub'}" in log
        assert "trained to step 4" in log
    logs = {r.folder: (r.folder / "train.log").stat().st_mtime_ns for r in runs}
    again = studies.run(study, "two", tmp / "root", jobs=2, cpus=2, nice=0, show=False)
    assert again.failed == [] and again.reused == 2
    assert logs == {r.folder: (r.folder / "train.log").stat().st_mtime_ns for r in runs}  # nothing ran
    # a folder made by another command is never taken over
    other = load_study(write_study(tmp / "other.yaml", study.corpus["source"], tmp / "corpus"))
    other.flags["eval-iters"] = 2
    failed = studies.run(other, "two", tmp / "root", jobs=2, cpus=2, nice=0, show=False).failed
    assert len(failed) == 2 and all("holds a run of another command" in message for _, message in failed)


def test_the_table_equals_the_logged_values(grid):
    study, tmp = grid
    results = studies.report(study, "two", tmp / "root", tmp / "report")
    runs = studies.runs_of(study, "two", tmp / "root")
    table = (tmp / "report" / "table.md").read_text()
    assert (tmp / "report" / "results.png").stat().st_size > 0
    for run, row in zip(runs, results["runs"]):
        logged = [json.loads(line) for line in (run.folder / "metrics.jsonl").read_text().splitlines()]
        evals = [r for r in logged if "valid_loss_fused0" in r]
        assert [r["step"] for r in evals] == [2, 4]
        final = [evals[-1][f"valid_loss_fused{j}"] for j in range(2 if run.model == "fbt_k2" else 1)]
        assert row["valid"] == final
        assert row["best_valid"] == min(r["valid_loss_fused0"] for r in evals)
        assert (row["tokens"], row["compute_tokens"]) == (logged[-1]["tokens"], logged[-1]["compute_tokens"])
        assert row["compute_tokens"] == (2 if run.model == "fbt_k2" else 1) * row["tokens"] and row["tokens"] == 4 * 16 * 128
        line = next(line for line in table.splitlines() if f"| {run.model} |" in line)
        assert all(f"{v:.4f}" in line for v in final)
    csv_lines = (tmp / "report" / "runs.csv").read_text().splitlines()
    assert len(csv_lines) == 3 and csv_lines[0].startswith("data,model,length,seed")
