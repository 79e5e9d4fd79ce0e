"""The data pipeline: documents → .bin/.idx, GPT datasets, corpus folders (written whole), command-line tools."""

import collections
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy
import pytest
import torch
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

from fbt_megatron.data import corpus as corpus_module
from fbt_megatron.data.corpus import ensure_corpus, load_corpus, prepare_corpus, split_documents
from fbt_megatron.data.datasets import build_datasets
from fbt_megatron.data.documents import iter_documents
from fbt_megatron.data.preprocess import preprocess
from fbt_megatron.data.tokenizer import load_tokenizer
from fbt_megatron.data.tokenizer_training import train_tokenizer

ROOT = Path(__file__).resolve().parents[1]
STDLIB = Path(sysconfig.get_paths()["stdlib"])
SOURCES = [STDLIB / f for f in ("textwrap.py", "shlex.py", "fnmatch.py", "json/decoder.py", "json/encoder.py")]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "sp512.model"
    return load_tokenizer(train_tokenizer([str(p) for p in SOURCES], str(path), 512, show_progress=False))


@pytest.fixture
def text_inputs(tmp_path):
    """A folder of source files (one in a subfolder, a hidden one, CRLF endings) and a JSONL file."""
    folder = tmp_path / "src"
    (folder / "pkg").mkdir(parents=True)
    shutil.copy(SOURCES[0], folder / "a.py")
    shutil.copy(SOURCES[1], folder / "pkg" / "b.py")
    (folder / "c.txt").write_bytes(b"line one\r\n\tline two \xe2\x98\x83\r\n")
    (folder / ".hidden.py").write_text("skipped")
    (folder / "empty.md").write_text("")
    jsonl = tmp_path / "docs.jsonl"
    records = [{"text": "def f():\n    return 1\n"}, {"text": ""}, {"text": "x = 'ü'\n", "id": 7}]
    jsonl.write_text("\n".join(json.dumps(r) for r in records[:2]) + "\n\n" + json.dumps(records[2]) + "\n")
    return [str(folder), str(jsonl)]


def test_documents_keep_text_exactly(text_inputs):
    docs = list(iter_documents(text_inputs))
    assert [d.name for d in docs] == ["a.py", "c.txt", "pkg/b.py", "docs.jsonl:1", "docs.jsonl:4"]
    assert docs[0].text == SOURCES[0].read_text()
    assert docs[1].text == "line one\r\n\tline two ☃\r\n"


@pytest.mark.parametrize("workers", [1, 2])
def test_preprocess_writes_what_megatron_reads(tokenizer, text_inputs, tmp_path, workers):
    prefix = str(tmp_path / "out" / "docs_text_document")
    counts = preprocess(text_inputs, tokenizer.path, prefix, workers=workers, show_progress=False)
    expected = [tokenizer.tokenize(d.text) + [tokenizer.eod] for d in iter_documents(text_inputs)]
    assert counts == {"documents": 5, "tokens": sum(map(len, expected))}
    data = IndexedDataset(prefix)
    assert data.index.dtype == numpy.uint16
    assert len(data) == len(expected)
    for i, ids in enumerate(expected):
        assert data[i].tolist() == ids
    assert sorted(os.listdir(tmp_path / "out")) == ["docs_text_document.bin", "docs_text_document.idx"]


def test_failed_preprocess_keeps_the_existing_output(tokenizer, text_inputs, tmp_path):
    prefix = str(tmp_path / "docs")
    preprocess(text_inputs, tokenizer.path, prefix, show_progress=False)
    before = {ext: Path(prefix + ext).read_bytes() for ext in (".bin", ".idx")}
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": "half\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: malformed JSON line"):
        preprocess([*text_inputs, str(bad)], tokenizer.path, prefix, workers=2, show_progress=False)
    assert {ext: Path(prefix + ext).read_bytes() for ext in (".bin", ".idx")} == before
    assert sorted(p.name for p in tmp_path.glob("docs*")) == ["docs.bin", "docs.idx", "docs.jsonl"]


def write_documents(prefix, documents):
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.uint16)
    for doc in documents:
        builder.add_document(numpy.array(doc), [len(doc)])
    builder.finalize(prefix + ".idx")
    return prefix


def synthetic(prefix, base, eod, n=30):
    """Documents of distinct ids (base + 40·doc + position), each ending with EOD."""
    return write_documents(prefix, [[base + 40 * d + i for i in range(3 + d)] + [eod] for d in range(n)])


