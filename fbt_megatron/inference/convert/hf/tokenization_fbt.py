"""The tokenizer of FBT exports: the run's sentencepiece model, encoding and decoding exactly as
sentencepiece does (the training data was tokenized with ``SentencePieceProcessor.encode``).

This file is copied verbatim into exported model folders and loaded with
``AutoTokenizer.from_pretrained(DIR, trust_remote_code=True)``; it imports only ``transformers`` and
``sentencepiece``. Converting the model to a "fast" tokenizer is avoided on purpose: that conversion
treats some sentencepiece models differently (whitespace, byte fallback).

Defaults follow how the model was trained: no BOS/EOS is added to encoded text (documents end with
``</s>``, which the training pipeline appended itself), text that spells a special token (e.g.
``"</s>"`` inside source code) is encoded as plain text, except the end of an assistant turn that a
chat template writes (``apply_chat_template``), and batches are padded on the left (for generation).
"""

from __future__ import annotations

from transformers.tokenization_utils_sentencepiece import SentencePieceBackend


def _piece(sp_model, piece_id: int, fallback: str | None) -> str | None:
    """The piece of a special id of the sentencepiece model, or ``fallback`` if the model has none."""
    return sp_model.id_to_piece(piece_id) if piece_id >= 0 else fallback


class FBTTokenizer(SentencePieceBackend):
    vocab_files_names = {"vocab_file": "tokenizer.model"}
    model_input_names = ["input_ids", "attention_mask"]
    padding_side = "left"

    def __init__(
        self,
        vocab_file: str,
        unk_token: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        add_bos_token: bool = False,
        add_eos_token: bool = False,
        split_special_tokens: bool = True,
        clean_up_tokenization_spaces: bool = False,
        **kwargs,
    ):
        import sentencepiece

        # special tokens default to the model's own pieces (<unk>, <s>, </s>, <pad>; pad falls back to </s>)
        sp = sentencepiece.SentencePieceProcessor(model_file=vocab_file)
        unk_token = unk_token or _piece(sp, sp.unk_id(), "<unk>")
        bos_token = bos_token or _piece(sp, sp.bos_id(), None)
        eos_token = eos_token or _piece(sp, sp.eos_id(), None)
        pad_token = pad_token or _piece(sp, sp.pad_id(), eos_token)
        self.add_bos_token, self.add_eos_token = add_bos_token, add_eos_token
        kwargs.setdefault("legacy", True)  # encode text as is (no prefix handling of the legacy=False path)
        super().__init__(
            vocab_file=vocab_file,
            unk_token=unk_token,
            bos_token=bos_token,
            eos_token=eos_token,
            pad_token=pad_token,
            add_bos_token=add_bos_token,
            add_eos_token=add_eos_token,
            split_special_tokens=split_special_tokens,
            clean_up_tokenization_spaces=clean_up_tokenization_spaces,
            **kwargs,
        )

    def apply_chat_template(self, *args, **kwargs):
        """transformers' ``apply_chat_template``, in which the ``eos_token`` the chat template writes
        after an assistant turn is the EOS id, as SFT training tokenized its conversations (each piece
        between them encoded alone); text anywhere else never reads special tokens."""
        self._chat = True
        try:
            return super().apply_chat_template(*args, **kwargs)
        finally:
            self._chat = False

    def _tokenize(self, text: str, **kwargs) -> list[str]:
        if not getattr(self, "_chat", False) or not self.eos_token:
            return self.sp_model.encode(text, out_type=str)
        pieces: list[str] = []
        for i, part in enumerate(text.split(self.eos_token)):
            if i:
                pieces.append(self.eos_token)
            if part:
                pieces += self.sp_model.encode(part, out_type=str)
        return pieces

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return self.sp_model.decode_pieces(list(tokens))

    def _decode(self, token_ids, skip_special_tokens: bool = False, clean_up_tokenization_spaces=None, **kwargs) -> str:
        ids = [token_ids] if isinstance(token_ids, int) else [int(i) for i in token_ids]
        if skip_special_tokens:
            special = set(self.all_special_ids)
            ids = [i for i in ids if i not in special]
        text = self.sp_model.decode(ids)
        if clean_up_tokenization_spaces:
            text = self.clean_up_tokenization(text)
        return text

    def build_inputs_with_special_tokens(self, token_ids_0, token_ids_1=None):
        bos = [self.bos_token_id] if self.add_bos_token and self.bos_token_id is not None else []
        eos = [self.eos_token_id] if self.add_eos_token and self.eos_token_id is not None else []
        ids = bos + list(token_ids_0) + eos
        if token_ids_1 is not None:
            ids += bos + list(token_ids_1) + eos
        return ids

    def get_special_tokens_mask(self, token_ids_0, token_ids_1=None, already_has_special_tokens=False):
        if already_has_special_tokens:
            special = set(self.all_special_ids)
            return [1 if i in special else 0 for i in token_ids_0]
        mask = lambda ids: [1] * self.add_bos_token + [0] * len(ids) + [1] * self.add_eos_token  # noqa: E731
        return mask(token_ids_0) + (mask(token_ids_1) if token_ids_1 is not None else [])


__all__ = ["FBTTokenizer"]
