"""Documents → megatron-core ``.bin/.idx`` (IndexedDataset), each document followed by EOD.

Tokenization runs in `workers` processes on chunks of documents, a bounded number in flight (the
input is streamed: memory does not grow with the corpus), order kept: the output depends only on
the input, and is byte for byte what Megatron-LM's ``tools/preprocess_data.py`` writes. The
smallest safe token dtype is chosen as megatron does (uint16 below 65,500 ids, else int32). Every
file is written under a temporary name beside its target and published at the end
(``io.publish_indexed``: the old ``.idx`` removed first, the new one in place last), so a failed,
interrupted or crashed run never leaves a half-written prefix that a loader takes.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import multiprocessing
import os
from typing import Iterable, Iterator

import numpy
from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder, get_bin_path, get_idx_path

from fbt_megatron.common import processes
from fbt_megatron.common.errors import StorageError
from fbt_megatron.common.folders import STORAGE_ERRNOS, unwritable
from fbt_megatron.common.io import publish_indexed
from fbt_megatron.data.documents import BadRecords, Reading, iter_documents, progress
from fbt_megatron.data.tokenizer import Tokenizer, load_tokenizer

CHUNK_BYTES = 1 << 18  # text per task sent to a worker: small, so that the workers end together
CHUNK_DOCUMENTS = 256
IN_FLIGHT = 4  # chunks per worker queued or being tokenized

_worker_encode = None  # a worker process's encoder, set by _start_worker


def _document_ids(tokenizer: Tokenizer, dtype, text: str) -> numpy.ndarray:
    return numpy.array(tokenizer.tokenize(text) + [tokenizer.eod], dtype=dtype)


def _start_worker(tokenizer_path: str, dtype) -> None:
    global _worker_encode
    _worker_encode = functools.partial(_document_ids, load_tokenizer(tokenizer_path), dtype)


def _encode_in_worker(texts: list[str]) -> list[numpy.ndarray]:
    return [_worker_encode(text) for text in texts]


def chunks(items: Iterable[tuple[int, str]]) -> Iterator[tuple[list[int], list[str]]]:
    """(outputs, texts) of consecutive documents, up to CHUNK_BYTES of text or CHUNK_DOCUMENTS each:
    what a worker is handed at a time."""
    outputs, texts, size = [], [], 0
    for output, text in items:
        outputs.append(output)
        texts.append(text)
        size += len(text)
        if size >= CHUNK_BYTES or len(texts) >= CHUNK_DOCUMENTS:
            yield outputs, texts
            outputs, texts, size = [], [], 0
    if texts:
        yield outputs, texts


def _encoded(items: Iterable[tuple[int, str]], tokenizer: Tokenizer, dtype, workers: int) -> Iterator[tuple[int, numpy.ndarray]]:
    """(output, ids) of each (output, text), in order; at most IN_FLIGHT chunks per worker pending."""
    if workers <= 1:
        for output, text in items:
            yield output, _document_ids(tokenizer, dtype, text)
        return
    processes.install()  # the workers die with this process
    with multiprocessing.Pool(workers, _start_worker, (tokenizer.path, dtype)) as pool:
        pending: collections.deque = collections.deque()
        for outputs, texts in chunks(items):
            pending.append((outputs, pool.apply_async(_encode_in_worker, (texts,))))
            if len(pending) >= IN_FLIGHT * workers:
                done_outputs, result = pending.popleft()
                yield from zip(done_outputs, result.get())
        while pending:
            done_outputs, result = pending.popleft()
            yield from zip(done_outputs, result.get())


@contextlib.contextmanager
def indexed_outputs(prefixes: list[str], dtype) -> Iterator[list[IndexedDatasetBuilder]]:
    """One builder per prefix, writing under temporary names; on success every prefix's files are
    finalized and published (``io.publish_indexed``), on any failure all of them removed (a file
    system that refuses the writes, full or read-only, is then one ``StorageError`` naming the folder)."""
    tmps = [f"{prefix}.tmp-{os.getpid()}" for prefix in prefixes]
    for prefix in prefixes:
        os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    builders = []
    try:
        builders += [IndexedDatasetBuilder(get_bin_path(tmp), dtype=dtype) for tmp in tmps]
        yield builders
        for builder, tmp in zip(builders, tmps):
            builder.finalize(get_idx_path(tmp))
        for prefix, tmp in zip(prefixes, tmps):
            publish_indexed(tmp, prefix)
    except BaseException as e:
        for builder in builders:
            with contextlib.suppress(OSError):  # a full disk refuses its buffer's last write again
                builder.data_file.close()
        for path in (p for tmp in tmps for p in (get_bin_path(tmp), get_idx_path(tmp))):
            if os.path.exists(path):
                os.remove(path)
        if isinstance(e, OSError) and e.errno in STORAGE_ERRNOS:
            folder = os.path.dirname(os.path.abspath(prefixes[0]))
            raise StorageError(f"{prefixes[0]}.bin/.idx not written: {unwritable(e, folder, 'write elsewhere')}") from None
        raise


def tokenize_into(items: Iterable[tuple[int, str]], tokenizer_path: str, prefixes: list[str], workers: int = 1,
                  show_progress: bool = True, desc: str | None = None, total: int | None = None,
                  done=None) -> list[dict]:
    """Tokenize each (output, text) into ``prefixes[output]``; returns per prefix ``{"documents": n,
    "tokens": n}`` (tokens as written, EOD included). The progress's ETA comes from `total` (how
    many items, if known) or `done` (the share of the input read, ``Reading.fraction``)."""
    tokenizer = load_tokenizer(tokenizer_path)
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    counts = [{"documents": 0, "tokens": 0} for _ in prefixes]
    with indexed_outputs(prefixes, dtype) as builders:
        encoded = progress(_encoded(items, tokenizer, dtype, workers), desc or os.path.basename(prefixes[0]),
                           show_progress, total, tokens=lambda item: item[1].size, done=done)
        for output, ids in encoded:
            builders[output].add_document(ids, [ids.size])
            counts[output]["documents"] += 1
            counts[output]["tokens"] += ids.size
    return counts


def preprocess(
    inputs: list,
    tokenizer_path: str,
    output_prefix: str,
    json_key: str = "text",
    workers: int = 1,
    show_progress: bool = True,
    split: str = "file",
    skip_bad_records: str | None = None,
) -> dict:
    """Tokenize the documents of `inputs` (paths, or ``documents.Source``s) into
    `output_prefix`.bin/.idx; returns ``{"documents": n, "tokens": n}`` (tokens as written, EOD
    included) and, when records were skipped, ``"skipped"`` by kind."""
    bad, reading = BadRecords(skip_bad_records), Reading()
    texts = ((0, doc.text) for doc in iter_documents(inputs, json_key, split, bad, reading))
    [counts] = tokenize_into(texts, tokenizer_path, [output_prefix], workers, show_progress, done=reading.fraction)
    return {**counts, "skipped": dict(bad.counts)} if bad.skipped else counts
