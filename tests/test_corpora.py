"""Corpora at scale (issue 32): the formats corpora ship in read alike, bad records cost one record,
shards merge into what one process writes, memory is bounded (a bounded tokenizer sample, a bounded
number of documents in flight), progress lines in a batch log. Issue 44: a damaged compressed file
is one line naming it, a DatasetDict is read by its train split, a shard made from other inputs or
with another tokenizer is redone."""

import contextlib
import gzip
import io
import json
import os
import re
import sysconfig
from pathlib import Path

import numpy
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset

from fbt_megatron.common.cli import plural, run_cli
from fbt_megatron.data import preprocess as preprocess_module
from fbt_megatron.data.corpus import load_corpus, prepare_corpus
from fbt_megatron.data.documents import BadRecords, iter_documents, progress, sources
from fbt_megatron.data.preprocess import preprocess
from fbt_megatron.data.tokenizer import load_tokenizer
from fbt_megatron.data.tokenizer_training import Sample, train_tokenizer

STDLIB = Path(sysconfig.get_paths()["stdlib"])
SOURCES = [STDLIB / f for f in ("textwrap.py", "shlex.py", "fnmatch.py", "json/decoder.py", "json/encoder.py")]
TEXTS = [p.read_text() for p in sorted(STDLIB.glob("*.py"))[:24]] + ["x = 'ü ☃'\n", "ünïcödé 🐍"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "sp512.model"
    return load_tokenizer(train_tokenizer([str(p) for p in SOURCES], str(path), 512, show_progress=False))


def jsonl(texts) -> bytes:
    return "".join(json.dumps({"id": i, "text": t}, ensure_ascii=False) + "\n" for i, t in enumerate(texts)).encode()


@pytest.fixture(scope="module")
def formats(tmp_path_factory):
    """The same documents in every format, each a folder (three shards where the format has files)."""
    import datasets
    import pyarrow
    import pyarrow.parquet
    import zstandard

    root = tmp_path_factory.mktemp("formats")
    thirds = [TEXTS[:10], TEXTS[10:20], TEXTS[20:]]
    writers = {
        "jsonl": lambda path, texts: path.write_bytes(jsonl(texts)),
        "jsonl.gz": lambda path, texts: path.write_bytes(gzip.compress(jsonl(texts))),
        "jsonl.zst": lambda path, texts: path.write_bytes(zstandard.ZstdCompressor().compress(jsonl(texts))),
        "parquet": lambda path, texts: pyarrow.parquet.write_table(
            pyarrow.table({"id": list(range(len(texts))), "text": texts}), path, row_group_size=4),
    }
    folders = {}
    for name, write in writers.items():
        folders[name] = root / name
        folders[name].mkdir()
        for i, texts in enumerate(thirds):
            write(folders[name] / f"part-{i}.{name}", texts)
    folders["datasets"] = root / "saved"
    datasets.Dataset.from_dict({"text": TEXTS, "id": list(range(len(TEXTS)))}).save_to_disk(
        str(folders["datasets"]), max_shard_size="20KB")
    folders["txt.gz"] = root / "txt"
    folders["txt.gz"].mkdir()
    for i, text in enumerate(TEXTS):
        (folders["txt.gz"] / f"{i:02d}.txt.gz").write_bytes(gzip.compress(text.encode()))
    return folders


def test_every_format_reads_the_same_documents(formats):
    for name, folder in formats.items():
        docs = list(iter_documents([str(folder)]))
        assert [d.text for d in docs] == TEXTS, name
    assert len(list((formats["datasets"]).glob("*.arrow"))) > 1  # the saved dataset's several arrow files, in order
    names = [d.name for d in iter_documents([str(formats["jsonl.zst"] / "part-*.jsonl.zst")])]  # a glob of shards
    assert names[:2] == ["part-0.jsonl.zst:1", "part-0.jsonl.zst:2"] and names[-1] == "part-2.jsonl.zst:6"
    assert [d.name for d in iter_documents([str(formats["parquet"])])][-1] == "part-2.parquet:6"


def test_every_format_tokenizes_to_the_same_files(formats, tokenizer, tmp_path):
    written = {}
    for name, folder in formats.items():
        prefix = str(tmp_path / name)
        preprocess([str(folder)], tokenizer.path, prefix, workers=1, show_progress=False)
        written[name] = [Path(prefix + ext).read_bytes() for ext in (".bin", ".idx")]
    assert all(files == written["jsonl"] for files in written.values())


def test_a_compressed_corpus_is_prepared_without_a_copy_of_its_train_split(formats, tokenizer, tmp_path):
    corpus = prepare_corpus(str(formats["jsonl.zst"]), str(tmp_path / "c"), vocab_size=512, valid_fraction=0.2,
                            tokenizer_sample_bytes=20_000, show_progress=False)
    manifest = json.loads((tmp_path / "c" / "corpus.json").read_text())
    assert manifest["splits"]["train"]["docs"] is None and not (tmp_path / "c" / "docs.train.jsonl").exists()
    held = [json.loads(line) for line in (tmp_path / "c" / "docs.valid.jsonl").open()]
    assert len(held) == corpus.documents["valid"] >= 1 and all(d["text"] in TEXTS for d in held)
    assert corpus.documents["train"] + corpus.documents["valid"] == len(TEXTS)
    tok = load_tokenizer(corpus.tokenizer_path)
    train = IndexedDataset(corpus.train_prefix)
    train_texts = [t for t in TEXTS if t not in {d["text"] for d in held}]
    assert [train[i].tolist() for i in range(len(train))] == [tok.tokenize(t) + [tok.eod] for t in train_texts]


def test_the_tokenizer_sample_is_bounded_seeded_and_whole_when_it_fits():
    docs = [(f"d{i}", "x" * (100 + i)) for i in range(200)]
    samples = {}
    for seed in (0, 0, 1):
        sample = Sample(max_bytes=3_000, seed=seed)
        for i, (name, text) in enumerate(docs):
            sample.add(i, name, text)
        assert 2_700 < sample.bytes <= 3_000 and not sample.whole
        samples.setdefault(seed, []).append(sample.texts())
    assert samples[0][0] == samples[0][1] != samples[1][0]
    kept = samples[0][0]
    assert kept == [t for _, t in docs if t in kept]  # in input order
    whole = Sample(max_bytes=10**6)
    for i, (name, text) in enumerate(docs):
        whole.add(i, name, text)
    assert whole.whole and whole.texts() == [t for _, t in docs]


def test_documents_in_flight_are_bounded(tokenizer, monkeypatch):
    """The input is pulled at most IN_FLIGHT chunks per worker ahead of what was written."""
    monkeypatch.setattr(preprocess_module, "CHUNK_DOCUMENTS", 2)
    pulled = []

    def texts():
        for i in range(200):
            pulled.append(i)
            yield 0, f"def f{i}(): return {i}\n"

    encoded = preprocess_module._encoded(texts(), tokenizer, numpy.uint16, workers=2)
    for written, (output, ids) in enumerate(encoded, 1):
        assert len(pulled) - written <= 2 * preprocess_module.IN_FLIGHT * 2 + 2
    assert written == 200


BAD = (b'{"text": "one"}\n'
       b'{"text": "caf\xc3\xa9 ok"}\n'
       b'{"text": "bad \xff byte"}\n'  # line 3, byte column 15
       b'{"text": "half\n'
       b'{"content": "no text key"}\n'
       b'\n'
       b'{"text": 7}\n'
       b'{"text": "last"}\n')


def test_a_bad_record_is_named_by_file_line_and_column(tmp_path, tokenizer):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(BAD)
    with pytest.raises(ValueError, match=r"bad.jsonl:3:15: not UTF-8 \(invalid start byte, byte column 15\) "
                                         r"\(to skip bad records: --skip-bad-records N or P%\)$"):
        list(iter_documents([str(path)]))
    bad = BadRecords("4")
    assert [d.text for d in iter_documents([str(path)], bad=bad)] == ["one", "café ok", "last"]
    assert bad.counts == {"invalid UTF-8": 1, "malformed JSON": 1, "missing key": 1, "not a string": 1}
    assert bad.summary() == "skipped 4 bad records: 1 invalid UTF-8, 1 malformed JSON, 1 missing key, 1 not a string"
    with pytest.raises(ValueError, match=r"bad.jsonl:5: no key 'text' .*: more than 2 bad records"):
        list(iter_documents([str(path)], bad=BadRecords("2")))
    with pytest.raises(ValueError, match=r"4 of 7 records are bad, more than --skip-bad-records 50%"):
        list(iter_documents([str(path)], bad=BadRecords("50%")))
    assert len(list(iter_documents([str(path)], bad=BadRecords("60%")))) == 3
    text = tmp_path / "notes.txt.gz"  # in a text file, the paragraph with the bad line is the record
    text.write_bytes(gzip.compress(b"first\npara\n\nsecond \xc3(\npara\n\nthird\n"))
    with pytest.raises(ValueError, match=r"notes.txt.gz:4:8: not UTF-8 \(invalid continuation byte"):
        list(iter_documents([str(text)], split="blank-line"))
    assert [d.name for d in iter_documents([str(text)], split="blank-line", bad=BadRecords("1"))] == [
        "notes.txt.gz:1", "notes.txt.gz:7"]
    with pytest.raises(ValueError, match=r"--skip-bad-records 'some': give a count"):
        BadRecords("some")


def in_process(module, *args) -> tuple:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exit_:
        run_cli(lambda: module.main(list(map(str, args))))
    return exit_.value.code, out.getvalue(), err.getvalue()


def test_skipping_bad_records_in_the_tools_and_nothing_half_written(tmp_path, tokenizer):
    import prepare_corpus
    import preprocess_data

    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "bad.jsonl").write_bytes(BAD)
    (tmp_path / "in" / "good.jsonl").write_bytes(jsonl(TEXTS[:6]))
    prefix = tmp_path / "out"
    code, out, err = in_process(preprocess_data, "--input", tmp_path / "in", "--tokenizer", tokenizer.path,
                                "--output-prefix", prefix, "--workers", 2)
    assert code == 2 and err.startswith("error: ") and "bad.jsonl:3:15: not UTF-8" in err and err.count("\n") == 1
    assert list(tmp_path.glob("out*")) == []
    code, out, err = in_process(preprocess_data, "--input", tmp_path / "in", "--tokenizer", tokenizer.path,
                                "--output-prefix", prefix, "--workers", 2, "--skip-bad-records", 4)
    assert code == 0, err
    assert err.count("warning: skipped") == 4 and "warning: skipped " + str(tmp_path / "in" / "bad.jsonl") + ":4: malformed" in err
    assert len(IndexedDataset(str(prefix))) == 9 and "skipped 4 bad records: 1 invalid UTF-8, 1 malformed JSON" in out
    code, out, err = in_process(prepare_corpus, "--source", tmp_path / "in", "--output", tmp_path / "corpus",
                                "--tokenizer", tokenizer.path, "--skip-bad-records", "3", "--workers", 1)
    assert code == 2 and "more than 3 bad records" in err and not (tmp_path / "corpus").exists()
    code, out, err = in_process(prepare_corpus, "--source", tmp_path / "in", "--output", tmp_path / "corpus",
                                "--tokenizer", tokenizer.path, "--skip-bad-records", "40%", "--workers", 1,
                                "--valid-fraction", 0.3)
    assert code == 0, err
    assert "skipped 4 bad records: 1 invalid UTF-8, 1 malformed JSON, 1 missing key, 1 not a string" in out
    manifest = json.loads((tmp_path / "corpus" / "corpus.json").read_text())
    assert manifest["skipped"] == {"invalid UTF-8": 1, "malformed JSON": 1, "missing key": 1, "not a string": 1}
    assert sum(load_corpus(tmp_path / "corpus").documents.values()) == 9