def test_gpt_samples_are_windows_of_the_shuffled_document_stream(tokenizer, tmp_path):
    L = 16
    prefix = synthetic(str(tmp_path / "a"), 1000, tokenizer.eod)
    train, valid, test = build_datasets(
        tokenizer, L, 1234, (60, None, None), str(tmp_path / "cache"), blend_per_split=[([prefix], None), None, None]
    )
    assert valid is None and test is None and len(train) >= 60
    docs = IndexedDataset(prefix)
    stream = numpy.concatenate([docs[int(d)] for d in train.document_index])
    for idx in range(len(train)):
        sample, j = train[idx], int(train.shuffle_index[idx])
        assert set(sample) == {"tokens", "labels", "loss_mask", "position_ids"}
        assert sample["tokens"].tolist() == stream[j * L : (j + 1) * L].tolist()
        assert sample["labels"].tolist() == stream[j * L + 1 : (j + 1) * L + 1].tolist()
        assert torch.equal(sample["position_ids"], torch.arange(L))
        assert torch.equal(sample["loss_mask"], torch.ones(L))
    assert any(tokenizer.eod in train[i]["tokens"].tolist() for i in range(len(train)))
    assert len(list((tmp_path / "cache").glob("*GPTDataset-train-shuffle_index.npy"))) == 1


def test_datasets_are_deterministic_given_the_seed(tokenizer, tmp_path):
    prefix = synthetic(str(tmp_path / "a"), 1000, tokenizer.eod)

    def tokens(seed, cache):
        train, _, _ = build_datasets(tokenizer, 16, seed, (40, None, None), str(tmp_path / cache),
                                     blend=([prefix], None), split="1,0,0")
        return [train[i]["tokens"].tolist() for i in range(40)]

    first = tokens(1, "c1")
    assert tokens(1, "c2") == first  # rebuilt from scratch in another cache
    assert tokens(1, "c1") == first  # loaded from the cache
    assert tokens(2, "c1") != first


def test_weighted_blend_draws_in_proportion(tokenizer, tmp_path):
    a = synthetic(str(tmp_path / "a"), 1000, tokenizer.eod)
    b = synthetic(str(tmp_path / "b"), 5000, tokenizer.eod)
    train, _, _ = build_datasets(
        tokenizer, 16, 7, (400, None, None), str(tmp_path / "cache"),
        blend_per_split=[([a, b], [0.75, 0.25]), None, None],
    )
    assert len(train) == 400
    counts = collections.Counter(train.dataset_index.tolist())
    assert abs(counts[0] - 300) <= 2 and abs(counts[1] - 100) <= 2
    for i in range(0, 400, 7):
        sample = train[i]
        ids = [t for t in sample["tokens"].tolist() if t != tokenizer.eod]
        low = 1000 if sample["dataset_id"] == 0 else 5000
        assert all(low <= t < low + 4000 for t in ids)


NO_PROCESS_GROUP = """
import collections, sys, numpy, torch
from fbt_megatron.data.datasets import build_datasets
from fbt_megatron.data.tokenizer import load_tokenizer
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
assert not torch.distributed.is_initialized()
tok, folder = load_tokenizer(sys.argv[1]), sys.argv[2]
for name, base in (("a", 1000), ("b", 5000)):
    builder = IndexedDatasetBuilder(f"{folder}/{name}.bin", dtype=numpy.uint16)
    for d in range(20):
        builder.add_document(numpy.array([base + d] * (5 + d) + [tok.eod]), [6 + d])
    builder.finalize(f"{folder}/{name}.idx")
blend = ([f"{folder}/a", f"{folder}/b"], [0.5, 0.5])
train, _, _ = build_datasets(tok, 8, 1, (50, None, None), folder + "/cache", blend_per_split=[blend, None, None])
print(sorted(collections.Counter(train.dataset_index.tolist()).values()), train[0]["tokens"].shape[0])
"""


