"""A sentencepiece tokenizer widened to a recipe's vocabulary without retraining.

A 100,352-piece sentencepiece cannot be learned from a small corpus (the embedded standard library
has too few distinct pieces), but a run's sizes depend only on how many rows the embedding has. The
corpus's own model is copied with ``<unused_i>`` pieces appended up to ``size``, each of
sentencepiece's UNUSED type, which encoding never emits: every text encodes to the same ids as
before (the corpus's ``.bin/.idx`` stay valid), while the tokenizer, the embedding, the logits, the
checkpoint and the export all have the full vocabulary.
"""

from __future__ import annotations

from pathlib import Path

from fbt_megatron.common.io import atomic_write

UNUSED = "<unused_{}>"


def widen(model_file: str, output: str, size: int) -> str:
    """Write ``model_file`` widened to ``size`` pieces to ``output`` (atomically; unchanged when it
    is there already with that size); returns ``output``."""
    import sentencepiece
    from sentencepiece import sentencepiece_model_pb2 as pb

    if Path(output).is_file() and sentencepiece.SentencePieceProcessor(model_file=output).get_piece_size() == size:
        return output
    proto = pb.ModelProto()
    proto.ParseFromString(Path(model_file).read_bytes())
    have = len(proto.pieces)
    if size < have:
        raise ValueError(f"{model_file} has {have:,} pieces, more than the {size:,} asked for")
    for i in range(size - have):
        piece = proto.pieces.add()
        piece.piece, piece.score, piece.type = UNUSED.format(i), 0.0, pb.ModelProto.SentencePiece.UNUSED
    atomic_write(output, proto.SerializeToString())
    return output