def test_shards_merge_into_what_one_process_writes_and_a_rerun_skips_complete_shards(formats, tokenizer, tmp_path):
    import merge_corpus
    import preprocess_data

    inputs = [formats["jsonl"], formats["parquet"], formats["jsonl.zst"]]  # 9 files, in this order
    one = tmp_path / "one"
    assert in_process(preprocess_data, "--input", *inputs, "--tokenizer", tokenizer.path, "--output-prefix", one,
                      "--workers", 2)[0] == 0
    prefix = tmp_path / "sharded"
    for i in range(4):
        code, out, err = in_process(preprocess_data, "--input", *inputs, "--tokenizer", tokenizer.path,
                                    "--output-prefix", prefix, "--shard", f"{i}/4", "--workers", 1)
        assert code == 0 and out.startswith(f"{prefix}_shard-{i:05d}-of-00004.bin/.idx: "), err
    shard = Path(f"{prefix}_shard-00002-of-00004.idx")
    stamp = shard.stat().st_mtime_ns
    os.remove(f"{prefix}_shard-00001-of-00004.idx")  # a shard that did not finish
    reruns = [in_process(preprocess_data, "--input", *inputs, "--tokenizer", tokenizer.path, "--output-prefix", prefix,
                         "--shard", f"{i}/4", "--workers", 1)[1] for i in range(4)]
    assert ["nothing to do" in out for out in reruns] == [True, False, True, True]
    assert shard.stat().st_mtime_ns == stamp
    code, out, err = in_process(merge_corpus, "--output-prefix", prefix, "--shards", 4)
    assert code == 0 and "4 prefixes merged" in out, err
    for ext in (".bin", ".idx"):
        assert Path(f"{prefix}{ext}").read_bytes() == Path(f"{one}{ext}").read_bytes()
    code, out, err = in_process(preprocess_data, "--input", *inputs, "--tokenizer", tokenizer.path,
                                "--output-prefix", prefix, "--shard", "3/10")
    assert code == 2 and "10 shards of 9 input files: use at most 9 shards" in err
    code, out, err = in_process(merge_corpus, "--output-prefix", tmp_path / "x", "--shards", 2)
    assert code == 2 and "x_shard-00000-of-00002.bin/.idx not there" in err
    # shard 1 made again with another tokenizer (the same token type: the .idx cannot tell): refused, naming the shards
    other = load_tokenizer(train_tokenizer([str(p) for p in SOURCES], str(tmp_path / "sp400.model"), 400, show_progress=False))
    assert in_process(preprocess_data, "--input", *inputs, "--tokenizer", other.path, "--output-prefix", prefix, "--shard", "1/4",
                      "--workers", 1)[0] == 0
    before = Path(f"{prefix}.bin").read_bytes()
    code, out, err = in_process(merge_corpus, "--output-prefix", prefix, "--shards", 4)
    assert code == 2 and out == "" and err.strip() == (
        f"error: the prefixes were tokenized with different tokenizers (sharded_shard-00000-of-00004 and 2 more: tokenizer "
        f"sha256 {tokenizer.sha256[:12]}…; sharded_shard-00001-of-00004: tokenizer sha256 {other.sha256[:12]}…): tokenize "
        "them again with one (tools/preprocess_data.py --tokenizer), the ids of one tokenizer mean other pieces in another")
    assert Path(f"{prefix}.bin").read_bytes() == before  # the merged corpus left as it was


