"""Documents → megatron-core ``.bin/.idx`` (IndexedDataset), each document followed by EOD.

Tokenization runs in `workers` processes (order kept: the output depends only on the input).
The smallest safe token dtype is chosen as megatron does (uint16 below 65,500 ids, else int32).
Both files are written under temporary names beside the target and renamed at the end, so an
interrupted run never leaves a half-written prefix.
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing
import os

import numpy
from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder, get_bin_path, get_idx_path

from fbt_megatron import processes
from fbt_megatron.data.documents import iter_documents, progress
from fbt_megatron.data.tokenizer import Tokenizer, load_tokenizer

_worker_encode = None  # a worker process's encoder, set by _start_worker


def _document_ids(tokenizer: Tokenizer, dtype, text: str) -> numpy.ndarray:
    return numpy.array(tokenizer.tokenize(text) + [tokenizer.eod], dtype=dtype)


def _start_worker(tokenizer_path: str, dtype) -> None:
    global _worker_encode
    _worker_encode = functools.partial(_document_ids, load_tokenizer(tokenizer_path), dtype)


def _encode_in_worker(text: str) -> numpy.ndarray:
    return _worker_encode(text)


def preprocess(
    inputs: list[str],
    tokenizer_path: str,
    output_prefix: str,
    json_key: str = "text",
    workers: int = 1,
    show_progress: bool = True,
) -> dict:
    """Tokenize the documents of `inputs` into `output_prefix`.bin/.idx; returns
    ``{"documents": n, "tokens": n}`` (tokens as written, EOD included)."""
    tokenizer = load_tokenizer(tokenizer_path)
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    tmp = f"{output_prefix}.tmp-{os.getpid()}"
    texts = (doc.text for doc in iter_documents(inputs, json_key))
    counts = {"documents": 0, "tokens": 0}
    builder = IndexedDatasetBuilder(get_bin_path(tmp), dtype=dtype)
    try:
        with contextlib.ExitStack() as stack:
            if workers > 1:
                processes.install()  # the workers die with this process
                pool = stack.enter_context(multiprocessing.Pool(workers, _start_worker, (tokenizer.path, dtype)))
                encoded = pool.imap(_encode_in_worker, texts, chunksize=16)
            else:
                encoded = map(functools.partial(_document_ids, tokenizer, dtype), texts)
            for ids in progress(encoded, os.path.basename(output_prefix), show_progress):
                builder.add_document(ids, [ids.size])
                counts["documents"] += 1
                counts["tokens"] += ids.size
        builder.finalize(get_idx_path(tmp))
        os.replace(get_bin_path(tmp), get_bin_path(output_prefix))
        os.replace(get_idx_path(tmp), get_idx_path(output_prefix))
    except BaseException:
        builder.data_file.close()
        for path in (get_bin_path(tmp), get_idx_path(tmp)):
            if os.path.exists(path):
                os.remove(path)
        raise
    return counts
