"""A sentencepiece BPE tokenizer for source code, trained on a bounded, seeded sample of documents.

Whitespace is kept exactly: identity normalization, no dummy prefix, no whitespace clean-up,
whitespace-only pieces (indentation) allowed, ``"\\n"`` a user-defined piece and byte fallback for
every character outside the vocabulary, so ``detokenize(tokenize(text)) == text`` for any text.
Ids: 0 ``<unk>``, 1 ``<s>``, 2 ``</s>`` (the end of document), 3 ``<pad>``, 4 ``"\\n"``.

Memory stays bounded whatever the corpus: training reads a ``Sample`` of at most `sample_bytes` of
UTF-8 (default ``SAMPLE_BYTES``), the documents whose seeded keys are smallest, in document order;
a corpus that fits is read whole. Every line of the sample goes to sentencepiece, in order, on
`threads` threads (default one: the merges depend on the thread count, so one thread gives the
same model file for the same input on any machine).
"""

from __future__ import annotations

import hashlib
import heapq
import io
import logging
import re

import sentencepiece

from fbt_megatron.common.io import atomic_write
from fbt_megatron.data.documents import BadRecords, iter_documents, progress, stage

log = logging.getLogger(__name__)

SAMPLE_BYTES = 100_000_000  # the most text a tokenizer trains on (default)


def parse_size(text: str) -> int:
    """Bytes from "100000000", "100M", "1.5G" (decimal K, M, G, T)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)B?\s*", str(text), re.IGNORECASE)
    if not match or float(match[1]) <= 0:
        raise ValueError(f"--tokenizer-sample-bytes {text!r}: give a positive size, e.g. 100M or 2G")
    return int(float(match[1]) * 1000 ** "_KMGT".index((match[2] or "_").upper()))


class Sample:
    """The documents offered whose keys (SHA-256 of the seed and the name) are smallest, as many as
    fit in `max_bytes` of UTF-8; all of them when they fit. Holds at most `max_bytes` of text."""

    def __init__(self, max_bytes: int = SAMPLE_BYTES, seed: int = 0):
        self.max_bytes, self.seed = max_bytes, seed
        self._heap: list[tuple[int, int, str, int]] = []  # (-key, index, text, bytes): the largest key on top
        self.bytes = 0
        self.offered = 0  # bytes offered, kept or not

    def add(self, index: int, name: str, text: str) -> None:
        """Offer the document `name` (its place in the input: `index`)."""
        size = len(text) if text.isascii() else len(text.encode("utf-8"))
        self.offered += size
        if size > self.max_bytes:
            return
        key = int.from_bytes(hashlib.sha256(f"{self.seed}:{name}".encode()).digest()[:8], "big")
        heapq.heappush(self._heap, (-key, index, text, size))
        self.bytes += size
        while self.bytes > self.max_bytes:
            self.bytes -= heapq.heappop(self._heap)[3]

    def discard(self, index: int) -> None:
        """Take the document at `index` out (it went to the other split)."""
        kept = [item for item in self._heap if item[1] != index]
        self.bytes = sum(item[3] for item in kept)
        self._heap = kept
        heapq.heapify(self._heap)

    @property
    def whole(self) -> bool:
        """Whether every document offered was kept."""
        return self.bytes == self.offered

    def texts(self) -> list[str]:
        """The kept documents' texts, in input order."""
        return [text for _, _, text, _ in sorted(self._heap, key=lambda item: item[1])]


def train_sentencepiece(texts: list[str], output: str, vocab_size: int, threads: int = 1,
                        show_progress: bool = True) -> str:
    """Train on every line of `texts` and write the model to `output` (atomically); returns `output`."""
    if vocab_size <= 0:
        raise ValueError(f"vocab size must be positive (got {vocab_size})")
    if threads < 1:
        raise ValueError(f"--tokenizer-threads {threads}: give 1 or more")
    lines = sum(text.count("\n") + 1 for text in texts)
    model = io.BytesIO()
    # the merges are learned in one silent native call: the stage is named, with its time at the end
    with stage(f"tokenizer: learning {vocab_size:,} BPE pieces from {lines:,} lines", show_progress):
        try:
            sentencepiece.SentencePieceTrainer.train(
                sentence_iterator=(line for text in texts for line in text.split("\n")),
                model_writer=model,
                model_type="bpe",
                vocab_size=vocab_size,
                byte_fallback=True,
                normalization_rule_name="identity",
                add_dummy_prefix=False,
                remove_extra_whitespaces=False,
                allow_whitespace_only_pieces=True,
                split_digits=True,
                user_defined_symbols=["\n"],
                unk_id=0,
                bos_id=1,
                eos_id=2,
                pad_id=3,
                max_sentence_length=1 << 16,
                input_sentence_size=0,  # every line of the sample, which is bounded already
                shuffle_input_sentence=False,
                num_threads=threads,  # the merges depend on the thread count
                minloglevel=2,
            )
        except RuntimeError as e:  # e.g. a vocabulary too small for the characters and the 256 bytes
            reason = str(e).rsplit("] ", 1)[-1]  # without sentencepiece's source location
            raise ValueError(f"cannot train a sentencepiece tokenizer of vocab size {vocab_size}: {reason}") from None
    atomic_write(output, model.getvalue())
    return output


def train_tokenizer(
    inputs: list[str], output: str, vocab_size: int, json_key: str = "text", show_progress: bool = True,
    sample_bytes: int = SAMPLE_BYTES, seed: int = 0, threads: int = 1, skip_bad_records: str | None = None,
    split: str = "file",
) -> str:
    """Train on a sample of the documents of `inputs` (see the module docstring) and write the
    model to `output` (atomically); returns `output`."""
    if vocab_size <= 0:
        raise ValueError(f"vocab size must be positive (got {vocab_size})")
    sample, bad = Sample(sample_bytes, seed), BadRecords(skip_bad_records)
    docs = progress(iter_documents(inputs, json_key, split, bad), "tokenizer sample", show_progress)
    for index, doc in enumerate(docs):
        sample.add(index, doc.name, doc.text)
    if bad.skipped and show_progress:
        log.info(bad.summary())
    return train_sentencepiece(sample.texts(), output, vocab_size, threads, show_progress)
