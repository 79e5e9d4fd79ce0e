"""A sentencepiece BPE tokenizer for source code, trained on documents.

Whitespace is kept exactly: identity normalization, no dummy prefix, no whitespace clean-up,
whitespace-only pieces (indentation) allowed, ``"\\n"`` a user-defined piece and byte fallback for
every character outside the vocabulary, so ``detokenize(tokenize(text)) == text`` for any text.
Ids: 0 ``<unk>``, 1 ``<s>``, 2 ``</s>`` (the end of document), 3 ``<pad>``, 4 ``"\\n"``.
Training reads every line, in document order, on one thread (the merges depend on the thread
count), so the model file is the same for the same input on any machine.
"""

from __future__ import annotations

import io
import os

import sentencepiece

from fbt_megatron.data.documents import iter_documents, progress


def train_tokenizer(
    inputs: list[str], output: str, vocab_size: int, json_key: str = "text", show_progress: bool = True
) -> str:
    """Train on the documents of `inputs` and write the model to `output` (atomically);
    returns `output`."""
    if vocab_size <= 0:
        raise ValueError(f"vocab size must be positive (got {vocab_size})")
    docs = progress(iter_documents(inputs, json_key), "tokenizer", show_progress)
    lines = [line for doc in docs for line in doc.text.split("\n")]  # read first: errors stay ours
    model = io.BytesIO()
    # the merges are learned in one silent native call: a bar names the stage and, at the end, its time
    stage = progress([], f"tokenizer: learning {vocab_size:,} BPE pieces from {len(lines):,} lines", show_progress,
                     total=1, bar_format="{desc} {elapsed}")
    try:
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=iter(lines),
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
            input_sentence_size=0,
            shuffle_input_sentence=False,
            num_threads=1,  # the merges depend on the thread count
            minloglevel=2,
        )
    except RuntimeError as e:  # e.g. a vocabulary too small for the characters and the 256 bytes
        reason = str(e).rsplit("] ", 1)[-1]  # without sentencepiece's source location
        raise ValueError(f"cannot train a sentencepiece tokenizer of vocab size {vocab_size}: {reason}") from None
    finally:
        stage.update()
        stage.close()
    tmp = f"{output}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(model.getvalue())
    os.replace(tmp, output)
    return output
