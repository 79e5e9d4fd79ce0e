"""Documents from the files corpora ship in, streamed: the one reader of raw text.

Formats, told by name:
  * ``.jsonl``, ``.jsonl.gz``, ``.jsonl.zst``: one JSON record a line, the text under `key`;
  * ``.parquet``: the `key` column (pyarrow), read a batch of rows at a time;
  * a folder saved by ``datasets.save_to_disk`` (``state.json`` beside its ``.arrow`` files, or a
    ``dataset_dict.json`` over split folders, of which the ``train`` split is read: its others are
    held-out data; a split's own folder reads that split): the `key` column, read with pyarrow
    (offline);
  * any other file (``.txt``, ``.py``, ..., also ``.gz``/``.zst`` compressed): UTF-8 text with its
    line endings kept exactly, split into documents by `split` (``SPLITS``): ``file`` one
    document, ``blank-line`` one per paragraph (lines between blank lines), ``line`` one per line
    (a line ends at ``\\n``).
An input is a file, a folder (read recursively in sorted order, skipping hidden entries and
``__pycache__``) or a glob pattern. A document is named "file:N" (N: the JSONL line, the row, the
first line of a piece of a text file) or by its file's relative path (a whole file). Empty
documents are skipped; inputs without any document are an error; a missing optional library
(pyarrow, zstandard) is named in the error.

A bad record (invalid UTF-8, malformed JSON, a missing key, a value that is not a string) is an
error naming its file and line (and, for UTF-8, the byte's column), unless ``BadRecords`` was
given a limit (``--skip-bad-records N`` or ``P%``): then it is skipped, counted by kind and named
in a ``warning:`` line (the first ten), and the read fails once more than the limit were skipped.
A damaged compressed or parquet file (a bad CRC, frame, footer or page; a file cut short) is an error naming the file and
about where in it, whatever the limit: what follows the damage is lost in an unknown number of
records, so the file is to be replaced or left out, not read in part.
"""

from __future__ import annotations

import collections
import contextlib
import glob
import gzip
import importlib
import io
import itertools
import json
import logging
import os
import sys
import time
import zlib
from dataclasses import dataclass
from typing import Iterable, Iterator

from tqdm import tqdm

from fbt_megatron.common import logs
from fbt_megatron.common.cli import plural

log = logging.getLogger(__name__)

SPLITS = ("file", "blank-line", "line")  # how a text file is split into documents
BAD_KINDS = ("invalid UTF-8", "malformed JSON", "missing key", "not a string")
DATASET_STATE = "state.json"  # what datasets.save_to_disk writes beside a dataset's arrow files
DATASET_DICT = "dataset_dict.json"
DATASET_DICT_SPLIT = "train"  # the split of a DatasetDict that is read
INPUTS_HELP = ("files, folders or glob patterns of .jsonl(.gz/.zst), .parquet, datasets.save_to_disk folders "
               "or text (.txt, .gz, ...)")  # what the tools' --input takes
SHOWN_BAD = 10  # skipped records named one line each; the rest only counted


@dataclass(frozen=True)
class Document:
    name: str  # the file's path relative to the input folder, or "file:N" (a record, a piece of a text file)
    text: str

    @property
    def file(self) -> str:
        """The name of the file the document comes from."""
        return self.name.rsplit(":", 1)[0] if self.name.rsplit(":", 1)[-1].isdigit() else self.name


@dataclass(frozen=True)
class Source:
    """One unit of input: a file, or a saved dataset's folder; `name` names its documents."""

    path: str
    name: str

    @property
    def files(self) -> list[str]:
        """Its files on disk: the file, or a saved dataset's arrow files (``_arrow_files``)."""
        return _arrow_files(self.path) if os.path.isdir(self.path) else [self.path]

    @property
    def size(self) -> int:
        """Bytes on disk (what shards are balanced by)."""
        return sum(os.path.getsize(f) for f in self.files)


