"""Tokenizers read from a local file, in the interface megatron-core's datasets use.

Three kinds of file, told apart by name:
  * a sentencepiece ``.model`` (EOD = the model's ``</s>``, pad = its pad piece, else EOD);
  * a Hugging Face ``tokenizer.json``, read with the ``tokenizers`` library (EOD/pad = the first
    of the usual special tokens it has);
  * a tiktoken BPE rank file (``.tiktoken``, or a ``.model`` of base64 rank lines as Llama 3 ships
    it) with the cl100k pre-tokenizer pattern and ``<|endoftext|>`` appended after the ranks as EOD.
Nothing is downloaded. ``unique_identifiers`` carry the file's SHA-256, so megatron's cached
dataset indices are rebuilt when the tokenizer changes.
"""

from __future__ import annotations

import hashlib
import os
import re
from unittest import mock

import sentencepiece
import tiktoken
import tokenizers
from tiktoken.load import load_tiktoken_bpe

from fbt_megatron.common.compat import LegacyTokenizer

CL100K_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+"""
    r"""|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
)
ENDOFTEXT = "<|endoftext|>"


def padded_vocab_size(vocab_size: int, tensor_model_parallel_size: int = 1, divisible_by: int = 128) -> int:
    """Megatron's embedding size: `vocab_size` rounded up to a multiple of divisible_by × TP."""
    multiple = divisible_by * tensor_model_parallel_size
    return -(-vocab_size // multiple) * multiple


class Tokenizer(LegacyTokenizer):
    """A tokenizer read from the file `path`; subclasses load it and set ``_eod``/``_pad``."""

    kind = ""

    def __init__(self, path: str):
        self.path = os.path.abspath(path)
        with open(self.path, "rb") as f:
            self.sha256 = hashlib.sha256(f.read()).hexdigest()
        super().__init__(self.path, sha256=self.sha256)
        self._eod = self._pad = None

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def pad(self) -> int:
        return self._pad

    @property
    def inv_vocab(self) -> dict:
        return {i: token for token, i in self.vocab.items()}

    def padded_vocab_size(self, tensor_model_parallel_size: int = 1, divisible_by: int = 128) -> int:
        return padded_vocab_size(self.vocab_size, tensor_model_parallel_size, divisible_by)


class SentencePieceTokenizer(Tokenizer):
    kind = "sentencepiece"

    def __init__(self, path: str):
        super().__init__(path)
        self._sp = sentencepiece.SentencePieceProcessor(model_file=self.path)
        if self._sp.eos_id() < 0:
            raise ValueError(f"{path}: the sentencepiece model has no </s> piece to end documents with")
        self._eod = self._sp.eos_id()
        self._pad = self._sp.pad_id() if self._sp.pad_id() >= 0 else self._eod

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    @property
    def vocab(self) -> dict[str, int]:
        return {self._sp.id_to_piece(i): i for i in range(self.vocab_size)}

    def tokenize(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def detokenize(self, ids) -> str:
        return self._sp.decode([int(i) for i in ids])


class HFTokenizer(Tokenizer):
    kind = "huggingface"
    EOD_TOKENS = (ENDOFTEXT, "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")
    PAD_TOKENS = ("<pad>", "<|pad|>", "[PAD]", "<|padding|>")

    def __init__(self, path: str):
        super().__init__(path)
        self._tok = tokenizers.Tokenizer.from_file(self.path)
        vocab = self._tok.get_vocab(with_added_tokens=True)
        found = lambda names: next((vocab[n] for n in names if n in vocab), None)
        self._eod = found(self.EOD_TOKENS)
        if self._eod is None:
            raise ValueError(f"{path}: no end-of-document token (one of {', '.join(self.EOD_TOKENS)})")
        self._pad = found(self.PAD_TOKENS)
        self._pad = self._eod if self._pad is None else self._pad
        self._vocab_size = max(vocab.values()) + 1

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def vocab(self) -> dict[str, int]:
        return self._tok.get_vocab(with_added_tokens=True)

    def tokenize(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


class TiktokenTokenizer(Tokenizer):
    kind = "tiktoken"

    def __init__(self, path: str):
        super().__init__(path)
        # tiktoken would copy the file into a cache in /tmp keyed by its path (and serve that copy
        # even after the file changed): an empty cache dir turns that off
        with mock.patch.dict(os.environ, {"TIKTOKEN_CACHE_DIR": ""}):
            self._ranks = load_tiktoken_bpe(self.path)
        self._eod = self._pad = max(self._ranks.values()) + 1
        self._enc = tiktoken.Encoding(
            name=os.path.basename(path),
            pat_str=CL100K_PATTERN,
            mergeable_ranks=self._ranks,
            special_tokens={ENDOFTEXT: self._eod},
        )

    @property
    def vocab_size(self) -> int:
        return self._enc.n_vocab

    @property
    def vocab(self) -> dict[bytes, int]:
        return {**self._ranks, ENDOFTEXT.encode(): self._eod}

    def tokenize(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)  # "<|endoftext|>" inside a document is plain text

    def detokenize(self, ids) -> str:
        return self._enc.decode([int(i) for i in ids])


def _tokenizer_class(path: str) -> type[Tokenizer]:
    if path.endswith(".json"):
        return HFTokenizer
    if path.endswith(".tiktoken"):
        return TiktokenTokenizer
    if path.endswith(".model"):
        with open(path, "rb") as f:
            first_line = f.readline().strip()
        return TiktokenTokenizer if re.fullmatch(rb"[A-Za-z0-9+/=]+ \d+", first_line) else SentencePieceTokenizer
    raise ValueError(
        f"{path}: unknown tokenizer kind (expected a sentencepiece .model, "
        "a Hugging Face tokenizer.json or a tiktoken .tiktoken file)"
    )


def load_tokenizer(path: str) -> Tokenizer:
    """The tokenizer in the local file `path`, its kind told by the file name."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"tokenizer file {path} does not exist")
    cls = _tokenizer_class(path)
    try:
        return cls(path)
    except ValueError:
        raise
    except Exception as e:  # the libraries raise RuntimeError, OSError or a bare Exception
        raise ValueError(f"{path}: not a valid {cls.kind} tokenizer file ({e})") from e
