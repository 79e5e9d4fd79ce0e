"""Tokenizers from local files: sentencepiece (trained here), tiktoken rank files, HF tokenizer.json."""

import base64
import os
import sysconfig

import pytest

from fbt_megatron.data.tokenizer import HFTokenizer, SentencePieceTokenizer, TiktokenTokenizer, load_tokenizer
from fbt_megatron.data.tokenizer_training import train_tokenizer

STDLIB = sysconfig.get_paths()["stdlib"]
SOURCES = [
    os.path.join(STDLIB, f) for f in ("textwrap.py", "shlex.py", "fnmatch.py", "json/decoder.py", "json/encoder.py")
]
TRICKY = "class A:\n\tdef f(self):\r\n        return 'héllo ☃ 漢字 🐍'  \n\n\n    \t  x = 1_000\n"


def read(path):
    with open(path, encoding="utf-8", newline="") as f:
        return f.read()


def test_sentencepiece_round_trips_python_source_exactly(tmp_path):
    model = train_tokenizer(SOURCES, str(tmp_path / "a.model"), 512, show_progress=False)
    tok = load_tokenizer(model)
    assert isinstance(tok, SentencePieceTokenizer)
    assert (tok.vocab_size, tok.eod, tok.pad) == (512, 2, 3)
    for text in [read(p) for p in SOURCES] + [TRICKY, "  leading spaces", "\n\ttrailing\n\n"]:
        ids = tok.tokenize(text)
        assert tok.detokenize(ids) == text
        assert tok.eod not in ids and tok.pad not in ids
    assert tok.tokenize("\n") == [4]  # the user-defined newline piece
    assert any(set(piece) == {"▁"} and len(piece) >= 4 for piece in tok.vocab)  # indentation pieces
    # deterministic: the same input gives the same file; megatron's cache key follows the content
    again = train_tokenizer(SOURCES, str(tmp_path / "b.model"), 512, show_progress=False)
    assert open(model, "rb").read() == open(again, "rb").read()
    other = load_tokenizer(train_tokenizer(SOURCES, str(tmp_path / "c.model"), 600, show_progress=False))
    assert tok.unique_identifiers["sha256"] == load_tokenizer(again).sha256 != other.sha256
    assert tok.unique_identifiers["tokenizer_path"] == [os.path.abspath(model)]


def write_ranks(path, tokens):
    with open(path, "w") as f:
        f.writelines(f"{base64.b64encode(t).decode()} {rank}\n" for rank, t in enumerate(tokens))
    return str(path)


BYTES = [bytes([b]) for b in range(256)]


@pytest.mark.parametrize("name", ["tiny.tiktoken", "tokenizer.model"])  # Llama 3 ships rank lines as .model
def test_tiktoken_rank_file(tmp_path, name):
    path = write_ranks(tmp_path / name, BYTES + [b"de", b"def", b" f", b" fo", b" foo"])
    tok = load_tokenizer(path)
    assert isinstance(tok, TiktokenTokenizer)
    assert tok.tokenize("def foo") == [257, 260]
    assert tok.eod == tok.pad == 261 and tok.vocab_size == 262
    assert tok.tokenize("<|endoftext|>") != [tok.eod]  # text, not the special token
    assert tok.detokenize([tok.eod]) == "<|endoftext|>"
    for text in (TRICKY, read(SOURCES[0])):
        assert tok.detokenize(tok.tokenize(text)) == text
    write_ranks(tmp_path / name, BYTES + [b"de"])  # same path, new content: read afresh, not from a cache
    assert load_tokenizer(path).vocab_size == 258


def test_hf_tokenizer_json(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    def save(special, name):
        hf = Tokenizer(models.BPE())
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        hf.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=400, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        )
        hf.train_from_iterator([read(p) for p in SOURCES], trainer)
        hf.save(str(tmp_path / name))
        return hf, str(tmp_path / name)

    hf, path = save(["<pad>", "<|endoftext|>"], "tokenizer.json")
    tok = load_tokenizer(path)
    assert isinstance(tok, HFTokenizer)
    assert (tok.pad, tok.eod) == (hf.token_to_id("<pad>"), hf.token_to_id("<|endoftext|>")) == (0, 1)
    assert tok.vocab_size == hf.get_vocab_size() == 400
    assert tok.tokenize(TRICKY) == hf.encode(TRICKY).ids
    assert tok.detokenize(tok.tokenize(TRICKY)) == TRICKY
    _, path = save(["</s>"], "no-pad.json")
    assert load_tokenizer(path).pad == load_tokenizer(path).eod == 0
    _, path = save([], "no-eod.json")
    with pytest.raises(ValueError, match="no-eod.json: no end-of-document token"):
        load_tokenizer(path)


@pytest.mark.parametrize(
    "vocab,tp,padded", [(1000, 1, 1024), (1024, 1, 1024), (1024, 4, 1024), (1025, 2, 1280), (262, 3, 384)]
)
def test_padded_vocab_size(tmp_path, vocab, tp, padded):
    extra = [b"%d," % i for i in range(vocab - 1 - 256)]  # + <|endoftext|>
    tok = load_tokenizer(write_ranks(tmp_path / "v.tiktoken", BYTES + extra))
    assert tok.vocab_size == vocab
    assert tok.padded_vocab_size(tp) == padded
    assert tok.padded_vocab_size(tensor_model_parallel_size=tp, divisible_by=1) == -(-vocab // tp) * tp


def test_bad_tokenizer_files_name_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.model does not exist"):
        load_tokenizer(str(tmp_path / "missing.model"))
    (tmp_path / "vocab.txt").write_text("a 1\n")
    with pytest.raises(ValueError, match="vocab.txt: unknown tokenizer kind"):
        load_tokenizer(str(tmp_path / "vocab.txt"))
    (tmp_path / "broken.model").write_bytes(b"\x00\x01 not a model")
    with pytest.raises(ValueError, match="broken.model: not a valid sentencepiece tokenizer file"):
        load_tokenizer(str(tmp_path / "broken.model"))
    (tmp_path / "broken.json").write_text("{}")
    with pytest.raises(ValueError, match="broken.json: not a valid huggingface tokenizer file"):
        load_tokenizer(str(tmp_path / "broken.json"))