class BadRecords:
    """What a bad record costs: an error (``limit`` None), or a skip counted by kind while at most
    ``limit`` records ("N", or "P%" of the records read, checked by ``check_share`` at the end) are
    bad. ``quiet``: a second pass over inputs already checked skips the same records silently."""

    def __init__(self, limit: str | None = None, quiet: bool = False):
        self.limit, self.quiet = limit, quiet
        self.count_limit, self.share = _parse_limit(limit)
        self.counts: collections.Counter = collections.Counter()
        self.records = 0  # read, good or bad

    @property
    def skipped(self) -> int:
        return sum(self.counts.values())

    def __call__(self, kind: str, where: str, message: str) -> None:
        """A bad record at `where` ("file:line[:column]"): raise, or count it and go on."""
        self.records += 1
        if self.limit is None:
            raise ValueError(f"{where}: {message} (to skip bad records: --skip-bad-records N or P%)")
        self.counts[kind] += 1
        if self.quiet:
            return
        if self.count_limit is not None and self.skipped > self.count_limit:
            raise ValueError(f"{where}: {message}: more than {self.count_limit:,} bad records "
                             f"(--skip-bad-records {self.limit}; {self.summary()})")
        if self.skipped <= SHOWN_BAD:
            more = " (further ones are only counted)" if self.skipped == SHOWN_BAD else ""
            log.warning(f"warning: skipped {where}: {message}{more}")

    def check_share(self) -> None:
        """At the end of a read: an error when more than the allowed share of records was bad."""
        if self.share is not None and not self.quiet and self.skipped > self.share * self.records:
            raise ValueError(f"{self.skipped:,} of {self.records:,} records are bad, more than "
                             f"--skip-bad-records {self.limit} ({self.summary()})")

    def summary(self) -> str:
        """"skipped 3 bad records: 2 malformed JSON, 1 invalid UTF-8" (kinds by count)."""
        kinds = ", ".join(f"{n:,} {kind}" for kind, n in self.counts.most_common())
        return f"skipped {self.skipped:,} bad record{'s' * (self.skipped != 1)}" + (f": {kinds}" if kinds else "")


class Reading:
    """How far a read of sources got, in bytes on disk (a batch log's ETA): the sizes of the
    sources read through, plus the offset reached in the current file (compressed: its compressed
    bytes; a parquet file: its share of rows; a saved dataset: its arrow files read through)."""

    def __init__(self):
        self.total = self.before = 0
        self.current = lambda: 0

    def fraction(self) -> float:
        return min(1.0, (self.before + self.current()) / self.total) if self.total else 0.0


def _parse_limit(limit: str | None) -> tuple[int | None, float | None]:
    if limit is None:
        return None, None
    text = str(limit).strip()
    try:
        if text.endswith("%"):
            share = float(text[:-1]) / 100
            if 0 <= share <= 1:
                return None, share
        elif int(text) >= 0:
            return int(text), None
    except ValueError:
        pass
    raise ValueError(f"--skip-bad-records {limit!r}: give a count (e.g. 100) or a share of the records (e.g. 0.1%)")


def walk(folder: str, suffixes: tuple[str, ...] | None = None, skip_dirs: Iterable[str] = ()) -> list[Source]:
    """The sources under `folder`, sorted by path, named by their paths relative to it: files (with one
    of `suffixes`, if given) and saved datasets (one source each), skipping hidden entries,
    ``__pycache__`` and folders named in `skip_dirs`."""
    skip = {"__pycache__", *skip_dirs}
    found = []
    for root, dirs, names in os.walk(folder):
        if root != folder and _is_dataset(root):
            found.append(root)
            dirs[:] = []
            continue
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in skip]
        found += [os.path.join(root, n) for n in names
                  if not n.startswith(".") and (suffixes is None or n.endswith(suffixes))]
    return [Source(p, os.path.relpath(p, folder)) for p in sorted(found)]


def _is_dataset(folder: str) -> bool:
    return any(os.path.isfile(os.path.join(folder, f)) for f in (DATASET_STATE, DATASET_DICT))


def sources(inputs: list[str]) -> list[Source]:
    """The sources of `inputs` (files, folders, glob patterns), in order; a missing one is an error."""
    out = []
    for path in inputs:
        if _is_dataset(path):
            out.append(Source(path, os.path.basename(os.path.normpath(path))))
        elif os.path.isdir(path):
            out += walk(path)
        elif os.path.isfile(path):
            out.append(Source(path, os.path.basename(path)))
        elif glob.has_magic(path) and glob.glob(path):
            for match in sorted(glob.glob(path)):
                out += sources([match]) if os.path.isdir(match) else [Source(match, os.path.basename(match))]
        else:
            raise FileNotFoundError(f"input {path} does not exist" + (" (no file matches the pattern)" if glob.has_magic(path) else ""))
    return out