def start(*args):
    return subprocess.Popen([sys.executable, *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def test_blend_builds_without_a_process_group(tokenizer, tmp_path):
    run = start("-W", "ignore", "-c", NO_PROCESS_GROUP, tokenizer.path, str(tmp_path))
    out, err = run.communicate(timeout=120)
    assert run.returncode == 0, err
    assert out.split("\n")[0] == "[25, 25] 8"


@pytest.fixture(scope="module")
def stdlib20(tmp_path_factory):
    """20 small standard-library modules in a folder."""
    folder = tmp_path_factory.mktemp("stdlib20")
    files = [p for p in sorted(STDLIB.glob("*.py")) if 2_000 < p.stat().st_size < 20_000][:20]
    for p in files:
        shutil.copy(p, folder / p.name)
    return folder


@pytest.fixture(scope="module")
def corpus20(stdlib20, tmp_path_factory):
    out = tmp_path_factory.mktemp("corpora") / "small"
    return prepare_corpus(str(stdlib20), str(out), vocab_size=512, valid_fraction=0.2, show_progress=False), out


def names(path):
    return [json.loads(line)["name"] for line in Path(path).read_text().splitlines()]


def test_corpus_splits_by_document_deterministically(stdlib20, corpus20, tmp_path):
    corpus, out = corpus20
    train, valid = names(out / "docs.train.jsonl"), names(out / "docs.valid.jsonl")
    everything = sorted(p.name for p in stdlib20.iterdir())
    assert not set(train) & set(valid) and sorted(train + valid) == everything
    assert valid == [n for n, v in zip(everything, split_documents(everything, 0.2)) if v]
    assert corpus.documents == {"train": len(train), "valid": len(valid)} and len(valid) >= 1
    for split, prefix in (("train", corpus.train_prefix), ("valid", corpus.valid_prefix)):
        data = IndexedDataset(prefix)
        assert len(data) == corpus.documents[split]
        assert sum(len(data[i]) for i in range(len(data))) == corpus.tokens[split]
    tok = load_tokenizer(corpus.tokenizer_path)
    first = json.loads((out / "docs.valid.jsonl").read_text().splitlines()[0])["text"]
    assert data[0].tolist() == tok.tokenize(first) + [tok.eod]  # data (valid) must outlive its mmap views
    assert tok.vocab_size == 512 and corpus.source == str(stdlib20)
    # the same source gives the same corpus, byte for byte
    again = tmp_path / "again"
    prepare_corpus(str(stdlib20), str(again), vocab_size=512, valid_fraction=0.2, show_progress=False)
    assert {p.name: p.read_bytes() for p in again.iterdir()} == {p.name: p.read_bytes() for p in out.iterdir()}


def test_a_text_file_splits_at_blank_lines_or_lines():
    """Paragraphs (blank lines of any whitespace and line ending between them) or lines, each named
    by its first line; the text inside a piece kept exactly, its last line ending dropped."""
    from fbt_megatron.data.documents import split_text

    text = "one\r\ntwo  \r\n \t\r\n\r\nthree\n\n\nfour\n"
    assert [(d.name, d.text) for d in split_text(text, "f.txt", "blank-line")] == [
        ("f.txt:1", "one\r\ntwo  "), ("f.txt:5", "three"), ("f.txt:8", "four")]
    assert [(d.name, d.text) for d in split_text(text, "f.txt", "line")] == [
        ("f.txt:1", "one"), ("f.txt:2", "two  "), ("f.txt:5", "three"), ("f.txt:8", "four")]
    assert [(d.name, d.text, d.file) for d in split_text(text, "f.txt", "file")] == [("f.txt", text, "f.txt")]
    assert {d.file for d in split_text(text, "a/f.txt", "line")} == {"a/f.txt"}
    with pytest.raises(ValueError, match="at least 2 documents, the source has 1 document: split a text file"):
        split_documents(["f.txt"], 0.1)


def test_split_gives_each_split_a_document():
    assert split_documents(["a", "b"], 1e-9).count(True) == 1
    assert split_documents(["a", "b"], 1 - 1e-9).count(False) == 1
    with pytest.raises(ValueError, match="at least 2 documents"):
        split_documents(["a"], 0.5)


def test_corpus_feeds_the_gpt_datasets(corpus20, tmp_path):
    corpus = load_corpus(corpus20[1])
    tok = load_tokenizer(corpus.tokenizer_path)
    blends = [([corpus.train_prefix], None), ([corpus.valid_prefix], None), None]
    train, valid, test = build_datasets(tok, 64, 1, (10, None, None), str(tmp_path / "cache"), blend_per_split=blends)
    assert test is None and len(valid) == (corpus.tokens["valid"] - 1) // 64
    sample = train[3]
    assert sample["tokens"].shape == (64,) and int(sample["tokens"].max()) < tok.vocab_size
    assert torch.equal(sample["tokens"][1:], sample["labels"][:-1])


def test_prepare_twice_does_nothing_the_second_time(stdlib20, corpus20, monkeypatch, capsys):
    corpus, out = corpus20
    stamps = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    monkeypatch.setattr(corpus_module, "_build", lambda *a: pytest.fail("rebuilt a complete corpus"))
    assert prepare_corpus(str(stdlib20), str(out), vocab_size=512, valid_fraction=0.2) == corpus
    assert "already prepared, nothing to do" in capsys.readouterr().out
    assert ensure_corpus(str(stdlib20), str(out), 512, valid_fraction=0.2, show_progress=False) == corpus
    with pytest.raises(ValueError, match=r"other settings \(vocab_size 512 → 1024\); choose another --output"):
        prepare_corpus(str(stdlib20), str(out), vocab_size=1024, valid_fraction=0.2)
    # the training entry point's call: advice in its own flags (a prepared --data-path without --corpus null)
    with pytest.raises(ValueError, match=r"^--data-path .* holds a corpus prepared with other settings \(source .*"
                                         r"to train on the corpus there as it is, add --corpus null; to prepare "
                                         r"--corpus stdlib with --vocab-size 2048, choose another --data-path$"):
        ensure_corpus("stdlib", str(out), 2048, valid_fraction=0.2)
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == stamps


def test_failed_prepare_leaves_nothing(stdlib20, tmp_path, monkeypatch):
    def fail(*args, **kwargs):
        raise RuntimeError("injected")

    monkeypatch.setattr(corpus_module, "tokenize_into", fail)
    with pytest.raises(RuntimeError, match="injected"):
        prepare_corpus(str(stdlib20), str(tmp_path / "out"), vocab_size=512, show_progress=False)
    assert list(tmp_path.iterdir()) == []


def test_a_corpus_another_process_finished_meanwhile_is_taken(stdlib20, corpus20, tmp_path, monkeypatch):
    """Two runs started together on a missing --data-path both prepare it; the one that finishes
    second takes the first one's corpus when it was prepared with the same settings (not an error),
    and says which setting differs when it was not."""
    corpus, done = corpus20
    build = corpus_module._build

    def build_while_another_finishes(settings_of_the_other):
        def run(tmp, *args):
            shutil.copytree(settings_of_the_other, out)  # the other process renames its folder into place first
            build(tmp, *args)
        return run

    out = tmp_path / "same"
    monkeypatch.setattr(corpus_module, "_build", build_while_another_finishes(done))
    taken = prepare_corpus(str(stdlib20), str(out), vocab_size=512, valid_fraction=0.2, show_progress=False)
    assert taken == load_corpus(out) and taken.tokens == corpus.tokens
    assert sorted(p.name for p in tmp_path.iterdir()) == ["same"]  # the temporary folder is gone
    out = tmp_path / "other"
    monkeypatch.setattr(corpus_module, "_build", build_while_another_finishes(done))
    with pytest.raises(ValueError, match=r"other settings \(vocab_size 512 → 1024\)"):
        prepare_corpus(str(stdlib20), str(out), vocab_size=1024, valid_fraction=0.2, show_progress=False)


def test_prepare_refuses_a_folder_that_is_not_a_corpus(stdlib20, tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="is not a prepared corpus"):
        prepare_corpus(str(stdlib20), str(tmp_path), vocab_size=512, show_progress=False)
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"] and (tmp_path / "notes.txt").read_text() == "mine"


def test_tools_report_bad_input_in_one_line(tokenizer, tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n{"text": \n')
    (tmp_path / "key.jsonl").write_text('{"content": "a"}\n')
    (tmp_path / "empty").mkdir()
    (tmp_path / "vocab.txt").write_text("a 1\n")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    prefix = str(tmp_path / "out")
    for ext in (".bin", ".idx"):
        Path(prefix + ext).write_text("existing")

    def pre(inputs, tok=tokenizer.path, *more):
        return ("tools/preprocess_data.py", "--input", *inputs, "--tokenizer", tok, "--output-prefix", prefix, *more)

    cases = {
        "missing.jsonl does not exist": pre([str(tmp_path / "missing.jsonl")]),
        "vocab.txt: unknown tokenizer kind": pre([str(SOURCES[0])], str(tmp_path / "vocab.txt")),
        "key.jsonl:1: no key 'text'": pre([str(tmp_path / "key.jsonl")]),
        "bad.jsonl:2: malformed JSON line": pre([str(tmp_path / "bad.jsonl")], tokenizer.path, "--workers", "2"),
        "empty corpus": pre([str(tmp_path / "empty")]),
        "vocab size must be positive (got 0)": (
            "tools/train_tokenizer.py", "--input", str(SOURCES[0]), "--vocab-size", "0",
            "--output", str(tmp_path / "t.model"),
        ),
        "mine is not a prepared corpus": (
            "tools/prepare_corpus.py", "--source", str(SOURCES[0]), "--output", str(tmp_path / "mine")
        ),
    }
    runs = {message: start(*args) for message, args in cases.items()}
    for message, run in runs.items():
        out, err = run.communicate(timeout=120)
        assert run.returncode == 2, (message, err)
        assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err
    assert [Path(prefix + ext).read_text() for ext in (".bin", ".idx")] == ["existing", "existing"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "bad.jsonl", "empty", "key.jsonl", "mine", "out.bin", "out.idx", "vocab.txt"
    ]
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"


def test_tools_have_help():
    tools = ("preprocess_data.py", "train_tokenizer.py", "prepare_corpus.py")
    runs = [start(f"tools/{tool}", "--help") for tool in tools]
    for run in runs:
        out, err = run.communicate(timeout=60)
        assert run.returncode == 0 and out.startswith("usage:"), err