def test_a_damaged_compressed_file_is_one_line_naming_it(tmp_path, tokenizer):
    """.gz and .zst files cut short, with a wrong checksum, with bytes after the last zstd frame, or
    not compressed at all: one line naming the file, about where it breaks and that
    --skip-bad-records does not cover it, exit code 2, nothing written (with or without the flag).
    The same files whole, and a .zst of two frames, read as the original."""
    import preprocess_data
    import zstandard

    data = jsonl(TEXTS)
    gz, zst = gzip.compress(data), zstandard.ZstdCompressor().compress(data)
    crc = gz[:-8] + bytes(b ^ 0xFF for b in gz[-8:-4]) + gz[-4:]  # the trailer's CRC-32 of the data, wrong
    damaged = {  # name: (content, the reason given)
        "cut.jsonl.gz": (gz[:len(gz) // 2], "Compressed file ended before the end-of-stream marker was reached"),
        "crc.jsonl.gz": (crc, r"CRC check failed 0x[0-9a-f]+ != 0x[0-9a-f]+"),
        "notgz.txt.gz": (b"plain text\n", r"Not a gzipped file \(b'pl'\)"),
        "cut.jsonl.zst": (zst[:len(zst) // 2], "the file ends inside a zstd frame: it was cut short"),
        "tail.jsonl.zst": (zst + b"trailing bytes", "zstd decompressor error: Unknown frame descriptor"),
    }
    for name, (content, reason) in damaged.items():
        path = tmp_path / name
        path.write_bytes(content)
        for skip in ([], ["--skip-bad-records", "100%"]):
            code, out, err = in_process(preprocess_data, "--input", path, "--tokenizer", tokenizer.path,
                                        "--output-prefix", tmp_path / "out", "--workers", 1, *skip)
            assert code == 2 and re.fullmatch(
                rf"error: {re.escape(str(path))}: a damaged (gzip|zstd) file \(({reason})\) near byte [\d,]+ of "
                rf"{len(content):,}: replace it or leave it out of the inputs \(--skip-bad-records skips bad records of a "
                rf"readable file, not a damaged compressed one\)\n", err), (name, err)
        path.unlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    import pyarrow
    import pyarrow.parquet

    table = io.BytesIO()
    pyarrow.parquet.write_table(pyarrow.table({"text": TEXTS * 40}), table, row_group_size=len(TEXTS) * 10)
    good = table.getvalue()
    pages = bytearray(good)
    pages[200:260] = b"\xff" * 60  # inside the first data page's header
    for name, content, reason in (("cut.parquet", good[:len(good) // 2], "Parquet magic bytes not found in footer"),
                                  ("page.parquet", bytes(pages), "")):  # pyarrow's words: the page's header, or its data
        path = tmp_path / name
        path.write_bytes(content)
        code, out, err = in_process(preprocess_data, "--input", path, "--tokenizer", tokenizer.path,
                                    "--output-prefix", tmp_path / "out", "--workers", 1)
        assert code == 2 and err.startswith(f"error: {path}: a damaged parquet file ({reason}") and err.endswith(
            "): replace it or leave it out of the inputs (--skip-bad-records skips bad records of a readable file, not a "
            "damaged one)\n") and err.count("\n") == 1, (name, err)
        path.unlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    frames = zstandard.ZstdCompressor().compress(jsonl(TEXTS[:5])) + zstandard.ZstdCompressor().compress(jsonl(TEXTS[5:]))
    for name, content in (("whole.jsonl.gz", gz), ("whole.jsonl.zst", zst), ("frames.jsonl.zst", frames)):
        (tmp_path / name).write_bytes(content)
        assert [d.text for d in iter_documents([str(tmp_path / name)])] == TEXTS, name


def test_a_dataset_dict_is_read_by_its_train_split(tmp_path, tokenizer):
    """A DatasetDict saved with train and test splits gives its train split only (alone, in a folder,
    as a shard's unit); one without a train split is one line listing its splits, and a split's own
    folder reads that split."""
    import datasets
    import preprocess_data

    train, test = TEXTS[:20], TEXTS[20:]
    saved = tmp_path / "corpora" / "dict"
    datasets.DatasetDict(train=datasets.Dataset.from_dict({"text": train}),
                         test=datasets.Dataset.from_dict({"text": test})).save_to_disk(str(saved))
    assert [d.text for d in iter_documents([str(saved)])] == train
    assert [d.text for d in iter_documents([str(tmp_path / "corpora")])] == train
    [unit] = sources([str(saved)])
    assert unit.files == [str(p) for p in sorted((saved / "train").glob("*.arrow"))]
    code, out, err = in_process(preprocess_data, "--input", saved, "--tokenizer", tokenizer.path,
                                "--output-prefix", tmp_path / "out", "--workers", 1)
    assert code == 0 and f"{plural(len(train), 'document')}," in out, err
    no_train = tmp_path / "eval"
    datasets.DatasetDict(validation=datasets.Dataset.from_dict({"text": test}),
                         test=datasets.Dataset.from_dict({"text": train})).save_to_disk(str(no_train))
    code, out, err = in_process(preprocess_data, "--input", no_train, "--tokenizer", tokenizer.path,
                                "--output-prefix", tmp_path / "eval_out", "--workers", 1)
    assert (code, err) == (2, f"error: {no_train}: a DatasetDict without a 'train' split (its splits: validation, test): "
                              f"give the folder of the split to read, e.g. {no_train}/validation\n")
    assert [d.text for d in iter_documents([str(no_train / "validation")])] == test


def test_a_shard_made_from_other_inputs_or_with_another_tokenizer_is_redone(formats, tokenizer, tmp_path):
    """Shards record what made them (``P_shard-…json``, written after their .bin/.idx): a rerun with
    the same inputs and tokenizer reuses them untouched; after the tokenizer changes, an input file
    changes or the record is gone, the shards concerned are redone, each with one line saying why,
    and equal what a fresh preparation writes."""
    import shutil

    import preprocess_data

    inputs = tmp_path / "inputs"
    shutil.copytree(formats["jsonl"], inputs)  # part-0 … part-2
    other = load_tokenizer(train_tokenizer([str(p) for p in SOURCES[:3]], str(tmp_path / "other.model"), 400,
                                           show_progress=False))

    def prepare(prefix, index, tok=tokenizer):
        code, out, err = in_process(preprocess_data, "--input", inputs, "--tokenizer", tok.path, "--output-prefix",
                                    prefix, "--shard", f"{index}/3", "--workers", 1)
        assert code == 0, err
        return out

    def files(prefix, index):
        shard = f"{prefix}_shard-{index:05d}-of-00003"
        return [Path(shard + ext).read_bytes() for ext in (".bin", ".idx")]

    prefix = tmp_path / "web"
    assert not any("redone" in prepare(prefix, i) for i in range(3))
    record = json.loads(Path(f"{prefix}_shard-00001-of-00003.json").read_text())
    assert record["tokenizer_sha256"] == tokenizer.sha256 and [p for p, *_ in record["inputs"]] == [str(inputs / "part-1.jsonl")]
    stamps = [Path(f"{prefix}_shard-{i:05d}-of-00003.bin").stat().st_mtime_ns for i in range(3)]
    assert all("(complete already, nothing to do)" in prepare(prefix, i) for i in range(3))
    assert [Path(f"{prefix}_shard-{i:05d}-of-00003.bin").stat().st_mtime_ns for i in range(3)] == stamps

    out = prepare(prefix, 0, other)
    assert out.startswith("shard 0: redone, its tokenizer changed\n") and "nothing to do" not in out
    prepare(tmp_path / "fresh_other", 0, other)
    assert files(prefix, 0) == files(tmp_path / "fresh_other", 0)
    assert "nothing to do" in prepare(prefix, 0, other)

    (inputs / "part-2.jsonl").write_bytes(jsonl(TEXTS[:3]))
    out = prepare(prefix, 2)
    assert out.startswith(f"shard 2: redone, its input {inputs / 'part-2.jsonl'} changed (size or modification time)\n")
    prepare(tmp_path / "fresh", 2)
    assert files(prefix, 2) == files(tmp_path / "fresh", 2)

    os.remove(f"{prefix}_shard-00001-of-00003.json")  # shards of before the records, or a crash before it
    assert prepare(prefix, 1).startswith("shard 1: redone, it has no record of what made it "
                                         "(web_shard-00001-of-00003.json)\n")
    assert all(Path(f"{prefix}_shard-{i:05d}-of-00003.bin").stat().st_mtime_ns != stamps[i] for i in range(3))
    assert all("nothing to do" in prepare(prefix, i, other if i == 0 else tokenizer) for i in range(3))


def test_a_batch_log_gets_periodic_status_lines(capsys):
    items = list(progress(iter(range(5)), "tokenize", True, total=5, tokens=lambda i: 10, every=0.0))
    assert items == list(range(5))
    lines = capsys.readouterr().err.splitlines()  # stderr is captured: not a terminal
    assert lines[0].startswith("tokenize: 1 document, 10 tokens, ") and "tokens/s, ETA 0:00:00" in lines[0]
    assert len(lines) == 6 and lines[-1].startswith("tokenize: 5 documents, 50 tokens") and "done in 0:00:00" in lines[-1]
    list(progress(iter(range(2)), "web", True, tokens=lambda i: 10, every=0.0, done=lambda: 0.5))  # the share read
    assert all("tokens/s, ETA 0:00:00" in line for line in capsys.readouterr().err.splitlines()[:2])


def test_the_share_of_the_input_read_grows_to_one_in_every_format(formats):
    """The ETA of a batch log comes from the bytes read on disk (the offset in a compressed file,
    the rows of a parquet file, the arrow files of a saved dataset) against the inputs' sizes."""
    from fbt_megatron.data.documents import Reading

    for name, folder in formats.items():
        reading = Reading()
        shares = [reading.fraction() for _ in iter_documents([str(folder)], reading=reading)]
        assert reading.total == sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and
                                    (name != "datasets" or p.suffix == ".arrow")), name
        assert shares == sorted(shares) and 0 < shares[0] and reading.fraction() == 1.0, (name, shares)
        assert len(set(shares)) > (2 if name != "txt.gz" else 20), (name, shares)  # it moves within and across files


def test_slurm_prepare_renders_a_shard_array_and_a_merge_after_it(formats, tokenizer, tmp_path):
    import re
    import subprocess

    from fbt_megatron.commands import slurm

    inputs = str(formats["jsonl"] / "part-*.jsonl")
    common = ["prepare", "--input", inputs, "--tokenizer", tokenizer.path, "--time", "01:00:00", "--partition", "cpu",
              "--log-dir", str(tmp_path / "logs"), "--dry-run"]
    code, out, err = in_process(slurm, *common, "--output-prefix", tmp_path / "web", "--shards", 3, "--",
                                "--skip-bad-records", "0.1%")
    assert code == 0, err
    parts = re.split(r"^# ---- (\S+): (sbatch --parsable.*)$", out, flags=re.M)
    (array, array_sbatch, array_script), (merge, merge_sbatch, merge_script) = zip(parts[1::3], parts[2::3], parts[3::3])
    assert (array, merge) == ("prepare-web", "prepare-web-merge")
    assert merge_sbatch == "sbatch --parsable --dependency=afterok:<job of prepare-web>"
    for script in (array_script, merge_script):
        assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
        assert "#SBATCH --partition=cpu" in script and "#SBATCH --exclusive" in script and "#SBATCH --requeue" in script
    assert "#SBATCH --array=0-2" in array_script and f"--output={tmp_path}/logs/prepare-web-%A_%a.out" in array_script
    assert (f"tools/preprocess_data.py --input {inputs!r} --tokenizer {tokenizer.path} --output-prefix {tmp_path}/web "
            f'--shard "$SLURM_ARRAY_TASK_ID/3" --workers "$CPUS" --skip-bad-records 0.1%') in array_script
    assert "--array" not in merge_script
    assert f"tools/merge_corpus.py --output-prefix {tmp_path}/web --shards 3" in merge_script
    code, out, err = in_process(slurm, *common, "--output-prefix", tmp_path / "web", "--shards", 4)
    assert code == 2 and err == "error: 4 shards of 3 input files: use at most 3 shards (a file is not cut)\n"


def test_a_missing_optional_library_is_named(formats, monkeypatch):
    import sys

    for module, folder, pattern in (("zstandard", formats["jsonl.zst"], "zstandard"), ("pyarrow", formats["parquet"], "pyarrow"),
                                    ("pyarrow", formats["datasets"], "pyarrow")):
        monkeypatch.setitem(sys.modules, module, None)  # import fails
        with pytest.raises(ValueError, match=rf": reading it needs the {pattern} package \(pip install {pattern}\)$"):
            list(iter_documents([str(folder)]))
        monkeypatch.undo()