def _needs(module: str, package: str, path: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ValueError(f"{path}: reading it needs the {package} package (pip install {package})") from None


@contextlib.contextmanager
def _open_binary(path: str, reading: Reading) -> Iterator[io.BufferedIOBase]:
    """The file's bytes, decompressed by its suffix (.gz, .zst); `reading` follows its offset on disk.
    A damaged compressed file is a ValueError naming it (``_damaged``)."""
    zstandard = _needs("zstandard", "zstandard", path) if path.endswith(".zst") else None
    with open(path, "rb") as raw:
        reading.current = raw.tell
        if path.endswith(".gz"):
            try:
                with gzip.GzipFile(fileobj=raw, mode="rb") as f:
                    yield f
            except (gzip.BadGzipFile, EOFError, zlib.error) as e:
                raise ValueError(_damaged(path, "gzip", raw, e)) from None
        elif zstandard is not None:
            try:
                with io.BufferedReader(_ZstdFrames(raw, zstandard), 1 << 20) as f:
                    yield f
            except (zstandard.ZstdError, EOFError) as e:
                raise ValueError(_damaged(path, "zstd", raw, e)) from None
        else:
            yield raw
        reading.current = lambda: 0


def _damaged(path: str, kind: str, raw, e: Exception) -> str:
    """The line of a compressed file that cannot be decompressed: where, why, what to do."""
    return (f"{path}: a damaged {kind} file ({e}) near byte {raw.tell():,} of {os.path.getsize(path):,}: replace it or "
            f"leave it out of the inputs (--skip-bad-records skips bad records of a readable file, not a damaged "
            f"compressed one)")


class _ZstdFrames(io.RawIOBase):
    """The decompressed bytes of a .zst file, frame after frame; a file that ends inside a frame is an
    EOFError (zstandard's stream reader ends there without a word)."""

    CHUNK = 1 << 16  # compressed bytes decompressed at a time

    def __init__(self, raw, zstandard):
        self.raw, self.zstandard = raw, zstandard
        self.frame = None  # the decompressor of the frame being read
        self.out, self.at = b"", 0  # decompressed bytes, and how many of them were read

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while self.at == len(self.out):
            data = self.raw.read(self.CHUNK)
            if not data:
                if self.frame is not None and not self.frame.eof:
                    raise EOFError("the file ends inside a zstd frame: it was cut short")
                return 0
            self.out, self.at = self._decompress(data), 0
        n = min(len(buffer), len(self.out) - self.at)
        buffer[:n] = self.out[self.at:self.at + n]
        self.at += n
        return n

    def _decompress(self, data: bytes) -> bytes:
        parts = []
        while data:
            if self.frame is None or self.frame.eof:
                self.frame = self.zstandard.ZstdDecompressor().decompressobj()
            parts.append(self.frame.decompress(data))
            data = self.frame.unused_data if self.frame.eof else b""
        return b"".join(parts)


def _decode(data: bytes, path: str, first_line: int, bad: BadRecords) -> str | None:
    """`data` as UTF-8, or None after reporting its first invalid byte by line and byte column."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = first_line + data.count(b"\n", 0, e.start)
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        bad("invalid UTF-8", f"{path}:{line}:{column}", f"not UTF-8 ({e.reason}, byte column {column})")
        return None


def _jsonl(source: Source, key: str, bad: BadRecords, reading: Reading) -> Iterator[Document]:
    with _open_binary(source.path, reading) as f:
        for number, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            line = _decode(raw, source.path, number, bad)
            if line is None:
                continue
            where = f"{source.path}:{number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                bad("malformed JSON", where, f"malformed JSON line ({e.msg})")
                continue
            if not isinstance(record, dict) or key not in record:
                bad("missing key", where, f"no key {key!r} (choose the text field with --json-key)")
                continue
            if not isinstance(record[key], str):
                bad("not a string", where, f"the value of {key!r} is not a string")
                continue
            bad.records += 1
            if record[key]:
                yield Document(f"{source.name}:{number}", record[key])


def _arrow_files(folder: str) -> list[str]:
    """The arrow files of a saved dataset, in its order (a DatasetDict's: its train split's); a
    DatasetDict without a train split is an error listing its splits."""
    if os.path.isfile(os.path.join(folder, DATASET_DICT)):
        with open(os.path.join(folder, DATASET_DICT)) as f:
            splits = json.load(f)["splits"]
        if DATASET_DICT_SPLIT not in splits:
            raise ValueError(f"{folder}: a DatasetDict without a {DATASET_DICT_SPLIT!r} split (its splits: "
                             f"{', '.join(splits)}): give the folder of the split to read, e.g. "
                             f"{os.path.join(folder, splits[0])}")
        return _arrow_files(os.path.join(folder, DATASET_DICT_SPLIT))
    with open(os.path.join(folder, DATASET_STATE)) as f:
        return [os.path.join(folder, d["filename"]) for d in json.load(f)["_data_files"]]


def _batches(source: Source, key: str, reading: Reading):
    """The `key` column of a parquet file or a saved dataset, a record batch at a time."""
    pyarrow = _needs("pyarrow", "pyarrow", source.path)
    if os.path.isdir(source.path):
        read = 0
        for path in _arrow_files(source.path):
            with pyarrow.memory_map(path) as stream:
                reading.current = lambda read=read: read + stream.tell()
                reader = pyarrow.ipc.open_stream(stream)
                _check_column(reader.schema.names, key, source.path)
                for batch in reader:
                    yield batch.column(key)
            read += os.path.getsize(path)
            reading.current = lambda read=read: read
        return
    import pyarrow.parquet

    try:  # pyarrow's own errors name no file: ArrowInvalid for a bad footer, OSError for a bad page
        file = pyarrow.parquet.ParquetFile(source.path)
        _check_column(file.schema_arrow.names, key, source.path)
        rows, size = 0, source.size
        for batch in file.iter_batches(batch_size=1024, columns=[key]):
            rows += batch.num_rows
            reading.current = lambda rows=rows: size * rows // max(file.metadata.num_rows, 1)
            yield batch.column(0)
    except (pyarrow.ArrowInvalid, OSError) as e:
        if isinstance(e, OSError) and e.errno is not None:
            raise  # the file system's, not the file's
        raise ValueError(f"{source.path}: a damaged parquet file ({' '.join(str(e).split())}): replace it or leave it out of "
                         "the inputs (--skip-bad-records skips bad records of a readable file, not a damaged one)") from None


def _check_column(names: list[str], key: str, path: str) -> None:
    if key not in names:
        raise ValueError(f"{path}: no column {key!r} (it has {', '.join(names)}; choose the text field with --json-key)")


def _table(source: Source, key: str, bad: BadRecords, reading: Reading) -> Iterator[Document]:
    row = 0
    for column in _batches(source, key, reading):
        for value in column.to_pylist():
            row += 1
            if not isinstance(value, str):
                bad("not a string", f"{source.path}:{row}", f"row {row}: the value of {key!r} is not a string")
                continue
            bad.records += 1
            if value:
                yield Document(f"{source.name}:{row}", value)


def _text(source: Source, split: str, bad: BadRecords, reading: Reading) -> Iterator[Document]:
    if split == "file":
        with _open_binary(source.path, reading) as f:
            text = _decode(f.read(), source.path, 1, bad)
            if text is not None:
                bad.records += 1
                if text:
                    yield Document(source.name, text)
        return
    with _open_binary(source.path, reading) as f:
        lines = ((n, _decode(raw, source.path, n, bad)) for n, raw in enumerate(f, 1))
        yield from _pieces(lines, source.name, split, bad)


def _pieces(lines: Iterable[tuple[int, str | None]], name: str, split: str, bad: BadRecords) -> Iterator[Document]:
    """The documents of numbered lines (None: a line already reported bad, which drops its piece)."""
    if split not in SPLITS:
        raise ValueError(f"--split-documents {split!r}: choose one of {', '.join(SPLITS)}")
    start, piece, broken = 0, [], False
    for number, line in itertools.chain(lines, [(0, "")]):
        blank = line is not None and not line.strip()
        if (piece or broken) and (blank or split == "line"):
            if not broken:
                bad.records += 1
                yield Document(f"{name}:{start}", "".join(piece).rstrip("\r\n"))
            piece, broken = [], False
        if not blank:
            start = number if not (piece or broken) else start
            broken = broken or line is None
            piece += [] if line is None else [line]


def split_text(text: str, name: str, split: str) -> Iterator[Document]:
    """The documents of a text file's content (see the module docstring)."""
    if split == "file":
        if text:
            yield Document(name, text)
        return
    lines = text.split("\n")
    lines = [line + "\n" for line in lines[:-1]] + ([lines[-1]] if lines[-1] else [])
    yield from _pieces(enumerate(lines, 1), name, split, BadRecords())


def read_source(source: Source, json_key: str = "text", split: str = "file",
                bad: BadRecords | None = None, reading: Reading | None = None) -> Iterator[Document]:
    """The documents of one source, by its format (see the module docstring)."""
    bad = BadRecords() if bad is None else bad
    reading = Reading() if reading is None else reading
    path = source.path
    stem = path[:-3] if path.endswith(".gz") else path[:-4] if path.endswith(".zst") else path
    if os.path.isdir(path) or path.endswith(".parquet"):
        yield from _table(source, json_key, bad, reading)
    elif stem.endswith(".jsonl"):
        yield from _jsonl(source, json_key, bad, reading)
    else:
        yield from _text(source, split, bad, reading)


def iter_documents(inputs: list[str] | list[Source], json_key: str = "text", split: str = "file",
                   bad: BadRecords | None = None, reading: Reading | None = None) -> Iterator[Document]:
    """The documents of `inputs` (files, folders, patterns, or ``Source``s) in order, text files
    split by ``split``; a missing input or no document at all is an error; bad records as `bad`
    says (default: an error); `reading` follows the bytes read (``Reading``)."""
    bad = BadRecords() if bad is None else bad
    reading = Reading() if reading is None else reading
    units = inputs if inputs and isinstance(inputs[0], Source) else sources(inputs)
    reading.total, reading.before, found = sum(unit.size for unit in units), 0, False
    for source in units:
        for doc in read_source(source, json_key, split, bad, reading):
            found = True
            yield doc
        reading.before += source.size
        reading.current = lambda: 0
    if not found:
        names = ", ".join(s.path if isinstance(s, Source) else s for s in inputs)
        raise ValueError(f"no documents in {names or 'the inputs'} (empty corpus)")
    bad.check_share()


STATUS_EVERY = 60.0  # seconds between the status lines of a batch job


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def progress(items: Iterable, desc: str, show: bool, total: int | None = None, tokens=None,
             every: float = STATUS_EVERY, done=None) -> Iterator:
    """`items` (documents), counted: a tqdm bar when `show` and stderr is a terminal; when `show`
    and it is not (a batch job's log), a status line every `every` seconds and one at the end:
    documents, and with `tokens` (an item's token count) tokens, tokens/s and the ETA, from
    `total` (documents) or else from `done` (the share of the input read: ``Reading.fraction``)."""
    if not show or sys.stderr.isatty():
        yield from tqdm(items, desc=desc, unit=" docs", total=total, disable=None if show else True)
        return
    start = last = time.monotonic()
    count = total_tokens = 0
    for item in items:
        yield item
        count += 1
        total_tokens += tokens(item) if tokens else 0
        now = time.monotonic()
        if now - last >= every:
            last = now
            share = count / total if total else done() if done else 0.0
            eta = f", ETA {_clock((now - start) * (1 - share) / share)}" if share > 0 else ""
            log.info(_status(desc, count, total_tokens, now - start) + eta, extra=logs.STDERR)
    log.info(_status(desc, count, total_tokens, time.monotonic() - start) + f", done in {_clock(time.monotonic() - start)}",
             extra=logs.STDERR)


def _status(desc: str, count: int, tokens: int, elapsed: float) -> str:
    line = f"{desc}: {plural(count, 'document')}"
    return line + (f", {tokens:,} tokens, {tokens / max(elapsed, 1e-9):,.0f} tokens/s" if tokens else "")


@contextlib.contextmanager
def stage(desc: str, show: bool) -> Iterator[None]:
    """A silent stage (a native call) named while it runs: on a terminal a bar ending in its time,
    in a log a line before and one after."""
    if not show:
        yield
        return
    if sys.stderr.isatty():
        bar = tqdm(total=1, desc=desc, bar_format="{desc} {elapsed}")
        try:
            yield
        finally:
            bar.update()
            bar.close()
        return
    start = time.monotonic()
    log.info(f"{desc} ...", extra=logs.STDERR)
    yield
    log.info(f"{desc}: done in {_clock(time.monotonic() - start)}", extra=logs.STDERR)
