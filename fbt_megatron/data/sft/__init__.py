"""Supervised fine-tuning data (``--sft``): chat JSONL → packed training rows.

chat       records, the chat template and the assistant's tokens (what the loss is on)
packing    conversations packed whole into rows of the sequence length, per-position masks
tiny_set   the tiny set from Python source files (``data.corpus: sft:stdlib``), prepared on first use

``load_sft_data`` is what a run reads: the chat files it names, or the prepared set in its data path.
"""

from __future__ import annotations

from typing import List, Tuple

from fbt_megatron.common.cli import plural
from fbt_megatron.data.sft.chat import ChatEncoder, chat_template, read_conversations
from fbt_megatron.data.sft.packing import SFTDataset
from fbt_megatron.data.sft.tiny_set import ensure_sft_set, set_files, set_source
from fbt_megatron.data.tokenizer import load_tokenizer

__all__ = ["ensure_sft_set", "load_sft_data", "set_source", "sft_chat_template", "sft_tokenizer_file"]


def _jsonl_files(spec, key: str) -> List[str]:
    if not all(isinstance(p, str) and p.endswith(".jsonl") for p in spec):
        raise ValueError(f"{key} must list chat .jsonl files with --sft (no blend weights), got {spec}")
    return list(spec)


def sft_tokenizer_file(d) -> str:
    """The tokenizer file whose chat template an SFT run with data section ``d`` trains with (the
    ``tokenizer_config.json`` beside it): ``d.tokenizer_model`` with chat files, else the prepared
    set's copy; what the HF export and ``generate --chat`` read the template from."""
    return d.tokenizer_model if d.train_data_path is not None else set_files(d.data_path)[2]


def sft_chat_template(d) -> Tuple[str, str]:
    """(template, where it came from) that an SFT run with data section ``d`` trains with."""
    return chat_template(sft_tokenizer_file(d))


def load_sft_data(d, seed: int):
    """(tokenizer, train, valid, source) for the data section ``d`` with ``d.sft``: its
    train_data_path / valid_data_path chat JSONL files with ``d.tokenizer_model``, or the prepared
    SFT set in ``d.data_path`` with the tokenizer (and chat template) stored there."""
    if d.train_data_path is not None:
        train = _jsonl_files(d.train_data_path, "data.train_data_path")
        valid = _jsonl_files(d.valid_data_path, "data.valid_data_path") if d.valid_data_path else train
        source = " ".join(train)
    else:
        train, valid, _ = set_files(d.data_path)
        source = str(d.data_path)
    tokenizer_path = sft_tokenizer_file(d)
    tokenizer = load_tokenizer(tokenizer_path)
    encoder = ChatEncoder(tokenizer, *chat_template(tokenizer_path))
    splits = []
    for paths, split_seed in ((train, seed), (valid, seed + 1)):
        conversations = [c for p in paths for c in read_conversations(p, encoder, d.seq_length, d.sft_skip_bad_records)]
        splits.append(SFTDataset(conversations, d.seq_length, split_seed, tokenizer.pad))
    described = (f"{source} (SFT: {plural(len(splits[0].conversations), 'conversation')} in {plural(len(splits[0]), 'row')}, "
                 f"{splits[0].tokens / (len(splits[0]) * d.seq_length):.0%} filled; {encoder.source}; "
                 f"prefix mixin: {d.sft_prefix_mixin})")
    return tokenizer, splits[0], splits[1], described
